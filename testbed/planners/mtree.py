"""MTREE: height-bounded multiple trees for inter-datacenter AllReduce (paper 000).

Luo, Wang, Xing, "Efficient Inter-Datacenter AllReduce With Multiple Trees".

Pipeline (Fig. 4):

1. **GOST** (Sec. III-A) = :func:`gbst` (Alg. 1) using :func:`grth` (Alg. 2), wrapped
   by :func:`ith` (Alg. 3): greedy Prim-like construction of spanning trees whose
   weighted diameter is at most ``2H``, rooted at the vertex of minimum height, each
   with a rate ``r_*`` subtracted from the residual capacities.
2. **MILP (1a-1f)** (Sec. III-B), :func:`select_trees`: pick at most ``K`` trees and
   re-balance their rates against the *original* link capacities; tree ``i`` carries
   the share ``r_i / sum r`` of the vector.
3. **Chunk-size model (Eqs. 2-8)** (Sec. III-C), :func:`optimal_chunks`: per tree, the
   chunk count minimising the pipelined completion time of the tree's critical path.
   ``chunks: auto`` (our addition) instead keeps, of that count and ``AUTO_CHUNKS``, the
   one whose plan :func:`testbed.costmodel.fastest` predicts finishes first: the paper's
   model stores and forwards whole chunks, the agents cut through and pay per transfer.

The graph is the undirected :class:`~testbed.planners.bound.WanView` of the WAN: link
capacity ``b_j = min`` of the two directions (both carry the tree's rate: reduce up,
broadcast down), symmetric latency ``max`` of the two directions.

Paper ambiguities and the choices made (each a parameter where it changes results):

* GBST Line 22, ``r_* <- min{b_j > 0 : e_j in E(G)}`` "globally smallest"
  (``rate_rule="global"``, the literal text) vs the tree's bottleneck
  (``rate_rule="bottleneck"``, standard greedy packing).  Default: ``"bottleneck"``.
  Evidence (seeded graphs, sk = 0.7, K = 10): on dense 20-node/141-link and
  40-node/231-link graphs the literal rule yields 34-59 GBST trees of ~10 Mbit/s,
  MILP (1) then needs > 10 s in HiGHS and reaches 0.65-0.80 normalised throughput,
  while the bottleneck rule yields 10-24 trees, solves in < 1 s (the paper's Sec. IV-H
  claim) and reaches 0.72-0.86 (Fig. 13: "70% to 85% ... with K not exceeding 10").
  On sparse WANs (GScale-like 12/19, Internet2-like 9/13) the literal rule's many
  small trees give the MILP more freedom and a higher rate (e.g. 0.84 vs 0.69), so
  sweep both when reproducing Fig. 6.
* r_bar (never given; 10 Mbit/s would suit rates in multiples of 10): by
  default 1/20 of the smallest link capacity, so it scales with scaled topologies.
* Quantised latency ``L`` for weighted heights (never defined): ``quantum_ms=0`` means
  hop counts (``L = 1``; the paper's "2H round trip" and Figs. 11-12's H = 4..6 read
  like hops); ``quantum_ms > 0`` gives ``L = max(1, ceil(delay_ms / quantum_ms))``.
* GRTH never updates ``D_j[u]`` (Alg. 2 as printed).  ``grth_fix=False`` keeps the
  algorithm as printed (affects only the root choice at GBST Line 20).
* Scan order of equal-capacity candidate edges (unspecified): link index order; as the
  test at Line 12 is ``<=``, the last of equally good edges wins.
* RandomSelect (Line 3) uses ``numpy.random.default_rng([seed, H])`` so a given H
  always yields the same trees, whatever path ITH's binary search takes.
* Identical trees (same edge set) returned by GBST are merged (rates added) before the
  MILP -- lossless, as they have identical columns ``a_ij``.
* b_j in (1b) = the original capacities; big-M per tree = its smallest link capacity
  (same feasible set as one large M, tighter relaxation; :func:`select_trees`).
* ITH judges an H by the GBST total ``sum R`` (i.e. K = infinity, as in Fig. 13's
  set-up).  With a small K the tightened H can lower the MILP rate (many small trees
  at small H): e.g. 0.75 vs 0.90 normalised on the equinix-like-20 topology with
  K = 10; ``ith=False`` or ``rho=1`` trade height for rate.
* Height guarantee [derived]: with hop lengths (``quantum_ms=0``) the trees' heights
  are <= H: the diameter test bounds the diameter by 2H, and GRTH's quirk only misses
  1-hop distances, so ``argmin D_*`` is a tree centre.  With weighted lengths only the
  diameter (<= 2H) is guaranteed (Alg. 2).
* Eqs. (7)-(8) as printed are dimensionally inconsistent; we use the corrected
  ``mu* = sqrt(v A / ((l-1) beta))``, ``lambda* = sqrt((l-1) beta v / A)``
  (derived from Eqs. 2-6) and minimise Eq. (4) over integer ``lambda`` directly.  For AllReduce with
  overlapped broadcast the critical path is a leaf->root->leaf' round trip
  (``chunk_path="roundtrip"``); ``"reduce"`` uses leaf->root only (the paper's
  reduce-phase evaluation, Figs. 8-10).  Tree ``i`` runs at ``b = r_i`` with
  ``v_i = S r_i / sum r``, so ``beta_i v_i = S / sum r`` for every tree.
* H = 0: no explicit bound (``(n-1) * max L``, i.e. unconstrained), then ITH finds the
  smallest sufficient H; the paper gives no default H, r_bar or rho.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

import networkx as nx
import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from testbed.plan import Plan, Tree, split_lengths, trees_plan
from testbed.planners import Param, ParamError, planner
from testbed.planners.bound import simple_bound
from testbed.planners.common import (
    WanView,
    check_graph,
    chunked,
    parents_from_edges,
    tree_pacing,
    tree_roundtrip_s,
    wan_view,
)

PAPER = ("S. Luo, R. Wang, H. Xing, 'Efficient Inter-Datacenter AllReduce With Multiple "
         "Trees' (MTREE), seed 000")


# ---------------------------------------------------------------------------
# GOST: GBST + GRTH + ITH (Sec. III-A)
# ---------------------------------------------------------------------------
def quantized_lengths(wv: WanView, quantum_ms: float) -> np.ndarray:
    """The quantised latency matrix 𝓛(G) of Alg. 1/2, per link (Sec. III-A-2).

    The paper never gives the rule; ``quantum_ms <= 0``: hop counts (all 1), else
    ``max(1, ceil(delay_ms / quantum_ms))``."""
    if quantum_ms <= 0:
        return np.ones(wv.m)
    return np.maximum(1.0, np.ceil(wv.delay_ms / quantum_ms - 1e-9))


def grth(u: int, v: int, L_vu: float, D_star: np.ndarray, dist_u: np.ndarray,
         in_tree: np.ndarray, *, fix: bool = False) -> np.ndarray:
    """GRTH, Alg. 2: the rooted heights ``D_j`` after attaching ``v`` to ``u``.

    Alg. 2 runs a BFS over the current tree from ``u`` carrying ``t = L_vu + dist(u, p)``;
    every other tree vertex ``x`` gets ``D_j[x] = max(D_*[x], L_vu + dist(u, x))``
    (Line 8), ``D_j[v] = l = L_vu + max_x dist(u, x)`` (Line 11), and -- as printed --
    ``D_j[u]`` is never updated (``fix=True`` adds ``max(D_*[u], L_vu)``).  This is the
    same computation vectorised over ``dist_u`` (tree distances from ``u``; only
    entries with ``in_tree`` are used); :func:`grth_bfs` is the literal version.
    """
    D = D_star.copy()
    cand = np.where(in_tree, L_vu + dist_u, -np.inf)
    cand[u] = max(D[u], L_vu) if fix else D[u]
    D = np.where(in_tree, np.maximum(D, cand), D)
    D[v] = float(np.max(np.where(in_tree, L_vu + dist_u, -np.inf)))
    return D


def grth_bfs(u: int, v: int, in_tree: np.ndarray, M: np.ndarray, D_star: np.ndarray,
             L: np.ndarray) -> np.ndarray:
    """GRTH, Alg. 2, line by line (``M`` tree adjacency, ``L`` n x n lengths).  Kept as
    the reference for :func:`grth`; O(n^2) per call."""
    n = len(D_star)
    D = D_star.copy()
    q = deque([(u, L[v, u])])
    visited = np.zeros(n, bool)
    visited[u] = True
    ell = -np.inf
    while q:
        p, t = q.popleft()
        ell = max(ell, t)
        for nxt in range(n):
            if in_tree[nxt] and not visited[nxt] and M[p, nxt]:
                D[nxt] = max(D[nxt], t + L[p, nxt])
                q.append((nxt, t + L[p, nxt]))
                visited[nxt] = True
    D[v] = ell
    return D


@dataclass
class GostTree:
    """A GBST tree: link indices into the WanView, root index, rate r_* (Mbit/s)."""

    edges: list[int]
    root: int
    rate: float
    diameter: float  # weighted (quantised) diameter when built


def gbst(wv: WanView, H: float, r_min: float, L: np.ndarray, *, rate_rule: str = "bottleneck",
         seed: int = 0, grth_fix: bool = False, max_trees: int = 200
         ) -> tuple[list[GostTree], list[float]]:
    """GBST, Alg. 1: generate basic spanning trees with weighted diameter <= d = 2H.

    Repeats (Line 2) a Prim-like construction from a random vertex (Line 3): among the
    crossing links with residual ``b >= r_min`` (Lines 5, 18) take the largest ``b``
    whose addition keeps the diameter (``max_i D_j[i]``, Line 12) within ``d``; among
    links of that same ``b``, the one giving the smallest diameter (Lines 9-13).  Fails
    -- and returns the trees so far -- when no link qualifies (Line 14) or the residual
    network no longer spans (Line 19).  The root is ``argmin D_*`` (Line 20); the rate
    follows ``rate_rule`` (Line 22, see module docstring); the rate is subtracted from
    the tree's links (Lines 24-25).  ``max_trees`` is a safety cap (not in the paper).

    The diameter test uses exact tree distances (``max_i D_j[i]`` equals the true
    diameter even with GRTH's quirk: each pairwise distance is recorded at the endpoint
    added later); ``D_*`` (for the root) follows :func:`grth`.
    """
    n = wv.n
    if n <= 1:
        return [], []
    eu = np.array([e[0] for e in wv.edges], int)
    ev = np.array([e[1] for e in wv.edges], int)
    b = wv.cap.astype(float).copy()
    eps = 1e-9 * max(1.0, float(b.max(initial=0.0)))
    rng = np.random.default_rng([seed, int(round(H * 1000))])
    trees: list[GostTree] = []
    rates: list[float] = []
    while len(trees) < max_trees:                                   # Line 2
        start = int(rng.integers(n))                                # Line 3
        grown = _grow_tree(n, start, eu, ev, b, eps, 2.0 * H, r_min, L, grth_fix)
        if grown is None:
            return trees, rates                                     # Lines 14, 19
        E_s, D_star, diam = grown
        root = int(np.argmin(D_star))                               # Line 20
        r_star = _tree_rate(b, E_s, eps, rate_rule)                 # Line 22
        trees.append(GostTree(sorted(E_s), root, r_star, diam))     # Line 23
        rates.append(r_star)
        b[E_s] -= r_star                                            # Lines 24-25
        b[np.abs(b) <= eps] = 0.0
    return trees, rates


def _grow_tree(n: int, start: int, eu: np.ndarray, ev: np.ndarray, b: np.ndarray, eps: float, d: float, r_min: float,
               L: np.ndarray, grth_fix: bool) -> tuple[list[int], np.ndarray, float] | None:
    """GBST's Prim-like construction of a tree over the ``n`` vertices from ``start`` (Alg. 1
    Lines 4-19), over the links with residual ``b``, diameter bound ``d``: returns (tree
    links E_s, D_*, weighted diameter), or None when no link qualifies (Line 14) or the
    residual network no longer spans (Line 19)."""
    in_tree = np.zeros(n, bool)
    in_tree[start] = True
    dist = np.zeros((n, n))
    ecc = np.zeros(n)
    D_star = np.zeros(n)                                            # Line 6
    diam = 0.0
    E_s: list[int] = []
    order_idx = np.arange(len(eu))
    while True:                                                     # Line 7
        cross = (in_tree[eu] ^ in_tree[ev]) & (b >= r_min - eps) & (b > eps)   # Line 5/18
        if not cross.any():
            break
        ks = order_idx[cross]
        us = np.where(in_tree[eu[ks]], eu[ks], ev[ks])
        new_diam = np.maximum(diam, L[ks] + ecc[us])                # max_i D_j[i]
        ok = new_diam <= d + 1e-9
        if not ok.any():
            return None                                             # Line 14
        bk = b[ks]
        bmax = bk[ok].max()
        group = ok & (np.abs(bk - bmax) <= eps)                     # Lines 9-10
        gd = np.where(group, new_diam, np.inf)
        best = gd.min()
        j = int(np.flatnonzero(gd <= best + 1e-9)[-1])              # '<=': last tie wins
        k = int(ks[j])
        u = int(us[j])
        v = int(ev[k] if u == eu[k] else eu[k])                     # Line 15
        D_star = grth(u, v, L[k], D_star, dist[u], in_tree, fix=grth_fix)   # Line 11/17
        row = L[k] + dist[u]
        dist[v, :] = np.where(in_tree, row, 0.0)
        dist[:, v] = dist[v, :]
        ecc = np.where(in_tree, np.maximum(ecc, dist[:, v]), ecc)
        ecc[v] = float(dist[v][in_tree].max())
        in_tree[v] = True                                           # Line 16
        diam = max(diam, float(ecc[v]))
        E_s.append(k)                                               # Line 17
    if not in_tree.all():
        return None                                                 # Line 19
    return E_s, D_star, diam


def _tree_rate(b: np.ndarray, E_s: list[int], eps: float, rate_rule: str) -> float:
    """GBST Line 22: the new tree's rate r_* by ``rate_rule`` (see the module docstring)."""
    if rate_rule == "global":
        pos = b[b > eps]
        return float(pos.min())                                     # Line 22 (literal)
    if rate_rule == "bottleneck":
        return float(b[E_s].min())
    raise ValueError(f"unknown rate_rule {rate_rule!r}")


