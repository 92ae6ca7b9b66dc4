"""Re-planning policy (testbed.runtime.closed_loop.replanner): the same pure planner on estimated or true
rates, every update_s, switching only when the plan changes.  No network."""

from __future__ import annotations

import pytest

from testbed import config
from testbed.errors import ConfigError
from testbed.experiment import build_plan
from testbed.runtime.closed_loop import replanner

EXP = {"name": "replan", "topology": "small-3", "workload": {"size": "8MB"},
       "scheme": {"name": "netstorm", "adaptive": {"update_s": 5, "min_gain": 0}}}


class FakeNet:
    def __init__(self, rates):
        self.rates = rates

    def latest(self):
        return {k: {"rate_mbps": r, "owd_ms": 1.0, "age_s": 0.1} for k, r in self.rates.items()}


def both(a, b, r):
    return {(a, b): r, (b, a): r}


NOMINAL = {**both("h1", "h2", 80), **both("h2", "h3", 50), **both("h1", "h3", 20)}
SKEWED = {**both("h1", "h2", 5), **both("h2", "h3", 5), **both("h1", "h3", 150)}


def parents(plan):
    return sorted((t["root"], tuple(sorted(t["parent"].items()))) for t in plan.meta["trees"])


def test_replans_on_estimates_every_update_s_and_reuses_known_plans():
    exp = config.validate(EXP)
    plan0 = build_plan(exp)[2]
    now = [0.0]
    policy = replanner(exp, exp.scheme, plan0, clock=lambda: now[0])
    net = FakeNet(NOMINAL)
    assert policy(0, net) is None  # not yet update_s
    now[0] = 6
    assert policy(1, net) is None  # estimates as planned: same plan, no switch
    net.rates = SKEWED
    now[0] = 8
    assert policy(2, net) is None  # 2 s after the last decision
    now[0] = 12
    new = policy(3, net)
    assert new is not None and new.programs != plan0.programs
    uses = {(c, p) for _, par in parents(new) for c, p in par if p}
    assert ("h1", "h3") in uses or ("h3", "h1") in uses  # the link that became fastest
    net.rates = NOMINAL
    now[0] = 18
    assert policy(4, net) is plan0  # back to the first plan: the same version, not a new one


def test_min_gain_keeps_the_plan_unless_the_new_one_is_predicted_faster_by_it():
    exp = config.validate({**EXP, "scheme": {"name": "netstorm", "adaptive": {"update_s": 5, "min_gain": 0.99}}})
    plan0 = build_plan(exp)[2]
    now = [0.0]
    policy = replanner(exp, exp.scheme, plan0, clock=lambda: now[0])
    now[0] = 6
    assert policy(1, FakeNet(SKEWED)) is None  # a different plan, but not 100x faster
    exp = config.validate({**EXP, "scheme": {"name": "netstorm", "adaptive": {"update_s": 5, "min_gain": 0.3}}})
    now[0] = 0.0
    policy = replanner(exp, exp.scheme, plan0, clock=lambda: now[0])
    now[0] = 6
    assert policy(1, FakeNet(SKEWED)) is not None  # the skewed rates make the old plan > 30 % slower
    with pytest.raises(ConfigError, match="min_gain"):
        config.validate({**EXP, "scheme": {"name": "netstorm", "adaptive": {"min_gain": 1}}})


def test_oracle_mode_and_static_schemes():
    exp = config.validate({**EXP, "scheme": {"name": "netstorm", "adaptive": {"update_s": 1, "mode": "oracle"}}})
    plan0 = build_plan(exp)[2]
    now = [0.0]
    def truth(s, d):
        return {"rate_mbps": SKEWED[(s, d)], "delay_ms": 1.0}
    policy = replanner(exp, exp.scheme, plan0, truth, clock=lambda: now[0])
    now[0] = 2
    assert policy(1, FakeNet({})).programs != plan0.programs
    with pytest.raises(ConfigError, match="oracle"):
        replanner(exp, exp.scheme, plan0)
    static = config.validate({**EXP, "scheme": {"name": "netstorm", "adaptive": False}})
    assert config.validate({**EXP, "scheme": {"name": "netstorm"}}).scheme["adaptive"]["update_s"] == 5  # NetStorm-std
    assert replanner(static, static.scheme, plan0) is None
    probe_only = config.validate({**EXP, "scheme": {"name": "mst", "adaptive": {"update_s": 0}}})
    assert probe_only.scheme["adaptive"]["probe_chunk_num"] == 4
    assert replanner(probe_only, probe_only.scheme, plan0) is None
    with pytest.raises(ConfigError, match="scheme.adaptive.estimator"):
        config.validate({**EXP, "scheme": {"name": "mst", "adaptive": {"estimator": "median"}}})


def test_probe_chunk_bytes_larger_than_every_transfer_is_refused():
    """A plan whose chunks are all below probe_chunk_bytes would never measure a link: the
    adaptive scheme would silently stay static (netstorm-aux's std variant once did)."""
    base = {"name": "t", "topology": "quick-5", "workload": {"size": "4MB"}}
    exp = config.validate({**base, "scheme": {"name": "netstorm", "chunk_elems": 100_000,
                                              "adaptive": {"probe_chunk_bytes": 2_000_000}}})
    with pytest.raises(ConfigError) as e:
        build_plan(exp)
    assert e.value.key == "scheme.adaptive.probe_chunk_bytes" and "largest is 371460 bytes" in str(e.value)
    ok = config.validate({**base, "scheme": {"name": "netstorm", "chunk_elems": 100_000,
                                             "adaptive": {"probe_chunk_bytes": 371_460}}})
    build_plan(ok)


def test_packet_trains_on_every_directed_link_at_the_duty_asked_and_off_at_zero():
    from testbed.runtime.closed_loop import probe_options

    exp = config.validate(EXP)
    probe = probe_options(exp.scheme, exp.topology.graph())
    assert probe["trains"]["duty"] == 0.008
    assert sorted((u, v) for u, v, _ in probe["trains"]["links"]) == sorted(exp.topology.graph().edges)
    off = config.validate({**EXP, "scheme": {"name": "netstorm", "adaptive": {"train_duty": 0}}})
    assert "trains" not in probe_options(off.scheme, off.topology.graph())
    for bad in (-0.1, 0.2, "lots"):
        with pytest.raises(ConfigError, match="train_duty"):
            config.validate({**EXP, "scheme": {"name": "netstorm", "adaptive": {"train_duty": bad}}})
