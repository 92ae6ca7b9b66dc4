"""Topology-adaptive forest packing, "TopoAdapt" (paper 001: Zhang, Wu, Li, "Near-Optimal
Topology-adaptive Parameter Synchronization in Distributed DNN Training", INFOCOM 2021;
reading note shared/spec/001-topoadapt.md).

Synchronisation is a *reduce* stage and a *broadcast* stage (Sec. III-B).  Per chunk the
best topology is a tree (Property 1); the scheme packs directed Steiner trees rooted at
the active workers -- reduce trees I^(v) (edges towards the root v) and broadcast trees
J^(v) (edges away from v) -- into the worker graph, inactive workers being allowed as
relays.  Tree weights w are bandwidths (Mbit/s) each tree takes on every one of its
edges; root v owns the share chi_v / sum chi of the vector, and each tree carries a part
of its root's data proportional to its weight (Property 3), so all trees finish together
and T_comm = 2 |C| / sum_v chi_v (Eq. 2 and Sec. V).

Pipeline of this module (Sec. IV-V, end-to-end procedure of the note Sec. 3.7):

1. :func:`steiner_oracle` -- the alpha-approximate minimum Steiner tree algorithm A.
   When every node of the graph is active the Steiner trees are spanning arborescences
   and Edmonds' algorithm is exact (alpha = 1, Sec. IV cites Gabow-Manu for this case).
   Otherwise ``heuristic`` (best of the directed shortest-path heuristic and a pruned
   minimum spanning arborescence; alpha <= number of terminals) or ``exact`` (a
   multi-commodity-flow MILP, for small graphs).
2. :func:`pack_forest` -- tree generation.  **Deviation, documented:** the paper finds the
   trees with Jain et al.'s primal-dual *ellipsoid* method on the dual (6) with a binary
   search on D (Alg. 1).  We use the equivalent, standard *column generation*: solve the
   restricted master LP (4) -- or (8) with ``overlap="partial"`` -- over the trees found so
   far, read the edge duals y_e, and ask the oracle for a minimum y-weight Steiner tree
   for every root and tree type; a tree whose y-weight is below its root's dual threshold
   has negative reduced cost and joins the master.  This uses the same oracle and the
   same separation argument as Theorem 1 (the final duals scaled by alpha are feasible),
   prices the coupled LP (4)/(8) directly instead of the broadcast-only LP (5), and stops
   when no tree prices out, when a dual bound proves the packing within ``gap`` of the
   LP optimum over all trees, or after ``max_iters`` rounds (all reported in the meta).
   Starting columns: latency-shortest-path trees and fattest trees per root.  Among
   LP-optimal weightings a secondary LP prefers shallow trees (``shallow``).
3. :func:`solve_weights` -- LP (4) (non-overlap: reduce and broadcast trees never share
   bandwidth) or LP (8) (partial overlap: overlapped broadcast trees K^(v) share links
   with the reduce trees, pure broadcast trees J^(v) run after reduce; the same
   broadcast tree set serves as K and J, Sec. V).  Equalities (4a)/(4b)/(8a)/(8b) are
   solved as "chi_v <= sum w" and the surplus weight is scaled down afterwards, as the
   proof of Theorem 2 does.  (8c) is written as sum_K w_k <= chi_v, equivalent under (8a).
4. :func:`prune_forest` -- ``max_trees`` (our addition, an execution budget): keep at most
   that many reduce trees and that many broadcast trees -- heaviest first, each root
   keeping its best tree of each kind while the budget allows -- halving the surplus per
   round and re-solving the LP after each round.  ``max_trees: auto`` (the default) compiles
   the forest at each budget of ``AUTO_BUDGETS`` and keeps the plan the cost model
   (:func:`testbed.costmodel.predict`) predicts fastest: fewer trees mean fewer, larger
   pieces and fewer deep pipelines to fill, at some cost in packing.
5. :func:`compile_forest` -- the plan IR.  Root v's range is cut into ``chunks`` rounds
   (pipelined sub-chunks, Property 2); every round is split among v's reduce trees by
   w_i and, independently, among its broadcast flows by weight (K flows by w_k, J flows
   by w_j).  A broadcast piece starts at the root once every reduce piece overlapping it
   has arrived there; J (pure broadcast) pieces additionally wait until the root has
   received *all* of its reduce data -- the stage barrier of LP (4)/(8), enforced per
   root (the IR has no global barrier); ``barrier: false`` drops it (our variant: a pure
   piece leaves as soon as its own data is reduced, using what the reduce leaves idle).
   With ``overlap="none"`` every broadcast flow is a J flow; with ``"partial"`` the K flows
   carry the fraction sum w_k / chi_v of every round as soon as it is reduced (the root's
   FIFO of Sec. V).

The weights size the pieces; with ``pace`` they are also the flows' rates (``Op.rate_mbps``):
every flow's (``pacing="all"``), or, as MTREE and BLINK do, only those of flows sharing a
link direction, scaled to fill it (``"contended"``) -- caps on a connection per tree, weights
on the agents' shared links (``agents.links``).  Unpaced (the default), trees sharing a link
take equal shares and finish far apart (bench efficiency: on NetStorm's overlay, 16 MB, the
first tree done at 0.12-0.36 of the CCT).  As caps both pacings are slower, predicted and
measured on NetStorm's overlay (docs/measurements/2026-11-29-forest-pacing.md): a paced tree
cannot use the capacity its link-mates leave idle while they fill or drain their pipelines
(deep Steiner trees, up to 8 hops), and pure broadcast trees wait for the whole reduce; as
weights pacing measured as fast as none (docs/measurements/2026-12-02-shared-links.md).
``plan.meta`` reports the LP rates per tree.
"""

from __future__ import annotations

import heapq
import warnings
from collections import defaultdict
from dataclasses import dataclass, field

import networkx as nx
import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, linprog, milp

from testbed.plan import Plan, ProgramBuilder, Tree, fill_contended, split_lengths
from testbed.planners import NODES, Param, ParamError, planner
from testbed.planners.common import check_graph, is_auto, min_arborescence

REFERENCE = ("TopoAdapt: Zhang, Wu, Li, 'Near-Optimal Topology-adaptive Parameter Synchronization in "
             "Distributed DNN Training', IEEE INFOCOM 2021 (paper 001), Sec. III-V, LP (4)/(8), Alg. 1")

OVERLAPS = ("none", "partial")
ORACLES = ("auto", "heuristic", "exact")
EPS = 1e-9


