"""Command line: ``python3 -m testbed VERB ...`` (``--help`` on every verb).

Exit codes: 0 success, 1 run failure (wrong result, agent error, emulator problem),
2 invalid input (experiment/topology file, arguments), 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from testbed.emulator import DEFAULT_TCP_CC
from testbed.emulator.shaping import CHOICES as SHAPING_CHOICES
from testbed.errors import ConfigError, TestbedError

if TYPE_CHECKING:
    from testbed.config import Experiment, Variant


def _experiment_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("experiment", help="experiment YAML file (or the name of one in experiments/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override any key of the experiment, e.g. --set scheme.name=ring --set workload.size=8MB")


def cmd_run(args) -> int:
    from testbed import config
    from testbed.experiment import run_experiment
    from testbed.progress import Progress
    from testbed.results import new_run_dir, write_json_atomic

    exp = config.load_experiment(args.experiment, args.overrides)
    progress = Progress(quiet=args.quiet)
    out = Path(args.out) if args.out else new_run_dir(exp.output_dir, exp.name)
    if exp.sweep:
        return _run_sweep(exp, out, progress, report=not args.no_report)
    progress(f"experiment {exp.name!r}: scheme {exp.scheme['name']} on {exp.topology.name}, "
             f"{exp.repetitions} repetition(s); results -> {out}")
    if args.servers:
        results = _run_on_servers(exp, args.servers, out, progress)
    else:
        results = run_experiment(exp, out, progress, save=lambda r: write_json_atomic(out / "results.json", r))
    write_json_atomic(out / "results.json", results)  # complete: with the emulation's health and events
    code = _report(results, out)
    if not args.no_report:
        _write_report([out], out)
    return code


def _cluster(exp, servers: str, progress, planned=()):
    """The checked servers file and the placement of ``exp`` on it (printed); ``planned``:
    its variants' plans, checked as well (``check_placement``)."""
    from testbed.cluster import check_placement, load_servers

    sf = load_servers(servers)
    placement = check_placement(exp, sf, planned)
    for line in placement.describe(exp.topology):
        progress(line)
    return sf, placement


def _run_on_servers(exp, servers: str, out: Path, progress) -> dict:
    """``run --servers``: the experiment on the servers' network; results.json gets
    ``cluster`` (placement, every server's health, the underlay)."""
    from testbed.cluster import ClusterNetwork
    from testbed.experiment import plan_variants, run_experiment
    from testbed.results import write_json_atomic

    planned = plan_variants(exp, progress, source=exp.source)  # what cannot run on servers, before any is built
    sf, placement = _cluster(exp, servers, progress, planned)
    em = exp.emulator
    with ClusterNetwork(exp.topology, sf, placement, method=em.method, relay_procs=em.relay_procs, seed=exp.seed,
                        log=progress, tcp_cc=em.tcp_cc, frame_ms=em.frame_ms) as net:
        results = run_experiment(exp, out, progress, net=net, planned=planned, save=lambda r: write_json_atomic(
            out / "results.json", {**r, "cluster": {"placement": placement.to_dict()}}))
        results["cluster"] = net.report(em.max_late_ms)
    late = [w for s in results["cluster"]["servers"].values() for w in s["warnings"]]
    if late:  # a server that did not keep up marks the run, naming the server
        results["emulation"]["warnings"] += late
        results["emulation"]["kept_up"] = False
    return results


def _write_report(folders: list[Path], out: Path) -> None:
    """Figures, CSV and report.html; the last line printed names the HTML file."""
    from testbed.report import write_report

    print(f"report: {write_report(folders, out)}")


def _run_sweep(exp, out: Path, progress, report: bool) -> int:
    from testbed.report import sweep_columns, sweep_rows
    from testbed.sweep import run_sweep

    progress(f"sweep {exp.name!r} over {', '.join(exp.sweep['keys'])}: {len(exp.sweep['points'])} points; "
             f"results -> {out}")
    record = run_sweep(exp, out, progress)
    cols = [c for c in sweep_columns(record) if c not in ("scheme", "cct_stdev_s", "repetitions", "error")]
    print("  ".join(f"{c[:14]:>14}" for c in cols))
    for row in sweep_rows(record):
        print("  ".join(f"{_cell(row.get(c))[:14]:>14}" for c in cols))
    print(f"results: {out / 'sweep.json'}, {out / 'sweep.csv'}")
    if report:
        _write_report([out], out)
    bad = [p for p in record["points"] if p["status"] != "ok"]
    for p in bad:
        print(f"error: sweep point {p['index']} {p['status']}: {p.get('error', 'wrong reduction result')}",
              file=sys.stderr)
    return 1 if bad else 0


