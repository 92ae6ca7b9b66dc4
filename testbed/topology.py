"""Inter-datacenter WAN topology model, loader and validator.

A topology is a set of datacenters (nodes) joined by full-duplex WAN links.  Every
link has two *directions*, each with its own rate, one-way delay, jitter, loss and
sender-side queue, so asymmetric WANs (CREW Sec. V-A, NetStorm's per-direction
fluctuation script) are first-class.  Planners consume :meth:`Topology.graph`, a
``networkx.DiGraph`` with one edge per direction carrying ``rate_mbps`` (Mbit/s) and
``delay_ms`` (one-way, ms) plus ``jitter_ms``, ``loss`` and ``queue_pkts``.

Topology file format (YAML; JSON is accepted too)
=================================================
::

    # every key is optional except datacenters+links, or generator
    name: netstorm-internet2-9          # default: the file's stem ("inline" for mappings)
    source: "citation / provenance"     # free text, carried into results
    scale: 1.0                          # informational: rate multiplier ALREADY applied
                                        # to the rates below (written by to_dict())
    defaults:                           # per-direction link values used where a link
      rate_mbps: 100                    # omits them (scalars only).  Built-in defaults:
      delay_ms: 30                      # delay 0, jitter 0, loss 0, queue 1000 packets;
      jitter_ms: 0                      # rate_mbps has no built-in default.
      loss: 0.0002
      queue_pkts: 1000
    datacenters:                        # names: a letter, then letters/digits/_ (<= 32)
      - h1
      - h2
      - {name: h3, region: us-east, lat: 40.7, lon: -74.0}   # free-form scalar attributes
    links:
      - {between: [h1, h2], rate_mbps: 80}                   # symmetric
      - {between: [h1, h3], rate_mbps: [120, 40], delay_ms: 30}
        # a two-element list [a->b, b->a] gives asymmetric values (any per-direction field)

    # ... or, instead of datacenters + links, a seeded generator (see testbed/topogen.py):
    generator: {kind: mtree-random, n: 20, m: 141, sk: 0.7, seed: 1}
    # With a generator, ``defaults`` and the generator block may also set jitter_ms,
    # loss and queue_pkts for every generated link direction.

Units: rates in Mbit/s (10^6 bit/s), delays and jitter in milliseconds, one-way per
direction (RTT over one link = delay a->b + delay b->a), loss a probability in [0, 1),
queues in packets.  Link list indices in error keys are 0-based (``links[3]`` is the
fourth link).

``load_topology`` also accepts a GraphML/GML file (Internet Topology Zoo), imported with
the ``zoo`` generator's default parameters.  Invalid input raises
:class:`testbed.errors.ConfigError` naming the file and the key path.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Mapping

import networkx as nx
import yaml

from .errors import ConfigError

TOPOLOGY_DIR = Path(__file__).resolve().parent.parent / "topologies"

#: Fewest packets a queue keeps when ``Topology.scaled`` shrinks it (a few TSO bursts).
MIN_SCALED_QUEUE = 16
#: Per-direction link fields, in canonical order.
LINK_FIELDS = ("rate_mbps", "delay_ms", "jitter_ms", "loss", "queue_pkts")
#: Keys allowed at the top level of a topology file.
TOP_LEVEL_KEYS = ("name", "source", "scale", "defaults", "datacenters", "links", "generator")
#: Keys allowed in one entry of ``links``.
LINK_KEYS = ("between",) + LINK_FIELDS
#: File suffixes read as Topology-Zoo graphs rather than YAML.
GRAPH_SUFFIXES = (".graphml", ".gml")
YAML_SUFFIXES = (".yaml", ".yml", ".json")

NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,31}$")


# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class LinkDir:
    """One direction of a WAN link (what the sender side shapes)."""

    rate_mbps: float  # > 0, Mbit/s
    delay_ms: float = 0.0  # one-way propagation delay, >= 0
    jitter_ms: float = 0.0  # >= 0
    loss: float = 0.0  # drop probability in [0, 1)
    queue_pkts: int = 1000  # sender-side queue length in packets, > 0

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in LINK_FIELDS}


@dataclass(frozen=True)
class Link:
    """An undirected WAN link between datacenters ``a`` and ``b``.

    ``ab`` describes the direction a->b, ``ba`` the direction b->a."""

    a: str
    b: str
    ab: LinkDir
    ba: LinkDir

    def dir(self, u: str, v: str) -> LinkDir:
        """The direction u->v of this link."""
        if (u, v) == (self.a, self.b):
            return self.ab
        if (u, v) == (self.b, self.a):
            return self.ba
        raise KeyError(f"link {self.a}-{self.b} does not join {u} and {v}")

    @property
    def symmetric(self) -> bool:
        return self.ab == self.ba


@dataclass
class Topology:
    """A WAN of datacenters.  Build one with :func:`load_topology` or a generator in
    :mod:`testbed.topogen`; :meth:`validate` re-checks a hand-built instance."""

    name: str
    nodes: list[str]  # datacenter names, in file order
    links: list[Link]
    source: str = ""  # citation / provenance
    scale: float = 1.0  # rate multiplier already applied to the links (see scaled())
    node_attrs: dict[str, dict] = field(default_factory=dict)  # region, lat, lon, row, col, ...

    # ---- derived views
    def scaled(self, factor: float) -> "Topology":
        """A copy with every ``rate_mbps`` and ``queue_pkts`` multiplied by ``factor``
        (delays unchanged; queues keep at least MIN_SCALED_QUEUE packets).

        Used to fit big WANs on one emulation host: MTREE's note suggests scaling all
        rates and the data size by the same factor, which keeps transfer times.  The
        queue scales too so that its delay (packets / rate) stays what it was: 1000
        packets at 27 Mbit/s would otherwise hold 450 ms instead of 45 ms at 270 Mbit/s."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (
            math.isfinite(factor) and factor > 0
        ):
            raise ConfigError(f"scale factor must be a positive number, got {factor!r}", key="scale")
        def scale(d: LinkDir) -> LinkDir:
            return replace(d, rate_mbps=d.rate_mbps * factor,
                           queue_pkts=max(MIN_SCALED_QUEUE, round(d.queue_pkts * factor)))

        links = [replace(l, ab=scale(l.ab), ba=scale(l.ba)) for l in self.links]
        return Topology(self.name, list(self.nodes), links, self.source, self.scale * factor,
                        {n: dict(a) for n, a in self.node_attrs.items()})

    def graph(self) -> nx.DiGraph:
        """Directed view: nodes carry ``node_attrs``; each link gives edges u->v and
        v->u with attributes rate_mbps, delay_ms, jitter_ms, loss, queue_pkts."""
        g = nx.DiGraph(name=self.name, scale=self.scale)
        for n in self.nodes:
            g.add_node(n, **self.node_attrs.get(n, {}))
        for l in self.links:
            g.add_edge(l.a, l.b, **l.ab.to_dict())
            g.add_edge(l.b, l.a, **l.ba.to_dict())
        return g

    def link(self, u: str, v: str) -> Link:
        """The link joining u and v, in either orientation."""
        for l in self.links:
            if (l.a, l.b) in ((u, v), (v, u)):
                return l
        for x in (u, v):
            if x not in self.nodes:
                raise KeyError(f"unknown datacenter {x!r} in topology {self.name!r} "
                               f"(known: {describe_names(self.nodes)})")
        raise KeyError(f"no link between {u!r} and {v!r} in topology {self.name!r}")

    def linkdir(self, u: str, v: str) -> LinkDir:
        """The direction u->v of the link joining u and v."""
        return self.link(u, v).dir(u, v)

    def neighbors(self, u: str) -> list[str]:
        """Datacenters directly linked to ``u``, in link order."""
        return [l.b if l.a == u else l.a for l in self.links if u in (l.a, l.b)]

    def is_connected(self) -> bool:
        g = nx.Graph()
        g.add_nodes_from(self.nodes)
        g.add_edges_from((l.a, l.b) for l in self.links)
        return len(self.nodes) > 0 and nx.is_connected(g)

    def summary(self) -> str:
        rates = [d.rate_mbps for l in self.links for d in (l.ab, l.ba)]
        delays = [d.delay_ms for l in self.links for d in (l.ab, l.ba)]
        s = f"{self.name}: {len(self.nodes)} datacenters, {len(self.links)} links"
        if rates:
            s += (f", rate {min(rates):g}-{max(rates):g} Mbit/s,"
                  f" delay {min(delays):g}-{max(delays):g} ms")
        return s

    def to_dict(self) -> dict:
        """JSON-able mapping in the file format; ``load_topology(t.to_dict())`` gives
        back an equal topology.  Every link lists all fields explicitly."""
        dcs: list[Any] = []
        for n in self.nodes:
            attrs = self.node_attrs.get(n) or {}
            dcs.append({"name": n, **attrs} if attrs else n)
        links = []
        for l in self.links:
            d: dict[str, Any] = {"between": [l.a, l.b]}
            for f in LINK_FIELDS:
                x, y = getattr(l.ab, f), getattr(l.ba, f)
                d[f] = x if x == y else [x, y]
            links.append(d)
        return {"name": self.name, "source": self.source, "scale": self.scale,
                "datacenters": dcs, "links": links}

    def validate(self, *, source: str = "", key: str = "") -> "Topology":
        """Check names, endpoints, duplicates and value ranges of a hand-built
        topology (the loader does the same checks while parsing).  Returns self."""
        _check_nodes(self.nodes, self.node_attrs, source=source, key=key)
        seen: dict[frozenset, int] = {}
        known = set(self.nodes)
        for i, l in enumerate(self.links):
            k = _k(key, f"links[{i}]")
            _check_endpoints(l.a, l.b, known, self.nodes, seen, i, source=source, key=k)
            for f in LINK_FIELDS:
                for j, d in enumerate((l.ab, l.ba)):
                    _check_field(f, getattr(d, f), source=source, key=_k(k, f"{f}[{j}]"))
        return self


