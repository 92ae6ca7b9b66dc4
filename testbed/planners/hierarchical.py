"""Baselines of the MTREE paper (000, Sec. IV-A-1): TOPOADOPT, PLINK and PSLD.

The MTREE paper describes them in one or two sentences each and their papers are not
in the seed set, so each scheme here is the closest defensible construction from those
descriptions (plus, where stated, the abstract of the cited work).  Every scheme is a
set of rooted trees with shares, compiled by :func:`testbed.plan.trees_plan` with **one
chunk per tree** (the MTREE paper runs all baselines unpipelined: "training workers
encapsulate all the data into a single message", Sec. IV-D).

* ``topoadopt`` -- TOPOADOPT (L. Luo et al., ICENAT 2022, ref. [6]).  MTREE: "formulated
  the joint optimization problem of generating trees to assign workloads as a ...
  mixed-integer nonlinear programming model and designed a heuristic algorithm based on
  Simulated Annealing"; no pipelining, no height limit.  ICENAT abstract: "multiple
  aggregators to share aggregation load and tree-based hierarchical aggregation ...
  jointly optimizes the parameter assignment among aggregators and the construction of
  aggregation trees".  Here: ``trees`` aggregators, each the root of a spanning tree of
  WAN links; simulated annealing over tree structure (re-parent a node to another
  neighbour, move a root) minimising the completion time of :func:`fs_linear_model`, with
  the parameter assignment (shares) optimal for each candidate (:func:`waterfill`).
  *Approximation*: the MINLP and its SA moves are not published in the seed texts.
* ``plink`` -- PLINK (Liang Luo et al., MLSys 2020, ref. [25]).  MTREE: "2-level
  hierarchical aggregation algorithm (intra-group aggregation and inter-group
  aggregation)"; it "needs to measure the communication performance between nodes",
  which the MTREE evaluation takes as latency-shortest paths with the *average* link
  bandwidth on the path.  Here: groups = complete-linkage clusters of pairwise latency
  (locality); leader = the member with the fastest modelled intra-group gather; members
  send to their leader, leaders aggregate shards across groups (a sharded parameter
  server among leaders, shares balanced on the pairwise model), results flow back down.
  As trees: one tree per leader ``L``: ``L`` is the root, other leaders are its
  children, members hang under their own leader.  Tree edges are *logical* (routed
  over latency-shortest paths, as the emulator routes).  *Approximation*: PLink's probing
  and plan fitting are replaced by the pairwise model; the group count (auto, at least
  2 so that there are two levels) is chosen by the fair-share estimate.
* ``psld`` -- PSLD (Y. Chen et al., SoCC 2020, ref. [24]).  MTREE: "multi-aggregator
  algorithm"; "if multiple parameter servers are available, training workers could
  consistently distribute their aggregation workloads into them for load balance".
  SoCC abstract: an exploitation-exploration method scales PSs in/out and adjusts the
  parameter distribution among PSs.  Here: each PS ``j`` is the root of a star (every
  other node pushes its shard to ``j`` and pulls the sum), shares balance the per-PS
  completion times on the pairwise model (exploitation), and the number of PSs (auto)
  is the one with the smallest fair-share estimate among the top-k PSs by pairwise
  speed (exploration, done offline).  *Approximation* of an online system.

Cost models (ours; stated because they drive the searches):

* pairwise model (PLINK/PSLD decisions): node pair ``(u, v)`` has latency = delay of the
  latency-shortest path and bandwidth = mean ``rate_mbps`` of its links (MTREE Sec.
  IV-A-1); transfers do not interfere.
* :func:`fs_linear_model`: every tree edge is a flow on its route in each direction;
  a flow gets ``min`` over its links of ``rate / (flows on that direction)`` (static
  fair share, like the max-min "FS" of the MTREE simulator); tree ``i`` takes
  ``A_i + x_i S C_i`` seconds for share ``x_i`` (unpipelined store-and-forward: worst
  leaf->root latency plus worst root->leaf latency, and per byte the worst sum of
  ``1/rate`` up plus down).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict

import networkx as nx
import numpy as np
from scipy.cluster.hierarchy import fcluster, linkage
from scipy.spatial.distance import squareform

from testbed.plan import Plan, Tree, trees_plan
from testbed.planners import Param, planner
from testbed.planners.bound import simple_bound
from testbed.planners.common import ACTIVE, check_graph, group_view, members, path_delay_s, tree_roundtrip_s, widen
from testbed.routing import shortest_paths

REFERENCES = {
    "topoadopt": "TOPOADOPT (Luo et al., ICENAT 2022) as described in MTREE (000) Sec. II-C/IV-A "
                 "and CREW (002) Sec. V-A; approximation",
    "plink": "PLINK (Luo et al., MLSys 2020) as described in MTREE (000) Sec. IV-A; approximation",
    "psld": "PSLD (Chen et al., SoCC 2020) as described in MTREE (000) Sec. II-C/IV-A; approximation",
}


# ---------------------------------------------------------------------------
# Shared models
# ---------------------------------------------------------------------------
def pairwise_performance(graph: nx.DiGraph, paths: dict | None = None
                         ) -> tuple[dict, dict[tuple[str, str], float], dict[tuple[str, str], float]]:
    """Pairwise node performance as the MTREE evaluation measures it for PSLD/PLINK
    (Sec. IV-A-1): route = latency-shortest path, latency = its one-way delay (s),
    bandwidth = the *average* ``rate_mbps`` of its links.  Returns (paths, lat, bw)."""
    paths = shortest_paths(graph) if paths is None else paths
    lat, bw = {}, {}
    for (u, v), p in paths.items():
        lat[(u, v)] = path_delay_s(graph, p)
        bw[(u, v)] = float(np.mean([graph[a][b]["rate_mbps"] for a, b in zip(p, p[1:])]))
    return paths, lat, bw


def _route(graph: nx.DiGraph, paths: dict, a: str, b: str) -> list[str]:
    return [a, b] if graph.has_edge(a, b) else paths[(a, b)]


def fs_linear_model(graph: nx.DiGraph, parents: list[dict], paths: dict
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Static fair-share, store-and-forward estimate of unpipelined trees (module doc).

    ``parents``: one node->parent map per tree (edges may be logical; routed on
    ``paths``).  Returns ``(A, C)``: tree ``i`` with ``x_i S`` bytes takes about
    ``A_i + x_i S C_i`` seconds (``A`` in s, ``C`` in s/byte)."""
    flows = defaultdict(int)
    routes = []
    for par in parents:
        r = {}
        for c, p in par.items():
            if p is None:
                continue
            for a, b in ((c, p), (p, c)):
                route = _route(graph, paths, a, b)
                r[(a, b)] = route
                for x, y in zip(route, route[1:]):
                    flows[(x, y)] += 1
        routes.append(r)
    A, C = [], []
    for par, r in zip(parents, routes):
        lat, per_byte = {}, {}
        for (a, b), route in r.items():
            lat[(a, b)] = path_delay_s(graph, route)
            rate = min(graph[x][y]["rate_mbps"] / flows[(x, y)] for x, y in zip(route, route[1:]))
            per_byte[(a, b)] = 8.0 / (rate * 1e6)
        up_a, up_c, dn_a, dn_c = {}, {}, {}, {}

        def walk(n):
            if n in up_a:
                return
            p = par[n]
            if p is None:
                up_a[n] = up_c[n] = dn_a[n] = dn_c[n] = 0.0
                return
            walk(p)
            up_a[n] = up_a[p] + lat[(n, p)]
            up_c[n] = up_c[p] + per_byte[(n, p)]
            dn_a[n] = dn_a[p] + lat[(p, n)]
            dn_c[n] = dn_c[p] + per_byte[(p, n)]

        for n in par:
            walk(n)
        A.append(max(up_a.values()) + max(dn_a.values()))
        C.append(max(up_c.values()) + max(dn_c.values()))
    return np.array(A), np.array(C)


