"""Real Mininet networks with shaped links (small and short)."""

import json
import os
import subprocess
import time

import pytest
from fidelity import fidelity

from testbed.emulator import shaping
from testbed.emulator.linkcheck import run_linkcheck
from testbed.emulator.network import CONTROL_BRIDGE, CONTROL_IP, WanNetwork, control_conflicts, control_route
from testbed.topology import load_topology

pytestmark = pytest.mark.net


def _linkcheck(topo, method, seconds=3):
    res = run_linkcheck(topo, seconds=seconds, phases=("single",), method=method, progress=lambda m: None)
    return res, res["steal"]


def _out_of_tolerance(res) -> list:
    """(phase, src, dst, failed checks, what was measured) per failing direction."""
    shown = ("rate_ratio", "udp_mbps_per_interval", "measured_queue_ms", "expected_queue_ms", "queue_overflow",
             "why", "measured_delay_ms", "measured_jitter_ms", "measured_loss")
    return [(d["phase"], d["src"], d["dst"], [k for k, ok in d["checks"].items() if not ok],
             {k: d[k] for k in shown if k in d}, res["emulation_kept_up"]["reasons"])
            for d in res["directions"] if not d["ok"]]


def _two(rate=50, delay=10):
    return load_topology({"name": "two", "datacenters": ["a", "b"],
                          "links": [{"between": ["a", "b"], "rate_mbps": rate, "delay_ms": delay}]})


@pytest.mark.parametrize("method", ["relay", "netem"])
def test_small3_rates_and_delays_within_tolerance(netenv, method):
    from testbed.emulator.capabilities import probe

    if method == "netem" and not probe().netem:
        pytest.skip("this kernel has no netem: the netem shaping path cannot be tested here")
    res = fidelity(lambda: _linkcheck(load_topology("small-3"), method), _out_of_tolerance)
    assert res["method"] == method
    assert len(res["directions"]) == 6
    assert all(d["method"] in ("htb+netem", "htb+user-space-relay") for d in res["directions"])


def test_links_without_delay_or_loss_bypass_the_relay_and_keep_their_rate(netenv):
    """In relay mode a link with no delay, jitter or loss is a direct veth pair shaped by HTB
    alone (method "htb"); it still measures within tolerance, beside a relayed link."""
    topo = load_topology({"name": "mixed", "datacenters": ["a", "b", "c"],
                          "links": [{"between": ["a", "b"], "rate_mbps": 40, "delay_ms": 0},
                                    {"between": ["b", "c"], "rate_mbps": 30, "delay_ms": 8}]})
    res = fidelity(lambda: _linkcheck(topo, "relay", seconds=2), _out_of_tolerance)
    methods = {(d["src"], d["dst"]): d["method"] for d in res["directions"]}
    assert methods == {("a", "b"): "htb", ("b", "a"): "htb", ("b", "c"): "htb+user-space-relay",
                       ("c", "b"): "htb+user-space-relay"}
    assert len(res["relay"]) >= 1  # the relay ran, for b-c only


def test_lossy_jittery_link_is_measured_within_tolerance(netenv):
    """The verdict checks every emulated property with a method independent of TCP:
    rate by UDP, one-way delay, jitter and loss by probes (loss by a binomial test), the
    standing queue's delay; under cubic the same link gives far less TCP goodput (informative)."""
    topo = load_topology({"name": "lossy", "datacenters": ["a", "b"],
                          "links": [{"between": ["a", "b"], "rate_mbps": 40, "delay_ms": 10, "jitter_ms": 1,
                                     "loss": 0.02, "queue_pkts": 100}]})
    res = fidelity(lambda: _linkcheck(topo, "auto", seconds=3), _out_of_tolerance)
    for d in res["directions"]:
        assert set(d["checks"]) == {"delay", "jitter", "loss", "loaded_delay", "rate", "queue"}
        assert d["rate_method"] == "udp" and d["probe_sent"] > 200
        assert d["loss_ci"][0] < 0.02 < d["loss_ci"][1] and d["measured_loss"] > 0
        assert d["measured_jitter_ms"] == pytest.approx(0.987, abs=0.3)
        assert d["measured_queue_ms"] == pytest.approx(100 * 1514 * 8 / 40e3, rel=0.05)
        assert d["queue_overflow"] == pytest.approx(1 / 3, abs=0.1)  # kept full under 1.5 x the rate
        assert d["tcp_cc"] == "cubic" and d["tcp_goodput_mbps"] < 0.5 * d["measured_mbps"]


