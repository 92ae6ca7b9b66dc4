"""``testbed bench``: benchmarks that report ratios measured in one run (no absolute pass/fail).

* ``dataplane`` — the agents' data plane: per chunk size (4 KB to 64 MB), on loopback the
  per-transfer CPU of an interior node (receive, add, forward) and goodput against iperf3,
  cut-through against store-and-forward; on one shaped link (100 Mbit/s, 30 ms by default;
  ``rates``) transfers/s and goodput against iperf3 on the same link, same bytes, same run.
* ``ring`` — ring AllReduce on the uniform 6-node ring topology: measured CCT vs the α-β
  prediction (``costmodel.alpha_beta``) and the flow-level prediction.
* ``planner`` — MTREE planner (tree generation + MILP) time on the 40-node, 231-link
  IDN-like topology, every scheme's planning time on NetStorm's 9-DC overlay, and what
  ``validate``/``plan``/``run`` do before a run (plan, prediction, optimum) for ring on
  CREW's 60-datacenter mesh (1,770 links) and a 200-datacenter sparse WAN (600 links).
* ``adaptive`` — NetStorm on its 9-DC overlay without dynamics, adaptive (probing,
  re-planning every 5 s) vs static, repetitions interleaved on one network: the CCT ratio is
  the closed loop's overhead (NetStorm §V claims none worth noting).
* ``efficiency`` — every tree scheme on NetStorm's overlay and GScale: CCT against the
  bound and the cost model's prediction, and where the time goes (:mod:`testbed.efficiency`).
* ``peers`` — PyTorch's gloo all_reduce in the emulated datacenters (``exec``) against the
  schemes on the same WAN: each scheme's speed-up over it (skipped without torch).
* ``chaos`` / ``fuzz`` — ``testbed.chaos``: 100 seeded SIGSTOP/SIGKILL trials on loopback
  (share ending right, time to end); 10^5 mutated wire frames (share detected per field).
* ``emulator`` — emulator headroom: for a topology, the largest scale at which
  ``linkcheck --concurrent`` passes every direction with the emulator kept up: through the
  user-space delay relay under TCP, and under UDP both through the relay and with HTB alone
  (delays, jitter and loss removed: the kernel's shaping capacity), and the UDP ratio — the
  share of that capacity the delay emulation preserves.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Callable

from agents.protocol import transfer_rows
from testbed.chaos import bench_chaos, bench_fuzz
from testbed.emulator.hosts import EmulatedHosts
from testbed.hosts import run_agents
from testbed.results import environment


def _topology(links, name):
    from testbed.topology import load_topology

    return load_topology({"name": name, "datacenters": sorted({n for l in links for n in l["between"]}),
                          "links": links})


DATAPLANE_CHUNKS = ("4KB", "64KB", "1MB", "16MB", "64MB")
DATAPLANE_LOOPBACK_BYTES = 128 << 20  # per iteration of the loopback chain (at least 2 chunks)


def _link_plan(nbytes: int, chunk: int):
    """a sends ``nbytes`` to b in transfers of ``chunk`` bytes, one after another on one connection."""
    from testbed.plan import Plan, ProgramBuilder

    b = ProgramBuilder(["a", "b"])
    elems, step = nbytes // 4, max(1, chunk // 4)
    for k, off in enumerate(range(0, elems, step)):
        b.transfer("a", "b", off, min(step, elems - off), reduce=True, chunk=k)
    return Plan("transfer", ["a", "b"], elems, b.programs, participants=["a"], receivers=["b"])


def bench_dataplane(out: Path, progress, sizes: tuple[str, ...] = DATAPLANE_CHUNKS, rates: tuple[float, ...] = (100.0,),
                    delay: float = 30.0, link_mb: float = 48.0, loopback: bool = True) -> dict:
    """The agents' data plane, chunk sizes ``sizes``: on loopback (:mod:`testbed.dataplane`:
    a -> b -> c, b adds and forwards; its CPU per chunk is the interior node's per-transfer
    cost; cut-through against store-and-forward in the same run; iperf3 on the same loopback);
    then per rate in ``rates`` (Mbit/s) one emulated link (``delay`` ms): iperf3's goodput for
    ``link_mb`` MB, and the agents' for the same bytes as one transfer and in chunks of each
    size (transfers/s, goodput, ratio to iperf3)."""
    from testbed.emulator.network import WanNetwork

    rows = _loopback_rows(sizes, progress) if loopback else []
    links = []
    for rate in rates:
        topo = _topology([{"between": ["a", "b"], "rate_mbps": rate, "delay_ms": delay}], f"bench-link-{rate:g}")
        nbytes = int(link_mb * 1e6) // 4 * 4
        with WanNetwork(topo, log=progress) as net:
            progress(f"iperf3: {link_mb:g} MB over {rate:g} Mbit/s, {delay:g} ms")
            iperf_mbps = _iperf3_link(net, nbytes)
            links.append({"rate_mbps": rate, "delay_ms": delay, "method": net.method, "iperf3_mbps": iperf_mbps})
            for size in ("whole",) + tuple(sizes):
                rows.append(_link_row(net, out / f"link-{rate:g}-{size}", nbytes, size, progress,
                                      link=f"{rate:g} Mbit/s, {delay:g} ms", link_mb=link_mb, iperf_mbps=iperf_mbps))
    return {"table": rows, "links": links, "bytes_per_link_run": int(link_mb * 1e6) // 4 * 4}


def _loopback_rows(sizes: tuple[str, ...], progress) -> list[dict]:
    """Per chunk size, the loopback chain a -> b -> c, cut-through and store-and-forward,
    against iperf3 on the same loopback."""
    from testbed.dataplane import iperf3_loopback, loopback_chain
    from testbed.workloads import parse_size

    rows = []
    lo_mbps = iperf3_loopback(DATAPLANE_LOOPBACK_BYTES)
    progress(f"loopback: iperf3 {lo_mbps:.0f} Mbit/s")
    for size in sizes:
        chunk = int(parse_size(size))
        chunks = max(2, min(2000, DATAPLANE_LOOPBACK_BYTES // chunk))
        r = {ct: loopback_chain(chunk, chunks, 3, cut_through=ct) for ct in (True, False)}
        b, sf = r[True]["b"], r[False]["b"]
        rows.append({"link": "loopback", "chunk": size, "chunks": chunks, "transfers_per_s": r[True]["c"]["transfers_per_s"],
                     "goodput_mbps": r[True]["c"]["goodput_mbps"], "iperf3_mbps": lo_mbps,
                     "ratio": r[True]["c"]["goodput_mbps"] / lo_mbps,
                     "interior_cpu_ms": b["cpu_per_chunk_ms"], "leaf_cpu_ms": r[True]["c"]["cpu_per_chunk_ms"],
                     "store_forward_goodput_mbps": r[False]["c"]["goodput_mbps"],
                     "store_forward_interior_cpu_ms": sf["cpu_per_chunk_ms"],
                     "correct": r[True]["exact"] and r[False]["exact"]})
        progress(f"loopback {size} x {chunks}: {rows[-1]['goodput_mbps']:.0f} Mbit/s, "
                 f"{rows[-1]['transfers_per_s']:.0f} transfers/s, interior CPU {b['cpu_per_chunk_ms']:.3f} ms/chunk")
    return rows


def _iperf3_link(net, nbytes: int) -> float:
    """iperf3's goodput (Mbit/s) sending ``nbytes`` from a to b over the emulated link."""
    srv = net.popen("b", ["iperf3", "-s", "-1", "-p", "5299"])
    time.sleep(0.5)
    cli = net.popen("a", ["iperf3", "-c", net.peer_address("a", "b"), "-p", "5299", "-n", str(nbytes), "-J"],
                    stdout=subprocess.PIPE, text=True)
    out_c, _ = cli.communicate(timeout=600)
    srv.wait(timeout=10)
    return json.loads(out_c)["end"]["sum_received"]["bits_per_second"] / 1e6


