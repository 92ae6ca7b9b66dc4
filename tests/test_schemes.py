"""Every registered scheme, automatically: a new planner is covered without its author
adding it anywhere.

* its plan on a few small WANs passes ``Plan.validate`` and the in-memory interpreter
  gives every node that should finish the exact sum (AllReduce, and a partial reduce for
  schemes with an ``active`` group);
* ``make_plan`` stamps ``params``, ``planner_s`` and ``reference``;
* every declared parameter kind (datacenter, list of datacenters, choices, bounds, type)
  rejects a bad value with a ConfigError at the parameter's key path;
* a small run on a real emulated network with real agents is exact (``net``).
"""

import numpy as np
import pytest
from wan_graphs import random_wan

from testbed import config
from testbed.errors import ConfigError
from testbed.plan import check_allreduce
from testbed.planners import NODE, NODE_MAP, NODES, make_plan, schemes
from testbed.topology import load_topology

SCHEMES = sorted(schemes())
LENGTH = 1009  # prime: blocks, shards and chunks come out uneven


def _asymmetric(n=7, m=10, seed=3):
    """A random WAN where every third link direction runs at half the rate of the other."""
    g = random_wan(n, m, seed)
    for u, v in list(g.edges)[::3]:
        g[u][v]["rate_mbps"] *= 0.5
    return g


GRAPHS = {"small-3": lambda: load_topology("small-3").graph(),
          "quick-5": lambda: load_topology("quick-5").graph(),
          "star-5": lambda: load_topology("star-5").graph(),  # no Hamiltonian cycle, routed hops
          "asymmetric-7": _asymmetric}


def _inputs(plan, seed=0):
    rng = np.random.default_rng(seed)
    return {n: rng.integers(-999, 999, plan.length).astype(np.float64) for n in plan.nodes}


@pytest.mark.parametrize("graph_name", sorted(GRAPHS))
@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_scheme_reduces_exactly(scheme, graph_name):
    g = GRAPHS[graph_name]()
    plan = make_plan(scheme, g, LENGTH)
    plan.validate()
    assert plan.length == LENGTH and set(plan.nodes) == set(g.nodes)
    assert set(plan.finishing()) == set(plan.contributing()) == set(g.nodes)  # an AllReduce of every node
    check_allreduce(plan, _inputs(plan))  # raises unless every receiver holds the exact sum


def _group_param(spec):
    """The parameter naming the workers of a partial reduce (a list of datacenters, null = all)."""
    return next((k for k, p in spec.params.items() if p.kind == NODES and p.default is None), None)


@pytest.mark.parametrize("scheme", [s for s in SCHEMES if _group_param(schemes()[s])])
def test_every_partial_reduce_gives_its_group_the_exact_sum(scheme):
    g = GRAPHS["asymmetric-7"]()
    group = ["n1", "n4", "n6"]
    plan = make_plan(scheme, g, LENGTH, {_group_param(schemes()[scheme]): group})
    plan.validate()
    assert plan.contributing() == plan.finishing() == sorted(group, key=list(g.nodes).index)
    check_allreduce(plan, _inputs(plan, seed=1))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_make_plan_stamps_params_time_and_reference(scheme):
    spec = schemes()[scheme]
    assert spec.reference and spec.doc, scheme
    plan = make_plan(scheme, GRAPHS["quick-5"](), 100)
    assert plan.meta["params"] == {k: p.default for k, p in spec.params.items()}
    assert plan.meta["planner_s"] >= 0
    assert plan.meta["reference"] == spec.reference
    assert "paper" not in plan.meta  # one key for the reference


