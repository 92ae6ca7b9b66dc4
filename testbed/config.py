"""Experiment files: load, apply ``--set`` overrides, validate, resolve defaults.

Every problem is a :class:`ConfigError` naming the file, the key path and what was
expected; nothing is started before the whole experiment (and its topology) validates.

Format (YAML; every key but ``name``, ``topology`` and ``scheme.name`` is optional)::

    name: quickstart
    topology: quick-5            # file in topologies/, a path, or an inline mapping
    scale: 1.0                   # multiplies every link rate AND the data size
    seed: 1
    repetitions: 3
    scheme: {name: ring, chunks: 4}        # scheme parameters beside the name
                                 # + adaptive: {update_s, probe_chunk_bytes, probe_chunk_num,
                                 #   estimator, mode} | true | false (any scheme; see
                                 #   ADAPTIVE_DEFAULTS; netstorm: true unless false)
                                 # + groups: {p, window_s} (any scheme with ``active``): CREW's
                                 #   run-time groups from a FIFO ready queue (agents/crew.py)
    workload:
      size: 4MB                  # or  model: resnet50   (size = the model's parameters)
      dtype: float32             # float32 | float64
      iterations: 1
      warmup: 1                  # iterations run (and checked) first, left out of CCT statistics
                                 # (the first one is dominated by TCP's start); their times
                                 # are kept apart in results.json (runs[].warmup_cct_s)
      compute_s: 0               # seconds per iteration: a number, {uniform: [lo, hi]},
                                 # {normal: [mean, std]}, {per_worker: {dc: s or [s per iteration]}},
                                 # or CREW's {T1: factor} / {T2: factor} (seeded per worker)
    emulator: {method: auto, relay_procs: 0, max_late_ms: 2, tcp_cc: cubic, frame_ms: 4}
                                 # max_late_ms: relay p99 lateness above which results.json
                                 # says the emulation did not keep up; tcp_cc: congestion
                                 # control of every datacenter host (never the machine's default);
                                 # frame_ms: the longest a link takes to carry one TCP frame
                                 # (TSO/GSO segment train; 0: the kernel's ~1 ms of pacing)
    agents: {timeout_s: 120, stop_and_wait: false, subblock_bytes: 64KiB, links: shared, clock_offset_ms: {}}
                                 # subblock_bytes: how many arrived bytes of a chunk an agent adds
                                 # (and forwards, cut-through) at a time; links: shared (one TCP
                                 # connection per neighbour, trees' pieces in weighted fair order)
                                 # or channel (one per tree, paced); clock_offset_ms: {dc: ms}
                                 # shifts that agent's clock (tests of the clock-offset correction;
                                 # real hosts have their own)
    dynamics: []                 # live rate changes, see testbed/emulator/dynamics.py
    dynamics_per_run: false      # true: every run (variant x repetition) starts on the healthy
                                 # network and replays the dynamics and faults from its measured
                                 # phase's start (every agent ready), so
                                 # schemes compared see the same rates and faults at the same
                                 # point of their run
    faults: []                   # link down/up, datacenter crash/restart
    placement: {}                # with --servers: {dc: server} pins datacenters to servers (the
                                 # rest are placed by testbed/placement.py)
    variants:                    # optional: more schemes run on the SAME network, compared
      - {label: ps, scheme: {name: ps}}     # in one results.json (the main scheme runs first)
    output: {dir: results}
    sweep:                       # optional: run the experiment once per point (see expand_sweep)
      grid: {scheme.chunks: [1, 4, 16], workload.size: [4MB, 64MB]}   # every combination
      points: [{seed: 2, scale: 0.5}]                                  # and/or explicit points
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from agents.executor import DEFAULT_LINKS, LINKS, SUBBLOCK_BYTES
from testbed.checks import Checker
from testbed.emulator import DEFAULT_TCP_CC
from testbed.emulator.shaping import CHOICES as SHAPING_CHOICES
from testbed.emulator.shaping import FRAME_MS
from testbed.errors import ConfigError
from testbed.plan import AUX_DISPATCH
from testbed.wan import Topology

EXPERIMENT_DIR = Path(__file__).resolve().parent.parent / "experiments"

DEFAULTS: dict[str, Any] = {
    "scale": 1.0,
    "seed": 0,
    "repetitions": 1,
    "workload": {"size": "1MB", "model": None, "dtype": "float32", "iterations": 1, "warmup": 1, "compute_s": 0},
    "emulator": {"method": "auto", "relay_procs": 0, "max_late_ms": 2.0, "tcp_cc": DEFAULT_TCP_CC,
                 "frame_ms": FRAME_MS},
    "agents": {"timeout_s": 120.0, "stop_and_wait": False, "subblock_bytes": SUBBLOCK_BYTES, "links": DEFAULT_LINKS,
               "clock_offset_ms": {}},
    "dynamics": [],
    "dynamics_per_run": False,
    "faults": [],
    "placement": {},
    "variants": [],
    "output": {"dir": "results"},
    "sweep": None,
}
TOP_KEYS = {"name", "topology", "scheme", *DEFAULTS}
# scheme.adaptive (NetStorm §V): agents probe the links with their data; update_s > 0 also
# re-plans that often on the estimated (mode: estimated) or the emulator's true current
# (mode: oracle) rates; update_s: 0 only measures; a new plan is taken when its predicted CCT
# on those rates beats the current plan's by min_gain.  Chunk size and count: NetStorm Table II.
# train_duty: every agent also sends packet trains on its WAN links, this share of each link's
# configured rate (agents.trains: capacity where the data leaves a link idle; not in the paper);
# 0 = passive probing only.
# scheme.groups (CREW §III, §V): no iterations; the controller forms groups P of the first p
# ready workers, each runs the scheme over P (its ``active``) while the others compute; each
# worker's completed rounds in a window of window_s seconds are counted.  link_timeout_s: a
# member pair whose UDP heartbeats (every link_timeout_s / 8, over the data network) stop for
# this long is a broken link (§IV-B: detected by heartbeat and timeout); 0 = not watched.
# noise: lambda of §V-H: the controller plans on b(1+x), x ~ U[-lambda, lambda] per link direction
# (drawn once per run from the seed), while the emulator shapes the true b.
# blocking: false = CREW's non-blocking scatter (§IV-A2, Alg. 2): a ready worker sends its
# default blocks (P = N) at once, before P forms; when P forms, that early scatter is cut short
# and the task sends what is left by Alg. 2's split (crew with every worker aggregating; no faults).
# controller_down: {at_s, for_s} (optional; blocking only): the controller is lost at_s into the
# window for for_s (§IV-B: workers go standalone, then rejoin the restarted controller).
GROUPS_DEFAULTS = {"p": 2, "window_s": 30.0, "link_timeout_s": 2.0, "noise": 0.0, "blocking": True}
ADAPTIVE_DEFAULTS = {"update_s": 5.0, "probe_chunk_bytes": 2_000_000, "probe_chunk_num": 4,
                     "estimator": "busy", "mode": "estimated", "min_gain": 0.1, "train_duty": 0.008}
# scheme.aux (NetStorm §VI, multipath auxiliary transmission; NetStorm-pro = netstorm with aux):
# Algorithm 3's paths per (sender, next aggregator) pair (testbed.planners.auxpaths.attach),
# re-computed at every re-plan.  primary_busy_bound: Table II.  aux_queue_length: Fig. 17's best
# (Table II says 1).  disjoint/idle_only: the authors' code (node-disjoint relays, any link but
# the pair's own) by default, because the paper's reading (edge-disjoint rounds over idle links)
# finds no auxiliary path for a tree scheme on any shipped topology but B4 (measured: see
# tests/test_auxpaths.py); it stays a choice.
# dispatch: "queue", the paper's rule (§VI-A: the bounds alone); "eta", a chunk also goes to an
# auxiliary path only if the rates say it arrives there sooner than behind the primary's queue
# (not in the paper: see agents.executor).
AUX_DEFAULTS = {"primary_busy_bound": 2, "aux_queue_length": 5, "max_paths": 2, "disjoint": "node",
                "idle_only": False, "resend_after_s": 5.0, "dispatch": "queue"}


@dataclass(frozen=True)
class Workload:
    """The vector every worker reduces: ``bytes`` (already scaled) = ``length`` elements of
    ``elem_bytes`` each; ``warmup`` iterations run first and are left out of CCT statistics."""

    size: Any
    model: str | None
    dtype: str
    iterations: int
    warmup: int
    compute_s: Any
    bytes: int
    length: int

    @property
    def elem_bytes(self) -> int:
        return self.bytes // self.length


@dataclass(frozen=True)
class Variant:
    """One scheme an experiment compares: ``scheme`` is ``{name, <every parameter>}``."""

    label: str
    scheme: dict


def planner_params(scheme: dict) -> dict:
    """A scheme's parameters for its planner: every key but ``name`` and the run-time
    features' blocks (``RUN_TIME_KEYS``)."""
    return {k: v for k, v in scheme.items() if k not in ("name", *RUN_TIME_KEYS)}


