"""Baseline AllReduce schemes: parameter server, ring, all-to-all, balanced k-ary tree, MST.

These are the comparison points of the papers in ``shared/seeds``:

* ``ps`` — the star / Hub-and-Spokes parameter server of MXNET, the baseline every
  NetStorm result is normalised to (NetStorm §IX-A "MXNET"; Li et al., OSDI'14).
* ``ring`` — ring AllReduce (reduce-scatter then all-gather; Patarasuk & Yuan, JPDC 2009),
  discussed by MTREE §I/§II ("a ring cannot use all capacities, and a Hamiltonian ring may
  not exist") and compared against by TopoAdapt §VI.
* ``alltoall`` — direct all-to-all reduce-scatter/all-gather, i.e. the colocated sharded PS
  (every worker is the server of 1/n of the vector) of TopoAdapt §VI-B.
* ``bkt`` — MLNET's balanced k-way tree (Mai et al., HotCloud'15; NetStorm §II, §IX-A).
* ``mst`` — TSEngine's maximum-throughput spanning tree (Zhou et al., TNSM 2021; NetStorm
  §II "Zhou et al. [4] employ a minimum spanning tree ... prioritizing transmission over
  links with the highest data throughput").

Every planner is pure: it reads the WAN graph (directed edges with ``rate_mbps`` and
``delay_ms``) and returns a :class:`~testbed.plan.Plan`.  Transfers between nodes that
are not WAN neighbours simply name the far node as peer; the emulator routes them along
:func:`testbed.routing.shortest_paths`, and the meta records those paths.
"""

from __future__ import annotations

import networkx as nx

from testbed.plan import Plan, ProgramBuilder, Tree, split_lengths, trees_plan
from testbed.planners import NODE, NODES, Param, ParamError, planner
from testbed.planners.common import (
    ACTIVE,
    check_graph,
    members,
    parents_from_edges,
    partial,
    path_delay_ms,
    path_rate,
    tree_centre,
)
from testbed.routing import shortest_paths

PS_REF = "Parameter server / MXNET star (Li et al., OSDI'14; NetStorm paper §IX-A baseline 'MXNET')"
RING_REF = "Ring AllReduce (Patarasuk & Yuan, JPDC 2009); MTREE paper §I-II, TopoAdapt paper §VI baseline"
A2A_REF = "Direct all-to-all reduce-scatter + all-gather = colocated sharded PS (TopoAdapt paper §VI-B)"
BKT_REF = "MLNET balanced k-way tree (Mai et al., HotCloud'15); NetStorm paper §II Fig. 1c, §IX-A"
MST_REF = "TSEngine maximum-throughput spanning tree (Zhou et al., IEEE TNSM 2021); NetStorm paper §II Fig. 1d, §IX-A"

EXACT_RING_MAX_N = 10  # exact bottleneck-TSP search up to this many nodes (brief)


# ---------------------------------------------------------------------------
# Graph helpers
# ---------------------------------------------------------------------------
def incident_rate(graph: nx.DiGraph) -> dict[str, float]:
    """Total rate (Mbit/s) of every link touching a node, both directions added.

    This is the "max-bandwidth" criterion used to pick a PS hub or a tree root.
    """
    tot = {n: 0.0 for n in graph.nodes}
    for u, v, d in graph.edges(data=True):
        tot[u] += d["rate_mbps"]
        tot[v] += d["rate_mbps"]
    return tot


def max_bandwidth_node(graph: nx.DiGraph) -> str:
    """Node with the largest :func:`incident_rate`; ties go to the smallest name."""
    tot = incident_rate(graph)
    return min(graph.nodes, key=lambda n: (-tot[n], str(n)))


def min_latency_node(graph: nx.DiGraph, paths: dict) -> str:
    """Node minimising the sum of shortest-path one-way delays to and from all others."""
    delay = {n: 0.0 for n in graph.nodes}
    for (s, t), p in paths.items():
        d = path_delay_ms(graph, p)
        delay[s] += d
        delay[t] += d
    return min(graph.nodes, key=lambda n: (delay[n], str(n)))


def _hop_info(graph: nx.DiGraph, paths: dict, u: str, v: str) -> dict:
    p = paths[(u, v)]
    return {"src": u, "dst": v, "path": p, "rate_mbps": path_rate(graph, p),
            "delay_ms": path_delay_ms(graph, p)}


