"""Pure parts of the runner and experiment loader (no network)."""

import os
import time

import pytest

from testbed import config
from testbed.errors import ConfigError
from testbed.experiment import build_plan
from testbed.workloads import compute_times

BASE = {"name": "t", "topology": "small-3", "scheme": {"name": "ring"}, "workload": {"size": "64KB"}}


def test_compute_times_kinds():
    nodes = ["a", "b"]
    assert compute_times(0.5, nodes, 2, 0) == {"a": [0.5, 0.5], "b": [0.5, 0.5]}
    per = compute_times({"per_worker": {"a": 1.0, "b": [0.1, 0.2]}}, nodes, 3, 0)
    assert per == {"a": [1.0] * 3, "b": [0.1, 0.2, 0.1]}
    u = compute_times({"uniform": [1, 2]}, nodes, 50, 7)
    assert all(1 <= x <= 2 for v in u.values() for x in v)
    assert u == compute_times({"uniform": [1, 2]}, nodes, 50, 7)  # seeded
    assert u == compute_times({"uniform": [1, 2]}, nodes[::-1], 50, 7)  # whatever the plan's node order
    n = compute_times({"normal": [0.1, 1.0]}, nodes, 50, 7)
    assert min(x for v in n.values() for x in v) >= 0.0  # clipped at zero


def test_variants_validated_and_ordered():
    exp = config.validate({**BASE, "variants": [{"label": "hub", "scheme": {"name": "ps", "hub": "h2"}},
                                                {"scheme": {"name": "mst"}}]}, "x.yaml")
    assert [v.label for v in exp.variants] == ["ring", "hub", "mst"]
    assert exp.variants[1].scheme["hub_rule"] == "max-bandwidth"  # defaults filled


@pytest.mark.parametrize("bad, key", [
    ([{"label": "ring", "scheme": {"name": "ps"}}], "variants[0].label"),  # clashes with main
    ([{"scheme": {"name": "nope"}}], "variants[0].scheme.name"),
    ([{"label": "x"}], "variants[0].scheme"),
    ([{"label": "x", "scheme": {"name": "ps", "hub": "zz"}}], "variants[0].scheme.hub"),
])
def test_bad_variants_name_the_key(bad, key):
    with pytest.raises(ConfigError) as e:
        config.validate({**BASE, "variants": bad}, "x.yaml")
    assert key in str(e.value)


def test_scale_multiplies_size_and_rates():
    exp = config.validate({**BASE, "scale": 0.5, "workload": {"size": "1MB"}}, "x.yaml")
    assert exp.workload.bytes == 500_000 and exp.workload.length == 125_000
    topo, graph, plan, prediction, bound = build_plan(exp)
    assert topo.scale == 0.5
    assert max(d["rate_mbps"] for _, _, d in graph.edges(data=True)) == 40.0  # 80 * 0.5
    assert prediction["cct_s"] > 0 and bound["transfer_s"] > 0 and plan.length == 125_000


def test_partial_reduce_has_no_allreduce_bound():
    """The spanning-tree packing bounds an AllReduce of every node, not a group P of them."""
    from testbed.experiment import _summary

    exp = config.validate({**BASE, "scheme": {"name": "crew", "active": ["h1", "h2"]}}, "x.yaml")
    *_, prediction, bound = build_plan(exp)
    assert bound is None
    s = _summary([{"cct_s": 1.0, "correct": True}], prediction, bound)
    assert s["bound_s"] is None and s["efficiency"] is None and s["prediction_ratio"] > 0


def test_warmup_iterations_are_checked_but_not_timed():
    from testbed.experiment import _summarise_run

    def it(i, cct, ok=True):
        return {"iteration": i, "cct_s": cct, "correct": ok, "workers": {"a": {"correct": ok}}}

    r = _summarise_run(0, "ring", {"iterations": [it(0, 9.0), it(1, 2.0), it(2, 4.0)]}, warmup=1)
    assert r["cct_s"] == 3.0 and r["correct"] and r["warmup_cct_s"] == [9.0]  # cold times kept apart
    assert [i["warmup"] for i in r["iterations"]] == [True, False, False]
    assert config.DEFAULTS["workload"]["warmup"] == 1
    bad = _summarise_run(0, "ring", {"iterations": [it(0, 9.0, ok=False), it(1, 2.0)]}, warmup=1)
    assert not bad["correct"] and bad["incorrect"] == ["a"]


def test_emulation_health_expects_relay_statistics_only_where_relays_ran():
    from testbed.results import emulation_health

    assert emulation_health("relay", 0, [], 0.5, 0.0, 2.0)["kept_up"] is True  # no link needed a relay
    h = emulation_health("relay", 2, [], 0.5, 0.0, 2.0)
    assert h["kept_up"] is False and "fidelity unknown" in h["warnings"][0]
    assert "CPU" in emulation_health("netem", 0, [], 0.99, 0.0, 2.0)["warnings"][0]
    assert "steal" in emulation_health("netem", 0, [], 0.5, 0.2, 2.0)["warnings"][0]  # a busy VM host


