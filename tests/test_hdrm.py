"""HDRM (testbed/planners/hdrm.py) and the BiGraph generator, against their description."""

import numpy as np
import pytest

from testbed.plan import check_allreduce
from testbed.planners import make_plan
from testbed.topogen import build


def _exact(plan):
    plan.validate()
    rng = np.random.default_rng(0)
    check_allreduce(plan, {v: rng.integers(-99, 99, plan.length).astype(np.float64) for v in plan.nodes})


def test_bigraph_generator():
    g = build({"kind": "bigraph", "upper": 2, "lower": 2, "hosts_per_switch": 8}).graph()
    hosts = [v for v in g.nodes if not g.nodes[v].get("switch")]
    assert len(hosts) == 32 and len(g.nodes) == 36
    assert all(g.has_edge(f"up{i}", f"lo{j}") for i in range(2) for j in range(2))
    assert not g.has_edge("up0", "up1") and not g.has_edge("lo0", "lo1")
    assert sum(g.nodes[h]["layer"] == "upper" for h in hosts) == 16


@pytest.mark.parametrize("per", [4, 8])
def test_every_pair_crosses_the_layers_on_a_bigraph(per):
    """EFLOPS' rank mapping: every exchange is between an upper-layer and a lower-layer host;
    2 log2 n steps; each host sends 2 (n - 1) / n of the vector."""
    g = build({"kind": "bigraph", "upper": 2, "lower": 2, "hosts_per_switch": per}).graph()
    plan = make_plan("hdrm", g, 4099)
    _exact(plan)
    n = 4 * per
    assert plan.meta["mapping"] == "bigraph" and plan.meta["steps"] == 2 * (n.bit_length() - 1)
    layer = {v: g.nodes[v].get("layer") for v in g.nodes}
    pairs = [(src, op.peer) for src, op in plan.transfers()]
    assert pairs and all({layer[a], layer[b]} == {"upper", "lower"} for a, b in pairs)
    assert plan.bytes_sent(1) / n / plan.length == pytest.approx(2 * (n - 1) / n, rel=0.01)
    unmapped = make_plan("hdrm", g, 4099, {"mapping": "order"})
    assert unmapped.meta["mapping"] == "order"
    assert any(layer[a] == layer[op.peer] for a, op in unmapped.transfers())


@pytest.mark.parametrize("n", [2, 3, 5, 6, 7, 8, 12])
def test_any_number_of_workers_folds_to_a_power_of_two(n):
    g = build({"kind": "full-mesh", "n": n}).graph()
    plan = make_plan("hdrm", g, 1009)
    _exact(plan)
    p = 1 << (n.bit_length() - 1)
    assert plan.meta["power_of_two"] == p and plan.meta["folded"] == n - p
    phases = {op.phase for _, op in plan.transfers()}
    assert ("fold" in phases) == (n != p) == ("unfold" in phases)
