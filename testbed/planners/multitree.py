"""MultiTree all-reduce (paper 004: Huang et al., "Communication Algorithm-Architecture
Co-Design for Distributed Deep Learning", ISCA 2021; reading note shared/spec/004-multitree.md).

MultiTree builds one spanning tree per node, rooted at that node, *concurrently* and
top-down (Algorithm 1, lines 1-14): in every time step a fresh copy of the topology graph
is used, the trees take turns (by root id) to attach one new node each through a free
directed link, and every link used is removed from the copy, so within one time step
every directed link carries at most one message (contention-free).  Time step = tree
level.  The all-gather (broadcast) schedule is what the construction produces; the
reduce-scatter schedule is its time-reverse (lines 15-18): an edge p->c added in step
t' is a reduce-scatter message c->p at step ``tot_t - t' + 1`` and an all-gather message
p->c at step ``tot_t + t'``, so an all-reduce takes ``2 * tot_t`` steps.  The vector is
cut into n blocks; the tree rooted at the i-th node (in id order) reduces and
broadcasts block i (Sec. III-A 1, "each node leads a reduction and a broadcast of one
chunk").

Functions:

* :func:`build_trees` -- Algorithm 1 (direct networks; and the BFS extension of
  Sec. III-C 3 for switch-based / routed networks, ``variant="bfs"``);
* :func:`schedule_tables` -- per-node schedule tables in the format of Fig. 5
  (Op, FlowID, Parent, Children, Step, Start Addr, Size), with :func:`table_rows`
  rendering them as the figure prints them;
* :func:`compile_plan` -- the plan IR, free-running (data dependencies only) or in
  lockstep (Sec. IV-A: a node starts step s only after its step s-1 operations);
* the ``multitree`` planner.

Choices where the paper is silent (each is a parameter where it can change results):

* Node ids: row-major ``row * W + col`` when every node has ``row``/``col`` attributes
  (Fig. 3: node 2 is the Y neighbour of node 0), else the graph's node order.
* Neighbour order (Alg. 1 line 10, "first checks the neighbors in Y dimension then in X
  dimension"): Y neighbours (same ``col``), then X neighbours (same ``row``), then any
  other neighbour by id; within a dimension the +1 neighbour (wrapping on a torus) before
  the -1 one (``dim_order``).  Graphs without coordinates use id order.
* Line 9 ("p in T's nodes added by previous time steps", examined breadth-first "in
  their order of adding"): a node added in step t can be a parent from step t+1 on.
* Line 8 round robin: every step restarts at the first tree (``rr_restart``); a tree
  that cannot attach any node in its turn is skipped; the step ends after a full round
  in which no tree attached a node.  ``tree_order="height"`` is the paper's suggestion
  for irregular networks (trees with larger remaining height first, re-sorted per step).
* Reduce-scatter only sends along the reverse of all-gather links; in the direct variant
  a link p->c is usable only if c->p exists too (always true on WAN graphs).
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from dataclasses import dataclass, field

import networkx as nx

from testbed.plan import Plan, ProgramBuilder, Tree, split_lengths
from testbed.planners import Param, ParamError, planner
from testbed.planners.common import check_graph
from testbed.routing import shortest_paths

REFERENCE = ("MultiTree: Huang et al., 'Communication Algorithm-Architecture Co-Design for "
             "Distributed Deep Learning', ISCA 2021 (paper 004), Algorithm 1, Sec. III-IV, Fig. 3/5")

NEIGHBOUR_ORDERS = ("auto", "yx", "xy", "id")
DIM_ORDERS = ("plus_first", "minus_first")
TREE_ORDERS = ("id", "height")
VARIANTS = ("direct", "bfs", "routed")
CHANNELS = ("tree", "link")


# ---------------------------------------------------------------------------
# Data structures
# ---------------------------------------------------------------------------
@dataclass
class TreeSchedule:
    """One MultiTree tree (Alg. 1 T_r) with the construction step of every edge.

    ``parent[c]`` is c's parent (root: None); ``added[c]`` the time step t' at which the
    edge parent[c] -> c was allocated (root: 0); ``order`` the nodes in order of adding.
    ``path[c]`` / ``rpath[c]`` are the physical routes of the all-gather message
    parent->c and of the reduce-scatter message c->parent (one hop in direct networks).
    """

    root: str
    parent: dict[str, str | None]
    added: dict[str, int]
    order: list[str]
    path: dict[str, list[str]] = field(default_factory=dict)
    rpath: dict[str, list[str]] = field(default_factory=dict)

    def children(self) -> dict[str, list[str]]:
        ch: dict[str, list[str]] = {n: [] for n in self.order}
        for n in self.order:
            p = self.parent[n]
            if p is not None:
                ch[p].append(n)
        return ch

    def height(self) -> int:
        return max(self.added.values())


@dataclass
class MultiTreeSchedule:
    """Output of :func:`build_trees`: trees in tree (= block) order and ``tot_t``."""

    trees: list[TreeSchedule]
    tot_t: int
    ids: dict[str, int]  # node -> id (the paper's node / FlowID numbering)
    neighbour_order: str
    variant: str
    alloc: list[tuple[int, str, str, int]] = field(default_factory=list)  # (tree, p, c, t) in allocation order

    @property
    def steps(self) -> int:
        """All-reduce steps: reduce-scatter steps 1..tot_t, all-gather tot_t+1..2 tot_t."""
        return 2 * self.tot_t

    def allgather(self, ti: int) -> list[tuple[str, str, int]]:
        """(p, c, step) of tree ti's all-gather schedule after Alg. 1 line 18."""
        t = self.trees[ti]
        return [(t.parent[c], c, self.tot_t + t.added[c]) for c in t.order if t.parent[c] is not None]

    def reduce_scatter(self, ti: int) -> list[tuple[str, str, int]]:
        """(c, p, step) of tree ti's reduce-scatter schedule (Alg. 1 line 17)."""
        t = self.trees[ti]
        return [(c, t.parent[c], self.tot_t - t.added[c] + 1) for c in t.order if t.parent[c] is not None]

    def construction(self, ti: int) -> list[tuple[str, str, int]]:
        """(p, c, t') as built by Alg. 1 lines 4-14 (before the time adjustment)."""
        t = self.trees[ti]
        return [(t.parent[c], c, t.added[c]) for c in t.order if t.parent[c] is not None]

    def link_use(self) -> dict[int, dict[tuple[str, str], int]]:
        """Messages per directed physical link per step, both phases (all must be <= 1)."""
        use: dict[int, dict[tuple[str, str], int]] = defaultdict(lambda: defaultdict(int))
        for ti, t in enumerate(self.trees):
            for c in t.order:
                if t.parent[c] is None:
                    continue
                ag, rs = self.tot_t + t.added[c], self.tot_t - t.added[c] + 1
                for a, b in zip(t.path[c], t.path[c][1:]):
                    use[ag][(a, b)] += 1
                for a, b in zip(t.rpath[c], t.rpath[c][1:]):
                    use[rs][(a, b)] += 1
        return {s: dict(d) for s, d in sorted(use.items())}


