"""Tests of the user-space WAN relay (testbed/emulator/relay).

The network tests build a real lab with ``ip netns``:

    ns A: <A> 10.250.0.1 <-veth-> <P> [ns R: relay] <Q> <-veth-> <B> 10.250.0.2 :ns B

send real traffic (ping, iperf3) through ``tbrelay`` and check delay, loss,
throughput and the relay's counters.  Everything is removed even on failure.
They need root; they are marked ``net``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import time

import pytest
from fidelity import fidelity

from testbed.emulator import DEFAULT_TCP_CC, jitter
from testbed.emulator import relay as relay_mod
from testbed.emulator.relay import Relay, RelayDirection, RelayLink, build, kept_up, partition_links
from testbed.errors import ConfigError, RunError
from testbed.results import CpuMeter

IS_ROOT = os.geteuid() == 0
TOOLS = [t for t in ("ip", "tc", "ping", "iperf3", "ethtool", "gcc") if shutil.which(t) is None]

needs_net = [
    pytest.mark.net,
    pytest.mark.skipif(not IS_ROOT, reason="needs root: creates network namespaces and veths"),
    pytest.mark.skipif(bool(TOOLS), reason=f"missing tools: {', '.join(TOOLS)}"),
]

IP_A, IP_B = "10.250.0.1", "10.250.0.2"


def net(test):
    """Mark a test that needs the namespace lab."""
    for mark in needs_net:
        test = mark(test)
    return test


# ------------------------------------------------------------ pure python


def test_directions_are_validated():
    with pytest.raises(ConfigError):
        RelayDirection(-1)
    with pytest.raises(ConfigError):
        RelayDirection(10, loss=1.5)
    with pytest.raises(ConfigError):
        RelayDirection(10, jitter_ms=float("nan"))
    with pytest.raises(ConfigError):
        RelayLink("p", "p", RelayDirection(1), RelayDirection(1), 10)
    with pytest.raises(ConfigError):
        RelayLink("a-much-too-long-name", "q", RelayDirection(1), RelayDirection(1), 10)
    with pytest.raises(ConfigError):
        Relay([RelayLink("p", "q", RelayDirection(1), RelayDirection(1), 10),
               RelayLink("q", "r", RelayDirection(1), RelayDirection(1), 10)])


def test_config_text_and_partition():
    links = [RelayLink(f"p{i}", f"q{i}", RelayDirection(30, 1, 0.01), RelayDirection(20), r)
             for i, r in enumerate([155, 20, 100, 50])]
    text = Relay(links, seed=7, cpu=1).config_text()
    assert "seed 7" in text and "cpu 1" in text
    # netem's MU and SIGMA for a mean of 30 ms and a standard deviation of 1 ms (testbed.emulator.jitter), table 1
    mu, sigma = jitter.netem_params(30, 1, "normal")
    assert f"link p0 q0 {mu * 1e3:.3f} {sigma * 1e3:.3f} 0.010000000 1 20000.000 0.000 0.000000000 0 155.000" in text
    assert f"table 1 {jitter.table_path('normal')}" in text
    groups = partition_links(links, 2)
    assert sorted(i for g in groups for i in g) == [0, 1, 2, 3]
    assert groups == [[0], [1, 2, 3]]  # largest first: 155 | 100+50+20


def test_layout_one_relay_per_core_recorded():
    links = [RelayLink(f"p{i}", f"q{i}", RelayDirection(30), RelayDirection(30), r)
             for i, r in enumerate([155, 20, 100, 50])]
    lay = relay_mod.layout(links, cpus=2)
    assert lay["processes"] == 2 and lay["cpus"] == [0, 1] and lay["rtprio"] == relay_mod.RTPRIO
    assert lay["groups"] == partition_links(links, 2) and lay["links"] == [1, 3]
    assert lay["rate_mbps"] == [155, 170]
    assert relay_mod.layout(links[:1], cpus=8)["processes"] == 1  # never more processes than links
    assert relay_mod.layout(links, cpus=8)["cpus"] == [0, 1, 2, 3]
    forced = relay_mod.layout(links, cpus=2, procs=3)
    assert forced["processes"] == 3 and forced["cpus"] == [0, 1, 0] and forced["rule"] == "requested"
    share = relay_mod.layout(links, cpus=2, cores=[1])  # a namespace server's part of the machine
    assert share["processes"] == 1 and share["cpus"] == [1] and "of its share" in share["rule"]
    assert relay_mod.layout(links, cpus=8, cores=[4, 5])["cpus"] == [4, 5]
    json.dumps(lay)  # goes into results.json as is


@pytest.mark.parametrize("n, cpus, want", [
    (3, 2, [[0], [1], [0]]), (2, 2, [[0], [1]]), (2, 8, [[0, 1, 2, 3], [4, 5, 6, 7]]), (3, 8, [[0, 1], [2, 3, 4], [5, 6, 7]]),
    (1, 2, [[0, 1]])])
def test_local_servers_split_the_machine_s_cores(n, cpus, want):
    """Namespace servers on one machine: every core used, no server without one, no two
    servers on a core while each can have its own."""
    from testbed.emulator.nsservers import core_share

    assert [core_share(i, n, cpus) for i in range(n)] == want


def test_kept_up_verdict():
    def d(**kw):
        base = dict(link=0, dir="ab", **{"in": "p", "out": "q"}, frames_out=10, drop_ring=0,
                    drop_queue=0, late_p99_us=120.0, late_max_us=900.0)
        return {**base, **kw}

    assert kept_up({"dirs": [d(), d(dir="ba")]}) == (True, "ok")
    ok, why = kept_up({"dirs": [d(), d(dir="ba", drop_ring=3)]})
    assert not ok and "link 0 ba" in why and "buffer was full" in why
    ok, why = kept_up({"dirs": [d(late_p99_us=1500.0)]})
    assert not ok and "p99 lateness 1.50 ms" in why
    assert kept_up({"dirs": [d(late_p99_us=1500.0)]}, max_p99_late_ms=2)[0]
    assert kept_up({"dirs": [d(drop_ring=3)]}, max_ring_drops=5)[0]


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not installed")
def test_build_is_cached_and_reports_missing_gcc(monkeypatch):
    path = build()
    assert path.exists() and os.access(path, os.X_OK)
    mtime = path.stat().st_mtime_ns
    assert build() == path and path.stat().st_mtime_ns == mtime  # not rebuilt
    monkeypatch.setattr(relay_mod.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="gcc"):
        build(force=True)


# ------------------------------------------------------------------- lab


def sh(*argv: str, ns: str | None = None, check: bool = True, timeout: float = 60) -> str:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(argv)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed: {p.stderr.strip() or p.stdout.strip()}")
    return p.stdout


class Lab:
    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.ns_a, self.ns_b, self.ns_r = (f"tbrt{tag}{c}" for c in "abr")
        self.if_a, self.if_p, self.if_q, self.if_b = (f"rt{c}{tag}" for c in "APQB")
        self.procs: list[subprocess.Popen] = []
        self.relays: list[Relay] = []
        self.created: list[str] = []

    def up(self) -> None:
        for ns in (self.ns_a, self.ns_b, self.ns_r):
            sh("ip", "netns", "add", ns)
            self.created.append(ns)
            sh("ip", "link", "set", "lo", "up", ns=ns)
            sh("sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
               "net.ipv6.conf.default.disable_ipv6=1", ns=ns)
        for host_ns, host_if, relay_if in ((self.ns_a, self.if_a, self.if_p),
                                           (self.ns_b, self.if_b, self.if_q)):
            sh("ip", "link", "add", "name", host_if, "type", "veth", "peer", "name", relay_if)
            sh("ip", "link", "set", host_if, "netns", host_ns)
            sh("ip", "link", "set", relay_if, "netns", self.ns_r)
            sh("ip", "link", "set", host_if, "up", ns=host_ns)
            sh("ip", "link", "set", relay_if, "up", ns=self.ns_r)
            buf = 16 << 20  # >= 4 x BDP of 100 Mbit/s x 60 ms
            sh("sysctl", "-qw", f"net.ipv4.tcp_rmem=4096 131072 {buf}",
               f"net.ipv4.tcp_wmem=4096 65536 {buf}",  # and never the machine's default CC
               f"net.ipv4.tcp_congestion_control={DEFAULT_TCP_CC}", ns=host_ns)
        sh("ip", "addr", "add", f"{IP_A}/24", "dev", self.if_a, ns=self.ns_a)
        sh("ip", "addr", "add", f"{IP_B}/24", "dev", self.if_b, ns=self.ns_b)
        self.static_neighbours()

    def static_neighbours(self) -> None:
        """No ARP frames, so the frame sequence (and the seeded loss pattern) only depends
        on the test traffic (again after a link was set down: that flushes them)."""
        mac = {ns: re.search(r"link/ether (\S+)", sh("ip", "link", "show", dev, ns=ns)).group(1)
               for ns, dev in ((self.ns_a, self.if_a), (self.ns_b, self.if_b))}
        sh("ip", "neigh", "replace", IP_B, "lladdr", mac[self.ns_b], "dev", self.if_a,
           "nud", "permanent", ns=self.ns_a)
        sh("ip", "neigh", "replace", IP_A, "lladdr", mac[self.ns_a], "dev", self.if_b,
           "nud", "permanent", ns=self.ns_b)

    def popen(self, ns: str):
        def popen(argv, **kw):
            p = subprocess.Popen(["ip", "netns", "exec", ns, *argv], **kw)
            self.procs.append(p)
            return p
        return popen

    def relay(self, ab: RelayDirection, ba: RelayDirection, rate: float = 100, **kw) -> Relay:
        r = Relay([RelayLink(self.if_p, self.if_q, ab, ba, rate)], **kw)
        self.relays.append(r)
        return r.start(self.popen(self.ns_r))

    def ping(self, count: int, interval: float, size: int = 56, deadline: float | None = None):
        """(sent, received, (min, median, max, mdev) RTT in ms or None).  The median, not
        the mean: one reply held up by the hypervisor (this VM has steal time) must not
        decide a test about the relay."""
        argv = ["ping", "-n", "-c", str(count), "-i", str(interval), "-s", str(size)]
        if deadline:
            argv += ["-w", str(deadline)]
        out = sh(*argv, IP_B, ns=self.ns_a, check=False)
        m = re.search(r"(\d+) packets transmitted, (\d+) received", out)
        rtt = re.search(r"= ([\d.]+)/([\d.]+)/([\d.]+)/([\d.]+) ms", out)
        times = [float(t) for t in re.findall(r"time=([\d.]+) ms", out)]
        if not rtt or not times:
            return int(m.group(1)), int(m.group(2)), None
        rmin, _, rmax, mdev = (float(x) for x in rtt.groups())
        return int(m.group(1)), int(m.group(2)), (rmin, statistics.median(times), rmax, mdev)

    def close(self) -> None:
        for r in self.relays:
            r.close()
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for ns in self.created:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture(scope="module")
def lab():
    lab = Lab()
    try:
        lab.up()
        yield lab
    finally:
        lab.close()


@pytest.fixture
def clean_lab(lab):
    """The lab, with relays/processes started by the test stopped afterwards
    and the hosts' qdiscs/offloads restored."""
    yield lab
    for r in lab.relays:
        r.close()
    lab.relays.clear()
    for ns, dev in ((lab.ns_a, lab.if_a), (lab.ns_b, lab.if_b)):
        sh("tc", "qdisc", "del", "dev", dev, "root", ns=ns, check=False)
        sh("ethtool", "-K", dev, "tx", "on", "tso", "on", "gso", "on", "rx", "on", ns=ns, check=False)


