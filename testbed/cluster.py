"""One experiment on several servers (``--servers SERVERS.yaml``): every datacenter's namespace
on the server :mod:`testbed.placement` gives it, links between servers tunnelled and shaped as
local ones are (:class:`testbed.emulator.network.Share`), the agents started on their servers
over SSH (paramiko, :mod:`testbed.ssh`), the coordinator here.

The servers file (YAML)::

    coordinator: 192.0.2.10      # this machine's underlay address, which the servers reach
    python: python3              # on the servers (testbed/setup.sh ran there: Mininet, iperf3, gcc)
    workdir: /var/tmp/testbed    # the code is copied to WORKDIR/NAME on each server (changed files only)
    vxlan_port: 4789             # the tunnels' UDP port on the underlay
    ssh_config: ~/.ssh/config    # these SSH keys as in deploy's hosts file (testbed/deploy.py)
    known_hosts: ~/.ssh/known_hosts
    accept_new_host_keys: false
    identity_file: ~/.ssh/id_testbed
    connect_timeout_s: 10
    command_timeout_s: 60
    local: {mtu: 9000}           # optional: stand the servers up on THIS machine as network
                                 # namespaces with their own sshd (testbed/emulator/nsservers.py)
    servers:
      s1: {ssh: root@s1.example.org, underlay: 192.0.2.1, cores: 16, nic_mbps: 10000}
      s2: {ssh: s2-alias, underlay: 192.0.2.2}

``underlay``: the server's address the others' tunnels and this machine reach (unique);
``cores`` and ``nic_mbps`` (optional): what placement may load it with.  Servers log in as root
(the emulator builds namespaces).  Control traffic (agents <-> coordinator) goes from each
server's control bridge to ``coordinator`` over the underlay, forwarded by the server's
process (:mod:`testbed.emulator.serve`); data takes the shaped links.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shlex
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from testbed import ssh
from testbed.checks import Checker
from testbed.config import Experiment, load_yaml
from testbed.deploy import echo_offset, private_dir, ssh_options
from testbed.emulator.hosts import EmulatedHosts
from testbed.emulator.network import CONTROL_IP, Direction, WanNetwork
from testbed.errors import ConfigError, RunError
from testbed.placement import VXLAN_OVERHEAD_BYTES, Placement, ServerSize, place, underlay_problems
from testbed.results import REPO

SERVERS_KEYS = {"coordinator", "python", "workdir", "vxlan_port", "local", "servers", "ssh_config", "known_hosts",
                "accept_new_host_keys", "identity_file", "connect_timeout_s", "command_timeout_s"}
SERVER_KEYS = {"ssh", "underlay", "cores", "nic_mbps", "python", "workdir"}
LOCAL_KEYS = {"mtu"}
CODE = ["testbed/**/*.py", "testbed/emulator/relay/tbrelay.c", "agents/*.py"]  # what a server runs
VNI_BASE = 4000  # link j's tunnel: VNI VNI_BASE + j
READY_S = 120.0  # a server's share built (plus a little per link)
HEALTH_EVERY_S = 1.0  # servers' health asked this often during a run
INNER_MTU = 1500
IPERF_PORT = 5299  # the underlay's throughput check, on the servers' underlay addresses


@dataclass(frozen=True)
class Server:
    name: str
    ssh: str
    underlay: str
    cores: float | None
    nic_mbps: float | None
    python: str
    workdir: str


@dataclass
class ServersFile:
    source: str
    coordinator: str
    servers: dict[str, Server]
    ssh: ssh.SshOptions
    vxlan_port: int = 4789
    local: dict | None = None  # {"mtu": ...}: namespace servers on this machine

    def sizes(self) -> list[ServerSize]:
        return [ServerSize(s.name, s.cores, s.nic_mbps) for s in self.servers.values()]


def load_servers(path: str | Path) -> ServersFile:
    """Read and check a servers file (nothing is contacted)."""
    source = str(path)
    data, c = load_yaml(path, what="servers"), Checker(source)
    c.mapping(data, "", SERVERS_KEYS)
    if "servers" not in data:
        c.fail("servers", "missing (format: testbed/cluster.py or docs/guides/multi-server.md)")
    local = _local_section(data, c)
    servers_raw = c.mapping(data["servers"], "servers")
    if not servers_raw:
        c.fail("servers", "expected at least one server")
    options = ssh_options(data, c)
    seen: dict[str, str] = {}  # underlay address -> the server that has it
    servers = {name: _server(name, s, data, c, local, options, seen) for name, s in servers_raw.items()}
    coordinator = _coordinator(data, c, local, seen)
    port = c.number(data.get("vxlan_port", 4789), "vxlan_port", integer=True, minimum=1)
    return ServersFile(source, coordinator, servers, options, port, local)


def _local_section(data: dict, c: Checker) -> dict | None:
    """The servers file's ``local`` section, checked: {"mtu": ...}, or None (real servers)."""
    local = data.get("local")
    if local is not None:
        c.mapping(local, "local", LOCAL_KEYS)
        mtu = c.number(local.get("mtu", 9000), "local.mtu", integer=True, minimum=1280)
        local = {"mtu": mtu}
    return local