# ---------------------------------------------------------------------------
# Node ids and neighbour order
# ---------------------------------------------------------------------------
def _has_coords(graph: nx.DiGraph, nodes: list[str]) -> bool:
    return all("row" in graph.nodes[n] and "col" in graph.nodes[n] for n in nodes)


def node_ids(graph: nx.DiGraph, nodes: list[str] | None = None) -> dict[str, int]:
    """Paper node ids: row-major ``row * W + col`` order when every node has ``row`` and
    ``col`` (MultiTree Sec. III-B/Fig. 3, id = y*W + x), else the graph's node order.
    Returned as ranks 0..n-1 of that order."""
    nodes = list(graph.nodes) if nodes is None else list(nodes)
    if _has_coords(graph, nodes):
        ranked = sorted(nodes, key=lambda n: (graph.nodes[n]["row"], graph.nodes[n]["col"]))
    else:
        ranked = nodes
    return {n: i for i, n in enumerate(ranked)}


def neighbour_key(graph: nx.DiGraph, ids: dict[str, int], order: str, dim_order: str = "plus_first"):
    """Sort key k(p, c) for candidate children c of p (Alg. 1 line 10, Sec. III-C 1).

    ``yx``: "first checks the neighbors in Y dimension then in X dimension" -- Y
    neighbours share p's ``col``, X neighbours p's ``row``; within a dimension the +1
    neighbour (modulo the dimension size, so torus wrap links count) comes before the
    -1 one unless ``dim_order="minus_first"`` (the paper does not say).  ``xy`` swaps
    the dimensions; ``id`` (and nodes without coordinates) orders by node id.
    """
    if order == "id":
        return lambda p, c: (0, 0, ids[c])
    rows = len({graph.nodes[n].get("row") for n in ids})
    cols = len({graph.nodes[n].get("col") for n in ids})
    first_y = order == "yx"

    def key(p: str, c: str):
        a, b = graph.nodes[p], graph.nodes[c]
        if "row" not in a or "row" not in b or "col" not in a or "col" not in b:
            return (2, 0, ids[c])
        if a["col"] == b["col"] and a["row"] != b["row"]:
            dim, delta, size = (0 if first_y else 1), (b["row"] - a["row"]) % rows, rows
        elif a["row"] == b["row"] and a["col"] != b["col"]:
            dim, delta, size = (1 if first_y else 0), (b["col"] - a["col"]) % cols, cols
        else:
            return (2, 0, ids[c])
        plus = delta == 1
        minus = delta == size - 1 and not plus
        sign = 0 if plus else (1 if minus else 2)
        if dim_order == "minus_first" and sign < 2:
            sign = 1 - sign
        return (dim, sign, ids[c])

    return key


