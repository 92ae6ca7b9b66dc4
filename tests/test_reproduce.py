"""`reproduce`: the claims file, expressions, verdicts and the command's bad input (pure: no
network; `.ci/run` runs `reproduce --smoke` for the emulated part)."""

import pytest

from testbed import cli, topogen
from testbed.errors import ConfigError
from testbed.planners import schemes
from testbed.progress import time_left
from testbed.reproduce import (
    CLAIMS_FILE,
    Claim,
    EvalError,
    Run,
    check_runs,
    evaluate,
    in_range,
    judge,
    load_claims,
    referenced_runs,
    runnable,
    select,
)


def _results(cct: dict, rounds: dict | None = None, meta: dict | None = None, correct: bool = True) -> dict:
    runs = [{"variant": lbl, "repetition": i, "cct_s": v, **({"rounds_total": rounds[lbl][i]} if rounds else {})}
            for lbl, vals in cct.items() for i, v in enumerate(vals)]
    return {"variants": [{"label": lbl, "summary": {"predicted_cct_s": 1.0}, "plan": {"meta": meta or {}}}
                         for lbl in cct], "runs": runs, "summary": {"correct": correct},
            "emulation": {"kept_up": True}}


def test_the_shipped_claims_load_and_every_runnable_run_is_a_valid_experiment_in_every_mode():
    papers, runs, claims = load_claims()
    assert set(papers) == {"crew", "netstorm", "mtree", "topoadapt", "multitree"}
    assert {c.paper for c in claims} == set(papers)
    check_runs({r: runs[r] for r in runnable(claims, set(schemes()))})
    assert all(runs[r].overrides["smoke"] is None or runs[r].minutes["smoke"] <= 1 for r in runs)
    smoke = sum(runs[r].minutes["smoke"] for r in runnable(claims, set(schemes())) if runs[r].overrides["smoke"] is not None)
    quick = sum(runs[r].minutes["quick"] for r in runnable(claims, set(schemes())) if runs[r].overrides["quick"] is not None)
    assert smoke <= 5 and quick <= 30  # smoke: CI's budget; quick: its "about 25 minutes", estimates rounded up


def test_expressions_allow_only_quantities_arithmetic_min_and_max():
    assert referenced_runs("cct('a') / cct('b', run='r2') + plan('x', 'k', run='r3')", "r1") == ["r1", "r2", "r3"]
    for bad in ("__import__('os')", "cct('a').real", "open('f')", "cct(a)", "[1]", "cct('a', run=1)", "plan('a')",
                "cct('a') if 1 else 2", "lambda: 1"):
        with pytest.raises(ValueError):
            referenced_runs(bad, "r")


def test_evaluate_uses_means_and_pairs_repetitions_for_the_spread():
    res = {"r": _results({"ps": [10.0, 12.0], "lite": [2.0, 4.0]}, meta={"k": 0.5}),
           "s": _results({"ps": [5.0]})}
    m = evaluate("cct('ps') / cct('lite')", "r", res)
    assert m["value"] == pytest.approx(11 / 3) and m["n"] == 2 and m["spread"] == pytest.approx((3.0, 5.0))
    m = evaluate("plan('ps', 'k') * 2 + cct('ps', run='s')", "r", res)
    assert m == {"value": 6.0, "n": 1, "spread": None}
    assert evaluate("max(cct('ps'), cct('lite')) - min(cct('ps'), 1)", "r", res)["value"] == pytest.approx(10.0)
    with pytest.raises(EvalError, match="no variant 'pro'"):
        evaluate("cct('pro')", "r", res)
    with pytest.raises(EvalError, match="no measured rounds"):
        evaluate("rounds('ps')", "r", res)
    with pytest.raises(EvalError, match="no number 'x'"):
        evaluate("plan('ps', 'x')", "r", res)


def test_in_range_widens_both_ends_by_the_tolerance():
    assert in_range(6.0, (6.7, None), 0.2) and not in_range(5.0, (6.7, None), 0.2)
    assert in_range(2.2, (None, 2.0), 0.1) and not in_range(2.3, (None, 2.0), 0.1)
    assert in_range(1.32, (1.32, 1.32), 0.0) and not in_range(1.0, (1.32, 1.32), 0.15)


def _claim(**kw) -> Claim:
    base = dict(paper="netstorm", figure="Fig. 18", claim="lite 5.5x PS", run="r", value="cct('ps') / cct('lite')",
                expect=(5.5, 5.5), tolerance=0.2, unit="x", why="the hub", runs=("r",))
    return Claim(**{**base, **kw})


