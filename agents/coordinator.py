"""Coordinator: distributes a plan to the agents, runs the iterations, collects results.

Library use::

    c = Coordinator(plan, addresses={"h1": "10.0.0.1", ...}, data_port=7100, secret=b"...")
    c.start()            # accept agent registrations (c.address is the bound (host, port))
    ...start one agent per plan node...
    results = c.run()    # raises testbed.errors.RunError on any failure
    c.close()

Command line (real hosts)::

    python3 -m agents.coordinator --plan plan.json --addresses addr.json \\
        --secret-file F --port P --out results.json [--iterations N --seed S ...]

``run()`` waits for every plan node to register, sends each its JOB, waits for READY,
with ``sync_clocks`` estimates every agent's clock offset (NTP-style CLOCK exchanges, :func:`testbed.clock.estimate`;
every timestamp an agent reports is moved to the coordinator's clock with it, so CCTs and
transfer records are right on hosts with unsynchronised clocks), then per iteration sends
GO to all and collects DONE from all.  With ``probe`` the agents report windows of received
chunks (PROBE) and, with ``probe["trains"]`` ({duty, links: [[src, dst, configured Mbit/s]]}),
the packet trains they received on those links (TRAIN, :mod:`agents.trains`), kept in
:class:`agents.netstate.NetState` (results ``estimates``).

Versioned plans and policy switches (NetStorm §VII-A): the JOB's plan is version 0.  With
``policy``, before every iteration ``policy(iteration, netstate)`` may return another plan
(same nodes, length, participants and receivers).  A plan not seen before gets the next
version and is installed on every agent (PLAN: the node's program, scratch buffers and
peers; the agent opens that version's data connections and answers INSTALLED).  The switch
itself rides on the per-iteration barrier: GO carries the version for the iteration, and
GO for iteration k is sent only once every agent reported DONE for k - 1 — the role of
NetStorm's TRP exchange (workers ask before each PUSH, the scheduler answers once all
asked), with one message less.  So no iteration mixes versions.  Every agent moves all its
versions' executors to iteration k before it reports DONE for k - 1, so a chunk of
iteration k that a faster peer sends before this agent has read its GO is accepted and
held (cached) in that version's receive buffer until the iteration runs — never dropped,
never applied to another iteration (frames of other iterations are refused).  Agents keep
every installed version, so switching back costs only the GO.  It fails (RunError
naming the node and reason) if an agent reports an error, disconnects, or is silent
for ``timeout_s`` (agents send a heartbeat every second), and always tells the agents
to finish or abort so they exit.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import socket
import sys
import threading
import time
from types import MappingProxyType
from typing import Callable, Iterable, Mapping

import numpy as np

from testbed.clock import estimate as clock_estimate
from testbed.errors import ConfigError, RunError
from testbed.plan import RECV, Plan

from . import wire
from .agent import Job
from .netstate import NetState
from .trains import FRAME as TRAIN_FRAME
from .trains import shape as train_shape

log = logging.getLogger("agents.coordinator")

# send_ts_ns: the sender's clock in the DATA header; recv_start_ns/recv_end_ns: first/last
# payload byte read at the receiver; apply_ns: when the receiver added/copied it in.
TRANSFER_COLUMNS = ["iteration", "xfer", "src", "dst", "channel", "flow", "chunk", "phase", "bytes",
                    "send_start_ns", "send_end_ns", "send_ts_ns", "recv_start_ns", "recv_end_ns", "apply_ns",
                    "route"]  # route: "" direct, else the auxiliary path "src>relay>...>dst" (send_ts_ns: last hop's)
WORKER_KEYS = ["go_ns", "compute_end_ns", "comm_start_ns", "comm_done_ns", "receiver", "correct", "max_abs_err",
               "digest"]
MAX_PENDING = 64  # unauthenticated connections at once; more are refused
CLOCK_ROUNDS = 8  # NTP-style exchanges per agent; the least delayed one counts
CLOCK_WAIT_S = 2.0  # longest wait for the answers
INT, NUM = "an integer", "a number"
DONE_FIELDS = {"iteration": INT, "go_ns": INT, "compute_end_ns": INT, "comm_start_ns": INT, "comm_done_ns": INT,
               "receiver": bool, "correct": bool, "max_abs_err": NUM, "digest": (str, type(None)),
               "sends": list, "recvs": list}


def check_done(msg: dict, transfers: dict[int, tuple[str, str]], node: str) -> str | None:
    """Why a DONE message is malformed (missing or mistyped field, a timing row of a transfer
    that is not this node's), or None."""
    for key, want in DONE_FIELDS.items():
        if key not in msg:
            return f"missing field {key!r}"
        v = msg[key]
        if want == INT:
            ok = isinstance(v, int) and not isinstance(v, bool)
        elif want == NUM:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
        else:
            ok = isinstance(v, want)
        if not ok:
            what = want if isinstance(want, str) else "/".join(t.__name__ for t in (want if isinstance(want, tuple)
                                                                                    else (want,)))
            return f"bad field {key!r} (expected {what})"
    for key, width, side in (("sends", 3, 0), ("recvs", 5, 1)):
        for row in msg[key]:
            if not (isinstance(row, list) and len(row) == width
                    and all(isinstance(x, int) and not isinstance(x, bool) for x in row)):
                return f"bad {key} row {wire.sanitize(row, 80)} (expected {width} integers)"
            if transfers.get(row[0], (None, None))[side] != node:
                return f"{key} row for transfer {row[0]}, which is not one of this node's"
    for row in msg.get("aux", []) if isinstance(msg.get("aux", []), list) else [None]:
        if not (isinstance(row, list) and len(row) == 2 and isinstance(row[0], int) and isinstance(row[1], list)
                and transfers.get(row[0], (None,))[0] == node and row[1][:1] == [node]
                and row[1][-1:] == [transfers[row[0]][1]] and all(isinstance(n, str) for n in row[1])):
            return f"bad aux row {wire.sanitize(row, 80)} (expected [one of this node's transfers, its path])"
    return None


def _address(addresses: Mapping, src: str, dst: str) -> str:
    """``dst``'s address as seen from ``src``: ``addresses`` maps src -> {dst: ip} or dst -> ip."""
    view = addresses.get(src) if isinstance(addresses.get(src), Mapping) else addresses
    ip = view.get(dst) if view is not None else None
    if not isinstance(ip, str) or not ip:
        raise ConfigError(f"no address for {dst} as seen from {src}", key="addresses")
    return ip


class Failure(RunError):
    """A failed run: ``culprit`` is the node (or "coordinator") the failure is laid to,
    ``link`` (src, dst) the stalled link if one was found, ``results`` what completed."""

    def __init__(self, message: str, culprit: str | None = None, link: tuple[str, str] | None = None):
        super().__init__(message)
        self.culprit, self.link, self.results = culprit, link, None


def _off_cpu_since_start() -> float:
    """Seconds this process has existed without running (stopped, or waiting for a CPU);
    Linux, 0 where unknown."""
    try:
        f = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
        tck = os.sysconf("SC_CLK_TCK")
        age = float(open("/proc/uptime").read().split()[0]) - int(f[19]) / tck
        return age - (int(f[11]) + int(f[12])) / tck
    except (OSError, ValueError, IndexError):
        return 0.0


class _Conn:
    """One registered agent: its socket (the send and receive timeout is the silence limit)
    and a sender thread, so a stopped agent never blocks the coordinator."""

    def __init__(self, name: str, sock: socket.socket, addr: str, events: queue.SimpleQueue):
        self.name, self.sock, self.addr, self.events = name, sock, addr, events
        self.q: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._send_loop, daemon=True, name=f"send-{name}")
        self.thread.start()

    def put(self, obj: dict, typ: int = wire.CTRL) -> None:
        self.q.put((obj, typ))

    def _send_loop(self) -> None:
        kind = "?"
        try:
            while (item := self.q.get()) is not None:
                kind = item[0].get("msg")
                wire.send_json(self.sock, *item)
        except socket.timeout:
            self.events.put(("silent", self.name, f"cannot send {kind.upper()} to the agent at {self.addr}: no "
                             f"byte accepted for {self.sock.gettimeout():g} s (stopped or unreachable)"))
        except Exception as e:  # no thread dies silently
            self.events.put(("lost", self.name, f"cannot send {kind.upper()} to the agent at {self.addr}: "
                             f"{type(e).__name__}: {e}"))

    def close(self, grace_s: float = 0.0) -> None:
        self.q.put(None)
        self.thread.join(grace_s)
        wire.close_quietly(self.sock)


