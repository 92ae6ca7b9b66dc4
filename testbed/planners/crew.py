"""CREW partial reduce (Luo et al., "Efficient Cross-Cloud Partial Reduce With CREW").

One partial-reduce task for a given group P of ready workers (the ``active`` parameter):
every worker of P cuts its model into ``k`` fixed-size chunks grouped into one block per
aggregator (Alg. 1, weights from LP (2)); phase 1 *weighted scatter* sends block j to
aggregator j, phase 2 *controlled reduce* adds the p copies at j, phase 3 *way-back
multicast* returns the reduced block j to every member of P.  CREW aggregates at all n
workers; OPR (the paper's "original partial reduce") is the same with the p members as
the only aggregators (``aggregators: members``).  The reduce is the sum (the paper says
"aggregate"; averaging is a local scaling by 1/p that moves no bytes).

The controller's FIFO ready queue that forms P at run time and its failover are in
agents/crew.py (``scheme.groups``); it calls this planner per group, with ``exclude``
(lost workers) and ``reassign`` (Eq. (3)'s replacement).

Non-blocking scatter (§IV-A2, Alg. 2; ``prescattered``): before P is known, every ready
worker sends its *default* blocks (LP (2) with P = N, Alg. 1) to every aggregator
(:func:`prescatter_plan`, one plan per sender, chunks in increasing index order); the task's
plan then uses Alg. 2's rearrangement of the default split for P's weights (:func:`rearrange`,
which moves the highest-indexed chunks: the last to be sent).  When P forms, the early
scatters are cut short; the task's plan scatters every chunk of every member, and at run time
a member *withdraws* (:mod:`agents.executor`) each chunk it already delivered to that chunk's
aggregator, whose agent adds the early copy into its input instead (agents/crew.py).  A chunk
delivered early to an aggregator Alg. 2 moved it away from is discarded there and sent again
("the worker will discard them", §IV-A2).  So the plan of a group does not depend on how far
each member's early scatter got, and one plan version serves every task of that group.
"""

from __future__ import annotations

import math

import networkx as nx
import numpy as np
from scipy.optimize import linprog

from testbed.plan import Plan, ProgramBuilder
from testbed.planners import NODE_MAP, NODES, Param, ParamError, planner
from testbed.planners.common import ACTIVE, check_graph, partial, path_rate
from testbed.planners.common import members as workers_of
from testbed.routing import data_paths

CREW_REF = "CREW (Luo et al.) §III-IV: weighted scatter, controlled reduce, way-back multicast; LP (2), Alg. 1"


def pair_rates(graph: nx.DiGraph) -> dict[tuple[str, str], float]:
    """b_{i,j} (Mbit/s) for every ordered pair: the link rate between neighbours, else the
    bottleneck of the routed path.  CREW assumes a full mesh of independent directed
    capacities (§II); on other topologies routed pairs that share a link are not
    independent, which this estimate ignores (a choice)."""
    return {pair: path_rate(graph, path) for pair, path in data_paths(graph).items()}


def phase_times(b: dict[tuple[str, str], float], x: dict[str, float], members: list[str]) -> tuple[float, float]:
    """Eqs. (1a)/(1b): T_scatter = max_j x_j / min_{i in P} b_{i,j}, T_multicast = max_j
    x_j / min_{i in P} b_{j,i} (i != j: b_{j,j} is "a large value"), model size 1."""
    t_s = max(w / min(b[(i, j)] for i in members if i != j) for j, w in x.items())
    t_m = max(w / min(b[(j, i)] for i in members if i != j) for j, w in x.items())
    return t_s, t_m


