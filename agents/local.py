"""Run a plan on real agent processes over loopback: for tests and quick checks without Mininet.

Each node gets its own loopback address (127.0.1.2, 127.0.1.3, ...; all of 127/8 is
local on Linux) and a free data port; the coordinator runs in this process on
127.0.0.1.  :class:`LocalCluster` exposes the processes (tests kill them);
:func:`run_local` is the one-call form.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from testbed.errors import RunError
from testbed.plan import Plan

from . import wire
from .coordinator import Coordinator

REPO = Path(__file__).resolve().parent.parent


def local_address(i: int) -> str:
    return f"127.0.{1 + i // 250}.{2 + i % 250}"


class LocalCluster:
    """Context manager: a started coordinator plus one agent subprocess per plan node
    (except the ``external`` ones, which the caller runs itself, e.g. a fake agent in a test)."""

    def __init__(self, plan: Plan, *, iterations: int = 1, seed: int = 0, dtype: str = "float32",
                 timeout_s: float = 30.0, stop_and_wait: bool = False, compute_s=None, progress=None,
                 external: tuple[str, ...] = (), handshake_s: float | None = None, probe: dict | None = None,
                 clock_offset_ms: dict[str, float] | None = None, driver=None, links: str = "channel"):
        self.plan = plan
        self.external = set(external)
        self.options = dict(iterations=iterations, seed=seed, dtype=dtype, timeout_s=timeout_s,
                            stop_and_wait=stop_and_wait, compute_s=compute_s, progress=progress, probe=probe,
                            driver=driver, links=links)
        self.clock_offset_ms = dict(clock_offset_ms or {})  # node -> shift of its agent's clock
        self.handshake_s = handshake_s or wire.HANDSHAKE_TIMEOUT_S  # agents' and coordinator's (tests shorten it)
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self.coordinator: Coordinator | None = None
        self.tmp: Path | None = None

    def __enter__(self) -> "LocalCluster":
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="testbed-local-"))
        timeout_s = self.options["timeout_s"]
        secret = secrets.token_hex(32).encode()
        secret_file = self.tmp / "secret"
        secret_file.touch(mode=0o600)
        secret_file.write_bytes(secret)
        addresses = {n: local_address(i) for i, n in enumerate(self.plan.nodes)}
        self.coordinator = Coordinator(self.plan, addresses=addresses, data_port=None, secret=secret,
                                       bind=("127.0.0.1", 0), health=self._health,
                                       register_timeout_s=max(30.0, timeout_s),
                                       handshake_s=self.handshake_s, **self.options)
        self.coordinator.start()
        host, port = self.coordinator.address
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        for n in self.plan.nodes:
            if n in self.external:
                continue
            cfg = self.tmp / f"{n}.json"
            cfg.write_text(json.dumps({"name": n, "coordinator": f"{host}:{port}", "data_port": 0,
                                       "bind": addresses[n], "secret_file": str(secret_file),
                                       "handshake_timeout_s": self.handshake_s,
                                       "clock_offset_ms": self.clock_offset_ms.get(n, 0)}))
            self.logs[n] = self.tmp / f"{n}.log"
            with open(self.logs[n], "wb") as log:
                self.procs[n] = subprocess.Popen([sys.executable, "-m", "agents.agent", "--config", str(cfg)],
                                                 cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                                 stdout=subprocess.DEVNULL, stderr=log)

    def _health(self) -> str | None:
        for n, p in self.procs.items():
            if p.poll() is not None:
                return f"{n}: agent process exited with code {p.returncode}"
        return None

    def log_tail(self, node: str, lines: int = 5) -> str:
        try:
            return "\n".join(self.logs[node].read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def run(self) -> dict:
        try:
            return self.coordinator.run()
        except RunError as e:
            named = [n for n in self.logs if re.search(rf"\b{re.escape(n)}\b", str(e))]
            time.sleep(0.2)  # let the agents log their side
            tails = "".join(f"\n--- {n} log ---\n{self.log_tail(n)}" for n in named[:4])
            e.args = (f"{e}{tails}",)  # the same error (culprit, link, results kept), logs appended
            raise

    def close(self) -> None:
        if self.coordinator:
            self.coordinator.close()
        deadline = time.monotonic() + 5.0
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)


def run_local(plan: Plan, *, iterations: int = 1, seed: int = 0, dtype: str = "float32", timeout_s: float = 30,
              stop_and_wait: bool = False, compute_s=None, links: str = "channel") -> dict:
    """Run ``plan`` on one real agent process per node over loopback; return the results
    dict of :meth:`Coordinator.run` (raises RunError on failure).  ``links``: the agents'
    data connections (:data:`agents.executor.LINKS`)."""
    with LocalCluster(plan, iterations=iterations, seed=seed, dtype=dtype, timeout_s=timeout_s,
                      stop_and_wait=stop_and_wait, compute_s=compute_s, links=links) as cluster:
        return cluster.run()
