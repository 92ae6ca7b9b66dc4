"""``python3 -m testbed.emulator.relay bench``: measure the WAN relay.

Builds a throw-away lab of network namespaces (no Mininet needed, must be
root): one relay namespace and, per link i, two host namespaces A_i and B_i::

    A_i: <p>A<i> <-veth-> <p>P<i>  [relay ns]  <p>Q<i> <-veth-> <p>B<i> :B_i

HTB at ``--rate`` on both hosts' egress, ``--delay`` ms one way in the relay,
then ping RTT on an idle link (vs 2 x delay) and ``--links`` x (1 or 2)
concurrent iperf3 TCP flows through the relay(s).  Prints per-flow and
aggregate throughput, relay CPU%, machine CPU%, and relay lateness.
Everything created is removed at the end, also on error or Ctrl-C.

Example (NetStorm-like load: 13 links, 26 busy directions):
    python3 -m testbed.emulator.relay bench --links 13 --rate 90 --delay 30 --procs 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

from testbed.emulator.relay import Relay, RelayDirection, RelayLink, build, kept_up, partition_links


class Lab:
    """Namespaces + veths + processes, all removed by :meth:`close`."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.namespaces: list[str] = []
        self.procs: list[subprocess.Popen] = []

    def run(self, ns: str | None, *argv: str, check: bool = True) -> str:
        cmd = (["ip", "netns", "exec", ns] if ns else []) + list(argv)
        p = subprocess.run(cmd, capture_output=True, text=True)
        if check and p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {p.stderr.strip() or p.stdout.strip()}")
        return p.stdout

    def netns(self, name: str) -> str:
        name = self.prefix + name
        self.run(None, "ip", "netns", "add", name)
        self.namespaces.append(name)
        self.run(name, "ip", "link", "set", "lo", "up")
        self.run(name, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
                 "net.ipv6.conf.default.disable_ipv6=1")
        return name

    def veth(self, ns1: str, if1: str, ns2: str, if2: str) -> None:
        # never `ip link add X type veth`: a bare name may parse as a keyword
        self.run(None, "ip", "link", "add", "name", if1, "type", "veth", "peer", "name", if2)
        self.run(None, "ip", "link", "set", if1, "netns", ns1)
        self.run(None, "ip", "link", "set", if2, "netns", ns2)
        self.run(ns1, "ip", "link", "set", if1, "up")
        self.run(ns2, "ip", "link", "set", if2, "up")

    def popen_in(self, ns: str):
        def popen(argv, **kw):
            p = subprocess.Popen(["ip", "netns", "exec", ns, *argv], **kw)
            self.procs.append(p)
            return p
        return popen

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.namespaces.clear()


def _cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine."""
    with open("/proc/stat") as f:
        v = [float(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return sum(v) - idle, sum(v)


def _children_cpu() -> float:
    """CPU seconds (user+sys) of all reaped children of this process."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _ksoftirqd_cpu() -> dict[str, float]:
    """CPU seconds used so far by each ksoftirqd thread (softirq work the
    kernel deferred because it could not run it at interrupt exit)."""
    out = {}
    tck = os.sysconf("SC_CLK_TCK")
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                st = f.read()
        except OSError:
            continue
        comm = st[st.index("(") + 1:st.rindex(")")]
        if comm.startswith("ksoftirqd/"):
            fields = st[st.rindex(")") + 2:].split()
            out[comm] = (int(fields[11]) + int(fields[12])) / tck
    return out


def _worst(stats_list: list[dict[str, Any]], key: str) -> float:
    return max((d[key] for s in stats_list for d in s["dirs"]), default=0.0)