def _cell(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else "" if v is None else str(v)


def cmd_report(args) -> int:
    _write_report([Path(d) for d in args.dirs], Path(args.out) if args.out else Path(args.dirs[0]))
    return 0


def cmd_exec(args) -> int:
    from testbed import config
    from testbed.execute import exec_command
    from testbed.progress import Progress
    from testbed.results import new_run_dir, write_json_atomic

    exp = config.load_experiment(args.experiment, args.overrides)
    out = Path(args.out) if args.out else new_run_dir(exp.output_dir, f"{exp.name}-exec")
    progress = Progress(quiet=args.quiet)
    with contextlib.ExitStack() as stack:
        net = None
        if args.servers:
            from testbed.cluster import ClusterNetwork

            sf, placement = _cluster(exp, args.servers, progress)
            em = exp.emulator
            net = stack.enter_context(ClusterNetwork(exp.topology, sf, placement, method=em.method,
                                                     relay_procs=em.relay_procs, seed=exp.seed, log=progress,
                                                     tcp_cc=em.tcp_cc, frame_ms=em.frame_ms))
        results = exec_command(exp, args.command, out, on=args.on.split(",") if args.on else None,
                               master_port=args.master_port, timeout_s=args.timeout, progress=progress, net=net)
        if net is not None:
            results["cluster"] = net.report(exp.emulator.max_late_ms)
    write_json_atomic(out / "results.json", results)
    for dc, p in results["processes"].items():
        wall = f"{p['wall_s']:.3f}s" if p["wall_s"] is not None else "timed out"
        print(f"{dc:12} rank {p['rank']:3}  exit {p['exit_code']:4}  {wall:>10}  output: {out}/exec/{dc}.out")
    print(f"results: {out / 'results.json'}")
    return 0 if results["ok"] else 1


def cmd_shell(args) -> int:
    from testbed import config
    from testbed.execute import shell
    from testbed.progress import Progress

    shell(config.load_experiment(args.experiment, args.overrides), Progress())
    return 0


def cmd_deploy(args) -> int:
    from testbed import config
    from testbed.deploy import check_deployable, deploy
    from testbed.progress import Progress
    from testbed.results import new_run_dir, write_json_atomic

    exp = config.load_experiment(args.experiment, args.overrides)
    if exp.sweep:
        raise ConfigError("sweeps run with `run`, not `deploy`", source=args.experiment, key="sweep")
    progress = Progress(quiet=args.quiet)
    progress(f"experiment {exp.name!r}: scheme {exp.scheme['name']} on the real hosts of {args.hosts}")
    hosts = check_deployable(exp, args.hosts)  # before the results folder is made
    out = Path(args.out) if args.out else new_run_dir(exp.output_dir, f"{exp.name}-deploy")
    results = deploy(exp, hosts, out, progress)
    write_json_atomic(out / "results.json", results)
    return _report(results, out)


def _report(results: dict, out: Path) -> int:
    """Print the summary table and where results.json is; 1 if any result was wrong."""
    _print_summary(results)
    print(f"results: {out / 'results.json'}")
    if not results["summary"]["correct"]:
        bad = sorted({n for r in results["runs"] for n in r["incorrect"]})
        print(f"error: wrong reduction result on {', '.join(bad) or 'some workers (digests differ)'}", file=sys.stderr)
        return 1
    return 0


def _print_summary(results: dict) -> None:
    print(f"{'variant':24} {'CCT mean':>9} {'min':>8} {'max':>8} {'predicted':>9} {'bound':>8} {'effic.':>6}  "
          f"{'vs first':>8}  correct")
    for v, cmp in zip(results["variants"], results["summary"]["comparison"]):
        s, c = v["summary"], v["summary"]["cct_s"]
        print(f"{v['label'][:24]:24} {c['mean']:9.3f} {c['min']:8.3f} {c['max']:8.3f} {s['predicted_cct_s']:9.3f} "
              f"{_num(s['bound_s'], 8, 3)} {_num(s['efficiency'], 6, 2)}  {cmp['cct_ratio_to_first']:7.2f}x  "
              f"{s['correct']}")
    _print_rounds(results)
    for w in results.get("emulation", {}).get("warnings", []):
        print(f"WARNING: emulation did not keep up: {w}", file=sys.stderr)
    from testbed.results import HOST_BUSY

    busy = results.get("emulation", {}).get("iterations_cpu_util")
    if busy is not None and busy > HOST_BUSY:
        print(f"NOTE: the machine's CPU was {busy:.0%} busy while the iterations ran: the CCTs may be this "
              "host's limit, not the WAN's (lower scale, or spread the datacenters over servers)", file=sys.stderr)


def _print_rounds(results: dict) -> None:
    """Groups runs (CREW at run time): rounds each worker completed in the window T."""
    runs = [r for r in results.get("runs", []) if "rounds" in r]
    if not runs:
        return
    nodes = list(runs[0]["rounds"])
    print("rounds each worker completed in the window T (groups of p from the ready queue):")
    print(f"{'variant':16} {'rep':>3} {'T s':>5} {'p':>2} {'tasks':>5} {'total':>5}  "
          + " ".join(f"{n:>5}" for n in nodes))
    for r in runs:
        g = r["groups"]
        print(f"{r['variant'][:16]:16} {r['repetition']:3} {g['window_s']:5g} {g['p']:2} "
              f"{len(g['tasks']):5} {r['rounds_total']:5}  " + " ".join(f"{r['rounds'].get(n, 0):5}" for n in nodes))


def _num(value, width: int, digits: int) -> str:
    return f"{value:{width}.{digits}f}" if value is not None else f"{'-':>{width}}"


def cmd_validate(args) -> int:
    from testbed import config
    from testbed.experiment import plan_variants

    exp = config.load_experiment(args.experiment, args.overrides)
    for point in [p["experiment"] for p in exp.sweep["points"]] if exp.sweep else [exp]:
        planned = plan_variants(point, lambda m: None, source=args.experiment)  # what planning rejects, before any run
    placed: list[str] = []
    if args.servers:  # a sweep is refused there, before its plans would count
        sf, _ = _cluster(exp, args.servers, placed.append, planned)
    t = exp.topology
    print(f"{args.experiment}: ok — scheme {exp.scheme['name']}, topology {t.name} "
          f"({len(t.nodes)} datacenters, {len(t.links)} links), "
          f"{exp.workload.bytes} bytes, {exp.repetitions} repetition(s)"
          + (f", a sweep of {len(exp.sweep['points'])} points" if exp.sweep else ""))
    if args.servers:
        print("\n".join(placed))
        print(f"{args.servers}: ok -- {len(sf.servers)} servers" + (" on this machine (namespaces)" if sf.local is not None
                                                                     else "") + " (no connection tried)")
    if args.hosts:
        from testbed.deploy import check_deployable

        hf = check_deployable(exp, args.hosts)
        print(f"{args.hosts}: ok — {len(hf.hosts)} hosts, coordinator {hf.coordinator[0]}:{hf.coordinator[1]} "
              f"(no connection tried)")
    return 0


def cmd_plan(args) -> int:
    from dataclasses import replace

    from testbed import config
    from testbed.emulator.dynamics import rates_at
    exp = config.load_experiment(args.experiment, args.overrides)
    if args.at_s is not None:
        if args.at_s < 0:
            raise ConfigError(f"--at-s must be >= 0, got {args.at_s:g}", source=args.experiment)
        exp = replace(exp, topology=exp.topology.with_rates(rates_at(exp.topology, list(exp.dynamics), args.at_s)))
    chosen = [v for v in exp.variants if args.variant in (None, v.label)]
    if not chosen:
        raise ConfigError(f"no variant {args.variant!r} (have: {', '.join(v.label for v in exp.variants)})",
                          source=args.experiment, key="variants")
    for v in chosen:
        _print_plan(exp, v, args)
    return 0


def _doctor_servers(args) -> int:
    """``doctor --servers``: every server's capabilities, VXLAN and clock; the underlay."""
    from testbed.cluster import doctor_servers, load_servers

    d = doctor_servers(load_servers(args.servers), log=lambda m: None if args.json else print(m))
    if args.json:
        print(json.dumps(d, indent=1, default=str))
        return 0
    bad = []
    for name, s in d["servers"].items():
        caps = s["capabilities"]
        method = caps.get("shaping_method")
        print(f"server {name} ({s['ssh']}, kernel {s['kernel']}): shaping {method or 'NONE'}; netem "
              f"{caps.get('netem')}, HTB {caps.get('htb')}; VXLAN {'yes' if s['vxlan'] else 'NO: ' + s.get('vxlan_error', '')}; "
              f"clock offset {s['clock_offset_ms']:+.3f} ms (round trip {s['clock_rtt_ms']:.3f} ms)")
        if not method or not s["vxlan"]:
            bad.append(name)
    for p in d["underlay"]["pairs"]:
        print(f"underlay {p['from']} -> {p['to']}: round trip {p['rtt_ms']:.3f} ms, MTU {p['mtu']}"
              + (f", TCP {p['mbps']:.0f} Mbit/s" if "mbps" in p else ""))
    print(f"WAN links get MTU {d['underlay']['link_mtu']}"
          + ("" if d["underlay"]["link_mtu"] == 1500 else " (an underlay MTU of 1550 keeps 1500)"))
    if bad:
        print(f"error: server(s) {', '.join(bad)} cannot emulate (see above)", file=sys.stderr)
    return 1 if bad else 0


def _print_plan(exp: Experiment, variant: Variant, args) -> None:
    from testbed.experiment import build_plan, scheme_key
    from testbed.plan import Tree

    topo, _, plan, prediction, bound = build_plan(exp, variant.scheme, source=args.experiment,
                                                  key=scheme_key(exp.variants.index(variant)))
    if args.json:
        print(json.dumps({"label": variant.label, "at_s": args.at_s, "plan": plan.to_dict() if args.full else plan.meta,
                          "prediction": prediction, "bound": bound}, indent=1, default=str))
        return
    print(f"== {variant.label}")
    print(f"scheme {plan.scheme} on {topo.name} (scale {topo.scale:g}"
          + (f", rates at {args.at_s:g} s of the dynamics" if args.at_s is not None else "")
          + f"): {exp.workload.bytes} bytes, "
          f"{sum(len(p) for p in plan.programs.values())} ops, {plan.bytes_sent(exp.workload.elem_bytes) / 1e6:.3g} MB on the wire")
    for i, t in enumerate(plan.meta.get("trees", [])):
        fan = max((len(v) for v in Tree(t["root"], t["parent"]).children().values()), default=0)
        print(f"  tree {i}: root {t['root']}, height {t.get('height')}, max fan-out {fan}, "
              f"rate {t.get('rate_mbps', 0):.1f} Mbit/s, share {t.get('share', 0):.3f}, chunks {t.get('chunks')}")
        print("    parents: " + ", ".join(f"{n}<-{p}" for n, p in t["parent"].items() if p is not None))
    for k, v in plan.meta.items():
        if k not in ("trees", "params") and not isinstance(v, (list, dict)):
            print(f"  {k}: {v}")
    if variant.scheme.get("aux"):
        paths = plan.aux["paths"]
        pairs = {(src, op.peer) for src, op in plan.transfers()}
        print(f"  auxiliary paths: {len(paths)} for {len({(p[0], p[-1]) for p in paths})} of {len(pairs)} "
              "(sender, next aggregator) pairs" + "".join(f"\n    {'>'.join(p)}" for p in paths[:8])
              + ("\n    ..." if len(paths) > 8 else ""))
    print(f"predicted CCT {prediction['cct_s']:.4f}s ({prediction.get('model', '')}); "
          + (f"bound (strict, {bound['bound']}): rate {bound['rate_mbps']:.1f} Mbit/s, transfer "
             f"{bound['transfer_s']:.4f}s; the packing ({bound['packing_rate_mbps']:.1f} Mbit/s, gap "
             f"{bound['gap']:.2g}) with its best tree's delay: estimated CCT {bound['estimate_cct_s']:.4f}s" if bound else
             "no bound: the tree-packing optimum bounds an AllReduce of every node, this is a partial reduce"))


def cmd_reproduce(args) -> int:
    from testbed.progress import Progress
    from testbed.reproduce import reproduce, summary_line, text_table
    from testbed.results import new_run_dir

    if args.quick and args.smoke:
        raise ConfigError("give --quick or --smoke, not both")
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    out = Path(args.out) if args.out else new_run_dir("results", f"reproduce-{mode}")
    done = reproduce(args.papers, mode, out, Progress(quiet=args.quiet), reuse=args.reuse,
                     command=" ".join(["python3 -m testbed reproduce", *args.papers] + [f"--{mode}"] * (mode != "full")
                                      + [f"--out {out}"] + ["--reuse"] * args.reuse))
    print(text_table(done["rows"]))
    print(summary_line(done["meta"]))
    print(f"table: {out / 'table.txt'}, {out / 'claims.csv'}, {out / 'reproducing.md'}")
    print(f"report: {out / 'report.html'}")
    failed = [rid for rid, st in done["meta"]["runs"].items() if st["status"] == "failed"]
    for rid in failed:
        print(f"error: run {rid} failed: {done['meta']['runs'][rid]['error']}", file=sys.stderr)
    return 1 if failed else 0


def cmd_doctor(args) -> int:
    from testbed.emulator.capabilities import probe

    if args.servers:
        return _doctor_servers(args)

    caps = probe()
    d = caps.to_dict()
    if args.json:
        print(json.dumps(d, indent=1))
        return 0 if not caps.problems() else 1
    rows = [("root", caps.root), ("mnexec (Debian package mininet)", caps.mnexec),
            ("Python package mininet", caps.mininet_python), ("network namespaces", caps.netns),
            ("Linux bridge", caps.linux_bridge), ("bridge-nf-call-*tables = 0", caps.bridge_nf_off),
            ("HTB (rate shaping)", caps.htb), ("netem (delay/loss/jitter in kernel)", caps.netem),
            ("gcc (builds the user-space delay relay)", caps.gcc), ("ethtool", caps.ethtool),
            ("iperf3", caps.iperf3), ("ping", caps.ping)]
    for name, ok in rows:
        print(f"  {'yes' if ok else 'NO ':3}  {name}")
    print(f"  kernel {caps.kernel}")
    from testbed.emulator.shaping import METHODS

    method = caps.shaping_method
    print("link shaping used by run: " + (METHODS[method].description if method else
                                           "none — cannot run experiments here"))
    for note in caps.notes:
        print(f"note: {note}")
    for p in caps.problems():
        print(f"problem: {p}")
    return 0 if not caps.problems() else 1


def cmd_clean(args) -> int:
    from testbed.emulator.cleanup import clean

    if args.servers:
        from testbed.cluster import clean_servers, load_servers

        clean_servers(load_servers(args.servers))
        return 0
    clean(everything=args.all)
    return 0


def cmd_linkcheck(args) -> int:
    from testbed.emulator.linkcheck import format_table, run_linkcheck
    from testbed.progress import Progress
    from testbed.results import environment, new_run_dir, write_json_atomic
    from testbed.topology import load_topology

    topo = load_topology(args.topology, source=args.topology).scaled(args.scale)
    phases = ("concurrent",) if args.concurrent else ("single",) if args.single else ("single", "concurrent")
    network = None
    if args.servers:
        from testbed.cluster import load_servers, network_on

        if args.load == "udp":
            raise ConfigError("--load udp reads the receivers' interface counters on this machine: not with --servers")
        network = network_on(load_servers(args.servers), topo, log=Progress())
    out = Path(args.out) if args.out else new_run_dir("results", f"linkcheck-{topo.name}")
    result = run_linkcheck(topo, seconds=args.seconds, phases=phases, method=args.method, tcp_cc=args.tcp_cc,
                           parallel=args.parallel, load=args.load, progress=Progress(), network=network)
    result["environment"] = environment()
    write_json_atomic(Path(out) / "linkcheck.json", result)
    print(format_table(result))
    if "concurrent_cpu_util" in result:
        per_frame = result.get("concurrent_cpu_us_per_frame")
        print(f"CPU during concurrent phase: {result['concurrent_cpu_util']:.0%}"
              + (f", {result['concurrent_frames_per_s'] / 1e3:.1f}k relayed frames/s,"
                 f" {per_frame:.1f} us of CPU per relayed frame" if per_frame else ""))
    print(f"CPU busy {result['cpu_util']:.0%}, taken by the hypervisor (steal) {result['steal']:.1%}; load "
          f"average before/after {result['load_before'][0]:.1f}/{result['load_after'][0]:.1f}; "
          f"emulator kept up: {result['emulation_kept_up']}")
    concurrent = "UDP, bytes received" if args.load == "udp" else "TCP; bbr where a link has loss"
    print(f"verdict: rate by UDP (single) or {concurrent} (concurrent), delay/jitter/loss by "
          "one-way UDP probes, queue = delay under a standing queue; 'tcp' = TCP goodput under "
          f"{result['tcp_cc']} (informative)")
    kept = ("the emulator kept up" if result["emulation_kept_up"]["ok"] else
            "THE EMULATOR DID NOT KEEP UP (its load is the relayed frames: a lower --scale cuts them only "
            "where flows fall under ~23 Mbit/s, two segments a millisecond; docs/guides/link-fidelity.md)")
    print(f"total configured capacity {result['total_capacity_mbps']:.0f} Mbit/s at scale {topo.scale:g}; "
          f"{'all directions within tolerance' if result['directions_ok'] else 'SOME DIRECTIONS OUT OF TOLERANCE'}; {kept}")
    print(f"linkcheck: {Path(out) / 'linkcheck.json'}")
    return 0 if result["ok"] else 1


def _check_bench_options(options: dict) -> None:
    from testbed.bench import EFFICIENCY_CASES
    from testbed.planners import schemes
    from testbed.workloads import parse_size

    for s in options.get("schemes", ()):
        if s not in schemes():
            raise ConfigError(f"--schemes: unknown scheme {s!r} (known: {', '.join(sorted(schemes()))})")
    known = [case[0] for case in EFFICIENCY_CASES]
    for t in options.get("topologies", ()):
        if t not in known:
            raise ConfigError(f"--topologies: {t!r} is not benchmarked (known: {', '.join(known)})")
    for z in options.get("sizes", ()):
        try:
            parse_size(z)
        except ValueError as e:
            raise ConfigError(f"--sizes: {e}") from None


def _print_table(rows: list[dict]) -> None:
    """Rows as an aligned text table (numbers to 3 significant digits); a column for every key
    of any row, in the order first seen, blank where a row lacks it."""
    if not rows:
        return
    cols = list(dict.fromkeys(k for r in rows for k in r))
    fmt = [[(f"{v:.3g}" if isinstance(v, float) else "" if v is None else str(v)) for v in map(r.get, cols)]
           for r in rows]
    width = [max(len(c), *(len(f[i]) for f in fmt)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, width)))
    for f in fmt:
        print("  ".join(v.ljust(w) for v, w in zip(f, width)))


