"""Multipath auxiliary transmission (NetStorm §VI) in the agents: chunks sent over
auxiliary paths (source-routed, forward-only relays) arrive exactly, for every tree scheme."""

from __future__ import annotations

import pytest

from agents.local import run_local
from agents.protocol import TRANSFER_COLUMNS
from testbed.planners import make_plan
from testbed.topology import load_topology

TREES = ("netstorm", "mst", "bkt", "mtree", "forest")
EAGER = {"primary_busy_bound": 0, "aux_queue_length": 2, "max_paths": 2, "disjoint": "node", "idle_only": False}


def _routes(res: dict) -> list[str]:
    col = TRANSFER_COLUMNS.index("route")
    return [row[col] for row in res["transfers"]["rows"]]


@pytest.mark.parametrize("scheme", TREES)
def test_every_tree_scheme_is_exact_with_auxiliary_paths(scheme):
    graph = load_topology("quick-5").graph()
    params = {"chunks": 8} if scheme in ("mtree", "mst", "bkt") else {}
    plan = make_plan(scheme, graph, 1 << 16, params, aux=EAGER)  # busy bound 0: any queued send overflows
    assert plan.aux["paths"], "quick-5 has auxiliary paths for every tree scheme"
    plan.validate()
    res = run_local(plan, iterations=3, timeout_s=20)
    assert all(it["correct"] for it in res["iterations"]), res["errors"]
    routes = [r for r in _routes(res) if r]
    assert routes, "no chunk took an auxiliary path"
    paths = {">".join(p) for p in plan.aux["paths"]}
    assert set(routes) <= paths


def test_relays_with_stale_path_tables_still_deliver(monkeypatch):
    """NetStorm Fig. 10: forwarding follows the route in the header.  Here every relay gets
    no path table at all (only senders know their paths), so it has no connection to the next
    hop either: it must connect on first use and forward by the header."""
    from agents.coordinator import Coordinator

    plan = make_plan("mst", load_topology("quick-5").graph(), 1 << 16, {"chunks": 8}, aux=EAGER)
    def own(self, node):
        return {**self.plan.aux, "paths": [p for p in self.plan.aux["paths"] if p[0] == node]}
    monkeypatch.setattr(Coordinator, "_aux_part", own)
    res = run_local(plan, iterations=3, timeout_s=20)
    assert all(it["correct"] for it in res["iterations"]), res["errors"]
    assert any(r for r in _routes(res)), "no chunk took an auxiliary path"


def test_relays_never_aggregate():
    """A relay that is not a participant (its input is not in the sum) forwards chunks of the
    others: every receiver's result is still exactly the participants' sum, the relay's too."""
    graph = load_topology("quick-5").graph()
    plan = make_plan("forest", graph, 1 << 16, {"active": ["h1", "h2", "h3"]}, aux=EAGER)
    res = run_local(plan, iterations=3, timeout_s=20)
    assert all(it["correct"] for it in res["iterations"]), res["errors"]
    relays = {n for r in _routes(res) if r for n in r.split(">")[1:-1]}
    assert relays - set(plan.contributing()), f"no non-participant relayed (relays: {relays})"


def test_a_misrouted_auxiliary_chunk_is_refused():
    """An auxiliary chunk whose route does not lead through the receiver from its sender is a
    protocol error naming the sender and the route, not data."""
    import socket

    from agents import wire
    from agents.executor import AUX_CHANNEL, Executor
    from testbed.plan import Op

    ex = Executor("b", [Op(0, "recv", "a", 1, 0, 4)], length=4, nodes=["a", "b", "c"], timeout_s=5)
    mine, theirs = socket.socketpair()
    ex.attach_incoming("c", AUX_CHANNEL, mine)
    wire.send_frame(theirs, wire.Header(wire.DATA, flags=wire.FLAG_AUX, xfer=1, payload_len=16, route=(0, 2, 1)),
                    bytes(16))  # route a>c>b from c: fine;  now one that claims to come from a
    wire.send_frame(theirs, wire.Header(wire.DATA, flags=wire.FLAG_AUX, xfer=1, payload_len=16, route=(2, 0, 1)),
                    bytes(16))
    with pytest.raises(wire.ProtocolError, match=r"from c: route c>a>b does not lead from c through b"):
        ex.run(0)
        ex.run(1)
    ex.close()
    theirs.close()