def waterfill(A: np.ndarray, C: np.ndarray, S: float) -> tuple[float, np.ndarray]:
    """Shares ``x`` (sum 1, >= 0) minimising ``max_i A_i + x_i S C_i`` over trees with
    ``x_i > 0``: equalise the finishing times of the trees that get work, leaving out
    trees whose fixed cost ``A_i`` already exceeds the common time."""
    k = len(A)
    if k == 0:
        return math.inf, np.zeros(0)
    if S <= 0:
        x = np.zeros(k)
        x[int(np.argmin(A))] = 1.0
        return float(A.min()), x
    order = np.argsort(A, kind="stable")
    T = math.inf
    active = []
    for i in order:
        if active and A[i] >= T:
            break
        active.append(i)
        inv = np.array([1.0 / (S * C[j]) for j in active])
        T = (1.0 + sum(A[j] * v for j, v in zip(active, inv))) / inv.sum()
    x = np.zeros(k)
    for j in active:
        x[j] = max(0.0, (T - A[j]) / (S * C[j]))
    x /= x.sum()
    return float(T), x


def _finish(scheme: str, graph: nx.DiGraph, length: int, elem_bytes: int, parents: list[dict],
            shares: np.ndarray, paths: dict, extra: dict) -> Plan:
    """Build the plan (one chunk per tree) and the common meta."""
    nodes = sorted(graph.nodes)
    keep = [i for i in range(len(parents)) if shares[i] > 1e-12]
    x = np.array([shares[i] for i in keep])
    x = x / x.sum()
    S = length * elem_bytes
    A, C = fs_linear_model(graph, [parents[i] for i in keep], paths)
    times = A + x * S * C
    # the modelled rate of a tree: bytes per second it moves (for information only)
    trees = [Tree(next(n for n, p in parents[i].items() if p is None), parents[i],
                  share=float(xi), chunks=1,
                  rate_mbps=float(xi * S * 8 / (ti * 1e6)) if ti > 0 and S else 0.0)
             for i, xi, ti in zip(keep, x, times)]
    infos = []
    for t, a, c, ti in zip(trees, A, C, times):
        d = t.to_dict()
        d.update({"max_fanout": max(len(v) for v in t.children().values()),
                  "roundtrip_s": tree_roundtrip_s(graph, t.parent, paths),
                  "model_fixed_s": float(a), "model_s_per_byte": float(c), "model_t_s": float(ti)})
        infos.append(d)
    logical = sum(1 for t in trees for c, p in t.edges() if not graph.has_edge(c, p))
    meta = {
        "trees": infos,
        "roots": [t.root for t in trees],
        "shares": [t.share for t in trees],
        "chunks": [1] * len(trees),
        "model_cct_s": float(times.max()) if len(times) else 0.0,
        "model_cct_kind": "static fair-share store-and-forward estimate (fs_linear_model)",
        "logical_tree_edges": logical,
        "avg_height": float(np.mean([t.height() for t in trees])),
        "avg_max_fanout": float(np.mean([d["max_fanout"] for d in infos])),
        "simple_bound_mbps": simple_bound(graph),
        **extra,
    }
    return trees_plan(scheme, nodes, length, trees, meta=meta)


