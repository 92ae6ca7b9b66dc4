"""Fault injection on real agent and coordinator processes over loopback: shared by
``tests/test_chaos.py`` (a few seeded trials) and ``python3 -m testbed bench chaos`` (many).

One trial: a coordinator process (``python3 -m agents.coordinator``) and one agent process
per node of a 3-node ring run many short iterations; at a seeded random moment one of them
(an agent or the coordinator) gets SIGSTOP or SIGKILL.  The trial passes when every process
ends within its deadline, the coordinator exits 1 (unless it was killed) naming the right
node in its error and in ``results.json`` (valid, with the iterations that completed), the
agents exit 1 (an agent stopped by SIGSTOP once it is continued), and none is left.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from agents.local import local_address
from testbed.plan import Plan

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 2.0  # agents' stall limit; silence limit = 1.5 s
HANDSHAKE_S = 3.0
DEADLINE_S = 15.0  # from the signal to the end of every process


def ring(length: int = 30_000) -> Plan:
    """The ring planner's plan on the 3-datacenter topology ``small-3``."""
    from testbed.planners import make_plan
    from testbed.topology import load_topology

    return make_plan("ring", load_topology("small-3").graph(), length)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dead_within(p: subprocess.Popen, seconds: float) -> bool:
    try:
        p.wait(timeout=max(0.01, seconds))
        return True
    except subprocess.TimeoutExpired:
        return False


def trial(seed: int, tmp: Path, iterations: int = 40, compute_s: float = 0.04) -> dict:
    """Run one seeded trial in ``tmp``; return what happened (``ok`` and ``problems``)."""
    rng = random.Random(seed)
    plan = ring()
    nodes = list(plan.nodes)
    target = rng.choice(["coordinator", *nodes])
    sig = rng.choice([signal.SIGSTOP, signal.SIGKILL])
    early = rng.random() < 0.2  # while processes start and register; else during the iterations
    at = rng.uniform(0.0, 1.0) if early else rng.uniform(0.0, 1.5)
    out = tmp / "results.json"
    procs = _start_trial(tmp, plan, iterations, compute_s, out)
    if not early:  # count from the moment every agent registered
        deadline = time.monotonic() + 20
        while "agents registered" not in (tmp / "coordinator.log").read_text(errors="replace"):
            if time.monotonic() > deadline or procs["coordinator"].poll() is not None:
                break
            time.sleep(0.02)
    time.sleep(at)
    t_sig = time.monotonic()
    procs[target].send_signal(sig)
    problems = _await_ends(procs, target, sig, t_sig)
    rc = {n: p.returncode for n, p in procs.items()}
    finished = rc["coordinator"] == 0  # the signal came after the run was over
    log = (tmp / "coordinator.log").read_text(errors="replace")
    error = next((l for l in log.splitlines() if l.startswith("error:")), "")
    if not finished:
        problems += _wrong_ends(tmp, nodes, target, sig, rc, error, out)
    return {"seed": seed, "target": target, "signal": signal.Signals(sig).name, "at_s": round(at, 3),
            "from": "start" if early else "registration",
            "finished_first": finished, "rc": rc, "error": error[:300], "problems": problems,
            "ok": not problems, "seconds": round(time.monotonic() - t_sig, 2)}


def _start_trial(tmp: Path, plan: Plan, iterations: int, compute_s: float, out: Path) -> dict[str, subprocess.Popen]:
    """The trial's files in ``tmp`` and its processes, by name: the coordinator (writing
    ``out``) and an agent per node of ``plan``, each logging to ``tmp/NAME.log``."""
    nodes = list(plan.nodes)
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "plan.json").write_text(plan.to_json())
    (tmp / "addresses.json").write_text(json.dumps({n: local_address(i) for i, n in enumerate(nodes)}))
    (tmp / "compute.json").write_text(json.dumps({n: [compute_s] for n in nodes}))
    secret = tmp / "secret"
    secret.touch(mode=0o600)
    secret.write_text(secrets.token_hex(16))
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    py = [sys.executable, "-m"]
    procs = {"coordinator": subprocess.Popen(
        py + ["agents.coordinator", "--plan", str(tmp / "plan.json"), "--addresses", str(tmp / "addresses.json"),
              "--secret-file", str(secret), "--port", str(port), "--bind", "127.0.0.1", "--out", str(out),
              "--iterations", str(iterations), "--timeout", str(TIMEOUT_S), "--register-timeout", "4",
              "--compute", str(tmp / "compute.json")],
        cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=open(tmp / "coordinator.log", "wb"))}
    for i, n in enumerate(nodes):
        cfg = tmp / f"{n}.json"
        cfg.write_text(json.dumps({"name": n, "coordinator": f"127.0.0.1:{port}", "data_port": 0,
                                   "bind": local_address(i), "secret_file": str(secret),
                                   "handshake_timeout_s": HANDSHAKE_S, "connect_retry_s": HANDSHAKE_S}))
        procs[n] = subprocess.Popen(py + ["agents.agent", "--config", str(cfg)], cwd=REPO, env=env,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=open(tmp / f"{n}.log", "wb"))
    return procs


