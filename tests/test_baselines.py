"""Baseline planners: ps, ring, alltoall, bkt, mst (testbed/planners/baselines.py)."""

from __future__ import annotations

import itertools
import random
import time
from pathlib import Path

import networkx as nx
import numpy as np
import pytest

from testbed.errors import ConfigError
from testbed.plan import check_allreduce
from testbed.planners import make_plan, schemes
from testbed.planners.baselines import bottleneck_ring_exact, max_spanning_tree, path_rate, ring_score
from testbed.routing import shortest_paths

# The NetStorm 9-DC overlay (shared/data/netstorm-internet2-9.edges, from the authors'
# klonet_deploy_topo.py), embedded so the tests do not depend on shared/ being present.
NETSTORM_EDGES = [("h1", "h2"), ("h1", "h3"), ("h2", "h3"), ("h2", "h5"), ("h3", "h4"), ("h4", "h5"),
                  ("h4", "h6"), ("h5", "h7"), ("h6", "h7"), ("h6", "h8"), ("h6", "h9"), ("h7", "h8"),
                  ("h8", "h9")]
GSCALE_EDGES = [(0, 1), (0, 2), (1, 4), (2, 3), (2, 5), (3, 4), (4, 5), (3, 6), (3, 7), (5, 6), (5, 7),
                (6, 7), (6, 10), (7, 9), (8, 9), (8, 10), (9, 10), (9, 11), (10, 11)]
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def build(edges, rate=100.0, delay=10.0, seed=None, lo=20, hi=155) -> nx.DiGraph:
    """Both directions of every undirected edge; fixed rate, or per-direction random
    integer rates in [lo, hi] when ``seed`` is given (NetStorm's fluctuation script)."""
    rnd = random.Random(seed)
    g = nx.DiGraph()
    for u, v in edges:
        u, v = str(u), str(v)
        for a, b in ((u, v), (v, u)):
            g.add_edge(a, b, rate_mbps=float(rnd.randint(lo, hi)) if seed is not None else rate,
                       delay_ms=delay)
    return g


def ring_edges(n):
    return [(f"n{i}", f"n{(i + 1) % n}") for i in range(n)]


def star_edges(n):
    return [("n0", f"n{i}") for i in range(1, n)]


def mesh_edges(n):
    return list(itertools.combinations([f"n{i}" for i in range(n)], 2))


def path_edges(n):
    return [(f"n{i}", f"n{i + 1}") for i in range(n - 1)]


def topologies():
    out = []
    for n in (3, 5, 9):
        out += [(f"ring{n}", build(ring_edges(n), seed=n)), (f"star{n}", build(star_edges(n), seed=n)),
                (f"mesh{n}", build(mesh_edges(n), seed=n))]
    out += [("path4", build(path_edges(4), seed=4)), ("netstorm9", build(NETSTORM_EDGES, delay=30.0, seed=1)),
            ("mesh2", build(mesh_edges(2)))]
    return out


TOPOS = topologies()
CASES = [
    ("ps", {}), ("ps", {"shards": 3}), ("ps", {"hub_rule": "min-latency"}), ("ps", {"hub_rule": "first", "shards": 2}),
    ("ring", {}), ("ring", {"chunks": 3}), ("ring", {"ring_rule": "name-order"}),
    ("alltoall", {}), ("alltoall", {"shard_rule": "bandwidth"}),
    ("bkt", {}), ("bkt", {"k": 3, "chunks": 4}), ("bkt", {"layout": "bfs"}), ("bkt", {"layout": "name", "k": 1}),
    ("mst", {}), ("mst", {"chunks": 5}),
]


def run_check(plan, g, length, seed=0):
    plan.validate()
    rng = np.random.default_rng(seed)
    check_allreduce(plan, {n: rng.integers(-1000, 1000, length) for n in g.nodes})


@pytest.mark.parametrize("scheme,params", CASES, ids=[f"{s}-{p}" for s, p in CASES])
@pytest.mark.parametrize("topo", TOPOS, ids=[t[0] for t in TOPOS])
def test_every_scheme_is_a_correct_allreduce(scheme, params, topo):
    _, g = topo
    for length in (1, 7, 101):
        plan = make_plan(scheme, g, length, params)
        assert plan.scheme == scheme
        run_check(plan, g, length, seed=length)
        assert plan.meta["reference"] and plan.meta["planner_s"] >= 0


