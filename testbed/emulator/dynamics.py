"""Time-varying link rates and faults, applied live while agents run.

Experiment keys (times in seconds from when the first run's agents are launched, on one
clock across all runs -- with ``dynamics_per_run: true`` every run's agents start on the
healthy network and its dynamics and faults count from its measured phase's start, the
moment its agents are all ready: its first GO, or CREW's window):

``dynamics:`` a list of
  * ``{at_s: 5, link: [h1, h2], rate_mbps: 50}`` — both directions, or ``rate_mbps: [ab, ba]``,
    or ``direction: ab|ba`` to change one;
  * ``{trace: rates.csv}`` — CSV rows ``time_s,src,dst,rate_mbps`` (header optional; path
    relative to the experiment file);
  * ``{redraw: {lo: 20, hi: 155, every_s: 180, seed: 1}}`` — NetStorm's fluctuation
    (paper Sec. 6 / authors' klonet_net_dynamic.py): every ``every_s`` each direction of
    every link gets an independent uniform integer rate in [lo, hi] Mbit/s (scaled by the
    experiment's ``scale``), from a seeded generator.

``faults:`` a list of ``{at_s: 3, link_down: [a, b]}``, ``{at_s: 6, link_up: [a, b]}``,
``{at_s: 4, crash: dc}`` (kill its processes, cut its links), ``{at_s: 9, restart: dc}``.

Every applied change is logged with its timestamp (``WanNetwork.events``) into results.json.
"""

from __future__ import annotations

import csv
import heapq
import random
import threading
import time
from pathlib import Path

from testbed.checks import Checker
from testbed.wan import Topology


def _link(c: Checker, value, key: str, topo: Topology) -> list[str]:
    if not (isinstance(value, list) and len(value) == 2):
        c.fail(key, "expected [datacenter, datacenter]")
    for i, dc in enumerate(value):
        c.node(dc, f"{key}[{i}]", list(topo.nodes))
    try:
        topo.link(*value)
    except KeyError:
        c.fail(key, f"no WAN link between {value[0]} and {value[1]}")
    return list(value)


def validate_dynamics(items, topo: Topology, c: Checker, source: str) -> list[dict]:
    """Check ``dynamics:`` and return it normalised to timed rate events plus redraw specs."""
    if not isinstance(items, list):
        c.fail("dynamics", "expected a list")
    out: list[dict] = []
    for i, item in enumerate(items):
        key = f"dynamics[{i}]"
        c.mapping(item, key)
        if "trace" in item:
            out += _trace_events(item, key, topo, c, source)
        elif "redraw" in item:
            out.append(_redraw_spec(item, key, c))
        else:
            out += _rate_events(item, key, topo, c)
    return out


def _trace_events(item: dict, key: str, topo: Topology, c: Checker, source: str) -> list[dict]:
    """``{trace: file}``: one rate event per CSV row (comments, blank rows and a header skipped)."""
    c.mapping(item, key, {"trace"})
    path = Path(item["trace"])
    if not path.is_absolute():
        path = Path(source).parent / path
    try:
        rows = list(csv.reader(path.read_text().splitlines()))
    except OSError as e:
        c.fail(f"{key}.trace", f"cannot read trace: {e.strerror}")
    out = []
    for r, row in enumerate(rows):
        if not row or row[0].strip().startswith("#") or (r == 0 and not _is_num(row[0])):
            continue
        rkey = f"{key}.trace line {r + 1}"
        if len(row) != 4 or not _is_num(row[0]) or not _is_num(row[3]):
            c.fail(rkey, "expected time_s,src,dst,rate_mbps")
        src, dst = row[1].strip(), row[2].strip()
        _link(c, [src, dst], rkey, topo)
        out.append({"at_s": float(row[0]), "src": src, "dst": dst, "rate_mbps": float(row[3])})
    return out


