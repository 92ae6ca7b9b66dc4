"""The scheduler's live picture of the WAN (NetStorm §V, scheduler side): per directed link
the latest rate and one-way-delay estimates with their age, and the whole time series.

Agents report raw windows of chunk samples (:class:`agents.probe.Prober`); this module
applies the clock offsets the scheduler estimated (θ = agent clock − scheduler clock, from
:func:`testbed.clock.estimate`) and the chosen estimator (:data:`agents.probe.ESTIMATORS`).
``truth(src, dst)`` (optional, given by the emulator's runner) is sampled at the instant each
estimate is recorded, so every entry states its own error.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Callable

from .probe import DEFAULT_ESTIMATOR, ESTIMATORS, WIRE_BYTES_PER_PAYLOAD, Sample, estimate

MAX_SAMPLES = 4096  # per report; more is a malformed report


def parse_samples(raw) -> list[Sample]:
    """Samples from an untrusted PROBE message; ValueError if malformed."""
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_SAMPLES:
        raise ValueError("samples: expected a non-empty list")
    out = []
    for row in raw:
        if not (isinstance(row, list) and len(row) == len(Sample._fields)
                and all(isinstance(x, int) and not isinstance(x, bool) for x in row)):
            raise ValueError(f"samples: expected rows of {len(Sample._fields)} integers [{', '.join(Sample._fields)}]")
        out.append(Sample(*row))
    return out


LINK_WINDOWS = 3  # a link's estimate: from its last this many windows of each kind ...
RECENT_S = 3.0  # ... no older than this (a fall shows once the windows before it aged out)
BASE_DELAY_S = 60.0  # a link's one-way delay: the least of its windows this recent (LEDBAT's base delay)
OWD_WINDOWS = 8  # ... once it has this many (measured: a 50 Mbit/s link the trees keep queued
# read 1.0-4.9 ms over its delay in each of its first 7 windows)
QUEUE_MS = 1.0  # a train whose delay exceeds that by more (or 5 %) met a queue
TRAIN_PERIODS = 3.5  # trains count this many of their link's periods (if longer than RECENT_S)


class NetState:
    """Per directed link: every window's estimate (``rate_mbps``: the chosen estimator's
    goodput times :data:`agents.probe.WIRE_BYTES_PER_PAYLOAD`, i.e. in link-rate units) and
    ``link_mbps``, the largest of the link's last ``windows`` window rates — what planners
    get.  Passive probing sees what TCP achieved, never more than the link carries, so a
    window in which TCP did not fill the link (a loss, a sender that ran late: 0.67-0.88 of
    the rate in about 1 window of 12 on this testbed) reads low while the capacity did not
    change; the maximum of recent windows is the tightest such lower bound.  A rise shows
    at once, a fall once ``windows`` windows saw it or RECENT_S passed (NetStorm re-plans
    every UPDATE_TIME = 5 s; a window on a busy link lasts ~1-3 s here).
    Packet trains (:mod:`agents.trains`, :meth:`add_train`) read the link's rate where they met
    no data and a share where they did: a train whose delay exceeds the least the link's samples
    of the last BASE_DELAY_S saw by QUEUE_MS (or 5 %) met a queue (``queued``) and counts as a
    chunk window does, a lower bound (a shaper spaces datagrams at least at its rate; bursts a
    relay passed on are no trains, :func:`agents.trains.train_rate`).  The others' median
    counts, the upper one of an even count (a fall shows at the second train; of 8105 trains on
    this testbed 2.8 % read over 10 % low, 0.35 % over 5 % high, mostly across a rate change),
    among the last ``windows`` within TRAIN_PERIODS of the link's train period (``train_every``;
    at least RECENT_S): slow links send trains seconds apart.  Trains are judged again as lower
    delays come in, and a link's only sample, a train, has nothing to be judged against: no
    estimate yet, ``link_mbps`` None.  So
    ``link_mbps`` = the larger of the largest recent lower bound and the median train.
    ``owd_ms``: the least one-way delay of the link's windows of the last BASE_DELAY_S, once
    there are OWD_WINDOWS of them (None before: a window that met a queue reads the queue too;
    ``sample_owd_ms``: this window's)."""

    def __init__(self, nodes: list[str], estimator: str = DEFAULT_ESTIMATOR,
                 truth: Callable[[str, str], dict | None] | None = None, windows: int = LINK_WINDOWS):
        if estimator not in ESTIMATORS:
            raise ValueError(f"unknown estimator {estimator!r} (known: {', '.join(ESTIMATORS)})")
        self.nodes, self.estimator, self.truth, self.windows = set(nodes), estimator, truth, int(windows)
        self.t0_ns = time.time_ns()
        self.offsets: dict[str, int] = {}  # θ per agent, ns
        self.clock: dict[str, dict] = {}
        self.series: list[dict] = []
        self._latest: dict[tuple[str, str], tuple[dict, int]] = {}
        self._recent: dict[tuple[str, str], dict[str, list[tuple[int, float, float]]]] = {}  # kind -> (t, rate, owd)
        self._owds: dict[tuple[str, str], list[tuple[int, float]]] = {}  # (t, one-way delay) of every window
        self.train_every: dict[tuple[str, str], float] = {}  # link -> seconds between its packet trains
        self.unrated: dict[str, int] = {}  # "src>dst" -> trains that gave no rate (agents.trains)
        self._lock = threading.Lock()

    def set_offset(self, node: str, offset_ns: int, rtt_ns: int) -> None:
        self.offsets[node] = offset_ns
        self.clock[node] = {"offset_ms": offset_ns / 1e6, "rtt_ms": rtt_ns / 1e6}

    def to_scheduler(self, node: str, t_ns: int) -> int:
        """An agent's timestamp on the scheduler's clock."""
        return t_ns - self.offsets.get(node, 0)

    def add(self, msg: dict) -> dict:
        """Record one PROBE report (``src``, ``dst``, ``samples``); ValueError if malformed."""
        src, dst = msg.get("src"), msg.get("dst")
        if src not in self.nodes or dst not in self.nodes or src == dst:
            raise ValueError(f"probe report for an unknown link {str(src)[:40]!r} -> {str(dst)[:40]!r}")
        samples = parse_samples(msg.get("samples"))
        est = estimate(samples, self.offsets.get(dst, 0) - self.offsets.get(src, 0))
        return self._record(src, dst, est[f"{self.estimator}_mbps"] * WIRE_BYTES_PER_PAYLOAD, {"source": "chunks", **est})

    def _record(self, src: str, dst: str, rate: float, fields: dict) -> dict:
        """One estimate of (src, dst): into the link's recent windows and the series."""
        now = time.time_ns()
        with self._lock:
            owds = self._owds.setdefault((src, dst), [])
            owds[:] = [(t, d) for t, d in owds if now - t <= BASE_DELAY_S * 1e9] + [(now, fields["owd_ms"])]
            least = min(d for _, d in owds)  # the queue-free delay as far as this link's samples know

            def met_queue(owd_ms: float) -> bool:
                return owd_ms - least > max(QUEUE_MS, 0.05 * least)

            queued = fields["source"] == "train" and met_queue(fields["owd_ms"])
            recent = self._recent.setdefault((src, dst), {"floor": [], "train": []})
            mine = recent["floor" if queued or fields["source"] == "chunks" else "train"]
            mine[:] = (mine + [(now, rate, fields["owd_ms"])])[-self.windows:]
            keep = {"floor": RECENT_S, "train": max(RECENT_S, TRAIN_PERIODS * self.train_every.get((src, dst), 0))}
            fresh = {k: [(r, d) for t, r, d in v if now - t <= keep[k] * 1e9] for k, v in recent.items()}
            # a train counts once another sample of the link shows whether its delay had a queue in it
            trains = [r for r, d in fresh["train"] if len(owds) > 1 and not met_queue(d)]
            floor = [r for r, _ in fresh["floor"]] + [r for r, d in fresh["train"] if met_queue(d)]
            link = max(([max(floor)] if floor else []) + ([statistics.median_high(trains)] if trains else []),
                       default=None)
            owd = least if len(owds) >= OWD_WINDOWS else None
        entry = {"t_s": round((now - self.t0_ns) / 1e9, 4), "src": src, "dst": dst, "link_mbps": link,
                 "rate_mbps": rate, **fields, "owd_ms": owd, "sample_owd_ms": fields["owd_ms"],
                 **({"queued": True} if queued else {})}
        if self.truth:
            entry["truth"] = self.truth(src, dst)
        with self._lock:
            self.series.append(entry)
            if link is not None:
                self._latest[(src, dst)] = (entry, now)
        return entry

    def add_train(self, msg: dict) -> dict | None:
        """Record one TRAIN report (``src``, ``dst``, ``rate_mbps``: already in link-rate units,
        or None for a train the link did not spread out, only counted in ``unrated``;
        ``send_ns``/``recv_ns``: the train's least-delay datagram, on the sender's and the
        receiver's clocks; :mod:`agents.trains`); ValueError if malformed."""
        src, dst, rate = msg.get("src"), msg.get("dst"), msg.get("rate_mbps")
        if src not in self.nodes or dst not in self.nodes or src == dst:
            raise ValueError(f"train report for an unknown link {str(src)[:40]!r} -> {str(dst)[:40]!r}")
        if rate is None:
            with self._lock:
                self.unrated[f"{src}>{dst}"] = self.unrated.get(f"{src}>{dst}", 0) + 1
            return None
        if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not 0 < rate < 1e7 or not all(
                isinstance(msg.get(k), int) and not isinstance(msg.get(k), bool) for k in ("send_ns", "recv_ns")):
            raise ValueError("train: expected rate_mbps > 0 and integer send_ns, recv_ns")
        owd_ns = self.to_scheduler(dst, msg["recv_ns"]) - self.to_scheduler(src, msg["send_ns"])
        return self._record(src, dst, float(rate), {"source": "train", "owd_ms": owd_ns / 1e6})

    def latest(self) -> dict[tuple[str, str], dict]:
        """(src, dst) -> {rate_mbps, owd_ms, age_s} of the latest estimate of every measured link."""
        now = time.time_ns()
        with self._lock:
            return {k: {"rate_mbps": e["link_mbps"], "owd_ms": e["owd_ms"], "age_s": (now - t) / 1e9}
                    for k, (e, t) in self._latest.items()}

    def report(self) -> dict:
        """The ``estimates`` block of results: estimator, clock offsets, the time series."""
        with self._lock:
            return {"estimator": self.estimator, "windows": self.windows, "wire_bytes_per_payload":
                    WIRE_BYTES_PER_PAYLOAD, "t0_ns": self.t0_ns, "clocks": dict(self.clock),
                    "series": list(self.series), "unrated_trains": dict(self.unrated)}