class Coordinator:
    """Runs ``plan`` on agents that connect to ``address``.

    ``addresses``: node -> IP (every node reaches it there) or node -> {peer: IP} (the
    address node uses to reach each peer).  ``data_port``: the agents' data port; None
    or 0 uses the port each agent reports when it registers.  ``compute_s``: node ->
    list of per-iteration compute seconds (the last value repeats; a number is allowed).
    ``secret``: bytes or str, surrounding whitespace ignored (as in a secret file).
    ``check_startup``: this is a process of its own (the command line): a start held up for
    longer than the silence limit is laid to the coordinator.
    ``health``: optional callable polled while waiting; a returned string ``"NODE: why"``
    fails the run (e.g. "h3: agent process exited").  ``predicted_s``: the plan's predicted
    communication time per iteration (bounds a whole iteration, with ``timeout_s``).

    Deadlines: an agent (or the coordinator) silent for ``silence_s`` (= max(1.5,
    timeout_s / 2), heartbeats every ``heartbeat_s``) is given up on, before any executor's
    ``timeout_s`` stall limit, so a stopped node is named rather than the ones waiting for
    it.  On a failure every live agent is asked for its status (what it awaits from whom)
    and the failure is laid to the node that stopped: a dead or silent one, the sender of a
    payload stalled mid-way, else the end of the chain of waits (:meth:`_diagnose`).
    ``clock_offsets_ns``: node -> its agent's clock minus this machine's
    (:mod:`testbed.clock`); every timestamp is reported on this machine's clock.
    ``sync_clocks`` (default: when probing) measures the offsets again over the control
    connection before the first GO (NetStorm §V's clock synchronisation); ``probe``,
    ``truth`` and ``policy``: the closed loop (module docstring).
    """

    def __init__(self, plan: Plan, *, addresses: Mapping, data_port: int | None, secret: bytes | str,
                 iterations: int = 1, seed: int = 0, dtype: str = "float32",
                 compute_s: Mapping[str, list[float] | float] | None = None, stop_and_wait: bool = False,
                 timeout_s: float = 60.0, bind: tuple[str, int] = ("0.0.0.0", 0),
                 progress: Callable[[str], None] | None = None, register_timeout_s: float | None = None,
                 health: Callable[[], str | None] | None = None, predicted_s: float | None = None,
                 handshake_s: float = wire.HANDSHAKE_TIMEOUT_S, check_startup: bool = False,
                 clock_offsets_ns: Mapping[str, int] | None = None, probe: dict | None = None,
                 truth: Callable[[str, str], dict | None] | None = None,
                 policy: Callable[[int, NetState], Plan | None] | None = None, sync_clocks: bool | None = None,
                 tasks: dict | None = None):
        plan.validate()
        np.dtype(dtype)
        self.plan, self.secret, self.data_port = plan, wire.as_secret(secret), data_port
        self.iterations, self.seed, self.dtype = int(iterations), int(seed), dtype
        self.stop_and_wait, self.timeout_s = bool(stop_and_wait), float(timeout_s)
        self.register_timeout_s = float(register_timeout_s or timeout_s)
        self.compute_s = {n: ([float(v)] if isinstance(v, (int, float)) else [float(x) for x in v])
                          for n, v in (compute_s or {}).items()}
        self.progress = progress or (lambda s: None)
        self.health = health
        self.handshake_s = float(handshake_s)
        self.check_startup = check_startup  # a process of its own: was it held up before it got going?
        self.silence_s = max(1.5, self.timeout_s / 2)
        self.heartbeat_s = min(1.0, self.silence_s / 6)
        # communication of one iteration: the stall limit plus a margin over the prediction
        self.limit_s = self.timeout_s + 4 * predicted_s if predicted_s else 10 * self.timeout_s
        self._addresses = addresses
        self._peer_ip = self._resolve_addresses(addresses)
        self._xfers = {op.xfer: (src, op.peer) for src, op in plan.transfers()}
        self.listener = socket.create_server(tuple(bind), backlog=socket.SOMAXCONN)
        self.address = self.listener.getsockname()[:2]
        self._conns: dict[str, _Conn] = {}
        self.rejoin_open = False  # CREW: a worker may rejoin (its controller came back)
        self._idents: dict[str, dict] = {}
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._stalled: str | None = None  # set when this process was stopped for longer than silence_s
        self._iterations: list[dict] = []
        self._rows: list[list] = []
        self._errors: list[str] = []
        # probe: {"chunk_bytes", "chunk_num", "estimator", "from_iteration"}; truth(src, dst): the emulator's rate/delay now
        self.probe = dict(probe) if probe else None
        self.net = NetState(plan.nodes, (probe or {}).get("estimator", "busy"), truth)
        trains = (probe or {}).get("trains")  # (src, dst) -> (configured Mbit/s, datagrams per train, seconds apart)
        self._trains = {(s, d): (float(r), *train_shape(float(r), float(trains["duty"])))
                        for s, d, r in trains["links"]} if trains else {}
        self.net.train_every = {k: every for k, (_, _, every) in self._trains.items()}
        for n, off in (clock_offsets_ns or {}).items():  # measured beforehand (over ssh); CLOCK refines them
            self.net.offsets[n] = off
        self._clock_x: dict[str, list[tuple[int, int, int, int]]] = {}
        self.policy = policy
        self.sync_clocks = bool(probe) if sync_clocks is None else sync_clocks  # CLOCK exchanges before GO
        self._trains_open = False  # TRAIN reports are taken from the first probed iteration (as PROBE windows)
        self._plans: list[Plan] = [plan]  # index = version
        self.version = 0
        self.switches = 0
        self.resend_requests = 0  # receivers that asked for chunks again (auxiliary recovery)
        self.tasks = tasks  # CREW's run-time groups (agents.crew.TaskRun): {p, window_s, plan_for}

    def _resolve_addresses(self, addresses: Mapping, plan: Plan | None = None) -> dict[tuple[str, str], str]:
        out = {}
        plan = plan or self.plan
        pairs = {(src, op.peer) for src, op in plan.transfers()}
        if plan.aux.get("paths"):  # relays forward to whichever node a chunk's route names
            pairs |= {(a, b) for a in plan.nodes for b in plan.nodes if a != b}
        for src, dst in sorted(pairs):
            out[(src, dst)] = _address(addresses, src, dst)
        return out

    def _trains_report(self) -> dict:
        """The packet trains' shape per link, for results (``estimates.trains``)."""
        if not self._trains:
            return {}
        return {"trains": {"duty": self.probe["trains"]["duty"], "frame_bytes": TRAIN_FRAME, "links": {
            f"{src}>{dst}": {"packets": n, "every_s": every, "rate_mbps": rate}
            for (src, dst), (rate, n, every) in self._trains.items()}}}

    def _train_targets(self, node: str) -> list:
        """``node``'s packet trains (:mod:`agents.trains`): [peer, ip, port, packets, every_s]
        per WAN link it sends on, shaped for the link's configured rate and ``duty``."""
        return [[dst, _address(self._addresses, src, dst), self.data_port or int(self._idents[dst]["data_port"]),
                 n, every] for (src, dst), (_, n, every) in self._trains.items() if src == node]

    # -- registration ----------------------------------------------------------------
    def start(self) -> "Coordinator":
        threading.Thread(target=wire.serve, daemon=True, name="coord-accept",
                         args=(self.listener, wire.Gate(MAX_PENDING), self._handshake,
                               lambda: self._closed, log)).start()
        threading.Thread(target=self._ticker, daemon=True, name="coord-heartbeat").start()
        return self

    def __enter__(self) -> "Coordinator":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _handshake(self, sock: socket.socket, addr) -> None:
        who = f"{addr[0]}:{addr[1]}"
        name = None

        def check(ident: dict) -> None:
            nonlocal name
            if ident.get("role") != "agent" or ident.get("name") not in self.plan.nodes:
                raise wire.ProtocolError(f"unknown agent {wire.sanitize(ident.get('name'), 60)!r} "
                                         f"(expected one of {', '.join(self.plan.nodes[:8])})")
            with self._lock:
                if ident.get("rejoin"):  # CREW: a worker back after its controller was lost (agents.crew)
                    if self._closed or not self.rejoin_open or ident["name"] not in self._idents \
                            or ident["name"] in self._conns:
                        raise wire.ProtocolError(f"agent {ident['name']} cannot rejoin now")
                elif self._closed or ident["name"] in self._idents or ident["name"] == name:
                    raise wire.ProtocolError(f"agent {ident['name']} is already registered")
                name = ident["name"]

        try:
            wire.tune(sock)
            ident = wire.server_handshake(sock, self.secret, check, time.monotonic() + self.handshake_s)
            sock.settimeout(self.silence_s)
        except (wire.ProtocolError, wire.Closed, OSError) as e:
            log.warning("refused connection from %s: %s", who, wire.sanitize(e))
            wire.close_quietly(sock)
            return
        with self._lock:
            if self._closed or name in self._conns:
                wire.close_quietly(sock)
                return
            conn = self._conns[name] = _Conn(name, sock, who, self._events)
            self._idents.setdefault(name, ident)
        conn.put({"msg": "welcome", "heartbeat_s": self.heartbeat_s, "silence_s": self.silence_s,
                  "job_within_s": self.register_timeout_s + self.silence_s})
        log.info("agent %s registered from %s", name, who)
        self._events.put(("registered", name, None))
        threading.Thread(target=self._reader, args=(conn,), daemon=True, name=f"read-{name}").start()

    def _reader(self, conn: _Conn) -> None:
        name = conn.name
        try:
            while True:
                h, msg = wire.recv_json(conn.sock)
                if h.type == wire.ERROR:
                    msg = {"msg": "error", "message": wire.sanitize(msg.get("message", msg), 2000),
                           "stall": bool(msg.get("stall")), "status": msg.get("status"),
                           "peer": msg.get("peer") if msg.get("peer") in self.plan.nodes else None}
                kind = msg.get("msg")
                if kind == "clock":
                    self._clock_answer(name, msg, time.time_ns())
                elif kind == "train" and not self._trains_open:
                    pass  # clocks not synchronised yet, or a warm-up iteration's queues (TCP start-up)
                elif kind in ("probe", "train"):
                    try:
                        (self.net.add if kind == "probe" else self.net.add_train)({**msg, "dst": name})
                    except ValueError as e:
                        raise wire.ProtocolError(f"malformed {kind.upper()} report: {wire.sanitize(e)}") from None
                elif kind == "missing":
                    self._ask_resend(name, msg)
                elif kind != "alive":
                    self._events.put(("msg", name, msg))
        except socket.timeout:
            self._events.put(("silent", name, f"no heartbeat from the agent at {conn.addr} for {self.silence_s:g} s "
                                              "(stopped or unreachable)"))
        except wire.ProtocolError as e:
            log.error("protocol error from agent %s: %s", name, wire.sanitize(e))
            self._events.put(("lost", name, f"protocol error from the agent at {conn.addr}: {wire.sanitize(e)}"))
        except (wire.Closed, OSError) as e:
            self._events.put(("lost", name, f"agent at {conn.addr} disconnected ({type(e).__name__}: {e})"))
        except Exception as e:  # no thread dies silently
            self._events.put(("lost", name, f"reader failed: {type(e).__name__}: {wire.sanitize(e)}"))
        finally:
            wire.close_quietly(conn.sock)

    def _ask_resend(self, node: str, msg: dict) -> None:
        """``node`` misses transfers of an iteration (auxiliary recovery, :mod:`agents.executor`):
        ask each of their senders to send its kept copies again."""
        xfers, by_src = msg.get("xfers"), {}
        if not isinstance(xfers, list) or not isinstance(msg.get("iteration"), int):
            raise wire.ProtocolError(f"malformed MISSING report: {wire.sanitize(msg, 120)}")
        for row in xfers:
            if not (isinstance(row, list) and len(row) == 2 and self._xfers.get(row[1]) == (row[0], node)):
                raise wire.ProtocolError(f"MISSING names {wire.sanitize(row, 60)}, not a transfer to {node}")
            by_src.setdefault(row[0], []).append(row[1])
        self.resend_requests += 1
        for src, xs in by_src.items():
            with self._lock:
                conn = self._conns.get(src)
            if conn:
                conn.put({"msg": "resend", "version": msg.get("version"), "iteration": msg["iteration"], "xfers": xs})

    def _ticker(self) -> None:
        """Heartbeats to every agent; notices when this process itself was stopped (also
        before it got here: a process that took longer than the silence limit to start)."""
        last = time.monotonic()
        off_cpu = _off_cpu_since_start() if self.check_startup else 0.0
        if off_cpu > self.silence_s + 1:
            self._stalled = (f"the coordinator was held up {off_cpu:.1f} s while starting (stopped or starved): "
                             "its agents gave up on it")
        while not self._closed:
            time.sleep(self.heartbeat_s)
            now = time.monotonic()
            if now - last > self.silence_s:
                self._stalled = (f"the coordinator itself was stopped or starved for {now - last:.1f} s: "
                                 "its agents gave up on it")
                self._events.put(("self", "coordinator", self._stalled))
            last = now
            with self._lock:
                conns = list(self._conns.values())
            for c in conns:
                if c.q.empty():
                    c.put({"msg": "alive"})

    def agents(self) -> dict[str, dict]:
        """Registered agents: name -> identity (``data_port``, ``pid``, ``host``)."""
        with self._lock:
            return dict(self._idents)

    # -- waiting, with deadlines ---------------------------------------------------------
    def _send(self, name: str, obj: dict) -> None:
        self._conns[name].put(obj)

    def _next(self, deadline: float, gone: Iterable[str] = ()):
        """The next event before ``deadline`` (None if none within 0.2 s); fails on a health
        problem of a node not in ``gone`` (those that said BYE may exit), once the events
        before it are handled (an agent's last message may still be queued when its exit is
        seen)."""
        try:
            ev = self._events.get(timeout=max(0.0, min(0.2, deadline - time.monotonic())))
        except queue.Empty:
            ev = None
        problem = self.health() if self.health else None
        if problem and ev is None:
            node = problem.split(":", 1)[0]
            if node not in gone:
                self._diagnose(("lost", node if node in self.plan.nodes else None, problem))
        return ev

    def _collect(self, kind: str, nodes: list[str], limit_s: float, iteration: int | None = None) -> dict:
        """Wait for message ``kind`` from every node within ``limit_s``; fail on anything else."""
        got: dict[str, dict] = {}
        deadline = time.monotonic() + limit_s
        while len(got) < len(nodes):
            if time.monotonic() > deadline:
                missing = [n for n in nodes if n not in got]
                self._diagnose(("deadline", missing[0], f"no {kind.upper()} from {', '.join(missing)} within "
                                                        f"{limit_s:g} s"))
            ev = self._next(deadline, got if kind == "bye" else ())
            if ev is None:
                continue
            what, node, data = ev
            if what in ("lost", "silent") and kind == "bye" and node in got:
                continue  # an agent that said goodbye may close at once
            if what != "msg":
                if what == "registered":
                    continue
                self._diagnose(ev)
            m = data.get("msg")
            if m == "status":
                continue  # a late answer to an earlier question
            if m == "error":
                self._diagnose(ev)
            if m != kind:
                self._diagnose(("protocol", node, f"unexpected {wire.sanitize(m, 40)!r} message while waiting "
                                                  f"for {kind.upper()}" + (f" of iteration {iteration}"
                                                                           if iteration is not None else "")))
            if iteration is not None and data.get("iteration") != iteration:
                late = isinstance(data.get("iteration"), int) and data["iteration"] < iteration
                self._diagnose(("protocol", node, f"{'late' if late else 'unexpected'} {kind.upper()} for "
                                                  f"iteration {wire.sanitize(data.get('iteration'), 20)} "
                                                  f"(expected iteration {iteration})"))
            if node in got:
                self._diagnose(("protocol", node, f"duplicate {kind.upper()}" + (
                    f" for iteration {iteration}" if iteration is not None else "")))
            why = check_done(data, self._xfers, node) if kind == "done" else None
            if why:
                self._diagnose(("protocol", node, f"malformed DONE for iteration {iteration}: {why}"))
            got[node] = data
        return got

    def _wait_registered(self) -> None:
        deadline = time.monotonic() + self.register_timeout_s
        while True:
            with self._lock:
                missing = [n for n in self.plan.nodes if n not in self._idents]
            if not missing:
                self.progress(f"all {len(self.plan.nodes)} agents registered")
                return
            if time.monotonic() > deadline:
                self._diagnose(("deadline", missing[0], f"did not register within {self.register_timeout_s:g} s"
                                + (f" (nor did {', '.join(missing[1:])})" if missing[1:] else "")))
            ev = self._next(deadline)
            if ev and ev[0] != "registered" and not (ev[0] == "msg" and ev[2].get("msg") == "status"):
                self._diagnose(ev)

    # -- diagnosis -----------------------------------------------------------------------
    def _diagnose(self, first: tuple) -> None:
        """Ask every live agent for its status, gather what else goes wrong meanwhile, lay the
        failure to the node that stopped, and raise :class:`Failure`."""
        dead: dict[str, str] = {}  # node -> why it is gone (disconnected, silent, exited)
        errors: dict[str, dict] = {}
        statuses: dict[str, dict] = {}
        other: list[str] = []
        me = None

        def note(ev) -> None:
            nonlocal me
            what, node, data = ev
            if what == "self":
                me = data
            elif what in ("lost", "silent"):
                if node is None:
                    other.append(data)
                else:
                    dead.setdefault(node, data)
            elif what == "msg" and data.get("msg") == "status":
                statuses[node] = data
            elif what == "msg" and data.get("msg") == "error":
                errors.setdefault(node, data)
            elif what in ("protocol", "deadline"):
                other.append(f"{node}: {data}")
            elif what == "msg" and data.get("msg") not in ("ready", "done", "bye"):
                other.append(f"{node}: unexpected {wire.sanitize(data.get('msg'), 40)!r} message")

        note(first)
        with self._lock:
            ask = [n for n in self._conns if n not in dead]
        for n in ask:
            self._conns[n].put({"msg": "status"})
        start = time.monotonic()
        deadline = start + max(1.5, min(5.0, self.silence_s))
        while time.monotonic() < deadline and (any(n not in statuses and n not in dead for n in ask)
                                               or time.monotonic() < start + 2 * self.heartbeat_s):
            try:
                note(self._events.get(timeout=max(0.0, min(0.2, deadline - time.monotonic()))))
            except queue.Empty:
                pass
            problem = self.health() if self.health else None
            if problem:
                node = problem.split(":", 1)[0]
                note(("lost", node if node in self.plan.nodes else None, problem))
        unresponsive = [n for n in ask if n not in statuses and n not in dead]
        culprit, link, why = self._blame(first, me or self._stalled, dead, unresponsive, errors, statuses)
        lines = [f"{culprit}: {why}" if culprit else why]
        lines += [f"{n}: {e.get('message')}" for n, e in errors.items()]
        lines += [f"{n}: {d}" for n, d in dead.items() if n != culprit]
        lines += other
        raise Failure("; ".join(dict.fromkeys(lines)), culprit, link)

    def _blame(self, first, me, dead, unresponsive, errors, statuses):
        """(culprit, link, reason) — see :meth:`_diagnose`."""
        if me:
            return "coordinator", None, me
        if first[0] in ("lost", "silent") and first[1] in dead:
            return first[1], None, dead[first[1]]
        if dead:
            n = next(iter(dead))
            return n, None, dead[n]
        if unresponsive:
            n = unresponsive[0]
            return n, None, f"does not answer (no status within {max(1.5, min(5.0, self.silence_s)):g} s: " \
                            "stopped or unreachable)"
        stalled = first[0] == "deadline" or any(e.get("stall") for e in errors.values())
        if first[0] == "msg" and first[2].get("peer"):  # a peer sent it a bad frame
            peer = first[2]["peer"]
            return peer, (peer, first[1]), f"protocol violation on link {peer} -> {first[1]} (reported by {first[1]})"
        if first[0] == "msg" and not first[2].get("stall"):
            return first[1], None, first[2].get("message")
        if first[0] == "protocol":
            return first[1], None, first[2]
        if stalled:
            for dst, st in statuses.items():  # a payload stalled part-way: its sender stopped
                for src, rows in (st.get("awaiting") or {}).items():
                    for xfer, got, n in rows:
                        if 0 < got < n:
                            return src, (src, dst), (f"stalled mid-payload on link {src} -> {dst}: {dst} received "
                                                     f"{got} of {n} bytes of transfer {xfer}")
            waits = {n: set(st.get("awaiting") or ()) for n, st in statuses.items()}
            for n, st in statuses.items():
                for dst, rows in (st.get("sending") or {}).items():
                    if any(0 < sent < size for _, sent, size in rows):
                        return n, (n, dst), f"send to {dst} stalled part-way (link {n} -> {dst})"
            for n in dict.fromkeys(p for ps in waits.values() for p in ps):  # end of a chain of waits
                if not waits.get(n) and not (statuses.get(n) or {}).get("sending"):
                    who = sorted(a for a, ps in waits.items() if n in ps)
                    return n, (n, who[0]), f"sends nothing, while {', '.join(who)} wait(s) for its data"
        node = first[1]
        return node, None, first[2].get("message") if isinstance(first[2], dict) else first[2]

    # -- clocks ------------------------------------------------------------------------
    def _clock_answer(self, name: str, msg: dict, t4: int) -> None:
        t = [msg.get(k) for k in ("t1", "t2", "t3")]
        if all(isinstance(x, int) and not isinstance(x, bool) for x in t):
            with self._lock:
                self._clock_x.setdefault(name, []).append((*t, t4))

    def _sync_clocks(self, nodes: list[str]) -> None:
        """Estimate every agent's clock offset (NTP-style, over the control connection).  An
        agent that does not answer within ``CLOCK_WAIT_S`` keeps offset 0 (said in
        ``estimates.clocks``); it is not a failure (its heartbeats still are the judge)."""
        for r in range(CLOCK_ROUNDS):
            for n in nodes:
                self._send(n, {"msg": "clock", "seq": r, "t1": time.time_ns()})
            time.sleep(0.005)
        deadline = time.monotonic() + CLOCK_WAIT_S
        while time.monotonic() < deadline:
            with self._lock:
                if all(len(self._clock_x.get(n, ())) >= CLOCK_ROUNDS for n in nodes):
                    break
            ev = self._next(deadline)
            if ev is not None and not (ev[0] == "msg" and ev[2].get("msg") == "status"):
                self._diagnose(ev)
        with self._lock:
            got = {n: list(self._clock_x.get(n, ())) for n in nodes}
        for n, xs in got.items():
            if xs:
                self.net.set_offset(n, *clock_estimate(xs))
            else:
                self.net.clock[n] = {"offset_ms": None, "rtt_ms": None}
                self.progress(f"{n}: no answer to CLOCK: its clock is taken as the coordinator's")

    # -- versions ------------------------------------------------------------------------
    def _use(self, plan: Plan) -> bool:
        """Make ``plan`` the current one (installing it on the agents if new); True if the
        version changed."""
        known = next((v for v, p in enumerate(self._plans) if p is plan), None)
        new = known is None
        if new:
            plan.validate()
            old = self._plans[0]
            if (list(plan.nodes), plan.length, plan.contributing(), plan.finishing()) != \
                    (list(old.nodes), old.length, old.contributing(), old.finishing()):
                raise ConfigError(f"policy plan {plan.scheme!r} differs from the first in nodes, length, "
                                  "participants or receivers", key="policy")
            known = len(self._plans)
            self._plans.append(plan)
        if known == self.version:
            return False
        self.plan, self.version = self._plans[known], known
        self._peer_ip = self._resolve_addresses(self._addresses)
        self._xfers = {op.xfer: (src, op.peer) for src, op in self.plan.transfers()}
        if new:  # agents keep every version they installed
            for n in self.plan.nodes:
                program, peers, scratch = self._part(n)
                self._send(n, {"msg": "plan", "version": known, "program": [op.to_dict() for op in program],
                               "peers": {p: list(a) for p, a in peers.items()}, "scratch": scratch,
                               "aux": self._aux_part(n)})
            self._collect("installed", list(self.plan.nodes), self.ready_limit())
        return True

    def _part(self, node: str, plan: Plan | None = None) -> tuple[list, dict, dict]:
        """The program, peers (ip, data port) and scratch buffers of ``node`` in ``plan``
        (default: the current plan)."""
        plan = plan or self.plan
        ips = self._peer_ip if plan is self.plan else self._resolve_addresses(self._addresses, plan)
        program = plan.programs.get(node, [])
        peers = {}
        for src, dst in ips:
            if src == node and dst not in peers:
                port = self.data_port or int(self._idents.get(dst, {}).get("data_port") or 0)
                peers[dst] = (ips[(node, dst)], port)
        return program, peers, dict(plan.scratch.get(node, {}))

    def _aux_part(self, node: str) -> dict:
        """The current plan's auxiliary paths that ``node`` sends or relays on, and the bounds."""
        aux = self.plan.aux  # every node gets the bounds: a receiver asks for what it misses
        return {**aux, "paths": [p for p in aux["paths"] if node in p[:-1]]} if aux.get("paths") else {}

    # -- the run -----------------------------------------------------------------------
    def make_job(self, node: str) -> Job:
        plan = self.plan
        program, peers, scratch = self._part(node)
        return Job(name=node, nodes=list(plan.nodes), length=plan.length, participants=plan.contributing(),
                   receivers=plan.finishing(), program=program, peers=peers,
                   scratch=scratch, dtype=self.dtype, seed=self.seed,
                   iterations=self.iterations, compute_s=self.compute_s.get(node, []),
                   stop_and_wait=self.stop_and_wait, timeout_s=self.timeout_s,
                   mode="tasks" if self.tasks else "iterations",
                   wait_s=self._iteration_limit() + self.ready_limit() + self.silence_s, limit_s=self.limit_s,
                   probe=({"chunk_bytes": int(self.probe["chunk_bytes"]), "chunk_num": int(self.probe["chunk_num"]),
                           "from_iteration": int(self.probe.get("from_iteration", 0)),
                           "trains": self._train_targets(node)} if self.probe else None),
                   aux=self._aux_part(node))

    def ready_limit(self) -> float:
        """JOB to READY: peers connect (retrying while they start) and authenticate."""
        return self.timeout_s + 3 * self.handshake_s

    def _iteration_limit(self) -> float:
        compute = max((max(v) for v in self.compute_s.values() if v), default=0.0)
        return compute + self.limit_s + self.silence_s

    def results(self) -> dict:
        """What completed so far (complete after :meth:`run`)."""
        return {"scheme": self.plan.scheme, "nodes": list(self.plan.nodes), "length": self.plan.length,
                "dtype": self.dtype, "seed": self.seed, "stop_and_wait": self.stop_and_wait,
                "iterations": self._iterations, "transfers": {"columns": TRANSFER_COLUMNS, "rows": self._rows},
                "estimates": {**self.net.report(), **self._trains_report()}, "switches": self.switches,
                "resend_requests": self.resend_requests,
                "versions": [{"version": v, "scheme": p.scheme, "meta": p.meta} for v, p in enumerate(self._plans)],
                "errors": self._errors}

    def run(self) -> dict:
        """Run every iteration; return :meth:`results`.  Raises :class:`Failure` (a RunError
        naming the culprit, with ``results``: what completed)."""
        nodes = list(self.plan.nodes)
        try:
            self._wait_registered()
            for n in nodes:
                self._send(n, {"msg": "job", "job": self.make_job(n).to_dict()})
            self._collect("ready", nodes, self.ready_limit())
            self.progress(f"all {len(nodes)} agents ready")
            if self.sync_clocks:
                self._sync_clocks(nodes)
            if self.tasks:  # groups from a ready queue instead of iterations (agents.crew)
                from .crew import TaskRun
                self._task_run = TaskRun(self, self.tasks)
                return self._task_run.run()
            for it in range(self.iterations):
                self._trains_open = it >= int((self.probe or {}).get("from_iteration", 0))
                new = self.policy(it, self.net) if self.policy else None
                if new is not None and self._use(new):
                    self.switches += 1
                go_ns = time.time_ns()
                for n in nodes:
                    self._send(n, {"msg": "go", "iteration": it, "version": self.version})
                done = self._collect("done", nodes, self._iteration_limit(), iteration=it)
                routes = {x: path for d in done.values() for x, path in d.get("aux", ())}
                done = {n: self._on_my_clock(n, d, routes) for n, d in done.items()}
                result = {**self._summarise(it, go_ns, done, self._errors), "version": self.version}
                self._iterations.append(result)
                self._rows.extend(self._transfer_rows(it, done))
                self.progress(f"iteration {it + 1}/{self.iterations}: cct {result['cct_s']:.4f} s, "
                              f"{'correct' if result['correct'] else 'WRONG'}")
            for n in nodes:
                self._send(n, {"msg": "finish"})
            for n, bye in self._collect("bye", nodes, self.silence_s + 2).items():
                for e in bye.get("errors") or []:  # e.g. a late or duplicate frame after the last iteration
                    self._errors.append(f"{n}: after the last iteration: {wire.sanitize(e)}")
        except Failure as e:
            e.results = self._task_run.results() if getattr(self, "_task_run", None) else self.results()
            self._errors.append(str(e))
            self.abort(str(e))
            raise
        except BaseException as e:
            self.abort(f"coordinator failed: {e}")
            raise
        return self.results()

    def _on_my_clock(self, node: str, done: dict, routes: Mapping = MappingProxyType({})) -> dict:
        """``node``'s DONE with its timestamps moved from the agents' clocks to this machine's
        (a recv row's ``send_ts_ns`` is on the clock of the node that sent it the last hop --
        the sender, or the last relay of its ``routes`` entry -- the rest on ``node``'s)."""
        off = self.net.offsets
        if not off:
            return done
        me = off.get(node, 0)
        return {**done, **{k: done[k] - me for k in ("go_ns", "compute_end_ns", "comm_start_ns", "comm_done_ns")
                           if isinstance(done.get(k), int)},
                "sends": [[x, s - me, e - me] for x, s, e in done.get("sends", ())],
                "recvs": [[x, ts - off.get(routes[x][-2] if x in routes else self._xfers.get(x, (None,))[0], 0),
                           first - me, last - me, applied - me]
                          for x, ts, first, last, applied in done.get("recvs", ())]}

    def _summarise(self, it: int, go_ns: int, done: dict, errors: list) -> dict:
        receivers = self.plan.finishing()
        wrong = [n for n in receivers if not done[n].get("correct")]
        digests = {done[n].get("digest") for n in receivers}
        correct = not wrong and len(digests) <= 1
        if wrong:
            errors.append(f"iteration {it}: wrong result at {', '.join(wrong)}")
        elif not correct:
            errors.append(f"iteration {it}: receivers' results differ")
        starts = [done[n]["comm_start_ns"] for n in done]
        ends = [done[n]["comm_done_ns"] for n in done]
        return {"iteration": it, "go_ns": go_ns, "cct_s": (max(ends) - min(starts)) / 1e9,
                "iteration_s": (max(ends) - go_ns) / 1e9, "correct": correct,
                "workers": {n: {k: done[n].get(k) for k in WORKER_KEYS} for n in self.plan.nodes}}

    def _transfer_rows(self, it: int, done: dict) -> list[list]:
        elem = np.dtype(self.dtype).itemsize
        sent = {x[0]: x[1:] for d in done.values() for x in d.get("sends", ())}
        recv = {x[0]: x[1:] for d in done.values() for x in d.get("recvs", ())}
        routes = {x: ">".join(path) for d in done.values() for x, path in d.get("aux", ())}
        rows = []
        for src, op in sorted(self.plan.transfers(), key=lambda t: t[1].xfer):
            rows.append([it, op.xfer, src, op.peer, op.channel, op.flow, op.chunk, op.phase, op.length * elem,
                         *sent.get(op.xfer, (None, None)), *recv.get(op.xfer, (None,) * 4), routes.get(op.xfer, "")])
        return rows

    def drop_connections(self) -> None:
        """CREW's controller lost (agents.crew.TaskRun): every agent's control connection
        closed at once, as a dead controller's would be; rejoins refused until
        ``rejoin_open``."""
        with self._lock:
            conns = list(self._conns.values())
            self._conns.clear()
            self.rejoin_open = False
        for c in conns:
            c.close()

    def abort(self, reason: str) -> None:
        """Tell every connected agent to abort (best effort, within 1 s) and drop the connections."""
        with self._lock:
            conns = list(self._conns.values())
        for c in conns:
            c.put({"msg": "abort", "reason": reason}, wire.ERROR)
        deadline = time.monotonic() + 1.0
        for c in conns:
            c.close(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._conns.values())
        self.listener.close()
        for c in conns:
            c.close()



