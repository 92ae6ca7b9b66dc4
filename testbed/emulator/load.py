"""TCP load for ``linkcheck``: one process per datacenter sends to and receives from all its
measured neighbours at once, and reports each incoming direction's goodput.

One iperf3 client and one server per direction cost 564 processes on ``equinix-like-20``
(282 directions), started one by one.  Here a datacenter is one process with one event loop, and
each receiving socket wakes it only once ``RCV_WAKE_S`` of its link's data is queued
(``SO_RCVLOWAT``), so wake-ups scale with the data, not with the packets.

    python3 -m testbed.emulator.load PORT --name N --omit O --seconds S \\
        [--flow ADDR,RATE_MBPS,CC,STREAMS ...]

The process binds PORT, prints ``ready``, and waits (at most READY_WAIT_S) for ``go T0`` on
standard input, T0 a CLOCK_REALTIME epoch shared by every namespace; then it connects its
flows (TCP congestion control CC, STREAMS connections each) and sends until the window
[T0 + O, T0 + O + S] has passed.  Bytes read in that window count; it prints one JSON line
``{"received": {SRC: {"bytes", "mbps", "per_s": [...], "acks"}}, "refused": n}``, ``acks`` being
the segments this side sent back to SRC in the window (TCP_INFO ``tcpi_segs_out`` of its receiving
sockets: their ACKs, which share the reverse direction's link).  Each connection
starts with a fixed-size header naming its sender and rate; a connection whose header is
malformed is closed and counted in ``refused``.  At the end every connection is reset (an
abortive close): a graceful one left the senders' queued megabytes to orphaned sockets that
outlived the emulated network for minutes (GScale: 4 orphans, 107 MB, after one check), on top
of the ~1 GB of TCP memory a check takes against tcp_mem's pressure mark (1.5 GB on a 24 GB
machine); in five consecutive GScale checks the 4th and 5th read their long-RTT links at
0.17-0.57 of their rate, likely that pressure; with resets, 5 of 5 passed and no orphan was left.

The load should cost the machine as little as possible, since its CPU is the emulator's: data
is sent with ``sendfile`` from a memfd of zeros (the socket takes references to its pages, no
copy) and read with ``MSG_TRUNC`` (TCP drops it without copying).  Copying in and out had taken
3.6 % of the machine's CPU samples in a NetStorm check at scale 1 (perf, 2 vCPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import socket
import struct
import sys
import time

HEADER_LEN = 64  # "<sender name> <rate in Mbit/s>", space-padded
READY_WAIT_S = 120  # the longest the process waits for its "go"
RCV_WAKE_S = 0.01  # a receiving socket wakes the loop once this much of its link's data is queued
SEND_BYTES = 1 << 18  # bytes offered to a sending socket per call
TAIL_S = 0.5  # sending goes on this long after the window, so that the window ends under load
_TCPI_SEGS_OUT = 136  # offset of tcpi_segs_out in struct tcp_info (linux/tcp.h, since 4.2)


def header(name: str, rate_mbps: float) -> bytes:
    h = f"{name} {rate_mbps:.6g}".encode()
    if len(h) > HEADER_LEN or b"\n" in h:
        raise ValueError(f"load: sender name {name!r} too long for the {HEADER_LEN}-byte header")
    return h.ljust(HEADER_LEN)


def parse_header(raw: bytes) -> tuple[str, float]:
    """(sender, rate Mbit/s) from a connection's first HEADER_LEN bytes; ValueError if malformed."""
    parts = raw.decode("ascii").split()
    if len(parts) != 2:
        raise ValueError(f"malformed load header {raw[:HEADER_LEN]!r}")
    rate = float(parts[1])
    if not 0 < rate < 1e6:
        raise ValueError(f"load header rate {parts[1]!r} out of range")
    return parts[0], rate


