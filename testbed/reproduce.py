"""``testbed reproduce``: the seed papers' headline claims, each beside what this testbed
measures on the same metric, with a verdict.

The claims are data (``experiments/reproduce/claims.yaml``, format in its header): *runs*
(an experiment file with ``--set`` overrides per mode, run once, read by any number of
claims) and *claims* (paper, figure, the claim as a number, an expression of measured
quantities, the expected range and tolerance, what it needs, why it may not hold).  Emulated
runs are ``python3 -m testbed run`` in a child process each (its own deadline, its log kept),
so a run that fails or hangs costs its rows, never the table; ``kind: plan`` runs only plan.

Verdicts: *reproduced* (the measured value within the expected range, widened by the
tolerance), *not reproduced* (with the claim's recorded reason and the run's results),
*not comparable* (smoke sizes, or a claim the measurement cannot judge) and *not run* (the
mode leaves the run out, a needed planner or capability is missing, the run failed).
"""

from __future__ import annotations

import ast
import csv
import html
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from testbed.checks import Checker
from testbed.errors import ConfigError
from testbed.results import REPO, CpuMeter, environment, write_json_atomic

CLAIMS_FILE = REPO / "experiments" / "reproduce" / "claims.yaml"
MODES = ("full", "quick", "smoke")
MODE_TEXT = {"full": "the sizes of the claims file (full)",
             "quick": "--quick: reduced sizes and fewer runs, about 25 minutes on a 2-core machine",
             "smoke": "--smoke: tiny sizes, a few runs; checks the command, judges no emulated claim"}
VERDICTS = ("reproduced", "not reproduced", "not comparable", "not run")
QUANTITIES = ("cct", "rounds", "predicted", "plan")
COLUMNS = ["paper", "figure", "claim", "expected", "measured", "n", "spread", "verdict", "why", "measurement",
           "kept_up", "sizes"]


@dataclass(frozen=True)
class Run:
    id: str
    experiment: str
    kind: str  # "emulate" | "plan"
    overrides: dict  # mode -> list of --set overrides, or None (the mode leaves the run out)
    minutes: dict  # mode -> estimated minutes
    validate_within_s: float | None = None


@dataclass(frozen=True)
class Claim:
    paper: str
    figure: str
    claim: str
    run: str
    value: str
    expect: tuple
    tolerance: float = 0.0
    unit: str = ""
    needs: tuple = ()
    comparable: str | None = None
    why: str | None = None
    runs: tuple = field(default=())  # every run the value reads (its own first)


# -- the claims file -----------------------------------------------------------------------
def load_claims(path: str | Path = CLAIMS_FILE) -> tuple[dict, dict[str, Run], list[Claim]]:
    """(papers, runs, claims) from the claims file; ConfigError naming the key otherwise."""
    from testbed.config import load_yaml

    data = load_yaml(path, what="claims")
    c = Checker(str(path))
    c.mapping(data, "", {"papers", "runs", "claims"})
    papers = data.get("papers") or {}
    c.mapping(papers, "papers")
    for k, v in papers.items():
        c.mapping(v, f"papers.{k}", {"title", "seed", "notes"})
    runs = {rid: _load_run(c, rid, spec) for rid, spec in (data.get("runs") or {}).items()}
    claims = [_load_claim(c, i, spec, papers, runs) for i, spec in enumerate(data.get("claims") or [])]
    return papers, runs, claims


def _load_run(c: Checker, rid: str, spec) -> Run:
    """One entry of ``runs``: its experiment, kind, overrides per mode, minutes."""
    key = f"runs.{rid}"
    c.mapping(spec, key, {"experiment", "kind", "set", "full", "quick", "smoke", "minutes", "validate_within_s"})
    if not isinstance(spec.get("experiment"), str):
        c.fail(f"{key}.experiment", "expected an experiment file name")
    kind = spec.get("kind", "emulate")
    if kind not in ("emulate", "plan"):
        c.fail(f"{key}.kind", f"expected emulate or plan, got {kind!r}")
    common = _overrides(c, spec.get("set", []), f"{key}.set")
    per_mode = {}
    for m in MODES:
        extra = spec.get(m, [])
        per_mode[m] = None if extra == "skip" else common + _overrides(c, extra, f"{key}.{m}")
    minutes = spec.get("minutes") or {}
    c.mapping(minutes, f"{key}.minutes", set(MODES))
    for m, v in minutes.items():
        if not isinstance(v, (int, float)) or v < 0:
            c.fail(f"{key}.minutes.{m}", f"expected minutes >= 0, got {v!r}")
    vw = spec.get("validate_within_s")
    if vw is not None and (not isinstance(vw, (int, float)) or vw <= 0):
        c.fail(f"{key}.validate_within_s", f"expected seconds > 0, got {vw!r}")
    return Run(rid, spec["experiment"], kind, per_mode, {m: float(minutes.get(m, 1.0)) for m in MODES}, vw)


