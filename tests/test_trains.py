"""Packet trains (agents/trains.py): the capacity of a link from the spacing a shaper gives a
train, its duty cycle, real UDP sockets between two agents' train endpoints, and the
scheduler's TRAIN reports (agents/netstate.py)."""

import socket
import threading
import time

import pytest

from agents.netstate import NetState
from agents.trains import FRAME, HEADER, MAGIC, Trains, shape, train_rate


def spaced(n: int, rate_mbps: float, burst: int = 0, t0: int = 10**9) -> list[int]:
    """Arrival times of ``n`` frames through a shaper of ``rate_mbps`` that lets the first
    ``burst`` through at once."""
    gap = FRAME * 8 / (rate_mbps * 1e6) * 1e9
    return [t0 + int(max(0, i - burst) * gap) for i in range(n)]


def sent(n: int, gap_us: float = 5.0, t0: int = 0) -> list[int]:
    """Send times of ``n`` datagrams a sender writes ``gap_us`` apart."""
    return [t0 + int(i * gap_us * 1e3) for i in range(n)]


def test_train_rate_is_the_second_halfs_dispersion_whatever_the_burst():
    assert train_rate(spaced(64, 100.0), sent(64)) == pytest.approx(100.0, rel=1e-3)
    assert train_rate(spaced(64, 100.0, burst=20), sent(64)) == pytest.approx(100.0, rel=1e-3)  # burst < half
    assert train_rate(spaced(64, 100.0, burst=20)[:1] + spaced(64, 100.0, burst=20)[5:],
                      sent(64)[:1] + sent(64)[5:]) == pytest.approx(100.0, rel=0.01)


def test_train_rate_shrugs_off_a_few_datagrams_handed_over_together():
    """A receiver busy for a moment timestamps the datagrams that waited all at once: the span
    from the first to the last of the half would read 1.4x the rate, the median pair does not."""
    arrivals = spaced(64, 50.0)
    held = arrivals[32:40]
    arrivals[32:40] = [held[-1]] * len(held)  # the first 8 of the second half, handed over together
    assert (31 * FRAME * 8 / ((arrivals[-1] - arrivals[32]) / 1e9) / 1e6) > 1.25 * 50
    assert train_rate(arrivals, sent(64)) == pytest.approx(50.0, rel=0.02)


def test_train_rate_is_none_when_a_burst_took_most_of_its_pairs():
    """A train an emulated 50 Mbit/s link carried (receive and send times in us, as the agent
    recorded them): the sender was descheduled for 6.3 ms after datagram 21, the link went idle,
    and its shaper passed the next five at once; the pairs starting among them read 51-100
    Mbit/s, their median 67."""
    rx = [0, 42, 294, 298, 301, 304, 484, 702, 941, 1195, 1427, 1673, 1915, 2158, 2396, 2712, 2890, 3128,
          3376, 3615, 3850, 6791, 6803, 6808, 6811, 6813, 7046, 7271, 7500, 7756, 7984, 8250, 8484, 8719]
    tx = [0, 51, 342, 351, 357, 363, 369, 388, 395, 399, 403, 407, 411, 414, 429, 443, 448, 462, 467, 479,
          491, 6786, 6855, 6863, 6869, 6874, 6880, 6893, 6898, 6902, 6906, 6909, 6913, 6917]
    us = 1000
    assert train_rate([t * us for t in rx], [t * us for t in tx]) is None


def test_train_rate_keeps_frames_a_relay_sent_two_at_a_time():
    """Two frames due close together that a relay sends in one call are no burst: a train of
    such pairs reads the link."""
    arrivals = spaced(32, 50.0)
    for i in range(17, 32, 3):  # every third frame of the second half 2 us after its predecessor
        arrivals[i] = arrivals[i - 1] + 2000
    assert train_rate(arrivals, sent(32)) == pytest.approx(50.0, rel=0.05)


def test_train_rate_counts_only_what_arrived():
    """Datagrams dropped at the shaper's queue took no link time: the rest keep their spacing."""
    arrivals = spaced(40, 50.0)  # the 40 that got through of a longer train
    sends = sent(80)[::2]  # every other one of 80 was dropped
    assert train_rate(arrivals, sends) == pytest.approx(50.0, rel=1e-3)
    assert train_rate(arrivals[:6], sends[:6]) is None  # fewer than 4 in the second half
    assert train_rate([5] * 20, sent(20)) is None  # no time between them


