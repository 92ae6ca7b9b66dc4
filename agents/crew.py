"""CREW at run time (Luo et al., "Efficient Cross-Cloud Partial Reduce With CREW", §III-IV):
the controller's FIFO ready queue forms partial-reduce groups P of the first p ready workers,
each group's reduce runs as a *task* (increasing ``pid``) while the other workers keep
computing, and every worker counts the rounds it completes in a window T (§V, Fig. 5).

Three parts, one home:

* :class:`Controller` — pure (no sockets, unit-tested): the ready queue, group formation in
  ready order, task ids, which worker is in which task; :func:`replacement` is Eq. (3).
* :class:`TaskRun` — the coordinator side at run time (driven by
  :meth:`agents.coordinator.Coordinator.run` when it is given ``tasks``).
* :func:`worker_loop` — the agent side (:meth:`agents.agent.Agent.run` in ``tasks`` mode).

Protocol (control messages; data moves over the plan versions' own connections).  A task
over P is a *plan version*: the scheme's planner run for ``active: P`` (for CREW, every
worker aggregates, so the plan involves all n; for OPR, PS over P... only the nodes with a
program) — installed once per distinct group with PLAN/INSTALLED exactly as a policy switch
installs one (:mod:`agents.coordinator`), then reused whenever the same group forms again::

    coordinator -> agents: begin                          (the window T starts; agents compute)
    agent -> coordinator:  enqueue {round}                (the paper's READY: compute of round done)
    coordinator -> involved: plan {version, ...}          (first time this group forms)
    involved -> coordinator: installed {version}
    coordinator -> involved: task {pid, version, rounds}  (rounds: member -> its round)
    involved -> coordinator: armed {pid}                  (executor moved to iteration pid, inputs set)
    coordinator -> involved: start {pid}
    involved -> coordinator: task_done {pid, timing, check} | task_failed {pid, message}
    agent -> coordinator:  link_lost {peer} | link_back {peer}   (heartbeats over the data network)
    coordinator -> involved: abandon {pid, version}      (failover: the task is stopped)
    coordinator -> agents: finish (after T, once the tasks in flight ended)

Non-blocking scatter (``prescatter_for``, §IV-A2): one more plan version per worker i, its
early scatter of the default blocks (installed before BEGIN); at i's ENQUEUE of round r::

    coordinator -> receivers: pre {of: i, version, seq}   (armed for i's early scatter number seq)
    receivers -> coordinator: pre_armed {of, seq}
    coordinator -> i:         pre_go {version, seq, round} (i sends its round-r blocks at once)

and TASK carries ``pre`` {from: {k: [version, seq]}}.  At TASK a member cuts its own early
scatter short (the chunks not yet written go *withdrawn*, a header without payload:
:mod:`agents.executor`) and, in the task, withdraws every chunk it delivered to that chunk's
aggregator in P's split (Alg. 2); the aggregator applies the early copy it holds instead.
Chunks delivered to an aggregator Alg. 2 moved them away from are not used there (§IV-A2:
"discard"); their senders send them again to the new owner.  ARMED comes at once, as in
blocking mode: a member asks whether a chunk was delivered only as the chunk is about to go
(its early scatter has ended by then), an aggregator reads an early copy only when the
withdrawn chunk arrives (once that early scatter ended there).  The worker whose ENQUEUE
completes a group scatters nothing early (P is known at once: it withdraws nothing).  The
task records count, per member, the chunks its early scatter delivered and how many of them
it withdrew (the rest were sent in vain).

ARMED before START is the one message more than the iteration barrier: a member may send
chunks of task ``pid`` to an aggregator only once that aggregator's executor accepts
iteration ``pid`` (the executor refuses early frames).  A version runs one task at a time
(the coordinator holds a group whose version is still finishing somewhere).  Members of a
task are checked exactly: the result equals the sum over P of every member's input of the
round it entered with (:func:`group_sum`).

Concurrent tasks run in their own executors (one per version, each with its own
connections).  The scheme's ``scheduling`` (§IV-C) decides how they share a link: ``fs``,
every flow on its own connection, sharing the rate as TCP flows do; ``fcfs`` (FL-FCFS, flow
level: the paper's choice), the PLAN says ``link_fifo`` and every version's sends to a peer
take turns through the agent's one :class:`agents.executor.LinkGate` for that peer, in the
order they became ready (a scatter's chunks all at START, a multicast chunk once reduced),
one at a time, no preemption.  Per-chunk arrival times go into the task records with the
``chunk_times`` option (tests measure the sharing from them).
"""

from __future__ import annotations

import hashlib
import logging
import queue
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from . import wire
from .inputs import make_input

log = logging.getLogger("agents.crew")


# -- pure controller logic ---------------------------------------------------------------
@dataclass
class Task:
    """One partial reduce: ``members`` (P, in ready order) and the round each entered with."""

    pid: int
    members: list[str]
    rounds: dict[str, int]
    state: str = "formed"  # formed | installing | held | arming | running | done | abandoned
    version: int | None = None
    involved: list[str] = field(default_factory=list)
    waiting: set = field(default_factory=set)
    times: dict = field(default_factory=dict)  # phase -> ns (coordinator clock)
    done: dict = field(default_factory=dict)  # node -> its task_done report
    deadline: float = 0.0  # monotonic
    failed: list = field(default_factory=list)  # (monotonic, node, message) of each TASK_FAILED


class Controller:
    """§III: a FIFO queue of ready workers; once ``p`` are queued they are popped as a group
    P and get the next task id.  A worker is an initiator of at most one task at a time
    (§IV-C); it is queued again only after its task ended (it then computes its next round).
    ``alive`` shrinks when a worker is lost (§IV-B: it joins no future P)."""

    def __init__(self, workers: list[str], p: int):
        if not 1 <= p <= len(workers):
            raise ValueError(f"group size p = {p} with {len(workers)} workers")
        self.p, self.alive = p, list(workers)
        self.queue: deque[tuple[str, int]] = deque()  # (worker, round) in ready order
        self.tasks: dict[int, Task] = {}
        self.member_of: dict[str, int] = {}  # worker -> pid of the task it initiates
        self.deferred: dict[str, int] = {}  # worker -> round it reported ready while still in a task
        self.next_pid = 0

    def ready(self, worker: str, rnd: int) -> None:
        if worker not in self.alive:
            return
        t = self.tasks.get(self.member_of.get(worker, -1))
        if t is not None and rnd > t.rounds[worker]:
            # its result of that round came in before a failover re-ran the task (a DONE that
            # crossed the repair): it joins the repair with that round and is queued after it
            self.deferred[worker] = rnd
            return
        if (worker, rnd) in self.queue:  # the same readiness twice (the controller re-queued an
            return  # abandoned member, or a REJOIN said ready, and its ENQUEUE crossed that): once
        if worker in self.member_of or any(w == worker for w, _ in self.queue):
            raise ValueError(f"{worker} is ready while queued or in task {self.member_of.get(worker)}")
        self.queue.append((worker, rnd))

    def form(self) -> list[Task]:
        """Every group the queue holds now, first ready first."""
        out = []
        while len(self.queue) >= self.p:
            got = [self.queue.popleft() for _ in range(self.p)]
            t = Task(self.next_pid, [w for w, _ in got], dict(got))
            self.next_pid += 1
            self.tasks[t.pid] = t
            for w in t.members:
                self.member_of[w] = t.pid
            out.append(t)
        return out

    def member_done(self, pid: int, worker: str) -> None:
        """``worker`` has its result of task ``pid``: it may be queued again."""
        if self.member_of.get(worker) == pid:
            del self.member_of[worker]
            if worker in self.deferred:
                self.ready(worker, self.deferred.pop(worker))

    def running(self) -> list[Task]:
        return [t for t in self.tasks.values() if t.state not in ("done", "abandoned", "repaired")]

    def lose(self, worker: str) -> list[Task]:
        """§IV-B, worker loss: out of the queue and of every future P; returns the tasks in
        flight that involve it (as member or aggregator)."""
        if worker in self.alive:
            self.alive.remove(worker)
        self.queue = deque((w, r) for w, r in self.queue if w != worker)
        self.member_of.pop(worker, None)
        return [t for t in self.running() if worker in t.members or worker in t.involved]