def _link_row(net, run_dir: Path, nbytes: int, size: str, progress, link: str, link_mb: float,
              iperf_mbps: float) -> dict:
    """The agents sending the same ``nbytes`` from a to b in transfers of ``size`` ("whole":
    one transfer): transfers/s and goodput against iperf3's."""
    from testbed.workloads import parse_size

    chunk = nbytes if size == "whole" else int(parse_size(size))
    plan = _link_plan(nbytes, chunk)
    progress(f"agents: the same {link_mb:g} MB in {len(plan.programs['a'])} transfers of {size}")
    res = run_agents(EmulatedHosts(net), plan, run_dir, progress=progress, timeout_s=600)
    tr = transfer_rows(res["transfers"])
    secs = (max(r.recv_end_ns for r in tr) - min(r.send_start_ns for r in tr)) / 1e9
    mbps = nbytes * 8 / secs / 1e6
    progress(f"agents: {mbps:.1f} Mbit/s ({mbps / iperf_mbps:.3f} of iperf3)")
    return {"link": link, "chunk": size, "chunks": len(tr), "transfers_per_s": len(tr) / secs, "goodput_mbps": mbps,
            "iperf3_mbps": iperf_mbps, "ratio": mbps / iperf_mbps,
            "correct": all(it["correct"] for it in res["iterations"])}


