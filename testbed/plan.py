"""Plans are data: a collective as a per-node program of sends and receives on blocks.

The idea follows msccl-tools: a collective is a *schedule* that one generic executor
runs.  Every scheme (ring, parameter server, MTREE, MultiTree, NetStorm, CREW, ...) is a
planner — a pure function from a network graph and parameters to a :class:`Plan` — and
the agents in ``agents/`` execute any plan unchanged.

Semantics (the agent executor and :func:`interpret` implement exactly this):

* Each node owns a vector ``x`` of ``plan.length`` elements.  It starts as the node's
  input if the node is a participant, else zeros (relays, inactive workers).  A node may
  also own scratch buffers (``plan.scratch[node][name] = length``) that start as zeros.
* A node's program is a list of :class:`Op`.  An op may start once every op named in its
  ``deps`` (ids in the same program) has completed.
* ``send``: transmit ``buf[offset:offset+length]`` to ``peer`` as transfer ``xfer``; it
  completes once the data has been handed to the transport (or acknowledged, in
  stop-and-wait mode).  The send reads the buffer *while* transmitting, so a write to
  the same range must be ordered after it by ``deps``.
* ``recv``: wait for transfer ``xfer`` from ``peer`` and then either add it into
  ``buf[offset:offset+length]`` (``reduce=True``) or overwrite that range.  Data may
  arrive before the op is ready; the executor holds it until the deps are met.  Applies
  on one node are serialised, so two reducing receives into the same range need no
  order between them (addition commutes); every other overlap of a write with another
  access must be ordered by ``deps`` (checked by :meth:`Plan.validate`).
* ``channel`` picks the connection between a pair of nodes (e.g. one per tree): ops on
  one channel share one ordered byte stream, different channels do not block each
  other.  ``flow``, ``chunk`` and ``phase`` label transfers for timing reports.
* ``rate_mbps`` (sends; 0 = unpaced) caps the sending rate of that connection (the
  executor sets the socket's pacing rate to the largest rate of its sends); where the
  executor shares one connection among a peer's channels (``agents.links: shared``) the rates
  are the channels' weights in its fair order instead of caps.  Planners
  that allocate rates to trees (MTREE, BLINK, forest packing) use it so trees sharing a
  link get their planned rates instead of TCP's equal shares.
* ``path`` (sends; empty = the network's own routing): the nodes the transfer crosses,
  sender first, receiver last, for plans that reserve links (MultiTree's switch-network
  variant).  Every send on one connection (node, peer, channel) names the same path: a
  connection is one byte stream, carried on one path.  Where the network can carry a
  connection on a named path (the emulator: :meth:`testbed.emulator.network.WanNetwork.install_paths`)
  it does; the semantics above do not depend on it.
* ``aux`` (NetStorm §VI, multipath auxiliary transmission): ``{"paths": [[src, relay, ...,
  dst], ...], "primary_busy_bound": b, "aux_queue_length": q}``; every path joins the two
  ends of some transfer through at least one relay, fastest first per pair.  The executor may
  send any transfer from src to dst over one of them instead of the direct connection
  (:mod:`agents.executor` says when); relays forward without aggregating, so the semantics
  above are unchanged.  Empty: none.
* After the program, every node in ``plan.receivers`` must hold the sum of the inputs of
  ``plan.participants``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field, fields
from typing import Iterable, Mapping, Sequence

import numpy as np

SEND, RECV = "send", "recv"
AUX_DISPATCH = ("queue", "eta")  # auxiliary dispatch rules (agents.executor.Executor._route)
AUX_MAX_NODES = 8  # nodes on an auxiliary path: what the wire header's route holds (agents.wire.ROUTE_MAX)


class PlanError(ValueError):
    """A plan is inconsistent (unmatched transfer, dependency cycle, data race, ...)."""


@dataclass(frozen=True)
class Op:
    id: int
    kind: str  # SEND or RECV
    peer: str
    xfer: int  # transfer id, unique in the plan; a send and its recv share it
    offset: int  # first element of the block
    length: int  # elements in the block
    buf: str = "x"
    reduce: bool = False  # recv only: add (True) or overwrite (False)
    deps: tuple[int, ...] = ()
    channel: int = 0
    flow: int = 0
    chunk: int = 0
    phase: str = ""
    rate_mbps: float = 0.0
    path: tuple[str, ...] = ()  # send only: the nodes it crosses, sender to peer (empty: routed)

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}  # (asdict's deep copies cost 3x)
        d["deps"] = list(self.deps)
        if self.path:
            d["path"] = list(self.path)
        else:
            del d["path"]
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "Op":
        d = dict(d)
        d["deps"] = tuple(d.get("deps", ()))
        d["path"] = tuple(d.get("path", ()))
        return cls(**d)


@dataclass
class Plan:
    scheme: str
    nodes: list[str]
    length: int
    programs: dict[str, list[Op]]
    participants: list[str] | None = None  # None: every node
    receivers: list[str] | None = None  # None: every node
    scratch: dict[str, dict[str, int]] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    aux: dict = field(default_factory=dict)  # auxiliary paths and dispatch bounds (NetStorm §VI)

    # -- accessors -------------------------------------------------------
    def contributing(self) -> list[str]:
        return list(self.nodes if self.participants is None else self.participants)

    def finishing(self) -> list[str]:
        return list(self.nodes if self.receivers is None else self.receivers)

    def transfers(self) -> Iterable[tuple[str, Op]]:
        """Every send op with the node that issues it."""
        for node, prog in self.programs.items():
            for op in prog:
                if op.kind == SEND:
                    yield node, op

    def paths(self) -> dict[tuple[str, str, int], tuple[str, ...]]:
        """(node, peer, channel) -> the path its connection is carried on, where a send names one."""
        return {(node, op.peer, op.channel): op.path for node, op in self.transfers() if op.path}

    def bytes_sent(self, elem_bytes: int) -> int:
        return sum(op.length for _, op in self.transfers()) * elem_bytes

    # -- (de)serialisation -------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "scheme": self.scheme,
            "nodes": list(self.nodes),
            "length": self.length,
            "participants": self.participants,
            "receivers": self.receivers,
            "scratch": self.scratch,
            "meta": self.meta,
            **({"aux": self.aux} if self.aux else {}),
            "programs": {n: [op.to_dict() for op in p] for n, p in self.programs.items()},
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> "Plan":
        return cls(
            scheme=d["scheme"],
            nodes=list(d["nodes"]),
            length=int(d["length"]),
            participants=d.get("participants"),
            receivers=d.get("receivers"),
            scratch={n: dict(s) for n, s in d.get("scratch", {}).items()},
            meta=dict(d.get("meta", {})),
            aux=dict(d.get("aux", {})),
            programs={n: [Op.from_dict(o) for o in p] for n, p in d["programs"].items()},
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, s: str) -> "Plan":
        return cls.from_dict(json.loads(s))

    # -- checks ------------------------------------------------------------
    def validate(self) -> None:
        """Raise PlanError unless the plan is well formed and race free."""
        known = set(self.nodes)
        for group, names in (("participants", self.participants), ("receivers", self.receivers)):
            for n in names or ():
                if n not in known:
                    raise PlanError(f"{group} names unknown node {n!r}")
        sends: dict[int, tuple[str, Op]] = {}
        recvs: dict[int, tuple[str, Op]] = {}
        conn_path: dict[tuple[str, str, int], tuple[str, ...]] = {}
        for node, prog in self.programs.items():
            if node not in known:
                raise PlanError(f"program for unknown node {node!r}")
            ids = [op.id for op in prog]
            if len(set(ids)) != len(ids):
                raise PlanError(f"{node}: duplicate op ids")
            idset = set(ids)
            for op in prog:
                self._check_op(node, op, idset, known, conn_path)
                table = sends if op.kind == SEND else recvs
                if op.xfer in table:
                    raise PlanError(f"transfer {op.xfer} has two {op.kind} ops")
                table[op.xfer] = (node, op)
            _check_acyclic(node, prog)
            _check_races(node, prog)
        _check_transfers(sends, recvs)
        self._check_aux(known, {(src, s.peer) for src, s in sends.values()})

    def _check_op(self, node: str, op: Op, idset: set[int], known: set[str],
                  conn_path: dict[tuple[str, str, int], tuple[str, ...]]) -> None:
        """One op of ``node``'s program: kind, peer, channel, buffer and block, deps (among
        ``idset``), and a send's path (one per connection: ``conn_path``)."""
        if op.kind not in (SEND, RECV):
            raise PlanError(f"{node} op {op.id}: unknown kind {op.kind!r}")
        if op.peer not in known or op.peer == node:
            raise PlanError(f"{node} op {op.id}: bad peer {op.peer!r}")
        if op.channel < 0:
            raise PlanError(f"{node} op {op.id}: channel {op.channel} (negative channels are reserved)")
        size = self.length if op.buf == "x" else self.scratch.get(node, {}).get(op.buf)
        if size is None:
            raise PlanError(f"{node} op {op.id}: unknown buffer {op.buf!r}")
        if op.length <= 0 or op.offset < 0 or op.offset + op.length > size:
            raise PlanError(f"{node} op {op.id}: block [{op.offset}, +{op.length}) outside {op.buf}")
        missing = set(op.deps) - idset
        if missing:
            raise PlanError(f"{node} op {op.id}: unknown deps {sorted(missing)}")
        if op.path and (op.kind != SEND or len(op.path) < 2 or op.path[0] != node
                        or op.path[-1] != op.peer or len(set(op.path)) < len(op.path)
                        or not set(op.path) <= known):
            raise PlanError(f"{node} op {op.id}: path {list(op.path)} is not distinct known nodes from "
                            f"{node} to {op.peer} on a send")
        if op.kind == SEND and conn_path.setdefault((node, op.peer, op.channel), op.path) != op.path:
            raise PlanError(f"{node} op {op.id}: path {list(op.path)} differs from that of an earlier send "
                            f"to {op.peer} on channel {op.channel} (one connection, one path)")

    def _check_aux(self, known: set[str], pairs: set[tuple[str, str]]) -> None:
        """The auxiliary paths (each joining the two ends of a transfer in ``pairs``) and
        their dispatch settings (NetStorm §VI)."""
        for path in self.aux.get("paths", []):
            if not 3 <= len(path) <= AUX_MAX_NODES or len(set(path)) < len(path) or not set(path) <= known \
                    or (path[0], path[-1]) not in pairs:
                raise PlanError(f"auxiliary path {path}: not 3 to {AUX_MAX_NODES} distinct nodes joining the two "
                                "ends of a transfer")
        if not isinstance(self.aux.get("resend_after_s", 0), (int, float)) or self.aux.get("resend_after_s", 0) < 0:
            raise PlanError("aux.resend_after_s must be a number >= 0")
        if self.aux.get("dispatch", "queue") not in AUX_DISPATCH:
            raise PlanError(f"aux.dispatch must be {' or '.join(AUX_DISPATCH)}, got {self.aux.get('dispatch')!r}")
        for path, rate in (self.aux.get("rates") or {}).items():
            if not (isinstance(rate, list) and len(rate) == 2 and all(isinstance(x, (int, float)) for x in rate)
                    and rate[0] > 0 and rate[1] >= 0):
                raise PlanError(f"aux.rates[{path!r}] must be [Mbit/s > 0, delay s >= 0], got {rate!r}")
        if self.aux.get("dispatch") == "eta":
            missing = [k for p in self.aux.get("paths", []) for k in (">".join(p), f"{p[0]}>{p[-1]}")
                       if k not in self.aux.get("rates", {})]
            if missing:
                raise PlanError(f"aux.dispatch eta: no rate of path {missing[0]}")
        for key in ("primary_busy_bound", "aux_queue_length"):
            if key in self.aux and not (isinstance(self.aux[key], int) and self.aux[key] >= (key == "aux_queue_length")):
                raise PlanError(f"aux.{key} must be an integer >= {int(key == 'aux_queue_length')}")


