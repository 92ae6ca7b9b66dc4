"""results.json: atomic writing, environment facts, summaries."""

from __future__ import annotations

import bisect
import gzip
import itertools
import json
import os
import platform
import re
import select
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def write_json_atomic(path: Path, data) -> None:
    """Write ``data`` so that readers only ever see the old file or the complete new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, default=_jsonable)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _jsonable(o):
    if hasattr(o, "tolist"):
        return o.tolist()
    if hasattr(o, "to_dict"):
        return o.to_dict()
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


def new_run_dir(base: str | Path, name: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    d = Path(base) / f"{stamp}-{name}"
    k = 1
    while d.exists():
        d = Path(base) / f"{stamp}-{name}-{k}"
        k += 1
    d.mkdir(parents=True)
    return d


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The processor's name (machines of one kind may differ: compare like with like)."""
    try:
        with open(cpuinfo) as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


PREEMPT_MODES = ("none", "voluntary", "full", "lazy")


def preemption(control: str = "/sys/kernel/debug/sched/preempt", cmdline: str = "/proc/cmdline",
               config: str = "/proc/config.gz") -> str | None:
    """The kernel's preemption model: the active one where debugfs shows it ("none voluntary
    (full) lazy"), else ``preempt=`` on the command line (a PREEMPT_DYNAMIC kernel), else the
    build's CONFIG_PREEMPT_*; None if unknown.  Under ``none``/``voluntary`` the SCHED_FIFO
    relay cannot preempt a task inside a system call or a kernel thread: it waits for it."""
    try:
        with open(control) as f:
            if m := re.search(r"\((\w+)\)", f.read()):
                return m.group(1)
    except OSError:
        pass
    try:
        with gzip.open(config, "rt") as f:
            built = {line.split("=")[0] for line in f if line.startswith("CONFIG_PREEMPT") and line.strip().endswith("=y")}
    except OSError:
        built = set()
    try:
        with open(cmdline) as f:
            asked = re.search(r"(?:^|\s)preempt=(\w+)", f.read())
    except OSError:
        asked = None
    if asked and asked.group(1) in PREEMPT_MODES and (not built or "CONFIG_PREEMPT_DYNAMIC" in built):
        return asked.group(1)
    for option, mode in (("CONFIG_PREEMPT_RT", "rt"), ("CONFIG_PREEMPT_LAZY", "lazy"), ("CONFIG_PREEMPT", "full"),
                         ("CONFIG_PREEMPT_VOLUNTARY", "voluntary"), ("CONFIG_PREEMPT_NONE", "none")):
        if option in built:
            return mode
    return None


def environment(caps=None) -> dict:
    pkgs = {}
    for name in ("numpy", "networkx", "scipy", "mininet", "PyYAML", "matplotlib", "paramiko"):
        try:
            pkgs[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pkgs[name] = None
    return {
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "preemption": preemption(),
        "packages": pkgs,
        "git_commit": git_commit(),
        "capabilities": caps.to_dict() if caps is not None else None,
    }


def stats(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "min": None, "max": None, "n": 0}
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
            "stdev": statistics.stdev(values) if len(values) > 1 else 0.0, "n": len(values)}


TCP_FIELDS = ("retrans_segs", "rtos", "rto_s")  # what TCP's loss recovery cost (agents.executor.tcp_losses)


def tcp_total(records) -> dict:
    """``[segments retransmitted, timeouts, s in their recovery]`` records (an iteration's
    ``tcp`` values) summed, keyed by :data:`TCP_FIELDS`."""
    return dict(zip(TCP_FIELDS, (sum(column) for column in zip((0, 0, 0.0), *records))))


# Above this share of CPU time taken by the hypervisor (steal, on a VM), timings are not
# trustworthy: the relay, TCP and agents all stall while the host runs someone else.
STEAL_MAX = 0.03


CPU_BUSY = 0.95  # whole-machine utilisation above which the emulator may not keep up
CPU_SAMPLE_S = 0.25  # CpuMeter's sampling period
# Above this share of the machine's CPU while the iterations communicate, the agents (which
# share the machine's cores) may be bound by the host, not the WAN: a note, not kept_up.
HOST_BUSY = 0.9
PAUSE_TICK_S = 0.01  # PauseMeter's sleep
PAUSE_NOTE_S = 0.1  # a wake-up this much late is a pause, recorded
PAUSE_MAX_S = 0.5  # a pause this long: the run did not keep up


def emulation_health(method: str, relays: int, relay: list[dict], cpu_util: float, steal: float,
                      max_late_ms: float, pauses: list | None = None) -> dict:
    """Did the emulator keep up during a run?  ``relays`` delay-relay processes ran (none where
    no link needed one); ``relay`` their statistics; ``cpu_util`` and ``steal`` from
    :class:`CpuMeter`; ``pauses`` from :class:`PauseMeter`."""
    from testbed.emulator import relay as relay_mod

    warnings = ["no statistics from the delay relay: fidelity unknown"] if relays and not relay else []
    long = [p for p in pauses or [] if p[1] >= PAUSE_MAX_S]
    if long:
        t, s = max(long, key=lambda p: p[1])
        warnings.append(f"the machine paused {len(long)} time(s) for {PAUSE_MAX_S:g} s or more, the longest "
                        f"{s:.2f} s at {time.strftime('%H:%M:%S', time.gmtime(t))} UTC (a process that only sleeps woke "
                        "that late: agents, relays and heartbeats may have stood still as long)")
    for i, st in enumerate(relay):
        ok, why = relay_mod.kept_up(st, max_p99_late_ms=max_late_ms)
        if not ok:
            warnings.append(f"relay {i}: {why}")
    if cpu_util > CPU_BUSY:
        warnings.append(f"machine CPU {cpu_util:.0%} busy: link emulation and agents may be CPU-bound")
    if steal > STEAL_MAX:
        warnings.append(f"the hypervisor took {steal:.1%} of the CPU time (steal): every timing may be stretched")
    return {"method": method, "kept_up": not warnings, "warnings": warnings, "cpu_util": cpu_util, "steal": steal,
            "max_late_ms": max_late_ms, "relay": relay, **({"pauses": pauses} if pauses is not None else {})}