def ith(wv: WanView, H: float, r_min: float, rho: float, L: np.ndarray, **gbst_kw
        ) -> tuple[float, list[GostTree], list[float], list[dict]]:
    """ITH, Alg. 3: binary search for the smallest ``H^M <= H`` whose GBST total rate
    is at least ``rho`` times the total at ``H`` (Lines 2, 7).  Returns ``(H^U, trees,
    rates, trace)``; ``trace`` lists every GBST call (H, number of trees, total rate)."""
    trees, rates = gbst(wv, H, r_min, L, **gbst_kw)                 # Line 1
    trace = [{"H": H, "trees": len(trees), "total_rate": float(sum(rates))}]
    r_rho = rho * sum(rates)                                        # Line 2
    lo, hi = 1, int(H)                                              # Line 3
    while lo < hi:                                                  # Line 4
        mid = (lo + hi) // 2                                        # Line 5
        t, r = gbst(wv, mid, r_min, L, **gbst_kw)                   # Line 6
        trace.append({"H": mid, "trees": len(t), "total_rate": float(sum(r))})
        if sum(r) >= r_rho - 1e-9:                                  # Line 7
            hi, trees, rates = mid, t, r                            # Line 8
        else:
            lo = mid + 1                                            # Line 10
    return float(hi), trees, rates, trace