def validate_connected(topo: Topology, *, source: str = "", key: str = "topology") -> None:
    """Raise ConfigError unless every datacenter can reach every other one.

    The loader accepts disconnected WANs; schemes that need a spanning structure
    (trees, rings, all-reduce in general) call this."""
    if not topo.nodes:
        raise ConfigError("empty topology: at least one datacenter is required", source=source, key=key)
    if topo.is_connected():
        return
    g = nx.Graph()
    g.add_nodes_from(topo.nodes)
    g.add_edges_from((l.a, l.b) for l in topo.links)
    order = {n: i for i, n in enumerate(topo.nodes)}
    comps = sorted((sorted(c, key=order.get) for c in nx.connected_components(g)),
                   key=lambda c: order[c[0]])
    shown = " | ".join("{" + describe_names(c) + "}" for c in comps[:5])
    more = f" | ... ({len(comps)} components in total)" if len(comps) > 5 else ""
    raise ConfigError(
        f"topology {topo.name!r} is not connected: {len(comps)} components {shown}{more}; "
        "expected every datacenter to reach every other one",
        source=source, key=key)


# --------------------------------------------------------------------------- helpers


def describe_names(names: Iterable[str], limit: int = 12) -> str:
    """Compact list for error messages: 'h1..h9' for a numbered run, else a comma list."""
    names = list(names)
    if not names:
        return "none"
    m = [re.fullmatch(r"(.*?)(\d+)", n) for n in names]
    if len(names) >= 3 and all(m):
        prefixes = {x.group(1) for x in m}  # type: ignore[union-attr]
        nums = [int(x.group(2)) for x in m]  # type: ignore[union-attr]
        if len(prefixes) == 1 and nums == list(range(nums[0], nums[0] + len(nums))) and all(
            str(v) == x.group(2) for v, x in zip(nums, m)  # type: ignore[union-attr]
        ):
            p = prefixes.pop()
            return f"{p}{nums[0]}..{p}{nums[-1]}"
    if len(names) > limit:
        return ", ".join(names[:limit]) + f", ... ({len(names)} in total)"
    return ", ".join(names)