AUX_EXP = """
name: aux-emulated
topology: quick-5
seed: 1
scheme: {name: netstorm, roots: 1, chunk_elems: 32768, adaptive: {update_s: 0, probe_chunk_bytes: 100000, probe_chunk_num: 2},
         aux: %(aux)s}  # one tree leaves links idle
variants:
%(variants)s
workload: {size: 2MB, iterations: 3}
emulator: {tcp_cc: bbr}
agents: {timeout_s: 60}
"""


@pytest.mark.net
def test_auxiliary_paths_on_an_emulated_wan_for_every_tree_scheme(netenv, tmp_path):
    """Every tree scheme with auxiliary paths on quick-5's emulated links: every iteration
    exact, chunks relayed, results.json accounts for them per hop and relay; and the links
    only auxiliary paths use are measured by the passive probes (NetStorm §VI: every link
    carries traffic, so every link gets measured)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    aux = "{primary_busy_bound: 0, aux_queue_length: 2}"
    chunks = {"mst": ", chunks: 8", "bkt": ", chunks: 8", "mtree": ", chunks: 8"}
    variants = "\n".join(f"  - {{label: {s}, scheme: {{name: {s}{chunks.get(s, '')}, aux: {aux}}}}}"
                         for s in TREES if s != "netstorm")
    exp = tmp_path / "exp.yaml"
    exp.write_text(AUX_EXP % {"aux": aux, "variants": variants})
    res = subprocess.run([sys.executable, "-m", "testbed", "run", str(exp), "--out", str(tmp_path), "--quiet",
                          "--no-report"], cwd=Path(__file__).resolve().parent.parent, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["variant"] for r in results["runs"]] == list(TREES)
    for run in results["runs"]:
        assert run["correct"] and all(it["correct"] for it in run["iterations"]), run["variant"]
        assert run["aux"]["chunks"] > 0 and run["aux"]["forwarded"], run["variant"]
        assert sum(l["aux_bytes"] for l in run["links"]) == run["aux"]["bytes"]
    ns = results["runs"][0]
    tree_links = {(c, p) for t in results["variants"][0]["plan"]["meta"]["trees"] for c, p in t["parent"].items() if p}
    tree_links |= {(p, c) for c, p in tree_links}
    measured = {(e["src"], e["dst"]) for e in ns["estimates"]["series"]}
    aux_only = {(h["src"], h["dst"]) for h in ns["aux"]["hops"]} - tree_links
    assert aux_only and aux_only & measured, (aux_only, measured)


def _chain(tmp_dead: str):
    """Three executors in this process over real sockets: ``a`` sends 6 chunks to ``b``,
    auxiliary path a>r>b (eager dispatch).  ``tmp_dead``: which auxiliary hop is broken
    ("a>r": a's own first hop, "r>b": the relay's next hop; the broken socket's far end is
    closed, so sends on it fail)."""
    import socket

    import numpy as np

    from agents.executor import AUX_CHANNEL, Executor
    from testbed.plan import Op

    nodes, n, k = ["a", "r", "b"], 6, 1000
    aux = {"paths": [["a", "r", "b"]], "primary_busy_bound": 0, "aux_queue_length": 2, "resend_after_s": 0.5}
    a = Executor("a", [Op(j, "send", "b", j, j * k, k) for j in range(n)], length=n * k, nodes=nodes, aux=aux,
                 timeout_s=10)
    b = Executor("b", [Op(j, "recv", "a", j, j * k, k, reduce=True) for j in range(n)], length=n * k, nodes=nodes,
                 aux=aux, timeout_s=10, on_missing=lambda it, xfers: a.resend(it, [x for _, x in xfers]))

    def broken() -> socket.socket:
        mine, far = socket.socketpair()
        far.close()
        return mine

    def pair() -> tuple[socket.socket, socket.socket]:
        return socket.socketpair()

    r = Executor("r", [], length=n * k, nodes=nodes, aux=aux, timeout_s=10,
                 connect=lambda peer, ch: broken() if tmp_dead == "r>b" else pair()[0])
    s, t = pair()
    a.attach_outgoing("b", 0, s)
    b.attach_incoming("a", 0, t)
    if tmp_dead == "a>r":
        a.attach_outgoing("r", AUX_CHANNEL, broken())
    else:
        s, t = pair()
        a.attach_outgoing("r", AUX_CHANNEL, s)
        r.attach_incoming("a", AUX_CHANNEL, t)
    a.prepare(np.arange(n * k, dtype=np.float32))
    b.prepare(np.ones(n * k, dtype=np.float32))
    return a, r, b


def test_a_relay_streams_a_chunk_on_as_its_bytes_arrive():
    """Cut-through (NetStorm §VI: relays forward at link speed): the next hop gets the header
    and the first bytes while the rest is still on its way to the relay; an upstream that
    breaks mid-way leaves the frame unfinishable, and the send says so."""
    import socket
    import threading

    from agents.executor import Relayed
    from agents.wire import DATA, FLAG_AUX, Header, Truncated, recv_header, recv_into_exact

    n = 1 << 20
    out, far = socket.socketpair()
    far.settimeout(5)
    relayed, errors = Relayed(n), []
    h = Header(DATA, flags=FLAG_AUX, xfer=7, payload_len=n, route=(0, 1, 2))

    def send() -> None:
        try:
            relayed.send(out, h, 5.0, lambda: None)
        except Exception as e:
            errors.append(e)
    t = threading.Thread(target=send)
    t.start()
    relayed.buf[:4096] = b"\x01" * 4096
    relayed.progress(4096)
    got = recv_header(far, bytearray(64), n)
    first = bytearray(4096)
    recv_into_exact(far, memoryview(first))  # arrives while 99.6 % of the chunk has not
    assert (got.xfer, got.payload_len, got.route) == (7, n, (0, 1, 2)) and first == b"\x01" * 4096
    relayed.buf[4096:] = b"\x02" * (n - 4096)
    relayed.progress(n)
    rest = bytearray(n - 4096)
    recv_into_exact(far, memoryview(rest))
    t.join(5)
    assert not errors and rest == b"\x02" * (n - 4096)

    broken = Relayed(n)  # the upstream breaks after 1 KB
    broken.progress(1024)
    broken.fail(ConnectionResetError("upstream reset"))
    with pytest.raises(Truncated, match="upstream broke"):
        broken.send(out, h, 5.0, lambda: None)
    silent = Relayed(n)  # or stops sending
    with pytest.raises(Truncated, match="silent for 0.2 s"):
        silent.send(out, h, 0.2, lambda: None)
    out.close(), far.close()


def test_a_slow_upstream_does_not_hold_up_another_through_the_same_relay():
    """A relay passes chunks on on a lane per upstream hop: a chunk from ``a`` that arrives
    slowly (half of it, then a pause) does not delay one from ``c`` to the same next hop."""
    import socket
    import time

    import numpy as np

    from agents import wire
    from agents.executor import AUX_CHANNEL, Executor
    from testbed.plan import Op

    nodes, k = ["a", "c", "r", "b"], 1 << 16
    b = Executor("b", [Op(0, "recv", "a", 1, 0, k), Op(1, "recv", "c", 2, k, k)], length=2 * k, nodes=nodes,
                 timeout_s=10)

    def connect(peer: str, ch: int) -> socket.socket:
        mine, far = socket.socketpair()
        b.attach_incoming("r", ch, far)
        return mine
    r = Executor("r", [], length=2 * k, nodes=nodes, timeout_s=10, connect=connect)
    ups = {}
    for name in ("a", "c"):
        ups[name], far = socket.socketpair()
        r.attach_incoming(name, AUX_CHANNEL, far)
    b.prepare(None)
    payload = {n: np.full(k, v, np.float32).tobytes() for n, v in (("a", 1), ("c", 2))}
    ha, hc = (wire.Header(wire.DATA, flags=wire.FLAG_AUX, xfer=x, payload_len=4 * k, route=(src, 2, 3))
              for x, src in ((1, 0), (2, 1)))
    wire.send_frame(ups["a"], ha, b"")  # a's header and half its payload; the rest comes later
    ups["a"].sendall(payload["a"][:2 * k])
    wire.send_frame(ups["c"], hc, payload["c"])
    deadline = time.monotonic() + 5
    while b._got[1] != 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert b._got[1] == 0 and b._got[0] != 0, "c's chunk waited behind a's half-arrived one"
    ups["a"].sendall(payload["a"][2 * k:])
    b.run(0)
    assert np.array_equal(b.bufs["x"], np.repeat(np.float32([1, 2]), k))
    assert sorted(ch for _, ch in b._receivers) == [-3, -2]  # one lane per upstream
    for ex in (r, b):
        ex.close()
    for sock in ups.values():
        sock.close()


@pytest.mark.parametrize("dead", ["a>r", "r>b"])
def test_a_broken_auxiliary_path_loses_no_chunk(dead):
    """An auxiliary hop that fails (the sender's own first hop, or a relay's next hop): the
    sender's chunks go to the primary connection, or the receiver asks for the ones the relay
    dropped and the sender re-sends its copies; the result is exact, and nothing fails."""
    import threading

    import numpy as np

    a, r, b = _chain(dead)
    out = {}
    t = threading.Thread(target=lambda: out.update(a=a.run(0)))
    t.start()
    got = b.run(0)
    t.join(10)
    assert np.array_equal(b.bufs["x"], np.arange(6000, dtype=np.float32) + 1)
    assert len(got["recvs"]) == 6 and "a" in out
    if dead == "r>b":
        assert out["a"].get("aux"), "no chunk took the auxiliary path"
        assert b._asked, "the receiver did not ask for the dropped chunks"
    else:
        assert not out["a"].get("aux"), "chunks given back to the primary are not auxiliary sends"
    for ex in (a, r, b):
        ex.close()


@pytest.mark.net
def test_an_auxiliary_link_going_down_mid_run_loses_nothing(netenv, tmp_path):
    """small-3, one NetStorm tree (h1-h2-h3), every pair's auxiliary path over the third link
    h1-h3, which goes down mid-run: the chunks on it are given up and sent directly (the
    sender's own) or asked for again (a relay's), every iteration is exact, the run goes on."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from testbed.routing import data_paths

    scheme = {"name": "netstorm", "roots": 1, "chunk_elems": 32768, "adaptive": False,
              "aux": {"primary_busy_bound": 0, "aux_queue_length": 2, "resend_after_s": 1.0}}
    graph = load_topology("small-3").graph()
    plan = make_plan("netstorm", graph, 1 << 19, {k: scheme[k] for k in ("roots", "chunk_elems")},
                     aux={**EAGER, **scheme["aux"]})
    routed = data_paths(graph)
    primary = {frozenset(l) for src, op in plan.transfers() for l in zip(routed[(src, op.peer)], routed[(src, op.peer)][1:])}
    hops = {frozenset(l) for p in plan.aux["paths"] for l in zip(p, p[1:])} - primary
    assert hops == {frozenset(("h1", "h3"))}, hops  # the link only auxiliary paths use
    exp = tmp_path / "exp.yaml"
    exp.write_text(json.dumps({"name": "aux-fault", "topology": "small-3", "seed": 1, "scheme": scheme,
                               "workload": {"size": "2MB", "iterations": 12}, "emulator": {"tcp_cc": "bbr"},
                               "agents": {"timeout_s": 60}, "faults": [{"at_s": 4, "link_down": ["h1", "h3"]}]}))
    res = subprocess.run([sys.executable, "-m", "testbed", "run", str(exp), "--out", str(tmp_path), "--quiet",
                          "--no-report"], cwd=Path(__file__).resolve().parent.parent, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    run = results["runs"][0]
    assert run["correct"] and len(run["iterations"]) == 13  # a warm-up and 12
    assert any(e.get("event") == "link_down" for e in results["events"])
    logs = "".join(p.read_text() for p in (tmp_path / "agents").glob("*.log"))
    assert "broke" in logs, "no auxiliary connection over the downed link was given up"


@pytest.mark.parametrize("aux_mbps, taken", [(10.0, False), (1000.0, True)])
def test_eta_dispatch_takes_an_auxiliary_path_only_if_the_chunk_arrives_sooner(aux_mbps, taken):
    """The primary to b (100 Mbit/s) has 2 chunks queued: a 1 Mbit chunk behind them arrives
    after 30 ms; on a 10 Mbit/s path after 100 ms (stays on the primary), on 1000 Mbit/s after
    1 ms (goes); the paper's rule (``queue``) sends it either way."""
    from collections import defaultdict

    from agents.executor import Executor
    from testbed.plan import Op

    op = Op(0, "send", "b", 1, 0, 31250)  # 125000 bytes of float32: 1 Mbit
    for dispatch in ("eta", "queue"):
        aux = {"paths": [["a", "r", "b"]], "primary_busy_bound": 1, "aux_queue_length": 2, "dispatch": dispatch,
               "rates": {"a>r>b": [aux_mbps, 0.0], "a>b": [100.0, 0.0]}}
        ex = Executor("a", [op], length=31250, nodes=["a", "r", "b"], aux=aux, timeout_s=5)
        route = ex._route(op, {"b": 2}, defaultdict(int))
        assert route == ((0, 1, 2) if taken or dispatch == "queue" else ()), dispatch
        assert ex._route(op, {"b": 1}, defaultdict(int)) == ()  # the primary is not busy
        ex.close()
