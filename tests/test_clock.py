"""Clock offsets NTP-style (testbed.clock) and the agent's side of the exchange (agents.clock)."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from testbed.clock import estimate

REPO = Path(__file__).resolve().parent.parent
MS = 1_000_000


def _exchange(t0: int, offset: int, out_ns: int, back_ns: int, hold_ns: int = 0) -> tuple:
    """What a remote ``offset`` ns ahead reports when the probe takes ``out_ns`` there and
    the answer ``back_ns`` back."""
    t1 = t0 + out_ns + offset
    return t0, t1, t1 + hold_ns, t0 + out_ns + hold_ns + back_ns


def test_symmetric_paths_give_the_exact_offset():
    for offset in (0, 1234 * MS, -5 * MS):
        got = estimate([_exchange(10**18, offset, 3 * MS, 3 * MS, hold_ns=2 * MS)])
        assert got.offset_ns == offset and got.rtt_ns == 6 * MS


def test_the_least_delayed_exchange_wins():
    """Queueing in one direction biases an exchange by half the extra delay; of several,
    the one with the least round trip is used, whatever its position."""
    offset = 700 * MS
    exchanges = [_exchange(i * 10**9, offset, out, back) for i, (out, back) in
                 enumerate([(40 * MS, 1 * MS), (1 * MS, 1 * MS), (1 * MS, 30 * MS), (9 * MS, 2 * MS)])]
    got = estimate(exchanges)
    assert got.offset_ns == offset and got.rtt_ns == 2 * MS
    # the error bound holds for every single exchange
    for ex in exchanges:
        one = estimate([ex])
        assert abs(one.offset_ns - offset) <= one.rtt_ns / 2


def test_bad_input():
    with pytest.raises(ValueError, match="no exchanges"):
        estimate([])
    with pytest.raises(ValueError, match="backwards"):
        estimate([(10, 5, 6, 9)])


def test_agent_clock_echo_and_shift():
    """``python3 -m agents.clock --offset-ms X`` answers on a clock X ms ahead of this one
    (as the agent option ``clock_offset_ms`` shifts the agent's), and the estimate finds it."""
    for shift_ms in (0, 2500, -800):
        p = subprocess.Popen([sys.executable, "-m", "agents.clock", "--offset-ms", str(shift_ms)], cwd=REPO,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            exchanges = []
            for _ in range(8):
                t0 = time.time_ns()
                p.stdin.write(b"\n")
                p.stdin.flush()
                t1, t2 = map(int, p.stdout.readline().split())
                exchanges.append((t0, t1, t2, time.time_ns()))
            p.stdin.close()
            assert p.wait(timeout=10) == 0  # exits at end of input
        finally:
            p.kill()
        got = estimate(exchanges)
        assert abs(got.offset_ns / MS - shift_ms) <= max(got.rtt_ns / MS / 2, 0.05), (got, shift_ms)


def test_agent_option_shifts_every_timestamp():
    code = ("import time, json; from agents import clock; a = time.time_ns(); clock.shift(1500); "
            "b = time.time_ns(); c = time.time(); print(json.dumps([a, b, c]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    a, b, c = __import__("json").loads(out)
    assert 1500 * MS <= b - a < 1600 * MS and abs(c * 1e9 - b) < 100 * MS