def _check_transfers(sends: dict[int, tuple[str, Op]], recvs: dict[int, tuple[str, Op]]) -> None:
    """Every transfer has one send and one recv, naming each other, of one length and channel."""
    if sends.keys() != recvs.keys():
        odd = sorted(sends.keys() ^ recvs.keys())[:5]
        raise PlanError(f"unmatched transfers (send without recv or vice versa): {odd}")
    for x, (src, s) in sends.items():
        dst, r = recvs[x]
        if s.peer != dst or r.peer != src or s.length != r.length or s.channel != r.channel:
            raise PlanError(f"transfer {x}: send {src}->{s.peer} does not match recv at {dst} from {r.peer}")


def _check_acyclic(node: str, prog: list[Op]) -> None:
    state: dict[int, int] = {}
    by_id = {op.id: op for op in prog}
    for start in by_id:
        stack = [(start, iter(by_id[start].deps))]
        if state.get(start):
            continue
        state[start] = 1
        while stack:
            cur, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[cur] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                raise PlanError(f"{node}: dependency cycle through op {nxt}")
            elif not state.get(nxt):
                state[nxt] = 1
                stack.append((nxt, iter(by_id[nxt].deps)))


def _ancestors(prog: list[Op]) -> dict[int, int]:
    """Bitmask (over op positions) of the transitive deps of each op."""
    pos = {op.id: i for i, op in enumerate(prog)}
    memo: dict[int, int] = {}
    order = _topo_order(prog)
    for op in order:
        mask = 0
        for d in op.deps:
            mask |= memo[d] | (1 << pos[d])
        memo[op.id] = mask
    return memo