_ITH = ith  # the scheme has a parameter named ``ith``


def merge_duplicates(trees: list[GostTree]) -> list[GostTree]:
    """Merge GBST trees with the same link set (rates added, first root kept)."""
    out: dict[tuple[int, ...], GostTree] = {}
    for t in trees:
        key = tuple(t.edges)
        if key in out:
            out[key].rate += t.rate
        else:
            out[key] = GostTree(list(t.edges), t.root, t.rate, t.diameter)
    return list(out.values())


# ---------------------------------------------------------------------------
# MILP (1) (Sec. III-B)
# ---------------------------------------------------------------------------
def select_trees(A: np.ndarray, cap: np.ndarray, r_min: float, K: int, *,
                 big_m: float | None = None, time_limit: float = 10.0
                 ) -> tuple[np.ndarray, np.ndarray, dict]:
    """MILP (1a)-(1f): choose at most ``K`` of the γ candidate trees and their rates.

    ``A`` is the link x tree incidence ``a_ij``; maximise ``sum r_i`` (1a) s.t.
    ``A r <= b`` (1b), ``M(1 - y_i) + r_i >= r_bar`` (1c), ``r_i <= M y_i`` (1d),
    ``sum y_i <= K`` (1e, omitted if ``K <= 0``), ``y`` binary, ``r >= 0`` (1f).
    ``big_m=None`` uses ``M_i = max(min_{e in T_i} b_e, r_bar)`` per tree instead of one
    large constant: (1b) already forces ``r_i <= min_{e in T_i} b_e``, so the feasible set
    is unchanged while the LP relaxation is much tighter (HiGHS then solves IDN-size
    instances in well under a second, matching the paper's Sec. IV-H claim).  Solved with HiGHS (``scipy.optimize.milp``).  Returns ``(r, y, info)``.
    """
    m, g = A.shape
    if g == 0:
        return np.zeros(0), np.zeros(0), {"status": "no candidate trees", "objective": 0.0}
    if big_m is None:  # per-tree M_i = min capacity on the tree: same feasible set, tighter LP
        M = np.array([max(float(cap[A[:, i] > 0].min(initial=cap.max())), r_min) for i in range(g)])
    else:
        M = np.full(g, float(big_m))
    I = np.eye(g)
    Z = np.zeros((m, g))
    MI = np.diag(M)
    cons = [LinearConstraint(np.hstack([A, Z]), -np.inf, cap),                 # (1b)
            LinearConstraint(np.hstack([I, -MI]), r_min - M, np.inf),          # (1c)
            LinearConstraint(np.hstack([I, -MI]), -np.inf, 0.0)]               # (1d)
    if K > 0:
        cons.append(LinearConstraint(np.hstack([np.zeros(g), np.ones(g)])[None, :], -np.inf, K))  # (1e)
    c = np.concatenate([-np.ones(g), np.zeros(g)])                             # (1a)
    integrality = np.concatenate([np.zeros(g), np.ones(g)])                    # (1f)
    t0 = time.perf_counter()
    res = milp(c, constraints=cons, integrality=integrality,
               bounds=Bounds(np.zeros(2 * g), np.concatenate([np.full(g, np.inf), np.ones(g)])),
               options={"time_limit": float(time_limit), "disp": False})
    info = {"status": int(res.status), "message": str(res.message),
            "objective": -float(res.fun) if res.x is not None else 0.0,
            "solve_s": time.perf_counter() - t0, "candidates": g,
            "big_m": "per-tree min capacity" if big_m is None else float(big_m)}
    if res.x is None:
        return np.zeros(g), np.zeros(g), info
    r = np.where(res.x[g:] > 0.5, np.maximum(res.x[:g], 0.0), 0.0)
    y = (res.x[g:] > 0.5).astype(float)
    return r, y, info


