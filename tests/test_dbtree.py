"""DBTREE, NCCL's double binary tree (testbed/planners/dbtree.py), against its description."""

import numpy as np
import pytest

from testbed.errors import ConfigError
from testbed.plan import check_allreduce
from testbed.planners import make_plan
from testbed.planners.dbtree import btree_parent, dtree_parents
from testbed.topology import load_topology


def _check_tree(parents):
    n = len(parents)
    assert parents.count(None) == 1
    kids = [0] * n
    for p in parents:
        if p is not None:
            kids[p] += 1
    assert max(kids) <= 2  # binary
    for r in range(n):  # every rank reaches the root
        x, hops = r, 0
        while parents[x] is not None:
            x, hops = parents[x], hops + 1
            assert hops <= n
    return {p for p in parents if p is not None}


@pytest.mark.parametrize("n", range(2, 34))
def test_two_complementary_binary_trees(n):
    """Each is a binary tree over all ranks; the first's leaves are the odd ranks; no node is
    interior in both (odd n: NCCL's shift leaves rank 0 interior in both)."""
    first, second = dtree_parents(n)
    inner1, inner2 = _check_tree(first), _check_tree(second)
    assert {r for r in range(n) if r not in inner1} == {r for r in range(n) if r % 2}
    assert inner1 & inner2 == (set() if n % 2 == 0 else {0})


def test_ncclgetbtree_on_eight_ranks():
    """NCCL's tree on 8 ranks: 0 -> 4, 4 -> {2, 6}, 2 -> {1, 3}, 6 -> {5, 7}; the mirror
    rooted at 7."""
    assert [btree_parent(8, r) for r in range(8)] == [None, 2, 4, 2, 0, 6, 4, 6]
    assert dtree_parents(8)[1] == [1, 3, 1, 7, 5, 3, 5, None]


@pytest.mark.parametrize("topology", ["torus-4x4", "mesh-2x2", "quick-5"])
def test_plan_is_an_exact_allreduce_with_half_the_vector_per_tree(topology):
    g = load_topology(topology).graph()
    plan = make_plan("dbtree", g, 1009, {"chunks": 3})
    plan.validate()
    rng = np.random.default_rng(0)
    check_allreduce(plan, {v: rng.integers(-99, 99, plan.length).astype(np.float64) for v in plan.nodes})
    trees = plan.meta["trees"]
    assert len(trees) == 2 and trees[0]["root"] != trees[1]["root"]
    n = len(g.nodes)
    assert plan.meta["interior_in_both"] == ([] if n % 2 == 0 else [plan.meta["ranks"][0]])


def test_order_is_checked():
    g = load_topology("quick-5").graph()
    nodes = sorted(g.nodes)
    plan = make_plan("dbtree", g, 100, {"order": nodes[::-1]})
    assert plan.meta["ranks"] == nodes[::-1] and plan.meta["trees"][0]["root"] == nodes[-1]
    with pytest.raises(ConfigError, match="scheme.order"):
        make_plan("dbtree", g, 100, {"order": nodes[:-1]})