def _topo_order(prog: list[Op]) -> list[Op]:
    by_id = {op.id: op for op in prog}
    indeg = {op.id: len(op.deps) for op in prog}
    users = defaultdict(list)
    for op in prog:
        for d in op.deps:
            users[d].append(op.id)
    ready = [op.id for op in prog if not op.deps]
    out = []
    while ready:
        i = ready.pop()
        out.append(by_id[i])
        for u in users[i]:
            indeg[u] -= 1
            if indeg[u] == 0:
                ready.append(u)
    return out


def _check_races(node: str, prog: list[Op]) -> None:
    """Every overlapping pair (write, any) on one buffer must be ordered by deps,
    except two reducing receives (applies are serialised and addition commutes)."""
    anc = _ancestors(prog)
    pos = {op.id: i for i, op in enumerate(prog)}
    by_buf: dict[str, list[Op]] = defaultdict(list)
    for op in prog:
        by_buf[op.buf].append(op)
    for ops in by_buf.values():
        ops.sort(key=lambda o: o.offset)
        active: list[Op] = []
        for op in ops:
            active = [a for a in active if a.offset + a.length > op.offset]
            for a in active:
                writes = (a.kind == RECV) or (op.kind == RECV)
                both_reduce = a.kind == RECV and op.kind == RECV and a.reduce and op.reduce
                if not writes or both_reduce:
                    continue
                ordered = anc[op.id] >> pos[a.id] & 1 or anc[a.id] >> pos[op.id] & 1
                if not ordered:
                    raise PlanError(f"{node}: ops {a.id} and {op.id} touch the same data of {op.buf!r} unordered")
            active.append(op)