def _adjacent(graph: nx.DiGraph, u: str, v: str) -> bool:
    return graph.has_edge(u, v) or graph.has_edge(v, u)


# ---------------------------------------------------------------------------
# ps
# ---------------------------------------------------------------------------
@planner(
    "ps", PS_REF,
    hub=Param(str, "", "parameter-server node; empty = chosen by hub_rule", kind=NODE),
    hub_rule=Param(str, "max-bandwidth",
                   "how to pick the hub when hub is empty: node with the largest total incident "
                   "rate, node with the smallest summed shortest-path delay, or the first node",
                   choices=("max-bandwidth", "min-latency", "first")),
    shards=Param(int, 1, "split the vector into this many chunks so the push of one chunk overlaps "
                         "the reduction and pull of the previous one (pipelined PS); 1 = plain PS", ge=1),
    active=ACTIVE,
)
def plan_ps(graph: nx.DiGraph, length: int, *, elem_bytes: int = 4, hub: str = "",
            hub_rule: str = "max-bandwidth", shards: int = 1, active=None) -> Plan:
    """Parameter-server AllReduce over a star (NetStorm §IX-A baseline "MXNET").

    Every worker pushes its vector to the hub, the hub adds them into its own vector (the
    hub is also a worker) and pushes the sum back.  With ``shards > 1`` the vector is cut
    into chunks sent back-to-back on each worker's connection; the hub returns chunk c as
    soon as every worker's chunk c has arrived, overlapping push and pull (a choice: the
    brief's "pipelined PS").  Traffic to a non-adjacent hub is routed by IP.  With
    ``active`` only those workers push and get the sum (CREW §V-A's PS baseline of a partial
    reduce; the hub need not be one of them).
    """
    nodes = check_graph(graph, "ps")
    group = members(graph, active)
    paths = shortest_paths(graph)
    if hub:
        rule_used = "given"
    elif hub_rule == "max-bandwidth":
        hub, rule_used = max_bandwidth_node(graph), hub_rule
    elif hub_rule == "min-latency":
        hub, rule_used = min_latency_node(graph, paths), hub_rule
    else:
        hub, rule_used = nodes[0], hub_rule
    workers = [n for n in group if n != hub]
    b = ProgramBuilder(nodes)
    offset = 0
    for c, size in enumerate(split_lengths(length, [1] * shards)):
        if size == 0:
            continue
        pushed: dict[str, int] = {}
        at_hub: list[int] = []
        for w in workers:
            s, r = b.transfer(w, hub, offset, size, reduce=True, chunk=c, phase="reduce")
            pushed[w] = s
            at_hub.append(r)
        for w in workers:
            b.transfer(hub, w, offset, size, reduce=False, send_deps=at_hub,
                       recv_deps=[pushed[w]], chunk=c, phase="bcast")
        offset += size
    meta = {
        "hub": hub,
        "hub_rule": rule_used,
        "shards": shards,
        "incident_rate_mbps": incident_rate(graph),
        "push": [_hop_info(graph, paths, w, hub) for w in workers],
        "pull": [_hop_info(graph, paths, hub, w) for w in workers],
    }
    return Plan("ps", nodes, length, b.programs, participants=partial(nodes, group),
                receivers=partial(nodes, group), meta=meta)


# ---------------------------------------------------------------------------
# ring
# ---------------------------------------------------------------------------
def _ring_hops(order: list[str]) -> list[tuple[str, str]]:
    n = len(order)
    return [(order[i], order[(i + 1) % n]) for i in range(n)] if n > 1 else []


class _RingScorer:
    """:func:`ring_score` with each hop's routed links looked up once (link ids, rates and
    delays in lists), for the local search's many evaluations; the same arithmetic in the
    same order, so the same scores."""

    def __init__(self, graph: nx.DiGraph, paths: dict):
        self.graph, self.paths = graph, paths
        self.ids: dict[tuple[str, str], int] = {}
        self.rate: list[float] = []
        self.delay: list[float] = []
        self.hop: dict[tuple[str, str], list[int]] = {}

    def links(self, u: str, v: str) -> list[int]:
        out = self.hop.get((u, v))
        if out is None:
            p = self.paths[(u, v)]
            out = []
            for a, c in zip(p, p[1:]):
                k = self.ids.get((a, c))
                if k is None:
                    k = self.ids[(a, c)] = len(self.rate)
                    self.rate.append(self.graph[a][c]["rate_mbps"])
                    self.delay.append(self.graph[a][c].get("delay_ms", 0.0))
                out.append(k)
            self.hop[(u, v)] = out
        return out

    def __call__(self, order: list[str]) -> tuple[float, float]:
        n = len(order)
        if n <= 1:
            return (float("inf"), 0.0)
        hops = [self.links(order[i], order[(i + 1) % n]) for i in range(n)]
        load: dict[int, int] = {}
        for h in hops:
            for k in h:
                load[k] = load.get(k, 0) + 1
        worst, delay, rate, dl = float("inf"), 0.0, self.rate, self.delay
        for h in hops:
            for k in h:
                worst = min(worst, rate[k] / load[k])
                delay += dl[k]
        return (worst, -delay)


