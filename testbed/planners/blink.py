"""BLINK-style spanning-tree packing (baseline of MTREE paper 000 and CREW paper 002).

This approximates BLINK (G. Wang et al., "Blink: Fast and generic collectives for
distributed ML", MLSys 2020) from the descriptions in the MTREE paper (Sec. I, II-C,
IV-A: "a spanning tree algorithm" that packs multiple trees, supports pipelining, does
not limit tree height) and the CREW paper (Sec. V-A: "multiple spanning trees are
generated ... and the workload is distributed among five of them, by solving a MILP").
It is *not* BLINK's code.  Steps:

1. :func:`~testbed.planners.bound.mwu_packing`: approximate maximum fractional packing of spanning trees by
   multiplicative weights (Garg-Könemann): link lengths ``l_e = delta / b_e``; repeatedly
   route the bottleneck capacity on a minimum-length spanning tree and multiply the
   lengths of its links by ``(1 + eps * c / b_e)``; stop when ``sum b_e l_e >= 1`` and
   scale down by ``log_{1+eps}((1+eps)/delta)``.  The result is feasible and within a
   factor ``(1 - eps)^-2`` (roughly) of the optimum of :mod:`.bound`.
2. :func:`select_subset`: keep at most ``max_trees`` of the (top ``candidates`` by
   packed rate) trees and re-solve their rates with the MTREE MILP (1) machinery
   (:func:`testbed.planners.mtree.select_trees` with ``r_bar = 0``), i.e. the best rate
   achievable with that many trees from the packing; greedy top-k + LP if the MILP
   gives no solution.
3. Shares ``r_i / sum r``.  Trees are unrooted in the packing; BLINK does not control
   height, we root each at its latency centre (smallest reduce+broadcast round trip) --
   a choice the descriptions leave open.  ``chunks``: per-tree chunk count; default 1
   because the MTREE paper's CCT comparison runs BLINK unpipelined ("one message per
   tree"); BLINK itself pipelines with fixed-size chunks, use ``chunk_bytes`` for that.

Rate model: as :mod:`.bound` (each tree uses its rate on both directions of its links).
"""

from __future__ import annotations

import math
import time

import networkx as nx
import numpy as np
from scipy.optimize import linprog

from testbed.plan import Plan, Tree, split_lengths, trees_plan
from testbed.planners import Param, planner
from testbed.planners.bound import mwu_packing, simple_bound
from testbed.planners.common import (
    ACTIVE,
    WanView,
    check_graph,
    group_view,
    members,
    parents_from_edges,
    tree_centre,
    tree_pacing,
    tree_roundtrip_s,
    wan_view,
    widen,
)
from testbed.planners.mtree import chunk_time, select_trees, tree_paths

REFERENCE = ("BLINK-style packing after G. Wang et al., MLSys 2020, as described by the MTREE "
             "(000) and CREW (002) papers; not BLINK's code")


def select_subset(wv: WanView, flow: dict[tuple[int, ...], float], max_trees: int,
                  candidates: int, time_limit: float) -> tuple[list[tuple[int, ...]], list[float], dict]:
    """Choose at most ``max_trees`` trees of the packing and re-optimise their rates
    (MILP over the ``candidates`` largest trees; greedy + LP fallback)."""
    cand = sorted(flow, key=lambda k: (-flow[k], k))[: max(candidates, max_trees)]
    A = np.zeros((wv.m, len(cand)))
    for i, k in enumerate(cand):
        A[list(k), i] = 1.0
    r, y, info = select_trees(A, wv.cap, 0.0, max_trees, time_limit=time_limit)
    chosen = [i for i in range(len(cand)) if y[i] > 0.5 and r[i] > 1e-9]
    if not chosen:
        chosen = list(range(min(max_trees, len(cand))))
        sub = A[:, chosen]
        res = linprog(-np.ones(len(chosen)), A_ub=sub, b_ub=wv.cap, bounds=(0, None), method="highs")
        r = np.zeros(len(cand))
        r[chosen] = res.x
        chosen = [i for i in chosen if r[i] > 1e-9]
        info["fallback"] = "greedy top-k + LP"
    return [cand[i] for i in chosen], [float(r[i]) for i in chosen], info


