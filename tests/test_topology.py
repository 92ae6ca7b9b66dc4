"""Fast unit tests for testbed.topology and testbed.topogen (no root, no network)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import networkx as nx
import pytest

from testbed import topogen
from testbed.errors import ConfigError
from testbed.topology import (
    TOPOLOGY_DIR,
    Link,
    LinkDir,
    Topology,
    describe_names,
    list_topologies,
    load_topology,
    validate_connected,
)

SHIPPED = [
    "netstorm-internet2-9", "gscale-b4-12", "equinix-like-20", "idn-like-40", "crew-mesh-8",
    "torus-4x4", "mesh-2x2", "ring-6", "star-5", "small-3", "quick-5",
]


def dirs(t: Topology):
    return [d for l in t.links for d in (l.ab, l.ba)]


def base(**link):
    """A valid two-node inline topology whose single link is ``link``."""
    return {"datacenters": ["a", "b"], "links": [{"between": ["a", "b"], "rate_mbps": 10, **link}]}


# --------------------------------------------------------------------------- shipped files


def test_all_expected_files_are_shipped():
    assert set(SHIPPED) <= set(list_topologies())


@pytest.mark.parametrize("name", sorted(set(SHIPPED) | set(list_topologies())))
def test_shipped_file_loads_and_validates(name):
    t = load_topology(name)
    assert t.name == name
    assert t.source
    validate_connected(t, source=name, key="topology")
    t.validate()
    text = (TOPOLOGY_DIR / f"{name}.yaml").read_text()
    assert text.startswith("#") and "Format (testbed/topology.py)" in text
    # also loadable by path
    assert load_topology(str(TOPOLOGY_DIR / f"{name}.yaml")).to_dict() == t.to_dict()


def _edges(fname):
    p = Path(__file__).resolve().parents[2] / "shared" / "data" / fname
    if not p.exists():
        pytest.skip(f"{p} not available")
    return [tuple(l.split()) for l in p.read_text().splitlines() if l.strip() and not l.startswith("#")]


def test_netstorm_file_matches_edges_and_seeded_draw():
    t = load_topology("netstorm-internet2-9")
    assert t.nodes == [f"h{i}" for i in range(1, 10)]
    assert len(t.links) == 13
    assert [(l.a, l.b) for l in t.links] == _edges("netstorm-internet2-9.edges")
    random.seed(1)
    for l in t.links:  # file order, a->b then b->a
        assert l.ab.rate_mbps == random.randint(20, 155)
        assert l.ba.rate_mbps == random.randint(20, 155)
    for d in dirs(t):
        assert d.delay_ms == 30 and d.loss == pytest.approx(0.0002) and 20 <= d.rate_mbps <= 155


def test_gscale_file_matches_edges_and_mtree_rule():
    t = load_topology("gscale-b4-12")
    assert len(t.nodes) == 12 and len(t.links) == 19
    assert [(l.a, l.b) for l in t.links] == [(f"g{a}", f"g{b}") for a, b in _edges("gscale-b4-12.edges")]
    again = topogen.mtree_weighted(t.nodes, [(l.a, l.b) for l in t.links], sk=0.7, seed=1)
    assert [(l.ab, l.ba) for l in again.links] == [(l.ab, l.ba) for l in t.links]
    for d in dirs(t):
        assert d.rate_mbps % 10 == 0 and 130 <= d.rate_mbps <= 270 and 50 <= d.delay_ms <= 400


def test_preset_files_have_mtree_sizes():
    e, i = load_topology("equinix-like-20"), load_topology("idn-like-40")
    assert (len(e.nodes), len(e.links)) == (20, 141)
    assert (len(i.nodes), len(i.links)) == (40, 231)
    assert "not public" in e.source and "not public" in i.source


def test_small_and_quick_files():
    s = load_topology("small-3")
    assert len(s.nodes) == 3
    assert sorted(d.rate_mbps for d in dirs(s)) == [20, 20, 50, 50, 80, 80]
    assert sorted({d.delay_ms for d in dirs(s)}) == [5, 10, 20]
    q = load_topology("quick-5")
    assert len(q.nodes) == 5 and len(q.links) < 10
    assert all(20 <= d.rate_mbps <= 100 and 5 <= d.delay_ms <= 30 for d in dirs(q))
    assert len({d.rate_mbps for d in dirs(q)}) > 3


def test_regular_shipped_files():
    t = load_topology("torus-4x4")
    assert all(deg == 4 for _, deg in nx.Graph(t.graph().to_undirected()).degree())
    for name in ("torus-4x4", "mesh-2x2", "ring-6", "star-5"):
        assert {(d.rate_mbps, d.delay_ms) for d in dirs(load_topology(name))} == {(100, 10)}


# --------------------------------------------------------------------------- model


def test_graph_attributes_directional():
    t = load_topology("netstorm-internet2-9")
    g = t.graph()
    assert isinstance(g, nx.DiGraph)
    assert g.number_of_nodes() == 9 and g.number_of_edges() == 26
    assert g["h1"]["h2"]["rate_mbps"] == 54 and g["h2"]["h1"]["rate_mbps"] == 36
    for u, v, d in g.edges(data=True):
        assert set(d) == {"rate_mbps", "delay_ms", "jitter_ms", "distribution", "loss", "queue_pkts"}
        assert d["rate_mbps"] == t.linkdir(u, v).rate_mbps
    inline = load_topology({"datacenters": [{"name": "x", "region": "eu", "lat": 1.5, "lon": 2}, "y"],
                            "links": [{"between": ["x", "y"], "rate_mbps": 5}]})
    assert inline.graph().nodes["x"] == {"region": "eu", "lat": 1.5, "lon": 2}


def test_link_lookup_either_orientation():
    t = load_topology("small-3")
    assert t.link("h1", "h2") is t.link("h2", "h1")
    assert t.linkdir("h3", "h1").rate_mbps == 20
    with pytest.raises(KeyError, match="no link between"):
        load_topology("netstorm-internet2-9").link("h1", "h9")
    with pytest.raises(KeyError, match="unknown datacenter 'zz'"):
        t.link("h1", "zz")


def test_asymmetric_fields_and_defaults():
    t = load_topology({"defaults": {"delay_ms": 7, "loss": 0.01, "queue_pkts": 50},
                       "datacenters": ["a", "b", "c"],
                       "links": [{"between": ["a", "b"], "rate_mbps": [120, 40], "delay_ms": [1, 2]},
                                 {"between": ["b", "c"], "rate_mbps": 10, "jitter_ms": 1}]})
    ab = t.link("a", "b")
    assert (ab.ab.rate_mbps, ab.ba.rate_mbps, ab.ab.delay_ms, ab.ba.delay_ms) == (120, 40, 1, 2)
    assert ab.ab.loss == 0.01 and ab.ab.queue_pkts == 50
    bc = t.linkdir("c", "b")
    assert (bc.rate_mbps, bc.delay_ms, bc.jitter_ms) == (10, 7, 1)
    assert t.name == "inline"


def test_scaled():
    t = load_topology("netstorm-internet2-9")
    s = t.scaled(0.5)
    assert s.scale == 0.5 and t.scale == 1.0
    for a, b in zip(dirs(t), dirs(s)):
        assert b.rate_mbps == pytest.approx(a.rate_mbps * 0.5)
        assert (b.delay_ms, b.loss) == (a.delay_ms, a.loss)
        assert b.queue_pkts == round(a.queue_pkts * 0.5)  # same queueing delay
    assert s.scaled(4).scale == 2.0
    assert {d.queue_pkts for d in dirs(t.scaled(0.001))} == {16}  # a floor, never 0
    with pytest.raises(ConfigError, match="scale"):
        t.scaled(0)


@pytest.mark.parametrize("name", SHIPPED)
def test_round_trip(name):
    t = load_topology(name).scaled(0.1)
    d = t.to_dict()
    d2 = json.loads(json.dumps(d))
    t2 = load_topology(d2)
    assert t2 == t
    assert t2.to_dict() == d


def test_round_trip_keeps_node_attrs():
    t = topogen.mesh2d(2, 3)
    t2 = load_topology(t.to_dict())
    assert t2.node_attrs == t.node_attrs and t2 == t


def test_validate_connected():
    t = load_topology({"datacenters": ["a", "b", "c", "d"],
                       "links": [{"between": ["a", "b"], "rate_mbps": 1}, {"between": ["c", "d"], "rate_mbps": 1}]})
    with pytest.raises(ConfigError) as e:
        validate_connected(t, source="exp.yaml", key="topology")
    assert e.value.source == "exp.yaml" and e.value.key == "topology"
    assert "not connected" in str(e.value) and "{a, b}" in str(e.value)
    validate_connected(load_topology({"datacenters": ["solo"]}), source="x", key="k")


def test_describe_names():
    assert describe_names([f"h{i}" for i in range(1, 10)]) == "h1..h9"
    assert describe_names(["a", "b"]) == "a, b"
    assert "(30 in total)" in describe_names([f"x{i}" for i in range(30, 0, -1)])


def test_hand_built_validate():
    d = LinkDir(10)
    Topology("t", ["a", "b"], [Link("a", "b", d, d)]).validate()
    with pytest.raises(ConfigError) as e:
        Topology("t", ["a", "b"], [Link("a", "b", d, LinkDir(-1))]).validate(source="s")
    assert e.value.key == "links[0].rate_mbps[1]"


# --------------------------------------------------------------------------- validation errors

ERROR_CASES = [
    # (mapping, expected key (inside the inline 'topology' block), message fragment)
    ({"datacenters": ["a"], "nodes": []}, "topology.nodes", "unknown key 'nodes'"),
    ({"datacenters": ["a", "b"], "links": [{"between": ["a", "b"], "rate_mbps": 1, "bw": 2}]},
     "topology.links[0].bw", "unknown key 'bw' in link"),
    ({"datacenters": ["a", "b"], "links": [{"rate_mbps": 1}]}, "topology.links[0].between", "missing 'between'"),
    ({"datacenters": ["a", "b"], "links": [{"between": ["a"], "rate_mbps": 1}]},
     "topology.links[0].between", "two datacenter names"),
    ({"datacenters": [f"h{i}" for i in range(1, 10)], "links": [{"between": ["h1", "h12"], "rate_mbps": 1}]},
     "topology.links[0].between[1]", "unknown datacenter 'h12' (known: h1..h9)"),
    ({"datacenters": ["a", "b"], "links": [{"between": ["a", "a"], "rate_mbps": 1}]},
     "topology.links[0].between", "self-loop"),
    ({"datacenters": ["a", "b"], "links": [{"between": ["a", "b"], "rate_mbps": 1},
                                           {"between": ["b", "a"], "rate_mbps": 2}]},
     "topology.links[1].between", "duplicate link"),
    (base(rate_mbps=0), "topology.links[0].rate_mbps", "> 0"),
    (base(rate_mbps=[10, -5]), "topology.links[0].rate_mbps[1]", "> 0"),
    (base(rate_mbps=[10, 5, 3]), "topology.links[0].rate_mbps", "list of 3"),
    (base(delay_ms=-1), "topology.links[0].delay_ms", ">= 0"),
    (base(jitter_ms=-0.5), "topology.links[0].jitter_ms", ">= 0"),
    (base(loss=1.0), "topology.links[0].loss", "[0, 1)"),
    (base(loss=-0.1), "topology.links[0].loss", "[0, 1)"),
    (base(queue_pkts=10.5), "topology.links[0].queue_pkts", "integer"),
    (base(queue_pkts=0), "topology.links[0].queue_pkts", "> 0"),
    (base(queue_pkts="100"), "topology.links[0].queue_pkts", "got string '100'"),
    (base(rate_mbps="fast"), "topology.links[0].rate_mbps", "got string 'fast'"),
    (base(delay_ms=True), "topology.links[0].delay_ms", "got boolean"),
    (base(rate_mbps=float("nan")), "topology.links[0].rate_mbps", "finite"),
    ({"datacenters": ["a", "b"], "links": [{"between": ["a", "b"]}]}, "topology.links[0].rate_mbps",
     "missing 'rate_mbps'"),
    ({"datacenters": ["a", "b"], "links": "a-b"}, "topology.links", "expected a list of links"),
    ({"datacenters": ["a", "b"], "links": ["a-b"]}, "topology.links[0]", "expected a link mapping"),
    ({"datacenters": ["a", "a"]}, "topology.datacenters[1]", "duplicate datacenter name 'a'"),
    ({"datacenters": ["a", {"name": "a"}]}, "topology.datacenters[1]", "duplicate datacenter name"),
    ({"datacenters": [1, 2]}, "topology.datacenters[0]", "expected a datacenter name"),
    ({"datacenters": ["bad name"]}, "topology.datacenters[0]", "invalid datacenter name"),
    ({"datacenters": [{"region": "x"}]}, "topology.datacenters[0]", "missing 'name'"),
    ({"datacenters": [{"name": "a", "lat": 100}]}, "topology.datacenters[0].lat", "latitude"),
    ({"datacenters": [{"name": "a", "tags": [1]}]}, "topology.datacenters[0].tags", "scalar"),
    ({"datacenters": []}, "topology.datacenters", "empty topology"),
    ({"name": "x"}, "topology.datacenters", "missing 'datacenters'"),
    ({"name": 3, "datacenters": ["a"]}, "topology.name", "expected a string"),
    ({"datacenters": ["a"], "defaults": {"rate": 1}}, "topology.defaults.rate", "unknown key 'rate'"),
    ({"datacenters": ["a"], "defaults": {"loss": 2}}, "topology.defaults.loss", "[0, 1)"),
    ({"datacenters": ["a"], "scale": 0}, "topology.scale", "positive"),
    ({"generator": {"kind": "banana"}}, "topology.generator.kind", "unknown generator kind 'banana'"),
    ({"generator": {"n": 3}}, "topology.generator.kind", "missing 'kind'"),
    ({"generator": "ring"}, "topology.generator", "expected a mapping"),
    ({"generator": {"kind": "ring", "n": 2}}, "topology.generator.n", ">= 3"),
    ({"generator": {"kind": "ring", "n": "six"}}, "topology.generator.n", "integer"),
    ({"generator": {"kind": "ring", "size": 6}}, "topology.generator.size", "unknown key 'size'"),
    ({"generator": {"kind": "ring", "n": 6, "rate_mbps": -1}}, "topology.generator.rate_mbps", "> 0"),
    ({"generator": {"kind": "ring", "n": 6, "loss": 3}}, "topology.generator.loss", "[0, 1)"),
    ({"generator": {"kind": "mtree-random", "n": 10}}, "topology.generator.m", "missing parameter 'm'"),
    ({"generator": {"kind": "mtree-random", "n": 10, "m": 8}}, "topology.generator.m", "9 <= m <= 45"),
    ({"generator": {"kind": "mtree-random", "n": 10, "m": 46}}, "topology.generator.m", "9 <= m <= 45"),
    ({"generator": {"kind": "mtree-random", "n": 5, "m": 5, "sk": 1.5}}, "topology.generator.sk", "[0, 1]"),
    ({"generator": {"kind": "mtree-random", "n": 5, "m": 5, "seed": -1}}, "topology.generator.seed", ">= 0"),
    ({"generator": {"kind": "mtree-random", "n": 5, "m": 5, "delay_scaling": "log"}},
     "topology.generator.delay_scaling", "'instance', 'range'"),
    ({"generator": {"kind": "mtree-random", "n": 5, "m": 5, "rate_min_mbps": 11, "rate_max_mbps": 19}},
     "topology.generator.rate_step_mbps", "no positive multiple"),
    ({"generator": {"kind": "kary-tree", "k": 2}}, "topology.generator.n", "exactly one of"),
    ({"generator": {"kind": "torus2d", "rows": 0, "cols": 4}}, "topology.generator.rows", ">= 1"),
    ({"generator": {"kind": "crew-mesh", "n": 4, "k_min": 5, "k_max": 2}}, "topology.generator.k_max", ">= 5"),
    ({"generator": {"kind": "zoo", "path": "nope.graphml"}}, "topology.generator.path", "file not found"),
    ({"generator": {"kind": "ring", "n": 4}, "datacenters": ["a"]}, "topology.datacenters", "cannot be combined"),
    ({"generator": {"kind": "ring", "n": 4}, "defaults": {"rate_mbps": 5}}, "topology.defaults.rate_mbps",
     "not used with a generator"),
]


@pytest.mark.parametrize("data,key,fragment", ERROR_CASES)
def test_validation_errors(data, key, fragment):
    with pytest.raises(ConfigError) as e:
        load_topology(data, source="exp.yaml", key="topology")
    err = e.value
    assert err.source == "exp.yaml"
    assert err.key == key, str(err)
    assert fragment in err.message, str(err)
    assert str(err) == f"exp.yaml: {key}: {err.message}"


def test_unknown_topology_name_lists_available():
    with pytest.raises(ConfigError) as e:
        load_topology("netstorm-internet2-10", source="exp.yaml", key="topology")
    assert e.value.key == "topology"
    assert "unknown topology 'netstorm-internet2-10'" in e.value.message
    for n in SHIPPED:
        assert n in e.value.message


def test_bad_ref_type():
    with pytest.raises(ConfigError, match="expected a topology name"):
        load_topology(42, source="e.yaml")


def test_file_errors_name_file_and_key(tmp_path):
    p = tmp_path / "t.yaml"
    p.write_text("datacenters: [a, b]\nlinks:\n  - {between: [a, b], rate_mbps: 10}\n"
                 "  - {between: [a, c], rate_mbps: 10}\n")
    with pytest.raises(ConfigError) as e:
        load_topology(str(p), source="exp.yaml", key="topology")
    assert e.value.source.endswith("t.yaml") and e.value.key == "links[1].between[1]"
    assert "unknown datacenter 'c' (known: a, b)" in str(e.value)


def test_yaml_syntax_duplicate_keys_and_exponent_floats(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("datacenters: [a, b\n")
    with pytest.raises(ConfigError, match="invalid YAML.*line"):
        load_topology(str(p))
    p.write_text("datacenters: [a]\ndatacenters: [b]\n")
    with pytest.raises(ConfigError, match="duplicate key 'datacenters'"):
        load_topology(str(p))
    p.write_text("datacenters: [a, b]\nlinks: [{between: [a, b], rate_mbps: 1e2, loss: 2e-4}]\n")
    t = load_topology(str(p))
    assert t.name == "bad" and t.links[0].ab.rate_mbps == 100 and t.links[0].ab.loss == pytest.approx(2e-4)
    p.write_text("")
    with pytest.raises(ConfigError, match="empty topology"):
        load_topology(str(p))


def test_relative_path_resolved_against_source(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "w.yaml").write_text("datacenters: [a, b]\nlinks: [{between: [a, b], rate_mbps: 3}]\n")
    exp = tmp_path / "exp.yaml"
    t = load_topology("sub/w.yaml", source=str(exp))
    assert t.name == "w"


# --------------------------------------------------------------------------- generators


@pytest.mark.parametrize("n,m", [(2, 1), (5, 4), (12, 19), (20, 141), (40, 231), (8, 28)])
def test_mtree_random_counts_and_connectivity(n, m):
    t = topogen.mtree_random(n, m, sk=0.7, seed=3)
    assert len(t.nodes) == n and len(t.links) == m
    assert t.is_connected()
    assert len({frozenset((l.a, l.b)) for l in t.links}) == m
    t.validate()


@pytest.mark.parametrize("sk", [0.1, 0.25, 0.7, 1.0])
def test_mtree_rates_multiples_of_ten_within_bounds(sk):
    t = topogen.mtree_random(20, 141, sk=sk, seed=7)
    lo, hi = 200 - 100 * sk, 200 + 100 * sk
    for d in dirs(t):
        assert d.rate_mbps % 10 == 0 and lo - 1e-9 <= d.rate_mbps <= hi + 1e-9
        assert 50 <= d.delay_ms <= 400
    for l in t.links:  # MTREE: one "bidirectional bandwidth" per link
        assert l.ab == l.ba


def test_mtree_rates_cover_range_and_extremes_get_50_and_400():
    t = topogen.mtree_random(40, 231, sk=0.7, seed=1)
    rates = {d.rate_mbps for d in dirs(t)}
    assert rates == set(range(130, 271, 10))
    by_rate = {d.rate_mbps: d.delay_ms for d in dirs(t)}
    assert by_rate[270] == 50 and by_rate[130] == 400


@pytest.mark.parametrize("scaling", ["instance", "range"])
def test_mtree_latency_inversely_ordered(scaling):
    t = topogen.mtree_random(20, 141, sk=0.9, seed=5, delay_scaling=scaling, asymmetric=True)
    ds = dirs(t)
    for x in ds:
        for y in ds:
            if x.rate_mbps > y.rate_mbps:
                assert x.delay_ms < y.delay_ms
            elif x.rate_mbps == y.rate_mbps:
                assert x.delay_ms == y.delay_ms
    assert any(l.ab.rate_mbps != l.ba.rate_mbps for l in t.links)


def test_mtree_delay_formula():
    d = topogen.mtree_delays([100, 300, 150], fast_mbps=300, slow_mbps=100)
    assert list(d) == [400, 50, pytest.approx(50 + 350 * (1 / 150 - 1 / 300) / (1 / 100 - 1 / 300), abs=0.01)]
    assert list(topogen.mtree_delays([200], fast_mbps=200, slow_mbps=200)) == [225]
    t = topogen.mtree_random(6, 8, sk=0, seed=1)
    assert {(d.rate_mbps, d.delay_ms) for d in dirs(t)} == {(200, 225)}


def test_mtree_overrides():
    t = topogen.mtree_random(10, 20, seed=2, rate_min_mbps=20, rate_max_mbps=60, rate_step_mbps=20,
                             delay_min_ms=5, delay_max_ms=30)
    assert {d.rate_mbps for d in dirs(t)} <= {20, 40, 60}
    assert all(5 <= d.delay_ms <= 30 for d in dirs(t))


def test_generators_deterministic_by_seed():
    for fn in (lambda s: topogen.mtree_random(20, 60, seed=s), lambda s: topogen.crew_mesh(6, seed=s),
               lambda s: topogen.equinix_like(seed=s)):
        assert fn(1) == fn(1)
        assert fn(1).links != fn(2).links
    a = load_topology({"generator": {"kind": "idn-like", "seed": 4}})
    assert a == load_topology({"generator": {"kind": "idn-like", "seed": 4}})


def test_presets():
    e = topogen.equinix_like(seed=1)
    i = topogen.idn_like(seed=1)
    assert (len(e.nodes), len(e.links), len(i.nodes), len(i.links)) == (20, 141, 40, 231)
    assert e.name == "equinix-like-20" and "not public" in e.source


def test_crew_mesh():
    t = topogen.crew_mesh(10, seed=3)
    assert len(t.links) == 45
    ks = [d.rate_mbps / 25 for d in dirs(t)]
    assert all(k == int(k) and 1 <= k <= 10 for k in ks)
    assert 4 <= sum(ks) / len(ks) <= 6
    assert any(l.ab.rate_mbps != l.ba.rate_mbps for l in t.links)  # directions independent
    assert all(d.delay_ms == 0 for d in dirs(t))
    assert {d.delay_ms for d in dirs(topogen.crew_mesh(3, delay_ms=20))} == {20}
    # extreme std exercises the clipping
    wide = topogen.crew_mesh(12, seed=1, k_std=10)
    assert {d.rate_mbps for d in dirs(wide)} >= {25, 250}


def test_torus_degrees_and_coordinates():
    t = topogen.torus2d(4, 4)
    g = t.graph()
    assert len(t.links) == 32
    assert all(g.out_degree(n) == 4 and g.in_degree(n) == 4 for n in t.nodes)
    for n in t.nodes:
        r, c = t.node_attrs[n]["row"], t.node_attrs[n]["col"]
        assert n == f"n{r * 4 + c}"
        nbrs = set(t.neighbors(n))
        assert nbrs == {f"n{((r + dr) % 4) * 4 + (c + dc) % 4}" for dr, dc in ((1, 0), (-1, 0), (0, 1), (0, -1))}
    t35 = topogen.torus2d(3, 5)
    assert all(d == 4 for _, d in t35.graph().out_degree())
    assert len(topogen.torus2d(2, 4).links) == 12  # 2-wide dimension: wrap == mesh link


def test_mesh_coordinates():
    t = topogen.mesh2d(3, 4)
    assert len(t.nodes) == 12 and len(t.links) == 3 * 3 + 2 * 4
    for n in t.nodes:
        r, c = t.node_attrs[n]["row"], t.node_attrs[n]["col"]
        assert n == f"n{r * 4 + c}"
        expect = {f"n{rr * 4 + cc}" for rr, cc in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1))
                  if 0 <= rr < 3 and 0 <= cc < 4}
        assert set(t.neighbors(n)) == expect
    m = load_topology("mesh-2x2")
    assert [(m.node_attrs[n]["row"], m.node_attrs[n]["col"]) for n in m.nodes] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {frozenset((l.a, l.b)) for l in m.links} == {frozenset(p) for p in
                                                         (("n0", "n1"), ("n2", "n3"), ("n0", "n2"), ("n1", "n3"))}


def test_regular_generators():
    r = topogen.ring(6, rate_mbps=50, delay_ms=3)
    assert all(d == 2 for _, d in r.graph().out_degree()) and r.is_connected()
    assert {(d.rate_mbps, d.delay_ms) for d in dirs(r)} == {(50, 3)}
    s = topogen.star(5)
    assert len(s.links) == 4 and set(s.neighbors("n0")) == {"n1", "n2", "n3", "n4"}
    f = topogen.full_mesh(5)
    assert len(f.links) == 10
    k = topogen.kary_tree(2, depth=3)
    assert len(k.nodes) == 15 and len(k.links) == 14 and k.is_connected()
    assert k.node_attrs["n14"]["level"] == 3
    k3 = topogen.kary_tree(3, n=10)
    assert len(k3.nodes) == 10 and set(k3.neighbors("n0")) == {"n1", "n2", "n3"}


def test_generator_block_link_extras_and_names():
    t = load_topology({"name": "mine", "defaults": {"queue_pkts": 64},
                       "generator": {"kind": "ring", "n": 4, "loss": 0.01, "jitter_ms": 2}})
    assert t.name == "mine"
    assert {(d.loss, d.jitter_ms, d.queue_pkts) for d in dirs(t)} == {(0.01, 2, 64)}
    assert load_topology({"generator": {"kind": "ring", "n": 4}}).name == "ring-4"


# --------------------------------------------------------------------------- Topology Zoo

ZOO_GRAPHML = """<?xml version="1.0" encoding="utf-8"?>
<graphml xmlns="http://graphml.graphdrawing.org/xmlns">
  <key attr.name="Network" attr.type="string" for="graph" id="d0"/>
  <key attr.name="label" attr.type="string" for="node" id="d1"/>
  <key attr.name="Latitude" attr.type="double" for="node" id="d2"/>
  <key attr.name="Longitude" attr.type="double" for="node" id="d3"/>
  <key attr.name="LinkSpeedRaw" attr.type="double" for="edge" id="d4"/>
  <key attr.name="LinkLabel" attr.type="string" for="edge" id="d5"/>
  <graph edgedefault="undirected">
    <data key="d0">Tiny</data>
    <node id="0"><data key="d1">New York</data><data key="d2">40.7128</data><data key="d3">-74.006</data></node>
    <node id="1"><data key="d1">Chicago</data><data key="d2">41.8781</data><data key="d3">-87.6298</data></node>
    <node id="2"><data key="d1">Los Angeles</data><data key="d2">34.0522</data><data key="d3">-118.2437</data></node>
    <node id="3"><data key="d1">Nowhere</data></node>
    <edge source="0" target="1"><data key="d4">10000000000.0</data><data key="d5">10G</data></edge>
    <edge source="1" target="2"/>
    <edge source="2" target="3"/>
  </graph>
