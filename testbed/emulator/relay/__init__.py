"""User-space WAN relay: one-way delay, jitter and loss without netem.

The kernel we run on has no ``sch_netem``; rate is shaped with HTB at each
sender's egress (elsewhere) and the per-direction delay / jitter / loss of
every emulated link is applied by ``tbrelay`` (``tbrelay.c`` next to this file,
see its header comment for the design), a small C program that sits in a
*relay namespace* in the middle of every link::

    host A ns: A-ethX <-veth-> P  [relay ns]  Q <-veth-> B-ethY :host B ns

Frames arriving on P (``iface_ab_in``) leave on Q after the A->B delay, frames
arriving on Q (``iface_ba_in``) leave on P after the B->A delay.

Typical use::

    relay = Relay([RelayLink("r-p0", "r-q0", RelayDirection(30), RelayDirection(30), 155)],
                  seed=1, cpu=0)
    relay.start(relay_node.popen)          # Mininet: the relay namespace's node
    ...
    final = relay.stop()
    ok, why = kept_up(final)               # warn "the emulation did not keep up"

Offloads (the biggest CPU lever on a 2-core machine): by default
(``vnet=True``) the relay uses PACKET_VNET_HDR, so GSO super-frames and
partial checksums pass through unchanged and offloads may stay ON.  With
TSO/GSO on at the hosts' veths the relay moves ~6 segments per frame (26
flows x 90 Mbit/s: ~30k frames/s instead of ~250k); alternatively keep the
hosts' TSO off but turn ``gro on`` on the veths (veth NAPI), which coalesces
frames before the relay.  Do NOT turn tso/gso/tx off on the relay-side veths in
vnet mode: the kernel would then segment every super-frame in software.
Loss stays per-MTU-segment (super-frames are split in user space when needed).
With ``vnet=False`` (plain mode) the caller must run
``ethtool -K <host-side veth> tx off tso off gso off`` on A-ethX and B-ethY
and keep GRO off on the relay-side veths (the veth default).  The relay
namespace should have no addresses on P/Q and ip_forward off; disabling IPv6
there (``net.ipv6.conf.all.disable_ipv6=1``) keeps its own ND frames off the
links.
"""

from __future__ import annotations

import json
import math
import os
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from testbed.emulator import jitter
from testbed.emulator.cleanup import relay_dir_prefix
from testbed.errors import ConfigError, RunError
from testbed.wan import DEFAULT_DISTRIBUTION, DISTRIBUTIONS

__all__ = [
    "RelayDirection",
    "RelayLink",
    "Relay",
    "build",
    "kept_up",
    "partition_links",
    "layout",
    "SOURCE",
    "BINARY",
]

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "tbrelay.c"
BUILD_DIR = HERE / "build"
BINARY = BUILD_DIR / "tbrelay"
CFLAGS = ["-O2", "-Wall", "-std=gnu11"]

Popen = Callable[..., "subprocess.Popen[bytes]"]


# --------------------------------------------------------------------- build


def build(force: bool = False) -> Path:
    """Compile tbrelay.c (``gcc -O2``) into ``build/tbrelay`` if the binary is
    missing or older than the source; return the binary's path."""
    if (
        not force
        and BINARY.exists()
        and BINARY.stat().st_mtime >= SOURCE.stat().st_mtime
        and os.access(BINARY, os.X_OK)
    ):
        return BINARY
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError(
            "cannot build the WAN relay: gcc not found (install it, e.g. `apt-get install gcc`)"
        )
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    gitignore = HERE / ".gitignore"
    if not gitignore.exists():
        gitignore.write_text("build/\n")
    # build to a private name, then rename: safe if several processes build at once
    tmp = BUILD_DIR / f".tbrelay.{os.getpid()}.tmp"
    proc = subprocess.run(
        [cc, *CFLAGS, "-o", str(tmp), str(SOURCE), "-lm"],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"building {SOURCE.name} failed:\n{proc.stderr.strip()}")
    os.replace(tmp, BINARY)
    return BINARY


# -------------------------------------------------------------------- config


