"""Agents, executor, wire format and coordinator: real processes and sockets on loopback."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from agents import wire
from agents.agent import Job
from agents.coordinator import Coordinator
from agents.executor import ExecError, Executor, links_for
from agents.inputs import bound, expected_sum, make_input
from agents.local import LocalCluster, local_address, run_local
from testbed.errors import ConfigError, RunError
from testbed.plan import RECV, SEND, Op, Plan, ProgramBuilder, Tree, interpret, split_lengths, trees_plan
from testbed.planners import make_plan
from testbed.topology import load_topology


# -- plans -------------------------------------------------------------------------
def two_tree_plan(length=1003, chunks=3) -> Plan:
    nodes = [f"h{i}" for i in range(5)]
    t1 = Tree("h0", {"h0": None, "h1": "h0", "h2": "h0", "h3": "h1", "h4": "h1"}, share=0.6, chunks=chunks)
    t2 = Tree("h4", {"h4": None, "h3": "h4", "h2": "h3", "h1": "h2", "h0": "h2"}, share=0.4, chunks=chunks)
    return trees_plan("two-trees", nodes, length, [t1, t2])


def ring_plan(n=4, length=1001) -> Plan:
    """Ring reduce-scatter then all-gather, written op by op."""
    nodes = [f"r{i}" for i in range(n)]
    sizes = split_lengths(length, [1] * n)
    offs = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    def blk(c):
        return (offs[c % n], sizes[c % n])
    b = ProgramBuilder(nodes)
    last_recv = {i: [] for i in range(n)}
    rs_send = {i: {} for i in range(n)}  # node -> chunk -> send op id
    for s in range(n - 1):  # reduce-scatter: node i sends chunk i-s to i+1, which adds it
        got = {}
        for i in range(n):
            c = (i - s) % n
            sid, rid = b.transfer(nodes[i], nodes[(i + 1) % n], *blk(c), reduce=True,
                                  send_deps=last_recv[i], phase="reduce-scatter", chunk=c)
            rs_send[i][c] = sid
            got[(i + 1) % n] = [rid]
        last_recv = got
    for s in range(n - 1):  # all-gather: node i forwards its complete chunk i+1-s
        got = {}
        for i in range(n):
            j, c = (i + 1) % n, (i + 1 - s) % n
            _, rid = b.transfer(nodes[i], nodes[j], *blk(c), reduce=False, send_deps=last_recv[i],
                                recv_deps=[rs_send[j][c]] if c in rs_send[j] else [],
                                phase="all-gather", chunk=c)
            got[j] = [rid]
        last_recv = got
    return Plan("ring", nodes, length, b.programs)


def relay_plan(length=777) -> Plan:
    """a and b exchange through relay r's scratch buffers; c (no input) receives the sum."""
    nodes = ["a", "b", "r", "c"]
    b = ProgramBuilder(nodes)
    s_a, r_ra = b.transfer("a", "r", 0, length, reduce=False, dst_buf="in_a")
    s_b, r_rb = b.transfer("b", "r", 0, length, reduce=False, dst_buf="in_b")
    _, r_b = b.transfer("r", "b", 0, length, reduce=True, src_buf="in_a", send_deps=[r_ra], recv_deps=[s_b])
    _, r_a = b.transfer("r", "a", 0, length, reduce=True, src_buf="in_b", send_deps=[r_rb], recv_deps=[s_a],
                        channel=1)
    b.transfer("a", "c", 0, length // 2, reduce=False, send_deps=[r_a])
    b.transfer("b", "c", length // 2, length - length // 2, reduce=False, send_deps=[r_b])
    return Plan("relay", nodes, length, b.programs, participants=["a", "b"], receivers=["a", "b", "c"],
                scratch={"r": {"in_a": length, "in_b": length}})


def p2p_plan(length: int) -> Plan:
    b = ProgramBuilder(["a", "b"])
    b.transfer("a", "b", 0, length, reduce=False)
    return Plan("p2p", ["a", "b"], length, b.programs, participants=["a"], receivers=["b"])


def check_results(plan: Plan, res: dict, *, seed=0, dtype="float32") -> None:
    """Every iteration correct and every receiver's digest equals testbed.plan.interpret's."""
    assert res["errors"] == []
    for it in res["iterations"]:
        assert it["correct"] is True
        inputs = {n: make_input(seed, i, it["iteration"], plan.length, dtype) for i, n in enumerate(plan.nodes)}
        want = interpret(plan, inputs)
        for n in plan.finishing():
            assert it["workers"][n]["correct"] is True and it["workers"][n]["receiver"] is True
            assert it["workers"][n]["digest"] == hashlib.sha256(want[n].tobytes()).hexdigest(), n
        assert 0 < it["cct_s"] <= it["iteration_s"]
    cols = res["transfers"]["columns"]
    rows = res["transfers"]["rows"]
    assert len(rows) == len(res["iterations"]) * sum(1 for _ in plan.transfers())
    for row in rows:
        d = dict(zip(cols, row))
        assert None not in row, d
        assert d["send_start_ns"] <= d["send_end_ns"] and d["recv_start_ns"] <= d["recv_end_ns"] <= d["apply_ns"]
        assert d["send_ts_ns"] == d["send_start_ns"]


# -- pure units ----------------------------------------------------------------------
def test_inputs_exact_and_deterministic():
    k = bound("float32")
    assert k * 1024 < 2**24
    a = make_input(7, 3, 2, 10_000, "float32")
    assert a.dtype == np.float32 and np.array_equal(a, make_input(7, 3, 2, 10_000, "float32"))
    assert not np.array_equal(a, make_input(7, 3, 3, 10_000, "float32"))
    assert np.all(np.abs(a) <= k) and np.all(a == np.round(a))
    s = expected_sum(7, range(5), 0, 1000, "float32")
    assert np.array_equal(s, sum(make_input(7, i, 0, 1000, "float64") for i in range(5)))


def test_header_round_trip_and_validation():
    h = wire.Header(wire.DATA, wire.phase_code("bcast"), wire.FLAG_AUX, 3, 42, 1, 9, 4000, 123456789, (1, 5, 2))
    raw = wire.encode_header(h)
    assert len(raw) == 64 and raw[:4] == b"TBW1"
    assert wire.decode_header(raw, 4000) == h
    for flags, route in ((0, (1, 5, 2)), (wire.FLAG_AUX, ()), (wire.FLAG_AUX, (1, 2))):  # route and flag disagree
        with pytest.raises(wire.ProtocolError, match="route of"):
            wire.decode_header(wire.encode_header(h._replace(flags=flags, route=route)), 4000)
    with pytest.raises(wire.ProtocolError, match="magic"):
        wire.decode_header(b"XXXX" + raw[4:], 4000)
    with pytest.raises(wire.ProtocolError, match="version"):
        wire.decode_header(raw[:4] + b"\x09" + raw[5:], 4000)
    with pytest.raises(wire.ProtocolError, match="type"):
        wire.decode_header(raw[:5] + b"\x63" + raw[6:], 4000)
    with pytest.raises(wire.ProtocolError, match="exceeds"):
        wire.decode_header(raw, 3999)
    w = wire.Header(wire.DATA, flags=wire.FLAG_WITHDRAWN, xfer=5)  # a withdrawn transfer: no payload, no route
    assert wire.decode_header(wire.encode_header(w), 0) == w
    for bad in (w._replace(payload_len=16), w._replace(flags=wire.FLAG_WITHDRAWN | wire.FLAG_AUX, route=(1, 5, 2)),
                w._replace(type=wire.CTRL)):
        with pytest.raises(wire.ProtocolError, match="withdrawn"):
            wire.decode_header(wire.encode_header(bad), 4000)
    p = wire.Header(wire.DATA, flags=wire.FLAG_PIECE, xfer=5, payload_len=16)  # a piece of a direct transfer
    assert wire.decode_header(wire.encode_header(p), 4000) == p
    for bad in (p._replace(flags=wire.FLAG_PIECE | wire.FLAG_AUX, route=(1, 5, 2)),
                p._replace(flags=wire.FLAG_PIECE | wire.FLAG_ACK_REQ), p._replace(type=wire.CTRL)):
        with pytest.raises(wire.ProtocolError, match="a piece is"):
            wire.decode_header(wire.encode_header(bad), 4000)


def test_handshake_mutual_and_refusals():
    def pair(server_secret, client_secret, ident):
        s, c = socket.socketpair()
        out = {}

        def serve():
            try:
                out["ident"] = wire.server_handshake(s, server_secret)
            except wire.ProtocolError as e:
                out["err"] = e
        t = threading.Thread(target=serve)
        t.start()
        try:
            wire.client_handshake(c, client_secret, ident)
            out["client"] = "ok"
        except wire.ProtocolError as e:
            out["client"] = e
        t.join(5)
        s.close(), c.close()
        return out

    ok = pair(b"k", b"k", {"name": "h1", "role": "agent"})
    assert ok["ident"] == {"name": "h1", "role": "agent"} and ok["client"] == "ok"
    bad = pair(b"k", b"wrong", {"name": "h1"})
    assert "authentication failed" in str(bad["err"]) and "authentication failed" in str(bad["client"])


def test_job_round_trip():
    plan = relay_plan()
    with Coordinator(plan, addresses={n: f"10.0.0.{i + 1}" for i, n in enumerate(plan.nodes)}, data_port=7100,
                     secret=b"s", iterations=3, compute_s={"a": [0.5, 0.1]}, subblock_bytes=8192,
                     bind=("127.0.0.1", 0)) as c:
        for n in plan.nodes:
            job = c.make_job(n)
            back = Job.from_dict(json.loads(json.dumps({"msg": "job", "job": job.to_dict()}))["job"])
            assert back == job and back.program == plan.programs[n] and back.subblock_bytes == 8192
    assert back.name == "c" and back.participants == ["a", "b"] and back.receivers == ["a", "b", "c"]
    assert Job.from_dict(json.loads(json.dumps(c.make_job("r").to_dict()))).scratch == plan.scratch["r"]
    assert c.make_job("a").peers == {"r": ("10.0.0.3", 7100), "c": ("10.0.0.4", 7100)}
    assert c.make_job("a").compute_for(2) == 0.1


def test_shared_links_only_where_the_run_allows_them():
    """``links="shared"`` reaches the agents' jobs unless the run needs whole frames per
    connection (stop-and-wait; probing, re-planning and drivers are the same rule); an unknown
    value is refused."""
    plan = two_tree_plan(length=64, chunks=2)
    addrs = {n: f"10.0.0.{i + 1}" for i, n in enumerate(plan.nodes)}
    for opts, want in (({}, "channel"), ({"links": "shared"}, "shared"),
                       ({"links": "shared", "stop_and_wait": True}, "channel")):
        with Coordinator(plan, addresses=addrs, data_port=7100, secret=b"s", bind=("127.0.0.1", 0), **opts) as c:
            assert {c.make_job(n).links for n in plan.nodes} == {want}, opts
    with pytest.raises(ValueError, match="links 'mux'"):
        Coordinator(plan, addresses=addrs, data_port=7100, secret=b"s", bind=("127.0.0.1", 0), links="mux")
    g = load_topology("quick-5").graph()
    aux = {"primary_busy_bound": 0, "aux_queue_length": 2, "max_paths": 2, "disjoint": "node", "idle_only": False}
    for scheme, params, opts in (("mtree", {}, {"probing": True}), ("mtree", {}, {"versions": True}),
                                 ("mst", {}, {}), ("multitree", {"variant": "bfs"}, {})):
        other = make_plan(scheme, g, 1000, params, aux=aux if scheme == "mst" else None)
        assert other.aux.get("paths") or any(op.path for _, op in other.transfers()) or opts, scheme
        assert links_for("shared", other, **opts) == "channel", (scheme, params, opts)
    assert links_for("shared", make_plan("mtree", g, 1000)) == "shared"


def test_per_node_address_view_and_missing_address():
    plan = relay_plan()
    view = {"a": {"r": "10.1.0.3", "c": "10.2.0.4"}, "b": {"r": "10.3.0.3", "c": "10.3.0.4"},
            "r": {"a": "10.1.0.1", "b": "10.3.0.2"}}
    with Coordinator(plan, addresses=view, data_port=7100, secret="s\n", bind=("127.0.0.1", 0)) as c:
        assert c.secret == b"s"  # a str secret (e.g. read from a file) works like the agents' secret_file
        assert c.make_job("a").peers == {"r": ("10.1.0.3", 7100), "c": ("10.2.0.4", 7100)}
        assert c.make_job("r").peers == {"a": ("10.1.0.1", 7100), "b": ("10.3.0.2", 7100)}
    del view["b"]["c"]
    with pytest.raises(ConfigError, match="no address for c as seen from b"):
        Coordinator(plan, addresses=view, data_port=7100, secret=b"s", bind=("127.0.0.1", 0))


# -- executor against hand-driven sockets ---------------------------------------------
@pytest.fixture
def lone_receiver():
    """Executor for 'b' expecting transfer 5 (4 float32) from 'a'; yields (executor, a's socket)."""
    ex = Executor("b", [Op(0, RECV, "a", 5, 0, 4, reduce=True)], length=4, timeout_s=1.0)
    sa, sb = socket.socketpair()
    sa.settimeout(5)
    ex.attach_incoming("a", 0, sb)
    try:
        yield ex, sa
    finally:
        ex.close()
        sa.close()


def _closed_by_peer(sock: socket.socket) -> bool:
    """Drain ``sock`` until the peer closes it (True) — a reset counts as closed too."""
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return True


def _data(xfer, n_bytes, it=0):
    return wire.Header(wire.DATA, op_id=it, xfer=xfer, payload_len=n_bytes)


def test_executor_applies_valid_frame(lone_receiver):
    ex, sa = lone_receiver
    ex.prepare(np.ones(4, np.float32))
    wire.send_frame(sa, _data(5, 16), np.arange(4, dtype=np.float32))
    ex.run(0)
    assert ex.bufs["x"].tolist() == [1, 2, 3, 4]


def test_executor_withdrawn_transfer_completes_without_touching_the_buffer(lone_receiver):
    """CREW's non-blocking scatter: a withdrawn transfer (header, no payload) completes the
    recv op and leaves the buffer as it was, or applies the copy ``on_withdrawn`` gives; the
    sender's ``withdraw`` decides per op."""
    ex, sa = lone_receiver
    ex.prepare(np.ones(4, np.float32))
    wire.send_frame(sa, _data(5, 0)._replace(flags=wire.FLAG_WITHDRAWN))
    assert ex.run(0)["withdrawn"] == [5] and ex.bufs["x"].tolist() == [1, 1, 1, 1]
    ex.prepare(np.ones(4, np.float32))
    wire.send_frame(sa, _data(5, 16, it=1), np.arange(4, dtype=np.float32))
    assert "withdrawn" not in ex.run(1) and ex.bufs["x"].tolist() == [1, 2, 3, 4]
    # a receiver holding the chunk already (``on_withdrawn``) applies its copy as the payload
    ex.on_withdrawn = lambda op: np.full(op.length, 5, np.float32)
    ex.prepare(np.ones(4, np.float32))
    wire.send_frame(sa, _data(5, 0, it=2)._replace(flags=wire.FLAG_WITHDRAWN))
    assert ex.run(2)["withdrawn"] == [5] and ex.bufs["x"].tolist() == [6, 6, 6, 6]
    # the sending side: ``withdraw(op)`` true -> the receiver's op completes, its buffer untouched
    tx = Executor("a", [Op(0, SEND, "b", 5, 0, 4)], length=4, timeout_s=5.0)
    sb, sc = socket.socketpair()
    rx = Executor("b", [Op(0, RECV, "a", 5, 0, 4, reduce=True)], length=4, timeout_s=5.0)
    try:
        tx.attach_outgoing("b", 0, sb)
        rx.attach_incoming("a", 0, sc)
        tx.prepare(np.full(4, 7, np.float32))
        rx.prepare(np.ones(4, np.float32))
        tx.withdraw = lambda op: op.xfer == 5
        assert tx.run(0)["withdrawn"] == [5]
        assert rx.run(0)["withdrawn"] == [5] and rx.bufs["x"].tolist() == [1, 1, 1, 1]
    finally:
        tx.close()
        rx.close()


def test_a_connection_opened_after_the_executor_closed_is_refused_and_closed():
    """A version given up on while its connections were being opened (CREW: a link broke
    during the install): a late connection is not kept open by a closed executor."""
    ex = Executor("a", [Op(0, SEND, "b", 5, 0, 4)], length=4, timeout_s=1.0)
    ex.close()
    sa, sb = socket.socketpair()
    with pytest.raises(ExecError, match="closed"):
        ex.attach_outgoing("b", 0, sa)
    assert sa.fileno() == -1 and sb.recv(1) == b""
    sb.close()


@pytest.mark.parametrize("frame, match", [
    (lambda: wire.encode_header(_data(99, 16)), "from a .*unknown transfer 99"),
    (lambda: wire.encode_header(_data(5, 12)), "from a .*12 bytes, expected 16"),
    (lambda: wire.encode_header(_data(5, 16)._replace(chunk=3)) + bytes(16), "from a .*transfer 5: chunk 3, expected 0"),
    (lambda: wire.encode_header(_data(5, 16)._replace(flags=wire.FLAG_ACK_REQ)) + bytes(16),
     "from a .*transfer 5: flags 1, expected 0"),
    (lambda: wire.encode_header(_data(5, 1 << 40)), "from a .*exceeds"),
    (lambda: wire.encode_header(_data(5, 16, it=7)), "from a .*iteration 7"),
    (lambda: wire.encode_header(wire.Header(wire.CTRL, payload_len=2)) + b"{}", "from a .*unexpected CTRL"),
    (lambda: b"GARBAGE!" * 8, "from a .*bad magic"),
    (lambda: wire.encode_header(_data(5, 16)) + b"\0" * 8, "from a .*middle of a transfer 5"),
    (lambda: wire.encode_header(_data(5, 8)._replace(flags=wire.FLAG_PIECE)) + b"\0" * 8,
     "from a .*a piece on a connection of one channel"),
])
def test_executor_rejects_malformed_data(lone_receiver, frame, match):
    ex, sa = lone_receiver
    ex.prepare(None)
    sa.sendall(frame())
    if match.endswith("transfer 5"):
        sa.shutdown(socket.SHUT_WR)  # truncated payload: the peer closes mid-frame
    t = time.monotonic()
    with pytest.raises(wire.ProtocolError, match=match):
        ex.run(0)
    assert time.monotonic() - t < 2  # at once, not after a timeout
    assert _closed_by_peer(sa)  # the executor closed the connection (else recv times out)


def test_a_shared_connection_takes_pieces_in_order_and_refuses_one_that_overruns():
    """Shared links: a transfer's pieces (8 + 8 bytes) are read one after the other into its
    block; a piece that would run past the transfer's end is refused at once, naming it."""
    ex = Executor("b", [Op(0, RECV, "a", 5, 0, 4, reduce=True)], length=4, timeout_s=1.0, links="shared")
    sa, sb = socket.socketpair()
    sa.settimeout(5)
    ex.attach_incoming("a", 0, sb)
    try:
        ex.prepare(np.ones(4, np.float32))
        piece = _data(5, 8)._replace(flags=wire.FLAG_PIECE)
        wire.send_frame(sa, piece, np.array([1, 2], np.float32))
        wire.send_frame(sa, piece, np.array([3, 4], np.float32))
        ex.run(0)
        assert ex.bufs["x"].tolist() == [2, 3, 4, 5]
        ex.prepare(None)
        wire.send_frame(sa, piece._replace(op_id=1), np.array([1, 2], np.float32))
        sa.sendall(wire.encode_header(piece._replace(op_id=1, payload_len=12)) + bytes(12))
        with pytest.raises(wire.ProtocolError, match="transfer 5: a piece of 12 bytes after 8 overruns its 16"):
            ex.run(1)
        assert _closed_by_peer(sa)
    finally:
        ex.close()
        sa.close()


def test_a_shared_connection_writes_what_is_ready_in_pieces_of_up_to_its_most():
    """A send whose block is whole goes in pieces of ``SHARED_PIECE_BYTES`` (256 KiB), not a
    sub-block (64 KiB) each: every piece is a frame, a turn and a wakeup of its receiver."""
    from agents.executor import SHARED_PIECE_BYTES

    n = (2 * SHARED_PIECE_BYTES + 4000) // 4
    ex = Executor("a", [Op(0, SEND, "b", 7, 0, n)], length=n, timeout_s=5.0, links="shared",
                  subblock_bytes=64 << 10)
    sa, sb = socket.socketpair()
    sb.settimeout(5)
    x = np.arange(n, dtype=np.float32)
    ex.attach_outgoing("b", 0, sa)
    done = []
    runner = threading.Thread(target=lambda: done.append(ex.run(0)), daemon=True)
    try:
        ex.prepare(x)
        runner.start()
        got, sizes, hbuf = bytearray(), [], bytearray(64)
        while len(got) < 4 * n:
            h = wire.recv_header(sb, hbuf, 1 << 30)
            assert h.xfer == 7 and h.flags == wire.FLAG_PIECE, h
            piece = bytearray(h.payload_len)
            wire.recv_into_exact(sb, memoryview(piece))
            sizes.append(h.payload_len)
            got += piece
        runner.join(5)
        assert done and [row[0] for row in done[0]["sends"]] == [7]
        assert sizes == [SHARED_PIECE_BYTES, SHARED_PIECE_BYTES, 4000], sizes
        assert np.array_equal(np.frombuffer(bytes(got), np.float32), x)
    finally:
        ex.close()
        sb.close()


def test_executor_peer_close_and_timeout_name_the_peer(lone_receiver):
    ex, sa = lone_receiver
    t = time.monotonic()
    with pytest.raises(ExecError, match=r"no progress for 1 s.*awaiting data from a: xfers \[5\]"):
        ex.run(0)
    assert 0.9 < time.monotonic() - t < 2
    sa.close()
    with pytest.raises(ExecError, match="from a .*closed"):
        ex.run(0)


def test_slow_transfer_counts_as_progress(lone_receiver):
    """Bytes trickling in for longer than timeout_s (1 s) are progress, not a stall."""
    ex, sa = lone_receiver
    ex.prepare(None)

    def trickle():
        sa.sendall(wire.encode_header(_data(5, 16)))
        for piece in np.split(np.arange(4, dtype=np.float32), 4):
            time.sleep(0.4)
            sa.sendall(piece.tobytes())
    threading.Thread(target=trickle, daemon=True).start()
    ex.run(0)
    assert ex.bufs["x"].tolist() == [0, 1, 2, 3]


# -- full runs on loopback -------------------------------------------------------------
@pytest.mark.parametrize("links", ["channel", "shared"])
def test_two_tree_pipelined_plan(links):
    plan = two_tree_plan()
    res = run_local(plan, iterations=2, timeout_s=10, links=links)
    check_results(plan, res)
    assert res["connections"] == links


def test_ring_plan_several_iterations_float64():
    plan = ring_plan()
    plan.validate()
    res = run_local(plan, iterations=3, seed=11, dtype="float64", timeout_s=10, compute_s={"r2": [0.0, 0.2]})
    check_results(plan, res, seed=11, dtype="float64")
    w = res["iterations"][1]["workers"]["r2"]
    assert w["compute_end_ns"] - w["go_ns"] >= 0.2e9 and w["comm_start_ns"] >= w["compute_end_ns"]


def test_relay_scratch_and_non_participant():
    plan = relay_plan()
    plan.validate()
    res = run_local(plan, iterations=2, timeout_s=10)
    check_results(plan, res)
    relay = res["iterations"][0]["workers"]["r"]  # neither participant nor receiver: nothing checked
    assert relay["receiver"] is False and relay["correct"] is True and relay["digest"] is None


def test_stop_and_wait():
    plan = two_tree_plan(length=4000, chunks=4)
    check_results(plan, run_local(plan, iterations=2, stop_and_wait=True, timeout_s=10))


def test_loopback_throughput():
    n = 25_000_000  # 100 MB of float32
    res = run_local(p2p_plan(n), iterations=2, timeout_s=20)
    assert all(it["correct"] for it in res["iterations"])
    cols = res["transfers"]["columns"]
    rates = []
    for row in res["transfers"]["rows"]:
        d = dict(zip(cols, row))
        rates.append(d["bytes"] / ((d["recv_end_ns"] - d["send_start_ns"]) / 1e9) / 1e6)
    print(f"loopback 100 MB transfer: {', '.join(f'{r:.0f}' for r in rates)} MB/s")
    assert max(rates) > 300


# -- robustness against live processes -------------------------------------------------
def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _wait_registered(coord: Coordinator, n: int, timeout=10.0) -> dict:
    deadline = time.monotonic() + timeout
    while len(coord.agents()) < n:
        assert time.monotonic() < deadline, "agents did not register"
        time.sleep(0.05)
    return coord.agents()


def _attack(addr, payload: bytes, close_early=False) -> None:
    """Connect, read the server's HELLO, send ``payload``, expect the server to close."""
    with socket.create_connection(addr, timeout=5) as s:
        hello = wire.recv_header(s, bytearray(64), wire.AUTH_MAX)
        assert hello.type == wire.HELLO
        wire.recv_payload(s, hello)
        s.sendall(payload)
        if close_early:
            s.shutdown(socket.SHUT_WR)
        assert _closed_by_peer(s)  # socket.timeout if the server kept the connection open


MALFORMED = {
    "bad magic": b"NOPE" + wire.encode_header(wire.Header(wire.AUTH))[4:],
    "unsupported version": wire.encode_header(wire.Header(wire.AUTH))[:4] + b"\x07" +
    wire.encode_header(wire.Header(wire.AUTH))[5:],
    "exceeds the limit": wire.encode_header(wire.Header(wire.AUTH, payload_len=1 << 40)),
    "middle of a payload": wire.encode_header(wire.Header(wire.AUTH, payload_len=100)) + b"x" * 10,
    "unknown frame type": wire.encode_header(wire.Header(wire.AUTH))[:5] + b"\x77" +
    wire.encode_header(wire.Header(wire.AUTH))[6:],
    "authentication failed": wire.encode_header(wire.Header(wire.AUTH, payload_len=60)) + os.urandom(60),
}


def test_malformed_frames_and_bad_secrets_are_refused(caplog):
    caplog.set_level(logging.INFO, logger="agents")
    plan = p2p_plan(1000)
    with LocalCluster(plan, timeout_s=10) as cluster:
        agents = _wait_registered(cluster.coordinator, 2)
        pid = cluster.procs["b"].pid
        rss0 = _rss_kb(pid)
        targets = {"agent b": (local_address(1), agents["b"]["data_port"]),
                   "coordinator": tuple(cluster.coordinator.address)}
        for target, addr in targets.items():
            for what, payload in MALFORMED.items():
                _attack(addr, payload, close_early=what == "middle of a payload")
            with pytest.raises(wire.ProtocolError, match="authentication failed"):
                wire.connect(addr, b"wrong", {"role": "data", "name": "a", "channel": 0}).close()
        assert cluster.procs["b"].poll() is None and _rss_kb(pid) < rss0 + 20_000
        res = cluster.run()  # both still serve
        check_results(plan, res)
        log_b = cluster.logs["b"].read_text()
    coord_log = caplog.text
    for what in MALFORMED:
        assert what in log_b, what
        assert what in coord_log, what


def test_authenticated_peer_sending_garbage_fails_the_run():
    """A fake agent 'ghost' (it knows the secret) sends a DATA frame for an unknown transfer."""
    b = ProgramBuilder(["ghost", "b", "c"])
    b.transfer("ghost", "b", 0, 10, reduce=True)
    b.transfer("b", "c", 0, 10, reduce=False, send_deps=[0])
    plan = Plan("ghost", ["ghost", "b", "c"], 10, b.programs, participants=["ghost", "b"], receivers=["c"])
    with LocalCluster(plan, timeout_s=5, external=["ghost"]) as cluster:
        secret = (cluster.tmp / "secret").read_bytes()
        ctrl = wire.connect(tuple(cluster.coordinator.address), secret,
                            {"role": "agent", "name": "ghost", "data_port": 1})

        def recv(kind):
            while (msg := wire.recv_json(ctrl)[1])["msg"] != kind:
                wire.send_json(ctrl, {"msg": "alive"})  # a heartbeat for every one received
            return msg

        def ghost():
            job = recv("job")
            data = wire.connect(tuple(job["job"]["peers"]["b"]), secret,
                                {"role": "data", "name": "ghost", "channel": 0})
            wire.send_json(ctrl, {"msg": "ready"})
            recv("go")
            sent["t"] = time.monotonic()
            wire.send_frame(data, _data(1234, 40), np.zeros(10, np.float32))
            data.recv(1)
            data.close()
        sent = {}
        t = threading.Thread(target=ghost, daemon=True)
        t.start()
        with pytest.raises(RunError, match=r"b: ProtocolError: from ghost \(channel 0\): unknown transfer 1234"):
            cluster.run()
        assert time.monotonic() - sent["t"] < 3  # at once, not after the 5 s timeout
        ctrl.close()
        t.join(5)
    assert all(p.poll() is not None for p in cluster.procs.values())


def test_agent_with_wrong_secret_exits(tmp_path, caplog):
    plan = p2p_plan(10)
    with Coordinator(plan, addresses={"a": "127.0.0.1", "b": "127.0.0.1"}, data_port=None, secret=b"right",
                     bind=("127.0.0.1", 0)) as coord:
        (tmp_path / "s").write_bytes(b"wrong\n")
        cfg = {"name": "a", "coordinator": "%s:%d" % coord.address, "data_port": 0, "bind": "127.0.0.1",
               "secret_file": str(tmp_path / "s"), "log_file": str(tmp_path / "a.log")}
        (tmp_path / "a.json").write_text(json.dumps(cfg))
        p = subprocess.run([sys.executable, "-m", "agents.agent", "--config", str(tmp_path / "a.json")],
                           cwd=Path(__file__).resolve().parent.parent, capture_output=True, timeout=15)
        assert p.returncode != 0
        assert "authentication failed" in (tmp_path / "a.log").read_text()
        assert coord.agents() == {}
    deadline = time.monotonic() + 2
    while "authentication failed" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.05)  # the coordinator logs right after answering
    assert "authentication failed" in caplog.text


def _when_ready(action):
    """A progress callback running ``action()`` once all agents are ready; records the time."""
    marks = {}

    def progress(msg):
        if "ready" in msg:
            marks["t"] = time.monotonic()
            action()
    return progress, marks


def test_killed_agent_fails_the_run_and_nothing_remains():
    plan = ring_plan(3, 3000)
    procs = {}
    progress, marks = _when_ready(lambda: procs["r1"].kill())
    with LocalCluster(plan, iterations=3, timeout_s=5, compute_s={"r0": [0.5]}, progress=progress) as cluster:
        procs.update(cluster.procs)
        with pytest.raises(RunError, match=r"\br1\b") as err:
            cluster.run()
        assert time.monotonic() - marks["t"] < 3  # at once, not after the 5 s timeout
        print(err.value)
    assert all(p.poll() is not None for p in procs.values())
    assert {p.returncode for n, p in procs.items() if n != "r1"} == {1}  # aborted, not killed


def test_hung_agent_times_out_naming_it():
    plan = ring_plan(3, 3000)
    procs = {}
    progress, marks = _when_ready(lambda: os.kill(procs["r2"].pid, signal.SIGSTOP))
    with LocalCluster(plan, timeout_s=2, progress=progress) as cluster:
        procs.update(cluster.procs)
        try:
            with pytest.raises(RunError, match=r"\br2\b"):
                cluster.run()
            assert 1.5 < time.monotonic() - marks["t"] < 5
        finally:
            os.kill(procs["r2"].pid, signal.SIGCONT)
    assert all(p.poll() is not None for p in procs.values())


def test_agent_inputs_are_their_blocks_rotated_and_checked_exactly_with_the_rotation(lone_receiver):
    """An iteration's input and true sum are its block's rotated (one block made per
    ``length`` iterations): make_input's and expected_sum's of that iteration; consecutive
    iterations differ almost everywhere; the executor's input and the check take the shift;
    a non-participant has no input, a non-receiver no sum."""
    from agents.agent import Agent
    job = Job(name="h1", nodes=["h0", "h1", "h2"], length=1000, participants=["h0", "h1"], receivers=["h1"],
              program=[], peers={}, seed=5, iterations=3)
    a = Agent.__new__(Agent)
    a.name, a.job = "h1", job
    for it in (0, 1, 999, 1000, 1003):
        x, want, shift = a.inputs(it)
        assert a._block[0] == it // 1000 and shift == it % 1000
        assert np.array_equal(np.roll(x, shift), make_input(5, 1, it, 1000))
        assert np.array_equal(np.roll(want, shift), expected_sum(5, [0, 1], it, 1000))
    assert np.mean(make_input(5, 1, 1, 1000) != make_input(5, 1, 2, 1000)) > 0.99
    ex, _ = lone_receiver
    ex.bufs["x"] = np.zeros(1000, np.float32)
    x, want, shift = a.inputs(3)
    ex.prepare(x, shift)
    assert np.array_equal(ex.bufs["x"], make_input(5, 1, 3, 1000))
    a.ex = ex
    ex.bufs["x"][:] = expected_sum(5, [0, 1], 3, 1000)
    assert a.verify(want, shift)["correct"]
    assert not a.verify(want, shift - 1)["correct"]  # the sum of the iteration before
    ex.bufs["x"][-1] += 1
    assert a.verify(want, shift) == {**a.verify(want, shift), "correct": False, "max_abs_err": 1.0}
    a.name, a.job, a._block = "h2", Job(**{**job.__dict__, "name": "h2"}), (None, None, None)
    assert a.inputs(0) == (None, None, 0)