def bench_ring(out: Path, progress, size_mb: float = 24.0) -> dict:
    """Ring AllReduce on `ring-6`, measured against the alpha-beta model and the flow-level
    cost model."""
    from testbed import config
    from testbed.costmodel import alpha_beta
    from testbed.experiment import build_plan, run_experiment

    exp = config.validate({"name": "bench-ring", "topology": "ring-6", "scheme": {"name": "ring"},
                           "workload": {"size": f"{size_mb}MB"}, "repetitions": 2}, "<bench>")
    res = run_experiment(exp, out / "ring", progress)
    _, graph, plan, prediction, _ = build_plan(exp)
    ab = alpha_beta(plan, graph, elem_bytes=exp.workload.elem_bytes)
    measured = res["summary"]["cct_s"]["mean"]
    ab_s = ab["cct_s"] if isinstance(ab, dict) else ab
    return {"bytes": exp.workload.bytes, "measured_cct_s": measured, "alpha_beta_cct_s": ab_s,
            "flow_model_cct_s": prediction["cct_s"], "ratio_to_alpha_beta": measured / ab_s,
            "ratio_to_flow_model": measured / prediction["cct_s"], "correct": res["summary"]["correct"],
            "emulation": {k: res["emulation"][k] for k in ("method", "kept_up", "warnings")}}


# The papers' scales: CREW's default n = 60 (full mesh) and a sparse WAN of 200 datacenters.
PLANNER_SCALES = (("crew-mesh-60", {"kind": "crew-mesh", "n": 60}),
                  ("sparse-200", {"kind": "mtree-random", "n": 200, "m": 600, "asymmetric": True}))


def bench_planner(out: Path, progress) -> dict:
    """Planning time: MTREE on the 40-node IDN-like WAN, every scheme on NetStorm's overlay, and
    ring with its prediction and the optimum at the papers' scales (:data:`PLANNER_SCALES`; no
    network)."""
    from testbed import config
    from testbed.experiment import build_plan
    from testbed.planners import make_plan, schemes
    from testbed.topology import load_topology

    result = {}
    g40 = load_topology("idn-like-40").graph()
    plan = make_plan("mtree", g40, 1 << 20)
    result["mtree_idn40_s"] = plan.meta["planner_s"]
    result["mtree_idn40_trees"] = len(plan.meta.get("trees", []))
    g9 = load_topology("netstorm-internet2-9").graph()
    per = {}
    for name in sorted(schemes()):
        try:
            per[name] = make_plan(name, g9, 1 << 20).meta["planner_s"]
        except Exception as e:  # a scheme that needs a special topology (e.g. a mesh)
            per[name] = f"n/a: {e}"
    result["netstorm9_s"] = per
    for label, gen in PLANNER_SCALES:
        exp = config.validate({"name": f"bench-planner-{label}", "topology": {"name": label, "generator": gen},
                               "scheme": {"name": "ring"}, "workload": {"size": "8MB"}}, "<bench planner>")
        progress(f"planner: ring, prediction and optimum on {label}")
        t0 = time.perf_counter()
        _, _, plan, _, bound = build_plan(exp)
        result[label] = {"planning_s": time.perf_counter() - t0, "ring_s": plan.meta["planner_s"],
                         "optimum_s": bound["planner_s"], "bound": bound["bound"], "gap": bound["gap"],
                         "rate_mbps": bound["rate_mbps"], "packing_rate_mbps": bound["packing_rate_mbps"]}
    return result


