"""CREW's controller at run time, the coordinator side (Luo et al., §III-IV): the ready queue
and groups of :class:`agents.crew.Controller` driven over real agents -- plan versions per
group, tasks armed and started, failover (§IV-B: lost workers, broken links, a lost
controller), non-blocking scatter's early scatters (§IV-A2).  The protocol is in
:mod:`agents.crew`; the agent side is :mod:`agents.crew_worker`."""

from __future__ import annotations

import time
from collections import deque
from typing import NoReturn

from .crew import Controller, Task, plan_pairs, redirect, replacement, rounds_in_window
from .protocol import Deadline, Event, Lost, Msg, Received, Registered, Violation, error_event, message

AFTER_FINISH = (Msg.BYE, Msg.ENQUEUE, Msg.STATUS, Msg.LINK_LOST, Msg.LINK_BACK, Msg.PRE_ARMED)  # no error then


class TaskRun:
    """The controller at run time: the :class:`agents.coordinator.Driver` of a run whose
    agents are READY (``Coordinator(..., driver=lambda c: TaskRun(c, opts))``), on the
    coordinator's driver API.  ``opts``: ``p``, ``window_s`` (T), ``plan_for(members) ->
    Plan`` (the scheme's pure planner over group P, same nodes and length as the JOB's plan);
    optional ``rate`` (Eq. 3's b_{i,j}), ``link_timeout_s``, ``chunk_times``,
    ``prescatter_for``, ``controller_down``, ``controller_wait_s``."""

    mode = "tasks"  # the agents run agents.crew_worker.WorkerLoop

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
        self.ahead: deque[Event] = deque()  # events received, not yet handled (_next)
        self.unplaced: deque[Task] = deque()  # formed, placed one per turn of the loop (_form)
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

    def run(self) -> None:
        c = self.c
        task_limit = c.ready_limit() + c.limit_s
        if self.prescatter_for:
            self._install_prescatter(task_limit)
        for n in self.nodes:
            watch = {"watch": {d: list(a) for d, a in c.data_addresses(n).items()},
                     "link_timeout_s": self.link_timeout_s} if self.link_timeout_s else {}
            c.send(n, message(Msg.BEGIN, controller_wait_s=self.controller_wait_s, **watch))
        self.t0_ns = time.time_ns()
        end = self.end = time.monotonic() + self.window_s
        self.down_at = end - self.window_s + self.down["at_s"] if self.down else float("inf")
        c.progress(f"window of {self.window_s:g} s started: groups of {self.p} from the ready queue")
        while True:
            now = time.monotonic()
            self._controller_events(now)
            if now >= end and not self.ctl.running() and not self.detached:
                break
            self._check_tasks(now, task_limit)
            ev = self._next(now + (0.0 if self.unplaced else 0.2))
            while ev is not None:  # every report already received, before the next placement
                self._on(ev)
                ev = self._next(now) if self.ahead else None
            if len(self.nodes) - len(self.lost) < self.p:
                self._fail(Lost(self.lost[-1], f"{len(self.nodes) - len(self.lost)} workers left (lost: "
                                f"{', '.join(self.lost)}), fewer than a group of {self.p}: no group can form"))
            for item in [x for x in self.later if x[0] <= time.monotonic()]:
                self.later.remove(item)
                self.ctl.ready(item[1], item[2])
            if time.monotonic() < end and not self.detached:
                self._form(task_limit)
            self._place_next()
        self._finish()

    def _controller_events(self, now: float) -> None:
        """The emulated controller loss: it goes down, comes back, gives up on workers that
        did not rejoin in time."""
        c = self.c
        if now >= self.down_at:
            self.down_at = float("inf")
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

    def _check_tasks(self, now: float, task_limit: float) -> None:
        """Fail the run on a task that failed for a reason other than a lost worker, or that
        is over its deadline."""
        for t in self.ctl.running():
            if t.failed and now - t.failed[0][0] > self.c.silence_s + 1:  # no worker loss explains it
                (_, node, why), others = t.failed[0], "".join(f"; {n}: {m}" for _, n, m in t.failed[1:])
                self._fail(error_event(node, f"task {t.pid}: {why}{others} "
                                                  "(a failure other than a lost worker: not repaired)"))
            if now > t.deadline:
                self._fail(Deadline(sorted(t.waiting)[0] if t.waiting else None,
                                         f"task {t.pid} over {'+'.join(t.members)} not done within {task_limit:g} s "
                                         f"(state {t.state}, waiting for {', '.join(sorted(t.waiting))})"))

    def _form(self, task_limit: float) -> None:
        """Every group the ready queue holds now, formed (placed by :meth:`_place_next`)."""
        for t in self.ctl.form():
            t.deadline = time.monotonic() + task_limit
            t.times["formed_ns"] = time.time_ns()
            self.unplaced.append(t)

    def _place_next(self) -> None:
        """One formed task placed (or given up on) per turn of the loop, so the reports that
        came meanwhile are read between placements (a placement plans over all n workers)."""
        while self.unplaced and self.unplaced[0].state != "formed":  # stopped before its turn (a lost member)
            self.unplaced.popleft()
        if self.unplaced:
            t = self.unplaced.popleft()
            if not self.place(t):
                self._unplaceable(t, "no plan of the group avoids the broken links")

    def _finish(self) -> None:
        """FINISH to every agent, BYE from each (an ENQUEUE sent meanwhile is no error)."""
        c, got = self.c, set()
        self.finishing = True
        alive = [n for n in self.nodes if n not in self.lost]
        for n in alive:
            c.send(n, message(Msg.FINISH))
        deadline = time.monotonic() + c.silence_s + 2
        while not set(alive) <= got:
            if time.monotonic() > deadline:
                missing = [n for n in alive if n not in got]
                self._fail(Deadline(missing[0], f"no BYE from {', '.join(missing)}"))
            ev = self._next(deadline)
            if ev is None or isinstance(ev, Registered) or ev.node in self.lost or (isinstance(ev, Lost)
                                                                                   and ev.node in got):
                continue
            if not isinstance(ev, Received) or ev.kind not in AFTER_FINISH:
                self._fail(ev)
            if ev.kind == Msg.BYE:
                got.add(ev.node)
                for e in ev.msg.get("errors") or []:
                    c.note_error(f"{ev.node}: after the last task: {e}")

    # events
    def _next(self, deadline: float) -> Event | None:
        """The coordinator's next event, every event already received read ahead with it
        (:meth:`_back_ahead`); an agent process that exited is a lost worker."""
        c = self.c
        if not self.ahead:
            ev = c.next_event(deadline)
            if ev is not None:
                self.ahead.extend([ev, *c.pending_events()])
        ev = self.ahead.popleft() if self.ahead else None
        problem = c.health_problem()
        if problem:
            node = problem.split(":", 1)[0]
            if node not in self.nodes:
                self._fail(Lost(None, problem))
            if node not in self.lost and not self.finishing:  # after FINISH an agent exits: BYE or not counts
                self._lose(node, problem)
        return ev

    def _fail(self, ev: Event) -> NoReturn:
        """The run fails on ``ev``: the events read ahead go back to the coordinator, whose
        diagnosis reads them with what else comes."""
        self.c.requeue(self.ahead)
        self.ahead.clear()
        self.c.diagnose(ev)

    def _on(self, ev: Event) -> None:
        if isinstance(ev, Registered) or ev.node in self.lost:
            return
        if ev.node in self.detached:  # its old connection's end, or its REJOIN to the restarted controller
            if isinstance(ev, Received) and ev.kind == Msg.REJOIN:
                self._rejoin(ev.node, ev.msg)
            return
        if isinstance(ev, Lost) and ev.node in self.nodes:
            self._lose(ev.node, ev.why)
            return
        if not isinstance(ev, Received) or ev.kind == Msg.ERROR:
            self._fail(ev)
        handler = {Msg.STATUS: lambda node, data: None, Msg.ENQUEUE: self._on_enqueue,
                   Msg.PRE_ARMED: self._on_pre_armed, Msg.INSTALLED: self._on_installed,
                   Msg.LINK_LOST: lambda node, data: self.link_changed(node, str(data.get("peer")), True),
                   Msg.LINK_BACK: lambda node, data: self.link_changed(node, str(data.get("peer")), False),
                   Msg.ARMED: self._on_task_report, Msg.TASK_DONE: self._on_task_report,
                   Msg.TASK_FAILED: self._on_task_report}.get(ev.kind)
        if handler is None:
            self._fail(Violation(ev.node, f"unexpected {ev.msg.get('msg')!r} message in a task run"))
        handler(ev.node, ev.msg)

    def _on_enqueue(self, node: str, data: dict) -> None:
        self.enqueued.append([node, data.get("round"), time.time_ns()])
        self.enq_round[node] = int(data["round"])
        self.ctl.ready(node, int(data["round"]))
        self.late.discard(node)
        queued = [w for w, _ in self.ctl.queue]  # groups of p form from its front
        completes = node in queued and (queued.index(node) + 1) % self.p == 0
        if self.prescatter_for and (completes or time.monotonic() >= self.end or node not in self.ctl.alive):
            self.late.add(node)  # no early scatter: it completes a group now (or the window is over)
        elif self.prescatter_for:
            v, seq = self.pre_v[node], self.seq.get(node, -1) + 1
            self.seq[node] = seq
            self.pre_wait[node] = {n for n in self.nodes if n != node and self.plans[v].programs.get(n)}
            for n in self.pre_wait[node]:
                self.c.send(n, message(Msg.PRE, of=node, version=v, seq=seq))

    def _on_pre_armed(self, node: str, data: dict) -> None:
        left = self.pre_wait.get(data.get("of"))
        if left is None or node not in left or data.get("seq") != self.seq.get(data.get("of")):
            self._fail(Violation(node, f"unexpected PRE_ARMED for {data.get('of')}"))
        left.discard(node)
        if not left:
            w = data["of"]
            self.c.send(w, message(Msg.PRE_GO, version=self.pre_v[w], seq=self.seq[w],
                                   round=data.get("round", self.enq_round.get(w))))

    def _on_installed(self, node: str, data: dict) -> None:
        v = data.get("version")
        left = self.installing.get(v)
        if left is None and isinstance(v, int) and 0 < v < len(self.plans):
            return  # a version given up on (a worker of it was lost)
        if left is None or node not in left:
            self._fail(Violation(node, f"unexpected INSTALLED for version {v}"))
        left.discard(node)
        if not left:
            del self.installing[v]
            for t in self.ctl.running():
                if t.version == v and t.state == "installing":
                    t.times["installed_ns"] = time.time_ns()
                    self._arm(t)

    def _on_task_report(self, node: str, data: dict) -> None:
        """ARMED, TASK_DONE or TASK_FAILED from ``node``."""
        kind = Msg(data["msg"])
        t = self.ctl.tasks.get(data.get("pid"))
        if t is not None and t.state in ("abandoned", "repaired"):  # its executors were told to stop
            if kind == Msg.TASK_DONE and node in t.members:
                self.ctl.moved_on(node, t.rounds[node])
                again = self.ctl.tasks.get(self.ctl.member_of.get(node, -1))
                if t.state == "abandoned" and not (again not in (None, t) and again.rounds[node] == t.rounds[node]):
                    self._done_after_abandon(t, node, data)  # (else its re-queued round is in a task: that one credits it)
            return
        want = "arming" if kind == Msg.ARMED else "running"
        if t is None or t.state != want or node not in t.waiting:
            self._fail(Violation(node, f"unexpected {kind.upper()} for task {data.get('pid')}"))
        if kind == Msg.TASK_FAILED and t.pid in self.orphans:  # a task the controller's loss broke
            self._drop_orphan(t, f"failed at {node} after the controller was lost: {data.get('message')}")
            return
        if kind == Msg.TASK_FAILED:  # a lost worker (noticed within silence_s) explains it, or it fails the run
            t.failed.append((time.monotonic(), node, data.get("message")))  # all of them go in the error
            return
        t.waiting.discard(node)
        if kind == Msg.ARMED:
            if not t.waiting:
                self._start(t)
        else:
            self._task_done(t, node, data)

    def _done_after_abandon(self, t: Task, node: str, data: dict) -> None:
        """§IV-B: the members of an abandoned task that finished it keep the round -- also one
        whose DONE crossed the ABANDON; its abandoned record credits it."""
        rec = next((r for r in reversed(self.records) if r["pid"] == t.pid and r["outcome"] == "abandoned"), None)
        if rec is None:
            return
        done, ok = self.c.to_my_clock(node, {"comm_done_ns": data.get("comm_done_ns")}), bool(data.get("correct"))
        rec["members_done"][node] = {"round": t.rounds[node], "done_ns": done["comm_done_ns"], "correct": ok,
                                     "after_abandon": True}
        if not ok:
            rec["correct"] = False
            self.c.note_error(f"task {t.pid}: wrong result at {node}")

    def place(self, t: Task) -> bool:
        """Find (or install) the version of t's group (without the lost workers as
        aggregators; with a repair's Eq. (3) replacements); hold it while that version runs.
        While links are down (:meth:`link_changed`), every aggregator cut off from a member of P
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
            pairs = self._vpairs(self.by_group[key]) if key in self.by_group else plan_pairs(plan)
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
                swap = redirect(swap, a, k)
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
            self._pair_cache[v] = plan_pairs(self.plans[v])
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
            if not self.ctl.member_done(t.pid, m):
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
            self.c.send(n, message(Msg.TASK, pid=t.pid, version=t.version, rounds=t.rounds,
                                   **({"chunk_times": True} if self.chunk_times else {}),
                                   **({"pre": pre} if pre is not None else {})))

    def _start(self, t: Task) -> None:
        t.state, t.waiting = "running", set(t.involved)
        t.times["start_ns"] = time.time_ns()
        for n in t.involved:
            self.c.send(n, message(Msg.START, pid=t.pid))

    def _task_done(self, t: Task, node: str, data: dict) -> None:
        t.done[node] = self.c.to_my_clock(node, {k: data.get(k) for k in
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
            self.c.note_error(f"task {t.pid}: wrong result at {', '.join(wrong)}")
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
            self.c.send(n, self.c.plan_message(n, v, plan, link_fifo=plan.meta.get("scheduling") == "fcfs"))
        return v

    def results(self) -> dict:
        rounds = rounds_in_window(self.records, self.t0_ns, self.window_s)
        return {"tasks_mode": {"p": self.p, "window_s": self.window_s, "t0_ns": self.t0_ns,
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
                self._fail(Deadline(left[0], f"early-scatter plans not installed within {limit:g} s "
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
        while (ev := c.next_event(0.0)) is not None:  # what the old controller already received is its own
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
                self._on(Received(n, r))
        for peer in msg.get("links_down") or []:
            self.link_changed(n, str(peer), True)
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
                self.c.send(n, message(Msg.ABANDON, pid=t.pid, version=t.version))
        self.busy.pop(t.version, None)
        self.records.append({"pid": t.pid, "members": t.members, "version": t.version, "outcome": "abandoned",
                             "why": why, **t.times, "correct": True,
                             "members_done": {m: {"round": t.rounds[m], "done_ns": t.done[m]["comm_done_ns"],
                                                  "correct": bool(t.done[m].get("correct"))}
                                              for m in t.members if m in t.done}})
        self.ctl_fault["tasks"].append({"pid": t.pid, "outcome": "abandoned", "why": why})
        for m in t.members:
            if m not in t.done and m not in self.rejoin_ready and m not in self.detached and m not in self.lost:
                self.ctl.release(t.pid, m, t.rounds[m])
            elif m not in t.done:
                self.ctl.member_done(t.pid, m)

    # failover (§IV-B)
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

    def link_changed(self, node: str, peer: str, lost: bool) -> None:
        """§IV-B, a link between two workers breaks (both ends' heartbeats stop; the first
        report counts, FCFS) or comes back.  Every task in flight whose plan sends over it
        is stopped and run again with the cut-off aggregators' blocks at Eq. (3)
        replacements (:meth:`place`), or ABANDONed; groups formed while it is down get such
        plans from the start, unless its return is among the reports already received
        (:meth:`_back_ahead`; its record says ``failover: false``).  A report about a lost
        worker is that loss, not a link."""
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
                 "tasks": [], **({"failover": False} if self._back_ahead(pair) else {})}
        self.broken[pair] = fault
        self.faults.append(fault)
        if "failover" in fault:
            self.c.progress(f"link {'-'.join(fault['link'])} reported lost and back (by {node}) before "
                            "the controller acted: no failover")
            return
        self.c.progress(f"link {'-'.join(fault['link'])} broken (reported by {node}): failover")
        for t in self.ctl.running():
            if t.version is not None and pair in self._vpairs(t.version):
                self._stop(t, fault, None)

    def _back_ahead(self, pair: frozenset) -> bool:
        """Is a report of ``pair``'s return among the events received and not yet handled?
        Then the link was down for less than the controller takes to reach it, and stopping
        the tasks over it would only cost them their progress (acted on report by report,
        one agent's heartbeats pausing would stop and re-plan the tasks over each of its
        links in turn, while the reports of their return wait behind the re-planning)."""
        return any(isinstance(ev, Received) and ev.kind == Msg.LINK_BACK
                   and frozenset((ev.node, str(ev.msg.get("peer")))) == pair for ev in self.ahead)

    def _stop(self, t: Task, fault: dict, w: str | None) -> None:
        """Stop task ``t`` (ABANDON to its nodes, its version retired) after worker ``w`` was
        lost (None: a link broke) and repair it as a new task with the same members and
        rounds (:meth:`_retry`) or abandon it."""
        for n in t.involved:
            if n not in self.lost:
                self.c.send(n, message(Msg.ABANDON, pid=t.pid, version=t.version))
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
                swap = redirect(swap, w, k)
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
                self.ctl.release(t.pid, m, t.rounds[m])
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
        if self.place(nt):
            return nt.pid
        del self.ctl.tasks[nt.pid]
        self.reassign.pop(nt.pid, None)
        for m in nt.members:
            self.ctl.member_of[m] = t.pid
        return None
