"""Auxiliary paths for multipath transmission (NetStorm §VI-B, Algorithm 3): a pure function.

For every (sender, next aggregator) pair of a plan -- child -> parent in the reduce, parent
-> child in the broadcast (the authors' code keys routes by that destination; the paper says
"any two nodes") -- the primary path and the auxiliary paths, fastest first.  Cost of a path:
its transfer delay sum over its links of ``w_trans(e) = 1 / s(e)`` (Alg. 3 line 5), ``s`` the
link's rate (configured, or the closed loop's estimate).

Two readings, chosen by ``disjoint``:

* ``"edge"`` (default; the paper's prose, §VI-B): rounds.  In each round every pair gets its
  fastest path on the graph that is left, then every link used by any of this round's paths
  is removed, until no pair is connected any more.  Round 0 gives the primary paths, later
  rounds auxiliary ones, so every auxiliary path is link-disjoint from every path chosen
  before it, also other pairs' (the pseudo-code removes links pair by pair inside the round
  while reusing a path set computed before it; the two differ, the prose is taken).  A link
  is removed in both directions: Alg. 3 works on an undirected graph.
* ``"node"`` (the authors' public code, ``find_trace``/``add_route``): all simple paths of
  the pair by increasing cost; the cheapest is primary, and each further path is kept when
  none of its intermediate nodes is an intermediate node of a path already kept.

``busy``: links to leave out of auxiliary paths (both directions), e.g. the trees' own links,
so that auxiliary paths use idle links only (§VI-A: "auxiliary paths are created from idle
links"); primary paths may use them.  ``max_paths`` bounds the auxiliary paths per pair.
"""

from __future__ import annotations

from itertools import islice
from typing import Iterable

import networkx as nx

DISJOINT = ("edge", "node")
MAX_SIMPLE_PATHS = 5000  # "node" mode enumerates simple paths by cost: at most this many per pair


def transfer_cost(graph: nx.DiGraph, path: list[str]) -> float:
    """Sum of 1 / rate (s per Mbit) along ``path``: Alg. 3's w_trans."""
    return sum(1.0 / graph[a][b]["rate_mbps"] for a, b in zip(path, path[1:]))


def _fastest(graph: nx.DiGraph, src: str, dst: str) -> list[str] | None:
    try:
        return nx.dijkstra_path(graph, src, dst, weight=lambda a, b, d: 1.0 / d["rate_mbps"])
    except (nx.NetworkXNoPath, nx.NodeNotFound):
        return None


def _without(graph: nx.DiGraph, links: Iterable[tuple[str, str]]) -> nx.DiGraph:
    g = graph.copy()
    for a, b in links:
        for u, v in ((a, b), (b, a)):
            if g.has_edge(u, v):
                g.remove_edge(u, v)
    return g


def aux_paths(graph: nx.DiGraph, pairs: Iterable[tuple[str, str]], *, disjoint: str = "edge",
              busy: Iterable[tuple[str, str]] = (), max_paths: int | None = None
              ) -> dict[tuple[str, str], dict]:
    """``{(src, dst): {"primary": path, "aux": [path, ...]}}`` for every pair (paths are node
    lists, both ends included; ``aux`` fastest first, at most ``max_paths``)."""
    if disjoint not in DISJOINT:
        raise ValueError(f"disjoint must be one of {DISJOINT}, got {disjoint!r}")
    pairs = list(dict.fromkeys(pairs))
    out = {}
    for s, d in pairs:
        primary = _fastest(graph, s, d)
        if primary is None:
            raise ValueError(f"no path from {s} to {d}")
        out[(s, d)] = {"primary": primary, "aux": []}
    idle = _without(graph, busy)
    if disjoint == "edge":
        left = _without(idle, [l for p in out.values() for l in zip(p["primary"], p["primary"][1:])])
        while True:
            found = {}
            for s, d in pairs:
                if max_paths is None or len(out[(s, d)]["aux"]) < max_paths:
                    path = _fastest(left, s, d)
                    if path is not None:
                        found[(s, d)] = path
            if not found:
                break
            for pair, path in found.items():
                out[pair]["aux"].append(path)
            left = _without(left, [l for p in found.values() for l in zip(p, p[1:])])
    else:
        weight = lambda a, b, e: 1.0 / e["rate_mbps"]  # noqa: E731 -- networkx's weight callable, read as the formula it is
        for (s, d), entry in out.items():
            used = set(entry["primary"][1:-1])
            candidates = nx.shortest_simple_paths(idle, s, d, weight=weight) if nx.has_path(idle, s, d) else ()
            for path in islice(candidates, MAX_SIMPLE_PATHS):
                if path == entry["primary"] or used & set(path[1:-1]):
                    continue
                entry["aux"].append(path)
                used |= set(path[1:-1])
                if max_paths is not None and len(entry["aux"]) >= max_paths:
                    break
    for entry in out.values():
        entry["aux"].sort(key=lambda p: transfer_cost(graph, p))
    return out


def plan_pairs(plan) -> list[tuple[str, str]]:
    """The (sender, next aggregator) pairs of a plan: every transfer's (src, dst)."""
    return sorted({(src, op.peer) for src, op in plan.transfers()})


def path_rate(graph: nx.DiGraph, path: list[str]) -> list[float]:
    """[bottleneck rate in Mbit/s, one-way delay in s] of ``path`` on ``graph``."""
    links = [graph[a][b] for a, b in zip(path, path[1:])]
    return [min(e["rate_mbps"] for e in links), sum(e.get("delay_ms", 0.0) for e in links) / 1e3]


def attach(plan, graph: nx.DiGraph, *, primary_busy_bound: int = 2, aux_queue_length: int = 5,
           max_paths: int | None = 2, disjoint: str = "edge", idle_only: bool = True,
           resend_after_s: float = 5.0, dispatch: str = "queue") -> dict:
    """``plan.aux`` for ``plan`` on ``graph`` (configured rates, or the closed loop's
    estimates at a re-plan): Algorithm 3's auxiliary paths of every (sender, next aggregator)
    pair -- with ``idle_only`` over links no transfer of the plan uses (its routed paths: §VI-A,
    "auxiliary paths are created from idle links"), else over any link but the pair's own
    primary -- those the wire's route can carry, the dispatch bounds and the re-send delay
    (:mod:`agents.executor`); with ``dispatch: eta`` also ``rates`` {"a>r>b": [bottleneck
    Mbit/s, delay s]} of every auxiliary path and, keyed "a>b", of every pair's primary path."""
    from testbed.plan import AUX_MAX_NODES
    from testbed.routing import data_paths

    pairs, routed = plan_pairs(plan), data_paths(graph)
    busy = {link for pair in pairs for link in zip(routed[pair], routed[pair][1:])} if idle_only else ()
    found = aux_paths(graph, pairs, disjoint=disjoint, busy=busy, max_paths=max_paths)
    paths = [p for pair in pairs for p in found[pair]["aux"] if 3 <= len(p) <= AUX_MAX_NODES]  # 2: the direct connection
    out = {"paths": paths, "primary_busy_bound": primary_busy_bound, "aux_queue_length": aux_queue_length,
           "resend_after_s": resend_after_s, "dispatch": dispatch}
    if dispatch == "eta":
        out["rates"] = {**{">".join(p): path_rate(graph, p) for p in paths},  # a pair's key: its primary path
                        **{f"{a}>{b}": path_rate(graph, routed[(a, b)]) for a, b in pairs}}
    return out
