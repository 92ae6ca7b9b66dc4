"""An experiment's run: plan every variant, run them on :class:`~testbed.hosts.Hosts` (the
emulated WAN for ``run``, real hosts for ``deploy``), summarise.  Returns the data of
results.json; the command line writes it.  What a run-time feature (the closed loop,
auxiliary multipath, CREW's groups) adds to a run and to its summary is its module's, in
:mod:`testbed.runtime`; here: orchestration and the summary every run has."""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, NamedTuple

from agents.coordinator import Failure
from agents.protocol import transfer_rows
from testbed import runtime
from testbed.config import Experiment, Variant, planner_params
from testbed.errors import TestbedError
from testbed.hosts import Hosts, run_agents
from testbed.plan import Plan
from testbed.results import CpuMeter, PauseMeter, comm_windows, emulation_health, environment, stats, tcp_total
from testbed.workloads import compute_times


class BuiltPlan(NamedTuple):
    """What :func:`build_plan` returns."""

    topology: object  # testbed.wan.Topology, scaled
    graph: object  # its nx.DiGraph
    plan: Plan
    prediction: dict  # testbed.costmodel.predict
    bound: dict | None  # testbed.planners.bound.optimum; None for a partial reduce


class Planned(NamedTuple):
    """One variant ready to run (:func:`plan_variants`)."""

    variant: Variant
    plan: Plan
    prediction: dict
    bound: dict | None


@dataclass(frozen=True)
class FailedRun:
    """The run that failed (results.json's ``failure``): where the failure was laid
    (``culprit``, ``link``: from the coordinator's diagnosis) and what had completed."""

    variant: str
    repetition: int
    message: str
    culprit: str | None
    link: tuple[str, str] | None
    iterations_completed: int
    extra: dict  # the run-time features' part (CREW's groups: the tasks so far)

    def to_dict(self) -> dict:
        d = asdict(self)
        return {**{k: v for k, v in d.items() if k != "extra"}, **self.extra}


def build_plan(exp: Experiment, scheme: dict | None = None, *, source: str = "", key: str = "scheme") -> BuiltPlan:
    """The plan of a validated experiment's scheme (default: the main one), its prediction and
    bound -- pure planning, no network.  What the planner rejects (a disconnected topology,
    a parameter) is a ConfigError naming ``source`` and ``key``."""
    from agents.executor import links_for
    from testbed import costmodel
    from testbed.planners import make_plan
    from testbed.planners.bound import optimum
    from testbed.wan import validate_connected

    scheme, topo, w = scheme or exp.scheme, exp.topology, exp.workload
    validate_connected(topo, source=source or exp.name, key="topology")
    graph = topo.graph()
    params = planner_params(scheme)
    if scheme.get("groups"):  # groups form at run time; the JOB's plan is the scheme over every node
        params["active"] = None
    plan = make_plan(scheme["name"], graph, w.length, params, elem_bytes=w.elem_bytes, source=source or exp.name,
                     key=key, aux=scheme.get("aux"))
    plan.validate()
    runtime.check_plan(exp, scheme, plan, source=source or exp.name, key=key)
    a = scheme.get("adaptive")  # the agents forward cut-through unless they probe: agents.executor
    links = links_for(exp.agents.links, plan, stop_and_wait=exp.agents.stop_and_wait, probing=bool(a),
                      versions=bool(a or scheme.get("groups")))
    prediction = costmodel.predict(plan, graph, elem_bytes=w.elem_bytes, stop_and_wait=exp.agents.stop_and_wait,
                                   tcp=True, transfer_s=costmodel.EXECUTOR_TRANSFER_S,
                                   cut_through_bytes=0 if a else exp.agents.subblock_bytes, links=links)
    # The optimum is a packing of reduce/broadcast trees over every node, a bound for an AllReduce
    # of all of them; a partial reduce (CREW's group P, forest's active workers) has none here.
    partial = set(plan.contributing()) != set(plan.nodes) or set(plan.finishing()) != set(plan.nodes)
    bound = None if partial else optimum(graph, w.bytes)
    return BuiltPlan(topo, graph, plan, prediction, bound)


