"""SSH to real hosts with paramiko, for ``testbed deploy``: no ``ssh`` binary needed.

One :class:`Connection` per host serves a whole experiment: commands, long-running
processes and their output are channels on it, files go over SFTP.  What a user's
OpenSSH set-up says applies: ``~/.ssh/config`` (Host, HostName, User, Port, IdentityFile,
ProxyJump, UserKnownHostsFile; read with paramiko's ``SSHConfig``), keys from ssh-agent
and the usual ``~/.ssh/id_*`` files.  Host keys are checked against known_hosts (and
``/etc/ssh/ssh_known_hosts``): an unknown key is refused unless ``accept_new`` (then it is
added to known_hosts, as OpenSSH's ``StrictHostKeyChecking=accept-new`` does), a changed
key always.  Connecting, authenticating and every command have a timeout; every failure
is a :class:`SshError` naming the host and the reason (DNS, refused, unreachable,
timeout, host key, authentication).
"""

from __future__ import annotations

import getpass
import hashlib
import logging
import os
import shlex
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TypeVar

import paramiko

from testbed.errors import RunError

logging.getLogger("paramiko").addHandler(logging.NullHandler())  # failures are reported as SshError

MAX_PARALLEL = 16  # hosts handled at once (connecting, copying, clock exchanges)
SYSTEM_KNOWN_HOSTS = "/etc/ssh/ssh_known_hosts"
KEEPALIVE_S = 15  # an idle connection (a server with nothing to do for minutes of a link check) still
# talks: firewalls and NAT drop silent TCP, and sshd's ClientAlive counts our replies only
_known_hosts_lock = threading.Lock()  # parallel first contacts append to one file

T, R = TypeVar("T"), TypeVar("R")


class SshError(RunError):
    """A host could not be reached, authenticated or commanded; the message names it."""


@dataclass(frozen=True)
class SshOptions:
    """How to reach every host (the hosts file's SSH keys)."""

    config: paramiko.SSHConfig = field(default_factory=paramiko.SSHConfig)
    known_hosts: str | None = None  # None: the config's UserKnownHostsFile, else ~/.ssh/known_hosts
    accept_new: bool = False  # add unknown host keys to known_hosts (first contact)
    identity_files: tuple[str, ...] = ()  # tried before the config's IdentityFile and the usual keys
    connect_timeout_s: float = 10.0  # TCP connect, SSH banner and authentication, each
    command_timeout_s: float = 60.0


