"""Predicting a plan's completion time from the topology.

Two models:

* :func:`predict` — a discrete-event, flow-level simulation of the plan IR with max-min
  fair link sharing, the model the MTREE and CREW papers use for their simulators
  (MTREE: "concurrent tasks share the link capacities equally"; CREW: flow-level Python
  simulation).  It is the reference the emulated runs are compared with.
* :func:`alpha_beta` — the classic closed-form Hockney α-β estimate (MTREE §III: a μ-byte
  message over link i costs α_i + βμ) summed over the plan's critical chain, with no
  contention, for comparison.

Both ignore reduction compute time (adding two vectors is assumed free) and treat a
send as complete when its last byte leaves the sender.  Neither models loss: on a lossy
link TCP's recovery (a round trip or more per lost segment, longer after a retransmission
timeout) delays the chunks behind a lost segment, and a stall upstream leaves a bottleneck
downstream idle; a run records what the recovery cost (``runs[].tcp``), the prediction
leaves it out.
"""

from __future__ import annotations

import heapq
from collections import deque
from itertools import count

import networkx as nx

from agents.executor import DEFAULT_LINKS, SUBBLOCK_BYTES, link_weights
from testbed.plan import SEND, Plan, PlanError
from testbed.routing import data_paths

MODEL = "flow-level max-min fair"


def _bytes_per_s(graph: nx.DiGraph, u: str, v: str) -> float:
    rate = graph[u][v].get("rate_mbps", 0.0)
    if not rate > 0:
        raise ValueError(f"link {u}->{v} has no positive rate_mbps")
    return rate * 1e6 / 8.0


class _Ops:
    """The plan's ops flattened to integer ids with dependency and transfer tables."""

    def __init__(self, plan: Plan):
        self.node: list[str] = []
        self.ops = []
        gid: dict[tuple[str, int], int] = {}
        for n in plan.nodes:
            for op in plan.programs.get(n, []):
                gid[(n, op.id)] = len(self.ops)
                self.node.append(n)
                self.ops.append(op)
        n_ops = len(self.ops)
        self.unmet = [0] * n_ops
        self.users: list[list[int]] = [[] for _ in range(n_ops)]
        send_of: dict[int, int] = {}
        recv_of: dict[int, int] = {}
        for i, op in enumerate(self.ops):
            self.unmet[i] = len(op.deps)
            for d in op.deps:
                self.users[gid[(self.node[i], d)]].append(i)
            (send_of if op.kind == SEND else recv_of)[op.xfer] = i
        if send_of.keys() != recv_of.keys():
            raise PlanError("plan has unmatched transfers; run plan.validate()")
        self.partner = [0] * n_ops
        for x, s in send_of.items():
            r = recv_of[x]
            self.partner[s], self.partner[r] = r, s
        self.is_send = [op.kind == SEND for op in self.ops]


class _Routes:
    """Per ordered pair: link ids on the latency-shortest path (or on a path a send names),
    one-way delay (s)."""

    def __init__(self, graph: nx.DiGraph, share: float = 1.0):
        self.graph = graph
        self.share = share  # payload per byte of link rate
        self.paths = data_paths(graph)
        self.link_id: dict[tuple[str, str], int] = {}
        self.cap: list[float] = []
        self.names: list[str] = []
        self._cache: dict[tuple, tuple[tuple[int, ...], float, float]] = {}

    def get(self, u: str, v: str, path: tuple[str, ...] = ()) -> tuple[tuple[int, ...], float, float]:
        """(link ids, one-way delay s, bottleneck bytes/s) of the route u→v, or of ``path``
        (``Op.path``) where given."""
        key = (u, v, path)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        if path and any(not self.graph.has_edge(a, b) for a, b in zip(path, path[1:])):
            raise PlanError(f"path {'>'.join(path)} crosses a link the topology does not have")
        path = path or self.paths.get((u, v))
        if path is None:
            raise PlanError(f"no route from {u} to {v} in the topology")
        ids = []
        delay = 0.0
        for a, b in zip(path, path[1:]):
            if (a, b) not in self.link_id:
                self.link_id[(a, b)] = len(self.cap)
                self.cap.append(_bytes_per_s(self.graph, a, b) * self.share)
                self.names.append(f"{a}->{b}")
            ids.append(self.link_id[(a, b)])
            delay += self.graph[a][b].get("delay_ms", 0.0) / 1000.0
        hit = (tuple(ids), delay, min(self.cap[i] for i in ids))
        self._cache[key] = hit
        return hit