def run_variants(exp: Experiment, planned: list[Planned], hosts: Hosts, out_dir: Path,
                 progress: Callable[[str], None], on_run: Callable[[list], None] | None = None,
                 before_run: Callable[[], None] | None = None, on_ready: Callable[[], None] | None = None,
                 on_failure: Callable[[FailedRun], None] | None = None) -> list[dict]:
    """Run every planned variant ``repetitions`` times on ``hosts``, interleaved (so slow
    drifts hit all variants alike); one summarised record per run, ``on_run(runs so far)``
    after each, ``before_run()`` before each, ``on_ready()`` when its agents are all ready
    (its measured phase starts); a run that fails is ``on_failure(record)`` before its error
    is raised."""
    runs = []
    for rep in range(exp.repetitions):
        for v, plan, prediction, _ in planned:
            progress(f"repetition {rep + 1}/{exp.repetitions} of {v.label}: starting {len(plan.nodes)} agents")
            if before_run:
                before_run()
            try:
                result = _run_once(exp, v, plan, prediction, rep, hosts, out_dir, progress, on_ready)
            except TestbedError as e:
                if on_failure:
                    on_failure(_failed_run(v, rep, e))
                raise
            r = runtime.summarise(result, _summarise_run(rep, v.label, result, exp.workload.warmup))
            runs.append(r)
            if on_run:
                on_run(runs)
            progress(f"repetition {rep + 1} of {v.label}: CCT {r['cct_s'] or 0:.3f}s, correct={r['correct']}"
                     + runtime.notes(r))
            if not r["correct"]:  # results are still written; the CLI exits 1
                progress(f"WRONG RESULT at {', '.join(r['incorrect']) or 'some workers (digests differ)'}")
    return runs


def _run_once(exp: Experiment, v: Variant, plan: Plan, prediction: dict, rep: int, hosts: Hosts, out_dir: Path,
              progress: Callable[[str], None], on_ready: Callable[[], None] | None = None) -> dict:
    """One repetition of one variant: the coordinator's results."""
    w, a = exp.workload, exp.agents
    seed, n_its = exp.seed * 1000 + rep, w.warmup + w.iterations
    opts = runtime.options(runtime.RunContext(exp, v.scheme, plan, hosts.truth(), seed, n_its))
    opts.setdefault("compute_s", compute_times(w.compute_s, plan.nodes, n_its, seed))
    return run_agents(hosts, plan, out_dir, iterations=n_its, seed=seed, dtype=w.dtype,
                      stop_and_wait=a.stop_and_wait, subblock_bytes=a.subblock_bytes, links=a.links,
                      timeout_s=a.timeout_s,
                      progress=progress, predicted_s=prediction["cct_s"], clock_offset_ms=a.clock_offset_ms,
                      on_ready=on_ready, **opts)


def _failed_run(v: Variant, rep: int, e: TestbedError) -> FailedRun:
    done = (e.results if isinstance(e, Failure) else None) or {}
    return FailedRun(v.label, rep, str(e), e.culprit if isinstance(e, Failure) else None,
                     e.link if isinstance(e, Failure) else None, len(done.get("iterations") or []),
                     runtime.failure(done))


def plan_variants(exp: Experiment, progress: Callable[[str], None], source: str = "") -> list[Planned]:
    """Every scheme of ``exp`` planned; ConfigError (naming ``source`` and the scheme's key)
    for what a planner rejects."""
    planned = []
    for i, v in enumerate(exp.variants):
        progress(f"planning {v.label} ({v.scheme['name']}) for {exp.workload.bytes / 1e6:.3g} MB")
        built = build_plan(exp, v.scheme, source=source, key=scheme_key(i))
        bound = built.bound
        progress(f"  {sum(len(p) for p in built.plan.programs.values())} ops; predicted CCT "
                 f"{built.prediction['cct_s']:.3f}s, "
                 + (f"bound {bound['transfer_s']:.3f}s ({bound['bound']}), estimate with delay "
                    f"{bound['estimate_cct_s']:.3f}s" if bound else "no bound (partial reduce)"))
        planned.append(Planned(v, built.plan, built.prediction, built.bound))
    return planned


def scheme_key(i: int) -> str:
    """Where variant ``i`` of ``Experiment.variants`` (0: the main scheme) is in the file."""
    return "scheme" if i == 0 else f"variants[{i - 1}].scheme"