def _redraw_spec(item: dict, key: str, c: Checker) -> dict:
    """``{redraw: {...}}`` with its defaults filled in."""
    c.mapping(item, key, {"redraw"})
    r = c.mapping(item["redraw"], f"{key}.redraw", {"lo", "hi", "every_s", "seed"})
    lo = c.number(r.get("lo", 20), f"{key}.redraw.lo", positive=True)
    hi = c.number(r.get("hi", 155), f"{key}.redraw.hi", positive=True)
    if hi < lo:
        c.fail(f"{key}.redraw.hi", "must be >= lo")
    every = c.number(r.get("every_s", 180), f"{key}.redraw.every_s", positive=True)
    seed = c.number(r.get("seed", 1), f"{key}.redraw.seed", integer=True)
    return {"redraw": {"lo": lo, "hi": hi, "every_s": every, "seed": seed}}


def _rate_events(item: dict, key: str, topo: Topology, c: Checker) -> list[dict]:
    """``{at_s, link, rate_mbps, direction}``: one rate event per direction it changes."""
    c.mapping(item, key, {"at_s", "link", "rate_mbps", "direction"})
    for req in ("at_s", "link", "rate_mbps"):
        if req not in item:
            c.fail(f"{key}.{req}", "missing (required)")
    at = c.number(item["at_s"], f"{key}.at_s", minimum=0)
    a, b = _link(c, item["link"], f"{key}.link", topo)
    rates = item["rate_mbps"]
    rates = rates if isinstance(rates, list) else [rates, rates]
    if len(rates) != 2:
        c.fail(f"{key}.rate_mbps", "expected a rate or [a->b, b->a]")
    for k, r in enumerate(rates):
        c.number(r, f"{key}.rate_mbps", positive=True)
    direction = c.choice(item.get("direction", "both"), f"{key}.direction", ("both", "ab", "ba"))
    out = []
    if direction in ("both", "ab"):
        out.append({"at_s": at, "src": a, "dst": b, "rate_mbps": float(rates[0])})
    if direction in ("both", "ba"):
        out.append({"at_s": at, "src": b, "dst": a, "rate_mbps": float(rates[1])})
    return out


def scaled(events: list[dict], scale: float) -> list[dict]:
    """``events`` (as :func:`validate_dynamics` returns them) with every rate times ``scale``:
    rate events get their ``rate_mbps`` scaled, a redraw spec gets ``scale`` (its integer draws
    in [lo, hi] stay those of the seed, then are multiplied)."""
    return [{"redraw": {**ev["redraw"], "scale": scale}} if "redraw" in ev
            else {**ev, "rate_mbps": ev["rate_mbps"] * scale} for ev in events]


def validate_faults(items, topo: Topology, c: Checker) -> list[dict]:
    if not isinstance(items, list):
        c.fail("faults", "expected a list")
    out = []
    kinds = ("link_down", "link_up", "crash", "restart")
    for i, item in enumerate(items):
        key = f"faults[{i}]"
        c.mapping(item, key, {"at_s", *kinds})
        present = [k for k in kinds if k in item]
        if len(present) != 1 or "at_s" not in item:
            c.fail(key, f"expected at_s and exactly one of {', '.join(kinds)}")
        kind = present[0]
        at = c.number(item["at_s"], f"{key}.at_s", minimum=0)
        if kind.startswith("link"):
            target = _link(c, item[kind], f"{key}.{kind}", topo)
        else:
            target = c.node(item[kind], f"{key}.{kind}", list(topo.nodes))
        out.append({"at_s": at, kind: target})
    return out