def ring_score(graph: nx.DiGraph, paths: dict, order: list[str]) -> tuple[float, float]:
    """(bottleneck effective hop rate, −total hop delay) of a ring; larger is better.

    All ring hops transmit at the same time, so hops whose routed paths share a directed
    link split it: a hop's effective rate is min over its links of rate / (#hops on the
    link).  This is the objective of the heuristic ring search (brief: TSP-bandwidth).
    """
    return _RingScorer(graph, paths)(order)


def _hamiltonian_exists(n: int, succ_mask: list[int]) -> bool:
    """Is there a directed Hamiltonian cycle?  Bitmask DP over paths from vertex 0
    (``ends[mask]`` = set of possible last vertices of a path covering ``mask``)."""
    if n == 1:
        return True
    full = (1 << n) - 1
    ends = [0] * (1 << n)
    ends[1] = 1
    pred_mask = [0] * n
    for u in range(n):
        m = succ_mask[u]
        for v in range(n):
            if m >> v & 1:
                pred_mask[v] |= 1 << u
    for mask in range(1, 1 << n):
        e = ends[mask]
        if not e or not mask & 1:
            continue
        for v in range(1, n):
            if not mask >> v & 1 and pred_mask[v] & e:
                ends[mask | 1 << v] |= 1 << v
    return bool(ends[full] & pred_mask[0])


def _min_delay_cycle(n: int, allowed: list[list[bool]], delay: list[list[float]]) -> list[int] | None:
    """Held–Karp: the Hamiltonian cycle (from vertex 0) of minimum total delay that uses
    only ``allowed`` directed hops; ties broken towards smaller vertex indices."""
    if n == 1:
        return [0]
    inf = float("inf")
    size = 1 << n
    best = [[inf] * n for _ in range(size)]
    prev = [[-1] * n for _ in range(size)]
    best[1][0] = 0.0
    for mask in range(1, size, 2):  # masks containing vertex 0
        row = best[mask]
        for u in range(n):
            cu = row[u]
            if cu == inf:
                continue
            for v in range(1, n):
                if mask >> v & 1 or not allowed[u][v]:
                    continue
                nm = mask | 1 << v
                c = cu + delay[u][v]
                if c < best[nm][v]:
                    best[nm][v] = c
                    prev[nm][v] = u
    full = size - 1
    last, cost = -1, inf
    for u in range(1, n):
        if allowed[u][0] and best[full][u] + delay[u][0] < cost:
            last, cost = u, best[full][u] + delay[u][0]
    if last < 0:
        return None
    cyc, mask, u = [], full, last
    while u != -1:
        cyc.append(u)
        u, mask = prev[mask][u], mask ^ (1 << u)
    return cyc[::-1]


def bottleneck_ring_exact(nodes: list[str], rate: dict, delay: dict) -> list[str] | None:
    """Exact bottleneck TSP: the Hamiltonian cycle over the directed hops in ``rate``
    maximising the minimum hop rate, then minimising the summed hop delay.

    Binary search on the rate threshold with a Hamiltonicity DP, then Held–Karp for the
    delay tie-break.  Exponential in n (used for n ≤ 10).  Returns None if no
    Hamiltonian cycle exists over the given hops.
    """
    n = len(nodes)
    idx = {v: i for i, v in enumerate(nodes)}
    thresholds = sorted(set(rate.values()), reverse=True)

    def masks(thr: float) -> list[int]:
        m = [0] * n
        for (u, v), r in rate.items():
            if r >= thr:
                m[idx[u]] |= 1 << idx[v]
        return m

    if n > 1 and (not thresholds or not _hamiltonian_exists(n, masks(thresholds[-1]))):
        return None
    lo, hi = 0, len(thresholds) - 1  # find the smallest index (largest rate) that is feasible
    while lo < hi:
        mid = (lo + hi) // 2
        if _hamiltonian_exists(n, masks(thresholds[mid])):
            hi = mid
        else:
            lo = mid + 1
    thr = thresholds[lo] if thresholds else 0.0
    allowed = [[False] * n for _ in range(n)]
    dl = [[0.0] * n for _ in range(n)]
    for (u, v), r in rate.items():
        allowed[idx[u]][idx[v]] = r >= thr
        dl[idx[u]][idx[v]] = delay[(u, v)]
    cyc = _min_delay_cycle(n, allowed, dl)
    return None if cyc is None else [nodes[i] for i in cyc]