def replacement(candidates: list[str], members: list[str], load: dict[str, float], block: float,
                rate) -> str | None:
    """Eq. (3): the candidate k (live connections to every member of P) minimising
    max_{i in P} (l_k + x_j) / min(b_{i,k}, b_{k,i}) — l_k, the candidate's scheduled
    aggregation volume, where the paper prints l_i (a probable typo, the note's §3.6); x_j
    the orphaned block's size; ``rate(a, b)`` = b_{a,b}.  None when S is empty (ABANDON)."""
    best, arg = None, None
    for k in candidates:
        if k in members:
            continue
        cost = max((load.get(k, 0.0) + block) / min(rate(i, k), rate(k, i)) for i in members)
        if best is None or cost < best:
            best, arg = cost, k
    return arg


def group_sum(seed: int, nodes: list[str], rounds: dict[str, int], length: int, dtype) -> np.ndarray:
    """What every member of a task must end with: the sum over P of each member's input of
    the round it entered the task with (inputs from seed, worker, round: :mod:`agents.inputs`)."""
    acc = np.zeros(int(length), dtype)
    for m, r in rounds.items():
        np.add(acc, make_input(seed, nodes.index(m), r, length, dtype), out=acc)
    return acc


def rounds_in_window(tasks: list[dict], t0_ns: int, window_s: float) -> dict[str, int]:
    """Rounds every worker completed within [t0, t0 + T] (a round: a task it initiated and
    whose result it holds, correct)."""
    end = t0_ns + int(window_s * 1e9)
    out: dict[str, int] = {}
    for t in tasks:
        for m, d in (t.get("members_done") or {}).items():
            if d.get("correct") and d["done_ns"] <= end:
                out[m] = out.get(m, 0) + 1
    return out


