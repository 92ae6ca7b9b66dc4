"""``bench emulator``'s pure parts: the scale search and the HTB-only copy of a topology
(the benchmark itself builds networks: run it with ``python3 -m testbed bench emulator``)."""

from __future__ import annotations

import pytest

from testbed.bench import largest_passing, without_delays
from testbed.topology import load_topology


@pytest.mark.parametrize("threshold", [0.13, 0.7, 1.0, 1.37, 2.9])
def test_largest_passing_brackets_the_threshold(threshold):
    calls = []

    def passes(x):
        calls.append(x)
        return x <= threshold

    best, tried = largest_passing(passes, lo=0.1, hi=4.0, precision=1.05)
    assert best is not None and best <= threshold
    failing = [x for x, ok in tried if not ok]
    assert not failing or min(failing) / best <= 1.05 and min(failing) > threshold
    assert [x for x, _ in tried] == calls and len(calls) < 20


def test_largest_passing_limits():
    assert largest_passing(lambda x: True, hi=3.0)[0] == 3.0
    best, tried = largest_passing(lambda x: False, lo=0.5)
    assert best is None and tried[-1] == (0.5, False)


def test_without_delays_keeps_rates_and_queues():
    topo = load_topology("netstorm-internet2-9")
    bare = without_delays(topo)
    assert [l.ab.rate_mbps for l in bare.links] == [l.ab.rate_mbps for l in topo.links]
    assert [l.ba.queue_pkts for l in bare.links] == [l.ba.queue_pkts for l in topo.links]
    assert all(d.delay_ms == d.jitter_ms == d.loss == 0 for l in bare.links for d in (l.ab, l.ba))
    assert any(l.ab.delay_ms for l in topo.links)  # the original is untouched
