"""Seeded topology generators and Internet-Topology-Zoo import.

Every generator is a plain function returning a :class:`~testbed.topology.Topology`
and is also reachable from a topology file as ``generator: {kind: KIND, ...}``
(see :func:`build`).  Random generators draw from ``numpy.random.default_rng(seed)``
only, so a (kind, parameters, seed) triple always yields the same WAN.  Node names
are ``n0, n1, ...``.  Invalid parameters raise :class:`~testbed.errors.ConfigError`
whose key is the parameter name (``build`` prefixes it with the file's key path).

Kinds
-----
``mtree-random``  MTREE (Luo, Wang, Xing) Sec. IV-A random heterogeneous WAN
``equinix-like``  ``mtree-random`` preset, n=20, m=141 (MTREE's Equinix size)
``idn-like``      ``mtree-random`` preset, n=40, m=231 (MTREE's IDN/SWAN size)
``crew-mesh``     CREW (Luo, Wang, Li, Xing) Sec. V-A full mesh, network setting N2
``kary-tree``, ``ring``, ``mesh2d``, ``torus2d``, ``star``, ``full-mesh``
                  uniform-rate regular graphs (MultiTree, Huang et al. ISCA'21, Secs. III and V)
``zoo``           Internet Topology Zoo GraphML/GML import
"""

from __future__ import annotations

import inspect
import math
import re
import xml.etree.ElementTree as ET
from dataclasses import replace
from itertools import combinations
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import networkx as nx
import numpy as np

from .checks import check_number, key_path, typename, unknown_key_msg
from .errors import ConfigError
from .wan import NAME_RE, Link, LinkDir, Topology, check_link_field

MTREE_SOURCE = ("MTREE: S. Luo, R. Wang, H. Xing, 'Efficient Inter-Datacenter AllReduce With "
                "Multiple Trees', Sec. IV-A (Workloads): rates integer multiples of 10 Mbit/s from "
                "[200-100sk, 200+100sk], latency in [50, 400] ms inversely proportional to rate")
CREW_SOURCE = ("CREW: S. Luo, R. Wang, et al., 'Efficient Cross-Cloud Partial Reduce With CREW', "
               "Sec. V-A network setting N2: full mesh, b_ij = k*25 Mbit/s, k integer in [1,10] "
               "sampled from N(5,1), directions independent; the paper's simulator has no latency")


# --------------------------------------------------------------------------- param helpers


def _int(x: Any, key: str, minimum: int | None = None, maximum: int | None = None) -> int:
    return int(check_number(x, key=key, integer=True, minimum=minimum, maximum=maximum))


def _num(x: Any, key: str, minimum: float | None = None, min_open: bool = False,
         maximum: float | None = None, what: str = "") -> float:
    return float(check_number(x, key=key, minimum=minimum, min_open=min_open, maximum=maximum, what=what))


def _seed(x: Any) -> int:
    return _int(x, "seed", minimum=0)


def _bool(x: Any, key: str) -> bool:
    if not isinstance(x, bool):
        raise ConfigError(f"expected true or false, got {typename(x)}", key=key)
    return x


def _choice(x: Any, key: str, options: Sequence[str]) -> str:
    if not isinstance(x, str) or x not in options:
        raise ConfigError(f"expected one of {', '.join(map(repr, options))}, got {typename(x)}", key=key)
    return x


def _uniform_dir(rate_mbps: Any, delay_ms: Any) -> LinkDir:
    return LinkDir(rate_mbps=check_link_field("rate_mbps", rate_mbps, source="", key="rate_mbps"),
                   delay_ms=check_link_field("delay_ms", delay_ms, source="", key="delay_ms"))


def _names(n: int) -> list[str]:
    return [f"n{i}" for i in range(n)]


def _uniform(name: str, n: int, edges: Sequence[tuple[int, int]], rate_mbps: Any, delay_ms: Any,
             source: str, attrs: dict[str, dict] | None = None) -> Topology:
    d = _uniform_dir(rate_mbps, delay_ms)
    names = _names(n)
    links = [Link(names[a], names[b], d, d) for a, b in edges]
    return Topology(name=name, nodes=names, links=links, source=source, node_attrs=attrs or {})


# --------------------------------------------------------------------------- MTREE


def mtree_rate_choices(sk: float = 0.7, *, rate_min_mbps: float | None = None,
                       rate_max_mbps: float | None = None, rate_step_mbps: float = 10) -> np.ndarray:
    """The rates MTREE may draw: the integer multiples of ``rate_step_mbps`` (10) in
    ``[200 - 100*sk, 200 + 100*sk]`` Mbit/s, or in ``[rate_min_mbps, rate_max_mbps]``."""
    sk = _num(sk, "sk", minimum=0, maximum=1, what="a skewness")
    step = _num(rate_step_mbps, "rate_step_mbps", minimum=0, min_open=True)
    lo = 200 - 100 * sk if rate_min_mbps is None else _num(rate_min_mbps, "rate_min_mbps", 0, True)
    hi = 200 + 100 * sk if rate_max_mbps is None else _num(rate_max_mbps, "rate_max_mbps", 0, True)
    if lo > hi:
        raise ConfigError(f"expected rate_max_mbps >= rate_min_mbps ({lo:g}), got {hi:g}", key="rate_max_mbps")
    klo = max(1, math.ceil(lo / step - 1e-9))
    khi = math.floor(hi / step + 1e-9)
    if klo > khi:
        raise ConfigError(f"no positive multiple of {step:g} Mbit/s in [{lo:g}, {hi:g}]; expected a "
                          "wider rate range or a smaller rate_step_mbps", key="rate_step_mbps")
    return np.arange(klo, khi + 1, dtype=float) * step