def add_summaries(results: dict, planned: list[Planned], exp: Experiment) -> dict:
    """Fill ``results["variants"]`` and ``results["summary"]`` from ``results["runs"]``."""
    results["variants"] = []
    for v, plan, prediction, bound in planned:
        runs = [r for r in results["runs"] if r["variant"] == v.label]
        results["variants"].append({
            "label": v.label, "scheme": v.scheme, "summary": _summary(runs, prediction, bound),
            "plan": {"scheme": plan.scheme, "ops": sum(len(p) for p in plan.programs.values()),
                     "bytes_sent": plan.bytes_sent(exp.workload.elem_bytes), "meta": plan.meta},
            "prediction": prediction, "bound": bound})
    main = results["variants"][0]["summary"]
    results["summary"] = {**main, "correct": all(r["correct"] for r in results["runs"]) and bool(results["runs"]),
                          "comparison": _comparison(results["variants"])}
    return results


def open_network(exp: Experiment, progress: Callable[[str], None], caps=None):
    """The experiment's emulated WAN (a context manager: built on entry, torn down on exit)."""
    from testbed.emulator.network import WanNetwork

    em = exp.emulator
    return WanNetwork(exp.topology, method=em.method, relay_procs=em.relay_procs, seed=exp.seed, log=progress,
                      caps=caps, tcp_cc=em.tcp_cc, frame_ms=em.frame_ms)


def run_experiment(exp: Experiment, out_dir: Path, progress: Callable[[str], None], net=None,
                   save: Callable[[dict], None] | None = None, planned: list[Planned] | None = None) -> dict:
    """Plan every variant (unless ``planned`` already), build the WAN once (or use ``net``, an
    open network of the same topology: a sweep reuses one), run every variant ``repetitions``
    times on it, tear down what it built, return results.  ``save(results so far)`` after every
    run, and with ``error`` set when a run fails (the error is raised after it), so a later
    failure keeps what finished."""
    from testbed.emulator.capabilities import probe

    planned = plan_variants(exp, progress) if planned is None else planned
    caps = probe()
    results: dict = {"experiment": exp.to_dict(), "environment": environment(caps), "runs": []}

    def checkpoint(runs: list) -> None:
        results["runs"] = runs
        if save:
            save(add_summaries(results, planned, exp))

    def failed(run: FailedRun) -> None:
        results["failure"] = run.to_dict()

    try:
        _run_on_network(exp, planned, results, out_dir, progress, caps, net, checkpoint, failed)
    except TestbedError as e:
        results["error"] = str(e)
        if save:
            save(add_summaries(results, planned, exp))
        raise
    return add_summaries(results, planned, exp)


def _run_on_network(exp: Experiment, planned: list[Planned], results: dict, out_dir: Path, progress, caps, net,
                    checkpoint: Callable[[list], None], failed: Callable[[FailedRun], None]) -> None:
    from testbed.emulator.dynamics import Scheduler, restore_network

    with (open_network(exp, progress, caps) if net is None else contextlib.nullcontext(net)) as net:
        results["links"] = net.link_report()
        results["events_t0_s"] = net.t0  # events[].t_s count from here (Unix time), transfers are Unix ns
        results["environment"]["host_sysctls"] = net.host_sysctls
        results["environment"]["memory_hold"] = net.memory_hold
        per_run = exp.dynamics_per_run and bool(exp.dynamics or exp.faults)
        scheds = [] if per_run else [Scheduler(net, exp.dynamics, exp.faults, log=progress).start()]

        def healthy() -> None:  # dynamics_per_run: each run's agents start on the healthy network
            if scheds:
                scheds[-1].stop()
            restore_network(net)

        def replay_dynamics() -> None:  # and its dynamics count from its measured phase's start
            scheds.append(Scheduler(net, exp.dynamics, exp.faults, log=progress).start())

        net.reset_relay_window()  # judge the emulator on the measured phase only
        cpu, paused = CpuMeter().start(), PauseMeter().start()
        try:
            run_variants(exp, planned, net.agent_hosts(), out_dir, progress, on_run=checkpoint,
                         before_run=healthy if per_run else None, on_ready=replay_dynamics if per_run else None,
                         on_failure=failed)
        finally:
            for sched in scheds:
                sched.stop()
            cpu_util, steal = cpu.stop()
            pauses = paused.stop()
            results["events"] = net.events + [{"error": e} for sched in scheds for e in sched.errors]
            try:
                relay = net.relay_stats()
            except Exception as e:  # never mask the run's own error with a reporting one
                relay, results["events"] = [], results["events"] + [{"error": f"relay statistics: {e}"}]
            results["emulation"] = emulation_health(net.method, len(net.relays), relay, cpu_util, steal,
                                                     exp.emulator.max_late_ms, pauses)
            results["emulation"]["iterations_cpu_util"] = cpu.busy_within(comm_windows(results["runs"]))
            for run in results["runs"]:
                run["iterations_cpu_util"] = cpu.busy_within(comm_windows([run]))
            results["emulation"]["relay_layout"] = net.relay_layout


