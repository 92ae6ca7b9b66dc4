"""No hangs, the right culprit, bounded resources — real processes on loopback and
a small emulated WAN, every trial bounded in time (``testbed.chaos`` holds the trials and
the wire fuzzer; ``bench chaos`` / ``bench fuzz`` run more of them)."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from agents import wire
from agents.coordinator import check_done
from agents.local import LocalCluster, local_address
from testbed import chaos
from testbed.errors import RunError
from testbed.plan import Plan, ProgramBuilder

REPO = Path(__file__).resolve().parent.parent


# -- pure checks ---------------------------------------------------------------------
def test_wire_fuzzer_detects_every_corrupted_field_the_same_way_every_run():
    runs = [chaos.fuzz_wire(10_000, seed=16) for _ in range(3)]
    for res in runs:
        assert not res["hangs"] and not res["missed"], res
        assert all(res["detected"][k] == n for k, n in res["per_field"].items()
                   if k not in chaos.UNCHECKABLE), res
        assert res["threads"][1] <= res["threads"][0]  # none leaked (an earlier test's thread may end meanwhile)
        assert res["rss_kb"][1] < res["rss_kb"][0] + 20_000
    assert all(r["detected"] == runs[0]["detected"] for r in runs)


def test_executor_close_leaves_each_socket_to_its_own_thread():
    """close() shuts connections down and the reader thread closes its socket: a socket closed
    under a thread still in recv would free its descriptor for the next socket opened, and the
    thread's next call would act on that one."""
    from agents.executor import Executor

    closers = []

    class Watched(socket.socket):
        def close(self):
            closers.append(threading.current_thread().name)
            super().close()

    b = ProgramBuilder(["p", "me"])
    b.transfer("p", "me", 0, 4, reduce=False)
    for _ in range(20):
        closers.clear()
        ex = Executor("me", b.programs["me"], length=4, timeout_s=2.0)
        sa, sb = socket.socketpair()
        sock = Watched(fileno=sb.detach())
        ex.attach_incoming("p", 0, sock)
        ex.close()
        deadline = time.monotonic() + 5
        while sock.fileno() >= 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        sa.close()
        assert sock.fileno() == -1 and set(closers) == {"recv-p-0"}, closers


def test_untrusted_text_is_sanitised():
    forged = "x\n2026-01-01 h1 ERROR forged line\x1b[31m\u202e" + "y" * 1000
    out = wire.sanitize(forged)
    assert "\n" not in out and "\x1b" not in out and out.isascii() and len(out) < 400
    assert "1000 characters" not in out and f"{len(forged)} characters" in out


def test_nested_json_bomb_is_a_protocol_error():
    with pytest.raises(wire.ProtocolError, match="malformed JSON"):
        wire.loads(b"[" * 200_000)


def test_done_checks_every_field():
    xfers = {1: ("a", "b")}
    done = {"iteration": 0, "go_ns": 1, "compute_end_ns": 2, "comm_start_ns": 3, "comm_done_ns": 4,
            "receiver": True, "correct": True, "max_abs_err": 0.0, "digest": "00", "sends": [],
            "recvs": [[1, 0, 0, 0, 0]]}
    nodes = ("a", "b")
    assert check_done(done, xfers, "b", nodes) is None
    for key in done:
        assert "missing field" in check_done({k: v for k, v in done.items() if k != key}, xfers, "b", nodes)
        if key not in ("digest",):
            assert check_done({**done, key: "x"}, xfers, "b", nodes), key
    assert "not one of this node's" in check_done(done, xfers, "a", nodes)
    assert check_done({**done, "tcp": [["a", 3, 1, 250]]}, xfers, "b", nodes) is None
    for bad in ("x", [["z", 1, 0, 0]], [["a", -1, 0, 0]], [["a", 1, 0]], [["a", 1.5, 0, 0]], [["a", True, 0, 0]]):
        assert "bad tcp row" in check_done({**done, "tcp": bad}, xfers, "b", nodes), bad


