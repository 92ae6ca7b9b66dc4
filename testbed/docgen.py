"""The reference pages' generated sections, read from the code.

``python3 -m testbed.docgen`` rewrites every region of ``docs/**/*.md`` between
``<!-- BEGIN GENERATED: NAME -->`` and ``<!-- END GENERATED: NAME -->`` with what
:data:`SECTIONS` ``[NAME]`` makes of the code now: the command line (argparse of
:mod:`testbed.cli`), the experiment keys (the defaults of :mod:`testbed.config`, each key's
checks found by giving :func:`testbed.config.validate` bad values), every registered scheme
and its ``Param`` table, the topology generators and shipped files, the shipped experiments,
results.json's fields and the CSV columns.  ``--check`` writes nothing and exits 1 naming
every section that differs (``tests/test_docs.py`` runs it).

What the code cannot say -- one sentence of meaning per experiment key, results.json field
and CSV column -- lives here, in :data:`KEY_DOCS`, :data:`RESULTS_FIELDS` and
:data:`COLUMN_DOCS`.  A key, field or column the code has and these tables do not is printed
as ``UNDOCUMENTED`` and fails the check: adding one to the code means adding its line here.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import re
import sys
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
UNDOCUMENTED = "UNDOCUMENTED"
GENERATED = re.compile(r"<!-- BEGIN GENERATED: ([a-z0-9-]+) -->.*?<!-- END GENERATED: \1 -->", re.S)
BEGIN = re.compile(r"<!-- BEGIN GENERATED: ([a-z0-9-]+) -->\n")
END = "<!-- END GENERATED: {} -->"


def _cell(text: Any) -> str:
    """A Markdown table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _code(value: Any) -> str:
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`' if value == "" else f"`{value}`"
    if isinstance(value, (list, tuple)):
        return "`[" + ", ".join(str(v) for v in value) + "]`" if value else "`[]`"
    if isinstance(value, dict):
        return "`{}`" if not value else "`" + str(value).replace("'", "") + "`"
    return f"`{value:g}`" if isinstance(value, float) else f"`{value}`"


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _md(text: str) -> str:
    """reStructuredText markup of docstrings as Markdown: ``x`` and :role:`x` -> `x`."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def _first_paragraph(doc: str) -> str:
    return _md(" ".join((inspect.cleandoc(doc or "").split("\n\n") or [""])[0].split()))


# --------------------------------------------------------------------------- command line

def _parsers() -> dict[str, argparse.ArgumentParser]:
    from testbed.cli import build_parser

    top = build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001 -- argparse offers no public API for a parser's actions
    return dict(sub.choices)


def _verb_help() -> dict[str, str]:
    from testbed.cli import build_parser

    top = build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001 -- argparse offers no public API for a parser's actions
    return {a.dest: a.help or "" for a in sub._choices_actions}  # noqa: SLF001 -- argparse offers no public API for a parser's actions


def section_cli_verbs() -> str:
    helps = _verb_help()
    return _table(["verb", "what it does"], [[f"[`{v}`](#{v})", helps.get(v, "")] for v in _parsers()])


def _usage(verb: str, p: argparse.ArgumentParser) -> str:
    p = copy.copy(p)
    p.prog = f"python3 -m testbed {verb}"
    p.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=88)
    lines = p.format_usage().replace("usage: ", "").replace(" [-h]", "").strip().splitlines()
    return "\n".join([lines[0]] + ["    " + line.strip() for line in lines[1:]])


def section_cli() -> str:
    out = []
    helps = _verb_help()
    for verb, p in _parsers().items():
        out += [f"### {verb}", "", helps.get(verb, "") + ("." if helps.get(verb) else ""), ""]
        if p.description and p.description != helps.get(verb):
            out += [" ".join(p.description.split()), ""]
        out += ["```", "sudo " + _usage(verb, p), "```", ""]
        rows = []
        for a in p._actions:  # noqa: SLF001 -- argparse offers no public API for a parser's actions
            if isinstance(a, argparse._HelpAction):  # noqa: SLF001 -- argparse offers no public API for a parser's actions
                continue
            name = ", ".join(a.option_strings) if a.option_strings else (a.metavar or a.dest)
            if a.option_strings and a.nargs != 0:
                name += f" {a.metavar or a.dest.upper()}"
            default = "" if a.default in (None, False, [], argparse.SUPPRESS) or not a.option_strings else _code(a.default)
            choices = ", ".join(str(c) for c in a.choices) if a.choices else ""
            rows.append([f"`{name}`", a.help or UNDOCUMENTED, choices, default])
        if rows:
            out += [_table(["argument", "meaning", "choices", "default"], rows), ""]
    return "\n".join(out).rstrip()


def section_benchmarks() -> str:
    from testbed.bench import BENCHES

    return _table(["benchmark", "what it measures"],
                  [[f"`{name}`", _first_paragraph(fn.__doc__) or UNDOCUMENTED] for name, fn in sorted(BENCHES.items())])


# --------------------------------------------------------------------------- experiment keys

#: One line of meaning per experiment key path (``variants[].x``: every entry of the list).
KEY_DOCS: dict[str, str] = {
    "name": "the experiment's name (required); results go to `output.dir/<time>-<name>/`",
    "topology": "the WAN (required): a name from `topologies/`, a path (relative to the experiment file), "
                "or an inline topology mapping ([topologies](topologies.md))",
    "scheme": "the main scheme (required): `{name: <scheme>, <parameter>: <value>, ...}` with the scheme's "
              "parameters from [schemes](schemes.md), plus `adaptive`, `aux`, `groups` below",
    "scheme.name": "a registered scheme ([schemes](schemes.md))",
    "scale": "multiplies every link rate and the data size; a queue keeps its delay "
             "([choosing scale](../guides/link-fidelity.md))",
    "seed": "seeds the inputs (integer-valued, so every result is checked exactly), the compute times and "
            "CREW's noise (a `redraw` has its own seed)",
    "repetitions": "runs of each variant; variants are interleaved repetition by repetition",
    "workload": "the vector every worker reduces",
    "workload.size": "bytes per worker before `scale` (`4MB`, `1.5GB`, or a number of bytes); ignored with `model`",
    "workload.model": "take the size from a model's parameter count instead of `size`",
    "workload.dtype": "element type (4 or 8 bytes)",
    "workload.iterations": "measured iterations per run",
    "workload.warmup": "iterations run (and checked) first and left out of the CCT statistics; "
                       "their times are in `runs[].warmup_cct_s`",
    "workload.compute_s": "compute time before each iteration's communication: seconds, `{uniform: [lo, hi]}`, "
                          "`{normal: [mean, std]}`, `{per_worker: {dc: s or [s per iteration]}}`, or CREW's "
                          "`{T1: factor}` / `{T2: factor}`",
    "emulator": "how the WAN is emulated",
    "emulator.method": "link shaping: `auto` (netem where the kernel has it, else the user-space relay), "
                       "`netem`, or `relay`",
    "emulator.relay_procs": "number of relay processes (0: one per core, at most one per link)",
    "emulator.max_late_ms": "relay p99 lateness above which results.json says the emulation did not keep up",
    "emulator.tcp_cc": "TCP congestion control of every datacenter host (never the machine's default)",
    "emulator.frame_ms": "the longest a link direction takes to carry one TCP frame (a TSO/GSO segment train, "
                         "whose bytes arrive together): each sender's gso_max_size is this much of its link's rate, "
                         "at most 64 KB, where its queue counts bytes (the relay's; netem links keep the kernel's "
                         "sizing); 0: the kernel's own sizing, ~1 ms of the flow's pacing rate and ~1,000 "
                         "frames per second per busy link whatever its rate",
    "agents": "the worker agents",
    "agents.timeout_s": "an agent silent for half of this, or a transfer stalled this long, fails the run "
                        "naming it; an iteration may take this plus 4x its predicted time",
    "agents.stop_and_wait": "execute one transfer at a time per node (for checking the cost model)",
    "agents.subblock_bytes": "cut-through granularity: an agent adds (or copies) a chunk's arrived bytes this many at "
                             "a time and forwards what it has added; a chunk no longer than this is stored and "
                             "forwarded whole (a size: `16KiB`, or bytes); the prediction models the same value; "
                             "agents that probe (`adaptive`) store and forward every chunk",
    "agents.links": "the agents' data connections: `shared`, one TCP connection per neighbour that carries "
                    "every tree's transfers in pieces (what is ready, up to 256 KiB), served in weighted fair "
                    "order (the plan's rates as weights, not caps: a tree with nothing ready leaves its share to "
                    "the others); or "
                    "`channel`, a connection per plan channel (per tree), paced at the plan's rates where it has "
                    "them.  Runs that probe, re-plan, form groups, stop and wait or use auxiliary paths use "
                    "`channel` (each run's record says which: `connections`); the prediction models the same",
    "agents.clock_offset_ms": "`{dc: ms}`: shift an agent's clock (tests of the clock-offset correction)",
    "dynamics": "live rate changes: `{at_s, link, rate_mbps, direction}`, `{trace: file.csv}`, "
                "`{redraw: {lo, hi, every_s, seed}}` ([below](#dynamics-and-faults))",
    "dynamics_per_run": "`true`: every run (variant x repetition) starts on the healthy network and replays "
                        "dynamics and faults from its measured phase's start (every agent ready), so compared "
                        "schemes see the same conditions at the same point of their run",
    "placement": "`{dc: server}`: with `--servers`, pin datacenters to servers of the servers file; the rest "
                 "are placed to cut the least rate ([multi-server guide](../guides/multi-server.md))",
    "faults": "`{at_s, link_down: [a, b]}`, `{at_s, link_up: [a, b]}`, `{at_s, crash: dc}`, `{at_s, restart: dc}`",
    "variants": "more schemes run on the same network and compared in one results.json",
    "variants[].label": "the variant's name in tables and figures (default: the scheme's name; unique)",
    "variants[].scheme": "as `scheme`",
    "output": "where results go",
    "output.dir": "folder under which each run makes `<time>-<name>/` (relative to the working directory)",
    "sweep": "run the experiment once per point: `{grid: {key.path: [values]}, points: [{key.path: value}]}`",
    "sweep.grid": "every combination of the listed values (first key slowest)",
    "sweep.points": "explicit points, after the grid's",
    "scheme.adaptive": "`true`, `false` or a mapping: probe the links with the scheme's own data and re-plan "
                       "on the estimates ([adaptive guide](../guides/adaptive.md)); `netstorm`: on unless `false`",
    "scheme.adaptive.update_s": "re-plan at the first iteration boundary after this many seconds; 0: only measure",
    "scheme.adaptive.probe_chunk_bytes": "chunk size of a probing window (NetStorm Table II)",
    "scheme.adaptive.probe_chunk_num": "chunks per probing window (NetStorm Table II)",
    "scheme.adaptive.estimator": "rate estimator: `busy` (bytes over busy time), `sum` (ratio of sums), "
                                 "`eq17` (NetStorm Eq. 17)",
    "scheme.adaptive.mode": "`estimated`: plan on the agents' estimates; `oracle`: on the emulator's true rates",
    "scheme.adaptive.min_gain": "take a new plan only when its predicted CCT beats the current one's by this share",
    "scheme.adaptive.train_duty": "share of each link's rate used by packet trains on links the data leaves idle; 0: off",
    "scheme.aux": "`true`, `false` or a mapping: send chunks over auxiliary multi-hop paths too "
                  "([auxiliary multipath](../guides/aux.md))",
    "scheme.aux.primary_busy_bound": "a chunk goes to an auxiliary path when more than this many wait for the "
                                     "direct connection (NetStorm Table II)",
    "scheme.aux.aux_queue_length": "at most this many of a sender's chunks in flight on one auxiliary path",
    "scheme.aux.max_paths": "auxiliary paths per (sender, next aggregator) pair",
    "scheme.aux.disjoint": "`node`: node-disjoint relays (the authors' code); `edge`: edge-disjoint rounds (the paper)",
    "scheme.aux.idle_only": "only over links no transfer of the plan uses (the paper's reading)",
    "scheme.aux.resend_after_s": "a receiver that got no byte for this long asks for what it misses",
    "scheme.aux.dispatch": "`queue`: the paper's bounds alone; `eta`: only when the path's rates say the chunk "
                           "arrives sooner there",
    "scheme.groups": "CREW's run-time groups: form groups of the first `p` ready workers for `window_s` seconds "
                     "and count rounds ([CREW guide](../guides/crew.md))",
    "scheme.groups.p": "workers per group (P)",
    "scheme.groups.window_s": "length of the measured window T",
    "scheme.groups.link_timeout_s": "a member pair whose UDP heartbeats stop this long is a broken link; 0: not watched",
    "scheme.groups.noise": "λ: the controller plans on b(1+x), x ~ U[-λ, λ] per link direction (CREW §V-H)",
    "scheme.groups.blocking": "`false`: non-blocking scatter (crew with `aggregators: all`; no faults)",
    "scheme.groups.controller_down": "`{at_s, for_s}`: the controller is lost for `for_s` seconds, `at_s` into "
                                     "the window (blocking only)",
    "scheme.groups.controller_down.at_s": "when the controller is lost, seconds into the window",
    "scheme.groups.controller_down.for_s": "how long it stays lost",
}

#: Keys whose value is a mapping of user names (not sub-keys).
FREE_MAPPINGS = {"agents.clock_offset_ms", "placement"}
SCHEME_NAME = "the scheme's name"
_PROBE_BASE = {"name": "probe", "topology": "small-3", "scheme": {"name": "ring"}}
_PROBE_VALUES = ("zz", -1, 0, 0.5, 10 ** 9)


def experiment_keys() -> list[tuple[str, Any]]:
    """Every experiment key path the code knows, with its default (``REQUIRED`` for the
    three required keys), in the order of the defaults."""
    from testbed import config

    keys: list[tuple[str, Any]] = [("name", "REQUIRED"), ("topology", "REQUIRED"), ("scheme", "REQUIRED"),
                                   ("scheme.name", "REQUIRED")]

    def walk(prefix: str, d: dict):
        for k, v in d.items():
            path = f"{prefix}{k}"
            keys.append((path, v if not isinstance(v, dict) or path in FREE_MAPPINGS else ""))
            if isinstance(v, dict) and path not in FREE_MAPPINGS:
                walk(path + ".", v)
            if path == "variants":
                keys.extend([("variants[].label", SCHEME_NAME), ("variants[].scheme", "REQUIRED")])
            if path == "sweep":
                keys.extend([("sweep.grid", {}), ("sweep.points", [])])

    walk("", config.DEFAULTS)
    for run_key, defaults in (("adaptive", config.ADAPTIVE_DEFAULTS), ("aux", config.AUX_DEFAULTS),
                              ("groups", config.GROUPS_DEFAULTS)):
        keys.append((f"scheme.{run_key}", False if run_key != "groups" else None))
        keys.extend((f"scheme.{run_key}.{k}", v) for k, v in defaults.items())
        if run_key == "groups":
            keys += [("scheme.groups.controller_down", None), ("scheme.groups.controller_down.at_s", "REQUIRED"),
                     ("scheme.groups.controller_down.for_s", "REQUIRED")]
    return keys


def _probe(path: str) -> str:
    """What :func:`testbed.config.validate` requires of ``path``: its messages for bad values."""
    from testbed import config
    from testbed.errors import ConfigError

    base = copy.deepcopy(_PROBE_BASE)
    if path.startswith("scheme.groups"):
        base["scheme"] = {"name": "crew", "groups": {"p": 2}}
    if path.startswith("scheme.groups.controller_down."):
        base["scheme"]["groups"]["controller_down"] = {"at_s": 1, "for_s": 1}
    found: list[str] = []
    for value in _PROBE_VALUES:
        data = copy.deepcopy(base)
        try:
            config.set_path(data, path.replace("[]", ""), value, "probe")
            config.validate(data, "probe")
        except ConfigError as e:
            if e.key != path or "memory" in e.message:
                continue
            msg = re.sub(r",? got .*$", "", e.message).strip()
            msg = re.sub(r" \(\d+( s)?\)", "", msg.replace("'zz'", "X"))  # the probe's own values and topology
            msg = re.sub(r"(?<![\w.])(-1|0\.5|1000000000)(?![\w.])", "X", msg)
            if msg and msg not in found:
                found.append(msg)
        except Exception:  # noqa: BLE001 -- a value the checks do not catch is no constraint to print
            continue
    return "; ".join(found)


def _applies(path: str) -> str:
    from testbed.planners import NODES, schemes

    if path.startswith("scheme.groups"):
        return ", ".join(sorted(n for n, s in schemes().items()
                                if any(k == "active" and p.kind == NODES for k, p in s.params.items())))
    if path.startswith(("scheme.aux", "scheme.adaptive")):
        return "every scheme"
    return ""


def section_experiment_keys() -> str:
    rows = []
    for path, default in experiment_keys():
        shown = ("required" if default == "REQUIRED" else "" if default == "" else
                 default if default == SCHEME_NAME else _code(default))
        rows.append([f"`{path}`", KEY_DOCS.get(path, UNDOCUMENTED), shown,
                     _probe(path) if default != "" and path not in ("scheme", "scheme.name", "topology") else "", _applies(path)])
    return _table(["key", "meaning", "default", "checked: must be", "schemes"], rows)


def stale_key_docs() -> list[str]:
    """KEY_DOCS entries the code no longer has."""
    known = {p for p, _ in experiment_keys()}
    return sorted(set(KEY_DOCS) - known)


# --------------------------------------------------------------------------- schemes

def _param_allowed(p) -> str:
    parts = []
    if p.choices:
        parts.append("one of " + ", ".join(f"`{c}`" for c in p.choices))
    for name, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        if getattr(p, name) is not None:
            parts.append(f"{sign} {getattr(p, name):g}")
    kind = {"node": "a datacenter", "nodes": "a list of datacenters", "node-map": "datacenter -> datacenter"}
    if p.kind:
        parts.append(kind.get(p.kind, p.kind))
    return ", ".join(parts)


_TYPE_NAMES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "list": "list",
               "NoneType": "null", "dict": "mapping"}


def _typename(t) -> str:
    types = t if isinstance(t, tuple) else (t,)
    return " or ".join(_TYPE_NAMES.get(x.__name__, x.__name__) for x in types if x is not tuple) or "list"


def section_schemes_index() -> str:
    from testbed.planners import schemes

    rows = [[f"[`{n}`](#{n})", _first_paragraph(s.doc).split(". ")[0], s.reference]
            for n, s in sorted(schemes().items())]
    return _table(["scheme", "what", "follows"], rows)


def section_schemes() -> str:
    from testbed.planners import schemes

    out = []
    for name, s in sorted(schemes().items()):
        out += [f"### {name}", "", f"*Follows:* {s.reference}", "", _first_paragraph(s.doc) or UNDOCUMENTED, ""]
        rows = [[f"`{k}`", _typename(p.type), _code(p.default), _param_allowed(p), p.doc or UNDOCUMENTED]
                for k, p in s.params.items()]
        out += [_table(["parameter", "type", "default", "allowed", "meaning"], rows) if rows else "No parameters.", ""]
    return "\n".join(out).rstrip()


# --------------------------------------------------------------------------- topologies

def section_topology_format() -> str:
    from testbed import topology

    doc = inspect.getdoc(topology) or ""
    m = re.search(r"Topology file format.*?\n=+\n::\n\n(.*?)\n\n(?=\S)", doc, re.S)
    block = inspect.cleandoc(m.group(1)) if m else UNDOCUMENTED
    rest = doc[m.end():].strip() if m else ""
    return "```yaml\n" + block + "\n```\n\n" + _md(" ".join(rest.split()))


def section_topology_generators() -> str:
    from testbed import topogen

    rows = []
    for kind, fn in topogen.GENERATORS.items():
        names, required = topogen._params_of(fn)  # noqa: SLF001 -- the loader's own reading of the signature
        sig = inspect.signature(fn)
        params = []
        for n in names:
            p = sig.parameters.get(n)
            if n in required:
                params.append(f"`{n}` (required)")
            elif p is not None and p.default is not inspect.Parameter.empty:
                params.append(f"`{n}` = {_code(p.default)}")
            else:
                params.append(f"`{n}`")
        rows.append([f"`{kind}`", _first_paragraph(fn.__doc__) or UNDOCUMENTED, ", ".join(params)])
    common = ", ".join(f"`{c}`" for c in topogen.COMMON_PARAMS)
    return _table(["kind", "what", "parameters"], rows) + f"\n\nEvery generator also takes {common} for every link."


def section_topology_files() -> str:
    from testbed.topology import list_topologies, load_topology

    rows = []
    for name in list_topologies():
        t = load_topology(name)
        rates = [d.rate_mbps for l in t.links for d in (l.ab, l.ba)]
        delays = [d.delay_ms for l in t.links for d in (l.ab, l.ba)]
        rows.append([f"`{name}`", len(t.nodes), len(t.links), f"{min(rates):g}-{max(rates):g}",
                     f"{min(delays):g}-{max(delays):g}", _md(getattr(t, "source", "") or "")])
    return _table(["name", "datacenters", "links", "rate Mbit/s", "one-way delay ms", "source"], rows)


# --------------------------------------------------------------------------- experiments

def section_experiments() -> str:
    from testbed import config

    rows = []
    for f in config.shipped_experiments():
        head = []
        for line in f.read_text().splitlines():
            if not line.startswith("#"):
                break
            text = line.lstrip("#").strip()
            if text.startswith(("sudo ", "python3 ")) or "python3 -m testbed" in text:
                continue
            head.append(text)
        data = config.load_yaml(f)
        schemes = [data.get("scheme", {}).get("name", "?")] + [
            v.get("label") or v.get("scheme", {}).get("name", "?") for v in data.get("variants") or []]
        topo = data.get("topology") if isinstance(data.get("topology"), str) else "inline"
        first = re.split(r"(?<!\bal)(?<!\bFig)(?<!\bSec)(?<!\bEq)\.\s+(?=[A-Z])", " ".join(head))[0]
        rows.append([f"`{f.stem}`", first.rstrip(".") + "." if first else UNDOCUMENTED, f"`{topo}`",
                     ", ".join(schemes)])
    return _table(["experiment", "what it reproduces (the file's header says more)", "topology",
                   "schemes (main first)"], rows)


# --------------------------------------------------------------------------- results

#: results.json, field by field: (path, unit, meaning).  ``[]``: every list entry; ``{dc}``: a
#: datacenter's name as key; ``{link}``: a directed link ``a->b`` as key; ``*`` at the end: the
#: row describes everything below (its parts are the named module's own record).
RESULTS_FIELDS: list[tuple[str, str, str]] = [
    ("experiment", "", "the experiment as run, every default filled in, the topology resolved to its mapping "
                       "(the file's rates, before `scale`)"),
    ("experiment.*", "", "the keys of the [experiment reference](experiment.md), plus `workload.bytes` "
                         "(after scale) and `workload.length` (elements)"),
    ("environment", "", "the machine"),
    ("environment.kernel", "", "`uname -r`"),
    ("environment.python", "", "Python version"),
    ("environment.host", "", "host name"),
    ("environment.cpus", "", "CPUs the kernel sees"),
    ("environment.cpu_model", "", "processor name"),
    ("environment.preemption", "", "the kernel's preemption model (`none`, `voluntary`, `full`, `lazy`, `rt`)"),
    ("environment.packages", "", "versions of the Python packages used"),
    ("environment.packages.*", "", ""),
    ("environment.git_commit", "", "the checkout's commit, `+dirty` when it has changes"),
    ("environment.capabilities", "", "what `doctor` reports (root, mnexec, HTB, netem, ...)"),
    ("environment.capabilities.*", "", ""),
    ("environment.host_sysctls", "", "the datacenter hosts' TCP settings (congestion control, buffers)"),
    ("environment.host_sysctls.*", "", ""),
    ("environment.memory_hold", "", "on a VM whose balloon reports free pages: the memory held for the run "
                                    "(`null` elsewhere)"),
    ("environment.memory_hold.*", "", ""),
    ("links", "", "every emulated link direction as shaped (not with `deploy`)"),
    ("links[].src", "", "sending datacenter"),
    ("links[].dst", "", "receiving datacenter"),
    ("links[].rate_mbps", "Mbit/s", "configured rate (after `scale`)"),
    ("links[].delay_ms", "ms", "one-way delay"),
    ("links[].jitter_ms", "ms", "jitter (standard deviation)"),
    ("links[].loss", "probability", "random loss"),
    ("links[].queue_pkts", "packets", "the sender's queue"),
    ("links[].method", "", "`htb`, `htb+netem` or `htb+user-space-relay`"),
    ("links[].segment_loss", "", "`false` where a lossy netem link drops whole TSO frames (kernel could not cap them)"),
    ("links[].frame_bytes", "bytes", "the largest TCP frame its sender hands the link (`emulator.frame_ms` of its "
                                     "rate); absent where frames keep the kernel's sizing"),
    ("events", "", "dynamics and faults as applied, and emulator errors: `{t_s, ...}`"),
    ("events[].*", "", ""),
    ("events_t0_s", "s (Unix time)", "the instant `events[].t_s` counts from"),
    ("emulation", "", "did the emulator keep up (not with `deploy`)"),
    ("emulation.method", "", "shaping method used"),
    ("emulation.kept_up", "", "`false` when the emulator was overloaded: do not publish such numbers, lower `scale`"),
    ("emulation.warnings", "", "why it did not keep up"),
    ("emulation.cpu_util", "share", "whole-machine CPU busy during the runs"),
    ("emulation.iterations_cpu_util", "share", "whole-machine CPU busy while the measured iterations communicated "
     "(GO to the last worker done); above 0.9 the CCTs may be the host's limit, not the WAN's (a note, not `kept_up`)"),
    ("emulation.steal", "share", "CPU time a hypervisor took (above 0.03 timings may be stretched)"),
    ("emulation.pauses", "[Unix s, s]", "every time a process that only sleeps 10 ms at a time woke 0.1 s or more "
     "late (start, length): the machine paused; one of 0.5 s or more makes `kept_up` false"),
    ("emulation.max_late_ms", "ms", "the relay's p99 lateness limit used for `kept_up`"),
    ("emulation.relay", "", "per relay process: its statistics and per-direction counters (lateness, drops, frames)"),
    ("emulation.relay[].*", "", ""),
    ("emulation.relay_layout", "", "relay processes, their cores, priority and links"),
    ("emulation.relay_layout.*", "", ""),
    ("deployment", "", "`deploy` only: each real host's kernel, Python and numpy, code files sent"),
    ("deployment.*", "", ""),
    ("variants", "", "one entry per scheme compared (the main scheme first)"),
    ("variants[].label", "", "the variant's label"),
    ("variants[].scheme", "", "the scheme with every parameter resolved"),
    ("variants[].scheme.*", "", ""),
    ("variants[].summary", "", "as `summary` below, for this variant"),
    ("variants[].summary.*", "", ""),
    ("variants[].plan", "", "the plan run first"),
    ("variants[].plan.scheme", "", "scheme name"),
    ("variants[].plan.ops", "", "number of send/receive operations in all programs"),
    ("variants[].plan.bytes_sent", "bytes", "bytes all transfers of one iteration move"),
    ("variants[].plan.meta", "", "what the planner reports: trees, roots, parents, heights, rates, shares, "
                                 "chunks, `params`, `planner_s` (s), `reference`; scheme-specific"),
    ("variants[].plan.meta.*", "", ""),
    ("variants[].prediction", "", "the cost model's prediction of one iteration"),
    ("variants[].prediction.cct_s", "s", "predicted CCT"),
    ("variants[].prediction.*", "", "the model's breakdown: per-link busy time and bytes, node finish times, "
                                    "bottleneck, phases, the model's assumptions"),
    ("variants[].bound", "", "the optimum for this network and size (`null` for a partial reduce)"),
    ("variants[].bound.transfer_s", "s", "the strict bound: the optimal packing's transfer time at `rate_mbps`; "
                                         "no tree-based AllReduce of every node finishes sooner in the model"),
    ("variants[].bound.rate_mbps", "Mbit/s", "a proven upper bound on the packing's rate"),
    ("variants[].bound.bound", "", "which bound `rate_mbps` is (a packing meeting a bound, the directed cut, "
                                   "the degree bound or the dual bound)"),
    ("variants[].bound.packing_rate_mbps", "Mbit/s", "the rate of the best packing found"),
    ("variants[].bound.gap", "", "(rate_mbps - packing_rate_mbps) / rate_mbps"),
    ("variants[].bound.estimate_cct_s", "s", "the packing's transfer time plus its best tree's round-trip delay: "
                                             "an estimate, not a bound"),
    ("variants[].bound.cut_rate_mbps", "Mbit/s", "the minimum directed cut (a bound for any scheme)"),
    ("variants[].bound.model", "", "what the bound models"),
    ("variants[].bound.assumes", "", "what it assumes"),
    ("variants[].bound.*", "", "the packing's trees, rates, solver status and timing"),
    ("variants[].error", "", "why a variant could not run (its runs are missing)"),
    ("runs", "", "one entry per variant and repetition, in the order run"),
    ("runs[].variant", "", "the variant's label"),
    ("runs[].repetition", "", "repetition number, from 0"),
    ("runs[].connections", "", "the agents' data connections in this run: `shared` (one per neighbour) or "
                               "`channel` (one per tree; `agents.links`)"),
    ("runs[].cct_s", "s", "mean CCT of the run's measured iterations (with `groups`: of its completed tasks)"),
    ("runs[].warmup_cct_s", "s", "CCT of each warm-up iteration (not in any statistic)"),
    ("runs[].iterations_cpu_util", "share", "`emulation.iterations_cpu_util` over this run's measured iterations"),
    ("runs[].correct", "", "every worker's result equal to the exact sum in every iteration"),
    ("runs[].incorrect", "", "datacenters whose result was wrong"),
    ("runs[].errors", "", "what went wrong (wrong results, protocol violations)"),
    ("runs[].iterations", "", "every iteration, warm-up ones marked"),
    ("runs[].iterations[].iteration", "", "iteration number"),
    ("runs[].iterations[].warmup", "", "a warm-up iteration"),
    ("runs[].iterations[].cct_s", "s", "from the first worker's start (after compute) to the last worker's "
                                       "exact result"),
    ("runs[].iterations[].iteration_s", "s", "from the GO to the last result, compute included"),
    ("runs[].iterations[].go_ns", "ns", "when the coordinator released the iteration"),
    ("runs[].iterations[].correct", "", "every worker exact in this iteration"),
    ("runs[].iterations[].version", "", "plan version the iteration ran (adaptive schemes switch)"),
    ("runs[].iterations[].workers", "", "per datacenter, the columns of the worker table below"),
    ("runs[].iterations[].workers.{dc}", "", ""),
    ("runs[].iterations[].workers.{dc}.*", "", ""),
    ("runs[].iterations[].tcp", "", "per link direction `src->dst` whose connections retransmitted: `[segments, "
                                    "timeouts, s in timeout recovery]` (Linux >= 6.7 on every agent)"),
    ("runs[].iterations[].tcp.*", "", ""),
    ("runs[].transfers", "", "every transfer of every iteration: `{columns, rows}` (the transfer table below)"),
    ("runs[].transfers.columns", "", "column names"),
    ("runs[].transfers.rows", "", "one list per transfer"),
    ("runs[].links", "", "per WAN link direction, from the transfers"),
    ("runs[].links[].src", "", "sender"),
    ("runs[].links[].dst", "", "receiver"),
    ("runs[].links[].bytes", "bytes", "payload carried"),
    ("runs[].links[].aux_bytes", "bytes", "of which on auxiliary paths"),
    ("runs[].links[].transfers", "", "transfers over it"),
    ("runs[].links[].span_s", "s", "first send to last byte received"),
    ("runs[].links[].goodput_mbps", "Mbit/s", "payload rate over the span"),
    ("runs[].links[].retrans_segs", "", "TCP segments the sender's connections to the receiver retransmitted, "
                                        "every iteration (Linux >= 6.7 on every agent)"),
    ("runs[].links[].rtos", "", "their retransmission timeouts"),
    ("runs[].links[].rto_s", "s", "time those connections spent recovering from the timeouts"),
    ("runs[].tcp", "", "`{retrans_segs, rtos, rto_s}` over the measured iterations and every connection: what "
                       "TCP's loss recovery cost the run (Linux >= 6.7 on every agent)"),
    ("runs[].tcp.*", "", ""),
    ("runs[].versions", "", "plan versions the run used (adaptive schemes: one per switch)"),
    ("runs[].versions[].*", "", ""),
    ("runs[].switches", "", "plan switches: when, which version, predicted gain"),
    ("runs[].estimates", "", "adaptive schemes: clock offsets, per-link estimate windows and series beside the "
                             "configured rate and delay"),
    ("runs[].estimates.*", "", ""),
    ("runs[].estimation", "", "how good the link estimates were: share within 10 % of the configured rate, "
                              "worst errors, packet trains"),
    ("runs[].estimation.*", "", ""),
    ("runs[].aux", "", "`aux` schemes: chunks and bytes over auxiliary paths, per hop and relay"),
    ("runs[].aux.*", "", ""),
    ("runs[].rounds", "", "`groups`: completed rounds per worker in the window"),
    ("runs[].rounds.*", "", ""),
    ("runs[].rounds_total", "", "`groups`: rounds of all workers"),
    ("runs[].groups", "", "`groups`: tasks, their members, timings, failovers and repairs"),
    ("runs[].groups.*", "", ""),
    ("runs[].clock_offsets", "", "`deploy`: each host's clock offset (`offset_ms`) and round trip (`rtt_ms`)"),
    ("runs[].clock_offsets.*", "", ""),
    ("failed_run", "", "a run that failed: its variant, repetition, message, `culprit`, `link`"),
    ("failed_run.*", "", ""),
    ("summary", "", "the main scheme's summary and the comparison of all variants"),
    ("summary.cct_s", "s", "`{mean, min, max, stdev, n}` over the runs' CCTs"),
    ("summary.cct_s.*", "", ""),
    ("summary.predicted_cct_s", "s", "the cost model's prediction"),
    ("summary.bound_s", "s", "the strict bound: the optimal tree packing's transfer time (empty for a partial "
                             "reduce)"),
    ("summary.estimate_cct_s", "s", "that packing's estimated CCT with its best tree's delay (an estimate, not a "
                                    "bound)"),
    ("summary.efficiency", "", "bound_s / mean CCT (at most 1 in the model)"),
    ("summary.prediction_ratio", "", "mean CCT / predicted CCT"),
    ("summary.rounds_total", "", "`groups`: `{mean, min, max, stdev, n}` of the runs' total rounds"),
    ("summary.rounds_total.*", "", ""),
    ("summary.correct", "", "every run exact"),
    ("summary.comparison", "", "one row per variant"),
    ("summary.comparison[].label", "", "variant"),
    ("summary.comparison[].cct_s", "s", "its mean CCT"),
    ("summary.comparison[].predicted_cct_s", "s", "its prediction"),
    ("summary.comparison[].efficiency", "", "its efficiency"),
    ("summary.comparison[].cct_ratio_to_first", "", "its mean CCT / the main scheme's"),
]

#: Columns of tables the code defines as lists: one line of meaning per column.
COLUMN_DOCS: dict[str, dict[str, str]] = {
    "transfers": {
        "iteration": "iteration number", "xfer": "the transfer's id in the sender's program",
        "src": "sender", "dst": "receiver", "channel": "connection the transfer uses",
        "flow": "tree or flow it belongs to", "chunk": "chunk number", "phase": "`reduce`, `bcast`, ... (the plan's)",
        "bytes": "payload bytes", "send_start_ns": "sender began sending (ns, coordinator's clock)",
        "send_end_ns": "sender's last byte handed to the socket",
        "send_ts_ns": "the sender's stamp in the DATA header (last hop's for a relayed chunk)",
        "recv_start_ns": "first payload byte read at the receiver", "recv_end_ns": "last payload byte read",
        "apply_ns": "receiver added or copied it in", "route": "empty: direct; else the auxiliary path `src>relay>...>dst`",
    },
    "workers": {
        "go_ns": "GO received", "compute_end_ns": "compute done", "comm_start_ns": "first send or receive",
        "comm_done_ns": "its result complete", "receiver": "it receives the result",
        "correct": "its result exact", "max_abs_err": "largest deviation from the exact sum",
        "digest": "hash of its result",
    },
    "variants.csv": {
        "experiment": "experiment name", "variant": "variant label", "scheme": "scheme name",
        "repetitions": "runs", "cct_mean_s": "mean CCT (s)", "cct_min_s": "fastest run (s)",
        "cct_max_s": "slowest run (s)", "cct_stdev_s": "standard deviation (s)",
        "predicted_cct_s": "cost model (s)", "bound_s": "strict bound (s)",
        "estimate_cct_s": "optimal packing's estimated CCT with delay (s)", "efficiency": "bound / mean CCT",
        "rounds_total_mean": "`groups`: mean total rounds", "correct": "every run exact",
        "error": "why the variant did not run",
    },
    "links.csv": {
        "experiment": "experiment name", "variant": "variant label", "repetition": "repetition",
        "src": "sender", "dst": "receiver", "bytes": "payload bytes", "transfers": "transfers",
        "span_s": "first send to last byte (s)", "goodput_mbps": "payload rate over the span (Mbit/s)",
        "retrans_segs": "TCP segments retransmitted", "rtos": "TCP retransmission timeouts",
        "rto_s": "s in timeout recovery",
    },
}


def _columns() -> dict[str, list[str]]:
    from agents.coordinator import TRANSFER_COLUMNS, WORKER_KEYS
    from testbed.report import LINK_COLUMNS, VARIANT_COLUMNS

    return {"transfers": TRANSFER_COLUMNS, "workers": WORKER_KEYS, "variants.csv": VARIANT_COLUMNS,
            "links.csv": LINK_COLUMNS}


def section_results_fields() -> str:
    rows = [[f"`{p}`", u, m] for p, u, m in RESULTS_FIELDS if m]
    return _table(["field", "unit", "meaning"], rows)


def _section_columns(name: str) -> Callable[[], str]:
    def make() -> str:
        docs = COLUMN_DOCS.get(name, {})
        return _table(["column", "meaning"], [[f"`{c}`", docs.get(c, UNDOCUMENTED)] for c in _columns()[name]])
    return make


def _path_tuple(path: str) -> tuple:
    return tuple(re.sub(r"\[\]$", "", p) + ("[]" if p.endswith("[]") else "") for p in path.split("."))


def results_paths(results: dict) -> set[tuple]:
    """Every field path of a results.json: list entries as ``x[]``, datacenter-name keys as
    ``{dc}``, directed-link keys as ``{link}``."""
    dcs = set()
    topo = (results.get("experiment") or {}).get("topology") or {}
    for d in topo.get("datacenters") or []:
        dcs.add(d["name"] if isinstance(d, dict) else d)
    out: set[tuple] = set()

    def walk(o, prefix: tuple):
        if isinstance(o, dict):
            for k, v in o.items():
                k = "{dc}" if k in dcs else "{link}" if re.fullmatch(r"[^>]+->[^>]+", str(k)) else str(k)
                out.add(prefix + (k,))
                walk(v, prefix + (k,))
        elif isinstance(o, list):
            if prefix:
                prefix = prefix[:-1] + (prefix[-1] + "[]",)
            for v in o[:100]:
                walk(v, prefix)

    walk(results, ())
    return out


def undocumented_results_fields(results: dict) -> list[str]:
    """Field paths of ``results`` that :data:`RESULTS_FIELDS` does not describe."""
    exact, below = set(), set()
    for path, _, _ in RESULTS_FIELDS:
        if path.endswith(".*"):
            below.add(_path_tuple(path[:-2]))
        else:
            exact.add(_path_tuple(path))

    def documented(p: tuple) -> bool:
        if p in exact:
            return True
        return any(p[:len(b)] == b and len(p) > len(b) for b in below) or \
            any(p[:len(b)] == b[:-1] + (b[-1] + "[]",) for b in below)  # "x.*" covers x[]'s fields too

    return sorted(".".join(p) for p in results_paths(results) if not documented(p))


# --------------------------------------------------------------------------- driver

SECTIONS: dict[str, Callable[[], str]] = {
    "cli-verbs": section_cli_verbs,
    "cli": section_cli,
    "benchmarks": section_benchmarks,
    "experiment-keys": section_experiment_keys,
    "schemes-index": section_schemes_index,
    "schemes": section_schemes,
    "topology-format": section_topology_format,
    "topology-generators": section_topology_generators,
    "topology-files": section_topology_files,
    "experiments": section_experiments,
    "results-fields": section_results_fields,
    "transfer-columns": _section_columns("transfers"),
    "worker-columns": _section_columns("workers"),
    "variants-csv": _section_columns("variants.csv"),
    "links-csv": _section_columns("links.csv"),
}


def render(text: str, made: dict[str, str]) -> tuple[str, list[str]]:
    """``text`` with every generated region filled in; the names of the regions found."""
    out, pos, names = [], 0, []
    for m in BEGIN.finditer(text):
        name = m.group(1)
        end = text.find(END.format(name), m.end())
        if end < 0:
            raise SystemExit(f"error: no '{END.format(name)}' after its BEGIN")
        if name not in SECTIONS:
            raise SystemExit(f"error: unknown generated section {name!r} (known: {', '.join(SECTIONS)})")
        if name not in made:
            made[name] = SECTIONS[name]().rstrip() + "\n"
        out += [text[pos:m.end()], made[name]]
        pos, names = end, names + [name]
    return "".join(out) + text[pos:], names


def generate(write: bool) -> list[str]:
    """Fill every generated region of docs/; returns the problems (files that differ from the
    code, with ``write`` False; sections placed nowhere; UNDOCUMENTED entries)."""
    made: dict[str, str] = {}
    problems, used = [], set()
    for f in sorted(DOCS.rglob("*.md")):
        text = f.read_text(encoding="utf-8")
        new, names = render(text, made)
        used.update(names)
        if new != text:
            if write:
                f.write_text(new, encoding="utf-8")
            else:
                problems.append(f"{f.relative_to(REPO)}: generated sections {', '.join(names)} differ from the code")
        for line in "".join(m.group(0) for m in GENERATED.finditer(new)).splitlines():
            if UNDOCUMENTED in line:
                problems.append(f"{f.relative_to(REPO)}: {UNDOCUMENTED} in: {line[:120]}")
    problems += [f"generated section {n!r} is placed in no page" for n in sorted(set(SECTIONS) - used)]
    problems += [f"testbed/docgen.py KEY_DOCS: {k!r} is no experiment key" for k in stale_key_docs()]
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m testbed.docgen", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page differs from the code")
    args = p.parse_args(argv)
    problems = generate(write=not args.check)
    for line in problems:
        print(line, file=sys.stderr)
    if problems and args.check:
        print("run `python3 -m testbed.docgen` and commit docs/", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
