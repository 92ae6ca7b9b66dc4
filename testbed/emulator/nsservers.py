"""Servers on this machine, for trying ``--servers`` without a cluster and for its tests: each
server is a network namespace ``tbs-NAME`` with its own sshd and underlay address on a bridge
``tbu0`` in the root namespace (which holds this machine's underlay address, where the
servers reach the coordinator).  Everything else is what a real cluster gets: the servers are
reached over SSH with paramiko, build their datacenters' namespaces inside their own, and
carry cut links over VXLAN on the underlay.

Keys: a fresh host key and client key in a private temporary folder per start, so nothing of
the user's ``~/.ssh`` is read or written.  :meth:`LocalServers.stop` (and ``clean``) kills
every process in the servers' namespaces and removes them and the bridge.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from testbed.emulator import cleanup
from testbed.errors import RunError

BRIDGE = "tbu0"
NS_PREFIX = "tbs-"
KEY_DIR_PREFIX = "tbsrv-"  # the temporary folder of keys and sshd configs (cleanup knows it)
SSHD_START_S = 10.0


def ns_name(server: str) -> str:
    return NS_PREFIX + server


def _veth(server: str) -> str:
    return f"tbu-{server}"[:15]


def _run(argv: list[str], what: str) -> str:
    res = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        raise RunError(f"{what}: '{' '.join(argv)}' failed: {(res.stderr or res.stdout).strip()}")
    return res.stdout


def _keypair(path: Path) -> str:
    """An ed25519 key in OpenSSH format at ``path`` (mode 600); its public line."""
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    path.write_bytes(key.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.OpenSSH, ser.NoEncryption()))
    path.chmod(0o600)
    return key.public_key().public_bytes(ser.Encoding.OpenSSH, ser.PublicFormat.OpenSSH).decode()


def sshd_binary() -> str | None:
    path = shutil.which("sshd") or "/usr/sbin/sshd"
    return path if os.access(path, os.X_OK) else None


def core_share(i: int, n: int, cpus: int) -> list[int]:
    """The cores the relays of local server ``i`` of ``n`` use on this ``cpus``-core machine:
    a split of them, round robin where servers outnumber cores (every server's relays pinned
    one per core put n of them on each core)."""
    if n >= cpus:
        return [i % cpus]
    return list(range(i * cpus // n, (i + 1) * cpus // n))


@dataclass
class LocalServers:
    """``servers``: name -> underlay address; ``head``: this machine's address on the bridge;
    ``prefix``: the underlay's prefix length; ``mtu``: the underlay's MTU."""

    servers: dict[str, str]
    head: str
    prefix: int = 24
    mtu: int = 9000
    log: object = print
    keys: Path | None = None
    host_pub: str = ""
    _made: list[str] = field(default_factory=list)

    def __enter__(self) -> "LocalServers":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def identity(self) -> str:
        return str(self.keys / "client")

    @property
    def known_hosts(self) -> str:
        return str(self.keys / "known_hosts")

    def start(self) -> None:
        sshd = sshd_binary()
        if sshd is None:
            raise RunError("local servers need sshd (apt install openssh-server; no service needs to run)")
        if subprocess.run(["ip", "link", "show", BRIDGE], capture_output=True).returncode == 0:
            raise RunError(f"interface {BRIDGE} exists: local servers of another run are up, or a crashed run "
                           "left them (remove them with: python3 -m testbed clean --servers FILE)")
        cleanup.claim()
        self.keys = Path(tempfile.mkdtemp(prefix=KEY_DIR_PREFIX))
        self.host_pub = _keypair(self.keys / "host")
        (self.keys / "authorized_keys").write_text(_keypair(self.keys / "client") + "\n")
        (self.keys / "known_hosts").write_text("".join(f"{a} {self.host_pub}\n" for a in self.servers.values()))
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation directory
        self._made.append(BRIDGE)
        _run(["ip", "link", "add", BRIDGE, "mtu", str(self.mtu), "type", "bridge"], "underlay bridge")
        _run(["ip", "addr", "add", f"{self.head}/{self.prefix}", "dev", BRIDGE], "underlay bridge")
        _run(["ip", "link", "set", BRIDGE, "up"], "underlay bridge")
        for name, addr in self.servers.items():
            ns, veth = ns_name(name), _veth(name)
            self._made.append(ns)
            _run(["ip", "netns", "add", ns], f"server {name}")
            _run(["ip", "link", "add", veth, "mtu", str(self.mtu), "type", "veth", "peer", "name", "eth0",
                  "mtu", str(self.mtu), "netns", ns], f"server {name}")
            _run(["ip", "link", "set", veth, "master", BRIDGE, "up"], f"server {name}")
            for argv in (["ip", "link", "set", "lo", "up"], ["ip", "addr", "add", f"{addr}/{self.prefix}", "dev", "eth0"],
                         ["ip", "link", "set", "eth0", "up"]):
                _run(["ip", "netns", "exec", ns, *argv], f"server {name}")
            conf = self.keys / f"sshd-{name}.conf"
            conf.write_text(f"ListenAddress {addr}\nHostKey {self.keys / 'host'}\n"
                            f"AuthorizedKeysFile {self.keys / 'authorized_keys'}\nPidFile {self.keys / name}.pid\n"
                            "StrictModes no\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
                            "PermitRootLogin prohibit-password\nUsePAM no\nSubsystem sftp internal-sftp\n"
                            "MaxSessions 200\nMaxStartups 100\nClientAliveInterval 15\nClientAliveCountMax 4\n")
            subprocess.Popen(["ip", "netns", "exec", ns, sshd, "-D", "-e", "-f", str(conf)],
                             stdout=subprocess.DEVNULL, stderr=open(self.keys / f"sshd-{name}.log", "wb"),
                             start_new_session=True)
        for name, addr in self.servers.items():
            self._wait(name, addr)
        self.log(f"local servers up: {', '.join(f'{n} ({a})' for n, a in self.servers.items())}")

    def _wait(self, name: str, addr: str) -> None:
        deadline = time.monotonic() + SSHD_START_S
        while True:
            try:
                socket.create_connection((addr, 22), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    log = (self.keys / f"sshd-{name}.log").read_text(errors="replace").strip()
                    raise RunError(f"server {name}: sshd did not listen on {addr}:22 within {SSHD_START_S:g} s"
                                   + (f": {log.splitlines()[-1]}" if log else "")) from None
                time.sleep(0.05)

    def stop(self) -> None:
        """Kill everything in the servers' namespaces, remove them, the bridge and the keys."""
        remove(self._made)
        self._made = []
        if self.keys:
            shutil.rmtree(self.keys, ignore_errors=True)
            self.keys = None


