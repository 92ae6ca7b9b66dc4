"""The AllReduce-rate optimum (testbed/planners/bound.py)."""

import itertools
import math

import networkx as nx
import numpy as np
import pytest

from testbed.plan import Tree
from testbed.planners.bound import optimum, pack_spanning_trees, simple_bound, spanning_tree
from testbed.planners.common import tree_link_loads, tree_roundtrip_s, wan_view
from wan_graphs import random_wan, wan


def check_feasible(g, result, tol=1e-6):
    trees = [Tree(t["root"], t["parent"], rate_mbps=t["rate_mbps"]) for t in result["trees"]]
    for t in trees:
        t.check(g.nodes)
    loads = tree_link_loads(g, trees)
    for (a, b), load in loads.items():
        assert load <= g[a][b]["rate_mbps"] * (1 + tol), (a, b, load)
    assert sum(t.rate_mbps for t in trees) == pytest.approx(result["rate_mbps"], rel=1e-6)


def partition_bound(g):
    """Nash-Williams/Tutte: min over partitions P of crossing capacity / (|P| - 1)."""
    wv = wan_view(g)
    nodes = list(range(wv.n))
    best = math.inf

    def partitions(seq):
        if not seq:
            yield []
            return
        first, rest = seq[0], seq[1:]
        for p in partitions(rest):
            for i in range(len(p)):
                yield p[:i] + [[first] + p[i]] + p[i + 1:]
            yield [[first]] + p

    for p in partitions(nodes):
        if len(p) < 2:
            continue
        label = {v: i for i, block in enumerate(p) for v in block}
        cross = sum(c for (i, j), c in zip(wv.edges, wv.cap) if label[i] != label[j])
        best = min(best, cross / (len(p) - 1))
    return best


def test_ring_uniform():
    n, c = 7, 100.0
    g = wan([(f"r{i}", f"r{(i + 1) % n}") for i in range(n)], rate=c)
    res = optimum(g, 1e6)
    # n paths (drop one link each) at c/(n-1): every link is in n-1 of them
    assert res["rate_mbps"] == pytest.approx(n * c / (n - 1))
    assert res["simple_rate_mbps"] == pytest.approx(n * c / (n - 1))
    check_feasible(g, res)


def test_complete_graph_uniform():
    n, c = 6, 50.0
    g = wan([(f"k{i}", f"k{j}") for i, j in itertools.combinations(range(n), 2)], rate=c)
    res = optimum(g, 1e6)
    # Nash-Williams/Tutte: K_n packs n/2 spanning trees per unit capacity
    assert res["rate_mbps"] == pytest.approx(c * n / 2)
    assert res["normalised"] == pytest.approx(1.0)
    check_feasible(g, res)


def test_bridge_limits_packing_below_simple_bound():
    left = [(f"a{i}", f"a{j}") for i, j in itertools.combinations(range(4), 2)]
    right = [(f"b{i}", f"b{j}") for i, j in itertools.combinations(range(4), 2)]
    g = wan(left + right, rate=100.0)
    g.add_edge("a0", "b0", rate_mbps=30.0, delay_ms=5.0)
    g.add_edge("b0", "a0", rate_mbps=30.0, delay_ms=5.0)
    res = optimum(g, 1e6)
    assert res["rate_mbps"] == pytest.approx(30.0)
    assert res["rate_mbps"] < res["simple_rate_mbps"]
    check_feasible(g, res)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lp_equals_partition_formula_and_below_simple_bound(seed):
    g = random_wan(6, 9, seed)
    res = optimum(g, 1e6)
    assert res["rate_mbps"] == pytest.approx(partition_bound(g), rel=1e-6)
    assert res["rate_mbps"] <= res["simple_rate_mbps"] * (1 + 1e-9)
    check_feasible(g, res)


def test_random_medium_graph_feasible_and_cct():
    g = random_wan(20, 60, 3)
    S = 1e9
    res = optimum(g, S)
    assert res["solver"]["status"].startswith("optimal")
    assert res["rate_mbps"] <= res["simple_rate_mbps"] * (1 + 1e-9)
    assert res["max_utilisation"] <= 1 + 1e-6
    check_feasible(g, res)
    assert res["transfer_s"] == pytest.approx(S * 8 / (res["rate_mbps"] * 1e6))
    rt = min(tree_roundtrip_s(g, t["parent"]) for t in res["trees"])
    assert res["latency_s"] == pytest.approx(rt)
    assert res["cct_s"] == pytest.approx(res["transfer_s"] + res["latency_s"])


def test_asymmetric_links_use_the_smaller_direction():
    g = wan([("x", "y", 100), ("y", "z", 100), ("z", "x", 100)])
    g["x"]["y"]["rate_mbps"] = 40.0  # y->x stays 100
    res = optimum(g, 1e6)
    # capacities 40, 100, 100 on a triangle: min over partitions = min(240/2, 140, 200, 140)
    assert res["rate_mbps"] == pytest.approx(120.0)
    assert simple_bound(g) == pytest.approx(120.0)
    check_feasible(g, res)


def test_nodes_restricts_to_induced_subgraph():
    g = wan([("a", "b", 100), ("b", "c", 100), ("a", "c", 100), ("c", "d", 10)])
    res = optimum(g, 1e6, nodes=["a", "b", "c"])
    assert res["rate_mbps"] == pytest.approx(150.0)
    assert set(res["trees"][0]["parent"]) == {"a", "b", "c"}


def test_spanning_tree_matches_networkx():
    g = random_wan(15, 40, 4)
    wv = wan_view(g)
    rng = np.random.default_rng(0)
    w = rng.random(wv.m)
    t = spanning_tree(wv.n, wv.edges, w)
    ug = nx.Graph()
    for k, (i, j) in enumerate(wv.edges):
        ug.add_edge(i, j, weight=w[k])
    ref = nx.minimum_spanning_tree(ug).size(weight="weight")
    assert len(t) == wv.n - 1
    assert w[t].sum() == pytest.approx(ref)
    tmax = spanning_tree(wv.n, wv.edges, w, maximize=True)
    assert w[tmax].sum() == pytest.approx(nx.maximum_spanning_tree(ug).size(weight="weight"))


def test_disconnected_graph_has_zero_rate():
    g = wan([("a", "b", 100), ("c", "d", 100)])
    value, used, info = pack_spanning_trees(wan_view(g))
    assert value == 0 and used == []