def test_registered_schemes_and_params():
    sch = schemes()
    assert set(sch) >= {"ps", "ring", "alltoall", "bkt", "mst"}
    assert set(sch["ps"].params) == {"hub", "hub_rule", "shards", "active"}
    assert sch["ps"].params["hub_rule"].choices == ("max-bandwidth", "min-latency", "first")
    assert set(sch["ring"].params) == {"order", "ring_rule", "chunks", "active"}
    assert sch["ring"].params["ring_rule"].default == "tsp-bandwidth"
    assert sch["alltoall"].params["shard_rule"].choices == ("equal", "bandwidth")
    assert "active" in sch["alltoall"].params
    assert {"k", "root", "chunks"} <= set(sch["bkt"].params) and sch["bkt"].params["k"].default == 2
    assert set(sch["mst"].params) == {"root", "chunks"}


def test_deterministic():
    g = build(NETSTORM_EDGES, delay=30.0, seed=7)
    for scheme, params in CASES:
        a, b = make_plan(scheme, g, 50, params), make_plan(scheme, g, 50, params)
        a.meta.pop("planner_s"), b.meta.pop("planner_s")
        assert a.to_json() == b.to_json()


# --- ps ----------------------------------------------------------------------
def test_ps_hub_rules():
    g = build(star_edges(6))
    assert make_plan("ps", g, 10).meta["hub"] == "n0"  # the centre has the most incident rate
    assert make_plan("ps", g, 10, {"hub_rule": "min-latency"}).meta["hub"] == "n0"
    assert make_plan("ps", g, 10, {"hub_rule": "first"}).meta["hub"] == "n0"
    plan = make_plan("ps", g, 10, {"hub": "n3"})  # leaf hub: traffic is routed through n0
    assert plan.meta["hub"] == "n3" and plan.meta["hub_rule"] == "given"
    run_check(plan, g, 10)
    push = {h["src"]: h["path"] for h in plan.meta["push"]}
    assert push["n1"] == ["n1", "n0", "n3"]
    with pytest.raises(ConfigError, match="hub"):
        make_plan("ps", g, 10, {"hub": "nope"})
    with pytest.raises(ConfigError, match="shards"):
        make_plan("ps", g, 10, {"shards": 0})


def test_ps_shards_structure():
    g = build(mesh_edges(5))
    plan = make_plan("ps", g, 40, {"shards": 4})
    sends = list(plan.transfers())
    assert len(sends) == 2 * 4 * 4  # (n-1) pushes and pulls per shard
    hub = plan.meta["hub"]
    assert all(op.peer == hub for n, op in sends if n != hub)
    assert sorted({op.chunk for _, op in sends}) == [0, 1, 2, 3]


def test_ps_min_latency_differs_from_max_bandwidth():
    # n0 has fat links but sits at the end of a slow chain; n2 is central in latency
    g = build(path_edges(5), rate=10)
    g["n0"]["n1"]["rate_mbps"] = g["n1"]["n0"]["rate_mbps"] = 1000
    assert make_plan("ps", g, 10).meta["hub"] in ("n0", "n1")
    assert make_plan("ps", g, 10, {"hub_rule": "min-latency"}).meta["hub"] == "n2"


# --- ring --------------------------------------------------------------------
def test_ring_follows_ring_topology():
    g = build(ring_edges(7))
    plan = make_plan("ring", g, 70)
    m = plan.meta
    assert m["hamiltonian"] and m["search"] == "exact-hamiltonian"
    assert all(len(h["path"]) == 2 for h in m["hops"])
    ring = m["ring"]
    assert all(g.has_edge(ring[i], ring[(i + 1) % 7]) for i in range(7))
    assert len(list(plan.transfers())) == 2 * 6 * 7


