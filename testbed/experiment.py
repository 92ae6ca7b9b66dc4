"""An experiment's run: plan every variant, run them on :class:`~testbed.hosts.Hosts` (the
emulated WAN for ``run``, real hosts for ``deploy``), summarise.  Returns the data of
results.json; the command line writes it."""

from __future__ import annotations

import contextlib
import random
import statistics
import time
from pathlib import Path
from typing import Callable

from testbed.config import RUN_TIME_KEYS, Experiment
from testbed.errors import ConfigError, TestbedError
from testbed.hosts import Hosts, run_agents
from testbed.results import STEAL_MAX, CpuMeter, environment, stats

CPU_BUSY = 0.95  # whole-machine utilisation above which the emulator may not keep up


# CREW §V-A's per-iteration compute times: T1 (LSTM on UCF101) and T2 (Transformer on
# WMT16), from Eager-SGD (Li et al., PPoPP 2020), "rescaled to [0.05, 0.2] s".  The paper
# gives no shape; both are long-tailed (input lengths vary), so: 0.05 + 0.15 * Beta(a, b),
# right-skewed, T2 with the heavier tail (a choice; Beta parameters below).
CREW_TIMES = {"T1": (2.0, 5.0), "T2": (1.2, 2.5)}


def compute_times(spec, nodes: list[str], iterations: int, seed: int) -> dict[str, list[float]]:
    """Per-worker compute seconds per iteration from the ``workload.compute_s`` spec; each
    worker draws from its own seeded generator, so the order of ``nodes`` does not matter."""
    out: dict[str, list[float]] = {}
    for n in nodes:
        rng = random.Random(f"{seed}:{n}")
        if isinstance(spec, (int, float)):
            out[n] = [float(spec)] * iterations
        elif "per_worker" in spec:  # a number per worker, or a per-iteration trace (cycled)
            v = spec["per_worker"].get(n, 0.0)
            out[n] = [float(v[i % len(v)]) for i in range(iterations)] if isinstance(v, list) else [float(v)] * iterations
        elif "uniform" in spec:
            lo, hi = spec["uniform"]
            out[n] = [rng.uniform(lo, hi) for _ in range(iterations)]
        elif set(spec) & set(CREW_TIMES):  # CREW §V-A's T1 / T2, times a factor (Fig. 9: x2..6)
            (kind, factor), = spec.items()
            a, b = CREW_TIMES[kind]
            out[n] = [factor * (0.05 + 0.15 * rng.betavariate(a, b)) for _ in range(iterations)]
        else:
            mean, std = spec["normal"]
            out[n] = [max(0.0, rng.gauss(mean, std)) for _ in range(iterations)]
    return out


def build_plan(exp: Experiment, scheme: dict | None = None, *, source: str = "", key: str = "scheme"):
    """(topology scaled, graph, plan, prediction, bound) for a validated experiment and one of
    its schemes (default: the main one) — pure planning, no network.  What the planner rejects
    (a disconnected topology, a parameter) is a ConfigError naming ``source`` and ``key``."""
    from testbed import costmodel
    from testbed.planners import make_plan
    from testbed.planners.bound import optimum
    from testbed.wan import validate_connected

    scheme, topo, w = scheme or exp.scheme, exp.topology, exp.workload
    validate_connected(topo, source=source or exp.name, key="topology")
    graph = topo.graph()
    params = {k: v for k, v in scheme.items() if k not in ("name", *RUN_TIME_KEYS)}
    if scheme.get("groups"):  # groups form at run time; the JOB's plan is the scheme over every node
        params["active"] = None
    plan = make_plan(scheme["name"], graph, w.length, params, elem_bytes=w.elem_bytes, source=source or exp.name,
                     key=key, aux=scheme.get("aux"))
    plan.validate()
    a = scheme.get("adaptive")
    largest = max((op.length for _, op in plan.transfers()), default=0) * w.elem_bytes
    if a and a["mode"] == "estimated" and largest < a["probe_chunk_bytes"]:
        raise ConfigError(f"{a['probe_chunk_bytes']} bytes: no transfer of this plan is that large (the largest "
                          f"is {largest} bytes), so no link would ever be measured", source=source or exp.name,
                          key=f"{key}.adaptive.probe_chunk_bytes")
    prediction = costmodel.predict(plan, graph, elem_bytes=w.elem_bytes, stop_and_wait=exp.agents.stop_and_wait,
                                   tcp=True, transfer_s=costmodel.EXECUTOR_TRANSFER_S)
    # The optimum is a packing of reduce/broadcast trees over every node, a bound for an AllReduce
    # of all of them; a partial reduce (CREW's group P, forest's active workers) has none here.
    partial = set(plan.contributing()) != set(plan.nodes) or set(plan.finishing()) != set(plan.nodes)
    bound = None if partial else optimum(graph, w.bytes)
    return topo, graph, plan, prediction, bound