def test_a_udp_load_that_never_filled_the_queue_is_started_again(netenv, monkeypatch):
    """iperf3's UDP stream starts with one datagram each way and no retry, so on a lossy link
    nothing may be sent (rate and queue then read 0): the queue check
    kills the load and its probes and starts them again.  Here the first wait for a full queue
    is told it never filled; that direction's load is started a second time and measures."""
    from testbed.emulator import linkcheck

    real, calls = linkcheck._await_full_queue, []

    def first_never_full(*args):
        calls.append(args)
        return None if len(calls) == 1 else real(*args)

    monkeypatch.setattr(linkcheck, "_await_full_queue", first_never_full)
    res, _ = _linkcheck(_two(rate=20, delay=5), "auto", seconds=2)
    tries = {(d["src"], d["dst"]): d["udp_start_tries"] for d in res["directions"]}
    assert sorted(tries.values()) == [1, 2] and len(calls) == 3, tries
    assert all(d["rate_ratio"] and d["rate_ratio"] > 0.5 for d in res["directions"]), _out_of_tolerance(res)


def test_a_queue_seen_full_too_late_to_probe_is_loaded_again_for_longer(netenv, monkeypatch):
    """Over several servers each poll of the queue is a process started over SSH, and a queue
    may be seen full seconds after it filled.  Here the first wait is held until too little
    of the load is left for the probes; that direction is loaded again, longer, and its
    queue measured."""
    from testbed.emulator import linkcheck

    real, calls = linkcheck._await_full_queue, []

    def first_seen_late(net, src, dst, frame, timeout_s):
        calls.append(src)
        full = real(net, src, dst, frame, timeout_s)
        if len(calls) == 1 and full:
            time.sleep(3.5)  # the load (under 3 s here) is over when the answer comes
            full = (full[0] + 3.5, *full[1:])
        return full

    monkeypatch.setattr(linkcheck, "_await_full_queue", first_seen_late)
    res, _ = _linkcheck(_two(rate=20, delay=5), "auto", seconds=2)
    tries = {(d["src"], d["dst"]): d["udp_start_tries"] for d in res["directions"]}
    assert sorted(tries.values()) == [1, 2] and len(calls) == 3, tries
    assert all(d["checks"]["queue"] and d["queue_probes"] >= linkcheck.QUEUE_PROBES for d in res["directions"]), \
        _out_of_tolerance(res)


def test_all_at_once_check_waits_out_cubic_regrowth_on_a_long_fat_link(netenv):
    """The concurrent phase: BBR on the lossy link, the experiment's cubic on the lossless one,
    both measured over CUBIC's regrowth time of the long fat link (its queue of 100 packets is
    under 0.43 of its bandwidth-delay product, 990 segments: K = 9.35 s)."""
    from testbed.emulator.linkcheck import cubic_regrowth_s

    topo = load_topology({"name": "longfat", "datacenters": ["a", "b", "c"],
                          "links": [{"between": ["a", "b"], "rate_mbps": 20, "delay_ms": 300, "queue_pkts": 100},
                                    {"between": ["b", "c"], "rate_mbps": 30, "delay_ms": 5, "loss": 0.01}]})
    k = cubic_regrowth_s(topo.links[0].ab, topo.links[0].ba)
    assert k == pytest.approx(9.35, abs=0.01)
    res = run_linkcheck(topo, seconds=2, phases=("concurrent",), progress=lambda m: None)
    rows = {(d["src"], d["dst"]): d for d in res["directions"]}
    assert {d["tcp_seconds"] for d in rows.values()} == {10}
    assert rows[("b", "c")]["rate_method"] == "tcp-bbr" and rows[("a", "b")]["rate_method"] == "tcp-cubic"
    assert rows[("a", "b")]["measured_mbps"] > 0 and rows[("b", "c")]["measured_mbps"] > 0
    # the window's frames are a part of all the relay sent; what one cost the machine is reported
    assert 0 < sum(s["win_frames_out"] for s in res["relay"]) <= sum(
        d["frames_out"] for s in res["relay"] for d in s["dirs"])
    assert res["concurrent_cpu_us_per_frame"] > 0
    # frames per second times CPU per frame is the CPU the machine spent (its cores' share)
    assert res["concurrent_frames_per_s"] * res["concurrent_cpu_us_per_frame"] / 1e6 == pytest.approx(
        res["concurrent_cpu_util"] * os.cpu_count())


