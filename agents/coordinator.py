"""Coordinator: distributes a plan to the agents, runs the iterations, collects results.

Library use::

    c = Coordinator(plan, addresses={"h1": "10.0.0.1", ...}, data_port=7100, secret=b"...")
    c.start()            # accept agent registrations (c.address is the bound (host, port))
    ...start one agent per plan node...
    results = c.run()    # raises testbed.errors.RunError on any failure
    c.close()

A run-time driver (``driver=``: CREW's groups, :class:`agents.crew_run.TaskRun`) runs instead
of the iterations once every agent is READY, and uses only the driver API: ``send``,
``next_event`` / ``collect`` (events: :mod:`agents.protocol`), ``diagnose`` (raises
:class:`Failure`), ``health_problem``, ``plan_message``, ``data_addresses``, ``to_my_clock``,
``note_error``, ``drop_connections`` and the limits ``ready_limit()``, ``limit_s``,
``silence_s``.

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
import traceback
from types import MappingProxyType
from typing import Callable, Collection, Iterable, Mapping, NoReturn, Protocol

import numpy as np

from testbed.clock import estimate as clock_estimate
from testbed.errors import ConfigError, RunError, TestbedError
from testbed.plan import Plan
from testbed.results import tcp_total

from . import wire
from .agent import Job
from .executor import SUBBLOCK_BYTES, check_links, links_for
from .netstate import NetState
from .protocol import (
    TRANSFER_COLUMNS,
    Deadline,
    Event,
    FailureReport,
    Held,
    Lost,
    Msg,
    Received,
    Registered,
    Violation,
    message,
)
from .trains import FRAME as TRAIN_FRAME
from .trains import shape as train_shape

log = logging.getLogger("agents.coordinator")

WORKER_KEYS = ["go_ns", "compute_end_ns", "comm_start_ns", "comm_done_ns", "receiver", "correct", "max_abs_err",
               "digest"]
MAX_PENDING = 64  # unauthenticated connections at once; more are refused
CLOCK_ROUNDS = 8  # NTP-style exchanges per agent; the least delayed one counts
CLOCK_WAIT_S = 2.0  # longest wait for the answers
INT, NUM = "an integer", "a number"
DONE_FIELDS = {"iteration": INT, "go_ns": INT, "compute_end_ns": INT, "comm_start_ns": INT, "comm_done_ns": INT,
               "receiver": bool, "correct": bool, "max_abs_err": NUM, "digest": (str, type(None)),
               "sends": list, "recvs": list}


def tcp_note(tcp: Mapping[str, list]) -> str:
    """What TCP's loss recovery cost an iteration (its ``tcp`` record), for a progress line."""
    segs, rtos, rto_s = tcp_total(tcp.values()).values()
    return (f"; TCP retransmitted {segs} segments, {rtos} timeout{'s' * (rtos != 1)} ({rto_s:.2f} s in their "
            "recovery)") if segs else ""


def check_done(msg: dict, transfers: dict[int, tuple[str, str]], node: str, peers: Collection[str]) -> str | None:
    """Why a DONE message is malformed (missing or mistyped field, a timing row of a transfer
    that is not this node's, a TCP row of a node not in the plan), or None."""
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
    for row in msg.get("tcp", []) if isinstance(msg.get("tcp", []), list) else [None]:
        if not (isinstance(row, list) and len(row) == 4 and isinstance(row[0], str) and row[0] in peers
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in row[1:])):
            return f"bad tcp row {wire.sanitize(row, 80)} (expected [a peer, three counts >= 0])"
    return None


def _address(addresses: Mapping, src: str, dst: str) -> str:
    """``dst``'s address as seen from ``src``: ``addresses`` maps src -> {dst: ip} or dst -> ip."""
    view = addresses.get(src) if isinstance(addresses.get(src), Mapping) else addresses
    ip = view.get(dst) if view is not None else None
    if not isinstance(ip, str) or not ip:
        raise ConfigError(f"no address for {dst} as seen from {src}", key="addresses")
    return ip