def _comparison(variants: list[dict]) -> list[dict]:
    """Mean CCT of every variant and its ratio to the first variant's (the reference)."""
    ref = variants[0]["summary"]["cct_s"]["mean"]
    return [{"label": v["label"], "cct_s": v["summary"]["cct_s"]["mean"],
             "predicted_cct_s": v["summary"]["predicted_cct_s"], "efficiency": v["summary"]["efficiency"],
             "cct_ratio_to_first": (v["summary"]["cct_s"]["mean"] / ref)
             if ref and v["summary"]["cct_s"]["mean"] is not None else None}  # None: no run yet (a checkpoint)
            for v in variants]


def _summarise_run(rep: int, label: str, result: dict, warmup: int = 0) -> dict:
    """One repetition: CCT = mean over the measured iterations (warm-up ones are kept in
    the record, marked, but left out); correctness over all of them.  The run-time features
    add their parts (:func:`testbed.runtime.summarise`)."""
    its = result["iterations"]
    for it in its:
        it["warmup"] = it["iteration"] < warmup
    incorrect = sorted({n for it in its for n, wk in it["workers"].items() if not wk.get("correct", True)})
    return {"variant": label, "repetition": rep, "connections": result.get("connections", "channel"),
            "cct_s": stats([it["cct_s"] for it in its if not it["warmup"]])["mean"],
            "warmup_cct_s": [it["cct_s"] for it in its if it["warmup"]],  # cold: TCP start on fresh connections
            "iterations": its, "correct": all(it["correct"] for it in its) and not incorrect,
            "incorrect": incorrect, "errors": result.get("errors", []), "transfers": result.get("transfers"),
            "links": _per_link(result.get("transfers"), its), **_tcp_summary(its),
            **({"clock_offsets": result["clock_offsets"]} if "clock_offsets" in result else {})}


def _per_link(transfers: dict | None, iterations: list[dict]) -> list[dict]:
    """Bytes and busy time per (src, dst) pair from the per-chunk transfer records; with the
    agents' TCP counters, what loss recovery cost the connections from src to dst."""
    agg: dict[tuple, list] = {}
    for row in transfer_rows(transfers):
        start, end = row.send_start_ns, row.recv_end_ns
        a = agg.setdefault((row.src, row.dst), [0, start, end, 0, 0])
        a[0] += row.bytes
        a[1], a[2], a[3] = min(a[1], start), max(a[2], end), a[3] + 1
        a[4] += row.bytes if row.route else 0
    counted = bool(iterations) and all("tcp" in it for it in iterations)
    return [{"src": s, "dst": d, "bytes": b, "aux_bytes": x, "transfers": n, "span_s": (e - t) / 1e9,
             "goodput_mbps": b * 8 / max(e - t, 1) * 1e3,
             **(tcp_total(it["tcp"][f"{s}->{d}"] for it in iterations if f"{s}->{d}" in it["tcp"]) if counted else {})}
            for (s, d), (b, t, e, n, x) in sorted(agg.items())]


def _tcp_summary(iterations: list[dict]) -> dict:
    """``{"tcp": {retrans_segs, rtos, rto_s}}`` summed over the measured iterations and every
    connection, where every agent's kernel counts them; else nothing."""
    measured = [it for it in iterations if not it["warmup"]]
    if not measured or not all("tcp" in it for it in measured):
        return {}
    return {"tcp": tcp_total(v for it in measured for v in it["tcp"].values())}


def _summary(runs: list[dict], prediction: dict, bound: dict | None) -> dict:
    cct = stats([r["cct_s"] for r in runs])
    return {**runtime.variant_summary(runs), "cct_s": cct, "correct": all(r["correct"] for r in runs) and bool(runs),
            "predicted_cct_s": prediction["cct_s"], "bound_s": bound["transfer_s"] if bound else None,
            "estimate_cct_s": bound["estimate_cct_s"] if bound else None,
            "efficiency": bound["transfer_s"] / cct["mean"] if bound and cct["mean"] else None,
            "prediction_ratio": cct["mean"] / prediction["cct_s"] if cct["mean"] and prediction["cct_s"] else None}
