"""Dynamics and faults: validation and the scheduler's timing, against a recording fake network."""

import time

import pytest

from testbed import config
from testbed.emulator.dynamics import Scheduler, rates_at, scaled
from testbed.errors import ConfigError
from testbed.topology import load_topology

BASE = {"name": "t", "topology": "small-3", "scheme": {"name": "ring"}}


class FakeNet:
    def __init__(self, topo):
        self.topo = topo
        self.calls = []
        self.t0 = time.monotonic()

    def _log(self, *call):
        self.calls.append((round(time.monotonic() - self.t0, 2), *call))

    def set_rate(self, src, dst, rate):
        self._log("rate", src, dst, rate)

    def set_link(self, a, b, up):
        self._log("link", a, b, up)

    def set_host(self, dc, up):
        self._log("host", dc, up)


def test_inline_and_trace_dynamics_are_normalised(tmp_path):
    trace = tmp_path / "rates.csv"
    trace.write_text("time_s,src,dst,rate_mbps\n0.5,h1,h2,10\n1.0,h2,h1,20\n")
    exp_file = tmp_path / "e.yaml"
    exp = config.validate({**BASE, "dynamics": [{"at_s": 0.2, "link": ["h1", "h3"], "rate_mbps": [5, 6]},
                                                {"trace": "rates.csv"}]}, str(exp_file))
    got = sorted((d["at_s"], d["src"], d["dst"], d["rate_mbps"]) for d in exp.dynamics)
    assert got == [(0.2, "h1", "h3", 5.0), (0.2, "h3", "h1", 6.0), (0.5, "h1", "h2", 10.0), (1.0, "h2", "h1", 20.0)]


def test_dynamics_are_scaled_once_in_the_experiment(tmp_path):
    """The typed experiment holds rates scaled like its topology; results.json the file's."""
    exp = config.validate({**BASE, "scale": 0.5, "dynamics": [
        {"at_s": 0.2, "link": ["h1", "h3"], "rate_mbps": [5, 6]},
        {"redraw": {"lo": 20, "hi": 155, "every_s": 9, "seed": 3}}]}, str(tmp_path / "e.yaml"))
    rates = sorted(d["rate_mbps"] for d in exp.dynamics if "rate_mbps" in d)
    assert rates == [2.5, 3.0]
    assert [d["redraw"]["scale"] for d in exp.dynamics if "redraw" in d] == [0.5]
    assert sorted(d["rate_mbps"] for d in exp.to_dict()["dynamics"] if "rate_mbps" in d) == [5.0, 6.0]


@pytest.mark.parametrize("bad, key", [
    ({"at_s": 1, "link": ["h1", "h9"], "rate_mbps": 5}, "dynamics[0].link[1]"),
    ({"at_s": -1, "link": ["h1", "h2"], "rate_mbps": 5}, "dynamics[0].at_s"),
    ({"at_s": 1, "link": ["h1", "h2"], "rate_mbps": 0}, "dynamics[0].rate_mbps"),
    ({"redraw": {"lo": 50, "hi": 20}}, "dynamics[0].redraw.hi"),
    ({"trace": "missing.csv"}, "dynamics[0].trace"),
])
def test_bad_dynamics_name_the_key(tmp_path, bad, key):
    with pytest.raises(ConfigError) as e:
        config.validate({**BASE, "dynamics": [bad]}, str(tmp_path / "e.yaml"))
    assert key in str(e.value)


def test_scheduler_applies_changes_on_time_scaled():
    topo = load_topology("small-3")
    net = FakeNet(topo)
    dyn = scaled([{"at_s": 0.1, "src": "h1", "dst": "h2", "rate_mbps": 40.0}], 0.5)
    faults = [{"at_s": 0.2, "link_down": ["h1", "h2"]}, {"at_s": 0.3, "link_up": ["h1", "h2"]},
              {"at_s": 0.35, "crash": "h3"}]
    s = Scheduler(net, dyn, faults).start()
    time.sleep(0.6)
    s.stop()
    kinds = [c[1:] for c in net.calls]
    assert kinds == [("rate", "h1", "h2", 20.0), ("link", "h1", "h2", False), ("link", "h1", "h2", True),
                     ("host", "h3", False)]
    assert [c[0] for c in net.calls] == pytest.approx([0.1, 0.2, 0.3, 0.35], abs=0.05)
    assert not s.errors


def test_netstorm_redraw_is_seeded_and_in_range():
    topo = load_topology("small-3")
    runs = []
    for _ in range(2):
        net = FakeNet(topo)
        s = Scheduler(net, scaled([{"redraw": {"lo": 20, "hi": 155, "every_s": 0.1, "seed": 1}}], 2.0), []).start()
        time.sleep(0.35)
        s.stop()
        runs.append([c[1:] for c in net.calls][:12])
    assert runs[0] == runs[1]  # same seed, same draws
    rates = [c[3] for c in runs[0]]
    assert len(rates) == 12 and all(40 <= r <= 310 and r % 2 == 0 for r in rates)  # integers in [20,155], x2
    assert {(c[1], c[2]) for c in runs[0][:6]} == {(l.a, l.b) for l in topo.links} | {(l.b, l.a) for l in topo.links}


