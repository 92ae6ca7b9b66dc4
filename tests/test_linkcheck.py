"""The link check's pass rules (testbed/emulator/linkcheck.py), without a network."""

import functools
from dataclasses import replace

import numpy as np
import pytest

from testbed.emulator import jitter
from testbed.emulator.linkcheck import (
    carried_share,
    cubic_regrowth_s,
    delay_ok,
    format_table,
    loss_check,
    owd_check,
    queue_jitter_ms,
    queue_ok,
    queue_overflow,
    rate_ok,
    single_batches,
    single_parallel,
    udp_payload,
)
from testbed.emulator.network import Direction
from testbed.emulator.shaping import netem_limit, standing_queue_ms
from testbed.topology import LinkDir


def test_loss_is_judged_by_a_binomial_test_fit_for_the_sample():
    # NetStorm's 0.02 %: 12 000 probes expect 2.4 losses; 0..8 are consistent, 20 are not
    assert loss_check(0, 12000, 2e-4)["ok"] and loss_check(8, 12000, 2e-4)["ok"]
    assert not loss_check(20, 12000, 2e-4)["ok"]
    # a lossless link must lose nothing; 2 % configured but none lost in 4000 is a failure
    assert not loss_check(1, 5000, 0.0)["ok"] and loss_check(0, 5000, 0.0)["ok"]
    assert not loss_check(0, 4000, 0.02)["ok"]
    r = loss_check(80, 4000, 0.02)
    assert r["ok"] and r["loss_ci"][0] < 0.02 < r["loss_ci"][1]


def _owd(rng, n, delay_ms, jitter_ms, dist, scale=1.0, shift=0.0):
    """n one-way delays drawn as the emulator draws them, their spread times ``scale``."""
    x = rng.choice(jitter.draws(delay_ms, jitter_ms, dist), n)
    return delay_ms + shift + scale * (x - delay_ms) + rng.normal(0, 0.03, n)  # + timestamp noise


@functools.lru_cache(maxsize=None)
def _model(n, delay_ms, jitter_ms, dist):
    return jitter.simulate(n, delay_ms, jitter_ms, dist, runs=2000)


def _check(owd, delay_ms, jitter_ms, dist):
    return owd_check(owd, _model(len(owd), delay_ms, jitter_ms, dist), max(1.0, 0.03 * delay_ms))


@pytest.mark.parametrize("dist", ["normal", "uniform", "pareto", "paretonormal"])
def test_delay_and_jitter_rules_compare_the_distribution_with_a_tolerance_from_the_sample(dist):
    """Median and spreads against those of the configured distribution: its samples pass (the
    rules' levels are 1e-3), shifted by a systematic 0.5 ms too; with 300 probes a spread 27 %
    short (8 ms of jitter measured 5.8) fails, and under pareto's long tail one half as wide;
    a delay 6 ms long fails (1 ms + 3.3 standard errors of the median is 2.0-3.6 ms); with 30
    probes the tolerance is wider."""
    rng = np.random.default_rng(7)
    fails = sum(not (c["delay"] and c["jitter"]) for c in (_check(_owd(rng, 300, 30, 8, dist), 30, 8, dist)
                                                          for _ in range(50)))
    assert fails <= 1
    assert _check(_owd(rng, 300, 30, 8, dist, shift=0.5), 30, 8, dist)["delay"]
    short = 0.5 if dist.startswith("pareto") else 0.73
    assert sum(_check(_owd(rng, 300, 30, 8, dist, scale=short), 30, 8, dist)["jitter"] for _ in range(20)) <= 1
    assert sum(_check(_owd(rng, 300, 30, 8, dist, shift=6.0), 30, 8, dist)["delay"] for _ in range(20)) <= 1
    few, many = _check(_owd(rng, 30, 30, 8, dist), 30, 8, dist), _check(_owd(rng, 300, 30, 8, dist), 30, 8, dist)
    assert all(a > b for a, b in zip(few["allowed"], many["allowed"]))


def test_the_jitter_rule_tells_the_distributions_apart():
    """300 probes of a normal jitter are not a pareto one's, nor a uniform one's."""
    rng = np.random.default_rng(3)
    assert not _check(_owd(rng, 300, 30, 8, "normal"), 30, 8, "pareto")["jitter"]
    assert not _check(_owd(rng, 300, 30, 8, "pareto"), 30, 8, "normal")["jitter"]
    assert not _check(_owd(rng, 300, 30, 8, "paretonormal"), 30, 8, "uniform")["jitter"]