# ---------------------------------------------------------------------------
# Algorithm 1
# ---------------------------------------------------------------------------
def _endpoints(graph: nx.DiGraph) -> list[str]:
    """Nodes that own data (all, except nodes flagged ``switch``)."""
    return [n for n in graph.nodes if not graph.nodes[n].get("switch")]


def _remaining_height(graph: nx.DiGraph, members: set[str], endpoints: set[str]) -> int:
    """Hop distance from tree T's nodes to the farthest endpoint not yet in T (the
    'remaining height' of Sec. III-C 1's suggestion for irregular networks)."""
    dist = {n: 0 for n in members}
    q = deque(members)
    far = 0
    while q:
        u = q.popleft()
        for v in graph.successors(u):
            if v not in dist:
                dist[v] = dist[u] + 1
                if v in endpoints:
                    far = max(far, dist[v])
                q.append(v)
    return far


def _free_path(graph: nx.DiGraph, p: str, members: set[str], endpoints: set[str], free_fwd: set,
               free_rev: set, key) -> list[tuple[str, list[str], list[str]]]:
    """Sec. III-C 3's BFS: the nearest endpoint not in ``members`` that p reaches over links
    free in this step (p->...->c in ``free_fwd``, the reverse in ``free_rev``), relaying only
    through switches; neighbours in ``key`` order.  Returns [(c, path, reversed path)] or []."""
    prev = {p: None}
    q = deque([p])
    while q:
        u = q.popleft()
        for v in sorted(graph.successors(u), key=lambda v: key(p, v) if v in endpoints else (-1, 0, str(v))):
            if v in prev or (u, v) not in free_fwd or (v, u) not in free_rev:
                continue
            prev[v] = u
            if v in endpoints:
                if v in members:
                    continue  # an endpoint never relays
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return [(v, path[::-1], path)]
            q.append(v)
    return []


def build_trees(graph: nx.DiGraph, *, neighbour_order: str = "auto", dim_order: str = "plus_first",
                tree_order: str = "id", rr_restart: bool = True, variant: str = "direct") -> MultiTreeSchedule:
    """MultiTree tree construction, Algorithm 1 (Huang et al., ISCA'21, Sec. III-C).

    Lines 1-3: tree T_i = {i} for every node i.  Lines 4-14: for t = 1, 2, ... take a
    fresh copy E' of the directed links; trees take turns by root id (line 8); in its
    turn a tree examines its nodes added in *previous* steps breadth-first in order of
    adding (line 9) and attaches the first free neighbour c not yet in the tree
    (line 10, neighbours in ``neighbour_order``), removing p->c from E' (lines 11-13),
    then yields its turn (line 14).  The step ends when no tree can attach a node;
    construction ends when every tree spans all endpoints; ``tot_t = t`` (line 15).

    ``variant="bfs"`` is the extension for switch-based networks (Sec. III-C 3): nodes
    flagged ``switch`` are relays, not tree members; to find a child of p, a BFS runs from
    p over the links still free *in this step* through switches only (an endpoint never
    relays), and the first endpoint not yet in the tree is attached along that path
    (hop-nearest first, "local first"); every link of it is reserved, and the reverse
    links are reserved in a second per-step pool so the reduce-scatter (reversed)
    schedule is contention-free as well.  On a leaf-spine fabric the paths of one step
    spread over the spines, so a phase takes N - 1 steps (Sec. III-C 3, as RING).
    ``variant="routed"`` (ours) reserves the one static latency-shortest route per pair
    (:func:`testbed.routing.shortest_paths`) instead: the route the emulator forwards on.
    The emulator and the cost model route a message on those static routes unless it names
    its path: with ``channels="tree"`` (one connection per tree edge and direction) every
    ``bfs`` send names its reserved path (``Op.path``), and the emulator carries each
    connection on it (policy routing by source address), so the schedule runs as reserved;
    with ``channels="link"`` one connection carries several trees' paths, none is named, and
    on a multi-path fabric the messages may take other routes than they reserved.  ``routed``
    is contention-free on the static routes.

    Returns a :class:`MultiTreeSchedule`.
    """
    for name, value, choices in (("neighbour_order", neighbour_order, NEIGHBOUR_ORDERS),
                                 ("dim_order", dim_order, DIM_ORDERS), ("tree_order", tree_order, TREE_ORDERS),
                                 ("variant", variant, VARIANTS)):
        if value not in choices:
            raise ValueError(f"{name} must be one of {choices}")
    ends = _endpoints(graph)
    endset = set(ends)
    if variant == "direct" and len(ends) != graph.number_of_nodes():
        raise ValueError("the direct variant needs every node to be an endpoint; use variant='bfs'")
    ids = node_ids(graph, ends)
    if neighbour_order == "auto":
        neighbour_order = "yx" if _has_coords(graph, ends) else "id"
    key = neighbour_key(graph, ids, neighbour_order, dim_order)
    by_id = sorted(ends, key=ids.__getitem__)
    cand = _candidates(graph, by_id, variant, key)
    trees, t, alloc = _grow_trees(graph, by_id, cand, variant, endset, key, tree_order, rr_restart)
    return MultiTreeSchedule(trees, t, ids, neighbour_order, variant, alloc)


