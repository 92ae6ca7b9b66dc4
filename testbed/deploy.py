"""``testbed deploy``: the same plans and the same agents, on real hosts over SSH.

The experiment's topology describes the real WAN (rates and delays measured or given); it
is only used to plan and to predict, nothing is shaped.  This machine runs the
coordinator; each datacenter's agent runs on its host, reached with paramiko
(:mod:`testbed.ssh`: ``~/.ssh/config``, keys, ssh-agent and ProxyJump apply; host keys are
checked against known_hosts; no ``ssh`` binary is needed).  The hosts file (YAML)::

    coordinator: 192.0.2.1:7000   # address:port the agents reach this machine at (port 0: any)
    python: python3               # interpreter on the hosts (needs numpy)
    workdir: .testbed-agent       # each datacenter uses WORKDIR/NAME (relative: to the login dir;
                                  # created private, refused if someone else owns it)
    ssh_config: ~/.ssh/config     # (default) Host, HostName, User, Port, IdentityFile, ProxyJump
    known_hosts: ~/.ssh/known_hosts   # (default: the config's UserKnownHostsFile, else this)
    accept_new_host_keys: false   # true: trust and record a host's key on first contact
    identity_file: ~/.ssh/id_testbed  # (optional) key file(s) tried first
    connect_timeout_s: 10         # TCP connect, SSH banner and authentication, each
    command_timeout_s: 60         # every remote command
    hosts:
      dc1: {ssh: alice@dc1.example.org, address: 198.51.100.1}
      dc2: {ssh: dc2-alias, address_from: {dc1: 10.0.0.2}, data_port: 7101}

``ssh``: ``[user@]host[:port]`` or a ``~/.ssh/config`` alias.  ``address``: where the other
agents connect to this datacenter (IP or name; default: the ssh host after the config's
HostName); ``address_from``: peer -> the address that peer uses instead (e.g. a private
link).  ``data_port`` (default 7100), ``python`` and ``workdir`` may be set per host;
``clock_offset_ms`` (testing) shifts that host's agent clock (:mod:`agents.clock`).

One SSH connection per host serves the whole experiment, opened in parallel (at most
:data:`testbed.ssh.MAX_PARALLEL` at once).  Set-up copies ``agents/`` and the harness
modules they import (``testbed/plan.py``, ``testbed/errors.py``) to WORKDIR/NAME with SFTP
(only files whose SHA-256 differs), records each host's kernel, Python and numpy, and
starts a clock echo (``python3 -m agents.clock``).  Before every run the clock offset of
each host is estimated NTP-style over that echo (:mod:`testbed.clock`), recorded in the
run's ``clock_offsets`` and subtracted from every timestamp the agents report, so CCT and
per-transfer timings are on this machine's clock.  Every run writes the agent's config and
secret with SFTP and starts it in a channel; its output streams into OUT/agents/NAME.log.
Agents exit by themselves when the coordinator finishes or disappears; teardown (also on
error or Ctrl-C) kills any that did not (``agent.pid``).
"""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import paramiko

from testbed import clock, ssh
from testbed.checks import Checker
from testbed.config import Experiment, load_yaml
from testbed.errors import ConfigError, RunError
from testbed.experiment import add_summaries, plan_variants, run_variants
from testbed.hosts import DATA_PORT, Hosts
from testbed.results import REPO, environment

CODE = ["agents/*.py", "testbed/__init__.py", "testbed/plan.py", "testbed/errors.py"]  # what an agent imports
HOSTS_KEYS = {"coordinator", "python", "workdir", "hosts", "ssh_config", "known_hosts", "accept_new_host_keys",
              "identity_file", "connect_timeout_s", "command_timeout_s"}
HOST_KEYS = {"ssh", "address", "address_from", "data_port", "python", "workdir", "clock_offset_ms"}
CLOCK_EXCHANGES = 8  # per host and run; the one with the least round trip is used


@dataclass
class Host:
    name: str
    ssh: str  # ssh destination ([user@]host[:port] or a ~/.ssh/config alias)
    address: str  # where peers connect to it
    address_from: dict[str, str]  # peer -> address that peer uses instead
    data_port: int
    python: str
    workdir: str  # this datacenter's folder on the host
    clock_offset_ms: float = 0.0  # testing: shift the agent's clock


