"""Datacenters placed on servers: which server emulates which datacenter when one experiment
runs on several machines (``--servers``).  Pure: a topology and the servers' sizes in, a
:class:`Placement` out; nothing is started.

The load that matters is frames, not bits (docs/guides/link-fidelity.md, "TCP frames"):
under TCP a loaded direction carries about one frame per ``emulator.frame_ms`` plus its ACKs
whatever its rate.  The figures below were measured with the kernel's own frames, one per
millisecond (``frame_ms: 0``); the default's larger frames cost less, so the placement
over-provisions.  A direction's cost is :func:`direction_frames` and a
datacenter's is half of its links' (the other half is the far end's): the frames a server
carries are its datacenters' sum, a link inside it counted once, a cut link half on each side.

The partition is METIS's multilevel k-way (``pymetis``): the graph partitioner MaxiNet used for
the same job, kept up, deterministic for a fixed seed, and it takes what this problem has --
vertex weights (frames), edge weights (configured rate, both directions) and target shares per
part (cores).  networkx offers only Kernighan-Lin bisection, unweighted by load.  METIS knows
neither pinned vertices nor hard capacities, so after it (a choice): parts are matched to
servers to agree with the most pins, pins are enforced, servers over their limit shed the
datacenters whose move costs least cut, and greedy moves that lower the cut rate while keeping
every server within its limit run until none is left (Fiduccia-Mattheyses without hill
climbing).  The same refinement also runs from contiguous blocks in file order and the lower
cut rate wins, so a placement is never worse than that simple split.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from testbed.errors import ConfigError

SEGMENT_BYTES = 1514  # a full-size Ethernet frame
# Frames/s a TCP-loaded direction carries at most, data and ACKs: NetStorm's 26 directions
# carried 40-45k relayed frames/s at every scale from 0.5 to 4 (docs/emulator-log.md).
FRAMES_PER_DIRECTION_MAX = 1700
# Below ~14 Mbit/s a direction is frame-limited by its rate: a segment per 1514 bytes and an
# ACK per two segments.
ACK_FACTOR = 1.5
# Frames/s one core carries, relay and TCP endpoints together: 40-50 us of CPU per relayed
# frame on the project's 2-core machine (README, "Emulator headroom").
FRAMES_PER_CORE = 20_000
IMBALANCE = 0.10  # a server may carry this much above its share (METIS's ufactor too)
VXLAN_OVERHEAD_BYTES = 50  # outer Ethernet + IPv4 + UDP + VXLAN headers per tunnelled frame
METIS_SEED = 1


def direction_frames(rate_mbps: float) -> float:
    """Frames per second (data and ACKs) one direction carries when TCP fills it."""
    return min(FRAMES_PER_DIRECTION_MAX, ACK_FACTOR * rate_mbps * 1e6 / 8 / SEGMENT_BYTES)


def node_loads(topo) -> dict[str, float]:
    """Frames per second each datacenter's links put on the server that emulates it."""
    load = {n: 0.0 for n in topo.nodes}
    for link in topo.links:  # each end takes half: a link inside one server counts once there
        f = direction_frames(link.ab.rate_mbps) + direction_frames(link.ba.rate_mbps)
        load[link.a] += f / 2
        load[link.b] += f / 2
    return load


@dataclass(frozen=True)
class ServerSize:
    """What placement needs of a server: its name, cores (None: unknown) and NIC rate in
    Mbit/s (None: unknown)."""

    name: str
    cores: float | None = None
    nic_mbps: float | None = None


