"""Coordinator: distributes a plan to the agents, runs the iterations, collects results.

Library use::

    c = Coordinator(plan, addresses={"h1": "10.0.0.1", ...}, data_port=7100, secret=b"...")
    c.start()            # accept agent registrations (c.address is the bound (host, port))
    ...start one agent per plan node...
    results = c.run()    # raises testbed.errors.RunError on any failure
    c.close()

Command line (real hosts)::

    python3 -m agents.coordinator --plan plan.json --addresses addr.json \\
        --secret-file F --port P --out results.json [--iterations N --seed S ...]

``run()`` waits for every plan node to register, sends each its JOB, waits for READY,
then per iteration sends GO to all and collects DONE from all.  It fails (RunError
naming the node and reason) if an agent reports an error, disconnects, or is silent
for ``timeout_s`` (agents send a heartbeat every second), and always tells the agents
to finish or abort so they exit.
"""

from __future__ import annotations

import argparse
import json
import logging
import queue
import socket
import sys
import threading
import time
from typing import Callable, Mapping

import numpy as np

from testbed.errors import ConfigError, RunError
from testbed.plan import RECV, Plan

from . import wire
from .agent import Job

log = logging.getLogger("agents.coordinator")

# send_ts_ns: the sender's clock in the DATA header; recv_start_ns/recv_end_ns: first/last
# payload byte read at the receiver; apply_ns: when the receiver added/copied it in.
TRANSFER_COLUMNS = ["iteration", "xfer", "src", "dst", "channel", "flow", "chunk", "phase", "bytes",
                    "send_start_ns", "send_end_ns", "send_ts_ns", "recv_start_ns", "recv_end_ns", "apply_ns"]
WORKER_KEYS = ["go_ns", "compute_end_ns", "comm_start_ns", "comm_done_ns", "receiver", "correct", "max_abs_err",
               "digest"]
GRACE_S = 0.3  # after a first failure, wait this long to collect related errors


