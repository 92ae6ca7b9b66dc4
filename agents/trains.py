"""Packet trains: the capacity of a directed link, whatever the data plan leaves on it.

Passive probing (:mod:`agents.probe`, NetStorm §V) can only see what the trees send: a link
the current plan leaves idle is never measured, and a link the trees use lightly between
chunks reads as their demand, not its rate (measured on netstorm-dynamic: no queue ever
builds, per-window goodput median 0.87 of the rate).  A planner fed such estimates moves
traffic off a link that merely carried little, and never learns better.  So every agent also
sends, on each WAN link it is an end of, a short train of back-to-back UDP datagrams at a
bounded duty cycle (``train_duty``: share of the link's configured rate, default 0.8 %; the
issue allows 1 %); the link's shaper spaces them at its rate, and the receiver reads the rate
from the spacing -- packet-train dispersion, the classic capacity estimate (Dovrolis et al.,
"Packet-dispersion techniques and a capacity-estimation methodology", ToN 2004).  Our choice,
not in the NetStorm paper (which has no idle-link probing besides auxiliary paths' traffic).

Rate: from the received datagrams of the train's second half (a shaper's burst allowance and
the sender's start let the first ones through faster), the median of ``h x frame / (t_(i+h) -
t_i)`` over its pairs h apart in arrival order (:func:`train_rate`) -- drops at the shaper's
queue cost no link time, so only received datagrams count.  Only pairs the link spread out
count: their receive span at least DISPERSED times their send span (every datagram carries its
send time).  A pair that arrived no slower than it was sent measured the sender (descheduled
mid-train: Python hands the interpreter to another thread every 5 ms) or a burst (a relay or
receiver held datagrams, then passed them on together: read 2-15x the rate on this testbed),
not the link; so do pairs that start or end among datagrams handed over together mid-train
(:func:`burst_members`); a train with fewer than half its pairs left gives no rate.  So a train
measures links slower than its sender (~1 Gbit/s from Python here); faster ones read None.
A train that meets the plan's own data in the queue reads low (a share): the scheduler tells
such trains by their delay (:class:`agents.netstate.NetState`).
One-way delay: the least (receive - send) of the train's datagrams.  Receive times are the
kernel's (``SO_TIMESTAMPNS``) moved onto this process's clock (:data:`agents.clock.offset_ns`).
"""

from __future__ import annotations

import logging
import math
import random
import socket
import struct
import threading
import time
from typing import Callable

import numpy as np

from . import clock

log = logging.getLogger("agents.trains")

MAGIC = b"TBtr"
HEADER = struct.Struct("!4sHIHHq")  # magic, sender's index in the plan's nodes, train id, seq, count, send ns
PAYLOAD = 1472  # UDP payload of a full 1500-byte IP packet
FRAME = PAYLOAD + 8 + 20 + 14  # bytes a shaper counts: UDP + IP + Ethernet headers
TRAIN_MS = 8.0  # a train lasts about this long at the link's configured rate
MIN_PACKETS, MAX_PACKETS = 32, 1000  # >= 16 in the second half: 8 pair spans for the median
TRAIN_IDLE_S = 0.3  # a train no datagram of which arrived for this long is complete
MAX_OPEN = 64  # trains assembled at once (a node has a few neighbours; more is a flood)
DISPERSED = 1.25  # a pair of datagrams measured the link if it arrived this much slower than sent


def shape(rate_mbps: float, duty: float) -> tuple[int, float]:
    """(datagrams per train, seconds between trains) on a link of ``rate_mbps`` so that trains
    last about TRAIN_MS and take ``duty`` of the link's rate."""
    n = min(MAX_PACKETS, max(MIN_PACKETS, math.ceil(rate_mbps * 1e3 * TRAIN_MS / (8 * FRAME))))
    return n, n * FRAME * 8 / (rate_mbps * 1e6 * duty)


