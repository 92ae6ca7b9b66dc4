"""Wire format and authentication shared by agents and the coordinator.

Every message is a frame: a fixed 64-byte header followed by ``payload_len`` bytes.
The header is ``struct`` format ``HEADER_FMT`` (network byte order, no padding):

====  ======  =============  ====================================================
off   size    field          meaning
====  ======  =============  ====================================================
0     4       magic          ``b"TBW1"``
4     1       version        ``VERSION`` (1)
5     1       type           HELLO, AUTH, CTRL (JSON payload), DATA, ACK, ERROR (JSON)
6     1       phase          plan phase label as a small code (``PHASES``), 0 if none
7     1       flags          ``FLAG_ACK_REQ``: the receiver must answer with an ACK;
                             ``FLAG_AUX``: an auxiliary chunk, source-routed by ``route``;
                             ``FLAG_WITHDRAWN``: no payload, the receiver has the chunk already
                             (CREW's non-blocking scatter, §IV-A2);
                             ``FLAG_PIECE``: the payload is the next bytes of the transfer,
                             not all of it (a shared connection interleaves transfers' pieces)
8     4       op_id          iteration number
12    4       xfer           transfer id from the plan
16    4       flow           flow label from the plan
20    4       chunk          chunk label from the plan
24    8       payload_len    bytes following the header
32    8       send_ts_ns     sender's ``time.time_ns()`` when the send started
40    1       route_len      used entries of ``route`` (0: direct; else >= 3, with FLAG_AUX)
41    16      route          8 x u16 node indices of a source route (sender, relays, receiver;
                             NetStorm §VI: relays forward by it, not by a table), zero-filled
57    7       (reserved)     zero
====  ======  =============  ====================================================

Every field is checked on receipt (unknown flag bits, a non-zero reserved byte or an unused
route entry are refused); only ``send_ts_ns`` is a measurement that cannot be checked.

Receivers never allocate from an untrusted length: :func:`decode_header` rejects
``payload_len`` above a caller-given maximum, DATA payloads are read with
``recv_into`` straight into a preallocated buffer of the expected size, and CTRL
payloads are capped (``CTRL_MAX`` after authentication, ``AUTH_MAX`` before).

Authentication (every connection, :func:`server_handshake` / :func:`client_handshake`),
over a per-run shared secret, mutual:

1. server -> client  HELLO  nonce_s (16 random bytes)
2. client -> server  AUTH   mac_c (32) + nonce_c (16) + identity (JSON object)
                            mac_c = HMAC-SHA256(secret, "client" + nonce_s + nonce_c + identity)
3. server checks mac_c (``hmac.compare_digest``) and the identity, then
   server -> client  AUTH   mac_s = HMAC-SHA256(secret, "server" + nonce_s + nonce_c + identity)
   or ERROR with a reason and closes.
4. client checks mac_s.

A whole handshake has one deadline (``HANDSHAKE_TIMEOUT_S``), not one per read: a client
dripping a byte at a time is dropped when it passes.  Text a peer sends is untrusted:
:func:`sanitize` it before logging.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import json
import os
import select
import socket
import struct
import threading
import time
from typing import Callable, NamedTuple

MAGIC = b"TBW1"
VERSION = 1
HEADER_FMT = "!4sBBBBIIIIQQB8H7s"
HEADER = struct.Struct(HEADER_FMT)
HEADER_SIZE = HEADER.size  # 64
ROUTE_MAX = 8

HELLO, AUTH, CTRL, DATA, ACK, ERROR = 1, 2, 3, 4, 5, 6
TYPE_NAMES = {HELLO: "HELLO", AUTH: "AUTH", CTRL: "CTRL", DATA: "DATA", ACK: "ACK", ERROR: "ERROR"}
FLAG_ACK_REQ = 0x01
FLAG_AUX = 0x02
FLAG_WITHDRAWN = 0x04
FLAG_PIECE = 0x08
FLAGS_KNOWN = FLAG_ACK_REQ | FLAG_AUX | FLAG_WITHDRAWN | FLAG_PIECE
RESERVED = bytes(7)

PHASES = ("", "reduce", "bcast", "reduce-scatter", "all-gather", "scatter", "gather", "relay")
PHASE_OTHER = 255

NONCE_LEN = 16
MAC_LEN = 32
AUTH_MAX = 4096  # payload cap before authentication
CTRL_MAX = 64 << 20  # payload cap for CTRL/ERROR frames
HANDSHAKE_TIMEOUT_S = 10.0
SEND_SLICE = 4 << 20  # bytes per sendmsg when reporting progress
TRICKLE_S = 0.25  # a payload read under a low-water mark takes what came at least this often

assert HEADER_SIZE == 64


class ProtocolError(Exception):
    """A peer sent something malformed or unexpected, or failed authentication; ``peer``: the
    plan node that sent it, where known (the coordinator lays the failure to it)."""

    def __init__(self, message: str = "", peer: str | None = None):
        super().__init__(message)
        self.peer = peer


class Closed(ConnectionError):
    """The peer closed the connection cleanly at a frame boundary."""


class Truncated(ProtocolError):
    """The connection closed in the middle of a frame."""


def sanitize(text, limit: int = 300) -> str:
    """Untrusted text made safe to log on one line: control and non-ASCII characters escaped
    (no forged log lines, no terminal escapes), at most ``limit`` characters kept."""
    text = text if isinstance(text, str) else str(text)
    out = text[:limit].encode("ascii", "backslashreplace").decode("ascii")
    out = "".join(c if 32 <= ord(c) < 127 else f"\\x{ord(c):02x}" for c in out)
    return out + (f"... ({len(text)} characters)" if len(text) > limit else "")


class Header(NamedTuple):
    type: int
    phase: int = 0
    flags: int = 0
    op_id: int = 0
    xfer: int = 0
    flow: int = 0
    chunk: int = 0
    payload_len: int = 0
    send_ts_ns: int = 0
    route: tuple[int, ...] = ()


def phase_code(phase: str) -> int:
    return PHASES.index(phase) if phase in PHASES else PHASE_OTHER


def encode_header(h: Header) -> bytes:
    route = tuple(h.route)
    if len(route) > ROUTE_MAX:
        raise ValueError(f"source route longer than {ROUTE_MAX} hops")
    return HEADER.pack(MAGIC, VERSION, h.type, h.phase, h.flags, h.op_id, h.xfer, h.flow,
                       h.chunk, h.payload_len, h.send_ts_ns, len(route),
                       *(route + (0,) * (ROUTE_MAX - len(route))), RESERVED)


def decode_header(buf, max_payload: int) -> Header:
    """Parse and validate a 64-byte header; raise ProtocolError if it is not acceptable."""
    if len(buf) != HEADER_SIZE:
        raise ProtocolError(f"header is {len(buf)} bytes, expected {HEADER_SIZE}")
    (magic, version, typ, phase, flags, op_id, xfer, flow, chunk, plen, ts, rlen,
     *route, reserved) = HEADER.unpack(buf)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise ProtocolError(f"unsupported version {version} (expected {VERSION})")
    if typ not in TYPE_NAMES:
        raise ProtocolError(f"unknown frame type {typ}")
    if plen > max_payload:
        raise ProtocolError(f"{TYPE_NAMES[typ]} payload of {plen} bytes exceeds the limit of {max_payload}")
    if rlen > ROUTE_MAX:
        raise ProtocolError(f"route length {rlen} exceeds {ROUTE_MAX}")
    if any(route[rlen:]):
        raise ProtocolError(f"unused route entries are not zero (route length {rlen})")
    if flags & ~FLAGS_KNOWN:
        raise ProtocolError(f"unknown flags 0x{flags:02x}")
    if bool(flags & FLAG_AUX) != (rlen > 0) or rlen in (1, 2):
        raise ProtocolError(f"route of {rlen} nodes with flags 0x{flags:02x} (an auxiliary chunk has "
                            "FLAG_AUX and a route of sender, relays and receiver; a direct one neither)")
    if flags & FLAG_WITHDRAWN and (plen or rlen or typ != DATA):
        raise ProtocolError(f"a withdrawn transfer is a DATA frame without payload or route, got "
                            f"{TYPE_NAMES[typ]} with {plen} bytes and a route of {rlen}")
    if flags & FLAG_PIECE and (flags & ~FLAG_PIECE or rlen or typ != DATA):
        raise ProtocolError(f"a piece is a DATA frame of a direct transfer without other flags, got "
                            f"{TYPE_NAMES[typ]} with flags 0x{flags:02x} and a route of {rlen}")
    if phase >= len(PHASES) and phase != PHASE_OTHER:
        raise ProtocolError(f"unknown phase code {phase}")
    if reserved != RESERVED:
        raise ProtocolError("reserved header bytes are not zero")
    return Header(typ, phase, flags, op_id, xfer, flow, chunk, plen, ts, tuple(route[:rlen]))


# -- socket I/O ----------------------------------------------------------------
def time_left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (monotonic; None: no deadline, None back); socket.timeout if
    it has passed."""
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise socket.timeout("deadline passed")
    return left


