"""HDRM: halving-doubling AllReduce with rank mapping (EFLOPS, Dong et al., HPCA'20; MultiTree
paper §V baseline "HDRM"; reading note shared/spec/004-multitree.md).

Recursive halving reduce-scatter (distances p/2, p/4, ..., 1: each rank sends the half of its
current segment its partner keeps and reduces the other half) then recursive doubling
all-gather (distances 1, 2, ..., p/2), 2 log2 p steps (Thakur, Rabenseifner & Gropp, IJHPCA
2005).  With n not a power of two, Rabenseifner's fold: of the first ``2 (n - p)`` ranks each
even one hands its vector to the next odd one, which takes part for both and returns the
result at the end (p = the largest power of two <= n).

Rank mapping (``mapping: bigraph``): EFLOPS maps ranks so that every pair is one host under an
upper-layer switch and one under a lower-layer switch of the BiGraph.  The paper gives no
rule; ours: partners differ in one bit of their rank, so upper-layer hosts take the ranks with
an even number of one bits and lower-layer hosts the odd ones, which puts every pair of every
step across the layers.  It applies when the hosts carry ``layer`` (the ``bigraph``
generator), n is a power of two and the layers are equal in size; otherwise (and with
``mapping: order``) ranks follow the topology's order, recorded in ``meta.mapping``.  Hops
between non-neighbours are routed; switches (``switch: true``) only forward.
"""

from __future__ import annotations

import networkx as nx

from testbed.plan import Plan, ProgramBuilder, split_lengths
from testbed.planners import Param, planner
from testbed.planners.common import check_graph, partial

HDRM_REF = "Halving-doubling with rank mapping (EFLOPS, Dong et al., HPCA 2020); MultiTree paper §V"


def bigraph_ranks(workers: list[str], layer: dict) -> list[str] | None:
    """Workers in rank order with every halving-doubling pair across the layers (upper: ranks
    with an even number of one bits), or None if that mapping does not apply."""
    n = len(workers)
    up = [w for w in workers if layer.get(w) == "upper"]
    lo = [w for w in workers if layer.get(w) == "lower"]
    if n < 2 or n & (n - 1) or len(up) != len(lo) or len(up) + len(lo) != n:
        return None
    ups, los = iter(up), iter(lo)
    return [next(los) if r.bit_count() % 2 else next(ups) for r in range(n)]


@planner(
    "hdrm", HDRM_REF,
    mapping=Param(str, "bigraph", "rank mapping: bigraph (every pair across the BiGraph's switch layers, where "
                                  "the hosts carry layer; else topology order) or order (topology order)",
                  choices=("bigraph", "order")),
)
def plan_hdrm(graph: nx.DiGraph, length: int, *, elem_bytes: int = 4, mapping: str = "bigraph") -> Plan:
    """Halving-doubling AllReduce (recursive halving reduce-scatter, recursive doubling
    all-gather) over the workers, ranks mapped onto the BiGraph's layers."""
    nodes = check_graph(graph, "hdrm")
    workers = [v for v in nodes if not graph.nodes[v].get("switch")]
    ranks = bigraph_ranks(workers, {v: graph.nodes[v].get("layer") for v in workers}) if mapping == "bigraph" else None
    used = "bigraph" if ranks else "order"
    ranks = ranks or workers
    n = len(ranks)
    p = 1 << (n.bit_length() - 1)
    extra = n - p
    b = ProgramBuilder(nodes)
    done: dict[str, list[int]] = {v: [] for v in ranks}  # each worker's ops of earlier steps
    for e in range(extra):  # fold: rank 2e hands its vector to rank 2e + 1
        sid, rid = b.transfer(ranks[2 * e], ranks[2 * e + 1], 0, length, reduce=True, phase="fold")
        done[ranks[2 * e]].append(sid)
        done[ranks[2 * e + 1]].append(rid)
    virt = [ranks[2 * e + 1] for e in range(extra)] + ranks[2 * extra:]  # the p ranks that halve and double
    seg = _halve(b, virt, length, done)
    _double(b, virt, seg, done)
    for e in range(extra):  # unfold: the result back to rank 2e
        b.transfer(ranks[2 * e + 1], ranks[2 * e], 0, length, reduce=False, send_deps=done[ranks[2 * e + 1]],
                   recv_deps=done[ranks[2 * e]], phase="unfold")
    return Plan("hdrm", nodes, length, b.programs, participants=partial(nodes, workers),
                receivers=partial(nodes, workers),
                meta={"ranks": ranks, "mapping": used, "power_of_two": p, "folded": extra,
                      "steps": 2 * (p.bit_length() - 1) + (2 if extra else 0)})


def _halve(b: ProgramBuilder, virt: list[str], length: int, done: dict[str, list[int]]) -> dict[int, tuple[int, int]]:
    """Recursive halving reduce-scatter over the power-of-two ranks ``virt``: at distance d
    (p/2, p/4, ..., 1) every rank keeps the half of its segment given by its bit d and adds
    the other half into its partner's.  Returns each rank's reduced segment (offset, length)."""
    p = len(virt)
    seg = {v: (0, length) for v in range(p)}  # virtual rank -> its current segment (offset, length)
    steps = []
    d = p >> 1
    while d:  # recursive halving: keep the lower half if the distance bit is 0
        new, ops = {}, []
        for v in range(p):
            off, ln = seg[v]
            lo_len, hi_len = split_lengths(ln, [1, 1])
            keep, give = ((off, lo_len), (off + lo_len, hi_len)) if not v & d else ((off + lo_len, hi_len), (off, lo_len))
            new[v] = keep
            if give[1]:
                ops.append((v, v ^ d, give))
        for v, w, (off, ln) in ops:
            sid, rid = b.transfer(virt[v], virt[w], off, ln, reduce=True, send_deps=done[virt[v]],
                                  recv_deps=done[virt[w]], phase="reduce-scatter", flow=d)
            steps.append((virt[v], sid, virt[w], rid))
        _commit(done, steps)
        seg, d = new, d >> 1
    return seg


def _double(b: ProgramBuilder, virt: list[str], seg: dict[int, tuple[int, int]], done: dict[str, list[int]]
            ) -> None:
    """Recursive doubling all-gather: at distance d (1, 2, ..., p/2) partners exchange the
    segments they own, each ending with their union."""
    p = len(virt)
    steps: list = []
    d = 1
    while d < p:  # recursive doubling: exchange the owned segments
        new = {}
        for v in range(p):
            off, ln = seg[v]
            w = v ^ d
            if ln:
                sid, rid = b.transfer(virt[v], virt[w], off, ln, reduce=False, send_deps=done[virt[v]],
                                      recv_deps=done[virt[w]], phase="all-gather", flow=d)
                steps.append((virt[v], sid, virt[w], rid))
            (a, la), (c, lc) = seg[v], seg[w]
            new[v] = (min(a, c), la + lc)
        _commit(done, steps)
        seg, d = new, d << 1


def _commit(done: dict[str, list[int]], steps: list) -> None:
    """A step's ops become dependencies of every later step (same-step ops stay independent, so
    the two partners' sends and receives of one exchange do not wait for each other)."""
    for src, sid, dst, rid in steps:
        done[src].append(sid)
        done[dst].append(rid)
    steps.clear()
