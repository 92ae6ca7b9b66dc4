#!/usr/bin/env bash
# The VM stage, run INSIDE the Debian guest by `python3 -m testbed.vm stage` (from the
# checkout's copy at /root/testbed), where the kernel has netem:
#   bash testbed/vm/stage.sh SCALE
# 1. testbed/setup.sh again (the image was provisioned by it: a second run must change
#    nothing; it builds the relay and runs doctor on the guest's kernel);
# 2. doctor must report netem and choose it;
# 3. the netem-path tests (skipped on a host without netem; method auto is netem here);
# 4. (LINKCHECKS="TOPOLOGY ...", `stage --linkchecks [NAME ...]`) with no names (LINKCHECK_TESTS=1)
#    first the two linkcheck-based netem-path tests (each measures up to 3 times under TCG:
#    over 15 min; reported, gating only with STRICT=1), then linkcheck of each topology named:
#    netstorm-internet2-9 (~14 min), lossy-jitter-4 (loss + jitter on every link), jitter-3
#    (2-8 ms of jitter at 20-60 Mbit/s, one distribution per link), link by link (`--single`: with every
#    link loaded at once the TCG guest measures its emulated CPU, not netem): it runs to its
#    verdict and every link is shaped htb+netem; the verdict is printed and kept in OUT but
#    gates only with STRICT=1 (docs/install.md);
# 5. experiments/quickstart.yaml: correct, its links htb+netem.
# SCALE multiplies link rates (and quickstart's data size): the guest runs under qemu's TCG.
# Every step runs even if an earlier one failed; the last line names the failed steps.
# Results go to /mnt/xfer/out (copied back to the host with `--out`).
set -uo pipefail
SCALE=${1:?usage: stage.sh SCALE}
OUT=${TESTBED_VM_OUT:-/mnt/xfer/out}
mkdir -p "$OUT"
failed=()
T0=$(date +%s)
step() {  # step NAME COMMAND...
  local name=$1 t=$(date +%s); shift
  echo "== vm stage: $name"
  if "$@"; then echo "== vm stage: $name: ok ($(( $(date +%s) - t )) s)"
  else echo "== vm stage: $name: FAILED ($(( $(date +%s) - t )) s)"; failed+=("$name"); fi
}
netem_only() { python3 -m testbed.vm check "$@"; }  # every link htb+netem, every run correct
doctor_netem() {
  python3 -m testbed doctor --json > "$OUT/doctor.json" || return 1
  python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); c = d.get("capabilities", d)
print("doctor: netem", c["netem"], "| run will use", c["shaping_method"])
sys.exit(0 if c["netem"] and c["shaping_method"] == "netem" else 1)' "$OUT/doctor.json"
}
step "setup.sh (second run)" bash testbed/setup.sh
step "doctor reports netem" doctor_netem
step "python is the interpreter with the packages" python -c 'import mininet.net, numpy, scipy, yaml, testbed'

step "netem-path tests" python3 -m pytest -q -p no:cacheprovider tests/test_netem.py -k "not relay"  # the relay under TCG: docs/measurements/2026-11-28-vm-stage.md
reported() {  # run; a failure is printed but gates only with STRICT=1 (timing under TCG: docs/install.md)
  "$@" && return 0
  [ "${STRICT:-0}" = 1 ] && return 1
  echo "(reported, not gating: under qemu's TCG the guest's own timing is not a real machine's; STRICT=1 gates)"
}
if [ "${LINKCHECK_TESTS:-0}" = 1 ]; then  # --linkchecks with no names: each test measures up to 3 times
step "netem-path linkcheck tests" reported python3 -m pytest -q -p no:cacheprovider -k "not relay" \
  "tests/test_emulator.py::test_small3_rates_and_delays_within_tolerance" \
  "tests/test_emulator.py::test_lossy_jittery_link_is_measured_within_tolerance"
fi
if [ -n "${LINKCHECKS:-}" ]; then  # the long link checks: --linkchecks [NAME ...]
linkcheck() {  # the check must run to its verdict (exit 0 or 1); the verdict gates only with STRICT=1
  python3 -m testbed linkcheck "$@"
  local rc=$?
  [ $rc -eq 1 ] && [ "${STRICT:-0}" != 1 ] && { reported false; return 0; }
  return $rc
}
for topo in $LINKCHECKS; do
  name=$(basename "$topo" .yaml)
  step "linkcheck $name (scale $SCALE, link by link)" linkcheck "$topo" --single --scale "$SCALE" --tcp-cc bbr \
    --seconds 4 --out "$OUT/linkcheck-$name"
  step "linkcheck $name: htb+netem" netem_only "$OUT/linkcheck-$name/linkcheck.json"
done
fi
step "quickstart (scale $SCALE)" python3 -m testbed run experiments/quickstart.yaml --set "scale=$SCALE" \
  --out "$OUT/quickstart"
step "quickstart: correct, htb+netem" netem_only "$OUT/quickstart/results.json"
echo "== vm stage: $(( $(date +%s) - T0 )) s in the guest; ${#failed[@]} step(s) failed${failed:+: ${failed[*]}}"
[ ${#failed[@]} -eq 0 ]