def _address(value, key: str, c: Checker) -> str:
    """``value`` as an IPv4 address; a ConfigError naming ``key`` if it is not one."""
    try:
        return str(ipaddress.IPv4Address(value))
    except (ipaddress.AddressValueError, ValueError):
        c.fail(key, f"expected an IPv4 address, got {value!r}")


def _server(name, s, data: dict, c: Checker, local: dict | None, options: ssh.SshOptions,
            seen: dict[str, str]) -> Server:
    """One entry of ``servers``, checked; its underlay address is added to ``seen``."""
    key = f"servers.{name}"
    if not isinstance(name, str) or not name.isidentifier() or len(name) > 10:
        c.fail(key, "a server name is a letter, then letters, digits or _ (at most 10)")
    c.mapping(s, key, SERVER_KEYS)
    if "underlay" not in s:
        c.fail(f"{key}.underlay", "missing: the address the other servers' tunnels reach this one at")
    under = _address(s["underlay"], f"{key}.underlay", c)
    if under in seen:
        c.fail(f"{key}.underlay", f"{under} is also server {seen[under]}'s: every server needs its own")
    seen[under] = name
    dest = s.get("ssh", f"root@{under}" if local is not None else None)
    if not isinstance(dest, str) or not dest:
        c.fail(f"{key}.ssh", "expected an ssh destination such as root@host")
    try:
        ssh.resolve(dest, options.config)
    except ValueError as e:
        c.fail(f"{key}.ssh", str(e))
    cores = c.number(s["cores"], f"{key}.cores", positive=True) if "cores" in s else None
    nic = c.number(s["nic_mbps"], f"{key}.nic_mbps", positive=True) if "nic_mbps" in s else None
    workdir = data.get("workdir", "/var/tmp/testbed")
    return Server(name, dest, under, cores, nic, str(s.get("python", data.get("python", "python3"))),
                  str(s.get("workdir", f"{workdir}/{name}")))


def _coordinator(data: dict, c: Checker, local: dict | None, seen: dict[str, str]) -> str:
    """The coordinator's underlay address, checked against the servers' (``seen``)."""
    if "coordinator" not in data and local is None:
        c.fail("coordinator", "missing: this machine's underlay address, which the servers reach")
    coordinator = _address(data.get("coordinator", "10.254.0.254"), "coordinator", c)
    if coordinator in seen:
        c.fail("coordinator", f"{coordinator} is server {seen[coordinator]}'s underlay address")
    if local is not None:
        net = ipaddress.IPv4Network(f"{coordinator}/24", strict=False)
        for under, name in seen.items():
            if ipaddress.IPv4Address(under) not in net:
                c.fail(f"servers.{name}.underlay", f"local servers share one /24 with the coordinator ({net})")
    return coordinator


# Why a plan that names paths does not run here: WanNetwork.install_paths is policy routing by
# source address in the datacenters' namespaces of one network; no server installs a path's rules.
PATHS_REFUSED = ("per-flow paths (policy routing by source address) are installed on one machine's network "
                 "only: on several servers these connections would take the static routes instead")


def far_paths(paths, topo) -> list[tuple[str, ...]]:
    """The paths among ``paths`` that need policy routing on ``topo``: those of more than one
    hop whose data or acknowledgements the static routes would carry elsewhere (a one-hop
    path is a link; a path that is the static route both ways is carried as it is)."""
    from testbed.routing import data_paths

    static = data_paths(topo.graph())
    return sorted({tuple(p) for p in paths if len(p) >= 3 and (static.get((p[0], p[-1])) != list(p)
                                                              or static.get((p[-1], p[0])) != list(p)[::-1])})