# ---------------------------------------------------------------------------
# Trees
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class SteinerTree:
    """A directed Steiner tree of the worker graph.

    ``kind`` is ``"reduce"`` (edges point towards ``root``) or ``"broadcast"`` (edges point
    away from it); ``edges`` are the directed graph edges in the direction data moves.
    """

    kind: str
    root: str
    edges: tuple[tuple[str, str], ...]

    def parent(self) -> dict[str, str | None]:
        """Parent map towards the root (the :class:`~testbed.plan.Tree` convention)."""
        par: dict[str, str | None] = {self.root: None}
        for u, v in self.edges:
            if self.kind == "reduce":
                par[u] = v
            else:
                par[v] = u
        return par

    def nodes(self) -> set[str]:
        return set(self.parent())

    def to_tree(self, **kw) -> Tree:
        return Tree(self.root, self.parent(), **kw)


def capacities(graph: nx.DiGraph) -> dict[tuple[str, str], float]:
    """b_e of every directed edge: its ``rate_mbps`` (Sec. III-A, "available bandwidth")."""
    return {(u, v): float(d["rate_mbps"]) for u, v, d in graph.edges(data=True)}


# ---------------------------------------------------------------------------
# Oracle A: minimum-weight directed Steiner tree
# ---------------------------------------------------------------------------
def _prune(parent: dict[str, str], root: str, terminals: set[str]) -> dict[str, str]:
    """Drop non-terminal leaves repeatedly (they only cost weight)."""
    parent = dict(parent)
    while True:
        has_child = set(parent.values())
        drop = [n for n in parent if n not in terminals and n != root and n not in has_child]
        if not drop:
            return parent
        for n in drop:
            del parent[n]


def _edmonds(H: nx.DiGraph, w: dict, root: str) -> dict[str, str]:
    """Exact minimum spanning out-arborescence of H rooted at ``root`` (Edmonds)."""
    nodes = list(H.nodes)
    idx = {x: i for i, x in enumerate(nodes)}
    elist = list(H.edges)
    try:
        chosen = min_arborescence(len(nodes), [(idx[u], idx[v], w[(u, v)]) for u, v in elist], idx[root])
    except ValueError as exc:
        raise nx.NetworkXException(str(exc)) from exc
    return {elist[i][1]: elist[i][0] for i in chosen}


def _shortest_path_heuristic(H: nx.DiGraph, w: dict, root: str, terminals: set[str]) -> dict[str, str]:
    """Directed shortest-path heuristic (Takahashi-Matsuyama): grow the tree from the
    root, attaching each time the terminal closest (in y-weight) to the current tree
    along a shortest path.  Approximation ratio at most the number of terminals."""
    parent: dict[str, str] = {}
    in_tree = {root}
    order = {n: i for i, n in enumerate(H.nodes)}
    while not terminals <= in_tree:
        dist = {n: 0.0 for n in in_tree}
        prev: dict[str, str] = {}
        heap = [(0.0, order[n], n) for n in in_tree]
        heapq.heapify(heap)
        done = set()
        target = None
        while heap:
            d, _, u = heapq.heappop(heap)
            if u in done:
                continue
            done.add(u)
            if u in terminals and u not in in_tree:
                target = u
                break
            for v in H.successors(u):
                nd = d + w[(u, v)]
                if v not in done and nd < dist.get(v, float("inf")) - 1e-15:
                    dist[v] = nd
                    prev[v] = u
                    heapq.heappush(heap, (nd, order[v], v))
        if target is None:
            raise ValueError(f"active workers unreachable from {root}")
        v = target
        while v not in in_tree:
            parent[v] = prev[v]
            in_tree.add(v)
            v = prev[v]
    return parent


def _milp_steiner(H: nx.DiGraph, w: dict, root: str, terminals: set[str]) -> dict[str, str]:
    """Exact minimum directed Steiner tree by a multi-commodity flow MILP (HiGHS):
    binary x_e, one unit of flow f^t from the root to every terminal t with f^t_e <= x_e.
    Small graphs only."""
    edges = list(H.edges)
    m = len(edges)
    nodes = list(H.nodes)
    terms = [t for t in nodes if t in terminals and t != root]
    nv = m * (1 + len(terms))
    c = np.zeros(nv)
    c[:m] = [w[e] + 1e-9 for e in edges]  # tiny cost: no useless zero-weight edges
    A, lo, hi = _flow_rows(edges, nodes, terms, root)
    integrality = np.zeros(nv)
    integrality[:m] = 1
    res = milp(c, constraints=LinearConstraint(A, lo, hi), integrality=integrality,
               bounds=Bounds(np.zeros(nv), np.ones(nv)))
    if res.x is None:
        raise ValueError(f"no Steiner tree rooted at {root}")
    chosen = {edges[i] for i in range(m) if res.x[i] > 0.5}
    # extract an arborescence (BFS from the root over the chosen edges)
    parent: dict[str, str] = {}
    seen = {root}
    frontier = [root]
    while frontier:
        nxt = []
        for u in frontier:
            for v in H.successors(u):
                if (u, v) in chosen and v not in seen:
                    seen.add(v)
                    parent[v] = u
                    nxt.append(v)
        frontier = nxt
    return parent


def _flow_rows(edges: list[tuple[str, str]], nodes: list[str], terms: list[str], root: str
               ) -> tuple[sparse.csr_matrix, list[float], list[float]]:
    """:func:`_milp_steiner`'s rows over the variables [x_e, then f^t_e per terminal t]:
    flow conservation of each commodity t (one unit from the root to t) and f^t_e <= x_e."""
    m = len(edges)
    rows, cols, vals, lo, hi = [], [], [], [], []
    r = 0
    for ti, t in enumerate(terms):
        base = m * (1 + ti)
        for n in nodes:
            for ei, (u, v) in enumerate(edges):
                if u == n:
                    rows.append(r), cols.append(base + ei), vals.append(1.0)
                if v == n:
                    rows.append(r), cols.append(base + ei), vals.append(-1.0)
            rhs = 1.0 if n == root else (-1.0 if n == t else 0.0)
            lo.append(rhs), hi.append(rhs)
            r += 1
        for ei in range(m):
            rows += [r, r]
            cols += [base + ei, ei]
            vals += [1.0, -1.0]
            lo.append(-np.inf), hi.append(0.0)
            r += 1
    return sparse.csr_matrix((vals, (rows, cols)), shape=(r, m * (1 + len(terms)))), lo, hi


