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

    def clock_offsets(self) -> dict:
        """dc -> :class:`testbed.clock.Offset` of its host's clock from this machine's, measured
        now ({}: the agents run on this machine's clock)."""

    def start_agent(self, dc: str, cfg: dict, out_dir: Path, secret_file: Path) -> None:
        """Start datacenter ``dc``'s agent with node config ``cfg`` (name, coordinator;
        ``sources`` where its data connections are bound to a path's source address)."""

    def carry_paths(self, paths: dict) -> dict[str, dict[str, str]]:
        """Make the network carry the named paths of a plan's connections ({(node, peer,
        channel): path}, ``Plan.paths``) and return, per node, {"peer/channel": source
        address} to bind each such connection to; {} where these hosts cannot (routing
        unchanged)."""

    def health(self) -> str | None:
        """Why a run cannot go on (an agent exited), or None."""

    def truth(self) -> Callable[[str, str], dict | None] | None:
        """``truth(src, dst)`` -> the path's configured {rate_mbps, delay_ms} now (after
        dynamics), the ground truth link estimates are recorded beside; None: unknown."""

    def stop_agents(self) -> None:
        """Stop every agent started (kill it if need be)."""


def run_agents(hosts: Hosts, plan, out_dir: Path, *, iterations: int = 1, seed: int = 0, dtype: str = "float32",
               compute_s: dict | None = None, stop_and_wait: bool = False, subblock_bytes: int | None = None,
               links: str = "channel", timeout_s: float = 120.0, progress: Callable[[str], None] = lambda m: None, predicted_s: float | None = None,
               probe: dict | None = None, clock_offset_ms: dict | None = None, policy=None,
               driver=None, on_ready: Callable[[], None] | None = None) -> dict:
    """Start a coordinator here and one agent per datacenter on ``hosts``, run ``plan``
    ``iterations`` times, and return the coordinator's results.  Agents are stopped
    (killed if need be) before returning, also on error.  ``probe``: passive probing
    ({chunk_bytes, chunk_num, estimator}); ``clock_offset_ms``: {dc: ms} shifts agents'
    clocks (tests); ``policy``: re-planning; ``driver``: a run-time driver instead of the
    iterations (CREW's groups); ``subblock_bytes``: the executors' cut-through sub-block
    (None: theirs); ``links``: their data connections (:class:`agents.executor.Executor`); ``on_ready()``: when the measured phase starts (:class:`agents.coordinator.Coordinator`)."""
    from agents.coordinator import Coordinator

    offsets = hosts.clock_offsets()  # node -> testbed.clock.Offset of its host's clock from ours
    out_dir.mkdir(parents=True, exist_ok=True)
    secret_file = out_dir / "secret"
    if not secret_file.exists():
        secret_file.touch(mode=0o600)
        secret_file.write_text(secrets.token_hex(32))
    coord = Coordinator(plan, addresses=hosts.addresses(), data_port=None, secret=secret_file.read_text(),
                        iterations=iterations, seed=seed, dtype=dtype, compute_s=compute_s,
                        stop_and_wait=stop_and_wait, subblock_bytes=subblock_bytes, links=links, timeout_s=timeout_s,
                        bind=hosts.coordinator_bind, progress=progress, health=hosts.health, predicted_s=predicted_s,
                        clock_offsets_ns={n: o.offset_ns for n, o in offsets.items()}, probe=probe,
                        truth=hosts.truth(), policy=policy, driver=driver, sync_clocks=bool(probe or clock_offset_ms),
                        on_ready=on_ready)
    coord.start()
    try:
        sources = hosts.carry_paths(plan.paths()) if plan.paths() else {}
        if plan.paths():
            carried = sum(len(s) for s in sources.values())
            progress(f"{carried} of the {len(plan.paths())} connections that name a path carried on it"
                     + ("" if carried else " (these hosts cannot: routed as usual)")
                     + ("; the rest are one hop" if 0 < carried < len(plan.paths()) else ""))
        for dc in plan.nodes:
            cfg = {"name": dc, "coordinator": f"{hosts.coordinator_host}:{coord.address[1]}"}
            if sources.get(dc):
                cfg["sources"] = sources[dc]
            if (clock_offset_ms or {}).get(dc):
                cfg["clock_offset_ms"] = clock_offset_ms[dc]
            hosts.start_agent(dc, cfg, out_dir, secret_file)
        result = coord.run()
        if offsets:
            result["clock_offsets"] = {n: {"offset_ms": o.offset_ns / 1e6, "rtt_ms": o.rtt_ns / 1e6}
                                       for n, o in offsets.items()}
        return result
    finally:
        coord.close()
        hosts.stop_agents()
