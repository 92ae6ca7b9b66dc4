"""``testbed deploy``: hosts-file checks, the agent's files, SSH failures named, and real
deployments over paramiko to sshd servers running in the hosts of an emulated WAN (host
keys, ProxyJump, unreachable hosts, one clock, Ctrl-C; no ``ssh`` binary)."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from testbed import config, ssh
from testbed.deploy import SshHosts, check_deployable, code_files, load_hosts
from testbed.errors import ConfigError, RunError

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
    assert (a.address, a.data_port, a.python, a.workdir) == ("a.example.org", 7100, "python3", ".testbed-agent/a")
    assert (b.data_port, b.python) == (7200, "/opt/py/bin/python3")
    addresses = SshHosts(hf).addresses()
    assert addresses["a"] == {"b": "172.16.0.2", "c": "c.example.org"}  # a uses b's private address
    assert addresses["c"] == {"a": "a.example.org", "b": "10.0.0.2"}


@pytest.mark.parametrize("change, needle", [
    (lambda d: d["hosts"].pop("c"), "no host for datacenter(s) c"),
    (lambda d: d["hosts"].update(z={"ssh": "z"}), "hosts.z: unknown datacenter 'z'"),
    (lambda d: d.update(coordinator="192.0.2.1"), "coordinator: expected ADDRESS:PORT"),
    (lambda d: d.pop("coordinator"), "coordinator: missing"),
    (lambda d: d.update(ssh_options=["-p", "22"]), "ssh_options: no longer used: deploy reaches hosts with paramiko"),
    (lambda d: d.update(accept_new_host_keys="yes"), "accept_new_host_keys: expected true or false"),
    (lambda d: d.update(identity_file="/nonexistent/key"), "identity_file: no such key file"),
    (lambda d: d.update(connect_timeout_s=0), "connect_timeout_s: must be > 0"),
    (lambda d: d.update(ssh_config="/nonexistent/config"), "ssh_config: cannot read /nonexistent/config"),
    (lambda d: d["hosts"]["a"].update(ssh="alice@a:99999"), "hosts.a.ssh: expected [user@]host[:port]"),
    (lambda d: d["hosts"]["a"].update(clock_offset_ms="5s"), "hosts.a.clock_offset_ms: expected a number"),
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


def test_hosts_file_follows_the_ssh_config(tmp_path):
    """An alias of the ssh config gives the host name (the default address), user and port."""
    cfg = tmp_path / "ssh_config"
    cfg.write_text("Host dc-*\n  User bob\n  Port 2222\nHost dc-a\n  HostName 198.51.100.7\n")
    data = _three()
    data["ssh_config"] = str(cfg)
    data["hosts"]["a"]["ssh"] = "dc-a"
    hf = load_hosts(_hosts_file(tmp_path, data), NODES)
    assert hf.hosts["a"].address == "198.51.100.7"
    assert ssh.resolve("dc-a", hf.ssh.config).items() >= {"hostname": "198.51.100.7", "user": "bob",
                                                          "port": 2222}.items()
    assert ssh.resolve("carol@dc-a:22", hf.ssh.config).items() >= {"user": "carol", "port": 22}.items()
    assert ssh.resolve("[2001:db8::1]:2200", hf.ssh.config)["port"] == 2200


def test_connect_failures_name_the_host_and_the_reason():
    """Refused, DNS and a server that never speaks SSH (timeout), each within the connect
    timeout, on loopback."""
    opts = ssh.SshOptions(connect_timeout_s=1.0)
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel does), never answers
    try:
        for dest, reason in [("root@127.0.0.1:1", "connection refused"), ("root@no-such-host.invalid", "DNS: "),
                             (f"root@127.0.0.1:{silent.getsockname()[1]}", "timeout: ")]:
            t = time.monotonic()
            with pytest.raises(ssh.SshError) as e:
                ssh.Connection("dcx", dest, opts).connect()
            assert str(e.value).startswith(f"dcx ({dest}): {reason}"), e.value
            assert time.monotonic() - t < 2.5
    finally:
        silent.close()


def test_agent_files_are_self_contained(tmp_path):
    """What deploy copies to a host is enough to run an agent: nothing else of the repo."""
    files = code_files()
    names = set(files)
    for name, content in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(content)
    assert {"agents/agent.py", "agents/clock.py", "testbed/plan.py"} <= names
    assert not any(n.startswith("testbed/emulator") for n in names)
    res = subprocess.run([sys.executable, "-c", "import agents.agent, agents.executor, sys; "
                          "print(sorted(m for m in sys.modules if m.startswith('testbed')))"],
                         cwd=tmp_path, capture_output=True, text=True, env={"PATH": os.environ["PATH"]})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "['testbed', 'testbed.plan']"



# -- real deployments: sshd in every host of an emulated WAN ------------------------------------

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


def _keypair(path: Path) -> str:
    """An ed25519 key in OpenSSH format at ``path`` (mode 600); returns its public line."""
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    path.write_bytes(key.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.OpenSSH, ser.NoEncryption()))
    path.chmod(0o600)
    return key.public_key().public_bytes(ser.Encoding.OpenSSH, ser.PublicFormat.OpenSSH).decode()


@dataclass
class SshWan:
    net: object
    keys: Path
    host_pub: str  # every sshd's host key
    def ssh_config(self, path: Path, extra: str = "") -> Path:
        """An ssh config with an alias DC-dc per datacenter (HostName, User, Port, IdentityFile)."""
        path.write_text("".join(f"Host {dc}-dc\n  HostName {self.net.control_address(dc)}\n  User root\n"
                                f"  Port 22\n  IdentityFile {self.keys / 'client'}\n" for dc in self.net.topo.nodes)
                        + extra)
        return path

    def known_hosts(self, path: Path, pub: dict | None = None) -> Path:
        """known_hosts listing every sshd (control and WAN address) with its key (``pub``: dc -> other key)."""
        path.write_text("".join(f"{a} {(pub or {}).get(dc, self.host_pub)}\n" for dc in self.net.topo.nodes
                                for a in (self.net.control_address(dc), self.net.node_address(dc))))
        return path


@pytest.fixture
def ssh_wan(netenv, tmp_path):
    """small-3 emulated, an sshd (one host key, one authorised client key) in every host,
    listening on the host's control and WAN addresses."""
    from testbed.emulator.network import WanNetwork
    from testbed.topology import load_topology

    sshd = _sshd()
    keys = tmp_path / "keys"
    keys.mkdir()
    host_pub = _keypair(keys / "host")
    (keys / "authorized_keys").write_text(_keypair(keys / "client") + "\n")
    os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation directory
    with WanNetwork(load_topology("small-3")) as net:
        for dc in net.topo.nodes:
            conf = keys / f"sshd-{dc}.conf"
            conf.write_text(f"ListenAddress {net.control_address(dc)}\nListenAddress {net.node_address(dc)}\n"
                            f"HostKey {keys / 'host'}\nAuthorizedKeysFile {keys / 'authorized_keys'}\n"
                            f"PidFile {keys / dc}.pid\nStrictModes no\nPasswordAuthentication no\n"
                            "KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\nUsePAM no\n"
                            "Subsystem sftp internal-sftp\n")
            net.popen(dc, [sshd, "-D", "-e", "-f", str(conf)], stderr=open(keys / f"sshd-{dc}.log", "wb"))
        for dc in net.topo.nodes:
            _wait_port(net.control_address(dc), 22)
        yield SshWan(net, keys, host_pub)
    left = subprocess.run(["pgrep", "-f", str(keys)], capture_output=True, text=True).stdout.split()
    assert not left, f"sshd processes left: {left}"