# -- coordinator side ----------------------------------------------------------------------
class TaskRun:
    """The controller at run time, on a :class:`agents.coordinator.Coordinator` whose agents
    are READY.  ``opts``: ``p``, ``window_s`` (T), ``plan_for(members) -> Plan`` (the scheme's
    pure planner over group P, same nodes and length as the JOB's plan)."""

    def __init__(self, coord, opts: dict):
        self.c, self.p, self.window_s = coord, int(opts["p"]), float(opts["window_s"])
        self.plan_for = opts["plan_for"]
        self.nodes = list(coord.plan.nodes)
        self.ctl = Controller(self.nodes, self.p)
        self.plans = [coord.plan]  # version -> plan (0: the JOB's)
        self.by_group: dict[frozenset, int] = {}
        self.busy: dict[int, int] = {}  # version -> pid running on it
        self.installing: dict[int, set] = {}  # version -> nodes yet to answer INSTALLED
        self.records: list[dict] = []
        self.enqueued: list[list] = []  # [node, round, t_ns]
        self.t0_ns = 0
        self.rate = opts.get("rate")  # b_{i,j}(i, j) for Eq. (3); None: no repair, only ABANDON
        self.lost: list[str] = []
        self.faults: list[dict] = []
        self.reassign: dict[int, dict] = {}  # pid -> {j: k} of a repair task
        self.link_timeout_s = float(opts.get("link_timeout_s") or 0.0)
        self.broken: dict[frozenset, dict] = {}  # {a, b} -> its fault record, while the link is down
        self.later: list[tuple[float, str, int]] = []  # (monotonic, worker, round): re-queued after a pause
        self._pair_cache: dict[int, set] = {}
        self.chunk_times = bool(opts.get("chunk_times"))  # per-chunk arrival times in the records
        self.prescatter_for = opts.get("prescatter_for")  # non-blocking scatter: sender -> its early plan
        self.pre_v: dict[str, int] = {}  # worker -> version of its early scatter
        self.seq: dict[str, int] = {}  # worker -> number of its latest early scatter
        self.pre_wait: dict[str, set] = {}  # worker -> receivers not yet armed for it
        self.end = float("inf")
        self.enq_round: dict[str, int] = {}
        self.finishing = False
        self.late: set[str] = set()  # non-blocking: workers whose queued round was not scattered early
        # controller loss (§IV-B): {"at_s", "for_s"} after the window starts; the workers wait for it
        self.down = opts.get("controller_down")
        self.controller_wait_s = float(opts.get("controller_wait_s") or
                                       max(10.0, 2 * coord.silence_s) + (self.down or {}).get("for_s", 0.0))
        self.detached: set[str] = set()  # workers not (yet) back with the restarted controller
        self.orphans: dict[int, Task] = {}  # tasks running when the controller was lost
        self.still: dict[int, set] = {}  # orphan pid -> workers that say they still run it
        self.rejoin_ready: set[str] = set()
        self.up_at = self.rejoin_by = float("inf")

    def run(self) -> dict:
        c = self.c
        task_limit = c.ready_limit() + c.limit_s
        if self.prescatter_for:
            self._install_prescatter(task_limit)
        for n in self.nodes:
            c._send(n, {"msg": "begin", "controller_wait_s": self.controller_wait_s, **({"watch": self._watch_peers(n), "link_timeout_s": self.link_timeout_s}
                                           if self.link_timeout_s else {})})
        self.t0_ns = time.time_ns()
        end = self.end = time.monotonic() + self.window_s
        down_at = end - self.window_s + self.down["at_s"] if self.down else float("inf")
        c.progress(f"window of {self.window_s:g} s started: groups of {self.p} from the ready queue")
        while True:
            now = time.monotonic()
            if now >= down_at:
                down_at = float("inf")
                self._controller_lost()
            if self.detached and now >= self.up_at and not c.rejoin_open:
                c.rejoin_open, self.rejoin_by = True, now + self.controller_wait_s
                self.ctl_fault["back_ns"] = time.time_ns()
                c.progress("controller restarted: workers rejoin")
            if self.detached and now > self.rejoin_by:
                for n in sorted(self.detached):
                    self.detached.discard(n)
                    self._lose(n, f"did not rejoin the restarted controller within {self.controller_wait_s:g} s")
                self._settle()
            if now >= end and not self.ctl.running() and not self.detached:
                break
            for t in self.ctl.running():
                if t.failed and now - t.failed[0][0] > c.silence_s + 1:  # no worker loss explains it
                    (_, node, why), others = t.failed[0], "".join(f"; {n}: {m}" for _, n, m in t.failed[1:])
                    c._diagnose(("msg", node, {"msg": "error", "message": f"task {t.pid}: {why}{others} "
                                                      "(a failure other than a lost worker: not repaired)"}))
                if now > t.deadline:
                    c._diagnose(("deadline", sorted(t.waiting)[0] if t.waiting else None,
                                 f"task {t.pid} over {'+'.join(t.members)} not done within {task_limit:g} s "
                                 f"(state {t.state}, waiting for {', '.join(sorted(t.waiting))})"))
            ev = self._next(now + 0.2)
            if ev is not None:
                self._on(ev)
            if len(self.nodes) - len(self.lost) < self.p:
                c._diagnose(("lost", self.lost[-1], f"{len(self.nodes) - len(self.lost)} workers left (lost: "
                             f"{', '.join(self.lost)}), fewer than a group of {self.p}: no group can form"))
            for item in [x for x in self.later if x[0] <= time.monotonic()]:
                self.later.remove(item)
                self.ctl.ready(item[1], item[2])
            if time.monotonic() < end and not self.detached:
                for t in self.ctl.form():
                    t.deadline = time.monotonic() + task_limit
                    t.times["formed_ns"] = time.time_ns()
                    if not self._place(t):
                        self._unplaceable(t, "no plan of the group avoids the broken links")
        self._finish()
        return self.results()

    def _finish(self) -> None:
        """FINISH to every agent, BYE from each (an ENQUEUE sent meanwhile is no error)."""
        c, got = self.c, set()
        self.finishing = True
        alive = [n for n in self.nodes if n not in self.lost]
        for n in alive:
            c._send(n, {"msg": "finish"})
        deadline = time.monotonic() + c.silence_s + 2
        while not set(alive) <= got:
            if time.monotonic() > deadline:
                missing = [n for n in alive if n not in got]
                c._diagnose(("deadline", missing[0], f"no BYE from {', '.join(missing)}"))
            ev = self._next(deadline)
            if ev is None or ev[0] == "registered" or ev[1] in self.lost or (ev[0] in ("lost", "silent")
                                                                              and ev[1] in got):
                continue
            if ev[0] != "msg" or ev[2].get("msg") not in ("bye", "enqueue", "status", "link_lost", "link_back",
                                                          "pre_armed"):
                c._diagnose(ev)
            if ev[2].get("msg") == "bye":
                got.add(ev[1])
                for e in ev[2].get("errors") or []:
                    c._errors.append(f"{ev[1]}: after the last task: {e}")

    # events
    def _next(self, deadline: float):
        """The coordinator's next event; an agent process that exited is a lost worker."""
        c = self.c
        try:
            ev = c._events.get(timeout=max(0.0, min(0.2, deadline - time.monotonic())))
        except queue.Empty:
            ev = None
        problem = c.health() if c.health else None
        if problem:
            node = problem.split(":", 1)[0]
            if node not in self.nodes:
                c._diagnose(("lost", None, problem))
            if node not in self.lost and not self.finishing:  # after FINISH an agent exits: BYE or not counts
                self._lose(node, problem)
        return ev

    def _on(self, ev) -> None:
        what, node, data = ev
        if what == "registered" or node in self.lost:
            return
        if node in self.detached:  # its old connection's end, or its REJOIN to the restarted controller
            if what == "msg" and data.get("msg") == "rejoin":
                self._rejoin(node, data)
            return
        if what in ("lost", "silent") and node in self.nodes:
            self._lose(node, data)
            return
        if what != "msg":
            self.c._diagnose(ev)
        kind = data.get("msg")
        if kind == "status":
            return
        if kind == "error":
            self.c._diagnose(ev)
        if kind == "enqueue":
            self.enqueued.append([node, data.get("round"), time.time_ns()])
            self.enq_round[node] = int(data["round"])
            self.ctl.ready(node, int(data["round"]))
            self.late.discard(node)
            if self.prescatter_for and (len(self.ctl.queue) >= self.p or time.monotonic() >= self.end
                                        or node not in self.ctl.alive):
                self.late.add(node)  # no early scatter: it completes a group now (or the window is over)
            elif self.prescatter_for:
                v, seq = self.pre_v[node], self.seq.get(node, -1) + 1
                self.seq[node] = seq
                self.pre_wait[node] = {n for n in self.nodes if n != node and self.plans[v].programs.get(n)}
                for n in self.pre_wait[node]:
                    self.c._send(n, {"msg": "pre", "of": node, "version": v, "seq": seq})
        elif kind == "pre_armed":
            left = self.pre_wait.get(data.get("of"))
            if left is None or node not in left or data.get("seq") != self.seq.get(data.get("of")):
                self.c._diagnose(("protocol", node, f"unexpected PRE_ARMED for {data.get('of')}"))
            left.discard(node)
            if not left:
                w = data["of"]
                self.c._send(w, {"msg": "pre_go", "version": self.pre_v[w], "seq": self.seq[w],
                                 "round": data.get("round", self.enq_round.get(w))})
        elif kind in ("link_lost", "link_back"):
            self._link(node, str(data.get("peer")), kind == "link_lost")
        elif kind == "installed":
            v = data.get("version")
            left = self.installing.get(v)
            if left is None and isinstance(v, int) and 0 < v < len(self.plans):
                return  # a version given up on (a worker of it was lost)
            if left is None or node not in left:
                self.c._diagnose(("protocol", node, f"unexpected INSTALLED for version {v}"))
            left.discard(node)
            if not left:
                del self.installing[v]
                for t in self.ctl.running():
                    if t.version == v and t.state == "installing":
                        t.times["installed_ns"] = time.time_ns()
                        self._arm(t)
        elif kind in ("armed", "task_done", "task_failed"):
            t = self.ctl.tasks.get(data.get("pid"))
            if t is not None and t.state in ("abandoned", "repaired"):
                return  # its executors were told to stop
            want = {"armed": "arming", "task_done": "running", "task_failed": "running"}[kind]
            if t is None or t.state != want or node not in t.waiting:
                self.c._diagnose(("protocol", node, f"unexpected {kind.upper()} for task {data.get('pid')}"))
            if kind == "task_failed" and t.pid in self.orphans:  # a task the controller's loss broke
                self._drop_orphan(t, f"failed at {node} after the controller was lost: {data.get('message')}")
                return
            if kind == "task_failed":  # a lost worker (noticed within silence_s) explains it, or it fails the run
                t.failed.append((time.monotonic(), node, data.get("message")))  # all of them go in the error
                return
            t.waiting.discard(node)
            if kind == "armed":
                if not t.waiting:
                    self._start(t)
            else:
                self._task_done(t, node, data)
        else:
            self.c._diagnose(("protocol", node, f"unexpected {kind!r} message in a task run"))

    def _place(self, t: Task) -> bool:
        """Find (or install) the version of t's group (without the lost workers as
        aggregators; with a repair's Eq. (3) replacements); hold it while that version runs.
        While links are down (:meth:`_link`), every aggregator cut off from a member of P
        hands its block to an Eq. (3) replacement with live links to all of P (§IV-B); False
        when the plan still needs a broken link (no candidate, or a scheme without per-block
        aggregators: the task cannot run)."""
        swap = dict(self.reassign.get(t.pid, {}))
        while True:
            exclude = [n for n in self.lost if n not in swap]
            key = (frozenset(t.members), tuple(exclude), tuple(sorted(swap.items())))
            if key in self.by_group:
                plan = self.plans[self.by_group[key]]
            else:
                extra = {**({"exclude": exclude} if exclude else {}), **({"reassign": swap} if swap else {})}
                plan = self.plan_for(sorted(t.members, key=self.nodes.index), **extra)
                if list(plan.nodes) != self.nodes or plan.length != self.plans[0].length:
                    raise ValueError(f"plan for group {t.members} differs in nodes or length")
                plan.validate()
            pairs = self._vpairs(self.by_group[key]) if key in self.by_group else _pairs(plan)
            cut = [pair for pair in self.broken if pair in pairs]
            if not cut:
                break
            weights = plan.meta.get("weights") or {}
            bad = sorted({e for pair in cut for e in pair if e in weights and (set(pair) - {e}) <= set(t.members)},
                         key=self.nodes.index)
            if not self.rate or not bad or any(not (set(pair) & set(bad)) for pair in cut):
                return False
            load = self._load(t)
            for a in bad:
                cands = self._candidates(t.members, set(bad) | set(swap))
                k = replacement([c for c in cands if c in weights], t.members, load, weights[a], self.rate)
                if k is None:
                    return False
                swap = _redirect(swap, a, k)
                load[k] = load.get(k, 0.0) + weights[a]  # l_k now includes the block it took
            self.reassign[t.pid] = swap
        if key not in self.by_group:
            self.by_group[key] = self._install(plan)
        t.version = self.by_group[key]
        t.involved = [n for n in self.nodes if self.plans[t.version].programs.get(n)]
        if t.version in self.installing:
            t.state = "installing"
            t.waiting = set(self.installing[t.version])
        elif t.version in self.busy:
            t.state = "held"
        else:
            self._arm(t)
        return True

    def _vpairs(self, v: int) -> set:
        if v not in self._pair_cache:
            self._pair_cache[v] = _pairs(self.plans[v])
        return self._pair_cache[v]

    def _candidates(self, members: list[str], out: set) -> list[str]:
        """§IV-B's S: workers alive, not in P, not in ``out``, with no broken link to a member."""
        return [k for k in self.nodes if k not in self.lost and k not in members and k not in out
                and not any(frozenset((k, m)) in self.broken for m in members)]

    def _load(self, t: Task) -> dict[str, float]:
        """Eq. (3)'s l_k: the block volume (model fractions) each worker aggregates in the
        other tasks in flight."""
        load: dict[str, float] = {}
        for r in self.ctl.running():
            if r is not t and r.version is not None:
                for a, x in (self.plans[r.version].meta.get("weights") or {}).items():
                    load[a] = load.get(a, 0.0) + x
        return load

    def _unplaceable(self, t: Task, why: str) -> None:
        """A group no plan can serve now: abandoned, its members queued again after a pause
        (at once they would form the same group again)."""
        t.state = "abandoned"
        self.records.append({"pid": t.pid, "members": t.members, "version": None, "outcome": "abandoned",
                             "why": why, **t.times, "correct": True, "members_done": {}})
        for m in t.members:
            self.ctl.member_done(t.pid, m)
            self.later.append((time.monotonic() + 1.0, m, t.rounds[m]))

    def _arm(self, t: Task) -> None:
        if t.version in self.busy:
            t.state = "held"
            return
        self.busy[t.version] = t.pid
        t.state, t.waiting = "arming", set(t.involved)
        t.times["arm_ns"] = time.time_ns()
        pre = {"from": {k: [self.pre_v[k], self.seq[k]] for k in t.members if k not in self.late}} \
            if self.plans[t.version].meta.get("prescattered") else None
        for n in t.involved:
            self.c._send(n, {"msg": "task", "pid": t.pid, "version": t.version, "rounds": t.rounds,
                             **({"chunk_times": True} if self.chunk_times else {}),
                             **({"pre": pre} if pre is not None else {})})

    def _start(self, t: Task) -> None:
        t.state, t.waiting = "running", set(t.involved)
        t.times["start_ns"] = time.time_ns()
        for n in t.involved:
            self.c._send(n, {"msg": "start", "pid": t.pid})

    def _task_done(self, t: Task, node: str, data: dict) -> None:
        t.done[node] = self.c._on_my_clock(node, {k: data.get(k) for k in
                                                   ("comm_start_ns", "comm_done_ns", "correct", "digest",
                                                    "max_abs_err", "receiver", "chunks", "early_sent",
                                                    "withdrawn")})
        if node in t.members:
            self.ctl.member_done(t.pid, node)
        if t.waiting:
            return
        t.state = "done"
        del self.busy[t.version]
        self.records.append(self._record(t))
        for h in self.ctl.running():  # a group held for this version
            if h.state == "held" and h.version == t.version:
                self._arm(h)
                break

    def _record(self, t: Task) -> dict:
        digests = {t.done[m].get("digest") for m in t.members}
        members = {m: {"round": t.rounds[m], "done_ns": t.done[m]["comm_done_ns"],
                       "correct": bool(t.done[m].get("correct")) and len(digests) == 1} for m in t.members}
        wrong = [m for m, d in members.items() if not d["correct"]]
        if wrong:
            self.c._errors.append(f"task {t.pid}: wrong result at {', '.join(wrong)}")
        start = min(d["comm_start_ns"] for d in t.done.values())
        end = max(t.done[m]["comm_done_ns"] for m in t.members)
        return {"pid": t.pid, "members": t.members, "version": t.version, "aggregators": len(t.involved),
                "outcome": "repair" if "repair_of" in t.times else "done", **t.times,
                **({"reassign": self.reassign[t.pid]} if self.reassign.get(t.pid) else {}),
                **({"chunks": {n: d["chunks"] for n, d in t.done.items() if d.get("chunks")}} if self.chunk_times
                   else {}),
                **({"early": {m: [t.done[m]["early_sent"], t.done[m]["withdrawn"]] for m in t.members
                              if t.done[m].get("early_sent") is not None}} if self.prescatter_for else {}),
                "cct_s": (end - start) / 1e9, "correct": not wrong, "members_done": members}

    def _install(self, plan) -> int:
        """``plan`` as a new version on the nodes that have a program in it (PLAN; their
        INSTALLED answers are awaited through ``installing``); its version."""
        v = len(self.plans)
        self.plans.append(plan)
        involved = [n for n in self.nodes if plan.programs.get(n)]
        self.installing[v] = set(involved)
        for n in involved:
            program, peers, scratch = self.c._part(n, plan)
            self.c._send(n, {"msg": "plan", "version": v, "program": [op.to_dict() for op in program],
                             "peers": {p: list(a) for p, a in peers.items()}, "scratch": scratch,
                             "link_fifo": plan.meta.get("scheduling") == "fcfs"})
        return v

    def results(self) -> dict:
        rounds = rounds_in_window(self.records, self.t0_ns, self.window_s)
        return {**self.c.results(),
                "tasks_mode": {"p": self.p, "window_s": self.window_s, "t0_ns": self.t0_ns,
                               "rounds": {n: rounds.get(n, 0) for n in self.nodes},
                               "tasks": self.records, "enqueued": self.enqueued,
                               "groups": [{"version": v, "members": sorted(g, key=self.nodes.index),
                                           "meta": self.plans[v].meta} for (g, *_), v in self.by_group.items()],
                               "faults": self.faults, "lost": self.lost,
                               "repaired": sum(r.get("outcome") == "repaired" for r in self.records),
                               "abandoned": sum(r.get("outcome") == "abandoned" for r in self.records),
                               **({"early_chunks": {  # non-blocking: delivered early, of them withdrawn
                                   k: sum(e[i] for r in self.records for e in r.get("early", {}).values())
                                   for i, k in enumerate(("delivered", "withdrawn"))}} if self.prescatter_for else {})}}

    def _install_prescatter(self, limit: float) -> None:
        """Non-blocking scatter: every worker's early-scatter version, installed before BEGIN."""
        for w in self.nodes:
            plan = self.prescatter_for(w)
            if list(plan.nodes) != self.nodes or plan.length != self.plans[0].length:
                raise ValueError(f"early-scatter plan of {w} differs in nodes or length")
            plan.validate()
            self.pre_v[w] = self._install(plan)
        deadline = time.monotonic() + limit
        while any(v in self.installing for v in self.pre_v.values()):
            if time.monotonic() > deadline:
                left = sorted({n for v in self.pre_v.values() for n in self.installing.get(v, ())})
                self.c._diagnose(("deadline", left[0], f"early-scatter plans not installed within {limit:g} s "
                                  f"at {', '.join(left)}"))
            ev = self._next(deadline)
            if ev is not None:
                self._on(ev)

    # controller loss (§IV-B, "failover of the CREW controller")
    def _controller_lost(self) -> None:
        """The controller goes down for ``for_s``: every worker's control connection is
        closed at once (what its death looks like to them) and its state is gone; then a
        restarted (stateless) controller re-obtains what it needs from the workers' REJOINs
        (:meth:`_rejoin`).  Emulated in this process: the coordinator also keeps the run's
        records (results.json), which survive -- the controller's ready queue, groups, plan
        versions and link view do not.  Tasks not yet started are abandoned (their START
        cannot come; the workers drop them); tasks running go on at the workers (they hold
        P, §IV-B: "would not get impacted") and are settled from the REJOINs."""
        c = self.c
        while True:  # what the old controller already received is its own
            try:
                ev = c._events.get_nowait()
            except queue.Empty:
                break
            self._on(ev)
        fault = self.ctl_fault = {"t_ns": time.time_ns(), "controller": "lost", "down_s": self.down["for_s"],
                                  "rejoined": {}, "tasks": []}
        self.faults.append(fault)
        c.progress(f"controller lost for {self.down['for_s']:g} s: workers standalone")
        c.drop_connections()
        self.detached = {n for n in self.nodes if n not in self.lost}
        self.up_at = time.monotonic() + self.down["for_s"]
        orphans = {}
        for t in self.ctl.running():
            if t.state == "running":
                orphans[t.pid] = t
                t.deadline += self.down["for_s"] + self.controller_wait_s
            else:
                t.state = "abandoned"
                self.records.append({"pid": t.pid, "members": t.members, "version": t.version,
                                     "outcome": "abandoned", "why": "controller lost before the task started",
                                     **t.times, "correct": True, "members_done": {}})
                fault["tasks"].append({"pid": t.pid, "outcome": "abandoned"})
        new = Controller([n for n in self.nodes if n not in self.lost], self.p)
        new.tasks, new.next_pid = dict(orphans), self.ctl.next_pid  # (pids never repeat in the records)
        self.ctl, self.orphans = new, orphans
        self.still = {pid: set() for pid in orphans}
        self.by_group, self.installing, self.broken, self.later = {}, {}, {}, []
        self.busy = {t.version: t.pid for t in orphans.values()}
        self.rejoin_ready = set()

    def _rejoin(self, n: str, msg: dict) -> None:
        """REJOIN from worker ``n``: its round and whether it is ready (queued), the tasks it
        still runs, its recent task reports (one lost in flight with the old connection is
        here again), the links it sees down."""
        self.detached.discard(n)
        self.ctl_fault["rejoined"][n] = time.time_ns()
        self.ctl.next_pid = max(self.ctl.next_pid, int(msg.get("pid", -1)) + 1)
        for pid in msg.get("running") or []:
            if pid in self.still:
                self.still[pid].add(n)
        for r in msg.get("reports") or []:
            t = self.ctl.tasks.get(r.get("pid"))
            if t is not None and t.pid in self.orphans and t.state == "running" and n in t.waiting:
                self._on(("msg", n, r))
        for peer in msg.get("links_down") or []:
            self._link(n, str(peer), True)
        if msg.get("ready"):
            self.rejoin_ready.add(n)
            self.ctl.ready(n, int(msg["round"]))
        else:
            for t in self.orphans.values():
                if t.state == "running" and n in t.members and n in t.waiting:
                    self.ctl.member_of[n] = t.pid
        if not self.detached:
            self._settle()

    def _settle(self) -> None:
        """Every worker is back (or lost): a task running at the loss that some node no longer
        runs (it never got START, or failed) cannot finish: ABANDON."""
        for t in list(self.orphans.values()):
            if t.state == "running":
                gone = sorted(n for n in t.waiting if n not in self.still[t.pid] and n not in self.lost)
                if gone:
                    self._drop_orphan(t, f"no longer run at {', '.join(gone)} after the controller was lost")

    def _drop_orphan(self, t: Task, why: str) -> None:
        """ABANDON a task the controller's loss broke: members that hold its result keep the
        round; the others are queued again with it (unless their REJOIN queued them)."""
        t.state = "abandoned"
        for n in t.involved:
            if n not in self.lost and n not in self.detached:
                self.c._send(n, {"msg": "abandon", "pid": t.pid, "version": t.version})
        self.busy.pop(t.version, None)
        self.records.append({"pid": t.pid, "members": t.members, "version": t.version, "outcome": "abandoned",
                             "why": why, **t.times, "correct": True,
                             "members_done": {m: {"round": t.rounds[m], "done_ns": t.done[m]["comm_done_ns"],
                                                  "correct": bool(t.done[m].get("correct"))}
                                              for m in t.members if m in t.done}})
        self.ctl_fault["tasks"].append({"pid": t.pid, "outcome": "abandoned", "why": why})
        for m in t.members:
            if m not in t.done:
                self.ctl.member_done(t.pid, m)
                if m not in self.rejoin_ready and m not in self.detached and m not in self.lost:
                    self.ctl.ready(m, t.rounds[m])

    # failover (§IV-B)
    def _watch_peers(self, n: str) -> dict[str, list]:
        """Where ``n`` reaches every other worker's data port (its heartbeats go there)."""
        c = self.c
        view = c._addresses.get(n) if isinstance(c._addresses.get(n), dict) else c._addresses
        out = {}
        for d in self.nodes:
            port = c.data_port or int(c._idents.get(d, {}).get("data_port") or 0)
            if d != n and isinstance(view.get(d), str) and port:
                out[d] = [view[d], port]
        return out

    def _lose(self, w: str, why: str) -> None:
        """Worker ``w`` is gone: out of the queue and of every future group (its aggregator
        share goes to the others: LP (2) over the rest); every task in flight that involves
        it is stopped on its other nodes and, if ``w`` only aggregated for it and Eq. (3)
        finds a replacement, run again with ``w``'s block at the replacement (a *repair*: a
        new pid, the same members and rounds; all blocks are sent again — the executor
        keeps no partial state, a choice); else ABANDONed: members that hold their result
        keep the round, the others are queued again with the same round."""
        self.lost.append(w)
        fault = {"t_ns": time.time_ns(), "node": w, "why": str(why), "tasks": []}
        self.faults.append(fault)
        self.c.progress(f"worker {w} lost ({why}): failover")
        stopped = self.ctl.lose(w)
        if self.detached:  # the controller is down or not every worker is back:
            self.detached.discard(w)  # no repair (it needs them all); the tasks with w are dropped
            for t in stopped:
                if t.state == "running" and t.pid in self.orphans:
                    self._drop_orphan(t, f"{w} lost while the controller was down")
                    fault["tasks"].append({"pid": t.pid, "outcome": "abandoned"})
            if not self.detached:
                self._settle()
            return
        for t in stopped:
            self._stop(t, fault, w)

    def _link(self, node: str, peer: str, lost: bool) -> None:
        """§IV-B, a link between two workers breaks (both ends' heartbeats stop; the first
        report counts, FCFS) or comes back.  Every task in flight whose plan sends over it
        is stopped and run again with the cut-off aggregators' blocks at Eq. (3)
        replacements (:meth:`_place`), or ABANDONed; groups formed while it is down get such
        plans from the start.  A report about a lost worker is that loss, not a link."""
        pair = frozenset((node, peer))
        if peer not in self.nodes or peer == node or node in self.lost or peer in self.lost:
            return
        if not lost:
            fault = self.broken.pop(pair, None)
            if fault is not None:
                fault["back_ns"] = time.time_ns()
                self.c.progress(f"link {'-'.join(fault['link'])} back (reported by {node})")
            return
        if pair in self.broken:
            return
        fault = {"t_ns": time.time_ns(), "link": sorted(pair, key=self.nodes.index), "reported_by": node,
                 "tasks": []}
        self.broken[pair] = fault
        self.faults.append(fault)
        self.c.progress(f"link {'-'.join(fault['link'])} broken (reported by {node}): failover")
        for t in self.ctl.running():
            if t.version is not None and pair in self._vpairs(t.version):
                self._stop(t, fault, None)

    def _stop(self, t: Task, fault: dict, w: str | None) -> None:
        """Stop task ``t`` (ABANDON to its nodes, its version retired) after worker ``w`` was
        lost (None: a link broke) and repair it as a new task with the same members and
        rounds (:meth:`_retry`) or abandon it."""
        for n in t.involved:
            if n not in self.lost:
                self.c._send(n, {"msg": "abandon", "pid": t.pid, "version": t.version})
        if self.busy.get(t.version) == t.pid:
            del self.busy[t.version]
        self.installing.pop(t.version, None)
        for key in [k for k, v in self.by_group.items() if v == t.version]:
            del self.by_group[key]  # retired on the agents
        pending = [m for m in t.members if m not in t.done and m != w]
        swap = dict(self.reassign.get(t.pid, {}))
        weights = (self.plans[t.version].meta.get("weights") or {}) if t.version is not None else {}
        why = (f"{w} was a member" if w in t.members
               else "a member already holds its result" if len(pending) < len(t.members)
               else "no link rates measured yet" if not self.rate
               else f"{w} aggregated no block of it" if w is not None and w not in weights else None)
        if why is None and w is not None:  # Eq. (3) for the lost aggregator's block
            k = replacement([c for c in self._candidates(t.members, set(swap) | {w}) if c in weights],
                            t.members, self._load(t), weights[w], self.rate)
            if k is None:
                why = "no replacement (Eq. 3's S is empty)"
            else:
                swap = _redirect(swap, w, k)
        new = self._retry(t, swap) if why is None else None
        if why is None and new is None:
            why = "the repair could not be placed"
        t.state = "repaired" if new is not None else "abandoned"
        rec = {"pid": t.pid, "members": t.members, "version": t.version, "outcome": t.state,
               **({"lost": w} if w else {"link": fault["link"]}), **t.times, "correct": True,
               "members_done": {m: {"round": t.rounds[m], "done_ns": t.done[m]["comm_done_ns"],
                                    "correct": bool(t.done[m].get("correct"))} for m in t.members if m in t.done}}
        fix = self.reassign.get(new, {}) if new is not None else {}
        fault["tasks"].append({"pid": t.pid, "outcome": t.state,
                               **({"replacement": fix.get(w) if w else fix} if new is not None else {"why": why})})
        if new is not None:
            rec["repair"] = new
        else:
            for m in pending:
                self.ctl.member_done(t.pid, m)
                self.ctl.ready(m, t.rounds[m])
        self.records.append(rec)

    def _retry(self, t: Task, swap: dict) -> int | None:
        """A repair of ``t``: a new pid, the same members and rounds, aggregators moved by
        ``swap`` (and around broken links); None if it cannot be placed."""
        nt = Task(self.ctl.next_pid, list(t.members), dict(t.rounds))
        self.ctl.next_pid += 1
        self.ctl.tasks[nt.pid] = nt
        for m in nt.members:
            self.ctl.member_of[m] = nt.pid
        self.reassign[nt.pid] = swap
        nt.times = {"formed_ns": time.time_ns(), "repair_of": t.pid}
        nt.deadline = time.monotonic() + self.c.ready_limit() + self.c.limit_s
        if self._place(nt):
            return nt.pid
        del self.ctl.tasks[nt.pid]
        self.reassign.pop(nt.pid, None)
        for m in nt.members:
            self.ctl.member_of[m] = t.pid
        return None


