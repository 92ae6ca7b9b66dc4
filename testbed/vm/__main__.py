"""python3 -m testbed.vm build|run|stage -- the Debian guest (testbed/vm/__init__.py).

  build [--rebuild]                 build (or find cached) the guest image
  run [options] -- COMMAND ...      boot, run COMMAND (bash, in the checkout's copy), power off;
                                    exit with COMMAND's exit code
  stage [options]                   the CI stage: testbed/vm/stage.sh in the guest
  compare A.json B.json             two linkcheck results (relay vs netem) side by side
  check RESULT.json ...             every link htb+netem and (results.json) every run correct

Exit codes: the guest command's own; 1 when the guest could not be built or booted or
gave no exit code (a message says which); 2 for bad arguments.
"""

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from testbed.vm import VmError, boot, compare_linkchecks, image, netem_problems

# the guest's link checks (`stage --linkchecks`): name -> topology, in the order they run
LINKCHECKS = {"netstorm-internet2-9": "netstorm-internet2-9",  # NetStorm's overlay, 26 directions
              "lossy-jitter-4": "testbed/vm/lossy-jitter-4.yaml",  # loss + jitter on every link
              "jitter-3": "testbed/vm/jitter-3.yaml"}  # 2-8 ms of jitter, one distribution per link


def _check(files) -> int:
    """``check``: each results.json / linkcheck.json, a line each; 0 when all show the netem path."""
    ok = True
    for f in files:
        try:
            result = json.loads(Path(f).read_text())
        except (OSError, ValueError) as e:
            result, bad = {}, [f"cannot read it: {e}"]
        else:
            bad = netem_problems(result) if isinstance(result, dict) else ["not a JSON object"]
        if not bad:
            n = len(result.get("links") or result.get("directions"))
            print(f"{f}: {n} link directions, all htb+netem")
        else:
            print(f"{f}: " + "; ".join(bad))
        ok = ok and not bad
    return 0 if ok else 1


def stage_command(scale: float, strict: bool, linkchecks: list[str] | None) -> str:
    """The guest's command for ``stage``: ``linkchecks`` None for none, [] for all of
    ``LINKCHECKS`` and the link-check-based emulator tests, else the names to check (in
    ``LINKCHECKS``' order)."""
    names = LINKCHECKS if linkchecks == [] else [n for n in LINKCHECKS if n in (linkchecks or ())]
    topologies = " ".join(LINKCHECKS[n] for n in names)
    return (f"{'STRICT=1 ' if strict else ''}{'LINKCHECK_TESTS=1 ' if linkchecks == [] else ''}"
            f"LINKCHECKS={shlex.quote(topologies)} bash testbed/vm/stage.sh {scale:g}")


def main(argv=None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.verb == "check":
        return _check(args.files)
    if args.verb == "compare":
        try:
            a, b = (json.loads(Path(f).read_text()) for f in args.files)
        except (OSError, ValueError) as e:
            p.error(f"compare: {e}")
        print(compare_linkchecks(a, b, tuple(args.labels)))
        return 0
    command = _guest_command(p, args)
    try:
        t0 = time.monotonic()
        img = image(rebuild=args.rebuild)
        print(f"vm: image ready in {time.monotonic() - t0:.0f} s: {img}", flush=True)
        if args.verb == "build":
            return 0
        t1 = time.monotonic()
        rc = boot(command, timeout_s=args.timeout, img=img, out=Path(args.out) if args.out else None,
                  cpus=args.cpus, memory_mb=args.memory, accel=args.accel)
        print(f"vm: guest command exit {rc}; boot + command + power-off {time.monotonic() - t1:.0f} s", flush=True)
        return rc
    except VmError as e:
        print(f"vm: error: {e}", file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m testbed.vm",
                                description="Build a Debian guest from packages and run commands in it with qemu.")
    sub = p.add_subparsers(dest="verb", required=True)
    b = sub.add_parser("build", help="build the guest image (cached while its inputs are unchanged)")
    b.add_argument("--rebuild", action="store_true", help="build even if a cached image exists")
    for name, hlp in (("run", "boot the guest, run a command, power off"),
                      ("stage", "the CI stage in the guest: setup.sh, doctor, netem tests, linkchecks, quickstart")):
        s = sub.add_parser(name, help=hlp)
        s.add_argument("--timeout", type=float, default=2400, help="seconds the command may run (default 2400)")
        s.add_argument("--cpus", type=int, default=1, help="guest vCPUs (each one a host thread under TCG; default 1)")
        s.add_argument("--memory", type=int, default=3072, help="guest memory in MB (default 3072)")
        s.add_argument("--accel", choices=("tcg", "kvm"), default="tcg",
                       help="tcg (default) or kvm (only on real hardware virtualisation)")
        s.add_argument("--out", help="copy the guest's /mnt/xfer/out here")
        s.add_argument("--rebuild", action="store_true", help="rebuild the image first")
    sub.choices["run"].add_argument("command", nargs=argparse.REMAINDER, help="the command (after --)")
    sub.choices["stage"].add_argument("--scale", type=float, default=0.1,
                                      help="rate scale of the guest's link checks and quickstart (default 0.1: TCG)")
    sub.choices["stage"].add_argument(
        "--linkchecks", nargs="*", choices=sorted(LINKCHECKS), metavar="NAME",
        help="also link checks through netem, of the named topologies (none named: all of "
             f"{', '.join(LINKCHECKS)} and the emulator's two link-check tests; 40 min or more under "
             "TCG, of which netstorm-internet2-9 ~14)")
    sub.choices["stage"].add_argument("--strict", action="store_true",
                                      help="link-check verdicts gate the stage (default: reported; docs/install.md)")
    c = sub.add_parser("compare", help="two linkcheck.json files (relay on the host, netem in the guest) side by side")
    c.add_argument("files", nargs=2, metavar="LINKCHECK.json")
    c.add_argument("--labels", nargs=2, default=("relay", "netem"))
    k = sub.add_parser("check", help="results.json / linkcheck.json: every link htb+netem, every run correct")
    k.add_argument("files", nargs="+", metavar="RESULT.json")
    return p


def _guest_command(p: argparse.ArgumentParser, args) -> str | None:
    """The command ``run`` or ``stage`` boots the guest for (None for ``build``); a bad
    argument exits 2 through ``p.error``."""
    if args.verb in ("run", "stage") and (args.timeout <= 0 or args.cpus < 1 or args.memory < 512):
        p.error("--timeout must be > 0, --cpus >= 1, --memory >= 512")
    if args.verb == "run":
        cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not cmd:
            p.error("run: give the command after --")
        return shlex.join(cmd) if len(cmd) > 1 else cmd[0]
    if args.verb == "stage":
        if not 0 < args.scale <= 1:
            p.error("--scale must be in (0, 1]")
        return stage_command(args.scale, args.strict, args.linkchecks)
    return None


if __name__ == "__main__":
    sys.exit(main())
