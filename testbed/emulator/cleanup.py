"""``testbed clean``: remove whatever a crashed or killed run left behind — and nothing of a
run that is still going.

Left-overs are recognised by name, never by guessing: Mininet host shells of our hosts
(``mininet:d<i>``, ``mininet:wan``), agent/coordinator/relay processes, iperf3/ping started
inside a non-root network namespace, root-namespace interfaces of our naming scheme
(``d<i>-*``, ``r<j>a``/``r<j>b``, ``tbc0*``, tunnels ``tbx<j>``, the local servers' ``tbu*``), ``ip netns`` namespaces named ``tb*``, and the
relays' configuration directories (``$TMPDIR/tbrelay-<run id>-*``).

Ownership: a run records its id (:func:`claim`: the owner's pid and start time) in the
environment variable ``TESTBED_RUN`` that every process it starts inherits (host shells,
which hold the hosts' namespaces, relays, agents, tools), and as the alias of the control
bridge ``tbc0``, which every other interface of the network hangs off.  By default only
*stale* things are removed: those whose owner process is gone, and processes without a run
id whose parent is gone (orphans).  ``everything=True`` (``clean --all``) removes all.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time

OUR_CMDLINE = re.compile(r"(mininet:(d\d+|wan|tbc0)\b|agents\.agent|agents\.coordinator|tbrelay|"
                         r"testbed\.emulator\.serve)")
NS_TOOLS = re.compile(r"^(iperf3|ping)\b")
OUR_INTF = re.compile(r"^(d\d+-\S+|r\d+[ab]|tbc0\S*|tbx\d+|tbu\S*)$")
RUN_ENV = "TESTBED_RUN"
ALIAS_PREFIX = "testbed-run="
BRIDGE = "tbc0"


def _start_time(pid: int) -> str | None:
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22: start time in clock ticks since boot


def claim() -> str:
    """This process's run id (set in the environment, so everything it starts inherits it)."""
    rid = f"{os.getpid()}.{_start_time(os.getpid())}"
    os.environ[RUN_ENV] = rid
    return rid


def owner_alive(rid: str) -> bool:
    """Is the process that claimed run id ``rid`` still running (same pid, same start)?"""
    pid, _, start = rid.partition(".")
    return pid.isdigit() and _start_time(int(pid)) == start


def _environ_run(pid: str) -> str | None:
    try:
        env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    except OSError:
        return None
    for kv in env:
        if kv.startswith(RUN_ENV.encode() + b"="):
            return kv.split(b"=", 1)[1].decode(errors="replace")
    return None


def _stale_process(pid: str) -> bool:
    rid = _environ_run(pid)
    if rid is not None:
        return not owner_alive(rid)
    try:
        ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return True
    return ppid <= 1  # an orphan: whoever started it is gone


def kill_run(rid: str) -> int:
    """SIGKILL every process of run ``rid`` (its environment's run id), remove its relays'
    directories; how many processes."""
    n = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) != os.getpid() and _environ_run(pid) == rid:
            try:
                os.kill(int(pid), signal.SIGKILL)
                n += 1
            except OSError:
                pass
    for d in glob.glob(os.path.join(tempfile.gettempdir(), f"tbrelay-{rid}-*")):
        shutil.rmtree(d, ignore_errors=True)
    return n


def bridge_owner() -> str | None:
    """Run id recorded on the control bridge, or None (no bridge, or no id on it)."""
    out = subprocess.run(["ip", "-o", "link", "show", "dev", BRIDGE], capture_output=True, text=True).stdout
    m = re.search(rf"alias {re.escape(ALIAS_PREFIX)}(\S+)", out)
    return m.group(1) if m else None


def _root_netns() -> str:
    """The namespace ``clean`` runs in, which is where runs are started from (pid 1's may
    not be readable inside a container)."""
    return os.readlink("/proc/self/ns/net")


def relay_dir_prefix() -> str:
    """The prefix of a relay's configuration directory: ``tbrelay-<run id>-``."""
    return f"tbrelay-{os.environ.get(RUN_ENV, 'none')}-"


def _stale_dir(path: str, cmdlines: list[str]) -> bool:
    """A relay directory whose run is over (or, without a run id, that no process's
    command line, of ``cmdlines``, names)."""
    rid = os.path.basename(path)[len("tbrelay-"):].rsplit("-", 1)[0]
    if rid != "none" and "." in rid:
        return not owner_alive(rid)
    return not any(path in cmd for cmd in cmdlines)


def leftovers(everything: bool = True) -> dict[str, list]:
    """What ``clean`` would remove: processes (pid, cmdline), interfaces, namespaces, relay
    directories; with ``everything=False`` only what belongs to no live run."""
    me = os.getpid()
    root_ns = _root_netns()
    procs, cmdlines = [], []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace").strip()
            cmdlines.append(cmd)
            ns = os.readlink(f"/proc/{pid}/ns/net")
        except OSError:
            continue
        if int(pid) == me or not cmd:
            continue
        if OUR_CMDLINE.search(cmd) or (ns != root_ns and NS_TOOLS.match(os.path.basename(cmd.split()[0]))):
            if everything or _stale_process(pid):
                procs.append((int(pid), cmd))
    owner = bridge_owner()
    live_net = not everything and owner is not None and owner_alive(owner)
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    intfs = [m.group(1) for m in re.finditer(r"^\d+: ([^:@]+)[:@]", out, re.M) if OUR_INTF.match(m.group(1))]
    ns_out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    namespaces = [l.split()[0] for l in ns_out.splitlines() if l.split() and l.split()[0].startswith("tb")]
    if live_net:  # a running network: its interfaces are in use
        intfs, namespaces = [], []
    dirs = [d for d in sorted(glob.glob(os.path.join(tempfile.gettempdir(), "tbrelay-*")))
            if everything or _stale_dir(d, cmdlines)]
    return {"processes": procs, "interfaces": intfs, "namespaces": namespaces, "directories": dirs}


def clean(log=print, everything: bool = False) -> dict[str, list]:
    """Remove stale left-overs (``everything``: all of ours, running or not)."""
    found = leftovers(everything)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid, _ in found["processes"]:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        time.sleep(0.3)
    for intf in found["interfaces"]:
        subprocess.run(["ip", "link", "del", intf], capture_output=True)
    for ns in found["namespaces"]:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    for d in found["directories"]:
        shutil.rmtree(d, ignore_errors=True)
    for kind, items in found.items():
        if items:
            log(f"removed {len(items)} {kind}: " + ", ".join(str(i[1] if isinstance(i, tuple) else i) for i in items[:8])
                + (" ..." if len(items) > 8 else ""))
    if not any(found.values()):
        log("nothing to clean")
    if not everything:
        kept = leftovers(True)
        n = len(kept["processes"]) + len(kept["interfaces"])
        if n:
            log(f"left {len(kept['processes'])} processes and {len(kept['interfaces'])} interfaces of runs "
                "still going (clean --all removes them too)")
    return found
