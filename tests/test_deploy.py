"""``testbed deploy``: hosts-file checks, the agent bundle, and a real deployment over ssh
to sshd servers running in the hosts of an emulated WAN."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
from io import BytesIO
from pathlib import Path

import pytest
import yaml

from testbed import config
from testbed.deploy import SshHosts, check_deployable, code_bundle, load_hosts
from testbed.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
NODES = ["a", "b", "c"]


def _hosts_file(tmp_path, data) -> Path:
    f = tmp_path / "hosts.yaml"
    f.write_text(yaml.safe_dump(data))
    return f


def _three(**extra):
    return {"coordinator": "192.0.2.1:7000",
            "hosts": {n: {"ssh": f"alice@{n}.example.org", **extra.get(n, {})} for n in NODES}}


def test_hosts_file_defaults_and_address_map(tmp_path):
    hf = load_hosts(_hosts_file(tmp_path, _three(b={"address": "10.0.0.2", "address_from": {"a": "172.16.0.2"},
                                                    "data_port": 7200, "python": "/opt/py/bin/python3"})),
                    NODES)
    assert hf.coordinator == ("192.0.2.1", 7000)
    a, b = hf.hosts["a"], hf.hosts["b"]
    assert (a.address, a.data_port, a.python, a.workdir) == ("a.example.org", 7100, "python3", "/tmp/testbed-agent/a")
    assert (b.data_port, b.python) == (7200, "/opt/py/bin/python3")
    addresses = SshHosts(hf).addresses()
    assert addresses["a"] == {"b": "172.16.0.2", "c": "c.example.org"}  # a uses b's private address
    assert addresses["c"] == {"a": "a.example.org", "b": "10.0.0.2"}


@pytest.mark.parametrize("change, needle", [
    (lambda d: d["hosts"].pop("c"), "no host for datacenter(s) c"),
    (lambda d: d["hosts"].update(z={"ssh": "z"}), "hosts.z: unknown datacenter 'z'"),
    (lambda d: d.update(coordinator="192.0.2.1"), "coordinator: expected ADDRESS:PORT"),
    (lambda d: d.pop("coordinator"), "coordinator: missing"),
    (lambda d: d.update(ssh_options="-p 22"), "ssh_options: expected a list of strings"),
    (lambda d: d["hosts"]["a"].pop("ssh"), "hosts.a.ssh: expected an ssh destination"),
    (lambda d: d["hosts"]["a"].update(address_from={"q": "1.2.3.4"}), "hosts.a.address_from: unknown datacenter"),
    (lambda d: d["hosts"]["a"].update(data_port=0), "hosts.a.data_port: must be >= 1"),
    (lambda d: d["hosts"]["a"].update(user="x"), "hosts.a.user: unknown key"),
])
def test_bad_hosts_file_names_the_problem(tmp_path, change, needle):
    data = _three()
    change(data)
    with pytest.raises(ConfigError) as e:
        load_hosts(_hosts_file(tmp_path, data), NODES)
    assert needle in str(e.value) and str(tmp_path) in str(e.value)


def test_dynamics_cannot_be_deployed(tmp_path):
    exp = config.validate({"name": "d", "topology": "small-3", "scheme": {"name": "ring"},
                           "faults": [{"at_s": 1, "link_down": ["h1", "h2"]}]}, "<test>")
    with pytest.raises(ConfigError, match="faults: emulator-only"):
        check_deployable(exp, _hosts_file(tmp_path, _three()))


def test_validate_checks_a_hosts_file_without_connecting(tmp_path):
    exp = tmp_path / "exp.yaml"
    exp.write_text("name: v\ntopology: small-3\nscheme: {name: ring}\n")
    data = {"coordinator": "192.0.2.1:7000", "hosts": {n: {"ssh": f"{n}.invalid"} for n in ("h1", "h2", "h3")}}
    cli = [sys.executable, "-m", "testbed", "validate", str(exp), "--hosts"]
    res = subprocess.run(cli + [str(_hosts_file(tmp_path, data))], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0 and "3 hosts, coordinator 192.0.2.1:7000" in res.stdout, res.stderr
    del data["hosts"]["h3"]
    res = subprocess.run(cli + [str(_hosts_file(tmp_path, data))], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 2 and "no host for datacenter(s) h3" in res.stderr


def test_agent_bundle_is_self_contained(tmp_path):
    """What deploy copies to a host is enough to run an agent: nothing else of the repo."""
    with tarfile.open(fileobj=BytesIO(code_bundle())) as tar:
        names = set(tar.getnames())
        tar.extractall(tmp_path)
    assert "agents/agent.py" in names and "testbed/plan.py" in names
    assert not any(n.startswith("testbed/emulator") for n in names)
    res = subprocess.run([sys.executable, "-c", "import agents.agent, agents.executor, sys; "
                          "print(sorted(m for m in sys.modules if m.startswith('testbed')))"],
                         cwd=tmp_path, capture_output=True, text=True, env={"PATH": os.environ["PATH"]})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "['testbed', 'testbed.plan']"


# -- a real deployment: sshd in every host of an emulated WAN ----------------------------------

def _sshd() -> str:
    path = shutil.which("sshd") or "/usr/sbin/sshd"
    if not os.access(path, os.X_OK):
        pytest.skip("sshd not installed (apt install openssh-server): the deployment test needs it")
    return path


def _wait_port(ip: str, port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((ip, port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise


@pytest.fixture
def ssh_wan(netenv, tmp_path):
    """small-3 emulated, an sshd (its own host key, one authorised key) in every host,
    listening on the host's control address; yields (net, ssh_options)."""
    from testbed.emulator.network import WanNetwork
    from testbed.topology import load_topology

    sshd = _sshd()
    keys = tmp_path / "keys"
    keys.mkdir()
    for k in ("host", "client"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / k)], check=True)
    shutil.copy(keys / "client.pub", keys / "authorized_keys")
    os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation directory
    with WanNetwork(load_topology("small-3")) as net:
        for dc in net.topo.nodes:
            conf = keys / f"sshd-{dc}.conf"
            conf.write_text(f"ListenAddress {net.control_address(dc)}\nHostKey {keys / 'host'}\n"
                            f"AuthorizedKeysFile {keys / 'authorized_keys'}\nPidFile {keys / dc}.pid\n"
                            "StrictModes no\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
                            "PermitRootLogin prohibit-password\nUsePAM no\n")
            net.popen(dc, [sshd, "-D", "-e", "-f", str(conf)], stderr=open(keys / f"sshd-{dc}.log", "wb"))
        for dc in net.topo.nodes:
            _wait_port(net.control_address(dc), 22)
        yield net, ["-i", str(keys / "client"), "-o", "StrictHostKeyChecking=no",
                    "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR"]
    left = subprocess.run(["pgrep", "-f", str(keys)], capture_output=True, text=True).stdout.split()
    assert not left, f"sshd processes left: {left}"