def test_all_at_once_rate_counts_the_reverse_flows_acks(netenv):
    """A slow direction whose fast reverse is loaded too carries that flow's ACKs: under BBR
    (lossy link) the fast flow's TSO frames are small and ACKed one by one, about 0.4 Mbit/s of
    the slow direction's 2 (NetStorm at scale 0.1: h5->h4 read 0.88 of its rate by goodput
    alone).  The rate check counts the L2 bytes the direction carried, ACKs included."""
    from testbed.emulator.linkcheck import TCP_SHARE

    topo = load_topology({"name": "asym", "datacenters": ["a", "b"],
                          "links": [{"between": ["a", "b"], "rate_mbps": [16, 2], "delay_ms": 10, "loss": 0.0002}]})

    def measure():
        res = run_linkcheck(topo, seconds=3, phases=("concurrent",), progress=lambda m: None)
        return res, res["steal"]

    res = fidelity(measure, _out_of_tolerance)
    slow = next(d for d in res["directions"] if (d["src"], d["dst"]) == ("b", "a"))
    assert slow["rate_method"] == "tcp-bbr" and slow["checks"]["rate"]
    # a share the goodput alone misses: judged by it, the direction would have failed
    assert 0.05 < slow["reverse_ack_mbps"] / slow["rate_mbps"] < 0.4
    assert slow["measured_mbps"] / (slow["rate_mbps"] * TCP_SHARE * (1 - slow["loss"])) < 0.93


def test_udp_load_reads_every_direction_at_its_own_rate(netenv):
    """``load="udp"`` (bench emulator's reference): every direction loaded at once by UDP, its
    rate read from the receiving interface.  Rates differ per direction, so reading the wrong
    end of a link, or the sender's, cannot pass; a lossy relayed link delivers rate x (1 - loss)."""
    topo = load_topology({"name": "udp", "datacenters": ["a", "b", "c"],
                          "links": [{"between": ["a", "b"], "rate_mbps": [40, 10], "delay_ms": 0},
                                    {"between": ["b", "c"], "rate_mbps": [30, 15], "delay_ms": [8, 4],
                                     "loss": 0.05}]})

    def measure():
        res = run_linkcheck(topo, seconds=3, phases=("concurrent",), load="udp", progress=lambda m: None)
        return res, res["steal"]

    res = fidelity(measure, _out_of_tolerance)
    assert res["concurrent_load"] == "udp"
    rows = {(d["src"], d["dst"]): d for d in res["directions"]}
    assert set(rows) == {("a", "b"), ("b", "a"), ("b", "c"), ("c", "b")}
    for (s, d), rate in {("a", "b"): 40, ("b", "a"): 10, ("b", "c"): 30 * 0.95, ("c", "b"): 15 * 0.95}.items():
        assert rows[(s, d)]["rate_method"] == "udp-l2" and set(rows[(s, d)]["checks"]) == {"rate"}
        # the verdict's tolerance is the pass rule (checked by fidelity); this says whose rate was read
        assert rows[(s, d)]["measured_mbps"] == pytest.approx(rate, rel=0.1)


