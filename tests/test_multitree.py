"""MultiTree (paper 004, Huang et al. ISCA'21): Algorithm 1, schedule tables, plan IR."""

from __future__ import annotations

import math

import networkx as nx
import numpy as np
import pytest

from testbed import topogen
from testbed.plan import check_allreduce
from testbed.planners import make_plan, schemes
from testbed.planners.multitree import build_trees, schedule_tables, table_rows

# ---------------------------------------------------------------------------
# The paper's worked example: 2x2 mesh, Sec. III-B, Fig. 3 and Fig. 5.
# ---------------------------------------------------------------------------
# Fig. 5 "All-Reduce schedule tables for the example in Sec. III-B", copied verbatim
# from the paper text (fields: Op FlowID Parent Children[4 slots] Step; the Start Addr
# and Size fields are omitted in the figure).
PAPER_FIG5_VERBATIM = {
    0: ["Reduce 3 1 nil nil nil nil 1",
        "Reduce 1 1 nil nil nil nil 2",
        "Reduce 2 2 1 nil nil nil 2",
        "Gather 0 nil 1 2 nil nil 3",
        "Gather 2 2 1 nil nil nil 4"],
    1: ["Reduce 2 0 nil nil nil nil 1",
        "Reduce 0 0 nil nil nil nil 2",
        "Reduce 3 3 0 nil nil nil 2",
        "Gather 1 nil 0 3 nil nil 3",
        "Gather 3 3 0 nil nil nil 4"],
    2: ["Reduce 1 3 nil nil nil nil 1",
        "Reduce 3 3 nil nil nil nil 2",
        "Reduce 0 0 3 nil nil nil 2",
        "Gather 1 nil 0 3 nil nil 3",
        "Gather 0 0 3 nil nil nil 4"],
    3: ["Reduce 0 2 nil nil nil nil 1",
        "Reduce 2 2 nil nil nil nil 2",
        "Reduce 1 1 2 nil nil nil 2",
        "Gather 3 nil 1 2 nil nil 3",
        "Gather 1 1 2 nil nil nil 4"],
}
# Erratum: accelerator 2's root Gather is printed with FlowID 1.  A Gather with parent
# nil is a root entry, accelerator 2 is the root of tree 2 only, and accelerator 1
# already holds the root Gather of flow 1 -- so it must read "Gather 2 nil 0 3 nil nil 3"
# (tree 2's root sends to its children 0 and 3, consistent with the Reduce entries of
# flow 2 at accelerators 0 and 3, whose parent is 2).
FIG5_ERRATUM = {(2, 3): "Gather 2 nil 0 3 nil nil 3"}

# The trees of Fig. 3(e) (all-gather schedule trees), decoded from Fig. 5: per tree,
# (parent, child, construction step t').  Fig. 3: link allocation for time step 1 uses
# all 8 directed links; time step 2 attaches the last node of every tree.
PAPER_TREES = {
    0: [(0, 2, 1), (0, 1, 1), (2, 3, 2)],
    1: [(1, 3, 1), (1, 0, 1), (3, 2, 2)],
    2: [(2, 0, 1), (2, 3, 1), (0, 1, 2)],
    3: [(3, 1, 1), (3, 2, 1), (1, 0, 2)],
}


def fig5_expected() -> dict[int, list[str]]:
    want = {a: list(rows) for a, rows in PAPER_FIG5_VERBATIM.items()}
    for (a, i), row in FIG5_ERRATUM.items():
        want[a][i] = row
    return want


@pytest.fixture(scope="module")
def mesh22():
    g = topogen.mesh2d(2, 2).graph()
    return g, build_trees(g)


def test_fig5_schedule_tables_exact(mesh22):
    g, s = mesh22
    tables = schedule_tables(s)
    got = {s.ids[v]: table_rows(tables[v], s.ids) for v in g.nodes}
    assert got == fig5_expected()
    # only the erratum row differs from the verbatim figure
    diff = [(a, i) for a in got for i, row in enumerate(got[a]) if row != PAPER_FIG5_VERBATIM[a][i]]
    assert diff == list(FIG5_ERRATUM)
    # no NOPs in the example: every node sends in each of the 4 steps
    assert all(e["op"] != "NOP" for t in tables.values() for e in t)