def cmd_bench(args) -> int:
    """``bench NAME``: run one benchmark into ``--out``, write bench.json, print its results."""
    from testbed.bench import run_bench
    from testbed.progress import Progress
    from testbed.results import new_run_dir, write_json_atomic

    options, error = _bench_options(args)
    if error:
        print(f"error: bench {args.name}: {error}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else new_run_dir("results", f"bench-{args.name}")
    result = run_bench(args.name, out, Progress(), **options)
    write_json_atomic(out / "bench.json", result)
    _print_bench(args.name, result)
    print(f"bench: {out / 'bench.json'}")
    return 0


def _bench_options(args) -> tuple[dict, str | None]:
    """The options ``args`` give ``bench NAME``, and what is wrong with them if anything (the
    line after ``error: bench NAME:``); an unknown --topology raises its ConfigError."""
    options = {k: v for k, v in (("topology", args.topology), ("tcp_cc", args.tcp_cc),
                                 ("seconds", args.seconds)) if v is not None}
    if options and args.name != "emulator":
        return options, "--topology, --tcp-cc and --seconds apply to 'bench emulator' only"
    if "topology" in options:
        from testbed.topology import load_topology

        load_topology(options["topology"], source=options["topology"])  # bad name: one line, before any network
    for key in ("sizes", "schemes", "topologies"):
        val = getattr(args, key, None)
        if val:
            if args.name not in ("efficiency", "peers") and not (key == "sizes" and args.name == "dataplane"):
                return options, f"--{key} applies to bench efficiency and peers only"
            options[key] = tuple(x for x in val.split(",") if x)
    if args.rates:
        if args.name != "dataplane":
            return options, "--rates applies to bench dataplane only"
        try:
            options["rates"] = tuple(float(x) for x in args.rates.split(",") if x)
            if not options["rates"] or min(options["rates"]) <= 0:
                raise ValueError
        except ValueError:
            return options, f"--rates {args.rates!r}: not a list of rates in Mbit/s > 0"
    if args.delay_ms is not None:
        if args.name != "dataplane":
            return options, "--delay-ms applies to bench dataplane only"
        if args.delay_ms < 0:
            return options, f"--delay-ms {args.delay_ms:g}: not a delay in ms >= 0"
        options["delay"] = args.delay_ms
    try:
        _check_bench_options(options)
    except ConfigError as e:
        return options, str(e)
    return options, None


def _print_bench(name: str, result: dict) -> None:
    """A benchmark's results on stdout: its table and its other results, and for ``emulator``
    one line of headroom."""
    for k, v in result.items():
        if k == "table":
            _print_table(v)
        elif k not in ("environment", "analysis") and not (name == "emulator" and isinstance(v, dict)):
            print(f"{k}: {v}")  # emulator: each search's runs are in bench.json, its result in the line below
    if name == "emulator":
        def g(x):
            return "none passed" if x is None else f"{x:.3g}"

        print(f"emulator headroom on {result['topology']}: largest passing scale through the relay under TCP "
              f"({result['tcp_cc']}) {g(result['relay-tcp']['max_scale'])}; under UDP through the relay "
              f"{g(result['relay-udp']['max_scale'])}, HTB alone {g(result['htb-udp']['max_scale'])}, "
              f"ratio {g(result['ratio'])}")


def _servers_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--servers", metavar="SERVERS.yaml",
                   help="spread the emulated WAN over these servers (format: testbed/cluster.py; "
                        "experiments/servers-local-2.yaml stands up two on this machine)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m testbed",
                                description="Emulated inter-datacenter WANs for geo-distributed ML synchronisation.")
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    for add in (_verb_run, _verb_report, _verb_exec, _verb_shell, _verb_deploy, _verb_validate, _verb_plan,
                _verb_reproduce, _verb_doctor, _verb_clean, _verb_linkcheck, _verb_bench):  # one subparser each, in --help order
        add(sub)
    return p