def _k(prefix: str, sub: str) -> str:
    """Join key paths: _k('topology', 'links[2]') -> 'topology.links[2]'."""
    if not prefix:
        return sub
    if not sub:
        return prefix
    return prefix + sub if sub.startswith("[") else f"{prefix}.{sub}"


def _typename(x: Any) -> str:
    if x is None:
        return "null"
    if isinstance(x, bool):
        return f"boolean {x!r}".lower()
    if isinstance(x, str):
        return f"string {x!r}"
    if isinstance(x, Mapping):
        return "a mapping"
    if isinstance(x, (list, tuple)):
        return "a list"
    return f"{type(x).__name__} {x!r}"


def _unknown_key_msg(what: str, k: Any, allowed: Iterable[str]) -> str:
    allowed = list(allowed)
    hint = difflib.get_close_matches(str(k), allowed, n=1)
    did = f"; did you mean {hint[0]!r}?" if hint else ""
    return f"unknown key {k!r} in {what} (expected one of: {', '.join(allowed)}){did}"


def check_number(x: Any, *, source: str = "", key: str = "", integer: bool = False,
                 minimum: float | None = None, min_open: bool = False,
                 maximum: float | None = None, max_open: bool = False,
                 what: str = "") -> float | int:
    """Validate a YAML scalar as a finite number (bools and strings rejected) in an
    optionally open/closed range; returns it (as int if ``integer``).  Shared with the
    generators so every parameter error reads the same way."""
    kind = "an integer" if integer else "a number"
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ConfigError(f"expected {what or kind}, got {_typename(x)}", source=source, key=key)
    if not math.isfinite(x):
        raise ConfigError(f"expected a finite number, got {x!r}", source=source, key=key)
    if integer:
        if isinstance(x, float) and not x.is_integer():
            raise ConfigError(f"expected an integer, got {x!r}", source=source, key=key)
        x = int(x)
    lo_bad = minimum is not None and (x <= minimum if min_open else x < minimum)
    hi_bad = maximum is not None and (x >= maximum if max_open else x > maximum)
    if lo_bad or hi_bad:
        lo = "" if minimum is None else ("(" if min_open else "[") + f"{minimum:g}"
        hi = "" if maximum is None else f"{maximum:g}" + (")" if max_open else "]")
        if minimum is not None and maximum is not None:
            rng = f"in {lo}, {hi}"
        elif minimum is not None:
            rng = f"{'>' if min_open else '>='} {minimum:g}"
        else:
            rng = f"{'<' if max_open else '<='} {maximum:g}"
        raise ConfigError(f"expected {what or kind} {rng}, got {x!r}", source=source, key=key)
    return x


