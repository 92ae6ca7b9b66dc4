"""NetStorm's multi-root Fastest Aggregation Path Tree (Zhou et al., NetStorm, §IV-A).

Transfer delay of a link is w_trans(e) = 1 / s(e) (Alg. 2 line 1, s = throughput; here
the configured rate).  The synchronisation delay of a tree is its longest weighted
leaf->root path (Theorem 1, Eq. 2); the FAPT rooted at v minimises it, and the
shortest-path tree towards v does (Definition 2).  Every node v scores q_v = 1 / w(FAPT_v);
the N best are the roots R (Alg. 1), each root's tree carries a share q_i / sum_R q of the
model (§III step 4), in chunks of at most ``chunk_elems`` elements (CHUNK_SIZE), and
each chunk is reduced up and broadcast down its tree (aggregate-forward).

Only the static topology decision is here ("NetStorm-lite" in the paper's Fig. 18); the
closed loop (§V: passive probing, re-planning, switches: ``agents/probe.py``,
``agents/netstate.py``) calls this planner on estimated rates, and the auxiliary paths of
NetStorm-pro (§VI, Alg. 3) are :mod:`.auxpaths`.

``pace`` (not in the paper, off by default): trees that share a link direction are paced in
proportion to their shares so that each gets the part of the link its share needs (TCP would
split it per connection, evenly); a direction only one tree uses stays unpaced.
"""

from __future__ import annotations

import heapq
import math

import networkx as nx

from testbed.plan import Plan, Tree, trees_plan
from testbed.planners import Param, ParamError, planner
from testbed.planners.common import check_graph, tree_pacing

FAPT_REF = "NetStorm §IV-A: Theorem 1 (Eq. 2), Definition 2 (Eq. 6), Alg. 1-2, multi-root shares q_i / sum q"


def link_weight(graph: nx.DiGraph, child: str, parent: str, direction: str) -> float:
    """w_trans of the tree edge child->parent, 1 / rate (s/Mbit).  The paper's graph is
    undirected; ``direction`` picks which measured rate stands for the edge (a choice):
    ``reduce`` the child->parent rate (aggregation traffic), ``min`` the slower direction
    (the broadcast comes back down the same edge)."""
    up = graph[child][parent]["rate_mbps"]
    if direction == "min" and graph.has_edge(parent, child):
        up = min(up, graph[parent][child]["rate_mbps"])
    return 1.0 / up


def fapt(graph: nx.DiGraph, root: str, direction: str = "reduce") -> tuple[dict[str, str | None], float]:
    """Definition 2: the shortest-path tree towards ``root`` under w_trans (Dijkstra on
    reversed edges, ties by name) and its synchronisation delay w(T) (Eq. 2)."""
    dist, parent = {root: 0.0}, {root: None}
    heap, done = [(0.0, root)], set()
    while heap:
        d, v = heapq.heappop(heap)
        if v in done:
            continue
        done.add(v)
        for u in sorted(graph.predecessors(v)):  # edge u->v: u may be v's child
            nd = d + link_weight(graph, u, v, direction)
            if u not in done and nd < dist.get(u, math.inf):
                dist[u], parent[u] = nd, v
                heapq.heappush(heap, (nd, u))
    return parent, max(dist.values())


def sync_delay(parent: dict[str, str | None], weight: dict[tuple[str, str], float]) -> float:
    """Theorem 1 (Eq. 2): the longest leaf->root path of a tree, ``weight[(child, parent)]``
    per edge; equal to the recursive form w(T_v) = max_c w(T_c) + w(e_cv) (Eq. 5)."""
    memo: dict[str, float] = {}

    def up(n: str) -> float:  # delay from n to the root
        if n not in memo:
            p = parent[n]
            memo[n] = 0.0 if p is None else weight[(n, p)] + up(p)
        return memo[n]

    return max(up(n) for n in parent)


@planner(
    "netstorm", FAPT_REF,
    roots=Param(int, 0, "N, number of roots (trees); 0 = every node (the paper's default N = |V|)", ge=0),
    chunk_elems=Param(int, 1_000_000, "CHUNK_SIZE, elements per chunk at most (Table II: 1 million)", ge=1),
    direction=Param(str, "reduce", "which rate weighs an undirected edge (the paper does not say): reduce = "
                                   "child->parent, min = the slower direction", choices=("reduce", "min")),
    pace=Param(bool, False, "not in the paper: pace trees sharing a link direction in proportion to their shares"),
)
def plan_netstorm(graph: nx.DiGraph, length: int, *, elem_bytes: int = 4, roots: int = 0,
                  chunk_elems: int = 1_000_000, direction: str = "reduce", pace: bool = False) -> Plan:
    """NetStorm multi-root FAPT AllReduce (static topology decision, §IV-A)."""
    nodes = check_graph(graph, "netstorm")
    if roots > len(nodes):
        raise ParamError("roots", f"must be in 0..{len(nodes)}, got {roots!r}")
    trees = {v: fapt(graph, v, direction) for v in nodes}
    q = {v: (1.0 / w if w > 0 else math.inf) for v, (_, w) in trees.items()}
    chosen = sorted(nodes, key=lambda v: (-q[v], v))[: roots or len(nodes)]  # Alg. 1 lines 2-4
    total_q = sum(q[v] for v in chosen)
    plan_trees = []
    for v in chosen:
        parent = trees[v][0]
        share = q[v] / total_q if math.isfinite(total_q) else 1.0 / len(chosen)
        n_chunks = max(1, math.ceil(share * length / chunk_elems))
        rate = min((1.0 / link_weight(graph, c, p, direction) for c, p in parent.items() if p is not None),
                   default=0.0)  # the tree's slowest edge (informational)
        plan_trees.append(Tree(v, parent, share=share, chunks=n_chunks, rate_mbps=rate))
    meta = {
        "roots": chosen,
        "direction": direction,
        "q": {v: q[v] for v in nodes},  # 1 / w(FAPT_v), w in s/Mbit
        "sync_delay_s_per_mbit": {v: trees[v][1] for v in nodes},
        "trees": [t.to_dict() for t in plan_trees],
    }
    # contended pacing scales the trees' rates on a shared direction up to fill it: give it the
    # shares in units of the slowest link's rate, never more than a direction carries
    unit = min(float(d["rate_mbps"]) for _, _, d in graph.edges(data=True))
    shares = [Tree(t.root, t.parent, rate_mbps=t.share * unit) for t in plan_trees]
    return trees_plan("netstorm", nodes, length, plan_trees, meta=meta,
                      pace=tree_pacing(graph, shares, pace, "contended"))
