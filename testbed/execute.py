"""``testbed exec`` and ``testbed shell``: your own program on an experiment's emulated WAN.

``exec`` builds the experiment's network (its dynamics and faults run as in ``run``), starts
``CMD ARGS...`` in every datacenter (or those named), waits, and records each one's exit
code, wall time, stdout and stderr; the network is torn down at the end, on error and on
Ctrl-C.  Environment of each process, in torchrun's convention:

``RANK`` (0..n-1 in the order of the datacenters), ``WORLD_SIZE``, ``LOCAL_RANK=0``,
``LOCAL_WORLD_SIZE=1``, ``MASTER_ADDR`` (rank 0's node address), ``MASTER_PORT``, plus
``TESTBED_DC`` (this datacenter's name), ``TESTBED_NODE_ADDRS`` (``dc=address,...`` in rank
order), ``TESTBED_NODE_ADDR`` and ``TESTBED_NODE_IFNAME``.  ``{dc}`` and ``{rank}`` in ARGS
are replaced per datacenter.

A datacenter's node address lives on ``lo`` (routed over the WAN); libraries that pick an
address by interface name (gloo's ``GLOO_SOCKET_IFNAME``) would get 127.0.0.1 from ``lo``,
so each host also gets an interface ``TESTBED_NODE_IFNAME`` (one end of a veth pair inside
the host) carrying the node address.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path
from typing import Callable

from testbed.config import Experiment
from testbed.errors import ConfigError, RunError

NODE_IFNAME = "tbnode"
OUTPUT_KEEP = 64 * 1024  # bytes of each stream kept in results.json (the files keep all)


def _add_node_interface(net, dc: str) -> None:
    addr = net.node_address(dc)
    # a veth pair inside the host (kernels without the dummy module have veth: Mininet needs it)
    p = net.popen(dc, ["sh", "-c", f"ip link add {NODE_IFNAME} type veth peer name {NODE_IFNAME}-peer && "
                                   f"ip addr add {addr}/32 dev {NODE_IFNAME} && ip link set {NODE_IFNAME}-peer up && "
                                   f"ip link set {NODE_IFNAME} up && echo ok"],
                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = p.communicate(timeout=30)
    if "ok" not in out:
        raise RunError(f"{dc}: cannot add interface {NODE_IFNAME} for the node address: {out.strip()}")


def ranks(exp: Experiment, on: list[str] | None) -> list[str]:
    """The datacenters that run the command, in rank order; unknown names are input errors."""
    nodes = list(exp.topology.nodes)
    if not on:
        return nodes
    bad = [d for d in on if d not in nodes]
    if bad:
        raise ConfigError(f"unknown datacenter {bad[0]!r} (known: {', '.join(nodes)})", key="--on")
    return [d for d in nodes if d in on]


def process_env(dcs: list[str], addrs: dict[str, str], dc: str, master_port: int) -> dict[str, str]:
    """The torchrun-style environment of ``dc``'s process."""
    return {"RANK": str(dcs.index(dc)), "WORLD_SIZE": str(len(dcs)), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": addrs[dcs[0]], "MASTER_PORT": str(master_port), "TESTBED_DC": dc,
            "TESTBED_NODE_ADDR": addrs[dc], "TESTBED_NODE_IFNAME": NODE_IFNAME,
            "TESTBED_NODE_ADDRS": ",".join(f"{d}={addrs[d]}" for d in dcs)}


def substitute(argv: list[str], dc: str, rank: int) -> list[str]:
    return [a.replace("{dc}", dc).replace("{rank}", str(rank)) for a in argv]