def _load_claim(c: Checker, i: int, spec, papers: dict, runs: dict[str, Run]) -> Claim:
    """The ``i``-th entry of ``claims``, checked against the papers and runs already read."""
    key = f"claims[{i}]"
    c.mapping(spec, key, {"paper", "figure", "claim", "run", "value", "expect", "tolerance", "unit", "needs",
                          "comparable", "why"})
    for k in ("paper", "figure", "claim", "run", "value"):
        if not isinstance(spec.get(k), str) or not spec[k]:
            c.fail(f"{key}.{k}", "expected a non-empty string")
    if spec["paper"] not in papers:
        c.fail(f"{key}.paper", f"unknown paper {spec['paper']!r} (known: {', '.join(papers)})")
    if spec["run"] not in runs:
        c.fail(f"{key}.run", f"unknown run {spec['run']!r}")
    exp = spec.get("expect")
    if (not isinstance(exp, list) or len(exp) != 2 or not all(x is None or isinstance(x, (int, float)) for x in exp)
            or exp == [None, None] or (None not in exp and exp[0] > exp[1])):
        c.fail(f"{key}.expect", f"expected [low, high] (numbers, low <= high, one may be null), got {exp!r}")
    tol = spec.get("tolerance", 0.0)
    if not isinstance(tol, (int, float)) or not 0 <= tol < 1:
        c.fail(f"{key}.tolerance", f"expected a relative tolerance in [0, 1), got {tol!r}")
    needs = spec.get("needs", [])
    if not isinstance(needs, list) or not all(isinstance(n, str) and n for n in needs):
        c.fail(f"{key}.needs", "expected a list of strings")
    reads = _claim_reads(c, key, spec, runs)
    return Claim(spec["paper"], spec["figure"], spec["claim"], spec["run"], spec["value"],
                 tuple(exp), float(tol), str(spec.get("unit", "")), tuple(needs), spec.get("comparable"),
                 spec.get("why"), tuple(reads))


def _claim_reads(c: Checker, key: str, spec: dict, runs: dict[str, Run]) -> list[str]:
    """The runs a claim's value expression reads, each one known."""
    try:
        reads = referenced_runs(spec["value"], spec["run"])
    except ValueError as e:
        c.fail(f"{key}.value", str(e))
    for r in reads:
        if r not in runs:
            c.fail(f"{key}.value", f"unknown run {r!r}")
    return reads


def _overrides(c: Checker, items, key: str) -> list[str]:
    if not isinstance(items, list) or not all(isinstance(s, str) and "=" in s for s in items):
        c.fail(key, "expected a list of KEY.PATH=VALUE overrides (or 'skip' for a mode)")
    return list(items)


# -- expressions ----------------------------------------------------------------------------
_ALLOWED = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.USub, ast.Call,
            ast.Name, ast.Load, ast.Constant, ast.keyword)


def _parse(expr: str) -> ast.Expression:
    """The expression's syntax tree, if it uses only numbers, strings, + - * /, and calls of
    the quantities, min and max; ValueError otherwise."""
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an expression: {e.msg}") from None
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED):
            raise ValueError(f"{type(node).__name__} is not allowed (only numbers, + - * /, "
                             f"{', '.join(QUANTITIES)}, min, max)")
        if isinstance(node, ast.Name) and node.id not in (*QUANTITIES, "min", "max"):
            raise ValueError(f"unknown name {node.id!r} (known: {', '.join(QUANTITIES)}, min, max)")
        if isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name):
                raise ValueError("only quantities, min and max may be called")
            if node.func.id in QUANTITIES:
                args = node.args + [k.value for k in node.keywords]
                if not all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in args) or \
                        any(k.arg != "run" for k in node.keywords):
                    raise ValueError(f"{node.func.id}(...) takes string arguments and run='ID'")
                want = 2 if node.func.id == "plan" else 1
                if len(node.args) != want:
                    raise ValueError(f"{node.func.id} takes {want} positional argument(s)")
    return tree