# ---------------------------------------------------------------------------
# TOPOADOPT
# ---------------------------------------------------------------------------
def _subtree(par: dict, v: str) -> set:
    ch = defaultdict(list)
    for c, p in par.items():
        if p is not None:
            ch[p].append(c)
    out, stack = {v}, [v]
    while stack:
        u = stack.pop()
        for c in ch[u]:
            out.add(c)
            stack.append(c)
    return out


def _reroot(par: dict, new_root: str) -> dict:
    """Same edges, rooted at ``new_root`` (reverse the path to the old root)."""
    par = dict(par)
    prev, cur = None, new_root
    while cur is not None:
        nxt = par[cur]
        par[cur] = prev
        prev, cur = cur, nxt
    return par


def initial_trees(graph: nx.DiGraph, k: int) -> list[dict]:
    """TOPOADOPT start state: the ``k`` nodes with the largest total link capacity as
    aggregators, each with its latency-shortest-path tree over WAN links."""
    nodes = sorted(graph.nodes)
    capsum = {n: sum(graph[n][v]["rate_mbps"] for v in graph.successors(n)) for n in nodes}
    roots = sorted(nodes, key=lambda n: (-capsum[n], n))[:k]
    out = []
    for r in roots:
        pred = {r: None}
        _, paths = nx.single_source_dijkstra(graph, r, weight="delay_ms")
        for n, p in paths.items():
            if n != r:
                pred[n] = p[-2]
        out.append(pred)
    return out


