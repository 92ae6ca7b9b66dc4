"""What several planners share: graph checks, the workers of a collective, path rates and
delays, parent maps, tree round trips and centres, the undirected view of the WAN, and the
per-link loads of trees, minimum spanning arborescences (Chu-Liu/Edmonds).  Pure functions, no scheme registered here."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import networkx as nx
import numpy as np

from testbed.errors import ConfigError
from testbed.plan import Tree, contended_pacing
from testbed.planners import NODES, Param, ParamError

INF = float("inf")


# ---------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------
def check_graph(graph: nx.DiGraph, scheme: str, *, min_nodes: int = 1, connected: bool = True) -> list[str]:
    """The WAN's nodes, after checking that it has at least ``min_nodes`` of them, positive
    link rates and (``connected``) every pair routable: every scheme but forest packing
    (which checks reachability of its active workers itself) talks across the whole WAN."""
    nodes = list(graph.nodes)
    if len(nodes) < min_nodes:
        raise ConfigError(f"{scheme} needs at least {min_nodes} datacenter(s), the topology has {len(nodes)}")
    if connected and len(nodes) > 1 and not nx.is_strongly_connected(graph):
        raise ConfigError(f"{scheme}: the topology is not (strongly) connected: some nodes cannot reach others")
    for u, v, d in graph.edges(data=True):
        if not d.get("rate_mbps", 0) > 0:
            raise ConfigError(f"{scheme}: link {u}->{v} has no positive rate_mbps")
    return nodes


ACTIVE = Param((list, type(None)), None, "the workers of a partial reduce (they contribute and get the "
                                          "result); null = every node (AllReduce)", kind=NODES)


def is_auto(name: str, value) -> bool:
    """Whether a parameter that takes an integer >= 0 or 'auto' is 'auto'; ParamError naming
    ``name`` when it is neither."""
    if value == "auto":
        return True
    if not isinstance(value, int) or value < 0:
        raise ParamError(name, f"expected an integer >= 0 or 'auto', got {value!r}")
    return False


def chunked(compiled, chunks: int | str, candidates: Sequence[int], graph: nx.DiGraph, elem_bytes: int,
            patience: int | None = None):
    """``compiled(chunks)``'s plan; with ``chunks: auto`` the plan of the count among
    ``candidates`` that :func:`testbed.costmodel.fastest` picks (``patience``: its early
    stop), every predicted count's CCT in ``plan.meta["chunk_cct_s"]``."""
    from testbed import costmodel

    if not is_auto("chunks", chunks):
        return compiled(chunks)
    (_, plan), cct = costmodel.fastest(((c, compiled(c)) for c in candidates), graph, elem_bytes, patience)
    plan.meta["chunk_cct_s"] = cct
    return plan


def members(graph: nx.DiGraph, active) -> list[str]:
    """The workers of the collective: ``active`` (at least two, distinct) in graph order, or all."""
    if active is None:
        return list(graph.nodes)
    if len(set(active)) != len(active) or len(active) < 2:
        raise ParamError("active", f"needs at least two distinct workers, got {list(active)}")
    return [n for n in graph.nodes if n in set(active)]


def group_view(graph: nx.DiGraph, group: list[str]) -> nx.DiGraph:
    """The WAN as the workers of a group P see it (CREW §V-A: BLINK and ToA build their trees
    "for P"): a full mesh over P whose edge i->j is the routed path data takes in the
    emulator (:func:`testbed.routing.data_paths`), at its bottleneck rate and summed delay.
    A tree edge between non-neighbours is then a routed transfer, as in ``ps`` and ``ring``."""
    from testbed.routing import data_paths

    paths = data_paths(graph)
    g = nx.DiGraph()
    g.add_nodes_from((n, graph.nodes[n]) for n in group)
    for i in group:
        for j in group:
            if i != j:
                path = paths[(i, j)]
                attrs = dict(graph[i][j]) if graph.has_edge(i, j) else {}
                g.add_edge(i, j, **{**attrs, "rate_mbps": path_rate(graph, path),
                                    "delay_ms": path_delay_ms(graph, path), "hops": len(path) - 1})
    return g


def widen(plan, nodes: list[str], group: list[str]):
    """A plan made on :func:`group_view` as a plan of every node (those outside P have no
    program) with P its participants and receivers."""
    from testbed.plan import Plan

    return Plan(plan.scheme, list(nodes), plan.length, {n: plan.programs.get(n, []) for n in nodes},
                participants=list(group), receivers=list(group), scratch=plan.scratch,
                meta={**plan.meta, "active": list(group)}, aux=plan.aux)


def partial(nodes: list[str], workers: list[str]) -> list[str] | None:
    """Plan participants/receivers: None (every node) unless only some nodes take part."""
    return None if len(workers) == len(nodes) else workers