# -- a fake agent that knows the secret ------------------------------------------------
class Ghost:
    """An authenticated agent under the test's control: heartbeats, answers STATUS (with an
    empty status unless told otherwise), and hands every other coordinator message to
    :meth:`wait`."""

    def __init__(self, cluster: LocalCluster, name: str = "ghost"):
        self.secret = (cluster.tmp / "secret").read_bytes()
        self.name = name
        self.ctrl = wire.connect(tuple(cluster.coordinator.address), self.secret,
                                 {"role": "agent", "name": name, "data_port": 1})
        self.lock = threading.Lock()
        self.inbox: queue.Queue = queue.Queue()
        self.status: dict = {}
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._beat, daemon=True).start()

    def send(self, obj, typ=wire.CTRL):
        with self.lock:
            wire.send_json(self.ctrl, obj, typ)

    def _read(self):
        try:
            while True:
                msg = wire.recv_json(self.ctrl)[1]
                if msg.get("msg") == "status":
                    self.send({"msg": "status", **self.status})
                elif msg.get("msg") != "alive":
                    self.inbox.put(msg)
        except (OSError, wire.ProtocolError):
            self.inbox.put({"msg": "closed"})

    def _beat(self):
        try:
            while True:
                time.sleep(0.2)
                self.send({"msg": "alive"})
        except OSError:
            pass

    def wait(self, kind: str, timeout: float = 10.0) -> dict:
        while True:
            msg = self.inbox.get(timeout=timeout)
            if msg.get("msg") == kind:
                return msg
            assert msg.get("msg") == "welcome", msg

    def data(self, job: dict, peer: str, channel: int = 0) -> socket.socket:
        return wire.connect(tuple(job["job"]["peers"][peer]), self.secret,
                            {"role": "data", "name": self.name, "channel": channel})


def ghost_plan(length: int = 10) -> Plan:
    """ghost -> b (added to b's input) -> c, which receives the sum."""
    b = ProgramBuilder(["ghost", "b", "c"])
    b.transfer("ghost", "b", 0, length, reduce=True, phase="reduce")
    b.transfer("b", "c", 0, length, reduce=False, send_deps=[0], phase="bcast")
    return Plan("ghost", ["ghost", "b", "c"], length, b.programs, participants=["ghost", "b"], receivers=["c"])


def _frame(plan: Plan, it: int, payload: np.ndarray) -> wire.Header:
    op = plan.programs["ghost"][0]
    return wire.Header(wire.DATA, wire.phase_code(op.phase), 0, it, op.xfer, op.flow, op.chunk, payload.nbytes,
                       time.time_ns())


def _done(it: int) -> dict:
    t = time.time_ns()
    return {"msg": "done", "iteration": it, "go_ns": t, "compute_end_ns": t, "comm_start_ns": t,
            "comm_done_ns": t, "receiver": False, "correct": True, "max_abs_err": 0.0, "digest": None,
            "sends": [[0, t, t]], "recvs": []}


def _ghost_run(script, *, iterations: int = 1, timeout_s: float = 2.0) -> tuple[RunError, float]:
    """Run ghost_plan with the ghost driven by ``script(ghost, job, plan)``; return the run's
    error and how long after the start of the ghost's script it came."""
    plan = ghost_plan()
    with LocalCluster(plan, iterations=iterations, timeout_s=timeout_s, external=["ghost"]) as cluster:
        g = Ghost(cluster)
        marks = {}

        def drive():
            job = g.wait("job")
            marks["t"] = time.monotonic()
            script(g, job, plan)

        t = threading.Thread(target=drive, daemon=True)
        t.start()
        with pytest.raises(RunError) as err:
            cluster.run()
        took = time.monotonic() - marks.get("t", time.monotonic())
        wire.close_quietly(g.ctrl)
        t.join(5)
    assert all(p.poll() is not None for p in cluster.procs.values())
    assert {p.returncode for p in cluster.procs.values()} == {1}
    return err.value, took


def test_peer_stalling_mid_payload_is_named_not_the_receivers():
    def script(g, job, plan):
        data = g.data(job, "b")
        g.send({"msg": "ready"})
        g.wait("go")
        x = np.ones(10, np.float32)
        wire.send_frame(data, _frame(plan, 0, x), x[:5].copy())  # header + half the payload
        g.status = {"iteration": 0, "awaiting": {}, "sending": {"b": [[0, 20, 40]]}}
        time.sleep(30)  # still heartbeating, never sends the rest

    err, took = _ghost_run(script)
    assert err.culprit == "ghost" and err.link == ("ghost", "b"), err
    assert str(err).startswith("ghost: stalled mid-payload on link ghost -> b: b received 20 of 40 bytes"), err
    assert took < 2.0 + 6  # the stall limit, then at most the status round