def test_ring_avoids_slow_links():
    g = build(mesh_edges(6), rate=100)
    for u, v in [("n0", "n1"), ("n1", "n2"), ("n2", "n3")]:
        g[u][v]["rate_mbps"] = g[v][u]["rate_mbps"] = 5
    m = make_plan("ring", g, 60).meta
    assert m["bottleneck_rate_mbps"] == 100
    assert min(h["rate_mbps"] for h in m["hops"]) == 100


def _brute_bottleneck(g, nodes):
    paths = shortest_paths(g)
    best = -1.0
    first = nodes[0]
    for perm in itertools.permutations(nodes[1:]):
        cyc = [first, *perm]
        hops = list(zip(cyc, cyc[1:] + cyc[:1]))
        if all(g.has_edge(u, v) for u, v in hops):
            best = max(best, min(path_rate(g, paths[h]) for h in hops))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_ring_exact_search_matches_brute_force(seed):
    rnd = random.Random(seed)
    nodes = [f"n{i}" for i in range(7)]
    edges = [e for e in itertools.combinations(nodes, 2) if rnd.random() < 0.6]
    g = build(edges + ring_edges(7), seed=seed, lo=1, hi=100)  # ring edges keep it Hamiltonian
    paths = shortest_paths(g)
    rate = {(u, v): path_rate(g, paths[(u, v)]) for u, v in g.edges}
    delay = {(u, v): 0.0 for u in nodes for v in nodes if u != v}
    ring = bottleneck_ring_exact(nodes, rate, delay)
    got = min(rate[(ring[i], ring[(i + 1) % 7])] for i in range(7))
    assert got == _brute_bottleneck(g, nodes)
    plan = make_plan("ring", g, 21)
    assert plan.meta["bottleneck_rate_mbps"] == got
    run_check(plan, g, 21)


def test_ring_on_non_hamiltonian_graphs():
    leafy = [e for e in NETSTORM_EDGES if e != ("h1", "h3")]  # h1 becomes a leaf
    for g in (build(star_edges(6)), build(path_edges(5)), build(leafy, seed=5, delay=30.0)):
        plan = make_plan("ring", g, 33, {"chunks": 2})
        m = plan.meta
        assert not m["hamiltonian"]
        assert any(len(h["path"]) > 2 for h in m["hops"])
        assert sorted(m["ring"]) == sorted(g.nodes)
        run_check(plan, g, 33)


def test_ring_routed_hops_account_for_sharing():
    g = build(star_edges(5), rate=100)
    m = make_plan("ring", g, 20).meta
    # every leaf->leaf hop crosses two star links; each link direction carries one hop
    assert m["bottleneck_rate_mbps"] == pytest.approx(100)
    score = ring_score(g, shortest_paths(g), m["ring"])
    assert score[0] == pytest.approx(m["bottleneck_rate_mbps"])


def test_ring_given_and_name_order():
    g = build(mesh_edges(4))
    order = ["n2", "n0", "n3", "n1"]
    m = make_plan("ring", g, 8, {"order": order}).meta
    assert m["ring"] == order and m["ring_rule"] == "given"
    assert make_plan("ring", g, 8, {"ring_rule": "name-order"}).meta["ring"] == ["n0", "n1", "n2", "n3"]
    with pytest.raises(ConfigError, match="order"):
        make_plan("ring", g, 8, {"ring_rule": "given"})
    with pytest.raises(ConfigError, match="order"):
        make_plan("ring", g, 8, {"order": ["n0", "n1", "n1", "n2"]})


def test_ring_heuristic_beyond_ten_nodes():
    g = build(GSCALE_EDGES, seed=3)
    t0 = time.perf_counter()
    plan = make_plan("ring", g, 120, {"chunks": 2})
    assert time.perf_counter() - t0 < 5
    assert plan.meta["search"] == "greedy+local-search"
    run_check(plan, g, 120)
    g12 = build(ring_edges(12))
    m = make_plan("ring", g12, 12).meta
    assert m["hamiltonian"]


def test_ring_exact_on_ten_node_mesh_is_fast():
    g = build(mesh_edges(10), seed=10)
    t0 = time.perf_counter()
    plan = make_plan("ring", g, 100)
    assert time.perf_counter() - t0 < 3
    assert plan.meta["search"] == "exact-hamiltonian"
    assert plan.meta["bottleneck_rate_mbps"] == _brute_bottleneck_fast(g)


