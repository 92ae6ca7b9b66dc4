"""A Debian guest built from packages and booted with qemu, to run the testbed where the
kernel has netem (its ``htb+netem`` path) and to test the provisioning script for real.

``build.sh`` makes the image (debootstrap + Debian's kernel + ``testbed/setup.sh`` in the new
root); :func:`image` caches it under a key of the files that decide its content, so a change
to them rebuilds it and nothing else does.  :func:`boot` starts qemu with direct kernel boot,
the serial console on stdout and ``-snapshot`` (the cached image is never written: after a
power-off an image is rebuilt, never edited), hands the guest this checkout and a command over
9p (``guest-init.sh``), and returns the command's exit code; the guest's ``/mnt/xfer/out``
comes back to the host.  Every step runs under a timeout.

Acceleration: TCG by default.  KVM is faster only on real hardware virtualisation; where
``/dev/kvm`` is itself nested/paravirtual (this project's CI) a stock kernel runs ~400x slower
under KVM than under TCG, so KVM is an explicit choice (``--accel kvm``), never a guess.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
# the files whose content decides the image (change one and the image is rebuilt)
IMAGE_INPUTS = ("testbed/vm/build.sh", "testbed/vm/debootstrap.sh", "testbed/vm/guest-init.sh",
                "testbed/setup.sh")
CACHE = Path(os.environ.get("TESTBED_VM_CACHE", "/var/cache/testbed-vm"))
BUILD_TIMEOUT_S = 1800


class VmError(Exception):
    """The guest could not be built or booted, or gave no exit code."""


def checkout_tar(dest: Path, repo: Path = REPO) -> Path:
    """This checkout's files (tracked and untracked-but-not-ignored, as git lists them;
    every file but .git/ and build outputs if it is no git checkout) as a tar."""
    try:
        names = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others",
                                "--exclude-standard"], capture_output=True, check=True,
                               timeout=60).stdout.decode().split("\0")
    except (OSError, subprocess.SubprocessError):
        names = [str(p.relative_to(repo)) for p in repo.rglob("*")
                 if p.is_file() and not {".git", "build", "__pycache__", "results"} & set(p.parts)]
    with tarfile.open(dest, "w") as tar:
        for name in sorted(n for n in names if n and (repo / n).is_file()):
            tar.add(repo / name, arcname=name)
    return dest


def image_key(repo: Path = REPO) -> str:
    h = hashlib.sha256()
    for name in IMAGE_INPUTS:
        h.update(name.encode() + b"\0" + (repo / name).read_bytes())
    h.update(os.environ.get("TESTBED_VM_SUITE", "bookworm").encode())
    return h.hexdigest()[:16]


def image(rebuild: bool = False, cache: Path = CACHE, log=print) -> Path:
    """The folder holding vmlinuz, initrd.img and root.img for this checkout's image
    inputs, built (``build.sh``, at most BUILD_TIMEOUT_S) if not cached.  Older images in
    ``cache`` are removed.  Concurrent callers wait for one build (a file lock)."""
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / image_key()
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if rebuild or not (out / "root.img").exists():
            shutil.rmtree(out, ignore_errors=True)
            t0 = time.monotonic()
            with tempfile.TemporaryDirectory() as tmp:
                tar = checkout_tar(Path(tmp) / "checkout.tar")
                try:
                    proc = subprocess.run(["bash", str(HERE / "build.sh"), str(out), str(tar)],
                                          timeout=BUILD_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    shutil.rmtree(out, ignore_errors=True)
                    raise VmError(f"building the guest image took more than {BUILD_TIMEOUT_S} s: stopped")
            if proc.returncode != 0 or not (out / "root.img").exists():
                shutil.rmtree(out, ignore_errors=True)
                raise VmError(f"building the guest image failed (build.sh exit {proc.returncode}, see above)")
            (out / "build_s").write_text(f"{time.monotonic() - t0:.0f}\n")
        else:
            log(f"vm: cached image {out} (inputs unchanged: {', '.join(IMAGE_INPUTS)})")
        for old in cache.iterdir():
            if old.is_dir() and old != out and not old.name.startswith("."):
                shutil.rmtree(old, ignore_errors=True)
    return out


def qemu_command(img: Path, xfer: Path, *, cpus: int, memory_mb: int, accel: str) -> list[str]:
    append = ("console=ttyS0 root=/dev/vda rw init=/sbin/testbed-init panic=-1 quiet loglevel=3 "
              "net.ifnames=0")
    return ["qemu-system-x86_64", "-accel", accel, "-cpu", "max" if accel == "tcg" else "host",
            "-smp", str(cpus), "-m", str(memory_mb), "-nodefaults", "-no-user-config",
            "-display", "none", "-serial", "stdio", "-no-reboot",
            "-kernel", str(img / "vmlinuz"), "-initrd", str(img / "initrd.img"), "-append", append,
            "-drive", f"file={img / 'root.img'},format=raw,if=virtio,snapshot=on",
            "-virtfs", f"local,path={xfer},mount_tag=xfer,security_model=none",
            "-device", "virtio-rng-pci"]


def boot(command: str, *, timeout_s: float, img: Path, out: Path | None = None, cpus: int = 1,
         memory_mb: int = 3072, accel: str = "tcg", console=sys.stdout) -> int:
    """Boot the guest, run ``command`` (bash, from the checkout's copy at /root/testbed)
    for at most ``timeout_s``, power off; return its exit code.  The console is copied to
    ``console`` as it comes; the guest's /mnt/xfer/out is copied to ``out``.  Raises
    VmError when the guest gives no exit code (boot failure, panic, or qemu killed after
    ``timeout_s`` + a margin for boot and power-off)."""
    with tempfile.TemporaryDirectory(prefix="testbed-vm-") as tmp:
        xfer = Path(tmp)
        checkout_tar(xfer / "checkout.tar")
        (xfer / "cmd").write_text(command + "\n")
        (xfer / "timeout").write_text(f"{int(timeout_s)}\n")
        limit = timeout_s + 180  # boot (~12 s under TCG) and power-off, with a wide margin
        proc = subprocess.Popen(qemu_command(img, xfer, cpus=cpus, memory_mb=memory_mb, accel=accel),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

        def copy():
            for raw in proc.stdout:
                console.write(raw.decode(errors="replace").replace("\r", ""))
                console.flush()

        reader = threading.Thread(target=copy, daemon=True)
        reader.start()
        try:
            proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise VmError(f"the guest did not power off within {limit:.0f} s: qemu killed")
        finally:
            reader.join(timeout=10)
            if out is not None and (xfer / "out").is_dir():
                shutil.copytree(xfer / "out", out, dirs_exist_ok=True)
        rc = xfer / "rc"
        if not rc.exists():
            raise VmError(f"the guest gave no exit code (qemu exit {proc.returncode}): "
                          "it did not boot, or its init failed; the console is above")
        return int(rc.read_text())


def netem_problems(result: dict) -> list[str]:
    """What keeps a ``results.json`` (of ``run``) or ``linkcheck.json`` from showing the
    netem path at work: a link direction not shaped ``htb+netem``; for a run, no run at all
    or a run whose result is not correct.  Empty when it shows it."""
    links = result.get("links") or result.get("directions") or []
    methods = {d.get("method") for d in links}
    bad = [] if methods == {"htb+netem"} else [f"link methods {sorted(map(str, methods))}, expected only htb+netem"]
    if "runs" in result and not result["runs"]:
        bad.append("no runs")
    for v in result.get("runs", []):
        if v.get("correct") is not True:
            bad.append(f"run {v.get('variant')} rep {v.get('repetition')}: result not correct")
    return bad


def compare_linkchecks(a: dict, b: dict, labels=("relay", "netem")) -> str:
    """Two ``linkcheck.json`` results of the same topology and scale (e.g. the host's
    relay and the guest's netem) side by side, per direction and phase: rate ratio; delay
    error (ms: idle one-way median - configured in the single phase, RTT/2 under load -
    configured in the concurrent one); measured jitter and loss, and the standing queue's
    error (ms: measured - expected; single phase); the checks that failed.  Then, per phase
    and path, the range of each over all directions."""
    ra, rb = _by_direction(a), _by_direction(b)
    la, lb = labels
    keys = sorted(set(ra) & set(rb), key=lambda k: (k[0] != "single", k[1], k[2]))
    out = [f"{a.get('topology')} at scale {a.get('scale')}: {la} = {a.get('method')}, {lb} = {b.get('method')}",
           f"{'phase':10} {'src':>4} {'dst':>4} {'Mbit/s':>6} | {'ratio':>6} {'ratio':>6} | {'delay err ms':>13} | "
           f"{'jitter ms':>17} | {'loss %':>20} | {'queue err ms':>13} | failed checks",
           f"{'':27} | {la:>6} {lb:>6} | {la:>6} {lb:>6} | {'conf':>5} {la:>5} {lb:>5} | {'conf':>6} {la:>6} {lb:>6} | "
           f"{la:>6} {lb:>6} | {la} / {lb}"]
    out += [_compare_row(k, ra[k], rb[k]) for k in keys]
    for phase in ("single", "concurrent"):
        for lab, r in ((la, ra), (lb, rb)):
            ds = [r[k] for k in keys if k[0] == phase]
            if ds:
                out.append(_compare_summary(phase, lab, ds))
    return "\n".join(out)


def _by_direction(result: dict) -> dict:
    """A linkcheck result's directions by (phase, src, dst)."""
    return {(d["phase"], d["src"], d["dst"]): d for d in result["directions"]}


def _delay_error(d: dict) -> float | None:
    """ms: idle one-way median - configured (single phase), else RTT/2 under load - expected."""
    if d["phase"] == "single" and d.get("measured_delay_ms") is not None:
        return d["measured_delay_ms"] - d["delay_ms"]
    return d["loaded_owd_ms"] - d["expected_owd_ms"] if d.get("loaded_owd_ms") is not None else None


def _queue_error(d: dict) -> float | None:
    """ms: the standing queue measured - expected (None where either is missing)."""
    q = d.get("measured_queue_ms")
    return None if q is None or d.get("expected_queue_ms") is None else q - d["expected_queue_ms"]


def _cell(x, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if x is None else format(format(x, spec), f">{width}")


def _failed_checks(d: dict) -> str:
    return ",".join(k for k, v in d.get("checks", {}).items() if not v) or "ok"


def _compare_row(k: tuple, da: dict, db: dict) -> str:
    """One direction of one phase, both paths side by side."""
    ja, jb = da.get("measured_jitter_ms"), db.get("measured_jitter_ms")
    pa, pb = da.get("measured_loss"), db.get("measured_loss")
    f, err, qerr = _cell, _delay_error, _queue_error
    return (f"{k[0]:10} {k[1]:>4} {k[2]:>4} {da['rate_mbps']:6.2f} | {f(da.get('rate_ratio'), '.3f', 6)} "
            f"{f(db.get('rate_ratio'), '.3f', 6)} | {f(err(da), '+.2f', 6)} {f(err(db), '+.2f', 6)} | "
            f"{da['jitter_ms']:5.2f} {f(ja, '.2f', 5)} {f(jb, '.2f', 5)} | {100 * da['loss']:6.3f} "
            f"{f(None if pa is None else 100 * pa, '.3f', 6)} {f(None if pb is None else 100 * pb, '.3f', 6)} | "
            f"{f(qerr(da), '+.1f', 6)} {f(qerr(db), '+.1f', 6)} | {_failed_checks(da)} / {_failed_checks(db)}")


def _compare_summary(phase: str, lab: str, ds: list[dict]) -> str:
    """The range of rate ratio, delay and queue error over one path's directions in ``phase``."""
    ratios = [d["rate_ratio"] for d in ds if d.get("rate_ratio") is not None]
    errs = [abs(_delay_error(d)) for d in ds if _delay_error(d) is not None]
    qerrs = [abs(_queue_error(d)) for d in ds if _queue_error(d) is not None]
    return (f"{phase} {lab}: rate ratio {min(ratios, default=0):.3f}-{max(ratios, default=0):.3f}, "
            f"|delay error| <= {max(errs, default=0):.2f} ms, "
            + (f"|queue error| <= {max(qerrs):.1f} ms, " if qerrs else "")
            + f"{sum(d['ok'] for d in ds)}/{len(ds)} directions pass every check")