def test_fig3_trees_and_allocation_sequence(mesh22):
    g, s = mesh22
    name = {i: v for v, i in s.ids.items()}
    assert [s.ids[t.root] for t in s.trees] == [0, 1, 2, 3]
    for ti, edges in PAPER_TREES.items():
        got = [(s.ids[p], s.ids[c], t) for p, c, t in s.construction(ti)]
        assert got == edges
    # "At sequence number 7, after the last edge (3->2) is added to connect nodes 2
    # (T3-2) and 3 (T3-3) in tree 3, the topology graph for time step 1 runs out of all
    # the edges" (sequence numbers counted from 0).
    step1 = [a for a in s.alloc if a[3] == 1]
    assert len(step1) == 8 == g.number_of_edges()
    ti, p, c, t = s.alloc[7]
    assert (s.ids[s.trees[ti].root], p, c, t) == (3, name[3], name[2], 1)
    # trees take turns by root id, one node at a time
    assert [s.ids[s.trees[a[0]].root] for a in step1] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_fig3_steps_and_time_reversal(mesh22):
    _, s = mesh22
    assert s.tot_t == 2 and s.steps == 4  # Fig. 3: levels 1 and 2; ring needs 3 per phase
    for ti in range(4):
        rs = {(c, p): st for c, p, st in s.reduce_scatter(ti)}
        for p, c, t in s.construction(ti):
            assert rs[(c, p)] == s.tot_t - t + 1  # Alg. 1 line 17
        assert sorted(st for _, _, st in s.allgather(ti)) == sorted(s.tot_t + t for _, _, t in s.construction(ti))


# ---------------------------------------------------------------------------
# Invariants
# ---------------------------------------------------------------------------
def graphs():
    return {
        "mesh-2x2": topogen.mesh2d(2, 2).graph(),
        "mesh-3x3": topogen.mesh2d(3, 3).graph(),
        "mesh-4x4": topogen.mesh2d(4, 4).graph(),
        "torus-4x4": topogen.torus2d(4, 4).graph(),
        "torus-3x4": topogen.torus2d(3, 4).graph(),
        "ring-6": topogen.ring(6).graph(),
        "star-5": topogen.star(5).graph(),
        "random-9": topogen.mtree_random(9, 14, seed=3).graph(),
        "random-12-asym": topogen.mtree_random(12, 20, seed=5, asymmetric=True).graph(),
    }


OPTIONS = [dict(), dict(dim_order="minus_first"), dict(rr_restart=False), dict(tree_order="height"),
           dict(neighbour_order="xy"), dict(variant="bfs")]


@pytest.mark.parametrize("name", list(graphs()))
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_trees_span_and_links_contention_free(name, opts):
    g = graphs()[name]
    s = build_trees(g, **opts)
    n = g.number_of_nodes()
    assert len(s.trees) == n and {t.root for t in s.trees} == set(g.nodes)
    for t in s.trees:
        assert set(t.parent) == set(g.nodes)  # spans all nodes
        assert len(_tree_nodes(t)) == n  # connected, acyclic
        for c in t.order:
            p = t.parent[c]
            if p is None:
                continue
            assert t.added[c] > t.added[p]  # parent added in a previous step (line 9)
            assert t.path[c][0] == p and t.path[c][-1] == c and t.rpath[c][0] == c and t.rpath[c][-1] == p
            if opts.get("variant", "direct") == "direct":
                assert g.has_edge(p, c) and len(t.path[c]) == 2
    # no directed link carries two messages in one step, in either phase
    use = s.link_use()
    assert set(use) == set(range(1, 2 * s.tot_t + 1))
    assert max(max(d.values()) for d in use.values()) == 1
    for st, d in use.items():
        assert all(g.has_edge(*e) for e in d)
    # tot_t is at least the largest root eccentricity and the link-count bound
    ecc = max(nx.eccentricity(g).values())
    assert s.tot_t >= ecc
    if opts.get("variant", "direct") == "direct":
        assert s.tot_t >= math.ceil(n * (n - 1) / g.number_of_edges())


def _tree_nodes(t):
    ch = t.children()
    seen, stack = {t.root}, [t.root]
    while stack:
        u = stack.pop()
        for c in ch[u]:
            assert c not in seen
            seen.add(c)
            stack.append(c)
    return seen


def test_torus_4x4_step_count():
    """The paper prints no step count for the 4x4 torus (only that MultiTree's steps are
    bounded below by the diameter, Sec. VI-C).  Derived: diameter 4 and the link bound
    ceil(16*15 / 64) = 4 give tot_t >= 4; Algorithm 1's greedy yields tot_t = 5 (all-reduce
    10 steps vs. ring's 2*(16-1) = 30).  With the paper's Y-then-X order, construction
    steps 1-2 use all 64 links (4 new nodes per tree), steps 3-4 only 48 (3 per tree) and
    step 5 attaches the antipode (16).  tot_t = 5 does not depend on any tie-break the
    paper leaves open (neighbour order, +/- first, round-robin restart, tree order)."""
    g = topogen.torus2d(4, 4).graph()
    for opts in [dict(), dict(dim_order="minus_first"), dict(rr_restart=False),
                 dict(tree_order="height"), dict(neighbour_order="xy"), dict(neighbour_order="id")]:
        s = build_trees(g, **opts)
        assert s.tot_t == 5 and s.steps == 10, opts
        if opts.get("neighbour_order") != "id":
            # symmetric torus + coordinate order: every tree has the same level sizes
            levels = {tuple(np.bincount(list(t.added.values()))) for t in s.trees}
            assert len(levels) == 1, opts
    s = build_trees(g)
    levels = {tuple(np.bincount(list(t.added.values()))) for t in s.trees}
    per_step = np.bincount([a[3] for a in s.alloc])
    assert list(per_step[1:]) == [64, 64, 48, 48, 16]
    assert levels == {(1, 4, 4, 3, 3, 1)}