def bench_adaptive(out: Path, progress, size_mb: float = 16.0, repetitions: int = 3) -> dict:
    """NetStorm with and without the closed loop on NetStorm's overlay with static rates: their
    CCT ratio (what probing and re-planning cost where there is nothing to adapt to)."""
    from testbed import config
    from testbed.experiment import run_experiment

    exp = config.validate({"name": "bench-adaptive", "topology": "netstorm-internet2-9", "seed": 1,
                           "scheme": {"name": "netstorm"},
                           "variants": [{"label": "static", "scheme": {"name": "netstorm", "adaptive": False}}],
                           "workload": {"size": f"{size_mb}MB", "iterations": 6}, "repetitions": repetitions,
                           "emulator": {"tcp_cc": "bbr"}}, "<bench>")
    res = run_experiment(exp, out / "adaptive", progress)
    cct = {v["label"]: v["summary"]["cct_s"]["mean"] for v in res["variants"]}
    runs = [r for r in res["runs"] if r["variant"] == "netstorm"]
    return {"bytes": exp.workload.bytes, "adaptive_cct_s": cct["netstorm"], "static_cct_s": cct["static"],
            "ratio": cct["netstorm"] / cct["static"], "switches": [r.get("switches", 0) for r in runs],
            "probe_windows": [len((r.get("estimates") or {}).get("series", [])) for r in runs],
            "correct": res["summary"]["correct"],
            "emulation": {k: res["emulation"][k] for k in ("method", "kept_up", "warnings")}}


def largest_passing(passes: Callable[[float], bool], start: float = 1.0, lo: float = 0.1, hi: float = 4.0,
                    factor: float = 1.25, precision: float = 1.1) -> tuple[float | None, list[tuple[float, bool]]]:
    """Largest scale in [lo, hi] at which ``passes(scale)`` holds, assuming it holds below some
    threshold and not above: from ``start``, step by ``factor`` until the verdict flips, then
    bisect (geometrically) until the bracket is within ``precision``.  Returns the largest
    passing scale tried (None if even ``lo`` fails) and every (scale, verdict) tried."""
    tried: list[tuple[float, bool]] = []

    def check(x: float) -> bool:
        ok = bool(passes(x))
        tried.append((x, ok))
        return ok

    good, bad = None, None
    x = min(max(start, lo), hi)
    if check(x):
        good = x
        while good < hi:
            x = min(hi, good * factor)
            if not check(x):
                bad = x
                break
            good = x
    else:
        bad = x
        while bad > lo:
            x = max(lo, bad / factor)
            if check(x):
                good = x
                break
            bad = x
    while good is not None and bad is not None and bad / good > precision:
        x = round((good * bad) ** 0.5, 3)
        if check(x):
            good = x
        else:
            bad = x
    return good, tried


def without_delays(topo):
    """The same links with delay, jitter and loss removed: shaped by HTB alone, no relay."""
    from dataclasses import replace

    from testbed.wan import Topology

    def bare(d):
        return replace(d, delay_ms=0.0, jitter_ms=0.0, loss=0.0)

    return Topology(topo.name + "-htb-only", list(topo.nodes), [replace(l, ab=bare(l.ab), ba=bare(l.ba))
                                                               for l in topo.links],
                    topo.source, topo.scale, {n: dict(a) for n, a in topo.node_attrs.items()})


EMULATOR_SEARCHES = (("relay", "tcp"), ("relay", "udp"), ("htb", "udp"))  # (path, linkcheck load)


