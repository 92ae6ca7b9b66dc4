"""One experiment on several servers, on one machine: "servers" that are network namespaces,
each with its own sshd and underlay address (testbed/emulator/nsservers.py), reached over SSH
with paramiko; cut links are VXLAN tunnels shaped as local links are."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from fidelity import fidelity

from testbed.cluster import load_servers, network_on
from testbed.emulator.nsservers import core_share, local_leftovers, sshd_binary
from testbed.placement import place
from testbed.topology import load_topology

REPO = Path(__file__).resolve().parent.parent
LOCAL2 = REPO / "experiments" / "servers-local-2.yaml"


@pytest.fixture
def servers(netenv):
    if sshd_binary() is None:
        pytest.skip("sshd not installed (apt install openssh-server): namespace servers need it")
    assert not local_leftovers(), "local servers of another run are up"
    yield
    assert not local_leftovers(), f"left behind: {local_leftovers()}"


def _servers_file(tmp_path, servers: int = 2, **local) -> Path:
    data = yaml.safe_load(LOCAL2.read_text())
    data["local"].update(local)
    for i in range(3, servers + 1):
        data["servers"][f"s{i}"] = {"underlay": f"10.254.0.{i}"}
    data["workdir"] = str(tmp_path / "servers")
    f = tmp_path / "servers.yaml"
    f.write_text(yaml.safe_dump(data))
    return f


def _ping_df(net, src, dst, size) -> int:
    p = net.popen(src, ["ping", "-n", "-q", "-c", "1", "-W", "3", "-M", "do", "-s", str(size),
                        net.peer_address(src, dst)])
    return p.wait(timeout=20)


@pytest.mark.net
@pytest.mark.parametrize("underlay_mtu, link_mtu", [(9000, 1500), (1500, 1450)])
def test_full_size_frames_cross_every_cut_link(servers, tmp_path, underlay_mtu, link_mtu):
    """quick-5 over two servers: every direction (local and cut) carries a full-size
    don't-fragment ping of the WAN's MTU and not one byte more; with a 1500-byte underlay
    every link's MTU is 1450, on purpose, everywhere alike."""
    sf = load_servers(_servers_file(tmp_path, mtu=underlay_mtu))
    topo = load_topology("quick-5")
    with network_on(sf, topo, log=lambda m: None)(topo, log=lambda m: None) as net:
        assert net.placement.cut and net.underlay["link_mtu"] == link_mtu
        for src, dst in net.directions:
            assert _ping_df(net, src, dst, link_mtu - 28) == 0, f"{src} -> {dst}: {link_mtu}-byte frame lost"
        for j in net.placement.cut:
            link = topo.links[j]
            assert _ping_df(net, link.a, link.b, link_mtu - 27) != 0, "a frame over the MTU crossed"
        # routes between non-adjacent datacenters: the single-machine network's (node addresses)
        for src in topo.nodes:
            for dst in topo.nodes:
                if src != dst:
                    p = net.popen(src, ["ping", "-n", "-q", "-c", "1", "-W", "3", net.node_address(dst)])
                    assert p.wait(timeout=20) == 0, f"{src} cannot reach {dst}'s node address"


