#!/usr/bin/env bash
# One-step, idempotent set-up for testbed on Debian 12 / Ubuntu 22.04 / 24.04 (run as root).
#   sudo bash testbed/setup.sh
# Installs the system tools (Mininet's mnexec, iperf3, iproute2, ethtool, bridge-utils, ping,
# gcc for the user-space delay relay, python-is-python3), the Python dependencies for the
# python3 on PATH (paramiko is deploy's SSH client: no ssh binary is needed; sudo's `python`
# finds that interpreter), sets the sysctls a Linux bridge needs, and builds the delay relay.
# A second run changes nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if [ "$(id -u)" -ne 0 ]; then
  echo "setup.sh: run as root (sudo bash testbed/setup.sh)" >&2
  exit 2
fi

APT_PKGS="mininet iperf3 iproute2 ethtool bridge-utils iputils-ping net-tools procps psmisc gcc libc6-dev python3 python3-pip python3-venv python-is-python3"
missing=""
for p in $APT_PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  echo "setup: installing system packages:$missing"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends $missing >/dev/null
else
  echo "setup: system packages present"
fi

# Python packages for the interpreter that will run `python3 -m testbed`
if ! "$PY" - <<'PYEOF' 2>/dev/null
import importlib.metadata as m, sys
need = {"numpy": "1.24", "networkx": "2.8", "scipy": "1.10", "PyYAML": "6.0", "pytest": "7.0", "mininet": "2.3",
        "matplotlib": "3.5", "paramiko": "3.2", "pymetis": "2023.1"}
for name in need:
    m.version(name)
import mininet.nodelib, numpy, networkx, scipy.optimize, yaml, matplotlib, paramiko, pymetis  # noqa
PYEOF
then
  echo "setup: installing Python packages for $("$PY" -c 'import sys; print(sys.executable)')"
  PIP=("$PY" -m pip install -q --disable-pip-version-check --root-user-action=ignore)
  REQS=(numpy networkx scipy pyyaml pytest mininet matplotlib "paramiko>=3.2" pymetis)
  # Debian/Ubuntu mark the system interpreter "externally managed" (PEP 668); this is a
  # root tool on a dedicated machine/VM, so install beside apt's packages there.
  "${PIP[@]}" "${REQS[@]}" 2>/dev/null || "${PIP[@]}" --break-system-packages "${REQS[@]}"
else
  echo "setup: Python packages present"
fi

# `sudo python -m testbed ...` (the README's command) must start the interpreter the packages
# were installed for: resolve `python` and `python3` as sudo does (its secure_path, when
# set) and, where one resolves to another interpreter, link /usr/local/bin/NAME (first on
# Debian's and Ubuntu's secure_path) to ours -- never replacing a file someone else put there.
ident='import sys; print(sys.prefix, *sys.version_info[:2])'   # same prefix + version: same packages
PYID=$("$PY" -c "$ident")
PYEXE=$("$PY" -c 'import sys; print(sys.executable)')
SUDO_PATH=$PATH
if command -v sudo >/dev/null; then
  sp=$(cat /etc/sudoers /etc/sudoers.d/* 2>/dev/null | sed -n 's/^Defaults[[:space:]]\+secure_path[[:space:]]*=[[:space:]]*"\?\([^"]*\)"\?.*/\1/p' | tail -1)
  SUDO_PATH=${sp:-$PATH}
fi
interp() { PATH=$SUDO_PATH "$1" -c "$ident" 2>/dev/null; }
for name in python python3; do
  [ "$(interp $name)" = "$PYID" ] && continue
  link=/usr/local/bin/$name
  if [ ! -e "$link" ] || [ -L "$link" ]; then
    ln -sfn "$PYEXE" "$link"
    echo "setup: $link -> $PYEXE (so that sudo $name finds the interpreter with the packages)"
  fi
  [ "$(interp $name)" = "$PYID" ] || echo "setup: WARNING: 'sudo $name' does not run $PYEXE, which has the packages: use 'sudo $PYEXE -m testbed'" >&2
done

# Linux bridge must not pass frames through iptables (Mininet's LinuxBridge needs this)
conf=/etc/sysctl.d/90-testbed.conf
want="net.bridge.bridge-nf-call-iptables = 0
net.bridge.bridge-nf-call-ip6tables = 0
net.bridge.bridge-nf-call-arptables = 0"
if [ "$(cat $conf 2>/dev/null)" != "$want" ]; then
  echo "$want" > $conf
fi
for t in ip ip6 arp; do
  f=/proc/sys/net/bridge/bridge-nf-call-${t}tables
  [ -e "$f" ] && [ "$(cat "$f")" != 0 ] && echo 0 > "$f"
done

# the user-space delay relay (used where the kernel has no netem)
"$PY" -c "from testbed.emulator.relay import build; print('setup: relay', build())"
"$PY" -m testbed doctor || true
echo "setup: done"
