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


def test_bench_emulator_searches_three_ways_and_measures_a_failure_twice(tmp_path, monkeypatch):
    """Relay under TCP, relay and HTB alone under UDP; the ratio is the UDP pair's.  A scale that
    fails narrowly once (a machine-wide stall) is measured again: it fails only twice in a row;
    a gross failure (fewer than half the directions in tolerance) is not measured again."""
    import testbed.emulator.linkcheck as linkcheck
    from testbed.bench import bench_emulator

    limits = {("relay", "tcp"): 2.0, ("relay", "udp"): 0.3, ("htb", "udp"): 0.5}
    calls = []

    def fake(topo, *, load, **kw):
        path = "htb" if topo.name.endswith("-htb-only") else "relay"
        calls.append((path, load, topo.scale))
        ok = topo.scale <= limits[(path, load)] and calls.count((path, load, topo.scale)) > (topo.scale == 1.0)
        near = topo.scale <= 1.5 * limits[(path, load)]  # beyond: every direction out of tolerance
        return {"ok": ok, "directions": [{"ok": ok or near, "rate_ratio": 1.0 if ok else 0.5}, {"ok": ok}],
                "emulation_kept_up": {"ok": True, "reasons": []}, "steal": 0.0}

    monkeypatch.setattr(linkcheck, "run_linkcheck", fake)
    res = bench_emulator(tmp_path, lambda m: None, topology="small-3")
    assert [k for k in res if "-" in k and k != "capacity_mbps_at_scale_1"] == ["relay-tcp", "relay-udp", "htb-udp"]
    assert calls[:2] == [("relay", "tcp", 1.0)] * 2  # failed once at 1.0, measured again: passed
    assert [r["attempt"] for r in res["relay-tcp"]["runs"][:2]] == [1, 2]
    for (path, load), limit in limits.items():
        best = res[f"{path}-{load}"]["max_scale"]
        assert limit / 1.1 <= best <= limit
        runs = res[f"{path}-{load}"]["runs"]
        for s in {r["scale"] for r in runs if r["scale"] > limit}:
            assert sum(r["scale"] == s for r in runs) == (2 if s <= 1.5 * limit else 1), (path, load, s)
    assert res["ratio"] == res["relay-udp"]["max_scale"] / res["htb-udp"]["max_scale"]
    assert (tmp_path / "relay-tcp-scale-1-2.json").exists()
