"""Versioned plans and policy switches (NetStorm §VII-A) on real agent processes over loopback:
a new plan every iteration, every iteration exactly checked."""

from __future__ import annotations

from test_agents import check_results, two_tree_plan

from agents.local import LocalCluster
from testbed.plan import Plan, Tree, trees_plan


def other_plan(length: int) -> Plan:
    """Same five nodes, different trees, channels and chunking than two_tree_plan."""
    nodes = [f"h{i}" for i in range(5)]
    t1 = Tree("h2", {"h2": None, "h0": "h2", "h1": "h0", "h3": "h2", "h4": "h3"}, share=0.3, chunks=2)
    t2 = Tree("h1", {"h1": None, "h4": "h1", "h0": "h1", "h2": "h4", "h3": "h2"}, share=0.3, chunks=5)
    t3 = Tree("h3", {"h3": None, "h0": "h3", "h1": "h3", "h2": "h3", "h4": "h3"}, share=0.4, chunks=1)
    return trees_plan("other", nodes, length, [t1, t2, t3])


def test_fifty_switches_every_iteration_exact():
    length = 50_021
    plans = [two_tree_plan(length, chunks=3), other_plan(length)]
    asked = []

    def policy(it, netstate):
        asked.append(it)
        return plans[it % 2]

    # uneven compute: some agents start sending an iteration while others still wait for its GO
    compute = {"h0": [0.0, 0.01, 0.0], "h3": [0.02, 0.0]}
    with LocalCluster(plans[0], iterations=53, timeout_s=20, compute_s=compute) as cluster:
        cluster.coordinator.policy = policy
        res = cluster.run()
    assert asked == list(range(53))
    assert res["switches"] == 52  # every iteration after the first runs the other version
    assert [it["version"] for it in res["iterations"]] == [i % 2 for i in range(53)]
    assert [v["scheme"] for v in res["versions"]] == ["two-trees", "other"]
    for v, plan in enumerate(plans):  # every iteration exact, against its own version's plan
        its = [it for it in res["iterations"] if it["version"] == v]
        rows = [r for r in res["transfers"]["rows"] if r[0] in {it["iteration"] for it in its}]
        check_results(plan, {**res, "iterations": its, "transfers": {**res["transfers"], "rows": rows}})
