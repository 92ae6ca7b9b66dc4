"""The strict bound's own packing, run as a plan: a reference scheme (ours, not a paper's).

:func:`testbed.planners.bound.optimum` packs pairs of a reduce in-tree and a broadcast
out-tree rooted at the same node, each pair taking its rate on every directed link it
uses, so that the rates add up to the bound's; every scheme of the model (all the shipped
AllReduce schemes) is a packing of such pairs, and this one is the fastest in the fluid
model.  This scheme runs that packing: pair ``k`` carries the share ``r_k / sum r`` of the
vector, cut into ``chunks`` pipelined chunks, reduced up its in-tree and broadcast down
its out-tree as it arrives at the root (:func:`testbed.plan.trees_plan`).  Measured against
the bound it separates the two factors of a scheme's efficiency: what the packing loses
to pipeline fill, TCP and the executor, with no loss to the plan's rate.

Choices (none is in a paper):

* Every pair gets the same chunk count, so a chunk takes the same time on every pair's
  links; ``chunks: auto`` (the default) keeps, of ``AUTO_CHUNKS``, the count the cost model
  predicts fastest (:func:`testbed.costmodel.fastest`).
* ``pace`` (default true): where pairs share a link direction their rates are the pairs'
  weights on the agents' shared links (caps on a connection per tree), scaled to fill the
  link (:func:`testbed.plan.contended_pacing`).
* The packing is the column generation's (:func:`~testbed.planners.bound.pack_arborescences`,
  its stopping rule): at its optimum it fills the bound's cut exactly, and it may hold
  pairs of tiny rate, which get tiny chunks.
"""

from __future__ import annotations

import networkx as nx

from testbed.plan import Plan, Tree, split_lengths, trees_plan
from testbed.planners import Param, ParamError, planner
from testbed.planners.bound import optimum
from testbed.planners.common import check_graph, is_auto, tree_pacing

AUTO_CHUNKS = (8, 16, 32, 64)  # chunks: auto picks one of these per pair


@planner(
    "packing", "testbed reference: planners.bound.optimum's packing of reduce/broadcast tree pairs, pipelined",
    chunks=Param((int, str), "auto", "chunks per tree pair (> 0); 'auto' = of "
                 f"{', '.join(map(str, AUTO_CHUNKS))} the count the cost model predicts fastest"),
    pace=Param(bool, True, "share a link direction among the pairs by their packed rates (weights on "
               "shared links, caps on a connection per tree); false = TCP sharing"),
)
def packing(graph: nx.DiGraph, length: int, *, elem_bytes: int, chunks: int | str = "auto", pace: bool = True
            ) -> Plan:
    """The strict bound's packing (:func:`~testbed.planners.bound.optimum`) of reduce in-tree
    and broadcast out-tree pairs, each carrying its rate's share of the vector, pipelined."""
    from testbed import costmodel

    check_graph(graph, "packing", min_nodes=2)
    opt = optimum(graph, length * elem_bytes)
    pairs = [t for t in opt["trees"] if t["rate_mbps"] > 0]
    total = sum(t["rate_mbps"] for t in pairs)
    nodes = sorted(graph.nodes)
    meta = {"rate_mbps": total, "bound_rate_mbps": opt["rate_mbps"], "bound": opt["bound"],
            "roots": [t["root"] for t in pairs], "packing_s": opt["planner_s"]}

    def compiled(count: int) -> Plan:
        sizes = split_lengths(length, [t["rate_mbps"] for t in pairs])
        trees = [Tree(t["root"], t["parent"], share=t["rate_mbps"] / total, chunks=max(1, min(count, size)),
                      rate_mbps=t["rate_mbps"], broadcast_parent=t["broadcast_parent"])
                 for t, size in zip(pairs, sizes)]
        return trees_plan("packing", nodes, length, trees, meta=dict(meta),
                          pace=tree_pacing(graph, trees, pace, "contended"))

    if not is_auto("chunks", chunks):
        if chunks < 1:
            raise ParamError("chunks", f"expected an integer >= 1 or 'auto', got {chunks!r}")
        return compiled(chunks)
    (_, plan), cct = costmodel.fastest(((c, compiled(c)) for c in AUTO_CHUNKS), graph, elem_bytes)
    plan.meta["chunk_cct_s"] = cct
    return plan
