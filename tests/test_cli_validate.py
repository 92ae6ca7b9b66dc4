"""`validate` and `run` reject broken experiment files with one clear line and exit 2."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

GOOD = """\
name: t
topology: small-3
scheme: {name: ring}
workload: {size: 64KB}
"""

BROKEN = {
    "yaml_syntax": ("name: t\ntopology: [small-3\n", "invalid YAML"),
    "unknown_top_key": (GOOD + "colour: blue\n", "colour: unknown key"),
    "unknown_scheme": (GOOD.replace("ring", "warp-drive"), "scheme.name: unknown scheme 'warp-drive'"),
    "wrong_type": (GOOD + "repetitions: three\n", "repetitions: expected an integer"),
    "missing_topology": ("name: t\nscheme: {name: ring}\n", "topology: missing"),
    "unknown_node": (GOOD.replace("{name: ring}", "{name: ps, hub: h9}"), "scheme.hub: unknown datacenter 'h9'"),
    "unknown_param": (GOOD.replace("{name: ring}", "{name: ring, speed: 3}"), "scheme.speed"),
    "bad_size": (GOOD.replace("64KB", "lots"), "workload.size"),
    "bad_topology_link": (textwrap.dedent("""\
        name: t
        scheme: {name: ring}
        topology:
          name: inline
          datacenters: [a, b]
          links: [{between: [a, c], rate_mbps: 10}]
        """), "links[0]"),
    "unknown_topology": (GOOD.replace("small-3", "no-such-topology"), "no-such-topology"),
    "dynamics_bad_link": (GOOD + "dynamics: [{at_s: 1, link: [h1, h7], rate_mbps: 5}]\n", "dynamics[0].link"),
    "fault_bad_kind": (GOOD + "faults: [{at_s: 1, explode: h1}]\n", "faults[0]"),
    "bad_tcp_cc": (GOOD + "emulator: {tcp_cc: 'fast please'}\n", "emulator.tcp_cc"),
    "negative_frame_ms": (GOOD + "emulator: {frame_ms: -1}\n", "emulator.frame_ms"),
    "tiny_subblock": (GOOD + "agents: {subblock_bytes: 4}\n", "agents.subblock_bytes: must be at least 8 bytes"),
    "bad_subblock": (GOOD + "agents: {subblock_bytes: big}\n", "agents.subblock_bytes: cannot parse size"),
    "bad_links": (GOOD + "agents: {links: mux}\n", "agents.links: expected one of channel, shared, got 'mux'"),
    # what only planning finds (validate runs the planners, no network)
    "disconnected": (textwrap.dedent("""\
        name: t
        scheme: {name: ring}
        topology: {name: d, datacenters: [a, b, c], links: [{between: [a, b], rate_mbps: 10}]}
        """), "topology: topology 'd' is not connected"),
    "planner_rejects_param": (GOOD.replace("{name: ring}", "{name: mtree, H: 0.001}"),
                              "scheme.H: mtree: GBST found no spanning tree"),
    "planner_rejects_variant": (GOOD + "variants: [{label: m, scheme: {name: mtree, H: 0.001}}]\n",
                                "variants[0].scheme.H: mtree"),
    "size_beyond_memory": (GOOD.replace("64KB", "5TB"), "does not fit in this machine's memory"),
}


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "testbed", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60)


def test_good_file_validates(tmp_path):
    f = tmp_path / "good.yaml"
    f.write_text(GOOD)
    res = _cli("validate", str(f))
    assert res.returncode == 0, res.stderr
    assert "ok" in res.stdout


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_file_is_rejected_clearly(tmp_path, case):
    text, expected = BROKEN[case]
    f = tmp_path / f"{case}.yaml"
    f.write_text(text)
    res = _cli("validate", str(f))
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr  # one line, no traceback
    assert lines[0].startswith("error: ") and str(f) in lines[0]
    assert expected in lines[0]


def test_binary_file_is_one_line(tmp_path):
    f = tmp_path / "binary.yaml"
    f.write_bytes(b"name: t\n\xff\xfe\x00\x01 binary")
    res = _cli("validate", str(f))
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [f"error: {f}: not a text (UTF-8) experiment file: "
                                               "byte 0xff at offset 8"]


def test_memory_limit_is_given():
    from testbed import config, workloads
    from testbed.errors import ConfigError

    limit = workloads.max_vector_bytes(3)
    assert 0 < limit < workloads.machine_memory()
    ok = {"name": "t", "topology": "small-3", "scheme": {"name": "ring"}, "workload": {"size": limit}}
    assert config.validate(ok).workload.bytes <= limit
    with pytest.raises(ConfigError, match=f"at most {limit / 1e6:.0f} MB"):
        config.validate({**ok, "workload": {"size": limit + 8}})


def test_run_rejects_broken_file_before_starting_anything(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text(BROKEN["unknown_scheme"][0])
    res = _cli("run", str(f), "--out", str(tmp_path / "out"))
    assert res.returncode == 2
    assert not (tmp_path / "out").exists()


def test_set_overrides_are_validated(tmp_path):
    f = tmp_path / "good.yaml"
    f.write_text(GOOD)
    assert _cli("validate", str(f), "--set", "scheme.name=ps").returncode == 0
    res = _cli("validate", str(f), "--set", "workload.iterations=0")
    assert res.returncode == 2 and "workload.iterations" in res.stderr


def test_every_shipped_experiment_validates():
    from testbed.config import shipped_experiments

    files = shipped_experiments()
    assert "quickstart.yaml" in {f.name for f in files} and "servers-local-2.yaml" not in {f.name for f in files}
    for f in files:
        res = _cli("validate", str(f))
        assert res.returncode == 0, f"{f.name}: {res.stderr}"


def test_help_on_every_verb():
    for verb in ("run", "deploy", "validate", "plan", "doctor", "clean", "linkcheck", "bench"):
        res = _cli(verb, "--help")
        assert res.returncode == 0 and "usage" in res.stdout.lower(), verb


def test_bench_table_takes_every_rows_keys(capsys):
    """bench dataplane's rows differ (loopback rows carry CPU columns, link rows `correct`):
    one column per key of any row, blank where a row lacks it."""
    from testbed.cli import _print_table

    _print_table([{"link": "loopback", "cpu_ms": 0.0631}, {"link": "100 Mbit/s", "correct": True}])
    head, first, second = capsys.readouterr().out.splitlines()
    assert head.split() == ["link", "cpu_ms", "correct"]
    assert first.split() == ["loopback", "0.0631"] and second.split() == ["100", "Mbit/s", "True"]
