"""End to end: real Mininet WAN, real agent processes, real TCP, exact results."""

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agents.executor import tcp_losses
from testbed.emulator import memory
from testbed.emulator.cleanup import leftovers
from testbed.emulator.hosts import EmulatedHosts
from testbed.emulator.network import WanNetwork
from testbed.experiment import _per_link, _tcp_summary
from testbed.hosts import run_agents
from testbed.planners import make_plan
from testbed.results import TCP_FIELDS
from testbed.topology import load_topology

pytestmark = pytest.mark.net
REPO = Path(__file__).resolve().parent.parent


def _run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "testbed", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_quickstart_smoke(netenv, tmp_path):
    res = _run_cli("run", "experiments/quickstart.yaml", "--out", str(tmp_path))
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads((tmp_path / "results.json").read_text())
    assert out["summary"]["correct"] is True
    assert len(out["runs"]) == out["experiment"]["repetitions"]
    assert all(r["correct"] and r["cct_s"] > 0 for r in out["runs"])
    assert out["summary"]["cct_s"]["mean"] > 0 and out["summary"]["predicted_cct_s"] > 0
    assert {l["method"] for l in out["links"]} <= {"htb+netem", "htb+user-space-relay"}
    assert any(l["delay_ms"] > 0 for l in out["links"])
    assert out["environment"]["git_commit"]
    env = out["environment"]
    assert "cpu_model" in env and "preemption" in env and (env["memory_hold"] is not None) == memory.reports_free_pages()
    assert "kept_up" in out["emulation"]
    for busy in [out["emulation"]["iterations_cpu_util"]] + [r["iterations_cpu_util"] for r in out["runs"]]:
        assert busy is None or 0 <= busy <= 1  # None: no 0.25-s sample fell inside an iteration
    assert out["runs"][0]["transfers"]["rows"]
    if tcp_losses(socket.socket()) is not None:  # what loss recovery cost, counted on a WAN without loss too
        assert all(set(r["tcp"]) == set(TCP_FIELDS) for r in out["runs"])
        assert all(set(TCP_FIELDS) <= set(lk) for r in out["runs"] for lk in r["links"])


def test_multitree_on_mesh(netenv, tmp_path):
    from testbed.planners import schemes

    if "multitree" not in schemes():
        pytest.skip("multitree planner not available")
    topo = load_topology("mesh-2x2")
    with WanNetwork(topo) as net:
        plan = make_plan("multitree", topo.graph(), 40_000)
        res = run_agents(EmulatedHosts(net), plan, tmp_path, timeout_s=60)
    assert all(it["correct"] for it in res["iterations"])


def _new(before: dict) -> dict:
    """What exists now that did not before the test started."""
    return {k: sorted(set(v) - before[k]) for k, v in leftovers().items() if set(v) - before[k]}


def _long_experiment(tmp_path, extra=""):
    f = tmp_path / "long.yaml"
    f.write_text("name: long\ntopology: small-3\nscheme: {name: ring}\nrepetitions: 50\n"
                 "workload: {size: 4MB, iterations: 3}\n" + extra)
    return f