def anneal_trees(graph: nx.DiGraph, S: float, k: int, iters: int, seed: int, t0_frac: float
                 ) -> tuple[list[dict], np.ndarray, dict]:
    """Simulated annealing over ``k`` rooted spanning trees of WAN links (TOPOADOPT's
    search): moves re-parent a random non-root node to another neighbour outside its
    subtree, or move a tree's root; cost = :func:`waterfill` time of
    :func:`fs_linear_model`; geometric cooling from ``t0_frac`` x initial cost to
    1e-3 of that; Metropolis acceptance.  Returns the best state, its shares and a
    trace."""
    rng = np.random.default_rng(seed)
    nodes = sorted(graph.nodes)
    nbrs = {n: sorted(set(graph.successors(n)) & set(graph.predecessors(n))) for n in nodes}
    cost = _fs_cost(graph, S)
    cur = initial_trees(graph, k)
    cur_c, cur_x = cost(cur)
    best, best_c, best_x = [dict(p) for p in cur], cur_c, cur_x
    T0 = t0_frac * cur_c if math.isfinite(cur_c) else 1.0
    accepted = 0
    for it in range(iters):
        temp = T0 * (1e-3 ** (it / max(iters - 1, 1)))
        move = _propose(cur, nodes, nbrs, rng)
        if move is None:
            continue
        i, new = move
        cand = cur[:i] + [new] + cur[i + 1:]
        c, x = cost(cand)
        if c <= cur_c or rng.random() < math.exp(-(c - cur_c) / max(temp, 1e-12)):
            cur, cur_c, cur_x = cand, c, x
            accepted += 1
            if c < best_c:
                best, best_c, best_x = [dict(p) for p in cand], c, x
    return best, best_x, {"initial_cost_s": float(cost(initial_trees(graph, k))[0]),
                          "best_cost_s": float(best_c), "accepted": accepted, "iters": iters}


def _fs_cost(graph: nx.DiGraph, S: float):
    """The annealing's cost of a state (a list of parent maps): the :func:`waterfill` time
    and shares of :func:`fs_linear_model`, specialised to trees of WAN links."""
    delay = {(a, b): d.get("delay_ms", 0.0) / 1e3 for a, b, d in graph.edges(data=True)}
    rate = {(a, b): float(d["rate_mbps"]) for a, b, d in graph.edges(data=True)}

    def cost(state):  # fs_linear_model specialised to trees of WAN links (hot loop)
        flows = defaultdict(int)
        for par in state:
            for c, p in par.items():
                if p is not None:
                    flows[(c, p)] += 1
                    flows[(p, c)] += 1
        A, C = np.empty(len(state)), np.empty(len(state))
        for i, par in enumerate(state):
            acc = {}
            for n0 in par:
                chain, n = [], n0
                while n not in acc:
                    p = par[n]
                    if p is None:
                        acc[n] = (0.0, 0.0, 0.0, 0.0)
                        break
                    chain.append(n)
                    n = p
                for c in reversed(chain):
                    p = par[c]
                    ua, uc, da, dc = acc[p]
                    acc[c] = (ua + delay[(c, p)], uc + 8.0 * flows[(c, p)] / (rate[(c, p)] * 1e6),
                              da + delay[(p, c)], dc + 8.0 * flows[(p, c)] / (rate[(p, c)] * 1e6))
            v = np.array(list(acc.values()))
            A[i] = v[:, 0].max() + v[:, 2].max()
            C[i] = v[:, 1].max() + v[:, 3].max()
        return waterfill(A, C, S)

    return cost


def _propose(cur: list[dict], nodes: list[str], nbrs: dict[str, list[str]], rng: np.random.Generator
             ) -> tuple[int, dict] | None:
    """One annealing move on a random tree i: move its root to a node that is not a root yet
    (probability 0.15), else re-parent a random non-root node to a neighbour outside its
    subtree.  Returns (i, the new parent map), or None when the drawn move is impossible."""
    i = int(rng.integers(len(cur)))
    par = cur[i]
    if rng.random() < 0.15:  # move this aggregator to a node that is not one yet
        roots = {next(n for n, p in t.items() if p is None) for t in cur}
        free = [n for n in nodes if n not in roots]
        if not free:
            return None
        new = _reroot(par, free[int(rng.integers(len(free)))])
    else:
        v = nodes[int(rng.integers(len(nodes)))]
        if par[v] is None:
            return None
        sub = _subtree(par, v)
        opts = [w for w in nbrs[v] if w not in sub and w != par[v]]
        if not opts:
            return None
        new = dict(par)
        new[v] = opts[int(rng.integers(len(opts)))]
    return i, new