def assert_counters_add_up(stats: dict) -> None:
    for d in stats["dirs"]:
        # drop_ring/drop_trunc frames never entered the relay's queue
        dropped = d["drop_queue"] + d["drop_tx"] + d["drop_down"]
        assert d["frames_in"] == d["frames_out"] + d["lost_frames"] + d["backlog"] + dropped, d
        if not d["backlog"] and not dropped:
            assert d["segs_in"] == d["segs_out"] + d["lost_segs"], d
        assert d["bytes_out"] <= d["bytes_in"], d
        if not d["gso_frames"]:
            assert d["lost_segs"] == d["lost_frames"], d


# ------------------------------------------------------------- net tests


@net
@pytest.mark.parametrize("delay_ms", [10, 30])
def test_ping_rtt_is_twice_the_delay(clean_lab, delay_ms):
    """No frame leaves early and none is lost, every time; the median round trip and the
    relay's lateness are timing fidelity, measured as :func:`fidelity` says (a busy machine
    delays a user-space relay)."""
    want = 2 * delay_ms

    def measure():
        cpu = CpuMeter().start()
        r = clean_lab.relay(RelayDirection(delay_ms), RelayDirection(delay_ms), seed=1)
        sent, recv, rtt = clean_lab.ping(100, 0.01)
        st = r.stop()
        assert recv == sent == 100
        assert rtt[0] >= want - 0.05, f"frames left early: min rtt {rtt[0]} < {want}"
        assert st["event"] == "exit" and r.proc.returncode == 0
        assert_counters_add_up(st)
        ab, ba = st["dirs"]
        assert ab["frames_out"] >= 100 and ba["frames_out"] >= 100
        assert ab["lost_segs"] == ba["lost_segs"] == 0 and ab["drop_ring"] == 0
        assert ab["delay_us"] == delay_ms * 1000
        return (rtt, st), cpu.stop()[1]

    def problems(result):
        rtt, st = result
        ok, why = kept_up(st, max_p99_late_ms=5)
        return ([] if abs(rtt[1] - want) <= max(1.0, 0.03 * want) else [f"median rtt {rtt[1]} for {want}"]) + (
            [] if ok else [why])

    fidelity(measure, problems)


