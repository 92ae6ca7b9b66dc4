#!/usr/bin/env bash
# Build a Vagrant box for the libvirt provider from Debian packages only (no downloaded image):
#   bash testbed/vm/box.sh OUT.box
#   vagrant box add --name debian/bookworm64 OUT.box     # then the Vagrantfile finds it
# For a host that cannot download debian/bookworm64 (this project's CI).  A plain Debian 12,
# as that box is: debootstrap (testbed/vm/debootstrap.sh, the same as the VM stage's guest)
# of minbase + Debian's kernel + systemd, udev, dbus, ifupdown/DHCP on eth0, openssh-server,
# sudo and rsync; a `vagrant` user (password vagrant, sudo without password) whose
# authorized_keys holds Vagrant's insecure public key (from the installed vagrant package;
# `vagrant up` replaces it on first boot); ssh host keys made at first boot; BIOS boot with
# GRUB from a 20 GB qcow2 (one ext4 partition).  Nothing of the testbed is in it:
# `vagrant up` provisions it with testbed/setup.sh, as a user's box.
# The box trusts what this host trusts: the host's local CAs (/usr/local/share/ca-certificates)
# are added to it, so that pip in the guest works behind a TLS-intercepting proxy.
# Needs root (debootstrap, chroot); every step runs under a deadline.
set -euo pipefail
export PATH=$PATH:/usr/sbin:/sbin
OUT=${1:?usage: box.sh OUT.box}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
. "$REPO/testbed/vm/debootstrap.sh"   # debootstrap_root, SUITE, MIRROR
INCLUDE=linux-image-amd64,kmod,systemd-sysv,udev,dbus,ifupdown,isc-dhcp-client,netbase,openssh-server,sudo,rsync,ca-certificates,iproute2,procps,less
DISK_GB=20
LABEL=debian-root
INSECURE_KEY=$(ls /usr/share/rubygems-integration/all/gems/vagrant-*/keys/vagrant.pub /usr/share/vagrant/keys/vagrant.pub \
  /opt/vagrant/embedded/gems/gems/vagrant-*/keys/vagrant.pub 2>/dev/null | head -1 || true)

[ "$(id -u)" -eq 0 ] || { echo "box.sh: run as root (debootstrap, chroot)" >&2; exit 2; }
[ -n "$INSECURE_KEY" ] || { echo "box.sh: Vagrant's insecure public key (keys/vagrant.pub of the vagrant package) not found: install vagrant" >&2; exit 2; }
need=""
command -v debootstrap >/dev/null || need="$need debootstrap"
command -v qemu-img >/dev/null || need="$need qemu-utils"
command -v sfdisk >/dev/null || need="$need fdisk"
command -v grub-mkimage >/dev/null || need="$need grub-common"
[ -d /usr/lib/grub/i386-pc ] || need="$need grub-pc-bin"
if [ -n "$need" ]; then
  echo "box: installing host tools:$need"
  export DEBIAN_FRONTEND=noninteractive
  timeout 600 apt-get update -qq && timeout 600 apt-get install -y -qq --no-install-recommends $need >/dev/null
fi