</graphml>
"""


def test_zoo_graphml_great_circle_delays(tmp_path):
    p = tmp_path / "Tiny.graphml"
    p.write_text(ZOO_GRAPHML)
    t = load_topology({"generator": {"kind": "zoo", "path": str(p), "rate_mbps": 40, "delay_ms": 7}})
    assert t.nodes == ["New_York", "Chicago", "Los_Angeles", "Nowhere"]
    assert t.node_attrs["New_York"]["label"] == "New York"
    assert t.node_attrs["Chicago"]["lat"] == pytest.approx(41.8781)
    ny_chi = topogen.great_circle_km(40.7128, -74.006, 41.8781, -87.6298)
    assert 1130 < ny_chi < 1160  # ~1145 km
    l = t.link("New_York", "Chicago")
    assert l.ab.delay_ms == pytest.approx(ny_chi / 200, abs=1e-3) and l.ab == l.ba
    assert l.ab.rate_mbps == 10000  # LinkSpeedRaw 10 Gbit/s
    chi_la = t.linkdir("Chicago", "Los_Angeles")
    assert chi_la.rate_mbps == 40  # no speed attribute -> parameter
    assert 2700 / 200 < chi_la.delay_ms < 2850 / 200
    assert t.linkdir("Los_Angeles", "Nowhere").delay_ms == 7  # no coordinates -> parameter
    assert "Topology Zoo" in t.source
    # direct load by path uses defaults (200 km/ms), relative km_per_ms changes delays
    direct = load_topology(str(p))
    assert direct.linkdir("Chicago", "New_York").delay_ms == l.ab.delay_ms
    assert direct.linkdir("Chicago", "Los_Angeles").rate_mbps == 100
    slow = topogen.zoo(p, km_per_ms=100)
    assert slow.linkdir("Chicago", "New_York").delay_ms == pytest.approx(2 * l.ab.delay_ms, abs=2e-3)
    idx = topogen.zoo(p, node_names="index")
    assert idx.nodes == ["n0", "n1", "n2", "n3"]


def test_zoo_relative_path_and_gml(tmp_path):
    p = tmp_path / "Tiny.graphml"
    p.write_text(ZOO_GRAPHML)
    spec = tmp_path / "topo.yaml"
    spec.write_text("generator: {kind: zoo, path: Tiny.graphml}\n")
    assert len(load_topology(str(spec)).links) == 3
    gml = tmp_path / "Two.gml"
    gml.write_text('graph [\n  multigraph 1\n  node [ id 0 label "A" Latitude 0.0 Longitude 0.0 ]\n'
                   '  node [ id 1 label "A" Latitude 0.0 Longitude 1.0 ]\n'
                   '  edge [ source 0 target 1 LinkSpeed "2.5" LinkSpeedUnits "G" ]\n'
                   '  edge [ source 0 target 1 LinkSpeed "2.5" LinkSpeedUnits "G" ]\n]\n')
    t = load_topology(str(gml))
    assert t.nodes == ["n0", "n1"]  # duplicate labels -> index names
    assert len(t.links) == 1 and t.links[0].ab.rate_mbps == 5000  # parallel edges merged
    assert t.links[0].ab.delay_ms == pytest.approx(111.19 / 200, abs=1e-2)


def test_zoo_bad_file(tmp_path):
    p = tmp_path / "bad.graphml"
    p.write_text("<graphml><not closed")
    with pytest.raises(ConfigError) as e:
        load_topology(str(p))
    assert e.value.source.endswith("bad.graphml") and "cannot parse" in e.value.message


def test_switch_nodes_and_the_leaf_spine_generator():
    """Switch (non-worker) nodes: ``switch: true`` on a datacenter entry (MultiTree
    Sec. III-C 3); the ``leaf-spine`` generator flags its leaves and spines."""
    topo = load_topology({"name": "sw", "datacenters": ["a", "b", {"name": "s", "switch": True}],
                          "links": [{"between": ["a", "s"], "rate_mbps": 10}, {"between": ["b", "s"], "rate_mbps": 10}]})
    assert topo.graph().nodes["s"]["switch"] is True and "switch" not in topo.graph().nodes["a"]
    with pytest.raises(ConfigError, match=r"datacenters\[1\]\.switch: expected true or false"):
        load_topology({"name": "sw", "datacenters": ["a", {"name": "s", "switch": "yes"}],
                       "links": [{"between": ["a", "s"], "rate_mbps": 10}]})
    ls = load_topology({"generator": {"kind": "leaf-spine", "leaves": 2, "spines": 3, "hosts_per_leaf": 4}})
    g = ls.graph()
    assert sorted(n for n in g if g.nodes[n].get("switch")) == ["leaf0", "leaf1", "spine0", "spine1", "spine2"]
    assert g.number_of_edges() == 2 * (8 + 2 * 3)
