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
      delay_ms: 30                      # delay 0, jitter 0 (normal), loss 0, queue 1000
      jitter_ms: 0                      # packets; rate_mbps has no built-in default.
      distribution: normal              # the jitter's shape: normal|uniform|pareto|paretonormal
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
    # distribution, loss and queue_pkts for every generated link direction.

Units: rates in Mbit/s (10^6 bit/s), delays and jitter in milliseconds, one-way per
direction (RTT over one link = delay a->b + delay b->a); ``delay_ms`` is the mean of a
direction's one-way delay and ``jitter_ms`` its standard deviation, drawn from
``distribution`` per packet, FIFO order kept (:mod:`testbed.emulator.jitter`); loss a probability in [0, 1),
queues in packets.  Link list indices in error keys are 0-based (``links[3]`` is the
fourth link).

``load_topology`` also accepts a GraphML/GML file (Internet Topology Zoo), imported with
the ``zoo`` generator's default parameters.  Invalid input raises
:class:`testbed.errors.ConfigError` naming the file and the key path.
"""


from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any, Mapping

import yaml

from testbed import topogen
from testbed.checks import check_number, describe_names, key_path, typename, unknown_key_msg
from testbed.errors import ConfigError
from testbed.wan import (
    LINK_FIELDS,
    MIN_SCALED_QUEUE,
    NAME_RE,
    Link,
    LinkDir,
    Topology,
    check_attrs,
    check_endpoints,
    check_link_field,
    check_name,
    validate_connected,
)

__all__ = ["LINK_FIELDS", "MIN_SCALED_QUEUE", "NAME_RE", "Link", "LinkDir", "Topology", "describe_names",
           "list_topologies", "load_topology", "read_yaml", "validate_connected", "TOPOLOGY_DIR"]

TOPOLOGY_DIR = Path(__file__).resolve().parent.parent / "topologies"

#: Keys allowed at the top level of a topology file.
TOP_LEVEL_KEYS = ("name", "source", "scale", "defaults", "datacenters", "links", "generator")
#: Keys allowed in one entry of ``links``.
LINK_KEYS = ("between",) + LINK_FIELDS
#: File suffixes read as Topology-Zoo graphs rather than YAML.
GRAPH_SUFFIXES = (".graphml", ".gml")
YAML_SUFFIXES = (".yaml", ".yml", ".json")




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
            try:
                return topogen.zoo(path=str(path))
            except ConfigError as e:
                raise ConfigError(e.message, source=shown, key="" if e.key == "path" else e.key) from None
        data = read_yaml(path, source=shown)
        return _from_mapping(data, source=shown, prefix="", base_dir=path.parent, default_name=path.stem)
    raise ConfigError(f"expected a topology name, a file path or a mapping, got {typename(ref)}",
                      source=source, key=key)


def _per_dir(f: str, x: Any, *, source: str, key: str) -> tuple[Any, Any]:
    """A link field: scalar (both directions) or [a->b, b->a]."""
    if isinstance(x, (list, tuple)):
        if len(x) != 2:
            raise ConfigError(f"expected a {'name' if f == 'distribution' else 'number'} or a list [a->b, b->a] of two, "
                              f"got a list of {len(x)}", source=source, key=key)
        return (check_link_field(f, x[0], source=source, key=key_path(key, "[0]")),
                check_link_field(f, x[1], source=source, key=key_path(key, "[1]")))
    v = check_link_field(f, x, source=source, key=key)
    return v, v


def _from_mapping(data: Any, *, source: str, prefix: str, base_dir: Path, default_name: str) -> Topology:
    _check_top_level(data, source=source, prefix=prefix)
    name = _string_field(data, "name", default_name, source=source, prefix=prefix)
    if not name.strip():
        raise ConfigError("expected a non-empty name", source=source, key=key_path(prefix, "name"))
    src = _string_field(data, "source", "", source=source, prefix=prefix)
    scale = 1.0
    if "scale" in data:
        scale = float(check_number(data["scale"], source=source, key=key_path(prefix, "scale"),
                                   minimum=0, min_open=True, what="a positive scale factor"))
    defaults = _parse_defaults(data.get("defaults"), source=source, key=key_path(prefix, "defaults"))
    if "generator" in data:
        topo = _from_generator(data, defaults, source=source, prefix=prefix, base_dir=base_dir)
        if "name" in data or default_name != "inline":
            topo.name = name  # a file's stem names it unless the generator block is inline
        if "source" in data:
            topo.source = src
        topo.scale = scale
        return topo

    if "datacenters" not in data:
        raise ConfigError("missing 'datacenters' (or give a 'generator')", source=source,
                          key=key_path(prefix, "datacenters"))
    nodes, attrs = _parse_datacenters(data["datacenters"], source=source, key=key_path(prefix, "datacenters"))
    links = _parse_links(data.get("links"), nodes, defaults, source=source, key=key_path(prefix, "links"))
    return Topology(name=name, nodes=nodes, links=links, source=src, scale=scale, node_attrs=attrs)


def _check_top_level(data: Any, *, source: str, prefix: str) -> None:
    """A topology is a mapping of known top-level keys."""
    if data is None:
        raise ConfigError("empty topology: expected a mapping with 'datacenters' and 'links' "
                          "or 'generator'", source=source, key=prefix)
    if not isinstance(data, Mapping):
        raise ConfigError(f"expected a mapping with 'datacenters' and 'links' or 'generator', "
                          f"got {typename(data)}", source=source, key=prefix)
    for k in data:
        if k not in TOP_LEVEL_KEYS:
            raise ConfigError(unknown_key_msg("topology", k, TOP_LEVEL_KEYS), source=source,
                              key=key_path(prefix, str(k)))


def _string_field(data: Mapping, k: str, default: str, *, source: str, prefix: str) -> str:
    """The string at key ``k`` (``default`` when absent or null)."""
    v = data.get(k, default)
    if v is None:
        return default
    if not isinstance(v, str):
        raise ConfigError(f"expected a string, got {typename(v)}", source=source, key=key_path(prefix, k))
    return v


def _parse_defaults(d: Any, *, source: str, key: str) -> dict[str, Any]:
    """The ``defaults`` block: link fields every link (or generated direction) starts from."""
    defaults: dict[str, Any] = {}
    if d is not None:
        if not isinstance(d, Mapping):
            raise ConfigError(f"expected a mapping of link fields, got {typename(d)}", source=source, key=key)
        for f, v in d.items():
            if f not in LINK_FIELDS:
                raise ConfigError(unknown_key_msg("defaults", f, LINK_FIELDS), source=source, key=key_path(key, str(f)))
            defaults[f] = check_link_field(f, v, source=source, key=key_path(key, f))
    return defaults


def _from_generator(data: Mapping, defaults: dict[str, Any], *, source: str, prefix: str, base_dir: Path
                    ) -> Topology:
    """The topology of a ``generator`` block (:func:`topogen.build`), which excludes
    ``datacenters``, ``links`` and default rates and delays."""
    for k in ("datacenters", "links"):
        if k in data:
            raise ConfigError(f"'{k}' cannot be combined with 'generator' (give one or the other)",
                              source=source, key=key_path(prefix, k))
    dk = key_path(prefix, "defaults")
    for f in ("rate_mbps", "delay_ms"):
        if f in defaults:
            raise ConfigError(f"defaults.{f} is not used with a generator; set the generator's own "
                              "rate/delay parameters instead", source=source, key=key_path(dk, f))
    return topogen.build(data["generator"], source=source, key=key_path(prefix, "generator"),
                         base_dir=base_dir, link_defaults=defaults)


def _parse_datacenters(raw: Any, *, source: str, key: str) -> tuple[list[str], dict[str, dict]]:
    if raw is None or (isinstance(raw, (list, tuple)) and not raw):
        raise ConfigError("empty topology: at least one datacenter is required", source=source, key=key)
    if not isinstance(raw, (list, tuple)):
        raise ConfigError(f"expected a list of datacenter names or mappings, got {typename(raw)}",
                          source=source, key=key)
    nodes: list[str] = []
    attrs: dict[str, dict] = {}
    first: dict[str, int] = {}
    for i, e in enumerate(raw):
        k = key_path(key, f"[{i}]")
        if isinstance(e, Mapping):
            if "name" not in e:
                raise ConfigError("missing 'name' in datacenter mapping", source=source, key=k)
            n = check_name(e["name"], source=source, key=key_path(k, "name"))
            a = check_attrs(n, {ak: av for ak, av in e.items() if ak != "name"}, source=source, key=k)
        else:
            n = check_name(e, source=source, key=k)
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
        raise ConfigError(f"expected a list of links, got {typename(raw)}", source=source, key=key)
    known = set(nodes)
    seen: dict[frozenset, int] = {}
    links: list[Link] = []
    for i, e in enumerate(raw):
        k = key_path(key, f"[{i}]")
        if not isinstance(e, Mapping):
            raise ConfigError(f"expected a link mapping like {{between: [a, b], rate_mbps: 100}}, "
                              f"got {typename(e)}", source=source, key=k)
        for lk in e:
            if lk not in LINK_KEYS:
                raise ConfigError(unknown_key_msg("link", lk, LINK_KEYS), source=source, key=key_path(k, str(lk)))
        if "between" not in e:
            raise ConfigError("missing 'between' (expected between: [a, b])", source=source, key=key_path(k, "between"))
        bt = e["between"]
        if not isinstance(bt, (list, tuple)) or len(bt) != 2:
            raise ConfigError(f"expected a list of two datacenter names, got {typename(bt)}"
                              + (f" of {len(bt)}" if isinstance(bt, (list, tuple)) else ""),
                              source=source, key=key_path(k, "between"))
        a, b = bt
        check_endpoints(a, b, known, nodes, seen, i, source=source, key=k)
        ab: dict[str, Any] = {}
        ba: dict[str, Any] = {}
        for f in LINK_FIELDS:
            if f in e:
                ab[f], ba[f] = _per_dir(f, e[f], source=source, key=key_path(k, f))
            elif f in defaults:
                ab[f] = ba[f] = defaults[f]
        if "rate_mbps" not in ab:
            raise ConfigError("missing 'rate_mbps' (and no defaults.rate_mbps)", source=source,
                              key=key_path(k, "rate_mbps"))
        links.append(Link(a, b, LinkDir(**ab), LinkDir(**ba)))
    return links