def mtree_delays(rates: Sequence[float], *, fast_mbps: float, slow_mbps: float,
                 delay_min_ms: float = 50, delay_max_ms: float = 400) -> np.ndarray:
    """MTREE latency rule: latency inversely proportional to rate, re-scaled into
    ``[delay_min_ms, delay_max_ms]``.  Pure proportionality cannot span [50, 400] ms
    when rates span less than 8x, so we read "inversely proportional ... and re-scale
    them into the range of [50, 400]" (MTREE Sec. IV-A and IV-D) as an affine map of
    ``1/rate``::

        delay = dmin + (dmax - dmin) * (1/rate - 1/fast) / (1/slow - 1/fast)

    so a rate of ``fast_mbps`` gets ``dmin`` and ``slow_mbps`` gets ``dmax``.  If
    ``fast == slow`` (e.g. sk = 0) every link gets the midpoint.  Rounded to 0.01 ms."""
    r = np.asarray(rates, dtype=float)
    if fast_mbps == slow_mbps:
        return np.full(r.shape, round((delay_min_ms + delay_max_ms) / 2, 2))
    x = (1.0 / r - 1.0 / fast_mbps) / (1.0 / slow_mbps - 1.0 / fast_mbps)
    return np.round(delay_min_ms + (delay_max_ms - delay_min_ms) * x, 2)


def _mtree_dirs(count: int, rng: np.random.Generator, *, sk: Any, rate_min_mbps: Any, rate_max_mbps: Any,
                rate_step_mbps: Any, delay_min_ms: Any, delay_max_ms: Any, delay_scaling: Any,
                asymmetric: Any) -> list[tuple[LinkDir, LinkDir]]:
    choices = mtree_rate_choices(sk, rate_min_mbps=rate_min_mbps, rate_max_mbps=rate_max_mbps,
                                 rate_step_mbps=rate_step_mbps)
    dmin = _num(delay_min_ms, "delay_min_ms", minimum=0)
    dmax = _num(delay_max_ms, "delay_max_ms", minimum=0)
    if dmax < dmin:
        raise ConfigError(f"expected delay_max_ms >= delay_min_ms ({dmin:g}), got {dmax:g}", key="delay_max_ms")
    scaling = _choice(delay_scaling, "delay_scaling", ("instance", "range"))
    asym = _bool(asymmetric, "asymmetric")
    idx = rng.integers(0, len(choices), size=(count, 2 if asym else 1))
    rates = choices[idx]
    if not asym:
        rates = np.repeat(rates, 2, axis=1)
    if scaling == "instance" and count:
        fast, slow = float(rates.max()), float(rates.min())
    else:
        fast, slow = float(choices[-1]), float(choices[0])
    delays = mtree_delays(rates, fast_mbps=fast, slow_mbps=slow, delay_min_ms=dmin, delay_max_ms=dmax)
    return [(LinkDir(float(rates[i, 0]), float(delays[i, 0])), LinkDir(float(rates[i, 1]), float(delays[i, 1])))
            for i in range(count)]


