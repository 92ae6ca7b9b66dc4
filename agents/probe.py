"""Passive probing (NetStorm §V): link rate and one-way delay from the DATA chunks themselves.

Pure functions over per-chunk samples, plus :class:`Prober`, the receiver-side accumulator
each agent feeds from its executor's per-chunk hook, reporting full windows to the
coordinator (:mod:`agents.agent`).  A sample is one DATA chunk as its receiver saw it
(:class:`Sample`): payload bytes, the sender's ``send_ts_ns`` from the header (sender's
clock), and the receiver's clock when the header was read (``first_ns``) and when the last
payload byte arrived (``last_ns``).  Everything is per *directed link* = (sender, receiver)
pair of agents; the flows on it are the data connections (channels) between the two.

Estimators (rates in bytes/s):

* ``eq17`` — NetStorm Eq. 17: mean of per-chunk rates S_i / (t_r^i - t_s^i), with t_s the
  sender's stamp moved to the receiver's clock.  Needs the clock offset; includes the
  propagation delay and any wait in the sender's socket buffer in every chunk's time, so it
  measures a flow's goodput, not the link;
* ``sum`` — the authors' code (van.cc): Σ S_i / Σ (t_r^i - t_s^i), the same per-flow
  goodput, less sensitive to one short outlier interval;
* ``busy`` (default link estimate) — all bytes the link carried in the window over the time
  it was busy at the receiver (receiver's clock only, so no clock offset enters): the
  chunks' intervals [first_i, last_i] form busy periods; each period counts from the
  earliest point where one of its chunks was half received (``mid``), with every byte of
  every chunk that arrived after it (linear between a chunk's recorded points).  The start
  of a period is left out because a chunk sent after an idle period starts in TCP's ramp-up
  (slow start after idle, BBR startup): measured on the emulator, whole chunks of 2-4 MB on
  50-80 Mbit/s links read 30-50 % low.  When several flows (channels, trees, chunks in flight) share the
  link, their intervals overlap and the union counts the time once, so this measures the
  link, not one flow's share.  It is *our* choice (the paper's Eq. 17 assumes one flow per
  link); it measures the link's rate only if the link was the bottleneck while busy (a
  sender that is slower than its link is measured as the sender's rate).

One-way delay: min_i (first_i - t_s^i) with t_s^i moved to the receiver's clock, i.e. the
delay of the header of the chunk that met the emptiest queue (the first chunk after an idle
period enters an empty pipe).  The minimum, not the mean: every chunk queued behind an
earlier one would add its wait.

Clocks: agents' clocks differ (real hosts; ``clock_offset_ms`` in tests).  The scheduler
estimates each agent's offset θ (agent clock − scheduler clock) NTP-style
(:func:`testbed.clock.estimate`) and corrects a link (s, r) by θ_r − θ_s (:func:`owd_s`,
:func:`per_flow_rates`).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import NamedTuple

ESTIMATORS = ("busy", "sum", "eq17")
# Bytes on the wire per payload byte of a full TCP segment: MSS 1448 (MTU 1500 less 20 IP, 20
# TCP and 12 timestamp-option bytes) in a 1514-byte Ethernet frame, which is what a link's
# rate limit counts.  Applied to turn a measured goodput into the link rate a planner's
# configured rates are in (NetStorm's tau is goodput; its planner compares like with like).
WIRE_BYTES_PER_PAYLOAD = 1514 / 1448
DEFAULT_ESTIMATOR = "busy"
PROBE_CHUNK_BYTES = 2_000_000  # NetStorm Table II / van.cc SIZE_MSG_REPORT, in bytes
PROBE_CHUNK_NUM = 4  # NetStorm Table II PROBE_CHUNK_NUM


class Sample(NamedTuple):
    nbytes: int
    send_ts_ns: int  # sender's clock
    first_ns: int  # receiver's clock: header read
    last_ns: int  # receiver's clock: last payload byte read
    channel: int = 0
    mid_ns: int = 0  # receiver's clock: the read that completed half the payload (0: not recorded)
    mid_bytes: int = 0  # payload bytes read by then



def _at(s: Sample, t: int) -> float:
    """Payload bytes of ``s`` arrived by receiver time ``t``, linear between the recorded
    points (first, 0), (mid, mid_bytes), (last, nbytes)."""
    pts = [(s.first_ns, 0)] + ([(s.mid_ns, s.mid_bytes)] if _has_mid(s) else []) + [(s.last_ns, s.nbytes)]
    if t <= pts[0][0]:
        return 0.0
    for (t0, b0), (t1, b1) in zip(pts, pts[1:]):
        if t <= t1:
            return b0 + (b1 - b0) * (t - t0) / (t1 - t0) if t1 > t0 else b1
    return float(s.nbytes)


def _has_mid(s: Sample) -> bool:
    return 0 < s.mid_bytes < s.nbytes and s.first_ns <= s.mid_ns <= s.last_ns


def busy_rate(samples: list[Sample]) -> float:
    """Bytes/s while the link was busy (see module docstring): the union of the chunks'
    receive intervals [first, last] falls into busy periods; each period is counted from the
    earliest half-way point (``mid``) of its chunks, with the bytes that arrived after it."""
    spans = sorted(samples, key=lambda s: (s.first_ns, s.last_ns))
    periods: list[list[Sample]] = []
    end = None
    for s in spans:
        if end is None or s.first_ns > end:
            periods.append([])
        periods[-1].append(s)
        end = s.last_ns if end is None or s.first_ns > end else max(end, s.last_ns)
    nbytes, busy = 0.0, 0
    for p in periods:
        mids = [s.mid_ns for s in p if _has_mid(s)]
        cut = min(mids) if mids else p[0].first_ns
        nbytes += sum(s.nbytes - _at(s, cut) for s in p)
        busy += max(s.last_ns for s in p) - cut
    return nbytes / (busy / 1e9) if busy > 0 else 0.0


def _durations(samples: list[Sample], offset_ns: int) -> list[tuple[int, int]]:
    """(bytes, t_r - t_s) per sample with t_s moved to the receiver's clock."""
    return [(s.nbytes, s.last_ns - (s.send_ts_ns + offset_ns)) for s in samples]


