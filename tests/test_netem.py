"""Both link-shaping paths, side by side, on a real emulated link with delay, jitter and
loss: the kernel's ``htb+netem`` (where the kernel has netem: most users' machines, and
the Debian guest of ``python3 -m testbed.vm stage``) and ``htb+user-space-relay`` (where it
has not: this project's CI host).  The netem cases are skipped, saying so, on a kernel
without netem; the VM stage runs them in a guest that has it."""

import json
import re
import statistics
import subprocess
import time

import pytest
from fidelity import fidelity

from testbed.emulator.capabilities import probe
from testbed.emulator.network import WanNetwork
from testbed.emulator.shaping import METHODS
from testbed.results import CpuMeter
from testbed.topology import load_topology

pytestmark = pytest.mark.net

DELAY_MS, JITTER_MS, LOSS, PINGS = 30, 2, 0.03, 600


def _lossy_pair():
    return load_topology({"name": "lossy-pair", "datacenters": ["a", "b"],
                          "links": [{"between": ["a", "b"], "rate_mbps": 20, "delay_ms": DELAY_MS,
                                     "jitter_ms": JITTER_MS, "loss": LOSS}]})


def _skip_without(method):
    if method == "netem" and not probe().netem:
        pytest.skip("this kernel has no netem: the netem shaping path cannot be tested here "
                    "(python3 -m testbed.vm stage tests it in a Debian guest)")


@pytest.mark.parametrize("method", ["relay", "netem"])
def test_delay_jitter_and_loss_as_configured(netenv, method):
    """600 pings a->b->a at 10 ms intervals.  Round-trip loss 1-(1-p)^2 within 4 binomial
    standard deviations; median RTT 2*delay within max(1 ms, 5 %); RTT spread that of two
    independent normal jitters, sqrt(2)*jitter, within [0.6, 1.5]x (netem draws from its
    normal table, the relay truncates at 3 sigma and keeps FIFO order).  Median and
    interquartile range, not mean and standard deviation: a machine's own scheduling
    outliers (a busy host, a guest under software emulation) must not decide."""
    _skip_without(method)
    p_rt = 1 - (1 - LOSS) ** 2
    sd = (p_rt * (1 - p_rt) / PINGS) ** 0.5

    def measure():
        cpu = CpuMeter().start()
        with WanNetwork(_lossy_pair(), method=method, log=lambda m: None) as net:
            qdiscs = net.host("a").cmd("tc qdisc show")
            links = net.link_report()
            out = net.host("a").cmd(f"ping -n -c {PINGS} -i 0.01 -W 2 {net.peer_address('a', 'b')}")
        rtts = [float(x) for x in re.findall(r"time=([\d.]+)", out)]
        return (out, rtts, qdiscs, links), cpu.stop()[1]

    def problems(res):
        out, rtts, _, _ = res
        sent, recv = map(int, re.search(r"(\d+) packets transmitted, (\d+) received", out).groups())
        lost = 1 - recv / sent
        bad = []
        if abs(lost - p_rt) > 4 * sd:
            bad.append(f"round-trip loss {lost:.3f}, expected {p_rt:.3f} +- {4 * sd:.3f}")
        q1, median, q3 = statistics.quantiles(rtts, n=4)
        spread = (q3 - q1) / 1.349  # the standard deviation of a normal distribution
        if abs(median - 2 * DELAY_MS) > max(1.0, 0.05 * 2 * DELAY_MS):
            bad.append(f"median RTT {median:.2f} ms, expected {2 * DELAY_MS} ms")
        want = 2 ** 0.5 * JITTER_MS
        if not 0.6 * want <= spread <= 1.5 * want:
            bad.append(f"RTT spread (IQR/1.349) {spread:.2f} ms, expected ~{want:.2f} ms")
        return bad

    _, _, qdiscs, links = fidelity(measure, problems)
    assert {d["method"] for d in links} == {METHODS[method].label}
    assert ("qdisc netem" in qdiscs) == (method == "netem"), qdiscs


@pytest.mark.parametrize("method", ["relay", "netem"])
def test_jitter_is_the_configured_distribution_both_ways(netenv, method):
    """A link of 20 Mbit/s one way and 60 the other with 4 ms of pareto jitter (a long right
    tail): in each direction linkcheck's idle probes find the configured one-way delay
    distribution (testbed.emulator.jitter) -- median and spreads, within tolerances that follow
    the number of probes -- on either shaping path."""
    from testbed.emulator.linkcheck import _idle_probe

    _skip_without(method)
    topo = load_topology({"name": "pareto-pair", "datacenters": ["a", "b"],
                          "links": [{"between": ["a", "b"], "rate_mbps": [20, 60], "delay_ms": 20,
                                     "jitter_ms": 4, "distribution": "pareto"}]})

    def measure():
        cpu = CpuMeter().start()
        with WanNetwork(topo, method=method, log=lambda m: None) as net:
            rows = [_idle_probe(net, s, d, 2.0) for s, d in (("a", "b"), ("b", "a"))]
        return rows, cpu.stop()[1]

    def problems(rows):
        return [f"{k}: {r['owd_stats_ms']} for {r['expected_owd_stats_ms']} +- {r['allowed_owd_stats_ms']}"
                for r in rows for k in ("delay", "jitter") if not r["checks"][k]]

    rows = fidelity(measure, problems)
    assert all(r["probe_received"] >= 250 for r in rows), [r["probe_received"] for r in rows]