def test_train_rate_is_none_when_the_link_did_not_space_the_datagrams():
    """Datagrams that arrived no slower than they were sent measured the sender or a burst,
    not the link: a relay that held the whole train and passed it on at once read 2-15x."""
    burst = [10**9 + i * 1000 for i in range(64)]  # 1 us apart, sent 5 us apart
    assert train_rate(burst, sent(64)) is None
    stalled = sent(64, gap_us=300.0)  # a sender slower than the 50 Mbit/s link (242 us a frame)
    assert train_rate([t + 10**7 for t in stalled], stalled) is None
    # a sender descheduled for 5 ms once in the second half (datagrams 32-63, pairs 16 apart):
    # the pairs over the gap arrived as slowly as they were sent and are left out, the others
    # still read the link; with the gap at 48 every pair spans it, and the train gives no rate
    def descheduled(at: int) -> tuple[list[int], list[int]]:
        sends, arrivals = sent(64), spaced(64, 50.0)
        sends[at:] = [t + 5 * 10**6 for t in sends[at:]]
        arrivals[at:] = [max(a, s + 10**5) for a, s in zip(arrivals[at:], sends[at:])]
        return arrivals, sends
    assert train_rate(*descheduled(40)) == pytest.approx(50.0, rel=0.02)
    assert train_rate(*descheduled(48)) is None


@pytest.mark.parametrize("rate", [2.5, 20.0, 100.0, 155.0, 1000.0, 20000.0])
def test_trains_last_about_8_ms_and_take_the_duty_share(rate):
    n, every = shape(rate, 0.005)
    assert 32 <= n <= 1000
    assert n * FRAME * 8 / every == pytest.approx(0.005 * rate * 1e6)
    if 32 < n < 1000:
        assert n * FRAME * 8 / (rate * 1e6) == pytest.approx(8e-3, rel=0.1)


def test_trains_between_two_endpoints_over_real_sockets_and_hostile_datagrams_refused():
    ports = []
    for _ in range(2):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    got, lock = [], threading.Lock()

    def report(src, rate, send_ns, recv_ns):
        with lock:
            got.append((src, rate, send_ns, recv_ns))

    nodes = ["a", "b"]
    a = Trains(0, nodes, ports[0], [("b", "127.0.0.1", ports[1], 32, 0.2)], report)
    b = Trains(1, nodes, ports[1], [], report)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as evil:  # short, bad magic, unknown sender, self
        for d in (b"x", HEADER.pack(b"nope", 0, 1, 0, 2, 0), HEADER.pack(MAGIC, 9, 1, 0, 2, 0),
                  HEADER.pack(MAGIC, 1, 1, 0, 2, 0), HEADER.pack(MAGIC, 0, 1, 5, 2, 0)):
            evil.sendto(d, ("127.0.0.1", ports[1]))
    a.start(), b.start()
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(got) < 3:
            time.sleep(0.05)
    finally:
        a.close(), b.close()
    assert len(got) >= 3 and b.refused == 5 and b.received == len(got) and a.sent >= len(got)
    for src, rate, send_ns, recv_ns in got:
        # loopback passes datagrams on as fast as they are sent: mostly no link spacing, no rate
        assert src == "a" and (rate is None or rate > 0) and 0 <= recv_ns - send_ns < 50e6