@net
def test_start_reports_relay_errors(clean_lab):
    r = Relay([RelayLink("nosuchif0", clean_lab.if_q, RelayDirection(1), RelayDirection(1), 10)])
    clean_lab.relays.append(r)
    with pytest.raises(RunError, match="no such interface nosuchif0"):
        r.start(clean_lab.popen(clean_lab.ns_r))


@net
def test_a_relay_with_more_links_than_its_first_allocation(clean_lab):
    """The relay grows its link table as it reads its configuration (16 links, then 32, ...):
    the first link must still forward once 16 more were read (its ports moved with the table;
    equinix-like-20 and idn-like-40 failed with 'no such interface' before)."""
    lab, tag = clean_lab, os.getpid() % 100000
    idle = [f"rd{tag}x{k}" for k in range(32)]
    try:
        for k in range(16):  # idle veth pairs (this kernel has no dummy interfaces)
            sh("ip", "link", "add", idle[2 * k], "type", "veth", "peer", "name", idle[2 * k + 1], ns=lab.ns_r)
            for name in idle[2 * k:2 * k + 2]:
                sh("ip", "link", "set", name, "up", ns=lab.ns_r)
        links = [RelayLink(lab.if_p, lab.if_q, RelayDirection(5), RelayDirection(5), 100)] + [
            RelayLink(idle[2 * k], idle[2 * k + 1], RelayDirection(1), RelayDirection(1), 10) for k in range(16)]
        r = Relay(links, seed=1)
        lab.relays.append(r)
        r.start(lab.popen(lab.ns_r))
        sent, recv, rtt = lab.ping(20, 0.02)
        assert recv == sent == 20 and abs(rtt[1] - 10) <= 1.0, rtt
        assert len(r.stop()["dirs"]) == 34
    finally:
        for name in idle[::2]:
            sh("ip", "link", "del", name, ns=lab.ns_r, check=False)