def _brute_bottleneck_fast(g):
    """Largest threshold keeping a Hamiltonian cycle, via networkx subgraph checks."""
    from testbed.planners.baselines import _hamiltonian_exists
    nodes = sorted(g.nodes)
    idx = {v: i for i, v in enumerate(nodes)}
    for thr in sorted({d["rate_mbps"] for *_, d in g.edges(data=True)}, reverse=True):
        succ = [0] * len(nodes)
        for u, v, d in g.edges(data=True):
            if d["rate_mbps"] >= thr:
                succ[idx[u]] |= 1 << idx[v]
        if _hamiltonian_exists(len(nodes), succ):
            return thr
    return None


def test_ring_shares_netstorm():
    g = build(NETSTORM_EDGES, delay=30.0, seed=1)
    m = make_plan("ring", g, 90).meta
    assert m["hamiltonian"]  # h1-h2-h5-h7-h8-h9-h6-h4-h3 exists
    assert m["bottleneck_rate_mbps"] == _brute_bottleneck(g, sorted(g.nodes))


# --- alltoall ------------------------------------------------------------------
def test_alltoall_structure_and_bandwidth_shards():
    g = build(star_edges(4), rate=100)
    g["n0"]["n1"]["rate_mbps"] = 300
    plan = make_plan("alltoall", g, 1000, {"shard_rule": "bandwidth"})
    shards = plan.meta["shards"]
    tot = plan.meta["incident_rate_mbps"]
    assert sum(shards.values()) == 1000
    for n in g.nodes:
        assert shards[n] == pytest.approx(1000 * tot[n] / sum(tot.values()), abs=1)
    assert len(list(plan.transfers())) == 2 * 4 * 3
    eq = make_plan("alltoall", g, 1000).meta["shards"]
    assert set(eq.values()) == {250}


# --- bkt -----------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_bkt_is_balanced_kary(k):
    g = build(NETSTORM_EDGES, seed=2)
    plan = make_plan("bkt", g, 30, {"k": k})
    t = plan.meta["trees"][0]
    parent = t["parent"]
    children = {}
    for c, p in parent.items():
        if p is not None:
            children.setdefault(p, []).append(c)
    assert max(len(v) for v in children.values()) <= k
    depth = {}
    for n in parent:
        d, x = 0, n
        while parent[x] is not None:
            x, d = parent[x], d + 1
        depth[n] = d
    leaves = [n for n in parent if n not in children]
    assert max(depth[x] for x in leaves) - min(depth[x] for x in leaves) <= 1
    # complete k-ary tree height
    h = 0
    while sum(k ** i for i in range(h + 1)) < 9:
        h += 1
    assert t["height"] == h
    assert plan.meta["root"] == max(g.nodes, key=lambda n: sum(d["rate_mbps"] for *_, d in g.in_edges(n, data=True))
                                    + sum(d["rate_mbps"] for *_, d in g.out_edges(n, data=True)))


def test_bkt_prefers_wan_neighbours():
    # the WAN itself is a binary tree with extra cross links: BKT must recover it
    tree = [(f"t{(i - 1) // 2}", f"t{i}") for i in range(1, 7)]
    g = build(tree + [("t3", "t6"), ("t4", "t5"), ("t1", "t2")])
    m = make_plan("bkt", g, 9, {"root": "t0"}).meta
    assert m["root"] == "t0"
    assert all(e["adjacent"] for e in m["tree_edges"])
    run_check(make_plan("bkt", g, 9, {"root": "t0", "chunks": 3}), g, 9)
    # and on the NetStorm overlay it never uses fewer WAN links than the plain BFS layout
    ns = build(NETSTORM_EDGES, seed=3)
    for root in sorted(ns.nodes):
        adj = {lay: sum(e["adjacent"] for e in make_plan("bkt", ns, 9, {"root": root, "layout": lay}).meta["tree_edges"])
               for lay in ("bfs-adjacent", "bfs")}
        assert adj["bfs-adjacent"] >= adj["bfs"]