def _grow_trees(graph: nx.DiGraph, by_id: list[str], cand: dict, variant: str, endset: set[str], key,
                tree_order: str, rr_restart: bool) -> tuple[list[TreeSchedule], int, list[tuple[int, str, str, int]]]:
    """Algorithm 1 lines 1-15: T_i = {i} for every endpoint (in id order), then time steps
    (:func:`_time_step`) until every tree spans all endpoints.  Returns the trees,
    ``tot_t`` and the allocation sequence (tree, p, c, t)."""
    n = len(by_id)
    trees = [TreeSchedule(r, {r: None}, {r: 0}, [r], {r: [r]}, {r: [r]}) for r in by_id]
    alloc: list[tuple[int, str, str, int]] = []
    members = [{r} for r in by_id]
    links = list(graph.edges)
    t = 0
    start = 0
    while any(len(m) < n for m in members):
        t += 1
        if t > n * max(1, len(links)):  # cannot happen on a strongly connected graph
            raise RuntimeError("MultiTree construction does not progress")
        if tree_order == "height":
            seq = sorted(range(n), key=lambda i: (-_remaining_height(graph, members[i], endset), i))
            pos = 0
        else:
            seq = list(range(n))
            pos = 0 if rr_restart else start
        last = _time_step(graph, trees, members, cand, variant, endset, links, key, t, seq, pos, alloc)
        if last is None:
            raise ValueError("the topology is not strongly connected: MultiTree cannot span it")
        start = (seq.index(last) + 1) % n
    return trees, t, alloc


def _time_step(graph: nx.DiGraph, trees: list[TreeSchedule], members: list[set[str]], cand: dict, variant: str,
               endset: set[str], links: list, key, t: int, seq: list[int], pos: int,
               alloc: list[tuple[int, str, str, int]]) -> int | None:
    """Time step t of Algorithm 1 (lines 5-14): a fresh copy of the links (line 6), then the
    trees take turns in ``seq`` from position ``pos`` (line 8), each attaching at most one
    node per turn (:func:`_turn`), until a full round attaches none.  Appends every
    attachment to ``alloc``; returns the index of the last tree that attached a node, or
    None if none did."""
    n = len(trees)
    free_fwd = set(links)
    free_rev = set(links)
    parents = [list(tr.order) for tr in trees]  # nodes added by previous steps (line 9)
    idle = 0
    last = None
    while idle < n:
        ti = seq[pos % n]
        pos += 1
        edge = (_turn(graph, trees[ti], members[ti], parents[ti], cand, variant, endset, free_fwd, free_rev, key, t)
                if len(members[ti]) < n else None)
        if edge:
            alloc.append((ti, *edge, t))
            idle = 0
            last = ti
        else:
            idle += 1
    return last


def _candidates(graph: nx.DiGraph, by_id: list[str], variant: str, key) -> dict[str, list[tuple[str, list[str], list[str]]]]:
    """Candidate children of each p in examination order (line 10), with the paths they
    occupy there and back: the neighbours (``direct``) or every endpoint by hops over its
    static route (``routed``); none for ``bfs``, whose paths are searched per step over the
    free links (:func:`_free_path`)."""
    routes = shortest_paths(graph) if variant == "routed" else None
    cand: dict[str, list[tuple[str, list[str], list[str]]]] = {}
    for p in by_id:
        if variant == "bfs":
            continue
        if variant == "direct":
            cs = [c for c in graph.successors(p) if graph.has_edge(c, p)]
            cand[p] = [(c, [p, c], [c, p]) for c in sorted(cs, key=lambda c: key(p, c))]
        else:
            hops = nx.single_source_shortest_path_length(graph, p)
            cs = [c for c in by_id if c != p and (p, c) in routes and (c, p) in routes]
            cs.sort(key=lambda c: (hops.get(c, len(graph)), key(p, c)))
            cand[p] = [(c, routes[(p, c)], routes[(c, p)]) for c in cs]
    return cand