def _bad_values(name, p):
    """(value, expected key suffix, expected message) that the declaration must reject."""
    types = p.type if isinstance(p.type, tuple) else (p.type,)
    out = [(0.5 if dict in types else {"not": "valid"}, name, "expected")]
    if int in types and bool not in types:
        out.append((True, name, "expected"))
    if p.kind == NODE:
        out.append(("zz", name, "unknown datacenter 'zz'"))
    if p.kind == NODES:
        out.append((["h1", "zz"], f"{name}[1]", "unknown datacenter 'zz'"))
    if p.kind == NODE_MAP:
        out.append(({"h1": "zz"}, f"{name}.h1", "unknown datacenter 'zz'"))
    if p.choices:
        out.append(("no-such-choice", name, "expected one of"))
    step = 1 if float not in types else 0.5
    for bound, value in ((p.ge, None if p.ge is None else p.ge - step), (p.gt, p.gt),
                         (p.le, None if p.le is None else p.le + step), (p.lt, p.lt)):
        if bound is not None:
            out.append((value, name, "must be"))
    return out


CASES = [(s, k, v, key, msg) for s in SCHEMES for k, p in schemes()[s].params.items()
         for v, key, msg in _bad_values(k, p)]


@pytest.mark.parametrize("scheme, param, value, key, message", CASES,
                         ids=[f"{s}.{k}={v!r}" for s, k, v, _, _ in CASES])
def test_every_declared_parameter_kind_rejects_bad_values(scheme, param, value, key, message):
    g = GRAPHS["quick-5"]()
    with pytest.raises(ConfigError, match=message) as e:
        make_plan(scheme, g, 10, {param: value})
    assert e.value.key == f"scheme.{key}"
    with pytest.raises(ConfigError) as e:  # the experiment loader uses the same table
        config.validate({"name": "t", "topology": "quick-5", "scheme": {"name": "ring"},
                         "variants": [{"label": "v", "scheme": {"name": scheme, param: value}}]}, "exp.yaml")
    assert (e.value.source, e.value.key) == ("exp.yaml", f"variants[0].scheme.{key}")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_default_is_valid_and_unknown_parameters_are_rejected(scheme):
    spec = schemes()[scheme]
    nodes = list(GRAPHS["quick-5"]().nodes)
    for k, p in spec.params.items():
        p.check(p.default, k, nodes)  # raises if a default breaks its own declaration
    with pytest.raises(ConfigError, match="has no parameter 'warp'") as e:
        make_plan(scheme, GRAPHS["quick-5"](), 10, {"warp": 9})
    assert e.value.key == "scheme.warp"


def test_ints_widen_to_floats_and_tuples_to_lists():
    g = GRAPHS["quick-5"]()
    assert make_plan("mtree", g, 10, {"rho": 1}).meta["params"]["rho"] == 1.0
    assert make_plan("ring", g, 10, {"order": ("h1", "h2", "h3", "h4", "h5")}).meta["params"]["order"] == \
        ["h1", "h2", "h3", "h4", "h5"]


def test_errors_found_while_planning_carry_the_key_path():
    g = GRAPHS["quick-5"]()
    with pytest.raises(ConfigError, match="every ring member exactly once") as e:
        make_plan("ring", g, 10, {"order": ["h1", "h2"]}, key="variants[2].scheme", source="x.yaml")
    assert (e.value.source, e.value.key) == ("x.yaml", "variants[2].scheme.order")
    with pytest.raises(ConfigError, match="roots") as e:
        make_plan("netstorm", g, 10, {"roots": 6})
    assert e.value.key == "scheme.roots"


@pytest.mark.net
def test_every_scheme_gives_exact_results_on_a_real_network(netenv, tmp_path):
    """Real Mininet WAN, real agent processes, real TCP: every registered scheme once with each
    kind of data connection (one per neighbour shared by the trees, one per tree)."""
    from agents.executor import LINKS, links_for
    from testbed.emulator.hosts import EmulatedHosts
    from testbed.emulator.network import WanNetwork
    from testbed.hosts import run_agents

    topo = load_topology("quick-5")
    graph = topo.graph()
    with WanNetwork(topo) as net:
        for name in SCHEMES:
            plan = make_plan(name, graph, 5_000)
            for links in LINKS:
                res = run_agents(EmulatedHosts(net), plan, tmp_path / f"{name}-{links}", timeout_s=60, links=links)
                assert all(it["correct"] for it in res["iterations"]), (name, links)
                assert res["iterations"][0]["cct_s"] > 0 and res["connections"] == links_for(links, plan), name
