"""Topology -> running Mininet network with shaped WAN links.

Overlay model (Mininet's Topo/Net/Node/Link split, built imperatively):

* every datacenter is a Mininet host ``d<i>`` (a network namespace);
* every WAN link is a point-to-point veth between the two hosts (method ``netem``, and
  ``htb`` for a link without delay, jitter or loss), or two veths through a shared relay
  namespace ``wan`` where the user-space delay relay joins them (method ``relay``); either
  way IP sees one hop, so agents reach a neighbour directly;
* each host has a *node address* on ``lo`` (10.0.x.y/32).  Non-adjacent datacenters reach
  each other over latency-shortest paths (``testbed.routing``): static /32 routes with the
  node address as source, and IP forwarding on every host;
* a separate, unshaped control network (Linux bridge ``tbc0`` in the root namespace,
  10.255.0.0/16) carries only control traffic: coordinator <-> agents, never data.  The
  machine routes only the block of it its hosts use (``control_route``), so its own addresses
  elsewhere in 10.255.0.0/16 stay reachable.

Addresses: node i -> 10.0.(i // 250).(i % 250 + 1); link j -> 10.(1 + j // 250).(j % 250).{1,2}/24
(end a gets .1); control: host i -> 10.255.(i // 250).(i % 250 + 1), root 10.255.255.254;
the m-th named path (below) -> 10.(128 + m // 65536).(m // 256 % 256).(m % 256).
Routes are static: a link taken down is not routed around (faults mean unreachability).

Per-flow paths (:meth:`WanNetwork.install_paths`, for plans that name a transfer's path,
``Op.path``): policy routing by source address.  Each path gets an address of its own on its
first node; every node along it has a rule "from that address: to the next node" and, for the
acknowledgements, "to that address: to the node before".  A connection bound to the address
(``agents``: a data connection's ``sources`` entry) is carried on its path, every other packet
on the static routes as before.  Why the source address: it is in every packet's header, so
every hop can route on it (a socket mark does not leave the sending host, a port would need the
agents to pick ports and rules that match ports), the agents' only part is binding a data
socket to an address before connecting, and the acknowledgements, addressed to it, can be
routed back along the same path.

On several servers (``share``, :class:`Share`; ``--servers``): each server builds this for its
share of the datacenters with the full topology's addresses and routes, so a flow takes the
same path through the same links as on one machine.  A link whose ends are on two servers is
one VXLAN tunnel (one VNI per link) between the servers' underlay addresses: its device is
created here, where the underlay is, and moved into the datacenter's namespace (or, where the
link needs the delay relay and the relay runs on this server, into the relay namespace, the
relay then sitting between the datacenter's veth and the tunnel).  Either way the sender's
interface is shaped by the same ``shaping`` commands as a local link's.  VXLAN, not GRE: the
kernels met have VXLAN built in and some lack GRE (``ip_gre``), and VXLAN's UDP crosses
NAT-free clouds and firewalls as one port.  MTU: every WAN interface gets ``Share.mtu``
(1500 where the underlay carries 1550, else the underlay's less the 50 bytes of VXLAN headers),
so every path has one MTU.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from testbed.emulator import DEFAULT_TCP_CC, cleanup, memory, shaping
from testbed.emulator.capabilities import Capabilities, probe
from testbed.errors import RunError
from testbed.routing import shortest_paths
from testbed.topology import LinkDir, Topology

CONTROL_BRIDGE = "tbc0"
CONTROL_IP = "10.255.255.254"
HOST_PREFIX = "d"


def node_ip(i: int) -> str:
    return f"10.0.{i // 250}.{i % 250 + 1}"


def link_ip(j: int, end: int) -> str:
    return f"10.{1 + j // 250}.{j % 250}.{end + 1}"


def control_ip(i: int) -> str:
    return f"10.255.{i // 250}.{i % 250 + 1}"


def control_route(n: int) -> ipaddress.IPv4Network:
    """The machine's route to the control addresses of n hosts: the smallest prefix of
    10.255.0.0 that holds them, not the whole /16, so the machine's own addresses in
    10.255.0.0/16 (a nameserver at 10.255.255.53, say) stay reachable during a run.  The
    machine's own control address (``CONTROL_IP``) is a /32 outside it; the hosts hold /16."""
    blocks = (max(n, 1) - 1) // 250 + 1  # /24s, one per 250 hosts
    return ipaddress.ip_network(f"10.255.0.0/{24 - (blocks - 1).bit_length()}")


