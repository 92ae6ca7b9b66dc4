"""Sweeps: an experiment with ``sweep:`` runs once per point (``config.expand_sweep``).

Layout of the output folder: ``sweep.json`` (keys, every point's values, status, error and
per-variant summary), ``sweep.csv`` (the combined table: one row per point and variant),
``points/NNN/results.json`` (each point as ``run`` writes it).  Both files are rewritten
after every point, so a failing or interrupted point loses none of the others.

Consecutive points whose network is the same (topology, scale, seed, emulator settings) and
that have no dynamics or faults (which change the network as they run) share one network.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from testbed.config import Experiment
from testbed.errors import TestbedError


def network_key(exp: Experiment) -> str | None:
    """Points with the same key can share a network; None: this point needs its own."""
    if exp.dynamics or exp.faults:
        return None
    e = exp.emulator
    return json.dumps([exp.topology.to_dict(), exp.seed, e.method, e.relay_procs, e.tcp_cc],
                      sort_keys=True, default=str)


def run_sweep(exp: Experiment, out: Path, progress: Callable[[str], None]) -> dict:
    """Run every point of ``exp.sweep`` into ``out``; return the sweep record."""
    from testbed.experiment import open_network

    points = exp.sweep["points"]
    base = {k: v for k, v in exp.to_dict().items() if k != "sweep"}
    record = {"name": exp.name, "keys": exp.sweep["keys"], "experiment": base,
              "points": [{"index": i, "values": p["values"], "dir": f"points/{i:03d}", "status": "pending"}
                         for i, p in enumerate(points)]}
    _save(record, out)
    net, key, t_start = None, None, time.monotonic()
    try:
        for i, (p, rec) in enumerate(zip(points, record["points"])):
            desc = ", ".join(f"{k}={v}" for k, v in p["values"].items())
            done = time.monotonic() - t_start
            eta = f", about {done / i * (len(points) - i):.0f}s left" if i else ""
            progress(f"sweep point {i + 1}/{len(points)}: {desc} ({done:.0f}s elapsed{eta})")
            want = network_key(p["experiment"])
            if net is not None and (want is None or want != key):
                net.__exit__(None, None, None)
                net = None
            if net is None and want is not None:
                net, key = open_network(p["experiment"], progress).__enter__(), want
            failed = _run_point(p["experiment"], rec, out, progress, net)
            if failed is not None:  # this point failed; the others go on, on a fresh network
                progress(f"sweep point {i + 1}/{len(points)} failed: {failed}")
                if net is not None:
                    net.__exit__(None, None, None)
                    net = None
            _save(record, out)
    except BaseException as e:  # interrupted: say so in sweep.json, keep every finished point
        for rec in record["points"]:
            if rec["status"] in ("pending", "running"):
                rec["status"] = "not run" if rec["status"] == "pending" else "interrupted"
                rec.setdefault("error", type(e).__name__)
        _save(record, out)
        raise
    finally:
        if net is not None:
            net.__exit__(None, None, None)
    return record


def _save(record: dict, out: Path) -> None:
    """Rewrite ``sweep.json`` and ``sweep.csv`` from ``record``."""
    from testbed.report import sweep_columns, sweep_rows, write_csv
    from testbed.results import write_json_atomic

    write_json_atomic(out / "sweep.json", record)
    write_csv(out / "sweep.csv", sweep_rows(record), sweep_columns(record))


def _run_point(exp: Experiment, rec: dict, out: Path, progress: Callable[[str], None], net) -> TestbedError | None:
    """Run one point on ``net`` (None: a network of its own) into its folder, its status,
    time and summary in ``rec``; the error if it failed."""
    from testbed.experiment import run_experiment
    from testbed.report import VARIANT_COLUMNS, variant_rows
    from testbed.results import write_json_atomic

    rec["status"] = "running"
    t0 = time.monotonic()
    try:
        results = run_experiment(exp, out / rec["dir"], progress, net=net)
    except TestbedError as e:
        rec.update(status="failed", error=str(e), wall_s=time.monotonic() - t0)
        return e
    write_json_atomic(out / rec["dir"] / "results.json", results)
    rec.update(status="ok" if results["summary"]["correct"] else "wrong-result",
               wall_s=time.monotonic() - t0,
               variants=[{k: r[k] for k in VARIANT_COLUMNS[1:]} for r in variant_rows(results)],
               emulation_kept_up=results["emulation"]["kept_up"])
    return None