class Failure(RunError):
    """A failed run: its :class:`~agents.protocol.FailureReport` (``culprit``: the node, or
    "coordinator", the failure is laid to; ``link``: (src, dst), the stalled link if one was
    found) and ``results``, what completed (None until :meth:`Coordinator.run` adds them)."""

    def __init__(self, report: FailureReport, results: dict | None = None):
        super().__init__(report.message)
        self.report, self.results = report, results

    @property
    def culprit(self) -> str | None:
        return self.report.culprit

    @property
    def link(self) -> tuple[str, str] | None:
        return self.report.link


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
            self.events.put(Lost(self.name, f"cannot send {kind.upper()} to the agent at {self.addr}: no "
                                 f"byte accepted for {self.sock.gettimeout():g} s (stopped or unreachable)"))
        except Exception as e:  # no thread dies silently
            self.events.put(Lost(self.name, f"cannot send {kind.upper()} to the agent at {self.addr}: "
                                 f"{type(e).__name__}: {e}"))

    def close(self, grace_s: float = 0.0) -> None:
        self.q.put(None)
        self.thread.join(grace_s)
        wire.close_quietly(self.sock)



class _Diagnosis:
    """What :meth:`Coordinator.diagnose` gathers while it asks every agent for its status."""

    def __init__(self):
        self.dead: dict[str, str] = {}  # node -> why it is gone (disconnected, silent, exited)
        self.errors: dict[str, dict] = {}
        self.statuses: dict[str, dict] = {}
        self.other: list[str] = []
        self.me: str | None = None  # the coordinator itself was held up

    def note(self, ev: Event) -> None:
        if isinstance(ev, Held):
            self.me = ev.why
        elif isinstance(ev, Lost):
            if ev.node is None:
                self.other.append(ev.why)
            else:
                self.dead.setdefault(ev.node, ev.why)
        elif isinstance(ev, (Violation, Deadline)):
            self.other.append(f"{ev.node}: {ev.why}")
        elif isinstance(ev, Received) and ev.kind == Msg.STATUS:
            self.statuses[ev.node] = ev.msg
        elif isinstance(ev, Received) and ev.kind == Msg.ERROR:
            self.errors.setdefault(ev.node, ev.msg)
        elif isinstance(ev, Received) and ev.kind not in (Msg.READY, Msg.DONE, Msg.BYE, Msg.LINK_LOST, Msg.LINK_BACK):
            self.other.append(f"{ev.node}: unexpected {wire.sanitize(ev.msg.get('msg'), 40)!r} message")


def _stalled_link(statuses: dict[str, dict]) -> tuple[str, tuple[str, str], str] | None:
    """(culprit, link, reason) from the agents' STATUS answers after a stall: the sender of a
    payload stalled part-way, a send stalled part-way, else the end of a chain of waits."""
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
    return None


