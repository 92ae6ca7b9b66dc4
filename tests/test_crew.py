"""CREW partial reduce (testbed/planners/crew.py) against the paper: LP (2) and its closed
form, Alg. 1, exact partial sums, the bound T/2 <= T_CREW <= T, CREW vs OPR."""

from __future__ import annotations

import itertools
import random

import networkx as nx
import numpy as np
import pytest

from testbed import costmodel, topogen
from testbed.errors import ConfigError
from testbed.plan import check_allreduce
from testbed.planners import make_plan
from testbed.planners.crew import scatter_weights, split_model


def crew_mesh(n: int, seed: int) -> nx.DiGraph:
    """CREW's setting N2 (§V-A), from the generator the shipped crew-mesh topology uses."""
    return topogen.crew_mesh(n, seed).graph()


def closed_form(b, members, aggs) -> float:
    """T* = 1 / max_a sum_j min(a B_in_j, (1 - a) B_out_j), maximised over the breakpoints
    a_j = B_out_j / (B_in_j + B_out_j) (our derivation from Eqs. (1a)/(1b); F is concave
    and piecewise linear)."""
    b_in = [min(b[(i, j)] for i in members if i != j) for j in aggs]
    b_out = [min(b[(j, i)] for i in members if i != j) for j in aggs]
    alphas = [0.0, 1.0] + [o / (i + o) for i, o in zip(b_in, b_out)]
    return 1.0 / max(sum(min(a * i, (1 - a) * o) for i, o in zip(b_in, b_out)) for a in alphas)


def rates(g):
    return {(u, v): d["rate_mbps"] for u, v, d in g.edges(data=True)}


def test_alg1_loses_no_chunk_to_floating_point():
    blocks = split_model([0.1] * 10, 10)  # the case a truncating Alg. 1 gets wrong
    assert [list(r) for r in blocks] == [[i] for i in range(10)]


def test_alg1_floors_the_real_bound_as_printed():
    """Alg. 1 (§IV-A): C_i = {j : l < j <= u}, u = k * prefix sum; weights 1/3, k = 10 give
    chunks {1-3}, {4-6}, {7-10} (1-based); rounding u to nearest gives {1-3}, {4-7}, {8-10}."""
    third = [1 / 3] * 3
    assert [(r.start, r.stop) for r in split_model(third, 10)] == [(0, 3), (3, 6), (6, 10)]
    assert [(r.start, r.stop) for r in split_model(third, 10, "nearest")] == [(0, 3), (3, 7), (7, 10)]
    g = crew_mesh(3, 1)
    for u, v in g.edges:
        g[u][v]["rate_mbps"] = 100.0  # symmetric: LP (2) gives x = 1/3 each
    plan = make_plan("crew", g, 1000, {"chunks": 10})
    assert plan.meta["rounding"] == "floor"
    assert sorted(plan.meta["blocks"].values()) == [[0, 3], [3, 6], [6, 10]]


@pytest.mark.parametrize("rounding", ["floor", "nearest"])
@pytest.mark.parametrize("seed", range(5))
def test_alg1_blocks_are_contiguous_cover_all_and_follow_the_weights(seed, rounding):
    rnd = random.Random(seed)
    w = [rnd.random() for _ in range(rnd.randint(2, 12))]
    k = rnd.randint(20, 500)
    blocks = split_model(w, k, rounding)
    assert [c for r in blocks for c in r] == list(range(k))
    for x, r in zip(w, blocks):
        assert abs(len(r) - k * x / sum(w)) <= 1.0


@pytest.mark.parametrize("seed", range(6))
def test_lp2_matches_the_closed_form(seed):
    g = crew_mesh(7, seed)
    b, nodes = rates(g), sorted(g.nodes)
    members = random.Random(seed).sample(nodes, 3)
    for aggs in (nodes, members):
        x, t_s, t_m = scatter_weights(b, members, aggs)
        assert abs(sum(x.values()) - 1) < 1e-9 and min(x.values()) >= 0
        assert t_s + t_m == pytest.approx(closed_form(b, members, aggs), rel=1e-6)


def test_lp2_symmetric_rates_weigh_by_bandwidth():
    """b_ij = b_ji: x_j = B_j / sum B and T = 2 / sum B (closed form, alpha = 1/2)."""
    g = nx.DiGraph()
    rnd = random.Random(3)
    for u, v in itertools.combinations("abcde", 2):
        r = float(rnd.choice([50, 100, 150, 200]))
        g.add_edge(u, v, rate_mbps=r)
        g.add_edge(v, u, rate_mbps=r)
    b, nodes = rates(g), list("abcde")
    x, t_s, t_m = scatter_weights(b, nodes, nodes)
    big_b = {j: min(b[(i, j)] for i in nodes if i != j) for j in nodes}
    for j in nodes:
        assert x[j] == pytest.approx(big_b[j] / sum(big_b.values()), abs=1e-9)
    assert t_s == pytest.approx(t_m) and t_s + t_m == pytest.approx(2 / sum(big_b.values()))


