"""BLINK-style packing and the TOPOADOPT / PLINK / PSLD baselines."""

import numpy as np
import pytest
from wan_graphs import random_wan, wan

from testbed.plan import Tree, check_allreduce
from testbed.planners import REGISTRY, make_plan
from testbed.planners.blink import blink
from testbed.planners.bound import mwu_packing, optimum, pack_spanning_trees
from testbed.planners.common import tree_link_loads, wan_view
from testbed.planners.hierarchical import (
    fs_linear_model,
    latency_groups,
    pairwise_performance,
    plink,
    psld,
    topoadopt,
    waterfill,
)


def inputs(plan, seed=0):
    rng = np.random.default_rng(seed)
    return {n: rng.integers(-1000, 1000, plan.length).astype(np.int64) for n in plan.nodes}


def trees_of(plan):
    return [Tree(t["root"], t["parent"], share=t["share"], chunks=t["chunks"],
                 rate_mbps=t["rate_mbps"]) for t in plan.meta["trees"]]


# ---------------------------------------------------------------- BLINK
@pytest.mark.parametrize("eps", [0.1, 0.3])
def test_mwu_packing_feasible_and_near_optimal(eps):
    g = random_wan(10, 20, 1)
    wv = wan_view(g)
    flow, info = mwu_packing(wv, eps)
    load = np.zeros(wv.m)
    for k, r in flow.items():
        assert len(k) == wv.n - 1
        load[list(k)] += r
    assert np.all(load <= wv.cap * (1 + 1e-9))
    opt = pack_spanning_trees(wv)[0]
    assert (1 - eps) ** 3 * opt <= info["total"] <= opt * (1 + 1e-9)


@pytest.mark.parametrize("seed", [0, 1])
def test_blink_plan(seed):
    g = random_wan(10, 22, seed)
    plan = blink(g, 97, elem_bytes=4, max_trees=3)
    plan.validate()
    trees = trees_of(plan)
    assert 1 <= len(trees) <= 3
    assert sum(t.share for t in trees) == pytest.approx(1.0)
    assert all(t.chunks == 1 for t in trees)  # unpipelined by default (MTREE Sec. IV-D)
    for t in trees:
        t.check(g.nodes)
        assert all(g.has_edge(c, p) for c, p in t.edges())
    for (a, b), load in tree_link_loads(g, trees).items():
        assert load <= g[a][b]["rate_mbps"] * (1 + 1e-6)
    assert plan.meta["total_rate_mbps"] <= optimum(g, 1e6)["rate_mbps"] + 1e-6
    check_allreduce(plan, inputs(plan, seed))
    piped = blink(g, 97, elem_bytes=4, max_trees=3, chunk_bytes=40)
    assert all(c >= 2 for c in piped.meta["chunks"])
    check_allreduce(piped, inputs(piped, seed))


# ---------------------------------------------------------------- shared models
def test_waterfill_equalises_active_trees():
    A = np.array([1.0, 2.0, 50.0])
    C = np.array([1e-8, 2e-8, 1e-8])
    S = 1e8
    T, x = waterfill(A, C, S)
    assert x.sum() == pytest.approx(1.0)
    assert x[2] == 0  # its fixed cost exceeds the common finishing time
    assert A[0] + x[0] * S * C[0] == pytest.approx(T)
    assert A[1] + x[1] * S * C[1] == pytest.approx(T)


def test_fs_model_single_link():
    g = wan([("a", "b", 80, 25)])
    A, C = fs_linear_model(g, [{"a": None, "b": "a"}], {})
    assert A[0] == pytest.approx(0.05)  # 25 ms up + 25 ms down
    assert C[0] == pytest.approx(2 * 8 / 80e6)


def test_pairwise_performance_uses_average_bandwidth():
    g = wan([("a", "b", 100, 10), ("b", "c", 50, 10), ("a", "c", 500, 100)])
    paths, lat, bw = pairwise_performance(g)
    assert paths[("a", "c")] == ["a", "b", "c"]  # latency-shortest
    assert lat[("a", "c")] == pytest.approx(0.02)
    assert bw[("a", "c")] == pytest.approx(75.0)  # mean, not bottleneck (MTREE Sec. IV-A-1)


