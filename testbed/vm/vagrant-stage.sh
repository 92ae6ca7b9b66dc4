#!/usr/bin/env bash
# The Vagrant stage: the Vagrantfile's libvirt path run for real, as a user types it.
#   bash testbed/vm/vagrant-stage.sh validate   # `vagrant validate` (seconds)
#   bash testbed/vm/vagrant-stage.sh cycle      # box, up, quickstart, destroy (17-22 min, 2 cores, TCG)
#   bash testbed/vm/vagrant-stage.sh clean      # remove what an interrupted cycle left
# A cycle, from a clean state:
#   1. the box: testbed/vm/box.sh (Debian's packages; this host cannot download
#      debian/bookworm64), cached in $TESTBED_VAGRANT_CACHE (default /var/cache/testbed-vagrant)
#      while box.sh, debootstrap.sh, Vagrant's insecure key and the host's local CAs are unchanged;
#   2. vagrant box add --name debian/bookworm64 BOX           (the step a user with network skips)
#      vagrant up --provider=libvirt                          (provisioning: testbed/setup.sh)
#      vagrant ssh -c 'cd /vagrant && sudo python -m testbed run experiments/quickstart.yaml'
#      vagrant destroy -f
#      in the checkout, with the Vagrantfile unchanged and TESTBED_LIBVIRT_DRIVER=qemu (TCG: this
#      machine's /dev/kvm is nested and slower than TCG; see testbed/vm/__init__.py);
#   3. quickstart's results.json (copied out of the guest): every run correct, every link
#      htb+netem; after destroy no domain, network or volume of the cycle is left.
# The sandbox: libvirt's NAT network for the guest needs IP forwarding, a global sysctl this
# machine must keep (other work shares it), so libvirtd (with virtlogd, dnsmasq and qemu under
# it) and vagrant run in a network namespace of their own, whose way out is slirp4netns (a
# user-space TCP/IP stack: no forwarding, no firewall rule on the host); there libvirt forwards
# and masquerades as on a user's machine.  The guest reaches Debian's mirror and PyPI only.
# vagrant's own state (VAGRANT_HOME) lives in the stage's state folder.  `clean` (also run
# before a cycle, and on exit, interrupt or termination) destroys the domains and networks,
# deletes the volumes and the storage pool the cycle made, stops every process of the
# namespace (all of them the stage's), deletes the namespace and the state.
# Every step runs under a deadline; the exit code is 0 only if every step passed.
set -uo pipefail
export PATH=$PATH:/usr/sbin:/sbin
REPO=$(cd "$(dirname "$0")/../.." && pwd)
NS=vagrantbed                      # not tb*: `testbed clean` owns those names
STATE=/run/testbed-vagrant         # pids, VAGRANT_HOME, what the cycle created
CACHE=${TESTBED_VAGRANT_CACHE:-/var/cache/testbed-vagrant}
HOST_PKGS="vagrant vagrant-libvirt libvirt-daemon-system libvirt-daemon-system-sysv libvirt-clients qemu-system-x86 qemu-utils dnsmasq-base slirp4netns debootstrap fdisk grub-pc-bin grub-common"
UP_TIMEOUT_S=${TESTBED_VAGRANT_UP_TIMEOUT:-2400}
RUN_TIMEOUT_S=${TESTBED_VAGRANT_RUN_TIMEOUT:-1500}
VERB=${1:?usage: vagrant-stage.sh validate|cycle|clean}