_FIELD_RULES: dict[str, dict] = {
    "rate_mbps": dict(minimum=0, min_open=True, what="a rate in Mbit/s"),
    "delay_ms": dict(minimum=0, what="a delay in ms"),
    "jitter_ms": dict(minimum=0, what="a jitter in ms"),
    "loss": dict(minimum=0, maximum=1, max_open=True, what="a loss probability"),
    "queue_pkts": dict(integer=True, minimum=0, min_open=True, what="a queue length in packets (integer)"),
}


def _check_field(f: str, x: Any, *, source: str, key: str) -> float | int:
    v = check_number(x, source=source, key=key, **_FIELD_RULES[f])
    return int(v) if f == "queue_pkts" else float(v)


def _check_name(n: Any, *, source: str, key: str) -> str:
    if not isinstance(n, str):
        raise ConfigError(f"expected a datacenter name (string), got {_typename(n)}"
                          + ("; quote it in YAML" if isinstance(n, (bool, int, float)) else ""),
                          source=source, key=key)
    if not NAME_RE.match(n):
        raise ConfigError(f"invalid datacenter name {n!r}: expected a letter followed by up to 31 "
                          "letters, digits or '_'", source=source, key=key)
    return n


def _check_attrs(name: str, attrs: Mapping, *, source: str, key: str) -> dict:
    out = {}
    for ak, av in attrs.items():
        if not isinstance(ak, str):
            raise ConfigError(f"attribute names must be strings, got {_typename(ak)}", source=source, key=key)
        kk = _k(key, ak)
        if av is not None and not isinstance(av, (str, int, float, bool)):
            raise ConfigError(f"expected a scalar attribute value, got {_typename(av)}", source=source, key=kk)
        if ak == "lat":
            av = check_number(av, source=source, key=kk, minimum=-90, maximum=90, what="a latitude")
        elif ak == "lon":
            av = check_number(av, source=source, key=kk, minimum=-180, maximum=180, what="a longitude")
        elif ak in ("row", "col"):
            av = check_number(av, source=source, key=kk, integer=True, minimum=0, what="a grid index")
        elif ak == "switch" and not isinstance(av, bool):  # a relay, not a worker (MultiTree Sec. III-C 3)
            raise ConfigError(f"expected true or false, got {_typename(av)}", source=source, key=kk)
        out[ak] = av
    return out