def run_variants(exp: Experiment, planned: list, hosts: Hosts, out_dir: Path,
                 progress: Callable[[str], None], on_run: Callable[[list], None] | None = None,
                 before_run: Callable[[], None] | None = None) -> list[dict]:
    """Run every planned variant ``repetitions`` times on ``hosts``, interleaved (so slow
    drifts hit all variants alike); one summarised record per run, ``on_run(runs so far)``
    after each, ``before_run()`` before each."""
    w, a = exp.workload, exp.agents
    runs = []
    for rep in range(exp.repetitions):
        for v, plan, prediction, _ in planned:
            progress(f"repetition {rep + 1}/{exp.repetitions} of {v.label}: starting {len(plan.nodes)} agents")
            seed = exp.seed * 1000 + rep
            n_its = w.warmup + w.iterations
            tasks = group_runtime(exp, v.scheme)
            if before_run:
                before_run()
            try:
                result = run_agents(hosts, plan, out_dir, iterations=n_its, seed=seed, dtype=w.dtype, tasks=tasks,
                                    compute_s=compute_times(w.compute_s, plan.nodes, MAX_ROUNDS if tasks else n_its,
                                                            seed),
                                    stop_and_wait=a.stop_and_wait, timeout_s=a.timeout_s, progress=progress,
                                    predicted_s=prediction["cct_s"],
                                    probe=probe_options(v.scheme, exp.topology.graph(), w.warmup),
                                    clock_offset_ms=a.clock_offset_ms,
                                    policy=replanner(exp, v.scheme, plan, hosts.truth()))
            except TestbedError as e:  # the failed run, recorded (results.json's "failure")
                done = getattr(e, "results", None) or {}
                e.failed_run = {"variant": v.label, "repetition": rep, "message": str(e),
                                "culprit": getattr(e, "culprit", None), "link": getattr(e, "link", None),
                                "iterations_completed": len(done.get("iterations") or []),
                                **({"groups": done["tasks_mode"]} if "tasks_mode" in done else {})}
                raise
            r = _summarise_run(rep, v.label, result, w.warmup)
            runs.append(r)
            if on_run:
                on_run(runs)
            progress(f"repetition {rep + 1} of {v.label}: CCT {r['cct_s'] or 0:.3f}s, correct={r['correct']}"
                     + (f", rounds in {tasks['window_s']:g} s: {r['rounds']}" if tasks else "")
                     + (f", {r['switches']} plan switches, link estimates within 10 %: "
                        f"{r['estimation']['rate_within_10pct']:.0%} of {r['estimation']['windows']}"
                        + (f" ({r['estimation']['trains']} packet trains, {r['estimation']['unrated_trains']} "
                           f"without a rate, at most "
                           f"{r['estimation']['train_overhead_max']:.2%} of a link)" if "trains" in r["estimation"] else "")
                        if r.get("estimation", {}).get("windows") else ""))
            if not r["correct"]:  # results are still written; the CLI exits 1
                progress(f"WRONG RESULT at {', '.join(r['incorrect']) or 'some workers (digests differ)'}")
    return runs


MAX_ROUNDS = 5000  # compute times drawn per worker for a groups run (the last one repeats)


def group_runtime(exp: Experiment, scheme: dict) -> dict | None:
    """The coordinator's ``tasks`` option for a scheme with ``groups`` (CREW §III: groups of
    p from the ready queue, agents/crew.py), None otherwise: ``plan_for(P)`` is the scheme's
    own pure planner with ``active: P``."""
    from testbed.planners import make_plan

    g = scheme.get("groups")
    if not g:
        return None
    graph, w = noisy_rates(exp.topology.graph(), g.get("noise", 0.0), exp.seed), exp.workload
    params = {k: v for k, v in scheme.items() if k not in ("name", *RUN_TIME_KEYS)}

    blocking = g.get("blocking", True)

    def plan_for(members: list[str], **failover):  # failover: crew's exclude / reassign
        return make_plan(scheme["name"], graph, w.length, {**params, "active": list(members), **failover,
                                                          **({} if blocking else {"prescattered": True})},
                         elem_bytes=w.elem_bytes)
    rate = None
    if scheme["name"] == "crew":  # Eq. (3)'s b_{i,j}: the rates of the paths as the controller sees them
        from testbed.planners.crew import pair_rates
        b = pair_rates(graph)
        rate = lambda i, j: b[(i, j)]  # noqa: E731
    return {"p": g["p"], "window_s": g["window_s"], "plan_for": plan_for, "rate": rate,
            "link_timeout_s": g.get("link_timeout_s", 0.0),
            **({"controller_down": g["controller_down"]} if g.get("controller_down") else {}),
            **({} if blocking else {"prescatter_for": lambda sender: prescatter_for(scheme, graph, w.length, sender)})}