def tcp_memory(sockstat: str = "/proc/net/sockstat", tcp_mem: str = "/proc/sys/net/ipv4/tcp_mem") -> dict:
    """The machine's TCP memory in use and orphaned sockets (both counted over every network
    namespace), and tcp_mem's low/pressure/high marks, in MB.  Orphans of earlier runs holding
    their queued data count against the same marks, and TCP under memory pressure cuts the
    windows of long-RTT flows (docs/measurements/emulator-log.md)."""
    page_mb = os.sysconf("SC_PAGE_SIZE") / 1e6
    with open(sockstat) as f:
        tcp = next(l.split()[1:] for l in f if l.startswith("TCP:"))
    counts = dict(zip(tcp[::2], (int(x) for x in tcp[1::2])))
    with open(tcp_mem) as f:
        marks = [int(x) * page_mb for x in f.read().split()]
    return {"mem_mb": round(counts["mem"] * page_mb, 1), "orphans": counts["orphan"],
            "marks_mb": [round(m, 1) for m in marks]}


class CpuMeter:
    """Whole-machine CPU use between start() and stop(), from /proc/stat: stop() returns
    (busy, steal), each a fraction of all CPU time (steal: taken by the hypervisor).  A
    thread samples it every ``CPU_SAMPLE_S`` meanwhile, for :meth:`busy_within`."""

    @staticmethod
    def _read() -> tuple[int, int, int]:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]] + [0] * 8
        return sum(vals[:8]), vals[3] + vals[4], vals[7]  # total (guest time is inside user), idle, steal

    def start(self) -> "CpuMeter":
        self._t = self._read()
        self.samples: list[tuple[int, int, int]] = []  # (time.time_ns(), total, idle)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="cpu-meter", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while True:
            self.samples.append((time.time_ns(), *self._read()[:2]))
            if self._done.wait(CPU_SAMPLE_S):
                return

    def stop(self) -> tuple[float, float]:
        self._done.set()
        self._thread.join(timeout=5.0)
        total, idle, steal = self._read()
        dt, di, ds = total - self._t[0], idle - self._t[1], steal - self._t[2]
        return (1.0 - di / dt, ds / dt) if dt else (0.0, 0.0)

    def busy_within(self, windows: list[tuple[int, int]]) -> float | None:
        """The machine's CPU busy share over the sampling intervals that lie inside the
        ``windows`` ([start_ns, end_ns] on time.time_ns()); None if no interval does."""
        spans = sorted(windows)
        starts = [s for s, _ in spans]
        reach = list(itertools.accumulate((e for _, e in spans), max))  # the latest end of a window begun by then
        total = idle = 0
        for (t0, a0, i0), (t1, a1, i1) in zip(self.samples, self.samples[1:]):
            k = bisect.bisect_right(starts, t0) - 1
            if k >= 0 and t1 <= reach[k]:
                total, idle = total + a1 - a0, idle + i1 - i0
        return 1.0 - idle / total if total else None


def comm_windows(runs: list[dict]) -> list[tuple[int, int]]:
    """[GO, last worker's communication done] of every measured iteration of ``runs`` (ns)."""
    out = []
    for run in runs:
        for it in (it for it in run.get("iterations", []) if not it.get("warmup")):
            done = [w["comm_done_ns"] for w in it.get("workers", {}).values() if w.get("comm_done_ns")]
            if it.get("go_ns") and done:
                out.append((it["go_ns"], max(done)))
    return out


class PauseMeter:
    """Pauses of the machine between start() and stop(): a process of its own sleeps
    PAUSE_TICK_S at a time and notes every wake-up PAUSE_NOTE_S or more late.  A machine that
    stops every process at once (the hypervisor, memory reclaim) stops the agents, their
    heartbeats and the relays alike: CPU time does not show it, the relays' lateness only
    where a packet was due.  stop() returns ``[[t_unix, seconds], ...]``."""

    def start(self) -> "PauseMeter":
        self.proc = subprocess.Popen([sys.executable, "-c", "from testbed.results import watch_pauses; watch_pauses()"],
                                     cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        return self

    def stop(self) -> list[list[float]]:
        try:
            out, _ = self.proc.communicate("", timeout=5.0)  # its stdin's end ends it
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        return [[float(x) for x in line.split()] for line in out.splitlines() if line.strip()]


def watch_pauses(tick_s: float = PAUSE_TICK_S, note_s: float = PAUSE_NOTE_S) -> None:
    """:class:`PauseMeter`'s process: sleep ``tick_s`` at a time until stdin ends, then print
    each pause (a wake-up ``note_s`` or more late) as ``t_unix seconds``."""
    pauses, last = [], time.monotonic()
    while not select.select([sys.stdin], [], [], tick_s)[0] or sys.stdin.readline():
        now = time.monotonic()
        if now - last - tick_s >= note_s:
            pauses.append((time.time() - (now - last), now - last - tick_s))
        last = now
    for t, s in pauses:
        print(f"{t:.3f} {s:.3f}")
