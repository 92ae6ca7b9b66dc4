"""CREW's groups at run time (Luo et al. §III, §IV): groups P of the first p ready workers from
the controller's FIFO ready queue, each group's partial reduce a task while the others
compute, rounds each worker completes in a window T.  The controller and the agents' loop
are :mod:`agents.crew`, :mod:`agents.crew_run` and :mod:`agents.crew_worker`; here: the
driver's options from the scheme (the scheme's own planner over P, Eq. 3's rates, noise,
non-blocking scatter's early scatters) and the run's rounds summary.  Scheme block:
``groups``."""

from __future__ import annotations

import random

from testbed.config import Experiment, planner_params
from testbed.results import stats
from testbed.workloads import compute_times

from . import Feature, RunContext, feature

MAX_ROUNDS = 5000  # compute times drawn per worker for a groups run (the last one repeats)


@feature("groups")
class Groups(Feature):
    def options(self, ctx: RunContext) -> dict:
        from agents.crew_run import TaskRun

        opts = group_runtime(ctx.exp, ctx.scheme)
        if opts is None:
            return {}
        return {"driver": lambda coord: TaskRun(coord, opts),
                "compute_s": compute_times(ctx.exp.workload.compute_s, ctx.plan.nodes, MAX_ROUNDS, ctx.seed)}

    def summarise(self, result: dict, record: dict) -> dict:
        """A groups run: CCT = mean over its completed tasks, ``rounds`` per worker in the window."""
        if "tasks_mode" not in result:
            return {}
        tm = result["tasks_mode"]
        tasks = tm["tasks"]
        incorrect = sorted({m for t in tasks for m, d in t["members_done"].items() if not d["correct"]})
        return {"cct_s": stats([t["cct_s"] for t in tasks if "cct_s" in t])["mean"],  # not stopped ones
                "warmup_cct_s": [], "iterations": [], "rounds": tm["rounds"],
                "rounds_total": sum(tm["rounds"].values()), "groups": tm,
                "correct": bool(tasks) and all(t["correct"] for t in tasks) and not result.get("errors"),
                "incorrect": incorrect, "transfers": None, "links": []}

    def note(self, record: dict) -> str:
        g = record.get("groups")
        return f", rounds in {g['window_s']:g} s: {record['rounds']}" if g else ""

    def variant_summary(self, runs: list[dict]) -> dict:
        rounds = [r["rounds_total"] for r in runs if "rounds_total" in r]
        return {"rounds_total": stats(rounds)} if rounds else {}

    def failure(self, results: dict) -> dict:
        return {"groups": results["tasks_mode"]} if "tasks_mode" in results else {}


def group_runtime(exp: Experiment, scheme: dict) -> dict | None:
    """The options of :class:`agents.crew_run.TaskRun` for a scheme with ``groups`` (CREW
    §III: groups of p from the ready queue), None otherwise: ``plan_for(P)`` is the scheme's
    own pure planner with ``active: P``."""
    from testbed.planners import make_plan

    g = scheme.get("groups")
    if not g:
        return None
    graph, w = noisy_rates(exp.topology.graph(), g.get("noise", 0.0), exp.seed), exp.workload
    params = planner_params(scheme)
    blocking = g.get("blocking", True)

    def plan_for(members: list[str], **failover):  # failover: crew's exclude / reassign
        return make_plan(scheme["name"], graph, w.length, {**params, "active": list(members), **failover,
                                                          **({} if blocking else {"prescattered": True})},
                         elem_bytes=w.elem_bytes)
    rate = None
    if scheme["name"] == "crew":  # Eq. (3)'s b_{i,j}: the rates of the paths as the controller sees them
        from testbed.planners.crew import pair_rates
        b = pair_rates(graph)
        def rate(i, j):
            return b[(i, j)]
    return {"p": g["p"], "window_s": g["window_s"], "plan_for": plan_for, "rate": rate,
            "link_timeout_s": g.get("link_timeout_s", 0.0),
            **({"controller_down": g["controller_down"]} if g.get("controller_down") else {}),
            **({} if blocking else {"prescatter_for": lambda sender: prescatter_for(scheme, graph, w.length, sender)})}


def prescatter_for(scheme: dict, graph, length: int, sender: str):
    """Non-blocking CREW: ``sender``'s early scatter of its default blocks (P = N)."""
    from testbed.planners.crew import prescatter_plan

    return prescatter_plan(graph, length, sender, split=scheme.get("split", "network-aware"),
                           chunks=scheme.get("chunks", 0), rounding=scheme.get("rounding", "floor"),
                           scheduling=scheme.get("scheduling", "fcfs"))


def noisy_rates(graph, lam: float, seed: int):
    """CREW §V-H: the rates the controller plans with, b(1+x), x ~ U[-lam, lam] drawn once per
    link direction from ``seed`` (the emulator keeps the true b); ``graph`` itself if lam = 0."""
    if not lam:
        return graph
    g = graph.copy()
    for u, v in sorted(g.edges):
        g[u][v]["rate_mbps"] *= 1 + random.Random(f"{seed}:noise:{u}:{v}").uniform(-lam, lam)
    return g
