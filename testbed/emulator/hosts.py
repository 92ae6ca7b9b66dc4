"""Agents in the emulator: one process per datacenter in its Mininet host."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from testbed.hosts import DATA_PORT, Hosts
from testbed.results import REPO, write_json_atomic


class EmulatedHosts(Hosts):
    """:class:`~testbed.hosts.Hosts` of a :class:`~testbed.emulator.network.WanNetwork`: one
    agent process per datacenter in its Mininet host; the coordinator listens on the control
    network (root namespace)."""

    def __init__(self, net):
        self.net, self._procs = net, {}
        self.coordinator_host = net.control_gateway  # agents connect here; the coordinator binds it, any port
        self.coordinator_bind = (net.control_gateway, 0)

    def addresses(self) -> dict:
        return self.net.address_map()

    def carry_paths(self, paths: dict) -> dict[str, dict[str, str]]:
        """Install the paths in the network (policy routing by source address,
        :meth:`~testbed.emulator.network.WanNetwork.install_paths`): {node: {"peer/channel":
        source address}} for every connection of more than one hop."""
        addr = self.net.install_paths(paths.values())
        out: dict[str, dict[str, str]] = {}
        for (node, peer, ch), path in paths.items():
            if tuple(path) in addr:
                out.setdefault(node, {})[f"{peer}/{ch}"] = addr[tuple(path)]
        return out

    def clock_offsets(self) -> dict:
        """None to correct: every agent runs on this machine's clock."""
        return {}

    def start_agent(self, dc: str, cfg: dict, out_dir: Path, secret_file: Path) -> None:
        path = out_dir / "agents" / f"{dc}.json"
        path.parent.mkdir(exist_ok=True)
        write_json_atomic(path, {**cfg, "data_port": DATA_PORT, "bind": "0.0.0.0",
                                 "secret_file": str(secret_file.resolve()),
                                 "log_file": str((out_dir / "agents" / f"{dc}.log").resolve())})
        self._procs[dc] = self.net.popen(dc, [sys.executable, "-m", "agents.agent", "--config", str(path.resolve())],
                                         cwd=str(REPO), env=dict(os.environ, PYTHONPATH=str(REPO)))

    def health(self) -> str | None:
        """Why a run cannot go on (an agent process exited, the network broke), or None."""
        problem = self.net.health()
        if problem:
            return problem
        for dc, p in self._procs.items():
            if p.poll() is not None:
                return f"{dc}: agent process exited with code {p.returncode} (log: agents/{dc}.log)"
        return None

    def truth(self):
        """``truth(src, dst)``: the configured rate (after dynamics) and delay of the path data
        takes from src to dst now: the least rate along it, the sum of its one-way delays."""
        from testbed.routing import data_paths

        paths, dirs = data_paths(self.net.topo.graph()), self.net.directions

        def truth(src: str, dst: str) -> dict | None:
            path = paths.get((src, dst))
            if not path:
                return None
            specs = [dirs[h].spec for h in zip(path, path[1:])]  # kept current by set_rate
            return {"rate_mbps": min(s.rate_mbps for s in specs), "delay_ms": sum(s.delay_ms for s in specs)}
        return truth

    def stop_agents(self) -> None:
        self.net.stop_processes()
        self._procs.clear()