@pytest.mark.parametrize("params", [
    {}, {"active": ["n0", "n3", "n5"]}, {"active": ["n1", "n2"], "aggregators": "members"},
    {"active": ["n0", "n4", "n5"], "pipelined": False}, {"active": ["n2", "n6"], "split": "even"},
    {"active": ["n0", "n1", "n2", "n3"], "scheduling": "fs", "chunks": 5},
])
def test_members_end_with_the_exact_partial_sum(params):
    g = crew_mesh(7, 1)
    plan = make_plan("crew", g, 5003, params)
    plan.validate()
    assert plan.contributing() == plan.finishing() == (params.get("active") or sorted(g.nodes))
    rnd = np.random.default_rng(0)
    check_allreduce(plan, {n: rnd.integers(-1000, 1000, 5003).astype(np.float32) for n in g.nodes})


@pytest.mark.parametrize("seed, p", [(0, 2), (1, 3), (2, 5), (3, 8)])
def test_predicted_time_within_the_papers_bound(seed, p):
    """T/2 <= T_CREW <= T (§III) for a large model; 5 % above T allowed for the last chunk."""
    g = crew_mesh(8, seed)
    members = sorted(g.nodes)[:p]
    plan = make_plan("crew", g, 2_000_000, {"active": members, "chunks": 256})
    lo, hi = plan.meta["bound_s"]
    cct = costmodel.predict(plan, g)["cct_s"]
    assert lo <= cct <= 1.05 * hi, (lo, cct, hi)


def test_crew_beats_opr_less_as_p_grows_and_equals_it_at_p_n():
    """§V-C: CREW's gain over OPR shrinks as p grows; OPR = CREW when p = n."""
    g = crew_mesh(8, 5)
    nodes = sorted(g.nodes)
    ratios = []
    for p in (2, 4, 8):
        t = {a: costmodel.predict(make_plan("crew", g, 1_000_000, {"active": nodes[:p], "aggregators": a}),
                                  g)["cct_s"] for a in ("all", "members")}
        ratios.append(t["members"] / t["all"])
    assert ratios[0] > ratios[1] > 1.2 and ratios[2] == pytest.approx(1.0)


@pytest.mark.parametrize("seed", range(3))
def test_crew_then_opr_beat_ps_and_ring_over_the_same_group(seed):
    """§V-B, Fig. 4: one partial reduce -- CREW fastest, OPR next, PS and ring over P slower."""
    g = crew_mesh(8, seed)
    p = {"active": sorted(g.nodes)[:3]}
    cct = {label: costmodel.predict(make_plan(scheme, g, 1_000_000, {**p, **extra}), g)["cct_s"]
           for label, scheme, extra in [("crew", "crew", {}), ("opr", "crew", {"aggregators": "members"}),
                                        ("ps", "ps", {}), ("ring", "ring", {})]}
    assert cct["crew"] < cct["opr"] < min(cct["ps"], cct["ring"]), cct


def test_network_aware_split_beats_even_split():
    g = crew_mesh(8, 2)
    members = sorted(g.nodes)[:4]
    t = {s: make_plan("crew", g, 1_000_000, {"active": members, "split": s}).meta["bound_s"][1]
         for s in ("network-aware", "even")}
    assert t["network-aware"] < t["even"]


@pytest.mark.parametrize("params, needle", [
    ({"active": ["n0"]}, "at least two distinct workers"),
    ({"active": ["n0", "n0"]}, "at least two distinct workers"),
    ({"active": ["n0", "zz"]}, "unknown datacenter 'zz'"),
    ({"chunks": -1}, "chunks"),
])
def test_bad_parameters_are_named(params, needle):
    with pytest.raises(ConfigError, match=needle):
        make_plan("crew", crew_mesh(4, 0), 1000, params)


@pytest.mark.net
def test_partial_reduce_on_a_real_network(netenv, tmp_path):
    """Agents over the emulated quick-5 WAN: only the members of P contribute and end with
    their exact sum; the non-members aggregate (CREW) or stay idle (OPR)."""
    from testbed.emulator.hosts import EmulatedHosts
    from testbed.emulator.network import WanNetwork
    from testbed.hosts import run_agents
    from testbed.topology import load_topology

    topo = load_topology("quick-5")
    members = topo.nodes[:3]
    with WanNetwork(topo) as net:
        for rule in ("all", "members"):
            plan = make_plan("crew", topo.graph(), 60_000, {"active": members, "aggregators": rule})
            res = run_agents(EmulatedHosts(net), plan, tmp_path / rule, timeout_s=60)
            it = res["iterations"][0]
            assert it["correct"], rule
            assert {n for n, w in it["workers"].items() if w["receiver"]} == set(members)
            senders = {row[2] for row in res["transfers"]["rows"]}
            assert senders == (set(topo.nodes) if rule == "all" else set(members))