def max_min_rates(classes: dict[tuple[int, ...], int], cap: list[float]) -> dict[tuple[int, ...], float]:
    """Max-min fair rate of one flow of each class by progressive filling.

    ``classes`` maps a flow's link-id tuple to the number of flows with exactly those
    links (identical flows get identical rates, so they are filled together), or to their
    total weight: a flow of weight w is w flows of one unit (weighted max-min), and the
    rate returned is one unit's.  Repeatedly
    the link with the smallest fair share (remaining capacity / unfrozen flows) freezes
    its flows at that share.  Shares only grow as flows freeze, so a heap of link shares
    with lazy invalidation finds the next bottleneck: O(Σ path lengths · log links).
    """
    rem: dict[int, float] = {}
    cnt: dict[int, int] = {}
    on_link: dict[int, list[tuple[int, ...]]] = {}
    for key, w in classes.items():
        for l in key:
            if l not in rem:
                rem[l], cnt[l], on_link[l] = cap[l], 0, []
            cnt[l] += w
            on_link[l].append(key)
    ver = dict.fromkeys(rem, 0)
    heap = [(rem[l] / cnt[l], 0, l) for l in rem]
    heapq.heapify(heap)
    rate: dict[tuple[int, ...], float] = {}
    while heap:
        share, v, l = heapq.heappop(heap)
        if v != ver[l] or cnt[l] <= 0:
            continue
        hit = set()
        for key in on_link[l]:
            if key in rate:
                continue
            rate[key] = share
            w = classes[key]
            for l2 in key:
                rem[l2] -= share * w
                cnt[l2] -= w
            hit.update(key)
        for l2 in hit:
            ver[l2] += 1
            if cnt[l2] > 0:
                heapq.heappush(heap, (max(share, rem[l2] / cnt[l2]), ver[l2], l2))
    return rate


PACE_PREFIX = "pace "  # names of the virtual links that model paced connections
STREAM_PREFIX = "stream "  # names of the virtual links that hold a cut-through send to its upstream's pace
WEIGHT_PREFIX = "weight "  # names of the uncapped virtual links that mark a weight class (shared links)
# TCP payload per shaped byte at MTU 1500 with timestamps: MSS 1448 in a 1514-byte Ethernet frame
# (HTB shapes frames: a link of rate R carries R x 1448/1514 of payload), and per IP byte (the
# kernel paces a connection's IP packets, 1500 bytes per 1448 of payload).
TCP_LINK_SHARE = 1448 / 1514
TCP_PACED_SHARE = 1448 / 1500
# The agent executor's CPU time per received transfer (Python: read, numpy add/copy, bookkeeping;
# the agent's threads share one interpreter, so a node handles its transfers one after another).
# Calibrated from bench efficiency runs on the project's 2-core machine shared by several
# workers: the measured CCT grew by ~2 ms per extra transfer per node when the same plans were
# cut into more chunks (MTREE 17 -> 160 chunks per tree, forest 4 -> 32 rounds).
EXECUTOR_TRANSFER_S = 0.002


def _shared_weights(ops: _Ops) -> dict[tuple[str, str, int], float]:
    """Shared links' weight of each connection (src, dst, channel): its largest rate where
    every channel from src to dst has one, else 1 (:func:`agents.executor.link_weights`)."""
    rates: dict[tuple[str, str], dict[int, float]] = {}
    for i, op in enumerate(ops.ops):
        if ops.is_send[i]:
            chans = rates.setdefault((ops.node[i], op.peer), {})
            chans[op.channel] = max(chans.get(op.channel, 0.0), op.rate_mbps)
    return {(s, d, ch): w for (s, d), chans in rates.items() for ch, w in link_weights(chans).items()}