def steiner_oracle(graph: nx.DiGraph, y: dict[tuple[str, str], float], root: str, terminals: set[str], *,
                   kind: str, method: str = "heuristic") -> SteinerTree:
    """Oracle A of Alg. 1 (TopoAdapt Sec. IV): an (approximately) minimum y-weight
    directed Steiner tree rooted at ``root`` containing every node of ``terminals``.

    ``kind="broadcast"``: an out-arborescence of ``graph``; ``kind="reduce"``: an
    in-arborescence ("reduce forest packing can be computed similarly except for
    reversing the direction of edges"), computed as an out-arborescence of the reversed
    graph.  If the terminals are all the nodes, Edmonds' algorithm is exact.  Otherwise
    ``method="heuristic"`` returns the cheaper of the shortest-path heuristic and the
    minimum spanning arborescence with non-terminal leaves pruned; ``"exact"`` solves a
    MILP.  Non-terminal leaves are always pruned.
    """
    H = graph if kind == "broadcast" else graph.reverse(copy=False)
    wH = y if kind == "broadcast" else {(v, u): y[(u, v)] for (u, v) in y}
    terminals = set(terminals) | {root}
    if terminals >= set(H.nodes):
        par = _edmonds(H, wH, root)
    elif method == "exact":
        par = _prune(_milp_steiner(H, wH, root, terminals), root, terminals)
    else:
        cands = [_prune(_shortest_path_heuristic(H, wH, root, terminals), root, terminals)]
        try:
            cands.append(_prune(_edmonds(H, wH, root), root, terminals))
        except nx.NetworkXException:
            pass
        par = min(cands, key=lambda p: (sum(wH[(u, v)] for v, u in p.items()), len(p)))
    hedges = [(u, v) for v, u in par.items()]  # H orientation: parent -> child
    edges = hedges if kind == "broadcast" else [(v, u) for u, v in hedges]
    return SteinerTree(kind, root, tuple(sorted(edges)))


def _height(t: SteinerTree) -> int:
    return t.to_tree().height()


def _shortest_path_tree(graph: nx.DiGraph, root: str, terminals: set[str], kind: str) -> SteinerTree:
    """Latency-shortest-path Steiner tree (one-way ``delay_ms``, ties by hop count then
    node order), pruned to the terminals: a shallow starting column."""
    H = graph if kind == "broadcast" else graph.reverse(copy=False)
    order = {n: i for i, n in enumerate(H.nodes)}
    best: dict[str, tuple] = {}
    parent: dict[str, str] = {}
    heap = [(0.0, 0, order[root], root, None)]
    while heap:
        d, hops, _, u, p = heapq.heappop(heap)
        if u in best:
            continue
        best[u] = (d, hops)
        if p is not None:
            parent[u] = p
        for v in H.successors(u):
            if v not in best:
                heapq.heappush(heap, (d + H[u][v].get("delay_ms", 0.0), hops + 1, order[v], v, u))
    par = _prune({v: parent[v] for v in parent}, root, terminals | {root})
    hedges = [(u, v) for v, u in par.items()]
    edges = hedges if kind == "broadcast" else [(v, u) for u, v in hedges]
    return SteinerTree(kind, root, tuple(sorted(edges)))


def tree_weight(t: SteinerTree, y: dict) -> float:
    return float(sum(y[e] for e in t.edges))


# ---------------------------------------------------------------------------
# LP (4) / LP (8)
# ---------------------------------------------------------------------------
@dataclass
class Weights:
    """Solution of LP (4) or (8) for fixed tree sets (weights in Mbit/s)."""

    chi: dict[str, float]
    w_reduce: list[float]
    w_k: list[float]  # overlapped broadcast (zeros for overlap="none")
    w_j: list[float]  # pure broadcast
    objective: float  # sum_v chi_v
    duals: dict = field(default_factory=dict)


def solve_weights(caps: dict[tuple[str, str], float], roots: list[str], reduce_trees: list[SteinerTree],
                  bcast_trees: list[SteinerTree], overlap: str, *, shallow: bool = False,
                  central: bool = False) -> Weights:
    """Solve LP (4) (``overlap="none"``) or LP (8) (``"partial"``) of TopoAdapt for the
    given trees (Sec. III-D, Sec. V).

    Variables chi_v, w_i (reduce), and w_j (broadcast; with overlap also w_k over the
    same broadcast trees).  maximize sum chi_v subject to chi_v <= sum_{I(v)} w_i (4a/8a),
    chi_v <= sum_{J(v)} w_j [+ sum_{K(v)} w_k] (4b/8b), sum_{K(v)} w_k <= chi_v (8c),
    per-edge capacities (4c)/(4d) or (8d)/(8e).  Returns the weights (scaled so that the
    per-root equalities hold exactly) and the duals for pricing.

    ``shallow=True`` breaks ties among optimal solutions (our addition): a second LP
    keeps sum chi within 1e-9 (relative) of the optimum and minimises sum_t w_t * height_t
    (tree height in hops), i.e. prefers shallow trees, which pipeline with fewer
    start-up steps (Property 2's (s + depth - 1)/s factor).  The model is bandwidth-only,
    so without it e.g. Hamiltonian chains and one-hop stars tie on a homogeneous
    complete graph (Sec. VI-B expects stars).
    """
    part = overlap == "partial"
    A, b, at = _lp_rows(caps, roots, reduce_trees, bcast_trees, part)
    nr, R, B = len(roots), len(reduce_trees), len(bcast_trees)
    c = np.zeros(A.shape[1])
    c[:nr] = -1.0
    res = _solve_lp(c, A, b, central)
    x = res.x
    lam = res.ineqlin.marginals  # <= 0 for a minimisation with <= rows
    if shallow and -res.fun > EPS:
        h = [_height(t) for t in reduce_trees] + [_height(t) for t in bcast_trees] * (2 if part else 1)
        x = _prefer_shallow(A, b, res, h, nr)
    ridx = {v: i for i, v in enumerate(roots)}
    chi = {v: max(0.0, float(x[ridx[v]])) for v in roots}
    wr = [max(0.0, float(x[at["o_r"] + i])) for i in range(R)]
    wj = [max(0.0, float(x[at["o_j"] + j])) for j in range(B)]
    wk = [max(0.0, float(x[at["o_k"] + j])) for j in range(B)] if part else [0.0] * B
    _scale_to_roots(roots, reduce_trees, bcast_trees, chi, wr, wj, wk)
    eidx = {e: i for i, e in enumerate(caps)}
    duals = {
        "y1": {e: max(0.0, -float(lam[at["e1"] + eidx[e]])) for e in caps},
        "y2": {e: max(0.0, -float(lam[at["e2"] + eidx[e]])) for e in caps},
        "A": {v: float(lam[at["rA"] + ridx[v]]) for v in roots},
        "B": {v: float(lam[at["rB"] + ridx[v]]) for v in roots},
        "C": {v: float(lam[at["rC"] + ridx[v]]) for v in roots} if part else {v: 0.0 for v in roots},
    }
    return Weights(chi, wr, wk, wj, float(sum(chi.values())), duals)