@pytest.mark.net
def test_remote_processes_leave_no_descriptor_open(servers, tmp_path):
    """A process per link direction and step (a link check starts hundreds): once
    communicated (or reaped), a remote process holds none of this process's descriptors."""
    sf = load_servers(_servers_file(tmp_path))
    topo = load_topology("small-3")
    with network_on(sf, topo, log=lambda m: None)(topo, log=lambda m: None) as net:
        before = len(os.listdir("/proc/self/fd"))
        for dc in topo.nodes:
            for _ in range(10):
                p = net.popen(dc, ["cat"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
                assert p.communicate("x", timeout=20) == ("x", "")
        assert len(os.listdir("/proc/self/fd")) == before  # though the network holds every process
        p = net.popen(topo.nodes[0], ["sleep", "60"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        net.stop_processes(grace_s=0)
        assert len(os.listdir("/proc/self/fd")) == before


def _linkcheck(topo_name: str, sf):
    from testbed.emulator.linkcheck import run_linkcheck

    topo = load_topology(topo_name)

    def measure():
        res = run_linkcheck(topo, seconds=3, phases=("single",), progress=lambda m: None,
                            network=network_on(sf, topo, log=lambda m: None))
        return res, res["steal"]

    def problems(res):
        return [f"{d['src']}->{d['dst']}: {[k for k, ok in d['checks'].items() if not ok]}"
                for d in res["directions"] if not d["ok"]] + (
            [] if res["emulation_kept_up"]["ok"] else [f"kept up: {res['emulation_kept_up']}"])
    return fidelity(measure, problems)


@pytest.mark.net
def test_linkcheck_over_two_servers_within_the_single_machine_tolerances(servers, tmp_path):
    """small-3 over two servers (two links cut, one local): every direction measured link by
    link within the tolerances the link check applies on one machine (rate, delay, jitter,
    loss, queue)."""
    sf = load_servers(_servers_file(tmp_path))
    cut = place(load_topology("small-3"), sf.sizes()).cut
    assert 0 < len(cut) < len(load_topology("small-3").links), "want cut and local links both"
    res = _linkcheck("small-3", sf)
    assert len(res["directions"]) == 2 * len(load_topology("small-3").links)
    crossing = {frozenset((d["src"], d["dst"])) for d in res["directions"] if len(set(d["servers"])) == 2}
    assert crossing == {frozenset((link.a, link.b)) for j, link in enumerate(load_topology("small-3").links)
                        if j in cut}, res["directions"]
    assert set(res["cluster"]["servers"]) == {"s1", "s2"}


def _run(tmp_path, *args, timeout=600, **kw):
    return subprocess.run([sys.executable, "-m", "testbed", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, **kw)


@pytest.mark.net
def test_quickstart_on_two_servers_is_exact_and_records_the_placement(servers, tmp_path):
    """The shipped example: quick-5's ring over two namespace servers, agents started over
    SSH; exact results, the placement and every server's health in results.json."""
    res = _run(tmp_path, "run", "experiments/quickstart.yaml", "--servers", _servers_file(tmp_path),
               "--out", tmp_path / "out", "--no-report", "--quiet")
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    out = json.loads((tmp_path / "out" / "results.json").read_text())
    assert out["summary"]["correct"] is True and len(out["runs"]) == 2
    c = out["cluster"]
    assert sorted(dc for dcs in c["placement"]["servers"].values() for dc in dcs) == ["h1", "h2", "h3", "h4", "h5"]
    assert c["placement"]["cut_links"] and set(c["servers"]) == {"s1", "s2"}
    for s in c["servers"].values():
        assert {"kept_up", "cpu_util", "steal", "datacenters", "kernel"} <= set(s)
    assert {p["from"] for p in c["underlay"]["pairs"]} == {"s1", "s2"}
    assert all(r["clock_offsets"] for r in out["runs"])


@pytest.mark.net
def test_gscale_on_three_servers_ring_mtree_and_netstorm_are_exact(servers, tmp_path):
    """GScale-12 at its nominal rates over three namespace servers (six links cut): ring,
    MTREE and the closed-loop NetStorm (one-way delays probed across servers, each server's
    clock offset applied) give every worker the exact sum."""
    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump({
        "name": "gscale-3", "topology": "gscale-b4-12", "scheme": {"name": "ring"},
        "variants": [{"label": "mtree", "scheme": {"name": "mtree"}},
                     {"label": "netstorm", "scheme": {"name": "netstorm", "adaptive": {"probe_chunk_bytes": 1000000}}}],
        "workload": {"size": "16MB", "iterations": 1}, "agents": {"timeout_s": 120}}))
    res = _run(tmp_path, "run", exp, "--servers", _servers_file(tmp_path, servers=3), "--out", tmp_path / "out",
               "--no-report", "--quiet")
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    out = json.loads((tmp_path / "out" / "results.json").read_text())
    assert out["summary"]["correct"] is True
    assert sorted(r["variant"] for r in out["runs"]) == ["mtree", "netstorm", "ring"]
    assert set(out["cluster"]["servers"]) == {"s1", "s2", "s3"} and out["cluster"]["placement"]["cut_links"]
    for i, name in enumerate(("s1", "s2", "s3")):  # local servers' relays split their machine's cores
        cpus = out["cluster"]["servers"][name]["relay_layout"]["cpus"]
        assert cpus and set(cpus) <= set(core_share(i, 3, os.cpu_count() or 1)), (name, cpus)


@pytest.mark.net
def test_a_server_lost_mid_run_fails_the_run_naming_it(servers, tmp_path):
    """s2's sshd and everything in its namespace killed while agents run: the run fails
    within the agents' deadline, exit 1, naming s2, and nothing is left on any server."""
    exp = tmp_path / "exp.yaml"
    exp.write_text("name: lost\ntopology: quick-5\nscheme: {name: ring}\nworkload: {size: 400MB, iterations: 50}\n"
                   "agents: {timeout_s: 60}\n")
    proc = subprocess.Popen([sys.executable, "-m", "testbed", "run", str(exp), "--servers", str(_servers_file(tmp_path)),
                             "--out", str(tmp_path / "out"), "--no-report"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    from testbed.emulator.nsservers import namespace_pids

    lines = []
    for line in proc.stdout:  # the first repetition under way: kill server s2
        lines.append(line)
        if "starting 5 agents" in line:
            time.sleep(3)
            break
    t = time.monotonic()
    for pid in namespace_pids("tbs-s2"):
        os.kill(pid, signal.SIGKILL)
    rest, _ = proc.communicate(timeout=180)
    out = "".join(lines) + rest
    assert proc.returncode == 1, out[-3000:]
    assert time.monotonic() - t < 90, "the run did not fail within its deadline"
    err = [line for line in out.splitlines() if line.startswith("error:")]
    assert err and "s2" in err[-1], out[-3000:]


@pytest.mark.net
def test_clean_servers_after_sigkill_leaves_nothing(servers, tmp_path):
    """The head killed with SIGKILL while the servers run agents: ``clean --servers`` removes
    the servers, their datacenters and every process."""
    exp = tmp_path / "exp.yaml"
    exp.write_text("name: killed\ntopology: small-3\nscheme: {name: ring}\nworkload: {size: 400MB, iterations: 50}\n")
    sf = _servers_file(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "testbed", "run", str(exp), "--servers", str(sf), "--out",
                             str(tmp_path / "out"), "--no-report"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if "starting 3 agents" in line:
            time.sleep(2)
            break
    proc.kill()
    proc.wait(timeout=30)
    assert local_leftovers(), "the servers went away by themselves: nothing to clean in this test"
    res = _run(tmp_path, "clean", "--servers", sf, timeout=180)
    assert res.returncode == 0, res.stderr
    time.sleep(1)  # the netenv fixture then checks processes, interfaces and namespaces


def test_unreachable_server_is_named_exit_1(tmp_path):
    """A server nobody answers for: one line naming it, exit 1, within the connect timeout."""
    exp = tmp_path / "exp.yaml"
    exp.write_text("name: u\ntopology: small-3\nscheme: {name: ring}\n")
    f = tmp_path / "servers.yaml"
    f.write_text(yaml.safe_dump({"coordinator": "127.0.0.1", "connect_timeout_s": 2, "known_hosts": str(tmp_path / "kh"),
                                 "ssh_config": str(tmp_path / "none"),
                                 "servers": {"s1": {"ssh": "root@127.0.0.1:1", "underlay": "127.0.0.2"},
                                             "s2": {"ssh": "root@127.0.0.1:1", "underlay": "127.0.0.3"}}}))
    (tmp_path / "none").write_text("")
    t = time.monotonic()
    res = _run(tmp_path, "run", exp, "--servers", f, "--out", tmp_path / "out", "--no-report", timeout=60)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    err = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "s1 (root@127.0.0.1:1): connection refused" in err[0], res.stderr
    assert time.monotonic() - t < 30


@pytest.mark.net
def test_doctor_reports_every_server_and_the_underlay(servers, tmp_path):
    res = _run(tmp_path, "doctor", "--servers", _servers_file(tmp_path), "--json", timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    d = json.loads(res.stdout)
    assert set(d["servers"]) == {"s1", "s2"}
    for s in d["servers"].values():
        assert s["vxlan"] is True and s["capabilities"]["root"] is True
        assert abs(s["clock_offset_ms"]) < 50  # one machine: one clock
    assert {(p["from"], p["to"]) for p in d["underlay"]["pairs"]} == {("s1", "s2"), ("s2", "s1")}
    assert all(p["mbps"] > 100 and p["mtu"] == 9000 for p in d["underlay"]["pairs"])
    assert d["underlay"]["link_mtu"] == 1500


@pytest.mark.net
def test_exec_runs_in_every_datacenter_on_its_server(servers, tmp_path):
    """exec --servers: the command runs in each datacenter's namespace on its server, with
    its rank, and reaches rank 0's node address over the WAN."""
    res = _run(tmp_path, "exec", "experiments/quickstart.yaml", "--servers", _servers_file(tmp_path), "--out",
               tmp_path / "out", "--quiet", "--", "sh", "-c",
               "echo $RANK $TESTBED_DC; ping -n -q -c 1 -W 3 $MASTER_ADDR >/dev/null", timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    out = json.loads((tmp_path / "out" / "results.json").read_text())
    assert {dc: p["stdout"].split() for dc, p in out["processes"].items()} == {
        dc: [str(i), dc] for i, dc in enumerate(["h1", "h2", "h3", "h4", "h5"])}
    assert out["cluster"]["placement"]["cut_links"]
