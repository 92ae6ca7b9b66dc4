"""One server's part of an experiment on several servers: ``python3 -m testbed.emulator.serve``,
started over SSH by the machine that runs ``testbed`` (``testbed/cluster.py``).

Reads one JSON line, the spec (the whole scaled topology, this server's datacenters and
tunnels, the emulator settings), builds its share with :class:`~.network.WanNetwork`, answers
``{"ready": ...}`` (the datacenters' namespace pids, the directions it shapes), then one JSON
reply per JSON request line on stdin:

* ``health`` -> ``{"ok": null | why}``; ``stats`` -> the relays' statistics and this server's
  CPU use and steal since the last ``reset``; ``reset`` starts that window (and the relays');
* ``forward {"to": [host, port]}``: control connections that agents make to the control
  bridge's address, port :data:`FORWARD_PORT`, are carried to ``host:port`` (the
  coordinator) over the underlay -- control traffic never crosses a shaped link;
* ``set_rate {"src", "dst", "rate_mbps"}``, ``set_link {"a", "b", "up"}``: live changes of the
  directions this server shapes;
* ``stop``, or the end of stdin (the SSH connection is gone): every process in this server's
  namespaces is killed and the network torn down.

Progress goes out as ``{"log": ...}`` lines between replies.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading

from testbed.emulator.network import CONTROL_IP, Share, Tunnel, WanNetwork
from testbed.results import CpuMeter

FORWARD_PORT = 7099  # on every server's control bridge: the coordinator, forwarded

_out_lock = threading.Lock()


def emit(msg: dict) -> None:
    with _out_lock:
        sys.stdout.write(json.dumps(msg) + "\n")
        sys.stdout.flush()


class Forwarder:
    """TCP connections to ``(CONTROL_IP, FORWARD_PORT)`` carried to ``self.to``."""

    def __init__(self):
        self.to: tuple[str, int] | None = None
        self.sock = socket.create_server((CONTROL_IP, FORWARD_PORT), reuse_port=False)
        threading.Thread(target=self._accept, daemon=True, name="forward").start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._carry, args=(conn,), daemon=True).start()

    def _carry(self, conn: socket.socket) -> None:
        try:
            far = socket.create_connection(self.to, timeout=10)
            far.settimeout(None)
        except (OSError, TypeError):
            conn.close()
            return
        for a, b in ((conn, far), (far, conn)):
            threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    def close(self) -> None:
        self.sock.close()


def _pump(a: socket.socket, b: socket.socket) -> None:
    try:
        while data := a.recv(65536):
            b.sendall(data)
    except OSError:
        pass
    for s in (a, b):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def kill_namespace_processes(pids: list[int]) -> int:
    """SIGKILL every process in the network namespaces of ``pids`` but those shells (Mininet
    stops them itself): what the head started there over SSH; how many were killed."""
    def netns(pid) -> int | None:
        try:
            return os.stat(f"/proc/{pid}/ns/net").st_ino
        except OSError:
            return None

    spaces = {netns(p) for p in pids} - {None}
    killed = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in pids and int(entry) != os.getpid() and netns(entry) in spaces:
            try:
                os.kill(int(entry), signal.SIGKILL)
                killed += 1
            except OSError:
                pass
    return killed


def _share(spec: dict) -> Share:
    return Share(nodes=tuple(spec["nodes"]), port=spec["vxlan_port"], mtu=spec["mtu"],
                 tunnels={int(j): Tunnel(**t) for j, t in spec["tunnels"].items()},
                 relay_cores=tuple(spec.get("relay_cores", ())))


def serve(spec: dict, requests) -> int:
    """Build this server's share, answer ``requests`` (lines) until ``stop`` or their end, tear
    the share down: 0, or 1 if the share could not be built (the error sent to the head)."""
    from testbed.topology import load_topology

    topo = load_topology(spec["topology"], source="<servers spec>")
    net = WanNetwork(topo, method=spec["method"], relay_procs=spec.get("relay_procs", 0), seed=spec.get("seed", 0),
                     log=lambda m: emit({"log": m}), icmp_priority=spec.get("icmp_priority", False),
                     tcp_cc=spec["tcp_cc"], frame_ms=spec["frame_ms"], share=_share(spec))
    fwd = None
    try:
        try:
            net.start()
            fwd = Forwarder()
        except Exception as e:  # noqa: BLE001 -- reported to the head, which names this server
            emit({"error": str(e)})
            return 1
        emit({"ready": _ready(net)})
        _answer(net, fwd, requests)
        return 0
    finally:
        _teardown(net, fwd)


def _ready(net: WanNetwork) -> dict:
    """What the head learns of the share once it is built."""
    return {"pids": {dc: h.pid for dc, h in net.hosts.items()}, "method": net.method,
            "run_id": net.run_id, "relay_layout": net.relay_layout, "memory_hold": net.memory_hold,
            "host_sysctls": net.host_sysctls, "kernel": os.uname().release,
            "directions": [{"src": d.src, "dst": d.dst, "link": d.link, "intf": d.intf, "method": d.method,
                            "segment_loss": d.segment_loss} for d in net.directions.values()]}


def _answer(net: WanNetwork, fwd: Forwarder, requests) -> None:
    """One reply per request line (the module docstring's list), until ``stop`` or their end."""
    cpu = CpuMeter().start()
    for line in requests:
        req = json.loads(line)
        op = req.get("op")
        try:
            if op == "stop":
                emit({"ok": True})
                break
            if op == "health":
                emit({"ok": net.health()})
            elif op == "stats":
                util, steal = cpu.stop()
                emit({"ok": {"relay": net.relay_stats(), "cpu_util": util, "steal": steal,
                             "cpus": os.cpu_count()}})
            elif op == "reset":
                net.reset_relay_window()
                cpu = CpuMeter().start()
                emit({"ok": True})
            elif op == "forward":
                fwd.to = tuple(req["to"])
                emit({"ok": True})
            elif op == "set_rate":
                net.set_rate(req["src"], req["dst"], req["rate_mbps"])
                emit({"ok": True})
            elif op == "set_link":
                net.set_link(req["a"], req["b"], req["up"])
                emit({"ok": True})
            else:
                emit({"error": f"unknown request {op!r}"})
        except Exception as e:  # noqa: BLE001 -- one request failed; the head decides
            emit({"error": f"{op}: {e}"})


def _teardown(net: WanNetwork, fwd: Forwarder | None) -> None:
    """The forwarder closed, every process the head started in the share killed, the share gone."""
    if fwd:
        fwd.close()
    kill_namespace_processes([h.pid for h in net.hosts.values()])  # what the head started there
    net.stop()


def main() -> int:
    def on_signal(signum, frame):  # once: a second signal must not cut the teardown short
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    line = sys.stdin.readline()
    if not line:
        return 1
    try:
        return serve(json.loads(line), iter(sys.stdin.readline, ""))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