# ---------------------------------------------------------------------------
# Paths
# ---------------------------------------------------------------------------
def path_rate(graph: nx.DiGraph, path: Sequence[str]) -> float:
    """Bottleneck rate (Mbit/s) along a routed path."""
    return min(graph[a][b]["rate_mbps"] for a, b in zip(path, path[1:]))


def path_delay_ms(graph: nx.DiGraph, path: Sequence[str]) -> float:
    """One-way delay (ms) along a node path: the sum of per-direction ``delay_ms``."""
    return sum(graph[a][b].get("delay_ms", 0.0) for a, b in zip(path, path[1:]))


def path_delay_s(graph: nx.DiGraph, path: Sequence[str]) -> float:
    """:func:`path_delay_ms` in seconds."""
    return path_delay_ms(graph, path) / 1e3


def _hop_delay_s(graph: nx.DiGraph, a: str, b: str, paths: Mapping | None) -> float:
    if graph.has_edge(a, b):
        return float(graph[a][b].get("delay_ms", 0.0)) / 1e3
    if paths is None:
        raise ValueError(f"{a}->{b} is not a link; pass routes")
    return path_delay_s(graph, paths[(a, b)])


# ---------------------------------------------------------------------------
# Trees
# ---------------------------------------------------------------------------
def parents_from_edges(nodes: Iterable[str], edge_pairs: Iterable[tuple[str, str]], root: str
                       ) -> dict[str, str | None]:
    """Orient an undirected tree (pairs of names) away from ``root``: node -> parent, in
    breadth-first order (neighbours by name)."""
    tree = nx.Graph(list(edge_pairs))
    tree.add_node(root)
    parent: dict[str, str | None] = {root: None}
    parent.update((v, u) for u, v in nx.bfs_edges(tree, root, sort_neighbors=sorted))
    missing = set(nodes) - set(parent)
    if missing:
        raise ValueError(f"edges do not span {sorted(missing)}")
    return parent


def tree_roundtrip_s(graph: nx.DiGraph, parent: Mapping[str, str | None],
                     paths: Mapping | None = None) -> float:
    """Latency of one reduce-then-broadcast over a rooted tree (seconds): the largest
    leaf->root delay (reduce) plus the largest root->leaf delay (broadcast), with
    per-direction link delays.  Logical (multi-hop) tree edges use ``paths``."""
    up: dict[str, float] = {}
    down: dict[str, float] = {}

    def resolve(n: str) -> None:
        chain = []
        while n not in up:
            p = parent[n]
            if p is None:
                up[n] = down[n] = 0.0
                break
            chain.append(n)
            n = p
        for c in reversed(chain):
            p = parent[c]
            up[c] = up[p] + _hop_delay_s(graph, c, p, paths)
            down[c] = down[p] + _hop_delay_s(graph, p, c, paths)

    for n in parent:
        resolve(n)
    return max(up.values()) + max(down.values())


def tree_centre(graph: nx.DiGraph, nodes: Sequence[str], edge_pairs: Sequence[tuple[str, str]]) -> str:
    """The root minimising :func:`tree_roundtrip_s` of the tree ``edge_pairs``; ties (within
    1e-12 s, e.g. a WAN without delays) by hop height, then by the smallest name."""
    best, best_key = None, (INF, 0)
    for r in sorted(nodes):
        parent = parents_from_edges(nodes, edge_pairs, r)
        t, h = tree_roundtrip_s(graph, parent), Tree(r, parent).height()
        if t < best_key[0] - 1e-12 or (t <= best_key[0] + 1e-12 and h < best_key[1]):
            best, best_key = r, (t, h)
    return best


def min_arborescence(n: int, edges: list[tuple[int, int, float]], root: int) -> list[int]:
    """Chu-Liu/Edmonds minimum spanning out-arborescence, O(n * |edges|).

    Nodes are 0..n-1; ``edges`` are (u, v, weight).  Returns the indices of the chosen
    edges (one entering every node but the root); ties go to the lower edge index, so the
    result is deterministic.  Raises ValueError if some node is unreachable from the root.
    (networkx's implementation copies graphs at every step and is ~30-50x slower here.)
    """
    E = [(u, v, float(w), i) for i, (u, v, w) in enumerate(edges) if u != v and v != root]
    return [E[j][3] for j in _cle(n, E, root)] if n > 1 else []