def bench_emulator(out: Path, progress, topology: str = "netstorm-internet2-9", tcp_cc: str | None = None,
                   seconds: float = 6.0, lo: float = 0.02, hi: float = 4.0) -> dict:
    """Three searches of the largest passing scale: through the relay under TCP (what the
    experiments get), and through the relay and HTB alone under UDP, whose ratio is the share
    of the kernel's shaping capacity the delay emulation keeps.  The reference is not TCP: with
    the delays removed, TCP on an asymmetric link loaded both ways reads its ACKs starving
    behind the slow direction's data (NetStorm's overlay failed at every scale down to 0.1)."""
    from testbed.emulator import DEFAULT_TCP_CC
    from testbed.emulator.linkcheck import run_linkcheck
    from testbed.results import write_json_atomic
    from testbed.topology import load_topology

    cc = tcp_cc or DEFAULT_TCP_CC
    topo = load_topology(topology, source=topology)
    result = {"topology": topo.name, "tcp_cc": cc, "seconds": seconds,
              "capacity_mbps_at_scale_1": sum(l.ab.rate_mbps + l.ba.rate_mbps for l in topo.links)}
    for path, load in EMULATOR_SEARCHES:
        base, name, runs = topo if path == "relay" else without_delays(topo), f"{path}-{load}", []

        def check(scale: float, attempt: int) -> tuple[bool, bool]:
            """(passed, worth measuring again: a near miss, at least half the directions in tolerance)."""
            progress(f"{name}: linkcheck --concurrent --load {load} at scale {scale:g}")
            r = run_linkcheck(base.scaled(scale), seconds=seconds, phases=("concurrent",), tcp_cc=cc, load=load,
                              progress=lambda m: None)
            rows = r["directions"]
            ok, n_ok = r["ok"], sum(d["ok"] for d in rows)  # ok: directions in tolerance and emulator kept up
            runs.append({"scale": scale, "attempt": attempt, "ok": ok, "directions_ok": n_ok,
                         "directions": len(rows), "worst_rate_ratio": min((d.get("rate_ratio") or 0) for d in rows),
                         "kept_up": r["emulation_kept_up"], "cpu_util": r.get("concurrent_cpu_util"),
                         "steal": r.get("steal"), "method": r.get("method"), "relay_layout": r.get("relay_layout")})
            write_json_atomic(out / f"{name}-scale-{scale:g}-{attempt}.json", r)
            progress(f"{name}: scale {scale:g}: {n_ok}/{len(rows)} directions, "
                     f"kept up {r['emulation_kept_up']['ok']} -> {'pass' if ok else 'fail'}")
            return ok, 2 * n_ok >= len(rows)

        def passes(scale: float) -> bool:
            # a near miss is measured once more, as the tests' fidelity rule: one machine-wide
            # stall (this VM's host takes the vCPUs for 9-36 ms at times) must not set the limit
            ok, near = check(scale, 1)
            return ok or near and check(scale, 2)[0]

        best, _ = largest_passing(passes, lo=lo, hi=hi)
        result[name] = {"max_scale": best, "max_capacity_mbps": best and best * result["capacity_mbps_at_scale_1"],
                        "runs": runs}
    r, h = result["relay-udp"]["max_scale"], result["htb-udp"]["max_scale"]
    result["ratio"] = r / h if r and h else None
    return result


# The benches' default schemes: the tree schemes, then the bound's own packing run as a plan, whose
# row is what pipeline fill, TCP and the executor leave of the bound with no loss to the plan's rate
BENCH_SCHEMES = ("mtree", "forest", "blink", "multitree", "netstorm", "mst", "packing")
# Measured iterations per scheme in bench efficiency and peers (after one warm-up): their mean is
# the CCT, so one slow iteration does not decide a row alone.
BENCH_ITERATIONS = 3
# (topology, scale, TCP congestion control, default sizes before the scale): NetStorm's overlay has
# 0.02 % random loss (BBR, as netstorm-baselines); GScale is lossless with long RTTs (cubic), at a
# scale two shared cores sustain, with a size at which bandwidth, not its 0.1-0.8 s RTTs, dominates
EFFICIENCY_CASES = (("netstorm-internet2-9", 1.0, "bbr", ("16MB", "64MB")), ("gscale-b4-12", 0.1, "cubic", ("128MB",)))
EFFICIENCY_COLUMNS = ["topology", "size", "scheme", "cct_s", "bound_s", "predicted_s", "efficiency",
                      "measured_over_predicted", "tcp_retrans_segs", "tcp_rtos", "plan_factor", "execution_factor",
                      "bottleneck", "bottleneck_busy", "mean_utilisation", "longest_idle_s", "startup_s", "tail_s",
                      "bottleneck_busy_mbps", "bottleneck_tcp_mbps", "start_skew_s", "trees", "first_tree_done_share",
                      "correct", "host_cpu"]


