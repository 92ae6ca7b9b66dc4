"""Reports and sweeps: real runs on small emulated WANs, the HTML page opened in a real
headless browser (Debian's chromium), every figure decoded; sweep expansion and validation."""

import base64
import csv
import json
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from testbed import config
from testbed.errors import ConfigError
from testbed.report import DPI, FIG_W_IN

REPO = Path(__file__).resolve().parent.parent
BASE = {"name": "t", "topology": "small-3", "seed": 1, "repetitions": 1, "scheme": {"name": "ring"},
        "workload": {"size": "256KB"}, "agents": {"timeout_s": 30}}


def _browser() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    pytest.skip("no headless browser: install Debian's chromium (apt-get install chromium; .ci/run does)")


def open_in_browser(page: Path) -> dict:
    """Load ``page`` in headless chromium and return what its check script recorded on
    <body>: images on the page, images the browser decoded, script errors."""
    res = subprocess.run([_browser(), "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=10000",
                          "--enable-logging=stderr", "--dump-dom", page.resolve().as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    body = re.search(r"<body([^>]*)>", res.stdout)
    assert body, res.stdout[:2000]
    attrs = dict(re.findall(r'data-([a-z-]+)="([^"]*)"', body.group(1)))
    assert "Uncaught" not in res.stderr, res.stderr[-2000:]
    return {k: int(v) for k, v in attrs.items()}


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", data[16:24])


def check_page(page: Path, figures: list[str]) -> None:
    """The page opens without errors, every image decodes, each named figure is on the page
    (embedded) and on disk, a PNG of the figure width."""
    got = open_in_browser(page)
    assert got["errors"] == 0 and got["images"] >= len(figures) and got["images-ok"] == got["images"], got
    html = page.read_text()
    embedded = [base64.b64decode(b) for b in re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", html)]
    for name in figures:
        data = (page.parent / name).read_bytes()
        w, h = png_size(data)
        assert w == int(FIG_W_IN * DPI) and h >= 200, (name, w, h)
        assert data in embedded, f"{name} not embedded in the page"


def test_browser_check_sees_a_broken_image(tmp_path):
    """The browser check can fail: a page with an undecodable image is caught."""
    from testbed.report import CHECK_JS

    page = tmp_path / "bad.html"
    page.write_text(f"<html><head><script>{CHECK_JS}</script></head><body>"
                    "<img src='data:image/png;base64,AAAA'></body></html>")
    got = open_in_browser(page)
    assert got["images"] == 1 and got["images-ok"] == 0


def _cli(*args, timeout=400):
    return subprocess.run([sys.executable, "-m", "testbed", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.net
def test_run_writes_report_with_every_figure(netenv, tmp_path):
    exp = {**BASE, "variants": [{"label": "ps", "scheme": {"name": "ps"}}], "scale": 0.5,
           "dynamics": [{"at_s": 0.5, "link": ["h1", "h2"], "rate_mbps": 20}]}
    exp_file = tmp_path / "e.yaml"
    exp_file.write_text(yaml.safe_dump(exp))
    res = _cli("run", str(exp_file), "--out", str(tmp_path / "r"))
    assert res.returncode == 0, res.stderr[-3000:]
    page = tmp_path / "r" / "report.html"
    assert res.stdout.strip().splitlines()[-1] == f"report: {page}"
    check_page(page, ["cct.png", "gantt-0.png", "links-0.png"])
    results = json.loads((tmp_path / "r" / "results.json").read_text())
    assert all(len(r["warmup_cct_s"]) == 1 for r in results["runs"])  # workload.warmup defaults to 1
    applied = {e["rate_mbps"] for e in results["events"] if e.get("event") == "rate"}
    assert applied == {10.0} and results["experiment"]["dynamics"][0]["rate_mbps"] == 20  # scaled once
    assert "rate" in page.read_text() and "Dynamics and faults" in page.read_text()
    rows = list(csv.DictReader(open(tmp_path / "r" / "variants.csv")))
    assert [r["variant"] for r in rows] == ["ring", "ps"] and all(float(r["cct_mean_s"]) > 0 for r in rows)
    # report over two folders (a run and the same run again): one comparison of both
    rep = _cli("report", str(tmp_path / "r"), str(tmp_path / "r"), "--out", str(tmp_path / "both"))
    assert rep.returncode == 0, rep.stderr
    check_page(tmp_path / "both" / "report.html", ["cct.png", "gantt-0.png", "gantt-1.png"])


@pytest.mark.net
def test_two_parameter_sweep_runs_and_plots(netenv, tmp_path):
    exp = {**BASE, "variants": [{"label": "ps", "scheme": {"name": "ps"}}],
           "sweep": {"grid": {"scheme.chunks": [1, 4], "workload.size": ["128KB", "512KB"]},
                     "points": [{"agents.timeout_s": 0.001}]}}  # a point that fails: the others stay
    exp_file = tmp_path / "s.yaml"
    exp_file.write_text(yaml.safe_dump(exp))
    res = _cli("run", str(exp_file), "--out", str(tmp_path / "s"))
    assert res.returncode == 1, res.stderr[-3000:]  # the failing point
    assert "sweep point 5/5" in res.stderr and "left" in res.stderr
    sweep = json.loads((tmp_path / "s" / "sweep.json").read_text())
    assert [p["status"] for p in sweep["points"]] == ["ok"] * 4 + ["failed"]
    assert sweep["keys"] == ["scheme.chunks", "workload.size", "agents.timeout_s"]
    # one network for all points: same topology, scale, seed and emulator; no dynamics
    assert res.stderr.count("network up") == 1, res.stderr
    rows = list(csv.DictReader(open(tmp_path / "s" / "sweep.csv")))
    assert len(rows) == 4 * 2 + 1
    sizes = {(r["scheme.chunks"], r["workload.size"], r["variant"]): float(r["cct_mean_s"])
             for r in rows if r["variant"]}
    assert sizes[("1", "512KB", "ring")] > sizes[("1", "128KB", "ring")]
    for p in sweep["points"][:4]:
        assert json.loads((tmp_path / "s" / p["dir"] / "results.json").read_text())["summary"]["correct"]
    check_page(tmp_path / "s" / "report.html", ["sweep-0.png", "cct.png", "gantt-0.png", "links-0.png"])
    assert "sweep point 4 failed" in (tmp_path / "s" / "report.html").read_text()


def test_sweep_expands_grid_and_points_and_validates_each():
    exp = config.validate({**BASE, "sweep": {"grid": {"scheme.chunks": [1, 2], "seed": [1, 2, 3]},
                                             "points": [{"workload.size": "2MB"}]}}, "x.yaml")
    pts = exp.sweep["points"]
    assert len(pts) == 7 and exp.sweep["keys"] == ["scheme.chunks", "seed", "workload.size"]
    assert pts[0]["values"] == {"scheme.chunks": 1, "seed": 1} and pts[5]["experiment"].seed == 3
    assert pts[6]["experiment"].workload.bytes == 2_000_000 and pts[6]["experiment"].scheme["chunks"] == 1
    assert all(p["experiment"].sweep is None for p in pts)
    assert exp.to_dict()["sweep"]["points"][5]["experiment"]["seed"] == 3  # results.json's mapping
    for bad, where in [({"grid": {"scheme.chunkz": [1]}}, "sweep point 0 (scheme.chunkz=1): scheme.chunkz"),
                       ({"grid": {"seed": [1, -1]}}, "sweep point 1 (seed=-1): seed"),
                       ({"grid": {"name": ["x"]}}, "sweep.name"), ({"grid": {"seed": 1}}, "sweep.grid.seed"),
                       ({"points": [{"workload.size": "lots"}]}, "workload.size"), ({}, "sweep"),
                       ({"grid": {}, "extra": 1}, "sweep.extra")]:
        with pytest.raises(ConfigError) as e:
            config.validate({**BASE, "sweep": bad}, "x.yaml")
        assert where in str(e.value), str(e.value)


def test_report_of_a_groups_run_shows_rounds_per_worker(tmp_path):
    """A groups run (CREW at run time) has no iterations: the report does not fail on it and
    shows the rounds each worker completed in T, one bar per variant and worker."""
    from testbed.report import write_report

    runs = [{"variant": lbl, "repetition": rep, "cct_s": 0.5, "warmup_cct_s": [], "iterations": [],
             "rounds": {f"n{i}": base + rep - i for i in range(4)}, "rounds_total": 4 * base,
             "groups": {"p": 2, "window_s": 10, "tasks": [], "faults": [
                 {"t_ns": 1, "link": ["n0", "n1"], "reported_by": "n1", "back_ns": 2_000_000_001,
                  "tasks": [{"pid": 7, "outcome": "repaired", "replacement": {"n0": "n3"}}]},
                 {"t_ns": 3, "link": ["n2", "n3"], "reported_by": "n2", "back_ns": 4, "tasks": [],
                  "failover": False}] if rep else []},
             "correct": True, "incorrect": [], "errors": [], "transfers": None, "links": []}
            for lbl, base in (("crew", 12), ("alltoall", 5)) for rep in (0, 1)]
    runs[1]["tcp"] = {"retrans_segs": 7, "rtos": 1, "rto_s": 0.25}  # a run that lost segments
    runs[2]["tcp"] = {"retrans_segs": 0, "rtos": 0, "rto_s": 0.0}
    res = {"experiment": {"name": "g", "topology": {"name": "m4"}, "workload": {"bytes": 8},
                          "scheme": {"name": "crew", "groups": {"p": 2, "window_s": 10}}},
           "runs": runs, "events": [], "summary": {"correct": True},
           "variants": [{"label": lbl, "scheme": {"name": lbl}, "summary": {
               "cct_s": {"mean": 0.5, "min": 0.5, "max": 0.5, "n": 2}, "rounds_total": {"mean": 4.0 * base},
               "correct": True}} for lbl, base in (("crew", 12), ("alltoall", 5))]}
    (tmp_path / "results.json").write_text(json.dumps(res))
    page = write_report([tmp_path])
    html = page.read_text()
    assert "Rounds per worker in the window T" in html and "Timeline of one iteration" not in html
    assert "groups of p = 2 from the ready queue in a window T = 10 s" in html
    assert "link n0-n1 broken" in html and "7 repaired to" in html and "<td>2</td>" in html
    assert "reported by n2, back before the controller acted" in html
    lossy = html.split("TCP's loss recovery")[1].split("</table>")[0]  # the runs with retransmissions only
    assert "<td>crew</td><td>1</td><td>7</td><td>1</td><td>0.25</td>" in lossy and "alltoall" not in lossy
    rows = list(csv.DictReader(open(tmp_path / "variants.csv")))
    assert [float(r["rounds_total_mean"]) for r in rows] == [48.0, 20.0]
    check_page(page, ["rounds-0.png", "cct.png"])
