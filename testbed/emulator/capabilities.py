"""What this machine can do for emulation: detected by trying, never assumed.

``probe()`` creates a throw-away network namespace with a veth pair and tries the
qdiscs the emulator wants.  The result decides the link-shaping method (the table :data:`testbed.emulator.shaping.METHODS`:
kernel netem where it exists, else the user-space delay relay).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import asdict, dataclass

from testbed.emulator import memory
from testbed.results import preemption


def _run(cmd: list[str], timeout: float = 10) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@dataclass
class Capabilities:
    root: bool
    mnexec: bool
    mininet_python: bool
    netns: bool
    htb: bool
    netem: bool
    linux_bridge: bool
    bridge_nf_off: bool
    iperf3: bool
    ping: bool
    ethtool: bool
    gcc: bool
    kernel: str
    notes: list[str]

    @property
    def shaping_method(self) -> str | None:
        """The method ``auto`` picks (:func:`testbed.emulator.shaping.choose`), or None if
        links cannot be shaped at all."""
        from testbed.emulator.shaping import choose

        return choose(self)

    def problems(self) -> list[str]:
        """What stops ``run`` from working, as sentences a user can act on."""
        out = []
        if not self.root:
            out.append("not root: run with sudo")
        if not self.mnexec:
            out.append("mnexec missing: install the Debian/Ubuntu package 'mininet' (testbed/setup.sh)")
        if not self.mininet_python:
            out.append("Python package 'mininet' missing: run testbed/setup.sh")
        if self.root and not self.htb:
            out.append("the kernel has no HTB qdisc: links cannot be rate-shaped")
        if self.root and self.shaping_method is None:
            out.append("no way to emulate delay: neither netem nor gcc+ethtool for the user-space relay")
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d["shaping_method"] = self.shaping_method
        return d


def _probe_kernel() -> tuple[bool, bool, bool, bool, list[str]]:
    """(netns, htb, netem, linux bridge, notes) — each tried inside a temporary netns."""
    ns = f"tbprobe{os.getpid()}"
    notes: list[str] = []
    if _run(["ip", "netns", "add", ns]).returncode != 0:
        return False, False, False, False, ["cannot create a network namespace"]
    try:
        def tc(*args: str) -> bool:
            return _run(["ip", "netns", "exec", ns, "tc", *args]).returncode == 0

        # veth, not dummy: some kernels (this project's CI) have no dummy driver
        _run(["ip", "-n", ns, "link", "add", "name", "probe0", "type", "veth", "peer", "name", "probe1"])
        _run(["ip", "-n", ns, "link", "set", "probe0", "up"])
        htb = tc("qdisc", "add", "dev", "probe0", "root", "handle", "1:", "htb", "default", "1")
        htb = htb and tc("class", "add", "dev", "probe0", "parent", "1:", "classid", "1:1", "htb", "rate", "10mbit")
        netem = tc("qdisc", "add", "dev", "probe0", "parent", "1:1", "handle", "10:", "netem",
                   "delay", "10ms", "1ms", "loss", "1%") if htb else False
        if not netem:
            notes.append("netem is not available in this kernel: delay/jitter/loss use the user-space relay")
        bridge = _run(["ip", "-n", ns, "link", "add", "name", "probebr0", "type", "bridge"]).returncode == 0
        return True, htb, netem, bridge, notes
    finally:
        _run(["ip", "netns", "del", ns])


def probe() -> Capabilities:
    root = os.geteuid() == 0
    try:
        import mininet.net  # noqa: F401 -- imported only to see whether it can be
        mininet_python = True
    except ImportError:
        mininet_python = False
    netns = htb = netem = bridge = False
    notes: list[str] = []
    if root and shutil.which("ip") and shutil.which("tc"):
        netns, htb, netem, bridge, notes = _probe_kernel()
    if memory.reports_free_pages():
        order = int(memory.REPORTING_ORDER.read_text())
        notes.append(f"this VM reports free memory to its hypervisor (virtio-balloon free page reporting, order {order}): "
                     + ("held" if order > memory.MAX_PAGE_ORDER else "the first network holds it until reboot")
                     + ("; warmed this boot" if memory.warmed_this_boot() else f"; the first network warms {memory.WARM_MIB} MiB"))
    if (model := preemption()) in ("none", "voluntary"):
        notes.append(f"kernel preemption '{model}': the SCHED_FIFO delay relay waits for a task in a system call "
                     "or a kernel thread to yield before it runs (preempt=full on the command line of a "
                     "PREEMPT_DYNAMIC kernel lets it preempt them)")
    bridge_nf_off = all(
        not os.path.exists(p) or open(p).read().strip() == "0"
        for p in (f"/proc/sys/net/bridge/bridge-nf-call-{t}tables" for t in ("ip", "ip6", "arp"))
    )
    return Capabilities(
        root=root,
        mnexec=shutil.which("mnexec") is not None,
        mininet_python=mininet_python,
        netns=netns,
        htb=htb,
        netem=netem,
        linux_bridge=bridge,
        bridge_nf_off=bridge_nf_off,
        iperf3=shutil.which("iperf3") is not None,
        ping=shutil.which("ping") is not None,
        ethtool=shutil.which("ethtool") is not None,
        gcc=shutil.which("gcc") is not None,
        kernel=os.uname().release,
        notes=notes,
    )