def _await_ends(procs: dict[str, subprocess.Popen], target: str, sig: int, t_sig: float) -> list[str]:
    """Wait for every process to end within its deadline (a stopped target is continued
    first); what did not.  None is left running."""
    problems = []
    others = [n for n in procs if n != target]
    try:
        for n in others:
            if not _dead_within(procs[n], t_sig + DEADLINE_S - time.monotonic()):
                problems.append(f"{n} still running {DEADLINE_S:g} s after the signal")
        if sig == signal.SIGSTOP:
            procs[target].send_signal(signal.SIGCONT)
            if not _dead_within(procs[target], 3 * HANDSHAKE_S + 2):
                problems.append(f"{target} still running after SIGCONT")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return problems


def _wrong_ends(tmp: Path, nodes: list[str], target: str, sig: int, rc: dict, error: str, out: Path) -> list[str]:
    """For a run the signal cut short: each way the processes' ends, the coordinator's error and
    ``results.json`` differ from what that fault must give."""
    problems = []
    for n in nodes:
        if rc[n] != 1 and not (n == target and sig == signal.SIGKILL):
            problems.append(f"{n} exited with {rc[n]}, expected 1")
    if target != "coordinator" or sig == signal.SIGSTOP:
        if rc["coordinator"] != 1:
            problems.append(f"coordinator exited with {rc['coordinator']}, expected 1")
        if not error.startswith(f"error: {target}:"):
            problems.append(f"coordinator blamed the wrong node: {error!r}")
        try:
            res = json.loads(out.read_text())
            if res["failure"]["culprit"] != target:
                problems.append(f"results.json names {res['failure']['culprit']}")
            if not all(it["correct"] for it in res["iterations"]):
                problems.append("a completed iteration is not correct")
        except (OSError, ValueError, KeyError, TypeError) as e:
            problems.append(f"results.json missing or invalid: {e}")
    else:  # a killed coordinator writes nothing; its agents notice at once
        if out.exists():
            problems.append("a killed coordinator left results.json")
        for n in nodes:
            if "coordinator" not in (tmp / f"{n}.log").read_text(errors="replace"):
                problems.append(f"{n}'s log does not name the coordinator")
    return problems


# -- the wire fuzzer -------------------------------------------------------------------
# (name, first byte, end byte) of every header field; send_ts_ns is a measurement (the
# sender's clock) that no receiver can check, so a changed value there is expected to pass.
FIELDS = [("magic", 0, 4), ("version", 4, 5), ("type", 5, 6), ("phase", 6, 7), ("flags", 7, 8),
          ("op_id", 8, 12), ("xfer", 12, 16), ("flow", 16, 20), ("chunk", 20, 24), ("payload_len", 24, 32),
          ("send_ts_ns", 32, 40), ("route_len", 40, 41), ("route", 41, 57), ("reserved", 57, 64)]
UNCHECKABLE = {"send_ts_ns"}


def _rss_kb() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def fuzz_wire(frames: int, seed: int = 0, length: int = 16) -> dict:
    """Feed ``frames`` seeded mutations of a valid DATA frame (one field, the payload, or a
    truncation per frame) to a fresh executor receiving over a socket pair, in this process.
    A mutation counts as detected when the frame is refused (ProtocolError) or, for the
    payload, when the received bytes differ from the true ones (the exact check agents do).
    Returns counts, ``missed`` (mutations neither refused nor caught: frame number, kind,
    header, what the executor said), ``hangs``, and this
    process's thread count and RSS before and after."""
    import logging

    agents_log = logging.getLogger("agents")
    level = agents_log.level
    agents_log.setLevel(logging.CRITICAL)  # one refusal per frame: not worth a log line
    try:
        return _fuzz(frames, seed, length)
    finally:
        agents_log.setLevel(level)


