"""The strict bound's own packing, run as a plan: a reference scheme (ours, not a paper's).

:func:`testbed.planners.bound.optimum` packs pairs of a reduce in-tree and a broadcast
out-tree rooted at the same node, each pair taking its rate on every directed link it
uses, so that the rates add up to the bound's; every scheme of the model (all the shipped
AllReduce schemes) is a packing of such pairs, and this one is the fastest in the fluid
model.  This scheme runs such a packing: pair ``k`` carries the share ``r_k / sum r`` of the
vector, cut into ``chunks`` pipelined chunks, reduced up its in-tree and broadcast down
its out-tree as it arrives at the root (:func:`testbed.plan.trees_plan`).  Measured against
the bound it separates the two factors of a scheme's efficiency: what the packing loses
to pipeline fill, TCP and the executor, with no loss to the plan's rate.

Choices (none is in a paper):

* Every pair gets the same chunk count, so a chunk takes the same time on every pair's
  links; ``chunks: auto`` (the default) keeps, of ``AUTO_CHUNKS``, the count the cost model
  predicts fastest (:func:`testbed.costmodel.fastest`), trying them in rising order until
  two in a row predict slower than the best (more chunks: less pipeline fill, more
  transfers; the prediction falls, then rises).
* ``pace`` (default true): where pairs share a link direction their rates are the pairs'
  weights on the agents' shared links (caps on a connection per tree), scaled to fill the
  link (:func:`testbed.plan.contended_pacing`).
* ``headroom``: the optimum found by column generation
  (:func:`~testbed.planners.bound.pack_arborescences`) fills many link directions exactly,
  not only those of the smallest cut, which every packing at the bound's rate must fill.
  With ``headroom: h`` the packing is made on the WAN with every link direction outside
  that cut at ``1 - h`` of its rate, so that the others keep slack to make up for a moment
  with nothing to send; ``auto`` takes the largest of ``HEADROOM_STEPS`` at which the
  packing still reaches the bound's rate (none where the bound is not the cut's alone); 0
  (the default) runs the bound's own packing.  The packing may hold pairs of tiny rate,
  which get tiny chunks.
* ``max_height``: pack only pairs whose two trees are at most that many hops deep
  (column generation priced by :func:`~testbed.planners.bound.bounded_arborescence`);
  the rate may fall below the bound's.  ``auto`` (the default) takes the lowest height at
  which the packing keeps the bound's rate (3 on NetStorm's overlay and GScale-12, where
  the bound's own pairs are up to six and nine deep; 2 on equinix-like-20 and
  idn-like-40).  0: any height, the bound's own packing.

A pair broadcasts on a connection of its own (:func:`testbed.plan.tree_channels`), so
where its two trees cross one link direction its broadcast chunks do not queue behind its
reduce chunks.
"""

from __future__ import annotations

import networkx as nx

from testbed.plan import Plan, Tree, split_lengths, trees_plan
from testbed.planners import Param, ParamError, planner
from testbed.planners.bound import optimum
from testbed.planners.common import check_graph, chunked, tree_pacing

AUTO_CHUNKS = (1, 2, 4, 8, 16, 32, 64)  # chunks: auto picks one of these per pair
AUTO_PATIENCE = 2  # and stops once two counts in a row are predicted slower than the best
HEADROOM_STEPS = (0.2, 0.15, 0.1, 0.05)  # headroom: auto tries these, largest first


