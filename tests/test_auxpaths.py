"""Auxiliary path search (NetStorm §VI-B, Algorithm 3): the paper's edge-disjoint rounds and the
authors' node-disjoint variant, idle links only, fastest first.  Pure: no network."""

import networkx as nx
import pytest

from testbed.planners import make_plan
from testbed.planners.auxpaths import aux_paths, plan_pairs, transfer_cost
from testbed.topology import load_topology


def graph(links):
    g = nx.DiGraph()
    for a, b, rate in links:
        g.add_edge(a, b, rate_mbps=rate, delay_ms=1.0)
        g.add_edge(b, a, rate_mbps=rate, delay_ms=1.0)
    return g


def links(path):
    return {frozenset(l) for l in zip(path, path[1:])}


# a-m-c is the fast primary; a-n-m-p-c shares node m with it but no link
DIAMOND = graph([("a", "m", 100), ("m", "c", 100), ("a", "n", 50), ("n", "m", 50), ("m", "p", 50), ("p", "c", 50)])


def test_edge_disjoint_rounds_reuse_nodes_but_not_links():
    got = aux_paths(DIAMOND, [("a", "c")])[("a", "c")]
    assert got == {"primary": ["a", "m", "c"], "aux": [["a", "n", "m", "p", "c"]]}


def test_node_disjoint_variant_refuses_a_shared_intermediate():
    assert aux_paths(DIAMOND, [("a", "c")], disjoint="node")[("a", "c")]["aux"] == []


def test_square_with_a_slow_chord_ranks_auxiliary_paths_by_transfer_delay():
    g = graph([("a", "b", 100), ("b", "c", 100), ("a", "d", 100), ("d", "c", 100), ("a", "c", 10)])
    for mode in ("edge", "node"):
        got = aux_paths(g, [("a", "c")], disjoint=mode)[("a", "c")]
        assert got["primary"] == ["a", "b", "c"]
        assert got["aux"] == [["a", "d", "c"], ["a", "c"]], mode  # 0.02 s/Mbit before 0.1
        assert aux_paths(g, [("a", "c")], disjoint=mode, max_paths=1)[("a", "c")]["aux"] == [["a", "d", "c"]]
        # busy links (the trees' own) are left to the primary paths
        assert aux_paths(g, [("a", "c")], disjoint=mode, busy=[("d", "a")])[("a", "c")]["aux"] == [["a", "c"]]


@pytest.mark.parametrize("topology", ["netstorm-internet2-9", "gscale-b4-12"])
@pytest.mark.parametrize("mode", ["edge", "node"])
def test_every_plan_pair_gets_valid_disjoint_idle_paths(topology, mode):
    g = load_topology(topology).graph()
    plan = make_plan("netstorm", g, 1 << 16, {"roots": 1})  # one tree: idle links outside it
    pairs = plan_pairs(plan)
    busy = {frozenset(p) for p in pairs}  # adjacent pairs: the trees' links
    res = aux_paths(g, pairs, disjoint=mode, busy=[tuple(b) for b in busy])
    assert set(res) == set(pairs)
    # NetStorm's overlay: the one tree leaves 5 of 13 links idle, and no tree pair is joined by
    # idle links alone; B4 has detours
    assert any(r["aux"] for r in res.values()) == (topology == "gscale-b4-12")
    for (s, d), r in res.items():
        paths = [r["primary"], *r["aux"]]
        for p in paths:
            assert p[0] == s and p[-1] == d and len(set(p)) == len(p) and nx.is_path(g, p)
        for p in r["aux"]:
            assert not links(p) & busy  # idle links only
        costs = [transfer_cost(g, p) for p in r["aux"]]
        assert costs == sorted(costs)
        if mode == "edge":  # pairwise link-disjoint
            for i, p in enumerate(paths):
                for q in paths[i + 1:]:
                    assert not links(p) & links(q), (p, q)
        else:  # intermediates pairwise disjoint
            for i, p in enumerate(paths):
                for q in paths[i + 1:]:
                    assert not set(p[1:-1]) & set(q[1:-1]), (p, q)


def test_bad_mode_and_unreachable_pair():
    with pytest.raises(ValueError, match="disjoint"):
        aux_paths(DIAMOND, [("a", "c")], disjoint="both")
    g = graph([("a", "b", 10)])
    g.add_node("z")
    with pytest.raises(ValueError, match="no path from a to z"):
        aux_paths(g, [("a", "z")])


def test_eta_dispatch_carries_the_rates_of_every_path_and_primary():
    """``dispatch: eta``: plan.aux gives each auxiliary path and each pair's primary path its
    bottleneck rate and delay (the executor compares arrival times); a plan without them is
    refused."""
    from testbed.plan import Plan, PlanError
    from testbed.planners.auxpaths import attach

    g = load_topology("netstorm-internet2-9").graph()
    plan = make_plan("netstorm", g, 1 << 16, {"roots": 1})
    aux = attach(plan, g, disjoint="node", idle_only=False, dispatch="eta")
    assert aux["paths"] and aux["dispatch"] == "eta"
    for p in aux["paths"]:
        rate, delay = aux["rates"][">".join(p)]
        assert rate == min(g[a][b]["rate_mbps"] for a, b in zip(p, p[1:]))
        assert delay == pytest.approx(sum(g[a][b]["delay_ms"] for a, b in zip(p, p[1:])) / 1e3)
        assert f"{p[0]}>{p[-1]}" in aux["rates"]
    assert "rates" not in attach(plan, g, disjoint="node", idle_only=False)
    plan.aux = aux
    plan.validate()
    bad = Plan.from_dict({**plan.to_dict(), "aux": {**aux, "rates": {}}})
    with pytest.raises(PlanError, match="dispatch eta: no rate of path"):
        bad.validate()
    with pytest.raises(PlanError, match="dispatch must be queue or eta"):
        Plan.from_dict({**plan.to_dict(), "aux": {**aux, "dispatch": "fast"}}).validate()
