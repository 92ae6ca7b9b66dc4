"""Runs one node's program (a list of :class:`testbed.plan.Op`) over sockets.

How bytes flow (threads):

* one receiver per incoming connection: reads a header, matches ``xfer`` against the recv
  ops expected on that ``(peer, channel)``, and ``recv_into``s the payload into that op's
  preallocated buffer (allocated once, reused every iteration), woken by the kernel once per
  ``RCV_LOWAT`` bytes rather than per segment (``SO_RCVLOWAT``: each wakeup is a context
  switch and a hand-over of the interpreter's lock).  Once the op's deps are
  met (it is *active*), the receiver applies (numpy add or copy, in place) what arrived to
  the op's block a sub-block (``subblock_bytes``) at a time as the bytes come; data that
  arrives before its op is active waits in the buffer and is applied when it becomes so;
* one sender per outgoing connection ``(peer, channel)``: takes the sends handed to it in
  order and writes each as one DATA frame straight from the buffer (``sendmsg``, no copy);
  in stop-and-wait mode it then waits for the receiver's ACK;
* whichever thread completes an op (a receiver applying the last bytes, a sender writing
  the last byte) updates the deps of the ops after it and hands the sends whose deps are
  met to their senders, activates the receives whose deps are met -- all under the
  executor's lock, so applies are serialised as the plan semantics require.  There is no
  per-chunk hand-off through a central thread; the caller's thread runs
  :meth:`Executor.run`, which only starts the iteration and waits for its end or an error.

Shared links (``links="shared"``): one connection per peer carries every plan channel to it.
Each channel keeps its sender thread and its order (a tree's chunks go in the order they
became ready), but writes its transfers as DATA frames flagged ``FLAG_PIECE``, taking turns on
the connection in weighted fair order (:class:`SharedLink`: the channels' rates as weights, not
caps; no pacing); the receiver reads each piece after the bytes of that transfer before it.  A
piece is what of the transfer is ready, up to ``SHARED_PIECE_BYTES`` (at least a sub-block): a
sender that has fallen behind, or whose block is whole, writes several sub-blocks as one frame,
since each frame costs a header, a turn and the receiver's wakeups.  A link direction then
carries one TCP flow whatever the number of trees on it, and a tree with nothing ready leaves
its share to the others.

Cut-through (``cut_through``, on by default): a send longer than a sub-block whose unmet deps
are all active receives whose frames have begun to arrive is handed to its sender at once;
the sender writes the header and streams each byte of the block as soon as every receive it
depends on has applied it (an interior node of a reduce tree adds and forwards a chunk as it
arrives, a broadcast node forwards it), and the send completes once its deps have.  The
plan's semantics are unchanged: a chunk is still the unit of dependency; only when its bytes
move changes.  Waiting for the frames to begin keeps it deadlock-free: a frame, once its
header is written, depends only on frames already under way, never on a send queued behind
it.  Cut-through is off for a send that must be whole before it is written: one that may take
an auxiliary path (the path keeps a copy), CREW's withdrawn sends and FL-FCFS link turns, and
in an executor with a probing hook (a chunk streamed as it arrives would be measured at its
upstream's pace, not this link's).

Each connection's socket is closed only by the thread that reads or writes it, when it ends;
:meth:`Executor.close` shuts the sockets down (which wakes those threads) but closes none, and
shutdowns and closes take the executor's lock.  A socket closed under a thread still using it
frees its descriptor number for the next socket the process opens, and the thread's pending
``recv``/``shutdown`` would then act on that other connection.

Every thread reports to the main loop through one event queue; the main loop fails
(``ExecError``/``ProtocolError``) on a peer error, an abort, or ``timeout_s`` without
progress, naming the peers and transfers it still waits for.  Progress is local: any
bytes sent or received by this node, or any op completing.  A node that legitimately
waits longer than ``timeout_s`` for upstream work (long unpipelined chains over slow
links) needs a larger ``timeout_s``.  ``limit_s`` bounds a whole iteration (a peer
dripping a byte now and then is progress, but not forever).  Outgoing data sockets get
``timeout_s`` as their send timeout.

Auxiliary transmission (NetStorm §VI): with ``aux`` paths (``plan.aux``), a send whose
primary connection is busy (more than ``primary_busy_bound`` sends queued on it) goes to the
fastest auxiliary path with fewer than ``aux_queue_length`` of this node's chunks in flight,
else to the primary (with ``dispatch: eta``, only to a path on which it would arrive sooner:
:meth:`Executor._route`).  An auxiliary chunk carries ``FLAG_AUX`` and its whole path in the
header's ``route`` and travels over auxiliary connections (negative channels: the sender's own
chunks on ``AUX_CHANNEL``, the chunks a relay passes on on a *lane* per upstream hop,
:func:`aux_lane`); a relay streams it on to the next node of the header's route as its bytes
arrive (cut-through, §VI: a relay forwards at link speed; :class:`Relayed`), once the frames
queued before it on that lane went (one lane per upstream, a choice: a chunk arriving slowly
from one upstream does not hold up a chunk from another that is ready to go)
-- never by a table of its own, so a relay with a stale or no path table still delivers
(NetStorm Fig. 10); it never aggregates, and connects to a next hop it has no connection to
on first use.  A relayed frame whose upstream breaks mid-way cannot be finished: the relay
closes the connection to the next hop (given up, as any broken auxiliary connection), whose
receiver asks for the chunk again.  Probing skips frames a relay passed on (their pace is
the upstream hop's, not this link's).  The
send completes when its first hop took it, as a direct send.  Not in stop-and-wait mode.
Recovery (not in the paper, which does not say what happens to a chunk on a path that
breaks): the sender keeps a copy of every chunk it sent over an auxiliary path in the
current iteration; a receiver that got no byte for ``resend_after_s`` while it waits asks
(``on_missing``, through the coordinator) for the transfers it misses, and their senders send
the kept copies again on the primary connection (:meth:`Executor.resend`).  A broken
auxiliary connection is not an error: a send on it that moves no byte for
``resend_after_s`` gives the next hop up for the run, the sender's own chunks queued for it
go to their primary connections, relayed ones are dropped (their receivers ask for them);
whichever copy of an asked-for chunk arrives second is dropped.

Withdrawn transfers (CREW's non-blocking scatter, §IV-A2): ``withdraw(op)``, when set, is
asked as a direct send is about to be written; True sends a header with ``FLAG_WITHDRAWN``
and no payload instead (the receiver has the chunk already, or will not get it: a cut-short
early scatter), without waiting for the link's turn; the receiver applies what
``on_withdrawn(op)`` gives it as the payload (the copy it holds), or nothing (None, or no
``on_withdrawn``).  ``run``'s result lists the withdrawn transfers.

FL-FCFS across plan versions (CREW §IV-C): executors given the same ``gate(peer)`` (one
:class:`LinkGate` per peer, shared by every version on an agent: concurrent partial-reduce
tasks) serve their sends to that peer in the order the sends became ready, whichever version
they belong to; without a gate each version's connections share the link as TCP flows do
(FS).

Every field of a DATA header is checked against the recv op it names (transfer,
iteration, size, phase, flow, chunk): late, duplicate and early frames are refused.
:meth:`Executor.status` is a snapshot for the coordinator's diagnosis of a stall: which
transfers are still awaited from whom (and how many bytes of each arrived), which sends are
not completed.
"""

from __future__ import annotations

import fcntl
import logging
import queue
import socket
import struct
import threading
import time
from collections import defaultdict, deque

import numpy as np

from testbed.plan import RECV, SEND, Op

from .inputs import rotate_into
from .wire import (
    ACK,
    DATA,
    FLAG_ACK_REQ,
    FLAG_AUX,
    FLAG_PIECE,
    FLAG_WITHDRAWN,
    SEND_SLICE,
    TYPE_NAMES,
    Closed,
    Header,
    ProtocolError,
    Truncated,
    close_quietly,
    phase_code,
    recv_header,
    recv_into_exact,
    send_frame,
    shutdown_quietly,
)

log = logging.getLogger("agents.executor")

SEND_COLUMNS = ["xfer", "send_start_ns", "send_end_ns"]
RECV_COLUMNS = ["xfer", "send_ts_ns", "recv_start_ns", "recv_end_ns", "apply_ns"]


SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)  # Linux value
AUX_CHANNEL = -1  # the data connections that carry auxiliary chunks (plans use channels >= 0)
SUBBLOCK_BYTES = 64 << 10  # a receive's arrived bytes are applied (and streamed on) this many at a time
# A payload's reader is woken once this many bytes arrived (SO_RCVLOWAT, wire.recv_into_exact).
# At most 32 KiB: a mark whose buffer space exceeds a new socket's receive buffer (128 KiB) also
# clamps its receive window to the mark (Linux tcp_set_rcvlowat).
RCV_LOWAT = 32 << 10
POLL_S = 0.5  # how often a waiting sender thread looks at the executor's closing flag
LINKS = ("channel", "shared")  # a data connection per plan channel, or one per peer (:class:`SharedLink`)
DEFAULT_LINKS = "shared"  # an experiment's default (agents.links); the library's is a connection per channel
SHARED_UNSENT_BYTES = 256 << 10  # a shared connection's TCP_NOTSENT_LOWAT: its turns are taken near the wire
# A shared connection's largest piece (one sub-block where sub-blocks are larger): as many bytes as
# the socket holds unsent, so a turn lasts about as long as the kernel's queue
SHARED_PIECE_BYTES = SHARED_UNSENT_BYTES


def link_weights(rates: dict[int, float]) -> dict[int, float]:
    """The weights of the channels sharing one connection, from their rates: the rates where
    every channel has one, else equal shares (:class:`SharedLink`)."""
    return dict(rates) if all(rates.values()) else dict.fromkeys(rates, 1.0)


def check_links(links: str) -> str:
    """``links`` if it is one of :data:`LINKS`, else ValueError."""
    if links not in LINKS:
        raise ValueError(f"links {links!r}: one of {', '.join(LINKS)}")
    return links


def links_for(links: str, plan, *, stop_and_wait: bool = False, probing: bool = False,
              versions: bool = False) -> str:
    """The data connections a run uses: ``links``, unless shared links cannot carry it --
    stop-and-wait, probing, plan versions installed at run time (re-planning, CREW's groups),
    auxiliary paths or sends on named paths need whole frames per connection: then one per
    channel."""
    whole = stop_and_wait or probing or versions or plan.aux.get("paths") or any(op.path for _, op in plan.transfers())
    return "channel" if whole else links


def aux_lane(upstream: int) -> int:
    """The auxiliary channel on which a relay passes on chunks from plan node ``upstream``."""
    return AUX_CHANNEL - 1 - upstream


def is_aux(channel: int) -> bool:
    return channel <= AUX_CHANNEL


SIOCOUTQNSD = 0x894B  # Linux: bytes in a TCP socket's send queue not yet sent
TCP_CLOSE = 7  # tcpi_state of a dead connection (reset, timed out)


TCP_INFO_RETRANS = 100  # struct tcp_info: offset of tcpi_total_retrans (u32)
TCP_INFO_RTO = 240  # ... of tcpi_total_rto (u16), tcpi_total_rto_recoveries (u16), tcpi_total_rto_time (u32, ms)