@dataclass(frozen=True)
class EmulatorSettings:
    method: str
    relay_procs: int
    max_late_ms: float
    tcp_cc: str
    frame_ms: float


@dataclass(frozen=True)
class AgentSettings:
    timeout_s: float
    stop_and_wait: bool
    subblock_bytes: int  # agents.executor's cut-through sub-block
    links: str  # agents.executor's data connections: per channel, or shared per peer
    clock_offset_ms: dict  # dc -> ms its agent's clock is shifted by (tests of the correction)


@dataclass(frozen=True, eq=False)
class Experiment:
    """A validated experiment.  ``topology`` is already scaled by ``scale`` (loaded once);
    ``variants`` starts with the main scheme; ``dynamics`` and ``faults`` are normalised,
    dynamics' rates scaled like the topology (results.json keeps the file's rates).
    :meth:`to_dict` is the resolved mapping results.json records (unscaled topology)."""

    name: str
    source: str
    topology: Topology
    scale: float
    seed: int
    repetitions: int
    workload: Workload
    variants: tuple[Variant, ...]
    dynamics: tuple
    dynamics_per_run: bool  # replay dynamics and faults from every run's start (variants see the same)
    faults: tuple
    emulator: EmulatorSettings
    agents: AgentSettings
    output_dir: str
    sweep: dict | None  # {"keys": [key paths], "points": [{"values": {key: value}, "experiment": Experiment}]}
    resolved: dict = field(repr=False)
    placement: dict = field(default_factory=dict)  # dc -> server pinned (with --servers)

    @property
    def scheme(self) -> dict:
        """The main scheme (``{name, <parameters>}``)."""
        return self.variants[0].scheme

    def to_dict(self) -> dict:
        d = copy.deepcopy(self.resolved)
        if self.sweep:
            d["sweep"] = {"keys": list(self.sweep["keys"]),
                          "points": [{"values": p["values"], "experiment": p["experiment"].to_dict()}
                                     for p in self.sweep["points"]]}
        return d