# ---------------------------------------------------------------------------
# Chunk-size model (Sec. III-C, Eqs. 2-8)
# ---------------------------------------------------------------------------
def chunk_time(lam, sum_alpha, max_alpha, hops, beta_v):
    """Eq. (4): ``t(lam) = sum a + (lam - 1) max a + (l - 1) beta v / lam + beta v``
    (seconds; ``beta_v`` = bytes / rate in seconds).  Broadcasts over array args."""
    lam = np.asarray(lam, float)
    return sum_alpha + (lam - 1) * max_alpha + (hops - 1) * beta_v / lam + beta_v


def lambda_star(sum_alpha, max_alpha, hops, beta_v):
    """Continuous optimum of Eq. (4), corrected Eq. (8): ``sqrt((l-1) beta v / A)``."""
    if hops <= 1 or beta_v <= 0:
        return 1.0
    if max_alpha <= 0:
        return math.inf
    return math.sqrt((hops - 1) * beta_v / max_alpha)


def tree_paths(graph: nx.DiGraph, parent: dict, mode: str = "roundtrip") -> np.ndarray:
    """Critical-path candidates of a rooted tree for Eq. (2): rows ``(sum alpha, max
    alpha, l)`` with one-way link delays in seconds.  ``"reduce"``: every leaf->root
    path; ``"roundtrip"``: every leaf->root->leaf' path (AllReduce with broadcast
    overlapping reduce, Sec. III-C).  Non-leaf paths are prefixes, hence dominated."""
    children: dict = {x: [] for x in parent}
    for x, p in parent.items():
        if p is not None:
            children[p].append(x)
    root = next(x for x, p in parent.items() if p is None)
    up = {root: (0.0, 0.0, 0)}
    down = {root: (0.0, 0.0, 0)}
    q = deque([root])
    while q:
        p = q.popleft()
        for c in children[p]:
            a_up = graph[c][p].get("delay_ms", 0.0) / 1e3
            a_dn = graph[p][c].get("delay_ms", 0.0) / 1e3
            s, mx, h = up[p]
            up[c] = (s + a_up, max(mx, a_up), h + 1)
            s, mx, h = down[p]
            down[c] = (s + a_dn, max(mx, a_dn), h + 1)
            q.append(c)
    leaves = [x for x in parent if not children[x]] or [root]
    U = np.array([up[x] for x in leaves], float)
    if mode == "reduce":
        rows = U
    elif mode == "roundtrip":
        Dn = np.array([down[x] for x in leaves], float)
        rows = np.stack([U[:, None, 0] + Dn[None, :, 0],
                         np.maximum(U[:, None, 1], Dn[None, :, 1]),
                         U[:, None, 2] + Dn[None, :, 2]], axis=-1).reshape(-1, 3)
    else:
        raise ValueError(f"unknown chunk path mode {mode!r}")
    return np.unique(rows, axis=0)