def greedy_ring(graph: nx.DiGraph, paths: dict, nodes: list[str]) -> list[str]:
    """Widest-next-hop construction: start at the max-bandwidth node and repeatedly move
    to the unvisited node with (adjacent first) the fastest routed hop, then lowest delay."""
    start = max_bandwidth_node(graph)
    order, left = [start], set(nodes) - {start}
    while left:
        u = order[-1]
        v = min(left, key=lambda w: (not graph.has_edge(u, w), -path_rate(graph, paths[(u, w)]),
                                     path_delay_ms(graph, paths[(u, w)]), str(w)))
        order.append(v)
        left.discard(v)
    return order


def improve_ring(graph: nx.DiGraph, paths: dict, order: list[str], max_rounds: int = 50,
                 max_evaluations: int = 20000) -> list[str]:
    """Local search on :func:`ring_score`: 2-opt (segment reversal) and node relocation,
    first improvement, until no move helps, ``max_rounds`` passes or ``max_evaluations``
    rings scored (a pass costs ~2 n^2 evaluations of O(n) each: the budget binds only on
    large WANs, ~200 nodes, and counts work, not seconds, so the ring is the same on any
    machine)."""
    n = len(order)
    best = list(order)
    score_of = _RingScorer(graph, paths)
    score = score_of(best)
    evals = 0
    for _ in range(max_rounds):
        improved = False
        for i in range(1, n - 1):
            for j in range(i + 1, n):
                if evals >= max_evaluations:
                    return best
                evals += 1
                cand = best[:i] + best[i:j + 1][::-1] + best[j + 1:]
                s = score_of(cand)
                if s > score:
                    best, score, improved = cand, s, True
        for i in range(n):
            for j in range(n):
                if i == j:
                    continue
                if evals >= max_evaluations:
                    return best
                evals += 1
                rest = best[:i] + best[i + 1:]
                cand = rest[:j] + [best[i]] + rest[j:]
                s = score_of(cand)
                if s > score:
                    best, score, improved = cand, s, True
        if not improved:
            break
    return best


def choose_ring(graph: nx.DiGraph, paths: dict, nodes: list[str]) -> tuple[list[str], dict]:
    """The ``tsp-bandwidth`` ring rule (brief).

    1. n ≤ 10: exact search for a Hamiltonian cycle over WAN links (hops between adjacent
       nodes only) maximising the minimum hop rate, ties by total delay.
    2. Otherwise (no Hamiltonian cycle, or n > 10): a cycle over routed shortest paths.
       For n ≤ 10 the start is the exact bottleneck cycle over the metric closure (hop rate =
       bottleneck of the routed path), for larger n the greedy widest-next-hop cycle; both
       are refined by 2-opt/relocation on :func:`ring_score`, which accounts for hops that
       share a link.  For n > 10 the heuristic may still find a Hamiltonian cycle; it is
       reported as such when every hop is a WAN link.
    Hop rates are the bottleneck of each hop's *routed* path (what the traffic sees).
    """
    n = len(nodes)
    ordered = sorted(nodes, key=str)
    info: dict = {}
    if n <= 2:
        return ordered, {"search": "trivial"}
    rate_all = {(u, v): path_rate(graph, paths[(u, v)]) for u in nodes for v in nodes if u != v}
    delay_all = {(u, v): path_delay_ms(graph, paths[(u, v)]) for u in nodes for v in nodes if u != v}
    if n <= EXACT_RING_MAX_N:
        adj = {e: r for e, r in rate_all.items() if graph.has_edge(*e)}
        ring = bottleneck_ring_exact(ordered, adj, delay_all)
        if ring is not None:
            return ring, {"search": "exact-hamiltonian"}
        start = bottleneck_ring_exact(ordered, rate_all, delay_all)
        info["search"] = "exact-closure+local-search"
    else:
        start = greedy_ring(graph, paths, ordered)
        info["search"] = "greedy+local-search"
    return improve_ring(graph, paths, start), info