def scatter_weights(b: dict[tuple[str, str], float], members: list[str],
                    aggregators: list[str]) -> tuple[dict[str, float], float, float]:
    """LP (2): block weights x_j (sum 1) minimising T_scatter + T_multicast, Eqs. (1a)/(1b).

    Linearised: min s + m  s.t.  x_j <= s * B_in_j,  x_j <= m * B_out_j,  sum x_j = 1,
    where B_in_j = min over i in P, i != j of b_{i,j} and B_out_j = min of b_{j,i} (b_{j,j}
    is "a large value").  Returns (x, T_scatter, T_multicast) with times in units of
    model / (Mbit/s): multiply by the model size in Mbit for seconds.
    """
    n = len(aggregators)
    b_in = [min(b[(i, j)] for i in members if i != j) for j in aggregators]
    b_out = [min(b[(j, i)] for i in members if i != j) for j in aggregators]
    # variables: x_1..x_n, s, m
    cost = np.r_[np.zeros(n), 1.0, 1.0]
    a_ub = np.zeros((2 * n, n + 2))
    for j in range(n):
        a_ub[j, j], a_ub[j, n] = 1.0, -b_in[j]
        a_ub[n + j, j], a_ub[n + j, n + 1] = 1.0, -b_out[j]
    a_eq = np.r_[np.ones(n), 0.0, 0.0][None, :]
    res = linprog(cost, A_ub=a_ub, b_ub=np.zeros(2 * n), A_eq=a_eq, b_eq=[1.0], bounds=[(0, None)] * (n + 2),
                  method="highs")
    if res.status != 0:
        raise RuntimeError(f"CREW LP (2) failed: {res.message}")
    x = np.clip(res.x[:n], 0.0, None)
    weights = dict(zip(aggregators, map(float, x / x.sum())))
    return (weights, *phase_times(b, weights, members))


def split_model(weights: list[float], k: int, rounding: str = "floor") -> list[range]:
    """Alg. 1: chunk index ranges C_1..C_n (contiguous, in order) for weights x (sum 1).

    Alg. 1 (§IV-A) puts chunk j (1-based) in block i when l < j <= u, u = k * (x_1 + ... +
    x_i) real, i.e. block i's upper bound is floor(u): ``rounding="floor"`` (the default, as
    printed).  ``"nearest"`` rounds u instead (our variant): every block is then within half
    a chunk of x_i k on both ends, where floor leaves each block's remainder to the next one
    and the last block is the largest (weights 1/3 each, k = 10: {1-3}, {4-6}, {7-10} floor,
    {1-3}, {4-7}, {8-10} nearest).  Nearest is not clearly better: over 60 random groups on
    CREW's N2 meshes (k = 8n, 20, 64) the cost model's CCT averaged 2.6 % (floor) and 2.3 %
    (nearest) above the better of the two, both at most 20 %; so the paper's floor is the
    default.  Either way the bounds are non-decreasing, the last is k
    (a relative tolerance of 1e-9 keeps floating-point sums from losing a chunk: x = 0.1 x 10,
    k = 10 loses chunk 10 if the bounds are truncated naively)."""
    total = math.fsum(weights)
    cut = math.floor if rounding == "floor" else round
    bounds, acc = [0], 0.0
    for w in weights[:-1]:
        acc += w
        u = k * acc / total + (1e-9 * k if rounding == "floor" else 0.0)
        bounds.append(min(k, max(bounds[-1], cut(u))))
    bounds.append(k)
    return [range(lo, hi) for lo, hi in zip(bounds, bounds[1:])]


def rearrange(blocks: list[list[int]], weights: list[float], rounding: str = "floor") -> tuple[list[list[int]], int]:
    """Alg. 2 (§IV-A2): the split ``blocks`` (chunk indexes per aggregator, k in all)
    adjusted to new ``weights``: block i gives up its d_i largest indexes when it holds
    d_i more chunks than its new share, and blocks short of chunks take the smallest of
    those (the largest indexes are the ones not sent yet: workers send in increasing order).
    New sizes are Alg. 1's (:func:`split_model`, same rounding; the paper's (u - l) is
    fractional), so each chunk moves at most once.  Returns (new blocks, chunks moved)."""
    k = sum(len(b) for b in blocks)
    target = [len(r) for r in split_model(weights, k, rounding)]
    out = [sorted(b) for b in blocks]
    spare: list[int] = []
    for i, t in enumerate(target):
        if len(out[i]) > t:
            spare += out[i][t:]
            out[i] = out[i][:t]
    spare.sort()
    moved = len(spare)
    for i, t in enumerate(target):
        if len(out[i]) < t:
            need = t - len(out[i])
            out[i] = sorted(out[i] + spare[:need])
            spare = spare[need:]
    return out, moved