def exec_command(exp: Experiment, argv: list[str], out_dir: Path, *, on: list[str] | None = None,
                 master_port: int = 29500, timeout_s: float | None = None,
                 progress: Callable[[str], None] = lambda m: None, net=None) -> dict:
    """Run ``argv`` in the chosen datacenters of ``exp``'s network (``net``: one already
    open, e.g. on several servers); return the results record (``processes``: per
    datacenter rank, argv, exit code, wall time, output)."""
    from testbed.emulator.dynamics import Scheduler
    from testbed.experiment import open_network
    from testbed.results import environment

    if not argv:
        raise ConfigError("no command given (usage: exec EXP.yaml -- CMD ARGS...)")
    dcs = ranks(exp, on)
    timeout_s = timeout_s or exp.agents.timeout_s
    logs = out_dir / "exec"
    logs.mkdir(parents=True, exist_ok=True)
    results: dict = {"experiment": exp.to_dict(), "environment": environment(), "command": argv, "processes": {}}
    with (open_network(exp, progress) if net is None else contextlib.nullcontext(net)) as net:
        results["links"] = net.link_report()
        results["events_t0_s"] = net.t0
        addrs = {dc: net.node_address(dc) for dc in dcs}
        for dc in dcs:
            _add_node_interface(net, dc)
        sched = Scheduler(net, exp.dynamics, exp.faults, log=progress).start()
        procs = {}
        try:
            for rank, dc in enumerate(dcs):
                cmd = substitute(argv, dc, rank)
                files = (open(logs / f"{dc}.out", "wb"), open(logs / f"{dc}.err", "wb"))
                try:
                    p = net.popen(dc, cmd, stdout=files[0], stderr=files[1], cwd=os.getcwd(),
                                  env=dict(os.environ, **process_env(dcs, addrs, dc, master_port)))
                except OSError as e:
                    raise ConfigError(f"cannot start {cmd[0]!r} in {dc}: {e.strerror}") from None
                finally:
                    for f in files:
                        f.close()
                procs[dc] = (p, time.monotonic(), cmd)
            progress(f"started {' '.join(argv)!r} in {len(dcs)} datacenter(s); waiting (timeout {timeout_s:g}s)")
            walls = _wait(procs, timeout_s, progress)
        finally:
            sched.stop()
            results["events"] = net.events + [{"error": e} for e in sched.errors]
    for dc, (p, _, cmd) in procs.items():
        results["processes"][dc] = {"rank": dcs.index(dc), "argv": cmd, "address": addrs[dc],
                                    "exit_code": p.returncode, "timed_out": walls[dc] is None,
                                    "wall_s": walls[dc], "stdout": _tail(logs / f"{dc}.out"),
                                    "stderr": _tail(logs / f"{dc}.err")}
    results["ok"] = all(r["exit_code"] == 0 for r in results["processes"].values())
    return results


def _wait(procs: dict, timeout_s: float, progress) -> dict[str, float | None]:
    """Wall seconds of every process (None: killed at the timeout)."""
    walls: dict[str, float | None] = {}
    deadline = time.monotonic() + timeout_s
    while len(walls) < len(procs) and time.monotonic() < deadline:
        for dc, (p, t0, _) in procs.items():
            if dc not in walls and p.poll() is not None:
                walls[dc] = time.monotonic() - t0
                progress(f"{dc}: exited with code {p.returncode} after {walls[dc]:.3f}s")
        time.sleep(0.02)
    for dc, (p, _, _) in procs.items():
        if dc not in walls:
            progress(f"{dc}: still running after {timeout_s:g}s: killed")
            p.kill()
            p.wait()
            walls[dc] = None
    return walls


def _tail(path: Path) -> str:
    data = path.read_bytes()
    return data[-OUTPUT_KEEP:].decode(errors="replace")


def shell(exp: Experiment, progress: Callable[[str], None]) -> None:
    """Mininet's interactive CLI on the experiment's network (dynamics and faults run)."""
    from mininet.cli import CLI
    from mininet.log import setLogLevel

    from testbed.emulator.dynamics import Scheduler
    from testbed.experiment import open_network

    with open_network(exp, progress) as net:
        for dc in net.topo.nodes:
            _add_node_interface(net, dc)
            # Mininet's pingall/iperf address a host by its first interface's IP: name the node
            # address there (bookkeeping only; the interface keeps its link address)
            net.host(dc).defaultIntf().ip = net.node_address(dc)
        setLogLevel("output")  # the network was built quietly; the CLI prints at this level
        names = ", ".join(f"{net.host(dc).name}={dc} ({net.node_address(dc)})" for dc in net.topo.nodes)
        progress(f"hosts: {names}; 'exit' or Ctrl-D tears the network down")
        sched = Scheduler(net, exp.dynamics, exp.faults, log=progress).start()
        try:
            CLI(net.net)
        finally:
            sched.stop()