def arm(sock: socket.socket, deadline: float | None) -> None:
    """Before one blocking call: give ``sock`` the time left until ``deadline`` (monotonic;
    None: leave the socket's timeout as it is); socket.timeout if it has passed."""
    left = time_left(deadline)
    if left is not None:
        sock.settimeout(left)


def recv_into_exact(sock: socket.socket, mv: memoryview, what: str = "payload",
                    progress: Callable[[int], None] | None = None, deadline: float | None = None,
                    lowat: int = 1) -> None:
    """Fill ``mv`` (a byte memoryview) from ``sock``; raise ProtocolError on early EOF.
    ``progress(bytes so far)`` is called after every successful ``recv_into``.

    ``lowat`` > 1: the thread sleeps in ``poll`` until ``min(lowat, bytes still to come)`` have
    arrived (the socket's ``SO_RCVLOWAT``; never more than the bytes still to come, so the last
    ones are not held) or ``TRICKLE_S`` passed (a trickle below the mark is still read and
    reported), then takes what is there without waiting: the kernel wakes it once per that
    many bytes rather than per segment or two (each wakeup a context switch and a hand-over of
    the interpreter's lock).  Never a blocking ``recv`` under a mark: the kernel compares its
    mark with the bytes not yet read, so a ``recv`` that had taken part of them would sleep
    until more than the frame's rest arrived.  The mark is 1 again on return."""
    n, pos, mark = mv.nbytes, 0, 1
    poller = None
    if lowat > 1:
        poller = select.poll()
        poller.register(sock, select.POLLIN)
    try:
        while pos < n:
            if poller:
                want = min(lowat, n - pos)
                if want != mark:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
                    mark = want
                wait_readable(poller, deadline, TRICKLE_S)
                try:
                    got = sock.recv_into(mv[pos:], n - pos, socket.MSG_DONTWAIT)
                except BlockingIOError:  # nothing arrived while it waited
                    continue
            else:
                arm(sock, deadline)
                got = sock.recv_into(mv[pos:], n - pos)
            if not got:
                raise Truncated(f"connection closed in the middle of a {what} ({pos} of {n} bytes)")
            pos += got
            if progress:
                progress(pos)
    finally:
        if mark != 1:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)