def _check_nodes(nodes: list, attrs: Mapping, *, source: str, key: str) -> None:
    if not nodes:
        raise ConfigError("empty topology: at least one datacenter is required",
                          source=source, key=_k(key, "datacenters"))
    first: dict[str, int] = {}
    for i, n in enumerate(nodes):
        k = _k(key, f"datacenters[{i}]")
        _check_name(n, source=source, key=k)
        if n in first:
            raise ConfigError(f"duplicate datacenter name {n!r} (first at datacenters[{first[n]}])",
                              source=source, key=k)
        first[n] = i
    for n, a in attrs.items():
        if n not in first:
            raise ConfigError(f"attributes given for unknown datacenter {n!r}", source=source,
                              key=_k(key, "node_attrs"))
        _check_attrs(n, a, source=source, key=_k(key, f"datacenters[{first[n]}]"))


def _check_endpoints(a: Any, b: Any, known: set, nodes: list, seen: dict, i: int,
                     *, source: str, key: str) -> None:
    for j, x in enumerate((a, b)):
        kk = _k(key, f"between[{j}]")
        if not isinstance(x, str):
            raise ConfigError(f"expected a datacenter name, got {_typename(x)}", source=source, key=kk)
        if x not in known:
            raise ConfigError(f"unknown datacenter {x!r} (known: {describe_names(nodes)})",
                              source=source, key=kk)
    if a == b:
        raise ConfigError(f"self-loop: link joins {a!r} to itself", source=source, key=_k(key, "between"))
    pair = frozenset((a, b))
    if pair in seen:
        raise ConfigError(f"duplicate link {a}-{b} (already defined at links[{seen[pair]}])",
                          source=source, key=_k(key, "between"))
    seen[pair] = i


# --------------------------------------------------------------------------- YAML


class _Loader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate mapping keys and reads '2e-4' as a float
    (YAML 1.1 would read exponent-without-dot numbers as strings)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False):
    loader.flatten_mapping(node)
    seen = set()
    for key_node, _ in node.value:
        k = loader.construct_object(key_node, deep=deep)
        try:
            dup = k in seen
            seen.add(k)
        except TypeError:
            continue
        if dup:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {k!r}", key_node.start_mark)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_Loader.add_constructor("tag:yaml.org,2002:map", _construct_mapping)