def shipped_experiments() -> list[Path]:
    """The experiment files of ``experiments/`` (not the servers files beside them, which
    have a top-level ``servers``: ``--servers``, testbed/cluster.py)."""
    return [f for f in sorted(EXPERIMENT_DIR.glob("*.yaml")) if "servers" not in load_yaml(f)]


def load_yaml(path: str | Path, what: str = "experiment") -> dict:
    """A YAML mapping from ``path`` (or ``experiments/NAME.yaml``); ConfigError otherwise."""
    p = Path(path)
    if not p.exists() and not p.suffix and (EXPERIMENT_DIR / f"{p}.yaml").exists():
        p = EXPERIMENT_DIR / f"{p}.yaml"
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read {what} file: {e.strerror}", source=str(path)) from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"not a text (UTF-8) {what} file: byte {e.object[e.start]:#04x} at offset {e.start}",
                          source=str(path)) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(f"invalid YAML: {where}{getattr(e, 'problem', None) or e}", source=str(path)) from None
    if not isinstance(data, dict):
        raise ConfigError(f"the {what} file must be a YAML mapping", source=str(path))
    return data


def apply_overrides(data: dict, overrides: list[str], source: str) -> dict:
    """``--set a.b.c=value``: value parsed as YAML (``8MB`` stays a string, ``4`` an int)."""
    data = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set expects key.path=value, got {item!r}", source=source)
        path, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        set_path(data, path.strip(), value, source)
    return data