def _verb_run(sub) -> None:
    r = sub.add_parser("run", help="run an experiment and write results.json",
                       description="Build the experiment's WAN, run its scheme with real agents, check results, write DIR/results.json.")
    _experiment_args(r)
    r.add_argument("--out", help="output folder (default: a new timestamped folder under output.dir, i.e. results/)")
    r.add_argument("--quiet", action="store_true", help="no progress lines")
    r.add_argument("--no-report", action="store_true", help="do not write figures, CSV and report.html")
    _servers_arg(r)
    r.set_defaults(func=cmd_run)


def _verb_report(sub) -> None:
    rp = sub.add_parser("report", help="figures, CSV tables and one self-contained HTML page from results folders",
                        description="Read DIR/results.json (or a sweep's DIR/sweep.json) of every DIR; write PNG "
                                    "figures, variants.csv, links.csv and report.html into --out.")
    rp.add_argument("dirs", nargs="+", metavar="DIR", help="results folder(s) of run or of a sweep")
    rp.add_argument("--out", help="output folder (default: the first DIR)")
    rp.set_defaults(func=cmd_report)


def _verb_exec(sub) -> None:
    ex = sub.add_parser("exec", help="run your own program in every datacenter of an experiment's emulated WAN",
                        description="Build the experiment's WAN (with its dynamics and faults), run CMD in every "
                                    "datacenter with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK, "
                                    "TESTBED_DC, TESTBED_NODE_ADDRS set ({dc} and {rank} in ARGS replaced), record "
                                    "exit codes, wall times and output in DIR/results.json, tear down.")
    _experiment_args(ex)
    ex.add_argument("--on", metavar="DC,DC", help="only these datacenters (default: all)")
    ex.add_argument("--out", help="output folder (default: a new timestamped folder under output.dir)")
    ex.add_argument("--master-port", type=int, default=29500, help="MASTER_PORT (default 29500)")
    ex.add_argument("--timeout", type=float, help="seconds before the processes are killed (default agents.timeout_s)")
    ex.add_argument("--quiet", action="store_true", help="no progress lines")
    _servers_arg(ex)
    ex.add_argument("command", nargs="*", metavar="-- CMD ARGS", help="the program and its arguments, after --")
    ex.set_defaults(func=cmd_exec)