def namespace_pids(ns: str) -> list[int]:
    """Processes in the ``ip netns`` namespace ``ns``."""
    try:
        ino = os.stat(f"/run/netns/{ns}").st_ino
    except OSError:
        return []
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{entry}/ns/net").st_ino == ino:
                out.append(int(entry))
        except OSError:
            pass
    return out


def remove(names: list[str]) -> None:
    """Remove the servers' namespaces (``tbs-*``: every process in them killed first) and the
    bridge among ``names``."""
    for ns in names:
        if ns.startswith(NS_PREFIX):
            for sig in (signal.SIGTERM, signal.SIGKILL):
                pids = namespace_pids(ns)
                for pid in pids:
                    try:
                        os.kill(pid, sig)
                    except OSError:
                        pass
                deadline = time.monotonic() + (10 if sig == signal.SIGTERM else 3)  # a server tears down
                while pids and namespace_pids(ns) and time.monotonic() < deadline:
                    time.sleep(0.05)
            # the underlay veth's end here goes now, not with the namespace's asynchronous teardown
            subprocess.run(["ip", "link", "del", _veth(ns[len(NS_PREFIX):])], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    if BRIDGE in names:
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)


def local_leftovers() -> list[str]:
    """Namespaces of local servers and their bridge that exist now."""
    ns_out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found = [l.split()[0] for l in ns_out.splitlines() if l.split() and l.split()[0].startswith(NS_PREFIX)]
    if subprocess.run(["ip", "link", "show", BRIDGE], capture_output=True).returncode == 0:
        found.append(BRIDGE)
    return found