def _lp_rows(caps: dict[tuple[str, str], float], roots: list[str], reduce_trees: list[SteinerTree],
             bcast_trees: list[SteinerTree], part: bool) -> tuple[sparse.csr_matrix, np.ndarray, dict[str, int]]:
    """:func:`solve_weights`' constraint rows A x <= b, and where each block starts (``at``).

    Variables: chi (one per root) | w_reduce | w_j | w_k (``part`` only).  Rows: A_v (4a/8a) |
    B_v (4b/8b) | C_v (8c, ``part`` only) | edge block 1 (4c/8d) | edge block 2 (4d/8e)."""
    edges = list(caps)
    eidx = {e: i for i, e in enumerate(edges)}
    m = len(edges)
    R, B = len(reduce_trees), len(bcast_trees)
    nr = len(roots)
    ridx = {v: i for i, v in enumerate(roots)}
    o_r, o_j = nr, nr + R
    o_k = nr + R + B
    nv = nr + R + B + (B if part else 0)
    rA, rB = 0, nr
    rC = 2 * nr
    e1 = 2 * nr + (nr if part else 0)
    e2 = e1 + m
    nrows = e2 + m
    rows, cols, vals = [], [], []

    def put(r, c, v):
        rows.append(r), cols.append(c), vals.append(v)

    for v in roots:
        put(rA + ridx[v], ridx[v], 1.0)
        put(rB + ridx[v], ridx[v], 1.0)
        if part:
            put(rC + ridx[v], ridx[v], -1.0)
    for i, t in enumerate(reduce_trees):
        put(rA + ridx[t.root], o_r + i, -1.0)
        for e in t.edges:
            put(e1 + eidx[e], o_r + i, 1.0)  # (4c) / (8d)
    for j, t in enumerate(bcast_trees):
        put(rB + ridx[t.root], o_j + j, -1.0)
        for e in t.edges:
            put(e2 + eidx[e], o_j + j, 1.0)  # (4d) / (8e)
        if part:
            put(rB + ridx[t.root], o_k + j, -1.0)
            put(rC + ridx[t.root], o_k + j, 1.0)
            for e in t.edges:
                put(e1 + eidx[e], o_k + j, 1.0)  # (8d): K shares links with reduce
    A = sparse.csr_matrix((vals, (rows, cols)), shape=(nrows, nv))
    b = np.zeros(nrows)
    b[e1:e1 + m] = [caps[e] for e in edges]
    b[e2:e2 + m] = [caps[e] for e in edges]
    return A, b, {"o_r": o_r, "o_j": o_j, "o_k": o_k, "rA": rA, "rB": rB, "rC": rC, "e1": e1, "e2": e2}


def _solve_lp(c: np.ndarray, A: sparse.csr_matrix, b: np.ndarray, central: bool):
    """min c x s.t. A x <= b, x >= 0 (HiGHS); raises RuntimeError if it fails.

    Central duals come from interior point without crossover; HiGHS sometimes stops that
    at an unrecognised status (15) on valid instances, so fall back to IPM with
    crossover, then to HiGHS' default (simplex): vertex duals still price correctly."""
    attempts = ([("highs-ipm", {"run_crossover": "off"}), ("highs-ipm", {})] if central else []) \
        + [("highs", {})]
    for method, options in attempts:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = linprog(c, A_ub=A, b_ub=b, bounds=(0, None), method=method, options=options)
        if res.status == 0:
            break
    if res.status != 0:
        raise RuntimeError(f"forest LP failed: {res.message}")
    return res


def _prefer_shallow(A: sparse.csr_matrix, b: np.ndarray, res, heights: list[int], nr: int) -> np.ndarray:
    """:func:`solve_weights`' tie-break: keep sum chi within 1e-9 (relative) of ``res``'s
    optimum and minimise sum_t w_t * height_t; ``res.x`` if that LP fails."""
    c2 = np.concatenate([np.zeros(nr), np.asarray(heights, dtype=float)])
    keep = np.zeros((1, A.shape[1]))
    keep[0, :nr] = -1.0
    A2 = sparse.vstack([A, sparse.csr_matrix(keep)]).tocsr()
    b2 = np.concatenate([b, [res.fun * (1 - 1e-9)]])
    res2 = linprog(c2, A_ub=A2, b_ub=b2, bounds=(0, None), method="highs")
    return res2.x if res2.status == 0 else res.x


def _scale_to_roots(roots: list[str], reduce_trees: list[SteinerTree], bcast_trees: list[SteinerTree],
                    chi: dict[str, float], wr: list[float], wj: list[float], wk: list[float]) -> None:
    """Scale surplus weight down (in place) so that the per-root equalities hold (proof of Thm. 2)."""
    for v in roots:
        ri = [i for i, t in enumerate(reduce_trees) if t.root == v]
        bi = [j for j, t in enumerate(bcast_trees) if t.root == v]
        sr = sum(wr[i] for i in ri)
        sb = sum(wj[j] + wk[j] for j in bi)
        for i in ri:
            wr[i] = wr[i] * chi[v] / sr if sr > 0 else 0.0
        for j in bi:
            f = chi[v] / sb if sb > 0 else 0.0
            wj[j] *= f
            wk[j] *= f


# ---------------------------------------------------------------------------
# Column generation (replaces the ellipsoid method of Alg. 1)
# ---------------------------------------------------------------------------
@dataclass
class Forest:
    """Reduce and broadcast trees with their LP weights."""

    overlap: str
    roots: list[str]
    reduce: list[SteinerTree]
    broadcast: list[SteinerTree]
    weights: Weights
    stats: dict = field(default_factory=dict)