def bench_efficiency(out: Path, progress, sizes: tuple[str, ...] | None = None,
                     schemes: tuple[str, ...] = BENCH_SCHEMES, topologies: tuple[str, ...] | None = None) -> dict:
    """Every tree scheme and the bound's packing against the bound and its prediction, with
    where the time goes (:mod:`testbed.efficiency`): one experiment per topology and size
    (nominal, before the scale; every scheme a variant on one network, 1 warm-up +
    :data:`BENCH_ITERATIONS` measured iterations, their mean the CCT; the link columns from the
    last), one row per scheme, ``efficiency.csv`` and one figure per topology.  ``sizes``
    (default: each topology's own, :data:`EFFICIENCY_CASES`) applies to every topology."""
    from testbed.experiment import run_experiment
    from testbed.report import write_csv
    from testbed.results import write_json_atomic

    rows, kept = [], []
    for topo, scale, cc, default_sizes in EFFICIENCY_CASES:
        if topologies and topo not in topologies:
            continue
        for size in sizes or default_sizes:
            exp = _schemes_experiment("efficiency", topo, scale, cc, size, schemes)
            progress(f"efficiency: {topo} (scale {scale:g}, {cc}), {size}: {', '.join(schemes)}")
            res = run_experiment(exp, out / f"{topo}-{size}", progress)
            write_json_atomic(out / f"{topo}-{size}" / "results.json", res)  # `testbed report` reads it
            kept.append(res["emulation"]["kept_up"])
            rows += _efficiency_rows(res, exp.topology.graph(), topo, size)
    write_csv(out / "efficiency.csv", rows, EFFICIENCY_COLUMNS)
    figures = [str(efficiency_figure([r for r in rows if r["topology"] == t], out / f"efficiency-{t}.png"))
               for t in dict.fromkeys(r["topology"] for r in rows)]
    return {"table": [{k: r[k] for k in EFFICIENCY_COLUMNS} for r in rows], "figures": figures,
            "analysis": [{"topology": r["topology"], "size": r["size"], "scheme": r["scheme"], **r["_analysis"]}
                         for r in rows],
            "kept_up": all(kept), "csv": str(out / "efficiency.csv")}


def _schemes_experiment(bench: str, topo: str, scale: float, cc: str, size: str, schemes: tuple[str, ...]):
    """The experiment ``bench`` (efficiency, peers) runs on ``topo``: every scheme a variant
    (NetStorm static), one repetition of 1 warm-up + :data:`BENCH_ITERATIONS` of ``size``."""
    from testbed import config

    variants = [{"label": s, "scheme": {"name": s, **({"adaptive": False} if s == "netstorm" else {})}}
                for s in schemes]
    return config.validate({"name": f"{bench}-{topo}-{size}", "topology": topo, "scale": scale, "seed": 1,
                            "scheme": variants[0]["scheme"], "variants": variants[1:], "repetitions": 1,
                            "workload": {"size": size, "warmup": 1, "iterations": BENCH_ITERATIONS},
                            "agents": {"timeout_s": 300}, "emulator": {"tcp_cc": cc}}, f"<bench {bench}>")


def _efficiency_rows(res: dict, graph, topo: str, size: str) -> list[dict]:
    """One row per variant of ``res``: CCT against bound and prediction, and where the time
    went (its analysis kept under ``_analysis`` for the figure and bench.json)."""
    from testbed.costmodel import TCP_LINK_SHARE
    from testbed.efficiency import analyse_run, breakdown

    rows = []
    for v in res["variants"]:
        sm = v["summary"]
        run = next(r for r in res["runs"] if r["variant"] == v["label"])
        a = analyse_run(run, graph)
        bd = breakdown(sm["cct_s"]["mean"], sm["bound_s"], a)
        hot, tcp = a.get("bottleneck") or {}, run.get("tcp", {})
        rows.append({"topology": topo, "size": size, "scheme": v["label"], "cct_s": sm["cct_s"]["mean"],
                     "bound_s": sm["bound_s"], "predicted_s": sm["predicted_cct_s"],
                     "efficiency": sm["efficiency"], "measured_over_predicted": sm["prediction_ratio"],
                     # loss recovery, which the cost model leaves out (None: the kernel does not count it)
                     "tcp_retrans_segs": tcp.get("retrans_segs"), "tcp_rtos": tcp.get("rtos"),
                     "plan_factor": bd.get("plan_factor"), "execution_factor": bd.get("execution_factor"),
                     "bottleneck": hot.get("link"), "bottleneck_busy": hot.get("busy_share"),
                     "mean_utilisation": a.get("mean_utilisation"), "longest_idle_s": hot.get("longest_idle_s"),
                     "startup_s": hot.get("startup_s"), "tail_s": hot.get("tail_s"),
                     "bottleneck_busy_mbps": hot.get("busy_mbps"),
                     "bottleneck_tcp_mbps": hot["rate_mbps"] * TCP_LINK_SHARE if hot else None,
                     "start_skew_s": a.get("start_skew_s"), "trees": a.get("trees"),
                     "first_tree_done_share": a.get("first_tree_done_share"), "correct": run["correct"],
                     "host_cpu": run.get("iterations_cpu_util"), "_analysis": a})
    return rows