def test_a_silent_udp_load_is_started_again_before_the_window(netenv, monkeypatch):
    """All at once with UDP: a direction whose receiver counted nothing by the end of the
    warm-up (iperf3's UDP set-up lost on a lossy link) is started again before the window.
    Here the first client of a -> b sends nothing; it is started a second time and measures."""
    from testbed.emulator import linkcheck

    real, calls = linkcheck._udp_client, []

    def first_silent(net, src, dst, port, seconds):
        calls.append((src, dst))
        if calls.count(("a", "b")) == 1 and (src, dst) == ("a", "b"):
            return ["sh", "-c", "read go && exec sleep 60"]
        return real(net, src, dst, port, seconds)

    monkeypatch.setattr(linkcheck, "_udp_client", first_silent)
    res = run_linkcheck(_two(rate=20, delay=5), seconds=2, phases=("concurrent",), load="udp", progress=lambda m: None)
    rows = {(d["src"], d["dst"]): d for d in res["directions"]}
    assert sorted(calls) == [("a", "b"), ("a", "b"), ("b", "a")]
    assert (rows[("a", "b")]["udp_start_tries"], rows[("b", "a")]["udp_start_tries"]) == (2, 1)
    assert all(d["rate_ratio"] > 0.5 for d in rows.values()), _out_of_tolerance(res)


def test_standing_queue_behind_a_long_round_trip(netenv):
    """GScale's g2-g5 (130 Mbit/s, 400 ms): iperf3 needs ~4 round trips (3.2 s) before its first
    datagram; probes sent before then read an empty queue (measured 3-29 ms for 93 ms)."""
    topo = load_topology({"name": "long", "datacenters": ["a", "b"],
                          "links": [{"between": ["a", "b"], "rate_mbps": 130, "delay_ms": 400}]})
    res = run_linkcheck(topo, seconds=3, phases=("single",), progress=lambda m: None)
    for d in res["directions"]:  # by the link check's own rule (max(2 ms, 5 %, a frame's time))
        assert d["measured_queue_ms"] is not None and d["checks"]["queue"], d


def test_rate_change_is_visible_within_one_second(netenv):
    with WanNetwork(_two(rate=50, delay=5)) as net:
        srv = net.popen("b", ["iperf3", "-s", "-1", "-J", "-i", "0.25", "-p", "5301"],
                        stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)
        t_start = time.time()
        cli = net.popen("a", ["iperf3", "-c", net.peer_address("a", "b"), "-p", "5301", "-t", "5"])
        time.sleep(2.5)
        net.set_rate("a", "b", 10)
        change = time.time() - t_start  # seconds into the test (iperf's own timestamps are whole seconds)
        cli.wait(timeout=30)
        out, _ = srv.communicate(timeout=30)
        events = net.events
    rep = json.loads(out)
    ivals = [(i["sum"]["start"], i["sum"]["end"], i["sum"]["bits_per_second"] / 1e6) for i in rep["intervals"]]
    # intervals count from the connection (a few ms after t_start): keep a 0.3 s margin before the change
    before = [m for s, e, m in ivals if 1.0 <= s and e <= change - 0.3]
    after = [m for s, e, m in ivals if s >= change + 1.0]
    assert before and after
    assert min(before) > 40, before
    assert max(after) < 12.5, after
    assert events and events[0]["event"] == "rate" and events[0]["rate_mbps"] == 10


def _gso_max_size(net, dc: str, peer: str) -> int:
    out = net.host(dc).cmd(f"ip -d link show dev {net.directions[(dc, peer)].intf}")
    return int(out.split("gso_max_size ")[1].split()[0])