@pytest.mark.parametrize("case", ["duplicate", "late"])
def test_duplicate_and_late_frames_name_their_sender(case):
    def script(g, job, plan):
        data = g.data(job, "b")
        g.send({"msg": "ready"})
        x = np.ones(10, np.float32)
        g.wait("go")
        wire.send_frame(data, _frame(plan, 0, x), x)
        g.send(_done(0))
        if case == "late":
            g.wait("go")
            wire.send_frame(data, _frame(plan, 0, x), x)  # iteration 0's frame in iteration 1
        else:
            wire.send_frame(data, _frame(plan, 0, x), x)
        time.sleep(10)

    err, took = _ghost_run(script, iterations=2)
    assert err.culprit == "ghost" and err.link == ("ghost", "b"), err
    # a duplicate that reaches b after it finished the iteration is late as well
    assert re.search(f"({case}|late) frame: transfer 0 of iteration 0", str(err)), err
    assert took < 4.0  # at once, not after a timeout


def test_violation_after_the_last_iteration_is_recorded():
    plan = ghost_plan()
    with LocalCluster(plan, timeout_s=2, external=["ghost"]) as cluster:
        g = Ghost(cluster)

        def drive():
            job = g.wait("job")
            data = g.data(job, "b")
            g.send({"msg": "ready"})
            g.wait("go")
            x = np.ones(10, np.float32)
            wire.send_frame(data, _frame(plan, 0, x), x)
            time.sleep(0.5)  # b is done with the last iteration
            wire.send_frame(data, _frame(plan, 0, x), x)
            time.sleep(0.3)
            g.send(_done(0))
            g.wait("finish")
            g.send({"msg": "bye", "errors": []})

        threading.Thread(target=drive, daemon=True).start()
        res = cluster.run()
    assert [e for e in res["errors"] if "b: after the last iteration" in e and "late frame" in e], res["errors"]


def test_malformed_done_and_json_bomb_name_the_sender():
    def bad_done(g, job, plan):
        data = g.data(job, "b")
        g.send({"msg": "ready"})
        g.wait("go")
        x = np.ones(10, np.float32)
        wire.send_frame(data, _frame(plan, 0, x), x)
        g.send({k: v for k, v in _done(0).items() if k != "comm_start_ns"})
        time.sleep(10)

    err, took = _ghost_run(bad_done)
    assert err.culprit == "ghost" and "missing field 'comm_start_ns'" in str(err), err

    def bomb(g, job, plan):
        body = b"{\"msg\":" + b"[" * 100_000
        with g.lock:
            wire.send_frame(g.ctrl, wire.Header(wire.CTRL, payload_len=len(body)), body)
        time.sleep(10)

    err, took = _ghost_run(bomb)
    assert err.culprit == "ghost" and "malformed JSON" in str(err) and took < 4.0, err


def test_agent_survives_a_json_bomb_from_its_coordinator(tmp_path):
    """A fake coordinator sends the agent a deeply nested message: the agent exits 1 at once."""
    secret = b"s3cret"
    (tmp_path / "s").write_bytes(secret)
    with socket.create_server(("127.0.0.1", 0)) as srv:
        cfg = {"name": "a", "coordinator": "127.0.0.1:%d" % srv.getsockname()[1], "data_port": 0,
               "bind": "127.0.0.1", "secret_file": str(tmp_path / "s"), "log_file": str(tmp_path / "a.log")}
        (tmp_path / "a.json").write_text(json.dumps(cfg))
        p = subprocess.Popen([sys.executable, "-m", "agents.agent", "--config", str(tmp_path / "a.json")], cwd=REPO,
                             stderr=subprocess.DEVNULL)
        try:
            srv.settimeout(10)
            sock, _ = srv.accept()
            wire.server_handshake(sock, secret, deadline=time.monotonic() + 5)
            body = b"[" * 100_000
            wire.send_frame(sock, wire.Header(wire.CTRL, payload_len=len(body)), body)
            assert p.wait(timeout=10) == 1
        finally:
            p.kill()
            p.wait()
    assert "malformed JSON" in (tmp_path / "a.log").read_text()