def predict(plan: Plan, graph: nx.DiGraph, *, elem_bytes: int = 4, stop_and_wait: bool = False,
            tcp: bool = False, transfer_s: float = 0.0, trace: bool = False, cut_through_bytes: float = 0.0,
            links: str = "channel") -> dict:
    """Flow-level, max-min fair discrete-event simulation of ``plan`` on ``graph``.

    * An op is ready when its ``deps`` have completed.  A ready send joins the FIFO of
      its connection (src, dst, channel); a connection transmits one transfer at a time,
      in the order they became ready (one ordered byte stream, as the executor's TCP
      connection).
    * A transmitting transfer is a flow on the path its send names (``Op.path``), else on the
      latency-shortest route (:func:`testbed.routing.data_paths`: the direct link between
      neighbours, else latency-shortest); flows sharing a directed link share its
      rate max-min fairly (progressive filling, recomputed whenever the set of flows
      changes).  A paced send (``Op.rate_mbps``) also crosses a virtual link of that
      rate private to its connection; with ``links="shared"`` (``agents.links``) instead
      a weight: weighted max-min, the rates of a node's channels to a peer as weights.
    * The send completes when its last byte has left (``stop_and_wait``: one route RTT
      later, when the acknowledgement is back, and only then can the connection send
      again — TSEngine-style stop-and-wait, NetStorm App. B).  With ``tcp`` the rates are
      the payload TCP gets through them (:data:`TCP_LINK_SHARE` of a link's rate,
      :data:`TCP_PACED_SHARE` of a pacing rate): what the executor's connections carry over
      the emulator's links; without, rates carry payload at face value (the papers' model).
    * ``transfer_s`` > 0: a receive, once its data has arrived and its deps are met, takes
      that much of its node's CPU, one receive at a time per node (the executor's
      per-transfer cost, :data:`EXECUTOR_TRANSFER_S`); 0: receives are free.  The data arrives at the
      receiver one-way delay α (sum of ``delay_ms`` on the route) after the last byte
      left.  A single transfer therefore takes α + size/rate exactly.
    * A recv completes once its data has arrived and its deps are met.  Reduction
      compute time is ignored.
    * ``cut_through_bytes`` > 0 (the executor's cut-through sub-block, ``agents.subblock_bytes``):
      a send longer than that which depends on a receive joins its connection's FIFO once
      each of its unmet deps is a receive whose deps are met and whose first
      ``cut_through_bytes`` have arrived; while it streams, a virtual link holds it to the
      rate its upstream flows had when it started (lifted as they end), and its last byte
      leaves no earlier than its deps complete.  0: store and forward (the papers' model).

    Returns a dict with ``cct_s`` (completion of the last op of any program),
    ``result_s`` (the last receive), ``model``, ``per_link_bytes`` and ``link_busy_s``
    (bytes / capacity) per directed link "u->v", ``bottleneck`` (the link with the largest
    busy time), ``node_finish_s``, ``phase_end_s`` and ``transfers``.  Raises PlanError
    if the plan deadlocks.
    """
    sim = _Simulation(plan, graph, elem_bytes=elem_bytes, stop_and_wait=stop_and_wait, tcp=tcp,
                      transfer_s=transfer_s, cut_through_bytes=cut_through_bytes, links=links)
    sim.run()
    sim.check_complete()
    out = _report(plan, sim.ops, sim.routes, sim.done, sim.per_link, stop_and_wait, transfer_s)
    if trace:
        out["trace"] = sim.trace()
    return out


def fastest(candidates, graph: nx.DiGraph, elem_bytes: int = 4, patience: int | None = None
            ) -> tuple[tuple, dict[str, float]]:
    """Of ``candidates`` (an iterable of tuples ``(label, plan, ...)``), the one whose plan
    :func:`predict` finishes first for the agents' defaults (TCP, the executor's per-transfer
    cost and cut-through sub-block, ``DEFAULT_LINKS``), and every predicted label's CCT (s).
    Only the best candidate is kept while the others are predicted; with ``patience`` the
    search stops once that many candidates in a row were predicted slower than the best
    (for candidates ordered so that the prediction falls, then rises).  Candidates are
    drawn one at a time, so a generator's later plans are not built."""
    best, cct, worse = None, {}, 0
    for cand in candidates:
        label, plan = str(cand[0]), cand[1]
        cct[label] = predict(plan, graph, elem_bytes=elem_bytes, tcp=True, transfer_s=EXECUTOR_TRANSFER_S,
                             cut_through_bytes=SUBBLOCK_BYTES, links=DEFAULT_LINKS)["cct_s"]
        if best is None or cct[label] < cct[str(best[0])]:
            best, worse = cand, 0
        elif patience and (worse := worse + 1) >= patience:
            break
    if best is None:
        raise ValueError("no candidate plan")
    return best, cct