def optimal_chunks(paths: np.ndarray, beta_v: float, max_chunks: int) -> dict:
    """Integer chunk count minimising the worst Eq. (4) time over the critical-path
    candidates (each path's continuous optimum is the corrected Eq. (8); past the
    largest of them every path's time increases).  Returns ``lambda`` (int),
    ``lambda_star`` (continuous, of the path that is critical at ``lambda``), the
    model times at ``lambda`` and at 1 (unpipelined), and ``lambda_hash`` (λ#, the
    count above which pipelining is slower than one message, on that path)."""
    if len(paths) == 0 or max_chunks <= 1 or beta_v <= 0:
        return {"lambda": 1, "lambda_star": 1.0, "t_s": 0.0, "t1_s": 0.0, "lambda_hash": 1.0}
    stars = [lambda_star(s, a, l, beta_v) for s, a, l in paths]
    hi = int(min(max_chunks, math.ceil(max(min(x, 1e7) for x in stars)) + 1))
    lam = np.arange(1, max(hi, 1) + 1, dtype=float)
    T = chunk_time(lam[None, :], paths[:, 0:1], paths[:, 1:2], paths[:, 2:3], beta_v)
    worst = T.max(axis=0)
    i = int(np.argmin(worst))
    crit = int(np.argmax(T[:, i]))
    s, a, l = paths[crit]
    return {"lambda": int(lam[i]), "lambda_star": float(stars[crit]), "t_s": float(worst[i]),
            "t1_s": float(worst[0]),
            "lambda_hash": float((l - 1) * beta_v / a) if a > 0 else math.inf,
            "critical_path": {"sum_alpha_s": float(s), "max_alpha_s": float(a), "hops": int(l)}}