# -- bounded accept ----------------------------------------------------------------------
def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_slow_drip_and_flood_before_authentication_are_bounded():
    b = ProgramBuilder(["a", "b"])
    b.transfer("a", "b", 0, 1000, reduce=True)
    plan = Plan("p2p", ["a", "b"], 1000, b.programs, participants=["a"], receivers=["b"])
    with LocalCluster(plan, timeout_s=5, handshake_s=2.0) as cluster:
        deadline = time.monotonic() + 20
        while len(cluster.coordinator.agents()) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        agents = cluster.coordinator.agents()
        pid = cluster.procs["b"].pid
        threads0 = _threads(pid)
        targets = [(local_address(1), agents["b"]["data_port"]), tuple(cluster.coordinator.address)]
        socks = []
        for addr in targets:
            for _ in range(200):  # slow drip: a byte now and then, never a whole frame
                s = socket.create_connection(addr, timeout=5)
                s.setblocking(False)
                socks.append(s)
        peak = 0
        for _ in range(6):  # 3 s of dripping, past the 2 s handshake deadline
            for s in socks:
                try:
                    s.send(b"T")
                except OSError:
                    pass
            peak = max(peak, _threads(pid))
            time.sleep(0.5)
        for addr in targets:  # a flood of connections opened and dropped at once
            for _ in range(200):
                with socket.create_connection(addr, timeout=5):
                    pass
        assert peak <= threads0 + 64 + 4, (threads0, peak)
        for s in socks:
            s.close()
        time.sleep(2.5)
        assert _threads(pid) <= threads0 + 2
        res = cluster.run()  # both still serve
    assert res["iterations"][0]["correct"] and res["errors"] == []


# -- full disk -----------------------------------------------------------------------------
def test_full_disk_for_results_fails_cleanly(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    mnt = tmp_path / "full"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], check=True)
    try:
        with open(mnt / "filler", "wb") as f:  # leave (almost) nothing free
            try:
                f.write(b"x" * (64 << 10))
            except OSError:
                pass
        plan = chaos.ring(3000)
        (tmp_path / "plan.json").write_text(plan.to_json())
        (tmp_path / "addr.json").write_text(json.dumps({n: local_address(i) for i, n in enumerate(plan.nodes)}))
        (tmp_path / "secret").write_text("s3cret")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        coord = subprocess.Popen(
            [sys.executable, "-m", "agents.coordinator", "--plan", str(tmp_path / "plan.json"), "--addresses",
             str(tmp_path / "addr.json"), "--secret-file", str(tmp_path / "secret"), "--port", str(port),
             "--bind", "127.0.0.1", "--out", str(mnt / "results.json"), "--timeout", "5"],
            cwd=REPO, stderr=subprocess.PIPE, text=True)
        agents = []
        for i, n in enumerate(plan.nodes):
            (tmp_path / f"{n}.json").write_text(json.dumps({
                "name": n, "coordinator": f"127.0.0.1:{port}", "data_port": 0, "bind": local_address(i),
                "secret_file": str(tmp_path / "secret")}))
            agents.append(subprocess.Popen([sys.executable, "-m", "agents.agent", "--config",
                                            str(tmp_path / f"{n}.json")], cwd=REPO, stderr=subprocess.DEVNULL))
        try:
            _, err = coord.communicate(timeout=60)
            for a in agents:
                a.wait(timeout=20)
        finally:
            for p in [coord, *agents]:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        assert coord.returncode == 1, err
        assert "cannot write the results" in err and "No space left" in err, err
        assert "Traceback" not in err
        assert sorted(x.name for x in mnt.iterdir()) == ["filler"]  # no half-written file
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