def test_without_jitter_the_delays_must_agree_within_the_probes_timing():
    rng = np.random.default_rng(5)
    assert _check(10.3 + rng.normal(0, 0.03, 200), 10, 0, "normal")["jitter"]
    assert not _check(10 + rng.normal(0, 0.5, 200), 10, 0, "normal")["jitter"]


def test_delay_rate_and_queue_rules():
    assert delay_ok(30.8, 30) and not delay_ok(31.2, 30) and delay_ok(409, 400) and not delay_ok(413, 400)
    assert delay_ok(13, 10, slack_ms=3) and not delay_ok(None, 10)
    assert rate_ok(0.95) and not rate_ok(0.92) and not rate_ok(1.03) and not rate_ok(None)
    assert queue_ok(31, 30.28) and not queue_ok(15, 30.28) and queue_ok(600, 606) and not queue_ok(560, 606)
    assert queue_ok(68.5, 72.5, frame_ms=4.83) and not queue_ok(68.5, 72.5)  # one frame at 2.5 Mbit/s


def test_a_queue_kept_full_overflows_a_third_of_what_arrives():
    """Under 1.5 x the rate a full queue drops a third of the arrivals; a sender short of the
    rate (the Debian guest's iperf3 under TCG) leaves it idle and drops only the random loss,
    which netem's queue counts too and is taken out."""
    at_full = {"sent_pkts": 1000, "dropped": 50, "backlog_p": 100}
    full = {"sent_pkts": 3000, "dropped": 1050, "backlog_p": 99}  # 2000 sent, 1000 dropped
    assert queue_overflow(at_full, full, 0.0) == pytest.approx(1000 / 2999)
    short = {"sent_pkts": 3000, "dropped": 90, "backlog_p": 3}  # 2 % loss at netem's queue
    assert queue_overflow(at_full, short, 0.02) == pytest.approx(40 / 1943 - 0.02)
    assert queue_overflow(at_full, at_full, 0.0) is None