@dataclass
class Placement:
    """Datacenter -> server, and what it implies."""

    assignment: dict[str, str]
    servers: list[str]
    cut: list[int]  # indices of links whose ends are on different servers
    cut_mbps: float  # configured rate crossing servers, both directions of every cut link
    underlay_mbps: dict[tuple[str, str], float]  # (from, to) -> rate tunnelled, with VXLAN headers
    load: dict[str, float]  # server -> frames/s of its datacenters
    limit: dict[str, float]  # server -> frames/s it may carry under this placement
    capacity: dict[str, float | None]  # server -> frames/s its cores carry (None: cores unknown)
    pinned: dict[str, str] = field(default_factory=dict)

    def on(self, server: str) -> list[str]:
        """The datacenters of ``server``, in topology order."""
        return [n for n, s in self.assignment.items() if s == server]

    def to_dict(self) -> dict:
        return {"servers": {s: self.on(s) for s in self.servers}, "cut_links": self.cut,
                "cut_mbps": self.cut_mbps, "pinned": self.pinned,
                "underlay_mbps": [{"from": a, "to": b, "mbps": m} for (a, b), m in sorted(self.underlay_mbps.items())],
                "load_frames_per_s": self.load, "capacity_frames_per_s": self.capacity,
                "partitioner": "METIS k-way (pymetis), refined"}

    def describe(self, topo) -> list[str]:
        """Lines for ``plan``/``validate``: servers, cut links, underlay load."""
        lines = [f"server {s}: {', '.join(self.on(s)) or '(nothing)'} -- ~{self.load[s] / 1e3:.1f}k frames/s"
                 + (f" of ~{self.capacity[s] / 1e3:.0f}k its cores carry" if self.capacity[s] else "")
                 for s in self.servers]
        for j in self.cut:
            link = topo.links[j]
            lines.append(f"cut link {link.a}-{link.b} ({self.assignment[link.a]}-{self.assignment[link.b]}): "
                         f"{link.ab.rate_mbps:g}/{link.ba.rate_mbps:g} Mbit/s")
        for (a, b), m in sorted(self.underlay_mbps.items()):
            lines.append(f"underlay {a} -> {b}: {m:.1f} Mbit/s tunnelled")
        lines.append(f"rate crossing servers: {self.cut_mbps:g} Mbit/s in {len(self.cut)} of {len(topo.links)} links")
        return lines


def _cut(topo, assign: dict[str, str]) -> float:
    return sum(l.ab.rate_mbps + l.ba.rate_mbps for l in topo.links if assign[l.a] != assign[l.b])


def _metis(topo, weights: dict[str, float], shares: list[float], k: int) -> list[int]:
    """METIS's k-way partition of the topology: part index per node (file order)."""
    import pymetis

    idx = {n: i for i, n in enumerate(topo.nodes)}
    adj: list[dict[int, float]] = [{} for _ in topo.nodes]
    for l in topo.links:
        a, b = idx[l.a], idx[l.b]
        r = l.ab.rate_mbps + l.ba.rate_mbps
        adj[a][b] = adj[a].get(b, 0.0) + r
        adj[b][a] = adj[b].get(a, 0.0) + r
    top = max((r for row in adj for r in row.values()), default=1.0)
    xadj, adjncy, ew = [0], [], []
    for row in adj:
        for nb in sorted(row):
            adjncy.append(nb)
            ew.append(max(1, round(1000 * row[nb] / top)))  # integers, 1/1000 of the largest
        xadj.append(len(adjncy))
    wmax = max(weights.values()) or 1.0
    vw = [max(1, round(1000 * weights[n] / wmax)) for n in topo.nodes]
    opts = pymetis.Options(seed=METIS_SEED, ufactor=int(IMBALANCE * 1000))
    _, parts = pymetis.part_graph(k, pymetis.CSRAdjacency(xadj, adjncy), vweights=vw, eweights=ew,
                                  tpwgts=[s / sum(shares) for s in shares], options=opts)
    return list(parts)


def _match(parts: list[int], nodes: list[str], servers: list[str], pins: dict[str, str],
           shares: list[float]) -> dict[str, str]:
    """Parts to servers: METIS sized part i for server i; among servers of equal share, the
    permutation agreeing with the most pins (first in lexicographic order on a tie)."""
    k = len(servers)
    groups: dict[float, list[int]] = {}
    for i, s in enumerate(shares):
        groups.setdefault(s, []).append(i)
    perm = list(range(k))
    for members in groups.values():
        if len(members) > 7:  # 8! permutations: keep METIS's order
            continue
        best, best_score = None, -1
        for p in itertools.permutations(members):
            m = dict(zip(members, p))
            score = sum(1 for n, s in pins.items() if parts[nodes.index(n)] in m and servers[m[parts[nodes.index(n)]]] == s)
            if score > best_score:
                best, best_score = m, score
        for part, srv in best.items():
            perm[part] = srv
    return {n: servers[perm[parts[i]]] for i, n in enumerate(nodes)}


