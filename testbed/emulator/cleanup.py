"""``testbed clean``: remove whatever a crashed or killed run left behind.

Left-overs are recognised by name, never by guessing: Mininet host shells of our hosts
(``mininet:d<i>``, ``mininet:wan``), agent/coordinator/relay processes, iperf3/ping started
inside a non-root network namespace, root-namespace interfaces of our naming scheme
(``d<i>-*``, ``r<j>a``/``r<j>b``, ``tbc0*``), and ``ip netns`` namespaces named ``tb*``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

OUR_CMDLINE = re.compile(r"(mininet:(d\d+|wan|tbc0)\b|agents\.agent|agents\.coordinator|tbrelay)")
NS_TOOLS = re.compile(r"^(iperf3|ping)\b")
OUR_INTF = re.compile(r"^(d\d+-\S+|r\d+[ab]|tbc0\S*)$")


def _root_netns() -> str:
    """The namespace ``clean`` runs in, which is where runs are started from (pid 1's may
    not be readable inside a container)."""
    return os.readlink("/proc/self/ns/net")


def leftovers() -> dict[str, list]:
    """What ``clean`` would remove: processes (pid, cmdline), interfaces, namespaces."""
    me = os.getpid()
    root_ns = _root_netns()
    procs = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace").strip()
            ns = os.readlink(f"/proc/{pid}/ns/net")
        except OSError:
            continue
        if int(pid) == me or not cmd:
            continue
        if OUR_CMDLINE.search(cmd) or (ns != root_ns and NS_TOOLS.match(os.path.basename(cmd.split()[0]))):
            procs.append((int(pid), cmd))
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    intfs = [m.group(1) for m in re.finditer(r"^\d+: ([^:@]+)[:@]", out, re.M) if OUR_INTF.match(m.group(1))]
    ns_out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    namespaces = [l.split()[0] for l in ns_out.splitlines() if l.split() and l.split()[0].startswith("tb")]
    return {"processes": procs, "interfaces": intfs, "namespaces": namespaces}


def clean(log=print) -> dict[str, list]:
    found = leftovers()
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
    for kind, items in found.items():
        if items:
            log(f"removed {len(items)} {kind}: " + ", ".join(str(i[1] if isinstance(i, tuple) else i) for i in items[:8])
                + (" ..." if len(items) > 8 else ""))
    if not any(found.values()):
        log("nothing to clean")
    return found
