"""2D-RING: ring AllReduce in one dimension of a 2D torus or mesh, then in the other (Ying et
al., TPU; MultiTree paper §V baseline "2D-Ring"; reading note shared/spec/004-multitree.md).

The vector is cut into ``cols`` blocks.  Every row runs a ring reduce-scatter, so the node in
column ``j`` holds block ``j`` summed over its row; every column ``j`` then cuts block ``j`` into
``rows`` parts and runs a ring reduce-scatter and all-gather of them, so every node of column
``j`` holds block ``j`` summed over the whole grid; the rows finish with a ring all-gather of
their blocks (part by part, each part as soon as it is complete).  Each node sends
``2 (cols - 1) / cols + 2 (rows - 1) / (rows * cols)`` of the vector, against a flat ring's
``2 (n - 1) / n``.  On a mesh the ring's wrap-around hop is routed over the row or column
(the paper: the slowest pair).  Choice, documented: one direction (rows first, or columns
with ``first: cols``), not two concurrent halves: the paper does not say how the TPU
implementation uses all links.

The grid comes from the topology's ``row``/``col`` node attributes (the ``torus2d``/``mesh2d``
generators set them); on any other WAN the nodes, in the topology's order, fill a
``rows`` x (n / rows) grid row by row (``rows`` 0: the most square grid), so the scheme runs
everywhere (a prime n makes one ring).
"""

from __future__ import annotations

import networkx as nx

from testbed.plan import Plan, ProgramBuilder, split_lengths
from testbed.planners import Param, ParamError, planner
from testbed.planners.common import check_graph

RING2D_REF = "2D ring AllReduce (Ying et al., 'Image classification at supercomputer scale', 2018); MultiTree paper §V"


def grid_of(graph: nx.DiGraph, rows: int) -> list[list[str]]:
    """The nodes as a grid (a list of rows): from ``row``/``col`` node attributes when every
    node has them and ``rows`` is 0, else the topology's node order row by row into ``rows``
    rows (0: the largest divisor of n not above its square root)."""
    nodes = list(graph.nodes)
    n = len(nodes)
    attrs = [graph.nodes[v] for v in nodes]
    if not rows and all("row" in a and "col" in a for a in attrs):
        r_n, c_n = 1 + max(a["row"] for a in attrs), 1 + max(a["col"] for a in attrs)
        cells = {(a["row"], a["col"]): v for a, v in zip(attrs, nodes)}
        if len(cells) == n == r_n * c_n:
            return [[cells[(r, c)] for c in range(c_n)] for r in range(r_n)]
    if not rows:
        rows = max(d for d in range(1, int(n ** 0.5) + 1) if n % d == 0)
    if n % rows:
        raise ParamError("rows", f"{rows} rows do not divide the {n} datacenters into a grid")
    cols = n // rows
    return [nodes[r * cols:(r + 1) * cols] for r in range(rows)]


@planner(
    "ring2d", RING2D_REF,
    rows=Param(int, 0, "grid rows; 0 = the topology's row/col attributes (torus2d, mesh2d), else the most "
                       "square grid of the nodes in topology order", ge=0),
    first=Param(str, "rows", "the dimension whose rings run first: rows (X) or cols (Y)", choices=("rows", "cols")),
)
def plan_ring2d(graph: nx.DiGraph, length: int, *, elem_bytes: int = 4, rows: int = 0, first: str = "rows") -> Plan:
    """2D ring AllReduce: reduce-scatter along one dimension, reduce-scatter and all-gather
    along the other, all-gather along the first."""
    nodes = check_graph(graph, "ring2d")
    grid = grid_of(graph, rows)
    if first == "cols":
        grid = [list(col) for col in zip(*grid)]
    R, C = len(grid), len(grid[0])
    b = ProgramBuilder(nodes)
    blocks = split_lengths(length, [1] * C)
    starts = [sum(blocks[:j]) for j in range(C)]
    for j in range(C):  # block j: owned by column j of every row
        parts = split_lengths(blocks[j], [1] * R)
        row_done, row_sent = _row_reduce_scatter(b, grid, j, starts[j], blocks[j])
        off = starts[j]
        for k, size in enumerate(parts):  # part k of block j: owned by row k of column j
            if size == 0:
                off += size
                continue
            _part_of_block(b, grid, j, k, off, size, row_done, row_sent)
            off += size
    return Plan("ring2d", nodes, length, b.programs,
                meta={"grid": grid, "rows": R, "cols": C, "first": first, "blocks": blocks})


def _row_reduce_scatter(b: ProgramBuilder, grid: list[list[str]], j: int, start: int, size: int
                        ) -> tuple[dict[int, list[int]], dict[tuple[int, int], int]]:
    """Block j's reduce-scatter along every row r, (r, j+1) ... -> (r, j).  Returns per row
    the receive completing the block at (r, j), and per (row, col) its send of the block."""
    R, C = len(grid), len(grid[0])
    row_done: dict[int, list[int]] = {}  # row -> [recv id completing block j at (row, j)]
    row_sent: dict[tuple[int, int], int] = {}  # (row, col) -> its reduce-scatter send of block j
    for r in range(R):  # reduce-scatter of block j along row r: (r, j+1) ... -> (r, j)
        last: list[int] = []
        for s in range(C - 1):
            p, q = (j + 1 + s) % C, (j + 2 + s) % C
            sid, rid = b.transfer(grid[r][p], grid[r][q], start, size, reduce=True, send_deps=last,
                                  phase="row reduce-scatter", flow=j, channel=0)
            row_sent[(r, p)] = sid
            last = [rid]
        row_done[r] = last
    return row_done, row_sent


def _part_of_block(b: ProgramBuilder, grid: list[list[str]], j: int, k: int, off: int, size: int,
                   row_done: dict[int, list[int]], row_sent: dict[tuple[int, int], int]) -> None:
    """Part k of block j (owned by row k of column j): reduce-scatter and all-gather along
    column j once the rows have reduced block j, then all-gather along every row."""
    R, C = len(grid), len(grid[0])
    have: dict[int, list[int]] = {}  # row -> ops after which (row, j) holds part k complete
    col_sent: dict[int, int] = {}
    last: list[int] = []
    for s in range(R - 1):  # column reduce-scatter: (k+1, j) ... -> (k, j)
        p, q = (k + 1 + s) % R, (k + 2 + s) % R
        sid, rid = b.transfer(grid[p][j], grid[q][j], off, size, reduce=True,
                              send_deps=last + row_done[p], recv_deps=row_done[q],
                              phase="column reduce-scatter", flow=C + j * R + k, channel=1)
        col_sent[p] = sid
        last = [rid]
    have[k] = last or row_done[k]
    for s in range(R - 1):  # column all-gather from (k, j)
        p, q = (k + s) % R, (k + s + 1) % R
        _, rid = b.transfer(grid[p][j], grid[q][j], off, size, reduce=False, send_deps=have[p],
                            recv_deps=[col_sent[q]], phase="column all-gather", flow=C + j * R + k,
                            channel=1)
        have[q] = [rid]
    for r in range(R):  # row all-gather of part k from (r, j)
        last = have[r]
        for s in range(C - 1):
            p, q = (j + s) % C, (j + s + 1) % C
            _, rid = b.transfer(grid[r][p], grid[r][q], off, size, reduce=False, send_deps=last,
                                recv_deps=[row_sent[(r, q)]], phase="row all-gather", flow=j, channel=0)
            last = [rid]
