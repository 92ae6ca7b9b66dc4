"""The WAN emulator: capabilities, shaping, network, relay, dynamics, linkcheck, cleanup."""

# TCP congestion control of the emulated hosts unless an experiment says otherwise
# (``emulator.tcp_cc``); never the machine's own default, so results do not depend on it.
DEFAULT_TCP_CC = "cubic"