@dataclass
class HostsFile:
    coordinator: tuple[str, int]
    hosts: dict[str, Host]
    ssh: ssh.SshOptions


def ssh_options(data: dict, c: Checker):
    """The hosts file's SSH keys, checked (files named must exist; the config must parse)."""
    def path(key: str, default: str | None = None) -> str | None:
        value = data.get(key, default)
        if value is not None and (not isinstance(value, str) or not value):
            c.fail(key, f"expected a file path, got {value!r}")
        return value and str(Path(value).expanduser())

    config_file = path("ssh_config", "~/.ssh/config")
    config = paramiko.SSHConfig()
    if "ssh_config" in data or Path(config_file).exists():
        try:
            config = paramiko.SSHConfig.from_path(config_file)
        except (OSError, paramiko.ConfigParseError) as e:
            c.fail("ssh_config", f"cannot read {config_file}: {getattr(e, 'strerror', None) or e}")
    ids = data.get("identity_file", [])
    ids = [ids] if isinstance(ids, str) else ids
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        c.fail("identity_file", "expected a key file path or a list of them")
    for i in ids:
        if not Path(i).expanduser().is_file():
            c.fail("identity_file", f"no such key file: {i}")
    accept_new = data.get("accept_new_host_keys", False)
    if not isinstance(accept_new, bool):
        c.fail("accept_new_host_keys", f"expected true or false, got {accept_new!r}")
    return ssh.SshOptions(config=config, known_hosts=path("known_hosts"), accept_new=accept_new,
                          identity_files=tuple(str(Path(i).expanduser()) for i in ids),
                          connect_timeout_s=c.number(data.get("connect_timeout_s", 10.0), "connect_timeout_s",
                                                     positive=True),
                          command_timeout_s=c.number(data.get("command_timeout_s", 60.0), "command_timeout_s",
                                                     positive=True))


DEFAULT_WORKDIR = ".testbed-agent"  # per user: relative to the login (home) directory


def private_dir(path: str) -> str:
    """Shell command creating ``path`` private to the login user (mode 700, umask 077), and
    refusing (exit 3, a message on stderr) a symbolic link, or a directory or parent owned
    by another user (a parent may be root's): on a shared host another user could otherwise
    create the directory first and read or replace the agent code and the secret."""
    d = shlex.quote(path)
    return (f"umask 077 && mkdir -p {d} && if [ -L {d} ]; then echo \"refusing workdir {d}: a symbolic link\" >&2; "
            f"exit 3; fi && for x in \"$(dirname {d})\" {d}; do o=$(stat -c %u \"$x\"); "
            f"if [ \"$o\" != \"$(id -u)\" ] && {{ [ \"$x\" = {d} ] || [ \"$o\" != 0 ]; }}; then "
            f"echo \"refusing workdir {d}: $x is owned by uid $o, not by $(id -un)\" >&2; exit 3; fi; done && "
            f"chmod 700 {d}")


def load_hosts(path: str | Path, nodes: list[str]) -> HostsFile:
    """Read and check a hosts file against the experiment's datacenters ``nodes``."""
    source = str(path)
    data, c = load_yaml(path, what="hosts"), Checker(source)
    if "ssh_options" in data:
        c.fail("ssh_options", "no longer used: deploy reaches hosts with paramiko, not the ssh binary; put "
                              "options in ~/.ssh/config (or the file ssh_config names), keys in identity_file")
    c.mapping(data, "", HOSTS_KEYS)
    for key in ("coordinator", "hosts"):
        if key not in data:
            c.fail(key, "missing (format: docs/guides/deploy.md)")
    host, _, port = str(data["coordinator"]).rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        c.fail("coordinator", f"expected ADDRESS:PORT (port 0: any free), got {data['coordinator']!r}")
    options = ssh_options(data, c)
    c.mapping(data["hosts"], "hosts")
    missing = [n for n in nodes if n not in data["hosts"]]
    if missing:
        c.fail("hosts", f"no host for datacenter(s) {', '.join(missing)} of the experiment's topology")
    hosts = {}
    for name, h in data["hosts"].items():
        key = f"hosts.{name}"
        c.node(name, key, nodes)
        c.mapping(h, key, HOST_KEYS)
        if not isinstance(h.get("ssh"), str) or not h["ssh"]:
            c.fail(f"{key}.ssh", "expected an ssh destination such as user@host")
        try:
            resolved = ssh.resolve(h["ssh"], options.config)
        except ValueError as e:
            c.fail(f"{key}.ssh", str(e))
        address = h.get("address", resolved["hostname"])
        if not isinstance(address, str) or not address:
            c.fail(f"{key}.address", f"expected an IP address or host name, got {address!r}")
        address_from = c.mapping(h.get("address_from", {}), f"{key}.address_from")
        for peer, a in address_from.items():
            c.node(peer, f"{key}.address_from", nodes)
            if not isinstance(a, str) or not a:
                c.fail(f"{key}.address_from.{peer}", f"expected an IP address or host name, got {a!r}")
        data_port = c.number(h.get("data_port", DATA_PORT), f"{key}.data_port", integer=True, minimum=1)
        python = str(h.get("python", data.get("python", "python3")))
        workdir = str(h.get("workdir", f"{data.get('workdir', DEFAULT_WORKDIR)}/{name}"))
        offset = c.number(h.get("clock_offset_ms", 0.0), f"{key}.clock_offset_ms")
        hosts[name] = Host(name, h["ssh"], address, dict(address_from), data_port, python, workdir, offset)
    return HostsFile((host.strip("[]"), int(port)), hosts, options)


