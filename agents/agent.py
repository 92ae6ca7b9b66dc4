"""The worker process: ``python3 -m agents.agent --config node.json``.

node.json::

    {"name": "h1", "coordinator": "10.0.0.100:7000", "data_port": 7100,
     "bind": "0.0.0.0", "secret_file": "/path/secret", "log_file": "/tmp/h1.log"}

``data_port`` 0 picks a free port (reported to the coordinator); ``log_file`` is
optional (logs always go to stderr too).  Life cycle: listen on the data port, connect
and authenticate to the coordinator (retrying while it starts), receive the JOB, open
the outgoing data connections, report READY, then per iteration wait for GO, sleep the
compute time, run the program, check the result and report DONE.  Exit 0 after FINISH,
1 on any failure or ABORT.  Control messages are JSON objects with a ``"msg"`` key:

    agent -> coordinator: ready, done, alive (heartbeat); error (ERROR frame)
    coordinator -> agent: job, go, finish; abort (ERROR frame)

Only ``testbed.plan`` is imported from the harness: this runs on real hosts too.
``clock_offset_ms`` in node.json (optional, for tests) shifts every timestamp the agent
reports, as on a host whose clock is off (:mod:`agents.clock`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import queue
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from testbed.plan import Op

from . import clock, wire
from .executor import Executor
from .inputs import expected_sum, make_input

log = logging.getLogger("agents")

CONNECT_RETRY_S = 10.0


class Aborted(Exception):
    """The coordinator aborted the run (or its connection was lost)."""


@dataclass
class Job:
    """Everything one agent needs to run its part of a plan (the JOB message)."""

    name: str
    nodes: list[str]  # plan.nodes (a node's input index is its position here)
    length: int
    participants: list[str]
    receivers: list[str]
    program: list[Op]
    peers: dict[str, tuple[str, int]]  # peer -> (ip, data port) for outgoing connections
    scratch: dict[str, int] = field(default_factory=dict)
    dtype: str = "float32"
    seed: int = 0
    iterations: int = 1
    compute_s: list[float] = field(default_factory=list)  # per iteration (last value repeats)
    stop_and_wait: bool = False
    timeout_s: float = 60.0

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["program"] = [op.to_dict() for op in self.program]
        d["peers"] = {p: [ip, port] for p, (ip, port) in self.peers.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Job":
        d = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        d["program"] = [Op.from_dict(o) for o in d["program"]]
        d["peers"] = {p: (str(a[0]), int(a[1])) for p, a in d["peers"].items()}
        return cls(**d)

    def compute_for(self, iteration: int) -> float:
        return float(self.compute_s[min(iteration, len(self.compute_s) - 1)]) if self.compute_s else 0.0


class Agent:
    def __init__(self, cfg: dict):
        self.name = str(cfg["name"])
        self.secret = wire.load_secret(cfg["secret_file"])
        host, _, port = str(cfg["coordinator"]).rpartition(":")
        self.coord_addr = (host.strip("[]"), int(port))
        self.listener = socket.create_server((cfg.get("bind", "0.0.0.0"), int(cfg.get("data_port", 0))),
                                             backlog=socket.SOMAXCONN)
        self.data_port = self.listener.getsockname()[1]
        self.ctrl: socket.socket | None = None
        self.ctrl_lock = threading.Lock()
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.job: Job | None = None
        self.ex: Executor | None = None
        self.job_ready = threading.Event()
        self.stopping = False

    # -- control channel ---------------------------------------------------------
    def send(self, obj: dict, typ: int = wire.CTRL) -> None:
        with self.ctrl_lock:
            wire.send_json(self.ctrl, obj, typ)

    def _ctrl_reader(self) -> None:
        """Forward coordinator messages to the inbox; abort the executor on ABORT/EOF."""
        try:
            while True:
                h, msg = wire.recv_json(self.ctrl)
                if h.type == wire.ERROR or msg.get("msg") == "abort":
                    msg = {"msg": "abort", "reason": msg.get("reason", "aborted by coordinator")}
                self.inbox.put(msg)
                if msg["msg"] == "abort":
                    break
        except (wire.ProtocolError, wire.Closed, OSError) as e:
            if not self.stopping:
                self.inbox.put({"msg": "abort", "reason": f"lost the coordinator connection: {e}"})
        if self.ex:
            self.ex.abort("aborted by the coordinator")

    def _heartbeat(self, period: float) -> None:
        while not self.stopping:
            time.sleep(period)
            try:
                self.send({"msg": "alive"})
            except OSError:
                return

    def next_msg(self, *kinds: str) -> dict:
        msg = self.inbox.get()
        if msg["msg"] == "abort":
            raise Aborted(msg["reason"])
        if msg["msg"] not in kinds:
            raise wire.ProtocolError(f"coordinator sent {msg['msg']!r}, expected {kinds}")
        return msg

    # -- data connections ----------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self.stopping:
            try:
                sock, addr = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._handshake, args=(sock, addr), daemon=True).start()

    def _handshake(self, sock: socket.socket, addr) -> None:
        who = f"{addr[0]}:{addr[1]}"
        try:
            wire.tune(sock)
            sock.settimeout(wire.HANDSHAKE_TIMEOUT_S)

            def check(ident: dict) -> None:
                if ident.get("role") != "data" or not isinstance(ident.get("channel"), int):
                    raise wire.ProtocolError(f"not a data connection: {ident}")
                if not self.job_ready.wait(wire.HANDSHAKE_TIMEOUT_S):
                    raise wire.ProtocolError("no job yet")
                sock.settimeout(None)
                self.ex.attach_incoming(str(ident.get("name")), ident["channel"], sock)

            ident = wire.server_handshake(sock, self.secret, check)
            log.info("data connection from %s (channel %d) at %s", ident["name"], ident["channel"], who)
        except (wire.ProtocolError, wire.Closed, OSError) as e:
            log.warning("refused connection from %s: %s", who, e)
            wire.close_quietly(sock)

    def _connect_peers(self) -> None:
        """Open every outgoing data connection at once: on long-RTT paths each handshake
        costs several round trips, so one after another would take seconds."""
        def connect(peer: str, ch: int) -> None:
            addr = self.job.peers[peer]
            sock = wire.connect(addr, self.secret, {"role": "data", "name": self.name, "channel": ch},
                                retry_s=CONNECT_RETRY_S)
            self.ex.attach_outgoing(peer, ch, sock)
            log.info("connected to %s (channel %d) at %s:%d", peer, ch, *addr)

        with ThreadPoolExecutor(max_workers=32) as pool:
            for f in [pool.submit(connect, peer, ch) for peer, ch in self.ex.outgoing()]:
                f.result()  # re-raise the first failure

    # -- main ------------------------------------------------------------------------
    def prepare(self, iteration: int) -> None:
        job = self.job
        if self.name in job.participants:
            self.ex.prepare(make_input(job.seed, job.nodes.index(self.name), iteration, job.length, job.dtype))
        else:
            self.ex.prepare(None)

    def verify(self, iteration: int) -> dict:
        job, x = self.job, self.ex.bufs["x"]
        if self.name not in job.receivers:  # nothing to check
            return {"receiver": False, "correct": True, "max_abs_err": 0.0, "digest": None}
        want = expected_sum(job.seed, [job.nodes.index(p) for p in job.participants], iteration,
                            job.length, job.dtype)
        ok = bool(np.array_equal(x, want))
        err = 0.0 if ok else float(np.max(np.abs(x.astype(np.float64) - want)))
        return {"receiver": True, "correct": ok, "max_abs_err": err, "digest": hashlib.sha256(memoryview(x).cast("B")).hexdigest()}

    def run(self) -> int:
        ident = {"role": "agent", "name": self.name, "data_port": self.data_port, "pid": os.getpid(),
                 "host": socket.gethostname()}
        self.ctrl = wire.connect(self.coord_addr, self.secret, ident, retry_s=CONNECT_RETRY_S)
        log.info("registered with coordinator %s:%d (data port %d)", *self.coord_addr, self.data_port)
        threading.Thread(target=self._ctrl_reader, daemon=True).start()
        threading.Thread(target=self._accept_loop, daemon=True).start()
        self.job = job = Job.from_dict(self.next_msg("job")["job"])
        self.ex = Executor(self.name, job.program, length=job.length, scratch=job.scratch, dtype=job.dtype,
                           stop_and_wait=job.stop_and_wait, timeout_s=job.timeout_s)
        self.job_ready.set()
        threading.Thread(target=self._heartbeat, args=(min(1.0, job.timeout_s / 4),), daemon=True).start()
        self._connect_peers()
        self.prepare(0)
        self.send({"msg": "ready"})
        for it in range(job.iterations):
            msg = self.next_msg("go")
            go_ns = time.time_ns()
            if msg.get("iteration") != it:
                raise wire.ProtocolError(f"GO for iteration {msg.get('iteration')}, expected {it}")
            time.sleep(job.compute_for(it))
            compute_end = time.time_ns()
            timing = self.ex.run(it)
            check = self.verify(it)
            if not check["correct"]:
                log.error("iteration %d: wrong result (max abs error %g)", it, check["max_abs_err"])
            if it + 1 < job.iterations:
                self.prepare(it + 1)
            self.send({"msg": "done", "iteration": it, "go_ns": go_ns, "compute_end_ns": compute_end,
                       **timing, **check})
            log.info("iteration %d done in %.3f s", it, (timing["comm_done_ns"] - timing["comm_start_ns"]) / 1e9)
        self.next_msg("finish")
        return 0

    def close(self) -> None:
        self.stopping = True
        if self.ex:
            self.ex.close()
        self.listener.close()
        wire.close_quietly(self.ctrl)


def setup_logging(name: str, log_file: str | None) -> None:
    fmt = logging.Formatter(f"%(asctime)s {name} %(levelname)s %(message)s")
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    handlers = [logging.StreamHandler(sys.stderr)] + ([logging.FileHandler(log_file)] if log_file else [])
    for h in handlers:
        h.setFormatter(fmt)
        root.addHandler(h)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m agents.agent", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="node.json")
    args = ap.parse_args(argv)
    with open(args.config) as f:
        cfg = json.load(f)
    setup_logging(cfg.get("name", "?"), cfg.get("log_file"))
    clock.shift(float(cfg.get("clock_offset_ms", 0)))
    agent = None
    try:
        agent = Agent(cfg)
        rc = agent.run()
        log.info("finished")
        return rc
    except Aborted as e:
        log.error("aborted: %s", e)
        return 1
    except Exception as e:
        log.error("failed: %s: %s", type(e).__name__, e)
        if agent and agent.ctrl:
            try:
                agent.send({"msg": "error", "message": f"{type(e).__name__}: {e}"}, wire.ERROR)
                agent.inbox.get(timeout=10)  # let the coordinator abort everyone first
            except (OSError, queue.Empty):
                pass
        return 1
    finally:
        if agent:
            agent.close()


if __name__ == "__main__":
    sys.exit(main())