def _refine(topo, assign: dict[str, str], weights: dict[str, float], limit: dict[str, float],
            pins: dict[str, str]) -> dict[str, str]:
    """Enforce pins, bring servers within ``limit``, then take cut-lowering moves that keep
    every server within it, until none is left.  Deterministic: ties go to file order."""
    assign = {**assign, **pins}
    servers = list(limit)
    nbr: dict[str, dict[str, float]] = {n: {} for n in topo.nodes}
    for l in topo.links:
        r = l.ab.rate_mbps + l.ba.rate_mbps
        nbr[l.a][l.b] = nbr[l.a].get(l.b, 0.0) + r
        nbr[l.b][l.a] = nbr[l.b].get(l.a, 0.0) + r
    load = {s: 0.0 for s in servers}
    for n, s in assign.items():
        load[s] += weights[n]

    def gain(n: str, t: str) -> float:  # cut rate saved by moving n to t
        return sum(r for m, r in nbr[n].items() if assign[m] == t) - sum(
            r for m, r in nbr[n].items() if assign[m] == assign[n])

    def move(n: str, t: str) -> None:
        load[assign[n]] -= weights[n]
        load[t] += weights[n]
        assign[n] = t

    free = [n for n in topo.nodes if n not in pins]
    for s in servers:  # shed load: the cheapest move first, to the server with most room
        while load[s] > limit[s] + 1e-9:
            options = [(-gain(n, t), -(limit[t] - load[t] - weights[n]), topo.nodes.index(n), n, t)
                       for n in free if assign[n] == s for t in servers
                       if t != s and load[t] + weights[n] <= limit[t] + 1e-9]
            if not options:
                break
            move(*min(options)[3:])
    for _ in range(10 * len(topo.nodes) * len(servers)):  # each move lowers the cut: bounded
        options = [(-gain(n, t), topo.nodes.index(n), servers.index(t), n, t) for n in free for t in servers
                   if t != assign[n] and load[t] + weights[n] <= limit[t] + 1e-9]
        options = [o for o in options if o[0] < -1e-9]
        if not options:
            break
        move(*min(options)[3:])
    return assign