def _turn(graph: nx.DiGraph, tr: TreeSchedule, mem: set[str], parents: list[str], cand: dict, variant: str,
          endset: set[str], free_fwd: set, free_rev: set, key, t: int) -> tuple[str, str] | None:
    """One tree's turn in step t (lines 9-13): the first of its ``parents`` (nodes added in
    previous steps, in order of adding) with a candidate child not in the tree whose links
    are still free attaches it and takes the links from this step's pool.  Returns the
    attached (parent, child), or None."""
    for p in parents:
        options = cand[p] if variant != "bfs" else _free_path(graph, p, mem, endset, free_fwd, free_rev, key)
        for c, fwd, rev in options:
            if c in mem:
                continue
            fl = list(zip(fwd, fwd[1:]))
            rl = list(zip(rev, rev[1:]))
            if all(e in free_fwd for e in fl) and (variant == "direct" or all(e in free_rev for e in rl)):
                free_fwd.difference_update(fl)
                if variant != "direct":
                    free_rev.difference_update(rl)
                mem.add(c)
                tr.parent[c], tr.added[c] = p, t
                tr.order.append(c)
                tr.path[c], tr.rpath[c] = list(fwd), list(rev)
                return p, c
    return None


# ---------------------------------------------------------------------------
# Schedule tables (Sec. IV-A, Fig. 5)
# ---------------------------------------------------------------------------
def schedule_tables(sched: MultiTreeSchedule, *, length: int | None = None,
                    include_nops: bool = True) -> dict[str, list[dict]]:
    """Per-node all-reduce schedule tables (MultiTree Sec. IV-A, Fig. 5).

    Only sending actions get entries.  ``Reduce``: send the partial sum of flow
    (= tree root) to ``parent`` at ``step`` once a Reduce has arrived from every node in
    ``children``.  ``Gather``: send the reduced block to ``children`` at ``step`` after the
    Gather from ``parent`` has arrived (the root, parent None, after its reduction).
    ``NOP`` fills a step in which the node sends nothing (lockstep stall).  If a node
    gains children in different construction steps it needs one Gather entry per step
    (the paper's "two entries per tree" assumes a single one).  Children are listed by
    node id as in Fig. 5; within a step, entries without dependencies come first, then
    by flow id (this reproduces Fig. 5's order).  ``start``/``size`` are the block's
    element offset and length when ``length`` is given.
    """
    ids = sched.ids
    n = len(sched.trees)
    blocks = _blocks(length, n) if length is not None else [(None, None)] * n
    tables: dict[str, list[tuple]] = {v: [] for v in ids}
    for ti, t in enumerate(sched.trees):
        ch = t.children()
        start, size = blocks[ti]
        for u in t.order:
            kids = sorted(ch[u], key=ids.__getitem__)
            p = t.parent[u]
            if p is not None:
                e = {"op": "Reduce", "flow": t.root, "parent": p, "children": kids,
                     "step": sched.tot_t - t.added[u] + 1, "start": start, "size": size}
                tables[u].append(((e["step"], bool(kids), ti), e))
            groups: dict[int, list[str]] = defaultdict(list)
            for c in kids:
                groups[t.added[c]].append(c)
            for tp in sorted(groups):
                e = {"op": "Gather", "flow": t.root, "parent": p, "children": groups[tp],
                     "step": sched.tot_t + tp, "start": start, "size": size}
                tables[u].append(((e["step"], p is not None, ti), e))
    out: dict[str, list[dict]] = {}
    for v, rows in tables.items():
        rows.sort(key=lambda r: r[0])
        entries = [e for _, e in rows]
        if include_nops:
            busy = {e["step"] for e in entries}
            for s in range(1, sched.steps + 1):
                if s not in busy:
                    entries.append({"op": "NOP", "flow": None, "parent": None, "children": [],
                                    "step": s, "start": None, "size": None})
            entries.sort(key=lambda e: e["step"])  # stable: keeps the order within a step
        out[v] = entries
    return out


def table_rows(entries: list[dict], ids: dict[str, int], slots: int = 4) -> list[str]:
    """Render table entries as Fig. 5 prints them: ``Op FlowID Parent Children.. Step``
    with node ids, ``nil`` for empty fields and ``slots`` child slots (Fig. 5 has 4:
    footnote 3, NI/link bandwidth ratio; more children extend the row)."""
    rows = []
    for e in entries:
        def lab(x):
            return "nil" if x is None else str(ids[x])
        kids = [lab(c) for c in e["children"]]
        kids += ["nil"] * max(0, slots - len(kids))
        rows.append(" ".join([e["op"], lab(e["flow"]), lab(e["parent"]), *kids, str(e["step"])]))
    return rows