log() { echo "== vagrant stage: $*"; }
stamp() {  # each line with the time; of a progress bar (redrawn after CRs) only its last state
  local l; while IFS= read -r l; do l=${l##*$'\r'}; printf '[%(%T)T] %s\n' -1 "${l//$'\e[K'/}"; done
}
IN_NS=(ip netns exec "$NS" env VAGRANT_HOME="$STATE/vagrant.d" TESTBED_LIBVIRT_DRIVER=qemu)  # a command as the user types it
virsh_ns() { timeout 60 ip netns exec "$NS" virsh -q -c qemu:///system "$@"; }

install_host_packages() {  # [PACKAGE ...]: these (default: all a cycle needs), if missing
  local missing="" p
  for p in ${*:-$HOST_PKGS}; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
  done
  [ -z "$missing" ] && return 0
  log "installing host packages:$missing"
  export DEBIAN_FRONTEND=noninteractive
  timeout 600 apt-get update -qq && timeout 900 apt-get install -y -qq --no-install-recommends $missing >/dev/null
}

validate() {  # needs vagrant and the provider plugin only: no libvirt daemon, qemu or box tools
  install_host_packages vagrant vagrant-libvirt || return 1
  local home; home=$(mktemp -d)
  (cd "$REPO" && VAGRANT_HOME=$home timeout 120 vagrant validate); local rc=$?
  rm -rf "$home"
  return $rc
}

box_file() {  # the cached box for these inputs, built if missing (older ones removed)
  local key f
  key=$( { cat "$REPO/testbed/vm/box.sh" "$REPO/testbed/vm/debootstrap.sh"
           cat /usr/share/rubygems-integration/all/gems/vagrant-*/keys/vagrant.pub 2>/dev/null
           cat /usr/local/share/ca-certificates/*.crt 2>/dev/null; echo "${TESTBED_VM_SUITE:-bookworm}"; } \
         | sha256sum | cut -c1-16)
  f=$CACHE/$key/debian-bookworm64.box
  if [ ! -f "$f" ]; then
    log "building the box (testbed/vm/box.sh) into $f" >&2
    timeout --kill-after=30 1800 bash "$REPO/testbed/vm/box.sh" "$f" >&2 || { rm -rf "${CACHE:?}/$key"; return 1; }
  else
    log "cached box $f" >&2
  fi
  find "$CACHE" -mindepth 1 -maxdepth 1 -type d ! -name "$key" ! -name '.*' -exec rm -rf {} +
  echo "$f"
}

sandbox_up() {
  if pgrep -x libvirtd >/dev/null || pgrep -x virtqemud >/dev/null; then
    echo "vagrant stage: a libvirt daemon already runs on this host; this stage runs its own in a network namespace: stop that one first" >&2
    return 1
  fi
  mkdir -p "$STATE/vagrant.d" "/etc/netns/$NS"
  [ -e "$REPO/.vagrant" ] || touch "$STATE/made-dot-vagrant"
  ip netns add "$NS" && ip -n "$NS" link set lo up || return 1
  echo "nameserver 10.0.2.3" > "/etc/netns/$NS/resolv.conf"   # slirp4netns's DNS
  slirp4netns --configure --mtu=65520 --disable-host-loopback --netns-type=path "/run/netns/$NS" tap0 \
    > "$STATE/slirp4netns.log" 2>&1 &
  echo $! > "$STATE/slirp4netns.pid"
  local i
  for i in $(seq 100); do ip -n "$NS" -4 addr show tap0 2>/dev/null | grep -q 10.0.2.100 && break; sleep 0.1; done
  ip -n "$NS" -4 addr show tap0 2>/dev/null | grep -q 10.0.2.100 || { echo "vagrant stage: slirp4netns did not configure tap0" >&2; return 1; }
  ip netns exec "$NS" virtlogd -d || return 1
  ip netns exec "$NS" libvirtd -d || return 1
  for i in $(seq 60); do virsh_ns version >/dev/null 2>&1 && break; sleep 1; done
  virsh_ns version >/dev/null 2>&1 || { echo "vagrant stage: libvirtd did not answer within 60 s" >&2; return 1; }
  virsh_ns pool-info default >/dev/null 2>&1 || touch "$STATE/made-pool"
  virsh_ns net-list --all --name > "$STATE/networks-before"
}

clean() {
  [ -d "$STATE" ] || ip netns list | grep -qw "$NS" || return 0
  log "clean"
  local d n v pid
  if pid=$(cat "$STATE/step.pid" 2>/dev/null) && kill -TERM "$pid" 2>/dev/null; then  # an interrupted step
    for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -KILL "$pid" 2>/dev/null
  fi
  if ip netns list | grep -qw "$NS" && virsh_ns version >/dev/null 2>&1; then
    if [ -d "$REPO/.vagrant/machines/default/libvirt" ] && [ -n "$(ls "$REPO/.vagrant/machines/default/libvirt" 2>/dev/null)" ]; then
      (cd "$REPO" && "${IN_NS[@]}" timeout 300 vagrant destroy -f >/dev/null 2>&1)
    fi
    for d in $(virsh_ns list --all --name); do
      virsh_ns destroy "$d" >/dev/null 2>&1; virsh_ns undefine "$d" --remove-all-storage --nvram >/dev/null 2>&1
      echo "vagrant stage: clean: removed domain $d"
    done
    for n in $(virsh_ns net-list --all --name); do
      virsh_ns net-destroy "$n" >/dev/null 2>&1
      # undefined: the networks the cycle made (vagrant-libvirt's); the host's own stay defined
      if [ "$n" = vagrant-libvirt ] || { [ -f "$STATE/networks-before" ] && ! grep -qx "$n" "$STATE/networks-before"; }; then
        virsh_ns net-undefine "$n" >/dev/null 2>&1; echo "vagrant stage: clean: removed network $n"
      fi
    done
    if [ -e "$STATE/made-pool" ]; then
      for v in $(virsh_ns vol-list default 2>/dev/null | awk '{print $1}'); do
        virsh_ns vol-delete "$v" --pool default >/dev/null 2>&1 && echo "vagrant stage: clean: deleted volume $v"
      done
      virsh_ns pool-destroy default >/dev/null 2>&1; virsh_ns pool-undefine default >/dev/null 2>&1
    fi
  fi
  if ip netns list | grep -qw "$NS"; then  # every process in the namespace is the stage's
    for pid in $(ip netns pids "$NS"); do kill -TERM "$pid" 2>/dev/null; done
    for _ in $(seq 20); do [ -z "$(ip netns pids "$NS")" ] && break; sleep 0.5; done
    for pid in $(ip netns pids "$NS"); do kill -KILL "$pid" 2>/dev/null; done
    ip netns del "$NS"
  fi
  pid=$(cat "$STATE/slirp4netns.pid" 2>/dev/null) && kill "$pid" 2>/dev/null
  [ -e "$STATE/made-dot-vagrant" ] && rm -rf "$REPO/.vagrant"
  rm -rf "/etc/netns/$NS" "$STATE" /run/libvirtd.pid /run/virtlogd.pid
  rmdir /etc/netns 2>/dev/null  # if the stage made it
  return 0
}

left_over() {  # what a cycle or its clean left behind (empty: nothing)
  local f left=()
  ip netns list | grep -qw "$NS" && left+=("network namespace $NS")
  for f in /etc/libvirt/qemu/*.xml /etc/libvirt/storage/*.xml /var/lib/libvirt/images/* "$STATE"; do
    [ -e "$f" ] && left+=("$f")
  done
  for f in /etc/libvirt/qemu/networks/*.xml; do  # the host's own networks stay defined
    [ -e "$f" ] && ! grep -qx "$(basename "$f" .xml)" "$1" 2>/dev/null && left+=("$f")
  done
  sleep 2  # processes just ended are reaped; a zombie is no process left running
  for f in $(ps -eo stat=,comm= | awk '$1 !~ /^Z/ && $2 ~ /^(libvirtd|virtlogd|qemu-system-x86|dnsmasq|slirp4netns)/ {print $2}' | sort -u); do
    left+=("a $f process")
  done
  [ -e "$REPO/.vagrant" ] && [ -e "$1.made-dot-vagrant" ] && left+=("$REPO/.vagrant")
  echo "${left[*]}"
}

cycle() {
  local failed=() t box r
  step() {  # step NAME COMMAND...
    local name=$1 t0=$SECONDS; shift
    log "$name"
    "$@" > >(stamp) 2>&1 &   # in the background: a signal to the stage is handled at once (clean stops the step)
    echo $! > "$STATE/step.pid"
    if wait $!; then log "$name: ok ($((SECONDS - t0)) s)"; else log "$name: FAILED ($((SECONDS - t0)) s)"; failed+=("$name"); return 1; fi
  }
  step_plain() {  # a step once the state folder is gone
    local name=$1; shift
    if "$@"; then log "$name: ok"; else log "$name: FAILED"; failed+=("$name"); return 1; fi
  }
  local T0=$SECONDS
  clean
  mkdir -p "$STATE"
  trap 'clean; exit 130' INT TERM
  trap clean EXIT
  step "host packages" install_host_packages || return 1
  t=$SECONDS
  box=$(box_file) || { log "box: FAILED"; return 1; }
  log "box: ok ($((SECONDS - t)) s)"
  step "sandbox (network namespace $NS, slirp4netns, libvirtd)" sandbox_up || return 1
  cd "$REPO" || return 1
  step "vagrant box add --name debian/bookworm64" "${IN_NS[@]}" timeout 600 vagrant box add --name debian/bookworm64 "$box" || return 1
  if step "vagrant up --provider=libvirt" "${IN_NS[@]}" timeout --kill-after=60 "$UP_TIMEOUT_S" vagrant up --provider=libvirt; then
    step "vagrant ssh: quickstart" "${IN_NS[@]}" timeout --kill-after=30 "$RUN_TIMEOUT_S" \
      vagrant ssh -c 'cd /vagrant && sudo python -m testbed run experiments/quickstart.yaml'
    r=$STATE/quickstart-results.json
    "${IN_NS[@]}" timeout 120 vagrant ssh -c 'sudo cat "$(ls -td /vagrant/results/*/ | head -1)results.json"' \
      < /dev/null > "$r" 2> "$r.stderr" || sed 's/^/vagrant ssh (results.json): /' "$r.stderr"
    step "quickstart: every run correct, every link htb+netem" python3 -m testbed.vm check "$r"
  fi
  step "vagrant destroy -f" "${IN_NS[@]}" timeout 600 vagrant destroy -f
  local d; d=$(virsh_ns list --all --name)
  step "no domain left after destroy" test -z "$d" || echo "left: $d"
  # then what the user's machine keeps (the box, its image in libvirt's pool) goes too
  local before; before=$(mktemp); cp "$STATE/networks-before" "$before"
  [ -e "$STATE/made-dot-vagrant" ] && touch "$before.made-dot-vagrant"
  trap - INT TERM EXIT
  clean
  t=$(left_over "$before"); rm -f "$before" "$before.made-dot-vagrant"
  step_plain "nothing of the stage left (domains, networks, volumes, processes, namespace)" test -z "$t" || echo "left: $t"
  log "$((SECONDS - T0)) s; ${#failed[@]} step(s) failed${failed:+: ${failed[*]}}"
  [ ${#failed[@]} -eq 0 ]
}

main() {
  [ "$(id -u)" -eq 0 ] || { echo "vagrant-stage.sh: run as root (libvirtd, network namespace)" >&2; return 2; }
  case $VERB in
    validate) validate ;;
    cycle) cycle ;;
    clean) clean ;;
    *) echo "usage: vagrant-stage.sh validate|cycle|clean" >&2; return 2 ;;
  esac
}
main; exit $?   # one line: bash has read all it runs before it runs it