def eq17_rate(samples: list[Sample], offset_ns: int = 0) -> float:
    """NetStorm Eq. 17: mean of S_i / (t_r^i - t_s^i) (bytes/s).  ``offset_ns`` = receiver's
    clock minus sender's clock."""
    rates = [b / (d / 1e9) for b, d in _durations(samples, offset_ns) if d > 0]
    return sum(rates) / len(rates) if rates else 0.0


def sum_rate(samples: list[Sample], offset_ns: int = 0) -> float:
    """The authors' code: Σ S_i / Σ (t_r^i - t_s^i) (bytes/s)."""
    pairs = _durations(samples, offset_ns)
    total = sum(d for _, d in pairs)
    return sum(b for b, _ in pairs) / (total / 1e9) if total > 0 else 0.0


def owd_s(samples: list[Sample], offset_ns: int = 0) -> float:
    """One-way delay (s): min over samples of header arrival - send stamp, clocks aligned."""
    return min(s.first_ns - (s.send_ts_ns + offset_ns) for s in samples) / 1e9


def link_rate(samples: list[Sample], estimator: str = DEFAULT_ESTIMATOR, offset_ns: int = 0) -> float:
    """The link's rate (bytes/s) by ``estimator`` (one of :data:`ESTIMATORS`)."""
    if estimator == "busy":
        return busy_rate(samples)
    if estimator == "sum":
        return sum_rate(samples, offset_ns)
    if estimator == "eq17":
        return eq17_rate(samples, offset_ns)
    raise ValueError(f"unknown estimator {estimator!r} (known: {', '.join(ESTIMATORS)})")


def per_flow_rates(samples: list[Sample], offset_ns: int = 0) -> dict[int, float]:
    """Each flow's (channel's) goodput by the authors' ratio of sums (bytes/s)."""
    by: dict[int, list[Sample]] = defaultdict(list)
    for s in samples:
        by[s.channel].append(s)
    return {ch: sum_rate(ss, offset_ns) for ch, ss in sorted(by.items())}


def estimate(samples: list[Sample], offset_ns: int = 0) -> dict:
    """Every estimate of one directed link from one window: ``busy_mbps``, ``sum_mbps``,
    ``eq17_mbps``, ``owd_ms``, ``flows_mbps`` {channel: Mbit/s}, ``chunks``, ``bytes``.
    ``offset_ns`` = receiver's clock minus sender's clock (0 if unknown)."""
    mbps = 8e-6
    return {"busy_mbps": busy_rate(samples) * mbps, "sum_mbps": sum_rate(samples, offset_ns) * mbps,
            "eq17_mbps": eq17_rate(samples, offset_ns) * mbps, "owd_ms": owd_s(samples, offset_ns) * 1e3,
            "flows_mbps": {str(ch): r * mbps for ch, r in per_flow_rates(samples, offset_ns).items()},
            "chunks": len(samples), "bytes": sum(s.nbytes for s in samples)}


class Prober:
    """Receiver side, per sending peer (= directed link): every chunk that arrives on the
    link (any size, every channel) joins the current window; chunks of at least
    ``min_bytes`` count towards ``num``.  The window is returned (to report) once it holds
    ``num`` counted chunks *and* no chunk is in flight on the link (:meth:`start` was called
    as often as :meth:`add`), so a window never cuts through chunks that shared the link
    (the busy-interval estimate needs all of them).  Raw samples are reported (the
    scheduler knows the clock offsets and applies them); windows do not overlap.
    Thread-safe: every data connection's receiver thread feeds it."""

    def __init__(self, min_bytes: int = PROBE_CHUNK_BYTES, num: int = PROBE_CHUNK_NUM):
        if num < 1:
            raise ValueError("probe_chunk_num must be >= 1")
        self.min_bytes, self.num = int(min_bytes), int(num)
        self._win: dict[str, list] = defaultdict(list)
        self._count: dict[str, int] = defaultdict(int)
        self._inflight: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def start(self, peer: str) -> None:
        """A chunk's header arrived from ``peer``."""
        with self._lock:
            self._inflight[peer] += 1

    def add(self, peer: str, sample: Sample) -> list[Sample] | None:
        """The chunk is complete: the window to report, or None."""
        with self._lock:
            self._inflight[peer] = max(0, self._inflight[peer] - 1)
            self._win[peer].append(sample)
            self._count[peer] += sample.nbytes >= self.min_bytes
            if self._count[peer] < self.num or self._inflight[peer]:
                return None
            out, self._win[peer], self._count[peer] = self._win[peer], [], 0
        return out