# ---------------------------------------------------------------------------
# Plan compilation
# ---------------------------------------------------------------------------
def _blocks(length: int, n: int) -> list[tuple[int, int]]:
    """(offset, size) of block i = the data of the tree rooted at the i-th node."""
    out, off = [], 0
    for s in split_lengths(length, [1] * n):
        out.append((off, s))
        off += s
    return out


def compile_plan(sched: MultiTreeSchedule, nodes: list[str], length: int, *, chunks: int = 1,
                 lockstep: bool = False, channels: str = "tree", scheme: str = "multitree",
                 participants: list[str] | None = None, paths: bool = False) -> Plan:
    """Compile a MultiTree schedule into the plan IR (Alg. 1 lines 16-18 + Sec. IV-A).

    Block i (tree T_i) is cut into ``chunks`` chunks, each following the same schedule.
    Reduce-scatter message c->p at step s: c sends its partial sum once the messages of
    all its children have been added (data dependency); p adds it in.  All-gather
    message p->c: p sends once it holds the final block (the root after its last
    reduce-scatter receive, others after their all-gather receive); c overwrites its copy
    after its own reduce-scatter send has read it.

    ``lockstep=True`` adds the NI's timestep discipline (Sec. IV-A, Fig. 6): every op a
    node performs in step s (sends and receives, all chunks) depends on all its ops of
    the latest earlier step in which it had any (steps without ops are the NOPs; the IR
    has no timers, so a NOP costs no time here).  With chunks > 1 in lockstep mode all
    chunks of step s precede step s+1, i.e. chunking only splits messages; pipelining
    across steps happens in the free-running mode.  ``channels="tree"`` gives every tree
    its own connection (flows never block each other); ``"link"`` one ordered stream
    per node pair, as the paper's single NI link.  ``paths`` (with ``channels="tree"``: one
    connection per tree edge and direction) names each send's reserved path (``Op.path``), so
    that a network that can carry it there does.  Ops are emitted in schedule order;
    ``plan.meta["op_step"][node][op_id]`` is the MultiTree time step of every op.
    """
    b = ProgramBuilder(nodes)
    chunk_ranges = _chunk_ranges(_blocks(length, len(sched.trees)), chunks)
    events = _step_events(sched)
    deps = _Dependencies(lockstep, {v: defaultdict(list) for v in nodes})
    for s, k in _slots(sched.tot_t, chunks, lockstep):
        for phase, ti, src, dst, c in events.get(s, []):
            if k >= len(chunk_ranges[ti]):
                continue
            off, size = chunk_ranges[ti][k]
            if size == 0:
                continue
            label = dict(channel=ti if channels == "tree" else 0, flow=ti, chunk=k, phase=phase)
            if paths and channels == "tree":  # a connection per tree edge and direction: one path each
                t = sched.trees[ti]
                label["path"] = t.rpath[c] if phase == "reduce-scatter" else t.path[c]
            if phase == "reduce-scatter":
                deps.reduce_scatter(b, (ti, k), src, dst, s, off, size, label)
            else:
                deps.all_gather(b, (ti, k), sched.trees[ti].root, src, dst, s, off, size, label)
    return Plan(scheme, list(nodes), length, b.programs, participants=participants,
                receivers=participants, meta={"op_step": deps.op_steps(b.programs)})


def _step_events(sched: MultiTreeSchedule) -> dict[int, list[tuple[str, int, str, str, str]]]:
    """The messages of every all-reduce step (Alg. 1 lines 16-18): step s -> list of
    (phase, tree index, sender, receiver, child node); the edge p->c added in step t' is
    the reduce-scatter message c->p in step ``tot_t - t' + 1`` and the all-gather message
    p->c in step ``tot_t + t'``."""
    T = sched.tot_t
    events: dict[int, list[tuple[str, int, str, str, str]]] = defaultdict(list)
    for ti, t in enumerate(sched.trees):
        for c in t.order:
            p = t.parent[c]
            if p is None:
                continue
            events[T - t.added[c] + 1].append(("reduce-scatter", ti, c, p, c))
            events[T + t.added[c]].append(("all-gather", ti, p, c, c))
    return events


def _chunk_ranges(blocks: list[tuple[int, int]], chunks: int) -> list[list[tuple[int, int]]]:
    """(offset, size) of every chunk of every tree's block."""
    chunk_ranges: list[list[tuple[int, int]]] = []
    for off, size in blocks:
        rs, o = [], off
        for cs in (split_lengths(size, [1] * chunks) if size else []):
            rs.append((o, cs))
            o += cs
        chunk_ranges.append(rs)
    return chunk_ranges