def wait_readable(poller: select.poll, deadline: float | None, limit_s: float) -> None:
    """Sleep in ``poller`` (one socket) until it is readable or closed, or ``limit_s`` passed;
    socket.timeout once ``deadline`` (monotonic; None: none) has passed."""
    left = time_left(deadline)
    wait_s = limit_s if left is None else min(limit_s, left)
    poller.poll(max(1, int(wait_s * 1000)))


def recv_header(sock: socket.socket, buf: bytearray, max_payload: int, deadline: float | None = None) -> Header:
    """Read one header into ``buf`` (64 bytes, reused).  Raises Closed on a clean EOF."""
    mv = memoryview(buf)
    arm(sock, deadline)
    got = sock.recv_into(mv, HEADER_SIZE)
    if not got:
        raise Closed("connection closed by peer")
    if got < HEADER_SIZE:
        recv_into_exact(sock, mv[got:], "header", deadline=deadline)
    return decode_header(buf, max_payload)


def send_frame(sock: socket.socket, header: Header, payload=None,
               progress: Callable[[int], None] | None = None, deadline: float | None = None) -> None:
    """Send header + payload with ``sendmsg`` (no copy of the payload), looping on partial sends.

    ``payload`` is anything exposing a C-contiguous buffer (bytes, a numpy slice).  With
    ``progress``, the payload goes in slices of at most ``SEND_SLICE`` bytes and
    ``progress(payload bytes sent)`` is called after each ``sendmsg`` (a long send still shows
    progress).  A send blocked longer than the socket's timeout raises socket.timeout."""
    hdr = encode_header(header)
    if payload is None:
        payload = b""
    body = memoryview(payload).cast("B")
    hlen, total, off = len(hdr), len(hdr) + body.nbytes, 0
    step = SEND_SLICE if progress else total
    while off < total:
        start = max(0, off - hlen)
        parts = [body[start:start + step]]
        if off < hlen:
            parts.insert(0, memoryview(hdr)[off:])
        arm(sock, deadline)
        off += sock.sendmsg(parts)
        if progress:
            progress(max(0, off - hlen))