# ---------------------------------------------------------------------------
# The scheme
# ---------------------------------------------------------------------------
def _finite(x: float) -> float | None:
    """JSON-safe number (None for inf, e.g. lambda* with zero-latency links)."""
    return float(x) if math.isfinite(x) else None


def _tree_info(graph: nx.DiGraph, t: Tree, wv: WanView, L: np.ndarray) -> dict:
    """Structure metrics of a rooted tree (hop and weighted heights, fan-outs)."""
    eidx = wv.edge_index()
    depth_q = {t.root: 0.0}
    depth_ms = {t.root: 0.0}
    ch = t.children()
    q = deque([t.root])
    while q:
        p = q.popleft()
        for c in ch[p]:
            k = eidx[(wv.index[c], wv.index[p])]
            depth_q[c] = depth_q[p] + float(L[k])
            depth_ms[c] = depth_ms[p] + float(graph[c][p].get("delay_ms", 0.0))
            q.append(c)
    return {"hop_height": t.height(), "weighted_height": max(depth_q.values()),
            "latency_height_ms": max(depth_ms.values()),
            "max_fanout": max(len(v) for v in ch.values()),
            "fanouts": {k: len(v) for k, v in ch.items() if v},
            "roundtrip_s": tree_roundtrip_s(graph, t.parent)}


AUTO_CHUNKS = (16, 32, 64)  # chunks: auto tries these besides the model's lambda*