@planner(
    "blink", REFERENCE,
    max_trees=Param(int, 5, "trees kept after packing (CREW: BLINK uses five)", ge=1),
    epsilon=Param(float, 0.2, "multiplicative-weights accuracy (smaller = closer to optimum, slower)", gt=0, lt=1),
    candidates=Param(int, 20, "largest packed trees offered to the subset MILP"),
    chunks=Param(int, 1, "chunks per tree (1 = unpipelined, as in MTREE's CCT comparison)", ge=1),
    chunk_bytes=Param(int, 0, "if > 0: fixed chunk size in bytes (BLINK-style pipelining); "
                      "overrides chunks", ge=0),
    milp_time_limit=Param((int, float), 5.0, "HiGHS time limit for the subset MILP, seconds"),
    pace=Param(bool, True, "pace each tree's transfers at its packed rate; false = TCP sharing"),
    pacing=Param(str, "contended", "with pace: 'all' paces every transfer at its tree's rate; 'contended' only the "
                 "trees sharing a link direction, scaled to fill it (plan.contended_pacing)", ("all", "contended")),
    active=ACTIVE,
)
def blink(graph: nx.DiGraph, length: int, *, elem_bytes: int, max_trees: int = 5,
          epsilon: float = 0.2, candidates: int = 20, chunks: int = 1, chunk_bytes: int = 0,
          milp_time_limit: float = 5.0, pace: bool = True, pacing: str = "contended", active=None) -> Plan:
    """BLINK-style: MWU fractional spanning-tree packing, best subset of <= max_trees
    trees with re-solved rates, shares by rate, no height limit (approximation of BLINK
    from the MTREE/CREW descriptions).  With ``active`` the trees span the group P only
    (CREW §V-A's BLINK baseline of a partial reduce), packed on :func:`group_view`."""
    check_graph(graph, "blink", min_nodes=2)
    if active is not None:
        group = members(graph, active)
        sub = blink(group_view(graph, group), length, elem_bytes=elem_bytes, max_trees=max_trees, epsilon=epsilon,
                    candidates=candidates, chunks=chunks, chunk_bytes=chunk_bytes, milp_time_limit=milp_time_limit,
                    pace=pace, pacing=pacing)
        return widen(sub, list(wan_view(graph).nodes), group)
    t0 = time.perf_counter()
    wv = wan_view(graph)
    flow, pack_info = mwu_packing(wv, epsilon)
    pack_s = time.perf_counter() - t0
    keys, rates, milp_info = select_subset(wv, flow, max_trees, candidates, milp_time_limit)
    total = sum(rates)
    trees, infos = _blink_trees(graph, wv, flow, keys, rates, total, length, elem_bytes, chunks, chunk_bytes)
    simple = simple_bound(graph)
    meta = {
        "trees": infos,
        "roots": [t.root for t in trees],
        "rates_mbps": rates,
        "shares": [t.share for t in trees],
        "chunks": [t.chunks for t in trees],
        "total_rate_mbps": total,
        "packing": {**pack_info, "distinct_trees": len(flow)},
        "simple_bound_mbps": simple,
        "normalised_throughput": total / simple,
        "milp": milp_info,
        "model_cct_s": max(d["model_t_s"] for d in infos),
        "model_cct_kind": "MTREE Eq. (4), worst tree, leaf->root->leaf' paths, tree at rate r_i",
        "avg_height": float(np.mean([t.height() for t in trees])),
        "avg_max_fanout": float(np.mean([d["max_fanout"] for d in infos])),
        "timing_s": {"packing_s": pack_s, "milp_s": milp_info.get("solve_s", 0.0)},
    }
    return trees_plan("blink", list(wv.nodes), length, trees, meta=meta, pace=tree_pacing(graph, trees, pace, pacing))


def _blink_trees(graph: nx.DiGraph, wv: WanView, flow: dict[tuple[int, ...], float], keys: list[tuple[int, ...]],
                 rates: list[float], total: float, length: int, elem_bytes: int, chunks: int, chunk_bytes: int
                 ) -> tuple[list[Tree], list[dict]]:
    """The selected trees rooted at their centres, with shares by rate and chunk counts
    (``chunk_bytes`` per chunk, else ``chunks``), and each tree's ``meta`` record."""
    trees, infos = [], []
    sizes = split_lengths(length, rates) if length else [0] * len(rates)
    for key, rate, size in zip(keys, rates, sizes):
        pairs = [wv.names(k) for k in key]
        root = tree_centre(graph, wv.nodes, pairs)
        parent = parents_from_edges(wv.nodes, pairs, root)
        if chunk_bytes > 0:
            lam = math.ceil(size * elem_bytes / chunk_bytes) if size else 1
        else:
            lam = chunks
        lam = int(max(1, min(lam, max(size, 1))))
        t = Tree(root, parent, share=rate / total, chunks=lam, rate_mbps=rate)
        trees.append(t)
        d = t.to_dict()
        paths = tree_paths(graph, parent, "roundtrip")
        beta_v = length * elem_bytes * 8.0 / (total * 1e6)
        d.update({"max_fanout": max(len(c) for c in t.children().values()),
                  "packed_rate_mbps": flow[key], "roundtrip_s": tree_roundtrip_s(graph, parent),
                  # MTREE's Eq. (4) on the tree's worst leaf->root->leaf' path (information)
                  "model_t_s": float(chunk_time(lam, paths[:, 0], paths[:, 1], paths[:, 2],
                                                beta_v).max())})
        infos.append(d)
    return trees, infos