def set_path(data: dict, path: str, value, source: str) -> None:
    """``data[a][b][c] = value`` for ``path`` ``a.b.c`` (as ``--set`` and ``sweep`` use it)."""
    cur = data
    keys = path.split(".")
    for k in keys[:-1]:
        if not isinstance(cur.get(k, {}), dict):
            raise ConfigError(f"cannot set {path}: {k} is not a mapping", source=source, key=path)
        cur = cur.setdefault(k, {})
    cur[keys[-1]] = value


def _merge(defaults: dict, given: dict) -> dict:
    out = copy.deepcopy(defaults)
    for k, v in given.items():
        out[k] = _merge(out[k], v) if isinstance(out.get(k), dict) and isinstance(v, dict) else v
    return out


def validate(data: dict, source: str = "<experiment>") -> Experiment:
    """Check an experiment mapping; the :class:`Experiment` (its ``to_dict()``: the mapping
    fully resolved, defaults filled in, ``topology`` resolved to its mapping,
    ``workload.bytes`` computed)."""
    from testbed.emulator.dynamics import scaled, validate_dynamics, validate_faults

    c = Checker(source)
    exp = _top_level(c, data)
    topo = _topology(exp["topology"], source)
    nodes = list(topo.nodes)
    exp["topology"] = topo.to_dict()
    _schemes(c, exp, nodes)
    _workload(c, exp["workload"], exp["scale"], nodes)
    _settings(c, exp, nodes)
    exp["dynamics"] = validate_dynamics(exp["dynamics"], topo, c, source)
    exp["faults"] = validate_faults(exp["faults"], topo, c)
    for i, v in enumerate([exp["scheme"], *(v["scheme"] for v in exp["variants"])]):
        if exp["faults"] and (v.get("groups") or {}).get("blocking") is False:
            c.fail("scheme.groups.blocking" if i == 0 else f"variants[{i - 1}].scheme.groups.blocking",
                   "non-blocking scatter has no failover (its early scatter would wait on a lost worker): "
                   "not with faults")
    sweep = expand_sweep(c, data, source) if data.get("sweep") is not None else None
    return Experiment(
        name=exp["name"], source=source, topology=topo.scaled(exp["scale"]), scale=exp["scale"], seed=exp["seed"],
        repetitions=exp["repetitions"], workload=Workload(**exp["workload"]),
        variants=(Variant(exp["scheme"]["name"], exp["scheme"]),
                  *(Variant(v["label"], v["scheme"]) for v in exp["variants"])),
        dynamics=tuple(scaled(exp["dynamics"], exp["scale"])),
        dynamics_per_run=exp["dynamics_per_run"], faults=tuple(exp["faults"]),
        emulator=EmulatorSettings(**exp["emulator"]), agents=AgentSettings(**exp["agents"]),
        output_dir=exp["output"]["dir"], sweep=sweep, placement=dict(exp["placement"]),
        resolved=copy.deepcopy({**exp, "sweep": None}))


