"""The executor's data path: cut-through forwarding, sub-block applies, and the store-and-forward
reference giving the same bytes (executors in this process over socket pairs; the loopback chain
in three processes)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

from agents import wire
from agents.executor import Executor, tcp_losses
from agents.inputs import make_input
from testbed.dataplane import loopback_chain
from testbed.plan import RECV, SEND, Op, interpret
from testbed.planners import make_plan, schemes
from testbed.topology import load_topology
from tests.test_agents import relay_plan, ring_plan, two_tree_plan


def run_in_process(plan, iterations=2, seed=3, **options):
    """Every node's executor in this process, one socket pair per connection; each node's
    final ``x`` per iteration, and every executor's timings of the last one."""
    exs = {n: Executor(n, plan.programs.get(n, []), length=plan.length, scratch=plan.scratch.get(n),
                       timeout_s=20, **options) for n in plan.nodes}
    for src, dst, ch in sorted((n, *key) for n, ex in exs.items() for key in ex.outgoing()):
        a, b = socket.socketpair()
        exs[src].attach_outgoing(dst, ch, a)
        exs[dst].attach_incoming(src, ch, b)
    outs, timings = [], {}
    try:
        for it in range(iterations):
            inputs = {n: make_input(seed, i, it, plan.length, "float32") for i, n in enumerate(plan.nodes)}
            for n, ex in exs.items():
                ex.prepare(inputs[n] if n in plan.contributing() else None)
            errors = []

            def go(n):
                try:
                    timings[n] = exs[n].run(it)
                except Exception as e:  # reported below
                    errors.append(f"{n}: {e}")
            threads = [threading.Thread(target=go, args=(n,)) for n in plan.nodes]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not errors, errors
            outs.append(({n: exs[n].bufs["x"].copy() for n in plan.nodes}, inputs))
    finally:
        for ex in exs.values():
            ex.close()
    return outs, timings


@pytest.mark.parametrize("make", [lambda: two_tree_plan(length=300_000, chunks=4), lambda: ring_plan(n=4, length=200_001),
                                  lambda: relay_plan(length=100_003)])
@pytest.mark.parametrize("subblock", [4, 4096, 1 << 16])
def test_cut_through_gives_the_reference_interpreters_bytes(make, subblock):
    """Cut-through (sub-blocks down to one element) and store-and-forward end with exactly
    what :func:`testbed.plan.interpret` computes, every iteration."""
    plan = make()
    for ct in (True, False):
        outs, _ = run_in_process(plan, cut_through=ct, subblock_bytes=subblock)
        for got, inputs in outs:
            want = interpret(plan, inputs)
            for n in plan.finishing():
                assert np.array_equal(got[n], want[n]), (n, ct, subblock)


