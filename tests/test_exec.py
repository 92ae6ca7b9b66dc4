"""``exec``: your own program on the emulated WAN — the shipped example ring all-reduce run
for real in every datacenter, its output and timing in results.json; the environment."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.net
REPO = Path(__file__).resolve().parent.parent


def _exec(tmp_path, *args, timeout=300):
    return subprocess.run([sys.executable, "-m", "testbed", "exec", "experiments/quickstart.yaml",
                           "--set", "topology=small-3", "--out", str(tmp_path), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def test_exec_runs_the_example_ring_allreduce_in_every_datacenter(netenv, tmp_path):
    res = _exec(tmp_path, "--", sys.executable, "examples/ring_allreduce.py", "--size-mb", "1", "--iterations", "2")
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout
    out = json.loads((tmp_path / "results.json").read_text())
    procs = out["processes"]
    assert sorted(procs) == ["h1", "h2", "h3"] and out["ok"]
    for dc, p in procs.items():
        assert p["exit_code"] == 0 and p["wall_s"] > 0 and not p["timed_out"]
        assert p["stdout"].startswith(f"rank {p['rank']} dc {dc}: ok, sum of 3 vectors"), p
    assert out["links"] and out["experiment"]["topology"]["name"] == "small-3"


def test_exec_environment_substitution_subset_and_failure(netenv, tmp_path):
    script = ("import os, socket, sys; e = os.environ; print(sys.argv[1], sys.argv[2], e['RANK'], e['WORLD_SIZE'], "
              "e['LOCAL_RANK'], e['MASTER_ADDR'], e['MASTER_PORT'], e['TESTBED_DC'], e['TESTBED_NODE_ADDRS'], "
              "socket.if_nametoindex(e['TESTBED_NODE_IFNAME']) > 0); sys.exit(int(e['RANK']))")
    res = _exec(tmp_path, "--on", "h3,h2", "--master-port", "29999", "--", sys.executable, "-c", script,
                "{dc}", "{rank}")
    assert res.returncode == 1, res.stderr  # rank 1 exits 1
    procs = json.loads((tmp_path / "results.json").read_text())["processes"]
    assert sorted(procs) == ["h2", "h3"]
    addrs = {dc: p["address"] for dc, p in procs.items()}
    for rank, dc in enumerate(["h2", "h3"]):  # rank order is the topology's order
        assert procs[dc]["stdout"].split() == [dc, str(rank), str(rank), "2", "0", addrs["h2"], "29999", dc,
                                               f"h2={addrs['h2']},h3={addrs['h3']}", "True"]
        assert procs[dc]["exit_code"] == rank