def _slots(tot_t: int, chunks: int, lockstep: bool) -> list[tuple[int, int]]:
    """(step, chunk) in emission order: step by step in lockstep (Sec. IV-A), else along
    the pipeline's diagonals (chunk k's step s with s + k)."""
    slots = [(s, k) for s in range(1, 2 * tot_t + 1) for k in range(chunks)]
    slots.sort(key=(lambda sk: sk) if lockstep else (lambda sk: (sk[0] + sk[1], sk[0])))
    return slots


@dataclass
class _Dependencies:
    """What :func:`compile_plan`'s ops wait on, kept per (tree, chunk) ``key``: the
    reduce-scatter receives of every node (its children's partial sums), its reduce-scatter
    send, the all-gather receive that gave it the final block (``have``), and with
    ``lockstep`` every node's ops per step (``step_ops``, also the plan's ``op_step``)."""

    lockstep: bool
    step_ops: dict[str, dict[int, list[int]]]
    rs_recv: dict[tuple[int, int], dict[str, list[int]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(list)))
    rs_send: dict[tuple[int, int], dict[str, int]] = field(default_factory=lambda: defaultdict(dict))
    have: dict[tuple[int, int], dict[str, list[int]]] = field(default_factory=lambda: defaultdict(dict))

    def barrier(self, v: str, s: int) -> list[int]:
        """Lockstep (Sec. IV-A): all of v's ops of its latest earlier step with any."""
        if not self.lockstep:
            return []
        prev = [q for q in self.step_ops[v] if q < s and self.step_ops[v][q]]
        return list(self.step_ops[v][max(prev)]) if prev else []

    def reduce_scatter(self, b: ProgramBuilder, key: tuple[int, int], src: str, dst: str, s: int, off: int,
                       size: int, label: dict) -> None:
        """src sends its partial sum once its children's have been added; dst adds it in."""
        sid, rid = b.transfer(src, dst, off, size, reduce=True,
                              send_deps=self.rs_recv[key][src] + self.barrier(src, s),
                              recv_deps=self.barrier(dst, s), **label)
        self.rs_send[key][src] = sid
        self.rs_recv[key][dst].append(rid)
        self.step_ops[src][s].append(sid)
        self.step_ops[dst][s].append(rid)

    def all_gather(self, b: ProgramBuilder, key: tuple[int, int], root: str, src: str, dst: str, s: int,
                   off: int, size: int, label: dict) -> None:
        """src sends the final block once it holds it; dst overwrites its copy after its own
        reduce-scatter send has read it."""
        src_have = self.have[key].get(src, self.rs_recv[key][root] if src == root else None)
        sid, rid = b.transfer(src, dst, off, size, reduce=False,
                              send_deps=list(src_have) + self.barrier(src, s),
                              recv_deps=[self.rs_send[key][dst]] + self.barrier(dst, s), **label)
        self.have[key][dst] = [rid]
        self.step_ops[src][s].append(sid)
        self.step_ops[dst][s].append(rid)

    def op_steps(self, programs: dict[str, list]) -> dict[str, list[int]]:
        """node -> the MultiTree time step of each of its ops, by op id."""
        op_step = {v: [0] * len(programs[v]) for v in self.step_ops}
        for v in self.step_ops:
            for s, ids_ in self.step_ops[v].items():
                for i in ids_:
                    op_step[v][i] = s
        return op_step


# ---------------------------------------------------------------------------
# Planner
# ---------------------------------------------------------------------------
#: ``plan.meta["routing_note"]`` of the bfs variant, by whether its sends name their paths.
ROUTING_NOTES = {
    True: "every send names its reserved path (Op.path); the emulator carries each connection on it",
    False: "channels=link: one connection carries several trees' paths, so none is named; messages follow "
           "the network's static routes, which may differ from the per-step BFS paths reserved here "
           "(Sec. III-C 3)",
}


def _trees_meta(sched: MultiTreeSchedule, length: int, chunks: int, variant: str) -> list[dict]:
    """``plan.meta["trees"]``: every tree with its block, construction steps, both
    schedules (Alg. 1 lines 4-18) and, unless direct, the reserved paths."""
    blocks = _blocks(length, len(sched.trees))
    trees_meta = []
    for ti, t in enumerate(sched.trees):
        d = Tree(t.root, dict(t.parent), share=blocks[ti][1] / length if length else 0.0,
                 chunks=chunks).to_dict()
        d.update({"block": list(blocks[ti]), "added_step": dict(t.added),
                  "construction": [list(x) for x in sched.construction(ti)],
                  "reduce_scatter": [list(x) for x in sched.reduce_scatter(ti)],
                  "all_gather": [list(x) for x in sched.allgather(ti)]})
        if variant != "direct":
            d["paths"] = {c: t.path[c] for c in t.order if t.parent[c] is not None}
        trees_meta.append(d)
    return trees_meta