def _ring_meta(graph: nx.DiGraph, paths: dict, order: list[str]) -> dict:
    hops = [_hop_info(graph, paths, u, v) for u, v in _ring_hops(order)]
    load: dict[tuple[str, str], int] = {}
    for h in hops:
        for e in zip(h["path"], h["path"][1:]):
            load[e] = load.get(e, 0) + 1
    for h in hops:
        h["effective_rate_mbps"] = min(graph[a][c]["rate_mbps"] / load[(a, c)]
                                       for a, c in zip(h["path"], h["path"][1:]))
    return {
        "hops": hops,
        "hamiltonian": all(graph.has_edge(u, v) for u, v in _ring_hops(order)),
        "min_hop_rate_mbps": min((h["rate_mbps"] for h in hops), default=0.0),
        "bottleneck_rate_mbps": min((h["effective_rate_mbps"] for h in hops), default=0.0),
    }


@planner(
    "ring", RING_REF,
    order=Param((list, tuple), (), "ring order as a list of node names (implies ring_rule='given'); "
                                   "empty = chosen by ring_rule", kind=NODES),
    ring_rule=Param(str, "tsp-bandwidth",
                    "tsp-bandwidth: Hamiltonian cycle maximising the minimum hop rate (exact for "
                    "n <= 10, greedy + 2-opt beyond), else a cycle over shortest paths; given: use "
                    "order; name-order: nodes sorted by name",
                    choices=("tsp-bandwidth", "given", "name-order")),
    chunks=Param(int, 1, "split each of the n blocks into this many chunks that pipeline through the steps",
                 ge=1),
    active=ACTIVE,
)
def plan_ring(graph: nx.DiGraph, length: int, *, elem_bytes: int = 4, order=(),
              ring_rule: str = "tsp-bandwidth", chunks: int = 1, active=None) -> Plan:
    """Ring AllReduce: reduce-scatter (n−1 steps) then all-gather (n−1 steps).

    The vector is cut into n blocks; block i is owned by ring position i.  In
    reduce-scatter step s (0-based) position p adds the partial block (p−1−s) mod n into
    what it receives and passes it to p+1, so block i starts at i+1 and is complete at i
    after n−1 hops; all-gather then carries block i from i around the ring, overwriting.
    With ``chunks > 1`` every block is cut into chunks that move independently, so chunk
    c+1 of a step overlaps chunk c of the next step.  Each hop uses one connection (FIFO).
    Hops between non-adjacent ring neighbours are routed (MTREE §II: "a Hamiltonian ring
    may not exist").  With ``active`` the ring runs over those workers only (CREW §V-A's
    ring baseline of a partial reduce); the others only forward routed traffic.
    """
    nodes = check_graph(graph, "ring")
    group = members(graph, active)
    paths = shortest_paths(graph)
    ring, rule_used, info = _ring_order(graph, paths, group, list(order or ()), ring_rule)
    n = len(ring)
    b = ProgramBuilder(nodes)
    blocks = split_lengths(length, [1] * n)
    starts = [sum(blocks[:i]) for i in range(n)]
    for i in range(n):  # block i, owned by ring position i
        if blocks[i] == 0 or n == 1:
            continue
        off = starts[i]
        for c, csize in enumerate(split_lengths(blocks[i], [1] * min(chunks, blocks[i]))):
            _ring_chunk(b, ring, i, off, csize, dict(chunk=c, flow=i))
            off += csize
    meta = {
        "ring": ring,
        "ring_rule": rule_used,
        **info,
        **_ring_meta(graph, paths, ring),
        "blocks": blocks,
        "chunks": chunks,
    }
    return Plan("ring", nodes, length, b.programs, participants=partial(nodes, group),
                receivers=partial(nodes, group), meta=meta)