def _verb_shell(sub) -> None:
    sh = sub.add_parser("shell", help="Mininet's interactive CLI on an experiment's emulated WAN")
    _experiment_args(sh)
    sh.set_defaults(func=cmd_shell)


def _verb_deploy(sub) -> None:
    dp = sub.add_parser("deploy", help="run an experiment's schemes with the same agents on real hosts over SSH",
                        description="Plan as `run` does, start one agent per datacenter on its real host over "
                                    "ssh, run, check, write DIR/results.json. Nothing is shaped: the topology "
                                    "describes the real WAN. Hosts file format: docs/guides/deploy.md.")
    _experiment_args(dp)
    dp.add_argument("--hosts", required=True, metavar="HOSTS.yaml",
                    help="coordinator address and, per datacenter, ssh destination and data address")
    dp.add_argument("--out", help="output folder (default: a new timestamped folder under output.dir)")
    dp.add_argument("--quiet", action="store_true", help="no progress lines")
    dp.set_defaults(func=cmd_deploy)


def _verb_validate(sub) -> None:
    v = sub.add_parser("validate", help="check an experiment (and its topology) without running anything")
    _experiment_args(v)
    v.add_argument("--hosts", metavar="HOSTS.yaml", help="also check a `deploy` hosts file against the topology")
    v.add_argument("--servers", metavar="SERVERS.yaml",
                   help="also check a servers file and print the placement on it (nothing is contacted)")
    v.set_defaults(func=cmd_validate)