def send_json(sock: socket.socket, obj, typ: int = CTRL, op_id: int = 0) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    send_frame(sock, Header(typ, op_id=op_id, payload_len=len(data), send_ts_ns=time.time_ns()), data)


def recv_payload(sock: socket.socket, h: Header, deadline: float | None = None) -> bytes:
    """Read a (size-capped, already validated) control payload."""
    buf = bytearray(h.payload_len)
    recv_into_exact(sock, memoryview(buf), deadline=deadline)
    return bytes(buf)


def loads(data: bytes):
    """JSON from a peer; ProtocolError for anything malformed, including nesting too deep
    for the parser (RecursionError)."""
    try:
        return json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ProtocolError(f"malformed JSON payload: {sanitize(e, 120)}") from None


def recv_json(sock: socket.socket, max_payload: int = CTRL_MAX) -> tuple[Header, dict]:
    """Read one CTRL or ERROR frame and return (header, decoded JSON object)."""
    h = recv_header(sock, bytearray(HEADER_SIZE), max_payload)
    if h.type not in (CTRL, ERROR):
        raise ProtocolError(f"expected a CTRL frame, got {TYPE_NAMES[h.type]}")
    obj = loads(recv_payload(sock, h))
    if not isinstance(obj, dict):
        raise ProtocolError("CTRL payload is not a JSON object")
    return h, obj


