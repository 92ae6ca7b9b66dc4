"""Both link-shaping paths, side by side, on a real emulated link with delay, jitter and
loss: the kernel's ``htb+netem`` (where the kernel has netem: most users' machines, and
the Debian guest of ``python3 -m testbed.vm stage``) and ``htb+user-space-relay`` (where it
has not: this project's CI host).  The netem cases are skipped, saying so, on a kernel
without netem; the VM stage runs them in a guest that has it."""

import re
import statistics

import pytest

from testbed.emulator.capabilities import probe
from testbed.emulator.network import WanNetwork
from testbed.emulator.shaping import METHODS
from testbed.results import CpuMeter
from testbed.topology import load_topology

from fidelity import fidelity

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


def test_auto_chooses_netem_where_the_kernel_has_it(netenv):
    """``method: auto`` (every experiment's default) is netem exactly where netem works."""
    with WanNetwork(_lossy_pair(), log=lambda m: None) as net:
        assert net.method == ("netem" if probe().netem else "relay")