def pack_forest(graph: nx.DiGraph, active: list[str], *, overlap: str = "partial", oracle: str = "auto",
                max_iters: int = 200, gap: float = 1e-3, tol: float = 1e-7, shallow: bool = True) -> Forest:
    """Generate reduce and broadcast Steiner trees and their weights by column
    generation on LP (4)/(8) (our replacement of TopoAdapt Alg. 1, see the module doc).

    Start: for every root and kind the latency-shortest-path tree and the oracle's tree
    under y_e = 1 / b_e (fat edges first).  Iterate: solve the master LP; for every root v and
    tree type price a new tree with the oracle under the edge duals of the rows the type
    occupies -- reduce trees: (4c)/(8d); broadcast: (4d), or, with overlap, both (8d)
    (as a K tree) and (8e) (as a J tree) -- and add it if its y-weight is below the
    root's threshold (reduced cost < 0).

    The master is solved by interior point without crossover during the iterations: its
    central duals avoid the degenerate vertex duals (many y_e = 0) that make the oracle
    return zero-weight trees and slow plain column generation down by an order of
    magnitude; the final weights come from a simplex (vertex, few trees) solve.

    Dual bound: with rho = min over roots and types of (oracle tree weight / threshold),
    y / min(1, rho) is feasible for the dual over *all* trees, so
    OPT <= sum_e b_e (y1_e + y2_e) / min(1, rho) -- exact when the oracle is (alpha = 1),
    otherwise up to alpha as in Theorem 1.  Stop when no tree prices out, when this
    bound proves the master within ``gap`` of the optimum, or after ``max_iters``.
    """
    caps = capacities(graph)
    terminals = set(active)
    method = "exact" if oracle == "exact" else "heuristic"
    roots = list(active)
    pool = _TreePool()
    y0 = {e: 1.0 / caps[e] for e in caps}
    for v in roots:
        for kind in ("reduce", "broadcast"):
            pool.add(_shortest_path_tree(graph, v, terminals, kind))
            pool.add(steiner_oracle(graph, y0, v, terminals, kind=kind, method=method))
    it, converged, oracle_calls, best_bound = _generate_columns(graph, caps, roots, terminals, pool, overlap,
                                                                method, max_iters, gap, tol)
    wts = solve_weights(caps, roots, pool.red, pool.bc, overlap, shallow=shallow)
    stats = {"iterations": it, "converged": converged, "oracle_calls": oracle_calls,
             "reduce_columns": len(pool.red), "broadcast_columns": len(pool.bc), "objective": wts.objective,
             "dual_bound": best_bound if np.isfinite(best_bound) else None,
             "gap_bound": (max(0.0, best_bound / wts.objective - 1)
                           if wts.objective > EPS and np.isfinite(best_bound) else None)}
    return Forest(overlap, roots, pool.red, pool.bc, wts, stats)


@dataclass
class _TreePool:
    """The master LP's columns: reduce and broadcast trees, each once."""

    red: list[SteinerTree] = field(default_factory=list)
    bc: list[SteinerTree] = field(default_factory=list)
    seen: set[SteinerTree] = field(default_factory=set)

    def add(self, t: SteinerTree) -> bool:
        """Add a tree to its kind's columns; False if it is one already."""
        if t in self.seen:
            return False
        self.seen.add(t)
        (self.red if t.kind == "reduce" else self.bc).append(t)
        return True


def _prices(d: dict, v: str, kind: str, overlap: str) -> list[tuple[dict, float]]:
    """The (edge duals, threshold) pairs a new tree of ``kind`` rooted at v is priced under:
    reduce trees (4c)/(8d); broadcast (4d), or with overlap both (8d) as a K tree and
    (8e) as a J tree."""
    if kind == "reduce":
        return [(d["y1"], -d["A"][v])]
    if overlap == "partial":
        return [(d["y1"], -d["B"][v] + d["C"][v]), (d["y2"], -d["B"][v])]  # as K, as J
    return [(d["y2"], -d["B"][v])]


def _generate_columns(graph: nx.DiGraph, caps: dict, roots: list[str], terminals: set[str], pool: _TreePool,
                      overlap: str, method: str, max_iters: int, gap: float, tol: float
                      ) -> tuple[int, bool, int, float]:
    """:func:`pack_forest`'s iterations: solve the master (interior point, central duals),
    price new trees, update the dual bound; until no tree prices out, the bound proves the
    master within ``gap``, or ``max_iters``.  Returns (iterations, converged, oracle calls,
    dual bound)."""
    it = 0
    converged = False
    oracle_calls = 0
    best_bound = float("inf")
    while it < max_iters:
        wts = solve_weights(caps, roots, pool.red, pool.bc, overlap, central=True)
        it += 1
        d = wts.duals
        added, rho, calls = _price_round(graph, d, roots, terminals, pool, overlap, method, tol)
        oracle_calls += calls
        if rho > 0:
            best_bound = min(best_bound, sum(caps[e] * (d["y1"][e] + d["y2"][e]) for e in caps) / min(1.0, rho))
        if not added:
            converged = True
            break
        if best_bound <= wts.objective * (1 + gap):
            break
    return it, converged, oracle_calls, best_bound


def _price_round(graph: nx.DiGraph, d: dict, roots: list[str], terminals: set[str], pool: _TreePool,
                 overlap: str, method: str, tol: float) -> tuple[int, float, int]:
    """One pricing round under the master's duals ``d``: for every root and tree type the
    oracle's tree, added when its y-weight is below the root's threshold (reduced cost
    < 0).  Returns (trees added, rho = min of tree weight / threshold, oracle calls)."""
    added = 0
    rho = float("inf")
    calls = 0
    for v in roots:
        for kind in ("reduce", "broadcast"):
            for y, thr in _prices(d, v, kind, overlap):
                if thr <= tol:
                    continue
                t = steiner_oracle(graph, y, v, terminals, kind=kind, method=method)
                calls += 1
                tw = tree_weight(t, y)
                rho = min(rho, tw / thr)
                if tw < thr - tol * max(1.0, thr) and pool.add(t):
                    added += 1
    return added, rho, calls


def _select(trees: list[SteinerTree], weight: list[float], roots: list[str], chi: dict, limit: int) -> list[int]:
    """Indices of at most ``limit`` positive-weight trees: the heaviest tree of every root
    first (roots by decreasing chi), then the rest by decreasing weight."""
    live = sorted((i for i in range(len(trees)) if weight[i] > EPS), key=lambda i: (-weight[i], i))
    if len(live) <= limit:
        return sorted(live)
    keep: list[int] = []
    for v in sorted(roots, key=lambda r: -chi[r]):
        best = next((i for i in live if trees[i].root == v), None)
        if best is not None and len(keep) < limit:
            keep.append(best)
    for i in live:
        if len(keep) >= limit:
            break
        if i not in keep:
            keep.append(i)
    return sorted(keep)


