"""The optimum every run is compared with: maximum fractional spanning-tree packing.

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

:func:`optimum` solves ``max sum_T r_T  s.t.  sum_{T ∋ e} r_T <= b_e, r >= 0`` over all
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
from typing import Iterable, Sequence

import networkx as nx
import numpy as np
from scipy.optimize import linprog

from testbed.plan import Tree
from testbed.planners.common import (INF, WanView, max_utilisation, parents_from_edges, tree_centre,
                                     tree_link_loads, tree_roundtrip_s, wan_view)


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
                         "upper_bound": ub if math.isfinite(ub) else None}


def optimum(graph: nx.DiGraph, size_bytes: float, *, nodes: Iterable[str] | None = None,
            tol: float = 1e-7) -> dict:
    """Best AllReduce rate of any fractional spanning-tree packing, and the CCT it implies.

    Parameters
    ----------
    graph : the WAN (directed edges with ``rate_mbps``, ``delay_ms``).
    size_bytes : bytes per node (``S``).
    nodes : restrict to these nodes (spanning trees of the *induced* subgraph; relays
        outside ``nodes`` are not used, so this is not a Steiner-tree bound).

    Returns
    -------
    dict with
      ``rate_mbps``: the LP optimum ``sum r`` (module docstring);
      ``simple_rate_mbps``: MTREE's ``sum b / (n - 1)``;
      ``normalised``: rate_mbps / simple_rate_mbps;
      ``transfer_s``: ``S * 8 / (rate_mbps * 1e6)``, the fluid transfer time;
      ``latency_s``: the smallest reduce+broadcast round trip (largest leaf->root delay
      plus largest root->leaf delay) among the packing's trees, each rooted at its
      latency centre -- i.e. 2 x the best tree's delay-weighted height for symmetric
      delays.  This is the pipeline-fill time of the best tree, not a strict lower bound;
      ``cct_s`` = transfer_s + latency_s;
      ``trees``: [{root, parent, rate_mbps, roundtrip_s}] of the packing;
      ``max_utilisation``: check value (<= 1 + tol); ``solver``: column-generation info;
      ``planner_s``: wall time.
    """
    t0 = time.perf_counter()
    wv = wan_view(graph, nodes)
    value, used, info = pack_spanning_trees(wv, tol=tol)
    trees = []
    for edges, rate in used:
        pairs = [wv.names(k) for k in edges]
        root = tree_centre(graph, wv.nodes, pairs)
        parent = parents_from_edges(wv.nodes, pairs, root)
        trees.append({"root": root, "parent": parent, "rate_mbps": rate,
                      "roundtrip_s": tree_roundtrip_s(graph, parent)})
    loads = tree_link_loads(graph, [Tree(t["root"], t["parent"], rate_mbps=t["rate_mbps"])
                                    for t in trees])
    simple = simple_bound(graph, nodes)
    transfer = size_bytes * 8 / (value * 1e6) if value > 0 else INF
    latency = min((t["roundtrip_s"] for t in trees), default=INF if wv.n > 1 else 0.0)
    return {
        "rate_mbps": value,
        "simple_rate_mbps": simple,
        "normalised": value / simple if simple and math.isfinite(simple) else float("nan"),
        "transfer_s": transfer,
        "latency_s": latency,
        "cct_s": transfer + latency,
        "trees": trees,
        "max_utilisation": max_utilisation(graph, loads),
        "solver": info,
        "planner_s": time.perf_counter() - t0,
        "model": "fractional spanning-tree packing; each tree uses its rate on both "
                 "directions of its links (reduce up, broadcast down); b = min of directions",
    }
