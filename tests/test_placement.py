"""Placement of datacenters on servers (pure) and the servers file's checks (nothing contacted)."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from testbed import config
from testbed.cluster import check_placement, load_servers
from testbed.errors import ConfigError, RunError
from testbed.placement import FRAMES_PER_CORE, ServerSize, contiguous, node_loads, place, underlay_problems
from testbed.routing import shortest_paths
from testbed.topology import list_topologies, load_topology

REPO = Path(__file__).resolve().parent.parent


def _cut(topo, assign):
    return sum(l.ab.rate_mbps + l.ba.rate_mbps for l in topo.links if assign[l.a] != assign[l.b])


def _servers(k, **kw):
    return [ServerSize(f"s{i}", **kw) for i in range(k)]


@pytest.mark.parametrize("name", list_topologies())
@pytest.mark.parametrize("k", [2, 3, 4])
def test_placement_beats_contiguous_blocks_within_its_balance(name, k):
    """On every shipped topology: every datacenter placed, every server within its limit, and
    the cut rate no worse than contiguous blocks in file order (where those are within the
    same limits; e.g. a star's hub alone outweighs a fair share)."""
    topo = load_topology(name)
    if k > len(topo.nodes):
        pytest.skip("more servers than datacenters")
    p = place(topo, _servers(k))
    assert set(p.assignment) == set(topo.nodes)
    assert all(p.load[s] <= p.limit[s] + 1e-6 for s in p.servers)
    base = contiguous(topo.nodes, p.servers)
    w = node_loads(topo)
    base_ok = all(sum(w[n] for n in topo.nodes if base[n] == s) <= p.limit[s] + 1e-6 for s in p.servers)
    if base_ok:
        assert p.cut_mbps <= _cut(topo, base) + 1e-6, (p.cut_mbps, _cut(topo, base))
    assert p.cut_mbps == pytest.approx(_cut(topo, p.assignment))
    assert p.cut == [j for j, l in enumerate(topo.links) if p.assignment[l.a] != p.assignment[l.b]]


def test_placement_is_deterministic():
    topo = load_topology("idn-like-40")
    runs = [place(topo, _servers(3)).assignment for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    # in a fresh interpreter too (METIS's seed is fixed, nothing depends on hash order)
    code = ("from testbed.placement import place, ServerSize; from testbed.topology import load_topology; "
            "print(sorted(place(load_topology('idn-like-40'), [ServerSize(f's{i}') for i in range(3)]).assignment.items()))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": "/usr/bin:/bin"}).stdout
    assert out.strip() == str(sorted(runs[0].items()))


def test_pins_are_respected_and_the_rest_follows():
    topo = load_topology("gscale-b4-12")
    free = place(topo, _servers(2))
    # pin two datacenters to the server METIS did not give them
    a, b = topo.nodes[0], topo.nodes[5]
    other = {s: t for s, t in (("s0", "s1"), ("s1", "s0"))}
    pins = {a: other[free.assignment[a]], b: other[free.assignment[b]]}
    p = place(topo, _servers(2), pins)
    assert all(p.assignment[dc] == s for dc, s in pins.items())
    assert all(p.load[s] <= p.limit[s] + 1e-6 for s in p.servers)
    assert p.pinned == pins
    with pytest.raises(ConfigError, match="placement.h1: unknown server 'nope'"):
        place(load_topology("small-3"), _servers(2), {"h1": "nope"})


def test_capacity_from_cores_is_respected_or_refused():
    """A server with fewer cores gets less load, never more than its cores carry; a topology
    too big for the cores is refused naming the server."""
    topo = load_topology("gscale-b4-12")
    total = sum(node_loads(topo).values())
    cores_small = 0.25 * total / FRAMES_PER_CORE  # carries a quarter of the whole
    p = place(topo, [ServerSize("big", cores=8), ServerSize("small", cores=cores_small)])
    assert p.load["small"] <= cores_small * FRAMES_PER_CORE + 1e-6
    assert p.load["small"] < p.load["big"]
    with pytest.raises(ConfigError, match="server (a|b): its datacenters' links would carry"):
        place(topo, [ServerSize("a", cores=0.5), ServerSize("b", cores=0.5)])


def test_underlay_too_small_is_named():
    p = place(load_topology("quick-5"), [ServerSize("s1"), ServerSize("s2")])
    assert underlay_problems(p, {}, {"s1": None, "s2": None}) == []
    why = underlay_problems(p, {("s1", "s2"): 50.0}, {"s1": 50.0, "s2": None})
    assert any(w.startswith("servers s1 -> s2: the cut links need") for w in why)
    assert any(w.startswith("server s1: the cut links would send") for w in why)


# -- the servers file ------------------------------------------------------------------------

def _file(tmp_path, data) -> Path:
    f = tmp_path / "servers.yaml"
    f.write_text(yaml.safe_dump(data))
    return f


def _two(**extra):
    return {"coordinator": "192.0.2.10",
            "servers": {"s1": {"ssh": "root@192.0.2.1", "underlay": "192.0.2.1"},
                        "s2": {"ssh": "root@192.0.2.2", "underlay": "192.0.2.2"}}, **extra}


def test_shipped_local_servers_file_is_valid():
    sf = load_servers(REPO / "experiments" / "servers-local-2.yaml")
    assert sf.local is not None and list(sf.servers) == ["s1", "s2"]
    assert sf.servers["s1"].ssh == "root@10.254.0.1"


@pytest.mark.parametrize("change, needle", [
    (lambda d: d["servers"]["s1"].update(usr="x"), "servers.s1.usr: unknown key"),
    (lambda d: d.update(colour="x"), "colour: unknown key"),
    (lambda d: d["servers"]["s2"].update(underlay="192.0.2.1"), "servers.s2.underlay: 192.0.2.1 is also server s1's"),
    (lambda d: d["servers"]["s1"].update(underlay="s1.example.org"), "servers.s1.underlay: expected an IPv4 address"),
    (lambda d: d["servers"]["s1"].pop("underlay"), "servers.s1.underlay: missing"),
    (lambda d: d["servers"]["s1"].pop("ssh"), "servers.s1.ssh: expected an ssh destination"),
    (lambda d: d["servers"]["s1"].update(cores=0), "servers.s1.cores: must be > 0"),
    (lambda d: d.pop("coordinator"), "coordinator: missing"),
    (lambda d: d.update(coordinator="192.0.2.2"), "coordinator: 192.0.2.2 is server s2's underlay address"),
    (lambda d: d.update(servers={}), "servers: expected at least one server"),
])
def test_bad_servers_file_names_the_problem(tmp_path, change, needle):
    data = _two()
    change(data)
    with pytest.raises(ConfigError) as e:
        load_servers(_file(tmp_path, data))
    assert needle in str(e.value) and str(tmp_path) in str(e.value)


def test_validate_prints_the_placement_and_refuses_a_small_underlay(tmp_path):
    exp = tmp_path / "exp.yaml"
    exp.write_text("name: v\ntopology: quick-5\nscheme: {name: ring}\nplacement: {h1: s2}\n")
    cli = [sys.executable, "-m", "testbed", "validate", str(exp), "--servers"]
    res = subprocess.run(cli + [str(_file(tmp_path, _two()))], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "server s2: h1" in res.stdout and "rate crossing servers: 220 Mbit/s" in res.stdout
    data = _two()
    data["servers"]["s1"]["nic_mbps"] = 100
    res = subprocess.run(cli + [str(_file(tmp_path, data))], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.count("\n") == 1 and "server s1: the cut links would" in res.stderr


def test_placement_pins_are_checked():
    exp = config.validate({"name": "p", "topology": "small-3", "scheme": {"name": "ring"},
                           "placement": {"h1": "s9"}}, "<test>")
    with pytest.raises(ConfigError, match="placement.h1: unknown server 's9'"):
        check_placement(exp, load_servers(REPO / "experiments" / "servers-local-2.yaml"))
    with pytest.raises(ConfigError, match="placement: unknown datacenter 'h7'"):
        config.validate({"name": "p", "topology": "small-3", "scheme": {"name": "ring"},
                         "placement": {"h7": "s1"}}, "<test>")


LEAF_SPINE = {"generator": {"kind": "leaf-spine", "leaves": 2, "spines": 2, "hosts_per_leaf": 2, "rate_mbps": 100}}


def test_a_plan_naming_paths_is_refused_on_servers(tmp_path):
    """MultiTree's bfs names every message's path (policy routing, one machine's network only):
    validate --servers refuses it in one line naming the scheme, before anything is built;
    the routed variant (static routes) is placed; the cluster network refuses a path off the
    static routes at run time too, and a link or the static route itself needs nothing."""
    from testbed.cluster import ClusterNetwork

    exp = tmp_path / "exp.yaml"
    servers = str(_file(tmp_path, _two()))
    cli = [sys.executable, "-m", "testbed", "validate", str(exp), "--servers", servers]
    exp.write_text(yaml.safe_dump({"name": "p", "topology": LEAF_SPINE, "scheme": {"name": "multitree", "variant": "routed"},
                                   "variants": [{"label": "bfs", "scheme": {"name": "multitree", "variant": "bfs"}}]}))
    res = subprocess.run(cli, cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 2 and "Traceback" not in res.stderr and res.stderr.count("\n") == 1, res.stderr
    assert not res.stdout and "variants[0].scheme: bfs's plan names" in res.stderr and "off the static routes" in res.stderr and "not with --servers" in res.stderr
    assert "policy routing" in res.stderr
    exp.write_text(yaml.safe_dump({"name": "p", "topology": LEAF_SPINE, "scheme": {"name": "multitree", "variant": "routed"}}))
    res = subprocess.run(cli, cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0 and "rate crossing servers" in res.stdout, res.stderr
    e = config.load_experiment(exp)
    sf = load_servers(servers)
    net = ClusterNetwork(e.topology, sf, check_placement(e, sf))  # not started: nothing is contacted
    a, b = e.topology.links[0].a, e.topology.links[0].b
    static = ("h0", "leaf0", "h1")  # the only way: the static route both ways
    assert net.install_paths([(a, b), static]) == {}
    off = next(p for p in (("leaf0", "spine0", "leaf1"), ("leaf0", "spine1", "leaf1"))
               if shortest_paths(e.topology.graph())[("leaf0", "leaf1")] != list(p))
    with pytest.raises(RunError, match=rf"names 1 paths off the static routes \(e.g. {'>'.join(off)}\): per-flow paths"):
        net.install_paths([(a, b), static, off])