def _cle(n: int, E: list[tuple[int, int, float, int]], root: int) -> list[int]:
    in_w = [float("inf")] * n
    in_e = [-1] * n
    for i, (u, v, w, _) in enumerate(E):
        if u != v and v != root and w < in_w[v]:
            in_w[v], in_e[v] = w, i
    for v in range(n):
        if v != root and in_e[v] < 0:
            raise ValueError("node unreachable from the root")
    cyc = [-1] * n
    mark = [-1] * n
    k = 0
    for v in range(n):
        x = v
        while x != root and mark[x] == -1 and cyc[x] == -1:
            mark[x] = v
            x = E[in_e[x]][0]
        if x != root and mark[x] == v and cyc[x] == -1:
            y = x
            while True:
                cyc[y] = k
                y = E[in_e[y]][0]
                if y == x:
                    break
            k += 1
    if k == 0:
        return [in_e[v] for v in range(n) if v != root]
    ncyc = k
    for v in range(n):
        if cyc[v] == -1:
            cyc[v] = k
            k += 1
    E2 = []
    for i, (u, v, w, _) in enumerate(E):
        if cyc[u] != cyc[v]:
            E2.append((cyc[u], cyc[v], w - in_w[v], i))
    chosen = [E2[j][3] for j in _cle(k, E2, cyc[root])]
    entered = {E[i][1] for i in chosen if cyc[E[i][1]] < ncyc}
    for v in range(n):
        if cyc[v] < ncyc and v not in entered:
            chosen.append(in_e[v])
    return chosen


def tree_link_loads(graph: nx.DiGraph, trees: Iterable[Tree], paths: Mapping | None = None
                    ) -> dict[tuple[str, str], float]:
    """Per-direction load (Mbit/s) of trees running at ``tree.rate_mbps``: the rate on
    every hop of :meth:`Tree.links` (child->parent up the reduce tree, parent->child down
    the broadcast tree).  A hop that is not a WAN link is charged on every link of its
    route in ``paths`` (latency-shortest routes, :func:`testbed.routing.shortest_paths`)."""
    load: dict[tuple[str, str], float] = defaultdict(float)
    for t in trees:
        for a, b in t.links():
            route = [a, b] if graph.has_edge(a, b) else paths[(a, b)]
            for x, y in zip(route, route[1:]):
                load[(x, y)] += t.rate_mbps
    return dict(load)


def max_utilisation(graph: nx.DiGraph, loads: Mapping[tuple[str, str], float]) -> float:
    """max over directed links of load / rate_mbps."""
    return max((l / float(graph[a][b]["rate_mbps"]) for (a, b), l in loads.items()), default=0.0)


# ---------------------------------------------------------------------------
# Undirected view of the WAN.
# ---------------------------------------------------------------------------
@dataclass
class WanView:
    """Undirected view of a directed WAN graph (tree capacities, symmetric latency).

    ``edges[k] = (i, j)`` with ``i < j`` indexes into ``nodes`` (sorted names);
    ``cap[k] = min(rate(i->j), rate(j->i))`` Mbit/s and ``delay_ms[k] = max(delay(i->j),
    delay(j->i))`` (one-way, ms).  Links with only one direction are dropped: a tree
    needs both directions (reduce up, broadcast down).
    """

    nodes: list[str]
    edges: list[tuple[int, int]]
    cap: np.ndarray
    delay_ms: np.ndarray
    index: dict[str, int] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.nodes)

    @property
    def m(self) -> int:
        return len(self.edges)

    def edge_index(self) -> dict[tuple[int, int], int]:
        """(i, j) -> k for both orientations."""
        d = {}
        for k, (i, j) in enumerate(self.edges):
            d[(i, j)] = k
            d[(j, i)] = k
        return d

    def names(self, k: int) -> tuple[str, str]:
        i, j = self.edges[k]
        return self.nodes[i], self.nodes[j]


def wan_view(graph: nx.DiGraph, nodes: Iterable[str] | None = None) -> WanView:
    """Build the :class:`WanView` of ``graph`` (restricted to ``nodes`` if given:
    the induced subgraph).  Nodes are sorted by name so results are deterministic."""
    names = sorted(graph.nodes if nodes is None else nodes)
    keep = set(names)
    index = {u: i for i, u in enumerate(names)}
    edges, cap, delay = [], [], []
    for u, v in graph.edges:
        if u not in keep or v not in keep or not (index[u] < index[v]) or not graph.has_edge(v, u):
            continue
        a, b = graph[u][v], graph[v][u]
        edges.append((index[u], index[v]))
        cap.append(min(float(a["rate_mbps"]), float(b["rate_mbps"])))
        delay.append(max(float(a.get("delay_ms", 0.0)), float(b.get("delay_ms", 0.0))))
    order = sorted(range(len(edges)), key=lambda k: edges[k])
    return WanView(names, [edges[k] for k in order], np.array([cap[k] for k in order], float),
                   np.array([delay[k] for k in order], float), index)



def tree_pacing(graph: nx.DiGraph, trees: list[Tree], pace: bool, pacing: str) -> bool | dict:
    """The ``pace`` argument of :func:`testbed.plan.trees_plan` for trees with planned rates:
    False (unpaced), True (``pacing="all"``: every transfer at its tree's rate) or, for
    ``"contended"``, :func:`testbed.plan.contended_pacing` on the graph's link rates."""
    if not pace:
        return False
    if pacing == "all":
        return True
    return contended_pacing(trees, {(u, v): float(d["rate_mbps"]) for u, v, d in graph.edges(data=True)})