def refuse_paths(exp: Experiment, planned) -> None:
    """ConfigError naming the first variant whose plan (``Planned``) carries a connection on a
    path the static routes do not carry (:func:`far_paths`): not on several servers
    (:data:`PATHS_REFUSED`)."""
    from testbed.experiment import scheme_key

    for i, p in enumerate(planned):
        far = far_paths(p.plan.paths().values(), exp.topology)
        if far:
            raise ConfigError(f"{p.variant.label}'s plan names {len(far)} paths off the static routes (e.g. "
                              f"{'>'.join(far[0])}), not with --servers: {PATHS_REFUSED} (run it on one machine, or "
                              "a variant whose plan names no path)", source=exp.source, key=scheme_key(i))


def check_placement(exp: Experiment, sf: ServersFile, planned=()) -> Placement:
    """The placement of ``exp`` on ``sf``'s servers (pins from ``placement:``); ConfigError if
    it cannot be placed, the servers' NICs (``nic_mbps``) cannot carry its cut links, or a plan
    of ``planned`` names paths (:func:`refuse_paths`)."""
    if exp.sweep:
        raise ConfigError("sweeps run on one machine (no --servers)", source=exp.source, key="sweep")
    refuse_paths(exp, planned)
    p = place(exp.topology, sf.sizes(), exp.placement, source=exp.source)
    problems = underlay_problems(p, {}, {s.name: s.nic_mbps for s in sf.servers.values()})
    if problems:
        raise ConfigError("the underlay cannot carry this placement: " + "; ".join(problems), source=sf.source,
                          key="servers")
    return p


def network_on(sf: ServersFile, topo, log: Callable[[str], None] = print):
    """What builds ``topo``'s network on ``sf``'s servers (placed without pins), with
    :class:`~testbed.emulator.network.WanNetwork`'s keywords (the link check's ``network``)."""
    p = place(topo, sf.sizes(), source=sf.source)
    problems = underlay_problems(p, {}, {s.name: s.nic_mbps for s in sf.servers.values()})
    if problems:
        raise ConfigError("the underlay cannot carry this placement: " + "; ".join(problems), source=sf.source,
                          key="servers")
    for line in p.describe(topo):
        log(line)
    return lambda topo, **kw: ClusterNetwork(topo, sf, p, **kw)


def code_files() -> dict[str, bytes]:
    """What a server runs: the testbed package, the relay's source, the agents."""
    return {str(f.relative_to(REPO)): f.read_bytes() for pattern in CODE for f in sorted(REPO.glob(pattern))
            if "__pycache__" not in f.parts}