def rcvlowat(rate_mbps: float) -> int:
    """SO_RCVLOWAT for a link of ``rate_mbps``: RCV_WAKE_S of its data, 4 KB to 32 KB (a window
    edge then miscounts at most that much: 10 ms of a 6 s window, 0.2 %).  At most 32 KB: a low
    mark whose buffer space exceeds the socket's initial receive buffer (128 KB) also clamps the
    receive window to the mark (Linux ``tcp_set_rcvlowat``), and on crew-mesh-8 a 125 Mbit/s
    direction whose ACKs queued behind the reverse direction's data then read 0.62 of its rate."""
    return int(min(32 << 10, max(4096, rate_mbps * 1e6 / 8 * RCV_WAKE_S)))


class _Conn:
    def __init__(self, sock: socket.socket):
        self.sock, self.head, self.src = sock, b"", None
        self.segs_out = None  # segments sent back, at the last read in the window


def segs_out(sock: socket.socket) -> int:
    """Segments ``sock`` has sent (a receiving socket sends ACKs only)."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCPI_SEGS_OUT + 4)
    return struct.unpack_from("I", info, _TCPI_SEGS_OUT)[0]


def run(port: int, name: str, flows: list[tuple[str, float, str, int]], omit: float, seconds: float,
        bind: str = "0.0.0.0", stdin=sys.stdin, emit=print) -> dict:
    """Bind ``port``, say ``ready``, wait for ``go T0``, then send ``flows`` and count what
    arrives in the window [T0 + omit, T0 + omit + seconds] (see the module's docstring)."""
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind((bind, port))
    lsock.listen(256)
    lsock.setblocking(False)
    emit("ready", flush=True)
    sel = selectors.DefaultSelector()
    t0 = _await_go(sel, stdin, name)
    window = _Window(t0 + omit, t0 + omit + seconds, seconds)
    sel.register(lsock, selectors.EVENT_READ, "listen")
    _connect(sel, flows, name, port)
    zeros = os.memfd_create("testbed-load-zeros")
    os.ftruncate(zeros, SEND_BYTES)
    # one event a wake-up (RCV_WAKE_S of a link's data, or SEND_BYTES sent): a step's call costs
    # next to nothing beside its system calls
    while (now := time.time()) < window.end + TAIL_S:
        for key, _ in sel.select(min(1.0, window.end + TAIL_S - now)):
            now = time.time()
            if key.data == "listen":
                _accept(sel, lsock)
            elif isinstance(key.data, list):  # a sending socket: the rest of its header, then zeros
                _send(sel, key, zeros)
            else:
                window.read(sel, key.data, now)
    for key in list(sel.get_map().values()):
        if key.fileobj is not lsock:
            _reset(key.fileobj)
    lsock.close()
    os.close(zeros)
    return window.result()


def _await_go(sel: selectors.BaseSelector, stdin, name: str) -> float:
    """T0 of the ``go T0`` line on ``stdin``; SystemExit if none came within READY_WAIT_S."""
    sel.register(stdin, selectors.EVENT_READ)
    ready = sel.select(READY_WAIT_S)
    line = stdin.readline().split() if ready else []
    if len(line) != 2 or line[0] != "go":
        raise SystemExit(f"load on {name}: no 'go T0' on standard input within {READY_WAIT_S} s")
    sel.unregister(stdin)
    return float(line[1])


def _connect(sel: selectors.BaseSelector, flows: list[tuple[str, float, str, int]], name: str, port: int) -> None:
    """Start connecting every stream of every flow (its congestion control set), each with its
    header to send first."""
    for addr, rate, cc, streams in flows:
        for _ in range(streams):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, cc.encode())
            s.setblocking(False)
            s.connect_ex((addr, port))
            pending = memoryview(header(name, rate / streams))
            sel.register(s, selectors.EVENT_WRITE, [pending])  # [what is left of its header]


def _accept(sel: selectors.BaseSelector, lsock: socket.socket) -> None:
    try:
        s, _ = lsock.accept()
    except BlockingIOError:
        return
    s.setblocking(False)
    sel.register(s, selectors.EVENT_READ, _Conn(s))


