"""The scheduler's live picture of the WAN (NetStorm §V, scheduler side): per directed link
the latest rate and one-way-delay estimates with their age, and the whole time series.

Agents report raw windows of chunk samples (:class:`agents.probe.Prober`); this module
applies the clock offsets the scheduler estimated (θ = agent clock − scheduler clock, from
:func:`testbed.clock.estimate`) and the chosen estimator (:data:`agents.probe.ESTIMATORS`).
``truth(src, dst)`` (optional, given by the emulator's runner) is sampled at the instant each
estimate is recorded, so every entry states its own error.
"""

from __future__ import annotations

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


LINK_WINDOWS = 3  # a link's estimate: the largest rate of its last this many windows


class NetState:
    """Per directed link: every window's estimate (``rate_mbps``: the chosen estimator's
    goodput times :data:`agents.probe.WIRE_BYTES_PER_PAYLOAD`, i.e. in link-rate units) and
    ``link_mbps``, the largest of the link's last ``windows`` window rates — what planners
    get.  Passive probing sees what TCP achieved, never more than the link carries, so a
    window in which TCP did not fill the link (a loss, a sender that ran late: 0.67-0.88 of
    the rate in about 1 window of 12 on this testbed) reads low while the capacity did not
    change; the maximum of recent windows is the tightest such lower bound.  A rise shows
    at once, a fall once ``windows`` windows saw it (NetStorm re-plans every UPDATE_TIME
    = 5 s; a window on a busy link lasts ~1-3 s here).  ``windows: 1`` = the latest window."""

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
        self._recent: dict[tuple[str, str], list[float]] = {}
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
        now = time.time_ns()
        est = estimate(samples, self.offsets.get(dst, 0) - self.offsets.get(src, 0))
        rate = est[f"{self.estimator}_mbps"] * WIRE_BYTES_PER_PAYLOAD
        with self._lock:
            recent = self._recent.setdefault((src, dst), [])
            recent[:] = (recent + [rate])[-self.windows:]
            link = max(recent)
        entry = {"t_s": round((now - self.t0_ns) / 1e9, 4), "src": src, "dst": dst,
                 "link_mbps": link, "rate_mbps": rate, **est}
        if self.truth:
            entry["truth"] = self.truth(src, dst)
        with self._lock:
            self.series.append(entry)
            self._latest[(src, dst)] = (entry, now)
        return entry

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
                    "series": list(self.series)}