def bench(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        print("bench needs root (network namespaces)", file=sys.stderr)
        return 2
    build()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up on kill, too
    lab = Lab(f"tbrb{os.getpid() % 10000}")
    relays: list[Relay] = []
    try:
        relay_ns = lab.netns("r")
        hosts = _hosts(lab, relay_ns, args)
        _start_relays(lab, relay_ns, hosts, args, relays)
        print(f"lab: {args.links} links, HTB {args.rate} Mbit/s, delay {args.delay} ms "
              f"(jitter {args.jitter} ms, loss {args.loss}), offloads {'on (GSO)' if args.gso else 'off'}, "
              f"{'GRO on, ' if args.gro else ''}relay {'vnet' if not args.plain else 'plain'}, {len(relays)} relay process(es), "
              f"rtprio {args.rtprio}, cc {args.cc}")
        _ping_idle(lab, hosts, args)
        if args.duration > 0:
            _load(lab, hosts, relays, args)
        finals = [r.stop() for r in relays]
        for k, f in enumerate(finals):
            ok, why = kept_up(f)
            print(f"relay {k} kept up: {ok} ({why})")
        if args.json:
            print(json.dumps(finals))
        return 0
    finally:
        for r in relays:
            r.close()
        lab.close()


def _hosts(lab: Lab, relay_ns: str, args: argparse.Namespace) -> list[tuple[str, str, str, str, str, str]]:
    """Per link a host pair a, b in their namespaces, each joined to the relay's namespace by a
    veth pair, shaped by HTB at the link rate.  Returns (a, b, a's address, b's address, the
    relay's interface towards a, towards b) per link."""
    hosts = []
    for i in range(args.links):
        a, b = lab.netns(f"a{i}"), lab.netns(f"b{i}")
        ia, ip_, iq, ib = (f"{lab.prefix}{c}{i}" for c in "APQB")
        lab.veth(a, ia, relay_ns, ip_)
        lab.veth(b, ib, relay_ns, iq)
        net = f"10.{100 + i // 250}.{i % 250}"
        lab.run(a, "ip", "addr", "add", f"{net}.1/24", "dev", ia)
        lab.run(b, "ip", "addr", "add", f"{net}.2/24", "dev", ib)
        bdp = args.rate * 1e6 / 8 * 2 * args.delay / 1e3
        buf = int(max(16 << 20, 4 * bdp))
        for ns, dev in ((a, ia), (b, ib)):
            lab.run(ns, "sysctl", "-qw", f"net.ipv4.tcp_rmem=4096 131072 {buf}",
                    f"net.ipv4.tcp_wmem=4096 65536 {buf}",
                    f"net.ipv4.tcp_congestion_control={args.cc}")
            if not args.gso:
                lab.run(ns, "ethtool", "-K", dev, "tx", "off", "tso", "off", "gso", "off")
            lab.run(ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb",
                    "default", "1")
            lab.run(ns, "tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:1",
                    "htb", "rate", f"{args.rate}mbit", "ceil", f"{args.rate}mbit")
        if args.gro:  # veth NAPI + GRO on all four ends (vnet relay only)
            for ns, dev in ((a, ia), (b, ib), (relay_ns, ip_), (relay_ns, iq)):
                lab.run(ns, "ethtool", "-K", dev, "gro", "on")
        hosts.append((a, b, f"{net}.1", f"{net}.2", ip_, iq))
    return hosts


def _start_relays(lab: Lab, relay_ns: str, hosts: list[tuple], args: argparse.Namespace, relays: list[Relay]) -> None:
    """Start ``args.procs`` relay processes over the links (appended to ``relays`` as they start)."""
    links = [RelayLink(h[4], h[5], RelayDirection(args.delay, args.jitter, args.loss),
                       RelayDirection(args.delay, args.jitter, args.loss), args.rate)
             for h in hosts]
    ncpu = os.cpu_count() or 1
    for k, group in enumerate(partition_links(links, args.procs)):
        r = Relay([links[i] for i in group], seed=k, cpu=k % ncpu if args.pin else None,
                  vnet=not args.plain, rtprio=args.rtprio)
        r.start(lab.popen_in(relay_ns))
        relays.append(r)


def _ping_idle(lab: Lab, hosts: list[tuple], args: argparse.Namespace) -> None:
    """Print the ping RTT on an idle link against the configured delay."""
    a, b, ipa, ipb = hosts[0][:4]
    lab.run(a, "ping", "-c", "3", "-i", "0.05", ipb, check=False)  # ARP warm-up
    out = lab.run(a, "ping", "-c", "50", "-i", "0.02", "-q", ipb, check=False)
    rtt = next((l.split("=")[1].split("/") for l in out.splitlines() if "rtt" in l), None)
    if rtt:
        print(f"ping idle: rtt min/avg/max {rtt[0]}/{rtt[1]}/{rtt[2]} ms, "
              f"expected {2 * args.delay:.3f} ms (+ ~0.1 ms stack), "
              f"avg excess {float(rtt[1]) - 2 * args.delay:.3f} ms")


def _load(lab: Lab, hosts: list[tuple], relays: list[Relay], args: argparse.Namespace) -> None:
    """One iperf3 flow per link (and direction, with ``bidir``) for ``args.duration`` s; print
    the throughput, then the relays' and the machine's CPU and the relays' lateness."""
    flows = _iperf3_servers(lab, hosts, args.bidir)
    time.sleep(0.5)
    before = [r.stats() for r in relays]
    c0 = _cpu_times()
    k0 = _children_cpu()
    s0 = _ksoftirqd_cpu()
    t0 = time.monotonic()
    results = _iperf3_clients(lab, flows, args)
    t1 = time.monotonic()
    c1 = _cpu_times()
    s1 = _ksoftirqd_cpu()
    for *_, srv in flows:  # iperf3 servers exit after their one test
        srv.communicate(timeout=30)
    iperf_cpu = _children_cpu() - k0  # clients and servers (all reaped by now)
    after = [r.stats() for r in relays]
    wall = t1 - t0
    _print_throughput(results, before, after, wall, args)
    _print_relay_cpu(before, after, wall)
    busy = (c1[0] - c0[0]) / (c1[1] - c0[1])
    relay_cpu = sum(r1["cpu_user_s"] + r1["cpu_sys_s"] - r0["cpu_user_s"] - r0["cpu_sys_s"]
                    for r0, r1 in zip(before, after))
    print(f"machine CPU during load: {100 * busy:.1f}% of {os.cpu_count()} cores; "
          f"this lab: relays {100 * relay_cpu / wall:.0f}% + iperf3 {100 * iperf_cpu / wall:.0f}% "
          f"of one core (the rest: softirq elsewhere, other users' processes); "
          + ", ".join(f"{k} {100 * (s1[k] - s0.get(k, 0)) / wall:.0f}%" for k in sorted(s1)))
    print(f"relay lateness over whole run: worst p50 {_worst(after, 'late_p50_us'):.0f} us, "
          f"worst p99 {_worst(after, 'late_p99_us'):.0f} us, worst p99.9 {_worst(after, 'late_p999_us'):.0f} us, "
          f"max {_worst(after, 'late_max_us'):.0f} us; "
          f"ring drops {sum(d['drop_ring'] + d['drop_queue'] for s in after for d in s['dirs'])}, "
          f"max backlog {int(_worst(after, 'max_backlog'))} frames")


def _iperf3_servers(lab: Lab, hosts: list[tuple], bidir: bool) -> list[tuple]:
    """An iperf3 server per flow (b's end of each link, and a's with ``bidir``), each for one
    test: (link, direction, server's and client's namespaces, server address, port, server)."""
    flows = []
    for i, (a, b, ipa, ipb, _, _) in enumerate(hosts):
        pairs = [(b, a, ipb, "ab")] + ([(a, b, ipa, "ba")] if bidir else [])
        for srv_ns, cli_ns, srv_ip, d in pairs:
            port = 5201
            srv = lab.popen_in(srv_ns)(["iperf3", "-s", "-1", "-p", str(port)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            flows.append((i, d, srv_ns, cli_ns, srv_ip, port, srv))
    return flows


def _iperf3_clients(lab: Lab, flows: list[tuple], args: argparse.Namespace) -> list[tuple[int, str, float]]:
    """Every flow's client started at once, then read: (link, direction, Mbit/s; NaN where
    iperf3 failed, said on stderr)."""
    clients = []
    for i, d, srv_ns, cli_ns, srv_ip, port, _ in flows:
        clients.append(lab.popen_in(cli_ns)(
            ["iperf3", "-c", srv_ip, "-p", str(port), "-t", str(args.duration),
             "-O", str(args.omit), "-J"], stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    results = []
    for (i, d, *_), c in zip(flows, clients):
        out, err = c.communicate(timeout=args.duration + args.omit + 60)
        try:
            bps = json.loads(out)["end"]["sum_received"]["bits_per_second"]
        except (ValueError, KeyError):
            bps = float("nan")
            print(f"iperf3 link {i} {d} failed: {err.decode()[-300:]}", file=sys.stderr)
        results.append((i, d, bps / 1e6))
    return results


def _print_throughput(results: list[tuple[int, str, float]], before: list[dict[str, Any]],
                      after: list[dict[str, Any]], wall: float, args: argparse.Namespace) -> None:
    """iperf3's goodput per flow (with ``verbose``) and in all, and the relays' output rate."""
    rates = [x for _, _, x in results]
    for i, d, x in results:
        if args.verbose:
            print(f"  flow link {i:2d} {d}: {x:8.2f} Mbit/s")
    agg = sum(rates)
    print(f"iperf3: {len(rates)} flows, aggregate {agg:.1f} Mbit/s "
          f"(min {min(rates):.1f}, median {statistics.median(rates):.1f}, "
          f"max {max(rates):.1f} per flow; {100 * agg / (len(rates) * args.rate):.1f}% of HTB rate)")
    wire = sum(d["bytes_out"] for s_ in after for d in s_["dirs"]) - sum(
        d["bytes_out"] for s_ in before for d in s_["dirs"])
    print(f"relay output (L2 bytes incl. headers and iperf3's omitted seconds): "
          f"{wire * 8 / wall / 1e6:.1f} Mbit/s aggregate over {wall:.1f} s "
          f"(offered HTB total {len(rates) * args.rate:.0f} Mbit/s)")


def _print_relay_cpu(before: list[dict[str, Any]], after: list[dict[str, Any]], wall: float) -> None:
    """Per relay process: its CPU, frame, segment and wakeup rates over the load, from its
    stats before and after."""
    for k, (r0, r1) in enumerate(zip(before, after)):
        cpu = (r1["cpu_user_s"] + r1["cpu_sys_s"] - r0["cpu_user_s"] - r0["cpu_sys_s"]) / (
            r1["uptime_s"] - r0["uptime_s"])
        fr = sum(d["frames_out"] for d in r1["dirs"]) - sum(d["frames_out"] for d in r0["dirs"])
        sg = sum(d["segs_out"] for d in r1["dirs"]) - sum(d["segs_out"] for d in r0["dirs"])
        print(f"relay {k}: {len(r1['dirs'])} dirs, CPU {100 * cpu:.1f}% of one core "
              f"(user {r1['cpu_user_s'] - r0['cpu_user_s']:.2f} s, sys {r1['cpu_sys_s'] - r0['cpu_sys_s']:.2f} s;"
              f" sys includes the receivers' stack run in softirq), "
              f"{fr / wall / 1e3:.1f} kframes/s, {sg / wall / 1e3:.1f} ksegments/s, "
              f"{(r1['wakeups'] - r0['wakeups']) / wall / 1e3:.1f} kwakeups/s; longest sendmmsg "
              f"{r1['send_call_max_us'] / 1e3:.1f} ms, worst timer overshoot {r1['wake_late_max_us'] / 1e3:.1f} ms")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m testbed.emulator.relay")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build", help="compile tbrelay.c").add_argument("--force", action="store_true")
    b = sub.add_parser("bench", help="measure throughput, CPU and delay accuracy through the relay")
    b.add_argument("--links", type=int, default=4, help="relayed links (default 4)")
    b.add_argument("--rate", type=float, default=90, help="HTB rate per direction, Mbit/s (default 90)")
    b.add_argument("--delay", type=float, default=30, help="one-way delay, ms (default 30)")
    b.add_argument("--jitter", type=float, default=0.0, help="jitter, ms")
    b.add_argument("--loss", type=float, default=0.0, help="loss probability")
    b.add_argument("--procs", type=int, default=1, help="relay processes (default 1)")
    b.add_argument("--duration", type=int, default=10, help="iperf3 seconds (0: ping only)")
    b.add_argument("--omit", type=int, default=2, help="iperf3 -O seconds")
    b.add_argument("--bidir", action=argparse.BooleanOptionalAction, default=True,
                   help="one flow in each direction of every link (default)")
    b.add_argument("--gso", action="store_true", help="keep TSO/GSO/csum offloads on the hosts")
    b.add_argument("--gro", action="store_true", help="enable GRO on all veth ends (vnet only)")
    b.add_argument("--plain", action="store_true", help="relay without PACKET_VNET_HDR")
    b.add_argument("--rtprio", type=int, default=10, help="relay SCHED_FIFO priority (0: off)")
    b.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                   help="pin relay k to cpu k")
    b.add_argument("--cc", default="bbr", help="TCP congestion control (default bbr)")
    b.add_argument("--json", action="store_true", help="also print the final relay stats")
    b.add_argument("-v", "--verbose", action="store_true", help="per-flow throughput")
    args = ap.parse_args(argv)
    if args.cmd == "build":
        print(build(force=args.force))
        return 0
    if args.plain and (args.gso or args.gro):
        ap.error("--plain needs offloads off (drop --gso/--gro)")
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())