def efficiency_figure(rows: list[dict], path: Path) -> Path:
    """Left: CCT, prediction and bound per scheme and size.  Right: the busiest link's busy
    share and the tree finish times (as shares of the CCT) per scheme at the largest size."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), dpi=110, layout="constrained")
    ax, bx = fig.subplots(1, 2)
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    schemes = list(dict.fromkeys(r["scheme"] for r in rows))
    w = 0.8 / max(1, len(sizes))
    for k, size in enumerate(sizes):
        xs = [i + (k - (len(sizes) - 1) / 2) * w for i in range(len(schemes))]
        by = {r["scheme"]: r for r in rows if r["size"] == size}
        ax.bar(xs, [by[s]["cct_s"] or 0 for s in schemes], width=w * 0.9, label=f"CCT {size}", alpha=0.8)
        ax.plot(xs, [by[s]["predicted_s"] for s in schemes], "D", color="#d95f02", ms=4,
                label="predicted" if k == 0 else None)
        ax.plot(xs, [by[s]["bound_s"] for s in schemes], "_", color="#1b9e77", ms=14, mew=3,
                label="bound" if k == 0 else None)
        for x, s in zip(xs, schemes):
            if by[s]["efficiency"]:
                ax.annotate(f"{by[s]['efficiency']:.2f}", (x, by[s]["cct_s"]), textcoords="offset points",
                            xytext=(0, 3), ha="center", fontsize=7)
    ax.set_xticks(range(len(schemes)), schemes)
    ax.set_ylabel("CCT (s)")
    ax.set_title(f"{rows[0]['topology']}: CCT, prediction, bound (labels: bound/CCT)", fontsize=9)
    ax.legend(fontsize=7)
    last = {r["scheme"]: r for r in rows if r["size"] == sizes[-1]}
    for i, s in enumerate(schemes):
        a = last[s]["_analysis"]
        fin = [e / a["cct_s"] for e in a.get("tree_finish_s", {}).values()] if a else []
        bx.plot([i] * len(fin), fin, "o", color="#1f4e79", ms=3, alpha=0.6, label="tree finish / CCT" if i == 0 else None)
        if last[s]["bottleneck_busy"] is not None:
            bx.bar(i, last[s]["bottleneck_busy"], width=0.5, color="#fdb863", alpha=0.7,
                   label="busiest link busy share" if i == 0 else None)
        if last[s]["execution_factor"] is not None:
            bx.plot(i, last[s]["execution_factor"], "x", color="#b2182b", ms=8,
                    label="busiest link utilisation (need/CCT)" if i == 0 else None)
    bx.set_xticks(range(len(schemes)), schemes)
    bx.set_ylim(0, 1.1)
    bx.set_title(f"where time goes at {sizes[-1]}", fontsize=9)
    bx.legend(fontsize=7, loc="lower left")
    fig.savefig(path, format="png")
    return path


PEER_SCHEMES = ("ring",) + BENCH_SCHEMES
GLOO_SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "gloo_allreduce.py"


def torch_missing() -> str | None:
    """Why PyTorch's gloo all-reduce cannot run here (None: it can)."""
    try:
        import torch.distributed as dist
    except Exception as e:  # not a dependency: any import failure means "not available"
        return (f"torch is not importable ({type(e).__name__}: {e}); install a CPU build "
                "(pip install torch --index-url https://download.pytorch.org/whl/cpu) to compare")
    if not dist.is_available() or not dist.is_gloo_available():
        return "torch is installed without torch.distributed's gloo backend"
    return None


