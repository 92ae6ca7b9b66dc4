"""``testbed deploy``: the same plans and the same agents, on real hosts over SSH.

The experiment's topology describes the real WAN (rates and delays measured or given); it
is only used to plan and to predict, nothing is shaped.  This machine runs the
coordinator; each datacenter's agent runs on its host, started with the system ``ssh``
client (so ``~/.ssh/config``, keys, ssh-agent and ProxyJump apply; BatchMode: a host that
would ask for a password fails instead).  The hosts file (YAML)::

    coordinator: 192.0.2.1:7000   # address:port the agents reach this machine at (port 0: any)
    python: python3               # interpreter on the hosts (needs numpy)
    workdir: /tmp/testbed-agent   # each datacenter uses WORKDIR/NAME (relative: to the login dir)
    ssh_options: ["-p", "2222"]   # extra ssh arguments for every host
    hosts:
      dc1: {ssh: alice@dc1.example.org, address: 198.51.100.1}
      dc2: {ssh: alice@dc2.example.org, address_from: {dc1: 10.0.0.2}, data_port: 7101}

``address``: where the other agents connect to this datacenter (IP or name; default: the
ssh host); ``address_from``: peer -> the address that peer uses instead (e.g. a private
link).  ``data_port`` (default 7100), ``python`` and ``workdir`` may be set per host.

Set-up copies ``agents/`` and the harness modules they import (``testbed/plan.py``,
``testbed/errors.py``) to WORKDIR/NAME with ``tar`` over ssh and records each host's
kernel, Python and numpy.  Every run writes the agent's config and secret there and
starts it; the agent's log streams back into OUT/agents/NAME.log.  Agents exit by
themselves when the coordinator finishes or disappears; teardown (also on error or
Ctrl-C) kills any that did not (``agent.pid``).
"""

from __future__ import annotations

import io
import json
import shlex
import subprocess
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from testbed.checks import Checker
from testbed.config import Experiment, load_yaml
from testbed.errors import ConfigError, RunError
from testbed.experiment import add_summaries, plan_variants, run_variants
from testbed.hosts import DATA_PORT, Hosts
from testbed.results import REPO, environment

