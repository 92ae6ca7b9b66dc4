"""DBTREE: NCCL's double binary tree (MultiTree paper §V baseline "DBTree"; reading note
shared/spec/004-multitree.md, baselines).

Two binary trees over the ranks, each reducing then broadcasting half of the vector; the
second tree is the first with the ranks mirrored (even n: rank r plays n-1-r) or shifted
(odd n: rank r plays r-1), as NCCL's ``ncclGetDtree`` builds them, so the first tree's
leaves (the odd ranks) are the second tree's interior nodes: every node is interior in at
most one tree (odd n: but for one node, which NCCL's shift leaves interior in both).  The
trees are topology-oblivious: a tree edge between ranks that are not neighbours is routed
over several links (the paper's point: such edges contend).

Deviation, documented: NCCL alternates the two trees' steps (even/odd) so a node never sends
or receives in both at once; here the two trees run concurrently on their own connections
(:func:`~testbed.plan.trees_plan`), sharing links as TCP shares them.
"""

from __future__ import annotations

import networkx as nx

from testbed.plan import Plan, Tree, trees_plan
from testbed.planners import NODES, Param, ParamError, planner
from testbed.planners.common import check_graph, tree_roundtrip_s
from testbed.routing import shortest_paths

DBTREE_REF = "NCCL double binary tree (ncclGetBtree/ncclGetDtree); MultiTree paper §V baseline DBTree"


def btree_parent(n: int, rank: int) -> int | None:
    """NCCL's ``ncclGetBtree`` parent of ``rank`` among ``n`` ranks (rank 0 is the root): with
    ``bit`` the lowest set bit of ``rank``, the parent is ``(rank ^ bit) | (bit << 1)``, or
    ``rank ^ bit`` if that is not a rank.  Odd ranks are the leaves."""
    if rank == 0:
        return None
    bit = rank & -rank
    up = (rank ^ bit) | (bit << 1)
    return up if up < n else rank ^ bit


def dtree_parents(n: int) -> tuple[list[int | None], list[int | None]]:
    """The two trees' parent lists over ranks 0..n-1 (``ncclGetDtree``): the second is the
    first mirrored (even n) or shifted by one (odd n)."""
    first = [btree_parent(n, r) for r in range(n)]
    if n % 2 == 0:
        second = [None if (p := btree_parent(n, n - 1 - r)) is None else n - 1 - p for r in range(n)]
    else:
        second = [None if (p := btree_parent(n, (r - 1) % n)) is None else (p + 1) % n for r in range(n)]
    return first, second


@planner(
    "dbtree", DBTREE_REF,
    order=Param((list, tuple), (), "the nodes in rank order; empty = sorted by name (NCCL's ranks ignore "
                                   "the WAN: the trees are topology-oblivious)", kind=NODES),
    chunks=Param(int, 1, "pipelined chunks per tree (NCCL pipelines in chunks; 1 = no pipelining)", ge=1),
)
def plan_dbtree(graph: nx.DiGraph, length: int, *, elem_bytes: int = 4, order=(), chunks: int = 1) -> Plan:
    """Double binary tree AllReduce: two complementary binary trees, half the vector each."""
    nodes = check_graph(graph, "dbtree")
    ranks = list(order) if order else sorted(nodes, key=str)
    if sorted(ranks, key=str) != sorted(nodes, key=str):
        raise ParamError("order", f"must list every node once, got {list(ranks)}")
    n = len(ranks)
    paths = shortest_paths(graph)
    trees, meta = [], []
    for parents in dtree_parents(n):
        parent = {ranks[r]: None if p is None else ranks[p] for r, p in enumerate(parents)}
        root = next(v for v, p in parent.items() if p is None)
        tree = Tree(root, parent, share=1.0 / (2 if n > 1 else 1), chunks=chunks)
        interior = sorted({p for p in parent.values() if p is not None}, key=str)
        meta.append({"root": root, "parent": parent, "height": tree.height(), "interior": interior,
                     "roundtrip_s": tree_roundtrip_s(graph, parent, paths)})
        trees.append(tree)
        if n == 1:
            break
    return trees_plan("dbtree", list(nodes), length, trees,
                      meta={"trees": meta, "ranks": ranks, "chunks": chunks,
                            "interior_in_both": sorted(set(meta[0]["interior"]) & set(meta[-1]["interior"]), key=str)
                            if n > 1 else []})