@pytest.mark.parametrize("seed", range(6))
def test_alg2_moves_each_chunk_at_most_once_and_only_the_largest(seed):
    """Alg. 2: new block sizes are Alg. 1's for the new weights; a shrinking block gives up
    its largest indexes (not sent yet), a growing one takes the smallest of those; the
    number moved is the least any re-split can do (sum of the shrinkages)."""
    from testbed.planners.crew import rearrange

    rnd = random.Random(seed)
    n, k = rnd.randint(2, 10), rnd.randint(20, 300)
    old = [list(r) for r in split_model([rnd.random() for _ in range(n)], k)]
    w = [rnd.random() if rnd.random() > 0.2 else 0.0 for _ in range(n)]
    w[0] += 0.1
    new, moved = rearrange(old, w)
    assert sorted(c for b in new for c in b) == list(range(k))
    assert [len(b) for b in new] == [len(r) for r in split_model(w, k)]
    assert moved == sum(max(0, len(o) - len(b)) for o, b in zip(old, new))
    for o, b in zip(old, new):
        if len(b) <= len(o):  # shrunk: kept its smallest indexes
            assert b == o[:len(b)]
        else:  # grew: kept all of its own
            assert set(o) <= set(b)
    gone = sorted(c for o, b in zip(old, new) for c in o if c not in b)
    taken = sorted(c for o, b in zip(old, new) for c in b if c not in o)
    assert gone == taken and len(gone) == moved


@pytest.mark.parametrize("cut", ["none sent", "all sent", "random prefixes"])
@pytest.mark.parametrize("members", [["n0", "n3", "n5"], ["n1", "n2", "n4", "n6", "n7"]])
def test_prescattered_plan_is_exact_wherever_the_early_scatters_were_cut(members, cut):
    """Non-blocking (§IV-A2): each member's early scatter sends its default blocks, chunk by
    chunk in increasing index order, and is cut short when P forms, having delivered a prefix
    of each block (none, all, or a random one per aggregator).  The task's plan (Alg. 2
    blocks) scatters every chunk; a member withdraws each chunk it delivered to the chunk's
    aggregator in P's split (modelled: it sends zeros there), and the aggregator starts with
    the early copies it keeps (``meta.kept``); copies Alg. 2 moved away are discarded.  Every
    member ends with the exact sum."""
    from testbed.plan import Plan, interpret
    from testbed.planners.crew import default_split, prescatter_plan

    g = crew_mesh(8, 1)
    length = 10_007
    nodes = list(g.nodes)
    plan = make_plan("crew", g, length, {"active": members, "prescattered": True})
    plan.validate()
    k, edges, default = default_split(g, length, nodes, "network-aware", 0, "floor")
    kept = {j: {c for c in range(k) for lo, hi in plan.meta["kept"].get(j, []) if lo <= edges[c] < hi}
            for j in nodes}
    assert all(kept[j] <= set(default[j]) for j in nodes)
    inputs = {n: np.random.default_rng(i).integers(-99, 99, length).astype(np.float64) for i, n in enumerate(nodes)}
    rng = np.random.default_rng(len(members))
    start = {j: inputs[j].copy() if j in members else np.zeros(length) for j in nodes}
    for m in members:
        pre = prescatter_plan(g, length, m)
        pre.validate()
        early = interpret(pre, {**{n: np.zeros(length) for n in nodes}, m: inputs[m]})
        for j in [j for j in nodes if j != m]:
            n = {"none sent": 0, "all sent": len(default[j])}.get(cut) if cut != "random prefixes" \
                else int(rng.integers(0, len(default[j]) + 1))
            for c in default[j][:n]:  # delivered early
                lo, hi = edges[c], edges[c + 1]
                if c in kept[j]:  # withdrawn in the task: j adds the early copy, m sends nothing
                    start[j][lo:hi] += early[j][lo:hi]
                    start[m][lo:hi] = 0
    whole = Plan(plan.scheme, plan.nodes, length, plan.programs, scratch=plan.scratch)  # every x as given
    out = interpret(whole, start)
    want = sum(inputs[m] for m in members)
    for m in members:
        assert np.array_equal(out[m], want), m
    owner = {c: j for j, rs in plan.meta["blocks"].items() for lo, hi in rs for c in range(lo, hi)}  # chunk ranges
    scatters = sum(op.kind == "send" and op.phase == "scatter" for prog in plan.programs.values() for op in prog)
    assert scatters == sum(len(members) - (owner[c] in members) for c in range(k))  # every chunk, every member
    assert 0 <= plan.meta["moved_chunks"] < plan.meta["chunks"]
    with pytest.raises(ConfigError):
        make_plan("crew", g, length, {"active": members, "prescattered": True, "aggregators": "members"})