def _text(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _inside(address: str, net: ipaddress.IPv4Network) -> bool:
    try:
        return ipaddress.ip_address(address) in net
    except ValueError:
        return False


def control_conflicts(route: ipaddress.IPv4Network, resolv_conf: str, routes: str) -> list[str]:
    """What of this machine the control route would hide: its nameservers (``resolv.conf``'s
    text), and its routes (``ip -4 route show``'s text) to a network inside ``route`` or by a
    gateway or source address inside it.  A wider route around it (10.0.0.0/8) loses only the
    control block's addresses, which such a machine does not use."""
    found = []
    for line in resolv_conf.splitlines():
        parts = line.split()
        if parts[:1] == ["nameserver"] and len(parts) > 1 and _inside(parts[1], route):
            found.append(f"nameserver {parts[1]}")
    for line in routes.splitlines():
        words = line.split()
        if not words or f" dev {CONTROL_BRIDGE} " in f" {line} ":
            continue
        try:
            dest = ipaddress.ip_network(words[0], strict=False)
        except ValueError:
            dest = None  # default, blackhole, ...
        hops = [w for k, w in zip(words, words[1:]) if k in ("via", "src")]
        if (dest is not None and dest.subnet_of(route)) or any(_inside(h, route) for h in hops):
            found.append(f"route {line.strip()}")
    return found


def path_ip(m: int) -> str:
    """The source address of the m-th named path."""
    if not 0 <= m < 128 * 65536:
        raise RunError(f"too many named paths ({m + 1})")
    return f"10.{128 + m // 65536}.{m // 256 % 256}.{m % 256}"


PATH_RULE_PRIORITY = 100  # before the main table's rule (32766), after local delivery (0)
PATH_TABLE_BASE = 1000  # table PATH_TABLE_BASE + j: a host's way over link j
TSO_RTT_LOG_PATH = Path("/proc/sys/net/ipv4/tcp_tso_rtt_log")  # Linux >= 5.18


@dataclass
class Direction:
    """One shaped direction of a WAN link, as it is right now."""

    src: str
    dst: str
    link: int  # index in topo.links
    intf: str  # sender-side interface whose egress is shaped
    spec: LinkDir
    method: str
    up: bool = True
    # netem with loss: whether the sender sends one segment per packet (gso_max_segs 1), so that
    # netem loses segments one by one; False where this kernel cannot cap it (see _cap_gso)
    segment_loss: bool | None = None
    frame_bytes: int | None = None  # the largest TCP frame its sender hands it (None: the kernel's sizing)

    def report(self) -> dict:
        return {"src": self.src, "dst": self.dst, "rate_mbps": self.spec.rate_mbps,
                "delay_ms": self.spec.delay_ms, "jitter_ms": self.spec.jitter_ms,
                **({"distribution": self.spec.distribution} if self.spec.jitter_ms else {}),
                "loss": self.spec.loss, "queue_pkts": self.spec.queue_pkts,
                "method": shaping.METHODS[self.method].label,
                **({} if self.segment_loss is None else {"segment_loss": self.segment_loss}),
                **({} if self.frame_bytes is None else {"frame_bytes": self.frame_bytes})}


@dataclass(frozen=True)
class Tunnel:
    """The VXLAN tunnel of one link whose other end is on another server."""

    vni: int
    local: str  # this server's underlay address
    remote: str  # the other end's server's underlay address
    relay_here: bool = False  # the link's delay relay (if it needs one) runs on this server
    underlay_delay_ms: float = 0.0  # one-way delay of the underlay, taken off the relay's delay


@dataclass(frozen=True)
class Share:
    """What one server of several builds: its datacenters and the tunnels of its cut links."""

    nodes: tuple[str, ...]
    tunnels: dict[int, Tunnel]  # link index -> tunnel
    port: int = 4789  # VXLAN UDP port
    mtu: int = 1500  # of every WAN interface
    relay_cores: tuple[int, ...] = ()  # the cores its relays use (empty: every core; relay.layout)


def tunnel_name(j: int) -> str:
    """A tunnel device's name until it is moved (and renamed) into its namespace."""
    return f"tbx{j}"


@dataclass
class WanNetwork:
    """Build, run and tear down the emulated WAN of ``topo``.  Use as a context manager:
    everything (hosts, links, bridge, relay, processes started with :meth:`popen`) is torn
    down on exit, also on error or Ctrl-C."""

    topo: Topology
    method: str = "auto"  # "auto" | "netem" | "relay"
    relay_procs: int = 0  # relay processes (0: decided by relay.layout: one per core)
    seed: int = 0
    log: Callable[[str], None] = lambda msg: None
    caps: Capabilities | None = None
    icmp_priority: bool = False  # linkcheck only: see shaping.shape_commands
    tcp_cc: str = DEFAULT_TCP_CC  # TCP congestion control of every datacenter host
    frame_ms: float = shaping.FRAME_MS  # a link direction's longest TCP frame, in its time (shaping)
    directions: dict[tuple[str, str], Direction] = field(default_factory=dict)
    share: Share | None = None  # on several servers: this server's part (None: everything here)

    def __post_init__(self):
        self.index = {dc: i for i, dc in enumerate(self.topo.nodes)}
        self.net = None
        self.hosts: dict = {}
        self.relays: list = []
        self.relay_final_stats: list[dict] = []
        self.relay_layout: dict | None = None  # relay.layout(): processes, cpus, priority (results.json)
        self._owns_bridge = False
        self._procs: list[tuple[str, subprocess.Popen]] = []  # (datacenter, process)
        self.events: list[dict] = []
        self.host_sysctls: dict = {}  # what every datacenter host was set to (for results.json)
        self.memory_hold: dict | None = None  # memory.hold(): free page reporting held (results.json)
        self.path_sources: dict[tuple[str, ...], str] = {}  # named path -> its source address (install_paths)
        self._path_tables: set[tuple[str, int]] = set()  # (dc, link) tables the named paths use
        self.t0 = time.time()

    # -- life cycle ------------------------------------------------------------
    def __enter__(self) -> "WanNetwork":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Check the machine, build the hosts and links, shape them, start the relays."""
        from mininet.log import setLogLevel
        from mininet.net import Mininet
        from mininet.nodelib import LinuxBridge

        route = self._preflight()
        method = self.method
        self._allow_tcp_cc()
        self.run_id = cleanup.claim()  # inherited by every process of this network (clean spares live runs)
        setLogLevel("error")
        self._owns_bridge = True  # from here on, stop() removes what this run made
        self.memory_hold = memory.hold(log=self.log)
        if self.memory_hold and not self.memory_hold["full"]:
            self.log(f"warning: {self.memory_hold['note']}: the emulator may stall (docs/guides/link-fidelity.md)")
        local = set(self.share.nodes) if self.share else set(self.topo.nodes)
        links = sum(1 for link in self.topo.links if {link.a, link.b} & local)
        self.log(f"building {len(local)} datacenters, {links} links (shaping: {method})")
        net = self.net = Mininet(build=False, controller=None, topo=None, autoSetMacs=False,
                                 waitConnected=False)
        for dc, i in self.index.items():
            if dc in local:
                self.hosts[dc] = net.addHost(f"{HOST_PREFIX}{i}", ip=None)
        bridge = net.addSwitch(CONTROL_BRIDGE, cls=LinuxBridge)
        wan, relay_pairs = self._add_links(net, method, local)
        for dc, h in self.hosts.items():
            net.addLink(h, bridge, intfName1=f"{h.name}-ctl", intfName2=f"{CONTROL_BRIDGE}-{h.name}")
        net.build()
        net.start()
        self._make_tunnels()
        _check(subprocess.run(["ip", "addr", "replace", f"{CONTROL_IP}/32", "dev", CONTROL_BRIDGE],
                              capture_output=True, text=True), "control bridge address")
        _check(subprocess.run(["ip", "route", "replace", str(route), "dev", CONTROL_BRIDGE, "src", CONTROL_IP],
                              capture_output=True, text=True), "control route")
        _check(subprocess.run(["ip", "link", "set", "dev", CONTROL_BRIDGE, "alias",
                               cleanup.ALIAS_PREFIX + self.run_id], capture_output=True, text=True), "bridge alias")
        self._configure_hosts()
        if wan is not None:
            self._start_relays(wan, relay_pairs)
        self.log("network up")

    def _preflight(self) -> ipaddress.IPv4Network:
        """RunError unless this machine can emulate with the method asked for (``auto``: its
        best, set in ``self.method``), no other run's control bridge is up, and the control
        route hides nothing of the machine's; that route."""
        caps = self.caps or probe()
        problems = caps.problems()
        if problems:
            raise RunError("cannot emulate on this machine: " + "; ".join(problems))
        method = caps.shaping_method if self.method == "auto" else self.method
        lacks = shaping.missing(method, caps)
        if lacks:
            raise RunError(f"shaping method {method!r} requested but this machine lacks {', '.join(lacks)} "
                           "(see: python3 -m testbed doctor; try 'auto')")
        self.method = method
        if subprocess.run(["ip", "link", "show", CONTROL_BRIDGE], capture_output=True).returncode == 0:
            raise RunError(f"interface {CONTROL_BRIDGE} exists: another run is active, or a crashed run left "
                           "its network behind (remove it with: python3 -m testbed clean)")
        route = control_route(len(self.topo.nodes))
        hidden = control_conflicts(route, _text("/etc/resolv.conf"), subprocess.run(
            ["ip", "-4", "route", "show"], capture_output=True, text=True).stdout)
        if hidden:
            raise RunError(f"the control network's route {route} would hide this machine's "
                           f"{', '.join(hidden)}: the emulator's control addresses are 10.255.0.0/16")
        return route

    def _add_links(self, net, method: str, local: set[str]) -> tuple:
        """Every WAN link with an end in ``local``: a veth (through the relay namespace
        ``wan`` where its method relays), or, on several servers, a cut link's local end whose
        tunnel :meth:`_make_tunnels` makes; ``directions`` filled.  Returns (the relay
        namespace or None, the relay's (link, interface a, interface b))."""
        link_methods = [shaping.link_method(method, (link.ab, link.ba)) for link in self.topo.links]
        tunnels = self.share.tunnels if self.share else {}

        def relay_here(j: int) -> bool:  # a cut link's relay runs on the server its tunnel says
            if not shaping.METHODS[link_methods[j]].relay:
                return False
            link = self.topo.links[j]
            return tunnels[j].relay_here if j in tunnels else {link.a, link.b} <= local
        relayed = {j for j in range(len(self.topo.links)) if relay_here(j)}
        wan = net.addHost("wan", ip=None) if relayed else None
        self._tunnel_ends: list[tuple[int, object, str]] = []  # (link, host it goes in, name there)
        self._link_intf: dict[tuple[str, int], str] = {}  # (dc, link index) -> interface
        port = {dc: 0 for dc in self.topo.nodes}
        relay_pairs = []
        for j, link in enumerate(self.topo.links):
            ia, ib = (f"{HOST_PREFIX}{self.index[dc]}-eth{port[dc]}" for dc in (link.a, link.b))
            port[link.a] += 1
            port[link.b] += 1
            ends = [dc for dc in (link.a, link.b) if dc in local]
            if not ends:
                continue
            ha, hb = self.hosts.get(link.a), self.hosts.get(link.b)
            if len(ends) == 2 and j not in relayed:
                net.addLink(ha, hb, intfName1=ia, intfName2=ib)
            elif len(ends) == 2:
                net.addLink(ha, wan, intfName1=ia, intfName2=f"r{j}a")
                net.addLink(wan, hb, intfName1=f"r{j}b", intfName2=ib)
                relay_pairs.append((j, f"r{j}a", f"r{j}b"))
            elif j in relayed:  # the datacenter's veth to the relay; the tunnel is the relay's far side
                if ha is not None:
                    net.addLink(ha, wan, intfName1=ia, intfName2=f"r{j}a")
                    self._tunnel_ends.append((j, wan, f"r{j}b"))
                else:
                    net.addLink(wan, hb, intfName1=f"r{j}b", intfName2=ib)
                    self._tunnel_ends.append((j, wan, f"r{j}a"))
                relay_pairs.append((j, f"r{j}a", f"r{j}b"))
            else:  # the tunnel is the datacenter's own interface
                self._tunnel_ends.append((j, ha or hb, ia if ha is not None else ib))
            m = link_methods[j]
            for dc, intf, other, spec in ((link.a, ia, link.b, link.ab), (link.b, ib, link.a, link.ba)):
                if dc in local:
                    self._link_intf[(dc, j)] = intf
                    self.directions[(dc, other)] = Direction(dc, other, j, intf, spec, m)
        return wan, relay_pairs

    def _make_tunnels(self) -> None:
        """Each cut link's VXLAN device: made here, on the underlay, then moved (and renamed)
        into the namespace it serves; the kernel keeps its UDP socket on the underlay.  GRO
        off, as on every local link's veth: a receiver behind a tunnel otherwise gets its
        segments coalesced, acknowledges fewer, larger packets, and flows sharing a cut link
        split it differently from flows sharing a local one."""
        for j, host, name in self._tunnel_ends:
            t = self.share.tunnels[j]
            dev = tunnel_name(j)
            for argv in (["ip", "link", "add", dev, "type", "vxlan", "id", str(t.vni), "local", t.local,
                          "remote", t.remote, "dstport", str(self.share.port), "nolearning"],
                         ["ip", "link", "set", dev, "mtu", str(self.share.mtu)],
                         ["ethtool", "-K", dev, "gro", "off"],
                         ["ip", "link", "set", dev, "netns", str(host.pid), "name", name]):
                res = subprocess.run(argv, capture_output=True, text=True)
                if res.returncode != 0:
                    subprocess.run(["ip", "link", "del", dev], capture_output=True)
                    _check(res, f"tunnel of link {j} ({' '.join(argv[:5])})")

    def stop(self) -> None:
        """Tear everything down; safe to call twice and on a half-built network."""
        self.stop_processes(grace_s=0)
        for r in self.relays:
            try:
                self.relay_final_stats.append(r.stop())
            except Exception as e:  # teardown must go on
                self.log(f"relay stop: {e}")
        self.relays = []
        if self.net is not None:
            try:
                self.net.stop()
            finally:
                self.net = None
        if self._owns_bridge:  # a half-built network may have left the bridge
            subprocess.run(["ip", "link", "del", CONTROL_BRIDGE], capture_output=True)
            self._owns_bridge = False

    # -- configuration -------------------------------------------------------
    def _allow_tcp_cc(self) -> None:
        """A network namespace may only pick a congestion control that the machine lists in
        net.ipv4.tcp_allowed_congestion_control: add ``tcp_cc`` there if it is missing
        (this only permits it; the machine's own default is unchanged)."""
        proc = Path("/proc/sys/net/ipv4")
        available = (proc / "tcp_available_congestion_control").read_text().split()
        if self.tcp_cc not in available and shutil.which("modprobe"):  # e.g. Debian's kernel: bbr is a module
            subprocess.run(["modprobe", f"tcp_{self.tcp_cc}"], capture_output=True, timeout=30)
            available = (proc / "tcp_available_congestion_control").read_text().split()
        if self.tcp_cc not in available:
            raise RunError(f"TCP congestion control {self.tcp_cc!r} is not available in this kernel "
                           f"(available: {', '.join(available)})")
        allowed = (proc / "tcp_allowed_congestion_control").read_text().split()
        if self.tcp_cc not in allowed:
            self.log(f"allowing TCP congestion control {self.tcp_cc} in namespaces "
                     "(net.ipv4.tcp_allowed_congestion_control)")
            (proc / "tcp_allowed_congestion_control").write_text(" ".join([*allowed, self.tcp_cc]))

    def _configure_hosts(self) -> None:
        if self.frame_ms and not all(shaping.METHODS[d.method].sized_frames for d in self.directions.values()):
            self.log("TCP frames keep the kernel's sizing: netem's queue limit counts packets "
                     "(emulator.frame_ms applies to the relay's byte queues)")
            self.frame_ms = 0.0
        self._size_frames()  # before the sysctls: TCP may fill frames up to the cap only once there is one
        # socket buffers: 4x the largest bandwidth x round-trip product, so one flow can fill any link
        bdp = max((d.spec.rate_mbps * 1e6 / 8 * (d.spec.delay_ms + self.topo.linkdir(d.dst, d.src).delay_ms
                                                  + 6 * d.spec.jitter_ms) / 1e3
                   for d in self.directions.values()), default=0)
        buf = int(max(16 << 20, 4 * bdp))
        paths = shortest_paths(self.topo.graph())  # static: computed once on the full topology
        for dc, h in self.hosts.items():
            i = self.index[dc]
            sysctls = {"net.ipv4.ip_forward": 1, "net.ipv4.conf.all.rp_filter": 0,
                       "net.ipv4.conf.default.rp_filter": 0,
                       "net.ipv4.tcp_rmem": f"4096 131072 {buf}", "net.ipv4.tcp_wmem": f"4096 65536 {buf}",
                       "net.ipv4.tcp_no_metrics_save": 1,
                       # long-lived agent connections idle between chunks and iterations; WAN
                       # deployments keep their window instead of restarting slow start
                       "net.ipv4.tcp_slow_start_after_idle": 0,
                       # explicit, never the machine's default (BBR's ProbeRTT alone costs ~3-10 %
                       # of a long link's rate every 10 s; cubic is Linux's default elsewhere)
                       "net.ipv4.tcp_congestion_control": self.tcp_cc}
            if self.frame_ms and TSO_RTT_LOG_PATH.exists():
                # TCP adds the device's gso_max_size to a frame's ~1 ms of pacing for a flow whose
                # minimum RTT is under 2^log us: with 2^24 us (16.8 s), every flow's frames grow
                # to the direction's cap (shaping.frame_commands)
                sysctls["net.ipv4.tcp_tso_rtt_log"] = 24
            _exec(h, ["sysctl", "-q", "-w", *(f"{k}={v}" for k, v in sysctls.items())])
            self.host_sysctls = sysctls
            cmds = ["link set lo up", f"addr add {node_ip(i)}/32 dev lo",
                    f"addr add {control_ip(i)}/16 dev {h.name}-ctl", f"link set {h.name}-ctl up"]
            for (owner, j), intf in self._link_intf.items():
                if owner == dc:
                    end = 0 if self.topo.links[j].a == dc else 1
                    cmds += [f"addr add {link_ip(j, end)}/24 dev {intf}", f"link set {intf} up{self._mtu_arg()}"]
                    _exec(h, ["sysctl", "-q", "-w", f"net.ipv4.conf.{intf}.rp_filter=0"])
            _batch(h, "ip", cmds + self._route_lines(dc, paths))
        tc_lines: dict[str, list[str]] = {}
        for d in self.directions.values():
            cmds = shaping.shape_commands(d.intf, d.spec, d.method, self.icmp_priority)
            tc_lines.setdefault(d.src, []).extend(" ".join(c[1:]) for c in cmds)
        for dc, lines in tc_lines.items():
            _batch(self.hosts[dc], "tc", lines)
        self._cap_gso()

    def _size_frames(self) -> None:
        """Every direction's sender hands its qdisc frames of at most ``frame_ms`` of the link's
        rate (:func:`.shaping.frame_commands`).  A kernel that cannot change a live device's
        ``gso_max_size`` keeps its own sizing, with a warning (``frame_ms`` is then 0)."""
        ip_lines: dict[str, list[str]] = {}
        for d in self.directions.values():
            cmds = shaping.frame_commands(d.intf, d.spec.rate_mbps, self.frame_ms)
            ip_lines.setdefault(d.src, []).extend(" ".join(c[1:]) for c in cmds)
            d.frame_bytes = shaping.frame_bytes(d.spec.rate_mbps, self.frame_ms) if cmds else None
        try:
            for dc, lines in ip_lines.items():
                if lines:
                    _batch(self.hosts[dc], "ip", lines)
        except RunError as e:
            self.log(f"warning: this kernel cannot size a device's TCP frames (gso_max_size): {e}; "
                     "frames keep the kernel's own sizing (emulator.frame_ms 0)")
            self.frame_ms = 0.0
            for d in self.directions.values():
                d.frame_bytes = None

    def _cap_gso(self) -> None:
        """netem drops whole packets, and TCP hands the qdisc TSO frames of ~1 ms of its pacing
        rate (GSO is always on for TCP, whatever ethtool says): on a lossy link each loss took
        ~3 segments at once at 40 Mbit/s (Debian guest), a burst where the link has independent
        losses.  A lossy netem direction's sender is capped to one segment per packet
        (``gso_max_segs 1``: 1.0 segment lost per drop), as the relay drops segments one by one.
        A kernel that cannot change it on a live device (older ones; Debian 12's 6.1 can) is
        warned about, and each direction records it (``segment_loss``)."""
        lossy: dict[str, list[Direction]] = {}
        for d in self.directions.values():
            if d.method == "netem" and d.spec.loss:
                lossy.setdefault(d.src, []).append(d)
        for dc, dirs in lossy.items():  # one ip process per host; a kernel that cannot, cannot on any
            try:
                _batch(self.hosts[dc], "ip", [f"link set dev {d.intf} gso_max_segs 1" for d in dirs])
                capped = True
            except RunError:
                capped = False
            for d in dirs:
                d.segment_loss = capped
        if any(not d.segment_loss for dirs in lossy.values() for d in dirs):
            self.log("warning: this kernel cannot cap a device's GSO segments (gso_max_segs): netem drops a "
                     "lossy link's TSO frames whole, several segments at once (links' segment_loss: false)")

    def _start_relays(self, wan, pairs) -> None:
        """One relay process per group of links (groups balanced by rate, one per core)."""
        from testbed.emulator import relay as relay_mod

        _exec(wan, ["sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1", "net.ipv4.ip_forward=0"])
        links = []
        for j, ra, rb in pairs:
            for intf in (ra, rb):
                _exec(wan, ["ip", "link", "set", intf, "up", *self._mtu_arg().split()])
            link = self.topo.links[j]
            t = self.share.tunnels.get(j) if self.share else None
            under = t.underlay_delay_ms if t else 0.0  # a tunnel's own delay is part of the link's
            links.append(relay_mod.RelayLink(
                iface_ab_in=ra, iface_ba_in=rb,
                ab=relay_mod.RelayDirection(max(0.0, link.ab.delay_ms - under), link.ab.jitter_ms, link.ab.loss,
                                            link.ab.distribution),
                ba=relay_mod.RelayDirection(max(0.0, link.ba.delay_ms - under), link.ba.jitter_ms, link.ba.loss,
                                            link.ba.distribution),
                rate_mbps_max=max(link.ab.rate_mbps, link.ba.rate_mbps)))
        lay = relay_mod.layout(links, os.cpu_count() or 1, self.relay_procs, self.share.relay_cores if self.share else ())
        self.relay_layout = {k: v for k, v in lay.items() if k != "groups"}
        groups = lay["groups"]
        for k, group in enumerate(groups):
            r = relay_mod.Relay([links[i] for i in group], seed=self.seed * 1000 + k, cpu=lay["cpus"][k],
                                rtprio=lay["rtprio"])
            self.relays.append(r)
            r.start(wan.popen)
        self.log(f"user-space delay relay: {len(groups)} process(es) for {len(pairs)} links")

    def _mtu_arg(self) -> str:
        return f" mtu {self.share.mtu}" if self.share and self.share.mtu != shaping.MTU else ""

    def health(self) -> str | None:
        """Why the network cannot carry a run any more (a relay or a host's shell, which holds
        its namespace, is gone — e.g. killed from outside), or None."""
        for k, r in enumerate(self.relays):
            if not r.running:
                return f"relay: WAN delay relay process {k} exited (code {r.proc.poll() if r.proc else '?'})"
        for dc, h in self.hosts.items():
            if h.shell is None or h.shell.poll() is not None:
                return f"{dc}: the datacenter's host (network namespace) is gone"
        return None

    # -- addressing --------------------------------------------------------------
    def host(self, dc: str):
        return self.hosts[dc]

    def node_address(self, dc: str) -> str:
        return node_ip(self.index[dc])

    def control_address(self, dc: str) -> str:
        return control_ip(self.index[dc])

    def peer_address(self, src: str, dst: str) -> str:
        """Address ``src`` uses for ``dst``: the link address for a WAN neighbour (traffic on
        that link), else the node address (traffic routed over the shortest path)."""
        d = self.directions.get((src, dst))
        if d is None:
            return self.node_address(dst)
        return link_ip(d.link, 0 if self.topo.links[d.link].a == dst else 1)

    def address_map(self) -> dict[str, dict[str, str]]:
        return {s: {d: self.peer_address(s, d) for d in self.topo.nodes if d != s} for s in self.topo.nodes}

    # -- processes ---------------------------------------------------------------
    control_gateway = CONTROL_IP  # the control network's address here: where agents reach the coordinator

    def agent_hosts(self):
        """The :class:`~testbed.hosts.Hosts` that runs agents in this network's datacenters."""
        from testbed.emulator.hosts import EmulatedHosts

        return EmulatedHosts(self)

    def popen(self, dc: str, argv: list[str], **kw) -> subprocess.Popen:
        """Start ``argv`` inside datacenter ``dc``; killed (whole process group) at stop()."""
        kw.setdefault("stdout", subprocess.DEVNULL)
        kw.setdefault("stderr", subprocess.DEVNULL)
        p = self.hosts[dc].popen(argv, **kw)
        self._procs.append((dc, p))
        return p

    def stop_processes(self, grace_s: float = 5.0) -> None:
        """Wait up to ``grace_s`` for processes started with :meth:`popen`, then kill them."""
        deadline = time.monotonic() + grace_s
        for _, p in self._procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            self._reap(p)
        self._procs.clear()

    def _reap(self, p) -> None:
        """End ``p`` if it still runs (its whole process group)."""
        _kill(p)

    # -- live changes (dynamics and faults) --------------------------------------
    def _event(self, kind: str, **info) -> None:
        self.events.append({"t_s": round(time.time() - self.t0, 4), "event": kind, **info})

    def set_rate(self, src: str, dst: str, rate_mbps: float) -> None:
        d = self._direction(src, dst)
        _batch(self.hosts[src], "tc", [" ".join(c[1:]) for c in
                                       shaping.rate_change_commands(d.intf, rate_mbps, self.icmp_priority)])
        for cmd in shaping.frame_commands(d.intf, rate_mbps, self.frame_ms):
            _exec(self.hosts[src], cmd)
            d.frame_bytes = shaping.frame_bytes(rate_mbps, self.frame_ms)
        d.spec = replace(d.spec, rate_mbps=rate_mbps)
        self._event("rate", src=src, dst=dst, rate_mbps=rate_mbps)

    def set_link(self, a: str, b: str, up: bool) -> None:
        for src, dst in ((a, b), (b, a)):
            if self.share and src not in self.share.nodes:
                continue  # its server sets that direction
            d = self._direction(src, dst)
            _exec(self.hosts[src], ["ip", "link", "set", d.intf, "up" if up else "down"])
            d.up = up
        if up:  # routes through the link were flushed when it went down
            self._restore_routes()
        self._event("link_up" if up else "link_down", a=a, b=b)

    def set_host(self, dc: str, up: bool) -> None:
        """Crash (kill every process started in ``dc`` and cut its links) or restart it."""
        if not up:
            for owner, p in self._procs:
                if owner == dc:
                    _kill(p)
        for (src, dst) in list(self.directions):
            if src == dc:
                self.set_link(src, dst, up)
        self._event("host_up" if up else "host_crash", dc=dc)

    def _route_lines(self, dc: str, paths: dict) -> list[str]:
        """``ip`` batch lines: a /32 route to every other node address, next hop = first hop
        of the latency-shortest path, source = our node address (routable everywhere)."""
        lines = []
        for dst in self.topo.nodes:
            path = paths.get((dc, dst))
            if dst == dc or path is None:
                continue
            d = self.directions[(dc, path[1])]
            nh_end = 0 if self.topo.links[d.link].a == path[1] else 1
            lines.append(f"route replace {node_ip(self.index[dst])}/32 via {link_ip(d.link, nh_end)} "
                         f"dev {d.intf} src {node_ip(self.index[dc])}")
        return lines

    def _restore_routes(self) -> None:
        """Re-install routes after a link came back (the kernel drops them on link down);
        routes over links that are still down fail and are skipped (-force)."""
        paths = shortest_paths(self.topo.graph())
        tables = self._path_tables
        for dc, h in self.hosts.items():
            _batch(h, "ip", self._route_lines(dc, paths) + [self._path_table_line(d, j) for d, j in sorted(tables)
                                                             if d == dc], force=True)

    def install_paths(self, paths) -> dict[tuple[str, ...], str]:
        """Carry every connection bound to a path's source address on that path (module
        doc): ``paths`` are node sequences (``Op.path``) of consecutive WAN neighbours.  Paths
        of one hop need nothing (a neighbour is reached over its link); for each longer one
        this adds its source address on its first node, and on each node of it the rules
        and the tables (one per link: ``default via`` the neighbour) that forward it.
        Returns {path: source address} of every path installed so far; a path that is no
        chain of links raises RunError naming it."""
        lines: dict[str, list[str]] = {}
        tables: set[tuple[str, int]] = set()
        for path in dict.fromkeys(tuple(p) for p in paths):
            if len(path) < 3 or path in self.path_sources:
                continue
            hops = list(zip(path, path[1:]))
            bad = [f"{a}->{b}" for a, b in hops if (a, b) not in self.directions]
            if bad or len(set(path)) < len(path):
                raise RunError(f"path {'>'.join(path)} is not a chain of distinct WAN links ({', '.join(bad) or 'a loop'})")
            addr = self.path_sources[path] = path_ip(len(self.path_sources))
            lines.setdefault(path[0], []).append(f"addr add {addr}/32 dev lo")
            for k, (a, b) in enumerate(hops):
                j = self.directions[(a, b)].link
                lines.setdefault(a, []).append(f"rule add from {addr} lookup {PATH_TABLE_BASE + j} "
                                               f"priority {PATH_RULE_PRIORITY}")
                lines.setdefault(b, []).append(f"rule add to {addr} lookup {PATH_TABLE_BASE + j} "
                                               f"priority {PATH_RULE_PRIORITY}")
                tables.update({(a, j), (b, j)})
        for dc, j in sorted(tables):
            lines.setdefault(dc, []).insert(0, self._path_table_line(dc, j))
        for dc, ls in lines.items():
            _batch(self.hosts[dc], "ip", ls)
        self._path_tables |= tables
        return dict(self.path_sources)

    def _path_table_line(self, dc: str, j: int) -> str:
        """``ip`` batch line: table PATH_TABLE_BASE + j of ``dc`` sends everything over link j."""
        link = self.topo.links[j]
        other = link.b if link.a == dc else link.a
        return (f"route replace default via {link_ip(j, 0 if link.a == other else 1)} "
                f"dev {self._link_intf[(dc, j)]} table {PATH_TABLE_BASE + j}")

    def _direction(self, src: str, dst: str) -> Direction:
        try:
            return self.directions[(src, dst)]
        except KeyError:
            raise RunError(f"no WAN link {src} -> {dst}") from None

    # -- reporting -----------------------------------------------------------------
    def link_report(self) -> list[dict]:
        return [d.report() for d in self.directions.values()]

    def relay_stats(self) -> list[dict]:
        return [r.stats() for r in self.relays]

    def reset_relay_window(self) -> None:
        """Judge the relays' keep-up statistics from now on (e.g. from the measured phase)."""
        for r in self.relays:
            r.reset_window()


def _check(res: subprocess.CompletedProcess, what: str) -> None:
    if res.returncode != 0:
        raise RunError(f"{what} failed: {(res.stderr or res.stdout).strip()}")


def _exec(node, argv: list[str]) -> str:
    out, err, rc = node.pexec(argv)
    if rc != 0:
        raise RunError(f"{node.name}: '{' '.join(argv)}' failed: {(err or out).strip()}")
    return out


def _batch(node, tool: str, lines: list[str], force: bool = False) -> None:
    """Run many ``ip``/``tc`` commands in ``node`` with one process (``-batch -``);
    ``force`` goes on past failing lines (and does not raise)."""
    if not lines:
        return
    res = subprocess.run(["mnexec", "-a", str(node.pid), tool, *(["-force"] if force else []), "-batch", "-"],
                         input="\n".join(lines) + "\n", capture_output=True, text=True)
    if res.returncode != 0 and not force:
        raise RunError(f"{node.name}: {tool} -batch failed: {(res.stderr or res.stdout).strip()}")


def _kill(p: subprocess.Popen) -> None:
    """Kill a process started with ``mnexec -d`` (own session) and its whole group."""
    if p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        p.wait(timeout=3)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(timeout=3)