mkdir -p "$(dirname "$OUT")"
WORK=$(mktemp -d "$(dirname "$OUT")/.box.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
ROOT=$WORK/rootfs
t0=$(date +%s)
echo "box: debootstrap $SUITE (minbase + kernel, systemd, sshd, sudo, rsync) into $ROOT"
debootstrap_root "$ROOT" "$INCLUDE" "$WORK/debootstrap.log" || { echo "box: debootstrap failed" >&2; exit 1; }
t1=$(date +%s)

# The system as Debian's box has it.  No daemon may start in the chroot (policy-rc.d), and
# /proc stays unmounted: nothing here touches the host.
in_root() { timeout 300 chroot "$ROOT" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 "$@"; }
cat > "$ROOT/etc/apt/sources.list" <<APT
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb ${MIRROR%/debian}/debian-security $SUITE-security main
APT
echo bookworm > "$ROOT/etc/hostname"
printf '127.0.0.1\tlocalhost\n127.0.1.1\tbookworm\n::1\tlocalhost ip6-localhost ip6-loopback\n' > "$ROOT/etc/hosts"
echo "LABEL=$LABEL / ext4 errors=remount-ro 0 1" > "$ROOT/etc/fstab"
cat > "$ROOT/etc/network/interfaces" <<'NET'
auto lo
iface lo inet loopback

allow-hotplug eth0
iface eth0 inet dhcp
NET
in_root useradd --create-home --shell /bin/bash --uid 1000 --user-group vagrant
echo vagrant:vagrant | in_root chpasswd
in_root passwd --lock root >/dev/null
echo 'vagrant ALL=(ALL) NOPASSWD: ALL' > "$ROOT/etc/sudoers.d/vagrant"
chmod 440 "$ROOT/etc/sudoers.d/vagrant"
install -d -m 700 "$ROOT/home/vagrant/.ssh"
install -m 600 "$INSECURE_KEY" "$ROOT/home/vagrant/.ssh/authorized_keys"
in_root chown -R vagrant:vagrant /home/vagrant/.ssh
# every machine made from the box gets its own ssh host keys and machine id at first boot
rm -f "$ROOT"/etc/ssh/ssh_host_*
cat > "$ROOT/etc/systemd/system/ssh-host-keys.service" <<'UNIT'
[Unit]
Description=Make the ssh host keys (first boot of a machine made from the box)
Before=ssh.service
ConditionPathExists=!/etc/ssh/ssh_host_ed25519_key

[Service]
Type=oneshot
ExecStart=/usr/bin/ssh-keygen -A

[Install]
WantedBy=multi-user.target
UNIT
in_root systemctl enable ssh-host-keys.service >/dev/null 2>&1
: > "$ROOT/etc/machine-id"
rm -f "$ROOT/var/lib/dbus/machine-id"
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
  cp /usr/local/share/ca-certificates/*.crt "$ROOT/usr/local/share/ca-certificates/"
  in_root update-ca-certificates >/dev/null 2>&1
fi
# GRUB reads /vmlinuz and /initrd.img, the links Debian's kernel packages keep to the newest
# kernel, so a kernel upgraded in the guest boots next time without a bootloader in the box.
mkdir -p "$ROOT/boot/grub"
cat > "$ROOT/boot/grub/grub.cfg" <<GRUB
set timeout=1
insmod part_msdos
insmod ext2
search --no-floppy --label --set=root $LABEL
menuentry "Debian GNU/Linux ($SUITE)" {
  linux /vmlinuz root=LABEL=$LABEL ro net.ifnames=0 console=tty0 console=ttyS0,115200n8
  initrd /initrd.img
}
GRUB
in_root apt-get clean
rm -rf "$ROOT"/var/lib/apt/lists/*_Packages "$ROOT"/var/log/*.log "$ROOT/etc/resolv.conf"
t2=$(date +%s)

# A 20 GB disk (sparse): an MBR with one ext4 partition from 1 MiB holding the root, made in
# the file itself (mkfs's offset: no loop device, no mount), and GRUB's boot sector in the MBR
# with its core image (prefix: the partition's /boot/grub) in the gap after it: sector 1, where
# GRUB's boot sector looks for it by default (what grub-install does on a real disk).
truncate -s "${DISK_GB}G" "$WORK/disk.raw"
echo 'start=2048, type=83, bootable' | timeout 60 sfdisk -q "$WORK/disk.raw"
mkdir -p "$ROOT/boot/grub/i386-pc"
cp /usr/lib/grub/i386-pc/*.mod /usr/lib/grub/i386-pc/*.lst "$ROOT/boot/grub/i386-pc/"
timeout 600 mkfs.ext4 -q -L "$LABEL" -E offset=$((2048 * 512)) -d "$ROOT" "$WORK/disk.raw" $((DISK_GB * 1024 * 1024 - 1024))k
timeout 60 grub-mkimage -O i386-pc -d /usr/lib/grub/i386-pc -o "$WORK/core.img" -p '(hd0,msdos1)/boot/grub' \
  biosdisk part_msdos ext2 normal
[ "$(stat -c %s "$WORK/core.img")" -lt $((2047 * 512)) ] || { echo "box: GRUB's core image does not fit before the partition" >&2; exit 1; }
dd if=/usr/lib/grub/i386-pc/boot.img of="$WORK/disk.raw" bs=446 count=1 conv=notrunc status=none
dd if="$WORK/core.img" of="$WORK/disk.raw" bs=512 seek=1 conv=notrunc status=none
timeout 600 qemu-img convert -O qcow2 "$WORK/disk.raw" "$WORK/box.img"
printf '{"provider": "libvirt", "format": "qcow2", "virtual_size": %d}\n' "$DISK_GB" > "$WORK/metadata.json"
tar -C "$WORK" -cf "$WORK/out.box" metadata.json box.img
mv "$WORK/out.box" "$OUT"
t3=$(date +%s)
echo "box: done in $((t3 - t0)) s (debootstrap $((t1 - t0)) s, system $((t2 - t1)) s, disk $((t3 - t2)) s): $OUT ($(du -h "$OUT" | cut -f1))"