def test_rates_at_replays_what_the_scheduler_applies():
    """``plan --at-s`` plans on the rates the live scheduler sets by then: same draws, same order,
    a later change of one direction on top, the topology's rates before anything happened."""
    topo = load_topology("small-3")
    dyn = scaled([{"redraw": {"lo": 20, "hi": 155, "every_s": 0.3, "seed": 4}},
                  {"at_s": 0.4, "src": "h2", "dst": "h3", "rate_mbps": 7.0}], 0.5)
    net = FakeNet(topo)
    s = Scheduler(net, dyn, []).start()
    time.sleep(0.5)
    s.stop()
    live = {}
    for _, _, src, dst, rate in [c for c in net.calls if c[1] == "rate"]:
        live[(src, dst)] = rate
    assert len(net.calls) == 7 and live[("h2", "h3")] == 3.5
    assert rates_at(topo, dyn, 0.5) == live
    nominal = {(l.a, l.b): l.ab.rate_mbps for l in topo.links} | {(l.b, l.a): l.ba.rate_mbps for l in topo.links}
    assert rates_at(topo, dyn, 0.1) == nominal
    assert rates_at(topo, dyn, 0.35) != nominal and rates_at(topo, dyn, 0.35)[("h2", "h3")] != 3.5


def test_plan_at_a_time_plans_on_the_rates_then(tmp_path):
    """`plan --at-s T` plans (and bounds) on the rates the dynamics give at T: an MST that
    avoids a link slowed at 5 s, and a bound that follows the change."""
    import json
    import subprocess
    import sys

    import yaml

    from testbed.results import REPO

    f = tmp_path / "e.yaml"
    f.write_text(yaml.safe_dump({**BASE, "scheme": {"name": "mst"},
                                 "dynamics": [{"at_s": 5, "link": ["h1", "h2"], "rate_mbps": 1}]}))

    def plan(*extra):
        res = subprocess.run([sys.executable, "-m", "testbed", "plan", str(f), "--json", *extra], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr[-2000:]
        return json.loads(res.stdout)

    before, after = plan(), plan("--at-s", "5")
    assert before["at_s"] is None and after["at_s"] == 5
    def edges(p):
        return {frozenset((c, q)) for c, q in p["plan"]["trees"][0]["parent"].items() if q}
    assert frozenset(("h1", "h2")) in edges(before) and frozenset(("h1", "h2")) not in edges(after)
    assert after["bound"]["cut_rate_mbps"] < before["bound"]["cut_rate_mbps"]
    assert plan("--at-s", "4.9")["plan"]["trees"] == before["plan"]["trees"]
    bad = subprocess.run([sys.executable, "-m", "testbed", "plan", str(f), "--at-s", "-1"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--at-s" in bad.stderr


@pytest.mark.net
def test_dynamics_per_run_replays_them_for_every_variant(netenv, tmp_path):
    """dynamics_per_run: each run starts on the healthy network and sees the change and the
    fault 0.3 s into its measured phase (events: the change, the restore before the second
    run, the change again; the link cut, back up before the second run, cut again), after its
    first GO however long its agents took to start.  PS's hub is h2: h1-h3, which the fault
    cuts for good, carries none of its data."""
    import json
    import subprocess
    import sys

    import yaml

    from testbed.results import REPO

    exp = {**BASE, "scheme": {"name": "ps"}, "variants": [{"label": "ps-again", "scheme": {"name": "ps"}}],
           "dynamics_per_run": True, "workload": {"size": "256KB", "iterations": 6, "compute_s": 0.15},
           "dynamics": [{"at_s": 0.3, "link": ["h1", "h2"], "rate_mbps": 20}],
           "faults": [{"at_s": 0.3, "link_down": ["h1", "h3"]}]}
    f = tmp_path / "e.yaml"
    f.write_text(yaml.safe_dump(exp))
    res = subprocess.run([sys.executable, "-m", "testbed", "run", str(f), "--out", str(tmp_path / "o"), "--quiet",
                          "--no-report"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads((tmp_path / "o" / "results.json").read_text())
    events = out["events"]
    rates = [(e["src"], e["dst"], e["rate_mbps"]) for e in events if e.get("event") == "rate"]
    changed_s = [out["events_t0_s"] + e["t_s"] for e in events if e.get("event") == "rate" and e["rate_mbps"] == 20]
    first_go_s = [run["iterations"][0]["go_ns"] / 1e9 for run in out["runs"]]
    assert len(changed_s) == 4 and changed_s[0] > first_go_s[0] and changed_s[2] > first_go_s[1], (changed_s, first_go_s)
    change = sorted([("h1", "h2", 20.0), ("h2", "h1", 20.0)])
    assert sorted(rates[:2]) == change and sorted(rates[2:4]) == [("h1", "h2", 80.0), ("h2", "h1", 80.0)]
    assert sorted(rates[4:]) == change
    assert [e["event"] for e in events if e.get("event") in ("link_down", "link_up")] == \
        ["link_down", "link_up", "link_down"]