@pytest.mark.parametrize("cut_through", [True, False])
def test_an_interior_node_forwards_a_chunk_while_it_arrives(cut_through):
    """b adds a's 1 MB chunk into its own and sends the sum to c: with cut-through, c gets the
    first bytes of the sum while a has sent only half of its chunk; store-and-forward (the
    reference) sends nothing of it until all of a's chunk is there; the sum is exact either way."""
    n = 1 << 18
    prog = [Op(0, RECV, "a", 1, 0, n, reduce=True), Op(1, SEND, "c", 2, 0, n, deps=(0,))]
    ex = Executor("b", prog, length=n, timeout_s=10, cut_through=cut_through, subblock_bytes=1 << 16)
    sa, sb = socket.socketpair()
    sc, sd = socket.socketpair()
    ex.attach_incoming("a", 0, sb)
    ex.attach_outgoing("c", 0, sc)
    ex.prepare(np.ones(n, np.float32))
    result = {}
    t = threading.Thread(target=lambda: result.update(ex.run(0)))
    t.start()
    try:
        payload = np.arange(n, dtype=np.float32)
        sa.sendall(wire.encode_header(wire.Header(wire.DATA, op_id=0, xfer=1, payload_len=payload.nbytes)))
        sa.sendall(payload[:n // 2].tobytes())
        sd.settimeout(5 if cut_through else 0.5)
        if cut_through:
            first = sd.recv(1 << 16)  # the header and the first bytes, before the second half is sent
            assert len(first) > 0
        else:
            with pytest.raises(socket.timeout):
                sd.recv(1)
            first = b""
        sa.sendall(payload[n // 2:].tobytes())
        sd.settimeout(5)
        got = bytearray(first)
        while len(got) < 64 + payload.nbytes:
            got += sd.recv(1 << 20)
        t.join(10)
        h = wire.decode_header(bytes(got[:64]), payload.nbytes)
        assert (h.xfer, h.payload_len) == (2, payload.nbytes)
        assert np.array_equal(np.frombuffer(bytes(got[64:]), np.float32), payload + 1)
        (_, start, _), = result["sends"]
        (_, _, _, recv_last, _), = result["recvs"]
        assert (start < recv_last) == cut_through  # the send began before the last byte it forwards arrived
    finally:
        ex.close()
        for s in (sa, sd):
            s.close()


def test_loopback_chain_cut_through_and_store_and_forward_are_exact():
    """Three processes a -> b -> c, b adding and forwarding: exact either way (the bench's harness)."""
    for ct in (True, False):
        r = loopback_chain(1 << 18, 8, iterations=2, cut_through=ct)
        assert r["exact"] and r["b"]["cpu_s"] > 0, r
    with pytest.raises(RuntimeError, match="loopback chain failed"):
        loopback_chain(1 << 12, 2, iterations=1, subblock_bytes="not a size")


@pytest.mark.parametrize("links", ["channel", "shared"])
@pytest.mark.parametrize("scheme", sorted(schemes()))
def test_every_scheme_is_exact_with_cut_through_in_small_sub_blocks(scheme, links):
    """Every registered scheme's plan on quick-5, its executors streaming in sub-blocks of 64
    bytes (every transfer of this size cut through), with a connection per channel or one per
    peer that the channels share (pieces of 64 bytes interleaved), equals the reference
    interpreter's."""
    plan = make_plan(scheme, load_topology("quick-5").graph(), 20_011)
    if links == "shared" and plan.aux.get("paths"):
        with pytest.raises(ValueError, match="auxiliary paths"):
            run_in_process(plan, iterations=1, links=links)
        return
    outs, _ = run_in_process(plan, iterations=2, subblock_bytes=64, links=links)
    for got, inputs in outs:
        want = interpret(plan, inputs)
        for n in plan.finishing():
            assert np.array_equal(got[n], want[n]), n


def test_a_shared_link_serves_backlogged_channels_by_weight_and_idles_for_none():
    """Two channels' writers on one connection (weights 3 and 1), both with pieces waiting
    while the reader drains slowly: the link gives them 3:1 of its frames; once the heavier one
    has sent all of its pieces the other's go back to back (no turn is kept for it)."""
    from agents.executor import SharedLink

    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    link, piece = SharedLink(a, {0: 3.0, 1: 1.0}), bytes(16 << 10)

    def writer(ch, n):
        for _ in range(n):
            link.write(ch, wire.Header(wire.DATA, xfer=ch, payload_len=len(piece)), piece, lambda: False)
    threads = [threading.Thread(target=writer, args=(0, 30)), threading.Thread(target=writer, args=(1, 30))]
    for t in threads:
        t.start()
    order, hbuf = [], bytearray(64)
    for _ in range(60):
        h = wire.recv_header(b, hbuf, 1 << 20)
        wire.recv_into_exact(b, memoryview(bytearray(h.payload_len)), "piece")
        order.append(h.xfer)
        threading.Event().wait(0.002)
    for t in threads:
        t.join(10)
    a.close()
    b.close()
    assert 22 <= order[4:36].count(0) <= 26, order  # 3:1 while both wait: 24 of 32
    last0 = max(k for k, c in enumerate(order) if c == 0)
    assert set(order[last0 + 1:]) == {1} and order.count(1) == 30, order


def test_a_payload_read_under_a_low_water_mark_waits_for_it_and_never_holds_its_tail(monkeypatch):
    """TCP: 10 KB of a 40 KB payload are there when the read starts, the other 30 KB come
    0.3 s later, and no more.  Under a 32 KiB mark the reader takes nothing before 32 KiB are
    there (without a mark it would take the 10 KB at once); the rest (below the mark) is not
    held, and the socket's mark is 1 again after.  A blocking ``recv`` under the mark would
    take the first 10 KB and sleep for ever (the kernel compares its mark with the bytes not
    yet read).  (A trickle below the mark is read every ``TRICKLE_S``: test_chaos's peer
    stalling mid-payload.)"""
    monkeypatch.setattr(wire, "TRICKLE_S", 30.0)
    lsock = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(lsock.getsockname())
    b, _ = lsock.accept()
    lsock.close()
    data = np.random.default_rng(1).integers(0, 256, 40_000, dtype=np.uint8).tobytes()
    a.sendall(data[:10_000])
    threading.Event().wait(0.2)
    got, calls = bytearray(len(data)), []
    reader = threading.Thread(target=wire.recv_into_exact, args=(b, memoryview(got), "payload", calls.append),
                              kwargs={"lowat": 32 << 10})  # no deadline: a blocking read, as the executor's
    reader.start()
    threading.Event().wait(0.3)
    a.sendall(data[10_000:])
    reader.join(5)
    try:
        assert not reader.is_alive(), f"the reader still waits with {calls} bytes read"
        assert bytes(got) == data
        assert calls[0] >= 32 << 10 and calls[-1] == 40_000, calls
        assert b.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
    finally:
        b.shutdown(socket.SHUT_RDWR)
        reader.join(5)
        a.close()
        b.close()


def test_tcp_losses_counts_a_connections_retransmissions_and_timeouts():
    """Segments dropped for a second (an iptables rule, in a network namespace of its own) go
    again on retransmission timeouts: tcp_losses counts the retransmissions, the timeouts and
    the time spent recovering from them; a Unix socket has no such counters."""
    if tcp_losses(socket.socket()) is None:
        pytest.skip("this kernel's tcp_info does not count timeouts (Linux < 6.7)")
    if os.geteuid() != 0 or not shutil.which("iptables") or not shutil.which("unshare"):
        pytest.skip("needs root, iptables and unshare")
    script = """if True:
        import json, socket, subprocess, time
        from agents.executor import tcp_losses
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
        srv = socket.socket(); srv.bind(("127.0.0.1", 5555)); srv.listen()
        c = socket.create_connection(("127.0.0.1", 5555)); a, _ = srv.accept()
        before = tcp_losses(c)
        rule = ["INPUT", "-p", "tcp", "--dport", "5555", "-j", "DROP"]
        subprocess.run(["iptables", "-A", *rule], check=True)
        c.sendall(b"x" * 1000)
        time.sleep(1.0)
        subprocess.run(["iptables", "-D", *rule], check=True)
        a.settimeout(10); got = 0
        while got < 1000:
            got += len(a.recv(4096))
        time.sleep(0.1)
        print(json.dumps([before, tcp_losses(c)]))
    """
    res = subprocess.run(["unshare", "-n", sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=30, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert res.returncode == 0, res.stderr[-2000:]
    before, after = json.loads(res.stdout)
    assert before == [0, 0, 0]
    retrans, rtos, rto_ms = after
    assert rtos >= 2 and retrans >= rtos and rto_ms >= 500  # timeouts at ~0.2 and ~0.6 s, recovered after 1 s
    a, b = socket.socketpair()
    assert tcp_losses(a) is None
    a.close()
    b.close()