def code_files() -> dict[str, bytes]:
    """The files an agent needs: path relative to the repository -> content."""
    return {str(f.relative_to(REPO)): f.read_bytes() for pattern in CODE for f in sorted(REPO.glob(pattern))}


def echo_offset(conn: ssh.Connection, chan, reader) -> clock.Offset:
    """A host's clock minus this machine's, NTP-style over a clock echo (``agents.clock``)
    running in ``chan``: CLOCK_EXCHANGES exchanges, the least round trip's estimate."""
    chan.settimeout(conn.options.command_timeout_s)
    exchanges = []
    try:
        for _ in range(CLOCK_EXCHANGES):
            t0 = time.time_ns()
            chan.sendall(b"\n")
            line = reader.readline()
            t3 = time.time_ns()
            t1, t2 = map(int, line.split())
            exchanges.append((t0, t1, t2, t3))
    except (OSError, ValueError) as e:
        raise conn.error(f"clock exchange failed: {e or 'no answer'}") from None
    return clock.estimate(exchanges)


class SshHosts(Hosts):
    """Agents on real hosts over SSH (one paramiko connection per host); the coordinator on
    this machine.  Same interface as :class:`testbed.hosts.Hosts` (addresses,
    clock_offsets, start_agent, health, stop_agents)."""

    def __init__(self, hosts_file: HostsFile, log: Callable[[str], None] = lambda m: None):
        self.hosts, self.log = hosts_file.hosts, log
        self.coordinator_host, port = hosts_file.coordinator
        self.coordinator_bind = ("0.0.0.0", port)
        self.environment: dict[str, dict] = {}
        self.conns = {n: ssh.Connection(n, h.ssh, hosts_file.ssh) for n, h in self.hosts.items()}
        self._echo: dict[str, tuple] = {}  # dc -> (channel, its reader) of the clock echo
        self._procs: dict[str, ssh.RemoteProcess] = {}

    def __enter__(self) -> "SshHosts":
        try:
            self.connect()
            self.install()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _each(self, fn: Callable[[str, Host], object]) -> dict:
        return ssh.for_each(self.hosts, fn)

    def connect(self) -> None:
        """One connection per host, opened in parallel; RunError naming every host that failed."""
        self.log(f"connecting to {len(self.hosts)} hosts over SSH")
        self._each(lambda dc, h: self.conns[dc].connect())

    def install(self) -> None:
        """Copy the agent code to every host (only what changed), record its environment and
        start its clock echo."""
        files = code_files()

        def one(dc: str, h: Host) -> None:
            conn, w = self.conns[dc], shlex.quote(h.workdir)
            conn.run(private_dir(h.workdir), "creating the agent's private workdir")
            sent = conn.sync(h.workdir, files)
            out = conn.run(f"uname -r && cd {w} && {h.python} -c " + shlex.quote(
                "import sys, numpy, agents.agent; print(sys.version.split()[0], numpy.__version__)"),
                "checking the agent's Python").split()
            self.environment[dc] = {"ssh": h.ssh, "kernel": out[0], "python": out[1], "numpy": out[2],
                                    "workdir": h.workdir, "code_files_sent": len(sent)}
            chan = conn.channel(f"cd {w} && exec {h.python} -m agents.clock --offset-ms {h.clock_offset_ms:g}")
            self._echo[dc] = (chan, chan.makefile("rb"))

        self.log(f"installing the agent on {len(self.hosts)} hosts (SFTP, changed files only)")
        self._each(one)

    def addresses(self) -> dict[str, dict[str, str]]:
        """src -> {dst: address src connects to}, as the coordinator takes it."""
        return {s: {d: h.address_from.get(s, h.address) for d, h in self.hosts.items() if d != s}
                for s in self.hosts}

    def clock_offsets(self) -> dict[str, clock.Offset]:
        """Each host's clock minus this machine's, estimated now (NTP-style, over the echo)."""
        return self._each(lambda dc, h: echo_offset(self.conns[dc], *self._echo[dc]))

    def start_agent(self, dc: str, cfg: dict, out_dir: Path, secret_file: Path) -> None:
        h, conn = self.hosts[dc], self.conns[dc]
        node = {**cfg, "data_port": h.data_port, "bind": "0.0.0.0", "secret_file": "secret",
                "clock_offset_ms": h.clock_offset_ms}
        conn.put(h.workdir, {"node.json": json.dumps(node).encode(), "secret": secret_file.read_bytes()}, mode=0o600)
        log = out_dir / "agents" / f"{dc}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        self._procs[dc] = conn.start(f"cd {shlex.quote(h.workdir)} && echo $$ > agent.pid && "
                                     f"exec {h.python} -m agents.agent --config node.json", log)

    def carry_paths(self, paths: dict) -> dict[str, dict[str, str]]:
        """Real hosts' networks route as they do: named paths are not carried ({})."""
        return {}

    def health(self) -> str | None:
        """Why a run cannot go on (an agent exited, a connection dropped), or None."""
        for dc, p in self._procs.items():
            code = p.poll()
            if code is not None:
                tail = p.log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
                return (f"{dc}: agent on {self.hosts[dc].ssh} " + ("lost (SSH connection dropped)" if code == -1
                        else f"exited with code {code}") + f": {tail[0]}")
        return None

    def stop_agents(self, grace_s: float = 5.0) -> None:
        """Wait ``grace_s`` for the agents to exit, then kill the rest on their hosts."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p in self._procs.values()):
            time.sleep(0.05)
        left = {dc: self.hosts[dc] for dc, p in self._procs.items() if p.poll() is None}

        def kill(dc: str, h: Host) -> None:
            self.conns[dc].run(f"cd {shlex.quote(h.workdir)} && kill $(cat agent.pid) 2>/dev/null; true",
                               "stopping the agent", timeout=15)

        try:
            ssh.for_each(left, kill)
        except RunError as e:
            self.log(f"warning: {e}")
        for p in self._procs.values():
            p.close()
        self._procs.clear()

    def close(self) -> None:
        """Stop the agents and clock echos, close every connection."""
        try:
            self.stop_agents()
        finally:
            for chan, _ in self._echo.values():
                chan.close()
            self._echo.clear()
            for conn in self.conns.values():
                conn.close()


def check_deployable(exp: Experiment, hosts_path: str | Path) -> HostsFile:
    """The checked hosts file for ``exp``; ConfigError if either cannot be deployed."""
    for key in ("dynamics", "faults"):
        if getattr(exp, key):
            raise ConfigError("emulator-only: real hosts cannot be reshaped; remove it to deploy",
                              source=exp.name, key=key)
    return load_hosts(hosts_path, exp.topology.nodes)


def deploy(exp: Experiment, hosts_file: HostsFile, out_dir: Path, progress: Callable[[str], None]) -> dict:
    """Run every scheme of ``exp`` on the real hosts of ``hosts_file`` (from
    :func:`check_deployable`; agent logs in ``out_dir``); the data of results.json."""
    planned = plan_variants(exp, progress)
    results: dict = {"experiment": exp.to_dict(), "environment": environment(), "runs": []}
    with SshHosts(hosts_file, log=progress) as hosts:
        results["deployment"] = {"coordinator": hosts.coordinator_host, "hosts": hosts.environment}
        results["runs"] = run_variants(exp, planned, hosts, out_dir, progress)
    return add_summaries(results, planned, exp)
