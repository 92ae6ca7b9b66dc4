"""The worker process: ``python3 -m agents.agent --config node.json``.

node.json::

    {"name": "h1", "coordinator": "10.0.0.100:7000", "data_port": 7100,
     "bind": "0.0.0.0", "secret_file": "/path/secret", "log_file": "/tmp/h1.log"}

``data_port`` 0 picks a free port (reported to the coordinator); ``log_file`` is
optional (logs always go to stderr too); optional ``handshake_timeout_s`` (one deadline
per handshake, default 10) and ``connect_retry_s`` (how long connects are retried while a
server starts, default 10).  Life cycle: listen on the data port, connect
and authenticate to the coordinator (retrying while it starts), receive the JOB, open
the outgoing data connections, report READY, then per iteration wait for GO, sleep the
compute time, run the program, check the result and report DONE.  Exit 0 after FINISH,
1 on any failure or ABORT.  Control messages are JSON objects with a ``"msg"`` key, one of
:class:`agents.protocol.Msg` (``agents.protocol.FIELDS``: who sends it, its fields).  A JOB
whose ``mode`` is a key of :data:`WORKER_LOOPS` runs that loop after READY instead of the
iterations (CREW's ``tasks``: :class:`agents.crew_worker.WorkerLoop`).

PLAN installs another version of the plan (program, peers, scratch: one more executor with
its own data connections, whose handshake names the version); the agent answers INSTALLED.
GO names the version its iteration runs (:mod:`agents.coordinator` documents the switch
protocol).  CLOCK is an NTP-style exchange (the agent answers with its receive and send times,
:func:`testbed.clock.estimate` on the coordinator's side); PROBE reports a window of DATA chunk samples this agent
received from one peer (NetStorm §V passive probing; the JOB's ``probe`` says the minimum
chunk size and how many chunks make a window, None: no probing).

Nothing waits without a deadline: the coordinator's WELCOME gives its heartbeat period and
the silence after which the agent gives up on it; the JOB bounds the wait for each next
message (derived from ``timeout_s`` and the plan's predicted time).  STATUS asks for the
executor's snapshot (what is awaited from whom) when the coordinator diagnoses a stall.

Only ``testbed.plan`` is imported from the harness: this runs on real hosts too.
``clock_offset_ms`` in node.json (optional, for tests) shifts every timestamp the agent
reports, as on a host whose clock is off (:mod:`agents.clock`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import queue
import socket
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from testbed.plan import Op

from . import clock, wire
from .crew_worker import WorkerLoop
from .executor import SUBBLOCK_BYTES, Executor, LinkGate, Stalled
from .inputs import expected_sum, make_input, rotation
from .probe import Prober, Sample
from .protocol import Aborted, Msg, message
from .trains import Trains

log = logging.getLogger("agents")

CONNECT_RETRY_S = 10.0
MAX_PENDING = 64  # unauthenticated connections at once; more are refused
# The JOB's mode -> the loop an agent runs after READY (``iterations``: Agent.run_iterations).
WORKER_LOOPS = {"tasks": WorkerLoop}  # CREW's groups from the controller's ready queue


@dataclass
class Job:
    """Everything one agent needs to run its part of a plan (the JOB message)."""

    name: str
    nodes: list[str]  # plan.nodes (a node's input index is its position here)
    length: int
    participants: list[str]
    receivers: list[str]
    program: list[Op]
    peers: dict[str, tuple[str, int]]  # peer -> (ip, data port) for outgoing connections
    scratch: dict[str, int] = field(default_factory=dict)
    dtype: str = "float32"
    seed: int = 0
    iterations: int = 1
    compute_s: list[float] = field(default_factory=list)  # per iteration (last value repeats)
    stop_and_wait: bool = False
    subblock_bytes: int = SUBBLOCK_BYTES  # cut-through: arrived bytes applied (and forwarded) at a time
    links: str = "channel"  # data connections: one per plan channel, or one per peer shared (agents.executor)
    timeout_s: float = 60.0
    wait_s: float = 600.0  # longest wait for the coordinator's next message (GO, FINISH)
    limit_s: float | None = None  # longest one iteration's communication may take
    probe: dict | None = None  # {"chunk_bytes", "chunk_num"}: report received chunks (agents.probe);
    # "trains": [[peer, ip, port, packets, every_s]]: send packet trains on these links (agents.trains)
    aux: dict = field(default_factory=dict)  # auxiliary paths through this node (testbed.plan.Plan.aux)
    mode: str = "iterations"  # or a key of WORKER_LOOPS (the driver's loop, e.g. CREW's "tasks")

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["program"] = [op.to_dict() for op in self.program]
        d["peers"] = {p: [ip, port] for p, (ip, port) in self.peers.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Job":
        d = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        d["program"] = [Op.from_dict(o) for o in d["program"]]
        d["peers"] = {p: (str(a[0]), int(a[1])) for p, a in d["peers"].items()}
        return cls(**d)

    def compute_for(self, iteration: int) -> float:
        return float(self.compute_s[min(iteration, len(self.compute_s) - 1)]) if self.compute_s else 0.0


class Agent:
    _block: tuple = (None, None, None)  # (block, input, true sum) of the iterations :meth:`inputs` gives

    def __init__(self, cfg: dict):
        self.name = str(cfg["name"])
        self.secret = wire.load_secret(cfg["secret_file"])
        host, _, port = str(cfg["coordinator"]).rpartition(":")
        self.coord_addr = (host.strip("[]"), int(port))
        self.coord = f"coordinator at {host}:{port}"
        self.handshake_s = float(cfg.get("handshake_timeout_s", wire.HANDSHAKE_TIMEOUT_S))
        self.retry_s = float(cfg.get("connect_retry_s", CONNECT_RETRY_S))
        self.sources = {str(k): str(v) for k, v in (cfg.get("sources") or {}).items()}  # "peer/channel" -> address
        self.prober: Prober | None = None
        self.trains: Trains | None = None
        self.iteration = 0  # the one GO last started
        self.listener = socket.create_server((cfg.get("bind", "0.0.0.0"), int(cfg.get("data_port", 0))),
                                             backlog=socket.SOMAXCONN)
        self.data_port = self.listener.getsockname()[1]
        self.ctrl: socket.socket | None = None
        self.ctrl_lock = threading.Lock()
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.job: Job | None = None
        self.ex: Executor | None = None  # the version running (or last run)
        self.execs: dict[int, Executor] = {}  # every installed plan version
        self._installed = threading.Condition()
        self._gates: dict[str, LinkGate] = {}
        self.stopping = False
        self.standalone_ok = False  # CREW tasks mode: a lost controller is survived (agents.crew_worker.WorkerLoop)
        self.detached: list | None = None  # not None while the controller is gone
        self.losses = 0  # how often the controller was lost (a version installed across a loss is void)
        self.recent: deque = deque(maxlen=32)  # the latest task reports
        self.silence_s = self.handshake_s  # until the coordinator's WELCOME says otherwise

    # -- control channel ---------------------------------------------------------
    def send(self, obj: dict, typ: int = wire.CTRL) -> None:
        """To the coordinator; a send that fails (or is blocked for the silence limit) raises
        ConnectionError naming the coordinator.
        Detached from a lost controller (CREW tasks mode, :meth:`detach`): dropped; the
        latest task reports (sent or not) go again in the REJOIN (:meth:`reattach`)."""
        with self.ctrl_lock:
            if obj.get("msg") in (Msg.TASK_DONE, Msg.TASK_FAILED):
                self.recent.append(obj)
            if self.detached is not None:
                return
            try:
                wire.send_json(self.ctrl, obj, typ)
            except OSError as e:
                why = f"cannot send to the {self.coord}: {type(e).__name__}: {e}"
                if not self.standalone_ok or self.stopping:
                    raise ConnectionError(why) from None
                self._detach_locked(why)

    def detach(self, why: str) -> None:
        """CREW §IV-B: the controller is gone; the worker goes on standalone (agents.crew_worker.WorkerLoop)."""
        with self.ctrl_lock:
            self._detach_locked(why)

    def _detach_locked(self, why: str) -> None:
        if self.detached is None:
            self.detached, self.losses = [], self.losses + 1
            wire.close_quietly(self.ctrl)
            log.warning("controller lost: %s", why)
            self.inbox.put(message(Msg.CTRL_LOST, why=why))

    def reattach(self, sock: socket.socket, first: dict) -> None:
        """Connected to the controller again: ``first`` (with ``reports``, the latest task
        reports: one sent just before the loss may not have arrived) is the first message on
        ``sock``; then normal sending."""
        with self.ctrl_lock:
            sock.settimeout(self.silence_s)
            wire.send_json(sock, {**first, "reports": list(self.recent)})
            self.ctrl, self.detached = sock, None
        threading.Thread(target=self._ctrl_reader, args=(sock,), daemon=True, name="ctrl-reader").start()

    def connect_again(self, deadline: float) -> socket.socket:
        """A new control connection to the coordinator, as a rejoining worker (one attempt)."""
        return wire.connect(self.coord_addr, self.secret, {**self.ident, "rejoin": True},
                            timeout_s=min(self.handshake_s, max(0.1, deadline - time.monotonic())))

    def post(self, msg: dict) -> None:
        """Any thread: put a (local) message in the main thread's inbox."""
        self.inbox.put(msg)

    def abort_soon(self, reason: str) -> None:
        """Any thread: make the main thread (and a running iteration) fail with ``reason``."""
        self.inbox.put(message(Msg.ABORT, reason=reason))
        for ex in list(self.execs.values()):
            ex.abort(reason)

    def _ctrl_reader(self, sock: socket.socket) -> None:
        """Forward coordinator messages to the inbox; answer STATUS; abort on ABORT, EOF, a
        malformed message or the coordinator's silence (it sends a heartbeat) -- or, with
        ``standalone_ok``, on the last three :meth:`detach`."""
        try:
            while True:
                h, msg = wire.recv_json(sock)
                kind = msg.get("msg")
                if h.type == wire.ERROR or kind == Msg.ABORT:
                    self.abort_soon(f"aborted by the coordinator: {wire.sanitize(msg.get('reason', '?'))}")
                    return
                if kind == Msg.ALIVE:
                    continue
                if kind == Msg.CLOCK:  # NTP-style: receive and answer times on this agent's clock
                    t2 = time.time_ns()
                    self.send(message(Msg.CLOCK, seq=msg.get("seq"), t1=msg.get("t1"), t2=t2, t3=time.time_ns()))
                    continue
                if kind == Msg.STATUS:
                    self.send(message(Msg.STATUS, **(self.ex.status() if self.ex else {})))
                    continue
                if kind == Msg.RESEND:  # a receiver misses chunks this agent sent over auxiliary paths
                    ex, xfers = self.execs.get(msg.get("version")), msg.get("xfers")
                    if ex is None or not isinstance(msg.get("iteration"), int) or not isinstance(xfers, list) \
                            or not all(isinstance(x, int) for x in xfers):
                        raise wire.ProtocolError(f"malformed RESEND: {wire.sanitize(msg, 120)}")
                    log.info("re-sending %d chunks of iteration %d", ex.resend(msg["iteration"], xfers),
                             msg["iteration"])
                    continue
                if kind == Msg.WELCOME:
                    self.silence_s = float(msg["silence_s"])
                    self.ctrl.settimeout(self.silence_s)
                self.inbox.put(msg)
        except socket.timeout:
            if not self.stopping and sock is self.ctrl:  # (an old connection's end is no news)
                (self.detach if self.standalone_ok else self.abort_soon)(
                    f"{self.coord} silent for {self.silence_s:g} s (stopped or unreachable)")
        except (wire.ProtocolError, wire.Closed, OSError) as e:
            if not self.stopping and sock is self.ctrl:
                (self.detach if self.standalone_ok else self.abort_soon)(
                    f"lost the connection to the {self.coord}: {type(e).__name__}: {e}")
        except Exception as e:  # no thread dies silently
            self.abort_soon(f"control reader failed: {type(e).__name__}: {wire.sanitize(e)}")

    def _heartbeat(self, period: float) -> None:
        try:
            while not self.stopping:
                time.sleep(period)
                self.send(message(Msg.ALIVE))
        except Exception as e:  # (send() does not raise once detached)
            if not self.stopping:
                self.abort_soon(f"heartbeat: {type(e).__name__}: {e}")  # send() names the coordinator

    def next_msg(self, kind: str | tuple[str, ...], timeout: float) -> dict:
        """The coordinator's next message, which must be ``kind`` (or one of them), within
        ``timeout`` s."""
        kinds = (kind,) if isinstance(kind, str) else kind
        try:
            msg = self.inbox.get(timeout=timeout)
        except queue.Empty:
            raise Aborted(f"no {'/'.join(k.upper() for k in kinds)} from the {self.coord} within "
                          f"{timeout:g} s") from None
        if msg.get("msg") == Msg.ABORT:
            raise Aborted(msg["reason"])
        if msg.get("msg") not in kinds:
            raise wire.ProtocolError(f"{self.coord} sent {wire.sanitize(msg.get('msg'), 40)!r}, "
                                     f"expected {' or '.join(map(repr, kinds))}")
        return msg

    def _on_chunk(self, peer: str, sample: tuple | None) -> None:
        """A receiver thread started (None) or completed a DATA chunk: feed the prober,
        report a full window."""
        if self.iteration < self.job.probe.get("from_iteration", 0):  # warm-up: cold connections
            return
        if sample is None:
            self.prober.start(peer)
            return
        window = self.prober.add(peer, Sample(*sample))
        if window:
            self.send(message(Msg.PROBE, src=peer, dst=self.name, t_ns=time.time_ns(),
                              samples=[list(s) for s in window]))

    # -- data connections ----------------------------------------------------------
    def _handshake(self, sock: socket.socket, addr) -> None:
        who = f"{addr[0]}:{addr[1]}"
        deadline = time.monotonic() + self.handshake_s

        def check(ident: dict) -> None:
            if ident.get("role") != "data" or not isinstance(ident.get("channel"), int) \
                    or not isinstance(ident.get("name"), str):
                raise wire.ProtocolError(f"not a data connection: {wire.sanitize(ident, 120)}")
            v = ident.get("version", 0)
            with self._installed:  # a faster peer may connect before this agent installed the version
                if not self._installed.wait_for(lambda: v in self.execs, max(0.0, deadline - time.monotonic())):
                    raise wire.ProtocolError(f"no plan version {wire.sanitize(v, 20)} here")

        try:
            wire.tune(sock)
            ident = wire.server_handshake(sock, self.secret, check, deadline)
            sock.settimeout(None)
            self.execs[ident.get("version", 0)].attach_incoming(ident["name"], ident["channel"], sock)
            log.info("data connection from %s (channel %d) at %s", ident["name"], ident["channel"], who)
        except (wire.ProtocolError, wire.Closed, OSError) as e:
            log.warning("refused connection from %s: %s", who, wire.sanitize(e))
            wire.close_quietly(sock)

    def gate(self, peer: str) -> LinkGate:
        """The link to ``peer``'s FL-FCFS gate, shared by every version installed with
        ``link_fifo`` (CREW §IV-C: concurrent tasks' flows in the order they became ready)."""
        with self._installed:
            return self._gates.setdefault(peer, LinkGate())

    def install_plan(self, version: int, msg: dict) -> None:
        """Install the PLAN ``msg`` as ``version`` (:meth:`install`)."""
        self.install(version, [Op.from_dict(o) for o in msg["program"]], msg["scratch"],
                     {p: (str(a[0]), int(a[1])) for p, a in msg["peers"].items()}, msg.get("aux", {}),
                     link_fifo=bool(msg.get("link_fifo")))

    def install(self, version: int, program: list[Op], scratch: dict, peers: dict, aux: dict,
                link_fifo: bool = False) -> None:
        """One executor for plan ``version``, its outgoing data connections open;
        ``link_fifo``: its sends take turns with the other such versions' (:meth:`gate`)."""
        job = self.job
        ex = Executor(self.name, program, length=job.length, scratch=scratch, dtype=job.dtype,
                      stop_and_wait=job.stop_and_wait, subblock_bytes=job.subblock_bytes, links=job.links,
                      timeout_s=job.timeout_s, limit_s=job.limit_s,
                      on_chunk=self._on_chunk if self.prober else None, nodes=job.nodes, aux=aux,
                      connect=lambda peer, ch: self._data_connection(version, peers, peer, ch),
                      on_missing=lambda it, xfers: self.send(message(Msg.MISSING, version=version,
                                                                    iteration=it, xfers=xfers)),
                      gate=self.gate if link_fifo else None)
        if self.ex is not None:
            ex.advance(self.ex.iteration)
        with self._installed:
            self.execs[version] = ex
            self._installed.notify_all()
        self._connect_peers(ex, version, peers)

    def _data_connection(self, version: int, peers: dict, peer: str, ch: int) -> socket.socket:
        """An authenticated data connection of plan ``version`` to ``peer`` on channel ``ch``."""
        if peer not in peers:
            raise ConnectionError(f"data connection to peer {peer} (channel {ch}): no address known")
        addr = peers[peer]
        ident = {"role": "data", "name": self.name, "channel": ch, **({"version": version} if version else {})}
        # the first plan's connections on a named path: from that path's address (testbed.hosts.run_agents)
        source = self.sources.get(f"{peer}/{ch}") if version == 0 else None
        try:
            sock = wire.connect(addr, self.secret, ident, timeout_s=self.handshake_s, retry_s=self.retry_s,
                                source=source)
        except (OSError, wire.ProtocolError) as e:
            raise ConnectionError(f"data connection to peer {peer} (channel {ch}, expected listening at "
                                  f"{addr[0]}:{addr[1]}): {e}") from None
        log.info("connected to %s (channel %d, version %d) at %s:%d", peer, ch, version, *addr)
        return sock

    def _connect_peers(self, ex: Executor, version: int, peers: dict) -> None:
        """Open every outgoing data connection at once: on long-RTT paths each handshake
        costs several round trips, so one after another would take seconds."""
        def connect(peer: str, ch: int) -> None:
            ex.attach_outgoing(peer, ch, self._data_connection(version, peers, peer, ch))

        with ThreadPoolExecutor(max_workers=32) as pool:
            for f in [pool.submit(connect, peer, ch) for peer, ch in ex.outgoing()]:
                f.result()  # re-raise the first failure

    # -- main ------------------------------------------------------------------------
    def inputs(self, iteration: int) -> tuple[np.ndarray | None, np.ndarray | None, int]:
        """(this node's input, the true sum it must end with, the shift) of ``iteration``: the
        input and the sum of its block, rotated by the shift (:func:`agents.inputs.rotation`);
        None where it has none (not a participant, not a receiver).  A block's are made once,
        the first before READY: made after GO, they take the CPU others communicate with on a
        shared machine and skew the agents' starts (a later block comes every ``length``
        iterations, so only small vectors have one)."""
        job = self.job
        block, shift = rotation(iteration, job.length)
        if self._block[0] != block:
            first = block * max(1, job.length)
            x = make_input(job.seed, job.nodes.index(self.name), first, job.length, job.dtype) \
                if self.name in job.participants else None
            want = expected_sum(job.seed, [job.nodes.index(p) for p in job.participants], first, job.length,
                                job.dtype) if self.name in job.receivers else None
            self._block = (block, x, want)
        return self._block[1], self._block[2], shift

    def verify(self, want: np.ndarray | None, shift: int) -> dict:
        """Exact, by bytes (a -0.0 where +0.0 belongs is wrong), against the true sum: ``want``
        rotated by ``shift``."""
        x = self.ex.bufs["x"]
        if want is None:  # not a receiver: nothing to check
            return {"receiver": False, "correct": True, "max_abs_err": 0.0, "digest": None}
        n = len(want) - shift
        ok = all(np.array_equal(a.view(np.uint8), b.view(np.uint8))
                 for a, b in ((x[shift:], want[:n]), (x[:shift], want[n:])))
        err = 0.0 if ok else float(np.nanmax(np.abs(x.astype(np.float64) - np.roll(want, shift)), initial=0.0))
        return {"receiver": True, "correct": ok, "max_abs_err": err,
                "digest": hashlib.sha256(memoryview(x).cast("B")).hexdigest()}

    def run(self) -> int:
        """Register, take the JOB, open the data connections, say READY, run the job's loop;
        the exit code."""
        welcome = self._register()
        self.job = job = Job.from_dict(self.next_msg(Msg.JOB, float(welcome["job_within_s"]))["job"])
        if job.probe:
            self.prober = Prober(job.probe["chunk_bytes"], job.probe["chunk_num"])
        if job.probe and job.probe.get("trains"):  # capacity of this node's WAN links (agents.trains)
            self.trains = Trains(job.nodes.index(self.name), job.nodes, self.data_port,
                                 job.probe["trains"], self._on_train, seed=str(job.seed),
                                 bind=self.listener.getsockname()[0]).start()
        self.install(0, job.program, job.scratch, job.peers, job.aux)
        self.ex = self.execs[0]
        loop = WORKER_LOOPS.get(job.mode)
        if loop is not None:
            self.send(message(Msg.READY))
            return loop(self).run()
        return self.run_iterations()

    def _register(self) -> dict:
        """Connect to the coordinator, start the control reader, the data listener and the
        heartbeats; the coordinator's WELCOME."""
        self.ident = ident = {"role": "agent", "name": self.name, "data_port": self.data_port,
                              "pid": os.getpid(), "host": socket.gethostname()}
        try:
            self.ctrl = wire.connect(self.coord_addr, self.secret, ident, timeout_s=self.handshake_s,
                                     retry_s=self.retry_s)
        except (OSError, wire.ProtocolError, wire.Closed) as e:  # e.g. the coordinator died before we connected
            raise ConnectionError(f"cannot register with the {self.coord}: {type(e).__name__}: "
                                  f"{wire.sanitize(e)}") from None
        self.silence_s = self.handshake_s  # the WELCOME is part of registering
        self.ctrl.settimeout(self.silence_s)
        log.info("registered with coordinator %s:%d (data port %d)", *self.coord_addr, self.data_port)
        threading.Thread(target=self._ctrl_reader, args=(self.ctrl,), daemon=True, name="ctrl-reader").start()
        threading.Thread(target=wire.serve, daemon=True, name="accept",
                         args=(self.listener, wire.Gate(MAX_PENDING), self._handshake,
                               lambda: self.stopping, log)).start()
        welcome = self.next_msg(Msg.WELCOME, self.handshake_s)
        threading.Thread(target=self._heartbeat, args=(float(welcome["heartbeat_s"]),), daemon=True,
                         name="heartbeat").start()
        return welcome

    def run_iterations(self) -> int:
        """The iteration barrier: per iteration GO (installing PLANs before it), compute, run
        the program, check, DONE; then FINISH and BYE."""
        job = self.job
        self.inputs(0)  # the first block's input and sum, before READY
        self.send(message(Msg.READY))
        for it in range(job.iterations):
            while (msg := self.next_msg((Msg.GO, Msg.PLAN), job.wait_s))["msg"] == Msg.PLAN:
                v = msg.get("version")
                if not isinstance(v, int) or v in self.execs:
                    raise wire.ProtocolError(f"PLAN for version {wire.sanitize(v, 20)}: not a new version")
                self.install_plan(v, msg)
                self.send(message(Msg.INSTALLED, version=v))
            go_ns = time.time_ns()
            if msg.get("iteration") != it or msg.get("version", 0) not in self.execs:
                raise wire.ProtocolError(f"GO for iteration {wire.sanitize(msg.get('iteration'), 20)} version "
                                         f"{wire.sanitize(msg.get('version'), 20)}, expected iteration {it} of "
                                         "an installed version")
            self.ex, self.iteration = self.execs[msg.get("version", 0)], it
            x, want, shift = self.inputs(it)
            self.ex.prepare(x, shift)
            time.sleep(job.compute_for(it))
            compute_end = time.time_ns()
            timing = self.ex.run(it)
            check = self.verify(want, shift)
            if not check["correct"]:
                log.error("iteration %d: wrong result (max abs error %g)", it, check["max_abs_err"])
            for ex in self.execs.values():  # before DONE: a peer's data for it + 1 may come any time now
                ex.advance(it + 1)
            self.send(message(Msg.DONE, iteration=it, go_ns=go_ns, compute_end_ns=compute_end, **timing, **check))
            log.info("iteration %d done in %.3f s", it, (timing["comm_done_ns"] - timing["comm_start_ns"]) / 1e9)
        self.next_msg(Msg.FINISH, job.wait_s)
        late = [e for ex in self.execs.values() for e in ex.late_errors()]  # e.g. a frame after the end
        for e in late:
            log.error("after the last iteration: %s", e)
        self.send(message(Msg.BYE, errors=late))
        return 1 if late else 0

    def _on_train(self, src: str, rate_mbps: float | None, send_ns: int, recv_ns: int) -> None:
        self.send(message(Msg.TRAIN, src=src, rate_mbps=rate_mbps, send_ns=send_ns, recv_ns=recv_ns,
                          t_ns=time.time_ns()))

    def close(self) -> None:
        self.stopping = True
        if self.trains:
            self.trains.close()
        for ex in list(self.execs.values()):
            ex.close()
        self.listener.close()
        wire.close_quietly(self.ctrl)