def test_tcp_frames_carry_frame_ms_of_the_link_rate(netenv):
    """emulator.frame_ms: a sender's gso_max_size is that much of its direction's rate (also
    after a live rate change) and TCP fills its frames up to it, so the relay moves fewer,
    larger frames than the kernel's ~1 ms of pacing would make; frame_ms 0 leaves the
    kernel's sizing alone."""
    with WanNetwork(_two(rate=50, delay=5)) as net:
        assert net.frame_ms == shaping.FRAME_MS
        assert net.host("a").cmd("sysctl -n net.ipv4.tcp_tso_rtt_log").strip() == "24"
        cap = shaping.frame_bytes(50, net.frame_ms)
        assert _gso_max_size(net, "a", "b") == _gso_max_size(net, "b", "a") == cap == 25000
        assert {d["frame_bytes"] for d in net.link_report()} == {cap}
        net.popen("b", ["iperf3", "-s", "-1", "-p", "5302"])
        time.sleep(0.5)
        net.popen("a", ["iperf3", "-c", net.peer_address("a", "b"), "-p", "5302", "-t", "2"]).wait(timeout=30)
        net.set_rate("a", "b", 10)
        assert _gso_max_size(net, "a", "b") == shaping.frame_bytes(10, net.frame_ms) == 5000
        assert net.directions[("a", "b")].report()["frame_bytes"] == 5000
    if net.method == "relay":
        ab = next(d for s in net.relay_final_stats for d in s["dirs"] if d["dir"] == "ab")
        assert ab["bytes_in"] / ab["gso_frames"] > 0.6 * cap, ab  # the kernel's own: ~6 KB at 50 Mbit/s
    with WanNetwork(_two(rate=50, delay=5), frame_ms=0) as net:
        assert _gso_max_size(net, "a", "b") == shaping.GSO_MAX_BYTES
        assert "net.ipv4.tcp_tso_rtt_log" not in net.host_sysctls
        assert all("frame_bytes" not in d for d in net.link_report())


def test_a_kernel_that_cannot_size_frames_keeps_its_own_with_a_warning(netenv, monkeypatch):
    monkeypatch.setattr(shaping, "frame_commands",
                        lambda intf, rate, ms: [["ip", "link", "set", "dev", intf, "gso_max_size", "none"]])
    said = []
    with WanNetwork(_two(), log=said.append) as net:
        assert net.frame_ms == 0
        assert net.host("a").cmd("sysctl -n net.ipv4.tcp_tso_rtt_log").strip() == "9"
        assert "net.ipv4.tcp_tso_rtt_log" not in net.host_sysctls
        assert all("frame_bytes" not in d for d in net.link_report())
    assert any("cannot size a device's TCP frames" in m for m in said), said


def test_hosts_use_the_configured_congestion_control_and_byte_queues(netenv):
    """Never the machine's default congestion control; the relay-mode queue is a byte limit
    of queue_pkts full frames (GSO super-frames would make a packet limit meaningless)."""
    topo = load_topology({"name": "two", "datacenters": ["a", "b"],
                          "links": [{"between": ["a", "b"], "rate_mbps": 50, "delay_ms": 5, "queue_pkts": 40}]})
    with WanNetwork(topo, tcp_cc="reno") as net:
        out = net.host("a").cmd("sysctl -n net.ipv4.tcp_congestion_control").strip()
        assert out == "reno"
        assert net.host_sysctls["net.ipv4.tcp_congestion_control"] == "reno"
        qdiscs = net.host("a").cmd(f"tc qdisc show dev {net.directions[('a', 'b')].intf}")
        if net.method == "relay":
            leaf = next(l for l in qdiscs.splitlines() if "parent 1:10 " in l)
            assert leaf.startswith("qdisc bfifo 10:") and leaf.endswith(f"limit {40 * 1514}b"), leaf


def test_network_holds_free_memory_from_the_hypervisor(netenv):
    """On a VM with free page reporting the first network raises the reporting order as far
    as the kernel allows and it stays raised (testbed.emulator.memory); results record it."""
    from testbed.emulator import memory

    if not memory.reports_free_pages():
        pytest.skip("this machine reports no free pages to a hypervisor")
    with WanNetwork(_two()) as net:
        held = net.memory_hold["held_at"]
        assert int(memory.REPORTING_ORDER.read_text()) == held >= memory.MAX_PAGE_ORDER
    assert int(memory.REPORTING_ORDER.read_text()) == held  # until reboot: the warmed memory stays warm


def test_unavailable_congestion_control_is_a_clear_error(netenv):
    from testbed.errors import RunError

    with pytest.raises(RunError, match="'no_such_cc' is not available"):
        with WanNetwork(_two(), tcp_cc="no_such_cc"):
            pass


def _ping_ok(net, src, dst) -> bool:
    p = net.popen(src, ["ping", "-n", "-q", "-c", "3", "-i", "0.2", "-W", "1", net.peer_address(src, dst)],
                  stdout=subprocess.PIPE, text=True)
    out, _ = p.communicate(timeout=20)
    return p.returncode == 0