class Coordinator:
    """Runs ``plan`` on agents that connect to ``address``.

    ``addresses``: node -> IP (every node reaches it there) or node -> {peer: IP} (the
    address node uses to reach each peer).  ``data_port``: the agents' data port; None
    or 0 uses the port each agent reports when it registers.  ``compute_s``: node ->
    list of per-iteration compute seconds (the last value repeats; a number is allowed).
    ``secret``: bytes or str, surrounding whitespace ignored (as in a secret file).
    ``health``: optional callable polled while waiting; a returned string fails the run
    (e.g. "agent process h3 exited").  ``clock_offsets_ns``: node -> its agent's clock minus
    this machine's (:mod:`testbed.clock`); every timestamp is reported on this machine's clock.
    """

    def __init__(self, plan: Plan, *, addresses: Mapping, data_port: int | None, secret: bytes | str,
                 iterations: int = 1, seed: int = 0, dtype: str = "float32",
                 compute_s: Mapping[str, list[float] | float] | None = None, stop_and_wait: bool = False,
                 timeout_s: float = 60.0, bind: tuple[str, int] = ("0.0.0.0", 0),
                 progress: Callable[[str], None] | None = None, register_timeout_s: float | None = None,
                 health: Callable[[], str | None] | None = None,
                 clock_offsets_ns: Mapping[str, int] | None = None):
        plan.validate()
        np.dtype(dtype)
        self.plan, self.secret, self.data_port = plan, wire.as_secret(secret), data_port
        self.iterations, self.seed, self.dtype = int(iterations), int(seed), dtype
        self.stop_and_wait, self.timeout_s = bool(stop_and_wait), float(timeout_s)
        self.register_timeout_s = float(register_timeout_s or timeout_s)
        self.compute_s = {n: ([float(v)] if isinstance(v, (int, float)) else [float(x) for x in v])
                          for n, v in (compute_s or {}).items()}
        self.progress = progress or (lambda s: None)
        self.health = health
        self.clock_offsets_ns = dict(clock_offsets_ns or {})
        self._sender = {op.xfer: src for src, op in plan.transfers()}
        self._peer_ip = self._resolve_addresses(addresses)
        self.listener = socket.create_server(tuple(bind), backlog=socket.SOMAXCONN)
        self.address = self.listener.getsockname()[:2]
        self._conns: dict[str, socket.socket] = {}
        self._idents: dict[str, dict] = {}
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False

    def _resolve_addresses(self, addresses: Mapping) -> dict[tuple[str, str], str]:
        out = {}
        for src, op in self.plan.transfers():
            view = addresses.get(src) if isinstance(addresses.get(src), Mapping) else addresses
            ip = view.get(op.peer) if view is not None else None
            if not isinstance(ip, str) or not ip:
                raise ConfigError(f"no address for {op.peer} as seen from {src}", key="addresses")
            out[(src, op.peer)] = ip
        return out

    # -- registration ----------------------------------------------------------------
    def start(self) -> "Coordinator":
        threading.Thread(target=self._accept_loop, daemon=True, name="coord-accept").start()
        return self

    def __enter__(self) -> "Coordinator":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, addr = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._handshake, args=(sock, addr), daemon=True).start()

    def _handshake(self, sock: socket.socket, addr) -> None:
        who = f"{addr[0]}:{addr[1]}"
        name = None

        def check(ident: dict) -> None:
            nonlocal name
            if ident.get("role") != "agent" or ident.get("name") not in self.plan.nodes:
                raise wire.ProtocolError(f"unknown agent {ident.get('name')!r}")
            with self._lock:
                if self._closed or ident["name"] in self._conns:
                    raise wire.ProtocolError(f"agent {ident['name']} is already registered")
                name = ident["name"]
                self._conns[name] = sock

        try:
            wire.tune(sock)
            sock.settimeout(wire.HANDSHAKE_TIMEOUT_S)
            ident = wire.server_handshake(sock, self.secret, check)
            sock.settimeout(None)
        except (wire.ProtocolError, wire.Closed, OSError) as e:
            log.warning("refused connection from %s: %s", who, e)
            with self._lock:
                if name is not None and self._conns.get(name) is sock:
                    del self._conns[name]
            wire.close_quietly(sock)
            return
        with self._lock:
            self._idents[name] = ident
        log.info("agent %s registered from %s", name, who)
        self._events.put(("registered", name, None))
        threading.Thread(target=self._reader, args=(name, sock), daemon=True).start()

    def _reader(self, name: str, sock: socket.socket) -> None:
        try:
            while True:
                h, msg = wire.recv_json(sock)
                if h.type == wire.ERROR:
                    msg = {"msg": "error", "message": str(msg.get("message", msg))}
                self._events.put(("msg", name, msg))
        except wire.ProtocolError as e:
            log.error("protocol error from agent %s: %s", name, e)
            self._events.put(("lost", name, f"protocol error: {e}"))
        except (wire.Closed, OSError) as e:
            self._events.put(("lost", name, f"agent disconnected ({e})"))
        finally:
            wire.close_quietly(sock)

    def agents(self) -> dict[str, dict]:
        """Registered agents: name -> identity (``data_port``, ``pid``, ``host``)."""
        with self._lock:
            return dict(self._idents)

    # -- messaging ---------------------------------------------------------------------
    def _send(self, name: str, obj: dict, typ: int = wire.CTRL) -> None:
        try:
            wire.send_json(self._conns[name], obj, typ)
        except OSError as e:
            self._failed(f"{name}: cannot send {obj.get('msg')}: {e}")

    def _failed(self, first: str):
        """Collect errors arriving within GRACE_S after ``first`` and raise them together."""
        msgs, named = [first], set()
        deadline = time.monotonic() + GRACE_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                kind, node, data = self._events.get(timeout=left)
            except queue.Empty:
                break
            if kind == "msg" and data.get("msg") == "error":
                msgs.append(f"{node}: {data.get('message')}")
                named.add(node)
            elif kind == "lost" and node not in named:
                msgs.append(f"{node}: {data}")
        raise RunError("; ".join(dict.fromkeys(msgs)))

    def _collect(self, kind: str, nodes: list[str], timeout_s: float, iteration: int | None = None) -> dict:
        """Wait for message ``kind`` from every node; fail on errors or ``timeout_s`` of silence."""
        got: dict[str, dict] = {}
        start = time.monotonic()
        last_seen = {n: start for n in nodes}
        while len(got) < len(nodes):
            try:
                ev, node, data = self._events.get(timeout=0.2)
            except queue.Empty:
                ev = None
            if ev == "msg":
                last_seen[node] = time.monotonic()
                m = data.get("msg")
                if m == "error":
                    self._failed(f"{node}: {data.get('message')}")
                elif m == kind and data.get("iteration") == iteration:
                    got[node] = data
                elif m != "alive":
                    self._failed(f"{node}: unexpected message {m!r} while waiting for {kind}")
            elif ev == "lost":
                self._failed(f"{node}: {data}")
            problem = self.health() if self.health else None
            if problem:
                self._failed(problem)
            now = time.monotonic()
            silent = [n for n in nodes if n not in got and now - last_seen[n] > timeout_s]
            if silent:
                self._failed(f"{', '.join(silent)}: no {kind} and no heartbeat for {timeout_s:g} s "
                             f"(hung or unreachable)")
        return got

    def _wait_registered(self) -> None:
        deadline = time.monotonic() + self.register_timeout_s
        while True:
            with self._lock:
                missing = [n for n in self.plan.nodes if n not in self._idents]
            if not missing:
                return
            if time.monotonic() > deadline:
                self._failed(f"{', '.join(missing)}: did not register within {self.register_timeout_s:g} s")
            try:
                ev, node, data = self._events.get(timeout=0.2)
            except queue.Empty:
                ev = None
            if ev == "registered":
                if len(self._idents) == len(self.plan.nodes):
                    self.progress(f"all {len(self._idents)} agents registered")
            elif ev == "lost":
                self._failed(f"{node}: {data}")
            elif ev == "msg" and data.get("msg") == "error":
                self._failed(f"{node}: {data.get('message')}")
            problem = self.health() if self.health else None
            if problem:
                self._failed(problem)

    # -- the run -----------------------------------------------------------------------
    def make_job(self, node: str) -> Job:
        plan = self.plan
        program = plan.programs.get(node, [])
        peers = {}
        for op in program:
            if op.kind != RECV and op.peer not in peers:
                port = self.data_port or int(self._idents.get(op.peer, {}).get("data_port") or 0)
                peers[op.peer] = (self._peer_ip[(node, op.peer)], port)
        return Job(name=node, nodes=list(plan.nodes), length=plan.length, participants=plan.contributing(),
                   receivers=plan.finishing(), program=program, peers=peers,
                   scratch=dict(plan.scratch.get(node, {})), dtype=self.dtype, seed=self.seed,
                   iterations=self.iterations, compute_s=self.compute_s.get(node, []),
                   stop_and_wait=self.stop_and_wait, timeout_s=self.timeout_s)

    def run(self) -> dict:
        """Run every iteration; return the results dict (see module docstring of agents)."""
        nodes = list(self.plan.nodes)
        try:
            self._wait_registered()
            for n in nodes:
                self._send(n, {"msg": "job", "job": self.make_job(n).to_dict()})
            self._collect("ready", nodes, self.timeout_s)
            self.progress(f"all {len(nodes)} agents ready")
            iterations, rows, errors = [], [], []
            for it in range(self.iterations):
                go_ns = time.time_ns()
                for n in nodes:
                    self._send(n, {"msg": "go", "iteration": it})
                done = self._collect("done", nodes, self.timeout_s, iteration=it)
                done = {n: self._on_my_clock(n, d) for n, d in done.items()}
                result = self._summarise(it, go_ns, done, errors)
                iterations.append(result)
                rows.extend(self._transfer_rows(it, done))
                self.progress(f"iteration {it + 1}/{self.iterations}: cct {result['cct_s']:.4f} s, "
                              f"{'correct' if result['correct'] else 'WRONG'}")
            for n in nodes:
                self._send(n, {"msg": "finish"})
        except RunError as e:
            self.abort(str(e))
            raise
        except BaseException as e:
            self.abort(f"coordinator failed: {e}")
            raise
        return {"scheme": self.plan.scheme, "nodes": nodes, "length": self.plan.length, "dtype": self.dtype,
                "seed": self.seed, "stop_and_wait": self.stop_and_wait, "iterations": iterations,
                "transfers": {"columns": TRANSFER_COLUMNS, "rows": rows}, "errors": errors}

    def _on_my_clock(self, node: str, done: dict) -> dict:
        """``node``'s DONE with its timestamps moved from the agents' clocks to this machine's
        (a recv row's ``send_ts_ns`` is on the sender's clock, the rest on ``node``'s)."""
        off = self.clock_offsets_ns
        if not off:
            return done
        me = off.get(node, 0)
        return {**done, **{k: done[k] - me for k in ("go_ns", "compute_end_ns", "comm_start_ns", "comm_done_ns")
                           if isinstance(done.get(k), int)},
                "sends": [[x, s - me, e - me] for x, s, e in done.get("sends", ())],
                "recvs": [[x, ts - off.get(self._sender.get(x), 0), first - me, last - me, applied - me]
                          for x, ts, first, last, applied in done.get("recvs", ())]}

    def _summarise(self, it: int, go_ns: int, done: dict, errors: list) -> dict:
        receivers = self.plan.finishing()
        wrong = [n for n in receivers if not done[n].get("correct")]
        digests = {done[n].get("digest") for n in receivers}
        correct = not wrong and len(digests) <= 1
        if wrong:
            errors.append(f"iteration {it}: wrong result at {', '.join(wrong)}")
        elif not correct:
            errors.append(f"iteration {it}: receivers' results differ")
        starts = [done[n]["comm_start_ns"] for n in done]
        ends = [done[n]["comm_done_ns"] for n in done]
        return {"iteration": it, "go_ns": go_ns, "cct_s": (max(ends) - min(starts)) / 1e9,
                "iteration_s": (max(ends) - go_ns) / 1e9, "correct": correct,
                "workers": {n: {k: done[n].get(k) for k in WORKER_KEYS} for n in self.plan.nodes}}

    def _transfer_rows(self, it: int, done: dict) -> list[list]:
        elem = np.dtype(self.dtype).itemsize
        sent = {x[0]: x[1:] for d in done.values() for x in d.get("sends", ())}
        recv = {x[0]: x[1:] for d in done.values() for x in d.get("recvs", ())}
        rows = []
        for src, op in sorted(self.plan.transfers(), key=lambda t: t[1].xfer):
            rows.append([it, op.xfer, src, op.peer, op.channel, op.flow, op.chunk, op.phase, op.length * elem,
                         *sent.get(op.xfer, (None, None)), *recv.get(op.xfer, (None,) * 4)])
        return rows

    def abort(self, reason: str) -> None:
        """Tell every connected agent to abort (best effort) and drop the connections."""
        with self._lock:
            conns = list(self._conns.values())
        for sock in conns:
            try:
                sock.settimeout(2.0)
                wire.send_json(sock, {"msg": "abort", "reason": reason}, wire.ERROR)
            except OSError:
                pass
            wire.close_quietly(sock)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._conns.values())
        self.listener.close()
        for sock in conns:
            wire.close_quietly(sock)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m agents.coordinator", description="Run a plan on agents.")
    ap.add_argument("--plan", required=True, help="plan JSON (testbed.plan.Plan.to_json)")
    ap.add_argument("--addresses", required=True, help="JSON: node -> IP, or node -> {peer: IP}")
    ap.add_argument("--secret-file", required=True)
    ap.add_argument("--port", type=int, required=True, help="control port to listen on")
    ap.add_argument("--bind", default="0.0.0.0")
    ap.add_argument("--data-port", type=int, default=0, help="agents' data port (0: as reported by each)")
    ap.add_argument("--out", required=True, help="results JSON")
    ap.add_argument("--iterations", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--compute", help="JSON: node -> list of per-iteration compute seconds")
    ap.add_argument("--stop-and-wait", action="store_true")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds without progress before failing")
    ap.add_argument("--register-timeout", type=float, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s coordinator %(levelname)s %(message)s")

    def load(path):
        with open(path) as f:
            return json.load(f)

    try:
        with Coordinator(Plan.from_dict(load(args.plan)), addresses=load(args.addresses),
                         data_port=args.data_port, secret=wire.load_secret(args.secret_file),
                         iterations=args.iterations, seed=args.seed, dtype=args.dtype,
                         compute_s=load(args.compute) if args.compute else None,
                         stop_and_wait=args.stop_and_wait, timeout_s=args.timeout,
                         bind=(args.bind, args.port), register_timeout_s=args.register_timeout,
                         progress=lambda s: print(s, file=sys.stderr, flush=True)) as coord:
            results = coord.run()
    except (RunError, ConfigError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 1)
    with open(args.out, "w") as f:
        json.dump(results, f)
    ok = all(r["correct"] for r in results["iterations"])
    for r in results["iterations"]:
        print(f"iteration {r['iteration']}: cct {r['cct_s']:.4f} s, iteration {r['iteration_s']:.4f} s, "
              f"{'correct' if r['correct'] else 'WRONG'}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
