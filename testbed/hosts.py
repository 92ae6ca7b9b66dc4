"""Where agents run: the :class:`Hosts` protocol and :func:`run_agents`, which runs one
plan with a coordinator here and one agent per datacenter on any ``Hosts``.

Two implementations: :class:`testbed.emulator.hosts.EmulatedHosts` (Mininet hosts of a
:class:`~testbed.emulator.network.WanNetwork`) and :class:`testbed.deploy.SshHosts` (real
hosts over ssh)."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Callable, Protocol

DATA_PORT = 7100  # an agent's default listening port for peers' data connections


class Hosts(Protocol):
    """Places that run one agent per datacenter.  ``coordinator_host``: the address agents
    reach the coordinator at; ``coordinator_bind``: (address, port) the coordinator binds."""

    coordinator_host: str
    coordinator_bind: tuple[str, int]

    def addresses(self) -> dict:
        """src -> {dst: address src connects to} (or a flat dc -> address map)."""

    def start_agent(self, dc: str, cfg: dict, out_dir: Path, secret_file: Path) -> None:
        """Start datacenter ``dc``'s agent with node config ``cfg`` (name, coordinator)."""

    def health(self) -> str | None:
        """Why a run cannot go on (an agent exited), or None."""

    def stop_agents(self) -> None:
        """Stop every agent started (kill it if need be)."""


def run_agents(hosts: Hosts, plan, out_dir: Path, *, iterations: int = 1, seed: int = 0, dtype: str = "float32",
               compute_s: dict | None = None, stop_and_wait: bool = False, timeout_s: float = 120.0,
               progress: Callable[[str], None] = lambda m: None) -> dict:
    """Start a coordinator here and one agent per datacenter on ``hosts``, run ``plan``
    ``iterations`` times, and return the coordinator's results.  Agents are stopped
    (killed if need be) before returning, also on error."""
    from agents.coordinator import Coordinator

    out_dir.mkdir(parents=True, exist_ok=True)
    secret_file = out_dir / "secret"
    if not secret_file.exists():
        secret_file.touch(mode=0o600)
        secret_file.write_text(secrets.token_hex(32))
    coord = Coordinator(plan, addresses=hosts.addresses(), data_port=None, secret=secret_file.read_text(),
                        iterations=iterations, seed=seed, dtype=dtype, compute_s=compute_s,
                        stop_and_wait=stop_and_wait, timeout_s=timeout_s, bind=hosts.coordinator_bind,
                        progress=progress, health=hosts.health)
    coord.start()
    try:
        for dc in plan.nodes:
            hosts.start_agent(dc, {"name": dc, "coordinator": f"{hosts.coordinator_host}:{coord.address[1]}"},
                              out_dir, secret_file)
        return coord.run()
    finally:
        coord.close()
        hosts.stop_agents()