_ARRIVE, _ACK, _CPU, _BEGUN = 0, 1, 2, 3  # kinds of :class:`_Simulation` events


class _Simulation:
    """The state of :func:`predict`'s simulation: the plan's sends on their routes, the
    connections' FIFOs, the transmitting flows and the pending events, at time ``t``."""

    def __init__(self, plan: Plan, graph: nx.DiGraph, *, elem_bytes: int, stop_and_wait: bool, tcp: bool,
                 transfer_s: float, cut_through_bytes: float, links: str = "channel") -> None:
        self.ops = ops = _Ops(plan)
        self.routes = _Routes(graph, TCP_LINK_SHARE if tcp else 1.0)
        self.stop_and_wait, self.transfer_s, self.cut_through_bytes = stop_and_wait, transfer_s, cut_through_bytes
        n_ops = len(ops.ops)
        self.link_weight: dict[int, float] = {}  # weight link -> the weight of the flows crossing it
        self._route_sends(elem_bytes, tcp, links == "shared")
        self.cap = cap = self.routes.cap
        self.deps_of: list[list[int]] = [[] for _ in range(n_ops)]
        for d in range(n_ops):
            for u in ops.users[d]:
                self.deps_of[u].append(d)
        self.streams = [cut_through_bytes > 0 and ops.is_send[i] and self.size[i] > cut_through_bytes
                        and any(not ops.is_send[d] for d in self.deps_of[i]) for i in range(n_ops)]
        self.begun = [False] * n_ops  # recv: its first cut_through_bytes have arrived
        self.queued = [False] * n_ops  # send: in its connection's FIFO (or sent)
        self.held = [False] * n_ops  # streaming send: all its bytes out, its deps not yet complete
        self.cur_links: list[tuple[int, ...]] = list(self.links)  # the links of a transmitting flow
        self.streamers: dict[int, list[int]] = {}  # send op -> streaming sends capped at its rate
        self.queues = [deque() for _ in self.conn_id]
        self.busy = [False] * len(self.conn_id)
        self.done = [-1.0] * n_ops
        self.started = [0.0] * n_ops  # send: when its first byte went out
        self.left_at = [0.0] * n_ops  # send: when its last byte left
        self.arrived = [False] * n_ops  # recv: its data is there
        self.ready = [False] * n_ops  # recv: its deps are met
        self.unmet = list(ops.unmet)
        self.per_link = [0.0] * len(cap)
        self.events: list[tuple[float, int, int, int]] = []  # (time, seq, kind, op): arrivals and ACKs
        self.cpu_free = dict.fromkeys(plan.nodes, 0.0)  # transfer_s: when each node's CPU is next free
        self.seq = count()
        # Transmitting flows.  A flow's bytes left are ``left`` as of ``t_upd`` at rate ``rate``;
        # its predicted end sits in ``ends`` (stale entries are skipped by version).
        self.left = [0.0] * n_ops
        self.t_upd = [0.0] * n_ops
        self.rate = [0.0] * n_ops
        self.ver = [0] * n_ops
        self.ends: list[tuple[float, int, int]] = []
        self.members: dict[tuple[int, ...], set[int]] = {}  # class (link tuple) -> transmitting flows
        self.class_rate: dict[tuple[int, ...], float] = {}  # max-min rate per class ...
        self.basis: dict[tuple[int, ...], int] = {}  # ... computed for these class sizes
        self.touched: set[tuple[int, ...]] = set()  # classes whose size may differ from basis
        self.on_link: list[set[tuple[int, ...]]] = [set() for _ in cap]  # link -> active classes
        self.fresh: list[int] = []  # flows started since the last rate update
        self.t = 0.0
        self.work = deque(i for i in range(n_ops) if self.unmet[i] == 0)

    def _route_sends(self, elem_bytes: int, tcp: bool, shared: bool) -> None:
        """Each send's links (with its connection's pacing link, or with shared links its
        weight's link), one-way delay, RTT, size and connection."""
        ops, routes = self.ops, self.routes
        n_ops = len(ops.ops)
        self.links: list[tuple[int, ...]] = [()] * n_ops
        self.alpha = [0.0] * n_ops
        self.rtt = [0.0] * n_ops
        self.size = [0.0] * n_ops
        self.conn = [0] * n_ops
        self.conn_id: dict[tuple[str, str, int], int] = {}
        paced: dict[tuple[str, str, int], int] = {}  # connection -> its virtual pacing link
        weights = _shared_weights(ops) if shared else {}
        weight_link: dict[float, int] = {}
        for i, op in enumerate(ops.ops):
            if not ops.is_send[i]:
                continue
            src = ops.node[i]
            self.links[i], self.alpha[i], _ = routes.get(src, op.peer, op.path)
            w = weights.get((src, op.peer, op.channel), 1.0)
            if w != 1.0:  # shared links: a weight class, marked by an uncapped virtual link
                if w not in weight_link:
                    weight_link[w] = len(routes.cap)
                    self.link_weight[weight_link[w]] = w
                    routes.cap.append(float("inf"))
                    routes.names.append(WEIGHT_PREFIX + f"{w:g}")
                self.links[i] = self.links[i] + (weight_link[w],)
            elif op.rate_mbps > 0 and not shared:  # a paced connection: a private virtual link at its rate
                key = (src, op.peer, op.channel)
                if key not in paced:
                    paced[key] = len(routes.cap)
                    routes.cap.append(op.rate_mbps * 1e6 / 8 * (TCP_PACED_SHARE if tcp else 1.0))
                    routes.names.append(PACE_PREFIX + f"{src}->{op.peer}#{op.channel}")
                self.links[i] = self.links[i] + (paced[key],)
            if self.stop_and_wait:
                self.rtt[i] = self.alpha[i] + routes.get(op.peer, src, op.path[::-1])[1]  # the acks come back the same way
            self.size[i] = float(op.length * elem_bytes)
            self.conn[i] = self.conn_id.setdefault((src, op.peer, op.channel), len(self.conn_id))

    def run(self) -> None:
        """The event loop: start what is ready, re-share rates, advance to the next flow end or event."""
        while True:
            self.start_ready()
            if self.touched:
                self.reshare()
            self.rate_fresh()
            ends, events, ver = self.ends, self.events, self.ver
            while ends and ends[0][1] != ver[ends[0][2]]:
                heapq.heappop(ends)
            t_flow = ends[0][0] if ends else float("inf")
            t_ev = events[0][0] if events else float("inf")
            if t_flow == float("inf") and t_ev == float("inf"):
                break
            self.t = min(t_flow, t_ev)
            horizon = self.t + 1e-12 * (1.0 + self.t)
            while ends and ends[0][0] <= horizon:
                _, v, i = heapq.heappop(ends)
                if v == ver[i]:
                    self.flow_ended(i)
            while events and events[0][0] <= horizon:
                _, _, kind, i = heapq.heappop(events)
                self.event(kind, i)

    def start_ready(self) -> None:
        """Ops whose deps are met: sends join their connection's FIFO, receives are ready."""
        ops = self.ops
        while self.work:
            i = self.work.popleft()
            if ops.is_send[i]:
                if not self.queued[i]:
                    self.queued[i] = True
                    self.queues[self.conn[i]].append(i)
                    self.pump(self.conn[i])
            else:
                self.ready[i] = True
                if self.arrived[i]:
                    self.received(i)
                for u in ops.users[i]:
                    self.early(u)

    def reshare(self) -> None:
        """Max-min rates anew for the connected component (classes linked by shared links) of
        the classes that changed; max-min allocations of components are independent."""
        members, basis, on_link = self.members, self.basis, self.on_link
        moved = [k for k in self.touched if len(members.get(k, ())) != basis.get(k, 0)]
        self.touched.clear()
        if not moved:
            return
        comp: set[tuple[int, ...]] = set()
        seen_links: set[int] = set()
        stack = list(moved)
        while stack:
            k = stack.pop()
            for l in k:
                if l in seen_links:
                    continue
                seen_links.add(l)
                for k2 in on_link[l]:
                    if k2 not in comp:
                        comp.add(k2)
                        stack.append(k2)
        for k in moved:
            if not members.get(k):
                basis.pop(k, None)
                self.class_rate.pop(k, None)
                for l in k:
                    on_link[l].discard(k)
        sub = {k: len(members[k]) for k in comp if members.get(k)}
        basis.update(sub)
        weight = {k: self._weight(k) for k in sub}
        for key, r in max_min_rates({k: n * weight[k] for k, n in sub.items()}, self.cap).items():
            r *= weight[key]
            if self.class_rate.get(key) != r:
                self.class_rate[key] = r
                for i in members[key]:
                    self.set_rate(i, r)

    def _weight(self, key: tuple[int, ...]) -> float:
        """The weight of a class's flows (1 unless shared links gave them another)."""
        w = 1.0
        for l in key:
            w *= self.link_weight.get(l, 1.0)
        return w

    def rate_fresh(self) -> None:
        """Flows started since the last re-share take their class's rate (one that replaced an
        identical flow keeps it); with cut-through, schedule when their first bytes are in."""
        ops, t = self.ops, self.t
        for i in self.fresh:
            self.set_rate(i, self.class_rate[self.cur_links[i]])
            if self.cut_through_bytes > 0 and any(self.streams[u] for u in ops.users[ops.partner[i]]):
                heapq.heappush(self.events, (t + self.alpha[i] + min(self.size[i], self.cut_through_bytes)
                                             / self.rate[i], next(self.seq), _BEGUN, ops.partner[i]))
        self.fresh.clear()

    def flow_ended(self, i: int) -> None:
        """Send i's last byte left now; the sends streaming its data are no longer held to its rate."""
        cur_links = self.cur_links
        self.ver[i] += 1
        self.left[i] = 0.0
        key = cur_links[i]
        self.members[key].discard(i)
        self.touched.add(key)
        for u in self.streamers.pop(i, ()):  # its data is all under way: the sends streaming it are free
            if self.left[u] > 0:
                self.cap[cur_links[u][-1]] = float("inf")
                self.basis[cur_links[u]] = -1
                self.touched.add(cur_links[u])
        if self.unmet[i] > 0:
            self.held[i] = True
        else:
            self.finish(i)

    def event(self, kind: int, i: int) -> None:
        if kind == _BEGUN:
            self.begun[i] = True
            for u in self.ops.users[i]:
                self.early(u)
        elif kind == _ARRIVE:
            self.arrived[i] = True
            if self.ready[i]:
                self.received(i)
        elif kind == _CPU:
            self.complete(i)
        else:  # _ACK: stop-and-wait's acknowledgement is back, the connection may send again
            self.complete(i)
            self.busy[self.conn[i]] = False
            self.pump(self.conn[i])

    def complete(self, i: int) -> None:
        self.done[i] = self.t
        for u in self.ops.users[i]:
            self.unmet[u] -= 1
            if self.unmet[u] == 0:
                if self.held[u]:
                    self.finish(u)
                elif not self.queued[u]:
                    self.work.append(u)
            else:
                self.early(u)

    def early(self, u: int) -> None:
        """Cut-through: queue send u before its deps are met."""
        ops, done = self.ops, self.done
        if self.streams[u] and not self.queued[u] and all(
                done[d] >= 0 or not ops.is_send[d] and self.ready[d] and self.begun[d] for d in self.deps_of[u]):
            self.queued[u] = True
            self.queues[self.conn[u]].append(u)
            self.pump(self.conn[u])

    def finish(self, i: int) -> None:
        """Send i's last byte left at t."""
        t = self.t
        self.held[i] = False
        self.left_at[i] = t
        heapq.heappush(self.events, (t + self.alpha[i], next(self.seq), _ARRIVE, self.ops.partner[i]))
        if self.stop_and_wait:
            heapq.heappush(self.events, (t + self.rtt[i], next(self.seq), _ACK, i))
        else:
            self.complete(i)
            self.busy[self.conn[i]] = False
            self.pump(self.conn[i])

    def received(self, i: int) -> None:
        """A recv whose data is there and whose deps are met."""
        if self.transfer_s <= 0:
            self.complete(i)
            return
        n = self.ops.node[i]
        self.cpu_free[n] = max(self.t, self.cpu_free[n]) + self.transfer_s
        heapq.heappush(self.events, (self.cpu_free[n], next(self.seq), _CPU, i))

    def pump(self, c: int) -> None:
        """Connection c starts its next transfer if it is idle."""
        if self.busy[c] or not self.queues[c]:
            return
        ops, routes = self.ops, self.routes
        i = self.queues[c].popleft()
        self.busy[c] = True
        key = self.links[i]
        if self.unmet[i] > 0:  # streaming: no faster than the flows bringing its data
            up = [ops.partner[d] for d in self.deps_of[i] if self.done[d] < 0 and not ops.is_send[d]]
            up = [s for s in up if self.left[s] > 0 and self.rate[s] > 0]
            if up:
                routes.cap.append(min(self.rate[s] for s in up))
                routes.names.append(STREAM_PREFIX + str(i))
                self.per_link.append(0.0)
                self.on_link.append(set())
                key = key + (len(routes.cap) - 1,)
                for s in up:
                    self.streamers.setdefault(s, []).append(i)
        self.cur_links[i] = key
        self.members.setdefault(key, set()).add(i)
        self.touched.add(key)
        for l in key:
            self.on_link[l].add(key)
        self.left[i] = self.size[i]
        self.started[i] = self.t
        self.fresh.append(i)
        for l in key:
            self.per_link[l] += self.size[i]

    def set_rate(self, i: int, r: float) -> None:
        t = self.t
        self.left[i] -= self.rate[i] * (t - self.t_upd[i])
        self.t_upd[i], self.rate[i] = t, r
        self.ver[i] += 1
        heapq.heappush(self.ends, (t + self.left[i] / r, self.ver[i], i))

    def check_complete(self) -> None:
        """Raise PlanError naming a few ops that never completed (the plan deadlocks)."""
        ops, done = self.ops, self.done
        stuck = [i for i in range(len(ops.ops)) if done[i] < 0]
        if stuck:
            sample = [(ops.node[i], ops.ops[i].id) for i in stuck[:5]]
            raise PlanError(f"plan deadlocks in the cost model; ops never complete: {sample}")

    def trace(self) -> list[list]:
        """[xfer, src, dst, started, last byte left, received] of every send, sorted."""
        ops, done = self.ops, self.done
        return sorted([ops.ops[i].xfer, ops.node[i], ops.ops[i].peer, self.started[i], self.left_at[i],
                       done[ops.partner[i]]] for i in range(len(ops.ops)) if ops.is_send[i])