class ClusterNetwork(WanNetwork):
    """A :class:`~testbed.emulator.network.WanNetwork` whose datacenters live on several
    servers.  The same interface for what runs on it (``directions``, addresses, ``popen``
    in a datacenter, ``health``, relay statistics, live rate and link changes), so the link
    check and the experiment run on it unchanged; ``popen`` gives :class:`testbed.ssh.RemotePopen`."""

    def __init__(self, topo, servers: ServersFile, placement: Placement, **kw):
        super().__init__(topo, **kw)
        self.sf, self.placement = servers, placement
        self.conns: dict[str, ssh.Connection] = {}
        self.local_servers = None
        self.server_info: dict[str, dict] = {}  # name -> ready message, environment
        self.underlay: dict = {}
        self._daemons: dict[str, tuple] = {}  # name -> (channel, reader, lock)
        self._pids: dict[str, int] = {}  # dc -> its namespace's shell pid on its server
        self._problem: str | None = None
        self._watch: threading.Thread | None = None
        self._stopping = threading.Event()
        self.run_id = ""
        self.all_pairs = False  # measure every pair's throughput (doctor), not only the placement's

    def server_of(self, dc: str) -> str:
        return self.placement.assignment[dc]

    # -- life cycle ----------------------------------------------------------------
    def start(self) -> None:
        self.open()
        self.underlay = self.measure_underlay(throughput=True)
        problems = underlay_problems(self.placement, {k: v["mbps"] for k, v in self.underlay["pairs"].items()
                                                      if v.get("mbps")},
                                     {s.name: s.nic_mbps for s in self.sf.servers.values()})
        if problems:
            raise RunError("the underlay cannot carry this placement: " + "; ".join(problems))
        self._start_daemons()
        self._watch = threading.Thread(target=self._watch_health, daemon=True, name="servers-health")
        self._watch.start()
        self.log("network up on " + ", ".join(f"{n} ({len(self.placement.on(n))} datacenters)"
                                             for n in self.sf.servers))

    def open(self) -> None:
        """Local servers stood up (if the file says so); every server connected, checked
        (root) and given the code."""
        from testbed.emulator.nsservers import LocalServers

        sf = self.sf
        if sf.local is not None:
            self.local_servers = LocalServers({n: s.underlay for n, s in sf.servers.items()}, sf.coordinator,
                                              mtu=sf.local["mtu"], log=self.log)
            self.local_servers.start()
            sf = self.sf = replace(sf, ssh=replace(sf.ssh, identity_files=(self.local_servers.identity,),
                                                   known_hosts=self.local_servers.known_hosts))
        self.log(f"connecting to {len(sf.servers)} servers")
        self.conns = {n: ssh.Connection(n, s.ssh, sf.ssh) for n, s in sf.servers.items()}
        ssh.for_each(self.conns, lambda n, c: c.connect())
        files = code_files()

        def prepare(name: str, conn: ssh.Connection) -> None:
            s = sf.servers[name]
            conn.run(private_dir(s.workdir), "making the work folder")
            conn.sync(s.workdir, files)
            out = conn.run("uname -r; id -u", "checking the server").split()
            if out[1:2] != ["0"]:
                raise conn.error(f"logged in as uid {out[1:2]}: the emulator needs root")
            self.server_info[name] = {"ssh": s.ssh, "underlay": s.underlay, "kernel": out[0],
                                      "datacenters": self.placement.on(name)}
        ssh.for_each(self.conns, prepare)

    def measure_underlay(self, throughput: bool = False) -> dict:
        """Round trip and MTU from every server to every other over the underlay; with
        ``throughput``, iperf3's TCP rate one way (pairs one at a time) where the placement
        tunnels links (every pair: ``all_pairs``)."""
        names = list(self.sf.servers)

        def one(name: str, conn: ssh.Connection) -> dict:
            out = {}
            for other in names:
                if other == name:
                    continue
                to = self.sf.servers[other].underlay
                text = conn.run(f"ping -n -q -c 5 -i 0.2 -W 2 {to}; d=$(ip -o route get {to} | "
                                f"sed -n 's/.* dev \\([^ ]*\\).*/\\1/p'); cat /sys/class/net/$d/mtu",
                                f"measuring the underlay to {other}", timeout=30)
                rtt = [float(x) for x in text.split("=")[-1].split("ms")[0].strip().split("/")] if "rtt" in text else None
                mtu = int(text.strip().splitlines()[-1])
                if rtt is None:
                    raise conn.error(f"the underlay does not reach {other} ({to}): no ping answered")
                out[other] = {"rtt_ms": rtt[0], "rtt_avg_ms": rtt[1], "mtu": mtu}
            return out
        seen = ssh.for_each(self.conns, one)
        pairs = {(a, b): m for a, row in seen.items() for b, m in row.items()}
        if throughput:
            for a, b in sorted(pairs):
                if self.all_pairs or (a, b) in self.placement.underlay_mbps:
                    pairs[(a, b)]["mbps"] = self._iperf(a, b)
        mtu = min([m["mtu"] for m in pairs.values()], default=INNER_MTU + VXLAN_OVERHEAD_BYTES)
        inner = min(INNER_MTU, mtu - VXLAN_OVERHEAD_BYTES)
        if inner < INNER_MTU:
            self.log(f"warning: the underlay's MTU is {mtu}: every WAN link gets MTU {inner} (VXLAN takes "
                     f"{VXLAN_OVERHEAD_BYTES} bytes); an underlay MTU of {INNER_MTU + VXLAN_OVERHEAD_BYTES} keeps 1500")
        return {"pairs": pairs, "mtu": mtu, "link_mtu": inner}

    def _iperf(self, a: str, b: str, seconds: float = 2.0) -> float:
        """TCP throughput from server ``a`` to server ``b`` over the underlay (iperf3), Mbit/s."""
        to = self.sf.servers[b].underlay
        srv = ssh.RemotePopen(self.conns[b], f"iperf3 -s -1 -B {to} -p {IPERF_PORT}")
        try:
            text = self.conns[a].run(f"for i in 1 2 3 4 5 6 7 8 9 10; do iperf3 -c {to} -p {IPERF_PORT} -t {seconds:g} "
                                     f"-J 2>/dev/null && break; sleep 0.3; done",
                                     f"measuring the underlay's throughput to {b}", timeout=seconds + 30)
            return json.loads(text)["end"]["sum_received"]["bits_per_second"] / 1e6
        except (ValueError, KeyError):
            raise self.conns[a].error(f"iperf3 to {b} ({to}) gave no result (is iperf3 installed on both?)") from None
        finally:
            srv.kill()
            srv.close()

    def _spec(self, name: str) -> dict:
        sf, topo = self.sf, self.topo
        tunnels = {}
        for j in self.placement.cut:
            link = topo.links[j]
            sa, sb = self.server_of(link.a), self.server_of(link.b)
            if name not in (sa, sb):
                continue
            other = sb if name == sa else sa
            m = self.underlay["pairs"].get((name, other), {})
            tunnels[j] = {"vni": VNI_BASE + j, "local": sf.servers[name].underlay, "remote": sf.servers[other].underlay,
                          "relay_here": name == sa,  # a cut link's relay runs on its first end's server
                          "underlay_delay_ms": m.get("rtt_ms", 0.0) / 2}
        return {"topology": topo.to_dict(), "nodes": self.placement.on(name), "tunnels": tunnels,
                "vxlan_port": sf.vxlan_port, "mtu": self.underlay["link_mtu"], "method": self.method,
                "relay_procs": self.relay_procs, "seed": self.seed, "tcp_cc": self.tcp_cc, "frame_ms": self.frame_ms,
                "icmp_priority": self.icmp_priority, **self._relay_cores(name)}

    def _relay_cores(self, name: str) -> dict:
        """Local servers share the cores of the machine they stand on: each one's relays get a part of them."""
        from testbed.emulator.nsservers import core_share

        if self.sf.local is None:
            return {}
        used = [n for n in self.sf.servers if self.placement.on(n)]
        return {"relay_cores": core_share(used.index(name), len(used), os.cpu_count() or 1)}

    def _start_daemons(self) -> None:
        deadline_s = READY_S + 0.5 * len(self.topo.links)

        def one(name: str, conn: ssh.Connection) -> dict:
            s = self.sf.servers[name]
            chan = conn.channel(f"cd {shlex.quote(s.workdir)} && exec {s.python} -m testbed.emulator.serve")
            reader = chan.makefile("rb")
            self._daemons[name] = (chan, reader, threading.Lock())
            chan.sendall((json.dumps(self._spec(name)) + "\n").encode())
            return self._reply(name, deadline_s, "ready")
        ready = ssh.for_each({n: c for n, c in self.conns.items() if self.placement.on(n)}, one)
        for name, r in ready.items():
            self.server_info[name].update({k: r[k] for k in ("method", "relay_layout", "memory_hold", "run_id")})
            for dc, pid in r["pids"].items():
                self._pids[dc] = pid
            for d in r["directions"]:
                self.directions[(d["src"], d["dst"])] = Direction(d["src"], d["dst"], d["link"], d["intf"],
                                                                  self.topo.linkdir(d["src"], d["dst"]), d["method"],
                                                                  segment_loss=d["segment_loss"])
            self.host_sysctls = r["host_sysctls"]
        first = next(iter(ready.values()))
        self.method = first["method"]
        self.relays = [n for n, r in ready.items() for _ in range((r["relay_layout"] or {}).get("processes", 0))]
        self.relay_layout = {n: r["relay_layout"] for n, r in ready.items()}
        self.memory_hold = {n: r["memory_hold"] for n, r in ready.items()}
        self.directions = {sd: self.directions[sd] for sd in sorted(self.directions, key=self._order)}

    def _order(self, sd: tuple[str, str]) -> tuple:
        link = self.topo.link(*sd)
        return self.topo.links.index(link), sd[0] != link.a

    def _reply(self, name: str, timeout: float, key: str = "ok"):
        """The next reply of server ``name``'s process (its log lines passed on)."""
        chan, reader, _ = self._daemons[name]
        conn = self.conns[name]
        chan.settimeout(timeout)
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = reader.readline()
            except (OSError, EOFError) as e:
                raise conn.error(f"no answer from the server's emulator within {timeout:g} s ({e or 'timeout'})") from None
            if not line:
                tail = b""
                while chan.recv_stderr_ready():
                    tail += chan.recv_stderr(65536)
                why = tail.decode(errors="replace").strip().splitlines()[-1:] or ["the SSH channel closed"]
                raise conn.error(f"the server's emulator exited: {why[0]}")
            try:
                msg = json.loads(line)
            except ValueError:  # something of the server's wrote to its output: pass it on
                msg = {"log": line.decode(errors="replace").rstrip()}
            if "log" in msg:
                self.log(f"{name}: {msg['log']}")
            elif "error" in msg:
                raise conn.error(msg["error"])
            elif key in msg:
                return msg[key]
            if time.monotonic() > deadline:
                raise conn.error(f"no answer from the server's emulator within {timeout:g} s")

    def call(self, name: str, op: str, timeout: float | None = None, **kw):
        """One request to server ``name``'s emulator; its reply."""
        chan, _, lock = self._daemons[name]
        with lock:
            try:
                chan.sendall((json.dumps({"op": op, **kw}) + "\n").encode())
            except (OSError, EOFError) as e:
                raise self.conns[name].error(f"{op}: the connection failed ({e or type(e).__name__})") from None
            return self._reply(name, timeout or self.sf.ssh.command_timeout_s)

    def _watch_health(self) -> None:
        while not self._stopping.wait(HEALTH_EVERY_S):
            for name in list(self._daemons):
                try:
                    why = self.call(name, "health", timeout=max(5.0, 3 * HEALTH_EVERY_S))
                except RunError as e:
                    why = str(e)
                if why and not self._stopping.is_set():
                    self._problem = self._problem or (why if why.startswith(name) else f"server {name}: {why}")

    def stop(self) -> None:
        self._stopping.set()
        try:
            self.stop_processes(grace_s=0)
        finally:
            def one(name: str, conn: ssh.Connection) -> None:
                if name in self._daemons:
                    try:
                        self.call(name, "stop", timeout=60)
                    except RunError as e:
                        self.log(f"warning: {e}")
                    chan = self._daemons[name][0]
                    if not chan.closed:
                        chan.status_event.wait(60)
                    chan.close()
                conn.close()
            try:
                ssh.for_each(self.conns, one)
            except RunError as e:
                self.log(f"warning: teardown: {e}")
            self._daemons.clear()
            if self.local_servers is not None:  # a server lost mid-run left its datacenters here
                from testbed.emulator.cleanup import kill_run

                for info in self.server_info.values():
                    if info.get("run_id"):
                        kill_run(info["run_id"])
                self.local_servers.stop()
                self.local_servers = None

    # -- what runs on it --------------------------------------------------------------
    def popen(self, dc: str, argv: list[str], **kw) -> ssh.RemotePopen:
        """``argv`` in datacenter ``dc``'s namespace on its server (this Python's path is
        the server's ``python``); ``env`` entries that differ from this process's are passed."""
        import os

        name = self.server_of(dc)
        s = self.sf.servers[name]
        argv = [s.python if a == sys.executable else a for a in argv]
        env = {k: v for k, v in (kw.get("env") or {}).items() if os.environ.get(k) != v and k != "PYTHONPATH"}
        env.update({"PYTHONPATH": s.workdir, "TESTBED_RUN": self.server_info[name].get("run_id", "")})
        cmd = (f"mnexec -a {self._pids[dc]} env " + " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
               + " " + " ".join(map(shlex.quote, argv)))
        p = ssh.RemotePopen(self.conns[name], cmd, cwd=s.workdir, stdin=kw.get("stdin"),
                            stdout=kw.get("stdout", _devnull()),
                            stderr=kw.get("stderr", _devnull()), text=kw.get("text", False) or
                            kw.get("universal_newlines", False))
        self._procs.append((dc, p))
        return p

    def _reap(self, p: ssh.RemotePopen) -> None:
        if p.poll() is None:
            p.kill()
        p.close()

    def health(self) -> str | None:
        return self._problem

    def relay_stats(self) -> list[dict]:
        out = []
        for name in self._daemons:
            st = self.call(name, "stats")
            self.server_info[name]["last_stats"] = {k: st[k] for k in ("cpu_util", "steal", "cpus")}
            out += [{**r, "server": name} for r in st["relay"]]
        return out

    def reset_relay_window(self) -> None:
        for name in self._daemons:
            self.call(name, "reset")

    def set_rate(self, src: str, dst: str, rate_mbps: float) -> None:
        d = self._direction(src, dst)
        self.call(self.server_of(src), "set_rate", src=src, dst=dst, rate_mbps=rate_mbps)
        d.spec = replace(d.spec, rate_mbps=rate_mbps)
        self._event("rate", src=src, dst=dst, rate_mbps=rate_mbps)

    def set_link(self, a: str, b: str, up: bool) -> None:
        for name in dict.fromkeys((self.server_of(a), self.server_of(b))):
            self.call(name, "set_link", a=a, b=b, up=up)
        for sd in ((a, b), (b, a)):
            self._direction(*sd).up = up
        self._event("link_up" if up else "link_down", a=a, b=b)

    def install_paths(self, paths) -> dict[tuple[str, ...], str]:
        """Paths the static routes carry need nothing; the others (:func:`far_paths`) are
        refused (:data:`PATHS_REFUSED`): RunError naming one (a plan made at run time; ``run``
        refuses planned ones before the network is built)."""
        far = far_paths(paths, self.topo)
        if far:
            raise RunError(f"the plan names {len(far)} paths off the static routes (e.g. {'>'.join(far[0])}): "
                           + PATHS_REFUSED)
        return {}

    def forward(self, host: str, port: int) -> None:
        """Agents' control connections on every server to ``host:port`` (the coordinator)."""
        for name in self._daemons:
            self.call(name, "forward", to=[host, port])

    def agent_hosts(self):
        return ClusterHosts(self)

    def servers_health(self, max_late_ms: float) -> dict:
        """Per server: its datacenters, CPU and steal of the last statistics window, and
        whether its relays kept up (names the server in every warning)."""
        from testbed.emulator import relay as relay_mod
        from testbed.results import STEAL_MAX

        out = {}
        stats = self.relay_stats()
        for name, info in self.server_info.items():
            warn = []
            for i, st in enumerate(s for s in stats if s["server"] == name):
                ok, why = relay_mod.kept_up(st, max_p99_late_ms=max_late_ms)
                if not ok:
                    warn.append(f"server {name}: relay {i}: {why}")
            last = info.get("last_stats", {})
            if last.get("cpu_util", 0) > 0.95:
                warn.append(f"server {name}: CPU {last['cpu_util']:.0%} busy")
            if last.get("steal", 0) > STEAL_MAX:
                warn.append(f"server {name}: the hypervisor took {last['steal']:.1%} of the CPU time (steal)")
            out[name] = {**{k: v for k, v in info.items() if k != "last_stats"}, **last, "kept_up": not warn,
                         "warnings": warn}
        return out

    def report(self, max_late_ms: float) -> dict:
        """results.json's ``cluster``: the placement, every server's health, the underlay."""
        return {"placement": self.placement.to_dict(), "servers": self.servers_health(max_late_ms),
                "underlay": {"mtu": self.underlay.get("mtu"), "link_mtu": self.underlay.get("link_mtu"),
                             "pairs": [{"from": a, "to": b, **m} for (a, b), m in self.underlay.get("pairs", {}).items()]}}


