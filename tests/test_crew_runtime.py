"""CREW at run time (agents/crew.py): the controller's ready queue and group formation (pure),
Eq. (3), and runs on real agent processes — over loopback and on a small emulated mesh — in
which stragglers complete fewer rounds in the window T than fast workers, groups form in
ready order, tasks run concurrently, and every completed round is exactly checked."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from agents.crew import Controller, group_sum, replacement, rounds_in_window
from agents.crew_run import TaskRun
from agents.inputs import make_input
from agents.protocol import Received
from testbed import config, topogen
from testbed.errors import ConfigError, RunError
from testbed.planners import make_plan

REPO = Path(__file__).resolve().parent.parent


def assert_rounds_consecutive(tasks: list[dict], nodes) -> None:
    """Every worker holds a correct result of rounds 0, 1, 2, ... each once: from every done task
    and repair, and from the members of an abandoned task that finished it (they keep the round,
    §IV-B) -- never from a task its repair superseded."""
    held = {n: [] for n in nodes}
    for t in tasks:
        if t.get("outcome") != "repaired":
            for m, d in t["members_done"].items():
                assert d["correct"], (t["pid"], m)
                held[m].append(d["round"])
    for n, rounds in held.items():
        assert sorted(rounds) == list(range(len(rounds))), (n, sorted(rounds))


# -- pure ---------------------------------------------------------------------------------
def test_groups_form_in_ready_order_and_a_worker_is_in_one_task_at_a_time():
    c = Controller(["a", "b", "c", "d", "e"], 2)
    c.ready("c", 0)
    assert c.form() == []
    c.ready("a", 0)
    c.ready("e", 0)
    t0, = c.form()
    assert (t0.pid, t0.members, t0.rounds) == (0, ["c", "a"], {"c": 0, "a": 0})
    c.ready("b", 0)
    t1, = c.form()
    assert (t1.pid, t1.members) == (1, ["e", "b"])
    with pytest.raises(ValueError):  # a worker in a running task is not ready again for its round
        c.ready("c", 0)
    c.ready("c", 1)  # ready for the next one: its DONE crossed a failover's re-run; queued after it
    assert c.form() == [] and c.deferred == {"c": 1}
    c.member_done(0, "c")
    c.ready("d", 0)
    t2, = c.form()
    assert (t2.pid, t2.members, t2.rounds) == (2, ["c", "d"], {"c": 1, "d": 0})


def test_the_same_readiness_twice_queues_once_and_another_round_is_refused():
    """A REJOIN's or the controller's own re-queue and an ENQUEUE that crossed it name the same
    round: queued once (the coordinator once failed on it, CI and a local run)."""
    c = Controller(["a", "b", "c"], 2)
    c.ready("a", 3)
    c.ready("a", 3)
    assert list(c.queue) == [("a", 3)]
    with pytest.raises(ValueError):
        c.ready("a", 4)


def test_a_lost_worker_leaves_the_queue_and_joins_no_group():
    c = Controller(["a", "b", "c"], 2)
    c.ready("a", 0)
    c.ready("b", 3)
    t, = c.form()
    t.involved = ["a", "b", "c"]
    c.ready("c", 0)
    assert c.lose("c") == [t]  # an aggregator of a running task
    c.ready("c", 1)  # ignored: it is gone
    assert list(c.queue) == [] and c.alive == ["a", "b"]


def test_eq3_picks_the_candidate_with_the_least_load_over_its_worst_member_link():
    b = {("a", "x"): 100, ("x", "a"): 50, ("b", "x"): 100, ("x", "b"): 100,
         ("a", "y"): 20, ("y", "a"): 200, ("b", "y"): 200, ("y", "b"): 200}
    def rate(s, d):
        return b[(s, d)]
    # x: (0 + 1) / min(50, 100) = 0.02, y: 1 / 20 = 0.05
    assert replacement(["x", "y"], ["a", "b"], {}, 1.0, rate) == "x"
    # a heavy load on x tips it: (2 + 1) / 50 = 0.06 > 0.05
    assert replacement(["x", "y"], ["a", "b"], {"x": 2.0}, 1.0, rate) == "y"
    assert replacement([], ["a", "b"], {}, 1.0, rate) is None  # S empty: ABANDON


def test_group_sum_takes_each_members_own_round():
    nodes = ["a", "b", "c"]
    got = group_sum(7, nodes, {"a": 3, "c": 0}, 1000, "float32")
    want = make_input(7, 0, 3, 1000) + make_input(7, 2, 0, 1000)
    assert np.array_equal(got, want)


def test_rounds_in_window_counts_correct_rounds_done_before_its_end():
    tasks = [{"members_done": {"a": {"done_ns": 5, "correct": True}, "b": {"done_ns": 5, "correct": True}}},
             {"members_done": {"a": {"done_ns": 9, "correct": True}, "c": {"done_ns": 12, "correct": True}}},
             {"members_done": {"b": {"done_ns": 6, "correct": False}}}]
    assert rounds_in_window(tasks, 0, 10e-9) == {"a": 2, "b": 1}


def test_groups_key_is_validated():
    base = {"name": "g", "topology": "small-3", "scheme": {"name": "crew", "groups": {"p": 2, "window_s": 5}}}
    exp = config.validate(base)
    assert exp.scheme["groups"] == {"p": 2, "window_s": 5, "link_timeout_s": 2.0, "noise": 0.0, "blocking": True}
    for bad, key in (({"p": 4}, "scheme.groups.p"), ({"window_s": 0}, "scheme.groups.window_s"),
                     ({"q": 1}, "scheme.groups.q")):
        with pytest.raises(ConfigError) as e:
            config.validate({**base, "scheme": {"name": "crew", "groups": bad}})
        assert e.value.key == key, e.value
    with pytest.raises(ConfigError) as e:  # a scheme that cannot reduce a group
        config.validate({**base, "scheme": {"name": "mst", "groups": {"p": 2}}})
    assert e.value.key == "scheme.groups"
    for scheme, extra, key in (({"name": "crew", "groups": {"blocking": "no"}}, {}, "scheme.groups.blocking"),
                               ({"name": "ring", "groups": {"blocking": False}}, {}, "scheme.groups.blocking"),
                               ({"name": "crew", "aggregators": "members", "groups": {"blocking": False}}, {},
                                "scheme.groups.blocking"),
                               ({"name": "crew", "groups": {"blocking": False}},
                                {"faults": [{"at_s": 1, "crash": "h1"}]}, "scheme.groups.blocking")):
        with pytest.raises(ConfigError) as e:
            config.validate({**base, "scheme": scheme, **extra})
        assert e.value.key == key, (scheme, e.value)


# -- real agents over loopback -----------------------------------------------------------
def check_groups_run(res: dict, nodes: list[str], fast: list[str], slow: list[str], p: int) -> dict:
    """Every round exact, groups in ready order, fast workers ahead; returns tasks_mode."""
    tm = res["tasks_mode"]
    assert not res["errors"], res["errors"]
    assert not tm["faults"], tm["faults"]
    assert tm["tasks"] and all(t["correct"] for t in tm["tasks"])
    for t in tm["tasks"]:
        assert len(t["members"]) == p and all(d["correct"] for d in t["members_done"].values())
    assert_rounds_consecutive(tm["tasks"], nodes)  # each in exactly one task
    # ready order: each group is the first p ready workers (ENQUEUE order at the controller)
    queue, by_pid = [], {t["pid"]: t for t in tm["tasks"]}
    pid = 0
    for node, rnd, _ in tm["enqueued"]:
        queue.append(node)
        if len(queue) == p:
            if pid in by_pid:  # tasks formed after T are not run
                assert by_pid[pid]["members"] == queue, (pid, by_pid[pid]["members"], queue)
            queue, pid = [], pid + 1
    assert min(tm["rounds"][n] for n in fast) > 1.5 * max(tm["rounds"][n] for n in slow), tm["rounds"]
    return tm


def test_loopback_stragglers_complete_fewer_rounds_and_tasks_overlap():
    from agents.local import LocalCluster

    g = topogen.crew_mesh(4, 1).graph()
    # every worker's first step takes as long, so that two groups form at once and their tasks
    # (~10-40 ms on loopback) overlap (measured: by 10-30 ms in 4 of 4 runs with two CPU hogs);
    # afterwards two workers step 0.04 s and two 0.8 s.  (A slow group meeting a fast one by
    # chance is rare: a fast round is mostly making and checking inputs, ~0.1 s, against ~10 ms
    # of task.)  A round's overhead beside its compute grows with the machine's load (~0.1 s
    # idle, ~0.4 s with a qemu guest busy on both cores): the slow workers' extra 0.76 s a round
    # keeps them well behind either way, where 0.26 s did not under load (6 rounds against 4).
    # The workers start their first steps up to ~80 ms apart (four processes making their inputs
    # on two cores), and then the two groups may form too far apart for their ~30 ms tasks to
    # meet; a controller that ran one task at a time would never let them meet, so the run is
    # made up to three times.
    length = 2_000_003
    plan0 = make_plan("crew", g, length, {})
    nodes = list(plan0.nodes)
    compute = {n: [0.25, 0.04] if i < 2 else [0.25, 0.8] for i, n in enumerate(nodes)}
    opts = {"p": 2, "window_s": 3.0, "link_timeout_s": 1.0,  # heartbeats: no false outage
            "plan_for": lambda m: make_plan("crew", g, length, {"active": list(m)})}
    for _ in range(3):
        with LocalCluster(plan0, timeout_s=20, compute_s=compute, seed=5, driver=lambda c: TaskRun(c, opts)) as cl:
            res = cl.run()
        tm = check_groups_run(res, nodes, nodes[:2], nodes[2:], 2)
        spans = sorted((t["start_ns"], max(d["done_ns"] for d in t["members_done"].values())) for t in tm["tasks"])
        if any(b[0] < a[1] for a, b in zip(spans, spans[1:])):
            return
    pytest.fail("no two tasks ran at once in 3 runs")


# -- emulated ------------------------------------------------------------------------------
EMU_EXP = """
name: crew-runtime
topology: {name: m4, generator: {kind: crew-mesh, n: 4, seed: 1, delay_ms: 5}}
seed: 3
scheme: {name: crew, groups: {p: 2, window_s: 8}}
variants: [{label: opr, scheme: {name: crew, aggregators: members, groups: {p: 2, window_s: 8}}}]
workload: {size: 2MB, compute_s: {per_worker: {n0: 0.05, n1: 0.05, n2: [0.8, 1.2], n3: [1.0, 0.7]}}}
agents: {timeout_s: 30}
"""


def run_emulated(tmp_path, text: str) -> tuple[str, dict]:
    """`testbed run` of the experiment ``text`` (it must exit 0): its output and results.json."""
    exp = tmp_path / "exp.yaml"
    exp.write_text(text)
    res = subprocess.run([sys.executable, "-m", "testbed", "run", str(exp), "--out", str(tmp_path), "--no-report"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout, json.loads((tmp_path / "results.json").read_text())


@pytest.mark.net
def test_emulated_groups_from_the_ready_queue(netenv, tmp_path):
    out, results = run_emulated(tmp_path, EMU_EXP)
    assert "rounds each worker completed in the window T" in out, out
    nodes = ["n0", "n1", "n2", "n3"]
    for run in results["runs"]:
        assert run["correct"], run["errors"]
        check_groups_run({"tasks_mode": run["groups"], "errors": run["errors"]}, nodes, nodes[:2], nodes[2:], 2)
        assert run["rounds_total"] == sum(run["rounds"].values()) > 0


def test_failover_plans_are_exact_and_skip_the_lost_and_the_replaced():
    """exclude (a lost worker aggregates nothing) and reassign (Eq. 3: j's block to k)."""
    from testbed.plan import check_allreduce

    g = topogen.crew_mesh(5, 2).graph()
    inputs = {n: make_input(1, i, 0, 997) for i, n in enumerate(sorted(g.nodes))}
    base = make_plan("crew", g, 997, {"active": ["n0", "n2"]})
    plan = make_plan("crew", g, 997, {"active": ["n0", "n2"], "exclude": ["n4"], "reassign": {"n1": "n3"}})
    check_allreduce(plan, inputs)
    assert plan.meta["aggregators"] == ["n0", "n2", "n3"] and not plan.programs["n4"] and not plan.programs["n1"]
    w0 = make_plan("crew", g, 997, {"active": ["n0", "n2"], "exclude": ["n4"]}).meta["weights"]
    assert plan.meta["weights"]["n3"] == pytest.approx(w0["n3"] + w0["n1"])
    assert set(base.meta["aggregators"]) == set(g.nodes)
    with pytest.raises(ConfigError):
        make_plan("crew", g, 997, {"active": ["n0", "n2"], "exclude": ["n4"], "reassign": {"n1": "n4"}})


CRASH_EXP = EMU_EXP.replace("name: crew-runtime", "name: crew-crash").replace(
    "variants: [{label: opr, scheme: {name: crew, aggregators: members, groups: {p: 2, window_s: 8}}}]\n",
    "faults: [{at_s: 4, crash: n3}]\n")


@pytest.mark.net
def test_emulated_crash_mid_run_repairs_or_abandons_and_the_run_goes_on(netenv, tmp_path):
    """n3 crashes (the emulator kills its processes and cuts its links) while groups run:
    tasks in flight with n3 only aggregating are repaired (Eq. 3) unless a member already
    holds its result, those with n3 as a member abandoned; the survivors keep forming groups to the end of T, every round exact."""
    _, results = run_emulated(tmp_path, CRASH_EXP)
    assert any(e.get("event") == "host_crash" and e.get("dc") == "n3" for e in results["events"]), results["events"]
    run, = results["runs"]
    g = run["groups"]
    assert run["correct"], run["errors"]
    assert g["lost"] == ["n3"] and g["faults"][0]["node"] == "n3"
    crash_ns = g["faults"][0]["t_ns"]
    for t in g["faults"][0]["tasks"]:
        rec = next(r for r in g["tasks"] if r["pid"] == t["pid"] and r.get("outcome") != "done")
        if "n3" in rec["members"]:
            assert t["outcome"] == "abandoned" and t["why"] == "n3 was a member", (t, rec)
        elif t["outcome"] == "abandoned":  # only when a member finished before the crash
            assert t["why"] == "a member already holds its result" and rec["members_done"], (t, rec)
        if t["outcome"] == "repaired":
            fix = next(r for r in g["tasks"] if r.get("repair_of") == t["pid"])
            assert fix["correct"] and fix["members"] == rec["members"], fix
    done = [t for t in g["tasks"] if t.get("outcome") in ("done", "repair")]
    assert all(t["correct"] for t in done)
    after = [t for t in done if t["start_ns"] > crash_ns]
    assert after and all("n3" not in t["members"] for t in after)
    assert_rounds_consecutive(g["tasks"], ("n0", "n1", "n2", "n3"))
    print("faults:", g["faults"], "rounds:", g["rounds"], "repaired", g["repaired"], "abandoned", g["abandoned"])


LINK_EXP = EMU_EXP.replace("name: crew-runtime", "name: crew-link").replace("window_s: 8}}\n", "window_s: 10}}\n").replace(
    "variants: [{label: opr, scheme: {name: crew, aggregators: members, groups: {p: 2, window_s: 8}}}]\n",
    "faults: [{at_s: 3, link_down: [n0, n1]}, {at_s: 6, link_up: [n0, n1]}]\n")


@pytest.mark.net
def test_emulated_link_break_between_members_is_repaired_and_the_run_goes_on(netenv, tmp_path):
    """The link n0-n1 between the two fast workers (a group of them every few hundred ms)
    goes down mid-run and comes back: the agents' heartbeats report it, the task in flight
    over it is stopped and run again with n0's and n1's blocks at Eq. (3) replacements
    (§IV-B), groups formed while it is down avoid it from the start, and every round is
    exact; results.json records the fault and the repairs."""
    _, results = run_emulated(tmp_path, LINK_EXP)
    run, = results["runs"]
    g = run["groups"]
    assert run["correct"], run["errors"]
    assert not g["lost"], g["lost"]
    fault, = [f for f in g["faults"] if f.get("link")]
    assert fault["link"] == ["n0", "n1"] and fault.get("back_ns", 0) > fault["t_ns"], fault
    done = [t for t in g["tasks"] if t.get("outcome") in ("done", "repair")]
    assert all(t["correct"] for t in done)
    # while the link was down, every group of n0 and n1 ran with both blocks elsewhere
    during = [t for t in done if fault["t_ns"] < t["start_ns"] < fault["back_ns"]
              and {"n0", "n1"} <= set(t["members"])]
    assert during, "no group of n0 and n1 ran while the link was down"
    for t in during:
        assert set(t.get("reassign", {})) >= {"n0", "n1"}, t
        assert not {"n0", "n1"} & set(t["reassign"].values()), t
    for t in fault["tasks"]:  # stopped in flight: repaired (a new pid, same members) or abandoned
        if t["outcome"] == "repaired":  # each end's block moves if the other end is a member it cannot reach
            fix = next(r for r in g["tasks"] if r.get("repair_of") == t["pid"])
            cut_off = {a for a, b in (("n0", "n1"), ("n1", "n0")) if b in fix["members"]}
            assert fix["correct"] and cut_off and set(fix["reassign"]) >= cut_off, fix
    assert_rounds_consecutive(g["tasks"], ("n0", "n1", "n2", "n3"))
    after = [t for t in done if t["start_ns"] > fault["back_ns"] + 1e9 and {"n0", "n1"} <= set(t["members"])]
    assert after and all(not t.get("reassign") for t in after), "groups after the link came back still avoid it"
    print("faults:", g["faults"], "rounds:", g["rounds"])


def test_a_watch_process_that_does_not_end_when_told_is_killed_without_failing_the_agent():
    """The end of the heartbeats never raises: a watch that ignores its stdin's end is
    killed (END_S later) and reaped."""
    from agents import linkwatch

    w = linkwatch.LinkWatch.__new__(linkwatch.LinkWatch)
    w.proc = subprocess.Popen(["sleep", "60"], stdin=subprocess.PIPE)  # does not read its stdin
    t0 = time.monotonic()
    w._end()
    assert w.proc.returncode == -9 and time.monotonic() - t0 < 2 * linkwatch.END_S


def test_link_watch_reports_a_silent_peer_and_its_return():
    """Heartbeats over real UDP sockets: a peer that stops is reported link_lost within the
    timeout (one report), and link_back once it beats again."""
    import socket
    import time as _time

    from agents.linkwatch import LinkWatch

    class Fake:
        def __init__(self, name):
            self.name, self.sent = name, []
            self.listener = socket.create_server(("127.0.0.1", 0))
            self.data_port = self.listener.getsockname()[1]

        def send(self, obj):
            self.sent.append((_time.monotonic(), obj))

    a, b = Fake("a"), Fake("b")
    wa = LinkWatch(a, {"b": ["127.0.0.1", b.data_port]}, 0.8)
    wb = LinkWatch(b, {"a": ["127.0.0.1", a.data_port]}, 0.8)
    try:
        _time.sleep(1.5)
        assert a.sent == [] and b.sent == []  # both beat: no outage
        wb.close()
        t0 = _time.monotonic()
        _time.sleep(1.5)
        assert [m for _, m in a.sent] == [{"msg": "link_lost", "peer": "b"}]
        assert a.sent[0][0] - t0 < 0.8 + 0.3
        wb = LinkWatch(b, {"a": ["127.0.0.1", a.data_port]}, 0.8)
        _time.sleep(0.6)
        assert [m for _, m in a.sent][1:] == [{"msg": "link_back", "peer": "b"}]
    finally:
        wa.close()
        wb.close()


LINK_WATCH_BEHIND_SLOW_QUEUES = """
import json, socket, subprocess, sys, time
sys.path.insert(0, sys.argv[1])
from agents.linkwatch import LinkWatch
for c in ("ip link set lo up", "ip link add d0 type veth peer name d1", "ip link set d1 up", "ip link set d0 up",
          "ip addr add 10.9.1.1/24 dev d0", "ip addr add 10.9.1.3/24 dev d0",
          "ip neigh add 10.9.1.2 lladdr 02:00:00:00:00:02 dev d0 nud permanent",
          "ip route add 10.9.0.0/24 via 10.9.1.2", "tc qdisc add dev d0 root tbf rate 8kbit burst 1600 limit 50000000"):
    subprocess.run(c.split(), check=True)
class Fake:  # a data address of its own, not loopback, as every agent has
    def __init__(self, name, address):
        self.name, self.sent = name, []
        self.listener = socket.create_server((address, 0))
        self.data_port = self.listener.getsockname()[1]
    def send(self, obj):
        self.sent.append(obj)
a, b = Fake("a", "10.9.1.1"), Fake("b", "10.9.1.3")
slow = {f"s{i}": [f"10.9.0.{10 + i}", 9] for i in range(150)}
wa = LinkWatch(a, {"b": ["10.9.1.3", b.data_port], **slow}, 2.0)
wb = LinkWatch(b, {"a": ["10.9.1.1", a.data_port]}, 2.0)
time.sleep(6)
wa.close()
wb.close()
print(json.dumps({"a": a.sent, "b": b.sent}))
"""


@pytest.mark.net
def test_link_watch_hears_a_live_peer_while_other_peers_links_hold_its_heartbeats(netenv):
    """In a network namespace of its own: 150 peers whose heartbeats wait in an 8 kbit/s queue
    (so they stay charged to the sending socket) and one live peer on this host.  Neither end
    of the live pair reports the other lost: the slow peers' queues must not fill the buffer
    the live peer's heartbeats leave from, nor stall the thread that hears them.  The timeout
    (2 s) is far above a loaded machine's scheduling pauses and the second watch's start; a
    watch stalled behind the slow queues is silent for the whole run."""
    res = subprocess.run(["unshare", "--net", sys.executable, "-c", LINK_WATCH_BEHIND_SLOW_QUEUES, str(REPO)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    sent = json.loads(res.stdout)
    lost_by_a = {m["peer"] for m in sent["a"] if m["msg"] == "link_lost"}
    assert lost_by_a == {f"s{i}" for i in range(150)}, sent["a"]  # never heard: lost, each once
    assert sent["b"] == [], sent["b"]


def test_crew_compute_time_distributions_are_seeded_skewed_and_scaled():
    """CREW §V-A's T1/T2 on [0.05, 0.2] s (times a factor, Fig. 9), drawn per worker from the seed."""
    from testbed.workloads import compute_times

    nodes = ["n0", "n1", "n2"]
    t1 = compute_times({"T1": 1}, nodes, 4000, seed=4)
    assert t1 == compute_times({"T1": 1}, nodes[::-1], 4000, seed=4)  # per worker, order-free
    assert t1["n0"] != t1["n1"] and t1 != compute_times({"T1": 1}, nodes, 4000, seed=5)
    t2 = compute_times({"T2": 1}, nodes, 4000, seed=4)
    for d in (t1, t2):
        v = sorted(x for xs in d.values() for x in xs)
        assert 0.05 <= v[0] and v[-1] <= 0.2
        assert np.median(v) < np.mean(v) < 0.125  # right-skewed: the tail is slow
    assert np.percentile(t2["n0"], 95) > np.percentile(t1["n0"], 95)  # T2's heavier tail
    t3 = compute_times({"T2": 3}, nodes, 50, seed=4)
    assert t3["n1"] == pytest.approx([3 * x for x in t2["n1"][:50]])
    base = {"name": "g", "topology": "small-3", "scheme": {"name": "ring"}}
    assert config.validate({**base, "workload": {"compute_s": {"T2": 2}}}).workload.compute_s == {"T2": 2}
    for bad in ({"T1": 0}, {"T3": 1}, {"T1": 1, "T2": 1}):
        with pytest.raises(ConfigError) as e:
            config.validate({**base, "workload": {"compute_s": bad}})
        assert e.value.key.startswith("workload.compute_s"), e.value


def test_bandwidth_noise_is_the_controllers_view_only():
    """§V-H: groups.noise = lambda plans on b(1+x), x ~ U[-lambda, lambda] per direction,
    seeded; the topology (what the emulator shapes) keeps b."""
    from testbed.runtime.groups import group_runtime, noisy_rates

    exp = config.validate({"name": "g", "topology": "crew-mesh-8", "seed": 2,
                           "scheme": {"name": "crew", "groups": {"p": 3, "noise": 0.5}}})
    g = exp.topology.graph()
    noisy = noisy_rates(g, 0.5, 2)
    ratios = [noisy[u][v]["rate_mbps"] / d["rate_mbps"] for u, v, d in g.edges(data=True)]
    assert all(0.5 <= r <= 1.5 for r in ratios) and np.std(ratios) > 0.1
    assert noisy_rates(g, 0.5, 2)["n0"]["n1"] == noisy["n0"]["n1"] != noisy_rates(g, 0.5, 3)["n0"]["n1"]
    assert noisy_rates(g, 0.0, 2) is g
    rt = group_runtime(exp, exp.scheme)
    clean_exp = config.validate({"name": "g", "topology": "crew-mesh-8", "seed": 2,
                                 "scheme": {"name": "crew", "groups": {"p": 3}}})
    clean = group_runtime(clean_exp, clean_exp.scheme)
    members = ["n0", "n3", "n5"]
    w_noisy, w_clean = rt["plan_for"](members).meta["weights"], clean["plan_for"](members).meta["weights"]
    assert w_noisy != pytest.approx(w_clean, abs=1e-3)
    assert exp.topology.graph()["n0"]["n1"]["rate_mbps"] == g["n0"]["n1"]["rate_mbps"]  # true b unchanged
    with pytest.raises(ConfigError) as e:
        config.validate({"name": "g", "topology": "small-3", "scheme": {"name": "crew", "groups": {"noise": 1.0}}})
    assert e.value.key == "scheme.groups.noise"


def test_loopback_non_blocking_scatter_is_exact():
    """Non-blocking scatter (§IV-A2) on real agents: each ready worker sends its default
    blocks at once; when its group forms, its early scatter is cut short and the group's plan
    (Alg. 2 blocks) sends the rest, withdrawing the chunks already delivered to their owner;
    every member of every group ends with the exact sum of P's inputs of its round."""
    from agents.local import LocalCluster
    from testbed.planners.crew import prescatter_plan

    g = topogen.crew_mesh(5, 1).graph()
    length = 40_009
    plan0 = make_plan("crew", g, length, {})
    nodes = list(plan0.nodes)
    compute = {n: [0.04] if i < 3 else [0.25, 0.3] for i, n in enumerate(nodes)}
    opts = {"p": 3, "window_s": 3.0,
            "plan_for": lambda m, **kw: make_plan("crew", g, length, {"active": list(m), "prescattered": True, **kw}),
            "prescatter_for": lambda s: prescatter_plan(g, length, s)}
    with LocalCluster(plan0, timeout_s=20, compute_s=compute, seed=6, driver=lambda c: TaskRun(c, opts)) as cl:
        res = cl.run()
    tm = check_groups_run(res, nodes, nodes[:3], nodes[3:], 3)
    assert all(gr["meta"].get("prescattered") for gr in tm["groups"])
    # per member: [chunks its early scatter delivered, of them withdrawn in the task]; the
    # worker completing a group scattered nothing early (it has no entry)
    early = [t["early"] for t in tm["tasks"]]
    assert all(len(e) == 2 and all(0 <= w <= d for d, w in e.values()) for e in early), early
    assert sum(w for e in early for _, w in e.values()) > 0, early
    assert sum(tm["rounds"].values()) >= 3 * 4, tm["rounds"]


class _FakeCoordinator:
    """What TaskRun uses of the coordinator (its driver API), recording the messages it sends."""

    def __init__(self, plan):
        self.plan, self.sent, self.limit_s, self.silence_s, self.errors = plan, [], 10.0, 2.0, []

    def send(self, node, msg):
        self.sent.append((node, msg))

    def plan_message(self, node, version, plan, **extra):
        return {"msg": "plan", "version": version, **extra}

    def diagnose(self, ev):
        raise AssertionError(f"run failed: {ev}")

    def note_error(self, text):
        self.errors.append(text)

    def progress(self, s):
        pass

    def ready_limit(self):
        return 5.0

    def to_my_clock(self, node, done):
        return done

    def next_event(self, deadline):
        return None

    def pending_events(self):
        return []

    def requeue(self, events):
        self.requeued = list(events)

    def health_problem(self):
        return None


def test_controller_repairs_around_a_broken_link_between_members():
    """§IV-B on the controller alone (no sockets): a link between two members of a running
    task breaks -> the task is stopped (ABANDON to its nodes) and re-placed with both cut-off
    aggregators' blocks at Eq. (3) replacements that have live links to all of P; a group
    formed while it is down gets such a plan from the start; once it is back, plain plans."""
    from agents.crew import plan_pairs
    from testbed.planners.crew import pair_rates

    g = topogen.crew_mesh(5, 1).graph()
    length = 5000
    plan0 = make_plan("crew", g, length, {})
    b = pair_rates(g)
    c = _FakeCoordinator(plan0)
    tr = TaskRun(c, {"p": 2, "window_s": 10, "rate": lambda i, j: b[(i, j)],
                     "plan_for": lambda m, **kw: make_plan("crew", g, length, {"active": list(m), **kw})})
    tr.ctl.ready("n0", 0)
    tr.ctl.ready("n1", 0)
    t, = tr.ctl.form()
    assert tr.place(t) and t.state == "installing"
    assert frozenset(("n0", "n1")) in plan_pairs(tr.plans[t.version])
    c.sent.clear()
    tr.link_changed("n1", "n0", True)
    tr.link_changed("n0", "n1", True)  # the other end's report: the same fault
    fault, = tr.faults
    assert fault["link"] == ["n0", "n1"] and t.state == "repaired"
    assert sorted(n for n, m in c.sent if m["msg"] == "abandon") == sorted(t.involved)
    rec, = [r for r in tr.records if r["pid"] == t.pid]
    new = tr.ctl.tasks[rec["repair"]]
    swap = tr.reassign[new.pid]
    assert set(swap) == {"n0", "n1"} and not set(swap.values()) & {"n0", "n1"}
    assert frozenset(("n0", "n1")) not in plan_pairs(tr.plans[new.version])
    assert new.members == ["n0", "n1"] and new.rounds == {"n0": 0, "n1": 0}
    # a group with n1 and a third worker: only n0 (not a member, cut off from n1) moves
    tr.ctl.member_done(new.pid, "n1")
    tr.ctl.ready("n1", 1)
    tr.ctl.ready("n2", 0)
    t2, = tr.ctl.form()
    assert tr.place(t2) and set(tr.reassign[t2.pid]) == {"n0"}
    assert frozenset(("n0", "n1")) not in plan_pairs(tr.plans[t2.version])
    tr.link_changed("n0", "n1", False)
    assert "back_ns" in fault and not tr.broken
    tr.ctl.member_done(t2.pid, "n2")
    tr.ctl.member_done(new.pid, "n0")
    tr.ctl.ready("n0", 1)
    tr.ctl.ready("n2", 1)
    t3, = tr.ctl.form()
    assert tr.place(t3) and not tr.reassign.get(t3.pid)


def test_a_scheme_without_per_block_aggregators_gives_up_a_group_across_a_broken_link():
    """§IV-B: all-to-all has no aggregator to move, so a group whose members' link is down
    is not placed."""
    g = topogen.crew_mesh(5, 1).graph()
    length = 5000
    tr2 = TaskRun(_FakeCoordinator(make_plan("alltoall", g, length, {})), {
        "p": 2, "window_s": 10, "plan_for": lambda m, **kw: make_plan("alltoall", g, length, {"active": list(m)})})
    tr2.link_changed("n0", "n1", True)
    tr2.ctl.ready("n0", 0)
    tr2.ctl.ready("n1", 0)
    t4, = tr2.ctl.form()
    assert not tr2.place(t4)


def _crew_taskrun(n: int, p: int):
    """A TaskRun of CREW over an ``n``-worker mesh on the fake coordinator, with Eq. (3) rates."""
    from testbed.planners.crew import pair_rates

    g = topogen.crew_mesh(n, 1).graph()
    b, c = pair_rates(g), _FakeCoordinator(make_plan("crew", g, 5000, {}))
    return c, TaskRun(c, {"p": p, "window_s": 10, "rate": lambda i, j: b[(i, j)],
                          "plan_for": lambda m, **kw: make_plan("crew", g, 5000, {"active": list(m), **kw})})


def _run_to_start(tr: TaskRun, t) -> None:
    """Task ``t``'s nodes answer INSTALLED (if it installs) and ARMED: it runs."""
    for n in sorted(tr.installing.get(t.version, ())):
        tr._on(Received(n, {"msg": "installed", "version": t.version}))
    for n in sorted(t.waiting if t.state == "arming" else ()):
        tr._on(Received(n, {"msg": "armed", "pid": t.pid}))
    assert t.state == "running", t.state


def _report(tr: TaskRun, node: str, kind: str, **fields) -> None:
    tr._on(Received(node, {"msg": kind, **fields}))


def _done(tr: TaskRun, node: str, pid: int) -> None:
    _report(tr, node, "task_done", pid=pid, comm_start_ns=1, comm_done_ns=2, correct=True)


def _first_task_running():
    """A CREW TaskRun over 5 workers, p = 2: n0 and n1 ready with round 0, their task A running."""
    _, tr = _crew_taskrun(5, 2)
    for n in ("n0", "n1"):
        _report(tr, n, "enqueue", round=0)
    a, = tr.ctl.form()
    assert tr.place(a)
    _run_to_start(tr, a)
    return tr, a


@pytest.mark.parametrize("enqueue_first", [True, False])
def test_abandoning_a_repair_queues_a_member_whose_done_crossed_the_first_failover_once(enqueue_first):
    """§IV-B: a link of task A breaks, A is repaired as B; a member's DONE of A crossed the
    ABANDON, so it computes its next round while B still needs it (B re-runs its round); then a
    link of B breaks after the other member holds B's result: B is abandoned.  The member is
    queued once, with the next round it reports (before or after B's ABANDON), never with the
    round it already holds (a worker in at most one of the queue and one task)."""
    tr, a = _first_task_running()
    _report(tr, "n1", "link_lost", peer="n0")
    assert a.state == "repaired"
    b = tr.ctl.tasks[tr.records[-1]["repair"]]
    _run_to_start(tr, b)
    _done(tr, "n1", a.pid)  # A was stopped: not counted; n1 computes its round 1
    if enqueue_first:
        _report(tr, "n1", "enqueue", round=1)
    _done(tr, "n0", b.pid)
    cut = next(pair for pair in tr._vpairs(b.version) if "n1" in pair and pair != frozenset(("n0", "n1")))
    tr.link_changed(*sorted(cut), True)
    assert b.state == "abandoned" and "n1" not in tr.ctl.member_of
    assert list(tr.ctl.queue) == ([("n1", 1)] if enqueue_first else [])
    if not enqueue_first:
        _report(tr, "n1", "enqueue", round=1)
    _report(tr, "n0", "enqueue", round=1)
    t, = tr.ctl.form()
    assert t.rounds == {"n1": 1, "n0": 1} and not tr.ctl.deferred


def _handle(tr: TaskRun, received: list) -> None:
    """``received`` arrived together: the driver reads them one by one, the rest read ahead."""
    tr.ahead.extend(received)
    while tr.ahead:
        tr._on(tr._next(0.0))


def test_a_link_whose_return_is_already_received_stops_no_task():
    """§IV-B on reports received together: a link reported lost whose return is among the
    reports already received (down for less than the controller takes to reach them) is
    recorded and stops nothing; its return received only later, the task over it is
    repaired; a report of another link received with them is still acted on."""
    tr, a = _first_task_running()
    lost = Received("n1", {"msg": "link_lost", "peer": "n0"})
    back = Received("n1", {"msg": "link_back", "peer": "n0"})
    _handle(tr, [lost, Received("n0", {"msg": "link_lost", "peer": "n1"}), back])
    fault, = tr.faults
    assert a.state == "running" and fault["failover"] is False and "back_ns" in fault and not tr.broken
    assert not fault["tasks"]
    _handle(tr, [lost])
    assert a.state == "repaired" and "failover" not in tr.faults[-1]
    _handle(tr, [back])
    b = tr.ctl.tasks[tr.records[-1]["repair"]]
    _run_to_start(tr, b)
    cut = next(pair for pair in tr._vpairs(b.version) if "n0" in pair and "n1" not in pair)
    other = sorted(cut - {"n0"})[0]
    _handle(tr, [lost, Received("n0", {"msg": "link_lost", "peer": other}), back])
    assert b.state != "running" and tr.faults[-1]["link"] == sorted(cut, key=tr.nodes.index)


def test_a_failing_run_gives_the_events_read_ahead_to_the_coordinator_s_diagnosis():
    """What was received behind the event a run fails on (an agent's error, say) goes back to
    the coordinator, whose diagnosis names the failure from everything it received."""
    c, tr = _crew_taskrun(4, 2)
    behind = [Received("n2", {"msg": "error", "message": "disk full"}), Received("n3", {"msg": "status"})]
    tr.ahead.extend(behind)
    with pytest.raises(AssertionError, match="run failed"):
        tr._on(Received("n1", {"msg": "no-such-kind"}))
    assert c.requeued == behind and not tr.ahead


def test_a_done_crossing_an_abandon_drops_the_member_s_re_queue_of_that_round():
    """§IV-B: task A is abandoned (a member already holds its result when a link of it breaks)
    and its other member is queued again with its round; that member's DONE of A crossed the
    ABANDON: it holds the round (A's record credits it) and computes its next, so the re-queue
    goes and its ENQUEUE of the next round queues it."""
    tr, a = _first_task_running()
    _done(tr, "n0", a.pid)
    _report(tr, "n1", "link_lost", peer="n0")
    assert a.state == "abandoned" and list(tr.ctl.queue) == [("n1", 0)]
    _done(tr, "n1", a.pid)
    assert list(tr.ctl.queue) == []
    rec, = [r for r in tr.records if r["pid"] == a.pid]  # n1 holds round 0 too: the record credits it
    assert rec["members_done"]["n1"] == {"round": 0, "done_ns": 2, "correct": True, "after_abandon": True}
    _report(tr, "n1", "enqueue", round=1)
    assert list(tr.ctl.queue) == [("n1", 1)]


def test_a_done_crossing_an_abandon_after_its_re_queue_formed_a_group_is_credited_once():
    """As above, but the member's re-queue of its round already formed a new task with another
    worker when its DONE of the abandoned task comes: the new task runs that round again and
    credits it; the abandoned record does not (each worker's rounds counted once, §IV-B)."""
    tr, a = _first_task_running()
    _done(tr, "n0", a.pid)
    _report(tr, "n1", "link_lost", peer="n0")
    _report(tr, "n2", "enqueue", round=0)
    c, = tr.ctl.form()
    assert a.state == "abandoned" and c.rounds == {"n1": 0, "n2": 0}
    _done(tr, "n1", a.pid)
    rec, = [r for r in tr.records if r["pid"] == a.pid]
    assert set(rec["members_done"]) == {"n0"}
    held = [d["round"] for r in tr.records for m, d in r["members_done"].items() if m == "n1"]
    assert held == []  # n1's round 0 is the new task's to credit


def test_a_controller_bug_fails_the_run_naming_it_not_with_a_traceback():
    """An exception of the driver's own (its state broke) is a run failure laid to the
    coordinator: one message with the exception and where it was raised (the CLI's one
    ``error:`` line, exit 1), not a traceback."""
    from agents.coordinator import Coordinator, Failure

    class Broken:
        def __init__(self, coord):
            self.ctl = Controller(list(coord.plan.nodes), 2)

        def run(self):
            self.ctl.ready("n1", 0)
            self.ctl.ready("n1", 1)

    plan = make_plan("crew", topogen.crew_mesh(3, 1).graph(), 3000, {})
    with Coordinator(plan, addresses={n: "127.0.0.1" for n in plan.nodes}, data_port=None, secret=b"s",
                     bind=("127.0.0.1", 0), driver=Broken) as c:
        with pytest.raises(Failure) as e:
            c._run_driver()
    assert e.value.culprit == "coordinator" and isinstance(e.value, RunError) and "\n" not in str(e.value)
    assert str(e.value).startswith("coordinator: Broken failed: ValueError: n1 is ready for round 1 while "
                                   "queued with round 0 (in ready, crew.py:"), str(e.value)


class _InstantAgents(_FakeCoordinator):
    """Agents that answer at once: INSTALLED to a PLAN, ARMED to a TASK, TASK_DONE to a
    START (its members ENQUEUE their next round), BYE to FINISH; every worker ENQUEUEs round
    0 at BEGIN."""

    def __init__(self, plan):
        super().__init__(plan)
        self.inbox, self.rounds = [], {}

    def send(self, node, msg):
        super().send(node, msg)
        kind, answer = msg["msg"], []
        if kind == "begin":
            answer = [{"msg": "enqueue", "round": 0}]
        elif kind == "plan":
            answer = [{"msg": "installed", "version": msg["version"]}]
        elif kind == "task":
            self.rounds[msg["pid"]] = msg["rounds"]
            answer = [{"msg": "armed", "pid": msg["pid"]}]
        elif kind == "start":
            rounds = self.rounds[msg["pid"]]
            answer = [{"msg": "task_done", "pid": msg["pid"], "comm_start_ns": 1, "comm_done_ns": 2, "correct": True},
                      *([{"msg": "enqueue", "round": rounds[node] + 1}] if node in rounds else [])]
        elif kind == "finish":
            answer = [{"msg": "bye"}]
        self.inbox += [Received(node, a) for a in answer]

    def next_event(self, deadline):
        return self.inbox.pop(0) if self.inbox else None

    def pending_events(self):
        out, self.inbox = self.inbox, []
        return out


def test_the_controller_reads_every_report_received_before_placing_the_next_group():
    """Groups formed together are placed one per turn of the controller's loop, every report
    received meanwhile read before the next placement (a placement plans over all n workers,
    seconds at n = 32 on a loaded machine); a group formed in the window is placed after its
    end too, and the run ends."""
    g = topogen.crew_mesh(6, 1).graph()
    c = _InstantAgents(make_plan("crew", g, 3000, {}))
    unread: list[int] = []

    def plan_for(members, **kw):
        unread.append(len(tr.installing) + sum(ev.msg["msg"] == "installed" for ev in c.inbox))
        return make_plan("crew", g, 3000, {"active": list(members), **kw})

    tr = TaskRun(c, {"p": 2, "window_s": 0.3, "plan_for": plan_for})
    tr.run()
    tm = tr.results()["tasks_mode"]
    assert len(unread) >= 3 and not any(unread), unread  # the first batch formed three groups at once
    assert tm["tasks"] and all(t["outcome"] == "done" for t in tm["tasks"]) and not tr.unplaced
    assert sorted(n for n, m in c.sent if m["msg"] == "finish") == tr.nodes


def _paced(plan, mbps: float):
    """``plan`` with every send paced at ``mbps`` (SO_MAX_PACING_RATE): loopback links with a rate."""
    from dataclasses import replace

    plan.programs = {n: [replace(op, rate_mbps=mbps) if op.kind == "send" else op for op in prog]
                     for n, prog in plan.programs.items()}
    return plan


class WakeUpLateness:
    """How late this machine wakes a sleeping thread while the block runs: a thread sleeps
    1 ms at a time and keeps each overshoot (:meth:`p99_ns`)."""

    def __enter__(self):
        self.late_ns, self._stop = [], threading.Event()

        def sample():
            while not self._stop.is_set():
                t = time.monotonic_ns()
                time.sleep(0.001)
                self.late_ns.append(time.monotonic_ns() - t - 1_000_000)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)

    def p99_ns(self) -> int:
        late = sorted(self.late_ns)
        return late[int(0.99 * (len(late) - 1))] if late else 0


def link_sharing(tasks: list[dict], min_overlap_ns: int = 1_500_000) -> tuple[int, int]:
    """(chunk pairs of two different tasks on one directed link whose arrivals overlapped by
    more than ``min_overlap_ns``, pairs of tasks that used one link at overlapping times) from
    the records' per-chunk arrival times (receiver side: first and last byte)."""
    by_link: dict[tuple, list] = {}
    for t in tasks:
        for dst, rows in t.get("chunks", {}).items():
            for src, first, last in rows:
                by_link.setdefault((src, dst), []).append((first, last, t["pid"]))
    shared, concurrent = 0, set()
    for link, rows in by_link.items():
        spans: dict[int, list] = {}
        for a, b, pid in rows:
            s = spans.setdefault(pid, [a, b])
            s[0], s[1] = min(s[0], a), max(s[1], b)
        pids = sorted(spans)
        for i, p in enumerate(pids):
            for q in pids[i + 1:]:
                if spans[p][0] < spans[q][1] and spans[q][0] < spans[p][1]:
                    concurrent.add((link, p, q))
        rows.sort()
        for i, (a, b, p) in enumerate(rows):
            for a2, b2, q in rows[i + 1:]:
                if a2 >= b:
                    break
                if q != p and min(b, b2) - a2 > min_overlap_ns:
                    shared += 1
    return shared, len(concurrent)


def _loopback_tasks(g, length: int, compute_base_s: float, seed: int, tasks: dict, plan_for,
                    stagger_s: float = 0.01):
    """Real agent processes on loopback in CREW's task mode (p = 2, T = 4 s), worker i computing
    ``compute_base_s + stagger_s * i`` s a round: (results, nodes, the agents' exit codes)."""
    from agents.local import LocalCluster

    plan0 = make_plan("crew", g, length, {})
    nodes = list(plan0.nodes)
    compute = {n: [compute_base_s + stagger_s * i] for i, n in enumerate(nodes)}
    opts = {"p": 2, "window_s": 4.0, "link_timeout_s": 1.0, **tasks, "plan_for": plan_for}
    with LocalCluster(plan0, timeout_s=20, compute_s=compute, seed=seed, driver=lambda c: TaskRun(c, opts)) as cl:
        res = cl.run()
        codes = {n: p.wait(timeout=15) for n, p in cl.procs.items()}
    return res, nodes, codes


@pytest.mark.parametrize("scheduling", ["fcfs", "fs"])
def test_loopback_concurrent_tasks_on_a_link_follow_the_scheduling_policy(scheduling):
    """§IV-C across tasks, on real agents: every worker aggregates for every task, so two
    groups in flight meet on the same directed links (one's scatter, the other's multicast).
    Sends are paced (400 Mbit/s per connection) so a chunk takes a few ms.  FL-FCFS: the
    link serves one task's chunk at a time (the agent's LinkGate), arrivals of two tasks'
    chunks on a link do not overlap; FS: each task's flow has its own connection and they
    overlap.  Every worker computes equally long, so the two groups of a round form together
    and meet on every link (staggered compute, on a loaded machine, can leave too few chunk
    pairs overlapping to tell).  Every round exact either way."""
    g, length = topogen.crew_mesh(4, 1).graph(), 1_000_003
    # an 8 s window: a margin for a loaded machine, where fewer tasks meet on a link
    with WakeUpLateness() as woken:
        res, nodes, _ = _loopback_tasks(g, length, 0.03, 8, {"chunk_times": True, "window_s": 8.0},
                                        lambda m, **kw: _paced(make_plan("crew", g, length, {
                                            "active": list(m), "scheduling": scheduling, "split": "even", **kw}), 400),
                                        stagger_s=0.0)
    tm = res["tasks_mode"]
    assert not res["errors"], res["errors"]
    assert tm["tasks"] and all(t["correct"] for t in tm["tasks"])
    assert_rounds_consecutive(tm["tasks"], nodes)
    # FL-FCFS: the gate hands the link on once the previous flow's socket has sent every byte, so
    # on the link the flows do not overlap; but a chunk's arrival is stamped when its receiving
    # thread reads the last bytes, as late as the machine wakes that thread.  Overlaps are
    # counted beyond that measured lateness (the p99 of a 1 ms sleep's overshoot during the run;
    # ~0.1 ms idle, several ms with a qemu guest busy on both cores).
    margin_ns = max(1_500_000, woken.p99_ns()) if scheduling == "fcfs" else 1_500_000
    shared, concurrent = link_sharing(tm["tasks"], margin_ns)
    print(f"{scheduling}: {len(tm['tasks'])} tasks, {concurrent} (link, task pair) overlaps, "
          f"{shared} chunk pairs sharing a link by more than {margin_ns / 1e6:.2f} ms")
    assert concurrent >= 3, "too few tasks met on a link to tell"
    if scheduling == "fcfs":
        assert shared <= max(2, concurrent // 4), (shared, concurrent)
    else:
        # measured (equal compute, 7 runs under two busy loops): 202-569 of 111-374; FL-FCFS 2-9 of
        # 100-141.  Busy cores serialise the senders, so fewer chunks meet: an eighth still says they overlap
        assert shared >= max(3, concurrent // 8), (shared, concurrent)


def test_loopback_controller_lost_mid_run_workers_go_standalone_and_rejoin():
    """§IV-B, the controller's failure, on real agent processes: 1.5 s into the window every
    worker's control connection is closed at once and the controller's state dropped; the
    workers go standalone (tasks they run go on, no new groups, reconnection tried) and
    rejoin the restarted controller 1 s later, which re-obtains their rounds, readiness and
    tasks from the REJOINs.  Tasks running across the loss finish or are abandoned; every
    round any worker holds is exact and counted once; groups form again; every agent exits
    cleanly."""
    g, length = topogen.crew_mesh(4, 1).graph(), 400_003
    res, nodes, codes = _loopback_tasks(
        g, length, 0.02, 9, {"controller_down": {"at_s": 1.5, "for_s": 1.0}, "controller_wait_s": 8.0},
        lambda m, **kw: make_plan("crew", g, length, {"active": list(m), **kw}))
    assert codes == {n: 0 for n in nodes}, codes
    assert not res["errors"], res["errors"]
    check_controller_lost(res["tasks_mode"], nodes)


def check_controller_lost(tm: dict, nodes: list[str]) -> None:
    """One controller loss, every worker rejoined, nothing counted twice, groups again after."""
    fault, = tm["faults"]
    assert fault["controller"] == "lost" and set(fault["rejoined"]) == set(nodes) and not tm["lost"], fault
    assert fault["t_ns"] < fault["back_ns"] <= min(fault["rejoined"].values())
    assert fault["back_ns"] - fault["t_ns"] >= 0.9e9
    assert all(t["correct"] for t in tm["tasks"])
    assert_rounds_consecutive(tm["tasks"], nodes)
    during = [t for t in tm["tasks"] if fault["t_ns"] < t.get("formed_ns", 0) < fault["back_ns"]]
    assert not during, "a group formed while the controller was down"
    after = [t for t in tm["tasks"] if t.get("formed_ns", 0) > fault["back_ns"] and t["outcome"] == "done"]
    assert after and {m for t in after for m in t["members"]} == set(nodes), "groups did not form again"
    for t in fault["tasks"]:
        assert t["outcome"] == "abandoned", t
    print("controller fault:", {k: v for k, v in fault.items() if k != "rejoined"}, "rounds:", tm["rounds"])


@pytest.mark.net
def test_emulated_controller_lost_mid_run_the_run_goes_on(netenv, tmp_path):
    """§IV-B's controller failure under `testbed run` on the emulated mesh
    (``groups.controller_down``): the workers go standalone and rejoin, the run completes its
    window with every round exact, and results.json records the fault."""
    text = EMU_EXP.replace("name: crew-runtime", "name: crew-controller").replace(
        "scheme: {name: crew, groups: {p: 2, window_s: 8}}",
        "scheme: {name: crew, groups: {p: 2, window_s: 8, controller_down: {at_s: 3, for_s: 1.5}}}").replace(
        "variants: [{label: opr, scheme: {name: crew, aggregators: members, groups: {p: 2, window_s: 8}}}]\n", "")
    _, results = run_emulated(tmp_path, text)
    run, = results["runs"]
    assert run["correct"], run["errors"]
    check_controller_lost(run["groups"], ["n0", "n1", "n2", "n3"])
    assert run["rounds_total"] == sum(run["rounds"].values()) > 0


def test_link_gate_serves_tickets_in_order_across_owners_and_skips_closed_ones():
    """FL-FCFS's gate alone (threads, no sockets sent on): sends of two executors to one peer
    are served in ticket (ready) order, one at a time; a closed executor's tickets pass."""
    import socket
    import threading

    from agents.executor import LinkGate

    class Owner:
        closing = False

    a, b, dead = Owner(), Owner(), Owner()
    gate, order, lock = LinkGate(), [], threading.Lock()
    s1, s2 = socket.socketpair()
    tickets = [(a, gate.ticket(a)), (b, gate.ticket(b)), (dead, gate.ticket(dead)), (a, gate.ticket(a)),
               (b, gate.ticket(b))]
    dead.closing = True

    def send(owner, t):
        gate.acquire(t, s1, 5.0, lambda: False)
        with lock:
            order.append(t)
        gate.release(t, s1)
    threads = [threading.Thread(target=send, args=x) for x in reversed(tickets) if x[0] is not dead]
    for th in threads:
        th.start()
    for th in threads:
        th.join(5)
    s1.close()
    s2.close()
    assert order == [0, 1, 3, 4]


def test_link_gate_does_not_wait_for_a_reset_connection_to_drain():
    """The previous holder's connection was reset with bytes unsent (its peer closed it: a
    version stopped at a link break).  Linux keeps counting those bytes as unsent for as
    long as the socket is open here; the next holder must not wait its whole timeout for them
    (the first task over a link that came back would stall for its whole timeout)."""
    import socket
    import time as _time

    from agents.executor import LinkGate, unsent_bytes

    class Owner:
        closing = False

    server = socket.create_server(("127.0.0.1", 0))
    dead = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    dead.setblocking(False)
    try:
        while True:  # the peer reads nothing: bytes pile up unsent here
            dead.send(b"x" * 65536)
    except BlockingIOError:
        pass
    assert unsent_bytes(dead) > 0
    peer.close()  # unread data: RST
    _time.sleep(0.2)
    assert unsent_bytes(dead) == 0
    gate, a, b = LinkGate(), Owner(), Owner()
    ta = gate.ticket(a)
    gate.acquire(ta, dead, 5.0, lambda: False)
    gate.release(ta, dead)
    tb = gate.ticket(b)
    t0 = _time.monotonic()
    with socket.socket() as mine:
        gate.acquire(tb, mine, 5.0, lambda: False)
    assert _time.monotonic() - t0 < 1.0
    for s in (dead, server):
        s.close()


def test_groups_controller_down_is_validated():
    base = {"name": "g", "topology": "small-3"}
    exp = config.validate({**base, "scheme": {"name": "crew", "groups": {
        "p": 2, "window_s": 5, "controller_down": {"at_s": 1, "for_s": 2}}}})
    assert exp.scheme["groups"]["controller_down"] == {"at_s": 1.0, "for_s": 2.0}
    for bad, key in (({"at_s": 6, "for_s": 1}, "scheme.groups.controller_down.at_s"),
                     ({"at_s": 1}, "scheme.groups.controller_down.for_s"),
                     ({"at_s": 1, "for_s": 1, "x": 1}, "scheme.groups.controller_down.x")):
        with pytest.raises(ConfigError) as e:
            config.validate({**base, "scheme": {"name": "crew", "groups": {"p": 2, "window_s": 5,
                                                                           "controller_down": bad}}})
        assert e.value.key == key, e.value


def test_a_send_ready_after_its_connection_broke_takes_no_turn_on_the_link():
    """FL-FCFS: a version whose connection to b broke (its run failed, its sender to b ended)
    still receives; a send to b that becomes ready then takes no ticket of b's gate, which
    would hold every later task's sends to b until this version is closed."""
    import socket

    from agents import wire
    from agents.executor import ExecError, Executor, LinkGate
    from testbed.plan import RECV, SEND, Op

    gate = LinkGate()
    prog = [Op(0, RECV, "c", 1, 0, 4), Op(1, SEND, "b", 2, 0, 4, deps=(0,)), Op(2, SEND, "b", 3, 4, 4)]
    ex = Executor("a", prog, length=8, timeout_s=5.0, gate=lambda peer: gate)
    to_b, b_end = socket.socketpair()
    c_end, from_c = socket.socketpair()
    try:
        ex.attach_outgoing("b", 0, to_b)
        ex.attach_incoming("c", 0, from_c)
        b_end.close()  # b is gone: the first send to it breaks the connection
        ex.prepare(None)
        with pytest.raises(ExecError, match="to b"):
            ex.run(0)
        wire.send_frame(c_end, wire.Header(wire.DATA, xfer=1, payload_len=16), np.zeros(4, np.float32))
        deadline = time.monotonic() + 5
        while ex._done[0] != 0 and time.monotonic() < deadline:  # the receive completes, the send is ready
            time.sleep(0.01)
        assert ex._done[0] == 0 and ex._dispatched[1]
        assert not gate._pending, gate._pending
    finally:
        ex.close()
        c_end.close()