# ---------------------------------------------------------------------------
# Reference interpreter: the executor's semantics without sockets.
# ---------------------------------------------------------------------------
def interpret(plan: Plan, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run ``plan`` in memory and return every node's final ``x``.

    Used by planner unit tests (is the schedule a correct AllReduce?) and as the
    oracle for the agents.  Raises PlanError on deadlock.
    """
    contributing = set(plan.contributing())
    bufs: dict[str, dict[str, np.ndarray]] = {}
    dtype = next(iter(inputs.values())).dtype if inputs else np.float32
    for n in plan.nodes:
        x = np.array(inputs[n], copy=True) if n in contributing else np.zeros(plan.length, dtype)
        bufs[n] = {"x": x, **{b: np.zeros(k, x.dtype) for b, k in plan.scratch.get(n, {}).items()}}
    done: dict[str, set[int]] = {n: set() for n in plan.nodes}
    pending = {n: list(plan.programs.get(n, [])) for n in plan.nodes}
    mailbox: dict[int, np.ndarray] = {}
    progress = True
    while progress:
        progress = False
        for n in plan.nodes:
            still = []
            for op in pending[n]:
                if not set(op.deps) <= done[n]:
                    still.append(op)
                    continue
                view = bufs[n][op.buf][op.offset : op.offset + op.length]
                if op.kind == SEND:
                    mailbox[op.xfer] = view.copy()
                elif op.xfer in mailbox:
                    data = mailbox.pop(op.xfer)
                    if op.reduce:
                        view += data
                    else:
                        view[:] = data
                else:
                    still.append(op)
                    continue
                done[n].add(op.id)
                progress = True
            pending[n] = still
    left = {n: [op.id for op in p] for n, p in pending.items() if p}
    if left:
        sample = {n: ids[:5] for n, ids in list(left.items())[:4]}
        raise PlanError(f"plan deadlocks; ops never run: {sample}")
    return {n: bufs[n]["x"] for n in plan.nodes}


def expected_result(plan: Plan, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
    return np.sum([inputs[n] for n in plan.contributing()], axis=0)


def check_allreduce(plan: Plan, inputs: Mapping[str, np.ndarray]) -> None:
    """Interpret ``plan`` and raise PlanError unless every receiver holds the exact sum."""
    out = interpret(plan, inputs)
    want = expected_result(plan, inputs)
    for n in plan.finishing():
        if not np.array_equal(out[n], want):
            bad = int(np.flatnonzero(out[n] != want)[0])
            raise PlanError(f"{n} ends with a wrong value at element {bad}: {out[n][bad]} != {want[bad]}")


# ---------------------------------------------------------------------------
# Building blocks shared by planners.
# ---------------------------------------------------------------------------
class ProgramBuilder:
    """Accumulates ops for every node, handing out op and transfer ids."""

    def __init__(self, nodes: Iterable[str]):
        self.programs: dict[str, list[Op]] = {n: [] for n in nodes}
        self._next_xfer = 0

    def transfer(self, src: str, dst: str, offset: int, length: int, *, reduce: bool,
                 send_deps: Iterable[int] = (), recv_deps: Iterable[int] = (),
                 src_buf: str = "x", dst_buf: str = "x", channel: int = 0, flow: int = 0,
                 chunk: int = 0, phase: str = "", rate_mbps: float = 0.0,
                 path: Iterable[str] = ()) -> tuple[int, int]:
        """Add a matched send (at src, on ``path`` if given) and recv (at dst); return
        (send_id, recv_id)."""
        xfer = self._next_xfer
        self._next_xfer += 1
        label = dict(channel=channel, flow=flow, chunk=chunk, phase=phase)
        s = Op(len(self.programs[src]), SEND, dst, xfer, offset, length, src_buf,
               deps=tuple(sorted(set(send_deps))), rate_mbps=rate_mbps, path=tuple(path), **label)
        self.programs[src].append(s)
        r = Op(len(self.programs[dst]), RECV, src, xfer, offset, length, dst_buf, reduce=reduce,
               deps=tuple(sorted(set(recv_deps))), **label)
        self.programs[dst].append(r)
        return s.id, r.id


def split_lengths(total: int, weights: Iterable[float]) -> list[int]:
    """Split ``total`` elements in proportion to ``weights`` (largest remainder; sums to total)."""
    w = np.asarray(list(weights), dtype=float)
    if len(w) == 0 or w.sum() <= 0:
        raise ValueError("weights must be non-empty with a positive sum")
    raw = total * w / w.sum()
    base = np.floor(raw).astype(int)
    for i in np.argsort(-(raw - base), kind="stable")[: total - int(base.sum())]:
        base[i] += 1
    return [int(b) for b in base]


@dataclass
class Tree:
    """A spanning (or Steiner) tree used for reduce-then-broadcast of one slice of the data.

    ``parent`` maps every node in the tree to its parent (the root to None).  ``share`` is
    the fraction of the vector the tree carries, ``chunks`` how many pipelined chunks the
    slice is cut into, ``rate_mbps`` the rate the planner assigned (informational).
    ``broadcast_parent``, if given, is a second parent map with the same root and nodes:
    the broadcast runs down that out-tree instead of down the reduce tree reversed (a pair
    of a reduce in-tree and a broadcast out-tree, as :func:`testbed.planners.bound.optimum`
    packs them).
    """

    root: str
    parent: dict[str, str | None]
    share: float = 1.0
    chunks: int = 1
    rate_mbps: float = 0.0
    broadcast_parent: dict[str, str | None] | None = None

    def parents(self, broadcast: bool = False) -> dict[str, str | None]:
        """The reduce tree's parent map, or with ``broadcast`` the broadcast tree's."""
        return self.broadcast_parent if broadcast and self.broadcast_parent is not None else self.parent

    def children(self, broadcast: bool = False) -> dict[str, list[str]]:
        parent = self.parents(broadcast)
        ch: dict[str, list[str]] = {n: [] for n in parent}
        for n, p in parent.items():
            if p is not None:
                ch[p].append(n)
        return ch

    def depth(self, broadcast: bool = False) -> dict[str, int]:
        d = {self.root: 0}
        ch = self.children(broadcast)
        stack = [self.root]
        while stack:
            u = stack.pop()
            for c in ch[u]:
                d[c] = d[u] + 1
                stack.append(c)
        return d

    def height(self) -> int:
        return max(self.depth().values())

    def edges(self) -> list[tuple[str, str]]:
        """Directed (child, parent) edges: the reduce direction."""
        return [(n, p) for n, p in self.parent.items() if p is not None]

    def links(self) -> list[tuple[str, str]]:
        """Every directed hop the tree's data takes: (child, parent) up the reduce tree,
        (parent, child) down the broadcast tree."""
        return self.edges() + [(p, n) for n, p in self.parents(True).items() if p is not None]

    def check(self, nodes: Iterable[str]) -> None:
        nodes = set(nodes)
        for broadcast in (False, True):
            parent = self.parents(broadcast)
            if parent.get(self.root, "missing") is not None:
                raise PlanError(f"tree root {self.root!r} must have parent None")
            if not nodes <= set(parent):
                raise PlanError(f"tree rooted at {self.root} misses {sorted(nodes - set(parent))}")
            if len(self.depth(broadcast)) != len(parent):
                raise PlanError(f"tree rooted at {self.root} is not connected or has a cycle")
        if set(self.parents(True)) != set(self.parent):
            raise PlanError(f"tree rooted at {self.root}: its broadcast tree spans other nodes than its reduce tree")

    def to_dict(self) -> dict:
        d = {"root": self.root, "parent": self.parent, "share": self.share,
             "chunks": self.chunks, "rate_mbps": self.rate_mbps, "height": self.height()}
        if self.broadcast_parent is not None:
            d["broadcast_parent"] = self.broadcast_parent
        return d


def contended_pacing(trees: list[Tree], capacity: dict[tuple[str, str], float]) -> dict[tuple[int, str, str], float]:
    """Pacing rates for trees running at ``tree.rate_mbps``, only where they contend: on a
    directed edge that two or more trees use (reduce child->parent, broadcast parent->child),
    each tree's connection is paced at its rate scaled by capacity / (sum of the rates on
    the edge) (a packing that leaves the edge partly idle fills it in the same proportions);
    an edge only one tree uses is left unpaced (the link itself limits it, and after a stall
    the tree can catch up, which a connection paced at exactly its mean rate never can).
    Returns {(channel, src, dst): rate_mbps} for the paced connections (channels of
    :func:`tree_channels`)."""
    load: dict[tuple[str, str], list[int]] = defaultdict(list)
    rates: dict[int, float] = {}
    for t, (up, down) in zip(trees, tree_channels(trees)):
        for c, p in t.parent.items():
            if p is not None:
                load[(c, p)].append(up)
        for c, p in t.parents(broadcast=True).items():
            if p is not None:
                load[(p, c)].append(down)
        rates[up] = rates[down] = t.rate_mbps
    return fill_contended(load, rates, capacity)


def tree_channels(trees: list[Tree]) -> list[tuple[int, int]]:
    """Each tree's (reduce channel, broadcast channel) in :func:`trees_plan`: its index for
    both, except that a tree with a broadcast tree of its own broadcasts on a channel of
    its own (its index + the number of trees): its reduce and broadcast trees may cross one
    link direction, where one ordered connection would queue every broadcast chunk behind
    the reduce chunks ready before it (a reduce leaf has all of them at the start)."""
    return [(ti, len(trees) + ti if t.broadcast_parent is not None else ti) for ti, t in enumerate(trees)]


def fill_contended(users: dict[tuple, list[int]], rates: Sequence[float] | Mapping[int, float],
                   capacity: dict[tuple[str, str], float]) -> dict[tuple[int, str, str], float]:
    """The scaling of :func:`contended_pacing`: ``users`` maps a key whose first two items
    are a link direction (a, b) to the indices of what shares it; where two or more share
    it, each with a rate above 0 is paced at ``rates[i]`` x capacity / (their rates' sum)
    (never below its rate).  Returns {(index, a, b): rate_mbps}."""
    out = {}
    for (a, b, *_), idx in users.items():
        if len(set(idx)) < 2:
            continue
        total = sum(rates[i] for i in idx)
        scale = max(1.0, capacity[(a, b)] / total) if total > 0 else 1.0
        out.update({(i, a, b): rates[i] * scale for i in idx if rates[i] > 0})
    return out


def trees_plan(scheme: str, nodes: list[str], length: int, trees: list[Tree], *,
               participants: list[str] | None = None, meta: dict | None = None,
               pace: bool | dict[tuple[int, str, str], float] = False) -> Plan:
    """Compile concurrent reduce-then-broadcast over several trees into a plan.

    The vector is split among trees by ``share``; each tree's slice into ``chunks``
    chunks.  Per chunk, a node adds its children's partial sums, forwards the result to
    its parent, and once the root has the full sum the chunk is broadcast back down the
    same tree (or down its ``broadcast_parent`` tree).  Chunks are independent, so
    broadcast of chunk k overlaps reduce of chunk k+1 (pipelining); each tree uses its own
    channel so trees never block each other.
    Every tree must contain all ``nodes`` that finish with the result (Steiner trees may
    omit non-participants only if they are neither participants nor receivers).
    With ``pace`` every transfer of a tree is paced at the tree's ``rate_mbps``; a dict
    {(channel, src, dst): rate_mbps} paces just those connections
    (:func:`contended_pacing`; channels: :func:`tree_channels`).
    """
    for t in trees:
        t.check(participants if participants is not None else nodes)
    b = ProgramBuilder(nodes)
    sizes = split_lengths(length, [t.share for t in trees])
    offset = 0
    for ti, (t, size, channels) in enumerate(zip(trees, sizes, tree_channels(trees))):
        up = sorted(t.depth().items(), key=lambda kv: -kv[1])  # leaves first
        down = sorted(t.depth(broadcast=True).items(), key=lambda kv: -kv[1])[::-1]  # root first
        children = t.children(broadcast=True)
        for ci, csize in enumerate(split_lengths(size, [1] * t.chunks) if size else []):
            if csize == 0:
                continue
            _tree_chunk(b, t, children, (up, down), offset, csize, channels, dict(flow=ti, chunk=ci),
                        _tree_pacing(pace, t))
            offset += csize
    meta = dict(meta or {})
    meta.setdefault("trees", [t.to_dict() for t in trees])
    plan = Plan(scheme, list(nodes), length, b.programs, participants=participants, meta=meta)
    return plan


def _tree_pacing(pace: bool | dict[tuple[int, str, str], float], t: Tree):
    """rate(channel, a, b): the pacing rate of tree t's connection a->b on ``channel`` (0:
    unpaced), by :func:`trees_plan`'s ``pace``."""

    def rate(channel: int, a: str, b: str) -> float:
        if isinstance(pace, dict):
            return pace.get((channel, a, b), 0.0)
        return t.rate_mbps if pace else 0.0
    return rate