def _top_level(c: Checker, data: dict) -> dict:
    """The top-level keys checked, merged over the defaults."""
    c.mapping(data, "", TOP_KEYS)
    for key in ("name", "topology", "scheme"):
        if key not in data:
            c.fail(key, "missing (required)")
    if not isinstance(data["name"], str) or not data["name"]:
        c.fail("name", "expected a non-empty string")
    for key in ("workload", "emulator", "agents", "output"):
        if key in data:
            c.mapping(data[key], key, set(DEFAULTS[key]))
    exp = _merge(DEFAULTS, data)
    c.number(exp["scale"], "scale", positive=True)
    c.number(exp["seed"], "seed", integer=True, minimum=0)
    c.number(exp["repetitions"], "repetitions", integer=True, minimum=1)
    return exp


def _topology(ref, source: str):
    """The topology ``ref`` names (a relative path with a folder: next to ``source`` if there)."""
    from testbed.topology import load_topology

    if isinstance(ref, str) and not Path(ref).is_absolute() and "/" in ref:
        candidate = Path(source).parent / ref
        ref = str(candidate) if candidate.exists() else ref
    return load_topology(ref, source=source, key="topology")


def _schemes(c: Checker, exp: dict, nodes: list[str]) -> None:
    """The main scheme and every variant's, resolved in place; labels unique."""
    exp["scheme"] = _scheme(c, exp["scheme"], "scheme", nodes)
    if not isinstance(exp["variants"], list):
        c.fail("variants", "expected a list of {label, scheme} mappings")
    labels = {exp["scheme"]["name"]}  # the main scheme's label
    for i, v in enumerate(exp["variants"]):
        key = f"variants[{i}]"
        c.mapping(v, key, {"label", "scheme"})
        if "scheme" not in v:
            c.fail(f"{key}.scheme", "missing (required)")
        c.mapping(v["scheme"], f"{key}.scheme")
        label = v.get("label") or v["scheme"].get("name", "")
        if not isinstance(label, str) or not label or label in labels:
            c.fail(f"{key}.label", f"expected a unique non-empty label, got {label!r}")
        labels.add(label)
        exp["variants"][i] = {"label": label, "scheme": _scheme(c, v["scheme"], f"{key}.scheme", nodes)}


def _size(c: Checker, value, key: str, minimum: int) -> int:
    """A size (``4MB``, ``64KB`` or a number of bytes) of at least ``minimum`` bytes, checked."""
    from testbed import workloads

    try:
        nbytes = workloads.parse_size(value)
    except (ValueError, TypeError) as e:
        c.fail(key, str(e))
    if nbytes < minimum:
        c.fail(key, "must be > 0" if minimum == 1 else f"must be at least {minimum} bytes, got {nbytes:g}")
    return int(nbytes)