def _ranges(chunks: list[int], edges: list[int]) -> list[list[int]]:
    """Element ranges [lo, hi) of chunk indexes (adjacent chunks merged)."""
    out: list[list[int]] = []
    for c in sorted(chunks):
        if out and out[-1][1] == edges[c]:
            out[-1][1] = edges[c + 1]
        else:
            out.append([edges[c], edges[c + 1]])
    return out


def default_split(graph: nx.DiGraph, length: int, aggs: list[str], split: str, chunks: int,
                  rounding: str) -> tuple[int, list[int], dict[str, list[int]]]:
    """§IV-A2's default plan, P = N: (k, chunk edges in elements, aggregator -> chunk indexes)."""
    b = pair_rates(graph)
    if split == "network-aware":
        x, _, _ = scatter_weights(b, list(graph.nodes), aggs)
    else:
        x = {j: 1.0 / len(aggs) for j in aggs}
    k = min(chunks or 8 * len(aggs), length)
    return k, [c * length // k for c in range(k + 1)], \
        {j: list(r) for j, r in zip(aggs, split_model([x[j] for j in aggs], k, rounding))}


def prescatter_plan(graph: nx.DiGraph, length: int, sender: str, *, split: str = "network-aware",
                    chunks: int = 0, rounding: str = "floor", exclude=(), scheduling: str = "fcfs") -> Plan:
    """Non-blocking scatter (§IV-A2) of one ready worker before P is known: ``sender`` sends
    default block j (:func:`default_split`) to every other aggregator j, one transfer per
    chunk in increasing index order (on one connection per pair: they leave in that order);
    each j receives into its ``x`` (overwrite), from where the agent takes the chunks j keeps
    once P is formed.  ``scheduling``: the scheme's (§IV-C; fcfs: these flows take their turn
    with the tasks' on every link)."""
    nodes = check_graph(graph, "crew")
    aggs = [j for j in nodes if j not in set(exclude or ())]
    k, edges, blocks = default_split(graph, length, aggs, split, chunks, rounding)
    bld = ProgramBuilder(nodes)
    for f, j in enumerate(aggs):
        if j != sender:
            for c in blocks[j]:
                bld.transfer(sender, j, edges[c], edges[c + 1] - edges[c], reduce=False, flow=f, chunk=c,
                             phase="prescatter")
    return Plan("crew-prescatter", nodes, length, bld.programs, participants=[sender],
                receivers=[j for j in aggs if j != sender], meta={"sender": sender, "chunks": k,
                                                                "blocks": blocks, "scheduling": scheduling})


@planner(
    "crew", CREW_REF,
    active=ACTIVE,  # the group P of this partial reduce; null = every node (CREW is then an AllReduce)
    aggregators=Param(str, "all", "all = every worker aggregates a block (CREW); members = only P (OPR)",
                      choices=("all", "members")),
    split=Param(str, "network-aware", "block weights: network-aware = LP (2) (N-A), even = 1/aggregators (E-D)",
                choices=("network-aware", "even")),
    chunks=Param(int, 0, "k, fixed-size chunks of the model (paper: k >> n, value not given); 0 = 8 per "
                         "aggregator", ge=0),
    pipelined=Param(bool, True, "multicast each chunk once its p copies are reduced (true) or a block only once "
                                "all of it is reduced (false: completion about T, the bound's upper end)"),
    rounding=Param(str, "floor", "Alg. 1 block bounds: floor = as printed (l < j <= u); nearest = round u "
                                 "(each block within half a chunk of its weight)", choices=("floor", "nearest")),
    exclude=Param(list, [], "workers that aggregate nothing (lost ones, §IV-B: G rebuilt without them; LP (2) "
                            "over the rest)", kind=NODES),
    reassign=Param(dict, {}, "failover, Eq. (3): {j: k} aggregator j's block (its LP (2) weight) goes to k",
                   kind=NODE_MAP),
    scheduling=Param(str, "fcfs", "fcfs = flows on a pair served whole in the order they became ready, within a "
                                  "task (one connection) and across concurrent tasks (one gate per link, "
                                  "agents.executor.LinkGate) (FL-FCFS, §IV-C); fs = every flow on its own "
                                  "connection, sharing the link (FS)", choices=("fcfs", "fs")),
    prescattered=Param(bool, False, "non-blocking scatter (§IV-A2): members began sending their default blocks "
                                    "(P = N) before P formed; blocks by Alg. 2, chunks already delivered are "
                                    "withdrawn at run time"),
)
def plan_crew(graph: nx.DiGraph, length: int, *, elem_bytes: int = 4, active=None, aggregators: str = "all",
              split: str = "network-aware", chunks: int = 0, pipelined: bool = True,
              scheduling: str = "fcfs", rounding: str = "floor", exclude=(), reassign=None,
              prescattered: bool = False) -> Plan:
    """CREW (or OPR) partial reduce of group ``active`` (§III, LP (2), Alg. 1, FL-FCFS);
    ``exclude`` and ``reassign``: the run-time failover (agents/crew.py)."""
    nodes = check_graph(graph, "crew")
    members = workers_of(graph, active)
    aggs, reassign = _aggregators(nodes, members, aggregators, exclude, reassign)
    x, t_s, t_m, aggs = _weights(graph, members, aggs, split, reassign)
    moved = 0
    if prescattered:
        if aggregators != "all":
            raise ParamError("prescattered", "needs every worker as an aggregator (CREW): OPR's aggregators "
                                             "are P, unknown before P forms")
        k, edges, blocks, kept, moved = _prescattered_blocks(graph, length, nodes, aggs, x, exclude, reassign,
                                                             split, chunks, rounding)
    else:
        k = min(chunks or 8 * len(aggs), length)
        blocks = dict(zip(aggs, split_model([x[j] for j in aggs], k, rounding)))
        edges = [c * length // k for c in range(k + 1)]  # chunk c = elements [edges[c], edges[c + 1])
    programs = _programs(nodes, members, aggs, blocks, edges, pipelined, scheduling)
    model_mbit = length * elem_bytes * 8 / 1e6
    meta = {
        "members": members,
        "aggregators": aggs,
        "aggregators_rule": aggregators,
        "exclude": list(exclude or ()),
        "reassign": reassign,
        "split": split,
        "weights": x,
        "chunks": k,
        "rounding": rounding,
        "blocks": {j: [r.start, r.stop] for j, r in blocks.items()} if not prescattered
        else {j: _ranges(c, list(range(k + 1))) for j, c in blocks.items()},  # chunk index ranges
        **({"prescattered": True, "moved_chunks": moved,
            "kept": {j: _ranges(kept[j], edges) for j in aggs}} if prescattered else {}),
        "pipelined": pipelined,
        "scheduling": scheduling,
        "t_scatter_s": t_s * model_mbit,
        "t_multicast_s": t_m * model_mbit,
        "bound_s": [(t_s + t_m) * model_mbit / 2, (t_s + t_m) * model_mbit],  # T/2 <= T_CREW <= T (§III)
    }
    return Plan("crew", nodes, length, programs, participants=partial(nodes, members),
                receivers=partial(nodes, members), meta=meta)


def _aggregators(nodes: list[str], members: list[str], aggregators: str, exclude, reassign
                 ) -> tuple[list[str], dict[str, str]]:
    """The aggregators (all workers for CREW, P for OPR, §III) without the ``exclude``d ones
    (§IV-B), and the checked failover map ``reassign`` (Eq. (3))."""
    aggs = [j for j in (nodes if aggregators == "all" else members) if j not in set(exclude or ())]
    reassign = dict(reassign or {})
    for j, r in reassign.items():
        if j not in aggs or r not in aggs or r in reassign:
            raise ParamError("reassign", f"expected {{aggregator: replacement}} between aggregators, the replacement "
                                         f"keeping its own block; got {j} -> {r}")
    if not aggs:
        raise ParamError("exclude", "no aggregator left")
    return aggs, reassign


def _weights(graph: nx.DiGraph, members: list[str], aggs: list[str], split: str, reassign: dict[str, str]
             ) -> tuple[dict[str, float], float, float, list[str]]:
    """Block weights x (LP (2), or even), the scatter and multicast times per Mbit of model
    (§III), and the aggregators left after Eq. (3)'s failover moved each reassigned block."""
    b = pair_rates(graph)
    if split == "network-aware":
        x, t_s, t_m = scatter_weights(b, members, aggs)
    else:
        x = {j: 1.0 / len(aggs) for j in aggs}
        t_s, t_m = phase_times(b, x, members)
    if reassign:  # Eq. (3): the replacement takes over j's block on top of its own
        for j, r in reassign.items():
            x[r] += x.pop(j)
        aggs = [j for j in aggs if j not in reassign]
        t_s, t_m = phase_times(b, x, members)
    return x, t_s, t_m, aggs


def _prescattered_blocks(graph: nx.DiGraph, length: int, nodes: list[str], aggs: list[str], x: dict[str, float],
                         exclude, reassign: dict[str, str], split: str, chunks: int, rounding: str
                         ) -> tuple[int, list[int], dict[str, list[int]], dict[str, list[int]], int]:
    """Non-blocking scatter (§IV-A2): the default split (P = N, :func:`default_split`)
    rearranged by Alg. 2 for the weights ``x``, with Eq. (3)'s reassigned chunks.  Returns
    (k, chunk edges, aggregator -> chunk indexes, the early copies each may keep, chunks
    moved)."""
    default_aggs = [j for j in nodes if j not in set(exclude or ())]
    k, edges, default = default_split(graph, length, default_aggs, split, chunks, rounding)
    new, moved = rearrange([default[j] for j in default_aggs], [x.get(j, 0.0) for j in default_aggs], rounding)
    start = dict(zip(default_aggs, new))
    for j, r in reassign.items():  # Eq. (3): j's chunks to r, none of them at r yet
        start[r] = sorted(start[r] + start.pop(j))
    blocks = {j: start[j] for j in aggs}
    kept = {j: sorted(set(blocks[j]) & set(default[j])) for j in aggs}  # early copies j may keep
    return k, edges, blocks, kept, moved


def _programs(nodes: list[str], members: list[str], aggs: list[str], blocks: dict, edges: list[int],
              pipelined: bool, scheduling: str) -> dict[str, list]:
    """The three phases (§III) per aggregator j: weighted scatter of block j from every
    other member, controlled reduce at j, way-back multicast of each chunk once its copies
    are added (``pipelined``) or of the block once all of it is."""
    bld = ProgramBuilder(nodes)
    mc_channel = 0 if scheduling == "fcfs" else 1
    for f, j in enumerate(aggs):
        peers = [i for i in members if i != j]  # initiators that scatter to j and get block j back
        sent: dict[tuple[str, int], int] = {}
        reduced: list[int] = []  # recv ids at j so far (whole block when not pipelined)
        for c in blocks[j]:
            off, size = edges[c], edges[c + 1] - edges[c]
            got = []
            for i in peers:
                sent[(i, c)], r = bld.transfer(i, j, off, size, reduce=True, flow=f, chunk=c, phase="scatter")
                got.append(r)
            reduced += got
            if pipelined:
                for i in peers:
                    bld.transfer(j, i, off, size, reduce=False, send_deps=got, recv_deps=[sent[(i, c)]]
                                 if (i, c) in sent else [], channel=mc_channel, flow=f, chunk=c, phase="multicast")
        if not pipelined:
            for c in blocks[j]:
                off, size = edges[c], edges[c + 1] - edges[c]
                for i in peers:
                    bld.transfer(j, i, off, size, reduce=False, send_deps=reduced, recv_deps=[sent[(i, c)]]
                                 if (i, c) in sent else [], channel=mc_channel, flow=f, chunk=c, phase="multicast")
    return bld.programs
