"""One-way UDP probe for ``linkcheck``: delay, jitter and loss of one emulated direction.

Every network namespace of the emulator shares the machine's clock, so the kernel's receive
timestamp (``SO_TIMESTAMPNS``) minus the send time written in the datagram is the one-way
delay of each packet -- per direction, which neither ping (round trip) nor iperf3 (RFC 3550
interarrival jitter, no delay) measures.  Nothing here depends on TCP.

    python3 -m testbed.emulator.probe recv PORT --seconds S      # prints JSON
    python3 -m testbed.emulator.probe send ADDR PORT --pps N --seconds S [--size B]

With ``--ready`` each prints ``ready`` once its socket is set up, and the sender then waits
for a line on standard input before its first datagram: Python's start-up takes seconds on a
slow machine (4.6 s measured under qemu's TCG), so a caller that needs the probes in a given
window (``linkcheck``'s standing queue) starts both ahead and says "go" when the window opens.
"""

from __future__ import annotations

import argparse
import json
import select
import socket
import struct
import sys
import time

import numpy as np

from agents.clock import SO_TIMESTAMPNS, kernel_rx_ns

HEADER = struct.Struct("!QQ")  # sequence number, send time (ns, CLOCK_REALTIME)
SKIP = 10  # first packets left out of delay statistics by default (neighbour resolution may hold them)


READY_WAIT_S = 120  # the longest a --ready sender waits for its "go"


def _ready() -> None:
    print("ready", flush=True)


def send(addr: str, port: int, pps: float, seconds: float, size: int, ready: bool = False) -> dict:
    """Send ``pps`` datagrams a second for ``seconds`` (paced on a schedule, no catch-up
    bursts beyond one interval); return the count sent.  ``ready``: first say so and wait
    (at most READY_WAIT_S) for a line on standard input: ``go``, or ``go S`` to send for at
    most S seconds instead."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    pad = b"\0" * max(0, size - HEADER.size)
    if ready:
        _ready()
        line = select.select([sys.stdin], [], [], READY_WAIT_S)[0] and sys.stdin.readline()
        if not line:
            raise SystemExit(f"probe send: no go on standard input within {READY_WAIT_S} s")
        if line.split()[1:]:
            seconds = min(seconds, float(line.split()[1]))
    n = max(1, int(round(pps * seconds)))
    t0 = time.monotonic()
    for seq in range(n):
        wait = t0 + seq / pps - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        s.sendto(HEADER.pack(seq, time.time_ns()) + pad, (addr, port))
    return {"sent": n}


def recv(port: int, seconds: float, idle_s: float = 1.0, ready: bool = False, skip: int = SKIP,
         samples: bool = False) -> dict:
    """Receive until ``idle_s`` without a datagram (after the first) or ``seconds`` in all;
    return one-way delay statistics (ms) of the datagrams from sequence number ``skip`` on,
    and the sequence numbers seen; with ``samples`` also those delays (``owd_ms``, to 1 us,
    in arrival order)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    s.bind(("0.0.0.0", port))
    if ready:
        _ready()
    deadline = time.monotonic() + seconds
    seqs, owd = [], []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        s.settimeout(min(left, idle_s) if seqs else left)
        try:
            data, anc, _, _ = s.recvmsg(2048, socket.CMSG_SPACE(16))
        except socket.timeout:
            break
        if len(data) < HEADER.size:
            continue
        seq, sent_ns = HEADER.unpack_from(data)
        rx_ns = kernel_rx_ns(anc)
        rx_ns = time.time_ns() if rx_ns is None else rx_ns
        seqs.append(seq)
        owd.append((rx_ns - sent_ns) / 1e6)
    counted = [o for q, o in zip(seqs, owd) if q >= skip]
    return {"received": len(seqs), "unique": len(set(seqs)), "max_seq": max(seqs, default=-1),
            **owd_stats(counted), **({"owd_ms": [round(o, 3) for o in counted]} if samples else {})}


def owd_stats(owd: list[float]) -> dict:
    """mean, standard deviation, min, median, p99, max and interquartile range of one-way delays (ms)."""
    if not owd:
        return {"owd_n": 0}
    a = np.asarray(owd)
    return {"owd_n": int(a.size), "owd_mean_ms": float(a.mean()), "owd_std_ms": float(a.std(ddof=1)) if a.size > 1
            else 0.0, "owd_min_ms": float(a.min()), "owd_p50_ms": float(np.median(a)),
            "owd_p99_ms": float(np.percentile(a, 99)), "owd_max_ms": float(a.max()),
            "owd_iqr_ms": float(np.subtract(*np.percentile(a, [75, 25])))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m testbed.emulator.probe", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    r = sub.add_parser("recv")
    r.add_argument("port", type=int)
    r.add_argument("--seconds", type=float, required=True, help="give up after this long in all")
    r.add_argument("--idle", type=float, default=1.0, help="stop after this long without a datagram (default 1 s)")
    r.add_argument("--skip", type=int, default=SKIP,
                   help=f"leave the first datagrams out of the delay statistics (default {SKIP})")
    t = sub.add_parser("send")
    t.add_argument("addr")
    t.add_argument("port", type=int)
    t.add_argument("--pps", type=float, required=True)
    t.add_argument("--seconds", type=float, required=True)
    t.add_argument("--size", type=int, default=64, help="UDP payload bytes (>= 16)")
    r.add_argument("--samples", action="store_true", help="also print every one-way delay counted (owd_ms)")
    for p in (r, t):
        p.add_argument("--ready", action="store_true", help="print 'ready' when set up (send: then wait for a line)")
    a = ap.parse_args(argv)
    out = (recv(a.port, a.seconds, a.idle, ready=a.ready, skip=a.skip, samples=a.samples) if a.verb == "recv"
           else send(a.addr, a.port, a.pps, a.seconds, a.size, ready=a.ready))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
