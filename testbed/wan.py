"""The WAN model: datacenters joined by full-duplex links with per-direction rate, delay,
jitter, loss and queue (:class:`Topology`, :class:`Link`, :class:`LinkDir`) and the checks
of its values.  Loading files lives in :mod:`testbed.topology`, generators in
:mod:`testbed.topogen`; both build these classes."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import networkx as nx

from testbed.checks import check_number, describe_names, key_path, typename
from testbed.errors import ConfigError

#: Fewest packets a queue keeps when ``Topology.scaled`` shrinks it (a few TSO bursts).
MIN_SCALED_QUEUE = 16
#: Per-direction link fields, in canonical order.
LINK_FIELDS = ("rate_mbps", "delay_ms", "jitter_ms", "distribution", "loss", "queue_pkts")
#: Shapes of the jitter (netem's; testbed.emulator.jitter defines what each packet gets).
DISTRIBUTIONS = ("normal", "uniform", "pareto", "paretonormal")
DEFAULT_DISTRIBUTION = "normal"

NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,31}$")


@dataclass(frozen=True)
class LinkDir:
    """One direction of a WAN link (what the sender side shapes)."""

    rate_mbps: float  # > 0, Mbit/s
    delay_ms: float = 0.0  # mean one-way delay, >= 0
    jitter_ms: float = 0.0  # standard deviation of the one-way delay, >= 0 (testbed.emulator.jitter)
    loss: float = 0.0  # drop probability in [0, 1)
    queue_pkts: int = 1000  # sender-side queue length in packets, > 0
    distribution: str = DEFAULT_DISTRIBUTION  # the jitter's shape, one of DISTRIBUTIONS

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

    def with_rates(self, rates: dict[tuple[str, str], float]) -> "Topology":
        """A copy whose directions (src, dst) in ``rates`` have that ``rate_mbps`` (the rest
        unchanged): the network at some point of its dynamics (``plan --at-s``)."""
        def at(d: LinkDir, src: str, dst: str) -> LinkDir:
            return replace(d, rate_mbps=rates.get((src, dst), d.rate_mbps))

        links = [replace(l, ab=at(l.ab, l.a, l.b), ba=at(l.ba, l.b, l.a)) for l in self.links]
        return replace(self, links=links)

    def graph(self) -> nx.DiGraph:
        """Directed view: nodes carry ``node_attrs``; each link gives edges u->v and
        v->u with attributes rate_mbps, delay_ms, jitter_ms, distribution, loss, queue_pkts."""
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
        check_nodes(self.nodes, self.node_attrs, source=source, key=key)
        seen: dict[frozenset, int] = {}
        known = set(self.nodes)
        for i, l in enumerate(self.links):
            k = key_path(key, f"links[{i}]")
            check_endpoints(l.a, l.b, known, self.nodes, seen, i, source=source, key=k)
            for f in LINK_FIELDS:
                for j, d in enumerate((l.ab, l.ba)):
                    check_link_field(f, getattr(d, f), source=source, key=key_path(k, f"{f}[{j}]"))
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


# --------------------------------------------------------------------------- checks


_FIELD_RULES: dict[str, dict] = {
    "rate_mbps": dict(minimum=0, min_open=True, what="a rate in Mbit/s"),
    "delay_ms": dict(minimum=0, what="a delay in ms"),
    "jitter_ms": dict(minimum=0, what="a jitter in ms"),
    "loss": dict(minimum=0, maximum=1, max_open=True, what="a loss probability"),
    "queue_pkts": dict(integer=True, minimum=0, min_open=True, what="a queue length in packets (integer)"),
}


def check_link_field(f: str, x: Any, *, source: str, key: str) -> float | int | str:
    if f == "distribution":
        if not isinstance(x, str) or x not in DISTRIBUTIONS:
            raise ConfigError(f"expected a jitter distribution, one of {', '.join(DISTRIBUTIONS)}; got "
                              + (repr(x) if isinstance(x, str) else typename(x)), source=source, key=key)
        return x
    v = check_number(x, source=source, key=key, **_FIELD_RULES[f])
    return int(v) if f == "queue_pkts" else float(v)


def check_name(n: Any, *, source: str, key: str) -> str:
    if not isinstance(n, str):
        raise ConfigError(f"expected a datacenter name (string), got {typename(n)}"
                          + ("; quote it in YAML" if isinstance(n, (bool, int, float)) else ""),
                          source=source, key=key)
    if not NAME_RE.match(n):
        raise ConfigError(f"invalid datacenter name {n!r}: expected a letter followed by up to 31 "
                          "letters, digits or '_'", source=source, key=key)
    return n


def check_attrs(name: str, attrs: Mapping, *, source: str, key: str) -> dict:
    out = {}
    for ak, av in attrs.items():
        if not isinstance(ak, str):
            raise ConfigError(f"attribute names must be strings, got {typename(ak)}", source=source, key=key)
        kk = key_path(key, ak)
        if av is not None and not isinstance(av, (str, int, float, bool)):
            raise ConfigError(f"expected a scalar attribute value, got {typename(av)}", source=source, key=kk)
        if ak == "lat":
            av = check_number(av, source=source, key=kk, minimum=-90, maximum=90, what="a latitude")
        elif ak == "lon":
            av = check_number(av, source=source, key=kk, minimum=-180, maximum=180, what="a longitude")
        elif ak in ("row", "col"):
            av = check_number(av, source=source, key=kk, integer=True, minimum=0, what="a grid index")
        elif ak == "switch" and not isinstance(av, bool):  # a relay, not a worker (MultiTree Sec. III-C 3)
            raise ConfigError(f"expected true or false, got {typename(av)}", source=source, key=kk)
        out[ak] = av
    return out


def check_nodes(nodes: list, attrs: Mapping, *, source: str, key: str) -> None:
    if not nodes:
        raise ConfigError("empty topology: at least one datacenter is required",
                          source=source, key=key_path(key, "datacenters"))
    first: dict[str, int] = {}
    for i, n in enumerate(nodes):
        k = key_path(key, f"datacenters[{i}]")
        check_name(n, source=source, key=k)
        if n in first:
            raise ConfigError(f"duplicate datacenter name {n!r} (first at datacenters[{first[n]}])",
                              source=source, key=k)
        first[n] = i
    for n, a in attrs.items():
        if n not in first:
            raise ConfigError(f"attributes given for unknown datacenter {n!r}", source=source,
                              key=key_path(key, "node_attrs"))
        check_attrs(n, a, source=source, key=key_path(key, f"datacenters[{first[n]}]"))


def check_endpoints(a: Any, b: Any, known: set, nodes: list, seen: dict, i: int,
                     *, source: str, key: str) -> None:
    for j, x in enumerate((a, b)):
        kk = key_path(key, f"between[{j}]")
        if not isinstance(x, str):
            raise ConfigError(f"expected a datacenter name, got {typename(x)}", source=source, key=kk)
        if x not in known:
            raise ConfigError(f"unknown datacenter {x!r} (known: {describe_names(nodes)})",
                              source=source, key=kk)
    if a == b:
        raise ConfigError(f"self-loop: link joins {a!r} to itself", source=source, key=key_path(key, "between"))
    pair = frozenset((a, b))
    if pair in seen:
        raise ConfigError(f"duplicate link {a}-{b} (already defined at links[{seen[pair]}])",
                          source=source, key=key_path(key, "between"))
    seen[pair] = i
