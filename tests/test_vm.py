"""The VM tooling's host-side logic (testbed/vm), without booting anything.  The guest
itself is exercised by `python3 -m testbed.vm stage` (.ci/run's VM stage)."""

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import testbed.vm as vm


def _git_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    for name in vm.IMAGE_INPUTS:
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(f"# {name}\n")
    (repo / ".gitignore").write_text("results/\n")
    (repo / "results").mkdir()
    (repo / "results" / "big.json").write_text("{}")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "add", "."], check=True)
    (repo / "new.py").write_text("x = 1\n")  # untracked, not ignored: a change being tested
    return repo


def test_checkout_tar_carries_tracked_and_new_files_but_not_ignored_ones(tmp_path):
    repo = _git_repo(tmp_path)
    (repo / "testbed/setup.sh").unlink()  # deleted in the work tree: not carried
    with tarfile.open(vm.checkout_tar(tmp_path / "c.tar", repo)) as tar:
        names = set(tar.getnames())
    assert names == {".gitignore", "new.py", "testbed/vm/build.sh", "testbed/vm/debootstrap.sh", "testbed/vm/guest-init.sh"}


def test_image_key_follows_exactly_the_image_inputs(tmp_path):
    repo = _git_repo(tmp_path)
    key = vm.image_key(repo)
    (repo / "new.py").write_text("x = 2\n")
    assert vm.image_key(repo) == key  # the checkout travels per boot: no rebuild
    (repo / "testbed/setup.sh").write_text("# changed provisioning\n")
    assert vm.image_key(repo) != key


def test_qemu_never_writes_the_cached_image_and_uses_tcg_by_default(tmp_path):
    cmd = vm.qemu_command(tmp_path, tmp_path / "x", cpus=1, memory_mb=1024, accel="tcg")
    drive = cmd[cmd.index("-drive") + 1]
    assert "snapshot=on" in drive and drive.startswith(f"file={tmp_path / 'root.img'}")
    assert cmd[cmd.index("-accel") + 1] == "tcg" and "-no-reboot" in cmd
    assert "panic=-1" in cmd[cmd.index("-append") + 1]  # a dead init ends qemu, never hangs it


@pytest.mark.parametrize("args", [["run"], ["run", "--timeout", "0", "--", "true"], ["stage", "--cpus", "0"],
                                  ["stage", "--accel", "xen"]])
def test_bad_arguments_exit_2_before_building_anything(args, tmp_path):
    res = subprocess.run([sys.executable, "-m", "testbed.vm", *args], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "TESTBED_VM_CACHE": str(tmp_path / "cache")},
                         timeout=60, cwd=Path(vm.__file__).parents[2])
    assert res.returncode == 2, res.stderr
    assert not (tmp_path / "cache").exists()


def test_compare_puts_the_two_paths_side_by_side_and_summarises_each():
    def result(method, ratio, delay, ok):
        row = {"phase": "single", "src": "a", "dst": "b", "rate_mbps": 5.0, "delay_ms": 10.0, "jitter_ms": 1.0,
               "loss": 0.01, "rate_ratio": ratio, "measured_delay_ms": delay, "measured_jitter_ms": 1.1,
               "measured_loss": 0.012, "expected_queue_ms": 100.0, "measured_queue_ms": 100.0 + delay - 10.0,
               "checks": {"rate": ok, "delay": True}, "ok": ok}
        return {"topology": "t", "scale": 0.1, "method": method, "directions": [row]}

    text = vm.compare_linkchecks(result("relay", 0.95, 10.2, True), result("netem", 0.90, 11.5, False))
    assert "0.950  0.900" in text and "+0.20  +1.50" in text and "ok / rate" in text
    assert "+0.2   +1.5 | ok / rate" in text  # the standing queue's error
    assert "single relay: rate ratio 0.950-0.950, |delay error| <= 0.20 ms, |queue error| <= 0.2 ms, 1/1" in text
    assert "single netem: rate ratio 0.900-0.900, |delay error| <= 1.50 ms, |queue error| <= 1.5 ms, 0/1" in text


def test_check_passes_only_netem_links_and_correct_runs(tmp_path):
    good = {"runs": [{"variant": "ring", "repetition": 0, "correct": True}],
            "links": [{"method": "htb+netem"}, {"method": "htb+netem"}]}
    assert vm.netem_problems(good) == []
    assert vm.netem_problems({"directions": [{"method": "htb+netem"}]}) == []  # a linkcheck.json
    relay = {**good, "links": [{"method": "htb+netem"}, {"method": "relay"}]}
    assert vm.netem_problems(relay) == ["link methods ['htb+netem', 'relay'], expected only htb+netem"]
    wrong = {**good, "runs": [{"variant": "ring", "repetition": 1, "correct": False}]}
    assert vm.netem_problems(wrong) == ["run ring rep 1: result not correct"]
    assert vm.netem_problems({**good, "runs": []}) == ["no runs"]
    assert vm.netem_problems({}) == ["link methods [], expected only htb+netem"]
    (tmp_path / "good.json").write_text(json.dumps(good))
    (tmp_path / "wrong.json").write_text(json.dumps(wrong))
    (tmp_path / "empty.json").write_text("")  # what a guest that wrote nothing leaves
    cmd = [sys.executable, "-m", "testbed.vm", "check"]
    ok = subprocess.run(cmd + [str(tmp_path / "good.json")], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "2 link directions, all htb+netem" in ok.stdout
    bad = subprocess.run(cmd + [str(tmp_path / f) for f in ("good.json", "wrong.json", "empty.json")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1
    assert "result not correct" in bad.stdout and "empty.json: cannot read it" in bad.stdout


def test_stage_runs_the_link_checks_named_and_only_those():
    from testbed.vm.__main__ import LINKCHECKS, stage_command
    assert "LINKCHECKS='' bash testbed/vm/stage.sh 0.1" == stage_command(0.1, False, None)
    every = stage_command(0.1, True, [])
    assert every.startswith("STRICT=1 LINKCHECK_TESTS=1 ") and all(t in every for t in LINKCHECKS.values())
    two = stage_command(0.2, False, ["jitter-3", "lossy-jitter-4"])
    assert two == "LINKCHECKS='testbed/vm/lossy-jitter-4.yaml testbed/vm/jitter-3.yaml' bash testbed/vm/stage.sh 0.2"
