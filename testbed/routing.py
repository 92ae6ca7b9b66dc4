"""Routes between datacenters that are not adjacent on the WAN.

The emulator installs these as IP routes on the hosts (each host forwards), and the cost
model charges multi-hop transfers along the same paths, so both agree.  Paths are
latency-shortest (sum of one-way ``delay_ms``), ties broken by hop count and then by node
names, so routing is deterministic for a given topology.
"""

from __future__ import annotations

import heapq

import networkx as nx


def shortest_paths(graph: nx.DiGraph, sources=None) -> dict[tuple[str, str], list[str]]:
    """Path (list of nodes, both ends included) for every ordered pair of distinct nodes
    that are connected, from each of ``sources`` (default: every node).  Weight:
    (delay_ms, hops, path) — lexicographic."""
    paths: dict[tuple[str, str], list[str]] = {}
    for src in graph.nodes if sources is None else sources:
        best: dict[str, tuple] = {}
        heap = [(0.0, 0, [src])]
        while heap:
            delay, hops, path = heapq.heappop(heap)
            u = path[-1]
            if u in best:
                continue
            best[u] = (delay, hops, path)
            for v in sorted(graph.successors(u)):
                if v not in best:
                    heapq.heappush(heap, (delay + graph[u][v].get("delay_ms", 0.0), hops + 1, path + [v]))
        for dst, (_, _, path) in best.items():
            if dst != src:
                paths[(src, dst)] = path
    return paths


def data_paths(graph: nx.DiGraph) -> dict[tuple[str, str], list[str]]:
    """The path data between two datacenters takes in the emulator: the direct WAN link
    for neighbours (agents address a neighbour by its link address), the latency-shortest
    path otherwise (agents use the node address, which is routed)."""
    n = graph.number_of_nodes()
    paths = shortest_paths(graph, [u for u in graph.nodes if graph.out_degree(u) < n - 1])  # (full mesh: none)
    for u, v in graph.edges:
        paths[(u, v)] = [u, v]
    return paths