# -- chaos: seeded SIGSTOP / SIGKILL of agents and the coordinator ------------------------
def test_agent_without_coordinator_names_it(tmp_path):
    """Nothing listens at the coordinator's address (it died before the agent connected):
    the agent gives up within its deadline and its error names the coordinator."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens there
    (tmp_path / "secret").write_bytes(os.urandom(32))
    cfg = tmp_path / "node.json"
    cfg.write_text(json.dumps({"name": "h1", "coordinator": f"127.0.0.1:{port}", "data_port": 0,
                               "secret_file": str(tmp_path / "secret"), "handshake_timeout_s": 1,
                               "connect_retry_s": 1}))
    res = subprocess.run([sys.executable, "-m", "agents.agent", "--config", str(cfg)], cwd=REPO,
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 1, res.stderr
    assert f"cannot register with the coordinator at 127.0.0.1:{port}" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_chaos_trials(tmp_path):
    seeds = [*range(20), 31, 74]  # 31, 74: the coordinator killed before its agents registered
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda s: chaos.trial(s, tmp_path / f"t{s}"), seeds))
    bad = [r for r in results if not r["ok"]]
    for r in results:
        print(r)
    assert not bad, bad
    assert {r["target"] for r in results} >= {"coordinator", "h1", "h2", "h3"}
    assert {r["signal"] for r in results} == {"SIGSTOP", "SIGKILL"}
    assert sum(not r["finished_first"] for r in results) >= 15  # most signals hit a running run


# -- on an emulated WAN -----------------------------------------------------------------
def _run(tmp_path, extra="", reps=50):
    tmp_path.mkdir(parents=True, exist_ok=True)
    f = tmp_path / "exp.yaml"
    f.write_text(f"name: chaos\ntopology: small-3\nscheme: {{name: ring}}\nrepetitions: {reps}\n"
                 "workload: {size: 1MB, iterations: 3}\nagents: {timeout_s: 4}\n" + extra)
    return subprocess.Popen([sys.executable, "-m", "testbed", "run", str(f), "--out", str(tmp_path / "o")],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _agent_pid(tmp_path, dc: str, timeout=60.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read()
            except OSError:
                continue
            if b"agents.agent" in cmd and str(tmp_path / "o" / "agents" / f"{dc}.json").encode() in cmd:
                return int(pid)
        time.sleep(0.1)
    raise AssertionError(f"agent {dc} did not start")


def test_emulated_stopped_agent_and_stopped_coordinator(netenv, tmp_path):
    p = _run(tmp_path / "a")
    pid = _agent_pid(tmp_path / "a", "h2")
    time.sleep(1.0)
    os.kill(pid, signal.SIGSTOP)
    t = time.monotonic()
    _, err = p.communicate(timeout=60)
    assert p.returncode == 1, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: h2:"), last
    assert time.monotonic() - t < 30

    p = _run(tmp_path / "b")
    _agent_pid(tmp_path / "b", "h1")
    time.sleep(1.0)
    p.send_signal(signal.SIGSTOP)  # the run process is the coordinator
    time.sleep(4)  # agents give up after the silence limit (2 s)
    p.send_signal(signal.SIGCONT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 1, err[-2000:]
    assert "error: coordinator:" in err, err[-2000:]


def test_clean_spares_a_running_experiment(netenv, tmp_path):
    p = _run(tmp_path, reps=3)
    _agent_pid(tmp_path, "h1")
    time.sleep(1.0)
    res = subprocess.run([sys.executable, "-m", "testbed", "clean"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    assert str(tmp_path) not in res.stdout, res.stdout  # our agents untouched (and the run completes)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-2000:]


def test_killed_run_is_cleaned_up(netenv, tmp_path):
    """SIGKILL of ``testbed run`` mid-run leaves a network nobody owns; ``clean`` (without
    --all) removes all of it: processes, interfaces, namespaces."""
    from testbed.emulator.cleanup import leftovers

    before = {k: set(v) for k, v in leftovers().items()}
    p = _run(tmp_path)  # small-3 has delays: relay processes too
    _agent_pid(tmp_path, "h1")
    time.sleep(1.0)
    p.kill()
    p.communicate(timeout=30)
    orphans = {k: set(v) - before[k] for k, v in leftovers().items()}
    assert orphans["interfaces"] and any("tbrelay" in c for _, c in orphans["processes"]), orphans
    res = subprocess.run([sys.executable, "-m", "testbed", "clean"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    left = {k: set(v) - before[k] for k, v in leftovers().items()}
    assert not any(left.values()), left


def test_deploy_workdir_is_private_and_refused_when_someone_else_owns_it(tmp_path):
    from testbed.deploy import DEFAULT_WORKDIR, private_dir

    assert not DEFAULT_WORKDIR.startswith("/")  # per user: under the login directory
    def run(p):
        return subprocess.run(["sh", "-c", private_dir(str(p))], capture_output=True, text=True)
    assert run(tmp_path / "a b" / "h1").returncode == 0
    assert (tmp_path / "a b" / "h1").stat().st_mode & 0o777 == 0o700
    if os.geteuid() == 0:  # another user's directory, or a parent of it
        for d in (tmp_path / "theirs", tmp_path / "their-parent"):
            d.mkdir()
            os.chown(d, 4242, 4242)
        for p in (tmp_path / "theirs", tmp_path / "their-parent" / "h1"):
            res = run(p)
            assert res.returncode == 3 and "owned by uid 4242" in res.stderr, res.stderr
    (tmp_path / "link").symlink_to(tmp_path / "a b")
    assert "symbolic link" in run(tmp_path / "link").stderr