@net
def test_loss_rate_and_reproducibility(clean_lab):
    """loss=0.1 on A->B: ~10 % of 300 pings lost; same seed => same losses."""
    patterns = []
    for _ in range(2):
        r = clean_lab.relay(RelayDirection(2, loss=0.1), RelayDirection(2), seed=42)
        sent, recv, _ = clean_lab.ping(300, 0.01)
        st = r.stop()
        assert_counters_add_up(st)
        ab = st["dirs"][0]
        assert 0.04 <= 1 - recv / sent <= 0.18, (sent, recv)
        assert ab["lost_frames"] == ab["frames_in"] - ab["frames_out"] - ab["backlog"]
        assert ab["lost_frames"] == sent - recv  # the only frames A sends are the pings
        patterns.append(ab["lost_frames"])
    assert patterns[0] == patterns[1]


@net
def test_jitter_keeps_fifo_order(clean_lab):
    r = clean_lab.relay(RelayDirection(20, jitter_ms=4), RelayDirection(20), seed=3)
    sent, recv, rtt = clean_lab.ping(100, 0.01)
    st = r.stop()
    assert recv == sent
    rmin, _, rmax, mdev = rtt
    assert mdev > 1.0, rtt  # jitter is there
    lo, hi = jitter.range_ms(20, 4)
    assert rmin >= 20 + lo - 0.05 and rmax <= 20 + hi + 3, rtt  # netem's normal table spans -4.0..+3.5 sigma
    assert st["dirs"][0]["jitter_us"] == pytest.approx(1e3 * jitter.netem_params(20, 4, "normal")[1], abs=0.001)
    assert st["dirs"][0]["table"] == 1