SHORT = "workload: {size: 400KB}\nvariants: [{label: ps, scheme: {name: ps}}]\n"


def _deploy_argv(tmp_path, hosts: dict, experiment: str = SHORT, out: str = "out") -> list[str]:
    exp = tmp_path / "exp.yaml"
    exp.write_text("name: deploy-test\ntopology: small-3\nscheme: {name: ring}\n" + experiment)
    return [sys.executable, "-m", "testbed", "deploy", str(exp), "--hosts", str(_hosts_file(tmp_path, hosts)),
            "--out", str(tmp_path / out)]


def _no_ssh_env(tmp_path) -> dict:
    """The environment with a PATH that has this Python and no ``ssh`` client."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if not (bin_dir / "python3").exists():
        (bin_dir / "python3").symlink_to(sys.executable)
    assert shutil.which("ssh", path=str(bin_dir)) is None
    return dict(os.environ, PATH=str(bin_dir))


def _deploy_cli(tmp_path, hosts: dict, experiment: str = SHORT, out: str = "out"):
    return subprocess.run(_deploy_argv(tmp_path, hosts, experiment, out), cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=_no_ssh_env(tmp_path))


def _ssh_hosts(wan: SshWan, tmp_path, known_hosts: bool = True, **host_keys) -> dict:
    from testbed.emulator.network import CONTROL_IP

    hosts = {"coordinator": f"{CONTROL_IP}:0", "python": sys.executable,
             "ssh_config": str(wan.ssh_config(tmp_path / "ssh_config")), "known_hosts": str(tmp_path / "known_hosts"),
             "hosts": {dc: {"ssh": f"{dc}-dc", "workdir": str(tmp_path / "remote" / dc), **host_keys.get(dc, {})}
                       for dc in wan.net.topo.nodes}}
    if known_hosts:
        wan.known_hosts(tmp_path / "known_hosts")
    return hosts


def _load(tmp_path, hosts: dict):
    return load_hosts(_hosts_file(tmp_path, hosts), ["h1", "h2", "h3"])


OFFSET_MS = 3000.0  # h2's agent clock runs this far ahead in the clock test


@pytest.mark.net
def test_deploy_gives_exact_results_on_one_clock_without_an_ssh_binary(ssh_wan, tmp_path):
    """Two deployments of ring and PS over the WAN links, with no ssh client on the PATH: the
    first with h2's agent clock 3 s ahead, the second without.  Results are exact; the
    offset is measured and corrected, so CCT, per-transfer timings and iteration times agree
    between the two (uncorrected, every CCT would be 3 s longer); the second deployment
    re-sends no code."""
    net = ssh_wan.net
    amap = net.address_map()  # src -> {dst: address}: the WAN links, as real private links would be
    wan_addresses = {dc: {"address": net.node_address(dc),
                          "address_from": {src: amap[src][dc] for src in amap if src != dc}} for dc in net.topo.nodes}
    exp = "repetitions: 2\n" + SHORT
    shifted = _ssh_hosts(ssh_wan, tmp_path, **wan_addresses)
    shifted["hosts"]["h2"]["clock_offset_ms"] = OFFSET_MS
    res = _deploy_cli(tmp_path, shifted, exp, out="shifted")
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    res = _deploy_cli(tmp_path, _ssh_hosts(ssh_wan, tmp_path, **wan_addresses), exp, out="same")
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    shifted, same = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("shifted", "same"))

    for out in (shifted, same):
        assert out["summary"]["correct"] is True
        assert [r["variant"] for r in out["runs"]] == ["ring", "ps", "ring", "ps"]
        assert all(r["correct"] and r["transfers"]["rows"] for r in out["runs"])
        assert set(out["deployment"]["hosts"]) == set(net.topo.nodes)
        assert out["deployment"]["hosts"]["h1"]["python"] == sys.version.split()[0]
    for dc in net.topo.nodes:  # the agent really ran there, from the copied code
        assert (tmp_path / "remote" / dc / "agents" / "agent.py").exists()
        assert "finished" in (tmp_path / "shifted" / "agents" / f"{dc}.log").read_text()
        assert shifted["deployment"]["hosts"][dc]["code_files_sent"] == len(code_files())
        assert same["deployment"]["hosts"][dc]["code_files_sent"] == 0  # unchanged: nothing re-sent

    _check_one_clock(net, shifted, same)


def _check_one_clock(net, shifted, same):
    """Every run measured every host's clock (h2 ``OFFSET_MS`` ahead in ``shifted``, within the
    exchange's error bound), and corrected it: CCT is the same on one clock (a missing or wrong
    correction is off by the offset) and every transfer crossed a shaped link on one clock."""
    for out, h2_ms in ((shifted, OFFSET_MS), (same, 0.0)):
        for r in out["runs"]:
            for dc, c in r["clock_offsets"].items():
                want = h2_ms if dc == "h2" else 0.0
                assert abs(c["offset_ms"] - want) <= c["rtt_ms"] / 2 + 1.0, (dc, c)
    delay_s = min(min(l.ab.delay_ms, l.ba.delay_ms) for l in net.topo.links) / 1e3
    for label in ("ring", "ps"):
        a, b = (next(v["summary"]["cct_s"]["mean"] for v in out["variants"] if v["label"] == label)
                for out in (shifted, same))
        assert abs(a - b) < 0.2 * b + 0.05, (label, a, b)
    for r in shifted["runs"]:
        for it in r["iterations"]:
            assert it["cct_s"] <= it["iteration_s"] < it["cct_s"] + 1.0
        cols = r["transfers"]["columns"]
        for row in r["transfers"]["rows"]:
            took = (row[cols.index("recv_end_ns")] - row[cols.index("send_start_ns")]) / 1e9
            flight = (row[cols.index("recv_start_ns")] - row[cols.index("send_ts_ns")]) / 1e9
            assert delay_s <= took < 1.0 and 0 < flight < 1.0, row


@pytest.mark.net
def test_host_keys_refused_unless_known_or_accepted_on_first_contact(ssh_wan, tmp_path):
    hosts = _ssh_hosts(ssh_wan, tmp_path, known_hosts=False)
    with pytest.raises(RunError) as e:  # no known_hosts: every host refused, each named, with the remedy
        SshHosts(_load(tmp_path, hosts)).__enter__()
    for dc in ("h1", "h2", "h3"):
        assert f"{dc} ({dc}-dc): host key unknown: {ssh_wan.net.control_address(dc)} offers ssh-ed25519 SHA256:" \
            in str(e.value)
    assert "accept_new_host_keys: true" in str(e.value)
    assert not (tmp_path / "known_hosts").exists()  # nothing trusted silently

    hosts["accept_new_host_keys"] = True  # first contact: accepted and recorded
    with SshHosts(_load(tmp_path, hosts)) as h:
        assert h.conns["h1"].run("echo $((6 * 7))", "a command") == "42\n"
        assert all(e["code_files_sent"] == len(code_files()) for e in h.environment.values())
    recorded = (tmp_path / "known_hosts").read_text().splitlines()
    assert sorted(recorded) == sorted(f"{ssh_wan.net.control_address(dc)} {ssh_wan.host_pub}"
                                      for dc in ("h1", "h2", "h3"))

    hosts["accept_new_host_keys"] = False  # now known: verified and used; unchanged code not re-sent
    (tmp_path / "remote" / "h3" / "agents" / "wire.py").write_text("# changed on the host\n")
    with SshHosts(_load(tmp_path, hosts)) as h:
        sent = {dc: e["code_files_sent"] for dc, e in h.environment.items()}
        assert sent == {"h1": 0, "h2": 0, "h3": 1}
        assert (tmp_path / "remote" / "h3" / "agents" / "wire.py").read_bytes() == code_files()["agents/wire.py"]

    hosts["accept_new_host_keys"] = True  # a changed key is refused even so
    ssh_wan.known_hosts(tmp_path / "known_hosts", pub={"h2": _keypair(tmp_path / "other")})
    with pytest.raises(RunError) as e:
        SshHosts(_load(tmp_path, hosts)).__enter__()
    # h1 is not named (each refused host is "name (dest): ..."; a bare "h1" can occur in the
    # random key fingerprints the message quotes)
    assert str(e.value).startswith("h2 (h2-dc): host key CHANGED") and "h1 (" not in str(e.value), e.value


@pytest.mark.net
def test_proxyjump_reaches_a_host_through_its_neighbour(ssh_wan, tmp_path):
    """ProxyJump through h1 to h2's WAN address: h2's sshd sees the connection come from h1
    over the WAN, not from this machine's control address."""
    from testbed.emulator.network import CONTROL_IP

    net = ssh_wan.net
    wan_ip = net.node_address("h2")
    _ssh_hosts(ssh_wan, tmp_path)
    config = ssh_wan.ssh_config(tmp_path / "ssh_config", extra=(
        f"Host h2-jump\n  HostName {wan_ip}\n  User root\n  IdentityFile {ssh_wan.keys / 'client'}\n"
        "  ProxyJump h1-dc\n"))
    import paramiko

    opts = ssh.SshOptions(config=paramiko.SSHConfig.from_path(str(config)), known_hosts=str(tmp_path / "known_hosts"),
                          connect_timeout_s=5.0)
    conn = ssh.Connection("h2", "h2-jump", opts).connect()
    try:
        client_ip, _, server_ip, _ = conn.run("echo $SSH_CONNECTION", "asking sshd").split()
    finally:
        conn.close()
    assert server_ip == wan_ip and client_ip not in (CONTROL_IP, net.control_address("h2")), (client_ip, server_ip)


