"""The closed loop (NetStorm §V, §VII): passive probing and packet trains on the agents, link
estimates at the coordinator (:mod:`agents.netstate`), re-planning with the scheme's own
planner on the estimated (or, mode ``oracle``, the emulator's true) rates, and how far the
estimates were from the truth.  Scheme block: ``adaptive``."""

from __future__ import annotations

import statistics
import time
from typing import Callable

from testbed.config import Experiment, planner_params
from testbed.errors import ConfigError

from . import Feature, RunContext, feature


@feature("closed-loop")
class ClosedLoop(Feature):
    def check_plan(self, exp: Experiment, scheme: dict, plan, source: str, key: str) -> None:
        """Probing needs chunks at least ``probe_chunk_bytes`` large."""
        a, elem = scheme.get("adaptive"), exp.workload.elem_bytes
        largest = max((op.length for _, op in plan.transfers()), default=0) * elem
        if a and a["mode"] == "estimated" and largest < a["probe_chunk_bytes"]:
            raise ConfigError(f"{a['probe_chunk_bytes']} bytes: no transfer of this plan is that large (the "
                              f"largest is {largest} bytes), so no link would ever be measured", source=source,
                              key=f"{key}.adaptive.probe_chunk_bytes")

    def options(self, ctx: RunContext) -> dict:
        opts = {"probe": probe_options(ctx.scheme, ctx.exp.topology.graph(), ctx.exp.workload.warmup),
                "policy": replanner(ctx.exp, ctx.scheme, ctx.plan, ctx.truth)}
        return {k: v for k, v in opts.items() if v is not None}

    def summarise(self, result: dict, record: dict) -> dict:
        if "tasks_mode" in result:
            return {}
        return {**{k: result[k] for k in ("estimates", "switches", "versions") if k in result},
                **({"estimation": estimation_error(result["estimates"])} if result.get("estimates") else {})}

    def note(self, record: dict) -> str:
        e = record.get("estimation", {})
        if not e.get("windows"):
            return ""
        trains = (f" ({e['trains']} packet trains, {e['unrated_trains']} without a rate, at most "
                  f"{e['train_overhead_max']:.2%} of a link)" if "trains" in e else "")
        return (f", {record['switches']} plan switches, link estimates within 10 %: "
                f"{e['rate_within_10pct']:.0%} of {e['windows']}" + trains)


def probe_options(scheme: dict, graph, warmup: int = 0) -> dict | None:
    """The coordinator's ``probe`` option from a scheme's ``adaptive`` block (None: off);
    chunks of the ``warmup`` iterations are not probed (fresh connections in slow start);
    packet trains on every directed link of ``graph`` (configured rates) at ``train_duty``."""
    a = scheme.get("adaptive")
    if not a:
        return None
    trains = {"duty": a["train_duty"], "links": [[u, v, r] for u, v, r in sorted(graph.edges(data="rate_mbps"))]}
    return {"chunk_bytes": a["probe_chunk_bytes"], "chunk_num": a["probe_chunk_num"],
            "estimator": a["estimator"], "from_iteration": warmup, **({"trains": trains} if a["train_duty"] else {})}


def replanner(exp: Experiment, scheme: dict, plan, truth: Callable[[str, str], dict | None] | None = None,
              clock: Callable[[], float] = time.monotonic):
    """The coordinator's ``policy`` for a scheme with ``adaptive.update_s`` > 0 (None
    otherwise): at the first iteration boundary at least ``update_s`` after the last
    decision (NetStorm §V: UPDATE_TIME), re-run the scheme's own pure planner on the topology
    with every WAN link's rate replaced by its latest estimate (mode ``estimated``; links not
    measured keep their last known rate) or by the emulator's true current rate (mode
    ``oracle``, from ``truth``), and switch if the new plan's predicted CCT on those rates
    (:func:`testbed.costmodel.predict`) beats the current plan's by ``min_gain`` (a choice,
    not in the paper: without it noisy estimates re-route every update, and every new
    version costs new connections in slow start; 0 = any change).  NetStorm §IV-A keeps the
    root set of its first decision; here the planner chooses again (a choice: the same
    planner, unchanged, is what "re-planning" means for every other scheme)."""
    a = scheme.get("adaptive")
    if not a or a["update_s"] <= 0:
        return None
    if a["mode"] == "oracle" and truth is None:
        raise ConfigError("mode oracle re-plans from the emulator's true rates: not available here",
                          key="scheme.adaptive.mode")
    return _Replanner(exp, scheme, plan, truth, clock)


