#!/bin/bash
# PID 1 of the testbed guest (kernel command line init=/sbin/testbed-init), written into the
# image by build.sh.  Mounts what a Debian system has, takes the checkout and the command
# from the 9p share "xfer" that testbed/vm/__init__.py prepares, runs the command under a
# timeout from /root/testbed, writes its exit code to xfer/rc and powers off.  Output goes to
# the serial console, which the host streams.  If anything here fails the kernel panics on
# PID 1's exit and qemu (-no-reboot, panic=-1) exits: the host then reports "no exit code".
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8
export PYTHONUNBUFFERED=1 TERM=dumb
mnt() { mountpoint -q "$2" || { mkdir -p "$2"; mount -t "$1" "$1" "$2" ${3:+-o "$3"}; }; }
mnt proc /proc; mnt sysfs /sys; mnt devtmpfs /dev; mnt devpts /dev/pts; mnt tmpfs /dev/shm
mnt tmpfs /run; mnt tmpfs /tmp; mnt cgroup2 /sys/fs/cgroup
mount -o remount,rw / 2>/dev/null
hostname testbed-vm
ip link set lo up
modprobe 9pnet_virtio && modprobe 9p \
  && mount -t 9p -o trans=virtio,version=9p2000.L,msize=1048576 xfer /mnt/xfer \
  || { echo "testbed-init: cannot mount the 9p share 'xfer'"; echo o > /proc/sysrq-trigger; }
limit=$(cat /mnt/xfer/timeout)
mkdir -p /root/testbed /mnt/xfer/out && cd /root/testbed && tar xf /mnt/xfer/checkout.tar
echo "testbed-init: $(uname -r), $(nproc) CPU(s), booted in $(cut -d' ' -f1 /proc/uptime) s; running for at most ${limit} s:"
cat /mnt/xfer/cmd
timeout --kill-after=10 "$limit" bash /mnt/xfer/cmd
rc=$?
[ $rc -eq 124 ] && echo "testbed-init: the command timed out after ${limit} s"
echo "$rc" > /mnt/xfer/rc
sync
umount /mnt/xfer
echo o > /proc/sysrq-trigger
sleep 30