def tune(sock: socket.socket) -> None:
    """TCP_NODELAY; buffer sizes are left to the kernel (autotuning, sysctls)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# -- authentication --------------------------------------------------------------
def as_secret(secret: bytes | str) -> bytes:
    """The shared secret as bytes, surrounding whitespace (a file's newline) removed."""
    secret = (secret.encode() if isinstance(secret, str) else bytes(secret)).strip()
    if not secret:
        raise ValueError("the shared secret is empty")
    return secret


def load_secret(path: str) -> bytes:
    with open(path, "rb") as f:
        return as_secret(f.read())


def _mac(secret: bytes, role: bytes, nonce_s: bytes, nonce_c: bytes, ident: bytes) -> bytes:
    return hmac.new(secret, role + nonce_s + nonce_c + ident, hashlib.sha256).digest()


def _recv_small(sock: socket.socket, want: int, deadline: float | None) -> bytes:
    h = recv_header(sock, bytearray(HEADER_SIZE), AUTH_MAX, deadline)
    if h.type == ERROR:
        raise ProtocolError(f"refused by peer: {sanitize(recv_payload(sock, h, deadline).decode(errors='replace'))}")
    if h.type != want:
        raise ProtocolError(f"expected {TYPE_NAMES[want]} during handshake, got {TYPE_NAMES[h.type]}")
    return recv_payload(sock, h, deadline)


def server_handshake(sock: socket.socket, secret: bytes, check: Callable[[dict], None] | None = None,
                     deadline: float | None = None) -> dict:
    """Authenticate the client on ``sock``; return its identity dict.

    ``check(identity)`` may raise ProtocolError to refuse an unexpected identity.  On any
    failure an ERROR frame is sent (best effort) and ProtocolError raised; the caller
    closes the socket.  ``deadline`` (monotonic) bounds the whole exchange."""
    nonce_s = os.urandom(NONCE_LEN)
    send_frame(sock, Header(HELLO, payload_len=NONCE_LEN), nonce_s, deadline=deadline)
    body = _recv_small(sock, AUTH, deadline)
    mac, nonce_c, ident = body[:MAC_LEN], body[MAC_LEN:MAC_LEN + NONCE_LEN], body[MAC_LEN + NONCE_LEN:]
    try:
        if len(nonce_c) != NONCE_LEN or not hmac.compare_digest(
                mac, _mac(secret, b"client", nonce_s, nonce_c, ident)):
            raise ProtocolError("authentication failed (wrong or missing secret)")
        try:
            identity = loads(ident)
        except ProtocolError:
            identity = None
        if not isinstance(identity, dict):
            raise ProtocolError("malformed identity")
        if check:
            check(identity)
    except ProtocolError as e:
        try:
            send_frame(sock, Header(ERROR, payload_len=len(str(e).encode())), str(e).encode(), deadline=deadline)
        except OSError:
            pass
        raise
    reply = _mac(secret, b"server", nonce_s, nonce_c, ident)
    send_frame(sock, Header(AUTH, payload_len=MAC_LEN), reply, deadline=deadline)
    return identity


def client_handshake(sock: socket.socket, secret: bytes, identity: dict, deadline: float | None = None) -> None:
    """Authenticate to the server on ``sock`` as ``identity`` and check the server's proof."""
    nonce_s = _recv_small(sock, HELLO, deadline)
    if len(nonce_s) != NONCE_LEN:
        raise ProtocolError("malformed HELLO")
    nonce_c = os.urandom(NONCE_LEN)
    ident = json.dumps(identity, separators=(",", ":"), sort_keys=True).encode()
    body = _mac(secret, b"client", nonce_s, nonce_c, ident) + nonce_c + ident
    send_frame(sock, Header(AUTH, payload_len=len(body)), body, deadline=deadline)
    proof = _recv_small(sock, AUTH, deadline)
    if not hmac.compare_digest(proof, _mac(secret, b"server", nonce_s, nonce_c, ident)):
        raise ProtocolError("server failed authentication (wrong secret?)")


def connect(addr: tuple[str, int], secret: bytes, identity: dict, *, timeout_s: float = HANDSHAKE_TIMEOUT_S,
            retry_s: float = 0.0, source: str | None = None) -> socket.socket:
    """Open a TCP connection to ``addr`` and authenticate within ``timeout_s`` (one deadline
    for connect and handshake); retry for ``retry_s`` while the server is not listening yet
    or drops the connection before authenticating (it is busy: at its cap of pending
    handshakes).  ``source``: the local address to send from (a path's, where the network
    routes by source address).  Errors say the address; a wrong secret is not retried."""
    give_up = time.monotonic() + retry_s
    where = f"{addr[0]}:{addr[1]}"
    while True:
        deadline = time.monotonic() + timeout_s
        sock = None
        try:
            sock = socket.create_connection(addr, timeout=timeout_s, source_address=(source, 0) if source else None)
            tune(sock)
            client_handshake(sock, secret, identity, deadline)
            sock.settimeout(None)
            return sock
        except ProtocolError as e:
            close_quietly(sock)
            raise ProtocolError(f"{where}: {e}") from None
        except (OSError, ValueError) as e:
            close_quietly(sock)
            if time.monotonic() >= give_up or isinstance(e, socket.timeout):
                raise ConnectionError(f"cannot connect to {where}: {type(e).__name__}: {e}") from None
            time.sleep(0.1)


def shutdown_quietly(sock: socket.socket) -> None:
    """Shut down both ways: a thread blocked in recv/send on ``sock`` returns."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def close_quietly(sock: socket.socket | None) -> None:
    """Shut down (unblocking any thread in recv/send on it) and close."""
    if sock is None:
        return
    shutdown_quietly(sock)
    sock.close()


class Gate:
    """A fixed cap on unauthenticated connections: ``admit()`` is False when ``limit``
    handshakes are already pending (the caller refuses the connection at once)."""

    def __init__(self, limit: int):
        self._slots = threading.BoundedSemaphore(limit)

    def admit(self) -> bool:
        return self._slots.acquire(blocking=False)

    def release(self) -> None:
        self._slots.release()


def serve(listener: socket.socket, gate: Gate, handshake: Callable[[socket.socket, tuple], None],
          stopping: Callable[[], bool], log) -> None:
    """Accept loop: one short-lived thread per admitted connection runs ``handshake(sock,
    addr)`` (which must bound itself with a deadline); connections over the cap are closed
    at once.  Survives any exception (a thread that cannot start, too many open files);
    returns when the listener is closed or ``stopping()``."""
    def run(sock, addr):
        try:
            handshake(sock, addr)
        except BaseException as e:  # never let a handshake thread die silently
            log.error("handshake with %s:%s failed: %s: %s", addr[0], addr[1], type(e).__name__, sanitize(e))
            close_quietly(sock)
        finally:
            gate.release()

    while not stopping():
        try:
            sock, addr = listener.accept()
        except OSError as e:
            if stopping() or listener.fileno() < 0 or e.errno in (errno.EBADF, errno.EINVAL):
                return
            log.warning("accept failed: %s", e)  # e.g. EMFILE: back off, keep serving
            time.sleep(0.05)
            continue
        if not gate.admit():
            log.warning("refused connection from %s:%s: too many pending handshakes", *addr[:2])
            close_quietly(sock)
            continue
        try:
            threading.Thread(target=run, args=(sock, addr), daemon=True, name="handshake").start()
        except BaseException as e:
            gate.release()
            close_quietly(sock)
            log.warning("refused connection from %s:%s: %s", addr[0], addr[1], e)