def _redirect(swap: dict, a: str, k: str) -> dict:
    """``swap`` with aggregator ``a``'s block (and what it inherited) moved to ``k``."""
    return {**{j: (k if r == a else r) for j, r in swap.items()}, a: k}


def _pairs(plan) -> set:
    """The worker pairs a plan sends data between (either direction)."""
    return {frozenset((n, op.peer)) for n, prog in plan.programs.items() for op in prog}


# -- agent side ------------------------------------------------------------------------------
class LinkWatch:
    """§IV-B's outage detection ("heartbeat and timeout", both ends of a connection get the
    same view): a UDP heartbeat to every other worker's data address every ``timeout_s``/8,
    over the data network (the path its chunks take); a peer silent for
    ``timeout_s`` (or never heard within ``timeout_s`` of the start) is reported ``link_lost``,
    heard again ``link_back``.  The UDP port is the
    agent's TCP data port.  A heartbeat is the sender's name, unauthenticated (a forged one
    can only make a broken link look alive)."""

    MAGIC = b"crew-hb "

    def __init__(self, agent, peers: dict, timeout_s: float):
        self.agent, self.timeout_s = agent, float(timeout_s)
        self.peers = {p: (str(a[0]), int(a[1])) for p, a in peers.items()}
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            self.sock.bind((agent.listener.getsockname()[0], agent.data_port))
        except OSError as e:
            self.sock.close()
            raise RuntimeError(f"link heartbeats: cannot bind UDP port {agent.data_port} (the data port; "
                               f"groups.link_timeout_s: 0 turns them off): {e}") from None
        self.heard = {p: time.monotonic() for p in self.peers}  # a peer never heard is lost too
        self.down: set[str] = set()
        self.stopped = False
        self.thread = threading.Thread(target=self._run, daemon=True, name="crew-linkwatch")
        self.thread.start()

    def _run(self) -> None:
        every, me, nxt = self.timeout_s / 8, self.MAGIC + self.agent.name.encode(), 0.0
        while not self.stopped:
            now = time.monotonic()
            if now >= nxt:
                for addr in self.peers.values():
                    try:
                        self.sock.sendto(me, addr)
                    except OSError:  # e.g. no route: the link is down
                        pass
                nxt = now + every
            self.sock.settimeout(max(0.01, nxt - time.monotonic()))
            try:
                data, _ = self.sock.recvfrom(512)
                name = data[len(self.MAGIC):].decode(errors="replace") if data.startswith(self.MAGIC) else ""
                if name in self.peers:
                    self.heard[name] = time.monotonic()
                    if name in self.down:
                        self.down.discard(name)
                        self._report("link_back", name)
            except (socket.timeout, OSError):
                pass
            now = time.monotonic()
            for name, t in self.heard.items():
                if now - t > self.timeout_s and name not in self.down:
                    self.down.add(name)
                    self._report("link_lost", name)

    def _report(self, kind: str, peer: str) -> None:
        log.warning("%s: %s", kind, peer)
        try:
            self.agent.send({"msg": kind, "peer": peer})
        except Exception as e:  # the control connection's own loss is handled elsewhere
            log.error("cannot report %s %s: %s", kind, peer, e)

    def close(self) -> None:
        self.stopped = True
        self.thread.join(timeout=1.0)
        self.sock.close()