def test_bkt_bad_params():
    g = build(ring_edges(4))
    with pytest.raises(ConfigError):
        make_plan("bkt", g, 9, {"k": 0})
    with pytest.raises(ConfigError):
        make_plan("bkt", g, 9, {"root": "zz"})


# --- mst -----------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_mst_is_maximum_spanning_tree(seed):
    g = build(mesh_edges(7), seed=seed, lo=1, hi=50)
    und = nx.Graph()
    for u, v in g.edges:
        und.add_edge(u, v, weight=min(g[u][v]["rate_mbps"], g[v][u]["rate_mbps"]))
    best = nx.maximum_spanning_tree(und).size(weight="weight")
    ours = max_spanning_tree(g)
    assert len(ours) == 6 and sum(w for *_, w in ours) == best
    plan = make_plan("mst", g, 50, {"chunks": 2})
    edges = {frozenset((e["child"], e["parent"])) for e in plan.meta["tree_edges"]}
    assert edges == {frozenset((a, c)) for a, c, _ in ours}
    run_check(plan, g, 50)


def test_mst_root_is_latency_centre():
    g = build(path_edges(5))
    assert make_plan("mst", g, 5).meta["root"] == "n2"
    # a long-delay edge moves the centre
    g["n3"]["n4"]["delay_ms"] = g["n4"]["n3"]["delay_ms"] = 100
    assert make_plan("mst", g, 5).meta["root"] == "n3"
    assert make_plan("mst", g, 5, {"root": "n0"}).meta["root"] == "n0"


def test_mst_uses_slower_direction():
    g = build(mesh_edges(3), rate=10)
    g["n0"]["n1"]["rate_mbps"] = 1000  # only one direction fast: not a fat edge
    g["n1"]["n2"]["rate_mbps"] = g["n2"]["n1"]["rate_mbps"] = 50
    g["n0"]["n2"]["rate_mbps"] = g["n2"]["n0"]["rate_mbps"] = 40
    edges = {frozenset((a, c)) for a, c, _ in max_spanning_tree(g)}
    assert edges == {frozenset(("n1", "n2")), frozenset(("n0", "n2"))}


def test_disconnected_graph_is_rejected():
    g = build([("a", "b"), ("c", "d")])
    for scheme in ("ps", "ring", "alltoall", "bkt", "mst"):
        with pytest.raises(ConfigError, match="connected"):
            make_plan(scheme, g, 10)


def test_shared_edge_list_matches_embedded_copy():
    f = SHARED / "netstorm-internet2-9.edges"
    if not f.exists():
        pytest.skip("shared/ not beside the repository")
    edges = [tuple(line.split()) for line in f.read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert edges == NETSTORM_EDGES


@pytest.mark.parametrize("scheme, params", [
    ("ps", {"active": ["h2", "h5", "h9"]}), ("ps", {"active": ["h1", "h3"], "hub": "h6", "shards": 3}),
    ("ring", {"active": ["h1", "h4", "h8", "h9"]}), ("ring", {"active": ["h2", "h7"], "chunks": 2}),
    ("ring", {"active": ["h3", "h6", "h9"], "order": ["h9", "h3", "h6"]}),
    ("alltoall", {"active": ["h1", "h5", "h7"]}), ("alltoall", {"active": ["h2", "h9"], "shard_rule": "bandwidth"}),
])
def test_partial_reduce_baselines_give_members_their_exact_sum(scheme, params):
    """CREW §V-A compares partial reduces of a group P: PS, ring and all-to-all over P only."""
    g = build(NETSTORM_EDGES, seed=4)
    plan = make_plan(scheme, g, 1001, params)
    assert plan.contributing() == plan.finishing() == sorted(params["active"], key=list(g.nodes).index)
    senders = {n for n, prog in plan.programs.items() if any(op.kind == "send" for op in prog)}
    assert senders <= set(params["active"]) | {params.get("hub", plan.meta.get("hub"))}
    run_check(plan, g, 1001, seed=3)


def test_partial_ring_order_must_list_the_members():
    with pytest.raises(ConfigError, match="every ring member exactly once"):
        make_plan("ring", build(NETSTORM_EDGES), 100, {"active": ["h1", "h2"], "order": ["h1", "h2", "h3"]})