@planner(
    "mtree", PAPER,
    K=Param(int, 10, "max number of trees chosen by MILP (1e); 0 = unlimited", ge=0),
    H=Param((int, float), 0, "max weighted tree height (units of quantum_ms, hops if 0); "
            "0 = unbounded, then ITH tightens it", ge=0),
    ith=Param(bool, True, "run ITH (Alg. 3) to find the smallest H within rho of the rate at H"),
    rho=Param(float, 0.95, "ITH allowed loss factor rho in (0, 1] (paper gives no value)", gt=0, le=1),
    min_rate_mbps=Param((int, float), 0, "r_bar, minimum non-zero tree rate (Mbit/s); "
                        "0 = auto: 1/20 of the smallest link capacity", ge=0),
    rate_rule=Param(str, "bottleneck", "GBST Line 22 rate: 'global' = globally smallest residual "
                    "(literal), 'bottleneck' = the tree's smallest residual",
                    ("global", "bottleneck")),
    quantum_ms=Param((int, float), 0, "latency quantum for weighted height; 0 = hop count", ge=0),
    grth_fix=Param(bool, False, "also update D_j[u] in GRTH (not in Alg. 2 as printed)"),
    seed=Param(int, 0, "seed of GBST's RandomSelect start vertex"),
    pipelined=Param(bool, True, "chunk counts from the Eq. 2-8 model; false = one chunk per tree"),
    chunks=Param((int, str), 0, "force this chunk count per tree (>0); 0 = model optimum lambda*; 'auto' = of "
                 f"lambda* and {', '.join(map(str, AUTO_CHUNKS))}, the count the cost model predicts fastest "
                 "(plan.meta chunk_cct_s; our addition)"),
    chunk_delta=Param(int, 0, "Fig. 10 offset: lambda = max(lambda* + delta, 1)"),
    chunk_path=Param(str, "roundtrip", "critical path of the chunk model: 'roundtrip' "
                     "(leaf->root->leaf', AllReduce) or 'reduce' (leaf->root)",
                     ("roundtrip", "reduce")),
    max_chunks=Param(int, 256, "upper limit on chunks per tree", ge=1),
    milp_time_limit=Param((int, float), 10.0, "HiGHS time limit for MILP (1), seconds"),
    max_gbst_trees=Param(int, 200, "safety cap on trees per GBST call (not in the paper)", ge=1),
    pace=Param(bool, True, "pace each tree's transfers at its MILP rate (the paper's rate "
               "allocation); false = trees share links as TCP flows do"),
    pacing=Param(str, "contended", "with pace: 'all' paces every transfer at its tree's rate; 'contended' only the "
                 "trees sharing a link direction, scaled to fill it (plan.contended_pacing)", ("all", "contended")),
)
def mtree(graph: nx.DiGraph, length: int, *, elem_bytes: int, K: int = 10, H: float = 0,
          ith: bool = True, rho: float = 0.95, min_rate_mbps: float = 0,
          rate_rule: str = "bottleneck", quantum_ms: float = 0, grth_fix: bool = False,
          seed: int = 0, pipelined: bool = True, chunks: int | str = 0, chunk_delta: int = 0,
          chunk_path: str = "roundtrip", max_chunks: int = 256, milp_time_limit: float = 10.0,
          max_gbst_trees: int = 200, pace: bool = True, pacing: str = "contended") -> Plan:
    """MTREE (paper 000): GOST trees (Algs. 1-3), MILP (1) selection of <= K trees with
    rates r_i and shares r_i / sum r, per-tree pipelined chunk counts from Eqs. (2)-(8);
    compiled to concurrent reduce-then-broadcast over the trees (trees_plan)."""
    check_graph(graph, "mtree", min_nodes=2)
    wv = wan_view(graph)
    L = quantized_lengths(wv, quantum_ms)
    r_min = float(min_rate_mbps) if min_rate_mbps > 0 else float(wv.cap.min()) / 20.0
    H_in = float(H) if H > 0 else float((wv.n - 1) * L.max())
    kw = dict(rate_rule=rate_rule, seed=seed, grth_fix=grth_fix, max_trees=max_gbst_trees)
    t0 = time.perf_counter()
    H_used, cand, gb_rates, trace = _gost(wv, H_in, r_min, rho, L, ith, kw)
    gost_s = time.perf_counter() - t0
    if not cand:
        raise ParamError("H", f"mtree: GBST found no spanning tree with weighted height <= H={H_in:g} "
                              f"and rate >= r_bar={r_min:g} Mbit/s")
    merged = merge_duplicates(cand)
    chosen, r, milp_info = _select(merged, wv, r_min, K, milp_time_limit)
    total = float(sum(r[i] for i in chosen))
    S = length * elem_bytes
    beta_v = S * 8.0 / (total * 1e6)  # beta_i v_i = S / sum r (seconds), the same for all trees
    simple = simple_bound(graph)
    common = {
        "total_rate_mbps": total, "simple_bound_mbps": simple, "normalised_throughput": total / simple,
        "H_input": H_in, "H_used": H_used, "r_bar_mbps": r_min, "ith_trace": trace,
        "gost": {"trees": len(cand), "distinct": len(merged),
                 "rates_mbps": [float(x) for x in gb_rates], "total_rate_mbps": float(sum(gb_rates))},
        "milp": milp_info, "timing_s": {"gost_s": gost_s, "milp_s": milp_info.get("solve_s", 0.0)},
    }

    def compiled(c: int) -> Plan:
        trees, infos = _chunked_trees(graph, wv, L, merged, chosen, r, total, length, beta_v, chunk_path=chunk_path,
                                      max_chunks=max_chunks, pipelined=pipelined, chunks=c, chunk_delta=chunk_delta)
        meta = {"trees": infos, "roots": [t.root for t in trees], "rates_mbps": [t.rate_mbps for t in trees],
                "shares": [t.share for t in trees], "chunks": [t.chunks for t in trees], **common,
                **_model_summary(infos)}
        return trees_plan("mtree", list(wv.nodes), length, trees, meta=meta,
                          pace=tree_pacing(graph, trees, pace, pacing))
    # our addition: with cut-through and a per-transfer cost the paper's model of
    # store-and-forward hops need not be fastest
    return chunked(compiled, chunks, (0, *AUTO_CHUNKS), graph, elem_bytes)


