"""2D-RING (testbed/planners/ring2d.py) against its description (MultiTree §V baseline)."""

import numpy as np
import pytest

from testbed.errors import ConfigError
from testbed.plan import check_allreduce
from testbed.planners import make_plan
from testbed.topogen import build
from testbed.topology import load_topology


def _exact(plan):
    plan.validate()
    rng = np.random.default_rng(0)
    check_allreduce(plan, {v: rng.integers(-99, 99, plan.length).astype(np.float64) for v in plan.nodes})


@pytest.mark.parametrize("spec", [{"kind": "torus2d", "rows": 4, "cols": 4}, {"kind": "torus2d", "rows": 3, "cols": 5},
                                  {"kind": "mesh2d", "rows": 2, "cols": 3}, {"kind": "mesh2d", "rows": 4, "cols": 4}])
@pytest.mark.parametrize("first", ["rows", "cols"])
def test_rings_along_the_grid_reduce_exactly(spec, first):
    g = build(spec).graph()
    plan = make_plan("ring2d", g, 1009, {"first": first})
    _exact(plan)
    R, C = (spec["rows"], spec["cols"]) if first == "rows" else (spec["cols"], spec["rows"])
    assert (plan.meta["rows"], plan.meta["cols"]) == (R, C)
    grid = plan.meta["grid"]
    assert all(g.nodes[v]["row" if first == "rows" else "col"] == r for r, line in enumerate(grid) for v in line)
    # every node sends 2 (C-1)/C of the vector along its row and 2 (R-1)/(R C) along its column
    per_node = plan.bytes_sent(1) / len(g) / plan.length
    assert per_node == pytest.approx(2 * (C - 1) / C + 2 * (R - 1) / (R * C), rel=0.02)
    transfers = [(src, op.peer) for src, op in plan.transfers()]
    same_line = all(any(src in line and dst in line for line in grid) or any(
        src in col and dst in col for col in zip(*grid)) for src, dst in transfers)
    assert same_line  # every transfer stays in a row or a column
    if spec["kind"] == "torus2d":  # rings of a torus are its links: one hop each
        assert all(g.has_edge(src, dst) for src, dst in transfers)
    else:  # a mesh has no wrap-around link: that hop is routed
        assert not all(g.has_edge(src, dst) for src, dst in transfers)


def test_any_wan_becomes_a_grid_in_topology_order():
    g = load_topology("quick-5").graph()
    plan = make_plan("ring2d", g, 500)
    _exact(plan)
    assert plan.meta["rows"] == 1 and plan.meta["grid"][0] == list(g.nodes)  # a prime n: one ring
    g6 = build({"kind": "ring", "n": 6}).graph()
    assert make_plan("ring2d", g6, 500).meta["rows"] == 2
    with pytest.raises(ConfigError, match="scheme.rows"):
        make_plan("ring2d", g, 500, {"rows": 2})