def test_a_pause_of_the_machine_is_recorded_and_fails_the_emulation_check():
    """The pause meter's own process stopped (SIGSTOP) for 0.8 s stands in for a machine that
    stops every process: the pause is recorded with its start and length, and the run is
    marked as not kept up, naming it; pauses under PAUSE_MAX_S are recorded only."""
    import signal

    from testbed.results import PAUSE_MAX_S, PauseMeter, emulation_health

    m = PauseMeter().start()
    time.sleep(0.5)
    t0 = time.time()
    os.kill(m.proc.pid, signal.SIGSTOP)
    time.sleep(0.8)
    os.kill(m.proc.pid, signal.SIGCONT)
    time.sleep(0.3)
    pauses = m.stop()
    assert m.proc.returncode == 0
    start, length = max(pauses, key=lambda p: p[1])
    assert 0.7 <= length <= 1.5 and abs(start - t0) < 0.3, pauses
    h = emulation_health("relay", 0, [], 0.5, 0.0, 2.0, pauses)
    assert h["kept_up"] is False and "the machine paused 1 time(s)" in h["warnings"][0] and h["pauses"] == pauses
    assert emulation_health("relay", 0, [], 0.5, 0.0, 2.0, [[t0, PAUSE_MAX_S / 2]])["kept_up"] is True


@pytest.mark.parametrize("control, cmdline, config, expected", [
    ("none voluntary (full) lazy\n", "quiet preempt=none", ["CONFIG_PREEMPT_NONE=y", "CONFIG_PREEMPT_DYNAMIC=y"], "full"),
    (None, "quiet preempt=lazy", ["CONFIG_PREEMPT_NONE=y", "CONFIG_PREEMPT_DYNAMIC=y"], "lazy"),
    (None, "quiet preempt=full", ["CONFIG_PREEMPT_NONE=y"], "none"),  # not dynamic: the parameter does nothing
    (None, "quiet", ["CONFIG_PREEMPT_BUILD=y", "CONFIG_PREEMPT_NONE=y", "CONFIG_PREEMPTION=y"], "none"),
    (None, "quiet", ["CONFIG_PREEMPT=y", "CONFIG_PREEMPT_COUNT=y"], "full"),
    (None, "quiet", ["# CONFIG_PREEMPT_NONE is not set", "CONFIG_PREEMPT_VOLUNTARY=y"], "voluntary"),
    (None, None, None, None),
])
def test_preemption_model_is_read_from_what_the_kernel_shows(tmp_path, control, cmdline, config, expected):
    """results.json's ``environment.preemption`` (and doctor's note): the active mode where
    debugfs shows it, else a PREEMPT_DYNAMIC kernel's ``preempt=``, else the build's choice."""
    import gzip

    from testbed.results import preemption

    paths = {k: tmp_path / k for k in ("control", "cmdline", "config.gz")}
    if control is not None:
        paths["control"].write_text(control)
    if cmdline is not None:
        paths["cmdline"].write_text(cmdline + "\n")
    if config is not None:
        with gzip.open(paths["config.gz"], "wt") as f:
            f.write("\n".join(config) + "\n")
    assert preemption(str(paths["control"]), str(paths["cmdline"]), str(paths["config.gz"])) == expected


def test_a_failed_run_is_recorded_from_the_typed_failure():
    """results.json's ``failure``: the coordinator's FailureReport (culprit, link), what had
    completed, and the run-time features' part (CREW's groups: the tasks so far)."""
    from agents.coordinator import Failure
    from agents.protocol import FailureReport
    from testbed.config import Variant
    from testbed.errors import RunError
    from testbed.experiment import _failed_run

    v = Variant("crew", {"name": "crew"})
    done = {"iterations": [{"iteration": 0}], "tasks_mode": {"tasks": [], "rounds": {}}}
    rec = _failed_run(v, 1, Failure(FailureReport("h2: exited", "h2", ("h2", "h3")), done)).to_dict()
    assert rec == {"variant": "crew", "repetition": 1, "message": "h2: exited", "culprit": "h2",
                   "link": ("h2", "h3"), "iterations_completed": 1, "groups": done["tasks_mode"]}
    other = _failed_run(v, 0, RunError("emulator broke")).to_dict()  # not the coordinator's: no culprit
    assert other["culprit"] is None and other["iterations_completed"] == 0 and "groups" not in other


def test_cpu_busy_within_the_iterations_only():
    from testbed.results import CpuMeter, comm_windows

    runs = [{"iterations": [{"warmup": True, "go_ns": 0, "workers": {"a": {"comm_done_ns": 4}}},
                            {"go_ns": 10, "workers": {"a": {"comm_done_ns": 14}, "b": {"comm_done_ns": 20}}},
                            {"go_ns": 30, "workers": {}}]}]
    assert comm_windows(runs) == [(10, 20)]  # not the warm-up, nor an iteration no worker finished
    cpu = CpuMeter()
    # (t_ns, total ticks, idle ticks): all idle outside [10, 20], all busy inside it
    cpu.samples = [(0, 0, 0), (5, 10, 10), (10, 20, 20), (15, 30, 20), (20, 40, 20), (25, 50, 30)]
    assert cpu.busy_within([(10, 20)]) == pytest.approx(1.0)
    assert cpu.busy_within([(0, 25)]) == pytest.approx(0.4)
    assert cpu.busy_within([(11, 19)]) is None  # no sampling interval inside it
    live = CpuMeter().start()
    time.sleep(0.6)
    live.stop()
    assert len(live.samples) >= 2 and live.busy_within([(live.samples[0][0], live.samples[-1][0])]) is not None