@planner(
    "topoadopt", REFERENCES["topoadopt"],
    trees=Param(int, 4, "number of aggregators (tree roots)", ge=1),
    iters=Param(int, 3000, "simulated-annealing iterations", ge=0),
    t0=Param(float, 0.05, "initial temperature as a fraction of the initial cost", gt=0),
    seed=Param(int, 0, "random seed of the annealing"),
    active=ACTIVE,
)
def topoadopt(graph: nx.DiGraph, length: int, *, elem_bytes: int, trees: int = 4,
              iters: int = 3000, t0: float = 0.05, seed: int = 0, active=None) -> Plan:
    """TOPOADOPT-style (approximation): simulated annealing over aggregator trees and
    their parameter shares; unpipelined (one chunk per tree).  With ``active`` the trees
    span the group P only (CREW §V-A: ToA "extended to support the all reduce requirement
    of P"), annealed on :func:`group_view`."""
    start = time.perf_counter()
    check_graph(graph, "topoadopt", min_nodes=2)
    if active is not None:
        group = members(graph, active)
        sub = topoadopt(group_view(graph, group), length, elem_bytes=elem_bytes, trees=trees, iters=iters, t0=t0,
                        seed=seed)
        return widen(sub, sorted(graph.nodes), group)
    S = float(length * elem_bytes)
    k = min(trees, graph.number_of_nodes())
    parents, x, info = anneal_trees(graph, S, k, iters, seed, t0)
    return _finish("topoadopt", graph, length, elem_bytes, parents, x, {},
                   {"annealing": {**info, "search_s": time.perf_counter() - start}})


# ---------------------------------------------------------------------------
# PSLD
# ---------------------------------------------------------------------------
def star(nodes: list[str], root: str) -> dict:
    """Parameter server ``root``: every other node is its child (push, then pull)."""
    return {n: (None if n == root else root) for n in nodes}


def ps_pairwise_model(nodes: list[str], lat: dict, bw: dict) -> tuple[np.ndarray, np.ndarray]:
    """Per-PS cost on the pairwise model: ``A_j`` = worst push latency + worst pull
    latency, ``C_j`` = worst 1/bandwidth push + pull (s/byte)."""
    A, C = [], []
    for j in nodes:
        others = [w for w in nodes if w != j]
        A.append(max(lat[(w, j)] for w in others) + max(lat[(j, w)] for w in others))
        C.append(max(8 / (bw[(w, j)] * 1e6) for w in others) + max(8 / (bw[(j, w)] * 1e6) for w in others))
    return np.array(A), np.array(C)


@planner(
    "psld", REFERENCES["psld"],
    servers=Param(int, 0, "number of parameter servers; 0 = auto (exploration: the count with "
                  "the smallest fair-share estimate)", ge=0),
)
def psld(graph: nx.DiGraph, length: int, *, elem_bytes: int, servers: int = 0) -> Plan:
    """PSLD-style (approximation): multiple parameter servers (stars over latency-
    shortest routes) with load shares balanced on pairwise performance; unpipelined."""
    check_graph(graph, "psld", min_nodes=2)
    nodes = sorted(graph.nodes)
    S = float(length * elem_bytes)
    paths, lat, bw = pairwise_performance(graph)
    A, C = ps_pairwise_model(nodes, lat, bw)
    rank = sorted(range(len(nodes)), key=lambda j: (A[j] + S * C[j], nodes[j]))
    ks = [min(servers, len(nodes))] if servers > 0 else list(range(1, len(nodes) + 1))
    tried = []
    best = None
    for k in ks:
        sel = rank[:k]
        _, x = waterfill(A[sel], C[sel], S)                       # exploitation
        parents = [star(nodes, nodes[j]) for j in sel]
        fa, fc = fs_linear_model(graph, parents, paths)
        est = float(max(a + xi * S * c for a, c, xi in zip(fa, fc, x) if xi > 0))
        tried.append({"servers": k, "estimate_s": est})
        if best is None or est < best[0] - 1e-12:
            best = (est, parents, x, k)
    est, parents, x, k = best
    extra = {"servers": k, "exploration": tried,
             "pairwise_model": {"A_s": A.tolist(), "C_s_per_byte": C.tolist()}}
    return _finish("psld", graph, length, elem_bytes, parents, x, paths, extra)