def _ring_order(graph: nx.DiGraph, paths: dict, group: list[str], order: list[str], ring_rule: str
                ) -> tuple[list[str], str, dict]:
    """The ring: ``order`` when given, else by ``ring_rule`` (name order, or
    :func:`choose_ring`'s search).  Returns (ring, the rule used, the search's info)."""
    if order:
        if set(order) != set(group) or len(set(order)) != len(order):
            raise ParamError("order", f"must list every ring member exactly once; they are {sorted(group)}")
        return order, "given", {"search": "given"}
    if ring_rule == "given":
        raise ParamError("order", "ring_rule 'given' needs a non-empty order")
    if ring_rule == "name-order":
        return sorted(group, key=str), ring_rule, {"search": "name-order"}
    ring, info = choose_ring(graph, paths, group)
    return ring, ring_rule, info


def _ring_chunk(b: ProgramBuilder, ring: list[str], i: int, off: int, csize: int, label: dict) -> None:
    """One chunk of block i (owned by ring position i) around the ring: n-1 reduce-scatter
    hops from position i+1 to i, then n-1 all-gather hops from i; each all-gather receive
    overwrites only after that position's reduce-scatter send has read the data."""
    n = len(ring)
    rs_send: dict[int, int] = {}
    last_recv: list[int] = []
    for s in range(n - 1):  # reduce-scatter: position i+1+s sends to i+2+s
        p = (i + 1 + s) % n
        q = (p + 1) % n
        sid, rid = b.transfer(ring[p], ring[q], off, csize, reduce=True, send_deps=last_recv,
                              phase="reduce-scatter", **label)
        rs_send[p] = sid
        last_recv = [rid]
    for s in range(n - 1):  # all-gather: position i+s sends to i+s+1
        p = (i + s) % n
        q = (p + 1) % n
        _, rid = b.transfer(ring[p], ring[q], off, csize, reduce=False, send_deps=last_recv,
                            recv_deps=[rs_send[q]], phase="all-gather", **label)
        last_recv = [rid]


# ---------------------------------------------------------------------------
# alltoall
# ---------------------------------------------------------------------------
@planner(
    "alltoall", A2A_REF,
    shard_rule=Param(str, "equal", "shard sizes: equal, or proportional to each owner's total "
                                   "incident rate (bandwidth)", choices=("equal", "bandwidth")),
    active=ACTIVE,
)
def plan_alltoall(graph: nx.DiGraph, length: int, *, elem_bytes: int = 4,
                  shard_rule: str = "equal", active=None) -> Plan:
    """Direct all-to-all AllReduce (colocated sharded PS, TopoAdapt §VI-B baseline).

    The vector is split into n shards, shard j owned by node j.  Every node sends shard j
    straight to node j (reduce-scatter); once node j has every contribution it sends the
    reduced shard back to everyone (all-gather).  Non-adjacent pairs are routed.  With
    ``active`` only those workers take part (CREW §V-A's all-to-all baseline over a group P:
    shards owned by P's members, traffic routed through the others).
    """
    nodes = check_graph(graph, "alltoall")
    group = members(graph, active)
    tot = incident_rate(graph)
    if shard_rule == "equal":
        weights = [1.0] * len(group)
    else:
        weights = [tot[n] for n in group] if len(group) > 1 else [1.0]
    shards = split_lengths(length, weights)
    b = ProgramBuilder(nodes)
    off = 0
    for j, owner in enumerate(group):
        size = shards[j]
        if size == 0:
            continue
        sent: dict[str, int] = {}
        got: list[int] = []
        for src in group:
            if src != owner:
                s, r = b.transfer(src, owner, off, size, reduce=True, flow=j, phase="reduce")
                sent[src] = s
                got.append(r)
        for dst in group:
            if dst != owner:
                b.transfer(owner, dst, off, size, reduce=False, send_deps=got, recv_deps=[sent[dst]],
                           flow=j, phase="bcast")
        off += size
    meta = {
        "shard_rule": shard_rule,
        "shards": {n: s for n, s in zip(group, shards)},
        "incident_rate_mbps": tot,
    }
    return Plan("alltoall", nodes, length, b.programs, participants=partial(nodes, group),
                receivers=partial(nodes, group), meta=meta)


# ---------------------------------------------------------------------------
# trees: bkt and mst
# ---------------------------------------------------------------------------
def bfs_order(graph: nx.DiGraph, root: str) -> list[str]:
    """Breadth-first order of the (undirected) WAN graph from ``root``, neighbours by name."""
    und = graph.to_undirected(as_view=True)
    return [root] + [v for _, v in nx.bfs_edges(und, root, sort_neighbors=lambda ns: sorted(ns, key=str))]