def _devnull():
    import subprocess

    return subprocess.DEVNULL


class ClusterHosts(EmulatedHosts):
    """Agents in their datacenters' namespaces on their servers, started over SSH; the
    coordinator here, reached through each server's control forwarder."""

    def __init__(self, net: ClusterNetwork):
        super().__init__(net)
        self.coordinator_bind = (net.sf.coordinator, 0)
        self._forwarding: int | None = None
        self._echo: dict[str, tuple] = {}

    def clock_offsets(self) -> dict:
        """Each server's clock minus this machine's (NTP-style over an echo per server),
        for every datacenter on it."""
        net = self.net

        def one(name: str, conn: ssh.Connection):
            if name not in self._echo:
                s = net.sf.servers[name]
                chan = conn.channel(f"cd {shlex.quote(s.workdir)} && exec {s.python} -m agents.clock")
                self._echo[name] = (chan, chan.makefile("rb"))
            return echo_offset(conn, *self._echo[name])
        offsets = ssh.for_each({n: c for n, c in net.conns.items() if net.placement.on(n)}, one)
        return {dc: offsets[net.server_of(dc)] for dc in net.topo.nodes}

    def start_agent(self, dc: str, cfg: dict, out_dir: Path, secret_file: Path) -> None:
        from testbed.emulator.serve import FORWARD_PORT
        from testbed.hosts import DATA_PORT

        net = self.net
        port = int(cfg["coordinator"].rpartition(":")[2])
        if self._forwarding != port:
            net.forward(net.sf.coordinator, port)
            self._forwarding = port
        name = net.server_of(dc)
        s, conn = net.sf.servers[name], net.conns[name]
        folder = f"{s.workdir}/run/{dc}"
        conn.run(private_dir(folder), "making the agent's folder")
        node = {**cfg, "coordinator": f"{CONTROL_IP}:{FORWARD_PORT}", "data_port": DATA_PORT, "bind": "0.0.0.0",
                "secret_file": f"{folder}/secret"}
        conn.put(folder, {"node.json": json.dumps(node).encode(), "secret": secret_file.read_bytes()}, mode=0o600)
        log = out_dir / "agents" / f"{dc}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        import subprocess

        with open(log, "ab") as f:
            self._procs[dc] = net.popen(dc, [s.python, "-m", "agents.agent", "--config", f"{folder}/node.json"],
                                        stdout=f, stderr=subprocess.STDOUT)

    def stop_agents(self) -> None:
        super().stop_agents()
        for chan, _ in self._echo.values():
            chan.close()
        self._echo.clear()