@planner(
    "packing", "testbed reference: planners.bound.optimum's packing of reduce/broadcast tree pairs, pipelined",
    chunks=Param((int, str), "auto", "chunks per tree pair (> 0); 'auto' = of "
                 f"{', '.join(map(str, AUTO_CHUNKS))} the count the cost model predicts fastest"),
    pace=Param(bool, True, "share a link direction among the pairs by their packed rates (weights on "
               "shared links, caps on a connection per tree); false = TCP sharing"),
    headroom=Param((float, str), 0.0, "pack with the link directions outside the bound's smallest cut at "
                   "(1 - headroom) of their rates; 'auto' = the largest of "
                   f"{', '.join(map(str, HEADROOM_STEPS))} that keeps the bound's rate, else 0; 0 = the bound's "
                   "own packing"),
    max_height=Param((int, str), "auto", "pack only trees at most this many hops deep (the rate may then fall "
                     "below the bound's); 'auto' = the lowest height at which the packing keeps the bound's rate; "
                     "0 = any height (the bound's own packing)"),
)
def packing(graph: nx.DiGraph, length: int, *, elem_bytes: int, chunks: int | str = "auto", pace: bool = True,
            headroom: float | str = 0.0, max_height: int | str = "auto") -> Plan:
    """A packing at the strict bound's rate (:func:`~testbed.planners.bound.optimum`; by default
    of the lowest trees that reach it) of reduce in-tree and broadcast out-tree pairs, each
    carrying its rate's share of the vector, pipelined."""
    check_graph(graph, "packing", min_nodes=2)
    if isinstance(chunks, int) and chunks < 1:
        raise ParamError("chunks", f"expected an integer >= 1 or 'auto', got {chunks!r}")
    opt, kept, height = _packed(graph, length * elem_bytes, headroom, max_height)
    pairs = [t for t in opt["trees"] if t["rate_mbps"] > 0]
    total = sum(t["rate_mbps"] for t in pairs)
    nodes = sorted(graph.nodes)
    meta = {"rate_mbps": total, "bound_rate_mbps": opt["rate_mbps"], "headroom": kept, "max_height": height,
            "roots": [t["root"] for t in pairs]}
    sizes = split_lengths(length, [t["rate_mbps"] for t in pairs])

    def compiled(count: int) -> Plan:
        trees = [Tree(t["root"], t["parent"], share=t["rate_mbps"] / total, chunks=max(1, min(count, size)),
                      rate_mbps=t["rate_mbps"], broadcast_parent=t["broadcast_parent"])
                 for t, size in zip(pairs, sizes)]
        return trees_plan("packing", nodes, length, trees, meta=dict(meta),
                          pace=tree_pacing(graph, trees, pace, "contended"))

    return chunked(compiled, chunks, AUTO_CHUNKS, graph, elem_bytes, patience=AUTO_PATIENCE)


def _packed(graph: nx.DiGraph, size_bytes: float, headroom: float | str, max_height: int | str
            ) -> tuple[dict, float, int | None]:
    """The packing to run, the headroom it keeps and the height it is bounded by (module
    doc): optimum's on ``graph`` with the link directions outside its smallest cut at
    ``1 - headroom`` of their rates, its trees at most that height deep.  Its ``rate_mbps``
    is the bound of ``graph`` itself."""
    auto = headroom == "auto"
    if not auto and not (isinstance(headroom, float) and 0 <= headroom < 1):
        raise ParamError("headroom", f"expected a number in [0, 1) or 'auto', got {headroom!r}")
    bound = optimum(graph, size_bytes)
    opt, height = _lowest(graph, size_bytes, bound, max_height)
    cut = bound["cut"]
    inside = {(u, v) for u in cut.get("from", ()) for v in cut.get("to", ())}
    for h in HEADROOM_STEPS if auto else (headroom,) if headroom else ():
        slack = graph.copy()
        for u, v, d in slack.edges(data=True):
            if (u, v) not in inside:
                d["rate_mbps"] *= 1 - h
        packed = optimum(slack, size_bytes, max_height=height)
        if not auto or packed["packing_rate_mbps"] >= opt["packing_rate_mbps"] * (1 - 1e-3):
            return {**packed, "rate_mbps": bound["rate_mbps"]}, h, height
    return opt, 0.0, height


def _lowest(graph: nx.DiGraph, size_bytes: float, bound: dict, max_height: int | str) -> tuple[dict, int | None]:
    """The packing of trees at most ``max_height`` deep (0: ``bound``'s own, of any height;
    'auto': the lowest height at which it keeps ``bound``'s packing rate) and that height
    (None: any), with ``bound``'s ``rate_mbps``."""
    if max_height == 0:
        return bound, None
    if max_height != "auto" and not (isinstance(max_height, int) and max_height > 0):
        raise ParamError("max_height", f"expected an integer >= 0 or 'auto', got {max_height!r}")
    for height in range(1, len(graph)) if max_height == "auto" else (max_height,):  # n - 1 hops fit any tree
        low = optimum(graph, size_bytes, max_height=height)
        if max_height != "auto" or low["packing_rate_mbps"] >= bound["packing_rate_mbps"] * (1 - 1e-3):
            break
    if low["packing_rate_mbps"] <= 0:
        raise ParamError("max_height", f"no node reaches every other within {max_height} hops and back")
    return {**low, "rate_mbps": bound["rate_mbps"]}, height
