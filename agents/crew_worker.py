"""CREW at run time, the agent side (Luo et al., §III-IV): :class:`WorkerLoop`, the worker in
``tasks`` mode (compute a round, ENQUEUE, run the tasks the controller starts, failover),
which watches its links with :class:`.linkwatch.LinkWatch` (§IV-B).  The protocol is in :mod:`agents.crew`;
the controller side is :mod:`agents.crew_run`."""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time

import numpy as np

from . import wire
from .crew import group_sum
from .inputs import make_input
from .linkwatch import LinkWatch
from .protocol import Aborted, Msg, message

log = logging.getLogger("agents.crew")


class WorkerLoop:
    """The agent in ``tasks`` mode, after READY (:data:`agents.agent.WORKER_LOOPS`): wait for
    BEGIN (installing PLANs meanwhile: non-blocking scatter's early versions); then compute
    round r (sleep its compute time), ENQUEUE, and serve the controller's messages: PLAN
    (install a version, in a thread: other tasks run meanwhile), TASK (arm), START (run the
    task in a thread; a member verifies its result and computes its next round), FINISH.
    The state lives in fields, each message kind has a method; the agent is used through its
    public API (send, install_plan, abort_soon, detach/reattach, execs)."""

    def __init__(self, agent):
        self.agent, self.job, self.me = agent, agent.job, agent.name
        self.armed: dict[int, tuple] = {}  # pid -> (executor, rounds, chunk_times, early scatter seq)
        self.running: dict[int, tuple] = {}  # pid -> (executor, rounds)
        self.seen_pid = -1  # the highest task id heard of (a restarted controller continues above it)
        self.done_round = 0  # the round whose task this worker finishes next (a repair of an earlier one does not count)
        self.abandoned: set[int] = set()
        self.dropped: set[int] = set()  # versions the controller abandoned
        self.threads: list[threading.Thread] = []
        self.early: dict[tuple, threading.Event] = {}  # (sender, seq) -> its early scatter ended here
        self.cut: dict[int, threading.Event] = {}  # seq -> this worker's early scatter seq is cut short (P formed)
        self.early_sent: dict[int, set] = {}  # seq -> (aggregator, chunk) this worker's early scatter delivered
        self.watch: LinkWatch | None = None
        self.wait_ctl = 0.0  # how long a lost controller is waited for (0: it aborts the worker)
        self.ctl_deadline = 0.0
        self.rnd, self.computing_until = 0, 0.0
        self.handlers = {Msg.PLAN: self.on_plan, Msg.TASK: self.on_task, Msg.PRE: self.on_pre,
                         Msg.PRE_GO: self.on_pre_go, Msg.START: self.on_start, Msg.ABANDON: self.on_abandon,
                         Msg.CTRL_LOST: self.on_ctrl_lost, Msg.CTRL_BACK: self.on_ctrl_back,
                         Msg.WELCOME: lambda msg: None,  # the controller's answer to a rejoin
                         Msg.ROUND_DONE: self.on_round_done}

    def run(self) -> int:
        """Serve the run to FINISH; the agent's exit code."""
        agent, job = self.agent, self.job
        while (begin := agent.next_msg((Msg.BEGIN, Msg.PLAN), job.wait_s))["msg"] == Msg.PLAN:
            self.install(int(begin["version"]), begin)  # non-blocking: the early-scatter versions, before BEGIN
        self.watch = LinkWatch(agent, begin["watch"], begin["link_timeout_s"]) if begin.get("watch") else None
        self.wait_ctl = float(begin.get("controller_wait_s") or 0)
        agent.standalone_ok = self.wait_ctl > 0
        self.computing_until = time.monotonic() + job.compute_for(0)
        while True:
            msg = self.next_message()
            if msg is None:
                continue
            kind = msg.get("msg")
            if kind == Msg.ABORT:
                raise Aborted(msg["reason"])
            if kind == Msg.FINISH:
                break
            handler = self.handlers.get(kind)
            if handler is None:
                raise ValueError(f"unexpected {kind!r} message in tasks mode")
            handler(msg)
        if self.watch:
            self.watch.close()
        late = [e for ex in agent.execs.values() for e in ex.late_errors()]
        agent.send(message(Msg.BYE, errors=late))
        return 1 if late else 0

    def next_message(self) -> dict | None:
        """The next message; None when this round's compute ended (ENQUEUE went out)."""
        wait = self.computing_until - time.monotonic() if self.computing_until is not None else self.job.wait_s
        try:
            return self.agent.inbox.get(timeout=max(0.0, wait))
        except queue.Empty:
            if self.computing_until is None:
                raise Aborted(f"no message from the {self.agent.coord} within {self.job.wait_s:g} s") from None
            self.computing_until = None
            self.agent.send(message(Msg.ENQUEUE, round=self.rnd))
            return None

    def spawn(self, fn, *args) -> None:
        th = threading.Thread(target=fn, args=args, daemon=True, name=f"crew-{fn.__name__}")
        self.threads.append(th)
        th.start()

    # -- message handlers (the main thread) ------------------------------------------------
    def on_plan(self, msg: dict) -> None:
        v = msg.get("version")
        if not isinstance(v, int) or v in self.agent.execs:
            raise ValueError(f"PLAN for version {v}: not a new version")
        self.spawn(self.install, v, msg)

    def on_task(self, msg: dict) -> None:
        pid, v, rounds = int(msg["pid"]), int(msg["version"]), dict(msg["rounds"])
        self.seen_pid = max(self.seen_pid, pid)
        self.arm(pid, self.agent.execs[v], rounds, msg.get("pre"), msg.get("chunk_times"))

    def on_pre(self, msg: dict) -> None:
        """Receive an early scatter (non-blocking, §IV-A2); PRE_ARMED once ready."""
        sender, v, seq = str(msg["of"]), int(msg["version"]), int(msg["seq"])
        self.early.setdefault((sender, seq), threading.Event())
        self.spawn(self.pre_recv, sender, seq, self.agent.execs[v], self.early.get((sender, seq - 1)),
                   self.early[(sender, seq)])

    def on_pre_go(self, msg: dict) -> None:
        """Every receiver is armed: send this round's default blocks now."""
        v, seq = int(msg["version"]), int(msg["seq"])
        self.spawn(self.pre_send, seq, int(msg["round"]), self.agent.execs[v], self.early.get((self.me, seq - 1)),
                   self.early.setdefault((self.me, seq), threading.Event()))

    def on_start(self, msg: dict) -> None:
        pid = int(msg["pid"])
        ex, rounds, chunk_times, seq = self.armed.pop(pid)
        self.running[pid] = (ex, rounds)
        self.spawn(self.run_task, pid, ex, rounds, chunk_times, seq)

    def on_abandon(self, msg: dict) -> None:
        """§IV-B: stop this task; its version is not used again."""
        pid, v, execs = int(msg["pid"]), msg.get("version"), self.agent.execs
        self.abandoned.add(pid)
        if isinstance(v, int):
            self.dropped.add(v)
        if pid in self.running:
            self.running[pid][0].abort(f"task {pid} abandoned by the controller")
        elif isinstance(v, int) and v in execs:
            self.armed.pop(pid, None)
            self.retire(execs[v])

    def on_ctrl_lost(self, msg: dict) -> None:
        """§IV-B: standalone; tasks not started cannot start (no START comes)."""
        for pid, (ex, *_) in list(self.armed.items()):
            self.retire(ex)
            del self.armed[pid]
        self.ctl_deadline = time.monotonic() + self.wait_ctl
        self.spawn(self.reconnect, self.ctl_deadline)

    def on_ctrl_back(self, msg: dict) -> None:
        """The (restarted) controller re-obtains this worker's state."""
        member = any(self.me in r for _, r in list(self.running.values()))
        try:
            self.agent.reattach(msg["sock"], message(
                Msg.REJOIN, round=self.rnd, pid=self.seen_pid, running=sorted(list(self.running)),
                ready=self.computing_until is None and self.rnd == self.done_round and not member,
                links_down=sorted(self.watch.down) if self.watch else []))
        except OSError as e:
            log.warning("rejoin failed (%s): trying again", e)
            wire.close_quietly(msg["sock"])
            self.spawn(self.reconnect, self.ctl_deadline)

    def on_round_done(self, msg: dict) -> None:
        self.rnd += 1
        self.computing_until = time.monotonic() + self.job.compute_for(self.rnd)

    # -- threads -----------------------------------------------------------------------------
    def install(self, v: int, msg: dict) -> None:
        agent, losses = self.agent, self.agent.losses
        try:
            agent.install_plan(v, msg)
            agent.send(message(Msg.INSTALLED, version=v))
        except Exception as e:
            if v in self.dropped or agent.losses != losses:  # given up on meanwhile (a link it needs broke,
                # or its controller was lost before every peer had it): no error
                log.warning("plan version %d not installed (abandoned): %s", v, e)
                return
            agent.abort_soon(f"installing plan version {v}: {type(e).__name__}: {e}")

    def after(self, prev: threading.Event | None, what: str) -> None:
        """An early-scatter executor runs one scatter at a time: wait for the previous one
        (a member's task may end before a node that keeps none of its chunks got them all)."""
        if prev is not None and not prev.wait(self.job.timeout_s):
            raise TimeoutError(f"{what}: the previous early scatter not done within {self.job.timeout_s:g} s")

    def pre_recv(self, sender: str, seq: int, ex, prev, done: threading.Event) -> None:
        try:
            self.after(prev, f"early scatter {seq} of {sender}")
            ex.advance(seq)
            ex.prepare(None)
            self.agent.send(message(Msg.PRE_ARMED, of=sender, seq=seq))
            ex.run(seq)
            done.set()
        except Exception as e:
            self.agent.abort_soon(f"early scatter {seq} of {sender}: {type(e).__name__}: {e}")

    def pre_send(self, seq: int, rnd: int, ex, prev, done: threading.Event) -> None:
        """This worker's early scatter number ``seq`` (round ``rnd``'s default blocks), chunk
        by chunk; once it is cut short (the TASK of its group came), the chunks not yet
        written go withdrawn: the task's plan sends them to their owner in P's split."""
        job = self.job
        try:
            self.after(prev, f"early scatter {seq}")
            self.early_sent.pop(seq - 1, None)  # its task is over: this worker enqueued again
            ex.advance(seq)
            ex.prepare(make_input(job.seed, job.nodes.index(self.me), rnd, job.length, job.dtype))
            stop = self.cut.setdefault(seq, threading.Event())
            ex.withdraw = lambda op: stop.is_set()
            withdrawn = set(ex.run(seq).get("withdrawn", ()))
            self.early_sent[seq] = {(op.peer, op.chunk) for op in ex.prog
                                    if op.kind == "send" and op.xfer not in withdrawn}
            self.cut.pop(seq, None)
            done.set()
        except Exception as e:
            self.agent.abort_soon(f"early scatter {seq}: {type(e).__name__}: {e}")

    def ended(self, k: str, seq: int) -> None:
        """Wait (at most the job's timeout) until ``k``'s early scatter ``seq`` ended here."""
        if not self.early.setdefault((k, seq), threading.Event()).wait(self.job.timeout_s):
            raise TimeoutError(f"early scatter {seq} of {k} not ended here within {self.job.timeout_s:g} s")

    def arm(self, pid: int, ex, rounds: dict, pre: dict | None, chunk_times: bool = False) -> None:
        """TASK: the executor moves to iteration ``pid`` with this node's input.  Non-blocking
        (``pre``: the members' early scatters, §IV-A2): :meth:`use_early_scatters`."""
        job, me = self.job, self.me
        try:
            x = make_input(job.seed, job.nodes.index(me), rounds[me], job.length, job.dtype) if me in rounds \
                else None
            ex.withdraw = ex.on_withdrawn = None
            seq = self.use_early_scatters(ex, pre) if pre is not None else None
            ex.advance(pid)
            ex.prepare(x)
            self.armed[pid] = (ex, rounds, bool(chunk_times), seq)
            self.agent.send(message(Msg.ARMED, pid=pid))
        except Exception as e:
            self.agent.abort_soon(f"arming task {pid}: {type(e).__name__}: {e}")

    def use_early_scatters(self, ex, pre: dict) -> int | None:
        """This worker's own early scatter is cut short, and in the task it withdraws each
        scatter chunk its early scatter delivered to the same aggregator (asked as the chunk
        is about to go, once the early scatter ended); a withdrawn chunk's receiver applies
        the early copy it holds instead (once that member's early scatter ended here).  Early
        copies of chunks Alg. 2 moved away are not used: their senders send them again to
        the new owner.  The number of this worker's early scatter (None: it had none)."""
        me, seq = self.me, None
        if me in pre["from"]:
            seq = pre["from"][me][1]
            if not self.early.setdefault((me, seq), threading.Event()).is_set():
                self.cut.setdefault(seq, threading.Event()).set()  # (pre_send may not have begun)

            def withdraw(op, seq=seq) -> bool:
                if op.phase != "scatter":
                    return False
                self.ended(me, seq)
                return (op.peer, op.chunk) in self.early_sent[seq]
            ex.withdraw = withdraw
        sources = {k: (self.agent.execs[v], s) for k, (v, s) in pre["from"].items() if k != me}

        def on_withdrawn(op) -> np.ndarray:
            if op.peer not in sources or op.buf != "x":
                raise wire.ProtocolError(f"transfer {op.xfer} withdrawn by {op.peer}, which sent this "
                                         "node no early scatter into x")
            early_ex, s = sources[op.peer]
            self.ended(op.peer, s)
            return early_ex.bufs["x"][op.offset:op.offset + op.length]
        ex.on_withdrawn = on_withdrawn
        return seq

    def retire(self, ex) -> None:
        """A version given up on: its threads and connections go."""
        for v, e in list(self.agent.execs.items()):
            if e is ex and v != 0:
                self.agent.execs.pop(v, None)  # (the task's thread and the ABANDON may both retire it)
        ex.close()

    def run_task(self, pid: int, ex, rounds: dict, chunk_times: bool, seq: int | None) -> None:
        agent, me = self.agent, self.me
        try:
            timing = ex.run(pid)
            agent.send(message(Msg.TASK_DONE, pid=pid, comm_start_ns=timing["comm_start_ns"],
                               comm_done_ns=timing["comm_done_ns"], **self.check(ex, rounds),
                               **self.early_use(ex, timing, seq),
                               **({"chunks": self.chunk_times(ex, timing)} if chunk_times else {})))
            self.running.pop(pid, None)  # after the report: a REJOIN names it running or carries the report
            if pid in self.abandoned:  # stopped after its run here ended (the ABANDON's abort came too late):
                self.retire(ex)  # its connections go all the same (one left open, reset later with bytes unsent,
                # held the next task's turn on the link: LinkGate)
            if me in rounds and rounds[me] == self.done_round:  # not a repair of a round already done
                self.done_round += 1
                agent.post(message(Msg.ROUND_DONE))
        except Exception as e:
            log.error("task %d failed: %s", pid, e)
            if pid in self.abandoned or agent.detached is not None:  # (its frames must not meet a later task)
                self.retire(ex)
            agent.send(message(Msg.TASK_FAILED, pid=pid, message=f"{type(e).__name__}: {e}"))
            self.running.pop(pid, None)
            if pid in self.abandoned:  # an ABANDON that came meanwhile found it running: only aborted
                self.retire(ex)

    def check(self, ex, rounds: dict) -> dict:
        """A member's result against the sum over P of the members' inputs (exact, by bytes)."""
        job = self.job
        if self.me not in rounds:
            return {"receiver": False, "correct": True, "max_abs_err": 0.0, "digest": None}
        x = ex.bufs["x"]
        want = group_sum(job.seed, job.nodes, rounds, job.length, job.dtype)
        ok = bool(np.array_equal(x.view(np.uint8), want.view(np.uint8)))
        return {"receiver": True, "correct": ok,
                "max_abs_err": 0.0 if ok else float(np.nanmax(np.abs(x.astype(np.float64) - want))),
                "digest": hashlib.sha256(memoryview(x).cast("B")).hexdigest()}

    def early_use(self, ex, timing: dict, seq: int | None) -> dict:
        """Chunks this worker's early scatter delivered; of them, withdrawn in the task."""
        if seq is None:
            return {}
        withdrawn = set(timing.get("withdrawn", ()))
        return {"early_sent": len(self.early_sent.get(seq, ())),
                "withdrawn": sum(op.kind == "send" and op.xfer in withdrawn for op in ex.prog)}

    @staticmethod
    def chunk_times(ex, timing: dict) -> list:
        """[sender, first byte, last byte] of every chunk received (agent clock)."""
        withdrawn = set(timing.get("withdrawn", ()))
        src = {op.xfer: op.peer for op in ex.prog if op.kind == "recv"}
        return [[src[r[0]], r[2], r[3]] for r in timing["recvs"] if r[0] not in withdrawn]

    def reconnect(self, deadline: float) -> None:
        """Standalone (§IV-B): try to reach the controller again until ``deadline``."""
        agent = self.agent
        while time.monotonic() < deadline and not agent.stopping:
            try:
                agent.post(message(Msg.CTRL_BACK, sock=agent.connect_again(deadline)))
                return
            except Exception:  # refused while it is down, or not listening
                time.sleep(0.2)
        agent.post(message(Msg.ABORT, reason=f"the controller did not come back within {self.wait_ctl:g} s"))