def clean_servers(sf: ServersFile, log: Callable[[str], None] = print) -> dict:
    """``clean --servers``: what any run left on every server.  Real servers: ``testbed
    clean`` there (what belongs to no live run).  Local servers: their namespaces (every
    process in them) and bridge, then this machine's ``clean`` (the servers' datacenter
    namespaces and relays live in this machine's process table)."""
    from testbed.emulator import cleanup
    from testbed.emulator.nsservers import local_leftovers, remove

    said: dict[str, str] = {}
    if sf.local is not None:
        names = local_leftovers()
        remove(names)
        said["local servers"] = f"removed {', '.join(names)}" if names else "none up"
        lines: list[str] = []
        cleanup.clean(log=lines.append)
        said["this machine"] = "; ".join(lines)
    else:
        def one(name: str, conn: ssh.Connection) -> str:
            s = sf.servers[name]
            try:
                conn.connect()
                return conn.run(f"cd {shlex.quote(s.workdir)} && {s.python} -m testbed clean", "cleaning",
                                timeout=120).strip().replace("\n", "; ")
            finally:
                conn.close()
        said.update(ssh.for_each({n: ssh.Connection(n, s.ssh, sf.ssh) for n, s in sf.servers.items()}, one))
    for who, what in said.items():
        log(f"{who}: {what}")
    return said