def _heap_parent(seq: list[str], k: int) -> dict[str, str | None]:
    """Complete k-ary tree over ``seq``: slot i's parent is slot (i−1)//k."""
    return {v: (None if i == 0 else seq[(i - 1) // k]) for i, v in enumerate(seq)}


def _layout_score(graph: nx.DiGraph, hops: dict, seq: list[str], k: int) -> tuple[int, int]:
    """(tree edges that are WAN links, −routed hops of all tree edges); larger is better."""
    adj = routed = 0
    for i in range(1, len(seq)):
        p, v = seq[(i - 1) // k], seq[i]
        adj += _adjacent(graph, p, v)
        routed += hops[(v, p)] + hops[(p, v)]
    return adj, -routed


def balanced_kary_tree(graph: nx.DiGraph, root: str, k: int, layout: str) -> dict[str, str | None]:
    """Parent map of a balanced (complete) k-ary tree over all nodes (MLNET's BKT).

    The shape is fixed: slot i's parent is slot (i−1)//k, so every level is full except
    the last and depths differ by at most one (NetStorm §II).  Nodes fill the slots:

    * ``bfs-adjacent`` (default): start from the better of the BFS heap layout and a
      greedy fill (each slot takes the first node in BFS order that is a WAN neighbour of
      the slot's parent), then swap pairs of non-root nodes while that raises the number
      of tree edges that are WAN links (ties: fewer routed hops) — so tree neighbours tend
      to be WAN neighbours, as the brief asks; link *rates* are ignored (BKT is the
      "regular balanced tree" NetStorm criticises);
    * ``bfs``: slots take the BFS order from the root as is (heap layout);
    * ``name``: root first, then the other nodes by name ("a balanced k-ary tree by node
      index", the reading note's suggestion).
    """
    if layout == "name":
        return _heap_parent([root] + sorted((n for n in graph.nodes if n != root), key=str), k)
    seq = bfs_order(graph, root)
    if layout == "bfs":
        return _heap_parent(seq, k)
    greedy = [root]
    for i in range(1, len(seq)):
        p = greedy[(i - 1) // k]
        cands = [v for v in seq if v not in greedy]
        near = [v for v in cands if _adjacent(graph, p, v)]
        greedy.append((near or cands)[0])
    hops = {pair: len(path) - 1 for pair, path in shortest_paths(graph).items()}
    best = max((seq, greedy), key=lambda s: _layout_score(graph, hops, s, k))
    score = _layout_score(graph, hops, best, k)
    improved = True
    while improved:
        improved = False
        for i in range(1, len(best)):
            for j in range(i + 1, len(best)):
                cand = list(best)
                cand[i], cand[j] = cand[j], cand[i]
                sc = _layout_score(graph, hops, cand, k)
                if sc > score:
                    best, score, improved = cand, sc, True
    return _heap_parent(best, k)


def _sym_rate(graph: nx.DiGraph, u: str, v: str) -> float:
    rates = [graph[a][c]["rate_mbps"] for a, c in ((u, v), (v, u)) if graph.has_edge(a, c)]
    return min(rates)


def _sym_delay(graph: nx.DiGraph, u: str, v: str) -> float:
    ds = [graph[a][c].get("delay_ms", 0.0) for a, c in ((u, v), (v, u)) if graph.has_edge(a, c)]
    return sum(ds) / len(ds)


def max_spanning_tree(graph: nx.DiGraph) -> list[tuple[str, str, float]]:
    """Kruskal maximum spanning tree of the undirected WAN graph (TSEngine, NetStorm §II).

    Edge weight: min(rate u→v, rate v→u) — a tree edge carries reduce traffic one way and
    broadcast traffic the other, so the slower direction is what the edge offers (a
    choice; with a one-way link only its rate counts).  Ties: lower mean delay, then names.
    """
    und: dict[tuple[str, str], float] = {}
    for u, v in graph.edges:
        a, c = sorted((u, v), key=str)
        und[(a, c)] = _sym_rate(graph, a, c)
    edges = sorted(und.items(), key=lambda kv: (-kv[1], _sym_delay(graph, *kv[0]), str(kv[0][0]), str(kv[0][1])))
    comp = nx.utils.UnionFind(graph.nodes)
    out = []
    for (a, c), w in edges:
        if comp[a] != comp[c]:
            comp.union(a, c)
            out.append((a, c, w))
    return out


def _tree_edges_meta(graph: nx.DiGraph, paths: dict, parent: dict) -> list[dict]:
    out = []
    for c, p in parent.items():
        if p is None:
            continue
        up, down = paths[(c, p)], paths[(p, c)]
        out.append({"child": c, "parent": p, "path_up": up, "path_down": down,
                    "rate_up_mbps": path_rate(graph, up), "rate_down_mbps": path_rate(graph, down),
                    "adjacent": _adjacent(graph, c, p)})
    return out


def _tree_result(scheme: str, graph: nx.DiGraph, nodes: list[str], length: int, root: str,
                 parent: dict, chunks: int, meta: dict) -> Plan:
    paths = shortest_paths(graph)
    edges = _tree_edges_meta(graph, paths, parent)
    rate = min((min(e["rate_up_mbps"], e["rate_down_mbps"]) for e in edges), default=0.0)
    tree = Tree(root, parent, share=1.0, chunks=chunks, rate_mbps=rate)
    meta = {**meta, "root": root, "chunks": chunks, "tree_edges": edges,
            "bottleneck_rate_mbps": rate, "height": tree.height()}
    return trees_plan(scheme, nodes, length, [tree], meta=meta)


@planner(
    "bkt", BKT_REF,
    k=Param(int, 2, "tree arity (MLNET's k is not given in the NetStorm paper; 2-3 are sensible)", ge=1),
    root=Param(str, "", "root node; empty = the node with the largest total incident rate", kind=NODE),
    chunks=Param(int, 1, "pipelined chunks (1 = no pipelining)", ge=1),
    layout=Param(str, "bfs-adjacent",
                 "how nodes fill the tree slots: bfs-adjacent (BFS layout refined to maximise tree "
                 "edges that are WAN links), bfs (plain BFS heap layout), name (root, then by name)",
                 choices=("bfs-adjacent", "bfs", "name")),
)
def plan_bkt(graph: nx.DiGraph, length: int, *, elem_bytes: int = 4, k: int = 2, root: str = "",
             chunks: int = 1, layout: str = "bfs-adjacent") -> Plan:
    """MLNET balanced k-way tree (NetStorm §II Fig. 1c and §IX-A baseline "MLNET").

    Reduce up and broadcast down one balanced k-ary tree, compiled with
    :func:`~testbed.plan.trees_plan`.  The tree ignores link rates (it is the "regular
    balanced tree" NetStorm criticises); only the slot filling looks at adjacency so tree
    edges tend to be WAN links.  Non-adjacent tree edges are routed.
    """
    nodes = check_graph(graph, "bkt")
    root = root or max_bandwidth_node(graph)
    parent = balanced_kary_tree(graph, root, k, layout)
    return _tree_result("bkt", graph, nodes, length, root, parent, chunks, {"k": k, "layout": layout})


@planner(
    "mst", MST_REF,
    root=Param(str, "", "root node; empty = the tree's centre (smallest reduce-then-broadcast round trip)",
               kind=NODE),
    chunks=Param(int, 1, "pipelined chunks (1 = no pipelining)", ge=1),
)
def plan_mst(graph: nx.DiGraph, length: int, *, elem_bytes: int = 4, root: str = "",
             chunks: int = 1) -> Plan:
    """TSEngine maximum-bandwidth spanning tree (NetStorm §II Fig. 1d, §IX-A "TSEngine").

    Maximum spanning tree of the undirected WAN graph weighted by min(rate u→v, v→u)
    (:func:`max_spanning_tree`), rooted at ``root`` or at :func:`tree_centre`, then
    reduce-then-broadcast with :func:`~testbed.plan.trees_plan`.  TSEngine measures links
    with RTT stop-and-wait (NetStorm App. B); the cost model's ``stop_and_wait`` option
    reproduces that transport behaviour.
    """
    nodes = check_graph(graph, "mst")
    edges = max_spanning_tree(graph)
    pairs = [(a, c) for a, c, _ in edges]
    root, rule = (root, "given") if root else (tree_centre(graph, nodes, pairs), "centre")
    parent = parents_from_edges(nodes, pairs, root)
    meta = {"root_rule": rule, "mst_edges": [{"u": a, "v": c, "rate_mbps": w} for a, c, w in edges]}
    return _tree_result("mst", graph, nodes, length, root, parent, chunks, meta)