def random_connected_edges(n: int, m: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """A uniformly-labelled random connected simple graph with exactly n nodes and m
    undirected edges: a random recursive spanning tree over a random node permutation
    (each node attaches to a uniformly chosen earlier one), then ``m - (n-1)`` distinct
    extra edges drawn uniformly without replacement from the remaining pairs.
    Returned sorted as (i, j) with i < j."""
    perm = rng.permutation(n)
    edges = set()
    for idx in range(1, n):
        u, v = int(perm[idx]), int(perm[rng.integers(0, idx)])
        edges.add((min(u, v), max(u, v)))
    extra = m - (n - 1)
    if extra > 0:
        rest = [p for p in combinations(range(n), 2) if p not in edges]
        for j in rng.choice(len(rest), size=extra, replace=False):
            edges.add(rest[int(j)])
    return sorted(edges)


def mtree_weighted(nodes: Sequence[str], edges: Sequence[tuple[str, str]], *, sk: Any = 0.7, seed: Any = 0,
                   rate_min_mbps: Any = None, rate_max_mbps: Any = None, rate_step_mbps: Any = 10,
                   delay_min_ms: Any = 50, delay_max_ms: Any = 400, delay_scaling: Any = "instance",
                   asymmetric: Any = False, name: str = "mtree-weighted", source: str = MTREE_SOURCE) -> Topology:
    """Give a fixed edge list MTREE's random rates and latencies (used to bake
    ``topologies/gscale-b4-12.yaml``): one ``numpy.random.default_rng(seed)``, one
    rate draw per link in the given order (two, a->b then b->a, if ``asymmetric``)."""
    rng = np.random.default_rng(_seed(seed))
    dirs = _mtree_dirs(len(edges), rng, sk=sk, rate_min_mbps=rate_min_mbps, rate_max_mbps=rate_max_mbps,
                       rate_step_mbps=rate_step_mbps, delay_min_ms=delay_min_ms, delay_max_ms=delay_max_ms,
                       delay_scaling=delay_scaling, asymmetric=asymmetric)
    links = [Link(a, b, ab, ba) for (a, b), (ab, ba) in zip(edges, dirs)]
    return Topology(name=name, nodes=list(nodes), links=links, source=source)


def mtree_random(n: Any, m: Any, sk: Any = 0.7, seed: Any = 0, *, rate_min_mbps: Any = None,
                 rate_max_mbps: Any = None, rate_step_mbps: Any = 10, delay_min_ms: Any = 50,
                 delay_max_ms: Any = 400, delay_scaling: Any = "instance", asymmetric: Any = False) -> Topology:
    """MTREE's random heterogeneous inter-DC WAN (MTREE Sec. IV-A "Workloads").

    Structure: a connected random graph with exactly ``n`` datacenters and ``m``
    undirected links (:func:`random_connected_edges`; the paper uses the real GScale,
    Equinix and IDN graphs, whose edge lists for the latter two are not public).

    Rates, our reading of the paper: "the available link bandwidth of a link is an
    integer multiple of ten randomly taken from [200 - 100sk, 200 + 100sk], with the
    unit of Mb/s" -- MTREE models the WAN as an undirected graph whose edge capacity
    b_j is "bidirectional bandwidth", so by default ONE rate is drawn per link
    (uniformly over the multiples of 10 in the interval) and used for both directions.
    ``asymmetric: true`` draws each direction independently instead.
    ``rate_min_mbps``/``rate_max_mbps``/``rate_step_mbps`` override the interval/step.

    Latency: "chosen from the range of [50, 400], inversely proportional to its
    available bandwidth, with the unit of ms" / "re-scale them into the range of
    [50, 400]" -- see :func:`mtree_delays`.  With ``delay_scaling: instance`` (default,
    the literal "re-scale") the fastest link drawn gets 50 ms and the slowest 400 ms;
    with ``range`` the map is fixed by the interval's end points, so the delay depends
    only on the rate.  Delays are one-way (the alpha of MTREE's Hockney model).

    Draw order from ``default_rng(seed)``: node permutation, tree attachments, extra
    edges, then link rates in sorted (i, j) link order."""
    n = _int(n, "n", minimum=2)
    m = _int(m, "m")
    mmax = n * (n - 1) // 2
    if not n - 1 <= m <= mmax:
        raise ConfigError(f"expected {n - 1} <= m <= {mmax} for a connected simple graph on n={n} "
                          f"nodes, got {m}", key="m")
    rng = np.random.default_rng(_seed(seed))
    edges = random_connected_edges(n, m, rng)
    dirs = _mtree_dirs(len(edges), rng, sk=sk, rate_min_mbps=rate_min_mbps, rate_max_mbps=rate_max_mbps,
                       rate_step_mbps=rate_step_mbps, delay_min_ms=delay_min_ms, delay_max_ms=delay_max_ms,
                       delay_scaling=delay_scaling, asymmetric=asymmetric)
    names = _names(n)
    links = [Link(names[a], names[b], ab, ba) for (a, b), (ab, ba) in zip(edges, dirs)]
    return Topology(name=f"mtree-random-{n}-{m}", nodes=names, links=links,
                    source=f"random connected graph (n={n}, m={m}, sk={float(sk):g}, seed={seed}); " + MTREE_SOURCE)


def equinix_like(n: Any = 20, m: Any = 141, sk: Any = 0.7, seed: Any = 0, **kw: Any) -> Topology:
    """MTREE's Equinix topology size (20 nodes, 282 directed = 141 undirected edges,
    MTREE Sec. IV-A, ref. [33]) as an :func:`mtree_random` graph.  The real Equinix edge
    list is not public, so this is a random connected graph of the same size."""
    t = mtree_random(n, m, sk, seed, **kw)
    t.name = f"equinix-like-{len(t.nodes)}"
    t.source = ("Equinix-like: the real Equinix edge list (MTREE ref. [33]) is not public; random "
                f"connected graph with MTREE's node/edge counts (20 nodes, 141 links); {t.source}")
    return t


def idn_like(n: Any = 40, m: Any = 231, sk: Any = 0.7, seed: Any = 0, **kw: Any) -> Topology:
    """MTREE's IDN (Microsoft SWAN, ref. [34]) size, 40 nodes and 462 directed = 231
    undirected edges, as an :func:`mtree_random` graph (the real edge list is not public)."""
    t = mtree_random(n, m, sk, seed, **kw)
    t.name = f"idn-like-{len(t.nodes)}"
    t.source = ("IDN-like: the real IDN/SWAN edge list (MTREE ref. [34]) is not public; random "
                f"connected graph with MTREE's node/edge counts (40 nodes, 231 links); {t.source}")
    return t


# --------------------------------------------------------------------------- CREW


def crew_mesh(n: Any = 8, seed: Any = 0, *, unit_mbps: Any = 25, k_mean: Any = 5, k_std: Any = 1,
              k_min: Any = 1, k_max: Any = 10, delay_ms: Any = 0) -> Topology:
    """CREW's cross-cloud full mesh, network setting N2 (CREW Sec. V-A).

    Paper: "calculated by k * u, where k is an integer in the range of [1, 10] sampled
    from N(5, 1) and u is the minimum bandwidth unit with the value of 25Mbps ... Note
    that b_ij and b_ji between worker i and worker j may not be equal."  So each
    DIRECTION gets its own draw: k = clip(round(N(k_mean, k_std)), k_min, k_max)
    (the paper gives no rounding/clipping rule; we round half-to-even then clip).
    Draw order: pairs (i, j), i < j, in lexicographic order, a->b then b->a.

    Delay: CREW's flow-level simulator ignores latency and the paper gives no value,
    so ``delay_ms`` defaults to 0 (set e.g. 20-50 ms for WAN realism)."""
    n = _int(n, "n", minimum=2)
    unit = _num(unit_mbps, "unit_mbps", minimum=0, min_open=True)
    mean = _num(k_mean, "k_mean")
    std = _num(k_std, "k_std", minimum=0)
    kmin = _int(k_min, "k_min", minimum=1)
    kmax = _int(k_max, "k_max", minimum=kmin)
    delay = check_link_field("delay_ms", delay_ms, source="", key="delay_ms")
    rng = np.random.default_rng(_seed(seed))
    pairs = list(combinations(range(n), 2))
    k = np.clip(np.rint(rng.normal(mean, std, size=(len(pairs), 2))), kmin, kmax)
    names = _names(n)
    links = [Link(names[a], names[b], LinkDir(float(k[i, 0] * unit), delay), LinkDir(float(k[i, 1] * unit), delay))
             for i, (a, b) in enumerate(pairs)]
    return Topology(name=f"crew-mesh-{n}", nodes=names, links=links,
                    source=f"full mesh (n={n}, seed={seed}); " + CREW_SOURCE)


# --------------------------------------------------------------------------- regular graphs


def kary_tree(k: Any = 2, depth: Any = None, n: Any = None, *, rate_mbps: Any = 100, delay_ms: Any = 0) -> Topology:
    """Complete k-ary tree rooted at n0, nodes numbered breadth-first (parent of n_i is
    n_{(i-1)//k}).  Give ``depth`` (root alone = depth 0) or ``n`` (the first n nodes
    of the breadth-first order).  node_attrs: ``level``."""
    k = _int(k, "k", minimum=1)
    if (depth is None) == (n is None):
        raise ConfigError("expected exactly one of 'depth' or 'n'", key="depth" if depth is not None else "n")
    if depth is not None:
        d = _int(depth, "depth", minimum=1, maximum=20)
        n = sum(k ** i for i in range(d + 1))
        if n > 10000:
            raise ConfigError(f"expected at most 10000 nodes, k={k} depth={d} gives {n}", key="depth")
    else:
        n = _int(n, "n", minimum=2, maximum=10000)
    edges = [((i - 1) // k, i) for i in range(1, n)]
    level = [0] * n
    for p, c in edges:
        level[c] = level[p] + 1
    attrs = {f"n{i}": {"level": level[i]} for i in range(n)}
    return _uniform(f"kary-tree-{k}-{n}", n, edges, rate_mbps, delay_ms,
                    f"complete {k}-ary tree, {n} nodes", attrs)


def ring(n: Any = 6, *, rate_mbps: Any = 100, delay_ms: Any = 0) -> Topology:
    """Ring n0 - n1 - ... - n{n-1} - n0 (n >= 3)."""
    n = _int(n, "n", minimum=3)
    edges = [(i, i + 1) for i in range(n - 1)] + [(0, n - 1)]
    return _uniform(f"ring-{n}", n, edges, rate_mbps, delay_ms, f"ring of {n} nodes")


def _grid(rows: Any, cols: Any, wrap: bool, rate_mbps: Any, delay_ms: Any) -> Topology:
    rows = _int(rows, "rows", minimum=1)
    cols = _int(cols, "cols", minimum=1)
    if rows * cols < 2:
        raise ConfigError("expected at least 2 nodes (rows * cols >= 2)", key="cols")
    if rows * cols > 10000:
        raise ConfigError(f"expected at most 10000 nodes, got {rows * cols}", key="rows")

    def nid(r: int, c: int) -> int:  # row-major: id = row * cols + col (MultiTree: y*W + x)
        return r * cols + c

    edges: list[tuple[int, int]] = []
    seen = set()

    def add(u: int, v: int) -> None:
        p = (min(u, v), max(u, v))
        if u != v and p not in seen:
            seen.add(p)
            edges.append(p)

    for r in range(rows):
        for c in range(cols):
            if c + 1 < cols or (wrap and cols > 2):
                add(nid(r, c), nid(r, (c + 1) % cols))  # X dimension
            if r + 1 < rows or (wrap and rows > 2):
                add(nid(r, c), nid((r + 1) % rows, c))  # Y dimension
    attrs = {f"n{nid(r, c)}": {"row": r, "col": c} for r in range(rows) for c in range(cols)}
    kind = "torus2d" if wrap else "mesh2d"
    return _uniform(f"{'torus' if wrap else 'mesh'}-{rows}x{cols}", rows * cols, edges, rate_mbps, delay_ms,
                    f"{kind} {rows}x{cols}, row-major node ids n(row*{cols}+col) as in MultiTree "
                    "(Huang et al., ISCA'21) Sec. III-C", attrs)


def mesh2d(rows: Any = 2, cols: Any = 2, *, rate_mbps: Any = 100, delay_ms: Any = 0) -> Topology:
    """2D mesh; node ``n{row*cols+col}`` (row-major, MultiTree's id = y*W + x with
    row = y, col = x) with node_attrs ``row`` and ``col`` for MultiTree's
    Y-before-X neighbour order (MultiTree Sec. III-C, Alg. 1 line 10)."""
    return _grid(rows, cols, False, rate_mbps, delay_ms)


def torus2d(rows: Any = 4, cols: Any = 4, *, rate_mbps: Any = 100, delay_ms: Any = 0) -> Topology:
    """2D torus, named like :func:`mesh2d` plus wrap-around links.  Every node has
    degree 4 when rows, cols >= 3.  In a dimension of size 2 the wrap-around link
    would duplicate the mesh link (a multigraph in hardware); we keep one link, so
    a 2-wide dimension behaves like a mesh dimension."""
    return _grid(rows, cols, True, rate_mbps, delay_ms)


def star(n: Any = 5, *, rate_mbps: Any = 100, delay_ms: Any = 0) -> Topology:
    """Star of ``n`` nodes in total: hub n0 linked to n1..n{n-1}."""
    n = _int(n, "n", minimum=2)
    return _uniform(f"star-{n}", n, [(0, i) for i in range(1, n)], rate_mbps, delay_ms,
                    f"star, hub n0 + {n - 1} leaves")


def full_mesh(n: Any = 4, *, rate_mbps: Any = 100, delay_ms: Any = 0) -> Topology:
    """Complete graph on n nodes."""
    n = _int(n, "n", minimum=2, maximum=500)
    return _uniform(f"full-mesh-{n}", n, list(combinations(range(n), 2)), rate_mbps, delay_ms,
                    f"full mesh of {n} nodes")


def gpu_cluster(machines: Any = 2, gpus: Any = 4, *, intra_mbps: Any = 100000, inter_mbps: Any = 10000,
                delay_ms: Any = 0) -> Topology:
    """TopoAdapt's GPU cluster (Zhang, Wu, Li, INFOCOM 2021, Sec. VI-A, Fig. 3): ``machines`` x
    ``gpus`` workers, GPU ``k`` of machine ``m`` named ``{letter m}{k}`` (a0, a1, ..., b0, ...).

    The paper's figures of the intra- and inter-machine graphs are not in its text; this is
    the complete-graph reading its Sec. VI-B supports ("one one-hop tree rooted at each worker
    ... utilizes all bandwidth on all links" at 100/100 Gbit/s): every GPU pair is a direct
    link, at ``intra_mbps`` (PCIe, 100 Gbit/s per direction) inside a machine and at
    ``inter_mbps`` (10, 25, 40 or 100 Gbit/s) across machines.  No delay by default (the
    paper's simulation has none)."""
    m = _int(machines, "machines", minimum=1, maximum=26)
    g = _int(gpus, "gpus", minimum=1, maximum=64)
    intra, inter = _uniform_dir(intra_mbps, delay_ms), _uniform_dir(inter_mbps, delay_ms)
    names = [f"{chr(ord('a') + i)}{k}" for i in range(m) for k in range(g)]
    links = [Link(a, b, *(2 * (intra if a[0] == b[0] else inter,))) for a, b in combinations(names, 2)]
    return Topology(name=f"gpu-{m}x{g}", nodes=names, links=links,
                    source=f"TopoAdapt GPU cluster, {m} machines x {g} GPUs, intra {float(intra_mbps):g} / inter "
                           f"{float(inter_mbps):g} Mbit/s, every GPU pair linked (Sec. VI-A)")


def leaf_spine(leaves: Any = 8, spines: Any = 8, hosts_per_leaf: Any = 8, *, rate_mbps: Any = 100,
               delay_ms: Any = 0) -> Topology:
    """Two-tier leaf-spine (folded Clos) fabric: hosts ``h{leaf * hosts_per_leaf + k}``, each
    on one NIC link to its leaf switch ``leaf{j}``, every leaf linked to every spine
    ``spine{s}``; switches carry ``switch: true`` (relays, not workers: MultiTree's
    Sec. III-C 3 switch-based networks).  With ``spines >= hosts_per_leaf`` it is
    non-blocking, a fat tree of two levels."""
    leaves = _int(leaves, "leaves", minimum=1, maximum=256)
    spines = _int(spines, "spines", minimum=1, maximum=256)
    per = _int(hosts_per_leaf, "hosts_per_leaf", minimum=1, maximum=256)
    d = _uniform_dir(rate_mbps, delay_ms)
    hosts = [f"h{i}" for i in range(leaves * per)]
    leaf_names = [f"leaf{j}" for j in range(leaves)]
    spine_names = [f"spine{s}" for s in range(spines)] if leaves > 1 else []
    links = [Link(h, leaf_names[i // per], d, d) for i, h in enumerate(hosts)]
    links += [Link(lf, sp, d, d) for lf in leaf_names for sp in spine_names]
    return Topology(name=f"leaf-spine-{leaves}x{per}", nodes=hosts + leaf_names + spine_names, links=links,
                    source=f"leaf-spine fabric: {leaves} leaves x {per} hosts, {len(spine_names)} spines",
                    node_attrs={n: {"switch": True} for n in leaf_names + spine_names})


def bigraph(upper: Any = 2, lower: Any = 2, hosts_per_switch: Any = 4, *, rate_mbps: Any = 100,
            delay_ms: Any = 0) -> Topology:
    """EFLOPS' BiGraph (Dong et al., HPCA'20; MultiTree Sec. V, "4x8" and "4x16"): two layers of
    switches, every upper switch ``up{i}`` linked to every lower switch ``lo{j}``, and
    ``hosts_per_switch`` hosts on every switch (hosts ``h{k}``, numbered switch by switch, upper
    layer first).  Switches carry ``switch: true``, hosts ``layer: upper | lower``."""
    upper = _int(upper, "upper", minimum=1, maximum=256)
    lower = _int(lower, "lower", minimum=1, maximum=256)
    per = _int(hosts_per_switch, "hosts_per_switch", minimum=1, maximum=256)
    d = _uniform_dir(rate_mbps, delay_ms)
    switches = [f"up{i}" for i in range(upper)] + [f"lo{j}" for j in range(lower)]
    hosts = [f"h{k}" for k in range(len(switches) * per)]
    links = [Link(h, switches[k // per], d, d) for k, h in enumerate(hosts)]
    links += [Link(f"up{i}", f"lo{j}", d, d) for i in range(upper) for j in range(lower)]
    attrs = {s: {"switch": True} for s in switches}
    attrs.update({h: {"layer": "upper" if k // per < upper else "lower"} for k, h in enumerate(hosts)})
    return Topology(name=f"bigraph-{upper + lower}x{per}", nodes=hosts + switches, links=links,
                    source=f"BiGraph: {upper} upper and {lower} lower switches, {per} hosts each (EFLOPS)",
                    node_attrs=attrs)


# --------------------------------------------------------------------------- Topology Zoo

EARTH_RADIUS_KM = 6371.0
_SPEED_UNITS = {"K": 1e-3, "M": 1.0, "G": 1e3, "T": 1e6}


def great_circle_km(lat1: float, lon1: float, lat2: float, lon2: float) -> float:
    """Haversine distance on a sphere of radius 6371 km."""
    p1, p2 = math.radians(lat1), math.radians(lat2)
    dp, dl = p2 - p1, math.radians(lon2 - lon1)
    h = math.sin(dp / 2) ** 2 + math.cos(p1) * math.cos(p2) * math.sin(dl / 2) ** 2
    return 2 * EARTH_RADIUS_KM * math.asin(min(1.0, math.sqrt(h)))


def _as_float(x: Any) -> float | None:
    if isinstance(x, bool) or x is None:
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _zoo_rate(d: Mapping) -> float | None:
    """Link speed in Mbit/s from Topology-Zoo edge attributes, if given."""
    raw = _as_float(d.get("LinkSpeedRaw"))  # bit/s
    if raw and raw > 0:
        return raw / 1e6
    sp = _as_float(d.get("LinkSpeed"))
    if sp and sp > 0:
        unit = str(d.get("LinkSpeedUnits", "M")).strip().upper()[:1] or "M"
        if unit in _SPEED_UNITS:
            return sp * _SPEED_UNITS[unit]
    return None


def _sanitize(label: str) -> str:
    s = re.sub(r"[^A-Za-z0-9]+", "_", label).strip("_")
    if s and not s[0].isalpha():
        s = "n_" + s
    return s


def zoo(path: Any, *, rate_mbps: Any = 100, delay_ms: Any = 0, km_per_ms: Any = 200,
        use_link_speed: Any = True, node_names: Any = "auto") -> Topology:
    """Import an Internet Topology Zoo (topology-zoo.org) GraphML or GML file.

    * Rates: the edge's ``LinkSpeedRaw`` (bit/s) or ``LinkSpeed`` + ``LinkSpeedUnits``
      when present and ``use_link_speed``, else ``rate_mbps``; symmetric.  Parallel
      edges between two nodes are merged into one link whose rate is their sum.
    * Delay: great-circle distance between the endpoints' ``Latitude``/``Longitude``
      divided by ``km_per_ms`` (default 200 km/ms, light in fibre) when both have
      coordinates, else ``delay_ms``; rounded to 0.001 ms.
    * Names: ``node_names: label`` uses the node labels made identifier-safe
      (``New York`` -> ``New_York``); ``index`` uses n0..; ``auto`` (default) uses
      labels if they are all present, unique and valid, else indices.  node_attrs keep
      ``label``, ``lat``, ``lon``, ``country`` and the file's node id ``zoo_id``.
    * Self-loops are dropped; directed files are read as undirected.
    """
    if not isinstance(path, (str, Path)) or not str(path):
        raise ConfigError(f"expected a path to a .graphml or .gml file, got {typename(path)}", key="path")
    p = Path(path)
    rate_fallback = check_link_field("rate_mbps", rate_mbps, source="", key="rate_mbps")
    delay_fallback = check_link_field("delay_ms", delay_ms, source="", key="delay_ms")
    kpm = _num(km_per_ms, "km_per_ms", minimum=0, min_open=True)
    use_speed = _bool(use_link_speed, "use_link_speed")
    naming = _choice(node_names, "node_names", ("auto", "label", "index"))
    suffix = p.suffix.lower()
    if suffix not in (".graphml", ".gml"):
        raise ConfigError(f"expected a .graphml or .gml file, got {p.name!r}", key="path")
    if not p.is_file():
        raise ConfigError(f"file not found: {str(path)!r}", key="path")
    g = _zoo_graph(p, suffix)
    ids = list(g.nodes)
    names = _zoo_names(g, ids, naming)
    attrs, coords = _zoo_node_attrs(g, ids, names)
    links = _zoo_links(g, coords, dict(zip(ids, names)), use_speed, rate_fallback, delay_fallback, kpm)
    net = g.graph.get("Network") or g.graph.get("label") or p.stem
    src = f"Internet Topology Zoo (topology-zoo.org) file {p.name}; network {net!r}"
    if g.graph.get("DateObtained"):
        src += f", obtained {g.graph['DateObtained']}"
    src += f"; delays = great-circle distance / {kpm:g} km/ms"
    return Topology(name=_zoo_name(p.stem), nodes=names, links=links, source=src, node_attrs=attrs)


def _zoo_graph(p: Path, suffix: str) -> nx.Graph:
    """The parsed Topology Zoo file as an undirected graph with at least one node."""
    try:
        g = nx.read_graphml(p) if suffix == ".graphml" else nx.read_gml(p, label="id")
    except (nx.NetworkXError, ET.ParseError, ValueError, KeyError, TypeError, OSError) as e:
        raise ConfigError(f"cannot parse {suffix[1:]} file: {e}", key="path") from None
    if g.is_directed():
        g = g.to_undirected(as_view=False)
    if not list(g.nodes):
        raise ConfigError("empty topology: the graph has no nodes", key="path")
    return g


def _zoo_names(g: nx.Graph, ids: list, naming: str) -> list[str]:
    """Node names by ``node_names`` (see :func:`zoo`): identifier-safe labels or n0, n1, ..."""
    labels = [str(g.nodes[i].get("label", "")) for i in ids]
    safe = [_sanitize(x) for x in labels]
    labels_ok = all(s and NAME_RE.match(s) for s in safe) and len(set(safe)) == len(safe)
    if naming == "label" and not labels_ok:
        raise ConfigError("node labels are missing, duplicated or not usable as names; expected "
                          "node_names: index or auto", key="node_names")
    return safe if (naming == "label" or (naming == "auto" and labels_ok)) else _names(len(ids))


def _zoo_node_attrs(g: nx.Graph, ids: list, names: list[str]) -> tuple[dict[str, dict], dict[Any, tuple[float, float]]]:
    """node_attrs (``zoo_id``, ``label``, ``lat``/``lon`` when valid, ``country``) by name,
    and the coordinates of the nodes that have them, by file id."""
    attrs: dict[str, dict] = {}
    coords: dict[Any, tuple[float, float]] = {}
    for i, nm in zip(ids, names):
        d = g.nodes[i]
        a: dict[str, Any] = {"zoo_id": str(i)}
        if d.get("label") is not None:
            a["label"] = str(d["label"])
        lat, lon = _as_float(d.get("Latitude")), _as_float(d.get("Longitude"))
        if lat is not None and lon is not None and -90 <= lat <= 90 and -180 <= lon <= 180:
            a["lat"], a["lon"] = lat, lon
            coords[i] = (lat, lon)
        if isinstance(d.get("Country"), str):
            a["country"] = d["Country"]
        attrs[nm] = a
    return attrs, coords


def _zoo_links(g: nx.Graph, coords: dict, name_of: dict, use_speed: bool, rate_fallback: float,
               delay_fallback: float, kpm: float) -> list[Link]:
    """One symmetric link per node pair (self-loops dropped, parallel edges' rates added):
    the file's speed or ``rate_fallback``; great-circle delay or ``delay_fallback``."""
    merged: dict[frozenset, list] = {}
    order: list[tuple[Any, Any]] = []
    for u, v, d in g.edges(data=True):
        if u == v:
            continue
        key = frozenset((u, v))
        if key not in merged:
            merged[key] = []
            order.append((u, v))
        r = _zoo_rate(d) if use_speed else None
        merged[key].append(r if r is not None else rate_fallback)
    links = []
    for u, v in order:
        rate = float(sum(merged[frozenset((u, v))]))
        if u in coords and v in coords:
            delay = round(great_circle_km(*coords[u], *coords[v]) / kpm, 3)
        else:
            delay = delay_fallback
        d = LinkDir(rate_mbps=rate, delay_ms=delay)
        links.append(Link(name_of[u], name_of[v], d, d))
    return links


def _zoo_name(stem: str) -> str:
    return "zoo-" + (re.sub(r"[^A-Za-z0-9]+", "-", stem).strip("-").lower() or "graph")


# --------------------------------------------------------------------------- dispatch

GENERATORS: dict[str, Callable[..., Topology]] = {
    "mtree-random": mtree_random,
    "equinix-like": equinix_like,
    "idn-like": idn_like,
    "crew-mesh": crew_mesh,
    "kary-tree": kary_tree,
    "ring": ring,
    "mesh2d": mesh2d,
    "torus2d": torus2d,
    "star": star,
    "full-mesh": full_mesh,
    "leaf-spine": leaf_spine,
    "gpu-cluster": gpu_cluster,
    "bigraph": bigraph,
    "zoo": zoo,
}

#: Link fields any generator block (or ``defaults``) may set for every generated direction.
COMMON_PARAMS = ("jitter_ms", "distribution", "loss", "queue_pkts")
_MTREE_KW = ("sk", "seed", "rate_min_mbps", "rate_max_mbps", "rate_step_mbps", "delay_min_ms",
             "delay_max_ms", "delay_scaling", "asymmetric")


def _params_of(fn: Callable[..., Topology]) -> tuple[list[str], list[str]]:
    """(all accepted parameter names, required ones) of a generator function."""
    sig = inspect.signature(fn)
    names, required = [], []
    for p in sig.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            names.extend(k for k in _MTREE_KW if k not in names)
            continue
        names.append(p.name)
        if p.default is p.empty:
            required.append(p.name)
    return names, required


def build(spec: Any, *, source: str = "", key: str = "generator", base_dir: Path | None = None,
          link_defaults: Mapping[str, Any] | None = None) -> Topology:
    """Run the generator described by a ``generator:`` block, e.g.
    ``{kind: torus2d, rows: 4, cols: 4, rate_mbps: 100, delay_ms: 10}``.

    ``jitter_ms``, ``loss`` and ``queue_pkts`` (in the block, else in
    ``link_defaults``) are applied to every generated direction.  A relative zoo
    ``path`` is resolved against ``base_dir``.  Errors name ``source`` and
    ``key.<parameter>``."""
    if not isinstance(spec, Mapping):
        raise ConfigError(f"expected a mapping like {{kind: ring, n: 6}}, got {typename(spec)}",
                          source=source, key=key)
    if "kind" not in spec:
        raise ConfigError(f"missing 'kind' (expected one of: {', '.join(GENERATORS)})", source=source,
                          key=key_path(key, "kind"))
    kind = spec["kind"]
    if not isinstance(kind, str) or kind not in GENERATORS:
        import difflib

        hint = difflib.get_close_matches(str(kind), list(GENERATORS), n=1)
        raise ConfigError(f"unknown generator kind {kind!r} (expected one of: {', '.join(GENERATORS)})"
                          + (f"; did you mean {hint[0]!r}?" if hint else ""), source=source, key=key_path(key, "kind"))
    fn = GENERATORS[kind]
    accepted, required = _params_of(fn)
    params = {k: v for k, v in spec.items() if k != "kind"}
    extras = {f: v for f, v in (link_defaults or {}).items() if f in COMMON_PARAMS}
    for p in list(params):
        if p in COMMON_PARAMS:
            extras[p] = check_link_field(p, params.pop(p), source=source, key=key_path(key, p))
        elif p not in accepted:
            raise ConfigError(unknown_key_msg(f"generator {kind!r}", p, accepted + list(COMMON_PARAMS)),
                              source=source, key=key_path(key, str(p)))
    for p in required:
        if p not in params:
            raise ConfigError(f"missing parameter {p!r} for generator {kind!r}", source=source, key=key_path(key, p))
    if kind == "zoo" and isinstance(params.get("path"), str) and base_dir is not None:
        pp = Path(params["path"]).expanduser()
        if not pp.is_absolute() and not pp.is_file():
            params["path"] = str(Path(base_dir) / pp)
    try:
        topo = fn(**params)
    except ConfigError as e:
        raise ConfigError(e.message, source=source, key=key_path(key, e.key)) from None
    if extras:
        topo.links = [replace(l, ab=replace(l.ab, **extras), ba=replace(l.ba, **extras)) for l in topo.links]
    return topo