class _Replanner:
    """The policy :func:`replanner` returns: ``policy(iteration, netstate)`` -> a new plan or None."""

    def __init__(self, exp: Experiment, scheme: dict, plan, truth, clock):
        self.a, self.scheme, self.truth, self.clock = scheme["adaptive"], scheme, truth, clock
        self.graph, self.w = exp.topology.graph(), exp.workload
        self.params = planner_params(scheme)
        self.seen = [plan]  # every version so far: switching back reuses it
        self.t, self.plan = clock(), plan

    def __call__(self, iteration: int, net):
        from testbed.planners import make_plan

        if self.clock() - self.t < self.a["update_s"]:
            return None
        self.t = self.clock()
        self._update_rates(net)
        new = make_plan(self.scheme["name"], self.graph, self.w.length, self.params, elem_bytes=self.w.elem_bytes,
                        aux=self.scheme.get("aux"))
        new = next((p for p in self.seen if (p.programs, p.aux) == (new.programs, new.aux)), None) or new
        if new is self.plan or not self._gains(new):
            return None
        if new not in self.seen:
            new.validate()
            self.seen.append(new)
        self.plan = new
        return new

    def _update_rates(self, net) -> None:
        """Every link's rate in the planning graph: the latest estimate or the true rate."""
        latest = net.latest() if self.a["mode"] == "estimated" else {}
        for u, v, attrs in self.graph.edges(data=True):
            if self.a["mode"] == "oracle":
                attrs["rate_mbps"] = self.truth(u, v)["rate_mbps"]
            elif (u, v) in latest and latest[(u, v)]["rate_mbps"] > 0:
                attrs["rate_mbps"] = latest[(u, v)]["rate_mbps"]

    def _gains(self, new) -> bool:
        """The new plan's predicted CCT beats the current one's by ``min_gain``."""
        from testbed.costmodel import EXECUTOR_TRANSFER_S, predict

        cct = [predict(p, self.graph, elem_bytes=self.w.elem_bytes, tcp=True,
                       transfer_s=EXECUTOR_TRANSFER_S)["cct_s"] for p in (new, self.plan)]
        return cct[0] <= (1 - self.a["min_gain"]) * cct[1]


def estimation_error(estimates: dict) -> dict:
    """How far the closed loop's link estimates were from the emulator's configured rate and
    delay at the same instants (windows that gave a link no estimate yet left out): windows,
    share of link estimates within 10 % of the rate (and of single windows), median and
    worst relative rate error, worst one-way-delay error."""
    rows = [e for e in estimates.get("series", []) if e.get("truth") and e["link_mbps"] is not None]
    if not rows:
        return {"windows": 0}
    rel = [e["link_mbps"] / e["truth"]["rate_mbps"] - 1 for e in rows]
    single = [e["rate_mbps"] / e["truth"]["rate_mbps"] - 1 for e in rows]
    owd = [abs(e["owd_ms"] - e["truth"]["delay_ms"]) for e in rows if e["owd_ms"] is not None]
    return {"windows": len(rows), "rate_within_10pct": sum(abs(r) <= 0.1 for r in rel) / len(rows),
            "window_within_10pct": sum(abs(r) <= 0.1 for r in single) / len(rows),
            "rate_err_median": statistics.median(map(abs, rel)), "rate_err_max": max(map(abs, rel)),
            "owd_err_ms_max": max(owd, default=None), **train_overhead(estimates)}


def train_overhead(estimates: dict) -> dict:
    """Packet trains received (with a rate, or ``unrated``: without) and the largest share
    of a link's configured rate they took while they were taken (trains x their bytes / (time
    from the first train to the last estimate x rate))."""
    t = estimates.get("trains")
    trains = [e for e in estimates.get("series") or [] if e.get("source") == "train"]
    if not t or len(trains) < 2:
        return {}
    span_s = max(e["t_s"] for e in estimates["series"]) - trains[0]["t_s"]
    count = dict(estimates.get("unrated_trains") or {})
    for e in trains:
        count[f"{e['src']}>{e['dst']}"] = count.get(f"{e['src']}>{e['dst']}", 0) + 1
    share = [count.get(k, 0) * x["packets"] * t["frame_bytes"] * 8 / (span_s * x["rate_mbps"] * 1e6)
             for k, x in t["links"].items()]
    return {"trains": len(trains), "unrated_trains": sum(count.values()) - len(trains),
            "train_overhead_max": max(share, default=0.0)}