def _fuzz(frames: int, seed: int, length: int) -> dict:
    import threading

    import numpy as np

    from agents import wire
    from testbed.plan import ProgramBuilder

    rng = random.Random(seed)
    b = ProgramBuilder(["p", "me"])
    b.transfer("p", "me", 0, length, reduce=False, flow=2, chunk=5, phase="reduce")
    op = b.programs["me"][0]
    kinds = [f[0] for f in FIELDS] + ["payload", "truncated"]
    counts = {k: 0 for k in kinds}
    detected = {k: 0 for k in kinds}
    missed, hangs = [], []
    threads0, rss0 = threading.active_count(), _rss_kb()
    for k in range(frames):
        payload = np.array([rng.randint(-1000, 1000) for _ in range(length)], np.float32)
        frame = bytearray(wire.encode_header(wire.Header(wire.DATA, wire.phase_code(op.phase), 0, 0, op.xfer,
                                                         op.flow, op.chunk, payload.nbytes, time.time_ns()))
                          + payload.tobytes())
        kind = kinds[k % len(kinds)]
        counts[kind] += 1
        frame = _mutated(frame, kind, rng)
        caught, why, hang = _feed(op, length, frame, kind, payload)
        if hang:
            hangs.append((k, kind))
        if caught:
            detected[kind] += 1
        elif kind not in UNCHECKABLE:
            missed.append((k, kind, bytes(frame[:64]).hex(), why))
    deadline = time.monotonic() + 5
    while threading.active_count() > threads0 and time.monotonic() < deadline:
        time.sleep(0.01)
    return {"frames": frames, "seed": seed, "per_field": counts, "detected": detected, "missed": missed[:20],
            "n_missed": len(missed), "hangs": hangs[:20], "threads": [threads0, threading.active_count()],
            "rss_kb": [rss0, _rss_kb()]}


def _mutated(frame: bytearray, kind: str, rng: random.Random) -> bytearray:
    """``frame`` cut short (``truncated``), or with 1-3 random bytes of field ``kind`` (or of
    the payload) changed, at least one really."""
    if kind == "truncated":
        return frame[:rng.randrange(1, len(frame))]
    lo, hi = (64, len(frame)) if kind == "payload" else next((a, e) for n, a, e in FIELDS if n == kind)
    while True:
        new = bytearray(frame)
        for _ in range(rng.randint(1, min(3, hi - lo))):
            i = rng.randrange(lo, hi)
            new[i] = rng.choice([0, 0xFF, 0x80, 1, rng.randrange(256)])
        if new != frame:
            return new


def _feed(op, length: int, frame: bytearray, kind: str, payload) -> tuple[bool, str, bool]:
    """``frame`` sent to a fresh executor receiving ``op`` over a socket pair: (caught, what
    the executor said, whether it hung)."""
    from agents import wire
    from agents.executor import ExecError, Executor

    ex = Executor("me", [op], length=length, timeout_s=2.0)
    sa, sb = socket.socketpair()
    try:
        ex.attach_incoming("p", 0, sb)
        try:
            sa.sendall(frame)
            if kind == "truncated":
                sa.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the receiver refused the frame before reading all of it
        why, hang = "accepted", False
        try:
            ex.run(0)
            caught = ex.bufs["x"].tobytes() != payload.tobytes()
        except wire.ProtocolError:
            caught = True
        except ExecError as e:
            caught, why = kind == "truncated" and "closed" in str(e), str(e)
            hang = "no progress" in str(e)
        return caught, why, hang
    finally:
        ex.close()
        sa.close()


# -- benchmarks (python3 -m testbed bench chaos|fuzz) -----------------------------------------
def bench_chaos(out: Path, progress, trials: int = 100) -> dict:
    """``trials`` seeded chaos trials, one after another: how many ended right, and how long
    from the signal to the end of every process."""
    results = []
    for seed in range(trials):
        r = trial(seed, out / "chaos" / f"t{seed}")
        results.append(r)
        progress(f"trial {seed}: {r['signal']} {r['target']} at {r['at_s']} s -> "
                 f"{'ok' if r['ok'] else 'FAILED: ' + '; '.join(r['problems'])}")
    secs = sorted(r["seconds"] for r in results)
    return {"trials": trials, "ok": sum(r["ok"] for r in results), "ok_ratio": sum(r["ok"] for r in results) / trials,
            "signal_before_end": sum(not r["finished_first"] for r in results),
            "seconds_to_end_median": secs[len(secs) // 2], "seconds_to_end_max": secs[-1],
            "failed": [r for r in results if not r["ok"]]}


def bench_fuzz(out: Path, progress, frames: int = 100_000) -> dict:
    """The wire fuzzer with ``frames`` mutated frames: detected ratio per field."""
    t = time.monotonic()
    res = fuzz_wire(frames, seed=1)
    res["seconds"] = time.monotonic() - t
    res["detected_ratio"] = {k: res["detected"][k] / n for k, n in res["per_field"].items() if n}
    return res