def _report(plan: Plan, ops: _Ops, routes: _Routes, done: list[float], per_link: list[float],
            stop_and_wait: bool, transfer_s: float = 0.0) -> dict:
    node_finish = {n: 0.0 for n in plan.nodes}
    phase_end: dict[str, float] = {}
    result = 0.0
    for i, op in enumerate(ops.ops):
        n = ops.node[i]
        node_finish[n] = max(node_finish[n], done[i])
        if not ops.is_send[i]:
            result = max(result, done[i])
            phase_end[op.phase] = max(phase_end.get(op.phase, 0.0), done[i])
    real = [l for l, name in enumerate(routes.names) if not name.startswith((PACE_PREFIX, STREAM_PREFIX, WEIGHT_PREFIX))]
    busy = {l: per_link[l] / routes.cap[l] for l in real}  # at the payload rate the model gives the link
    bott = max(real, key=lambda l: (busy[l], routes.names[l]), default=None)
    return {
        "cct_s": max(node_finish.values(), default=0.0),
        "result_s": result,
        "model": MODEL,
        "stop_and_wait": stop_and_wait,
        "payload_share": routes.share,
        "transfer_s": transfer_s,
        "compute": "reduction compute time ignored",
        "per_link_bytes": {routes.names[l]: per_link[l] for l in real},
        "link_busy_s": {routes.names[l]: busy[l] for l in real},
        "bottleneck": routes.names[bott] if bott is not None else "",
        "node_finish_s": node_finish,
        "phase_end_s": phase_end,
        "transfers": sum(ops.is_send),
    }