def read_yaml(path: Path, *, source: str) -> Any:
    """Parse a YAML file, turning I/O and syntax errors into ConfigError."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read file: {e.strerror or e}", source=source) from None
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"invalid YAML: {e.problem or e.context}{where}", source=source) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"invalid YAML: {e}", source=source) from None


# --------------------------------------------------------------------------- loading


def list_topologies() -> list[str]:
    """Names of the topology files shipped in ``topologies/``."""
    if not TOPOLOGY_DIR.is_dir():
        return []
    return sorted(p.stem for p in TOPOLOGY_DIR.iterdir()
                  if p.suffix in (".yaml", ".yml") and not p.name.startswith("."))


def _display(path: Path) -> str:
    """Path as shown in error messages: relative to cwd when below it."""
    try:
        rel = os.path.relpath(path)
        return path.as_posix() if rel.startswith("..") else Path(rel).as_posix()
    except ValueError:
        return str(path)


def _resolve_ref(ref: str, *, source: str, key: str) -> Path:
    p = Path(ref).expanduser()
    looks_like_path = p.suffix.lower() in YAML_SUFFIXES + GRAPH_SUFFIXES or "/" in ref or os.sep in ref
    candidates = [p]
    if not p.is_absolute() and source and source != "<inline>":
        candidates.append(Path(source).parent / p)
    if looks_like_path:
        for c in candidates:
            if c.is_file():
                return c
        raise ConfigError(f"topology file not found: {ref!r}", source=source, key=key)
    for suf in (".yaml", ".yml"):
        c = TOPOLOGY_DIR / f"{ref}{suf}"
        if c.is_file():
            return c
    for c in candidates:
        if c.is_file():
            return c
    avail = list_topologies()
    hint = difflib.get_close_matches(ref, avail, n=1)
    did = f"; did you mean {hint[0]!r}?" if hint else ""
    raise ConfigError(f"unknown topology {ref!r} (available: {', '.join(avail) or 'none'}; "
                      f"or give a path to a .yaml/.graphml/.gml file){did}", source=source, key=key)


def load_topology(ref: Any, *, source: str = "<inline>", key: str = "topology") -> Topology:
    """Load a topology from ``ref``:

    * a :class:`Topology` (returned unchanged);
    * a name of a file in ``topologies/`` (``"netstorm-internet2-9"``);
    * a path to a ``.yaml``/``.yml``/``.json`` file in the format above, or to a
      ``.graphml``/``.gml`` Topology-Zoo file (relative paths are tried against the
      working directory, then against the directory of ``source``);
    * an inline mapping in the file format (e.g. the ``topology:`` block of an
      experiment file).

    ``source`` and ``key`` locate ``ref`` itself in the calling document: errors in an
    inline mapping are reported as ``source: key.links[3].rate_mbps``; errors inside a
    referenced file name that file and the key inside it.
    """
    if isinstance(ref, Topology):
        return ref
    if isinstance(ref, Mapping):
        base = Path(source).parent if source and source != "<inline>" else Path.cwd()
        return _from_mapping(ref, source=source, prefix=key, base_dir=base, default_name="inline")
    if isinstance(ref, (str, os.PathLike)) and str(ref).strip():
        path = _resolve_ref(str(ref), source=source, key=key)
        shown = _display(path)
        if path.suffix.lower() in GRAPH_SUFFIXES:
            from . import topogen

            try:
                return topogen.zoo(path=str(path))
            except ConfigError as e:
                raise ConfigError(e.message, source=shown, key="" if e.key == "path" else e.key) from None
        data = read_yaml(path, source=shown)
        return _from_mapping(data, source=shown, prefix="", base_dir=path.parent, default_name=path.stem)
    raise ConfigError(f"expected a topology name, a file path or a mapping, got {_typename(ref)}",
                      source=source, key=key)


def _per_dir(f: str, x: Any, *, source: str, key: str) -> tuple[Any, Any]:
    """A link field: scalar (both directions) or [a->b, b->a]."""
    if isinstance(x, (list, tuple)):
        if len(x) != 2:
            raise ConfigError(f"expected a number or a list [a->b, b->a] of two numbers, "
                              f"got a list of {len(x)}", source=source, key=key)
        return (_check_field(f, x[0], source=source, key=_k(key, "[0]")),
                _check_field(f, x[1], source=source, key=_k(key, "[1]")))
    v = _check_field(f, x, source=source, key=key)
    return v, v


def _from_mapping(data: Any, *, source: str, prefix: str, base_dir: Path, default_name: str) -> Topology:
    if data is None:
        raise ConfigError("empty topology: expected a mapping with 'datacenters' and 'links' "
                          "or 'generator'", source=source, key=prefix)
    if not isinstance(data, Mapping):
        raise ConfigError(f"expected a mapping with 'datacenters' and 'links' or 'generator', "
                          f"got {_typename(data)}", source=source, key=prefix)
    for k in data:
        if k not in TOP_LEVEL_KEYS:
            raise ConfigError(_unknown_key_msg("topology", k, TOP_LEVEL_KEYS), source=source,
                              key=_k(prefix, str(k)))

    def s(k: str, default: str) -> str:
        v = data.get(k, default)
        if v is None:
            return default
        if not isinstance(v, str):
            raise ConfigError(f"expected a string, got {_typename(v)}", source=source, key=_k(prefix, k))
        return v

    name = s("name", default_name)
    if not name.strip():
        raise ConfigError("expected a non-empty name", source=source, key=_k(prefix, "name"))
    src = s("source", "")
    scale = 1.0
    if "scale" in data:
        scale = float(check_number(data["scale"], source=source, key=_k(prefix, "scale"),
                                   minimum=0, min_open=True, what="a positive scale factor"))

    # defaults
    defaults: dict[str, Any] = {}
    dk = _k(prefix, "defaults")
    if data.get("defaults") is not None:
        d = data["defaults"]
        if not isinstance(d, Mapping):
            raise ConfigError(f"expected a mapping of link fields, got {_typename(d)}", source=source, key=dk)
        for f, v in d.items():
            if f not in LINK_FIELDS:
                raise ConfigError(_unknown_key_msg("defaults", f, LINK_FIELDS), source=source, key=_k(dk, str(f)))
            defaults[f] = _check_field(f, v, source=source, key=_k(dk, f))

    if "generator" in data:
        for k in ("datacenters", "links"):
            if k in data:
                raise ConfigError(f"'{k}' cannot be combined with 'generator' (give one or the other)",
                                  source=source, key=_k(prefix, k))
        for f in ("rate_mbps", "delay_ms"):
            if f in defaults:
                raise ConfigError(f"defaults.{f} is not used with a generator; set the generator's own "
                                  "rate/delay parameters instead", source=source, key=_k(dk, f))
        from . import topogen

        topo = topogen.build(data["generator"], source=source, key=_k(prefix, "generator"),
                             base_dir=base_dir, link_defaults=defaults)
        if "name" in data or default_name != "inline":
            topo.name = name  # a file's stem names it unless the generator block is inline
        if "source" in data:
            topo.source = src
        topo.scale = scale
        return topo

    if "datacenters" not in data:
        raise ConfigError("missing 'datacenters' (or give a 'generator')", source=source,
                          key=_k(prefix, "datacenters"))
    nodes, attrs = _parse_datacenters(data["datacenters"], source=source, key=_k(prefix, "datacenters"))
    links = _parse_links(data.get("links"), nodes, defaults, source=source, key=_k(prefix, "links"))
    return Topology(name=name, nodes=nodes, links=links, source=src, scale=scale, node_attrs=attrs)


def _parse_datacenters(raw: Any, *, source: str, key: str) -> tuple[list[str], dict[str, dict]]:
    if raw is None or (isinstance(raw, (list, tuple)) and not raw):
        raise ConfigError("empty topology: at least one datacenter is required", source=source, key=key)
    if not isinstance(raw, (list, tuple)):
        raise ConfigError(f"expected a list of datacenter names or mappings, got {_typename(raw)}",
                          source=source, key=key)
    nodes: list[str] = []
    attrs: dict[str, dict] = {}
    first: dict[str, int] = {}
    for i, e in enumerate(raw):
        k = _k(key, f"[{i}]")
        if isinstance(e, Mapping):
            if "name" not in e:
                raise ConfigError("missing 'name' in datacenter mapping", source=source, key=k)
            n = _check_name(e["name"], source=source, key=_k(k, "name"))
            a = _check_attrs(n, {ak: av for ak, av in e.items() if ak != "name"}, source=source, key=k)
        else:
            n = _check_name(e, source=source, key=k)
            a = {}
        if n in first:
            raise ConfigError(f"duplicate datacenter name {n!r} (first at datacenters[{first[n]}])",
                              source=source, key=k)
        first[n] = i
        nodes.append(n)
        if a:
            attrs[n] = a
    return nodes, attrs


def _parse_links(raw: Any, nodes: list[str], defaults: Mapping, *, source: str, key: str) -> list[Link]:
    if raw is None:
        return []
    if not isinstance(raw, (list, tuple)):
        raise ConfigError(f"expected a list of links, got {_typename(raw)}", source=source, key=key)
    known = set(nodes)
    seen: dict[frozenset, int] = {}
    links: list[Link] = []
    for i, e in enumerate(raw):
        k = _k(key, f"[{i}]")
        if not isinstance(e, Mapping):
            raise ConfigError(f"expected a link mapping like {{between: [a, b], rate_mbps: 100}}, "
                              f"got {_typename(e)}", source=source, key=k)
        for lk in e:
            if lk not in LINK_KEYS:
                raise ConfigError(_unknown_key_msg("link", lk, LINK_KEYS), source=source, key=_k(k, str(lk)))
        if "between" not in e:
            raise ConfigError("missing 'between' (expected between: [a, b])", source=source, key=_k(k, "between"))
        bt = e["between"]
        if not isinstance(bt, (list, tuple)) or len(bt) != 2:
            raise ConfigError(f"expected a list of two datacenter names, got {_typename(bt)}"
                              + (f" of {len(bt)}" if isinstance(bt, (list, tuple)) else ""),
                              source=source, key=_k(k, "between"))
        a, b = bt
        _check_endpoints(a, b, known, nodes, seen, i, source=source, key=k)
        ab: dict[str, Any] = {}
        ba: dict[str, Any] = {}
        for f in LINK_FIELDS:
            if f in e:
                ab[f], ba[f] = _per_dir(f, e[f], source=source, key=_k(k, f))
            elif f in defaults:
                ab[f] = ba[f] = defaults[f]
        if "rate_mbps" not in ab:
            raise ConfigError("missing 'rate_mbps' (and no defaults.rate_mbps)", source=source,
                              key=_k(k, "rate_mbps"))
        links.append(Link(a, b, LinkDir(**ab), LinkDir(**ba)))
    return links