def prune_forest(forest: Forest, caps: dict, max_trees: int, *, shallow: bool = True) -> Forest:
    """Keep at most ``max_trees`` reduce trees and ``max_trees`` broadcast trees (execution
    budget; our addition, not in the paper) and re-solve the LP on them.

    Trees with zero weight are dropped first.  While a kind still has too many trees,
    the LP is re-solved and the kind's surplus is halved by keeping the heaviest trees
    (every root keeps its heaviest tree while the budget allows; broadcast weight is
    w_k + w_j), so the weights can redistribute between rounds (better than one cut).
    The result is feasible (a subset of columns) and never better than before.
    """
    w0 = forest.weights
    red, bc, w = list(forest.reduce), list(forest.broadcast), w0
    rounds = 0
    while True:
        bw = [a + b for a, b in zip(w.w_k, w.w_j)]
        nr, nb = sum(x > EPS for x in w.w_reduce), sum(x > EPS for x in bw)
        target_r = max(max_trees, (nr + max_trees) // 2) if max_trees else nr
        target_b = max(max_trees, (nb + max_trees) // 2) if max_trees else nb
        kr = _select(red, w.w_reduce, forest.roots, w.chi, target_r)
        kb = _select(bc, bw, forest.roots, w.chi, target_b)
        changed = len(kr) < len(red) or len(kb) < len(bc)
        red, bc = [red[i] for i in kr], [bc[i] for i in kb]
        if not changed and rounds:
            break
        w = solve_weights(caps, forest.roots, red, bc, forest.overlap, shallow=shallow)
        rounds += 1
        if not changed:
            break
    pruned = (len(red) < sum(x > EPS for x in w0.w_reduce)
              or len(bc) < sum(a + b > EPS for a, b in zip(w0.w_k, w0.w_j)))
    stats = dict(forest.stats, pruned=pruned, prune_rounds=rounds, objective_before_prune=w0.objective,
                 objective=w.objective, reduce_trees=sum(x > EPS for x in w.w_reduce),
                 broadcast_trees=sum(a + b > EPS for a, b in zip(w.w_k, w.w_j)))
    return Forest(forest.overlap, forest.roots, red, bc, w, stats)


def link_loads(forest: Forest) -> dict[tuple[str, str], dict[str, float]]:
    """Per directed edge: the LP load of the concurrent stage (reduce [+ K]) and of the
    pure broadcast stage (J, or all broadcast trees without overlap)."""
    w = forest.weights
    load: dict = defaultdict(lambda: {"stage1": 0.0, "stage2": 0.0})
    for t, x in zip(forest.reduce, w.w_reduce):
        for e in t.edges:
            load[e]["stage1"] += x
    for t, k, j in zip(forest.broadcast, w.w_k, w.w_j):
        for e in t.edges:
            load[e]["stage1"] += k
            load[e]["stage2"] += j
    return dict(load)


# ---------------------------------------------------------------------------
# Plan
# ---------------------------------------------------------------------------
def _tree_order(t: SteinerTree) -> list[tuple[str, int]]:
    return sorted(t.to_tree().depth().items(), key=lambda kv: (-kv[1], kv[0]))


def compile_forest(forest: Forest, nodes: list[str], length: int, active: list[str], *, chunks: int,
                   scheme: str = "forest", pace: bool = False, pacing: str = "all",
                   caps: dict[tuple[str, str], float] | None = None, barrier: bool = True) -> tuple[Plan, list[dict]]:
    """Compile a weighted forest into the plan IR (TopoAdapt Sec. III-C/V; the static
    piece assignment is ours, see the module doc).  Returns the plan and the flow table
    (one entry per tree and stage: kind, stage, tree, rate, elements).  With ``pace`` every
    transfer of a flow is paced at the flow's LP weight w (Mbit/s): the trees sharing a link
    get the bandwidths LP (4)/(8) allots them, which the shares assume (Property 3: all trees
    finish together), instead of the transport's equal shares; ``pacing="contended"`` paces
    only where flows of one stage contend (:func:`contended_rates`, on the link capacities
    ``caps``, which it then needs).  ``barrier``: a pure broadcast piece also waits for all of its
    root's reduce data (LP (4)/(8)'s stage order); false: only for the reduce pieces it overlaps."""
    w = forest.weights
    roots = [v for v in forest.roots if w.chi[v] > EPS]
    b = ProgramBuilder(nodes)
    flows: list[dict] = []

    def flow(tree: SteinerTree, stage: str, rate: float) -> int:
        flows.append({"tree": tree, "stage": stage, "rate_mbps": rate, "elements": 0})
        return len(flows) - 1

    red_flows = {v: [(flow(t, "reduce", x), t, x) for t, x in zip(forest.reduce, w.w_reduce)
                     if t.root == v and x > EPS] for v in roots}
    k_flows = {v: [(flow(t, "overlap", x), t, x) for t, x in zip(forest.broadcast, w.w_k)
                   if t.root == v and x > EPS] for v in roots}
    j_flows = {v: [(flow(t, "pure", x), t, x) for t, x in zip(forest.broadcast, w.w_j)
                   if t.root == v and x > EPS] for v in roots}
    paced = contended_rates(flows, caps) if pace and pacing == "contended" else {}

    def rate_of(fi: int, src: str, dst: str) -> float:
        if not pace:
            return 0.0
        return flows[fi]["rate_mbps"] if pacing == "all" else paced.get((fi, src, dst), 0.0)

    sizes = split_lengths(length, [w.chi[v] for v in roots]) if roots and length else [0] * len(roots)
    plan_pieces: dict[str, list[tuple[list, list]]] = {}
    off = 0
    for v, size in zip(roots, sizes):
        plan_pieces[v] = _rounds(off, size, chunks, red_flows[v], k_flows[v] + j_flows[v])
        off += size
    nrounds = max((len(r) for r in plan_pieces.values()), default=0)
    up_send, at_root, all_at_root = _emit_reduce(b, flows, roots, plan_pieces, nrounds, rate_of)
    _emit_broadcast(b, flows, roots, plan_pieces, nrounds, rate_of, up_send, at_root,
                    all_at_root if barrier else defaultdict(list))
    plan = Plan(scheme, list(nodes), length, b.programs, participants=list(active), receivers=list(active))
    return plan, flows


def contended_rates(flows: list[dict], caps: dict[tuple[str, str], float]) -> dict[tuple[int, str, str], float]:
    """Pacing only where flows contend, as :func:`testbed.plan.contended_pacing` does for
    trees: on a link direction that two or more flows of one LP stage use (reduce and
    overlapped broadcast share capacity, (8d); pure broadcast trees share it among
    themselves, (4c)/(8e)), each flow's connection is paced at its weight scaled by
    capacity / (the weights on the direction), filling it in the LP's proportions; a
    direction one flow uses stays unpaced.  Returns {(flow, src, dst): rate_mbps}."""
    users: dict[tuple[str, str, bool], list[int]] = defaultdict(list)
    for fi, f in enumerate(flows):
        for n, p in f["tree"].parent().items():
            if p is not None:
                edge = (n, p) if f["stage"] == "reduce" else (p, n)
                users[(*edge, f["stage"] == "pure")].append(fi)
    return fill_contended(users, [f["rate_mbps"] for f in flows], caps)


def _rounds(off: int, size: int, chunks: int, red: list, bc: list) -> list[tuple[list, list]]:
    """Root v's range [off, off + size) cut into ``chunks`` rounds, each round's range split
    over v's reduce flows ``red`` and (separately) its broadcast flows ``bc`` by weight.
    Returns per round (reduce pieces, broadcast pieces); a piece = (flow, tree, off, len)."""
    rounds = []
    o = off
    for rs in (split_lengths(size, [1] * chunks) if size else []):
        if rs == 0:
            continue
        rp, bp = [], []
        q = o
        for (fi, t, x), part in zip(red, split_lengths(rs, [x for _, _, x in red])):
            if part:
                rp.append((fi, t, q, part))
                q += part
        q = o
        for (fi, t, x), part in zip(bc, split_lengths(rs, [x for _, _, x in bc])):
            if part:
                bp.append((fi, t, q, part))
                q += part
        rounds.append((rp, bp))
        o += rs
    return rounds


def _emit_reduce(b: ProgramBuilder, flows: list[dict], roots: list[str], plan_pieces: dict, nrounds: int,
                 rate_of) -> tuple[dict, dict, dict]:
    """The reduce stage's ops, round-major so that program order follows time: every piece
    flows up its tree, leaves first.  Returns (up_send: (flow, offset) -> node -> send id,
    at_root: (flow, offset) -> recv ids at the root, all_at_root: root -> recv ids)."""
    up_send: dict[tuple[int, int], dict[str, int]] = {}
    at_root: dict[tuple[int, int], list[int]] = {}
    all_at_root: dict[str, list[int]] = defaultdict(list)
    for r in range(nrounds):
        for v in roots:
            if r >= len(plan_pieces[v]):
                continue
            for fi, t, o, ln in plan_pieces[v][r][0]:
                par = t.parent()
                got: dict[str, list[int]] = defaultdict(list)
                sends: dict[str, int] = {}
                for n, _ in _tree_order(t):
                    p = par[n]
                    if p is None:
                        continue
                    s, rid = b.transfer(n, p, o, ln, reduce=True, send_deps=got[n], channel=fi, flow=fi,
                                        chunk=r, phase="reduce", rate_mbps=rate_of(fi, n, p))
                    sends[n] = s
                    got[p].append(rid)
                up_send[(fi, o)] = sends
                at_root[(fi, o)] = got[v]
                all_at_root[v] += got[v]
                flows[fi]["elements"] += ln
    return up_send, at_root, all_at_root


def _emit_broadcast(b: ProgramBuilder, flows: list[dict], roots: list[str], plan_pieces: dict, nrounds: int,
                    rate_of, up_send: dict, at_root: dict, all_at_root: dict) -> None:
    """The broadcast stage's ops: overlapped (K) pieces first, then pure (J) pieces.  A piece
    leaves its root once the reduce pieces it overlaps are there (a pure piece: also once
    ``all_at_root`` of its root are), and a node forwards it once it has it."""
    for stage in ("overlap", "pure"):
        for r in range(nrounds):
            for v in roots:
                if r >= len(plan_pieces[v]):
                    continue
                rp, bp = plan_pieces[v][r]
                for fi, t, o, ln in bp:
                    if flows[fi]["stage"] != stage:
                        continue
                    over = [(rf, ro) for rf, _, ro, rl in rp if ro < o + ln and o < ro + rl]
                    root_deps = [i for key in over for i in at_root[key]]
                    if stage == "pure":
                        root_deps = root_deps + all_at_root[v]
                    have = {v: root_deps}
                    children = t.to_tree().children()
                    for n, _ in sorted(_tree_order(t), key=lambda kv: (kv[1], kv[0])):
                        for c in children[n]:
                            mine = [up_send[key][c] for key in over if c in up_send[key]]
                            _, rid = b.transfer(n, c, o, ln, reduce=False, send_deps=have[n], recv_deps=mine,
                                                channel=fi, flow=fi, chunk=r, rate_mbps=rate_of(fi, n, c),
                                                phase="bcast" if stage == "pure" else "bcast-overlap")
                            have[c] = [rid]
                    flows[fi]["elements"] += ln


AUTO_BUDGETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 64)  # max_trees: auto tries these


@planner(
    "forest", REFERENCE,
    overlap=Param(str, "partial", "reduce/broadcast overlap: none = LP (4), broadcast after reduce; partial = "
                                  "LP (8), overlapped broadcast trees share links with reduce (paper default)",
                  choices=OVERLAPS),
    active=Param((list, type(None)), None, "active workers (participants and receivers); null = all nodes. "
                                           "Inactive nodes may relay inside Steiner trees", kind=NODES),
    relays=Param(bool, True, "let inactive workers relay (Steiner trees); false = trees over the active "
                             "workers' induced subgraph only"),
    max_trees=Param((int, str), "auto", "keep at most this many reduce and this many broadcast trees (pruned in "
                                        "rounds, heaviest first, every root keeps its best tree, weights re-solved); "
                                        f"0 = no limit; 'auto' = whichever of {', '.join(map(str, AUTO_BUDGETS))} the "
                                        "cost model predicts fastest (plan.meta budget_cct_s)"),
    chunks=Param(int, 8, "pipelined sub-chunks (rounds) per root's data (Property 2 pipelining); 8 ran faster than 4 "
                         "on NetStorm's overlay at 64 MB (docs/measurements/2026-11-26-efficiency.md) and than "
                         "32 or 64 at 16 MB (docs/measurements/2026-11-29-forest-pacing.md)", ge=1),
    oracle=Param(str, "auto", "minimum Steiner tree oracle A: auto/heuristic = Edmonds when all nodes are "
                              "terminals (exact), else best of shortest-path heuristic and pruned arborescence; "
                              "exact = MILP (small graphs)", choices=ORACLES),
    max_iters=Param(int, 200, "column generation rounds at most", ge=0),
    gap=Param(float, 1e-3, "stop column generation once the dual bound proves the packing within this "
                           "relative gap of the LP optimum (exact with an exact oracle)", ge=0),
    shallow=Param(bool, True, "among LP-optimal weightings prefer shallow trees (secondary LP minimising "
                              "weight x height; our tie-break, the LP is bandwidth-only)"),
    pace=Param(bool, False, "pace every tree's transfers at its LP weight (the bandwidth the shares assume); "
                            "false = the transport shares links (measured faster, see the module doc)"),
    pacing=Param(str, "all", "with pace: 'all' paces every transfer at its flow's LP weight; 'contended' only "
                             "the flows of one stage sharing a link direction, scaled to fill it (contended_rates)",
                 ("all", "contended")),
    barrier=Param(bool, True, "a pure broadcast piece leaves its root once all of the root's reduce data is there "
                              "(the stage order of LP (4)/(8)); false = once the reduce pieces it overlaps are "
                              "(our variant: broadcast uses what reduce leaves idle)"),
)
def plan_forest(graph: nx.DiGraph, length: int, *, elem_bytes: int = 4, overlap: str = "partial",
                active: list | None = None, relays: bool = True, max_trees: int | str = "auto", chunks: int = 8,
                oracle: str = "auto", max_iters: int = 200, gap: float = 1e-3, shallow: bool = True,
                pace: bool = False, pacing: str = "all", barrier: bool = True) -> Plan:
    """Topology-adaptive Steiner forest packing (TopoAdapt, INFOCOM'21): reduce and
    broadcast trees rooted at every active worker, packed by column generation with a
    minimum-Steiner-tree oracle, weighted by LP (4) or (8), each tree carrying a share of
    its root's data proportional to its weight; inactive workers may relay."""
    nodes = check_graph(graph, "forest", connected=False)  # reachability of the active workers below
    act, g = _active_workers(graph, nodes, active, relays)
    meta: dict = {"overlap": overlap, "active": act, "relays_allowed": relays,
                  "chunks": chunks, "max_trees": max_trees, "shallow": shallow, "pace": pace,
                  "pacing": pacing, "barrier": barrier}
    if len(act) == 1:
        plan = Plan("forest", nodes, length, {n: [] for n in nodes}, participants=act, receivers=act)
        meta.update(trees=[], roots={act[0]: {"chi_mbps": None, "share": 1.0}})
        plan.meta.update(meta)
        return plan
    all_terminals = set(act) == set(g.nodes)
    forest = pack_forest(g, act, overlap=overlap, oracle=oracle, max_iters=max_iters, gap=gap, shallow=shallow)
    caps = capacities(g)

    def compiled(budget: int) -> tuple[Forest, Plan, list[dict]]:
        pruned = prune_forest(forest, caps, budget, shallow=shallow)
        if pruned.weights.objective <= EPS:
            raise RuntimeError("forest LP found no bandwidth")
        return (pruned, *compile_forest(pruned, nodes, length, act, chunks=chunks, pace=pace, pacing=pacing,
                                        caps=caps, barrier=barrier))
    forest, plan, flows, meta["max_trees"], cct = _budgeted(compiled, max_trees, graph, elem_bytes)
    meta.update({"budget_cct_s": cct} if cct else {})
    w = forest.weights
    total = w.objective
    used = set().union(*(f["tree"].nodes() for f in flows)) if flows else set()
    loads = link_loads(forest)
    meta.update({
        "oracle": ("edmonds (exact, all nodes active)" if all_terminals else
                   "milp (exact)" if oracle == "exact" else "shortest-path heuristic / pruned arborescence"),
        "oracle_alpha": 1 if (all_terminals or oracle == "exact") else f"<= {len(act)} (heuristic)",
        "tree_generation": "column generation on LP (4)/(8) (replaces the ellipsoid method of Alg. 1)",
        "roots": {v: {"chi_mbps": w.chi[v], "share": w.chi[v] / total} for v in act},
        "sum_chi_mbps": total,
        "predicted_time_s": 2 * length * elem_bytes * 8 / (total * 1e6),
        "trees": _flows_meta(flows, total, chunks, act),
        "relays_used": sorted(used - set(act)),
        "link_load_mbps": [{"edge": list(e), "capacity": caps[e], **l} for e, l in sorted(loads.items())],
        "lp": forest.stats,
    })
    plan.meta.update(meta)
    return plan


def _budgeted(compiled, max_trees: int | str, graph: nx.DiGraph, elem_bytes: int
              ) -> tuple[Forest, Plan, list[dict], int, dict[str, float]]:
    """The pruned forest, its plan and flows (``compiled(budget)``), the budget, and with
    ``max_trees: auto`` every budget's predicted CCT (s, else empty): of the budgets in
    AUTO_BUDGETS the one whose plan :func:`testbed.costmodel.fastest` picks.  Our addition:
    fewer trees mean fewer, larger pieces and fewer deep pipelines to fill, at some cost in
    packing; which budget is fastest depends on the topology and the size."""
    from testbed import costmodel

    if not is_auto("max_trees", max_trees):
        return (*compiled(max_trees), max_trees, {})
    def budgets():
        for b in AUTO_BUDGETS:
            forest, plan, flows = compiled(b)
            yield b, plan, forest, flows
    (budget, plan, forest, flows), cct = costmodel.fastest(budgets(), graph, elem_bytes)
    return forest, plan, flows, budget, cct


def _active_workers(graph: nx.DiGraph, nodes: list[str], active: list | None, relays: bool
                    ) -> tuple[list[str], nx.DiGraph]:
    """The active workers in graph order and the graph the trees may use (all of it with
    ``relays``, else the active workers' induced subgraph), checked that every active
    worker reaches every other."""
    if active is None:
        act = nodes
    else:
        if not active:
            raise ParamError("active", "must be a non-empty list of node names")
        act = [n for n in nodes if n in set(active)]  # graph order, no duplicates
    g = graph if relays else graph.subgraph(act).copy()
    if len(act) > 1:
        for v in act:
            reach = nx.descendants(g, v)
            if not set(act) - {v} <= reach:
                raise ParamError("active", f"active workers unreachable from {v}"
                           + ("" if relays else " without relays"))
    return act, g


def _flows_meta(flows: list[dict], total: float, chunks: int, act: list[str]) -> list[dict]:
    """``plan.meta["trees"]``: every compiled flow's tree with its share, stage, elements
    and relays."""
    trees_meta = []
    for fi, f in enumerate(flows):
        t: SteinerTree = f["tree"]
        d = t.to_tree(share=f["rate_mbps"] / total, chunks=chunks, rate_mbps=f["rate_mbps"]).to_dict()
        d.update({"flow": fi, "kind": t.kind, "stage": f["stage"], "elements": f["elements"],
                  "edges": [list(e) for e in t.edges],
                  "relays": sorted(t.nodes() - set(act))})
        trees_meta.append(d)
    return trees_meta