def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m agents.coordinator", description="Run a plan on agents.")
    ap.add_argument("--plan", required=True, help="plan JSON (testbed.plan.Plan.to_json)")
    ap.add_argument("--addresses", required=True, help="JSON: node -> IP, or node -> {peer: IP}")
    ap.add_argument("--secret-file", required=True)
    ap.add_argument("--port", type=int, required=True, help="control port to listen on")
    ap.add_argument("--bind", default="0.0.0.0")
    ap.add_argument("--data-port", type=int, default=0, help="agents' data port (0: as reported by each)")
    ap.add_argument("--out", required=True, help="results JSON")
    ap.add_argument("--iterations", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--compute", help="JSON: node -> list of per-iteration compute seconds")
    ap.add_argument("--stop-and-wait", action="store_true")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds without progress before failing")
    ap.add_argument("--register-timeout", type=float, default=None)
    ap.add_argument("--predicted", type=float, default=None, help="predicted seconds per iteration (bounds one)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s coordinator %(levelname)s %(message)s")

    def load(path):
        with open(path) as f:
            return json.load(f)

    from testbed.results import write_json_atomic

    failure = None
    try:
        with Coordinator(Plan.from_dict(load(args.plan)), addresses=load(args.addresses),
                         data_port=args.data_port, secret=wire.load_secret(args.secret_file),
                         iterations=args.iterations, seed=args.seed, dtype=args.dtype,
                         compute_s=load(args.compute) if args.compute else None,
                         stop_and_wait=args.stop_and_wait, timeout_s=args.timeout,
                         bind=(args.bind, args.port), register_timeout_s=args.register_timeout,
                         predicted_s=args.predicted, check_startup=True,
                         progress=lambda s: print(s, file=sys.stderr, flush=True)) as coord:
            try:
                results = coord.run()
            except Failure as e:  # keep what completed, with the failure
                failure, results = e, {**e.results, "failure": {"culprit": e.culprit, "link": e.link,
                                                                "message": str(e)}}
    except (RunError, ConfigError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 1)
    try:
        write_json_atomic(args.out, results)
    except OSError as e:
        print(f"error: cannot write the results to {args.out}: {e}", file=sys.stderr)
        return 1
    if failure:
        print(f"error: {failure}", file=sys.stderr)
        return 1
    ok = all(r["correct"] for r in results["iterations"]) and not results["errors"]
    for r in results["iterations"]:
        print(f"iteration {r['iteration']}: cct {r['cct_s']:.4f} s, iteration {r['iteration_s']:.4f} s, "
              f"{'correct' if r['correct'] else 'WRONG'}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
