"""The jitter model both shaping paths carry out (testbed/emulator/jitter.py), without a network."""

import numpy as np
import pytest

from testbed.emulator import jitter
from testbed.emulator.shaping import _leaf
from testbed.errors import ConfigError
from testbed.topology import LinkDir, load_topology


@pytest.mark.parametrize("dist", jitter.DISTRIBUTIONS)
def test_delay_is_the_mean_and_jitter_the_standard_deviation_whatever_the_distribution(dist):
    """netem's MU and SIGMA are derived so that its table's draws have mean delay_ms and
    standard deviation jitter_ms (where no draw falls below 0)."""
    d = jitter.draws(30, 4, dist)
    assert d.mean() == pytest.approx(30, abs=1e-3) and d.std() == pytest.approx(4, rel=1e-3)
    assert jitter.std_ms(30, 4, dist) == pytest.approx(4, rel=1e-3)
    lo, hi = jitter.range_ms(30, 4, dist)
    assert lo < 30 < hi and hi - lo < 8 * 4


def test_netem_parameters_follow_each_table():
    """normal: netem's SIGMA is the standard deviation; uniform: netem draws from
    [MU - SIGMA, MU + SIGMA), so SIGMA = sqrt(3) x the standard deviation; pareto's table has a
    standard deviation of 0.82 and a mean of -0.033."""
    mu, sigma = jitter.netem_params(20, 4, "normal")
    assert sigma == pytest.approx(4, rel=1e-3) and mu == pytest.approx(20, abs=0.01)
    assert jitter.netem_params(20, 4, "uniform") == pytest.approx((20, 4 * 3 ** 0.5))
    mu, sigma = jitter.netem_params(20, 4, "pareto")
    assert sigma == pytest.approx(4 / 0.8197, rel=1e-3) and mu == pytest.approx(20 + 0.0335 * sigma, rel=1e-3)
    assert jitter.netem_params(20, 0, "pareto") == (20, 0)


def test_netem_gets_the_derived_parameters_and_its_table():
    leaf = _leaf(LinkDir(40, 20, 4, distribution="pareto"), "netem")
    mu, sigma = jitter.netem_params(20, 4, "pareto")
    assert leaf[leaf.index("delay"):leaf.index("rate")] == ["delay", f"{mu * 1e3:.3f}us", f"{sigma * 1e3:.3f}us",
                                                           "distribution", "pareto"]
    uni = _leaf(LinkDir(40, 20, 4, distribution="uniform"), "netem")
    assert "distribution" not in uni and f"{4e3 * 3 ** 0.5:.3f}us" in uni  # netem's own uniform
    assert _leaf(LinkDir(40, 20), "netem")[3:5] == ["delay", "20ms"]


@pytest.mark.parametrize("dist", ["normal", "pareto"])
def test_fifo_order_model_agrees_with_the_simulated_stream(dist):
    """A stream whose packets are closer than the jitter's range is held in FIFO order: the
    product formula (fifo_cdf) and a simulation of the rule due = max(previous due, arrival +
    draw) agree; back to back at 40 Mbit/s (0.3 ms apart) the median delay rises by over
    a standard deviation for a normal jitter, and the spread shrinks."""
    sim = jitter.simulate(1000, 20, 4, dist, spacing_ms=0.3, runs=200, seed=1)[:, 200:].ravel()
    qs = [0.1, 0.5, 0.9]
    assert np.quantile(sim, qs) == pytest.approx(jitter.quantiles(qs, 20, 4, dist, spacing_ms=0.3), abs=0.15)
    if dist == "normal":
        assert 24.5 < np.median(sim) < 26 and sim.std() < 0.6 * 4


def test_fifo_free_spacing_holds_a_probe_back_rarely():
    for dist in jitter.DISTRIBUTIONS:
        s = jitter.fifo_free_spacing_ms(4, dist)
        sim = jitter.simulate(20000, 100, 4, dist, spacing_ms=s, seed=2)[0]
        free = jitter.simulate(20000, 100, 4, dist, seed=2)[0]
        assert np.mean(~np.isclose(sim, free)) <= 2e-3, dist
    assert jitter.fifo_free_spacing_ms(0) == 0


def test_the_distribution_is_a_link_field():
    t = load_topology({"name": "t", "defaults": {"distribution": "pareto"}, "datacenters": ["a", "b", "c"],
                       "links": [{"between": ["a", "b"], "rate_mbps": 10, "jitter_ms": 2,
                                  "distribution": ["uniform", "paretonormal"]},
                                 {"between": ["b", "c"], "rate_mbps": 10, "jitter_ms": 2}]})
    assert [(d.distribution) for l in t.links for d in (l.ab, l.ba)] == ["uniform", "paretonormal", "pareto", "pareto"]
    assert load_topology(t.to_dict()).links == t.links
    assert load_topology({"name": "t", "datacenters": ["a", "b"],
                          "links": [{"between": ["a", "b"], "rate_mbps": 10}]}).links[0].ab.distribution == "normal"
    with pytest.raises(ConfigError, match="links\\[0\\].distribution.*expected a jitter distribution, one of normal, "
                                          "uniform, pareto, paretonormal; got 'gauss'"):
        load_topology({"name": "t", "datacenters": ["a", "b"],
                       "links": [{"between": ["a", "b"], "rate_mbps": 10, "distribution": "gauss"}]})