def test_ring_steps_equal_half_ring():
    s = build_trees(topogen.ring(6).graph())
    assert s.tot_t == 3  # each root reaches both directions: ceil((6-1)/2) levels


def test_mesh_4x4_trees_have_different_heights():
    # Sec. III-B: "for networks like a (4x4) Mesh ... the trees are asymmetric with
    # different heights" -> NOPs appear in the tables
    g = topogen.mesh2d(4, 4).graph()
    s = build_trees(g)
    assert len({t.height() for t in s.trees}) > 1
    tables = schedule_tables(s, length=160)
    assert any(e["op"] == "NOP" for t in tables.values() for e in t)
    for v, entries in tables.items():
        assert [e["step"] for e in entries] == sorted(e["step"] for e in entries)
        assert {e["step"] for e in entries} == set(range(1, s.steps + 1))
        for e in entries:
            if e["op"] != "NOP":
                assert e["size"] == 10 and e["start"] == 10 * s.ids[e["flow"]]


# ---------------------------------------------------------------------------
# Plans
# ---------------------------------------------------------------------------
def run_check(plan, g, length, seed=0):
    plan.validate()
    rng = np.random.default_rng(seed)
    inputs = {n: rng.integers(-1000, 1000, size=length) for n in g.nodes}
    check_allreduce(plan, inputs)


PLAN_GRAPHS = ["mesh-2x2", "mesh-3x3", "torus-4x4", "ring-6", "random-9", "random-12-asym", "star-5"]


@pytest.mark.parametrize("name", PLAN_GRAPHS)
@pytest.mark.parametrize("params", [
    dict(), dict(lockstep=True), dict(chunks=3), dict(lockstep=True, chunks=2),
    dict(channels="link", chunks=2), dict(variant="bfs", lockstep=True),
], ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()) or "default")
def test_plan_is_correct_allreduce(name, params):
    g = graphs()[name]
    length = 101
    plan = make_plan("multitree", g, length, params)
    run_check(plan, g, length)
    assert plan.scheme == "multitree"
    n = g.number_of_nodes()
    chunks = params.get("chunks", 1)
    sends = sum(1 for _ in plan.transfers())
    assert sends == 2 * n * (n - 1) * chunks  # every tree edge once per phase and chunk
    # no directed node pair used twice within one (step, chunk) -- the schedule is
    # contention-free on the plan level too
    seen = set()
    for node, op in plan.transfers():
        key = (plan.meta["op_step"][node][op.id], op.chunk, node, op.peer)
        assert key not in seen
        seen.add(key)
    plan.to_json()


@pytest.mark.parametrize("length", [1, 3, 16, 17])
def test_small_and_uneven_lengths(length):
    g = graphs()["torus-4x4"]
    run_check(make_plan("multitree", g, length, {"chunks": 2}), g, length)
    run_check(make_plan("multitree", g, length, {"lockstep": True}), g, length)


def _ancestors(prog):
    by = {op.id: op for op in prog}
    memo = {}

    def anc(i):
        if i not in memo:
            memo[i] = set()
            for d in by[i].deps:
                memo[i] |= {d} | anc(d)
        return memo[i]

    return {i: anc(i) for i in by}


def test_lockstep_orders_every_step_after_the_previous():
    g = graphs()["mesh-3x3"]
    free = make_plan("multitree", g, 90, {})
    lock = make_plan("multitree", g, 90, {"lockstep": True})
    for v in g.nodes:
        steps = lock.meta["op_step"][v]
        anc = _ancestors(lock.programs[v])
        for op in lock.programs[v]:
            earlier = {o.id for o in lock.programs[v] if steps[o.id] < steps[op.id]}
            assert earlier <= anc[op.id]
        # free-running: only data dependencies, strictly fewer deps overall
    def ndeps(p):
        return sum(len(op.deps) for prog in p.programs.values() for op in prog)
    assert ndeps(lock) > ndeps(free)
    # same transfers either way
    assert sorted((n, o.peer, o.offset, o.length) for n, o in free.transfers()) == \
        sorted((n, o.peer, o.offset, o.length) for n, o in lock.transfers())