SSH_BASE = ["ssh", "-T", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
CODE = ["agents/*.py", "testbed/__init__.py", "testbed/plan.py", "testbed/errors.py"]  # what an agent imports
HOSTS_KEYS = {"coordinator", "python", "workdir", "ssh_options", "hosts"}
HOST_KEYS = {"ssh", "address", "address_from", "data_port", "python", "workdir"}


@dataclass
class Host:
    name: str
    ssh: str  # ssh destination ([user@]host or a ~/.ssh/config alias)
    address: str  # where peers connect to it
    address_from: dict[str, str]  # peer -> address that peer uses instead
    data_port: int
    python: str
    workdir: str  # this datacenter's folder on the host


@dataclass
class HostsFile:
    coordinator: tuple[str, int]
    hosts: dict[str, Host]
    ssh_options: list[str]


def load_hosts(path: str | Path, nodes: list[str]) -> HostsFile:
    """Read and check a hosts file against the experiment's datacenters ``nodes``."""
    source = str(path)
    data, c = load_yaml(path, what="hosts"), Checker(source)
    c.mapping(data, "", HOSTS_KEYS)
    for key in ("coordinator", "hosts"):
        if key not in data:
            c.fail(key, "missing (format: testbed/deploy.py or the README's 'Real hosts')")
    host, _, port = str(data["coordinator"]).rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        c.fail("coordinator", f"expected ADDRESS:PORT (port 0: any free), got {data['coordinator']!r}")
    options = data.get("ssh_options", [])
    if not isinstance(options, list) or not all(isinstance(o, str) for o in options):
        c.fail("ssh_options", "expected a list of strings")
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
        address = h.get("address", h["ssh"].rpartition("@")[2])
        if not isinstance(address, str) or not address:
            c.fail(f"{key}.address", f"expected an IP address or host name, got {address!r}")
        address_from = c.mapping(h.get("address_from", {}), f"{key}.address_from")
        for peer, a in address_from.items():
            c.node(peer, f"{key}.address_from", nodes)
            if not isinstance(a, str) or not a:
                c.fail(f"{key}.address_from.{peer}", f"expected an IP address or host name, got {a!r}")
        data_port = c.number(h.get("data_port", DATA_PORT), f"{key}.data_port", integer=True, minimum=1)
        python = str(h.get("python", data.get("python", "python3")))
        workdir = str(h.get("workdir", f"{data.get('workdir', '/tmp/testbed-agent')}/{name}"))
        hosts[name] = Host(name, h["ssh"], address, dict(address_from), data_port, python, workdir)
    return HostsFile((host.strip("[]"), int(port)), hosts, options)


def code_bundle() -> bytes:
    """tar.gz of the files an agent needs (paths relative to the repository)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for pattern in CODE:
            for f in sorted(REPO.glob(pattern)):
                tar.add(f, arcname=str(f.relative_to(REPO)))
    return buf.getvalue()


def _files_tar(files: dict[str, bytes]) -> bytes:
    """Uncompressed tar of small files, each readable by the owner only."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, content in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(content), 0o600, int(time.time())
            tar.addfile(info, io.BytesIO(content))
    return buf.getvalue()


class SshHosts(Hosts):
    """Agents on real hosts over ssh; the coordinator on this machine.  Same interface as
    :class:`testbed.hosts.Hosts` (addresses, start_agent, health, stop_agents)."""

    def __init__(self, hosts_file: HostsFile, log: Callable[[str], None] = lambda m: None):
        self.hosts, self.ssh_options, self.log = hosts_file.hosts, hosts_file.ssh_options, log
        self.coordinator_host, port = hosts_file.coordinator
        self.coordinator_bind = ("0.0.0.0", port)
        self.environment: dict[str, dict] = {}
        self._procs: dict[str, tuple[subprocess.Popen, Path]] = {}

    def __enter__(self) -> "SshHosts":
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_agents()

    def _argv(self, h: Host, command: str) -> list[str]:
        return [*SSH_BASE, *self.ssh_options, h.ssh, command]

    def _run(self, h: Host, command: str, what: str, stdin: bytes = b"", timeout: float = 60.0) -> str:
        try:
            res = subprocess.run(self._argv(h, command), input=stdin, capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RunError(f"{h.name} ({h.ssh}): {what}: no answer within {timeout:g}s") from None
        except FileNotFoundError:
            raise RunError("the ssh client is not installed (apt install openssh-client)") from None
        if res.returncode != 0:
            err = res.stderr.decode(errors="replace").strip().splitlines()
            raise RunError(f"{h.name} ({h.ssh}): {what} failed (exit {res.returncode}): "
                           f"{err[-1] if err else 'no message'}")
        return res.stdout.decode(errors="replace")

    def install(self) -> None:
        """Copy the agent code to every host (in parallel) and record its environment."""
        bundle = code_bundle()

        def one(h: Host) -> None:
            w, py = shlex.quote(h.workdir), h.python
            out = self._run(h, f"mkdir -p {w} && tar -xzf - -C {w} && uname -r && cd {w} && {py} -c "
                               + shlex.quote("import sys, numpy, agents.agent; "
                                             "print(sys.version.split()[0], numpy.__version__)"),
                            "installing the agent", stdin=bundle)
            lines = out.split()
            self.environment[h.name] = {"ssh": h.ssh, "kernel": lines[0], "python": lines[1],
                                        "numpy": lines[2], "workdir": h.workdir}

        self.log(f"installing the agent on {len(self.hosts)} hosts over ssh")
        with ThreadPoolExecutor(max_workers=min(16, len(self.hosts))) as pool:
            for f in [pool.submit(one, h) for h in self.hosts.values()]:
                f.result()

    def addresses(self) -> dict[str, dict[str, str]]:
        """src -> {dst: address src connects to}, as the coordinator takes it."""
        return {s: {d: h.address_from.get(s, h.address) for d, h in self.hosts.items() if d != s}
                for s in self.hosts}

    def start_agent(self, dc: str, cfg: dict, out_dir: Path, secret_file: Path) -> None:
        h = self.hosts[dc]
        node = {**cfg, "data_port": h.data_port, "bind": "0.0.0.0", "secret_file": "secret"}
        files = _files_tar({"node.json": json.dumps(node).encode(), "secret": secret_file.read_bytes()})
        cmd = (f"cd {shlex.quote(h.workdir)} && tar -xf - && echo $$ > agent.pid && "
               f"exec {h.python} -m agents.agent --config node.json")
        log = out_dir / "agents" / f"{dc}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as f:  # own session: Ctrl-C reaches us, and teardown stops the agent
            p = subprocess.Popen(self._argv(h, cmd), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=f,
                                 start_new_session=True)
        self._procs[dc] = (p, log)
        try:
            p.stdin.write(files)
            p.stdin.close()
        except OSError:  # ssh already gone: health() reports it with the log's last line
            pass

    def health(self) -> str | None:
        """Why a run cannot go on (an ssh session or agent exited), or None."""
        for dc, (p, log) in self._procs.items():
            if p.poll() is not None:
                tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
                return f"{dc}: agent on {self.hosts[dc].ssh} exited with code {p.returncode}: {tail[0]}"
        return None

    def stop_agents(self, grace_s: float = 5.0) -> None:
        """Wait ``grace_s`` for the agents to exit, then kill the rest on their hosts."""
        deadline = time.monotonic() + grace_s
        for dc, (p, _) in self._procs.items():
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                h = self.hosts[dc]
                try:
                    self._run(h, f"cd {shlex.quote(h.workdir)} && kill $(cat agent.pid) 2>/dev/null; true",
                              "stopping the agent", timeout=15)
                except RunError as e:
                    self.log(f"warning: {e}")
                p.kill()
                p.wait()
        self._procs.clear()


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