def tcp_losses(sock: socket.socket) -> tuple[int, int, int] | None:
    """What loss recovery cost ``sock``'s TCP connection so far: (segments retransmitted,
    retransmission timeouts, ms spent recovering from them), from Linux's ``tcp_info``; None
    if the kernel does not count timeouts (before Linux 6.7) or the socket has no connection."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_RTO + 8)
    except (OSError, ValueError):
        return None
    if len(info) < TCP_INFO_RTO + 8:
        return None
    rtos, _, rto_ms = struct.unpack_from("HHI", info, TCP_INFO_RTO)
    return struct.unpack_from("I", info, TCP_INFO_RETRANS)[0], rtos, rto_ms


def unsent_bytes(sock: socket.socket) -> int:
    """Bytes written to ``sock`` that TCP has not sent yet and still will: 0 once the socket
    is closed here, and 0 once its connection is dead (reset, timed out) -- Linux keeps
    counting the bytes a reset connection never sent, for as long as the socket is open."""
    try:
        n = struct.unpack("i", fcntl.ioctl(sock.fileno(), SIOCOUTQNSD, b"\0\0\0\0"))[0]
        return n if n == 0 or sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] != TCP_CLOSE else 0
    except (OSError, ValueError):
        return 0


class LinkGate:
    """Flow-level FCFS on one directed link shared by several executors (CREW §IV-C, "FL":
    flows served in the order they became ready, each with the whole link, no preemption).

    A send takes a :meth:`ticket` when it becomes ready (its executor's main loop, in order)
    and is written once it holds the oldest ticket still pending; when the link passes to
    another executor, that one first waits until the previous holder's socket has sent
    every byte it was given (``SIOCOUTQNSD``), so two tasks' flows never share the link.
    Work-conserving at chunk granularity: a chunk not yet ready (a multicast chunk still
    being reduced) does not hold the link.  A ticket whose send will not happen is released
    (:meth:`release`; a closed executor's are dropped)."""

    def __init__(self):
        self._cv = threading.Condition()
        self._next = 0
        self._pending: dict[int, object] = {}  # ticket -> owner (an executor)
        self._last: tuple[object, socket.socket] | None = None  # the previous holder and its socket

    def ticket(self, owner) -> int:
        with self._cv:
            t = self._next
            self._next += 1
            self._pending[t] = owner
            return t

    def acquire(self, t: int, sock: socket.socket, timeout_s: float, stop) -> None:
        """Block until ticket ``t`` is the oldest pending and the link's previous holder (another
        owner) drained its socket; ``stop()`` true, ``timeout_s`` without the gate moving or
        without the previous holder's socket draining raise ExecError."""
        with self._cv:
            head, moved = None, time.monotonic()
            while True:
                for k in [k for k, o in self._pending.items() if k != t and getattr(o, "closing", False)]:
                    del self._pending[k]  # a closed executor's sends will not happen
                if min(self._pending) == t:
                    break
                if stop():
                    raise ExecError("closed while waiting for the link")
                now = min(self._pending)
                if now != head:
                    head, moved = now, time.monotonic()
                elif time.monotonic() - moved > timeout_s:
                    raise ExecError(f"link gate: the flow ahead (ticket {head}) made no progress for {timeout_s:g} s")
                self._cv.wait(0.1)
            prev, me = self._last, self._pending[t]
        if prev is not None and prev[0] is not me and prev[1] is not sock:
            deadline = time.monotonic() + timeout_s
            while (left := unsent_bytes(prev[1])) > 0 and not stop():
                if time.monotonic() > deadline:
                    raise ExecError(f"link gate: the previous flow on this link (another task's) still had {left} "
                                    f"bytes unsent after {timeout_s:g} s")
                time.sleep(0.0005)

    def release(self, t: int, sock: socket.socket | None = None) -> None:
        with self._cv:
            owner = self._pending.pop(t, None)
            if sock is not None:
                self._last = (owner, sock)
            self._cv.notify_all()


class SharedLink:
    """One connection to a peer that several plan channels share (``links="shared"``): each
    channel's sender thread writes its transfers in pieces (up to ``SHARED_PIECE_BYTES``), one
    piece at a time, and the link serves the channels with a piece ready in weighted fair order
    (start-time fair queueing: a channel's tag grows by a piece's bytes over its weight; the
    waiting channel with the least tag goes next; one idle restarts from the tag in service).
    It is work-conserving (a channel with nothing ready leaves its share to the others) and
    gives backlogged channels the link in proportion to their weights: the plan's rates of
    trees sharing a link direction, as shares rather than caps.  A piece written wakes the
    channel whose turn is next alone, not every waiting one.  With TCP_NOTSENT_LOWAT the
    kernel holds few unsent bytes, so the order of turns is the order on the wire."""

    def __init__(self, sock: socket.socket, weights: dict[int, float]):
        self.sock, self.weights = sock, weights
        self._lock = threading.Lock()
        self._turn = {c: threading.Condition(self._lock) for c in weights}  # woken for its turn alone
        self._tag = dict.fromkeys(weights, 0.0)
        self._waiting: set[int] = set()
        self._busy, self._now = False, 0.0
        self.users = len(weights)  # sender threads still using the socket (the last one closes it)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, SHARED_UNSENT_BYTES)

    def _next(self) -> int | None:
        """The waiting channel whose turn is next (under the lock)."""
        return min(self._waiting, key=lambda c: (self._tag[c], c)) if self._waiting else None

    def _pass_turn(self) -> None:
        """Wake the channel whose turn is next, if the link is free (under the lock)."""
        nxt = None if self._busy else self._next()
        if nxt is not None:
            self._turn[nxt].notify()

    def write(self, channel: int, header: Header, payload, stop) -> None:
        """Send one frame in ``channel``'s turn; ExecError once ``stop()`` is true."""
        with self._lock:
            if channel not in self._waiting:
                self._tag[channel] = max(self._tag[channel], self._now)
                self._waiting.add(channel)
            while self._busy or self._next() != channel:
                if stop():
                    self._waiting.discard(channel)
                    self._pass_turn()
                    raise ExecError("closed while waiting for the shared connection")
                self._turn[channel].wait(POLL_S)
            self._waiting.discard(channel)
            self._busy, self._now = True, self._tag[channel]
            self._tag[channel] += max(1, len(payload)) / self.weights[channel]
        try:
            send_frame(self.sock, header, payload)
        finally:
            with self._lock:
                self._busy = False
                self._pass_turn()


class Relayed:
    """A relayed chunk's payload while it arrives (cut-through): bytes [0, ``filled``) of
    ``buf`` are in; the relay's receiving thread calls :meth:`progress` and, if its upstream
    breaks, :meth:`fail`; the sending thread streams with :meth:`send`."""

    def __init__(self, nbytes: int):
        self.buf, self.filled, self.failed = bytearray(nbytes), 0, None
        self._cond = threading.Condition()

    def progress(self, n: int) -> None:
        with self._cond:
            self.filled = n
            self._cond.notify_all()

    def fail(self, why: BaseException) -> None:
        with self._cond:
            self.failed = why
            self._cond.notify_all()

    def send(self, sock: socket.socket, header: Header, wait_s: float, tick) -> None:
        """Header, then the payload as it fills; Truncated if the upstream broke or gave no
        byte for ``wait_s`` (the frame cannot be finished: the caller drops the connection)."""
        send_frame(sock, header)
        sent, mv = 0, memoryview(self.buf)
        while sent < len(self.buf):
            with self._cond:
                if not self._cond.wait_for(lambda: self.filled > sent or self.failed, wait_s) or self.failed:
                    raise Truncated(f"relayed transfer {header.xfer}: upstream "
                                    + (f"broke ({self.failed})" if self.failed else f"silent for {wait_s:g} s"))
                end = self.filled
            sock.sendall(mv[sent:end])
            sent = end
            tick()


class ExecError(Exception):
    """The program could not complete: timeout, a peer connection closed, an abort."""


class Stalled(ExecError):
    """No progress for ``timeout_s``, or an iteration over its limit."""


def _summary(ids_by_peer: dict[str, list[int]]) -> str:
    parts = []
    for peer, ids in sorted(ids_by_peer.items()):
        more = f" (+{len(ids) - 5} more)" if len(ids) > 5 else ""
        parts.append(f"{peer}: xfers {sorted(ids)[:5]}{more}")
    return "; ".join(parts)


class _Outbox:
    """The frames waiting for one connection's sender thread: ``items`` (guarded by the
    executor's lock) and ``cv`` (on that lock), notified when an item is added or data a
    queued send streams from has been applied; ``ended`` once that thread has ended."""

    __slots__ = ("items", "cv", "ended")

    def __init__(self, lock: threading.Lock):
        self.items: deque = deque()
        self.cv = threading.Condition(lock)
        self.ended = False


class Executor:
    """State of one node: buffers, connections and the program's dependency graph."""

    def __init__(self, name: str, program: list[Op], *, length: int, scratch: dict[str, int] | None = None,
                 dtype="float32", stop_and_wait: bool = False, timeout_s: float = 60.0,
                 limit_s: float | None = None, on_chunk=None, nodes: list[str] | None = None,
                 aux: dict | None = None, connect=None, on_missing=None, gate=None,
                 cut_through: bool = True, subblock_bytes: int = SUBBLOCK_BYTES, links: str = "channel"):
        """``nodes``: the plan's nodes (route entries index them); ``aux``: {"paths": [[src,
        relays..., dst]] through this node, "primary_busy_bound", "aux_queue_length",
        "resend_after_s"}; ``connect(peer, channel)``: an authenticated data socket (a relay's
        next hop on first use); ``on_missing(iteration, [[src, xfer], ...])``: ask for re-sends;
        ``gate(peer)``: the :class:`LinkGate` of the link to ``peer`` (FL-FCFS across executors);
        ``cut_through``: stream a send as the receives it depends on arrive (else store and
        forward); ``subblock_bytes``: how many arrived bytes of a receive are applied at a time;
        ``links``: a data connection per plan channel (``"channel"``), or one per peer that the
        channels share (``"shared"``, :class:`SharedLink`; not with stop-and-wait, a link gate,
        a probing hook or auxiliary paths, which need whole frames per connection)."""
        self.shared = check_links(links) == "shared"
        if self.shared and (stop_and_wait or gate or on_chunk or (aux or {}).get("paths")):
            raise ValueError("links 'shared' needs whole frames per connection with stop-and-wait, a link gate, "
                             "a probing hook or auxiliary paths")
        self.name = name
        # probing hooks, called in the receiver thread: on_chunk(peer, None) when a chunk's header
        # arrived, on_chunk(peer, (bytes, send_ts_ns, first_ns, last_ns, channel, mid_ns, mid_bytes))
        # when it is complete; (mid_ns, mid_bytes): the first read that completed half the payload
        self.on_chunk = on_chunk
        self.prog = list(program)
        self.dtype = np.dtype(dtype)
        self.stop_and_wait = stop_and_wait
        self.timeout_s = timeout_s
        self.limit_s = limit_s
        self.cut_through = cut_through
        self.subblock = max(int(subblock_bytes), self.dtype.itemsize)
        self.bufs = {"x": np.zeros(length, self.dtype)}
        self.bufs.update({b: np.zeros(n, self.dtype) for b, n in (scratch or {}).items()})
        self._init_graph()
        self._init_state()
        self._gate = gate
        self._tickets: dict[int, int] = {}  # send op -> its LinkGate ticket (while queued)
        self.withdraw = None  # op -> bool: send it withdrawn (no payload), asked as it is written
        self.on_withdrawn = None  # recv op -> the payload this node holds for a withdrawn transfer, or None
        self._reset_run(-1)
        self._init_aux(nodes or [], aux or {}, connect, on_missing)

    def _conn(self, peer: str, channel: int) -> tuple[str, int]:
        """The connection a plan channel to ``peer`` is carried on."""
        return (peer, 0) if self.shared and not is_aux(channel) else (peer, channel)

    def _init_graph(self) -> None:
        """The program's dependency graph by op index, each op's view of its buffer, and a
        receive buffer per recv op (which transfer on which connection it expects)."""
        pos = {op.id: i for i, op in enumerate(self.prog)}
        self._ndeps = [len(set(op.deps)) for op in self.prog]
        self._deps = [sorted({pos[d] for d in op.deps}) for op in self.prog]
        self._users: list[list[int]] = [[] for _ in self.prog]
        for i, op in enumerate(self.prog):
            for d in self._deps[i]:
                self._users[d].append(i)
        self._is_send = [op.kind == SEND for op in self.prog]
        # a send may stream while receives it depends on arrive (cut-through) if it depends on one
        self._streams = [op.kind == SEND and any(not self._is_send[d] for d in self._deps[i])
                         for i, op in enumerate(self.prog)]
        self._views = [self.bufs[op.buf][op.offset:op.offset + op.length] for op in self.prog]
        self._rbuf: dict[int, np.ndarray] = {}
        self._labels: dict[int, tuple] = {}  # recv op -> the (phase, flow, chunk, ACK flag) its frames carry
        self._expect: dict[tuple[str, int], dict[int, int]] = defaultdict(dict)  # (src, ch) -> xfer -> op
        self._out_keys: set[tuple[str, int]] = set()
        for i, op in enumerate(self.prog):
            if op.kind == RECV:
                self._rbuf[i] = np.zeros(op.length, self.dtype)
                self._labels[i] = (phase_code(op.phase), op.flow, op.chunk, FLAG_ACK_REQ if self.stop_and_wait else 0)
                self._rbuf[i].fill(0)  # touch the pages now, not during the first transfer
                self._expect[self._conn(op.peer, op.channel)][op.xfer] = i
            elif op.kind == SEND:
                self._out_keys.add((op.peer, op.channel))

    def _init_state(self) -> None:
        """Connections, the event queue and the lock, and every op's state (guarded by the lock)."""
        n = len(self.prog)
        self._got = [-1] * n  # iteration whose data last arrived whole, per recv op
        self._senders: dict[tuple[str, int], tuple[socket.socket, _Outbox]] = {}
        self._receivers: dict[tuple[str, int], socket.socket] = {}
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # connections, and every op's state below
        self._closing = False
        self._progress = time.monotonic()  # last time any thread moved bytes or posted an event
        self._rx_bytes = [0] * n  # bytes of the current iteration's data arrived, per recv op
        self._rx_iter = [-1] * n  # iteration _rx_bytes counts (its frame's header arrived)
        self._rx_times: list[tuple] = [()] * n  # (send_ts, first, last, withdrawn) of the data arrived whole
        self._rx_first = [0] * n  # when the first piece of the current iteration's data arrived (shared links)
        self._tx_bytes = [0] * n  # bytes sent, per send op
        self._active = [-1] * n  # recv op: iteration in which its deps are met (its data is applied as it arrives)
        self._applied = [0] * n  # recv op: bytes of its data applied (in iteration _active)
        self._done = [-1] * n  # iteration in which the op completed
        self._wait = list(self._ndeps)  # deps not yet completed (this run)
        self._dispatched = [False] * n  # send handed to a sender (this run)
        self._work: deque = deque()  # ops whose deps changed, to look at (under the lock)
        self._ndone = 0
        self._run_it = -1  # the iteration being run
        self._queued: set[int] = set()
        self.iteration = 0  # the iteration whose data receivers accept

    def _reset_run(self, iteration: int) -> None:
        """Per-run state (under the lock)."""
        self._run_it = iteration
        self._wait = list(self._ndeps)
        self._dispatched = [False] * len(self.prog)
        self._ndone = 0
        self._queued = set()
        self._load: dict[str, int] = defaultdict(int)  # sends queued on the direct connections to a peer
        self._on_route: dict[int, tuple[int, ...]] = {}  # auxiliary sends in flight -> their route
        self._in_flight: dict[tuple[int, ...], int] = defaultdict(int)
        self._log = {"sends": [], "recvs": [], "aux": [], "withdrawn": []}
    def _init_aux(self, nodes: list[str], aux: dict, connect, on_missing) -> None:
        self.nodes, self._index = list(nodes), {n: k for k, n in enumerate(nodes)}
        self._aux_routes: dict[str, list[tuple[int, ...]]] = defaultdict(list)  # dst -> routes, fastest first
        for path in aux.get("paths", []):
            k = path.index(self.name)
            if k == 0 and not self.stop_and_wait:
                self._aux_routes[path[-1]].append(tuple(self._index[n] for n in path))
            if k < len(path) - 1:
                self._out_keys.add((path[k + 1], aux_lane(self._index[path[k - 1]]) if k else AUX_CHANNEL))
        self._busy_bound = int(aux.get("primary_busy_bound", 2))
        self._aux_queue = int(aux.get("aux_queue_length", 5))
        rates = aux.get("rates", {}) if aux.get("dispatch") == "eta" else {}
        self._eta = {tuple(self._index[n] for n in key.split(">")): (float(mbps), float(delay))
                     for key, (mbps, delay) in rates.items() if key.split(">")[0] == self.name}
        self._connect = connect
        self._connect_lock = threading.Lock()
        self._by_src = {(op.peer, op.xfer): i for i, op in enumerate(self.prog) if op.kind == RECV}
        self._frame_max = len(self.bufs["x"]) * self.dtype.itemsize
        self._resend_after = float(aux.get("resend_after_s", 0)) if on_missing else 0.0
        self._on_missing = on_missing
        self._kept: dict[int, tuple[int, int, np.ndarray]] = {}  # xfer -> (iteration, op, copy sent on a path)
        self._asked: set[tuple[int, int]] = set()  # (recv op, iteration) re-sends were asked for
        self._rx_at = time.monotonic()  # last time a data byte arrived
        self._dead: set[str] = set()  # next hops whose auxiliary connection broke
        self._tcp_seen: dict[socket.socket, tuple[int, int, int]] = {}  # tcp_losses at the last iteration's end

    @property
    def closing(self) -> bool:
        """:meth:`close` was called (its threads are ending)."""
        return self._closing

    # -- connections -----------------------------------------------------------
    def outgoing(self) -> list[tuple[str, int]]:
        """(peer, channel) pairs this node must open connections to."""
        return sorted({self._conn(*k) for k in self._out_keys})

    def incoming(self) -> list[tuple[str, int]]:
        """(peer, channel) pairs this node expects connections from."""
        return sorted(self._expect)

    def attach_outgoing(self, peer: str, channel: int, sock: socket.socket) -> None:
        """Take the data connection to ``peer`` on ``channel`` and start its sender thread (with
        shared links, one per plan channel the connection carries)."""
        key, shared = (peer, channel), self.shared and not is_aux(channel)
        keys = sorted(k for k in self._out_keys if k[0] == peer and not is_aux(k[1])) if shared else [key]
        rates = {k[1]: max((op.rate_mbps for op in self.prog if op.kind == SEND and (op.peer, op.channel) == k),
                           default=0.0) for k in keys}
        link = None
        if shared:  # the plan's rates are the channels' weights (all unpaced: equal shares)
            link = SharedLink(sock, link_weights(rates))
        elif rates[channel] > 0:  # TCP paces internally (no fq needed) once a maximum rate is set
            sock.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, int(rates[channel] * 1e6 / 8))
        # a send that moves no byte for timeout_s fails; on an auxiliary path it is given up sooner
        sock.settimeout((self._resend_after or self.timeout_s) if is_aux(channel) else self.timeout_s)
        with self._lock:  # an auxiliary connection may also be one a relay opens on first use
            if self._closing:  # closed while this connection was being opened (a version given up on)
                close_quietly(sock)
                raise ExecError(f"data connection to {peer} channel {channel}: the executor is closed")
            expected = (channel == 0 and keys) if shared else (key in self._out_keys or is_aux(channel))
            if not expected or any(k in self._senders for k in keys):
                raise ProtocolError(f"no (further) data connection to {peer} channel {channel} expected")
            boxes = {k: _Outbox(self._lock) for k in keys}
            for k, box in boxes.items():
                self._senders[k] = (sock, box)
                self._out_keys.add(k)
        for k, box in boxes.items():
            threading.Thread(target=self._send_loop, args=(k, sock, box, link), daemon=True,
                             name=f"send-{peer}-{k[1]}").start()

    def attach_incoming(self, peer: str, channel: int, sock: socket.socket) -> None:
        """Accept an authenticated connection from ``peer``; ProtocolError if unexpected."""
        key = (peer, channel)
        with self._lock:
            if self._closing:
                raise ProtocolError("shutting down")
            if key not in self._expect and not (aux_lane(len(self.nodes)) < channel <= AUX_CHANNEL
                                                and peer in self._index):
                raise ProtocolError(f"no data expected from {peer} on channel {channel}")
            if key in self._receivers:
                raise ProtocolError(f"duplicate data connection from {peer} channel {channel}")
            self._receivers[key] = sock
        threading.Thread(target=self._recv_loop, args=(key, sock), daemon=True,
                         name=f"recv-{peer}-{channel}").start()

    # -- threads -------------------------------------------------------------
    def _tick(self, _n: int = 0) -> None:
        self._progress = time.monotonic()

    def _close_own(self, sock: socket.socket, link: SharedLink | None = None) -> None:
        """Close the socket of the calling thread's connection (see the module docstring); a
        shared one once its last sender thread ends."""
        with self._lock:
            if link is not None:
                link.users -= 1
                if link.users:
                    return
            close_quietly(sock)

    def _fail(self, exc: Exception) -> None:
        if not self._closing:
            self._events.put(("error", exc))

    def _count(self, counts: list[int], i: int):
        def progress(n: int) -> None:
            counts[i] = n
            self._progress = time.monotonic()
        return progress

    def _put(self, key: tuple[str, int], item) -> None:
        """Queue ``item`` for the sender of connection ``key`` (under the lock)."""
        box = self._senders[key][1]
        box.items.append(item)
        box.cv.notify()

    def _pick(self, box: _Outbox):
        """The next item of ``box`` (under the lock), or None."""
        return box.items.popleft() if box.items else None

    def _ready_bytes(self, i: int, it: int) -> int:
        """Bytes of send ``i``'s block that every write it depends on has reached (under the
        lock): all of them once its deps are met, else up to the first element a receive it
        depends on has not applied yet."""
        op = self.prog[i]
        if self._wait[i] == 0:
            return self._views[i].nbytes
        s0, s1, size = op.offset, op.offset + op.length, self.dtype.itemsize
        front = s1
        for d in self._deps[i]:
            od = self.prog[d]
            if self._done[d] == it or od.buf != op.buf:
                continue
            lo = od.offset + (self._applied[d] // size if self._active[d] == it else 0)
            if lo < s1 and od.offset + od.length > s0:
                front = min(front, max(lo, s0))
        return (front - s0) * size

    def _wait_ready(self, box: _Outbox, i: int, it: int, sent: int) -> int:
        """Bytes of send ``i``'s block ready to go, once there are more than ``sent``."""
        with self._lock:
            while (ready := self._ready_bytes(i, it)) <= sent:
                if self._closing:
                    raise ExecError("closed while streaming")
                box.cv.wait(POLL_S)
        return ready

    def _stream(self, sock: socket.socket, box: _Outbox, i: int, it: int, header: Header) -> None:
        """Cut-through: ``header``, then send ``i``'s block as the receives it depends on apply it."""
        send_frame(sock, header)
        mv, sent = memoryview(self._views[i]).cast("B"), 0
        total = mv.nbytes
        while sent < total:
            ready = self._wait_ready(box, i, it, sent)
            while sent < ready:
                sent += sock.send(mv[sent:min(ready, sent + SEND_SLICE)])
                self._tx_bytes[i] = sent
                self._progress = time.monotonic()

    def _send_pieces(self, link: SharedLink, channel: int, box: _Outbox, i: int, it: int, header: Header) -> None:
        """Shared link: send ``i``'s block in pieces, each in ``channel``'s turn, as the receives it
        depends on apply it (cut-through) or at once if its deps are met: a piece is what is ready,
        up to ``SHARED_PIECE_BYTES`` or a sub-block if that is larger."""
        mv, sent = memoryview(self._views[i]).cast("B"), 0
        total, piece = mv.nbytes, header._replace(flags=header.flags | FLAG_PIECE)
        most = max(self.subblock, SHARED_PIECE_BYTES)
        while True:
            end = min(self._wait_ready(box, i, it, sent) if sent < total else sent, sent + most)
            link.write(channel, piece._replace(payload_len=end - sent), mv[sent:end], lambda: self._closing)
            sent = self._tx_bytes[i] = end
            self._progress = time.monotonic()
            if sent >= total:
                return

    def _send_loop(self, key: tuple[str, int], sock: socket.socket, box: _Outbox,
                   link: SharedLink | None = None) -> None:
        """One connection's sender thread: :meth:`_send_items` until closing; every way it can
        fail becomes the run's error (an auxiliary path is given up instead), and the socket it
        owns is closed and the link turns of the sends it will not make are passed on."""
        peer, ch = key
        broken = (OSError, Truncated) if is_aux(ch) else ()  # an auxiliary path is given up, not fatal
        current = [None]  # the item being sent, for the error paths
        try:
            self._send_items(key, sock, box, current, link)
        except broken as e:
            self._give_up(key, sock, box, current[0], e)
        except Closed:
            self._fail(ExecError(f"data connection to {peer} (channel {ch}) closed by peer"))
        except ProtocolError as e:
            log.error("protocol error on data connection to %s (channel %d): %s", peer, ch, e)
            self._fail(ProtocolError(f"data connection to {peer} (channel {ch}): {e}"))
        except socket.timeout:
            self._fail(ExecError(f"send to {peer} (channel {ch}) stalled: no byte accepted for "
                                 f"{self.timeout_s:g} s"))
        except OSError as e:
            self._fail(ExecError(f"data connection to {peer} (channel {ch}) failed: {e}"))
        except Exception as e:  # no thread dies silently
            self._fail(ExecError(f"sender to {peer} (channel {ch}) failed: {type(e).__name__}: {e}"))
        finally:
            self._close_own(sock, link)
            with self._lock:  # the sends still queued here will not happen: their turns pass
                box.ended = True
                rest = list(box.items) + ([current[0]] if current[0] is not None else [])
                box.items.clear()
            for r in rest if self._gate else ():
                if r[0] is not None and r[0] in self._tickets:
                    self._gate(peer).release(self._tickets.pop(r[0]))

    def _send_items(self, key: tuple[str, int], sock: socket.socket, box: _Outbox, current: list,
                    link: SharedLink | None) -> None:
        """Send the items queued in ``box`` as they come (``current[0]``: the one being sent)
        until the executor closes: a relayed or re-sent chunk as it is, a send withdrawn (no
        payload), in pieces (a shared ``link``), streamed (cut-through) or whole, each in its
        link turn under FL-FCFS."""
        peer = key[0]
        hbuf = bytearray(64)
        flags = FLAG_ACK_REQ if self.stop_and_wait else 0
        while True:
            with self._lock:
                current[0] = item = None
                while not self._closing and (item := self._pick(box)) is None:
                    box.cv.wait(POLL_S)
                current[0] = item
            if item is None:
                return
            i, it, route, payload = item
            start = time.time_ns()
            if i is None:  # a relayed or re-sent chunk: ``it`` is its header, stamped per hop
                if isinstance(payload, Relayed):
                    payload.send(sock, it._replace(send_ts_ns=start), self.timeout_s, self._tick)
                else:
                    send_frame(sock, it._replace(send_ts_ns=start), payload, self._tick)
                continue
            op, view = self.prog[i], self._views[i] if payload is None else payload
            self._tx_bytes[i] = 0
            t = self._tickets.get(i)
            if not route and self.withdraw is not None and self.withdraw(op):
                if t is not None:  # no payload: it needs no turn on the link
                    self._gate(peer).release(self._tickets.pop(i))
                send_frame(sock, Header(DATA, phase_code(op.phase), flags | FLAG_WITHDRAWN, it, op.xfer,
                                        op.flow, op.chunk, 0, start))
                self._await_ack(sock, hbuf, op, it)
                self._sent(box, i, it, start, True)
                continue
            if t is not None:  # FL-FCFS: this link's turn among every task's flows
                self._gate(peer).acquire(t, sock, self.timeout_s, lambda: self._tick() or self._closing)
                start = time.time_ns()
            header = Header(DATA, phase_code(op.phase), flags | (FLAG_AUX if route else 0), it,
                            op.xfer, op.flow, op.chunk, view.nbytes, start, route)
            try:
                self._write(sock, box, link, key[1], i, it, header, payload)
            finally:
                if t is not None:
                    self._gate(peer).release(self._tickets.pop(i), sock)
            self._await_ack(sock, hbuf, op, it)
            self._sent(box, i, it, start, False)

    def _write(self, sock: socket.socket, box: _Outbox, link: SharedLink | None, channel: int, i: int, it: int,
               header: Header, copy) -> None:
        """Write send ``i``: in pieces on a shared ``link``, streamed as its deps apply it
        (cut-through), else whole (from ``copy``, an auxiliary path's, if given)."""
        if link is not None:
            self._send_pieces(link, channel, box, i, it, header)
        elif copy is None and self._wait[i]:
            self._stream(sock, box, i, it, header)
        else:
            send_frame(sock, header, self._views[i] if copy is None else copy, self._count(self._tx_bytes, i))

    def _sent(self, box: _Outbox, i: int, it: int, start: int, without: bool) -> None:
        """Send ``i`` of iteration ``it`` is written: it completes once its deps have (a
        streamed send may finish before a receive it read from has applied its other bytes)."""
        with self._lock:
            while self._wait[i] and not self._closing:
                box.cv.wait(POLL_S)
            if self._closing or self._run_it != it:
                return
            if without:
                self._log["withdrawn"].append(self.prog[i].xfer)
            if i in self._on_route:
                self._in_flight[self._on_route.pop(i)] -= 1
            else:
                self._load[self.prog[i].peer] -= 1
            self._log["sends"].append([self.prog[i].xfer, start, time.time_ns()])
            self._complete(i, it)
            self._drain(it)

    def _await_ack(self, sock: socket.socket, hbuf: bytearray, op: Op, it: int) -> None:
        """Stop-and-wait: the receiver's ACK of ``op`` in iteration ``it``."""
        if self.stop_and_wait:
            a = recv_header(sock, hbuf, 0)
            if a.type != ACK or a.xfer != op.xfer or a.op_id != it:
                raise ProtocolError(f"expected ACK of transfer {op.xfer}, got {TYPE_NAMES[a.type]} "
                                    f"of transfer {a.xfer}")

    def _recv_loop(self, key: tuple[str, int], sock: socket.socket) -> None:
        """One connection's receiver thread: :meth:`_recv_frames` until the connection ends;
        every way it can end becomes the run's error (an auxiliary connection's loss is only
        logged: its chunks are asked for again), and the socket it owns is closed."""
        peer, ch = key
        lost = (Closed, Truncated, OSError) if is_aux(ch) else ()  # an auxiliary connection's chunks are asked for again
        try:
            self._recv_frames(key, sock)
        except lost:
            if not self._closing:
                log.warning("auxiliary connection from %s closed or failed", peer)
        except Closed:
            if not self._closing:
                log.info("data connection from %s (channel %d) closed", peer, ch)
            self._fail(ExecError(f"data connection from {peer} (channel {ch}) closed by peer"))
        except ProtocolError as e:
            log.error("protocol error from %s (channel %d): %s; closing the connection", peer, ch, e)
            self._fail(ProtocolError(f"from {peer} (channel {ch}): {e}", peer=peer))
        except OSError as e:
            if not self._closing:
                log.error("data connection from %s (channel %d) failed: %s", peer, ch, e)
            self._fail(ExecError(f"data connection from {peer} (channel {ch}) failed: {e}"))
        except Exception as e:  # no thread dies silently
            self._fail(ExecError(f"receiver from {peer} (channel {ch}) failed: {type(e).__name__}: {e}"))
        finally:
            self._close_own(sock)

    def _recv_frames(self, key: tuple[str, int], sock: socket.socket) -> None:  # -- the per-frame hot loop
        """Read DATA frames from ``sock`` until it ends: on an auxiliary connection a chunk for
        another node is relayed as it arrives (cut-through); a withdrawn chunk carries no
        payload; a copy that may also come the other way is committed once; else the payload
        is read into its receive buffer, applied as it arrives once its op is active.  The
        steps of a frame stay inline: one taken out would cost a function call per frame."""
        peer, ch = key
        aux = is_aux(ch)
        expect = self._expect.get(key, {})
        limit = self._frame_max if aux else max(self._rbuf[i].nbytes for i in expect.values())
        hbuf = bytearray(64)
        while True:
            h = recv_header(sock, hbuf, limit)
            first = time.time_ns()
            if h.type != DATA:
                raise ProtocolError(f"unexpected {TYPE_NAMES[h.type]} frame")
            self._rx_at = time.monotonic()
            if aux:
                src, nxt = self._hop(h, peer)
                if nxt is not None:  # cut-through: queued for the next hop before its bytes arrive
                    payload = Relayed(h.payload_len)
                    self._forward(nxt, aux_lane(self._index[peer]), h, payload)
                    try:
                        self._read(sock, h, memoryview(payload.buf), lambda n: self._tick() or payload.progress(n),
                                   peer, ch, first)
                    except BaseException as e:
                        payload.fail(e)
                        raise
                    continue
                i = self._by_src.get((src, h.xfer))
            elif h.route:
                raise ProtocolError(f"transfer {h.xfer}: an auxiliary chunk on a direct connection")
            else:
                i = expect.get(h.xfer)
            if i is None:
                raise ProtocolError(f"unknown transfer {h.xfer}")
            if h.flags & FLAG_WITHDRAWN:  # no payload: the receiver has the chunk
                self._withdrawn_arrived(sock, h, i, first)
                continue
            if h.flags & FLAG_PIECE:
                self._piece_arrived(sock, h, i, first)
                continue
            if aux or (i, h.op_id) in self._asked:  # a copy may also come the other way: commit once
                self._receive_copy(sock, h, i, peer, ch, first)
                continue
            self._check(h, i)
            it = h.op_id
            with self._lock:
                self._rx_iter[i], self._rx_bytes[i] = it, 0
                if self._active[i] == it:  # a send streaming from it may start its frame
                    self._work.extend(u for u in self._users[i] if self._is_send[u])
                    self._drain(it)
            last = self._read(sock, h, memoryview(self._rbuf[i]).cast("B"), self._progress_fn(i, it),
                              peer, ch, first)
            if h.flags & FLAG_ACK_REQ:
                send_frame(sock, Header(ACK, op_id=h.op_id, xfer=h.xfer, send_ts_ns=last))
            self._arrived(i, it, h.payload_len, (h.send_ts_ns, first, last, False))

    def _piece_arrived(self, sock: socket.socket, h: Header, i: int, first: int) -> None:
        """The next bytes of recv ``i``'s data (a shared connection), read into its buffer after
        the bytes before them and applied as they come once the op is active."""
        if not self.shared:
            raise ProtocolError(f"transfer {h.xfer}: a piece on a connection of one channel")
        it = h.op_id
        at = self._rx_bytes[i] if self._rx_iter[i] == it and self._got[i] != it else 0
        self._check(h, i, at)
        if not at:
            with self._lock:
                self._rx_iter[i], self._rx_bytes[i], self._rx_first[i] = it, 0, first
                if self._active[i] == it:  # a send streaming from it may start
                    self._work.extend(u for u in self._users[i] if self._is_send[u])
                    self._drain(it)
        progress = self._progress_fn(i, it)

        def tick(n: int) -> None:
            self._rx_at = time.monotonic()
            progress(at + n)
        end = at + h.payload_len
        recv_into_exact(sock, memoryview(self._rbuf[i]).cast("B")[at:end], f"transfer {h.xfer}", tick,
                        lowat=RCV_LOWAT)
        self._rx_bytes[i] = end
        if end == self._rbuf[i].nbytes:
            self._arrived(i, it, end, (h.send_ts_ns, self._rx_first[i], time.time_ns(), False))

    def _withdrawn_arrived(self, sock: socket.socket, h: Header, i: int, first: int) -> None:
        """A withdrawn chunk of recv ``i`` (no payload: the receiver has it) arrived at ``first``."""
        self._check(h, i)
        if h.flags & FLAG_ACK_REQ:
            send_frame(sock, Header(ACK, op_id=h.op_id, xfer=h.xfer, send_ts_ns=first))
        self._arrived(i, h.op_id, 0, (h.send_ts_ns, first, first, True))

    def _progress_fn(self, i: int, it: int):
        """Called with the bytes of recv ``i``'s payload arrived so far: applies them a
        sub-block at a time once the op is active (cut-through)."""
        sub = self.subblock

        def progress(n: int) -> None:
            self._rx_bytes[i] = n
            self._progress = time.monotonic()
            if self._active[i] == it and n - self._applied[i] >= sub:
                with self._lock:
                    if self._active[i] == it:
                        self._apply(i, n)
        return progress

    def _arrived(self, i: int, it: int, nbytes: int, times: tuple) -> None:
        """Recv ``i``'s data of iteration ``it`` is all there (``times``: send_ts, first,
        last, withdrawn): it completes once active."""
        with self._lock:
            self._rx_iter[i], self._rx_bytes[i], self._got[i], self._rx_times[i] = it, nbytes, it, times
            if self._active[i] == it:
                self._finish_recv(i, it)
                self._drain(it)

    def _read(self, sock: socket.socket, h: Header, mv: memoryview, count, peer: str, ch: int, first: int) -> int:
        """Receive ``h``'s payload into ``mv`` (``count(bytes so far)``), feeding the probing
        hook (not with a chunk a relay passed on: it came at the pace of the hop before); the
        time the last byte arrived."""
        probe = self.on_chunk if not h.route or self.nodes[h.route[0]] == peer else None
        if not probe:
            def tick(n: int) -> None:
                self._rx_at = time.monotonic()
                count(n)
            recv_into_exact(sock, mv, f"transfer {h.xfer}", tick, lowat=RCV_LOWAT)
            return time.time_ns()
        mid, half, inner = [0, 0], mv.nbytes // 2, count

        def counted(n: int) -> None:
            self._rx_at = time.monotonic()
            inner(n)
            if not mid[1] and n >= half:
                mid[:] = time.time_ns(), n
        probe(peer, None)
        recv_into_exact(sock, mv, f"transfer {h.xfer}", counted, lowat=RCV_LOWAT)
        last = time.time_ns()
        probe(peer, (h.payload_len, h.send_ts_ns, first, last, ch, *mid))
        return last

    def _give_up(self, key: tuple[str, int], sock: socket.socket, box: _Outbox, item,
                 why: Exception) -> None:
        """The auxiliary connection ``key`` broke (``item`` was being sent): no more chunks
        to its peer over any lane; this node's own chunks queued for it go to their primary
        connections."""
        if self._closing:
            return
        peer = key[0]
        log.warning("auxiliary connection to %s (channel %d) broke (%s): %s not used again", peer, key[1],
                    why or type(why).__name__, peer)
        with self._lock:
            self._dead.add(peer)
            self._senders.pop(key, None)
            self._out_keys.discard(key)
            close_quietly(sock)  # called in the thread that owns ``sock``
            rest = ([item] if item is not None else []) + list(box.items)
            box.items.clear()
            for i, it, route, copy in rest:
                if i is None or it != self._run_it:  # a relayed chunk: its receiver asks for it again
                    continue
                op = self.prog[i]  # counted as a primary send from now on
                if i in self._on_route:
                    self._in_flight[self._on_route.pop(i)] -= 1
                self._load[op.peer] += 1
                self._log["aux"][:] = [a for a in self._log["aux"] if a[0] != op.xfer]
                self._put((op.peer, op.channel), (i, it, (), copy))

    def _receive_copy(self, sock: socket.socket, h: Header, i: int, peer: str, ch: int, first: int) -> None:
        """Receive a chunk that may arrive twice (over an auxiliary path, or re-sent on the
        primary after it was asked for) into a buffer of its own, and take the first copy
        whole: a second one, also after the iteration ended, is dropped."""
        payload = bytearray(h.payload_len)
        if h.payload_len != self._rbuf[i].nbytes:
            self._check(h, i)  # raises: the size is wrong
        last = self._read(sock, h, memoryview(payload), self._tick, peer, ch, first)
        with self._lock:
            if (i, h.op_id) in self._asked and (self._got[i] == h.op_id or h.op_id < self.iteration):
                log.info("dropped a second copy of transfer %d of iteration %d", h.xfer, h.op_id)
                return
            self._check(h, i)
            memoryview(self._rbuf[i]).cast("B")[:] = payload
            self._rx_iter[i], self._rx_bytes[i], self._got[i] = h.op_id, h.payload_len, h.op_id
            self._rx_times[i] = (h.send_ts_ns, first, last, False)
            if self._active[i] == h.op_id:
                self._finish_recv(i, h.op_id)
                self._drain(h.op_id)

    def resend(self, iteration: int, xfers: list[int]) -> int:
        """Send the kept copies of ``xfers`` of ``iteration`` (sent over auxiliary paths) again
        on their primary connections; how many there were (any thread)."""
        n = 0
        with self._lock:
            for x in xfers:
                it, i, copy = self._kept.get(x, (None, None, None))
                if it == iteration and (self.prog[i].peer, self.prog[i].channel) in self._senders:
                    op = self.prog[i]
                    self._put((op.peer, op.channel), (None, Header(
                        DATA, phase_code(op.phase), 0, it, op.xfer, op.flow, op.chunk, copy.nbytes), None, copy))
                    n += 1
        return n

    def _hop(self, h: Header, peer: str) -> tuple[str, str | None]:
        """(sender, next hop or None here) of an auxiliary chunk that came from ``peer``; its
        route must lead through this node, from ``peer``, without repeating a node."""
        route, me = h.route, self._index.get(self.name)
        names = [self.nodes[k] if k < len(self.nodes) else f"#{k}" for k in route]
        if not route or h.flags & FLAG_ACK_REQ or len(set(route)) < len(route) or len(names) > len(self.nodes) \
                or me not in route[1:] or names[route.index(me) - 1] != peer or any(n[0] == "#" for n in names):
            raise ProtocolError(f"auxiliary transfer {h.xfer} from {peer}: route {'>'.join(names) or 'none'} "
                                f"does not lead from {peer} through {self.name}")
        k = route.index(me)
        return names[0], (names[k + 1] if k + 1 < len(names) else None)


    def _forward(self, nxt: str, lane: int, h: Header, payload: Relayed) -> None:
        """Queue a relayed chunk to ``nxt`` on ``lane`` (connecting on first use)."""
        key = (nxt, lane)
        with self._connect_lock:
            if key not in self._senders and nxt not in self._dead:
                if self._connect is None:
                    raise ProtocolError(f"auxiliary transfer {h.xfer}: no connection to {nxt}")
                self.attach_outgoing(nxt, lane, self._connect(nxt, lane))
        with self._lock:  # as _give_up: nothing is queued for a connection once it is given up
            if nxt in self._dead:
                log.info("dropped auxiliary transfer %d: the connection to %s broke", h.xfer, nxt)
                return
            self._put(key, (None, h, None, payload))


    def _check(self, h: Header, i: int, at: int | None = None) -> None:
        """Every header field against recv op ``i`` (the transfer it names); ``at``: a piece
        of its data that follows the ``at`` bytes already arrived."""
        want = 0 if h.flags & FLAG_WITHDRAWN else self._rbuf[i].nbytes
        if at is not None and at + h.payload_len > want:
            raise ProtocolError(f"transfer {h.xfer}: a piece of {h.payload_len} bytes after {at} overruns its "
                                f"{want} bytes")
        if at is None and h.payload_len != want:
            raise ProtocolError(f"transfer {h.xfer} has {h.payload_len} bytes, expected {want}")
        if h.op_id < self.iteration:
            raise ProtocolError(f"late frame: transfer {h.xfer} of iteration {h.op_id} arrived in "
                                f"iteration {self.iteration}")
        if h.op_id > self.iteration:
            raise ProtocolError(f"early frame: transfer {h.xfer} of iteration {h.op_id} arrived in "
                                f"iteration {self.iteration}")
        if self._got[i] == h.op_id:
            raise ProtocolError(f"duplicate frame: transfer {h.xfer} of iteration {h.op_id} arrived twice")
        got = (h.phase, h.flow, h.chunk, h.flags & FLAG_ACK_REQ)
        if got != self._labels[i]:
            key, g, e = next(f for f in zip(("phase", "flow", "chunk", "flags"), got, self._labels[i]) if f[1] != f[2])
            raise ProtocolError(f"transfer {h.xfer}: {key} {g}, expected {e}")

    # -- main loop -----------------------------------------------------------------
    # -- dependencies (every method here runs under the lock) ----------------------
    def _cut_through_ok(self, i: int) -> bool:
        """Send ``i`` may start before its deps are met: cut-through is on, the send reads
        what a receive writes, is longer than a sub-block, and nothing needs it whole before it is written (an auxiliary
        copy, a CREW withdrawal or link turn, a probed receiver measuring this link's pace)."""
        return (self.cut_through and self._streams[i] and self._views[i].nbytes > self.subblock
                and self.withdraw is None and self.on_withdrawn is None
                and self._gate is None and self.on_chunk is None and not self._aux_routes.get(self.prog[i].peer))

    def _notify_users(self, i: int) -> None:
        """Wake the senders of the dispatched sends that read what recv ``i`` writes."""
        for u in self._users[i]:
            if self._dispatched[u] and self._done[u] != self._run_it:
                box = self._senders.get((self.prog[u].peer, self.prog[u].channel))
                if box:
                    box[1].cv.notify_all()

    def _apply(self, i: int, upto: int) -> None:
        """Apply bytes [applied, ``upto``) of recv ``i``'s data (whole elements) to its block."""
        size = self.dtype.itemsize
        a, b = self._applied[i] // size, upto // size
        if b <= a:
            return
        dst, src = self._views[i][a:b], self._rbuf[i][a:b]
        if self.prog[i].reduce:
            np.add(dst, src, out=dst)
        else:
            np.copyto(dst, src)
        self._applied[i] = b * size
        self._notify_users(i)

    def _activate(self, i: int, it: int) -> None:
        """Recv ``i``'s deps are met: what arrived of its data is applied, the rest as it comes."""
        self._active[i], self._applied[i] = it, 0
        if self._got[i] == it:
            self._finish_recv(i, it)
        elif self._rx_iter[i] == it:
            self._apply(i, self._rx_bytes[i])
            self._notify_users(i)
        self._work.extend(u for u in self._users[i] if self._is_send[u])

    def _finish_recv(self, i: int, it: int) -> None:
        """Recv ``i`` is active and its data all there: apply the rest, complete."""
        op = self.prog[i]
        send_ts, first, last, without = self._rx_times[i]
        if without:
            self._log["withdrawn"].append(op.xfer)
            data = self.on_withdrawn(op) if self.on_withdrawn is not None else None
            if data is not None:
                if op.reduce:
                    np.add(self._views[i], data, out=self._views[i])
                else:
                    np.copyto(self._views[i], data)
            self._applied[i] = self._rbuf[i].nbytes
        else:
            self._apply(i, self._rbuf[i].nbytes)
        self._log["recvs"].append([op.xfer, send_ts, first, last, time.time_ns()])
        self._complete(i, it)

    def _complete(self, i: int, it: int) -> None:
        self._done[i] = it
        self._ndone += 1
        self._queued.discard(i)
        self._progress = time.monotonic()
        for u in self._users[i]:
            self._wait[u] -= 1
            self._work.append(u)
        if self._ndone == len(self.prog):
            self._events.put(("done", it))

    def _drain(self, it: int) -> None:
        """Look at every op whose deps changed: activate receives whose deps are met, hand
        sends to their senders once their deps are met (or, cut-through, once every unmet
        dep is an active receive), wake the senders of sends already streaming."""
        if self._run_it != it:
            return
        while self._work:
            u = self._work.popleft()
            if self._done[u] == it:
                continue
            if not self._is_send[u]:
                if self._wait[u] == 0 and self._active[u] != it:
                    self._activate(u, it)
            elif self._dispatched[u]:
                box = self._senders.get((self.prog[u].peer, self.prog[u].channel))
                if box:
                    box[1].cv.notify_all()
            elif self._wait[u] == 0 or self._cut_through_ok(u) and all(
                    self._done[d] == it or not self._is_send[d] and self._active[d] == it == self._rx_iter[d]
                    for d in self._deps[u]):
                self._dispatch(u, it)

    def _dispatch(self, i: int, it: int) -> None:
        """Hand send ``i`` to a sender: the primary connection's, or an auxiliary path's
        (:meth:`_route`; only a send whose deps are met, since the path keeps a copy)."""
        op = self.prog[i]
        self._dispatched[i] = True
        self._queued.add(i)
        route = self._route(op, self._load, self._in_flight) if self._wait[i] == 0 else ()
        if route:
            copy = self._views[i].copy()  # kept for a re-send (sends read the buffer while they run)
            self._put((self.nodes[route[1]], AUX_CHANNEL), (i, it, route, copy))
            self._on_route[i] = route
            self._in_flight[route] += 1
            self._log["aux"].append([op.xfer, [self.nodes[k] for k in route]])
            self._kept[op.xfer] = (it, i, copy)
        else:
            self._load[op.peer] += 1
            if self._gate and not self._senders[(op.peer, op.channel)][1].ended:  # (else it would hold the link)
                self._tickets[i] = self._gate(op.peer).ticket(self)
            self._put((op.peer, op.channel), (i, it, (), None))
    def prepare(self, x: np.ndarray | None, shift: int = 0) -> None:
        """Reset buffers for the next iteration: ``x`` rotated by ``shift`` elements becomes the
        input (zeros if None; :mod:`agents.inputs`)."""
        if x is None:
            self.bufs["x"].fill(0)
        else:
            rotate_into(self.bufs["x"], x, shift)
        for name, b in self.bufs.items():
            if name != "x":
                b.fill(0)

    def advance(self, iteration: int) -> None:
        """The next iteration is ``iteration`` (another plan version ran the ones before):
        receivers accept its frames from now on and hold them until :meth:`run`."""
        if iteration > self.iteration:
            self.iteration = iteration

    def abort(self, reason: str) -> None:
        """Make a running (or the next) :meth:`run` fail with ``reason``."""
        self._events.put(("error", ExecError(reason)))

    def run(self, iteration: int) -> dict:
        """Execute the program once; return timings and, where the kernel counts it, what TCP's
        loss recovery cost this node's connections meanwhile (``tcp``).  Raises ExecError/ProtocolError."""
        started = time.monotonic()
        if iteration != self.iteration:
            raise ExecError(f"iteration {iteration} run out of order (expected {self.iteration})")
        missing = self._out_keys - self._senders.keys()
        if missing:
            raise ExecError(f"no data connection to {sorted(missing)}")
        comm_start = time.time_ns()
        self._tick()
        with self._lock:
            self._reset_run(iteration)
            log_ = self._log
            self._work.extend(range(len(self.prog)))
            self._drain(iteration)
        poll = min(1.0, self.timeout_s)
        while self.prog:
            try:
                ev = self._events.get(timeout=poll)
            except queue.Empty:
                if self._resend_after and time.monotonic() - self._rx_at > self._resend_after:
                    self._ask_missing(iteration)
                if time.monotonic() - self._progress > self.timeout_s:
                    raise Stalled(self._stall_message(self._queued, self._ndone)) from None
                if self.limit_s and time.monotonic() - started > self.limit_s:
                    raise Stalled(f"iteration {iteration} not done within its limit of {self.limit_s:g} s; "
                                  + self._stall_message(self._queued, self._ndone)) from None
                continue
            if ev[0] == "done":
                if ev[1] == iteration:
                    break
                continue
            raise ev[1]
        self.iteration = iteration + 1
        done_ns, tcp = time.time_ns(), self._tcp_since_last()
        return {"comm_start_ns": comm_start, "comm_done_ns": done_ns, "sends": log_["sends"],
                "recvs": log_["recvs"], **({"aux": log_["aux"]} if log_["aux"] else {}),
                **({"withdrawn": log_["withdrawn"]} if log_["withdrawn"] else {}),
                **({"tcp": tcp} if tcp is not None else {})}

    def _tcp_since_last(self) -> list[list] | None:
        """Per peer, what loss recovery cost this node's connections to it since the last call
        (:func:`tcp_losses`, summed over the connections): [[peer, segments retransmitted,
        timeouts, ms in timeout recovery]] where any is non-zero; None if the kernel does not
        count timeouts."""
        with self._lock:
            socks = {sock: peer for (peer, _), (sock, _) in self._senders.items()}
        out: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
        counted = False
        for sock, peer in socks.items():
            now = tcp_losses(sock)
            if now is None:
                continue
            counted = True
            last = self._tcp_seen.get(sock, (0, 0, 0))
            self._tcp_seen[sock] = now
            for j in range(3):
                out[peer][j] += now[j] - last[j]
        return [[peer, *v] for peer, v in sorted(out.items()) if any(v)] if counted else None

    def _ask_missing(self, iteration: int) -> None:
        """Ask once per iteration for the re-send of every transfer not arrived (its senders
        re-send those they sent over auxiliary paths; the others are still coming directly)."""
        with self._lock:
            missing = [i for i, op in enumerate(self.prog) if op.kind == RECV and self._got[i] != iteration
                       and (i, iteration) not in self._asked]
            self._asked.update((i, iteration) for i in missing)
        if missing:
            log.warning("iteration %d: no data for %.1f s; asking for %d transfers again", iteration,
                        time.monotonic() - self._rx_at, len(missing))
            self._on_missing(iteration, [[self.prog[i].peer, self.prog[i].xfer] for i in missing])

    def _route(self, op: Op, load: dict, in_flight: dict) -> tuple[int, ...]:
        """NetStorm §VI dispatch: () (the primary path: the direct connections to the peer,
        every channel) unless more than ``primary_busy_bound`` sends to the peer are queued on
        it; then the fastest auxiliary route to the peer with fewer than ``aux_queue_length``
        chunks in flight, if any.  With ``dispatch: eta`` (not in the paper: a relayed chunk
        that arrives late stalls the aggregation waiting for it) only a route on which the
        chunk would arrive before it would behind the primary's queue, by the plan's rates:
        delay + (chunks queued + 1) x size / bottleneck rate on each."""
        routes = self._aux_routes.get(op.peer)
        if not routes or load[op.peer] <= self._busy_bound:
            return ()
        ok = [r for r in routes if in_flight[r] < self._aux_queue and self.nodes[r[1]] not in self._dead]
        if self._eta and ok:
            mbit = op.length * self.dtype.itemsize * 8e-6
            eta = {r: d + (n + 1) * mbit / rate for r, (rate, d), n in
                   ((r, self._eta[r], in_flight[r]) for r in ok if r in self._eta)}
            rate, d = self._eta.get((self._index[self.name], self._index[op.peer]), (0.0, 0.0))
            primary = d + (load[op.peer] + 1) * mbit / rate if rate else float("inf")
            ok = [r for r in ok if eta.get(r, float("inf")) < primary]
        return ok[0] if ok else ()

    def status(self) -> dict:
        """What this node still waits for: ``awaiting`` {peer: [[xfer, bytes arrived, bytes]]}
        (data of the current iteration not yet received) and ``sending`` {peer: [[xfer,
        bytes sent, bytes]]} (sends handed over, not completed); ``idle_s`` since progress."""
        awaiting: dict[str, list] = defaultdict(list)
        sending: dict[str, list] = defaultdict(list)
        for i, op in enumerate(self.prog):
            if op.kind == RECV and self._got[i] != self.iteration:
                got = self._rx_bytes[i] if self._rx_iter[i] == self.iteration else 0
                awaiting[op.peer].append([op.xfer, got, int(self._rbuf[i].nbytes)])
        for i in sorted(self._queued):
            sending[self.prog[i].peer].append([self.prog[i].xfer, self._tx_bytes[i], int(self._views[i].nbytes)])
        return {"iteration": self.iteration, "idle_s": round(time.monotonic() - self._progress, 3),
                "awaiting": dict(awaiting), "sending": dict(sending)}


    def late_errors(self) -> list[str]:
        """Protocol violations threads posted after the last :meth:`run` returned (e.g. a late
        frame); peers closing their connections once done is no violation."""
        out = []
        while True:
            try:
                ev = self._events.get_nowait()
            except queue.Empty:
                return out
            if ev[0] == "error" and isinstance(ev[1], ProtocolError):
                out.append(f"{type(ev[1]).__name__}: {ev[1]}")

    def _stall_message(self, queued: set[int], done: int) -> str:
        awaited: dict[str, list[int]] = defaultdict(list)
        for i, op in enumerate(self.prog):
            if op.kind == RECV and self._got[i] != self.iteration:
                awaited[op.peer].append(op.xfer)
        unsent: dict[str, list[int]] = defaultdict(list)
        for i in queued:
            unsent[self.prog[i].peer].append(self.prog[i].xfer)
        msg = f"no progress for {self.timeout_s:g} s ({done}/{len(self.prog)} ops done)"
        if awaited:
            msg += f"; awaiting data from {_summary(awaited)}"
        if unsent:
            msg += f"; sends not completed to {_summary(unsent)}"
        return msg

    def close(self) -> None:
        """Stop all threads: their connections are shut down, and each thread closes its
        own socket as it ends."""
        with self._lock:
            self._closing = True
            for _, box in self._senders.values():
                box.cv.notify_all()
            for s in [s for s, _ in self._senders.values()] + list(self._receivers.values()):
                shutdown_quietly(s)