def test_scheduler_takes_train_reports_on_its_clock_and_refuses_malformed_ones():
    from agents import netstate

    net = NetState(["a", "b"], truth=lambda s, d: {"rate_mbps": 100.0, "delay_ms": 20.0})
    net.set_offset("b", 500_000_000, 1000)  # b's clock 500 ms ahead
    e = net.add_train({"src": "a", "dst": "b", "rate_mbps": 96.0, "send_ns": 10**12,
                       "recv_ns": 10**12 + 520_000_000})
    assert e["source"] == "train" and e["sample_owd_ms"] == pytest.approx(20.0)
    assert e["link_mbps"] is None and net.latest() == {}  # a link's only train: nothing shows whether it met a queue
    assert e["owd_ms"] is None  # one window may have met a queue: the delay is the least of several
    for r in (60.0, 95.0):  # these met data: a share of the rate, and 10 ms of queue
        e = net.add_train({"src": "a", "dst": "b", "rate_mbps": r, "send_ns": 10**12, "recv_ns": 10**12 + 530_000_000})
        assert e["queued"] and e["link_mbps"] == 96.0
    assert e["sample_owd_ms"] == pytest.approx(30.0) and e["owd_ms"] is None
    assert net.latest()[("a", "b")]["rate_mbps"] == 96.0
    for _ in range(netstate.OWD_WINDOWS - 3):  # more windows, all with the queue
        e = net.add_train({"src": "a", "dst": "b", "rate_mbps": 95.0, "send_ns": 10**12,
                           "recv_ns": 10**12 + 530_000_000})
    assert e["owd_ms"] == pytest.approx(20.0)  # the least of OWD_WINDOWS
    # the other way round: the first train met a queue, which only the second's delay shows
    net = NetState(["a", "b"])
    first = net.add_train({"src": "a", "dst": "b", "rate_mbps": 50.0, "send_ns": 0, "recv_ns": 30_000_000})
    second = net.add_train({"src": "a", "dst": "b", "rate_mbps": 100.0, "send_ns": 0, "recv_ns": 20_000_000})
    assert first["link_mbps"] is None and second["link_mbps"] == 100.0
    n = len(net.series)  # a train the link did not spread out: counted, no estimate
    assert net.add_train({"src": "a", "dst": "b", "rate_mbps": None, "send_ns": 1, "recv_ns": 2}) is None
    assert len(net.series) == n and net.report()["unrated_trains"] == {"a>b": 1}
    for bad in ({"src": "a", "dst": "a"}, {"src": "a", "dst": "b", "rate_mbps": "fast", "send_ns": 1, "recv_ns": 2},
                {"src": "a", "dst": "b", "rate_mbps": -1.0, "send_ns": 1, "recv_ns": 2},
                {"src": "a", "dst": "b", "rate_mbps": 1.0, "send_ns": 1.5, "recv_ns": 2}):
        with pytest.raises(ValueError):
            net.add_train(bad)


def test_link_estimate_is_the_median_train_or_the_largest_lower_bound_of_recent_ones(monkeypatch):
    """Of the trains that met no queue the (upper) median of the last 3 counts; chunk windows and
    trains that met a queue only ever read low (a share of the link): their largest counts; the
    larger of the two is the link's estimate, from windows no older than RECENT_S."""
    from agents import netstate

    net = NetState(["a", "b"])
    def train(r):
        return net.add_train({"src": "a", "dst": "b", "rate_mbps": r, "send_ns": 1, "recv_ns": 2})
    assert [train(r)["link_mbps"] for r in (100.0, 60.0, 130.0, 98.0)] == [None, 100.0, 100.0, 98.0]
    monkeypatch.setattr(netstate, "RECENT_S", 0.05)
    time.sleep(0.1)
    assert train(40.0)["link_mbps"] == 40.0  # the rate fell: older trains aged out
    queued = net.add_train({"src": "a", "dst": "b", "rate_mbps": 50.0, "send_ns": 1, "recv_ns": 10**7})
    assert queued["queued"] and queued["link_mbps"] == 50.0  # 10 ms of queue, yet 50 got through: a lower bound
    assert train(41.0)["link_mbps"] == 50.0


def test_a_flood_of_train_starts_is_bounded():
    from agents.trains import MAX_OPEN

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    got = []
    b = Trains(1, ["a", "b"], port, [], lambda *r: got.append(r), bind="127.0.0.1").start()
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as evil:  # 100 trains' first datagrams
            for tid in range(100):
                evil.sendto(HEADER.pack(MAGIC, 0, tid, 0, 1000, 0), ("127.0.0.1", port))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and b.refused < 100 - MAX_OPEN:
            time.sleep(0.05)
    finally:
        b.close()
    assert b.refused == 100 - MAX_OPEN and not got  # none reported: one datagram is no train