@pytest.mark.net
def test_unreachable_host_fails_naming_it_within_the_connect_timeout(ssh_wan, tmp_path):
    hosts = _ssh_hosts(ssh_wan, tmp_path, h2={"ssh": "root@10.255.0.200"})  # no such host on the network
    hosts["connect_timeout_s"] = 1.5
    t = time.monotonic()
    with pytest.raises(RunError) as e:
        SshHosts(_load(tmp_path, hosts)).__enter__()
    assert time.monotonic() - t < 1.5 + 1.0
    assert str(e.value) == "h2 (root@10.255.0.200): timeout: no connection to root@10.255.0.200:22 within 1.5 s"


@pytest.mark.net
def test_deploy_auth_failure_fails_clearly(ssh_wan, tmp_path):
    hosts = _ssh_hosts(ssh_wan, tmp_path, h2={"ssh": f"nobody@{ssh_wan.net.control_address('h2')}"})
    hosts["identity_file"] = str(ssh_wan.keys / "client")
    res = _deploy_cli(tmp_path, hosts)  # the key is not authorised for that user
    assert res.returncode == 1
    assert "error: h2 (nobody@" in res.stderr and "authentication failed as nobody" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def _remote(module: str) -> list[str]:
    """Pids of Python processes running ``module`` (not the remote shells that are about to
    exec them: bash may fork briefly there, and its forks carry the same command line)."""
    return subprocess.run(["pgrep", "-f", rf"^\S*python\S* -m {module}"], capture_output=True, text=True).stdout.split()


@pytest.mark.net
def test_deploy_sigint_stops_the_remote_agents(ssh_wan, tmp_path):
    # one long repetition (a new repetition would start new agents while the old ones exit)
    argv = _deploy_argv(tmp_path, _ssh_hosts(ssh_wan, tmp_path), "repetitions: 1\nworkload: {size: 4MB, iterations: 500}\n")
    p = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=_no_ssh_env(tmp_path))
    try:
        deadline = time.time() + 60
        while time.time() < deadline and len(_remote("agents.agent --config node.json")) < 3:
            time.sleep(0.2)
        assert len(_remote("agents.agent --config node.json")) == 3
        assert len(_remote("agents.clock")) == 3
        time.sleep(1.0)
    finally:  # also when an assertion failed: never leave the run going, wait for it to stop
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err[-2000:]
    assert not _remote("agents.agent --config node.json") and not _remote("agents.clock")
    assert not (tmp_path / "out" / "results.json").exists()