def _tree_chunk(b: ProgramBuilder, t: Tree, children: dict[str, list[str]],
                order: tuple[list[tuple[str, int]], list[tuple[str, int]]], offset: int, csize: int,
                channels: tuple[int, int], label: dict, rate) -> None:
    """One chunk of one tree (:func:`trees_plan`): reduce bottom-up, each node forwarding the
    sum of its children's partial sums and its own; then broadcast top-down from the root
    (``children``: the broadcast tree's; ``order``: the nodes leaves first in the reduce
    tree, and root first in the broadcast tree; ``channels``: the reduce's and the
    broadcast's)."""
    up_channel, down_channel = channels
    got: dict[str, list[int]] = defaultdict(list)  # node -> recv ids of children's sums
    up_send: dict[str, int] = {}
    up, down = order
    for n, _ in up:  # reduce, bottom-up
        p = t.parent[n]
        if p is None:
            continue
        s, r = b.transfer(n, p, offset, csize, reduce=True, send_deps=got[n], phase="reduce",
                          channel=up_channel, rate_mbps=rate(up_channel, n, p), **label)
        up_send[n] = s
        got[p].append(r)
    have: dict[str, list[int]] = {t.root: got[t.root]}
    for n, _ in down:  # broadcast, top-down
        for c in children[n]:
            # the child's copy-in must wait until its own upward send has read the data
            _, r = b.transfer(n, c, offset, csize, reduce=False, send_deps=have[n], recv_deps=[up_send[c]],
                              phase="bcast", channel=down_channel, rate_mbps=rate(down_channel, n, c), **label)
            have[c] = [r]