def _verb_plan(sub) -> None:
    pl = sub.add_parser("plan", help="print the plan (trees, roots, rates, shares, chunks) and the bound; no network")
    _experiment_args(pl)
    pl.add_argument("--json", action="store_true", help="print JSON (plan meta, prediction, bound)")
    pl.add_argument("--full", action="store_true", help="with --json: the whole plan including every op")
    pl.add_argument("--variant", help="only this variant (label); default: every scheme of the experiment")
    pl.add_argument("--at-s", type=float, metavar="T",
                    help="plan on the rates the experiment's dynamics give at T s into a run (faults aside), "
                         "e.g. an oracle's plan after a redraw")
    pl.set_defaults(func=cmd_plan)


def _verb_reproduce(sub) -> None:
    rd = sub.add_parser("reproduce", help="run the experiments behind the seed papers' headline claims and judge "
                                          "each claim against what was measured",
                        description="For each paper (crew, netstorm, mtree, topoadapt, multitree, or all), run the "
                                    "experiments its claims need (experiments/reproduce/claims.yaml) and write one "
                                    "table: the claim as a number, what was measured on the same metric (N runs, "
                                    "spread), a verdict (reproduced / not reproduced / not comparable / not run) and "
                                    "why: DIR/table.txt, claims.csv, reproducing.md, report.html.")
    rd.add_argument("papers", nargs="*", metavar="PAPER", help="papers (default: all)")
    rd.add_argument("--quick", action="store_true", help="reduced sizes and fewer runs: about 25 minutes on 2 cores")
    rd.add_argument("--smoke", action="store_true", help="tiny sizes, a few runs (a few minutes): checks the command, "
                                                         "judges no emulated claim")
    rd.add_argument("--out", help="output folder (default: a new folder under results/)")
    rd.add_argument("--reuse", action="store_true", help="reuse runs already finished in --out (same mode)")
    rd.add_argument("--quiet", action="store_true", help="no progress lines")
    rd.set_defaults(func=cmd_reproduce)