def bench_peers(out: Path, progress, sizes: tuple[str, ...] = ("16MB",), schemes: tuple[str, ...] = PEER_SCHEMES,
                topologies: tuple[str, ...] | None = ("netstorm-internet2-9",)) -> dict:
    """PyTorch's ``gloo`` all_reduce, one process per datacenter started with ``exec``
    (examples/gloo_allreduce.py, ``GLOO_SOCKET_IFNAME=tbnode``), against the testbed's
    schemes on the same WAN (same topology, scale, congestion control; one warm-up and
    :data:`BENCH_ITERATIONS` measured iterations each, their mean the CCT): every scheme's
    speed-up = gloo CCT / scheme CCT.  Skipped, saying why, when torch is not importable (it
    is not a dependency)."""
    from testbed.experiment import run_experiment
    from testbed.results import write_json_atomic

    why = torch_missing()
    if why:
        progress(f"peers: skipped: {why}")
        return {"skipped": why}
    rows, kept = [], []
    for topo, scale, cc, _ in EFFICIENCY_CASES:
        if topologies and topo not in topologies:
            continue
        for size in sizes:
            exp = _schemes_experiment("peers", topo, scale, cc, size, schemes)
            run_dir = out / f"{topo}-{size}"
            gloo = _gloo_run(exp, run_dir / "gloo", topo, scale, cc, size, progress)
            progress(f"peers: gloo CCT {gloo['cct_s']}; the schemes on the same WAN: {', '.join(schemes)}")
            res = run_experiment(exp, run_dir / "schemes", progress)
            write_json_atomic(run_dir / "schemes" / "results.json", res)
            kept.append(res["emulation"]["kept_up"])
            rows.append({"topology": topo, "size": size, "scheme": "gloo (PyTorch)", "cct_s": gloo["cct_s"],
                         "speedup_over_gloo": 1.0 if gloo["cct_s"] else None, "efficiency":
                         res["variants"][0]["summary"]["bound_s"] / gloo["cct_s"] if gloo["cct_s"] else None,
                         "correct": gloo["correct"]})
            for v in res["variants"]:
                sm = v["summary"]
                cct = sm["cct_s"]["mean"]
                rows.append({"topology": topo, "size": size, "scheme": v["label"], "cct_s": cct,
                             "speedup_over_gloo": gloo["cct_s"] / cct if gloo["cct_s"] and cct else None,
                             "efficiency": sm["efficiency"], "correct": sm["correct"]})
    return {"table": rows, "torch": __import__("torch").__version__, "kept_up": all(kept)}


def _gloo_run(exp, run_dir: Path, topo: str, scale: float, cc: str, size: str, progress) -> dict:
    """gloo's all_reduce of ``size`` (times ``scale``) in every datacenter of ``exp``'s WAN, run
    with ``exec`` into ``run_dir``: its CCT and whether every rank summed right."""
    from testbed.execute import exec_command
    from testbed.results import write_json_atomic
    from testbed.workloads import parse_size

    mb = parse_size(size) * scale / 1e6
    progress(f"peers: {topo} (scale {scale:g}, {cc}), {size}: gloo all_reduce of {mb:g} MB")
    argv = ["env", "GLOO_SOCKET_IFNAME=tbnode", "python3", str(GLOO_SCRIPT), "--size-mb", f"{mb:g}",
            "--warmup", "1", "--iterations", str(BENCH_ITERATIONS)]
    ex = exec_command(exp, argv, run_dir, progress=progress)
    write_json_atomic(run_dir / "results.json", ex)
    return _gloo_cct(ex)


def _gloo_cct(ex: dict) -> dict:
    """The measured iterations' CCT (mean over iterations of the slowest rank) from the
    processes' JSON lines, and whether every rank summed right."""
    per_rank, ok = [], ex.get("ok", False)
    for p in ex["processes"].values():
        line = next((l for l in reversed(p["stdout"].splitlines()) if l.startswith("{")), None)
        if line is None:
            ok = False
            continue
        d = json.loads(line)
        per_rank.append(d["times_s"][d["warmup"]:])
        ok = ok and d["correct"]
    if not per_rank or len(per_rank) != len(ex["processes"]):
        return {"cct_s": None, "correct": False}
    its = [max(t[i] for t in per_rank) for i in range(min(len(t) for t in per_rank))]
    return {"cct_s": sum(its) / len(its) if its else None, "correct": ok}


BENCHES = {"emulator": bench_emulator, "adaptive": bench_adaptive, "dataplane": bench_dataplane, "efficiency": bench_efficiency, "peers": bench_peers, "ring": bench_ring, "planner": bench_planner, "chaos": bench_chaos,
           "fuzz": bench_fuzz}


def run_bench(name: str, out: Path, progress: Callable[[str], None] = lambda m: None, **options) -> dict:
    """Run benchmark ``name`` (its scratch files under ``out``; ``options`` are the benchmark's
    keyword parameters, e.g. ``topology`` for ``emulator``); its bench.json data."""
    return {"bench": name, **BENCHES[name](out, progress, **options), "environment": environment()}