def alpha_beta(plan: Plan, graph: nx.DiGraph, elem_bytes: int = 4) -> dict:
    """Classic Hockney α-β estimate (MTREE §III: a μ-byte message over a route costs
    α + μ/b, α = route one-way delay, b = route bottleneck rate) along the plan's critical
    chain, with **no contention** between connections.

    The only queueing kept is the one the α-β model itself implies: a connection
    (src, dst, channel) sends one message at a time, in the order they become ready, so a
    pipelined chain occupies each hop μ/b per chunk (the flow-shop recurrence of MTREE
    eq. (2)).  Reduction compute time is ignored.  Returns ``cct_s``, ``model`` and the
    transfers on the critical chain as "src->dst" strings.
    """
    ops = _Ops(plan)
    cost, conn, n_conn = _alpha_beta_costs(ops, _Routes(graph), elem_bytes)
    finish, why = _critical_times(ops, cost, conn, n_conn)
    if any(f < 0 for f in finish):
        raise PlanError("plan deadlocks (cyclic dependencies across nodes)")
    model = "alpha-beta critical chain (no contention)"
    n_ops = len(ops.ops)
    if not n_ops:
        return {"cct_s": 0.0, "model": model, "critical_chain": []}
    last = max(range(n_ops), key=lambda i: finish[i])
    chain = []
    i = last
    while i >= 0:
        if not ops.is_send[i]:
            chain.append(f"{ops.ops[i].peer}->{ops.node[i]}")
        i = why[i]
    return {"cct_s": finish[last], "model": model, "critical_chain": chain[::-1]}