def train_rate(arrivals: list[int], sends: list[int], frame_bytes: int = FRAME) -> float | None:
    """Mbit/s from a train's datagrams in arrival order: receive and send times (ns, each on its
    own host's clock).  The second half's dispersion, as the median over the pairs (i, i + h) of
    its m datagrams, h = m // 2, that the link spread out (receive span >= DISPERSED x send
    span) and that start and end outside a burst (:func:`burst_members`) -- a few datagrams held
    up and handed over together skew only the pairs that end among them; None with fewer than 4
    datagrams in the half, or fewer than half of its pairs left (the sender stalled, or a burst:
    not the link's spacing)."""
    rx = np.asarray(arrivals[len(arrivals) // 2:], dtype=np.int64)
    tx = np.asarray(sends[len(sends) // 2:], dtype=np.int64)
    h = len(rx) // 2
    if len(rx) < 4:
        return None
    rx_spans, tx_spans = rx[h:] - rx[:len(rx) - h], tx[h:] - tx[:len(tx) - h]
    burst = burst_members(rx, tx, max(2, h // 8))
    kept = (rx_spans > 0) & (rx_spans >= DISPERSED * np.abs(tx_spans)) & ~burst[:len(rx) - h] & ~burst[h:]
    if 2 * np.count_nonzero(kept) < len(rx_spans):
        return None
    return float(np.median(h * frame_bytes * 8 / (rx_spans[kept] / 1e9))) / 1e6


def burst_members(rx: np.ndarray, tx: np.ndarray, run: int) -> np.ndarray:
    """Which datagrams arrived in a burst: ``run`` or more consecutive gaps each no slower than
    sent (receive gap < DISPERSED x send gap), i.e. ``run`` + 1 datagrams handed over together.
    A sender descheduled mid-train lets the link go idle, and the shaper's burst allowance then
    passes the next few datagrams at once (as at a train's start); a relay held up passes what
    queued meanwhile at once.  Pairs that start in such a burst read 1.3-1.8x the rate
    (docs/measurements/2026-12-02-train-bursts.md).  Shorter runs (the relay sending two frames due close together in
    one call) move too few pairs to move the median: ``run`` is h // 8, at least 2."""
    close = np.diff(rx) < DISPERSED * np.abs(np.diff(tx))
    counts = np.convolve(close.astype(np.int64), np.ones(run, dtype=np.int64), mode="valid")
    member = np.zeros(len(rx), dtype=bool)
    for start in np.flatnonzero(counts == run):  # gaps start .. start + run - 1 are all close
        member[start:start + run + 1] = True
    return member


class Trains:
    """Sends this agent's trains and receives its neighbours' on one UDP socket (``bind``, the
    data port's number; CREW's link heartbeats use it too, so never both: config refuses
    ``adaptive`` with ``groups``).  ``targets``: [(peer, ip, port, packets, every_s)];
    ``report(src, rate_mbps, send_ns, recv_ns)`` is called per received train (``rate_mbps`` None
    if the link did not spread it out; ``send_ns``/``recv_ns``: the datagram with the least
    one-way delay, each on its own host's clock).
    Datagrams that are not a neighbour's train are counted (``refused``) and dropped; at most
    MAX_OPEN trains are assembled at once."""

    def __init__(self, me: int, nodes: list[str], port: int, targets: list, report: Callable, seed: str = "",
                 bind: str = "0.0.0.0"):
        self.me, self.nodes, self.targets, self.report = me, list(nodes), list(targets), report
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, clock.SO_TIMESTAMPNS, 1)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        self.sock.bind((bind, port))
        self.sock.settimeout(0.1)
        self.stop = threading.Event()
        self.rng = random.Random(f"trains:{seed}:{me}")
        self.sent = self.received = self.refused = 0
        self._threads = [threading.Thread(target=self._send_loop, daemon=True, name="trains-send"),
                         threading.Thread(target=self._recv_loop, daemon=True, name="trains-recv")]

    def start(self) -> "Trains":
        for t in self._threads:
            t.start()
        return self

    def close(self) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(timeout=2)
        self.sock.close()

    def _send_loop(self) -> None:
        # first trains spread over one period, so that neighbours' trains rarely meet
        due = {i: time.monotonic() + self.rng.uniform(0, t[4]) for i, t in enumerate(self.targets)}
        train_id = 0
        pad = b"\0" * (PAYLOAD - HEADER.size)
        while not self.stop.is_set():
            i = min(due, key=due.get, default=None)
            if i is None or self.stop.wait(max(0.0, due[i] - time.monotonic())):
                return
            _, ip, port, n, every_s = self.targets[i]
            train_id += 1
            try:
                for seq in range(n):
                    self.sock.sendto(HEADER.pack(MAGIC, self.me, train_id, seq, n, time.time_ns()) + pad, (ip, port))
                self.sent += 1
            except OSError as e:  # e.g. the link is down: try again next period
                log.debug("train to %s failed: %s", self.targets[i][0], e)
            due[i] = time.monotonic() + every_s * self.rng.uniform(0.8, 1.2)

    def _recv_loop(self) -> None:
        open_: dict[tuple[int, int], dict] = {}  # (sender, train id) -> arrivals, best one-way delay, last seen
        while not self.stop.is_set():
            try:
                data, anc, _, _ = self.sock.recvmsg(2048, socket.CMSG_SPACE(16))
            except socket.timeout:
                data = None
            except OSError:
                return
            now = time.monotonic()
            if data is not None:
                self._take(open_, data, anc, now)
            for key in [k for k, t in open_.items() if now - t["seen"] > TRAIN_IDLE_S]:
                self._finish(key, open_.pop(key))

    def _take(self, open_: dict, data: bytes, anc, now: float) -> None:
        if len(data) < HEADER.size:
            self.refused += 1
            return
        magic, src, tid, seq, n, send_ns = HEADER.unpack_from(data)
        if magic != MAGIC or src >= len(self.nodes) or src == self.me or seq >= n or (
                (src, tid) not in open_ and len(open_) >= MAX_OPEN):
            self.refused += 1
            return
        rx = clock.kernel_rx_ns(anc)
        rx = time.time_ns() if rx is None else rx + clock.offset_ns
        t = open_.setdefault((src, tid), {"arrivals": [], "sends": [], "best": None, "n": n})
        t["arrivals"].append(rx)
        t["sends"].append(send_ns)
        t["seen"] = now
        if t["best"] is None or rx - send_ns < t["best"][1] - t["best"][0]:
            t["best"] = (send_ns, rx)
        if seq == n - 1:
            self._finish((src, tid), open_.pop((src, tid)))

    def _finish(self, key: tuple[int, int], t: dict) -> None:
        if len(t["arrivals"]) < 2:
            return
        rate = train_rate(t["arrivals"], t["sends"])
        self.received += 1
        try:
            self.report(self.nodes[key[0]], rate, *t["best"])
        except Exception as e:  # the control connection's trouble is the agent's to report, not this thread's
            log.warning("train report from %s not sent: %s", self.nodes[key[0]], e)