def setup_logging(name: str, log_file: str | None) -> None:
    fmt = logging.Formatter(f"%(asctime)s {name} %(levelname)s %(message)s")
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    handlers = [logging.StreamHandler(sys.stderr)] + ([logging.FileHandler(log_file)] if log_file else [])
    for h in handlers:
        h.setFormatter(fmt)
        root.addHandler(h)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m agents.agent", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="node.json")
    args = ap.parse_args(argv)
    with open(args.config) as f:
        cfg = json.load(f)
    setup_logging(cfg.get("name", "?"), cfg.get("log_file"))
    clock.shift(float(cfg.get("clock_offset_ms", 0)))
    agent = None

    def thread_failed(args) -> None:  # no thread dies silently: it aborts the agent
        if agent is not None and not agent.stopping:
            agent.abort_soon(f"thread {args.thread.name if args.thread else '?'} failed: "
                             f"{args.exc_type.__name__}: {args.exc_value}")
    threading.excepthook = thread_failed
    try:
        agent = Agent(cfg)
        rc = agent.run()
        log.info("finished")
        return rc
    except Aborted as e:
        log.error("aborted: %s", e)
        return 1
    except Exception as e:
        log.error("failed: %s: %s", type(e).__name__, e)
        if agent and agent.ctrl:
            try:
                agent.send(message(Msg.ERROR, message=f"{type(e).__name__}: {e}",
                                   peer=e.peer if isinstance(e, wire.ProtocolError) else None, stall=isinstance(e, Stalled),
                                   status=agent.ex.status() if agent.ex else {}), wire.ERROR)
                # let the coordinator diagnose (it asks every agent for its status) and abort
                agent.inbox.get(timeout=agent.silence_s)
            except (OSError, queue.Empty):
                pass
        return 1
    finally:
        if agent:
            agent.close()


if __name__ == "__main__":
    sys.exit(main())