def test_sigint_tears_everything_down(netenv, tmp_path):
    """SIGINT tears the run down, also one started with SIGINT ignored (as a script's
    background job is, which Python then never interrupts by itself)."""
    f = _long_experiment(tmp_path)
    p = subprocess.Popen([sys.executable, "-m", "testbed", "run", str(f), "--out", str(tmp_path / "o")],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not list((tmp_path / "o" / "agents").glob("*.json")):
            time.sleep(0.2)
        time.sleep(1.0)  # agents running
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:  # never leave it running: the next tests would meet its network
            p.kill()
            p.wait()
            _run_cli("clean")
    assert p.returncode == 130, err[-2000:]
    assert "interrupted" in err
    assert not _new(netenv), _new(netenv)
    assert not (tmp_path / "o" / "results.json").exists()


def test_sigkill_then_clean_leaves_nothing(netenv, tmp_path):
    f = _long_experiment(tmp_path)
    p = subprocess.Popen([sys.executable, "-m", "testbed", "run", str(f), "--out", str(tmp_path / "o")],
                         cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline and not list((tmp_path / "o" / "agents").glob("*.json")):
        time.sleep(0.2)
    time.sleep(1.0)
    p.kill()
    p.wait()
    assert _new(netenv)  # a killed run cannot clean up after itself ...
    res = _run_cli("clean")
    assert res.returncode == 0
    assert not _new(netenv), _new(netenv)  # ... but `clean` removes it all


def test_a_failed_run_keeps_the_repetitions_that_finished(netenv, tmp_path):
    """results.json is rewritten after every repetition: a crash mid-run leaves the finished
    repetitions in it, and the error, and exits 1."""
    f = tmp_path / "e.yaml"
    f.write_text("name: crash\ntopology: small-3\nscheme: {name: ring}\nrepetitions: 60\n"
                 "workload: {size: 200KB, iterations: 1, warmup: 0}\nfaults: [{at_s: 6, crash: h2}]\n"
                 "agents: {timeout_s: 10}\n")
    res = _run_cli("run", str(f), "--out", str(tmp_path / "o"), "--no-report", timeout=180)
    assert res.returncode == 1, res.stderr[-2000:]
    out = json.loads((tmp_path / "o" / "results.json").read_text())
    assert "h2" in out["error"]
    assert out["failure"]["variant"] == "ring" and out["failure"]["repetition"] == len(out["runs"]), out["failure"]
    assert 1 <= len(out["runs"]) < 60 and all(r["correct"] for r in out["runs"]), len(out["runs"])
    assert [r["repetition"] for r in out["runs"]] == list(range(len(out["runs"])))


def test_crashed_datacenter_fails_the_run_naming_it(netenv, tmp_path):
    f = _long_experiment(tmp_path, "faults: [{at_s: 3, crash: h2}]\nagents: {timeout_s: 10}\n")
    res = _run_cli("run", str(f), "--out", str(tmp_path / "o"), timeout=120)
    assert res.returncode == 1, res.stderr[-2000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and "h2" in last, last


def test_every_iteration_counts_what_tcps_loss_recovery_cost(netenv, tmp_path):
    """On a lossy link the agents' connections retransmit; every iteration records, per link
    direction, the segments retransmitted, the timeouts and the time in their recovery, and
    the run sums them (Linux >= 6.7)."""
    if tcp_losses(socket.socket()) is None:
        pytest.skip("this kernel's tcp_info does not count timeouts (Linux < 6.7)")
    topo = load_topology({"name": "lossy", "datacenters": ["a", "b"],
                          "links": [{"between": ["a", "b"], "rate_mbps": 50, "delay_ms": 5, "loss": 0.02}]})
    with WanNetwork(topo) as net:
        res = run_agents(EmulatedHosts(net), make_plan("ring", topo.graph(), 1_000_000), tmp_path, timeout_s=60,
                         iterations=2)
    its = res["iterations"]
    assert all(it["correct"] for it in its)
    assert all(set(it["tcp"]) <= {"a->b", "b->a"} for it in its)
    # 2 % of ~2,800 segments a direction per iteration: none lost has a chance of e^-55
    assert all(sum(v[0] for v in it["tcp"].values()) > 0 for it in its)
    for it in its:
        it["warmup"] = False
        for segs, rtos, rto_s in it["tcp"].values():
            assert segs >= rtos >= 0 and rto_s >= 0
    links = _per_link(res["transfers"], its)
    assert {(l["src"], l["dst"]) for l in links} == {("a", "b"), ("b", "a")}
    total = _tcp_summary(its)["tcp"]
    assert total["retrans_segs"] == sum(l["retrans_segs"] for l in links) > 0
    assert [total[f] for f in TCP_FIELDS[:2]] == [sum(l[f] for l in links) for f in TCP_FIELDS[:2]]