def _is_num(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def restore_network(net) -> None:
    """Every link up (also a crashed host's) and every direction at its topology rate: the
    healthy network a run that replays the dynamics and faults starts from."""
    for a, b in sorted({tuple(sorted(k)) for k, d in net.directions.items() if not d.up}):
        net.set_link(a, b, up=True)
    for (src, dst), d in net.directions.items():
        nominal = net.topo.links[d.link].dir(src, dst).rate_mbps
        if d.spec.rate_mbps != nominal:
            net.set_rate(src, dst, nominal)


class Timeline:
    """Dynamics (already :func:`scaled`) and faults in time order, each redraw drawn into its
    rate changes when its time comes: the one sequence the :class:`Scheduler` applies live and
    :func:`rates_at` replays on paper.  :meth:`pop` returns ``(at_s, event)``; rate changes
    come out as ``{"rates": [(src, dst, rate_mbps), ...]}`` (a redraw: every direction of
    ``links``), faults as given."""

    def __init__(self, links, dynamics: list[dict], faults: list[dict] = ()):
        self._directions = [d for l in links for d in ((l.a, l.b), (l.b, l.a))]
        self._queue: list[tuple[float, int, dict]] = []
        self._n = 0
        for ev in dynamics:
            if "redraw" in ev:
                self._redraw = dict(ev["redraw"], rng=random.Random(ev["redraw"]["seed"]))
                self._push(ev["redraw"]["every_s"], {"redraw": True})
            else:
                self._push(ev["at_s"], ev)
        for ev in faults:
            self._push(ev["at_s"], ev)

    def _push(self, at: float, ev: dict) -> None:
        heapq.heappush(self._queue, (at, self._n, ev))
        self._n += 1

    def next_at(self) -> float | None:
        return self._queue[0][0] if self._queue else None

    def pop(self) -> tuple[float, dict]:
        at, _, ev = heapq.heappop(self._queue)
        if ev.get("redraw"):
            r = self._redraw
            self._push(at + r["every_s"], ev)
            ev = {"rates": [(src, dst, r["rng"].randint(int(r["lo"]), int(r["hi"])) * r.get("scale", 1.0))
                            for src, dst in self._directions]}
        elif "rate_mbps" in ev:
            ev = {"rates": [(ev["src"], ev["dst"], ev["rate_mbps"])]}
        return at, ev


def rates_at(topo: Topology, dynamics: list[dict], at_s: float) -> dict[tuple[str, str], float]:
    """Every direction's rate (Mbit/s) ``at_s`` seconds into a run that replays ``dynamics``
    from the topology's rates (faults aside): what ``plan --at-s`` plans on."""
    rates = {(l.a, l.b): l.ab.rate_mbps for l in topo.links} | {(l.b, l.a): l.ba.rate_mbps for l in topo.links}
    timeline = Timeline(topo.links, dynamics)
    while timeline.next_at() is not None and timeline.next_at() <= at_s:
        _, ev = timeline.pop()
        for src, dst, rate in ev["rates"]:
            rates[(src, dst)] = rate
    return rates


class Scheduler:
    """Applies a :class:`Timeline` of dynamics and faults to a running :class:`WanNetwork`
    from a thread."""

    def __init__(self, net, dynamics: list[dict], faults: list[dict], *, log=lambda msg: None):
        self.net, self.log = net, log
        self._timeline = Timeline(net.topo.links, dynamics, faults)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dynamics", daemon=True)
        self.errors: list[str] = []

    def start(self) -> "Scheduler":
        self.t0 = time.monotonic()
        if self._timeline.next_at() is not None:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        while (at := self._timeline.next_at()) is not None and not self._stop.is_set():
            if self._stop.wait(max(0.0, at - (time.monotonic() - self.t0))):
                return
            at, ev = self._timeline.pop()
            try:
                self._apply(at, ev)
            except Exception as e:  # a failed change is recorded, the run goes on
                self.errors.append(f"t={at:g}s {ev}: {e}")
                self.log(f"dynamics: {self.errors[-1]}")

    def _apply(self, at: float, ev: dict) -> None:
        net = self.net
        if "rates" in ev:
            for src, dst, rate in ev["rates"]:
                net.set_rate(src, dst, rate)
        elif "link_down" in ev or "link_up" in ev:
            up = "link_up" in ev
            net.set_link(*ev["link_up" if up else "link_down"], up=up)
        elif "crash" in ev:
            net.set_host(ev["crash"], up=False)
        elif "restart" in ev:
            net.set_host(ev["restart"], up=True)
