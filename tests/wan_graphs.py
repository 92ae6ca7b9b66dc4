"""Small WAN graphs for planner tests (shared by the MTREE, bound and BLINK tests)."""

import networkx as nx
import numpy as np


def wan(edges, rate=None, delay=10.0):
    """Symmetric WAN from (u, v[, rate[, delay]]) tuples."""
    g = nx.DiGraph()
    for e in edges:
        u, v = e[0], e[1]
        r = e[2] if len(e) > 2 else rate
        d = e[3] if len(e) > 3 else delay
        g.add_edge(u, v, rate_mbps=float(r), delay_ms=float(d))
        g.add_edge(v, u, rate_mbps=float(r), delay_ms=float(d))
    return g


def random_wan(n, m, seed, lo=130, hi=270):
    """Connected random WAN: rates multiples of 10 in [lo, hi], delay 50-400 ms
    inversely proportional to rate (MTREE Sec. IV-A-2)."""
    rng = np.random.default_rng(seed)
    pairs = set()
    perm = rng.permutation(n)
    for k in range(1, n):
        a, b = perm[k], perm[rng.integers(k)]
        pairs.add((min(a, b), max(a, b)))
    while len(pairs) < m:
        a, b = rng.choice(n, 2, replace=False)
        pairs.add((min(a, b), max(a, b)))
    edges = []
    for a, b in sorted(pairs):
        r = float(rng.integers(lo // 10, hi // 10 + 1) * 10)
        d = 50 + 350 * (1 / r - 1 / hi) / (1 / lo - 1 / hi)
        edges.append((f"n{a}", f"n{b}", r, d))
    return wan(edges)
