"""CREW at run time (Luo et al., "Efficient Cross-Cloud Partial Reduce With CREW", §III-IV):
the controller's FIFO ready queue forms partial-reduce groups P of the first p ready workers,
each group's reduce runs as a *task* (increasing ``pid``) while the other workers keep
computing, and every worker counts the rounds it completes in a window T (§V, Fig. 5).

Three parts, three modules:

* here, pure (no sockets, unit-tested): :class:`Controller` -- the ready queue, group
  formation in ready order, task ids, which worker is in which task; :func:`replacement` is
  Eq. (3); the result check (:func:`group_sum`) and the rounds count;
* :class:`agents.crew_run.TaskRun` -- the coordinator side at run time (the
  :class:`agents.coordinator.Driver` of a groups run, on the coordinator's driver API);
* :class:`agents.crew_worker.WorkerLoop` -- the agent side (the worker loop of a JOB in
  ``tasks`` mode, :data:`agents.agent.WORKER_LOOPS`).

Protocol (control messages, :class:`agents.protocol.Msg` with their fields in
``agents.protocol.FIELDS``; data moves over the plan versions' own connections).  A task
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

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .inputs import make_input


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
        self.moved: dict[str, int] = {}  # worker -> round it finished in a stopped task (it computes the next)
        self.next_pid = 0

    def ready(self, worker: str, rnd: int) -> None:
        if worker not in self.alive:
            return
        if self.moved.get(worker, rnd) < rnd:
            del self.moved[worker]
        t = self.tasks.get(self.member_of.get(worker, -1))
        if t is not None and rnd > t.rounds[worker]:
            # its result of that round came in before a failover re-ran the task (a DONE that
            # crossed the repair): it joins the repair with that round and is queued after it
            self.deferred[worker] = rnd
            return
        if (worker, rnd) in self.queue:  # the same readiness twice (the controller re-queued an
            return  # abandoned member, or a REJOIN said ready, and its ENQUEUE crossed that): once
        if worker in self.member_of:
            raise ValueError(f"{worker} is ready for round {rnd} while a member of task {self.member_of[worker]} "
                             f"with round {t.rounds[worker] if t else '?'}")
        if any(w == worker for w, _ in self.queue):
            raise ValueError(f"{worker} is ready for round {rnd} while queued with round "
                             f"{next(r for w, r in self.queue if w == worker)}")
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

    def member_done(self, pid: int, worker: str) -> bool:
        """``worker`` has its result of task ``pid``: it may be queued again.  True if it was
        (the later round it reported ready while in the task)."""
        if self.member_of.get(worker) == pid:
            del self.member_of[worker]
            if worker in self.deferred:
                self.ready(worker, self.deferred.pop(worker))
                return True
        return False

    def release(self, pid: int, worker: str, rnd: int) -> None:
        """§IV-B, ABANDON: ``worker`` leaves task ``pid`` without its result and is queued
        again with the round ``rnd`` it entered with -- unless it reported a later round ready
        meanwhile (its DONE of the run a repair superseded crossed the failover): it has moved
        on, so it is queued once, with that round."""
        if not self.member_done(pid, worker) and self.moved.get(worker) != rnd:
            self.ready(worker, rnd)

    def moved_on(self, worker: str, rnd: int) -> None:
        """``worker``'s DONE of round ``rnd`` came from a task already stopped (it crossed
        the ABANDON): it holds that round's result and computes its next one, whose readiness
        it reports itself -- an ABANDON does not queue it again with ``rnd`` (:meth:`release`),
        and a re-queue with ``rnd`` not yet in a group is dropped."""
        self.moved[worker] = rnd
        self.queue = deque(e for e in self.queue if e != (worker, rnd))

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


def redirect(swap: dict, a: str, k: str) -> dict:
    """``swap`` with aggregator ``a``'s block (and what it inherited) moved to ``k``."""
    return {**{j: (k if r == a else r) for j, r in swap.items()}, a: k}


def plan_pairs(plan) -> set:
    """The worker pairs a plan sends data between (either direction)."""
    return {frozenset((n, op.peer)) for n, prog in plan.programs.items() for op in prog}