def worker_loop(agent, Aborted: type[Exception]) -> int:
    """The agent in ``tasks`` mode, after READY: wait for BEGIN (installing PLANs meanwhile:
    non-blocking scatter's early versions); then compute round r (sleep
    its compute time), ENQUEUE, and serve the controller's messages: PLAN (install a version,
    in a thread: other tasks run meanwhile), TASK (arm), START (run the task in a thread;
    a member verifies its result and computes its next round), FINISH.  ``Aborted``: the
    agent's exception for an abort (passed in: agents.agent imports this module)."""
    from testbed.plan import Op

    job, me = agent.job, agent.name
    armed: dict[int, tuple] = {}
    running: dict[int, tuple] = {}  # pid -> (executor, rounds)
    seen_pid = [-1]  # the highest task id heard of (a restarted controller continues above it)
    done_round = [0]  # the round whose task this worker finishes next (a repair of an earlier one does not count)
    abandoned: set[int] = set()
    threads: list[threading.Thread] = []
    dropped: set[int] = set()  # versions the controller abandoned
    early: dict[tuple, threading.Event] = {}  # (sender, seq) -> its early scatter ended here
    cut: dict[int, threading.Event] = {}  # seq -> this worker's early scatter seq is cut short (P formed)
    early_sent: dict[int, set] = {}  # seq -> (aggregator, chunk) this worker's early scatter delivered

    def spawn(fn, *args) -> None:
        th = threading.Thread(target=fn, args=args, daemon=True, name=f"crew-{fn.__name__}")
        threads.append(th)
        th.start()

    def install(v: int, msg: dict) -> None:
        losses = agent.losses
        try:
            agent._install(v, [Op.from_dict(o) for o in msg["program"]], msg["scratch"],
                           {p: (str(a[0]), int(a[1])) for p, a in msg["peers"].items()}, {},
                           link_fifo=bool(msg.get("link_fifo")))
            agent.send({"msg": "installed", "version": v})
        except Exception as e:
            if v in dropped or agent.losses != losses:  # given up on meanwhile (a link it needs broke,
                # or its controller was lost before every peer had it): no error
                log.warning("plan version %d not installed (abandoned): %s", v, e)
                return
            agent.abort_soon(f"installing plan version {v}: {type(e).__name__}: {e}")

    def after(prev: threading.Event | None, what: str) -> None:
        """An early-scatter executor runs one scatter at a time: wait for the previous one
        (a member's task may end before a node that keeps none of its chunks got them all)."""
        if prev is not None and not prev.wait(job.timeout_s):
            raise TimeoutError(f"{what}: the previous early scatter not done within {job.timeout_s:g} s")

    def pre_recv(sender: str, seq: int, ex, prev, done: threading.Event) -> None:
        try:
            after(prev, f"early scatter {seq} of {sender}")
            ex.advance(seq)
            ex.prepare(None)
            agent.send({"msg": "pre_armed", "of": sender, "seq": seq})
            ex.run(seq)
            done.set()
        except Exception as e:
            agent.abort_soon(f"early scatter {seq} of {sender}: {type(e).__name__}: {e}")

    def pre_send(seq: int, rnd_: int, ex, prev, done: threading.Event) -> None:
        """This worker's early scatter number ``seq`` (round ``rnd_``'s default blocks), chunk
        by chunk; once it is cut short (the TASK of its group came), the chunks not yet
        written go withdrawn: the task's plan sends them to their owner in P's split."""
        try:
            after(prev, f"early scatter {seq}")
            early_sent.pop(seq - 1, None)  # its task is over: this worker enqueued again
            ex.advance(seq)
            ex.prepare(make_input(job.seed, job.nodes.index(me), rnd_, job.length, job.dtype))
            stop = cut.setdefault(seq, threading.Event())
            ex.withdraw = lambda op: stop.is_set()
            withdrawn = set(ex.run(seq).get("withdrawn", ()))
            early_sent[seq] = {(op.peer, op.chunk) for op in ex.prog if op.kind == "send" and op.xfer not in withdrawn}
            cut.pop(seq, None)
            done.set()
        except Exception as e:
            agent.abort_soon(f"early scatter {seq}: {type(e).__name__}: {e}")

    def ended(k: str, seq: int) -> None:
        """Wait (at most the job's timeout) until ``k``'s early scatter ``seq`` ended here."""
        if not early.setdefault((k, seq), threading.Event()).wait(job.timeout_s):
            raise TimeoutError(f"early scatter {seq} of {k} not ended here within {job.timeout_s:g} s")

    def arm(pid: int, ex, rounds: dict, pre: dict | None, chunk_times: bool = False) -> None:
        """TASK: the executor moves to iteration ``pid`` with this node's input.  Non-blocking
        (``pre``: the members' early scatters, §IV-A2): this worker's own is cut short, and in
        the task it withdraws each scatter chunk its early scatter delivered to the same
        aggregator (asked as the chunk is about to go, once the early scatter ended); a
        withdrawn chunk's receiver applies the early copy it holds instead (once that
        member's early scatter ended here).  Early copies of chunks Alg. 2 moved away are
        not used: their senders send them again to the new owner."""
        try:
            x = make_input(job.seed, job.nodes.index(me), rounds[me], job.length, job.dtype) if me in rounds \
                else None
            ex.withdraw = ex.on_withdrawn = None
            seq = None
            if pre is not None:
                if me in pre["from"]:
                    seq = pre["from"][me][1]
                    if not early.setdefault((me, seq), threading.Event()).is_set():
                        cut.setdefault(seq, threading.Event()).set()  # (pre_send may not have begun)

                    def withdraw(op, seq=seq) -> bool:
                        if op.phase != "scatter":
                            return False
                        ended(me, seq)
                        return (op.peer, op.chunk) in early_sent[seq]
                    ex.withdraw = withdraw
                sources = {k: (agent.execs[v], s) for k, (v, s) in pre["from"].items() if k != me}

                def on_withdrawn(op) -> np.ndarray:
                    if op.peer not in sources or op.buf != "x":
                        raise wire.ProtocolError(f"transfer {op.xfer} withdrawn by {op.peer}, which sent this "
                                                 "node no early scatter into x")
                    early_ex, s = sources[op.peer]
                    ended(op.peer, s)
                    return early_ex.bufs["x"][op.offset:op.offset + op.length]
                ex.on_withdrawn = on_withdrawn
            ex.advance(pid)
            ex.prepare(x)
            armed[pid] = (ex, rounds, bool(chunk_times), seq)
            agent.send({"msg": "armed", "pid": pid})
        except Exception as e:
            agent.abort_soon(f"arming task {pid}: {type(e).__name__}: {e}")

    def retire(ex) -> None:  # a version given up on: its threads and connections go
        for v, e in list(agent.execs.items()):
            if e is ex and v != 0:
                agent.execs.pop(v, None)  # (the task's thread and the ABANDON may both retire it)
        ex.close()

    def run_task(pid: int, ex, rounds: dict, chunk_times: bool, seq: int | None) -> None:
        try:
            timing = ex.run(pid)
            withdrawn = set(timing.get("withdrawn", ()))
            if chunk_times:  # [sender, first byte, last byte] of every chunk received (agent clock)
                src = {op.xfer: op.peer for op in ex.prog if op.kind == "recv"}
                timing["chunks"] = [[src[r[0]], r[2], r[3]] for r in timing["recvs"] if r[0] not in withdrawn]
            early = {} if seq is None else {  # chunks delivered early; of them, withdrawn here
                "early_sent": len(early_sent.get(seq, ())),
                "withdrawn": sum(op.kind == "send" and op.xfer in withdrawn for op in ex.prog)}
            check = {"receiver": me in rounds, "correct": True, "max_abs_err": 0.0, "digest": None}
            if me in rounds:
                x = ex.bufs["x"]
                want = group_sum(job.seed, job.nodes, rounds, job.length, job.dtype)
                ok = bool(np.array_equal(x.view(np.uint8), want.view(np.uint8)))
                check = {"receiver": True, "correct": ok,
                         "max_abs_err": 0.0 if ok else float(np.nanmax(np.abs(x.astype(np.float64) - want))),
                         "digest": hashlib.sha256(memoryview(x).cast("B")).hexdigest()}
            agent.send({"msg": "task_done", "pid": pid, "comm_start_ns": timing["comm_start_ns"],
                        "comm_done_ns": timing["comm_done_ns"], **check, **early,
                        **({"chunks": timing["chunks"]} if chunk_times else {})})
            running.pop(pid, None)  # after the report: a REJOIN names it running or carries the report
            if pid in abandoned:  # stopped after its run here ended (the ABANDON's abort came too late):
                retire(ex)  # its connections go all the same (one left open, reset later with bytes unsent,
                # held the next task's turn on the link: LinkGate)
            if me in rounds and rounds[me] == done_round[0]:  # not a repair of a round already done
                done_round[0] += 1
                agent.inbox.put({"msg": "_round_done"})
        except Exception as e:
            log.error("task %d failed: %s", pid, e)
            if pid in abandoned or agent.detached is not None:  # (its frames must not meet a later task)
                retire(ex)
            agent.send({"msg": "task_failed", "pid": pid, "message": f"{type(e).__name__}: {e}"})
            running.pop(pid, None)

    while (begin := agent.next_msg(("begin", "plan"), job.wait_s))["msg"] == "plan":
        install(int(begin["version"]), begin)  # non-blocking: the early-scatter versions, before BEGIN
    watch = LinkWatch(agent, begin["watch"], begin["link_timeout_s"]) if begin.get("watch") else None
    wait_ctl = float(begin.get("controller_wait_s") or 0)  # 0: a lost controller aborts the worker
    agent.standalone_ok = wait_ctl > 0
    ctl_deadline = [0.0]

    def reconnect(deadline: float) -> None:
        """Standalone (§IV-B): try to reach the controller again until ``deadline``."""
        while time.monotonic() < deadline and not agent.stopping:
            try:
                sock = wire.connect(agent.coord_addr, agent.secret, {**agent.ident, "rejoin": True},
                                    timeout_s=min(agent.handshake_s, max(0.1, deadline - time.monotonic())))
                agent.inbox.put({"msg": "_ctrl_back", "sock": sock})
                return
            except Exception:  # refused while it is down, or not listening
                time.sleep(0.2)
        agent.inbox.put({"msg": "abort", "reason": f"the controller did not come back within {wait_ctl:g} s"})
    rnd, computing_until = 0, time.monotonic() + job.compute_for(0)
    while True:
        wait = computing_until - time.monotonic() if computing_until is not None else job.wait_s
        try:
            msg = agent.inbox.get(timeout=max(0.0, wait))
        except queue.Empty:
            if computing_until is None:
                raise Aborted(f"no message from the {agent.coord} within {job.wait_s:g} s") from None
            computing_until = None
            agent.send({"msg": "enqueue", "round": rnd})
            continue
        kind = msg.get("msg")
        if kind == "abort":
            raise Aborted(msg["reason"])
        if kind == "plan":
            v = msg.get("version")
            if not isinstance(v, int) or v in agent.execs:
                raise ValueError(f"PLAN for version {v}: not a new version")
            spawn(install, v, msg)
        elif kind == "task":
            pid, v, rounds = int(msg["pid"]), int(msg["version"]), dict(msg["rounds"])
            seen_pid[0] = max(seen_pid[0], pid)
            arm(pid, agent.execs[v], rounds, msg.get("pre"), msg.get("chunk_times"))
        elif kind == "pre":  # receive an early scatter (non-blocking, §IV-A2); PRE_ARMED once ready
            sender, v, seq = str(msg["of"]), int(msg["version"]), int(msg["seq"])
            early.setdefault((sender, seq), threading.Event())
            spawn(pre_recv, sender, seq, agent.execs[v], early.get((sender, seq - 1)), early[(sender, seq)])
        elif kind == "pre_go":  # every receiver is armed: send this round's default blocks now
            v, seq = int(msg["version"]), int(msg["seq"])
            spawn(pre_send, seq, int(msg["round"]), agent.execs[v], early.get((me, seq - 1)),
                  early.setdefault((me, seq), threading.Event()))
        elif kind == "start":
            ex, rounds, chunk_times, seq = armed.pop(int(msg["pid"]))
            running[int(msg["pid"])] = (ex, rounds)
            spawn(run_task, int(msg["pid"]), ex, rounds, chunk_times, seq)
        elif kind == "abandon":  # §IV-B: stop this task; its version is not used again
            pid = int(msg["pid"])
            abandoned.add(pid)
            if isinstance(msg.get("version"), int):
                dropped.add(msg["version"])
            if pid in running:
                running[pid][0].abort(f"task {pid} abandoned by the controller")
            elif isinstance(msg.get("version"), int) and msg["version"] in agent.execs:
                armed.pop(pid, None)
                retire(agent.execs[msg["version"]])
        elif kind == "_ctrl_lost":  # §IV-B: standalone; tasks not started cannot start (no START comes)
            for pid, (ex, *_) in list(armed.items()):
                retire(ex)
                del armed[pid]
            ctl_deadline[0] = time.monotonic() + wait_ctl
            spawn(reconnect, ctl_deadline[0])
        elif kind == "_ctrl_back":  # the (restarted) controller re-obtains this worker's state
            member = any(me in r for _, r in list(running.values()))
            try:
                agent.reattach(msg["sock"], {
                    "msg": "rejoin", "round": rnd, "pid": seen_pid[0], "running": sorted(list(running)),
                    "ready": computing_until is None and rnd == done_round[0] and not member,
                    "links_down": sorted(watch.down) if watch else []})
            except OSError as e:
                log.warning("rejoin failed (%s): trying again", e)
                wire.close_quietly(msg["sock"])
                spawn(reconnect, ctl_deadline[0])
        elif kind == "welcome":  # the controller's answer to a rejoin
            pass
        elif kind == "_round_done":
            rnd += 1
            computing_until = time.monotonic() + job.compute_for(rnd)
        elif kind == "finish":
            break
        else:
            raise ValueError(f"unexpected {kind!r} message in tasks mode")
    if watch:
        watch.close()
    late = [e for ex in agent.execs.values() for e in ex.late_errors()]
    agent.send({"msg": "bye", "errors": late})
    return 1 if late else 0
