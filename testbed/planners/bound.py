"""The optimum every run is compared with: maximum fractional tree packing.

:func:`optimum` (the reported bound) packs reduce in-trees and broadcast out-trees that share
each link *direction's* capacity (:func:`pack_arborescences`), and reports the any-scheme cut
bound (:func:`cut_bound`) beside it.  On symmetric links that packing equals the undirected
spanning-tree packing below, which is solved instead (faster).  The undirected model below
(min of the two directions, one tree for reduce and broadcast) is MTREE's and BLINK's rate
model; their planners use it, but it is not an upper bound on asymmetric links
(crew-mesh-8, netstorm-internet2-9).

This module registers no scheme; it is the optimum (and the spanning-tree packings it is
built from, which :mod:`.blink` reuses) that the run reports and planners compare with.
The tree and graph helpers it uses live in :mod:`.common`.

Rate model (the one MTREE, Sec. III-B, MILP (1b), and BLINK use)
================================================================
The WAN is seen as an undirected graph.  A link {u, v} has the *tree capacity*
``b_uv = min(rate(u->v), rate(v->u))`` (Mbit/s): a spanning tree that carries
AllReduce at rate ``r`` reduces up the tree (child -> parent, ``r`` on that direction)
and broadcasts back down the same tree (parent -> child, ``r`` on the reverse
direction), so both directions of every tree link carry ``r``.  With full-duplex
links, the per-direction constraint is therefore ``sum of r over trees using {u,v} <=
b_uv`` -- the paper's (1b) with ``b_j`` read as a per-direction capacity (see the note
000-mtree.md Sec. 2.7).  The *AllReduce rate* of a multi-tree scheme is ``sum r``; every
node's vector of ``S`` bytes is split across trees in proportion to ``r``, so the
fluid transfer time is ``S * 8 / (sum r * 1e6)`` seconds.

:func:`pack_spanning_trees` solves ``max sum_T r_T  s.t.  sum_{T ∋ e} r_T <= b_e, r >= 0`` over all
spanning trees ``T`` by column generation (the LP has exponentially many columns): the
restricted master is solved with HiGHS (``scipy.optimize.linprog``), and the pricing
problem -- is there a tree whose dual price ``sum_{e in T} y_e`` is below 1? -- is a
minimum spanning tree under the duals ``y``.  By LP duality, ``y / MST_y(G)`` is dual
feasible, so ``master / MST_y`` is an upper bound at every iteration; we stop when it
meets the master value.  The LP value equals the Nash-Williams/Tutte fractional
packing number ``min_P (sum of b over links crossing partition P) / (|P| - 1)``.

The paper's simple bound (MTREE Sec. IV-A-3, "Throughput" metric) is ``sum_j b_j /
(|V| - 1)``: every spanning tree uses ``|V| - 1`` links, so summing (1b) over all links
gives ``sum r (|V| - 1) <= sum b``.  Here ``b_j`` is counted once per *undirected* link
(19/141/231 links for GScale/Equinix/IDN, note Sec. 5); counting directed edges would
double it.  The LP value is never above the simple bound.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from typing import Iterable, Mapping, Sequence

import networkx as nx
import numpy as np
from scipy.optimize import linprog

from testbed.planners.common import (
    INF,
    WanView,
    max_utilisation,
    parents_from_edges,
    tree_centre,
    tree_roundtrip_s,
    wan_view,
)


# ---------------------------------------------------------------------------
# Spanning trees.
# ---------------------------------------------------------------------------
def spanning_tree(n: int, edges: Sequence[tuple[int, int]], weight: np.ndarray, *,
                  maximize: bool = False, usable: np.ndarray | None = None) -> list[int] | None:
    """Minimum (or maximum) weight spanning tree by dense Prim; returns edge indices,
    or None if the usable edges do not connect all ``n`` nodes.  ``edges`` must be
    distinct unordered pairs (as in :class:`WanView`).  Deterministic (ties: lowest
    node index)."""
    if n <= 1:
        return []
    sign = -1.0 if maximize else 1.0
    ends = np.asarray(edges, dtype=int).reshape(-1, 2)
    ks = np.arange(len(ends))
    if usable is not None:
        ks = ks[np.asarray(usable, bool)]
    W = np.full((n, n), INF)
    E = np.full((n, n), -1, dtype=int)
    w = sign * np.asarray(weight, float)[ks]
    i, j = ends[ks, 0], ends[ks, 1]
    W[i, j] = w
    W[j, i] = w
    E[i, j] = ks
    E[j, i] = ks
    in_tree = np.zeros(n, bool)
    in_tree[0] = True
    best = W[0].copy()
    via = E[0].copy()
    out = []
    for _ in range(n - 1):
        cand = np.where(in_tree, INF, best)
        v = int(np.argmin(cand))
        if not np.isfinite(cand[v]):
            return None
        out.append(int(via[v]))
        in_tree[v] = True
        better = W[v] < best
        best = np.where(better, W[v], best)
        via = np.where(better, E[v], via)
    return out


# ---------------------------------------------------------------------------
# Bounds.
# ---------------------------------------------------------------------------
def simple_bound(graph: nx.DiGraph, nodes: Iterable[str] | None = None) -> float:
    """MTREE's normaliser (Sec. IV-A-3): ``sum_j b_j / (|V| - 1)`` over undirected links,
    ``b_j`` the tree capacity (min of the two directions) -- an upper bound on the total
    AllReduce rate of any spanning-tree packing."""
    wv = wan_view(graph, nodes)
    return float(wv.cap.sum() / (wv.n - 1)) if wv.n > 1 else INF


def _greedy_packing(wv: WanView) -> list[tuple[list[int], float]]:
    """Initial columns: repeatedly take a maximum-capacity spanning tree of the residual
    network at its bottleneck rate until the residual network disconnects."""
    res = wv.cap.copy()
    out = []
    eps = 1e-9 * max(1.0, float(wv.cap.max(initial=0.0)))
    while True:
        t = spanning_tree(wv.n, wv.edges, res, maximize=True, usable=res > eps)
        if t is None:
            return out
        r = float(res[t].min())
        out.append((t, r))
        res[t] -= r


def mwu_packing(wv: WanView, epsilon: float = 0.1, max_iter: int = 200000
                ) -> tuple[dict[tuple[int, ...], float], dict]:
    """Garg-Könemann multiplicative-weights fractional spanning-tree packing.

    Returns ``{tree (sorted link indices): rate}`` (feasible: every link's total <= its
    capacity) and info (iterations, packed total)."""
    m = wv.m
    if wv.n <= 1 or m == 0:
        return {}, {"iterations": 0, "total": 0.0}
    eps = float(epsilon)
    b = wv.cap.astype(float)
    delta = (1 + eps) / ((1 + eps) * m) ** (1 / eps)
    length = delta / b
    flow: dict[tuple[int, ...], float] = {}
    it = 0
    while float(b @ length) < 1.0 and it < max_iter:
        it += 1
        t = spanning_tree(wv.n, wv.edges, length)
        if t is None:
            break
        c = float(b[t].min())
        key = tuple(sorted(t))
        flow[key] = flow.get(key, 0.0) + c
        length[t] *= 1.0 + eps * c / b[t]
    scale = math.log((1 + eps) / delta, 1 + eps)
    flow = {k: v / scale for k, v in flow.items()}
    load = np.zeros(m)
    for k, v in flow.items():
        load[list(k)] += v
    over = float((load / b).max(initial=0.0))
    if over > 1.0:  # numerical safety; theory guarantees feasibility
        flow = {k: v / over for k, v in flow.items()}
    return flow, {"iterations": it, "total": float(sum(flow.values())), "epsilon": eps}


def pack_spanning_trees(wv: WanView, *, tol: float = 1e-7, max_iter: int = 20000,
                        warm_start: bool = True) -> tuple[float, list[tuple[list[int], float]], dict]:
    """Maximum fractional spanning-tree packing by column generation.

    Solves ``max sum r_T  s.t.  A r <= cap`` (A: link x tree incidence) over all
    spanning trees; pricing = minimum spanning tree under the LP duals.  The first
    columns come from a greedy bottleneck packing and (``warm_start``) the trees of a
    coarse :func:`mwu_packing`.  Returns the
    LP value, the trees with positive rate (edge indices, rate) and solver info
    (iterations, columns, final upper bound, status).
    """
    if wv.n <= 1:
        return INF, [], {"status": "trivial"}
    cols = [t for t, _ in _greedy_packing(wv)]
    if not cols:
        return 0.0, [], {"status": "disconnected", "iterations": 0}
    seen = {tuple(sorted(t)) for t in cols}
    if warm_start:  # a coarse multiplicative-weights packing: many good columns at once
        for key in mwu_packing(wv, 0.3)[0]:
            if key not in seen:
                seen.add(key)
                cols.append(list(key))
    value, ub, it, r = 0.0, INF, 0, np.zeros(0)
    status = "iteration limit"
    for it in range(1, max_iter + 1):
        A = np.zeros((wv.m, len(cols)))
        for c, t in enumerate(cols):
            A[t, c] = 1.0
        res = linprog(-np.ones(len(cols)), A_ub=A, b_ub=wv.cap, bounds=(0, None), method="highs")
        if res.status != 0:
            status = f"linprog failed: {res.message}"
            break
        value, r = -float(res.fun), res.x
        y = np.maximum(-res.ineqlin.marginals, 0.0)
        t = spanning_tree(wv.n, wv.edges, y)
        w = float(y[t].sum())
        if w > 0:
            ub = min(ub, value / w)
        if w >= 1.0 - 1e-12 or ub - value <= tol * max(value, 1.0):
            status = "optimal"
            break
        key = tuple(sorted(t))
        if key in seen:  # degenerate duals: cannot improve further by this column
            status = "optimal (degenerate pricing)"
            break
        seen.add(key)
        cols.append(t)
    used = [(sorted(cols[c]), float(r[c])) for c in range(len(cols)) if r[c] > 1e-9]
    return value, used, {"status": status, "iterations": it, "columns": len(cols),
                         "upper_bound": float(ub) if math.isfinite(ub) else None}


# ---------------------------------------------------------------------------
# Directed capacities: reduce in-trees and broadcast out-trees (the optimum reported).
# ---------------------------------------------------------------------------
def is_symmetric(graph: nx.DiGraph, nodes: Iterable[str] | None = None) -> bool:
    """True if every link of the (induced) WAN exists in both directions at the same rate."""
    g = graph if nodes is None else graph.subgraph(nodes)
    return all(g.has_edge(v, u) and float(d["rate_mbps"]) == float(g[v][u]["rate_mbps"])
               for u, v, d in g.edges(data=True))


def _min_arborescence(arcs: nx.DiGraph, root, inward: bool) -> list[tuple]:
    """Cheapest spanning arborescence (Edmonds, networkx) of ``arcs`` (weight ``y``) rooted at
    ``root``: out-tree (root -> all), or ``inward`` in-tree (all -> root); a list of arcs."""
    g = arcs.reverse(copy=True) if inward else arcs.copy()
    g.remove_edges_from(list(g.in_edges(root)))  # the only node without an in-arc: the root
    t = nx.minimum_spanning_arborescence(g, attr="y", preserve_attrs=False)
    return [(v, u) for u, v in t.edges] if inward else list(t.edges)


def pack_arborescences(graph: nx.DiGraph, nodes: Iterable[str] | None = None, *,  # noqa: C901 -- column generation: the master LP and the pricing loop share their state
                       tol: float = 1e-7, max_iter: int = 2000) -> tuple[float, list[dict], dict]:
    """Maximum AllReduce rate with per-direction capacities, by column generation.

    Every block of the vector is reduced along an in-arborescence to a root ``r`` (children
    send to parents) and broadcast from ``r`` along an out-arborescence; the two trees may
    differ and share each direction's capacity with all other trees::

        max sum_r z_r   s.t.  sum_{in-trees T of r} x_T = sum_{out-trees T of r} y_T = z_r,
                              sum over trees using arc a of x_T + y_T <= c(a)  for each direction a.

    This contains every scheme that moves a block towards a root with aggregation at nodes
    and then distributes it (ring, PS, all-to-all, k-ary / spanning / Steiner trees and
    packings of them, MultiTree, ...): a logical tree edge routed over several links uses
    at least the arcs of an arborescence.  Pricing: for each root, the cheapest in- and
    out-arborescence under the arc duals (Edmonds' algorithm); if every root's pair costs
    at least ``beta`` > 0, the duals / beta are dual feasible, so master / beta bounds the
    optimum from above; stop when it meets the master value.  With symmetric links this
    equals :func:`pack_spanning_trees` (both meet the partition bound).

    Returns (value, pairs ``[{root, reduce: [(child, parent)], broadcast: [(parent,
    child)], rate_mbps}]``, solver info).
    """
    g = nx.DiGraph(graph if nodes is None else graph.subgraph(nodes))
    names = sorted(g.nodes)
    if len(names) <= 1:
        return INF, [], {"status": "trivial"}
    if not nx.is_strongly_connected(g):
        return 0.0, [], {"status": "disconnected", "iterations": 0}
    arcs = sorted(g.edges)
    aidx = {a: k for k, a in enumerate(arcs)}
    cap = np.array([float(g[u][v]["rate_mbps"]) for u, v in arcs])
    ridx = {r: i for i, r in enumerate(names)}
    cols: list[tuple[str, bool, tuple]] = []  # (root, inward, arcs)
    seen: set = set()

    def add(root, inward, tree) -> bool:
        key = (root, inward, tuple(sorted(tree)))
        if key in seen:
            return False
        seen.add(key)
        cols.append(key)
        return True

    for r in names:  # first columns: hop-shortest trees towards and from every root
        for inward in (True, False):
            for u, v in g.edges:
                g[u][v]["y"] = 1.0
            add(r, inward, _min_arborescence(g, r, inward))
    value, it, x = 0.0, 0, np.zeros(0)
    ub = cut_bound(g)[0]  # no packing beats the smallest directed cut: stop once it is met
    status = "iteration limit"
    for it in range(1, max_iter + 1):
        A = np.zeros((len(arcs), len(cols)))
        B = np.zeros((len(names), len(cols)))
        obj = np.zeros(len(cols))
        for c, (r, inward, tree) in enumerate(cols):
            A[[aidx[a] for a in tree], c] = 1.0
            B[ridx[r], c] = 1.0 if inward else -1.0
            obj[c] = -1.0 if inward else 0.0
        res = linprog(obj, A_ub=A, b_ub=cap, A_eq=B, b_eq=np.zeros(len(names)), bounds=(0, None),
                      method="highs")
        if res.status != 0:
            status = f"linprog failed: {res.message}"
            break
        value, x = -float(res.fun), res.x
        if ub - value <= tol * max(value, 1.0):
            status = "optimal (meets the cut bound)"
            break
        y = np.maximum(-res.ineqlin.marginals, 0.0)
        for (u, v), k in aidx.items():
            g[u][v]["y"] = float(y[k])
        beta, added = INF, 0
        for r in names:
            t_in, t_out = _min_arborescence(g, r, True), _min_arborescence(g, r, False)
            cost = sum(y[aidx[a]] for a in t_in) + sum(y[aidx[a]] for a in t_out)
            beta = min(beta, cost)
            if cost < 1.0 - 1e-9:
                added += add(r, True, t_in) + add(r, False, t_out)
        if beta > 0:
            ub = min(ub, value / beta)
        if beta >= 1.0 - 1e-9 or ub - value <= tol * max(value, 1.0):
            status = "optimal"
            break
        if not added:  # degenerate duals: the priced columns are already in the master
            status = "optimal (degenerate pricing)"
            break
    pairs = []
    for r in names:  # pair each root's in-trees with its out-trees (equal totals)
        ins = [[cols[c][2], x[c]] for c in range(len(cols)) if cols[c][:2] == (r, True) and x[c] > 1e-9]
        outs = [[cols[c][2], x[c]] for c in range(len(cols)) if cols[c][:2] == (r, False) and x[c] > 1e-9]
        while ins and outs:
            rate = min(ins[0][1], outs[0][1])
            pairs.append({"root": r, "reduce": list(ins[0][0]), "broadcast": list(outs[0][0]),
                          "rate_mbps": float(rate)})
            for side in (ins, outs):
                side[0][1] -= rate
                if side[0][1] <= 1e-9:
                    side.pop(0)
    return value, pairs, {"status": status, "iterations": it, "columns": len(cols),
                          "upper_bound": float(ub) if math.isfinite(ub) else None}


def cut_bound(graph: nx.DiGraph, nodes: Iterable[str] | None = None) -> tuple[float, dict]:
    """An upper bound on the AllReduce rate of *any* scheme: for every split of the nodes
    into X and the rest, each element's result outside X depends on the inputs in X and vice
    versa, so at least ``S`` bytes cross the cut in each direction; the rate is at most the
    smallest directed cut capacity (singletons: each node's egress and ingress).  Global
    minimum directed cut by max-flow from/to one node (networkx).  Returns (rate, {"from":
    X, "to": rest})."""
    g = nx.DiGraph(graph if nodes is None else graph.subgraph(nodes))
    names = sorted(g.nodes)
    if len(names) <= 1:
        return INF, {}
    for u, v, d in g.edges(data=True):
        d["capacity"] = float(d["rate_mbps"])
    best, cut = INF, {}
    s = names[0]
    for t in names[1:]:
        for a, b in ((s, t), (t, s)):
            val, (side, rest) = nx.minimum_cut(g, a, b)
            if val < best:
                best, cut = float(val), {"from": sorted(side), "to": sorted(rest)}
    return best, cut


def _pair_roundtrip_s(graph: nx.DiGraph, reduce_parent: Mapping, broadcast_parent: Mapping) -> float:
    """Largest leaf->root delay of the reduce tree plus largest root->leaf delay of the
    broadcast tree (seconds; both trees as node -> parent maps)."""

    def depth(parent: Mapping, outward: bool) -> float:
        memo: dict = {}

        def d(n) -> float:
            if n not in memo:
                p = parent[n]
                a, b = (p, n) if outward else (n, p)
                memo[n] = 0.0 if p is None else d(p) + float(graph[a][b].get("delay_ms", 0.0)) / 1e3
            return memo[n]

        return max(d(n) for n in parent)

    return depth(reduce_parent, False) + depth(broadcast_parent, True)


def optimum(graph: nx.DiGraph, size_bytes: float, *, nodes: Iterable[str] | None = None,
            tol: float = 1e-7) -> dict:
    """The AllReduce-rate optimum every run is compared with, valid for directed capacities.

    Parameters
    ----------
    graph : the WAN (directed edges with ``rate_mbps``, ``delay_ms``).
    size_bytes : bytes per node (``S``).
    nodes : restrict to these nodes (trees of the *induced* subgraph; relays outside
        ``nodes`` are not used, so this is not a Steiner-tree bound).

    The rate is the best packing of reduce in-trees and broadcast out-trees sharing each
    direction's capacity (:func:`pack_arborescences`).  When every link has the same rate
    both ways this is the spanning-tree packing with each tree used both ways
    (:func:`pack_spanning_trees`, faster; the two LPs have the same value), so that is solved
    instead.  ``cut_rate_mbps`` (:func:`cut_bound`) bounds every AllReduce scheme, tree or
    not, and is never below ``rate_mbps``.

    Returns
    -------
    dict with
      ``rate_mbps``: the packing optimum; ``method``: which LP was solved;
      ``cut_rate_mbps``, ``cut``: the any-scheme bound and the cut attaining it;
      ``simple_rate_mbps``: MTREE's ``sum b / (n - 1)`` (b = min of the two directions; only
      a bound for symmetric links); ``normalised``: rate_mbps / simple_rate_mbps;
      ``transfer_s``: ``S * 8 / (rate_mbps * 1e6)``, the fluid transfer time -- a strict lower
      bound for every scheme in the model;
      ``latency_s``: the smallest reduce+broadcast round trip (largest leaf->root delay
      plus largest root->leaf delay) among the packing's trees -- the pipeline-fill time of
      the best tree, not a strict lower bound; ``cct_s`` = transfer_s + latency_s;
      ``trees``: [{root, parent (reduce), broadcast_parent, rate_mbps, roundtrip_s}];
      ``max_utilisation``: check value (<= 1 + tol); ``solver``; ``planner_s``: wall time;
      ``model`` and ``assumes``: what the bound is and what it assumes (for results.json).
    """
    t0 = time.perf_counter()
    names = sorted(graph.nodes if nodes is None else nodes)
    trees = []
    if is_symmetric(graph, names):
        wv = wan_view(graph, names)
        value, used, info = pack_spanning_trees(wv, tol=tol)
        method = "spanning-tree packing (symmetric links: equal to the directed packing)"
        for edges, rate in used:
            pairs = [wv.names(k) for k in edges]
            root = tree_centre(graph, wv.nodes, pairs)
            parent = parents_from_edges(wv.nodes, pairs, root)
            trees.append({"root": root, "parent": parent, "broadcast_parent": parent,
                          "rate_mbps": rate, "roundtrip_s": tree_roundtrip_s(graph, parent)})
    else:
        value, pairs, info = pack_arborescences(graph, names, tol=tol)
        method = "reduce in-tree / broadcast out-tree packing (directed capacities)"
        for p in pairs:
            up = {**{c: q for c, q in p["reduce"]}, p["root"]: None}
            down = {**{c: q for q, c in p["broadcast"]}, p["root"]: None}
            trees.append({"root": p["root"], "parent": up, "broadcast_parent": down,
                          "rate_mbps": p["rate_mbps"], "roundtrip_s": _pair_roundtrip_s(graph, up, down)})
    loads: dict[tuple[str, str], float] = defaultdict(float)
    for t in trees:
        for c, p in t["parent"].items():
            if p is not None:
                loads[(c, p)] += t["rate_mbps"]
        for c, p in t["broadcast_parent"].items():
            if p is not None:
                loads[(p, c)] += t["rate_mbps"]
    cut_rate, cut = cut_bound(graph, names)
    simple = simple_bound(graph, names)
    transfer = size_bytes * 8 / (value * 1e6) if value > 0 else INF
    latency = min((t["roundtrip_s"] for t in trees), default=INF if len(names) > 1 else 0.0)
    return {
        "rate_mbps": value,
        "method": method,
        "cut_rate_mbps": cut_rate,
        "cut": cut,
        "simple_rate_mbps": simple,
        "normalised": value / simple if simple and math.isfinite(simple) else float("nan"),
        "transfer_s": transfer,
        "latency_s": latency,
        "cct_s": transfer + latency,
        "trees": trees,
        "max_utilisation": max_utilisation(graph, loads),
        "solver": info,
        "planner_s": time.perf_counter() - t0,
        "model": "best packing of reduce in-trees and broadcast out-trees (each block reduced "
                 "to a root with aggregation at nodes, then broadcast), sharing each link "
                 "direction's rate_mbps; cct_s = S*8/rate + the best tree's round-trip delay",
        "assumes": "full-duplex links with independent per-direction rates; fluid transfers "
                   "(no TCP, header or compute overhead); every scheme that reduces blocks "
                   "along trees and broadcasts them (all shipped AllReduce schemes) is inside "
                   "the model; cut_rate_mbps bounds any scheme; latency_s is the best tree's "
                   "pipeline fill, not a strict lower bound",
    }