def test_blocks_owned_by_roots_and_meta():
    g = graphs()["mesh-2x2"]
    plan = make_plan("multitree", g, 8, {})
    m = plan.meta
    assert m["tot_t"] == 2 and m["steps"] == 4
    assert [t["root"] for t in m["trees"]] == ["n0", "n1", "n2", "n3"]
    assert [t["block"] for t in m["trees"]] == [[0, 2], [2, 2], [4, 2], [6, 2]]
    assert sum(t["share"] for t in m["trees"]) == pytest.approx(1.0)
    # block i is reduced at root i: the root receives reduce-scatter messages for it
    for node, prog in plan.programs.items():
        for op in prog:
            if op.phase == "reduce-scatter" and op.kind == "recv":
                root = m["trees"][op.flow]["root"]
                assert m["trees"][op.flow]["block"][0] <= op.offset < sum(m["trees"][op.flow]["block"])
                assert node == root or node in m["trees"][op.flow]["parent"]
    rows = {m["node_ids"][v]: table_rows(t, m["node_ids"]) for v, t in m["schedule_tables"].items()}
    assert rows == fig5_expected()
    assert m["max_link_use_per_step"] == 1
    assert "reference" in m and m["planner_s"] >= 0


def test_registered_params():
    spec = schemes()["multitree"]
    assert {"lockstep", "chunks", "neighbour_order", "variant"} <= set(spec.params)
    assert spec.params["lockstep"].default is False and spec.params["chunks"].default == 1


def test_bad_params():
    from testbed.errors import ConfigError
    g = graphs()["ring-6"]
    with pytest.raises(ConfigError):
        make_plan("multitree", g, 10, {"chunks": 0})
    with pytest.raises(ConfigError):
        make_plan("multitree", g, 10, {"neighbour_order": "zz"})
    h = nx.DiGraph()
    h.add_edge("a", "b", rate_mbps=1, delay_ms=1)
    h.add_edge("b", "a", rate_mbps=1, delay_ms=1)
    h.add_edge("c", "d", rate_mbps=1, delay_ms=1)
    with pytest.raises(ConfigError):
        make_plan("multitree", h, 10, {})


def test_bfs_variant_on_switch_network():
    """Sec. III-C 3: switch-based networks.  A star whose hub is a switch (not an
    endpoint): every tree edge is leaf->switch->leaf and reserves both links; each leaf
    has one NIC link, so at most one message leaves it per step -> 12 tree edges need
    tot_t = 3 steps, every link busy in every step."""
    g = topogen.star(5).graph()
    g.nodes["n0"]["switch"] = True
    s = build_trees(g, variant="bfs")
    assert s.tot_t == 3 and {t.root for t in s.trees} == {"n1", "n2", "n3", "n4"}
    assert all(len(t.path[c]) == 3 and t.path[c][1] == "n0" for t in s.trees for c in t.order if t.parent[c])
    use = s.link_use()
    assert all(len(d) == 8 and max(d.values()) == 1 for d in use.values())
    plan = make_plan("multitree", g, 40, {"variant": "bfs", "lockstep": True})
    assert plan.participants == plan.receivers == ["n1", "n2", "n3", "n4"]
    assert not plan.programs["n0"]
    run_check(plan, g, 40)
    from testbed.errors import ConfigError
    with pytest.raises(ConfigError):
        make_plan("multitree", g, 40, {})  # the direct variant needs endpoints everywhere


def test_bfs_over_free_links_takes_n_minus_1_steps_on_a_fat_tree():
    """Sec. III-C 3: per-step BFS over the links still free, through switches only.  On a
    non-blocking 64-host leaf-spine fabric (one NIC link per host) a phase takes N - 1 = 63
    steps, as RING; reserving the one static route per pair crosses one spine per leaf pair
    and needs far more (231).  Local first: step 1 stays inside the leaves."""
    g = topogen.leaf_spine(8, 8, 8).graph()
    s = build_trees(g, variant="bfs")
    assert s.tot_t == 63 and len(s.trees) == 64
    assert max(max(d.values()) for d in s.link_use().values()) == 1
    assert all(len(t.path[c]) == 3 for t in s.trees for c in t.order if t.added[c] == 1)
    assert all(g.nodes[x].get("switch") for t in s.trees for c in t.order if t.parent[c]
               for x in t.path[c][1:-1])
    plan = make_plan("multitree", g, 640, {"variant": "bfs"})
    assert plan.meta["tot_t"] == 63 and "routing_note" in plan.meta
    assert not any(plan.programs[f"leaf{j}"] or plan.programs[f"spine{j}"] for j in range(8))
    small = topogen.leaf_spine(2, 2, 2).graph()
    assert build_trees(small, variant="routed").tot_t > build_trees(small, variant="bfs").tot_t == 3
    run_check(make_plan("multitree", small, 40, {"variant": "bfs"}), small, 40)
