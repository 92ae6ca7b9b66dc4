"""Where a tree scheme's completion time goes, from the per-chunk timings of a run.

For one measured iteration of a run (``runs[].transfers``) on the topology's graph:

* per tree (``flow``): when its last chunk arrived, as a share of the CCT — trees of a
  packing that finish far apart did not get the rates their shares assume;
* per directed WAN link (transfers between non-adjacent datacenters charged to every link
  of their route, :func:`testbed.routing.data_paths`): bytes, ``need_s`` = bytes / rate
  (the time the link needs at full rate), utilisation = need_s / CCT, busy share (union of
  the intervals in which a chunk crossing it was being received, moved back by the
  route's one-way delay, over the CCT), the longest idle gap, the idle time between its
  first and last busy instant, the start-up (first busy instant), the tail (CCT - last busy
  instant) and the payload rate while busy (``busy_mbps``, against the rate x 1448/1514
  TCP can carry);
* ``start_skew_s``: how far apart the workers began communicating (the CCT counts from the
  first);
* the decomposition ``efficiency = bound / CCT = (bound / need) x (need / CCT)``, with
  ``need`` the busiest link's ``need_s``: the first factor is the plan's (how its traffic
  is spread over the links, against the packing optimum), the second the execution's (how
  much of the run the busiest link was kept busy).

Pure functions of results data; no network.
"""

from __future__ import annotations

import networkx as nx

from agents.protocol import transfer_rows
from testbed.routing import data_paths


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def measured_iteration(run: dict) -> dict | None:
    """The last measured (non-warm-up) iteration record of a run, or None."""
    its = [it for it in run.get("iterations", []) if not it.get("warmup")]
    return its[-1] if its else None


def analyse_run(run: dict, graph: nx.DiGraph) -> dict:
    """Per-tree finish times and per-link utilisation of the last measured iteration of
    ``run`` (a ``runs[]`` record of results.json) on ``graph``; see the module doc."""
    it = measured_iteration(run)
    table = transfer_rows(run.get("transfers"))
    if it is None or not table:
        return {}
    rows = [r for r in table if r.iteration == it["iteration"]]
    starts = [w["comm_start_ns"] for w in it["workers"].values() if w.get("comm_start_ns")]
    t0 = min(starts) if starts else min(r.send_start_ns for r in rows)
    cct = it["cct_s"]
    paths = data_paths(graph)
    flow_end: dict[int, float] = {}
    busy: dict[tuple[str, str], list[tuple[float, float]]] = {}
    nbytes: dict[tuple[str, str], int] = {}
    for r in rows:
        src, dst, f = r.src, r.dst, r.flow
        rs, re_ = (r.recv_start_ns - t0) / 1e9, (r.recv_end_ns - t0) / 1e9
        flow_end[f] = max(flow_end.get(f, 0.0), re_)
        path = paths.get((src, dst), [src, dst])
        owd = sum(graph[a][b].get("delay_ms", 0.0) for a, b in zip(path, path[1:])) / 1e3
        for a, b in zip(path, path[1:]):
            busy.setdefault((a, b), []).append((max(0.0, rs - owd), max(0.0, re_ - owd)))
            nbytes[(a, b)] = nbytes.get((a, b), 0) + r.bytes
    links = []
    for (a, b), iv in sorted(busy.items()):
        u = _union(iv)
        rate = float(graph[a][b]["rate_mbps"])
        need = nbytes[(a, b)] * 8 / (rate * 1e6)
        gaps = [u[0][0]] + [y[0] - x[1] for x, y in zip(u, u[1:])] + [max(0.0, cct - u[-1][1])]
        busy_s = sum(y - x for x, y in u)
        links.append({"link": f"{a}->{b}", "rate_mbps": rate, "bytes": nbytes[(a, b)], "need_s": need,
                      "utilisation": need / cct if cct else None,
                      "busy_share": busy_s / cct if cct else None,
                      "longest_idle_s": max(gaps), "startup_s": u[0][0], "tail_s": max(0.0, cct - u[-1][1]),
                      "idle_s": sum(gaps[1:-1]),  # between its first and last busy instant
                      "busy_mbps": nbytes[(a, b)] * 8 / busy_s / 1e6 if busy_s > 0 else None})
    ends = sorted(flow_end.values())
    hot = max(links, key=lambda l: l["need_s"]) if links else None
    return {"iteration": it["iteration"], "cct_s": cct, "trees": len(flow_end),
            "start_skew_s": (max(starts) - t0) / 1e9 if starts else None,
            "tree_finish_s": {str(f): e for f, e in sorted(flow_end.items())},
            "first_tree_done_share": ends[0] / cct if ends and cct else None,
            "bottleneck": hot, "links": links,
            "mean_utilisation": sum(l["utilisation"] for l in links) / len(links) if links and cct else None}


def breakdown(cct_s: float, bound_s: float | None, analysis: dict) -> dict:
    """efficiency = bound/CCT split into the plan's factor bound/need and the execution's
    factor need/CCT (``need`` = the busiest link's bytes / rate)."""
    hot = analysis.get("bottleneck")
    if not hot or not cct_s:
        return {}
    need = hot["need_s"]
    return {"need_s": need, "plan_factor": bound_s / need if bound_s and need else None,
            "execution_factor": need / cct_s}
