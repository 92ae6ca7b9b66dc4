"""The control protocol between the coordinator and its agents, named in one place.

Control messages are JSON objects ``{"msg": KIND, field: value, ...}`` in CTRL frames (an
agent's error, and the coordinator's abort, in ERROR frames: :mod:`agents.wire`).  Every
kind is a member of :class:`Msg`; :data:`FIELDS` is the table of who sends it, its fields
and what it means.  :func:`message` builds one and refuses a field the table does not list.
``local`` kinds never go on the wire: an agent's threads post them to its own inbox.

The coordinator's threads report to its run loop through :data:`Event` objects (a message
received, an agent registered or lost, a deadline missed, a protocol violation); a failed
run is a :class:`FailureReport` (the node it is laid to, the stalled link, the reason).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple, Union


class Msg(str, Enum):
    """Every control-message kind (the value is what goes in the ``msg`` field)."""

    # registration and the iteration barrier
    WELCOME = "welcome"
    JOB = "job"
    READY = "ready"
    PLAN = "plan"
    INSTALLED = "installed"
    GO = "go"
    DONE = "done"
    FINISH = "finish"
    BYE = "bye"
    ABORT = "abort"
    ERROR = "error"
    ALIVE = "alive"
    STATUS = "status"
    # the closed loop and auxiliary recovery
    CLOCK = "clock"
    PROBE = "probe"
    TRAIN = "train"
    MISSING = "missing"
    RESEND = "resend"
    # CREW's groups (agents.crew)
    BEGIN = "begin"
    ENQUEUE = "enqueue"
    TASK = "task"
    ARMED = "armed"
    START = "start"
    TASK_DONE = "task_done"
    TASK_FAILED = "task_failed"
    ABANDON = "abandon"
    LINK_LOST = "link_lost"
    LINK_BACK = "link_back"
    PRE = "pre"
    PRE_ARMED = "pre_armed"
    PRE_GO = "pre_go"
    REJOIN = "rejoin"
    # local to an agent (never sent)
    CTRL_LOST = "_ctrl_lost"
    CTRL_BACK = "_ctrl_back"
    ROUND_DONE = "_round_done"

    def __str__(self) -> str:
        return self.value


class Kind(NamedTuple):
    direction: str  # "c>a" coordinator to agent, "a>c" agent to coordinator, "both", "local"
    fields: tuple[str, ...]
    meaning: str


TIMING = ("comm_start_ns", "comm_done_ns", "sends", "recvs", "aux", "withdrawn", "tcp")
CHECK = ("receiver", "correct", "max_abs_err", "digest")

FIELDS: dict[Msg, Kind] = {
    Msg.WELCOME: Kind("c>a", ("heartbeat_s", "silence_s", "job_within_s"),
                      "registered: heartbeat period, silence limit, deadline for the JOB"),
    Msg.JOB: Kind("c>a", ("job",), "the agent's part of the plan (agents.agent.Job.to_dict)"),
    Msg.READY: Kind("a>c", (), "data connections open, inputs made"),
    Msg.PLAN: Kind("c>a", ("version", "program", "peers", "scratch", "aux", "link_fifo"),
                   "install another plan version (its own executor and data connections)"),
    Msg.INSTALLED: Kind("a>c", ("version",), "that version's executor is ready"),
    Msg.GO: Kind("c>a", ("iteration", "version"), "run this iteration on this version"),
    Msg.DONE: Kind("a>c", ("iteration", "go_ns", "compute_end_ns") + TIMING + CHECK,
                   "an iteration's timings (agent clock) and its result check"),
    Msg.FINISH: Kind("c>a", (), "no more work: say BYE and exit"),
    Msg.BYE: Kind("a>c", ("errors",), "leaving; protocol violations seen after the last run"),
    Msg.ABORT: Kind("both", ("reason",), "stop now (ERROR frame from the coordinator; local in an agent)"),
    Msg.ERROR: Kind("a>c", ("message", "peer", "stall", "status"),
                    "the agent failed (ERROR frame): reason, the peer that sent a bad frame, a stall?, its status"),
    Msg.ALIVE: Kind("both", (), "heartbeat"),
    Msg.STATUS: Kind("both", ("iteration", "idle_s", "awaiting", "sending"),
                     "asked: what the executor awaits (agents.executor.Executor.status)"),
    Msg.CLOCK: Kind("both", ("seq", "t1", "t2", "t3"), "NTP-style exchange (t1 coordinator, t2/t3 agent clock)"),
    Msg.PROBE: Kind("a>c", ("src", "dst", "t_ns", "samples"), "a window of DATA chunks received (agents.probe)"),
    Msg.TRAIN: Kind("a>c", ("src", "rate_mbps", "send_ns", "recv_ns", "t_ns"), "a packet train received"),
    Msg.MISSING: Kind("a>c", ("version", "iteration", "xfers"), "ask for chunks again ([[src, xfer]])"),
    Msg.RESEND: Kind("c>a", ("version", "iteration", "xfers"), "send the kept copies of these transfers again"),
    Msg.BEGIN: Kind("c>a", ("controller_wait_s", "watch", "link_timeout_s"),
                    "the window T starts: compute; link heartbeats to ``watch`` {peer: [ip, port]}"),
    Msg.ENQUEUE: Kind("a>c", ("round",), "CREW's READY: this round's compute is done"),
    Msg.TASK: Kind("c>a", ("pid", "version", "rounds", "chunk_times", "pre"),
                   "arm task pid on this version; rounds: member -> its round; pre: early scatters"),
    Msg.ARMED: Kind("a>c", ("pid",), "executor at iteration pid, input set"),
    Msg.START: Kind("c>a", ("pid",), "run the armed task"),
    Msg.TASK_DONE: Kind("a>c", ("pid", "comm_start_ns", "comm_done_ns", "chunks", "early_sent", "withdrawn")
                        + CHECK, "a task's timings and result check"),
    Msg.TASK_FAILED: Kind("a>c", ("pid", "message"), "a task failed here"),
    Msg.ABANDON: Kind("c>a", ("pid", "version"), "stop this task; its version is not used again"),
    Msg.LINK_LOST: Kind("a>c", ("peer",), "heartbeats from this peer stopped"),
    Msg.LINK_BACK: Kind("a>c", ("peer",), "heartbeats from this peer again"),
    Msg.PRE: Kind("c>a", ("of", "version", "seq"), "arm for worker ``of``'s early scatter number seq"),
    Msg.PRE_ARMED: Kind("a>c", ("of", "seq", "round"), "armed for it"),
    Msg.PRE_GO: Kind("c>a", ("version", "seq", "round"), "send this round's default blocks now"),
    Msg.REJOIN: Kind("a>c", ("round", "pid", "running", "ready", "links_down", "reports"),
                     "first message to a restarted controller: the worker's state"),
    Msg.CTRL_LOST: Kind("local", ("why",), "the control connection is gone (CREW: go standalone)"),
    Msg.CTRL_BACK: Kind("local", ("sock",), "connected to the restarted controller"),
    Msg.ROUND_DONE: Kind("local", (), "a task of this worker's current round ended: compute the next"),
}


def message(kind: Msg, **fields) -> dict:
    """A control message of ``kind``; ValueError for a field :data:`FIELDS` does not list."""
    extra = set(fields) - set(FIELDS[kind].fields)
    if extra:
        raise ValueError(f"{kind.value.upper()} has no field {', '.join(sorted(extra))}")
    return {"msg": kind.value, **fields}


def kind_of(msg: dict) -> Msg | None:
    """The kind of a received message (None: not one of :class:`Msg`)."""
    try:
        return Msg(msg.get("msg"))
    except ValueError:
        return None


class Aborted(Exception):
    """The coordinator aborted the run (or its connection was lost): the agent exits 1."""


# -- the coordinator's events ----------------------------------------------------------------
@dataclass(frozen=True)
class Received:
    """A control message from agent ``node``."""

    node: str
    msg: dict

    @property
    def kind(self) -> Msg | None:
        return kind_of(self.msg)


@dataclass(frozen=True)
class Registered:
    """Agent ``node`` connected and authenticated."""

    node: str


@dataclass(frozen=True)
class Lost:
    """Agent ``node`` disconnected, went silent or exited (None: not a plan node)."""

    node: str | None
    why: str


@dataclass(frozen=True)
class Held:
    """The coordinator itself was stopped or starved for longer than the silence limit."""

    why: str
    node: str = "coordinator"


@dataclass(frozen=True)
class Deadline:
    """What ``node`` should have sent within a deadline did not come."""

    node: str | None
    why: str


@dataclass(frozen=True)
class Violation:
    """``node`` broke the protocol (an unexpected or malformed message)."""

    node: str | None
    why: str


Event = Union[Received, Registered, Lost, Held, Deadline, Violation]


def error_event(node: str, message_text: str) -> Received:
    """A failure laid to ``node`` as if it had reported an ERROR (not a stall)."""
    return Received(node, {"msg": Msg.ERROR.value, "message": message_text})


@dataclass(frozen=True)
class FailureReport:
    """Why a run failed: ``culprit`` the node (or "coordinator") it is laid to, ``link``
    (src, dst) the stalled link if one was found."""

    message: str
    culprit: str | None = None
    link: tuple[str, str] | None = None

    def to_dict(self) -> dict:
        return {"culprit": self.culprit, "link": self.link, "message": self.message}


# -- the coordinator's results: the transfers table -------------------------------------------
class Transfer(NamedTuple):
    """One row of ``results["transfers"]``: one chunk sent once.  ``send_ts_ns``: the sender's
    clock in the DATA header (the last hop's, for an auxiliary chunk); ``recv_start_ns`` /
    ``recv_end_ns``: first / last payload byte read at the receiver; ``apply_ns``: when the
    receiver added or copied it in; ``route``: "" direct, else the auxiliary path
    "src>relay>...>dst".  Times are on the coordinator's clock (None: not sent / received)."""

    iteration: int
    xfer: int
    src: str
    dst: str
    channel: int
    flow: int
    chunk: int
    phase: str
    bytes: int
    send_start_ns: int | None
    send_end_ns: int | None
    send_ts_ns: int | None
    recv_start_ns: int | None
    recv_end_ns: int | None
    apply_ns: int | None
    route: str = ""


TRANSFER_COLUMNS = list(Transfer._fields)


def transfer_rows(table: dict | None) -> list[Transfer]:
    """The rows of a results ``transfers`` table ({"columns", "rows"}; None or empty: [])."""
    if not table or not table.get("rows"):
        return []
    cols = list(table["columns"])
    if cols == TRANSFER_COLUMNS:
        return [Transfer._make(r) for r in table["rows"]]
    return [Transfer(**{c: v for c, v in zip(cols, r) if c in Transfer._fields}) for r in table["rows"]]