def referenced_runs(expr: str, default: str) -> list[str]:
    """Every run an expression reads (``default`` first: quantities without ``run=`` read it)."""
    out = [default]
    calls = [n for n in ast.walk(_parse(expr)) if isinstance(n, ast.Call) and n.func.id in QUANTITIES]
    for node in sorted(calls, key=lambda n: n.col_offset):  # in the order written
        for k in node.keywords:
            if k.value.value not in out:
                out.append(k.value.value)
    return out


class EvalError(Exception):
    pass


def _series(results: dict, quantity: str, label: str, key: str | None) -> list[float]:
    """Per repetition (or one value, for what planning gives) of a quantity of a variant."""
    variants = {v["label"]: v for v in results.get("variants", [])}
    if label not in variants:
        raise EvalError(f"no variant {label!r} (have: {', '.join(variants)})")
    v = variants[label]
    if quantity == "plan":
        val = (v.get("plan") or {}).get("meta", {}).get(key)
        if not isinstance(val, (int, float)):
            raise EvalError(f"variant {label!r}: plan meta has no number {key!r}")
        return [float(val)]
    if quantity == "predicted":
        return [float(v["summary"]["predicted_cct_s"])]
    field_ = {"cct": "cct_s", "rounds": "rounds_total"}[quantity]
    runs = sorted((r for r in results.get("runs", []) if r["variant"] == label), key=lambda r: r["repetition"])
    vals = [r.get(field_) for r in runs]
    if not vals or any(x is None for x in vals):
        raise EvalError(f"variant {label!r}: no measured {quantity}")
    return [float(x) for x in vals]


def evaluate(expr: str, default_run: str, results: dict[str, dict]) -> dict:
    """``{"value", "n", "spread"}``: the expression on the means of its quantities, and its
    min..max over repetitions (the i-th repetition of every quantity with several, what
    planning gives as is).  EvalError for a missing variant, quantity or division by zero."""
    tree = _parse(expr)
    lengths: list[int] = []

    def env(pick):
        def quantity(name):
            def f(*args, run=None):
                rid = run or default_run
                if rid not in results:
                    raise EvalError(f"run {rid!r} has no results")
                vals = _series(results[rid], name, args[0], args[1] if len(args) > 1 else None)
                if len(vals) > 1:
                    lengths.append(len(vals))
                if pick is None or len(vals) == 1:
                    return sum(vals) / len(vals)
                return vals[pick]
            return f
        return {"__builtins__": {}, "min": min, "max": max, **{q: quantity(q) for q in QUANTITIES}}

    code = compile(tree, "<claim>", "eval")
    try:
        value = eval(code, env(None))  # the tree holds only what _parse allows
        n = min(lengths) if lengths else 1
        per = [eval(code, env(i)) for i in range(n)] if lengths else []
    except ZeroDivisionError:
        raise EvalError("division by zero (a quantity measured 0)") from None
    return {"value": float(value), "n": n, "spread": (min(per), max(per)) if len(per) > 1 else None}


# -- verdicts -------------------------------------------------------------------------------
def in_range(value: float, expect: tuple, tolerance: float) -> bool:
    lo, hi = expect
    return (lo is None or value >= lo * (1 - tolerance)) and (hi is None or value <= hi * (1 + tolerance))


def expected_text(claim: Claim) -> str:
    lo, hi = claim.expect
    u = claim.unit
    tol = f" (±{claim.tolerance:.0%})" if claim.tolerance else ""
    if lo is None:
        return f"<= {hi:g}{u}{tol}"
    if hi is None:
        return f">= {lo:g}{u}{tol}"
    return (f"{lo:g}{u}" if lo == hi else f"{lo:g}-{hi:g}{u}") + tol


def missing_needs(claim: Claim, known_schemes) -> list[str]:
    """What a claim needs that is not here: unregistered planners, and capabilities named in words."""
    out = []
    for n in claim.needs:
        if n.startswith("scheme:"):
            if n.split(":", 1)[1] not in known_schemes:
                out.append(f"the {n.split(':', 1)[1]} planner")
        else:
            out.append(n)
    return out