def contiguous(nodes: list[str], servers: list[str]) -> dict[str, str]:
    """The simple split: blocks of consecutive datacenters in file order, one per server,
    as equal in count as can be."""
    k, n = len(servers), len(nodes)
    return {dc: servers[min(k - 1, i * k // n)] for i, dc in enumerate(nodes)}


def place(topo, servers: list[ServerSize], pins: dict[str, str] | None = None, *, source: str = "") -> Placement:
    """Assign every datacenter of ``topo`` to one of ``servers`` (see the module docstring).
    ConfigError (naming ``source``) if a pin names an unknown server or datacenter, or if no
    placement keeps every server within what its cores carry."""
    pins = dict(pins or {})
    names = [s.name for s in servers]
    _check_pins(topo, names, pins, source)
    weights = node_loads(topo)
    total = sum(weights.values())
    given = [s.cores for s in servers if s.cores]
    mean = sum(given) / len(given) if given else 1.0
    shares = [s.cores or mean for s in servers]
    capacity = {s.name: s.cores * FRAMES_PER_CORE if s.cores else None for s in servers}
    fair = {s: total * share / sum(shares) for s, share in zip(names, shares)}
    if len(servers) == 1:
        candidates = [{n: names[0] for n in topo.nodes}]
    else:
        parts = _metis(topo, weights, shares, len(servers))
        candidates = [_match(parts, topo.nodes, names, pins, shares), contiguous(topo.nodes, names)]
    limit = _limits(names, weights, candidates[0], fair, capacity, total)
    assign, load = _best(topo, candidates, names, weights, limit, pins)
    _check_capacity(names, load, capacity, source)
    cut = [j for j, l in enumerate(topo.links) if assign[l.a] != assign[l.b]]
    under = _underlay(topo, assign, cut)
    return Placement(assign, names, cut, _cut(topo, assign), under, load, limit, capacity, pins)


def _check_pins(topo, names: list[str], pins: dict[str, str], source: str) -> None:
    """ConfigError if a pin names a datacenter ``topo`` lacks or a server not in ``names``."""
    for dc, s in pins.items():
        if dc not in topo.nodes:
            raise ConfigError(f"unknown datacenter {dc!r} (the topology has {', '.join(topo.nodes[:12])})",
                              source=source, key=f"placement.{dc}")
        if s not in names:
            raise ConfigError(f"unknown server {s!r} (the servers file names {', '.join(names)})",
                              source=source, key=f"placement.{dc}")


def _limits(names: list[str], weights: dict[str, float], first_candidate: dict[str, str],
            fair: dict[str, float], capacity: dict[str, float | None], total: float) -> dict[str, float]:
    """Frames/s each server may carry: its fair share with the tolerance, at most its cores."""
    # a server may carry its share plus the tolerance, or as much more as METIS's partition
    # gave its busiest server where the datacenters' sizes allow no better
    first = {s: sum(weights[n] for n, t in first_candidate.items() if t == s) for s in names}
    ratio = max([1 + IMBALANCE] + [first[s] / fair[s] for s in names if fair[s]])
    limit = {s: fair[s] * ratio if len(names) > 1 else total for s in names}
    for s in names:
        if capacity[s] is not None:
            limit[s] = min(limit[s], capacity[s])
    return limit


def _best(topo, candidates: list[dict[str, str]], names: list[str], weights: dict[str, float],
          limit: dict[str, float], pins: dict[str, str]) -> tuple[dict[str, str], dict[str, float]]:
    """Every candidate refined, then the one with the lowest cut rate among those within the
    limits (if none is, the lowest cut rate, then the least over), the first on a tie:
    (assignment, server -> frames/s)."""
    best = None
    for start in candidates:
        a = _refine(topo, start, weights, limit, pins)
        load = {s: sum(weights[n] for n in topo.nodes if a[n] == s) for s in names}
        over = sum(max(0.0, load[s] - limit[s]) for s in names)
        key = (over > 1e-9, _cut(topo, a), over)
        if best is None or key < best[0]:
            best = (key, a, load)
    _, assign, load = best
    return assign, load


def _check_capacity(names: list[str], load: dict[str, float], capacity: dict[str, float | None],
                    source: str) -> None:
    """ConfigError naming the first server whose load exceeds what its cores carry."""
    for s in names:
        if capacity[s] is not None and load[s] > capacity[s] + 1e-9:
            raise ConfigError(f"server {s}: its datacenters' links would carry ~{load[s] / 1e3:.1f}k frames/s, more "
                              f"than its {capacity[s] / FRAMES_PER_CORE:g} cores carry (~{capacity[s] / 1e3:.0f}k at "
                              f"{FRAMES_PER_CORE} per core); add servers or cores (docs/guides/multi-server.md)",
                              source=source, key="servers")


def _underlay(topo, assign: dict[str, str], cut: list[int]) -> dict[tuple[str, str], float]:
    """(from server, to server) -> Mbit/s the cut links tunnel that way, VXLAN headers included."""
    under: dict[tuple[str, str], float] = {}
    wire = (SEGMENT_BYTES + VXLAN_OVERHEAD_BYTES) / SEGMENT_BYTES
    for j in cut:
        l = topo.links[j]
        for (u, v), d in (((l.a, l.b), l.ab), ((l.b, l.a), l.ba)):
            key = (assign[u], assign[v])
            under[key] = under.get(key, 0.0) + d.rate_mbps * wire
    return under


def underlay_problems(placement: Placement, pair_mbps: dict[tuple[str, str], float],
                      nic_mbps: dict[str, float | None]) -> list[str]:
    """Why the underlay cannot carry ``placement``: a pair of servers whose tunnelled rate one
    way exceeds what was measured (or configured) between them, or a server whose NIC would
    send or receive more than its rate.  [] if it can."""
    out = []
    for (a, b), m in sorted(placement.underlay_mbps.items()):
        cap = pair_mbps.get((a, b))
        if cap is not None and m > cap:
            out.append(f"servers {a} -> {b}: the cut links need {m:.1f} Mbit/s, the underlay carried {cap:.1f}")
    for s in placement.servers:
        nic = nic_mbps.get(s)
        if nic is None:
            continue
        for what, total in (("send", sum(m for (a, _), m in placement.underlay_mbps.items() if a == s)),
                            ("receive", sum(m for (_, b), m in placement.underlay_mbps.items() if b == s))):
            if total > nic:
                out.append(f"server {s}: the cut links would {what} {total:.1f} Mbit/s over a {nic:g} Mbit/s NIC")
    return out