# ---------------------------------------------------------------- baselines
@pytest.mark.parametrize("seed", [0, 1])
def test_topoadopt(seed):
    g = random_wan(9, 16, seed)
    plan = topoadopt(g, 64, elem_bytes=4, trees=3, iters=400, seed=seed)
    plan.validate()
    trees = trees_of(plan)
    assert 1 <= len(trees) <= 3
    assert len({t.root for t in trees}) == len(trees)  # distinct aggregators
    assert all(t.chunks == 1 for t in trees)  # no pipelining
    for t in trees:
        t.check(g.nodes)
        assert all(g.has_edge(c, p) for c, p in t.edges())
    assert sum(t.share for t in trees) == pytest.approx(1.0)
    ann = plan.meta["annealing"]
    assert ann["best_cost_s"] <= ann["initial_cost_s"] + 1e-12
    check_allreduce(plan, inputs(plan, seed))


def test_psld():
    g = random_wan(9, 14, 2)
    plan = psld(g, 80, elem_bytes=4)
    plan.validate()
    trees = trees_of(plan)
    assert plan.meta["servers"] >= len(trees) >= 1
    assert all(t.height() == 1 for t in trees)  # push/pull stars
    assert all(t.chunks == 1 for t in trees)
    assert sum(t.share for t in trees) == pytest.approx(1.0)
    check_allreduce(plan, inputs(plan))
    two = psld(g, 80, elem_bytes=4, servers=2)
    assert len(two.meta["trees"]) <= 2
    check_allreduce(two, inputs(two, 1))


def test_plink_two_levels():
    # two latency clusters joined by one long link
    left = [("a1", "a2", 100, 5), ("a2", "a3", 100, 5), ("a1", "a3", 100, 5)]
    right = [("b1", "b2", 100, 5), ("b2", "b3", 100, 5), ("b1", "b3", 100, 5)]
    g = wan(left + right + [("a1", "b1", 100, 200)])
    paths, lat, bw = pairwise_performance(g)
    groups = latency_groups(sorted(g.nodes), lat, 2)
    assert groups == [["a1", "a2", "a3"], ["b1", "b2", "b3"]]
    plan = plink(g, 60, elem_bytes=4, groups=2)
    plan.validate()
    trees = trees_of(plan)
    assert plan.meta["groups"] == groups
    assert len(trees) == 2
    leaders = set(plan.meta["leaders"])
    for t in trees:
        assert t.root in leaders
        assert t.height() <= 2
        for n, p in t.parent.items():
            if n not in leaders:
                assert p in leaders and p[0] == n[0]  # members hang under their own leader
    check_allreduce(plan, inputs(plan))
    auto = plink(random_wan(12, 20, 3), 70, elem_bytes=4)
    auto.validate()
    check_allreduce(auto, inputs(auto, 3))


def test_registered_with_defaults():
    g = random_wan(8, 12, 5)
    for name in ("blink", "topoadopt", "plink", "psld", "mtree"):
        assert name in REGISTRY
    for name, params in (("blink", {}), ("topoadopt", {"iters": 200}), ("plink", {}), ("psld", {})):
        plan = make_plan(name, g, 33, params)
        plan.validate()
        check_allreduce(plan, inputs(plan))
        assert plan.meta["reference"]


def test_bad_parameters_name_the_key():
    from testbed.errors import ConfigError

    g = random_wan(6, 8, 0)
    for name, params, key in (("mtree", {"rho": 0.0}, "scheme.rho"), ("mtree", {"K": -1}, "scheme.K"),
                              ("blink", {"epsilon": 1.5}, "scheme.epsilon"),
                              ("topoadopt", {"trees": 0}, "scheme.trees"),
                              ("psld", {"servers": -2}, "scheme.servers"),
                              ("plink", {"groups": -1}, "scheme.groups")):
        with pytest.raises(ConfigError) as e:
            make_plan(name, g, 10, params)
        assert e.value.key == key
    disconnected = wan([("a", "b", 10), ("c", "d", 10)])
    for name in ("mtree", "blink", "topoadopt", "plink", "psld"):
        with pytest.raises(ConfigError):
            make_plan(name, disconnected, 10)