def prescatter_for(scheme: dict, graph, length: int, sender: str):
    """Non-blocking CREW: ``sender``'s early scatter of its default blocks (P = N)."""
    from testbed.planners.crew import prescatter_plan

    return prescatter_plan(graph, length, sender, split=scheme.get("split", "network-aware"),
                           chunks=scheme.get("chunks", 0), rounding=scheme.get("rounding", "floor"),
                           scheduling=scheme.get("scheduling", "fcfs"))


def noisy_rates(graph, lam: float, seed: int):
    """CREW §V-H: the rates the controller plans with, b(1+x), x ~ U[-lam, lam] drawn once per
    link direction from ``seed`` (the emulator keeps the true b); ``graph`` itself if lam = 0."""
    if not lam:
        return graph
    g = graph.copy()
    for u, v in sorted(g.edges):
        g[u][v]["rate_mbps"] *= 1 + random.Random(f"{seed}:noise:{u}:{v}").uniform(-lam, lam)
    return g


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
    from testbed.costmodel import EXECUTOR_TRANSFER_S, predict
    from testbed.planners import make_plan

    a = scheme.get("adaptive")
    if not a or a["update_s"] <= 0:
        return None
    if a["mode"] == "oracle" and truth is None:
        raise ConfigError("mode oracle re-plans from the emulator's true rates: not available here",
                          key="scheme.adaptive.mode")
    graph, w = exp.topology.graph(), exp.workload
    params = {k: v for k, v in scheme.items() if k not in ("name", *RUN_TIME_KEYS)}
    seen = [plan]
    state = {"t": clock(), "plan": plan}

    def policy(iteration: int, net):
        if clock() - state["t"] < a["update_s"]:
            return None
        state["t"] = clock()
        latest = net.latest() if a["mode"] == "estimated" else {}
        for u, v, attrs in graph.edges(data=True):
            if a["mode"] == "oracle":
                attrs["rate_mbps"] = truth(u, v)["rate_mbps"]
            elif (u, v) in latest and latest[(u, v)]["rate_mbps"] > 0:
                attrs["rate_mbps"] = latest[(u, v)]["rate_mbps"]
        new = make_plan(scheme["name"], graph, w.length, params, elem_bytes=w.elem_bytes, aux=scheme.get("aux"))
        new = next((p for p in seen if (p.programs, p.aux) == (new.programs, new.aux)), None) or new
        if new is state["plan"]:
            return None
        cct = {id(p): predict(p, graph, elem_bytes=w.elem_bytes, tcp=True,
                                  transfer_s=EXECUTOR_TRANSFER_S)["cct_s"] for p in (new, state["plan"])}
        if cct[id(new)] > (1 - a["min_gain"]) * cct[id(state["plan"])]:
            return None
        if new not in seen:
            new.validate()
            seen.append(new)
        state["plan"] = new
        return new
    return policy


def plan_variants(exp: Experiment, progress: Callable[[str], None], source: str = "") -> list:
    """[(variant, plan, prediction, bound)] for every scheme of ``exp``; ConfigError (naming
    ``source`` and the scheme's key) for what a planner rejects."""
    planned = []
    for i, v in enumerate(exp.variants):
        progress(f"planning {v.label} ({v.scheme['name']}) for {exp.workload.bytes / 1e6:.3g} MB")
        _, _, plan, prediction, bound = build_plan(exp, v.scheme, source=source, key=scheme_key(i))
        progress(f"  {sum(len(p) for p in plan.programs.values())} ops; predicted CCT {prediction['cct_s']:.3f}s, "
                 + (f"bound {bound['cct_s']:.3f}s" if bound else "no bound (partial reduce)"))
        planned.append((v, plan, prediction, bound))
    return planned


def scheme_key(i: int) -> str:
    """Where variant ``i`` of ``Experiment.variants`` (0: the main scheme) is in the file."""
    return "scheme" if i == 0 else f"variants[{i - 1}].scheme"


def add_summaries(results: dict, planned: list, exp: Experiment) -> dict:
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
                      caps=caps, tcp_cc=em.tcp_cc)