def _alpha_beta_costs(ops: _Ops, routes: _Routes, elem_bytes: int) -> tuple[list[float], list[int], int]:
    """Per op the α-β cost (send: μ/b, its transmission time; recv: α of its route) and per
    send its connection's number; and the number of connections."""
    n_ops = len(ops.ops)
    cost = [0.0] * n_ops  # send: transmission time; recv: α of its route
    conn = [0] * n_ops
    conn_id: dict[tuple[str, str, int], int] = {}
    for i, op in enumerate(ops.ops):
        if ops.is_send[i]:
            _, a, b = routes.get(ops.node[i], op.peer, op.path)
            cost[i] = op.length * elem_bytes / b
            cost[ops.partner[i]] = a
            conn[i] = conn_id.setdefault((ops.node[i], op.peer, op.channel), len(conn_id))
    return cost, conn, len(conn_id)


def _critical_times(ops: _Ops, cost: list[float], conn: list[int], n_conn: int) -> tuple[list[float], list[int]]:
    """:func:`alpha_beta`'s event pass: every op's completion time (-1: never) and the op
    that last held it up (its connection's previous send, its data's send or its latest
    dep; -1: none), each connection sending one message at a time in ready order."""
    n_ops = len(ops.ops)
    free = [0.0] * n_conn
    last_on = [-1] * n_conn
    unmet = list(ops.unmet)
    dep_t = [0.0] * n_ops  # latest completion among deps
    dep_w = [-1] * n_ops
    arrive = [-1.0] * n_ops  # recv: data arrival time (-1 = unknown)
    arrive_w = [-1] * n_ops
    finish = [-1.0] * n_ops
    why = [-1] * n_ops
    seq = count()
    heap = [(0.0, next(seq), i) for i in range(n_ops) if unmet[i] == 0 and ops.is_send[i]]
    deps_ok = [unmet[i] == 0 for i in range(n_ops)]

    def push_recv(r: int) -> None:
        if deps_ok[r] and arrive[r] >= 0:
            heapq.heappush(heap, (max(dep_t[r], arrive[r]), next(seq), r))

    while heap:
        t, _, i = heapq.heappop(heap)
        if ops.is_send[i]:
            c = conn[i]
            if free[c] > t:
                t, why[i] = free[c], last_on[c]
            else:
                why[i] = dep_w[i]
            finish[i] = free[c] = t + cost[i]
            last_on[c] = i
            r = ops.partner[i]
            arrive[r], arrive_w[r] = finish[i] + cost[r], i
            push_recv(r)
        else:
            finish[i] = t
            why[i] = arrive_w[i] if arrive[i] >= dep_t[i] else dep_w[i]
        for u in ops.users[i]:
            unmet[u] -= 1
            if finish[i] >= dep_t[u]:
                dep_t[u], dep_w[u] = finish[i], i
            if unmet[u] == 0:
                deps_ok[u] = True
                if ops.is_send[u]:
                    heapq.heappush(heap, (dep_t[u], next(seq), u))
                else:
                    push_recv(u)
    return finish, why