@net
def test_frames_due_while_the_link_is_down_are_lost_not_delivered_late(clean_lab):
    """A host's end of a link set down (a fault) takes the carrier of the relay's end with
    it: the frames in flight and those due meanwhile are lost, as on a cut link -- not kept
    and delivered when it is back (they were: ~half a second late here, and the relay
    retried them every 20 us for the whole outage)."""
    lab = clean_lab
    r = lab.relay(RelayDirection(100), RelayDirection(100), seed=1)
    ping = lab.popen(lab.ns_a)(["ping", "-n", "-q", "-c", "150", "-i", "0.01", IP_B], stdout=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        sh("ip", "link", "set", lab.if_b, "down", ns=lab.ns_b)
        time.sleep(0.5)
    finally:
        sh("ip", "link", "set", lab.if_b, "up", ns=lab.ns_b)
        lab.static_neighbours()
    ping.wait(10)
    st = r.stop()
    assert_counters_add_up(st)
    ab = st["dirs"][0]
    # retried every 20 us through the 0.5 s outage would be ~25000; a few hundred can come as the
    # link comes back, most likely before the kernel has put its queue back (some hundreds under
    # a loaded machine) -- frames due on a live link, late by that much, which the next line bounds
    assert ab["drop_down"] > 10 and ab["tx_retry"] < 2500, ab
    assert ab["late_max_us"] < 50_000, ab


@net
def test_reorder_mode_lets_jitter_reorder(clean_lab):
    r = clean_lab.relay(RelayDirection(20, jitter_ms=4), RelayDirection(20), seed=3, reorder=True)
    sent, recv, rtt = clean_lab.ping(100, 0.005)
    st = r.stop()
    assert st["reorder"] == 1 and recv == sent
    rmin, _, rmax, mdev = rtt
    assert mdev > 1.0 and rmin >= 40 - 12 - 0.05 and rmax <= 40 + 12 + 3, rtt


@net
def test_update_changes_delay_at_runtime(clean_lab):
    r = clean_lab.relay(RelayDirection(5), RelayDirection(5), seed=1)
    _, _, rtt1 = clean_lab.ping(9, 0.03)
    r.update(0, "ab", delay_ms=25)
    time.sleep(0.05)
    _, _, rtt2 = clean_lab.ping(9, 0.03)
    st = r.stats()
    assert abs(rtt1[1] - 10) < 1 and abs(rtt2[1] - 30) < 1, (rtt1, rtt2)
    assert st["event"] == "stats" and st["dirs"][0]["delay_us"] == 25000
    assert r.links[0].ab.delay_ms == 25


def _iperf(lab, seconds: int, omit: int = 2) -> float:
    srv = lab.popen(lab.ns_b)(["iperf3", "-s", "-1", "-p", "5299"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.3)
    out = sh("iperf3", "-c", IP_B, "-p", "5299", "-t", str(seconds), "-O", str(omit), "-J",
             ns=lab.ns_a, timeout=seconds + omit + 30)
    srv.wait(timeout=10)
    return json.loads(out)["end"]["sum_received"]["bits_per_second"] / 1e6


def _htb(lab, rate_mbit: int) -> None:
    sh("tc", "qdisc", "add", "dev", lab.if_a, "root", "handle", "1:", "htb", "default", "1", ns=lab.ns_a)
    sh("tc", "class", "add", "dev", lab.if_a, "parent", "1:", "classid", "1:1", "htb",
       "rate", f"{rate_mbit}mbit", "ceil", f"{rate_mbit}mbit", ns=lab.ns_a)


@net
def test_iperf_through_relay_reaches_htb_rate(clean_lab):
    """HTB 100 Mbit/s at A, 30 ms each way, MTU frames (offloads off): TCP gets >= 90 %
    of the rate (headers cost 3.5 %).  The sender runs BBR: this checks the relay's
    capacity, not cubic's recovery from its slow-start overshoot, which at 60 ms RTT
    outlasts the measurement (78-95 % seen here)."""
    lab = clean_lab
    for ns, dev in ((lab.ns_a, lab.if_a), (lab.ns_b, lab.if_b)):
        sh("ethtool", "-K", dev, "tx", "off", "tso", "off", "gso", "off", ns=ns)
    sh("sysctl", "-qw", "net.ipv4.tcp_congestion_control=bbr", ns=lab.ns_a)
    _htb(lab, 100)
    r = lab.relay(RelayDirection(30), RelayDirection(30), rate=100, seed=1)

    def measure():
        cpu = CpuMeter().start()
        mbps = _iperf(lab, 6)
        return mbps, cpu.stop()[1]

    mbps = fidelity(measure, lambda m: [f"{m:.1f} Mbit/s through the relay"] if m < 90 else [])
    st = r.stop()
    assert_counters_add_up(st)
    ab, ba = st["dirs"]
    assert ab["drop_ring"] == ab["drop_queue"] == ab["drop_tx"] == 0
    assert ab["gso_frames"] == 0  # offloads off: MTU frames only
    assert ab["bytes_out"] >= mbps * 1e6 / 8 * 6  # everything iperf counted crossed the relay
    assert ab["max_backlog"] > 100  # ~one BDP of frames was in flight in the relay


@net
def test_gso_frames_with_loss_are_segmented_correctly(clean_lab):
    """Offloads on: the relay forwards GSO super-frames; with loss it splits
    them in user space.  B verifies every checksum (rx offload off), so a
    wrong segment would show up as a checksum error."""
    lab = clean_lab
    sh("ethtool", "-K", lab.if_b, "rx", "off", ns=lab.ns_b)
    _htb(lab, 200)
    r = lab.relay(RelayDirection(10, loss=0.01), RelayDirection(10), rate=200, seed=5)
    nstat0 = sh("nstat", "-asz", "TcpInCsumErrors", "IpInHdrErrors", ns=lab.ns_b, check=False)
    mbps = _iperf(lab, 3, omit=1)
    st = r.stop()
    ab = st["dirs"][0]
    assert ab["gso_frames"] > 0 and ab["segs_in"] > ab["frames_in"], ab
    assert ab["gso_split"] > 0 and ab["lost_segs"] > 0, ab
    assert 0.004 < ab["lost_segs"] / ab["segs_in"] < 0.02, ab
    assert_counters_add_up(st)
    nstat = sh("nstat", "-asz", "TcpInCsumErrors", "IpInHdrErrors", ns=lab.ns_b, check=False)
    errs = sum(int(x) for x in re.findall(r"^\S+\s+(\d+)", nstat, re.M))
    if nstat0 or nstat:  # nstat is optional (iproute2); skip the check without it
        assert errs == 0, nstat
    # 1 % loss at 20 ms RTT limits cubic to ~7 Mbit/s (Mathis: 1.22 MSS / (RTT sqrt(p))); if
    # split segments were corrupt TCP would retransmit them forever and stall far below that
    assert mbps > 2, f"{mbps:.1f} Mbit/s with 1 % loss: segments were not accepted"