def doctor_servers(sf: ServersFile, log: Callable[[str], None] = print) -> dict:
    """``doctor --servers``: per server root, kernel, what this project's ``doctor`` finds there
    (netem, HTB, relay; the shaping method), VXLAN, the clock offset from this machine; per
    pair of servers the underlay's round trip, MTU and TCP throughput."""
    from testbed.deploy import echo_offset
    from testbed.wan import Topology

    names = list(sf.servers)
    net = ClusterNetwork(Topology("doctor", [], []), sf, Placement({}, names, [], 0.0, {}, {}, {}, {}), log=log)
    net.all_pairs = True
    try:
        net.open()
        underlay = net.measure_underlay(throughput=len(names) > 1)

        def one(name: str, conn: ssh.Connection) -> dict:
            s = net.sf.servers[name]
            wd = shlex.quote(s.workdir)
            caps = json.loads(conn.run(f"cd {wd} && {s.python} -m testbed doctor --json", "running doctor"))
            vx = conn.run(f"ip link add tbxdoc type vxlan id 1 local {s.underlay} dstport {sf.vxlan_port} 2>&1 && "
                          "ip link del tbxdoc && echo ok; true", "trying VXLAN").strip()
            chan = conn.channel(f"cd {wd} && exec {s.python} -m agents.clock")
            try:
                off = echo_offset(conn, chan, chan.makefile("rb"))
            finally:
                chan.close()
            return {**net.server_info[name], "capabilities": caps, "vxlan": vx.endswith("ok"),
                    **({} if vx.endswith("ok") else {"vxlan_error": vx}),
                    "clock_offset_ms": off.offset_ns / 1e6, "clock_rtt_ms": off.rtt_ns / 1e6}
        rows = ssh.for_each(net.conns, one)
    finally:
        net.stop()
    return {"servers": rows, "underlay": {"mtu": underlay["mtu"], "link_mtu": underlay["link_mtu"],
                                          "pairs": [{"from": a, "to": b, **m} for (a, b), m in underlay["pairs"].items()]}}
