"""Keep freed memory inside this machine (virtual machines only).

A VM whose balloon device reports free pages (virtio-balloon free page reporting, Linux
``mm/page_reporting.c``) hands every free block of at least 2^``page_reporting_order`` pages
back to the hypervisor within seconds, and touching that memory again costs a page fault on
the host.  Measured on this project's 2-core VMs (docs/measurements/emulator-log.md, "Memory on a VM"):
a 4 KiB page the host does not back cost 5-9 us to touch, one it backs 0.4 us; a NetStorm link
check at scale 1 frees and re-allocates ~1.4 GB of socket buffers, which the host took back
during the check, and the relays stalled in kernel paths on every link at once (max lateness
23-47 ms): 1 of 5 checks kept up with reporting on, 5 of 5 with it held (alternating runs).
Memory never touched since boot is just as cold: held but not warmed, right after the host
had taken all free memory back, 3 of 8 checks kept up (narrower misses: p99 2.0-3.5 ms).

So the first network on a machine raises the order above the buddy allocator's largest
(:data:`HOLD_ORDERS`) and touches :data:`WARM_MIB` once, which the kernel then reuses for the
networks' buffers.  The hold stays until reboot -- restoring it after each run would hand the
warmed memory back and make every run pay the warm-up again (~10 s).  Upstream kernels accept
at most MAX_PAGE_ORDER (10): there 4 MiB blocks are still reported, a partial hold (recorded).
Whether this boot was warmed is kept apart from whether the order is raised (:data:`WARMED`,
by boot id): a platform may raise the order on the kernel's command line (this one passes
``page_reporting.page_reporting_order=11``), and memory held from boot is still cold.
The order's file exists wherever the kernel can report (Debian's 6.1 reads 11 with no device
at all), so only a virtio balloon that offers page reporting counts (:func:`reports_free_pages`;
Hyper-V's ``hv_balloon`` reports too and is not detected); never more than half the memory
available is warmed (the CI's Debian guest has 3 GiB)."""

from __future__ import annotations

import mmap
import time
from pathlib import Path

import numpy as np

REPORTING_ORDER = Path("/sys/module/page_reporting/parameters/page_reporting_order")
MAX_PAGE_ORDER = 10  # Linux x86-64: the largest free block is 2^10 pages (4 MiB)
HOLD_ORDERS = (MAX_PAGE_ORDER + 1, MAX_PAGE_ORDER)  # no block is ever reported; else the largest allowed
WARM_MIB = 4096  # a GScale check holds ~1 GB of TCP memory at scale 1; 4 GiB takes ~10 s to warm from cold
WARMED = Path("/run/testbed-memory-warmed")  # the boot id of the boot whose memory was warmed
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
VIRTIO_DEVICES = Path("/sys/bus/virtio/devices")
BALLOON_DEVICE, F_PAGE_REPORTING = 5, 5  # virtio spec: device id of the memory balloon, its feature bit


def reports_free_pages(param: Path = REPORTING_ORDER, devices: Path = VIRTIO_DEVICES) -> bool:
    """Whether this machine hands free memory to a hypervisor: the kernel can report and a
    virtio balloon offers VIRTIO_BALLOON_F_PAGE_REPORTING (``features``: one digit per bit)."""
    if not param.exists():
        return False
    for dev in devices.glob("virtio*"):
        try:
            if int((dev / "device").read_text(), 16) == BALLOON_DEVICE and (dev / "features").read_text()[F_PAGE_REPORTING] == "1":
                return True
        except (OSError, ValueError, IndexError):
            continue
    return False


def available_mib(meminfo: Path = Path("/proc/meminfo")) -> int:
    """MemAvailable in MiB."""
    return next(int(line.split()[1]) >> 10 for line in meminfo.read_text().splitlines() if line.startswith("MemAvailable:"))


def warm(mib: int) -> float:
    """Touch ``mib`` MiB once and free them; the seconds it took."""
    t = time.perf_counter()
    buf = mmap.mmap(-1, mib << 20)
    pages = np.frombuffer(buf, np.uint8)
    pages[::mmap.PAGESIZE] = 1
    del pages
    buf.close()
    return time.perf_counter() - t


def warmed_this_boot(warmed: Path = WARMED) -> bool:
    """Whether a network has warmed this VM's memory since it booted."""
    return warmed.exists() and warmed.read_text().strip() == BOOT_ID.read_text().strip()


def hold(param: Path = REPORTING_ORDER, warm_mib: int = WARM_MIB, warmed: Path = WARMED,
         devices: Path = VIRTIO_DEVICES, log=lambda msg: None) -> dict | None:
    """Hold free memory in this VM and warm it once per boot (see the module); what was done,
    for results.json (None: this machine reports no free pages)."""
    if not reports_free_pages(param, devices):
        return None
    before = int(param.read_text())
    rec = {"page_reporting_order": before, "held_at": None, "full": False, "warmed_mib": 0, "warm_s": 0.0}
    errors = []
    for order in HOLD_ORDERS:
        if before >= order:  # held already, by an earlier run or the boot command line
            rec.update(held_at=before, full=before > MAX_PAGE_ORDER)
            break
        try:
            param.write_text(str(order))
        except OSError as e:
            errors.append(f"{order}: {e}")
            continue
        log(f"holding free memory in this VM until reboot (free page reporting order {before} -> {order})")
        rec.update(held_at=order, full=order > MAX_PAGE_ORDER)
        break
    if rec["held_at"] and not warmed_this_boot(warmed):
        mib = min(warm_mib, available_mib() // 2)
        log(f"warming {mib} MiB once this boot (up to ~10 s)")
        rec.update(warmed_mib=mib, warm_s=round(warm(mib), 2))
        warmed.write_text(BOOT_ID.read_text())
    rec["note"] = (None if rec["full"] else "free blocks of 4 MiB still go back to the hypervisor" if rec["held_at"]
                   else f"free memory still goes back to the hypervisor ({'; '.join(errors)})")
    return rec