@planner(
    "multitree", REFERENCE,
    lockstep=Param(bool, False, "add the NI lockstep discipline (Sec. IV-A): a node starts step s only "
                                "after finishing its step s-1 ops; false = free-running, data "
                                "dependencies only"),
    chunks=Param(int, 1, "split each tree's block into this many chunks pipelined through the same "
                         "schedule (our extension; the paper sends one message per block)", ge=1),
    neighbour_order=Param(str, "auto", "Alg. 1 line 10 neighbour order: yx = Y (same col) then X "
                                       "(same row) neighbours as in the paper; auto = yx when nodes have "
                                       "row/col, else id order", choices=NEIGHBOUR_ORDERS),
    dim_order=Param(str, "plus_first", "within a dimension, +1 (wrapping) neighbour before -1 or "
                                       "the reverse (not stated in the paper)", choices=DIM_ORDERS),
    tree_order=Param(str, "id", "Alg. 1 line 8 turn order: by root id (paper default) or larger "
                                "remaining height first (paper's suggestion for irregular networks)",
                     choices=TREE_ORDERS),
    rr_restart=Param(bool, True, "restart the round robin at the first tree in every time step (else "
                                 "continue after the last tree that added a node)"),
    variant=Param(str, "direct", "direct = one-hop tree edges (torus/mesh/WAN links); bfs = "
                                 "Sec. III-C 3: per step, BFS from the parent over the still-free links "
                                 "through switch nodes, all links of the path reserved; routed = ours: "
                                 "the static latency-shortest route per pair (the emulator's) reserved",
                  choices=VARIANTS),
    channels=Param(str, "tree", "connection per tree (tree) or one ordered stream per node pair (link)",
                   choices=CHANNELS),
)
def plan_multitree(graph: nx.DiGraph, length: int, *, elem_bytes: int = 4, lockstep: bool = False,
                   chunks: int = 1, neighbour_order: str = "auto", dim_order: str = "plus_first",
                   tree_order: str = "id", rr_restart: bool = True, variant: str = "direct",
                   channels: str = "tree") -> Plan:
    """MultiTree all-reduce (Huang et al., ISCA'21): one spanning tree per node built by
    Algorithm 1, reduce-scatter as the time-reverse of all-gather (2 tot_t steps), the
    tree rooted at node i owning block i of the vector; compiled free-running or in
    lockstep.  ``plan.meta`` holds the trees, construction steps, both schedules, the
    per-node schedule tables (Fig. 5 format) and per-step link use."""
    t0 = time.perf_counter()
    check_graph(graph, "multitree")
    ends = _endpoints(graph)
    try:
        sched = build_trees(graph, neighbour_order=neighbour_order, dim_order=dim_order,
                            tree_order=tree_order, rr_restart=rr_restart, variant=variant)
    except ValueError as exc:
        raise ParamError("variant", str(exc)) from exc
    t_build = time.perf_counter() - t0
    nodes = list(graph.nodes)
    participants = None if len(ends) == len(nodes) else ends
    named = variant == "bfs" and channels == "tree"
    plan = compile_plan(sched, nodes, length, chunks=chunks, lockstep=lockstep, channels=channels,
                        participants=participants, paths=named)
    use = sched.link_use()
    plan.meta.update({
        "algorithm": "MultiTree Algorithm 1 (concurrent top-down spanning trees, one per node)",
        "node_ids": sched.ids,
        "roots": [t.root for t in sched.trees],
        "tot_t": sched.tot_t,
        "allocation_sequence": [[sched.trees[ti].root, p, c, t] for ti, p, c, t in sched.alloc],
        "steps": sched.steps,
        "trees": _trees_meta(sched, length, chunks, variant),
        "schedule_tables": schedule_tables(sched, length=length),
        "links_per_step": {s: len(d) for s, d in use.items()},
        "max_link_use_per_step": max((max(d.values()) for d in use.values()), default=0),
        "lockstep": lockstep,
        "chunks": chunks,
        "neighbour_order": sched.neighbour_order,
        "dim_order": dim_order,
        "tree_order": tree_order,
        "rr_restart": rr_restart,
        "variant": variant,
        **({"routing_note": ROUTING_NOTES[named]} if variant == "bfs" else {}),
        "channels": channels,
        "build_s": t_build,
    })
    return plan