def run_experiment(exp: Experiment, out_dir: Path, progress: Callable[[str], None], net=None,
                   save: Callable[[dict], None] | None = None) -> dict:
    """Plan every variant, build the WAN once (or use ``net``, an open network of the same
    topology: a sweep reuses one), run every variant ``repetitions`` times on it, tear down
    what it built, return results.  ``save(results so far)`` after every run, and with
    ``error`` set when a run fails (the error is raised after it), so a later failure keeps
    what finished."""
    from testbed.emulator.capabilities import probe

    planned = plan_variants(exp, progress)
    caps = probe()
    results: dict = {"experiment": exp.to_dict(), "environment": environment(caps), "runs": []}

    def checkpoint(runs: list) -> None:
        results["runs"] = runs
        if save:
            save(add_summaries(results, planned, exp))

    try:
        _run_on_network(exp, planned, results, out_dir, progress, caps, net, checkpoint)
    except TestbedError as e:
        results["error"] = str(e)
        if getattr(e, "failed_run", None):
            results["failure"] = e.failed_run
        if save:
            save(add_summaries(results, planned, exp))
        raise
    return add_summaries(results, planned, exp)


def _run_on_network(exp: Experiment, planned: list, results: dict, out_dir: Path, progress, caps, net,
                    checkpoint: Callable[[list], None]) -> None:
    from testbed.emulator.dynamics import Scheduler, restore_network

    with (open_network(exp, progress, caps) if net is None else contextlib.nullcontext(net)) as net:
        results["links"] = net.link_report()
        results["events_t0_s"] = net.t0  # events[].t_s count from here (Unix time), transfers are Unix ns
        results["environment"]["host_sysctls"] = net.host_sysctls
        results["environment"]["memory_hold"] = net.memory_hold
        per_run = exp.dynamics_per_run and bool(exp.dynamics or exp.faults)
        scheds = [] if per_run else [Scheduler(net, exp.dynamics, exp.faults, log=progress).start()]

        def replay_dynamics() -> None:  # dynamics_per_run: from this run's start, on the healthy network
            if scheds:
                scheds[-1].stop()
            restore_network(net)
            scheds.append(Scheduler(net, exp.dynamics, exp.faults, log=progress).start())

        net.reset_relay_window()  # judge the emulator on the measured phase only
        cpu = CpuMeter().start()
        try:
            run_variants(exp, planned, net.agent_hosts(), out_dir, progress, on_run=checkpoint,
                         before_run=replay_dynamics if per_run else None)
        finally:
            for sched in scheds:
                sched.stop()
            cpu_util, steal = cpu.stop()
            results["events"] = net.events + [{"error": e} for sched in scheds for e in sched.errors]
            try:
                relay = net.relay_stats()
            except Exception as e:  # never mask the run's own error with a reporting one
                relay, results["events"] = [], results["events"] + [{"error": f"relay statistics: {e}"}]
            results["emulation"] = _emulation_health(net.method, len(net.relays), relay, cpu_util, steal,
                                                      exp.emulator.max_late_ms)
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
    the record, marked, but left out); correctness over all of them.  A groups run (CREW
    at run time): CCT = mean over its tasks, ``rounds`` per worker in the window."""
    if "tasks_mode" in result:
        tm = result["tasks_mode"]
        tasks = tm["tasks"]
        incorrect = sorted({m for t in tasks for m, d in t["members_done"].items() if not d["correct"]})
        return {"variant": label, "repetition": rep,  # CCT over completed tasks (not stopped ones)
                "cct_s": stats([t["cct_s"] for t in tasks if "cct_s" in t])["mean"],
                "warmup_cct_s": [], "iterations": [], "rounds": tm["rounds"],
                "rounds_total": sum(tm["rounds"].values()), "groups": tm,
                "correct": bool(tasks) and all(t["correct"] for t in tasks) and not result.get("errors"),
                "incorrect": incorrect, "errors": result.get("errors", []), "transfers": None, "links": []}
    its = result["iterations"]
    for it in its:
        it["warmup"] = it["iteration"] < warmup
    incorrect = sorted({n for it in its for n, wk in it["workers"].items() if not wk.get("correct", True)})
    return {"variant": label, "repetition": rep,
            "cct_s": stats([it["cct_s"] for it in its if not it["warmup"]])["mean"],
            "warmup_cct_s": [it["cct_s"] for it in its if it["warmup"]],  # cold: TCP start on fresh connections
            "iterations": its, "correct": all(it["correct"] for it in its) and not incorrect,
            "incorrect": incorrect, "errors": result.get("errors", []), "transfers": result.get("transfers"), "links": _per_link(result.get("transfers")),
            **({"aux": aux} if (aux := _aux_use(result.get("transfers"))) else {}),
            **{k: result[k] for k in ("clock_offsets", "estimates", "switches", "versions") if k in result},
            **({"estimation": estimation_error(result["estimates"])} if result.get("estimates") else {})}


def estimation_error(estimates: dict) -> dict:
    """How far the closed loop's link estimates were from the emulator's configured rate and
    delay at the same instants (windows that gave a link no estimate yet left out): windows, share of link estimates within 10 % of the rate (and
    of single windows), median and worst relative rate error, worst one-way-delay error."""
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


def _per_link(transfers: dict | None) -> list[dict]:
    """Bytes and busy time per (src, dst) pair from the per-chunk transfer records."""
    if not transfers or not transfers.get("rows"):
        return []
    col = {c: i for i, c in enumerate(transfers["columns"])}
    agg: dict[tuple, list] = {}
    for row in transfers["rows"]:
        key = (row[col["src"]], row[col["dst"]])
        start, end = row[col["send_start_ns"]], row[col["recv_end_ns"]]
        a = agg.setdefault(key, [0, start, end, 0, 0])
        a[0] += row[col["bytes"]]
        a[1], a[2], a[3] = min(a[1], start), max(a[2], end), a[3] + 1
        a[4] += row[col["bytes"]] if row[col["route"]] else 0
    return [{"src": s, "dst": d, "bytes": b, "aux_bytes": x, "transfers": n, "span_s": (e - t) / 1e9,
             "goodput_mbps": b * 8 / max(e - t, 1) * 1e3}
            for (s, d), (b, t, e, n, x) in sorted(agg.items())]


def _aux_use(transfers: dict | None) -> dict | None:
    """Auxiliary transmission (NetStorm §VI) in a run: chunks and bytes sent over auxiliary
    paths, bytes each hop carried for them and bytes each relay forwarded; None if none."""
    if not transfers or not transfers.get("rows"):
        return None
    col = {c: i for i, c in enumerate(transfers["columns"])}
    hops: dict[tuple, int] = {}
    relayed: dict[str, int] = {}
    chunks = total = 0
    for row in transfers["rows"]:
        path, size = row[col["route"]].split(">") if row[col["route"]] else [], row[col["bytes"]]
        if path:
            chunks, total = chunks + 1, total + size
            for a, b in zip(path, path[1:]):
                hops[(a, b)] = hops.get((a, b), 0) + size
            for r in path[1:-1]:
                relayed[r] = relayed.get(r, 0) + size
    return {"chunks": chunks, "bytes": total, "forwarded": relayed,
            "hops": [{"src": a, "dst": b, "bytes": n} for (a, b), n in sorted(hops.items())]} if chunks else None


def _emulation_health(method: str, relays: int, relay: list[dict], cpu_util: float, steal: float,
                      max_late_ms: float) -> dict:
    """``relays`` delay-relay processes ran (none where no link needed one); ``relay`` their
    statistics; ``cpu_util`` and ``steal`` from :class:`~testbed.results.CpuMeter`."""
    from testbed.emulator import relay as relay_mod

    warnings = ["no statistics from the delay relay: fidelity unknown"] if relays and not relay else []
    for i, st in enumerate(relay):
        ok, why = relay_mod.kept_up(st, max_p99_late_ms=max_late_ms)
        if not ok:
            warnings.append(f"relay {i}: {why}")
    if cpu_util > CPU_BUSY:
        warnings.append(f"machine CPU {cpu_util:.0%} busy: link emulation and agents may be CPU-bound")
    if steal > STEAL_MAX:
        warnings.append(f"the hypervisor took {steal:.1%} of the CPU time (steal): every timing may be stretched")
    return {"method": method, "kept_up": not warnings, "warnings": warnings, "cpu_util": cpu_util, "steal": steal,
            "max_late_ms": max_late_ms, "relay": relay}


def _summary(runs: list[dict], prediction: dict, bound: dict) -> dict:
    cct = stats([r["cct_s"] for r in runs])
    rounds = [r["rounds_total"] for r in runs if "rounds_total" in r]
    return {**({"rounds_total": stats(rounds)} if rounds else {}),"cct_s": cct, "correct": all(r["correct"] for r in runs) and bool(runs),
            "predicted_cct_s": prediction["cct_s"], "bound_cct_s": bound["cct_s"] if bound else None,
            "efficiency": bound["cct_s"] / cct["mean"] if bound and cct["mean"] else None,
            "prediction_ratio": cct["mean"] / prediction["cct_s"] if cct["mean"] and prediction["cct_s"] else None}
