#!/usr/bin/env bash
# Build the testbed's Debian guest from Debian packages only (no downloaded image):
#   bash testbed/vm/build.sh OUT_DIR CHECKOUT.tar
# debootstrap (minbase) of Debian 12 with Debian's kernel and initrd and the Python stack as
# Debian packages, then the project's own testbed/setup.sh run in the new root -- the same
# provisioning as a bare machine, CI and the Vagrantfile; setup.sh's pip installs what Debian
# does not package (pymetis).  The root trusts what this host trusts: the host's local CAs
# (/usr/local/share/ca-certificates) are added to it, so that pip works behind a
# TLS-intercepting proxy (as testbed/vm/box.sh does for the Vagrant box).  Writes OUT_DIR/{vmlinuz,initrd.img,root.img}; the image
# is never modified afterwards (the boot uses a throw-away overlay, qemu -snapshot).
# Called by `python3 -m testbed.vm build` (testbed/vm/__init__.py), which caches OUT_DIR.
set -euo pipefail
export PATH=$PATH:/usr/sbin:/sbin
OUT=${1:?usage: build.sh OUT_DIR CHECKOUT.tar}
CHECKOUT=${2:?usage: build.sh OUT_DIR CHECKOUT.tar}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
. "$REPO/testbed/vm/debootstrap.sh"   # debootstrap_root, SUITE, MIRROR
# Debian's kernel (ships sch_netem as a module) + the Python stack from Debian.
INCLUDE=linux-image-amd64,kmod,python3,python3-numpy,python3-networkx,python3-scipy,python3-yaml,python3-pytest,python3-matplotlib,mininet

[ "$(id -u)" -eq 0 ] || { echo "build.sh: run as root (debootstrap, chroot)" >&2; exit 2; }
need=""
command -v debootstrap >/dev/null || need="$need debootstrap"
command -v qemu-system-x86_64 >/dev/null || need="$need qemu-system-x86"
command -v mkfs.ext4 >/dev/null || need="$need e2fsprogs"
if [ -n "$need" ]; then
  echo "vm-build: installing host tools:$need"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends $need >/dev/null
fi

mkdir -p "$OUT"
WORK=$(mktemp -d "$OUT/.build.XXXXXX")
cleanup() {
  for m in proc run; do umount -R "$WORK/rootfs/$m" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT
ROOT=$WORK/rootfs
t0=$(date +%s)
echo "vm-build: debootstrap $SUITE (minbase + kernel + Python stack) into $ROOT"
debootstrap_root "$ROOT" "$INCLUDE" "$WORK/debootstrap.log" || { echo "vm-build: debootstrap failed" >&2; exit 1; }
t1=$(date +%s)

# Provision with the project's own set-up script, as on a bare machine.  No daemon may start
# in the chroot; /proc stays unmounted so the script's sysctl and `doctor` steps touch
# nothing of the host (they run for real at every boot, in the guest's own kernel); a tmpfs
# on /run takes what `ip netns` mounts there when doctor probes.
printf '#!/bin/sh\nexit 101\n' > "$ROOT/usr/sbin/policy-rc.d"; chmod +x "$ROOT/usr/sbin/policy-rc.d"
cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
# paramiko (deploy's SSH client) from Debian too, after debootstrap: as an --include its
# dependencies (python3-bcrypt, ...) fail minbase's configure step.
chroot "$ROOT" env DEBIAN_FRONTEND=noninteractive sh -c \
  'apt-get update -qq && apt-get install -y -qq --no-install-recommends python3-paramiko ca-certificates' \
  > "$WORK/paramiko.log" 2>&1 \
  || { tail -20 "$WORK/paramiko.log" >&2; echo "vm-build: installing python3-paramiko failed" >&2; exit 1; }
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
  cp /usr/local/share/ca-certificates/*.crt "$ROOT/usr/local/share/ca-certificates/"
  chroot "$ROOT" update-ca-certificates >/dev/null 2>&1
fi
mkdir -p "$ROOT/opt/provision"
tar xf "$CHECKOUT" -C "$ROOT/opt/provision"
echo "vm-build: testbed/setup.sh inside the new root"
mount -t tmpfs tmpfs "$ROOT/run"
chroot "$ROOT" env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
  bash /opt/provision/testbed/setup.sh > "$WORK/setup.log" 2>&1 \
  || { tail -30 "$WORK/setup.log" >&2; echo "vm-build: testbed/setup.sh failed in the guest root (log above)" >&2; exit 1; }
umount -R "$ROOT/run"
grep "^setup:" "$WORK/setup.log" | sed 's/^/  guest root: /'
rm -rf "$ROOT/opt/provision" "$ROOT/usr/sbin/policy-rc.d" "$ROOT/var/cache/apt/archives/"*.deb "$ROOT/var/lib/apt/lists/"*_Packages
echo testbed-vm > "$ROOT/etc/hostname"
echo "127.0.0.1 localhost testbed-vm" > "$ROOT/etc/hosts"
install -m 755 "$REPO/testbed/vm/guest-init.sh" "$ROOT/sbin/testbed-init"
mkdir -p "$ROOT/mnt/xfer"
t2=$(date +%s)

# Kernel + initrd for direct boot; the root file system as an ext4 image (room for the run).
cp "$(readlink -f "$ROOT/vmlinuz")" "$WORK/vmlinuz"
cp "$(readlink -f "$ROOT/initrd.img")" "$WORK/initrd.img"
mb=$(( $(du -sm "$ROOT" | cut -f1) + 1024 ))
mkfs.ext4 -q -F -L testbed-root -d "$ROOT" "$WORK/root.img" "${mb}M"
mv "$WORK/vmlinuz" "$WORK/initrd.img" "$WORK/root.img" "$OUT/"
t3=$(date +%s)
echo "vm-build: done in $((t3 - t0)) s (debootstrap $((t1 - t0)) s, setup.sh $((t2 - t1)) s, image $((t3 - t2)) s): $OUT"