RUNS = {"r": Run("r", "netstorm-aux", "emulate", {"full": [], "quick": ["workload.size=8MB"], "smoke": None},
                 {"full": 9, "quick": 1, "smoke": 1})}


def test_judge_gives_each_verdict_with_its_reason():
    ok = {"r": {"status": "ok", "results": _results({"ps": [11.0], "lite": [2.0]})}}
    row = judge(_claim(), ok, "quick", {"ps"}, RUNS)
    assert row["verdict"] == "reproduced" and row["measured"] == "5.5x" and row["sizes"] == "workload.size=8MB"
    row = judge(_claim(expect=(7.5, 7.5)), ok, "quick", {"ps"}, RUNS)
    assert row["verdict"] == "not reproduced" and row["why"] == "the hub"
    assert judge(_claim(), ok, "smoke", {"ps"}, RUNS)["verdict"] == "not comparable"
    assert judge(_claim(comparable="other metric"), ok, "quick", {"ps"}, RUNS)["why"] == "other metric"
    row = judge(_claim(needs=("scheme:dbtree", "a BiGraph")), ok, "quick", {"ps"}, RUNS)
    assert row["verdict"] == "not run" and row["why"] == "needs the dbtree planner; a BiGraph"
    assert judge(_claim(needs=("scheme:ps",)), ok, "quick", {"ps"}, RUNS)["verdict"] == "reproduced"
    row = judge(_claim(), {"r": {"status": "skipped"}}, "smoke", {"ps"}, RUNS)
    assert row["verdict"] == "not run" and "--smoke leaves run r out (about 9 min" in row["why"]
    row = judge(_claim(), {"r": {"status": "failed", "error": "exit 1: boom"}}, "quick", {"ps"}, RUNS)
    assert row["verdict"] == "not run" and "boom" in row["why"] and row["measurement"] == "runs/r/run.log"
    wrong = {"r": {"status": "ok", "results": _results({"ps": [11.0], "lite": [2.0]}, correct=False)}}
    assert judge(_claim(), wrong, "quick", {"ps"}, RUNS)["verdict"] == "not comparable"
    row = judge(_claim(value="cct('pro')"), ok, "quick", {"ps"}, RUNS)
    assert row["verdict"] == "not run" and "no variant 'pro'" in row["why"]


def test_a_bad_claims_file_names_the_key(tmp_path):
    text = CLAIMS_FILE.read_text()
    bad = tmp_path / "claims.yaml"
    bad.write_text(text.replace("expect: [12, 15]", "expect: [15, 12]", 1))
    with pytest.raises(ConfigError, match=r"claims\[0\]\.expect"):
        load_claims(bad)
    bad.write_text(text.replace("run: crew-n8-p5, unit: x", "run: nosuch, unit: x", 1))
    with pytest.raises(ConfigError, match=r"claims\[0\]\.run: unknown run 'nosuch'"):
        load_claims(bad)
    papers, _, claims = load_claims()
    with pytest.raises(ConfigError, match="unknown paper 'nosuch'"):
        select(claims, papers, ["nosuch"])
    assert {c.paper for c in select(claims, papers, ["crew"])} == {"crew"}


def test_reproduce_rejects_an_unknown_paper_in_one_line(tmp_path, capsys):
    assert cli.main(["reproduce", "nosuch", "--smoke", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown paper 'nosuch'" in err[0]
    assert cli.main(["reproduce", "--smoke", "--quick"]) == 2


def test_gpu_cluster_links_every_pair_at_the_intra_or_inter_rate():
    t = topogen.build({"kind": "gpu-cluster", "machines": 3, "gpus": 2, "inter_mbps": 25000})
    assert t.nodes == ["a0", "a1", "b0", "b1", "c0", "c1"] and len(t.links) == 15
    rates = {frozenset((lk.a, lk.b)): lk.ab.rate_mbps for lk in t.links}
    assert rates[frozenset(("a0", "a1"))] == 100000 and rates[frozenset(("a0", "b1"))] == 25000
    assert all(lk.ab.rate_mbps == lk.ba.rate_mbps for lk in t.links)


def test_time_left_extrapolates_the_pace_so_far():
    assert time_left(0, 0, 600) == "0s elapsed, about 600s left"
    assert time_left(100, 50, 300) == "100s elapsed, about 500s left"
