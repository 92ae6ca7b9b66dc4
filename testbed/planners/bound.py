"""The optimum every run is compared with: maximum fractional tree packing.

:func:`optimum` packs reduce in-trees and broadcast out-trees that share each link
*direction's* capacity (:func:`pack_arborescences`) and reports two things apart: the
**strict bound** -- ``rate_mbps``, an upper bound on that packing's rate (the packing optimum
where a packing proves it, else the least of the smallest directed cut :func:`cut_bound`,
the node ingress/egress bound :func:`degree_bound` and column generation's dual bound), and
``transfer_s``, the fluid transfer time at that rate, below every scheme's CCT in the model;
efficiency divides by it -- and the packing's **estimate** ``estimate_cct_s`` (its transfer
time plus its best tree's round-trip delay), which a scheme may beat.  The undirected model
below (min of the two directions, one tree for reduce and broadcast) is MTREE's and
BLINK's rate model; their planners use it, but it is not an upper bound on asymmetric links
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
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, linprog, milp
from scipy.sparse.csgraph import breadth_first_order, maximum_flow

from testbed.planners.common import INF, WanView, max_utilisation, min_arborescence, wan_view


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


def capacity_matrix(graph: nx.DiGraph, names: Sequence[str]) -> np.ndarray:
    """``C[i, j]``: rate (Mbit/s) of the link direction ``names[i] -> names[j]`` (0: none)."""
    idx = {x: i for i, x in enumerate(names)}
    C = np.zeros((len(names), len(names)))
    for u, v, d in graph.subgraph(names).edges(data=True):
        C[idx[u], idx[v]] = float(d["rate_mbps"])
    return C


def degree_bound(C: np.ndarray) -> float:
    """An upper bound on the packing rate from each node's ingress and egress (a small LP).

    Every out-tree not rooted at ``v`` enters ``v`` by exactly one arc, and every in-tree not
    rooted at ``v`` leaves it by exactly one; the other arcs of a tree at ``v`` (in-tree arcs
    into it, out-tree arcs out of it) add up over all nodes to ``(n - 1) Z`` per side.  So with
    root rates ``z`` (``Z = sum z``) and ``a_v``, ``b_v`` those other loads:
    ``Z - z_v + a_v <= in(v)``, ``Z - z_v + b_v <= out(v)``, ``sum a = sum b = (n - 1) Z``.
    Summed, this is the counting bound ``sum c / (2 (n - 1))``.  On full meshes it is the
    optimum (CREW's meshes of 8-20 nodes, exactly; 60 nodes within the packing's gap)."""
    n = len(C)
    if n <= 1:
        return INF
    ing, egr = C.sum(0), C.sum(1)
    eye = sparse.identity(n, format="csr")
    ones = sparse.csr_matrix(np.ones((n, n)))
    zero = sparse.csr_matrix((n, n))
    A = sparse.vstack([sparse.hstack([ones - eye, eye, zero]), sparse.hstack([ones - eye, zero, eye])])
    row = np.concatenate([np.full(n, -(n - 1.0)), np.ones(n), np.zeros(n)])
    Aeq = np.vstack([row, np.concatenate([np.full(n, -(n - 1.0)), np.zeros(n), np.ones(n)])])
    res = linprog(np.concatenate([-np.ones(n), np.zeros(2 * n)]), A_ub=A.tocsr(), b_ub=np.concatenate([ing, egr]),
                  A_eq=Aeq, b_eq=np.zeros(2), bounds=(0, None), method="highs")
    if res.status != 0:
        return float(C.sum() / (2 * (n - 1)))  # the counting bound: the LP's sum
    return -float(res.fun)


def _widest_arborescence(C: np.ndarray, root: int) -> tuple[np.ndarray | None, float]:
    """Out-arborescence of ``root`` with the largest bottleneck capacity (the widest-path
    tree, Prim-like): (parent array, parent[root] = -1, bottleneck) or (None, 0)."""
    n = len(C)
    width = C[root].astype(float).copy()
    width[root] = INF
    parent = np.full(n, root)
    parent[root] = -1
    done = np.zeros(n, bool)
    done[root] = True
    for _ in range(n - 1):
        cand = np.where(done, -1.0, width)
        v = int(cand.argmax())
        if cand[v] <= 0:
            return None, 0.0
        done[v] = True
        w = np.minimum(width[v], C[v])
        better = (w > width) & ~done
        width[better] = w[better]
        parent[better] = v
    return parent, float(width[np.arange(n) != root].min(initial=INF))


def greedy_pairs(C: np.ndarray, step: float = 0.5) -> list[tuple[int, np.ndarray, np.ndarray, float]]:
    """A feasible packing of (out-tree, in-tree) pairs, greedily: roots in turn take their
    widest out- and in-arborescence of the residual capacities at ``step`` times the pair's
    bottleneck (the whole bottleneck once that is small), until no root has a pair left.
    Returns [(root, out parent array, in parent array (in the reversed graph), rate)].
    Taking half the bottleneck keeps the residual network connected longer: on CREW's
    60-node mesh it packs 99.999 % of :func:`degree_bound` (the whole bottleneck: 94 %)."""
    n = len(C)
    R = C.astype(float).copy()
    tiny, floor = 1e-9 * float(C.max(initial=0.0)), 1e-3 * float(C.max(initial=0.0))
    out, active, steps = [], list(range(n)), 0
    others = [np.flatnonzero(np.arange(n) != r) for r in range(n)]
    while active and steps < 4 * max(1, int((C > 0).sum())):
        still = []
        for r in active:
            po, _ = _widest_arborescence(R, r)
            pi, _ = _widest_arborescence(R.T, r) if po is not None else (None, 0.0)
            if pi is None:
                continue
            ch = others[r]
            use = np.zeros_like(R)
            np.add.at(use, (po[ch], ch), 1.0)
            np.add.at(use, (ch, pi[ch]), 1.0)
            rate = float((R[use > 0] / use[use > 0]).min())
            if rate <= tiny:
                continue
            rate = rate * step if rate * step > floor else rate
            R -= rate * use
            out.append((r, po, pi, rate))
            still.append(r)
            steps += 1
        active = still
    return out


def pack_arborescences(graph: nx.DiGraph, nodes: Iterable[str] | None = None, *,
                       tol: float = 1e-4, max_pricing: int = 1000, max_master_nonzeros: int = 20000,
                       max_height: int | None = None) -> tuple[float, list[dict], dict]:
    """The best AllReduce rate with per-direction capacities: a packing and an upper bound.

    Every block of the vector is reduced along an in-arborescence to a root ``r`` (children
    send to parents) and broadcast from ``r`` along an out-arborescence; the two trees may
    differ and share each direction's capacity with all other trees::

        max sum_r z_r   s.t.  sum_{in-trees T of r} x_T = sum_{out-trees T of r} y_T = z_r,
                              sum over trees using arc a of x_T + y_T <= c(a)  for each direction a.

    This contains every scheme that moves a block towards a root with aggregation at nodes
    and then distributes it (ring, PS, all-to-all, k-ary / spanning / Steiner trees and
    packings of them, MultiTree, ...): a logical tree edge routed over several links uses
    at least the arcs of an arborescence.

    Solved from both sides.  Upper bounds (valid whenever they are computed): the smallest
    directed cut (:func:`cut_bound`), :func:`degree_bound`, and column generation's dual
    (Farley) bound ``master / beta``, ``beta`` the cheapest in- plus out-arborescence of any
    root under the arc duals (Edmonds' algorithm, :func:`.common.min_arborescence`).
    Packing: :func:`greedy_pairs`; if that is more than ``tol`` (relative) below the best
    upper bound, the restricted master LP (HiGHS) over its trees, improved by column
    generation while the gap exceeds ``tol`` and fewer than ``max_pricing`` arborescences
    have been priced (2 per node and round).  The master is skipped when it would have more
    than ``max_master_nonzeros`` tree-arc entries: this LP is highly degenerate and HiGHS's
    time grows steeply with it (CREW meshes, greedy's columns: 0.7 s at 20 nodes, 9 s at 30,
    90 s at 40, 490 s at 60).  Both budgets count work, not seconds, so the result does not
    depend on the machine's speed; a stopped search keeps every bound valid and reports
    its gap.

    With ``max_height`` every tree of the packing is at most that many hops deep (roots
    farther than that from some node take no pairs); pricing is then the cheapest
    arborescence of bounded depth (:func:`bounded_arborescence`), the greedy packing only
    seeds the master with its trees that are low enough, and the upper bounds are those of
    the height-bounded packing (below the problem's own).

    Returns (packing rate, pairs ``[{root, reduce: [(child, parent)], broadcast: [(parent,
    child)], rate_mbps}]``, info): info has ``upper_bound`` (the least upper bound),
    ``bound`` (which one: "cut", "degree" or "dual"), the bounds, ``gap`` (1 - packing /
    upper bound), ``status`` ("optimal" when the gap is within ``tol``), rounds, columns.
    """
    g = nx.DiGraph(graph if nodes is None else graph.subgraph(nodes))
    names = sorted(g.nodes)
    if len(names) <= 1:
        return INF, [], {"status": "trivial", "upper_bound": None, "bound": None, "gap": 0.0}
    if not nx.is_strongly_connected(g):
        return 0.0, [], {"status": "disconnected", "upper_bound": 0.0, "bound": "cut", "gap": 0.0,
                         "bounds": {"cut": 0.0}, "cut": {}}
    return _pack(g, names, tol, max_pricing, max_master_nonzeros, max_height)


def bounded_arborescence(n: int, U: np.ndarray, V: np.ndarray, cost: np.ndarray, root: int, height: int
                         ) -> np.ndarray | None:
    """The cheapest out-arborescence of ``root`` over the arcs ``U[k] -> V[k]`` (costs
    ``cost``) in which every node is at most ``height`` hops from the root: a parent array
    (``parent[root] = -1``), or None if some node is farther.  Exact, as a layered integer
    program (HiGHS, ``scipy.optimize.milp``): ``x[k, h]`` = arc ``k`` enters its head at
    depth ``h``; every other node is entered once, and an arc leaves its tail at depth
    ``h - 1`` only if the tail was entered at that depth."""
    m, H = len(U), int(height)
    ub = np.ones((m, H))
    ub[V == root] = 0
    ub[U == root, 1:] = 0
    ub[U != root, 0] = 0
    var = np.arange(m * H).reshape(m, H)
    enter = [np.flatnonzero(V == v) for v in range(n)]
    rows, cols, vals, hi = [], [], [], []
    for v in (v for v in range(n) if v != root):  # entered exactly once
        rows += [len(hi)] * (len(enter[v]) * H)
        cols += var[enter[v]].ravel().tolist()
        vals += [1.0] * (len(enter[v]) * H)
        hi.append(1.0)
    once = len(hi)
    for k in np.flatnonzero(U != root):  # leaves its tail at depth h - 1 only from there
        for h in range(1, H):
            rows += [len(hi)] * (1 + len(enter[U[k]]))
            cols += [int(var[k, h])] + var[enter[U[k]], h - 1].tolist()
            vals += [1.0] + [-1.0] * len(enter[U[k]])
            hi.append(0.0)
    A = sparse.csr_matrix((vals, (rows, cols)), shape=(len(hi), m * H))
    lo = np.concatenate([np.ones(once), np.full(len(hi) - once, -np.inf)])
    res = milp(np.repeat(np.asarray(cost, float), H), constraints=LinearConstraint(A, lo, hi),
               integrality=np.ones(m * H), bounds=Bounds(0, ub.ravel()))
    if res.status != 0:
        return None
    used = res.x.reshape(m, H).sum(1) > 0.5
    parent = np.full(n, -1)
    parent[V[used]] = U[used]
    return parent


def tree_height(parent: np.ndarray, root: int) -> int:
    """Hops from the farthest node to ``root`` in a parent array."""
    depth = np.zeros(len(parent), int)
    for v in range(len(parent)):
        x = v
        while x != root and depth[v] <= len(parent):
            x, depth[v] = parent[x], depth[v] + 1
    return int(depth.max(initial=0))


class _Columns:
    """The master LP's columns, each arborescence once: (root, inward, sorted arc ids),
    arcs numbered in the order of ``U, V`` (the nonzero capacities); with ``height``, only
    trees at most that deep."""

    def __init__(self, n: int, U: np.ndarray, V: np.ndarray, height: int | None = None):
        self.n = n
        self.height = height
        self.arc_id = np.full((n, n), -1)
        self.arc_id[U, V] = np.arange(len(U))
        self.cols: list[tuple[int, bool, tuple]] = []  # (root, inward, sorted arc ids)
        self.seen: set = set()

    def add(self, r: int, inward: bool, parent) -> bool:
        """Add root r's in-tree (``inward``) or out-tree given by its parent array; False
        if it is a column already or too deep."""
        if self.height is not None and tree_height(parent, r) > self.height:
            return False
        ch = np.flatnonzero(np.arange(self.n) != r)
        ids = self.arc_id[ch, parent[ch]] if inward else self.arc_id[parent[ch], ch]
        key = (r, inward, tuple(sorted(int(k) for k in ids)))
        if key in self.seen:
            return False
        self.seen.add(key)
        self.cols.append(key)
        return True


def _pack(g: nx.DiGraph, names: list[str], tol: float, max_pricing: int, max_master_nonzeros: int,
          max_height: int | None = None) -> tuple[float, list[dict], dict]:
    """:func:`pack_arborescences` on a strongly connected graph of two or more nodes: the
    upper bounds, :func:`greedy_pairs`' packing and, unless that is within ``tol`` of the
    bounds or the master would be too large, the master LP over its trees and the
    hop-shortest ones, improved by column generation (trees at most ``max_height`` deep
    if given)."""
    n = len(names)
    C = capacity_matrix(g, names)
    U, V = np.nonzero(C)
    cols = _Columns(n, U, V, max_height)
    cut_rate, cut = cut_bound(g)
    bounds = {"cut": cut_rate, "degree": degree_bound(C)}
    greedy = greedy_pairs(C)
    for r, po, pi, _ in greedy:
        cols.add(r, False, po)
        cols.add(r, True, pi)
    greedy_rate = sum(t[3] for t in greedy)
    if max_height is None and (min(bounds.values()) - greedy_rate <= tol * min(bounds.values())
                               or len(cols.cols) * (n - 1) > max_master_nonzeros):
        return _greedy_result(names, greedy, bounds, tol, len(cols.cols), cut)
    hops = sparse.csr_matrix(C > 0, dtype=float)
    for r in range(n):  # hop-shortest trees from and to every root
        for inward, adj in ((False, hops), (True, hops.T.tocsr())):
            cols.add(r, inward, breadth_first_order(adj, r, directed=True, return_predecessors=True)[1])
    if not cols.cols:
        return 0.0, [], {"status": f"no tree of height <= {max_height}", "upper_bound": 0.0, "bound": "dual",
                         "bounds": {**bounds, "dual": 0.0}, "gap": 0.0, "cut": cut}
    value, x, rounds, priced, status = _column_generation(cols.cols, cols.add, bounds, U, V, C[U, V], n, tol,
                                                          max_pricing, max_height)
    ub, kind = _least(bounds)
    return value, _pair_trees(cols.cols, x, names, U, V), {
        "status": status, "upper_bound": ub, "bound": kind, "bounds": {k: float(v) for k, v in bounds.items()},
        "gap": max(0.0, 1.0 - value / ub) if ub > 0 else 0.0, "rounds": rounds, "priced": priced,
        "columns": len(cols.cols), "greedy_rate_mbps": greedy_rate, "master": True, "cut": cut}


def _least(bounds: dict) -> tuple[float, str]:
    """The least upper bound and its name."""
    kind = min(bounds, key=lambda k: bounds[k])
    return bounds[kind], kind


def _column_generation(cols: list, add, bounds: dict, U: np.ndarray, V: np.ndarray, cap: np.ndarray, n: int,
                       tol: float, max_pricing: int, max_height: int | None = None
                       ) -> tuple[float, np.ndarray, int, int, str]:
    """:func:`pack_arborescences`' search: solve the restricted master over ``cols``, price
    new arborescences under its duals (``add`` appends one to ``cols``), update the dual
    bound in ``bounds``; until the gap is within ``tol``, the pricing budget is spent or
    pricing stalls.  Returns (master value, its solution, rounds, priced, status)."""
    value, x, rounds, priced = 0.0, np.zeros(0), 0, 0
    while True:
        res = _solve_master(cols, len(U), n, cap)
        if res.status != 0:
            return value, x, rounds, priced, f"linprog failed: {res.message}"
        value, x = -float(res.fun), res.x
        ub, _ = _least(bounds)
        if ub - value <= tol * max(ub, 1e-12):
            return value, x, rounds, priced, "optimal"
        if priced + 2 * n > max_pricing:
            return value, x, rounds, priced, "pricing budget spent"
        rounds += 1
        beta, added = _price(res, add, U, V, n, max_height)
        priced += 2 * n
        if beta > 0:
            bounds["dual"] = min(bounds.get("dual", INF), value / beta)
        ub, _ = _least(bounds)
        if beta >= 1.0 - 1e-9 or ub - value <= tol * max(ub, 1e-12):
            bounds["dual"] = min(bounds.get("dual", INF), value)  # the master is the LP optimum
            return value, x, rounds, priced, "optimal"
        if not added:  # degenerate duals: the priced columns are already in the master
            return value, x, rounds, priced, "stalled (degenerate pricing)"


def _solve_master(cols: list, m: int, n: int, cap: np.ndarray):
    """The restricted master LP over ``cols`` (HiGHS): max the in-trees' rates, each root's
    in-tree total equal to its out-tree total, each arc's use within its capacity."""
    rows = np.concatenate([np.asarray(t, int) for _, _, t in cols])
    colidx = np.repeat(np.arange(len(cols)), [len(t) for _, _, t in cols])
    A = sparse.csr_matrix((np.ones(len(rows)), (rows, colidx)), shape=(m, len(cols)))
    B = sparse.csr_matrix(([1.0 if inw else -1.0 for _, inw, _ in cols],
                           ([r for r, _, _ in cols], np.arange(len(cols)))), shape=(n, len(cols)))
    return linprog(np.array([-1.0 if inw else 0.0 for _, inw, _ in cols]), A_ub=A, b_ub=cap, A_eq=B,
                   b_eq=np.zeros(n), bounds=(0, None), method="highs")


def _price(res, add, U: np.ndarray, V: np.ndarray, n: int, max_height: int | None = None) -> tuple[float, int]:
    """One pricing round under the master's duals: every root's cheapest in- and out-arborescence
    (Edmonds; :func:`bounded_arborescence` under ``max_height``), added when its reduced cost
    is negative.  Returns (beta, the cheapest in- plus out-arborescence of any root; how many
    columns were added)."""
    y = np.maximum(-res.ineqlin.marginals, 0.0)
    p = -res.eqlin.marginals
    arc = np.full((n, n), -1)
    arc[U, V] = np.arange(len(U))
    beta, added = INF, 0
    for r in range(n):
        po, pi = _cheapest_pair(n, U, V, y, r, max_height)
        if po is None or pi is None:
            continue
        ch = np.flatnonzero(np.arange(n) != r)
        c_out, c_in = float(y[arc[po[ch], ch]].sum()), float(y[arc[ch, pi[ch]]].sum())
        beta = min(beta, c_out + c_in)
        if c_in + p[r] < 1.0 - 1e-9:
            added += add(r, True, pi)
        if c_out - p[r] < -1e-9:
            added += add(r, False, po)
    return beta, added


def _cheapest_pair(n: int, U: np.ndarray, V: np.ndarray, y: np.ndarray, r: int, max_height: int | None
                   ) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Root ``r``'s cheapest out-arborescence and in-arborescence under arc costs ``y``, as
    parent arrays (the in-tree's in the reversed graph); None where none is low enough."""
    if max_height is not None:
        return (bounded_arborescence(n, U, V, y, r, max_height), bounded_arborescence(n, V, U, y, r, max_height))
    sides = []
    for a, b in ((U, V), (V, U)):
        t = min_arborescence(n, list(zip(a.tolist(), b.tolist(), y.tolist())), r)
        parent = np.full(n, -1)
        parent[b[t]] = a[t]
        sides.append(parent)
    return sides[0], sides[1]


def _pair_trees(cols: list, x: np.ndarray, names: list[str], U: np.ndarray, V: np.ndarray) -> list[dict]:
    """Pair each root's in-trees with its out-trees (equal totals) in the master's solution ``x``."""
    pairs = []
    for r in range(len(names)):
        side = {inw: [[cols[c][2], x[c]] for c in range(len(cols)) if cols[c][:2] == (r, inw) and x[c] > 1e-9]
                for inw in (True, False)}
        ins, outs = side[True], side[False]
        while ins and outs:
            rate = min(ins[0][1], outs[0][1])
            pairs.append({"root": names[r], "reduce": [(names[U[k]], names[V[k]]) for k in ins[0][0]],
                          "broadcast": [(names[U[k]], names[V[k]]) for k in outs[0][0]], "rate_mbps": float(rate)})
            for s in (ins, outs):
                s[0][1] -= rate
                if s[0][1] <= 1e-9:
                    s.pop(0)
    return pairs


def _greedy_result(names: list[str], greedy: list, bounds: dict, tol: float, columns: int, cut: dict
                   ) -> tuple[float, list[dict], dict]:
    """:func:`pack_arborescences`' answer from the greedy packing alone."""
    n = len(names)
    value = sum(t[3] for t in greedy)
    kind = min(bounds, key=lambda k: bounds[k])
    ub = bounds[kind]
    pairs = []
    for r, po, pi, rate in greedy:
        ch = [v for v in range(n) if v != r]
        pairs.append({"root": names[r], "reduce": [(names[v], names[pi[v]]) for v in ch],
                      "broadcast": [(names[po[v]], names[v]) for v in ch], "rate_mbps": float(rate)})
    gap = max(0.0, 1.0 - value / ub) if ub > 0 else 0.0
    return value, pairs, {"status": "optimal" if gap <= tol else "master LP too large: greedy packing only",
                          "upper_bound": ub, "bound": kind, "bounds": {k: float(v) for k, v in bounds.items()},
                          "gap": gap, "rounds": 0, "priced": 0, "columns": columns, "greedy_rate_mbps": value,
                          "master": False, "cut": cut}


def cut_bound(graph: nx.DiGraph, nodes: Iterable[str] | None = None) -> tuple[float, dict]:
    """An upper bound on the AllReduce rate of *any* scheme: for every split of the nodes
    into X and the rest, each element's result outside X depends on the inputs in X and vice
    versa, so at least ``S`` bytes cross the cut in each direction; the rate is at most the
    smallest directed cut capacity (singletons: each node's egress and ingress).  Global
    minimum directed cut by max-flow from/to one node (scipy's ``maximum_flow`` on the rates
    rounded up to integers at a resolution of 2**-30 of their sum; each cut found is then
    measured with the exact rates, so the value is a cut's capacity, within that resolution
    of the smallest).  Returns (rate, {"from": X, "to": rest})."""
    names = sorted(graph.nodes if nodes is None else nodes)
    n = len(names)
    if n <= 1:
        return INF, {}
    C = capacity_matrix(graph, names)
    scale = float(2 ** 30) / max(float(C.sum()), 1e-300)
    G = sparse.csr_matrix(np.ceil(C * scale).astype(np.int32))
    best, cut = INF, {}
    for t in range(1, n):
        for a, b in ((0, t), (t, 0)):
            flow = maximum_flow(G, a, b).flow
            residual = (G - flow).tocsr()
            residual.data = np.maximum(residual.data, 0)
            residual.eliminate_zeros()
            side = np.zeros(n, bool)
            side[breadth_first_order(residual, a, directed=True, return_predecessors=False)] = True
            val = float(C[np.ix_(side, ~side)].sum())
            if val < best:
                best, cut = val, {"from": [names[i] for i in np.flatnonzero(side)],
                                  "to": [names[i] for i in np.flatnonzero(~side)]}
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
            tol: float = 1e-4, max_pricing: int = 1000, max_master_nonzeros: int = 20000,
            max_height: int | None = None) -> dict:
    """The AllReduce-rate optimum every run is compared with, valid for directed capacities:
    a strict bound and, apart from it, an estimate.

    Parameters
    ----------
    graph : the WAN (directed edges with ``rate_mbps``, ``delay_ms``).
    size_bytes : bytes per node (``S``).
    nodes : restrict to these nodes (trees of the *induced* subgraph; relays outside
        ``nodes`` are not used, so this is not a Steiner-tree bound).
    tol, max_pricing, max_master_nonzeros : :func:`pack_arborescences`'s stopping rule.
    max_height : pack only trees at most this many hops deep; ``rate_mbps`` is then the
        bound of such packings, not of every scheme (what the ``packing`` scheme runs).

    Returns
    -------
    dict with
      ``rate_mbps``: an upper bound on the rate of any packing of reduce in-trees and
      broadcast out-trees (:func:`pack_arborescences`' least upper bound; ``bound`` says
      which: the packing optimum proved by a matching packing, the cut, the degree bound or
      column generation's dual bound); ``transfer_s`` = ``S * 8 / (rate_mbps * 1e6)``: the
      **strict lower bound** on the CCT of every scheme in the model, what efficiency divides;
      ``packing_rate_mbps``: the rate of the packing found (``gap`` = 1 - packing / bound;
      0 up to ``tol`` when ``optimal``); ``method``;
      ``cut_rate_mbps``, ``cut``: the any-scheme bound and the cut attaining it;
      ``simple_rate_mbps``: MTREE's ``sum b / (n - 1)`` (b = min of the two directions; only
      a bound for symmetric links); ``normalised``: rate_mbps / simple_rate_mbps;
      ``latency_s``: the smallest reduce+broadcast round trip (largest leaf->root delay plus
      largest root->leaf delay) among the packing's trees; ``estimate_cct_s``: the packing's
      **estimated** CCT, its transfer time ``S * 8 / packing_rate`` plus ``latency_s`` (the
      pipeline fill of its best tree) -- an estimate, not a bound: a scheme may beat it;
      ``trees``: [{root, parent (reduce), broadcast_parent, rate_mbps, roundtrip_s}];
      ``max_utilisation``: check value (<= 1 + tol); ``solver``; ``planner_s``: wall time;
      ``model`` and ``assumes``: what the bound is and what it assumes (for results.json).
    """
    t0 = time.perf_counter()
    names = sorted(graph.nodes if nodes is None else nodes)
    value, pairs, info = pack_arborescences(graph, names, tol=tol, max_pricing=max_pricing,
                                            max_master_nonzeros=max_master_nonzeros, max_height=max_height)
    return _optimum_result(graph, names, size_bytes, value, _pair_records(graph, pairs), info, t0)


def _pair_records(graph: nx.DiGraph, pairs: list[dict]) -> list[dict]:
    """:func:`optimum`'s ``trees``: each packed pair as reduce and broadcast parent maps with
    its rate and round-trip delay."""
    trees = []
    for p in pairs:
        up = {**{c: q for c, q in p["reduce"]}, p["root"]: None}
        down = {**{c: q for q, c in p["broadcast"]}, p["root"]: None}
        trees.append({"root": p["root"], "parent": up, "broadcast_parent": down,
                      "rate_mbps": p["rate_mbps"], "roundtrip_s": _pair_roundtrip_s(graph, up, down)})
    return trees


def _pair_loads(trees: list[dict]) -> dict[tuple[str, str], float]:
    """Mbit/s the packed pairs put on each directed link."""
    loads: dict[tuple[str, str], float] = defaultdict(float)
    for t in trees:
        for c, p in t["parent"].items():
            if p is not None:
                loads[(c, p)] += t["rate_mbps"]
        for c, p in t["broadcast_parent"].items():
            if p is not None:
                loads[(p, c)] += t["rate_mbps"]
    return loads


#: The name of each upper bound :func:`pack_arborescences` reports (``info["bound"]``).
BOUND_NAMES = {"cut": "smallest directed cut", "degree": "node ingress/egress (degree) bound",
               "dual": "column generation's dual (Farley) bound"}


def _optimum_result(graph: nx.DiGraph, names: list[str], size_bytes: float, value: float, trees: list[dict],
                    info: dict, t0: float) -> dict:
    """:func:`optimum`'s answer from the packing (its rate ``value``, ``trees`` and solver
    ``info``); ``t0``: when the search started."""
    loads = _pair_loads(trees)
    if len(names) <= 1:
        rate, cut_rate, cut = INF, INF, {}
    else:
        rate = info["upper_bound"]
        cut_rate = info["bounds"]["cut"] if "bounds" in info else 0.0
        cut = info.get("cut", {})
    simple = simple_bound(graph, names)
    transfer = size_bytes * 8 / (rate * 1e6) if rate > 0 else INF
    latency = min((t["roundtrip_s"] for t in trees), default=INF if len(names) > 1 else 0.0)
    return {
        "rate_mbps": rate,
        "bound": ("packing optimum (a packing meets the " + BOUND_NAMES[info["bound"]] + ")"
                  if info["status"] == "optimal" else BOUND_NAMES.get(info["bound"], info["status"])),
        "packing_rate_mbps": value,
        "gap": info.get("gap", 0.0),
        "method": "reduce in-tree / broadcast out-tree packing (directed capacities)",
        "cut_rate_mbps": cut_rate,
        "cut": cut,
        "simple_rate_mbps": simple,
        "normalised": rate / simple if simple and math.isfinite(simple) else float("nan"),
        "transfer_s": transfer,
        "latency_s": latency,
        "estimate_cct_s": (size_bytes * 8 / (value * 1e6) if value > 0 else INF) + latency,
        "trees": trees,
        "max_utilisation": max_utilisation(graph, loads),
        "solver": info,
        "planner_s": time.perf_counter() - t0,
        "model": "best packing of reduce in-trees and broadcast out-trees (each block reduced "
                 "to a root with aggregation at nodes, then broadcast), sharing each link "
                 "direction's rate_mbps; transfer_s = S*8/rate_mbps is a strict lower bound; "
                 "estimate_cct_s = the packing's transfer time + its best tree's round-trip delay",
        "assumes": "full-duplex links with independent per-direction rates; fluid transfers "
                   "(no TCP, header or compute overhead); every scheme that reduces blocks "
                   "along trees and broadcasts them (all shipped AllReduce schemes) is inside "
                   "the model; cut_rate_mbps bounds any scheme; latency_s is the packing's best "
                   "tree's pipeline fill, so estimate_cct_s is not a bound",
    }