# ---------------------------------------------------------------------------
# PLINK
# ---------------------------------------------------------------------------
def latency_groups(nodes: list[str], lat: dict, k: int) -> list[list[str]]:
    """Locality groups: complete-linkage clustering of the symmetrised pairwise
    latency into ``k`` groups (deterministic; groups sorted by first member)."""
    n = len(nodes)
    if k <= 1 or n <= 1:
        return [list(nodes)]
    D = np.zeros((n, n))
    for a in range(n):
        for b in range(n):
            if a != b:
                D[a, b] = 0.5 * (lat[(nodes[a], nodes[b])] + lat[(nodes[b], nodes[a])])
    Z = linkage(squareform(D, checks=False), method="complete")
    labels = fcluster(Z, t=min(k, n), criterion="maxclust")
    groups = defaultdict(list)
    for n_, l in zip(nodes, labels):
        groups[l].append(n_)
    return sorted(groups.values(), key=lambda g: g[0])


def group_leader(group: list[str], lat: dict, bw: dict, S: float) -> str:
    """The member that gathers its group fastest on the pairwise model."""
    if len(group) == 1:
        return group[0]
    return min(group, key=lambda j: (max(lat[(w, j)] + S * 8 / (bw[(w, j)] * 1e6)
                                         for w in group if w != j), j))


def plink_trees(nodes: list[str], groups: list[list[str]], leaders: list[str]) -> list[dict]:
    """One tree per leader L: L is the root, the other leaders its children, every
    member's parent is its own group's leader (2-level aggregation, sharded on leaders)."""
    out = []
    for L in leaders:
        par = {}
        for g, lead in zip(groups, leaders):
            for n in g:
                par[n] = lead if n != lead else (None if lead == L else L)
        out.append(par)
    return out


@planner(
    "plink", REFERENCES["plink"],
    groups=Param(int, 0, "number of locality groups; 0 = auto (the count in 2..ceil(sqrt(2n)) "
                 "with the smallest fair-share estimate)", ge=0),
    shard=Param(str, "balanced", "inter-group shares among leaders: 'balanced' (pairwise "
                "model) or 'equal'", ("balanced", "equal")),
)
def plink(graph: nx.DiGraph, length: int, *, elem_bytes: int, groups: int = 0,
          shard: str = "balanced") -> Plan:
    """PLINK-style (approximation): latency-locality groups aggregate at a leader, the
    leaders aggregate shards among themselves, results return down; unpipelined."""
    check_graph(graph, "plink", min_nodes=2)
    nodes = sorted(graph.nodes)
    S = float(length * elem_bytes)
    paths, lat, bw = pairwise_performance(graph)
    n = len(nodes)
    # auto: 2..ceil(sqrt(2n)) groups (two levels need >= 2 groups; one group = one PS)
    ks = [min(groups, n)] if groups > 0 else list(range(min(2, n), max(2, math.ceil(math.sqrt(2 * n))) + 1))
    tried, best = [], None
    for k in ks:
        grp = latency_groups(nodes, lat, k)
        leaders = [group_leader(g, lat, bw, S) for g in grp]
        parents = plink_trees(nodes, grp, leaders)
        if shard == "equal" or len(leaders) == 1:
            x = np.full(len(leaders), 1.0 / len(leaders))
        else:
            A, C = ps_pairwise_model(leaders, lat, bw)
            _, x = waterfill(A, C, S)
        fa, fc = fs_linear_model(graph, parents, paths)
        est = float(max(a + xi * S * c for a, c, xi in zip(fa, fc, x) if xi > 0))
        tried.append({"groups": len(grp), "estimate_s": est})
        if best is None or est < best[0] - 1e-12:
            best = (est, parents, x, grp, leaders)
    est, parents, x, grp, leaders = best
    extra = {"groups": grp, "leaders": leaders, "exploration": tried}
    return _finish("plink", graph, length, elem_bytes, parents, x, paths, extra)