def test_link_down_and_up(netenv):
    topo = load_topology("small-3")
    a, b = topo.links[0].a, topo.links[0].b
    with WanNetwork(topo) as net:
        assert _ping_ok(net, a, b)
        net.set_link(a, b, up=False)
        assert not _ping_ok(net, a, b)
        net.set_link(a, b, up=True)
        assert _ping_ok(net, a, b)
        kinds = [e["event"] for e in net.events]
    assert kinds == ["link_down", "link_up"]


def test_non_adjacent_datacenters_are_routed(netenv):
    line = load_topology({"name": "line", "datacenters": ["a", "b", "c"],
                          "links": [{"between": ["a", "b"], "rate_mbps": 50, "delay_ms": 5},
                                    {"between": ["b", "c"], "rate_mbps": 50, "delay_ms": 5}]})
    with WanNetwork(line) as net:
        assert net.peer_address("a", "c") == net.node_address("c")
        p = net.popen("a", ["ping", "-n", "-c", "3", "-i", "0.2", net.node_address("c")],
                      stdout=subprocess.PIPE, text=True)
        out, _ = p.communicate(timeout=20)
    assert p.returncode == 0, out
    rtt_min = float(out.rsplit("=", 1)[1].split("/")[0])  # min: the first ping also waits for ARP
    assert 19 <= rtt_min <= 23, rtt_min  # two hops of 5 ms each way


def test_the_control_network_hides_none_of_the_machines_own_addresses(netenv):
    """The machine routes only its hosts' control block: an address elsewhere in 10.255.0.0/16
    (a resolver at 10.255.255.53, say) still leaves by the machine's own route."""
    with WanNetwork(_two()) as net:
        route = subprocess.run(["ip", "-4", "route", "get", "10.255.255.53"], capture_output=True, text=True).stdout
        host = subprocess.run(["ip", "-4", "route", "get", net.control_address("b")], capture_output=True,
                              text=True).stdout
        p = net.popen("a", ["ping", "-n", "-c", "1", "-W", "2", CONTROL_IP], stdout=subprocess.PIPE, text=True)
        out, _ = p.communicate(timeout=10)
    assert f"dev {CONTROL_BRIDGE} " not in route, route
    assert f"dev {CONTROL_BRIDGE} " in host, host
    assert p.returncode == 0, out  # a host reaches the coordinator's address


def test_a_control_route_that_would_hide_a_nameserver_or_network_is_refused():
    block = control_route(9)
    assert str(block) == "10.255.0.0/24" and str(control_route(251)) == "10.255.0.0/23"
    assert control_conflicts(block, "nameserver 10.255.255.53\n", "default via 192.0.2.1 dev eth0\n"
                             "10.0.0.0/8 via 192.0.2.1 dev eth0\n10.255.0.0/16 dev tbc0 scope link\n") == []
    assert control_conflicts(block, "nameserver 10.255.0.53\n", "10.255.0.128/25 dev eth1\n"
                             "172.16.0.0/12 via 10.255.0.9 dev eth0\n") == [
        "nameserver 10.255.0.53", "route 10.255.0.128/25 dev eth1", "route 172.16.0.0/12 via 10.255.0.9 dev eth0"]


def test_bad_topology_fails_validation_clearly(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("name: bad\ndatacenters: [a, b]\nlinks: [{between: [a, zz], rate_mbps: 10}]\n")
    res = subprocess.run(["python3", "-m", "testbed", "linkcheck", str(f)], capture_output=True, text=True)
    assert res.returncode == 2
    assert "zz" in res.stderr and "links[0]" in res.stderr


def test_doctor_reports_what_run_will_use(netenv):
    from testbed.emulator.capabilities import probe

    caps = probe()
    res = subprocess.run(["python3", "-m", "testbed", "doctor"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    netem_line = next(l for l in res.stdout.splitlines() if "netem (delay/loss/jitter in kernel)" in l)
    assert netem_line.split()[0] == ("yes" if caps.netem else "NO")
    expected = "HTB rate + netem" if caps.netem else "HTB rate + user-space delay relay"
    assert f"link shaping used by run: {expected}" in res.stdout