@dataclass
class RelayDirection:
    """One direction of a link: one-way delay (mean), jitter (standard deviation)
    and its distribution as :mod:`testbed.emulator.jitter` defines them (FIFO
    order is kept), and independent per-packet loss probability."""

    delay_ms: float
    jitter_ms: float = 0.0
    loss: float = 0.0
    distribution: str = DEFAULT_DISTRIBUTION

    def __post_init__(self) -> None:
        for name in ("delay_ms", "jitter_ms", "loss"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise ConfigError(f"{name} must be a finite number, got {v!r}")
        if self.delay_ms < 0:
            raise ConfigError(f"delay_ms must be >= 0, got {self.delay_ms}")
        if self.jitter_ms < 0:
            raise ConfigError(f"jitter_ms must be >= 0, got {self.jitter_ms}")
        if not 0.0 <= self.loss <= 1.0:
            raise ConfigError(f"loss must be a probability in [0, 1], got {self.loss}")
        if self.distribution not in DISTRIBUTIONS:
            raise ConfigError(f"distribution must be one of {', '.join(DISTRIBUTIONS)}, got {self.distribution!r}")

    def netem(self, tables: dict[str, int]) -> str:
        """tbrelay's "DELAY_US JITTER_US LOSS TABLE" of this direction: netem's MU and
        SIGMA (:func:`.jitter.netem_params`) and the number of its table in ``tables``
        (0: netem's uniform), which gains the table if it is new."""
        mu, sigma = jitter.netem_params(self.delay_ms, self.jitter_ms, self.distribution)
        path = jitter.table_path(self.distribution) if self.jitter_ms else None
        k = tables.setdefault(str(path), len(tables) + 1) if path else 0
        return f"{mu * 1000:.3f} {sigma * 1000:.3f} {self.loss:.9f} {k}"


@dataclass
class RelayLink:
    """A relayed link.  ``iface_ab_in`` receives A's frames (they leave on
    ``iface_ba_in`` after ``ab``), ``iface_ba_in`` receives B's frames.
    ``rate_mbps_max`` (the larger of the two directions' rates) sizes the
    relay's buffers: rate * (delay + 3 jitter)."""

    iface_ab_in: str
    iface_ba_in: str
    ab: RelayDirection
    ba: RelayDirection
    rate_mbps_max: float = 1000.0

    def __post_init__(self) -> None:
        for name in ("iface_ab_in", "iface_ba_in"):
            v = getattr(self, name)
            if not isinstance(v, str) or not 0 < len(v) < 16 or any(c.isspace() for c in v):
                raise ConfigError(f"{name} must be an interface name (1-15 chars), got {v!r}")
        if self.iface_ab_in == self.iface_ba_in:
            raise ConfigError(f"a link needs two different interfaces, got {self.iface_ab_in!r} twice")
        if not self.rate_mbps_max > 0:
            raise ConfigError(f"rate_mbps_max must be > 0, got {self.rate_mbps_max}")


def partition_links(links: Sequence[RelayLink], n: int) -> list[list[int]]:
    """Split link indices into ``n`` groups of about equal total rate (one
    relay process per core).  Returns lists of indices into ``links``."""
    groups: list[list[int]] = [[] for _ in range(max(1, n))]
    load = [0.0] * len(groups)
    order = sorted(range(len(links)), key=lambda i: -links[i].rate_mbps_max)
    for i in order:
        g = load.index(min(load))
        groups[g].append(i)
        load[g] += links[i].rate_mbps_max
    return [sorted(g) for g in groups if g]


RTPRIO = 10  # SCHED_FIFO priority of every relay process


def layout(links: Sequence[RelayLink], cpus: int, procs: int = 0, cores: Sequence[int] = ()) -> dict[str, Any]:
    """How many relay processes, on which cores, at which priority (recorded in results.json).

    Decided from measurement (docs/measurements/emulator-log.md): a relay's sends run the
    receiving hosts' network stack in its own context, so the relays must spread that work
    over every core.  With one process for NetStorm's 13 links (2059 Mbit/s) on 2 cores one
    ``sendmmsg`` took up to 35 ms and p99 lateness reached 22 ms; with one process per core,
    pinned, the longest call was 0.3 ms and p99 0.3 ms, and GScale's 19 links (7660 Mbit/s)
    kept up too.  SCHED_FIFO: its run-queue wait under full load averaged 2-4 us per
    timeslice (0.2 s in a 29 s window), while a CFS relay waits behind the TCP endpoints.
    ``procs`` > 0 overrides the count (emulator.relay_procs).  ``cores``: the cores this
    network's relays may use (default: all ``cpus``): namespace servers sharing one machine
    split its cores, or each server's relays pinned one per core would queue behind the
    others' on the same core (SCHED_FIFO does not preempt its equal)."""
    use = list(cores) or list(range(max(1, cpus)))
    n = procs if procs > 0 else max(1, min(len(use), len(links)))
    groups = partition_links(links, n)
    rule = "requested" if procs > 0 else f"one per core{' of its share' if cores else ''} (at most one per link)"
    return {"processes": len(groups), "cpus": [use[k % len(use)] for k in range(len(groups))],
            "rtprio": RTPRIO, "links": [len(g) for g in groups],
            "rate_mbps": [sum(links[i].rate_mbps_max for i in g) for g in groups],
            "groups": groups, "rule": rule}


# ------------------------------------------------------------------- verdict


def kept_up(
    stats: dict[str, Any], max_p99_late_ms: float = 1.0, max_ring_drops: int = 0
) -> tuple[bool, str]:
    """Did the emulation keep up?  False (with a reason naming the worst
    direction) if a direction dropped frames because its buffer was full
    (overload), or its 99th percentile lateness is ``>= max_p99_late_ms``."""
    problems = []
    for d in stats.get("dirs", []):
        name = f"link {d['link']} {d['dir']} ({d['in']}->{d['out']})"
        drops = d["drop_ring"] + d["drop_queue"]
        if drops > max_ring_drops:
            problems.append(f"{name}: {drops} frames dropped because the relay buffer was full")
        if d["frames_out"] and d["late_p99_us"] >= max_p99_late_ms * 1000:
            problems.append(
                f"{name}: p99 lateness {d['late_p99_us'] / 1000:.2f} ms >= {max_p99_late_ms} ms"
                f" (max {d['late_max_us'] / 1000:.2f} ms)"
            )
    if problems:
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        return False, "; ".join(problems[:3]) + more
    return True, "ok"


# --------------------------------------------------------------------- relay


class Relay:
    """One ``tbrelay`` process serving ``links`` (all its interfaces must be in
    the namespace ``start``'s ``popen`` runs in).

    ``seed`` makes loss and jitter reproducible; ``cpu`` pins the process;
    ``rtprio`` runs it SCHED_FIFO (strongly recommended when the TCP endpoints
    share the cores: it is what keeps lateness in the tens of microseconds;
    0 disables); ``vnet`` relays GSO super-frames (see module doc);
    ``reorder`` lets jitter reorder frames like netem (default: FIFO);
    ``max_ring_mb`` caps each direction's frame buffer (sized automatically
    from rate * (delay + 3 jitter) + 100 ms of slack); ``spin_us`` > 0 spins
    up to that long before a due time instead of sleeping (off: under load it
    costs the keep-up more than the ~10 us it saves, see tbrelay.c); ``extra`` passes raw
    config keys of tbrelay.c (e.g. ``{"rx_poll_us": 500}``).  Serve many links
    with one process per core (see :func:`partition_links`): a single relay
    also runs the receivers' network stack for all its links and its lateness
    grows when one core carries everything.
    """

    def __init__(
        self,
        links: Sequence[RelayLink],
        seed: int = 0,
        cpu: int | None = None,
        *,
        vnet: bool = True,
        reorder: bool = False,
        rtprio: int = RTPRIO,
        batch: int = 64,
        spin_us: int = 0,
        max_ring_mb: int = 256,
        tx_kb: int = 0,
        extra: dict[str, int] | None = None,
    ) -> None:
        if not links:
            raise ConfigError("a relay needs at least one link")
        names = [n for l in links for n in (l.iface_ab_in, l.iface_ba_in)]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ConfigError(f"interface(s) used by more than one link: {sorted(dup)}")
        self.links = list(links)
        self.seed = int(seed)
        self.cpu = cpu
        self.options = {
            "vnet": int(bool(vnet)),
            "reorder": int(bool(reorder)),
            "rtprio": int(rtprio),
            "batch": int(batch),
            "spin_us": int(spin_us),
            "max_ring_mb": int(max_ring_mb),
            "tx_kb": int(tx_kb),
            **(extra or {}),
        }
        self.proc: subprocess.Popen[bytes] | None = None
        self._events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._reader: threading.Thread | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._stderr_path: Path | None = None
        self._lock = threading.Lock()
        self.last_stats: dict[str, Any] | None = None
        self._tables: dict[str, int] = {}  # jitter table file -> its number in the running relay

    # -- config file
    def config_text(self) -> str:
        """The line-format config the C program reads (see tbrelay.c)."""
        out = ["# tbrelay config (written by testbed.emulator.relay)", f"seed {self.seed}"]
        if self.cpu is not None:
            out.append(f"cpu {int(self.cpu)}")
        out += [f"{k} {v}" for k, v in self.options.items()]
        tables: dict[str, int] = {}
        lines = [f"link {l.iface_ab_in} {l.iface_ba_in} {l.ab.netem(tables)} {l.ba.netem(tables)} "
                 f"{l.rate_mbps_max:.3f}" for l in self.links]
        out += [f"table {k} {path}" for path, k in tables.items()] + lines
        self._tables = tables
        return "\n".join(out) + "\n"

    # -- lifecycle
    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self, popen: Popen, timeout: float = 10.0) -> "Relay":
        """Start the relay via ``popen(argv, **kw)`` (which must run argv in the
        relay namespace) and wait until its sockets are set up."""
        if self.proc is not None:
            raise RunError("relay already started")
        binary = build()
        self._dir = tempfile.TemporaryDirectory(prefix=relay_dir_prefix())  # `clean` finds it if we are killed
        cfg = Path(self._dir.name) / "relay.conf"
        cfg.write_text(self.config_text())
        self._stderr_path = Path(self._dir.name) / "relay.err"
        with open(self._stderr_path, "wb") as err:
            self.proc = popen(
                [str(binary), str(cfg)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
            )
        self._reader = threading.Thread(target=self._read_stdout, name="tbrelay-stdout", daemon=True)
        self._reader.start()
        ev = self._wait_event({"ready"}, timeout)
        if ev is None:
            self._kill()
            raise RunError(f"WAN relay did not start: {self._stderr_text() or 'no message'}")
        return self

    def _read_stdout(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                self._events.put(json.loads(raw))
            except ValueError:
                continue
        self._events.put({"event": "eof"})

    def _wait_event(self, kinds: set[str], timeout: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                ev = self._events.get(timeout=left)
            except queue.Empty:
                return None
            if ev.get("event") == "eof":
                self._events.put(ev)  # keep it for later callers
                return None
            if ev.get("event") in kinds:
                if ev["event"] != "ready":
                    self.last_stats = ev
                return ev

    def _drain(self) -> None:
        """Forget stale events (e.g. an answer that came after a timeout)."""
        while True:
            try:
                ev = self._events.get_nowait()
            except queue.Empty:
                return
            if ev.get("event") == "eof":
                self._events.put(ev)
                return

    def _stderr_text(self) -> str:
        try:
            return self._stderr_path.read_text(errors="replace").strip() if self._stderr_path else ""
        except OSError:
            return ""

    def stderr(self) -> str:
        """What the relay wrote on stderr so far (warnings)."""
        return self._stderr_text()

    def stats(self, timeout: float = 10.0) -> dict[str, Any]:
        """Current counters (SIGUSR1 -> one JSON line), see tbrelay.c."""
        with self._lock:
            if not self.running:
                raise RunError(f"WAN relay is not running: {self._stderr_text() or 'exited'}")
            assert self.proc is not None
            self._drain()
            self.proc.send_signal(signal.SIGUSR1)
            ev = self._wait_event({"stats"}, timeout)
            if ev is None:
                raise RunError(f"WAN relay did not answer a stats request: {self._stderr_text()}")
            return ev

    def update(
        self,
        link_index: int,
        direction: str,
        delay_ms: float | None = None,
        jitter_ms: float | None = None,
        loss: float | None = None,
    ) -> None:
        """Change one direction's parameters while running (applies to frames
        arriving from now on; FIFO order is kept, so a shorter delay takes
        effect once older frames have left).  Its distribution stays."""
        if direction not in ("ab", "ba"):
            raise ConfigError(f"direction must be 'ab' or 'ba', got {direction!r}")
        link = self.links[link_index]
        cur: RelayDirection = getattr(link, direction)
        new = RelayDirection(
            cur.delay_ms if delay_ms is None else delay_ms,
            cur.jitter_ms if jitter_ms is None else jitter_ms,
            cur.loss if loss is None else loss,
            cur.distribution,
        )
        setattr(link, direction, new)
        if self.running:
            assert self.proc is not None and self.proc.stdin is not None
            tables = dict(self._tables)
            line = f"set {link_index} {direction} {new.netem(tables)}\n"
            if tables != self._tables:  # jitter on a direction that had none: its table is not loaded
                raise RunError(f"relay link {link_index} {direction}: jitter where the relay started without "
                               f"one needs its {new.distribution} table: start the relay with jitter there")
            with self._lock:
                self.proc.stdin.write(line.encode())
                self.proc.stdin.flush()

    def reset_window(self) -> None:
        """Start a new window for the keep-up statistics (lateness histogram and maximum,
        maximum backlog, overload drops); totals (frames, bytes, loss) keep counting."""
        if self.running:
            assert self.proc is not None and self.proc.stdin is not None
            with self._lock:
                self.proc.stdin.write(b"reset\n")
                self.proc.stdin.flush()

    def stop(self, timeout: float = 5.0) -> dict[str, Any]:
        """SIGTERM the relay and return its final counters."""
        if self.proc is None:
            raise RunError("relay was not started")
        final = None
        with self._lock:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                final = self._wait_event({"exit"}, timeout)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._kill()
        self._cleanup()
        if final is None:
            if self.last_stats is not None:
                return self.last_stats
            raise RunError(f"WAN relay exited without final stats: {self._stderr_text()}")
        return final

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def _cleanup(self) -> None:
        if self.proc is not None and self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def close(self) -> None:
        """Stop if running, never raises (for finally blocks)."""
        try:
            if self.running:
                self.stop()
        except Exception:
            self._kill()
        finally:
            self._kill()
            self._cleanup()

    def __enter__(self) -> "Relay":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