def test_standing_queue_is_what_a_probe_finds_ahead_in_a_full_queue():
    """A tail-drop queue takes an arrival only while it fits: a small probe finds the most
    frames ahead that leave it room -- a byte FIFO of queue_pkts full-size frames (relay),
    or netem's packet limit less one, less the frames on the emulated wire."""
    d = LinkDir(20.0, 30.0, 0.0, 2e-4, queue_pkts=1000)
    frame_ms = 1490 * 8 / 20e3
    assert standing_queue_ms(d, "relay", 1490, 106) == pytest.approx((1000 * 1514 - 106) // 1490 * frame_ms)
    assert standing_queue_ms(d, "relay", 1514, 106) == pytest.approx(999 * 1514 * 8 / 20e3)  # no room: one less
    # netem: 1000 + 50 frames on the wire (20 Mbit/s x 30 ms = 49.5 frames of 1514 bytes) in its limit
    assert netem_limit(d) == 1050
    assert standing_queue_ms(d, "netem", 1490, 106) == pytest.approx(1049 * frame_ms - 30)
    # jitter adds nothing on average: its mean is zero
    j = LinkDir(20.0, 30.0, 5.0, 0.0, queue_pkts=1000)
    assert netem_limit(j) == 1050 and standing_queue_ms(j, "netem", 1490, 106) == standing_queue_ms(d, "netem", 1490, 106)
    # measured in the VM (netstorm-internet2-9, scale 0.1, netem): 100 packets + the wire at
    # 2.0 Mbit/s, 30 ms; the probes read 597.8 ms, one frame (6 ms) under netem_limit's 604.2
    slow = LinkDir(2.0, 30.0, 0.0, 2e-4, queue_pkts=100)
    assert standing_queue_ms(slow, "netem", 1510, 106) == pytest.approx(598.2, abs=0.1)


def test_a_jittery_queue_leaves_frames_at_the_latest_due_time_before_them():
    """Frames leaving a full queue one frame's time apart are held, in FIFO order, to the
    latest due time before them: the relay adds that to the queue (measured on the relay, 8 ms
    of jitter at 40 Mbit/s: a 30 ms queue read 43, 12.6 modelled; 25 Mbit/s: 59 for 48, 11.0);
    netem dates a packet as it enters its queue, so a queue longer than that hides it."""
    d, j = LinkDir(40.0, 30.0, 0.0, queue_pkts=100), LinkDir(40.0, 30.0, 8.0, queue_pkts=100)
    assert standing_queue_ms(j, "relay", 1510, 106) - standing_queue_ms(d, "relay", 1510, 106) == pytest.approx(12.6, abs=0.2)
    assert standing_queue_ms(j, "netem", 1510, 106) == standing_queue_ms(d, "netem", 1510, 106)  # 30 ms > 12.6
    short = LinkDir(40.0, 30.0, 8.0, queue_pkts=20)
    assert standing_queue_ms(short, "netem", 1510, 106) == pytest.approx(12.6, abs=0.2)  # 6 ms < 12.6
    # the probes' median varies with the draws that hold the stream: more under a long tail
    frame_ms = 1510 * 8 / 40e3
    normal = queue_jitter_ms(j, "relay", frame_ms, 80, 48)
    tail = queue_jitter_ms(replace(j, distribution="paretonormal"), "relay", frame_ms, 80, 48)
    assert 0.3 < normal < tail and queue_jitter_ms(d, "relay", frame_ms, 80, 48) == 0
    assert queue_jitter_ms(j, "netem", frame_ms, 80, 48) < 1e-9  # hidden behind its 30 ms queue


def test_queue_check_datagrams_leave_a_probe_room_in_a_full_byte_queue():
    """A byte FIFO of q x 1514 bytes full of 1510-byte datagrams leaves 4q bytes: under a probe's
    106 for q < 27, so the probes would get in only just after a departure.  There the
    datagrams shrink until the rest fits a probe; the expected queue follows the frame used."""
    for q in (1, 2, 10, 16, 26):
        p = udp_payload(LinkDir(2.0, 160.0, queue_pkts=q), "relay")
        frame, limit = p + 42, q * 1514
        assert p < 1468 and limit % frame >= 106 and limit >= frame
        assert all(limit % (b + 42) < 106 for b in range(p + 1, 1469))  # the largest that fits
    for q in (27, 100, 1000):
        assert udp_payload(LinkDir(2.0, 160.0, queue_pkts=q), "relay") == 1468
    assert udp_payload(LinkDir(2.0, 160.0, queue_pkts=10), "netem") == 1468  # netem counts packets
    d = LinkDir(2.0, 160.0, queue_pkts=10)
    assert standing_queue_ms(d, "relay", udp_payload(d, "relay") + 42, 106) == pytest.approx(10 * 1503 * 8 / 2e3)


def test_loss_based_flows_are_measured_over_cubic_regrowth_where_the_queue_is_short():
    """RFC 9438's K where 0.7 x (BDP + queue) < BDP, else 0: GScale's g2->g5 at scale 1
    (130 Mbit/s, 400 ms each way, 1000 packets: BDP 8586 segments of 1514 bytes)."""
    long_fat, back = LinkDir(130.0, 400.0, 0.0, 0.0, queue_pkts=1000), LinkDir(130.0, 400.0, 0.0, 0.0, queue_pkts=1000)
    assert cubic_regrowth_s(long_fat, back) == pytest.approx((9586.5 * 0.3 / 0.4) ** (1 / 3), rel=1e-3)  # 19.3 s
    # the queue keeps the link busy after a loss: 3680 >= 0.3/0.7 x 8586
    assert cubic_regrowth_s(LinkDir(130.0, 400.0, 0.0, 0.0, queue_pkts=3680), back) == 0.0
    assert cubic_regrowth_s(LinkDir(50.0, 30.0, 0.0, 0.0, queue_pkts=200), LinkDir(50.0, 30.0, 0.0, 0.0)) == 0.0


def test_link_by_link_rounds_never_share_a_datacenter():
    """Larger topologies are checked link by link in rounds of node-disjoint directions (each on
    its own link, queue and hosts); small ones one direction at a time, in order."""
    import itertools

    from testbed.topology import load_topology

    topo = load_topology("equinix-like-20")
    rtt = {}
    for link in topo.links:
        for s, d in ((link.a, link.b), (link.b, link.a)):
            rtt[(s, d)] = 2 * link.ab.delay_ms
    assert len(rtt) == 282 and single_parallel(282) == 8 and single_parallel(40) == 1 and single_parallel(26) == 1
    rounds = single_batches(rtt, 8)
    assert sorted(sd for r in rounds for sd in r) == sorted(rtt)  # every direction exactly once
    for r in rounds:
        assert 1 <= len(r) <= 8
        nodes = [n for sd in r for n in sd]
        assert len(nodes) == len(set(nodes))  # no datacenter twice, so never a direction and its reverse
    degree = max(sum(n in sd for sd in rtt) for n in topo.nodes)  # a datacenter's directions, in and out
    assert degree <= len(rounds) <= 60  # about SINGLE_ROUNDS, bounded below by the busiest datacenter
    assert [r[0][0] for r in rounds[:1]] and max(rtt[sd] for sd in rounds[0]) == max(rtt.values())
    small = {sd: 1.0 for sd in itertools.permutations("abc", 2)}
    assert single_batches(small, 1) == [[sd] for sd in small]


@pytest.mark.parametrize("skip", [None, 0])
def test_probe_sender_waits_for_go_after_saying_ready(skip):
    """linkcheck starts its probes ahead (Python's start-up takes seconds on slow machines) and
    lets them go when the standing queue is full: nothing may leave before the go.  The delay
    statistics leave out the first SKIP datagrams, or ``--skip`` of them (the queue probes: 0)."""
    import json
    import select
    import socket
    import subprocess
    import sys

    from testbed.emulator.probe import SKIP

    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    probe = [sys.executable, "-m", "testbed.emulator.probe"]
    rx = subprocess.Popen([*probe, "recv", str(port), "--seconds", "20", "--ready",
                           *(["--skip", str(skip)] if skip is not None else [])], stdout=subprocess.PIPE, text=True)
    tx = subprocess.Popen([*probe, "send", "127.0.0.1", str(port), "--pps", "100", "--seconds", "0.5", "--ready"],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        for p in (rx, tx):
            assert select.select([p.stdout], [], [], 30)[0] and p.stdout.readline().strip() == "ready"
        with pytest.raises(subprocess.TimeoutExpired):  # held: the receiver hears nothing, so it stays
            rx.wait(timeout=2.5)
        tx.stdin.write("go\n")
        tx.stdin.flush()
        assert json.loads(tx.communicate(timeout=20)[0]) == {"sent": 50}
        got = json.loads(rx.communicate(timeout=20)[0])
        assert got["unique"] == 50 and got["max_seq"] == 49
        assert got["owd_n"] == 50 - (SKIP if skip is None else skip)
    finally:
        for p in (rx, tx):
            p.kill()
            p.wait()


def test_tcp_memory_reads_every_namespace_s_tcp_pages_and_the_pressure_marks(tmp_path):
    """What the check records before and after (orphans of earlier runs count against tcp_mem)."""
    import os

    from testbed.results import tcp_memory

    stat, mem = tmp_path / "sockstat", tmp_path / "tcp_mem"
    stat.write_text("sockets: used 8\nTCP: inuse 1 orphan 4 tw 0 alloc 5 mem 27529\nUDP: inuse 0 mem 0\n")
    mem.write_text("287901\t383868\t575802\n")
    page_mb = os.sysconf("SC_PAGE_SIZE") / 1e6
    got = tcp_memory(str(stat), str(mem))
    assert got["orphans"] == 4 and got["mem_mb"] == round(27529 * page_mb, 1)
    assert got["marks_mb"] == [round(x * page_mb, 1) for x in (287901, 383868, 575802)]
    live = tcp_memory()  # this machine's /proc
    assert live["mem_mb"] >= 0 and len(live["marks_mb"]) == 3 and live["marks_mb"][0] <= live["marks_mb"][1]


def test_a_full_lossy_link_carries_its_rate_less_what_was_lost_after_the_shaper():
    """Through the relay a lost packet had used the rate (1 - loss reaches the receiver); netem
    drops before HTB, so a full link delivers its whole rate (the Debian guest, 5 % loss, 4
    Mbit/s, UDP overload: 1.051 of rate x (1 - loss), which the old rule failed)."""
    spec = LinkDir(4.0, 10.0, 0.0, 0.05, queue_pkts=50)
    assert carried_share(Direction("a", "b", 0, "a-eth0", spec, "relay")) == pytest.approx(0.95)
    assert carried_share(Direction("a", "b", 0, "a-eth0", spec, "netem")) == 1.0
    assert rate_ok(1.051 * 0.95 / carried_share(Direction("a", "b", 0, "a-eth0", spec, "netem")))


def test_a_check_that_could_not_measure_says_why():
    row = {"phase": "single", "src": "a", "dst": "b", "rate_mbps": 40.0, "delay_ms": 10.0, "jitter_ms": 0.0,
           "loss": 0.0, "ok": False, "checks": {"rate": True, "queue": False},
           "why": {"queue": "never seen full in 3 tries: not measured"}}
    assert format_table({"directions": [row]}).endswith("FAIL queue (never seen full in 3 tries: not measured)")