def judge(claim: Claim, state: dict[str, dict], mode: str, known_schemes, runs: dict[str, Run]) -> dict:
    """One table row for ``claim`` from the runs' states (``status`` ok / skipped / failed /
    not-run, ``results``, ``dir``, ``error``)."""
    row = {"paper": claim.paper, "figure": claim.figure, "claim": claim.claim, "expected": expected_text(claim),
           "measured": "", "n": "", "spread": "", "why": "", "kept_up": "", "sizes": "",
           "measurement": ", ".join(f"runs/{r}/results.json" for r in claim.runs)}
    own = runs[claim.run]
    row["sizes"] = " ".join(own.overrides[mode] or []) if own.overrides[mode] is not None else ""
    missing = missing_needs(claim, known_schemes)
    if missing:
        return {**row, "verdict": "not run", "why": "needs " + "; ".join(missing), "measurement": ""}
    for rid in claim.runs:
        st = state.get(rid, {"status": "not-run", "error": "not run"})
        if st["status"] == "skipped":
            est = runs[rid].minutes["full"]
            return {**row, "verdict": "not run", "measurement": "",
                    "why": f"--{mode} leaves run {rid} out (about {est:g} min in the full mode)"}
        if st["status"] != "ok":
            return {**row, "verdict": "not run", "why": f"run {rid}: {st.get('error') or st['status']}",
                    "measurement": f"runs/{rid}/run.log"}
    res = {rid: state[rid]["results"] for rid in claim.runs}
    kept = [r.get("emulation", {}).get("kept_up") for r in res.values() if "emulation" in r]
    row["kept_up"] = "" if not kept else "yes" if all(kept) else "NO"
    try:
        m = evaluate(claim.value, claim.run, res)
    except EvalError as e:
        return {**row, "verdict": "not run", "why": f"cannot evaluate {claim.value}: {e}"}
    u = claim.unit
    row.update(measured=f"{m['value']:.3g}{u}", n=m["n"],
               spread=f"{m['spread'][0]:.3g}-{m['spread'][1]:.3g}{u}" if m["spread"] else "", value=m["value"])
    wrong = [rid for rid, r in res.items() if r.get("summary") and not r["summary"].get("correct", True)]
    if wrong:
        return {**row, "verdict": "not comparable", "why": f"a wrong reduction result in run {', '.join(wrong)}"}
    emulated = any(runs[r].kind == "emulate" for r in claim.runs)
    if mode == "smoke" and emulated:
        return {**row, "verdict": "not comparable", "why": "smoke sizes: the command is checked, not the claim"}
    if claim.comparable:
        return {**row, "verdict": "not comparable", "why": claim.comparable}
    if in_range(m["value"], claim.expect, claim.tolerance):
        return {**row, "verdict": "reproduced"}
    return {**row, "verdict": "not reproduced", "why": claim.why or "no reason recorded yet"}


# -- running ----------------------------------------------------------------------------------
def _experiment_path(name: str) -> str:
    p = Path(name)
    if p.exists() or p.suffix:
        return str(p)
    return str(REPO / "experiments" / f"{name}.yaml")


def runnable(claims: list[Claim], known_schemes) -> list[str]:
    """The runs the claims read whose needs are all met, in order."""
    out: list[str] = []
    for c in claims:
        if not missing_needs(c, known_schemes):
            out += [r for r in c.runs if r not in out]
    return out


def check_runs(runs: dict[str, Run]) -> None:
    """Every run's experiment with every mode's overrides is a valid experiment (no planning):
    ConfigError naming the run otherwise."""
    from testbed import config

    for r in runs.values():
        for mode, ov in r.overrides.items():
            if ov is None:
                continue
            try:
                config.load_experiment(_experiment_path(r.experiment), ov)
            except ConfigError as e:
                raise ConfigError(f"run {r.id} ({mode}): {e}", source=str(CLAIMS_FILE)) from None