def _verb_doctor(sub) -> None:
    d = sub.add_parser("doctor", help="report what this machine can do and which link shaping run will use")
    d.add_argument("--json", action="store_true", help="print the capabilities as JSON")
    d.add_argument("--servers", metavar="SERVERS.yaml",
                   help="report every server of this servers file instead, and the underlay between them")
    d.set_defaults(func=cmd_doctor)


def _verb_clean(sub) -> None:
    c = sub.add_parser("clean", help="remove namespaces, interfaces, bridges and processes a crashed run left")
    c.add_argument("--all", action="store_true", help="also those of runs still going (default: only runs whose "
                                                      "owner process is gone)")
    c.add_argument("--servers", metavar="SERVERS.yaml",
                   help="clean every server of this servers file instead (local servers: remove them too)")
    c.set_defaults(func=cmd_clean)


def _verb_linkcheck(sub) -> None:
    lc = sub.add_parser("linkcheck", help="measure every link direction's rate, delay, jitter, loss and queue "
                                           "against the topology (UDP probes, iperf3, ping)")
    lc.add_argument("topology", help="topology name (topologies/) or file")
    lc.add_argument("--out", help="output folder for linkcheck.json (default: a new folder under results/)")
    lc.add_argument("--scale", type=float, default=1.0, help="multiply every rate by this factor")
    lc.add_argument("--concurrent", action="store_true", help="only the phase with all links loaded at once")
    lc.add_argument("--single", action="store_true", help="only the link-by-link phase")
    lc.add_argument("--seconds", type=float, default=6.0,
                    help="measuring time per direction and measurement after warm-up (default 6)")
    lc.add_argument("--parallel", type=int, default=0,
                    help="link by link: directions of node-disjoint links checked at once (default: 1 up to "
                         "40 directions, else enough for about 40 rounds)")
    lc.add_argument("--load", choices=("tcp", "udp"), default="tcp",
                    help="what loads every direction at once in the concurrent phase (default tcp, what "
                         "experiments get; udp: iperf3 at 1.05 x each rate, a packet per 1.5 KB, i.e. the "
                         "emulation host's packet capacity)")
    lc.add_argument("--method", choices=SHAPING_CHOICES, default="auto", help="link shaping method")
    lc.add_argument("--tcp-cc", default=DEFAULT_TCP_CC,
                    help=f"TCP congestion control of the hosts (as emulator.tcp_cc; default {DEFAULT_TCP_CC}): "
                         "the informative TCP goodput column, and the concurrent rate on lossless links")
    _servers_arg(lc)
    lc.set_defaults(func=cmd_linkcheck)