SHORT = "workload: {size: 400KB}\nvariants: [{label: ps, scheme: {name: ps}}]\n"


def _deploy_argv(tmp_path, hosts: dict, experiment: str = SHORT) -> list[str]:
    exp = tmp_path / "exp.yaml"
    exp.write_text("name: deploy-test\ntopology: small-3\nscheme: {name: ring}\n" + experiment)
    return [sys.executable, "-m", "testbed", "deploy", str(exp), "--hosts", str(_hosts_file(tmp_path, hosts)),
            "--out", str(tmp_path / "out")]


def _deploy_cli(tmp_path, hosts: dict):
    return subprocess.run(_deploy_argv(tmp_path, hosts), cwd=REPO, capture_output=True, text=True, timeout=300)


def _ssh_hosts(net, ssh_options, tmp_path, **host_keys) -> dict:
    from testbed.emulator.network import CONTROL_IP

    return {"coordinator": f"{CONTROL_IP}:0", "python": sys.executable, "ssh_options": ssh_options,
            "hosts": {dc: {"ssh": f"root@{net.control_address(dc)}", "workdir": str(tmp_path / "remote" / dc),
                           **host_keys.get(dc, {})} for dc in net.topo.nodes}}


def test_deploy_over_ssh_gives_exact_results(ssh_wan, tmp_path):
    net, ssh_options = ssh_wan
    amap = net.address_map()  # src -> {dst: address}: the WAN links, as real private links would be
    hosts = _ssh_hosts(net, ssh_options, tmp_path, **{
        dc: {"address": net.node_address(dc), "address_from": {src: amap[src][dc] for src in amap if src != dc}}
        for dc in net.topo.nodes})
    res = _deploy_cli(tmp_path, hosts)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    out = json.loads((tmp_path / "out" / "results.json").read_text())
    assert out["summary"]["correct"] is True
    assert [r["variant"] for r in out["runs"]] == ["ring", "ps"]
    assert all(r["correct"] and r["transfers"]["rows"] for r in out["runs"])
    assert set(out["deployment"]["hosts"]) == set(net.topo.nodes)
    assert out["deployment"]["hosts"]["h1"]["python"] == sys.version.split()[0]
    for dc in net.topo.nodes:  # the agent really ran there, from the copied code
        assert (tmp_path / "remote" / dc / "agents" / "agent.py").exists()
        assert "finished" in (tmp_path / "out" / "agents" / f"{dc}.log").read_text()
    # the ring's traffic crossed the shaped WAN links: every transfer at least one link delay
    delay_s = min(min(l.ab.delay_ms, l.ba.delay_ms) for l in net.topo.links) / 1e3
    cols = out["runs"][0]["transfers"]["columns"]
    first = out["runs"][0]["transfers"]["rows"][0]
    assert (first[cols.index("recv_end_ns")] - first[cols.index("send_start_ns")]) / 1e9 >= delay_s


def test_deploy_unreachable_host_fails_clearly(ssh_wan, tmp_path):
    net, ssh_options = ssh_wan
    hosts = _ssh_hosts(net, ssh_options, tmp_path, h2={"ssh": f"nobody@{net.control_address('h2')}"})
    res = _deploy_cli(tmp_path, hosts)  # the key is not authorised for that user
    assert res.returncode == 1
    assert "error: h2 (nobody@" in res.stderr and "installing the agent failed" in res.stderr
    assert "Traceback" not in res.stderr


def _remote_agents() -> list[str]:
    return subprocess.run(["pgrep", "-f", "agents.agent --config node.json"], capture_output=True,
                          text=True).stdout.split()


def test_deploy_sigint_stops_the_remote_agents(ssh_wan, tmp_path):
    net, ssh_options = ssh_wan
    argv = _deploy_argv(tmp_path, _ssh_hosts(net, ssh_options, tmp_path),
                        "repetitions: 50\nworkload: {size: 4MB, iterations: 3}\n")
    p = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and len(_remote_agents()) < 3:
        time.sleep(0.2)
    assert len(_remote_agents()) == 3
    time.sleep(1.0)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err[-2000:]
    assert not _remote_agents()
    assert not (tmp_path / "out" / "results.json").exists()