class Driver(Protocol):
    """A run-time driver: what runs once every agent is READY, instead of the iterations."""

    mode: str  # the JOB's mode: the worker loop the agents run (agents.agent.WORKER_LOOPS)

    def run(self) -> None:
        """Drive the run to its end (FINISH and BYE included); raise :class:`Failure`."""

    def results(self) -> dict:
        """The driver's part of :meth:`Coordinator.results` (what completed so far)."""


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
    ``truth`` and ``policy``: the closed loop (module docstring).  ``driver(coordinator)``:
    a :class:`Driver` that runs instead of the iteration barrier once every agent is READY
    (CREW's groups: :class:`agents.crew_run.TaskRun`), on the driver API below.
    ``on_ready()``: called once every agent is READY (and clocks are synchronised), just
    before the first GO or the driver: where the measured phase starts.
    """

    def __init__(self, plan: Plan, *, addresses: Mapping, data_port: int | None, secret: bytes | str,
                 iterations: int = 1, seed: int = 0, dtype: str = "float32",
                 compute_s: Mapping[str, list[float] | float] | None = None, stop_and_wait: bool = False,
                 subblock_bytes: int | None = None, links: str = "channel", timeout_s: float = 60.0, bind: tuple[str, int] = ("0.0.0.0", 0),
                 progress: Callable[[str], None] | None = None, register_timeout_s: float | None = None,
                 health: Callable[[], str | None] | None = None, predicted_s: float | None = None,
                 handshake_s: float = wire.HANDSHAKE_TIMEOUT_S, check_startup: bool = False,
                 clock_offsets_ns: Mapping[str, int] | None = None, probe: dict | None = None,
                 truth: Callable[[str, str], dict | None] | None = None,
                 policy: Callable[[int, NetState], Plan | None] | None = None, sync_clocks: bool | None = None,
                 driver: Callable[["Coordinator"], "Driver"] | None = None,
                 on_ready: Callable[[], None] | None = None):
        plan.validate()
        np.dtype(dtype)
        self.plan, self.secret, self.data_port = plan, wire.as_secret(secret), data_port
        self.iterations, self.seed, self.dtype = int(iterations), int(seed), dtype
        self.stop_and_wait, self.timeout_s = bool(stop_and_wait), float(timeout_s)
        self.subblock_bytes, self.links = int(subblock_bytes or SUBBLOCK_BYTES), check_links(links)
        self.register_timeout_s = float(register_timeout_s or timeout_s)
        self.compute_s = {n: ([float(v)] if isinstance(v, (int, float)) else [float(x) for x in v])
                          for n, v in (compute_s or {}).items()}
        self.progress, self.health = progress or (lambda s: None), health
        self.handshake_s = float(handshake_s)
        self.check_startup = check_startup  # a process of its own: was it held up before it got going?
        self.silence_s = max(1.5, self.timeout_s / 2)
        self.heartbeat_s = min(1.0, self.silence_s / 6)
        # communication of one iteration: the stall limit plus a margin over the prediction
        self.limit_s = self.timeout_s + 4 * predicted_s if predicted_s else 10 * self.timeout_s
        self._addresses = addresses
        self._peer_ip, self._ips_of = self._resolve_addresses(addresses), (None, {})  # _ips_of: _part's other plan
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
        self._init_closed_loop(probe, truth, clock_offsets_ns, policy, sync_clocks)
        self._plans: list[Plan] = [plan]  # index = version
        self.version = 0
        self.switches = 0
        self.resend_requests = 0  # receivers that asked for chunks again (auxiliary recovery)
        self.on_ready = on_ready
        self.driver = driver(self) if driver else None  # built last: it may read any of the above

    def _init_closed_loop(self, probe: dict | None, truth, clock_offsets_ns: Mapping[str, int] | None, policy,
                          sync_clocks: bool | None) -> None:
        """Probing, packet trains, clock offsets and the re-planning policy (module docstring)."""
        # probe: {"chunk_bytes", "chunk_num", "estimator", "from_iteration"}; truth(src, dst): the emulator's rate/delay now
        self.probe = dict(probe) if probe else None
        self.net = NetState(self.plan.nodes, (probe or {}).get("estimator", "busy"), truth)
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
        conn.put(message(Msg.WELCOME, heartbeat_s=self.heartbeat_s, silence_s=self.silence_s,
                         job_within_s=self.register_timeout_s + self.silence_s))
        log.info("agent %s registered from %s", name, who)
        self._events.put(Registered(name))
        threading.Thread(target=self._reader, args=(conn,), daemon=True, name=f"read-{name}").start()

    def _reader(self, conn: _Conn) -> None:
        name = conn.name
        try:
            while True:
                h, msg = wire.recv_json(conn.sock)
                if h.type == wire.ERROR:
                    msg = message(Msg.ERROR, message=wire.sanitize(msg.get("message", msg), 2000),
                                  stall=bool(msg.get("stall")), status=msg.get("status"),
                                  peer=msg.get("peer") if msg.get("peer") in self.plan.nodes else None)
                kind = msg.get("msg")
                if kind == Msg.CLOCK:
                    self._clock_answer(name, msg, time.time_ns())
                elif kind == Msg.TRAIN and not self._trains_open:
                    pass  # clocks not synchronised yet, or a warm-up iteration's queues (TCP start-up)
                elif kind in (Msg.PROBE, Msg.TRAIN):
                    try:
                        (self.net.add if kind == Msg.PROBE else self.net.add_train)({**msg, "dst": name})
                    except ValueError as e:
                        raise wire.ProtocolError(f"malformed {kind.upper()} report: {wire.sanitize(e)}") from None
                elif kind == Msg.MISSING:
                    self._ask_resend(name, msg)
                elif kind != Msg.ALIVE:
                    self._events.put(Received(name, msg))
        except socket.timeout:
            self._events.put(Lost(name, f"no heartbeat from the agent at {conn.addr} for {self.silence_s:g} s "
                                        "(stopped or unreachable)"))
        except wire.ProtocolError as e:
            log.error("protocol error from agent %s: %s", name, wire.sanitize(e))
            self._events.put(Lost(name, f"protocol error from the agent at {conn.addr}: {wire.sanitize(e)}"))
        except (wire.Closed, OSError) as e:
            self._events.put(Lost(name, f"agent at {conn.addr} disconnected ({type(e).__name__}: {e})"))
        except Exception as e:  # no thread dies silently
            self._events.put(Lost(name, f"reader failed: {type(e).__name__}: {wire.sanitize(e)}"))
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
                conn.put(message(Msg.RESEND, version=msg.get("version"), iteration=msg["iteration"], xfers=xs))

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
                self._events.put(Held(self._stalled))
            last = now
            with self._lock:
                conns = list(self._conns.values())
            for c in conns:
                if c.q.empty():
                    c.put(message(Msg.ALIVE))

    def agents(self) -> dict[str, dict]:
        """Registered agents: name -> identity (``data_port``, ``pid``, ``host``)."""
        with self._lock:
            return dict(self._idents)

    # -- the driver API: what a run-time driver (the iteration loop, agents.crew_run) uses ------
    def send(self, node: str, msg: dict) -> None:
        """Queue control message ``msg`` (:func:`agents.protocol.message`) to ``node``'s agent."""
        self._conns[node].put(msg)

    def next_event(self, deadline: float) -> Event | None:
        """The next event from the agents' threads before ``deadline`` (None if none within 0.2 s)."""
        try:
            return self._events.get(timeout=max(0.0, min(0.2, deadline - time.monotonic())))
        except queue.Empty:
            return None

    def pending_events(self) -> list[Event]:
        """Every event already queued (without waiting)."""
        out = []
        while True:
            try:
                out.append(self._events.get_nowait())
            except queue.Empty:
                return out

    def requeue(self, events) -> None:
        """Give back events taken with :meth:`pending_events` (after those queued since)."""
        for ev in events:
            self._events.put(ev)

    def health_problem(self) -> str | None:
        """Why a run cannot go on (``"NODE: why"``, e.g. an agent process exited), or None."""
        return self.health() if self.health else None

    def note_error(self, text: str) -> None:
        """Record an error of the run (results ``errors``; a wrong result, a late frame)."""
        self._errors.append(text)

    def data_addresses(self, src: str) -> dict[str, tuple[str, int]]:
        """The node map as ``src`` sees it: every other node's (address, data port) that is known."""
        view = self._addresses.get(src) if isinstance(self._addresses.get(src), Mapping) else self._addresses
        out = {}
        for d in self.plan.nodes:
            port = self.data_port_of(d)
            if d != src and isinstance(view.get(d), str) and port:
                out[d] = (view[d], port)
        return out

    def data_port_of(self, node: str) -> int:
        """``node``'s data port (the configured one, else the one its agent reported; 0: unknown)."""
        return self.data_port or int(self._idents.get(node, {}).get("data_port") or 0)

    def plan_message(self, node: str, version: int, plan: Plan, **extra) -> dict:
        """The PLAN installing ``plan`` as ``version`` on ``node`` (its program, peers, scratch)."""
        program, peers, scratch = self._part(node, plan)
        return message(Msg.PLAN, version=version, program=[op.to_dict() for op in program],
                       peers={p: list(a) for p, a in peers.items()}, scratch=scratch, **extra)

    def _next(self, deadline: float, gone: Iterable[str] = ()) -> Event | None:
        """The next event before ``deadline`` (None if none within 0.2 s); fails on a health
        problem of a node not in ``gone`` (those that said BYE may exit), once the events
        before it are handled (an agent's last message may still be queued when its exit is
        seen)."""
        ev = self.next_event(deadline)
        problem = self.health_problem()
        if problem and ev is None:
            node = problem.split(":", 1)[0]
            if node not in gone:
                self.diagnose(Lost(node if node in self.plan.nodes else None, problem))
        return ev

    def collect(self, kind: Msg, nodes: list[str], limit_s: float, iteration: int | None = None) -> dict:
        """Wait for message ``kind`` from every node within ``limit_s``; fail on anything else."""
        got: dict[str, dict] = {}
        deadline = time.monotonic() + limit_s
        what = kind.upper() + (f" of iteration {iteration}" if iteration is not None else "")
        while len(got) < len(nodes):
            if time.monotonic() > deadline:
                missing = [n for n in nodes if n not in got]
                self.diagnose(Deadline(missing[0], f"no {kind.upper()} from {', '.join(missing)} within "
                                                   f"{limit_s:g} s"))
            ev = self._next(deadline, got if kind == Msg.BYE else ())
            if ev is None or isinstance(ev, Registered):
                continue
            if isinstance(ev, Lost) and kind == Msg.BYE and ev.node in got:
                continue  # an agent that said goodbye may close at once
            if not isinstance(ev, Received) or ev.kind == Msg.ERROR:
                self.diagnose(ev)
            if ev.kind == Msg.STATUS:
                continue  # a late answer to an earlier question
            why = self._unexpected(ev, kind, what, iteration, got)
            if why:
                self.diagnose(Violation(ev.node, why))
            got[ev.node] = ev.msg
        return got

    def _unexpected(self, ev: Received, kind: Msg, what: str, iteration: int | None, got: dict) -> str | None:
        """Why ``ev`` is not the next ``kind`` :meth:`collect` waits for, or None."""
        data = ev.msg
        if ev.kind != kind:
            return f"unexpected {wire.sanitize(data.get('msg'), 40)!r} message while waiting for {what}"
        if iteration is not None and data.get("iteration") != iteration:
            late = isinstance(data.get("iteration"), int) and data["iteration"] < iteration
            return (f"{'late' if late else 'unexpected'} {kind.upper()} for iteration "
                    f"{wire.sanitize(data.get('iteration'), 20)} (expected iteration {iteration})")
        if ev.node in got:
            return f"duplicate {kind.upper()}" + (f" for iteration {iteration}" if iteration is not None else "")
        why = check_done(data, self._xfers, ev.node, self.plan.nodes) if kind == Msg.DONE else None
        return f"malformed DONE for iteration {iteration}: {why}" if why else None

    def _wait_registered(self) -> None:
        deadline = time.monotonic() + self.register_timeout_s
        while True:
            with self._lock:
                missing = [n for n in self.plan.nodes if n not in self._idents]
            if not missing:
                self.progress(f"all {len(self.plan.nodes)} agents registered")
                return
            if time.monotonic() > deadline:
                self.diagnose(Deadline(missing[0], f"did not register within {self.register_timeout_s:g} s"
                                       + (f" (nor did {', '.join(missing[1:])})" if missing[1:] else "")))
            ev = self._next(deadline)
            if ev and not isinstance(ev, Registered) and not (isinstance(ev, Received) and ev.kind == Msg.STATUS):
                self.diagnose(ev)

    # -- diagnosis -----------------------------------------------------------------------
    def diagnose(self, first: Event) -> NoReturn:
        """Ask every live agent for its status, gather what else goes wrong meanwhile, lay the
        failure to the node that stopped, and raise :class:`Failure`."""
        seen = _Diagnosis()
        seen.note(first)
        with self._lock:
            ask = [n for n in self._conns if n not in seen.dead]
        for n in ask:
            self._conns[n].put(message(Msg.STATUS))
        start = time.monotonic()
        deadline = start + max(1.5, min(5.0, self.silence_s))
        while time.monotonic() < deadline and (any(n not in seen.statuses and n not in seen.dead for n in ask)
                                               or time.monotonic() < start + 2 * self.heartbeat_s):
            ev = self.next_event(deadline)
            if ev is not None:
                seen.note(ev)
            problem = self.health_problem()
            if problem:
                node = problem.split(":", 1)[0]
                seen.note(Lost(node if node in self.plan.nodes else None, problem))
        unresponsive = [n for n in ask if n not in seen.statuses and n not in seen.dead]
        culprit, link, why = self._blame(first, seen.me or self._stalled, seen, unresponsive)
        lines = [f"{culprit}: {why}" if culprit else why]
        lines += [f"{n}: {e.get('message')}" for n, e in seen.errors.items()]
        lines += [f"{n}: {d}" for n, d in seen.dead.items() if n != culprit]
        lines += seen.other
        raise Failure(FailureReport("; ".join(dict.fromkeys(lines)), culprit, link))

    def _blame(self, first: Event, me: str | None, seen: "_Diagnosis", unresponsive: list[str]):
        """(culprit, link, reason) — see :meth:`diagnose`."""
        dead = seen.dead
        if me:
            return "coordinator", None, me
        if isinstance(first, Lost) and first.node in dead:
            return first.node, None, dead[first.node]
        if dead:
            n = next(iter(dead))
            return n, None, dead[n]
        if unresponsive:
            n = unresponsive[0]
            return n, None, f"does not answer (no status within {max(1.5, min(5.0, self.silence_s)):g} s: " \
                            "stopped or unreachable)"
        if isinstance(first, Received):
            if first.msg.get("peer"):  # a peer sent it a bad frame
                peer = first.msg["peer"]
                return peer, (peer, first.node), \
                    f"protocol violation on link {peer} -> {first.node} (reported by {first.node})"
            if not first.msg.get("stall"):
                return first.node, None, first.msg.get("message")
        if isinstance(first, Violation):
            return first.node, None, first.why
        stalled = isinstance(first, Deadline) or any(e.get("stall") for e in seen.errors.values())
        found = _stalled_link(seen.statuses) if stalled else None
        if found:
            return found
        if isinstance(first, Received):
            return first.node, None, first.msg.get("message")
        return first.node, None, first.why

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
                self.send(n, message(Msg.CLOCK, seq=r, t1=time.time_ns()))
            time.sleep(0.005)
        deadline = time.monotonic() + CLOCK_WAIT_S
        while time.monotonic() < deadline:
            with self._lock:
                if all(len(self._clock_x.get(n, ())) >= CLOCK_ROUNDS for n in nodes):
                    break
            ev = self._next(deadline)
            if ev is not None and not isinstance(ev, Registered) and not (isinstance(ev, Received)
                                                                          and ev.kind == Msg.STATUS):
                self.diagnose(ev)
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
                self.send(n, self.plan_message(n, known, self.plan, aux=self._aux_part(n)))
            self.collect(Msg.INSTALLED, list(self.plan.nodes), self.ready_limit())
        return True

    def _part(self, node: str, plan: Plan | None = None) -> tuple[list, dict, dict]:
        """The program, peers (ip, data port) and scratch buffers of ``node`` in ``plan``
        (default: the current plan)."""
        plan = plan or self.plan
        if plan is not self.plan and self._ips_of[0] is not plan:  # (asked once per node of a new version)
            self._ips_of = (plan, self._resolve_addresses(self._addresses, plan))
        ips = self._peer_ip if plan is self.plan else self._ips_of[1]
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
                   stop_and_wait=self.stop_and_wait, subblock_bytes=self.subblock_bytes, links=self.links_used(),
                   timeout_s=self.timeout_s,
                   mode=self.driver.mode if self.driver else "iterations",
                   wait_s=self._iteration_limit() + self.ready_limit() + self.silence_s, limit_s=self.limit_s,
                   probe=({"chunk_bytes": int(self.probe["chunk_bytes"]), "chunk_num": int(self.probe["chunk_num"]),
                           "from_iteration": int(self.probe.get("from_iteration", 0)),
                           "trains": self._train_targets(node)} if self.probe else None),
                   aux=self._aux_part(node))

    def links_used(self) -> str:
        """The agents' data connections (:func:`agents.executor.links_for`)."""
        return links_for(self.links, self.plan, stop_and_wait=self.stop_and_wait, probing=bool(self.probe),
                         versions=bool(self.driver or self.policy))

    def ready_limit(self) -> float:
        """JOB to READY: peers connect (retrying while they start) and authenticate."""
        return self.timeout_s + 3 * self.handshake_s

    def _iteration_limit(self) -> float:
        compute = max((max(v) for v in self.compute_s.values() if v), default=0.0)
        return compute + self.limit_s + self.silence_s

    def results(self) -> dict:
        """What completed so far (complete after :meth:`run`)."""
        out = {"scheme": self.plan.scheme, "nodes": list(self.plan.nodes), "length": self.plan.length,
               "dtype": self.dtype, "seed": self.seed, "stop_and_wait": self.stop_and_wait, "connections": self.links_used(),
               "iterations": self._iterations, "transfers": {"columns": TRANSFER_COLUMNS, "rows": self._rows},
               "estimates": {**self.net.report(), **self._trains_report()}, "switches": self.switches,
               "resend_requests": self.resend_requests,
               "versions": [{"version": v, "scheme": p.scheme, "meta": p.meta} for v, p in enumerate(self._plans)],
               "errors": self._errors}
        return {**out, **self.driver.results()} if self.driver else out

    def run(self) -> dict:
        """Run every iteration (or the driver's run); return :meth:`results`.  Raises
        :class:`Failure` (a RunError naming the culprit, with ``results``: what completed)."""
        nodes = list(self.plan.nodes)
        try:
            self._wait_registered()
            for n in nodes:
                self.send(n, message(Msg.JOB, job=self.make_job(n).to_dict()))
            self.collect(Msg.READY, nodes, self.ready_limit())
            self.progress(f"all {len(nodes)} agents ready")
            if self.sync_clocks:
                self._sync_clocks(nodes)
            if self.on_ready:
                self.on_ready()
            if self.driver:
                self._run_driver()
            else:
                self._run_iterations(nodes)
        except Failure as e:
            self._errors.append(str(e))
            self.abort(str(e))
            raise Failure(e.report, self.results()) from None
        except BaseException as e:
            self.abort(f"coordinator failed: {e}")
            raise
        return self.results()

    def _run_driver(self) -> None:
        """The driver's run; an exception of its own (its state broke: a bug, not a failure
        of the network or the agents) fails the run, laid to the coordinator, with where."""
        try:
            self.driver.run()
        except TestbedError:
            raise
        except Exception as e:
            at = traceback.extract_tb(e.__traceback__)[-1]
            raise Failure(FailureReport(f"coordinator: {type(self.driver).__name__} failed: {type(e).__name__}: {e} "
                                        f"(in {at.name}, {os.path.basename(at.filename)}:{at.lineno})",
                                        "coordinator")) from e

    def _run_iterations(self, nodes: list[str]) -> None:
        """The iteration barrier: per iteration (switching versions as ``policy`` says) GO to
        every agent and DONE from each; then FINISH and BYE."""
        for it in range(self.iterations):
            self._trains_open = it >= int((self.probe or {}).get("from_iteration", 0))
            new = self.policy(it, self.net) if self.policy else None
            if new is not None and self._use(new):
                self.switches += 1
            go_ns = time.time_ns()
            for n in nodes:
                self.send(n, message(Msg.GO, iteration=it, version=self.version))
            done = self.collect(Msg.DONE, nodes, self._iteration_limit(), iteration=it)
            routes = {x: path for d in done.values() for x, path in d.get("aux", ())}
            done = {n: self.to_my_clock(n, d, routes) for n, d in done.items()}
            result = {**self._summarise(it, go_ns, done, self._errors), "version": self.version}
            self._iterations.append(result)
            self._rows.extend(self._transfer_rows(it, done))
            self.progress(f"iteration {it + 1}/{self.iterations}: cct {result['cct_s']:.4f} s, "
                          f"{'correct' if result['correct'] else 'WRONG'}{tcp_note(result.get('tcp', {}))}")
        for n in nodes:
            self.send(n, message(Msg.FINISH))
        for n, bye in self.collect(Msg.BYE, nodes, self.silence_s + 2).items():
            for e in bye.get("errors") or []:  # e.g. a late or duplicate frame after the last iteration
                self._errors.append(f"{n}: after the last iteration: {wire.sanitize(e)}")

    def to_my_clock(self, node: str, done: dict, routes: Mapping = MappingProxyType({})) -> dict:
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
        # what TCP's loss recovery cost each link direction (counted where every agent's kernel counts it)
        tcp = {f"{n}->{peer}": [segs, rtos, ms / 1e3]
               for n in sorted(done) for peer, segs, rtos, ms in done[n].get("tcp", ())}
        return {"iteration": it, "go_ns": go_ns, "cct_s": (max(ends) - min(starts)) / 1e9,
                "iteration_s": (max(ends) - go_ns) / 1e9, "correct": correct,
                "workers": {n: {k: done[n].get(k) for k in WORKER_KEYS} for n in self.plan.nodes},
                **({"tcp": tcp} if all("tcp" in d for d in done.values()) else {})}

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
            c.put(message(Msg.ABORT, reason=reason), wire.ERROR)
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



def _parser() -> argparse.ArgumentParser:
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
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
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
                failure, results = e, {**e.results, "failure": e.report.to_dict()}
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