def _workload(c: Checker, w: dict, scale: float, nodes: list[str]) -> None:
    """``workload`` checked, its ``bytes`` and ``length`` (after ``scale``) added in place."""
    from testbed import workloads

    c.choice(w["dtype"], "workload.dtype", ("float32", "float64"))
    c.number(w["iterations"], "workload.iterations", integer=True, minimum=1)
    c.number(w["warmup"], "workload.warmup", integer=True, minimum=0)
    if w["model"] is not None:
        c.choice(w["model"], "workload.model", sorted(workloads.MODELS))
        nbytes = workloads.model_bytes(w["model"], w["dtype"])
    else:
        nbytes = _size(c, w["size"], "workload.size", minimum=1)
    itemsize = workloads.dtype_bytes(w["dtype"])
    w["bytes"] = max(itemsize, int(nbytes * scale) // itemsize * itemsize)
    w["length"] = w["bytes"] // itemsize
    limit = workloads.max_vector_bytes(len(nodes))
    if w["bytes"] > limit:
        c.fail("workload.model" if w["model"] is not None else "workload.size",
               f"{w['bytes'] / 1e9:.3g} GB per vector does not fit in this machine's memory "
               f"({workloads.machine_memory() / 1e9:.3g} GB for {len(nodes)} agents x {workloads.AGENT_VECTORS} "
               f"vectors): at most {limit / 1e6:.0f} MB (after scale)")
    _check_compute(c, w["compute_s"], nodes)


def _settings(c: Checker, exp: dict, nodes: list[str]) -> None:
    """``emulator``, ``agents``, ``dynamics_per_run``, ``output`` and ``placement`` checked."""
    e = exp["emulator"]
    c.choice(e["method"], "emulator.method", SHAPING_CHOICES)
    c.number(e["relay_procs"], "emulator.relay_procs", integer=True, minimum=0)
    c.number(e["max_late_ms"], "emulator.max_late_ms", positive=True)
    if not (isinstance(e["tcp_cc"], str) and re.fullmatch(r"[a-z0-9_]+", e["tcp_cc"])):
        c.fail("emulator.tcp_cc", f"expected a TCP congestion control name such as cubic or bbr, got {e['tcp_cc']!r}")
    c.number(e["frame_ms"], "emulator.frame_ms", minimum=0)
    a = exp["agents"]
    c.number(a["timeout_s"], "agents.timeout_s", positive=True)
    if not isinstance(a["stop_and_wait"], bool):
        c.fail("agents.stop_and_wait", f"expected true or false, got {a['stop_and_wait']!r}")
    a["subblock_bytes"] = _size(c, a["subblock_bytes"], "agents.subblock_bytes", minimum=8)
    c.choice(a["links"], "agents.links", LINKS)
    if not isinstance(exp["dynamics_per_run"], bool):
        c.fail("dynamics_per_run", f"expected true or false, got {exp['dynamics_per_run']!r}")
    c.mapping(a["clock_offset_ms"], "agents.clock_offset_ms")
    for dc, ms in a["clock_offset_ms"].items():
        c.node(dc, "agents.clock_offset_ms", nodes)
        c.number(ms, f"agents.clock_offset_ms.{dc}")
    if not isinstance(exp["output"]["dir"], str):
        c.fail("output.dir", "expected a path string")
    c.mapping(exp["placement"], "placement")
    for dc, server in exp["placement"].items():
        c.node(dc, "placement", nodes)
        if not isinstance(server, str) or not server:
            c.fail(f"placement.{dc}", f"expected a server name of the servers file, got {server!r}")


SWEEP_FIXED = {"name", "sweep", "output"}  # keys a sweep point may not change


def expand_sweep(c: Checker, data: dict, source: str) -> dict:
    """``sweep: {grid: {key.path: [values]}, points: [{key.path: value}]}`` -> ``{"keys",
    "points": [{"values", "experiment"}]}``: the grid's every combination (first key
    slowest), then the explicit points; each point is the experiment with its values set as
    ``--set`` would, validated here in full, so a bad point stops the sweep before it starts."""
    sw = c.mapping(data["sweep"], "sweep", {"grid", "points"})
    grid = c.mapping(sw.get("grid", {}), "sweep.grid")
    points = sw.get("points", [])
    if not isinstance(points, list):
        c.fail("sweep.points", "expected a list of {key.path: value} mappings")
    for k, vals in grid.items():
        if not isinstance(vals, list) or not vals:
            c.fail(f"sweep.grid.{k}", "expected a non-empty list of values")
    combos = [{}]
    for k, vals in grid.items():
        combos = [{**cmb, k: v} for cmb in combos for v in vals]
    combos = combos if grid else []
    for i, p in enumerate(points):
        c.mapping(p, f"sweep.points[{i}]")
        if not p:
            c.fail(f"sweep.points[{i}]", "expected at least one key.path: value")
    combos += points
    if not combos:
        c.fail("sweep", "no points: give grid and/or points")
    keys = list(dict.fromkeys(k for cmb in combos for k in cmb))
    for k in keys:
        if not isinstance(k, str) or k.split(".")[0] not in TOP_KEYS or k.split(".")[0] in SWEEP_FIXED:
            c.fail(f"sweep.{k}", f"cannot sweep {k!r} (any experiment key path but {', '.join(sorted(SWEEP_FIXED))})")
    base = {k: v for k, v in data.items() if k != "sweep"}
    out = []
    for i, values in enumerate(combos):
        point = copy.deepcopy(base)
        for k, v in values.items():
            set_path(point, k, v, source)
        try:
            out.append({"values": values, "experiment": validate(point, source)})
        except ConfigError as e:
            desc = ", ".join(f"{k}={v}" for k, v in values.items())
            raise ConfigError(e.message, source=source, key=f"sweep point {i} ({desc}): {e.key}") from None
    return {"keys": keys, "points": out}


def _scheme(c: Checker, scheme, key: str, nodes: list[str]) -> dict:
    """Validate ``{name: ..., <param>: ...}`` with the planner registry (the scheme's
    parameter table: types, choices, bounds, datacenters) and return it with every default
    filled in."""
    from testbed.planners import resolve_scheme

    c.mapping(scheme, key)
    # netstorm is adaptive unless told otherwise (NetStorm-std: probing and re-planning, §V)
    adaptive = _adaptive(c, scheme.get("adaptive", scheme.get("name") == "netstorm"), f"{key}.adaptive")
    aux = _aux(c, scheme.get("aux"), f"{key}.aux")
    out = resolve_scheme({k: v for k, v in scheme.items() if k not in RUN_TIME_KEYS}, nodes, source=c.source,
                         key=key)
    if scheme.get("groups") is not None:
        out["groups"] = _groups(c, scheme["groups"], f"{key}.groups", nodes, out)
        if adaptive:
            c.fail(f"{key}.adaptive", "not with groups (re-planning runs between iterations; groups have none)")
        if aux:
            c.fail(f"{key}.aux", "not with groups (the groups' plans carry no auxiliary paths)")
    return {**out, **({"adaptive": adaptive} if adaptive else {}), **({"aux": aux} if aux else {})}


RUN_TIME_KEYS = ("adaptive", "aux", "groups")  # scheme keys of every scheme, not planner parameters


def _aux(c: Checker, spec, key: str) -> dict | None:
    """``aux: true | false | {...}`` resolved to None or every key of AUX_DEFAULTS."""
    from testbed.planners.auxpaths import DISJOINT

    if spec is None or spec is False:
        return None
    out = {**AUX_DEFAULTS, **({} if spec is True else c.mapping(spec, key, set(AUX_DEFAULTS)))}
    c.number(out["primary_busy_bound"], f"{key}.primary_busy_bound", integer=True, minimum=0)
    c.number(out["aux_queue_length"], f"{key}.aux_queue_length", integer=True, minimum=1)
    if out["max_paths"] is not None:
        c.number(out["max_paths"], f"{key}.max_paths", integer=True, minimum=1)
    c.choice(out["disjoint"], f"{key}.disjoint", DISJOINT)
    c.choice(out["idle_only"], f"{key}.idle_only", (True, False))
    c.number(out["resend_after_s"], f"{key}.resend_after_s", minimum=0)
    c.choice(out["dispatch"], f"{key}.dispatch", AUX_DISPATCH)
    return out


def _groups(c: Checker, spec, key: str, nodes: list[str], scheme: dict) -> dict:
    """``groups: {p, window_s}`` resolved; the scheme must take a group (``active``)."""
    if "active" not in scheme:
        c.fail(key, f"scheme {scheme['name']!r} has no group parameter 'active'")
    out = {**GROUPS_DEFAULTS, **c.mapping(spec, key, set(GROUPS_DEFAULTS) | {"controller_down"})}
    c.number(out["p"], f"{key}.p", integer=True, minimum=1)
    if out["p"] > len(nodes):
        c.fail(f"{key}.p", f"must be at most the number of datacenters ({len(nodes)}), got {out['p']!r}")
    if c.number(out["window_s"], f"{key}.window_s") <= 0:
        c.fail(f"{key}.window_s", f"must be positive, got {out['window_s']!r}")
    c.number(out["link_timeout_s"], f"{key}.link_timeout_s", minimum=0)
    if not 0 <= c.number(out["noise"], f"{key}.noise") < 1:
        c.fail(f"{key}.noise", f"must be in [0, 1), got {out['noise']!r}")
    if not isinstance(out["blocking"], bool):
        c.fail(f"{key}.blocking", f"expected true or false, got {out['blocking']!r}")
    if not out["blocking"] and (scheme["name"] != "crew" or scheme.get("aggregators") != "all"):
        c.fail(f"{key}.blocking", "non-blocking scatter needs crew with every worker aggregating "
                                  "(the receivers of the early scatter must be known before P)")
    if "controller_down" in out:
        down = c.mapping(out["controller_down"], f"{key}.controller_down", {"at_s", "for_s"})
        for k in ("at_s", "for_s"):
            if k not in down or c.number(down[k], f"{key}.controller_down.{k}") <= 0:
                c.fail(f"{key}.controller_down.{k}", f"a positive number of seconds, got {down.get(k)!r}")
        if down["at_s"] >= out["window_s"]:
            c.fail(f"{key}.controller_down.at_s", f"must be within the window ({out['window_s']:g} s)")
        if not out["blocking"]:
            c.fail(f"{key}.controller_down", "only with blocking scatter (a restarted controller does not "
                                             "re-obtain early scatters)")
        out["controller_down"] = {"at_s": float(down["at_s"]), "for_s": float(down["for_s"])}
    return out


def _adaptive(c: Checker, spec, key: str) -> dict | None:
    """``adaptive: true | false | {...}`` resolved to None or every key of ADAPTIVE_DEFAULTS."""
    from agents.probe import ESTIMATORS

    if spec is None or spec is False:
        return None
    spec = {} if spec is True else c.mapping(spec, key, set(ADAPTIVE_DEFAULTS))
    out = {**ADAPTIVE_DEFAULTS, **spec}
    c.number(out["update_s"], f"{key}.update_s", minimum=0)
    c.number(out["probe_chunk_bytes"], f"{key}.probe_chunk_bytes", integer=True, minimum=1)
    c.number(out["probe_chunk_num"], f"{key}.probe_chunk_num", integer=True, minimum=1)
    c.choice(out["estimator"], f"{key}.estimator", ESTIMATORS)
    c.choice(out["mode"], f"{key}.mode", ("estimated", "oracle"))
    if c.number(out["train_duty"], f"{key}.train_duty", minimum=0) > 0.05:
        c.fail(f"{key}.train_duty", f"at most 0.05 (a share of each link's rate), got {out['train_duty']!r}")
    if c.number(out["min_gain"], f"{key}.min_gain", minimum=0) >= 1:
        c.fail(f"{key}.min_gain", f"must be below 1 (a share of the current plan's CCT), got {out['min_gain']!r}")
    return out


def _check_compute(c: Checker, spec, nodes: list[str]) -> None:
    key = "workload.compute_s"
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        c.number(spec, key, minimum=0)
        return
    c.mapping(spec, key, {"uniform", "normal", "per_worker", "T1", "T2"})
    if len(spec) != 1:
        c.fail(key, "give exactly one of uniform, normal, per_worker, T1, T2")
    (kind, arg), = spec.items()
    if kind in ("T1", "T2"):  # CREW §V-A's distributions on [0.05, 0.2] s, times a factor
        c.number(arg, f"{key}.{kind}", positive=True)
    elif kind == "per_worker":
        c.mapping(arg, f"{key}.per_worker")
        for dc, s in arg.items():
            c.node(dc, f"{key}.per_worker", nodes)
            for v in (s if isinstance(s, list) and s else [s]):  # seconds, or a per-iteration trace
                c.number(v, f"{key}.per_worker.{dc}", minimum=0)
    elif not (isinstance(arg, list) and len(arg) == 2 and all(isinstance(x, (int, float)) for x in arg)):
        c.fail(f"{key}.{kind}", "expected a list of two numbers")


def load_experiment(path: str | Path, overrides: list[str] = ()) -> Experiment:
    data = apply_overrides(load_yaml(path), list(overrides), str(path))
    return validate(data, str(path))
