# Sourced by build.sh (the VM stage's image) and box.sh (the Vagrant box): the one place that
# debootstraps a Debian 12 root, so both guests are the same Debian from the same mirror.
#   debootstrap_root ROOT INCLUDE LOG   -- minbase + INCLUDE (comma-separated) into ROOT
# A mirror's transient "Couldn't download packages" must not fail CI: up to 3 tries, each
# under a deadline.  Returns 1 (the log's tail on stderr) when all of them failed.
SUITE=${TESTBED_VM_SUITE:-bookworm}
MIRROR=${TESTBED_VM_MIRROR:-http://deb.debian.org/debian}
DEBOOTSTRAP_TIMEOUT_S=${DEBOOTSTRAP_TIMEOUT_S:-900}

debootstrap_root() {
  local root=$1 include=$2 log=$3 try
  for try in 1 2 3; do
    timeout --kill-after=30 "$DEBOOTSTRAP_TIMEOUT_S" \
      debootstrap --variant=minbase --include="$include" "$SUITE" "$root" "$MIRROR" > "$log" 2>&1 && return 0
    tail -5 "$log" >&2
    [ "$try" = 3 ] && { echo "debootstrap failed 3 times (log above)" >&2; return 1; }
    echo "debootstrap failed (try $try of 3), again in 20 s" >&2
    umount -R "$root/proc" "$root/sys" 2>/dev/null || true; rm -rf "$root"; sleep 20
  done
}