def test_auto_chooses_netem_where_the_kernel_has_it(netenv):
    """``method: auto`` (every experiment's default) is netem exactly where netem works."""
    with WanNetwork(_lossy_pair(), log=lambda m: None) as net:
        assert net.method == ("netem" if probe().netem else "relay")
        if net.method == "netem":  # its queue limit counts packets: frames keep the kernel's sizing
            assert net.frame_ms == 0 and "net.ipv4.tcp_tso_rtt_log" not in net.host_sysctls
            assert all("frame_bytes" not in d for d in net.link_report())


def _tcp_counters(net, dc: str) -> dict[str, int]:
    """The datacenter's TCP counters (its namespace's /proc/net/netstat and snmp)."""
    text = net.host(dc).cmd("cat /proc/net/netstat /proc/net/snmp")
    out = {}
    lines = text.splitlines()
    for names, values in zip(lines[::2], lines[1::2]):
        proto, *keys = names.split()
        out.update({proto + k: int(v) for k, v in zip(keys, values.split()[1:])})
    return out


def _tcp_for(net, seconds: int, cc: str) -> dict:
    """One TCP flow a -> b for ``seconds``; iperf3's JSON report."""
    srv = net.popen("b", ["iperf3", "-s", "-1", "-p", "5201", "-J"], stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    cli = net.popen("a", ["iperf3", "-c", net.peer_address("a", "b"), "-p", "5201", "-t", str(seconds), "-J",
                          "-C", cc], stdout=subprocess.PIPE, text=True)
    out, _ = cli.communicate(timeout=seconds + 60)
    srv.communicate(timeout=30)
    return json.loads(out)


@pytest.mark.parametrize("method", ["relay", "netem"])
def test_jitter_never_reorders_a_flow(netenv, method):
    """Jitter keeps FIFO order on both paths (tbrelay.c; shaping._leaf gives netem a rate for
    it): TCP's reordering counters stay at a handful -- they also count a segment retransmitted
    in vain after its start-up overflowed the queue (0-6 in the Debian guest, FIFO) -- where
    netem without a rate gave 1540 in 5 s (2593 in 8 s; 40 Mbit/s, 2 ms jitter)."""
    _skip_without(method)
    topo = load_topology({"name": "jittery", "datacenters": ["a", "b"],
                          "links": [{"between": ["a", "b"], "rate_mbps": 40, "delay_ms": 20, "jitter_ms": 2}]})
    with WanNetwork(topo, method=method, tcp_cc="bbr", log=lambda m: None) as net:
        before = _tcp_counters(net, "a")
        rep = _tcp_for(net, 5, "bbr")
        after = _tcp_counters(net, "a")
    reorders = {k: after[k] - before[k] for k in after if "Reorder" in k and after[k] != before[k]}
    assert rep["end"]["sum_received"]["bytes"] > 0
    assert sum(reorders.values()) <= 50, reorders


def test_lossy_netem_link_loses_segments_one_by_one(netenv):
    """netem drops whole packets; a lossy direction's sender is capped to one segment per packet
    (network._cap_gso), so each drop is one segment, as through the relay.  TCP segments
    retransmitted per packet netem dropped: ~0.8 capped, 3.0 with TSO frames (Debian guest,
    40 Mbit/s, 0.5 % loss)."""
    _skip_without("netem")
    topo = load_topology({"name": "lossy", "datacenters": ["a", "b"],
                          "links": [{"between": ["a", "b"], "rate_mbps": 40, "delay_ms": 20, "loss": 0.005}]})
    with WanNetwork(topo, method="netem", tcp_cc="bbr", log=lambda m: None) as net:
        assert all(d["segment_loss"] for d in net.link_report()), net.link_report()
        rep = _tcp_for(net, 6, "bbr")
        qdisc = net.host("a").cmd(f"tc -s qdisc show dev {net.directions[('a', 'b')].intf}")
    dropped = int(re.search(r"qdisc netem 10: .*?dropped (\d+)", qdisc, re.S)[1])
    retrans = rep["end"]["sum_sent"]["retransmits"]
    assert dropped >= 20, qdisc  # enough losses to tell 1 from 3
    assert retrans <= 1.5 * dropped, (retrans, dropped)
