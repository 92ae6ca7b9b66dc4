"""The shaping-method table (testbed/emulator/shaping.py) and what reads it, without a network."""

import dataclasses
import subprocess

from testbed.emulator import shaping
from testbed.emulator.capabilities import Capabilities
from testbed.topology import LinkDir


def caps(**over) -> Capabilities:
    base = dict(root=True, mnexec=True, mininet_python=True, netns=True, htb=True, netem=True, linux_bridge=True,
                bridge_nf_off=True, iperf3=True, ping=True, ethtool=True, gcc=True, kernel="x", notes=[])
    return Capabilities(**{**base, **over})


def test_auto_prefers_kernel_netem_then_the_relay_then_nothing():
    assert caps().shaping_method == "netem"
    assert caps(netem=False).shaping_method == "relay"
    assert caps(netem=False, gcc=False).shaping_method is None
    assert caps(htb=False).shaping_method is None
    assert shaping.missing("netem", caps(netem=False)) == ["netem"]
    assert shaping.missing("relay", caps(ethtool=False, netem=False)) == ["ethtool"]


def test_relay_links_without_delay_jitter_or_loss_are_plain_htb():
    plain, lossy = LinkDir(10.0), LinkDir(10.0, loss=0.01)
    assert shaping.link_method("relay", (plain, plain)) == "htb"
    assert shaping.link_method("relay", (plain, lossy)) == "relay"
    assert shaping.link_method("netem", (plain, plain)) == "netem"


def test_every_method_has_its_leaf_and_label():
    d = LinkDir(10.0, 5.0, 1.0, 0.01, queue_pkts=50)
    for m in shaping.METHODS.values():
        leaf = shaping.shape_commands("eth0", d, m.name)[3]
        assert leaf[leaf.index("10:") + 1] == m.leaf
    assert [m.label for m in shaping.METHODS.values()] == ["htb+netem", "htb+user-space-relay", "htb"]


def test_config_and_cli_offer_the_selectable_methods():
    assert shaping.CHOICES == ("auto", "netem", "relay")
    out = subprocess.run(["python3", "-m", "testbed", "linkcheck", "--help"], capture_output=True, text=True).stdout
    assert "{auto,netem,relay}" in out
    assert dataclasses.is_dataclass(shaping.METHODS["htb"]) and not shaping.METHODS["htb"].selectable


def test_netem_keeps_jittered_packets_in_fifo_order_as_the_relay_does():
    """netem sorts by due time, so jitter alone reorders; with a rate it dates each packet from
    the one before (FIFO).  That rate is FIFO_RATE_FACTOR x the link's, only where there is jitter."""
    leaf = shaping.shape_commands("eth0", LinkDir(40.0, 20.0, 2.0, 0.01, queue_pkts=100), "netem")[3]
    assert leaf[leaf.index("distribution"):leaf.index("loss")] == [
        "distribution", "normal", "rate", shaping._rate(shaping.FIFO_RATE_FACTOR * 40.0)]
    steady = shaping.shape_commands("eth0", LinkDir(40.0, 20.0, 0.0, 0.01, queue_pkts=100), "netem")[3]
    assert "rate" not in steady  # a constant delay keeps the order by itself


def test_where_a_lost_packet_is_dropped_is_one_field_of_the_table():
    """The relay drops after HTB (a lost packet used the rate), netem at enqueue, before it."""
    assert {k: m.loss_takes_rate for k, m in shaping.METHODS.items()} == {"netem": False, "relay": True, "htb": True}


def test_a_frame_is_frame_ms_of_the_rate_within_two_packets_and_64_kb():
    assert shaping.frame_bytes(50, 4) == 25000
    assert shaping.frame_bytes(1, 4) == 2 * (shaping.MTU + 14)
    assert shaping.frame_bytes(1000, 4) == shaping.GSO_MAX_BYTES
    assert shaping.frame_commands("x", 50, 4) == [["ip", "link", "set", "dev", "x", "gso_max_size", "25000"]]
    assert shaping.frame_commands("x", 50, 0) == []
    assert [m.name for m in shaping.METHODS.values() if m.sized_frames] == ["relay", "htb"]  # byte queues
