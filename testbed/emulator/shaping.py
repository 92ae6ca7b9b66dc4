"""Link-shaping methods (one table, :data:`METHODS`) and the tc commands that shape one
direction of a WAN link at the sender's egress.

Rate is an HTB class (so it can be changed live with ``tc class change``); under it a leaf
qdisc that depends on the method:

* ``netem``: a netem qdisc for delay, jitter and loss.  Its ``limit`` holds the sender
  queue plus every packet in flight on the emulated wire (bandwidth-delay product).  Made to
  model the link the relay models (measured in the Debian guest, docs/measurements/emulator-log.md "The
  netem path's lossy and jittery links"): jitter keeps FIFO order (:func:`_leaf`) and a lossy
  direction's sender sends one segment per packet (``network``: ``gso_max_segs 1``), so netem,
  which drops whole packets, loses segments one by one, not a TSO frame's several at once.
  One difference stays: netem drops at enqueue, before HTB's rate, so a lost packet takes none
  of the link's rate (``Method.loss_takes_rate``).
* ``relay``: a byte-limited FIFO (``queue_pkts`` full-size frames; offloads stay on in this
  mode, so one queued skb may be a 64 KB GSO super-frame and a packet count would be no
  limit at all); delay, jitter and loss are added afterwards by the user-space relay in the
  middle of the link (see ``relay/``);
* ``htb``: the same FIFO on a link without delay, jitter or loss (no relay needed); chosen
  per link in relay mode, never asked for.

Either way the queue a TCP sender fills is the HTB leaf at its own host, as it would be
at a WAN router's egress, and its size is the link's ``queue_pkts``.  Unlike a router's, it
counts against the sender's TCP small-queue budget, which netem (``skb_orphan_partial``)
releases and HTB's ``bfifo`` does not: through the relay, a frame waiting in it can hold back
a lost segment's retransmission until the retransmission timer (docs/guides/link-fidelity.md).

Frames: TCP hands the qdisc segment trains (TSO/GSO frames) that leave HTB whole and are
delayed whole, so a frame's bytes arrive together, its last ones up to the frame's time on
the link early.  Left to itself, Linux sizes a frame to ~1 ms of the flow's pacing rate,
which makes ~1,000 frames (and as many ACKs) per second on every busy link direction
whatever its rate: the emulation's cost (a relay or netem, and the receivers' stack) is per
frame.  ``emulator.frame_ms`` sizes them by time instead: each direction's sender gets a
``gso_max_size`` of ``frame_ms`` of the link's rate (:func:`frame_commands`) and TCP fills
frames up to it (``network``: ``tcp_tso_rtt_log``).  A choice of timing granularity against
emulation cost: larger frames move fewer packets and arrive coarser.  Only where the sender's
queue is a byte limit (``Method.sized_frames``): netem's limit counts packets, so a queue of
larger frames would hold more bytes; a netem network keeps the kernel's sizing.  Config validation,
the CLI's choices, ``doctor``, capability selection and :class:`.network.WanNetwork` all
read :data:`METHODS`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from testbed.emulator import jitter
from testbed.topology import LinkDir

MTU = 1500
FRAME_MS = 4.0  # emulator.frame_ms: the longest a link direction spends on one TCP frame
GSO_MAX_BYTES = 65536  # the largest TCP frame without BIG TCP


@dataclass(frozen=True)
class Method:
    """One way to shape a link direction."""

    name: str  # emulator.method / --method value
    label: str  # what results.json and linkcheck.json call it
    leaf: str  # qdisc under the HTB rate class: "netem" or "bfifo"
    relay: bool  # delay, jitter and loss come from the user-space relay
    selectable: bool  # a user may ask for it (else chosen per link)
    loss_takes_rate: bool  # a lost packet used the link's rate (dropped after HTB), else before
    sized_frames: bool  # emulator.frame_ms applies: the sender queue's limit counts bytes, whatever the frames
    requires: tuple[str, ...]  # Capabilities fields that must all be true
    description: str  # for doctor


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("netem", "htb+netem", "netem", False, True, False, False, ("root", "netns", "htb", "netem"),
           "HTB rate + netem delay/jitter/loss (kernel)"),
    Method("relay", "htb+user-space-relay", "bfifo", True, True, True, True,
           ("root", "netns", "htb", "gcc", "ethtool"),
           "HTB rate + user-space delay relay for delay/jitter/loss (no netem in this kernel)"),
    Method("htb", "htb", "bfifo", False, False, True, True, ("root", "netns", "htb"),
           "HTB rate alone (a link without delay, jitter or loss)"),
)}
CHOICES = ("auto", *(m.name for m in METHODS.values() if m.selectable))  # emulator.method values


def missing(method: str, caps) -> list[str]:
    """The capabilities ``method`` needs that ``caps`` lacks."""
    return [r for r in METHODS[method].requires if not getattr(caps, r)]


def choose(caps) -> str | None:
    """``auto``: the first selectable method (table order: kernel netem first) this machine
    can do, or None."""
    return next((m.name for m in METHODS.values() if m.selectable and not missing(m.name, caps)), None)


def link_method(method: str, dirs) -> str:
    """The method of one link under ``method``: a relay method needs no relay on a link
    whose directions ``dirs`` have no delay, jitter or loss (then ``htb``)."""
    if METHODS[method].relay and not any(d.delay_ms or d.jitter_ms or d.loss for d in dirs):
        return "htb"
    return method


def _rate(mbps: float) -> str:
    return f"{max(mbps, 0.001) * 1000:.3f}kbit"


def htb_class_args(rate_mbps: float) -> list[str]:
    # burst: ~1 ms at the link rate, at least a few MTUs, so HTB is accurate at high rates
    burst = max(4 * MTU, int(rate_mbps * 1e6 / 8 / 1000))
    return ["rate", _rate(rate_mbps), "ceil", _rate(rate_mbps),
            "burst", str(burst), "cburst", str(burst), "quantum", str(MTU + 14)]


def netem_limit(d: LinkDir) -> int:
    """netem's packet limit: ``queue_pkts`` plus the full-size frames on the emulated wire at
    the link rate.  On average (Little's law; the jitter's mean is zero) ``rate x delay`` of
    them are in flight, so the standing queue is ``queue_pkts`` to half a frame.  (Counting
    3 jitter sigmas and rounding up, as before, made it up to 15 % longer: measured in the VM.)"""
    return d.queue_pkts + round(d.rate_mbps * 1e6 / 8 * d.delay_ms / 1e3 / (MTU + 14))


# netem's own rate where it only keeps FIFO order (:func:`_leaf`): this many times the link's,
# so each packet gains 1/1000 of its time at the link rate
FIFO_RATE_FACTOR = 1000


def _leaf(d: LinkDir, method: str) -> list[str]:
    """The leaf qdisc's argv tail.  Delay and jitter as :mod:`.jitter` defines them: netem's
    ``delay MU SIGMA distribution T`` from the direction's mean, standard deviation and
    distribution (:func:`.jitter.netem_params`; ``uniform`` is netem's own, no table).
    netem sorts its packets by due time, so jitter reorders them (TCP counted 2593
    reorderings in 8 s at 40 Mbit/s, 2 ms jitter); given a ``rate``, netem dates each packet
    from the one before it instead, due = max(previous due, arrival + delay + jitter) + its
    time at that rate (sch_netem.c, netem_enqueue): FIFO, as the relay (tbrelay.c: real WAN
    paths very rarely reorder) -- 0 reorderings.  That rate is FIFO_RATE_FACTOR x the link's,
    HTB above still shapes."""
    if method not in METHODS:
        raise ValueError(f"unknown shaping method {method!r}")
    if METHODS[method].leaf == "bfifo":
        return ["bfifo", "limit", str(d.queue_pkts * (MTU + 14))]
    leaf = ["netem", "limit", str(netem_limit(d))]
    if d.delay_ms and not d.jitter_ms:
        leaf += ["delay", f"{d.delay_ms}ms"]
    elif d.jitter_ms:
        mu, sigma = jitter.netem_params(d.delay_ms, d.jitter_ms, d.distribution)
        leaf += ["delay", f"{mu * 1e3:.3f}us", f"{sigma * 1e3:.3f}us",
                 *(["distribution", d.distribution] if jitter.table_path(d.distribution) else []),
                 "rate", _rate(FIFO_RATE_FACTOR * d.rate_mbps)]
    if d.loss:
        leaf += ["loss", f"{d.loss * 100:.6f}%"]
    return leaf


def shape_commands(intf: str, d: LinkDir, method: str, icmp_priority: bool = False) -> list[list[str]]:
    """tc argv lists that shape the egress of ``intf`` as direction ``d``.

    Classes: 1:1 holds the link rate; 1:10 (default) is the bulk queue under it.  With
    ``icmp_priority`` (used by ``linkcheck`` only) ICMP goes to a strict-priority sibling
    1:20 with its own small queue, so ``ping`` under full load measures propagation plus
    emulator delay instead of the bulk queue's queueing delay; it still shares the rate.
    """
    q = ["tc", "qdisc", "replace", "dev", intf]
    c = ["tc", "class", "replace", "dev", intf]
    cmds = [
        [*q, "root", "handle", "1:", "htb", "default", "10"],
        [*c, "parent", "1:", "classid", "1:1", "htb", *htb_class_args(d.rate_mbps)],
        [*c, "parent", "1:1", "classid", "1:10", "htb", *htb_class_args(d.rate_mbps), "prio", "1"],
        [*q, "parent", "1:10", "handle", "10:", *_leaf(d, method)],
    ]
    if icmp_priority:
        probe = replace(d, queue_pkts=100)
        cmds += [
            [*c, "parent", "1:1", "classid", "1:20", "htb", *htb_class_args(d.rate_mbps), "prio", "0"],
            [*q, "parent", "1:20", "handle", "20:", *_leaf(probe, method)],
            ["tc", "filter", "replace", "dev", intf, "parent", "1:", "protocol", "ip", "prio", "1",
             "u32", "match", "ip", "protocol", "1", "0xff", "flowid", "1:20"],
        ]
    return cmds


def rate_change_commands(intf: str, rate_mbps: float, icmp_priority: bool = False) -> list[list[str]]:
    """Change the rate of an already shaped direction, live (queues are kept)."""
    classes = ["1:1", "1:10"] + (["1:20"] if icmp_priority else [])
    return [["tc", "class", "change", "dev", intf, "classid", cid, "htb", *htb_class_args(rate_mbps)]
            for cid in classes]


def frame_bytes(rate_mbps: float, frame_ms: float) -> int:
    """The largest TCP frame a direction's sender hands its qdisc: ``frame_ms`` of the link's
    rate, at least two full-size packets and at most :data:`GSO_MAX_BYTES`."""
    return int(min(GSO_MAX_BYTES, max(2 * (MTU + 14), rate_mbps * 125 * frame_ms)))


def frame_commands(intf: str, rate_mbps: float, frame_ms: float) -> list[list[str]]:
    """Cap the frames TCP hands ``intf`` at :func:`frame_bytes` (``gso_max_size``); none with
    ``frame_ms`` 0 (the kernel's own sizing)."""
    return [["ip", "link", "set", "dev", intf, "gso_max_size", str(frame_bytes(rate_mbps, frame_ms))]] \
        if frame_ms else []


def standing_queue_ms(d: LinkDir, method: str, frame_bytes: int, probe_bytes: int) -> float:
    """Queueing delay (ms) a packet of ``probe_bytes`` sees on arrival at a full sender queue
    of ``frame_bytes`` frames, beyond the direction's mean delay.  The queue drops at its tail,
    so an arrival gets in only while it fits: ahead of it is the most that leaves room for it.
    The relay/htb leaf is a byte FIFO of ``queue_pkts`` full-size frames; netem's limit counts
    packets (:func:`netem_limit`) -- ``limit - 1`` ahead, of which ``rate x delay`` are on the
    emulated wire.  (Measured in the VM, netem: the probes read one frame less than
    ``netem_limit`` frames, on every link.)  Jitter: the frames leave the queue one frame's
    time apart, and FIFO order holds each to the latest due time before it
    (:func:`.jitter.fifo_cdf`), a median ``shift`` above the mean delay: the relay adds it
    after the queue; netem dates a packet as it enters the queue, so the queue hides it where
    it is the longer (the delay is the later of the two)."""
    frame_ms = frame_bytes * 8 / (d.rate_mbps * 1e3)
    shift = float(jitter.quantiles([0.5], d.delay_ms, d.jitter_ms, d.distribution, frame_ms)[0]) - d.delay_ms \
        if d.jitter_ms else 0.0
    if METHODS[method].leaf == "bfifo":
        return (d.queue_pkts * (MTU + 14) - probe_bytes) // frame_bytes * frame_ms + shift
    return max((netem_limit(d) - 1) * frame_ms - d.delay_ms, shift)