def _gost(wv: WanView, H_in: float, r_min: float, rho: float, L: np.ndarray, use_ith: bool, kw: dict
          ) -> tuple[float, list[GostTree], list[float], list[dict]]:
    """GOST (Sec. III-A): ITH's search for the smallest sufficient H (Alg. 3), or one GBST
    call at ``H_in`` (Alg. 1).  Returns (H used, trees, their GBST rates, the GBST calls)."""
    if use_ith:
        return _ITH(wv, H_in, r_min, rho, L, **kw)
    cand, gb_rates = gbst(wv, H_in, r_min, L, **kw)
    return H_in, cand, gb_rates, [{"H": H_in, "trees": len(cand), "total_rate": float(sum(gb_rates))}]


def _select(merged: list[GostTree], wv: WanView, r_min: float, K: int, time_limit: float
            ) -> tuple[list[int], np.ndarray, dict]:
    """MILP (1) over the distinct GBST trees: the chosen ones, the rates and the solver's
    info; GBST's own rates of the K fastest trees when the MILP found no solution."""
    A = np.zeros((wv.m, len(merged)))
    for i, t in enumerate(merged):
        A[t.edges, i] = 1.0
    r, y, milp_info = select_trees(A, wv.cap, r_min, K, time_limit=time_limit)
    chosen = [i for i in range(len(merged)) if y[i] > 0.5 and r[i] > 1e-9]
    if not chosen:  # MILP failed (time limit without incumbent): fall back to GBST rates
        chosen = sorted(range(len(merged)), key=lambda i: -merged[i].rate)[: K or None]
        r = np.array([t.rate for t in merged], float)
        milp_info["fallback"] = "GBST rates"
    return chosen, r, milp_info


def _chunked_trees(graph: nx.DiGraph, wv: WanView, L: np.ndarray, merged: list[GostTree], chosen: list[int],
                   r: np.ndarray, total: float, length: int, beta_v: float, *, chunk_path: str, max_chunks: int,
                   pipelined: bool, chunks: int, chunk_delta: int) -> tuple[list[Tree], list[dict]]:
    """The chosen trees with their shares r_i / sum r and chunk counts (Eqs. (2)-(8), or as
    forced by ``pipelined``/``chunks``/``chunk_delta``), and each tree's ``meta`` record."""
    trees: list[Tree] = []
    infos = []
    sizes = split_lengths(length, [r[i] for i in chosen]) if length else [0] * len(chosen)
    for i, size in zip(chosen, sizes):
        g = merged[i]
        pairs = [wv.names(k) for k in g.edges]
        root = wv.nodes[g.root]
        parent = parents_from_edges(wv.nodes, pairs, root)
        paths = tree_paths(graph, parent, chunk_path)
        model = optimal_chunks(paths, beta_v, max_chunks)
        if not pipelined:
            lam = 1
        elif chunks > 0:
            lam = chunks
        else:
            lam = max(model["lambda"] + chunk_delta, 1)
        lam = int(max(1, min(lam, max(size, 1))))
        t = Tree(root, parent, share=float(r[i]) / total, chunks=lam, rate_mbps=float(r[i]))
        trees.append(t)
        info = t.to_dict()
        info.update(_tree_info(graph, t, wv, L))
        info.update({"gbst_rate_mbps": g.rate, "weighted_diameter": g.diameter,
                     "lambda_star": _finite(model["lambda_star"]), "lambda_opt": model["lambda"],
                     "lambda_hash": _finite(model["lambda_hash"]), "model_t_s": model["t_s"],
                     "model_t_unpipelined_s": model["t1_s"],
                     "model_t_used_s": float(chunk_time(lam, paths[:, 0], paths[:, 1],
                                                        paths[:, 2], beta_v).max()),
                     "critical_path": model.get("critical_path")})
        infos.append(info)
    return trees, infos


def _model_summary(infos: list[dict]) -> dict:
    """The chunk model's CCT (Eq. (4), worst tree) and the trees' average shape."""
    return {
        "model_cct_s": max((i["model_t_used_s"] for i in infos), default=0.0),
        "model_cct_kind": "MTREE Eq. (4), worst tree, chunk_path critical paths, tree at rate r_i",
        "avg_height": float(np.mean([i["hop_height"] for i in infos])),
        "avg_max_fanout": float(np.mean([i["max_fanout"] for i in infos])),
    }