def _verb_bench(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks that report ratios measured in one run")
    b.add_argument("name", choices=("dataplane", "ring", "planner", "adaptive", "efficiency", "peers", "chaos",
                                    "fuzz", "emulator"), help="which benchmark")
    b.add_argument("--topology", help="emulator: topology whose largest passing scale is searched "
                                      "(default netstorm-internet2-9)")
    b.add_argument("--tcp-cc", help=f"emulator: the hosts' TCP congestion control (default {DEFAULT_TCP_CC})")
    b.add_argument("--seconds", type=float, help="emulator: linkcheck measuring time per scale (default 6)")
    b.add_argument("--sizes", help="efficiency, peers: comma-separated model sizes before the scale (e.g. 16MB,64MB); "
                                   "dataplane: chunk sizes (default 4KB,64KB,1MB,16MB,64MB)")
    b.add_argument("--rates", help="dataplane: comma-separated rates in Mbit/s of the emulated link (default 100)")
    b.add_argument("--delay-ms", type=float, help="dataplane: the emulated link's one-way delay (default 30; 0: the "
                                                  "link is shaped by HTB alone, with no delay relay)")
    b.add_argument("--schemes", help="efficiency, peers: comma-separated schemes (default: the tree schemes and packing, the bound's own)")
    b.add_argument("--topologies", help="efficiency, peers: comma-separated topologies among the benchmarked ones")
    b.add_argument("--out", help="output folder")
    b.set_defaults(func=cmd_bench)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = None
    if argv[:1] == ["exec"] and "--" in argv:  # exec's CMD ARGS: everything after "--", options included
        argv, command = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    args = build_parser().parse_args(argv)
    if command is not None:
        args.command = command

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    # SIGINT too: a command started in the background from a script inherits SIGINT ignored,
    # and Python then never raises KeyboardInterrupt -- kill -INT must still tear it down
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except TestbedError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted: network and processes torn down", file=sys.stderr)
        return 130
