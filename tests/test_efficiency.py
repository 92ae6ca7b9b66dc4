"""Where a scheme's time goes (testbed/efficiency.py), the TCP-aware cost model,
pacing only where trees contend, forest pacing, and the bench verbs' input checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

from testbed.bench import BENCH_ITERATIONS, PEER_SCHEMES
from testbed.costmodel import TCP_LINK_SHARE, TCP_PACED_SHARE, predict
from testbed.efficiency import analyse_run, breakdown
from testbed.plan import Plan, ProgramBuilder, Tree, contended_pacing, trees_plan
from testbed.planners import make_plan, schemes
from testbed.topology import load_topology

REPO = Path(__file__).resolve().parent.parent
COLUMNS = ["iteration", "xfer", "src", "dst", "channel", "flow", "chunk", "phase", "bytes", "send_start_ns",
           "send_end_ns", "send_ts_ns", "recv_start_ns", "recv_end_ns", "apply_ns"]


def pair_graph(rate=8.0, delay=10.0) -> nx.DiGraph:
    g = nx.DiGraph()
    g.add_edge("a", "b", rate_mbps=rate, delay_ms=delay)
    g.add_edge("b", "a", rate_mbps=rate, delay_ms=delay)
    return g


def row(it, x, flow, chunk, nbytes, recv_s, t0=10**12):
    """A transfer a->b received over [recv_s[0], recv_s[1]] seconds after t0."""
    ns = [t0 + int(s * 1e9) for s in recv_s]
    return [it, x, "a", "b", flow, flow, chunk, "reduce", nbytes, ns[0] - 10**7, ns[0] - 10**7, ns[0] - 10**7,
            ns[0], ns[1], ns[1]]


def run_record(rows, cct, t0=10**12):
    return {"iterations": [{"iteration": 0, "warmup": True, "cct_s": 9.0, "workers": {}},
                           {"iteration": 1, "warmup": False, "cct_s": cct,
                            "workers": {"a": {"comm_start_ns": t0}, "b": {"comm_start_ns": t0 + 5}}}],
            "transfers": {"columns": COLUMNS, "rows": rows}}


def test_link_utilisation_gaps_and_tree_finish_from_chunk_timings():
    # 8 Mbit/s = 1 MB/s, 10 ms one way: two 1 MB chunks of tree 0 received over [0.01, 1.01]
    # and [1.51, 2.51] s, one of tree 1 over [1.01, 1.51]; CCT 2.6 s.  The warm-up iteration's
    # row must be ignored.
    rows = [row(0, 0, 0, 0, 5_000_000, (0.0, 5.0)),
            row(1, 0, 0, 0, 1_000_000, (0.01, 1.01)), row(1, 1, 1, 0, 500_000, (1.01, 1.51)),
            row(1, 2, 0, 1, 1_000_000, (1.51, 2.51))]
    a = analyse_run(run_record(rows, 2.6), pair_graph())
    assert a["iteration"] == 1 and a["trees"] == 2
    assert a["tree_finish_s"] == {"0": pytest.approx(2.51), "1": pytest.approx(1.51)}
    assert a["first_tree_done_share"] == pytest.approx(1.51 / 2.6)
    (link,) = a["links"]
    assert link["link"] == "a->b" and link["bytes"] == 2_500_000
    assert link["need_s"] == pytest.approx(2.5)
    assert link["utilisation"] == pytest.approx(2.5 / 2.6)
    # busy (moved back by the 10 ms delay): [0, 2.5] without a gap
    assert link["busy_share"] == pytest.approx(2.5 / 2.6)
    assert link["startup_s"] == pytest.approx(0.0) and link["tail_s"] == pytest.approx(0.1)
    b = breakdown(2.6, 2.0, a)
    assert b["plan_factor"] == pytest.approx(2.0 / 2.5) and b["execution_factor"] == pytest.approx(2.5 / 2.6)
    assert b["plan_factor"] * b["execution_factor"] == pytest.approx(2.0 / 2.6)


def test_idle_gap_between_chunks_is_found():
    rows = [row(1, 0, 0, 0, 1_000_000, (0.31, 1.31)), row(1, 1, 0, 1, 1_000_000, (2.01, 3.01))]
    a = analyse_run(run_record(rows, 3.2), pair_graph())
    (link,) = a["links"]
    assert link["startup_s"] == pytest.approx(0.3)
    assert link["longest_idle_s"] == pytest.approx(0.7)  # 1.30 .. 2.00
    assert link["busy_share"] == pytest.approx(2.0 / 3.2)
    assert analyse_run({"iterations": [], "transfers": None}, pair_graph()) == {}


def test_multi_hop_transfers_are_charged_to_every_link_of_the_route():
    g = nx.DiGraph()
    for u, v in (("a", "c"), ("c", "b")):
        g.add_edge(u, v, rate_mbps=8.0, delay_ms=5.0)
        g.add_edge(v, u, rate_mbps=8.0, delay_ms=5.0)
    a = analyse_run(run_record([row(1, 0, 0, 0, 1_000_000, (0.01, 1.01))], 1.1), g)
    assert sorted(l["link"] for l in a["links"]) == ["a->c", "c->b"]
    assert all(l["need_s"] == pytest.approx(1.0) for l in a["links"])


def test_tcp_cost_model_charges_headers():
    g = pair_graph(rate=80.0, delay=10.0)
    b = ProgramBuilder(["a", "b"])
    b.transfer("a", "b", 0, 250_000, reduce=False)
    plan = Plan("manual", ["a", "b"], 250_000, b.programs)
    ideal = predict(plan, g)["cct_s"]
    tcp = predict(plan, g, tcp=True)["cct_s"]
    assert ideal == pytest.approx(0.01 + 1e6 / 10e6)
    assert tcp == pytest.approx(0.01 + 1e6 / (10e6 * TCP_LINK_SHARE))
    # a connection paced at half the link is limited by its pacing rate's payload
    b = ProgramBuilder(["a", "b"])
    b.transfer("a", "b", 0, 250_000, reduce=False, rate_mbps=40.0)
    paced = Plan("manual", ["a", "b"], 250_000, b.programs)
    assert predict(paced, g, tcp=True)["cct_s"] == pytest.approx(0.01 + 1e6 / (5e6 * TCP_PACED_SHARE))


def test_contended_pacing_only_on_shared_edges_scaled_to_the_link():
    # trees t0 (root r: x->r) and t1 (root r: x->r, y->x) share x->r (and r->x); y<->x only t1
    t0 = Tree("r", {"r": None, "x": "r", "y": "r"}, share=0.5, rate_mbps=10.0)
    t1 = Tree("r", {"r": None, "x": "r", "y": "x"}, share=0.5, rate_mbps=30.0)
    cap = {("x", "r"): 80.0, ("r", "x"): 40.0, ("y", "r"): 50.0, ("r", "y"): 50.0, ("y", "x"): 50.0,
           ("x", "y"): 50.0}
    rates = contended_pacing([t0, t1], cap)
    assert rates == {(0, "x", "r"): pytest.approx(20.0), (1, "x", "r"): pytest.approx(60.0),
                     (0, "r", "x"): pytest.approx(10.0), (1, "r", "x"): pytest.approx(30.0)}
    plan = trees_plan("t", ["r", "x", "y"], 100, [t0, t1], pace=rates)
    plan.validate()
    got = {(op.channel, n, op.peer): op.rate_mbps for n, prog in plan.programs.items() for op in prog
           if op.kind == "send"}
    for (ti, a, b), r in got.items():
        assert r == pytest.approx(rates.get((ti, a, b), 0.0))
    assert got[(1, "y", "x")] == 0.0 and got[(0, "y", "r")] == 0.0


@pytest.mark.parametrize("pacing", ["all", "contended"])
def test_mtree_pacing_modes(pacing):
    g = load_topology("netstorm-internet2-9").graph()
    plan = make_plan("mtree", g, 1_000_000, {"pacing": pacing})
    trees = plan.meta["trees"]
    sends = [(n, op) for n, prog in plan.programs.items() for op in prog if op.kind == "send"]
    if pacing == "all":
        assert all(op.rate_mbps == pytest.approx(trees[op.channel]["rate_mbps"]) for _, op in sends)
    else:
        paced = [(n, op) for n, op in sends if op.rate_mbps > 0]
        assert paced and len(paced) < len(sends)
        for n, op in paced:  # never below the tree's rate, never above the link
            assert trees[op.channel]["rate_mbps"] - 1e-9 <= op.rate_mbps <= g[n][op.peer]["rate_mbps"] + 1e-9


def test_forest_pace_puts_lp_weights_in_the_plan():
    g = load_topology("netstorm-internet2-9").graph()
    paced = make_plan("forest", g, 1_000_000, {"pace": True})
    rate = {t["flow"]: t["rate_mbps"] for t in paced.meta["trees"]}
    ops = [op for prog in paced.programs.values() for op in prog if op.kind == "send"]
    assert all(op.rate_mbps == pytest.approx(rate[op.flow]) and op.rate_mbps > 0 for op in ops)
    plain = make_plan("forest", g, 1_000_000, {})
    assert all(op.rate_mbps == 0 for prog in plain.programs.values() for op in prog)


def cli(*args):
    return subprocess.run([sys.executable, "-m", "testbed", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("args, culprit", [
    (["bench", "efficiency", "--sizes", "3XB"], "--sizes"),
    (["bench", "efficiency", "--schemes", "nosuch"], "--schemes"),
    (["bench", "peers", "--topologies", "mars-3"], "--topologies"),
    (["bench", "ring", "--sizes", "1MB"], "--sizes"),
    (["bench", "ring", "--delay-ms", "0"], "--delay-ms"),
    (["bench", "dataplane", "--delay-ms", "-1"], "--delay-ms"),
])
def test_bench_options_rejected_with_one_line(args, culprit, tmp_path):
    r = cli(*args, "--out", str(tmp_path / "o"))
    assert r.returncode == 2
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and culprit in lines[0]
    assert not (tmp_path / "o").exists()


def test_bench_default_schemes_are_known_and_end_with_the_bounds_packing():
    # a misspelt default would fail only after the emulated WAN is up
    assert set(PEER_SCHEMES) <= set(schemes()) and PEER_SCHEMES[0] == "ring" and PEER_SCHEMES[-1] == "packing"


def test_bench_peers_without_torch_says_so(tmp_path):
    # a torch package that fails to import shadows any installed one: the skip path, no network
    fake = tmp_path / "shadow" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    r = subprocess.run([sys.executable, "-m", "testbed", "bench", "peers", "--out", str(tmp_path / "o")], cwd=REPO,
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": f"{fake.parent}{os.pathsep}{REPO}"})
    assert r.returncode == 0, r.stderr
    assert "skipped: torch is not importable" in r.stdout and "hidden by the test" in r.stdout
    assert json.loads((tmp_path / "o" / "bench.json").read_text())["skipped"].startswith("torch is not importable")


@pytest.mark.net
def test_bench_efficiency_end_to_end_small(netenv, tmp_path):
    """Two schemes on NetStorm's overlay at 2 MB: a row per scheme with the bound, the
    prediction and the where-time-goes columns taken from real per-chunk timings."""
    r = cli("bench", "efficiency", "--topologies", "netstorm-internet2-9", "--sizes", "2MB",
            "--schemes", "mtree,mst", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads((tmp_path / "bench.json").read_text())
    rows = {row["scheme"]: row for row in out["table"]}
    assert sorted(rows) == ["mst", "mtree"]
    for row in rows.values():
        assert row["correct"] and row["cct_s"] > row["bound_s"] > 0
        assert 0 < row["efficiency"] < 1 and row["predicted_s"] > 0
        assert row["plan_factor"] * row["execution_factor"] == pytest.approx(row["efficiency"], rel=1e-6)
        assert 0 < row["bottleneck_busy"] <= 1.0 + 1e-9
        assert row["tcp_rtos"] is None or row["tcp_retrans_segs"] >= row["tcp_rtos"] >= 0
    assert rows["mst"]["trees"] == 1 and rows["mst"]["first_tree_done_share"] == pytest.approx(1.0, abs=0.05)
    assert (tmp_path / "efficiency.csv").read_text().count("\n") == 3
    assert (tmp_path / "efficiency-netstorm-internet2-9.png").stat().st_size > 10_000
    res = json.loads((tmp_path / "netstorm-internet2-9-2MB" / "results.json").read_text())
    for run in res["runs"]:  # the row's CCT is the mean of the measured iterations
        measured = [it["cct_s"] for it in run["iterations"] if not it["warmup"]]
        assert len(measured) == BENCH_ITERATIONS
        assert rows[run["variant"]]["cct_s"] == pytest.approx(sum(measured) / len(measured), rel=1e-6)
    assert "mtree" in r.stdout and "efficiency" in r.stdout


def test_idle_time_rate_while_busy_and_start_skew():
    # 1 MB chunks received over [0.31, 1.31] and [2.01, 2.51] s: 0.7 s idle between them, 2 MB
    # in 1.5 s busy; the workers started 5 ns apart
    rows = [row(1, 0, 0, 0, 1_000_000, (0.31, 1.31)), row(1, 1, 0, 1, 1_000_000, (2.01, 2.51))]
    a = analyse_run(run_record(rows, 3.2), pair_graph())
    (link,) = a["links"]
    assert link["idle_s"] == pytest.approx(0.7)
    assert link["busy_mbps"] == pytest.approx(16 / 1.5)
    assert a["start_skew_s"] == pytest.approx(5e-9)