def plan_run(run: Run, overrides: list[str]) -> dict:
    """A ``kind: plan`` run: every variant planned (no bound, no network), in results.json's shape."""
    from testbed import config
    from testbed.config import RUN_TIME_KEYS
    from testbed.planners import make_plan

    exp = config.load_experiment(_experiment_path(run.experiment), overrides)
    graph = exp.topology.graph()
    variants = []
    for v in exp.variants:
        params = {k: val for k, val in v.scheme.items() if k not in ("name", *RUN_TIME_KEYS)}
        plan = make_plan(v.scheme["name"], graph, exp.workload.length, params, elem_bytes=exp.workload.elem_bytes)
        variants.append({"label": v.label, "scheme": v.scheme, "plan": {"scheme": plan.scheme, "meta": plan.meta}})
    return {"experiment": exp.to_dict(), "variants": variants, "runs": [], "kind": "plan"}


def _child(cmd: list[str], log: Path, timeout_s: float) -> tuple[int | None, str]:
    """Run ``cmd`` (its own process group) with output to ``log``; (exit code or None on
    timeout, last line of the log).  On timeout: SIGTERM to the group (``testbed run`` tears
    its network down on it), then SIGKILL after 60 s."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)
        try:
            code = p.wait(timeout=timeout_s)
        except BaseException:  # the deadline, or Ctrl-C of reproduce itself
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            if sys.exc_info()[0] is not subprocess.TimeoutExpired:
                raise
            code = None
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    last = next((ln for ln in reversed(lines) if ln.startswith("error:")), lines[-1] if lines else "")
    return code, last.strip()


def run_one(run: Run, mode: str, out: Path, reuse: bool) -> dict:
    """Run ``run`` in ``mode`` into ``out/runs/ID``; its state for :func:`judge`."""
    d = out / "runs" / run.id
    overrides = run.overrides[mode]
    if overrides is None:
        return {"status": "skipped"}
    done = d / "results.json"
    if reuse and done.exists():
        res = json.loads(done.read_text())
        if res.get("reproduce_mode", mode) == mode and not res.get("error"):
            return {"status": "ok", "results": res, "dir": d, "reused": True}
    d.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    if run.kind == "plan":
        try:
            res = plan_run(run, overrides)
        except ConfigError as e:
            return {"status": "failed", "error": str(e), "dir": d}
        res["reproduce_mode"] = mode
        write_json_atomic(done, res)
        return {"status": "ok", "results": res, "dir": d, "wall_s": time.monotonic() - t0}
    sets = [a for o in overrides for a in ("--set", o)]
    exp = _experiment_path(run.experiment)
    if run.validate_within_s:
        code, last = _child([sys.executable, "-m", "testbed", "validate", exp, *sets], d / "validate.log",
                            run.validate_within_s)
        if code != 0:
            why = (f"planning did not finish within {run.validate_within_s:g} s" if code is None else
                   f"planning failed: {last}")
            return {"status": "not-run", "error": why + f" (runs/{run.id}/validate.log)", "dir": d}
    timeout_s = 3 * 60 * run.minutes[mode] + 300
    code, last = _child([sys.executable, "-m", "testbed", "run", exp, "--out", str(d), "--quiet", "--no-report", *sets],
                        d / "run.log", timeout_s)
    wall = time.monotonic() - t0
    if code is None:
        return {"status": "failed", "error": f"did not finish within {timeout_s:.0f} s", "dir": d, "wall_s": wall}
    if not done.exists():
        return {"status": "failed", "error": f"exit {code}: {last}", "dir": d, "wall_s": wall}
    res = json.loads(done.read_text())
    res["reproduce_mode"] = mode
    write_json_atomic(done, res)
    if code != 0 and res.get("error"):
        return {"status": "failed", "error": f"exit {code}: {res['error']}", "dir": d, "wall_s": wall}
    return {"status": "ok", "results": res, "dir": d, "wall_s": wall}


def select(claims: list[Claim], papers: dict, wanted: list[str]) -> list[Claim]:
    """The claims of the papers named (``all`` or none: every paper); ConfigError for an unknown one."""
    if not wanted or "all" in wanted:
        return claims
    unknown = [p for p in wanted if p not in papers]
    if unknown:
        raise ConfigError(f"unknown paper {unknown[0]!r} (known: {', '.join(papers)}, all)")
    return [c for c in claims if c.paper in wanted]


def reproduce(wanted: list[str], mode: str, out: Path, progress: Callable[[str], None], reuse: bool = False,
              claims_file: str | Path = CLAIMS_FILE, command: str = "") -> dict:
    """Run what the wanted papers' claims need in ``mode`` and judge every claim; write
    ``claims.json``, ``claims.csv``, ``table.txt``, ``reproducing.md`` and the report into
    ``out``; return ``{"rows", "meta"}``."""
    from testbed.planners import schemes
    from testbed.progress import time_left

    papers, runs, claims = load_claims(claims_file)
    chosen = select(claims, papers, wanted)
    known = set(schemes())
    needed = runnable(chosen, known)
    check_runs({r: runs[r] for r in needed})
    state: dict[str, dict] = {}
    todo = [runs[r] for r in needed if runs[r].overrides[mode] is not None]
    for r in needed:
        if runs[r].overrides[mode] is None:
            state[r] = {"status": "skipped"}
    est_total = sum(r.minutes[mode] * 60 for r in todo)
    progress(f"reproduce {', '.join(wanted) or 'all'} ({mode}): {len(chosen)} claims, {len(todo)} runs, "
             f"about {est_total / 60:.0f} min; results -> {out}")
    out.mkdir(parents=True, exist_ok=True)
    load0, t0, cpu = os.getloadavg(), time.monotonic(), CpuMeter().start()
    est_done = 0.0
    for i, r in enumerate(todo):
        elapsed = time.monotonic() - t0
        progress(f"run {i + 1}/{len(todo)} {r.id} ({r.kind}, {r.experiment}"
                 + (f" {' '.join(r.overrides[mode])}" if r.overrides[mode] else "") + ")"
                 + f", {time_left(elapsed, est_done, est_total)}")
        state[r.id] = run_one(r, mode, out, reuse)
        est_done += r.minutes[mode] * 60
        st = state[r.id]
        progress(f"  {r.id}: {st['status']}" + (f" in {st['wall_s']:.0f} s" if "wall_s" in st else "")
                 + (" (reused)" if st.get("reused") else "") + (f": {st['error']}" if st.get("error") else ""))
    busy, steal = cpu.stop()
    rows = [judge(c, state, mode, known, runs) for c in chosen]
    env = environment()
    meta = {"notes": {p: papers[p]["notes"] for p in dict.fromkeys(c.paper for c in chosen) if papers[p].get("notes")},
            "command": command, "mode": mode, "mode_text": MODE_TEXT[mode], "papers": wanted or ["all"],
            "date": time.strftime("%Y-%m-%d %H:%M %Z"), "wall_s": time.monotonic() - t0,
            "machine": {k: env[k] for k in ("host", "cpus", "cpu_model", "kernel", "python", "preemption")},
            "git_commit": env["git_commit"], "cpu_busy": busy, "steal": steal,
            "load_before": load0, "load_after": os.getloadavg(),
            "runs": {rid: {k: v for k, v in st.items() if k not in ("results", "dir")} for rid, st in state.items()},
            "counts": {v: sum(r["verdict"] == v for r in rows) for v in VERDICTS}}
    write_outputs(rows, meta, out, [st["dir"] for st in state.values()
                                    if st.get("status") == "ok" and st["results"].get("kind") != "plan"])
    return {"rows": rows, "meta": meta}


# -- output -------------------------------------------------------------------------------------
def text_table(rows: list[dict]) -> str:
    """The table for a terminal: one line per claim, its reason and pointer indented below."""
    lines = []
    for r in rows:
        meas = (f"{r['measured']}" + (f" (N {r['n']}, {r['spread']})" if r["spread"] else f" (N {r['n']})"
                                      if r["n"] != "" else "")) if r["measured"] else "-"
        lines.append(f"{r['verdict'].upper():15} {r['paper']:9} {r['figure'][:28]:28} expected {r['expected']:16} "
                     f"measured {meas}" + ("" if r["kept_up"] != "NO" else "  [emulator behind]"))
        lines.append(f"{'':15} {r['claim']}")
        if r["why"]:
            lines.append(f"{'':15} why: {r['why']}" + (f" [{r['measurement']}]" if r["measurement"] and
                                                        r["verdict"] != "reproduced" else ""))
    return "\n".join(lines)


def markdown_table(rows: list[dict]) -> str:
    cols = ["paper", "figure", "claim", "expected", "measured", "N", "spread", "verdict", "why / measurement"]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        why = r["why"] + (f" (`{r['measurement']}`)" if r["measurement"] and r["verdict"] != "reproduced" else "")
        if r["kept_up"] == "NO":
            why = (why + "; " if why else "") + "the emulator did not keep up"
        cells = [r["paper"], r["figure"], r["claim"], r["expected"], r["measured"] or "-", str(r["n"]),
                 r["spread"], f"**{r['verdict']}**", why]
        out.append("| " + " | ".join(c.replace("|", "/").replace("\n", " ") for c in cells) + " |")
    return "\n".join(out)


def summary_line(meta: dict) -> str:
    c = meta["counts"]
    total = sum(c.values())
    return (f"{total} claims: {c['reproduced']} reproduced, {c['not reproduced']} not reproduced, "
            f"{c['not comparable']} not comparable, {c['not run']} not run")


def noise_text(meta: dict) -> str:
    lb, la = meta["load_before"], meta["load_after"]
    return (f"machine CPU busy {meta['cpu_busy']:.0%} over the {meta['wall_s'] / 60:.0f} min "
            f"(steal {meta['steal']:.1%}); load average {lb[0]:.1f} before, {la[0]:.1f} after")


def markdown_doc(rows: list[dict], meta: dict) -> str:
    m = meta["machine"]
    runs = meta["runs"]
    ok = sum(1 for s in runs.values() if s.get("status") == "ok")
    return "\n".join([
        "# Reproducing the papers' headline claims",
        "",
        "Generated by `python3 -m testbed reproduce` from its own output; the table is the last measured one.",
        "",
        f"- **Date:** {meta['date']}",
        f"- **Commit:** {meta['git_commit']}",
        (f"- **Machine:** {m['host']}, {m['cpus']} CPUs ({m['cpu_model']}), kernel {m['kernel']} "
         f"(preemption {m['preemption']}), Python {m['python']}"),
        f"- **Command:** `{meta['command']}` (as root, from the repository root)",
        f"- sizes: {meta['mode_text']}",
        f"- {summary_line(meta)}; runs: {ok} of {len(runs)} finished",
        f"- noise: {noise_text(meta)}",
        "",
        ("Verdicts: *reproduced* = the measured value lies in the claim's range widened by its tolerance; "
         "*not reproduced* = outside it, with the reason and the run that shows it; *not comparable* = the "
         "measurement cannot judge the claim; *not run* = what it needs is missing, or the mode leaves it out. "
         "N = repetitions behind the value (spread: min-max over them). Claims, runs and tolerances: "
         "`experiments/reproduce/claims.yaml`; the runs' results.json are under the command's --out folder."),
        "",
        markdown_table(rows),
        "",
        *[f"**{p}**: {note}\n" for p, note in meta.get("notes", {}).items()],
    ])


def write_outputs(rows: list[dict], meta: dict, out: Path, run_dirs: list[Path]) -> None:
    from testbed.report import write_report

    write_json_atomic(out / "claims.json", {"meta": meta, "rows": rows})
    with open(out / "claims.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    (out / "table.txt").write_text(text_table(rows) + "\n\n" + summary_line(meta) + "\n")
    (out / "reproducing.md").write_text(markdown_doc(rows, meta))
    write_report(run_dirs, out, claims=claims_html(rows, meta))


def claims_html(rows: list[dict], meta: dict) -> str:
    """The report's section: the table, its sizes, machine and noise."""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in COLUMNS)
    body = []
    for r in rows:
        cls = r["verdict"].replace(" ", "-")
        body.append("<tr class='" + cls + "'>" + "".join(f"<td>{html.escape(str(r.get(c, '')))}</td>" for c in COLUMNS)
                    + "</tr>")
    m = meta["machine"]
    return (f"<h2>The papers' claims, reproduced ({html.escape(meta['mode'])})</h2>"
            f"<p>{html.escape(summary_line(meta))}. Sizes: {html.escape(meta['mode_text'])}. Machine "
            f"{html.escape(str(m['host']))}, {m['cpus']} CPUs, {html.escape(str(m['cpu_model']))}; "
            f"{html.escape(noise_text(meta))}; {html.escape(meta['date'])}.</p>"
            f"<table class='claims'><tr>{head}</tr>{''.join(body)}</table>")