def parse_destination(dest: str) -> tuple[str | None, str, int | None]:
    """``[user@]host[:port]`` (``[v6addr]:port``) -> (user, host, port); ValueError if malformed."""
    user, _, hostport = dest.rpartition("@")
    if hostport.startswith("["):
        host, _, rest = hostport[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else rest or None
    elif hostport.count(":") == 1:
        host, port = hostport.split(":")
    else:
        host, port = hostport, None
    if not host or (port is not None and (not port.isdigit() or not 0 < int(port) < 65536)):
        raise ValueError(f"expected [user@]host[:port], got {dest!r}")
    return user or None, host, int(port) if port else None


def resolve(dest: str, config: paramiko.SSHConfig) -> dict:
    """``dest`` after ``~/.ssh/config``: {user, hostname, port, identityfile, proxyjump, ...}."""
    user, host, port = parse_destination(dest)
    cfg = dict(config.lookup(host))
    cfg["user"] = user or cfg.get("user") or getpass.getuser()
    cfg["port"] = port or int(cfg.get("port", 22))
    cfg.setdefault("hostname", host)
    return cfg


def for_each(items: dict[str, T], fn: Callable[[str, T], R], max_parallel: int = MAX_PARALLEL) -> dict[str, R]:
    """``fn(name, item)`` for every item, at most ``max_parallel`` at once; a RunError naming
    every failed item (all of them, not just the first) if any failed."""
    out: dict[str, R] = {}
    errors = []
    with ThreadPoolExecutor(max_workers=max(1, min(max_parallel, len(items)))) as pool:
        futures = {name: pool.submit(fn, name, item) for name, item in items.items()}
        for name, f in futures.items():
            try:
                out[name] = f.result()
            except RunError as e:
                errors.append(str(e))
            except Exception as e:  # a bug or an unforeseen library error: still name the host
                errors.append(f"{name}: {type(e).__name__}: {e}")
    if errors:
        raise RunError("; ".join(errors))
    return out


def _fingerprint(key: paramiko.PKey) -> str:
    return f"{key.get_name()} {key.fingerprint}"


class _HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """An unknown host key: refused, saying how to accept it; or, with ``accept_new``,
    appended to ``known_hosts`` (first contact)."""

    def __init__(self, conn: "Connection", known_hosts: str, accept_new: bool):
        self.conn, self.known_hosts, self.accept_new = conn, known_hosts, accept_new

    def missing_host_key(self, client, hostname, key):
        if not self.accept_new:
            raise self.conn.error(
                f"host key unknown: {hostname} offers {_fingerprint(key)}, which {self.known_hosts} does not "
                f"list; refused. If that is the host's key, accept it on first contact with "
                f"'accept_new_host_keys: true' in the hosts file (it is then added to {self.known_hosts}), "
                f"or add it to {self.known_hosts} yourself")
        path, line = Path(self.known_hosts), f"{hostname} {key.get_name()} {key.get_base64()}\n"
        with _known_hosts_lock:  # several datacenters may share a host
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            if line not in (path.read_text().splitlines(keepends=True) if path.exists() else []):
                with open(path, "a") as f:
                    f.write(line)
        client.get_host_keys().add(hostname, key.get_name(), key)


class RemoteProcess:
    """A command running in its own channel; its output (stdout and stderr) is appended
    to ``log`` as it comes."""

    def __init__(self, chan: paramiko.Channel, log: Path):
        self.chan, self.log = chan, log
        self._thread = threading.Thread(target=self._copy, daemon=True, name=f"log-{log.name}")
        self._thread.start()

    def _copy(self) -> None:
        with open(self.log, "ab") as f:
            try:
                while data := self.chan.recv(65536):
                    f.write(data)
                    f.flush()
            except (OSError, EOFError, paramiko.SSHException):
                pass  # the channel closed under us: poll() reports it

    def poll(self) -> int | None:
        """The exit status once the command ended (-1 if the connection dropped), or None."""
        if self.chan.exit_status_ready():
            return self.chan.recv_exit_status()
        if self.chan.closed or not self.chan.get_transport().is_active():
            return -1
        return None

    def close(self) -> None:
        self.chan.close()
        self._thread.join(timeout=2.0)


class Connection:
    """One SSH connection to host ``name`` at destination ``dest`` (``[user@]host[:port]``
    or a ``~/.ssh/config`` alias); :meth:`connect` opens it (and any ProxyJump hops)."""

    def __init__(self, name: str, dest: str, options: SshOptions):
        self.name, self.dest, self.options = name, dest, options
        self._clients: list[paramiko.SSHClient] = []  # ProxyJump hops first, this host last
        self._sftp: paramiko.SFTPClient | None = None
        self._lock = threading.Lock()

    def error(self, why: str) -> SshError:
        return SshError(f"{self.name} ({self.dest}): {why}")

    # -- connecting -------------------------------------------------------------------
    def connect(self) -> "Connection":
        self._open(self.dest, None)
        for client in self._clients:
            client.get_transport().set_keepalive(KEEPALIVE_S)
        return self

    def _open(self, dest: str, jumps: list[str] | None) -> paramiko.SSHClient:
        """Connect to ``dest``; through ``jumps`` (None: its ProxyJump setting), the last hop
        reached through the ones before it, as OpenSSH's ``ProxyJump a,b``."""
        o = self.options
        try:
            cfg = resolve(dest, o.config)
        except ValueError as e:
            raise self.error(str(e)) from None
        host, port, user = cfg["hostname"], cfg["port"], cfg["user"]
        where = f"{user}@{host}:{port}" + (f" (jump host {dest})" if dest != self.dest else "")
        if jumps is None:
            jumps = [j.strip() for j in cfg.get("proxyjump", "none").split(",")]
            jumps = [] if jumps == ["none"] else jumps
        sock = self._through(jumps, host, port) if jumps else self._tcp(host, port, where)
        client = paramiko.SSHClient()
        self._clients.append(client)
        known = os.path.expanduser(o.known_hosts or cfg.get("userknownhostsfile", "~/.ssh/known_hosts").split()[0])
        if os.path.exists(SYSTEM_KNOWN_HOSTS):
            client.load_system_host_keys(SYSTEM_KNOWN_HOSTS)
        if os.path.exists(known):
            client.load_host_keys(known)
        client.set_missing_host_key_policy(_HostKeyPolicy(self, known, o.accept_new))
        keys = [os.path.expanduser(k) for k in (*o.identity_files, *cfg.get("identityfile", ()))]
        self._login(client, sock, host, port, user, where, known, keys)
        return client

    def _through(self, jumps: list[str], host: str, port: int) -> paramiko.Channel:
        """A channel to ``host:port`` from the last of ``jumps`` (opened through the ones before it)."""
        hop = self._open(jumps[-1], jumps[:-1] or None)
        try:
            return hop.get_transport().open_channel("direct-tcpip", (host, port), ("127.0.0.1", 0),
                                                    timeout=self.options.connect_timeout_s)
        except (paramiko.SSHException, OSError) as e:
            raise self.error(f"jump host {jumps[-1]} cannot reach {host}:{port}: {e}") from None

    def _login(self, client: paramiko.SSHClient, sock, host: str, port: int, user: str, where: str, known: str,
               keys: list[str]) -> None:
        """The SSH handshake, host key check and authentication over ``sock``; each way it can
        fail said in one SshError naming the host."""
        t = self.options.connect_timeout_s
        start = time.monotonic()
        try:
            client.connect(host, port, user, key_filename=[k for k in keys if os.path.exists(k)] or None,
                           timeout=t, banner_timeout=t, auth_timeout=t, channel_timeout=t, sock=sock,
                           allow_agent=True, look_for_keys=True)
        except SshError:
            raise
        except paramiko.BadHostKeyException as e:
            raise self.error(
                f"host key CHANGED: {e.hostname} offers {_fingerprint(e.key)} but {known} lists "
                f"{_fingerprint(e.expected_key)}; refused (a reinstalled host, or someone in between). "
                f"If the change is expected, delete the old line from {known} "
                f"(ssh-keygen -R {e.hostname} -f {known})") from None
        except paramiko.AuthenticationException as e:
            if "timeout" in str(e).lower():
                raise self.error(f"timeout: authentication as {user} at {where} took over {t:g} s") from None
            tried = ", ".join(k for k in keys if os.path.exists(k)) or "none given"
            raise self.error(f"authentication failed as {user} at {where} (ssh-agent, key files: {tried}, "
                             f"~/.ssh/id_*): {e}") from None
        except paramiko.SSHException as e:  # paramiko says little more than "No existing session"
            if time.monotonic() - start >= 0.95 * t:
                raise self.error(f"timeout: {where} accepted the connection but the SSH handshake did not "
                                 f"finish within {t:g} s") from None
            raise self.error(f"SSH handshake with {where} failed: {e}") from None
        except (OSError, EOFError) as e:
            raise self.error(f"connection to {where} lost: {e or type(e).__name__}") from None

    def _tcp(self, host: str, port: int, where: str) -> socket.socket:
        """A TCP connection to ``host``: name lookup and connect each within the connect timeout."""
        t = self.options.connect_timeout_s
        found: list = []

        def lookup() -> None:  # getaddrinfo has no timeout of its own
            try:
                found.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
            except OSError as e:
                found.append(e)

        th = threading.Thread(target=lookup, daemon=True, name=f"dns-{host}")
        th.start()
        th.join(t)
        if not found:
            raise self.error(f"DNS: no answer for {host!r} within {t:g} s")
        if isinstance(found[0], OSError):
            raise self.error(f"DNS: cannot resolve {host!r} ({getattr(found[0], 'strerror', None) or found[0]})")
        err: OSError | None = None
        for family, kind, proto, _, addr in found[0]:
            sock = socket.socket(family, kind, proto)
            sock.settimeout(t)
            try:
                sock.connect(addr)
                return sock
            except OSError as e:
                sock.close()
                err = e
        if isinstance(err, (socket.timeout, TimeoutError)):
            raise self.error(f"timeout: no connection to {where} within {t:g} s")
        if isinstance(err, ConnectionRefusedError):
            raise self.error(f"connection refused at {where} (no SSH server on that port?)")
        raise self.error(f"unreachable: {where}: {err.strerror or err}")

    def close(self) -> None:
        with self._lock:
            if self._sftp:
                self._sftp.close()
                self._sftp = None
        for c in reversed(self._clients):
            c.close()
        self._clients.clear()

    # -- channels ---------------------------------------------------------------------
    def channel(self, command: str, *, combine_stderr: bool = False) -> paramiko.Channel:
        """A new session channel running ``command`` (the remote user's shell runs it)."""
        try:
            transport = self._clients[-1].get_transport()
            chan = transport.open_session(timeout=self.options.connect_timeout_s)
            chan.set_combine_stderr(combine_stderr)
            chan.exec_command(command)
            return chan
        except (IndexError, AttributeError):
            raise self.error("not connected") from None
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise self.error(f"the SSH connection failed: {e or type(e).__name__}") from None

    def run(self, command: str, what: str, *, stdin: bytes = b"", timeout: float | None = None) -> str:
        """``command``'s stdout; SshError naming the host and ``what`` if it fails or takes
        over ``timeout`` s (default: the options' command timeout)."""
        t = timeout or self.options.command_timeout_s
        deadline = time.monotonic() + t
        chan = self.channel(command)
        try:
            chan.settimeout(t)
            if stdin:
                chan.sendall(stdin)
            chan.shutdown_write()
            out = bytearray()
            while data := chan.recv(65536):
                out += data
                if time.monotonic() > deadline:
                    raise socket.timeout
            if not chan.status_event.wait(max(0.0, deadline - time.monotonic())):
                raise socket.timeout
            err = bytearray()
            while chan.recv_stderr_ready():
                err += chan.recv_stderr(65536)
            status = chan.recv_exit_status()
        except socket.timeout:
            raise self.error(f"{what}: no answer within {t:g} s") from None
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise self.error(f"{what}: the SSH connection failed: {e or type(e).__name__}") from None
        finally:
            chan.close()
        if status != 0:
            lines = err.decode(errors="replace").strip().splitlines()
            raise self.error(f"{what} failed (exit {status}): {lines[-1] if lines else 'no message'}")
        return out.decode(errors="replace")

    def start(self, command: str, log: Path) -> RemoteProcess:
        """``command`` running in its own channel, its output appended to ``log``."""
        return RemoteProcess(self.channel(command, combine_stderr=True), log)

    # -- files ------------------------------------------------------------------------
    def sftp(self) -> paramiko.SFTPClient:
        with self._lock:
            if self._sftp is None:
                try:
                    self._sftp = self._clients[-1].open_sftp()
                except (paramiko.SSHException, OSError, EOFError) as e:
                    raise self.error(f"cannot open SFTP ({e}): does the SSH server have the sftp subsystem?") from None
            return self._sftp

    def put(self, folder: str, files: dict[str, bytes], mode: int = 0o644) -> None:
        """Write ``files`` (relative path -> content) under ``folder`` with SFTP, each with
        ``mode`` from the start and renamed into place whole."""
        sftp = self.sftp()
        try:
            for rel, content in files.items():
                path = f"{folder}/{rel}"
                with sftp.open(f"{path}.part", "wb") as f:
                    f.chmod(mode)
                    f.set_pipelined(True)
                    f.write(content)
                sftp.posix_rename(f"{path}.part", path)
        except (OSError, paramiko.SSHException, EOFError) as e:
            raise self.error(f"copying {rel} to {folder}: {e}") from None

    def sync(self, folder: str, files: dict[str, bytes]) -> list[str]:
        """Make ``folder`` hold ``files``: one command checks the SHA-256 of what is there,
        SFTP sends only what differs (nothing for an unchanged tree); returns what was sent."""
        names = sorted(files)
        dirs = sorted({f"{folder}/{os.path.dirname(n)}".rstrip("/") for n in names})
        q = " ".join(shlex.quote(n) for n in names)
        out = self.run(f"mkdir -p {' '.join(map(shlex.quote, dirs))} && cd {shlex.quote(folder)} && "
                       f"{{ sha256sum -- {q} 2>/dev/null; true; }}", "checking the code on the host")
        there = {}
        for line in out.splitlines():
            digest, _, name = line.partition(" ")
            there[name.lstrip(" *")] = digest
        changed = [n for n in names if there.get(n) != hashlib.sha256(files[n]).hexdigest()]
        self.put(folder, {n: files[n] for n in changed})
        return changed


class RemotePopen:
    """A command on a host as a :class:`subprocess.Popen` look-alike, for code written for
    local processes (the emulator's link checks, ``exec``): ``stdin``/``stdout``/``stderr``
    are real pipe files here when asked for with ``subprocess.PIPE`` (so ``select`` works),
    ``subprocess.DEVNULL`` is redirected on the host, a file object receives the output;
    ``poll``, ``wait``, ``communicate``, ``kill``, ``returncode``.  The command runs in its
    own process group (the session sshd makes), which :meth:`kill` signals."""

    def __init__(self, conn: "Connection", command: str, *, cwd: str | None = None, stdin=None, stdout=None,
                 stderr=None, text: bool = False, universal_newlines: bool = False):
        import subprocess

        self.conn, self.args, self.returncode, self.pid = conn, command, None, None
        text = text or universal_newlines
        redirect = ("" if stdout not in (None, subprocess.DEVNULL) else " >/dev/null") + (
            " 2>&1" if stderr == subprocess.STDOUT else "" if stderr not in (None, subprocess.DEVNULL) else " 2>/dev/null")
        cd = f"cd {shlex.quote(cwd)} && " if cwd else ""
        self.chan = conn.channel(f"{cd}echo $$ && exec {command}{redirect}")
        self._threads: list[threading.Thread] = []
        self.stdin = self.stdout = self.stderr = None
        self._pid_ready = threading.Event()
        if stdin == subprocess.PIPE:
            r, w = os.pipe()
            self.stdin = os.fdopen(w, "w" if text else "wb")
            self._thread(self._feed, r)
        else:
            self.chan.shutdown_write()
        self.stdout = self._sink(stdout, self.chan.recv, text, first_line=True)
        self.stderr = self._sink(stderr if stderr != subprocess.STDOUT else subprocess.DEVNULL,
                                 self.chan.recv_stderr, text)
        if not self._pid_ready.wait(conn.options.command_timeout_s):
            raise conn.error(f"starting {command[:60]!r}: no answer")

    def _thread(self, fn, *args) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True, name=f"rp-{self.conn.name}")
        t.start()
        self._threads.append(t)

    def _feed(self, fd: int) -> None:
        try:
            while data := os.read(fd, 65536):
                self.chan.sendall(data)
            self.chan.shutdown_write()
        except (OSError, EOFError, paramiko.SSHException):
            pass
        finally:
            os.close(fd)

    def _sink(self, where, recv, text: bool, first_line: bool = False):
        """Copy ``recv``'s bytes to ``where``: a new pipe (returned as a file) for PIPE, a file
        object's descriptor, or nowhere.  The first line of stdout is the remote pid."""
        import subprocess

        out, fd = None, None
        if where == subprocess.PIPE:
            r, fd = os.pipe()
            out = os.fdopen(r, "r" if text else "rb")
        elif where not in (None, subprocess.DEVNULL):
            fd = os.dup(where.fileno())

        def copy() -> None:
            head = b""
            try:
                while data := recv(65536):
                    if first_line and self.pid is None:
                        head += data
                        if b"\n" not in head:
                            continue
                        line, _, data = head.partition(b"\n")
                        self.pid = int(line)
                        self._pid_ready.set()
                    if fd is not None and data:
                        os.write(fd, data)
            except (OSError, EOFError, ValueError, paramiko.SSHException):
                pass
            finally:
                self._pid_ready.set()
                if fd is not None:
                    os.close(fd)
        self._thread(copy)
        return out

    def poll(self) -> int | None:
        if self.returncode is None:
            if self.chan.exit_status_ready():
                self.returncode = self.chan.recv_exit_status()
            elif self.chan.closed or not self.chan.get_transport().is_active():
                self.returncode = -1  # the connection is gone
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.chan.status_event.wait(0.1)
        for t in self._threads:
            t.join(timeout=2.0)
        return self.returncode

    def communicate(self, input=None, timeout: float | None = None):
        import subprocess

        if input is not None and self.stdin:
            self.stdin.write(input)
        if self.stdin and not self.stdin.closed:
            try:
                self.stdin.close()
            except OSError:
                pass
        got: dict[str, object] = {}

        def read(name: str, f) -> None:
            got[name] = f.read()
            f.close()  # as subprocess's communicate does: a process per direction, hundreds in a link check
        readers = [threading.Thread(target=read, args=(n, f), daemon=True)
                   for n, f in (("out", self.stdout), ("err", self.stderr)) if f is not None and not f.closed]
        for r in readers:
            r.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for r in readers:
            r.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if r.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.1, deadline - time.monotonic()))
        return got.get("out"), got.get("err")

    def send_signal(self, sig: int) -> None:
        if self.poll() is not None or self.pid is None:
            return
        try:
            self.conn.run(f"kill -{int(sig)} -- -{self.pid} {self.pid} 2>/dev/null; true", "signalling a process",
                          timeout=15)
        except SshError:
            pass

    def terminate(self) -> None:
        self.send_signal(15)

    def kill(self) -> None:
        self.send_signal(9)

    def close(self) -> None:
        """The channel and every pipe file this side holds, the copying threads' ends too:
        closing the channel and our ends ends those threads, which close theirs."""
        self.chan.close()
        for f in (self.stdin, self.stdout, self.stderr):
            if f is not None and not f.closed:
                try:
                    f.close()
                except OSError:
                    pass
        for t in self._threads:
            t.join(timeout=2.0)
