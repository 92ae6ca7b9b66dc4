"""agents/probe.py: the estimators against synthetic chunk samples with known answers."""

from __future__ import annotations

import pytest

from agents.probe import Prober, Sample, busy_rate, eq17_rate, estimate, link_rate, owd_s, per_flow_rates, sum_rate

MB = 1_000_000


def fifo_link(chunks, rate_bps, delay_s, sender_clock_ns=0, receiver_clock_ns=0):
    """A FIFO link of ``rate_bps`` bits/s and one-way ``delay_s``: ``chunks`` = [(send time s,
    bytes, channel)] in sending order.  Samples as the receiver records them (header read at
    the first byte's arrival, last byte when the whole chunk arrived), clocks shifted."""
    out, free = [], 0.0
    for t, n, ch in chunks:
        start = max(t, free)  # the link is busy with earlier chunks until ``free``
        free = start + n * 8 / rate_bps
        out.append(Sample(n, int(t * 1e9) + sender_clock_ns, int((start + delay_s) * 1e9) + receiver_clock_ns,
                          int((free + delay_s) * 1e9) + receiver_clock_ns, ch))
    return out


def test_eq17_and_ratio_of_sums_differ_as_the_paper_and_code_do():
    # the reading note's oracle (§6.3): four 4 MB chunks taking 0.4, 0.5, 0.4, 0.5 s
    samples = [Sample(4 * MB, 0, 0, int(d * 1e9)) for d in (0.4, 0.5, 0.4, 0.5)]
    assert eq17_rate(samples) == pytest.approx(9 * MB)
    assert sum_rate(samples) == pytest.approx(16 * MB / 1.8)
    assert link_rate(samples, "eq17") == eq17_rate(samples)
    with pytest.raises(ValueError, match="unknown estimator"):
        link_rate(samples, "median")


def test_busy_rate_measures_the_link_when_flows_share_it():
    # two flows (channels 0, 1) interleave 2 MB chunks on a 100 Mbit/s link, 30 ms: every
    # per-flow goodput is about half the link, the union of busy intervals the whole link
    chunks = [(i * 0.01, 2 * MB, i % 2) for i in range(8)]
    s = fifo_link(chunks, 100e6, 0.030)
    assert busy_rate(s) * 8 == pytest.approx(100e6, rel=1e-6)
    flows = per_flow_rates(s)
    assert set(flows) == {0, 1}
    assert all(r * 8 < 0.6 * 100e6 for r in flows.values())  # shares, not the link
    # chunks with idle gaps between them: the gaps are not counted as busy time
    gaps = fifo_link([(i * 1.0, 2 * MB, 0) for i in range(4)], 50e6, 0.030)
    assert busy_rate(gaps) * 8 == pytest.approx(50e6, rel=1e-6)


def test_owd_and_rates_corrected_for_clock_offsets():
    # sender's clock 300 ms behind, receiver's 500 ms ahead: raw difference off by 800 ms
    s = fifo_link([(0.0, 2 * MB, 0), (0.0, 2 * MB, 0), (0.5, 2 * MB, 0), (0.5, 2 * MB, 0)], 80e6, 0.025,
                  sender_clock_ns=-300_000_000, receiver_clock_ns=500_000_000)
    off = 800_000_000  # receiver's clock minus sender's
    assert owd_s(s, off) == pytest.approx(0.025, abs=1e-9)  # the chunk into an empty pipe
    assert owd_s(s) == pytest.approx(0.825, abs=1e-9)  # uncorrected: wrong by the offset
    assert busy_rate(s) * 8 == pytest.approx(80e6, rel=1e-6)  # receiver's clock only
    # per-chunk durations include the delay and the wait behind the previous chunk
    assert eq17_rate(s, off) * 8 < 80e6 and sum_rate(s, off) * 8 < 80e6
    one = fifo_link([(0.0, 2 * MB, 0)], 80e6, 0.025, -300_000_000, 500_000_000)
    assert eq17_rate(one, off) == pytest.approx(2 * MB / (2 * MB * 8 / 80e6 + 0.025))
    e = estimate(s, off)
    assert e["busy_mbps"] == pytest.approx(80.0) and e["owd_ms"] == pytest.approx(25.0)
    assert e["chunks"] == 4 and e["bytes"] == 8 * MB and set(e["flows_mbps"]) == {"0"}



def test_prober_windows():
    p = Prober(min_bytes=1000, num=2)
    small = Sample(999, 0, 1, 2)
    big = [Sample(1000, i, i + 1, i + 2, i % 2) for i in range(6)]

    def feed(peer, s):
        p.start(peer)
        return p.add(peer, s)

    assert feed("h1", small) is None  # joins the window, does not count
    assert feed("h1", big[0]) is None
    assert feed("h1", big[1]) == [small, big[0], big[1]]
    assert feed("h2", big[0]) is None  # per sending peer
    # a window is not cut while another chunk on the link is in flight
    for _ in range(3):
        p.start("h1")
    assert p.add("h1", big[2]) is None
    assert p.add("h1", big[3]) is None  # count reached, one more still arriving
    assert p.add("h1", big[4]) == big[2:5]
    with pytest.raises(ValueError):
        Prober(num=0)


def test_busy_rate_leaves_out_the_first_half_of_each_chunk():
    # a chunk after idle ramps up (TCP slow start): 1 MB in its first 0.8 s, 1 MB in 0.2 s
    ramp = Sample(2 * MB, 0, 0, 1_000_000_000, 0, 800_000_000, MB)
    assert busy_rate([ramp]) == pytest.approx(MB / 0.2)
    assert busy_rate([ramp._replace(mid_ns=0, mid_bytes=0)]) == pytest.approx(2 * MB / 1.0)  # not recorded


def test_busy_rate_with_overlapping_flows_that_ramp():
    # two flows start together after idle and share a link of R bytes/s: B (2.2 MB) ends at
    # 4.4/R, A (3.6 MB) at 5.8/R; counted from B's half-way point 2.2/R: 3.6 MB in 3.6/R
    R = 10 * MB
    def ns(x):
        return int(x / R * 1e9)  # x MB-units of time at rate R
    a = Sample(int(3.6 * MB), 0, 0, ns(5.8 * MB), 0, ns(3.6 * MB), int(1.8 * MB))
    b = Sample(int(2.2 * MB), 0, 0, ns(4.4 * MB), 1, ns(2.2 * MB), int(1.1 * MB))
    assert busy_rate([a, b]) == pytest.approx(R, rel=1e-3)


def test_link_estimate_is_the_largest_of_the_last_three_windows():
    """agents.netstate: a window in which the link was not kept full reads low, so the link's
    estimate is the largest of its last 3 windows (a rise shows at once, a fall after 3)."""
    from agents.netstate import NetState
    from agents.probe import WIRE_BYTES_PER_PAYLOAD

    net = NetState(["a", "b"])

    def window(mbps: float) -> float:
        half = int(1e6 * 8 / (mbps * 1e6) * 1e9)  # 1 MB after the half-way point at ``mbps``
        rows = [[2_000_000, 0, 0, 2 * half, 0, half, 1_000_000]]
        return net.add({"src": "a", "dst": "b", "samples": rows})["link_mbps"] / WIRE_BYTES_PER_PAYLOAD

    assert [round(window(r)) for r in (100, 60, 50, 70, 40, 30)] == [100, 100, 100, 70, 70, 70]