def _send(sel: selectors.BaseSelector, key: selectors.SelectorKey, zeros: int) -> None:
    """A sending socket is writable: the rest of its header, else SEND_BYTES of zeros."""
    head = key.data[0]
    try:
        if head:
            key.data[0] = head[key.fileobj.send(head):]
        else:
            os.sendfile(key.fileobj.fileno(), zeros, 0, SEND_BYTES)
    except (BlockingIOError, InterruptedError):
        pass
    except OSError:  # refused or reset: the receiver counts what arrived
        sel.unregister(key.fileobj)
        key.fileobj.close()


class _Window:
    """What the receiving connections read: per sender the bytes in the counted window
    [start, end), per second too, and the ACKs sent back meanwhile; and the connections refused."""

    def __init__(self, start: float, end: float, seconds: float):
        self.start, self.end, self.seconds = start, end, seconds
        self.buf = bytearray(1 << 20)
        self.received: dict[str, dict] = {}
        self.refused = 0

    def read(self, sel: selectors.BaseSelector, c: _Conn, now: float) -> None:
        """A receiving connection is readable: its header first, then data counted, not copied."""
        buf = self.buf
        try:
            if c.src is None:
                n = c.sock.recv_into(buf, HEADER_LEN - len(c.head))
            else:  # counted, not copied
                n = c.sock.recv_into(buf, len(buf), socket.MSG_TRUNC)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            n = 0
        if n == 0:
            sel.unregister(c.sock)
            c.sock.close()
        elif c.src is None:
            self._header(sel, c, bytes(buf[:n]))
        elif self.start <= now < self.end:
            r = self.received[c.src]
            r["bytes"] += n
            r["per_s"][min(len(r["per_s"]) - 1, int(now - self.start))] += n
            sent = segs_out(c.sock)
            if c.segs_out is not None:  # the ACKs sent since the previous read in the window
                r["acks"] += sent - c.segs_out
            c.segs_out = sent

    def _header(self, sel: selectors.BaseSelector, c: _Conn, part: bytes) -> None:
        """More of a connection's header; once whole, its sender (a malformed one: refused)."""
        c.head += part
        if len(c.head) != HEADER_LEN:
            return
        try:
            c.src, rate = parse_header(c.head)
        except (ValueError, UnicodeDecodeError):
            self.refused += 1
            sel.unregister(c.sock)
            c.sock.close()
            return
        c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, rcvlowat(rate))
        self.received.setdefault(c.src, {"bytes": 0, "per_s": [0] * max(1, int(self.seconds + 0.999)), "acks": 0})

    def result(self) -> dict:
        for r in self.received.values():
            r["mbps"] = r["bytes"] * 8 / self.seconds / 1e6
            r["per_s"] = [round(b * 8 / 1e6, 3) for b in r["per_s"]]
        return {"received": self.received, "refused": self.refused}


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with a reset (SO_LINGER 0): its queued data is dropped, not orphaned."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


def _flow(text: str) -> tuple[str, float, str, int]:
    addr, rate, cc, streams = text.split(",")
    return addr, float(rate), cc, int(streams)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m testbed.emulator.load", description=__doc__.splitlines()[0])
    ap.add_argument("port", type=int)
    ap.add_argument("--name", required=True, help="this datacenter (named in each connection's header)")
    ap.add_argument("--bind", default="0.0.0.0", help="listening address (default: every address)")
    ap.add_argument("--omit", type=float, default=0.0, help="seconds after T0 not counted (TCP's start-up)")
    ap.add_argument("--seconds", type=float, required=True, help="the counted window")
    ap.add_argument("--flow", type=_flow, action="append", default=[],
                    help="ADDR,RATE_MBPS,CC,STREAMS: load one neighbour (RATE sets its receiver's wake-ups)")
    a = ap.parse_args(argv)
    print(json.dumps(run(a.port, a.name, a.flow, a.omit, a.seconds, a.bind)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
