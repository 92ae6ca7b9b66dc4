"""``testbed linkcheck``: are the emulated links what the topology says?

The verdict is about the emulated link, measured without depending on TCP's loss response
(cubic cannot fill a 60 ms path with 0.02 % random loss, so a cubic goodput check
measured cubic, not the link).  Per direction:

``single`` (link by link, nothing else on the link or its hosts; on a topology of more than
SINGLE_ROUNDS directions, directions of node-disjoint links are checked at the same time in
about SINGLE_ROUNDS rounds -- :func:`single_batches`, ``--parallel``):

* **delay, jitter, loss** -- an idle one-way UDP probe (:mod:`.probe`; all namespaces share
  the clock): the distribution of the one-way delay against the configured one
  (:mod:`.jitter`: ``delay_ms``, ``jitter_ms``, ``distribution``) by its median (``delay``)
  and its spread around it, below and above (``jitter``; :func:`owd_check`); lost probes vs
  ``loss`` by an exact binomial test.  Probes are spaced so that FIFO order holds one behind
  the one before it with probability <= 1e-3 (:func:`.jitter.fifo_free_spacing_ms`), what it
  does hold being in the expected values (:func:`.jitter.simulate`); a jittery direction is
  probed until JITTER_PROBES are sent (at most JITTER_PROBE_S).
* **rate and queue** -- iperf3 UDP at 1.5 x the rate fills the sender's queue: the goodput at
  the receiver (payload share 1468/1510 of the L2 rate HTB enforces, times the carried share) is the
  link rate, and probes sent through the same full queue measure delay under a standing queue
  vs what a probe finds ahead of it in a full queue of ``queue_pkts`` at that rate
  (:func:`testbed.emulator.shaping.standing_queue_ms`).  Where the queue never fills (iperf3's
  UDP stream set-up lost on a lossy link), load and probes start again (``UDP_START_TRIES``);
  where it did not stay full while the probes went (the queue's own counters: under
  ``QUEUE_FULL_OVERFLOW`` of the arrivals dropped for want of room, where a full one drops a
  third; a sender short of the rate), the queue is reported not measured.
* **TCP goodput** under the experiment's congestion control (``--tcp-cc``), informative only,
  with ping (ICMP in its own priority class, see ``shaping.shape_commands``) measuring the
  delay under that load.

``concurrent`` (every direction loaded at once: does the emulator keep up?): TCP goodput as
the rate, with BBR wherever a direction has random loss (its rate does not collapse on random
loss, so it measures the link) and the experiment's congestion control elsewhere; ping under
load.  UDP is not used here by default: at full load its per-packet cost (no GSO) measures the
emulation host's packet capacity, not what TCP experiments get (``load="udp"``, ``--load udp``:
every direction iperf3 UDP at 1.05 x its rate, the rate being the bytes its receiving
interface counted in one window common to all; ``bench emulator``'s HTB-only reference needs
it).  Where BBR replaced the experiment's congestion control, a second all-at-once pass
measures the informative TCP goodput under it.  TCP load comes from :mod:`.load`, one process
per datacenter (an iperf3 pair per direction made 564 processes on ``equinix-like-20``).

Pass rules: rate ratio = goodput / (rate x payload share x carried share) in [0.93, 1.02], the
payload share being what HTB's L2 rate leaves for payload (UDP 1468/1510, TCP 1448/1514; 1 for
the L2 bytes a receiving interface counts, ``--load udp``), the carried share 1 - loss through
the relay, 1 through netem, which drops before the rate (:func:`carried_share`); all at once
under TCP, a direction also carries the reverse flow's ACKs, which count as its bytes (their
sender's TCP_INFO ``segs_out``, ACK_FRAME bytes each): under BBR a fast flow's TSO frames are
small and ACKed one by one, about 0.4 Mbit/s of a 2.7 Mbit/s reverse direction (NetStorm's
h5->h4 at scale 0.1 read 0.88 by goodput alone, 1.00 with its ACKs); delay (median one-way idle;
RTT/2 under load): the median within max(1 ms, 3 %) + z(1e-3) of its standard deviations
for that many probes of the configured distribution (under load |delay - expected| <= max(1
ms, 3 %) + the distance from the mean to the top of the jitter's range, to which FIFO order
under load brings the delay); jitter: the mean absolute deviation from the median, the median
less the 10 % quantile and the 90 % quantile less the median, each within z(1e-3 / 3) of its
standard deviations + TIMING_MS (the probes' own timing); loss: binomial p-value
>= 1e-3; standing queue within max(2 ms, 5 %, one frame's time). CPU steal and load average are
recorded: a failure while the hypervisor or other work took the CPU says little about the
emulator.
"""

from __future__ import annotations

import json
import math
import os
import re
import select
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from scipy.stats import binomtest, norm

from testbed.emulator import DEFAULT_TCP_CC, jitter
from testbed.emulator.probe import SKIP
from testbed.emulator.shaping import METHODS, MTU, netem_limit, standing_queue_ms
from testbed.errors import RunError
from testbed.results import STEAL_MAX, CpuMeter, tcp_memory

RATE_OK = (0.93, 1.02)
LOSS_ALPHA = 1e-3  # two-sided binomial test level for measured vs configured loss
BASE_PORT = 5201
PROBE_PORT = 6201
PROBE_PPS = 2000  # idle probes a second (at most 25 % of the link rate, FIFO-free spacing under jitter)
JITTER_PROBES = 300  # idle probes a jittery direction gets at least (within JITTER_PROBE_S)
JITTER_PROBE_S = 15.0
OWD_ALPHA = 1e-3  # level of each of the delay and jitter checks
OWD_RUNS = 2000  # simulated probe streams giving the delay and jitter statistics their spread
TIMING_MS = 0.2  # the probes' own timing noise allowed on each spread (scheduling, timestamps)
PROBE_BYTES = 64  # UDP payload of a probe
PROBE_FRAME = PROBE_BYTES + 8 + 20 + 14  # what the queues count per probe
QUEUE_PROBES = 30  # standing-queue probes sent at least (a long queue's check runs longer to send them)
QUEUE_MIN_PROBES = 10  # fewer fit before the load ends: the queue is not measured
LOAD_END_MARGIN_S = 0.3  # the last probe enters the queue this long before the load can end
# iperf3's control connection sends fewer packets than this through the queue before its load
# (its set-up takes several round trips: seconds on GScale's links, not yet the load)
CONTROL_PKTS = 32
READY_S = 60  # the longest a probe process may take to start
IPERF_SETUP_RTTS = 5  # round trips before iperf3's first datagram (connect, parameters, streams, start)
# iperf3 opens a UDP stream with one datagram each way and no retry (esnet/iperf#351): on a lossy
# link either may be lost and nothing is sent (rate and queue then read 0)
UDP_START_TRIES = 3
UDP_PAYLOAD = MTU - 20 - 8 - 4  # iperf3 datagram: 1468 bytes (+ UDP/IP headers: 1496, under the MTU)
UDP_HEADERS = 8 + 20 + 14  # what HTB counts per datagram beyond its payload
UDP_FRAME = UDP_PAYLOAD + UDP_HEADERS
TCP_SHARE = (MTU - 52) / (MTU + 14)  # TCP payload per L2 byte at MTU 1500 (1448 with timestamps): 0.956
ACK_FRAME = 14 + 20 + 32  # L2 bytes of a pure ACK with timestamps, as HTB counts it (SACK blocks not counted)
OVERLOAD = 1.5  # UDP offered load / link rate when filling the queue
# a queue kept full under OVERLOAD drops 1 - 1/OVERLOAD (a third) of what arrives; under this
# share of overflow the sender fell short of keeping it full while the probes went
QUEUE_FULL_OVERFLOW = 0.1
UDP_LOAD_OVERLOAD = 1.05  # all at once with UDP: enough to keep every queue non-empty, little to drop
LOSSY_CC = "bbr"
SINGLE_ROUNDS = 40  # link by link: rounds of directions checked at once on larger topologies


# ---------------------------------------------------------------------------
# Pass rules (pure).
# ---------------------------------------------------------------------------
def delay_ok(measured_ms: float | None, expected_ms: float, slack_ms: float = 0.0) -> bool:
    return measured_ms is not None and abs(measured_ms - expected_ms) <= delay_tolerance_ms(expected_ms) + slack_ms


def delay_tolerance_ms(delay_ms: float) -> float:
    """Systematic offset a one-way delay may show: max(1 ms, 3 %) (the hosts' own packet
    processing: 0.4-1.0 ms in a guest under TCG)."""
    return max(1.0, 0.03 * delay_ms)


def owd_stats(owd_ms) -> np.ndarray:
    """Of one-way delays (ms), along the last axis: the median (where they lie), the mean
    absolute deviation from it (how far they spread), and the lower and upper spreads, median
    less the 10 % quantile and the 90 % quantile less the median (how: a pareto jitter's
    upper spread is four times its lower one)."""
    a = np.asarray(owd_ms, dtype=float)
    q10, q50, q90 = np.quantile(a, [0.1, 0.5, 0.9], axis=-1)
    dev = np.abs(a - q50[..., None]).mean(axis=-1)
    return np.stack([q50, dev, q50 - q10, q90 - q50], axis=-1)


def owd_check(owd_ms, model, tol_ms: float, alpha: float = OWD_ALPHA, timing_ms: float = TIMING_MS) -> dict:
    """Do the probes' one-way delays ``owd_ms`` come from the configured distribution?
    ``model``: simulated probe streams of the same length (:func:`.jitter.simulate`, one a
    row), which give each statistic of :func:`owd_stats` its sampling distribution (mean and
    standard deviation: its tolerance follows the number of probes).  ``delay``: the median
    within z(alpha) standard deviations + ``tol_ms`` (systematic offsets) of its mean;
    ``jitter``: the deviation and both spreads each within z(alpha / 3) standard deviations
    + ``timing_ms``."""
    if len(owd_ms) < 2:
        return {"delay": False, "jitter": False, "measured": None, "expected": None, "allowed": None}
    got, sim = owd_stats(owd_ms), owd_stats(model)
    mean, sd = sim.mean(axis=0), sim.std(axis=0)
    allowed = sd * np.array([norm.isf(alpha / 2)] + 3 * [norm.isf(alpha / 6)]) + np.array([tol_ms] + 3 * [timing_ms])
    ok = np.abs(got - mean) <= allowed
    return {"delay": bool(ok[0]), "jitter": bool(ok[1:].all()),
            "measured": [round(float(v), 4) for v in got], "expected": [round(float(v), 4) for v in mean],
            "allowed": [round(float(v), 4) for v in allowed]}


def loss_check(lost: int, sent: int, loss: float) -> dict:
    """Measured loss vs configured: exact two-sided binomial test and a 99.9 % Clopper-Pearson
    interval for the measured loss (its width says how much this sample can tell)."""
    if sent <= 0:
        return {"measured_loss": None, "loss_ci": None, "loss_p": None, "ok": False}
    t = binomtest(max(0, min(lost, sent)), sent, loss)
    ci = t.proportion_ci(1 - LOSS_ALPHA)
    return {"measured_loss": lost / sent, "loss_ci": [ci.low, ci.high], "loss_p": t.pvalue,
            "ok": bool(t.pvalue >= LOSS_ALPHA)}


def queue_ok(measured_ms: float | None, expected_ms: float, frame_ms: float = 0.0, jitter_ms: float = 0.0) -> bool:
    """Within max(2 ms, 5 %, one frame's time at the rate) + ``jitter_ms``: a queue holds whole
    frames, and how many are still on the emulated wire varies by one (the arrival's phase);
    ``jitter_ms``: what a jitter's FIFO shift may add to the probes' median
    (:func:`queue_jitter_ms`)."""
    return measured_ms is not None and abs(measured_ms - expected_ms) <= max(2.0, 0.05 * expected_ms, frame_ms) + jitter_ms


def queue_jitter_ms(d, method: str, frame_ms: float, interval_ms: float, probes: int) -> float:
    """z(OWD_ALPHA) standard deviations of the median of ``probes`` probes ``interval_ms``
    apart in a stream of frames ``frame_ms`` apart, in FIFO order (:func:`.jitter.simulate`):
    under a heavy tail one long draw holds many frames (8 ms of paretonormal jitter at 25
    Mbit/s: 2.2 ms for 38 probes); on netem the later of that and the queue's own delay
    (:func:`.shaping.standing_queue_ms`).  0 without jitter."""
    if not d.jitter_ms or probes < 2:
        return 0.0
    step = max(1, round(interval_ms / frame_ms))
    sim = jitter.simulate(probes * step, d.delay_ms, d.jitter_ms, d.distribution, frame_ms, runs=200)[:, ::step]
    if METHODS[method].leaf != "bfifo":
        sim = np.maximum(sim, (netem_limit(d) - 1) * frame_ms)
    return float(norm.isf(OWD_ALPHA / 2) * np.median(sim, axis=1).std())


def queue_overflow(before: dict, after: dict, loss_at_leaf: float) -> float | None:
    """The share of the packets reaching the sender's queue (leaf ``10:``) that it dropped for
    want of room between two reads of its counters (:func:`_leaf_counts`), the link's random
    loss taken out where it is dropped there too (netem); None without packets."""
    dropped = after["dropped"] - before["dropped"]
    arrived = after["sent_pkts"] - before["sent_pkts"] + dropped + after["backlog_p"] - before["backlog_p"]
    return dropped / arrived - loss_at_leaf if arrived > 0 else None


def rate_ok(ratio: float | None) -> bool:
    return ratio is not None and RATE_OK[0] <= ratio <= RATE_OK[1]


def carried_share(dirn) -> float:
    """The share of a full link's rate that reaches the receiver: 1 - loss where a lost packet
    had used the rate (the relay drops after HTB), 1 where netem dropped it before
    (``Method.loss_takes_rate``; Debian guest, a 5 % lossy 4 Mbit/s link under UDP overload:
    1.051 of rate x (1 - loss), 3.9 of 4 Mbit/s delivered)."""
    return 1 - dirn.spec.loss if METHODS[dirn.method].loss_takes_rate else 1.0


# ---------------------------------------------------------------------------
# Measurements.
# ---------------------------------------------------------------------------
def _ping_rtt_ms(text: str) -> float | None:
    m = re.search(r"= [\d.]+/([\d.]+)/", text)
    return float(m.group(1)) if m else None


def _probe_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "testbed.emulator.probe", *args]


def _json(text: str) -> dict:
    try:
        return json.loads(text.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {}


def _warmup_s(net, directions) -> int:
    """Seconds not counted after the load's go: TCP needs ~10 round trips to reach the rate of
    a long link, after 2 to connect (the load process connects at the go; iperf3 used to
    count its omitted time from the connection on: with 10 round trips from the go, GScale's
    g2<->g5, 0.8 s round trips, read 0.90-0.93 in 3 of 5 checks, 0.16 and 0.71 in the others)."""
    rtt = max((net.directions[(s, d)].spec.delay_ms + net.directions[(d, s)].spec.delay_ms) / 1e3
               for s, d in directions)
    return min(15, max(1, math.ceil(12 * rtt)))


def _streams(net, src: str, dst: str, phase: str) -> int:
    """Parallel TCP streams for one direction.  Link by link: on a long fat pipe whose queue
    is far below its bandwidth-delay product (GScale: 1000 packets against 0.8 s x 130
    Mbit/s), one cubic flow needs tens of seconds to regrow its window after a loss, so it
    measures TCP's own dynamics, not the link; four flows share the back-off.  With every
    link loaded at once, one flow per direction: four would quadruple the TCP work on the
    emulation host's cores (152 flows on GScale) and measure the CPU instead."""
    rtt_ms = net.directions[(src, dst)].spec.delay_ms + net.directions[(dst, src)].spec.delay_ms
    return 4 if phase == "single" and rtt_ms >= 100 else 1


def _tcp(net, directions, seconds: float, phase: str, cc: dict, port: int = BASE_PORT) -> list[dict]:
    """TCP goodput (:mod:`.load`: one process per datacenter, congestion control ``cc[(src,
    dst)]``) and ping under that load (ICMP priority class) on ``directions``, all at once."""
    omit = _warmup_s(net, directions)
    hosts = sorted({h for sd in directions for h in sd})
    procs = {}
    for h in hosts:
        flows = [a for s, d in directions if s == h
                 for a in ("--flow", f"{net.peer_address(s, d)},{net.directions[(s, d)].spec.rate_mbps},"
                                     f"{cc[(s, d)]},{_streams(net, s, d, phase)}")]
        procs[h] = net.popen(h, [sys.executable, "-m", "testbed.emulator.load", str(port), "--name", h,
                                 "--omit", str(omit), "--seconds", str(seconds), *flows],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    # ping once the load is on; started ahead, held until then (under the load of hundreds of
    # directions starting a process takes up to a second: equinix-like-20's last pings began late)
    count = max(5, int(seconds / 0.2))
    pings = [net.popen(src, ["sh", "-c", f"read go && exec ping -n -q -c {count} -i 0.2 {net.peer_address(src, dst)}"],
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for src, dst in directions]
    for h, p in procs.items():
        _await_ready(p, f"TCP load on {h}")
    t0 = time.time() + 0.2
    _release(procs.values(), f"go {t0:.6f}")
    time.sleep(max(0.0, t0 + omit - time.time()))
    _release(pings)
    got = {h: _json(p.communicate(timeout=omit + seconds + 60)[0]).get("received", {}) for h, p in procs.items()}
    out = []
    for (src, dst), p in zip(directions, pings):
        rtt = _ping_rtt_ms(p.communicate(timeout=seconds + 60)[0])
        rx = got[dst].get(src, {})
        out.append({"mbps": rx.get("mbps"), "per_s": rx.get("per_s", []), "owd_ms": rtt / 2 if rtt is not None else None,
                    "ack_mbps": rx.get("acks", 0) * ACK_FRAME * 8 / seconds / 1e6})  # sent back on dst -> src
    return out


def _probe_interval_s(spec) -> float:
    """Probe spacing: PROBE_PPS, at most 25 % of the link rate, and wide enough that FIFO
    order holds a probe behind the one before it with probability <= 1e-3."""
    return max(1 / PROBE_PPS, PROBE_FRAME * 8 / (0.25 * spec.rate_mbps * 1e6),
               jitter.fifo_free_spacing_ms(spec.jitter_ms, spec.distribution) / 1e3)


def _top_ms(d) -> float:
    """The longest one-way delay direction ``d`` gives a packet (the top of its jitter's range)."""
    return jitter.range_ms(d.delay_ms, d.jitter_ms, d.distribution)[1]


def _release(procs, line: str = "go") -> None:
    """Start processes held at their first line of input (``sh -c "read go && exec ..."``, or
    a helper waiting for its go), one write each: started ahead, they begin together."""
    for p in procs:
        p.stdin.write(line + "\n")
        p.stdin.flush()


def _kill(procs) -> None:
    """Kill and reap the processes of a load whose start did not take (UDP_START_TRIES)."""
    for p in procs:
        p.kill()
        p.communicate(timeout=30)


def _await_ready(p: subprocess.Popen, who: str) -> None:
    """Wait (at most READY_S) for a helper process's ``ready`` line (probe or TCP load)."""
    if not select.select([p.stdout], [], [], READY_S)[0] or p.stdout.readline().strip() != "ready":
        p.kill()
        raise RunError(f"linkcheck: the {who} did not start within {READY_S} s")


class _Probe:
    """One-way probe src -> dst, receiver and sender both started and past their start-up
    (:mod:`.probe`'s ``--ready``); the first datagram leaves at :meth:`go`."""

    def __init__(self, net, src: str, dst: str, seconds: float, interval_s: float, port: int = PROBE_PORT,
                 skip: int | None = None):
        d = net.directions[(src, dst)].spec
        self.seconds, self.wait = seconds, seconds + _top_ms(d) / 1e3 + 10
        # the receiver stops once the probes stop: no datagram for a few (possibly dropped) intervals
        self.rx = net.popen(dst, _probe_cmd("recv", str(port), "--seconds", f"{self.wait + READY_S}", "--idle",
                                            f"{max(1.0, 5 * interval_s):.3f}", "--ready", "--samples",
                                            *(["--skip", str(skip)] if skip is not None else [])),
                            stdout=subprocess.PIPE, text=True)
        _await_ready(self.rx, f"probe receiver on {dst}")
        self.tx = net.popen(src, _probe_cmd("send", net.peer_address(src, dst), str(port), "--pps",
                                            f"{1 / interval_s:.3f}", "--seconds", str(seconds), "--size",
                                            str(PROBE_BYTES), "--ready"),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        _await_ready(self.tx, f"probe sender on {src}")

    def go(self, seconds: float | None = None) -> None:
        """Start sending (for at most ``seconds``, if given)."""
        _release([self.tx], "go" if seconds is None else f"go {seconds:.3f}")

    def result(self) -> dict:
        """The receiver's statistics plus ``sent``."""
        out_tx, _ = self.tx.communicate(timeout=self.seconds + 30)
        out_rx, _ = self.rx.communicate(timeout=self.wait + READY_S + 30)  # no datagram at all: its --seconds
        return {**_json(out_rx), "sent": _json(out_tx).get("sent", 0)}


def _idle_probe(net, src: str, dst: str, seconds: float, port: int = PROBE_PORT) -> dict:
    """Delay, jitter and loss of src -> dst with nothing else on the link."""
    d = net.directions[(src, dst)].spec
    # resolve the neighbour first (ARP crosses the emulated link and may be lost: its 1 s
    # retry would hold the first probes back)
    net.popen(src, ["ping", "-n", "-q", "-c", "3", "-i", "0.2", "-W", "3", net.peer_address(src, dst)]).wait(30)
    interval = _probe_interval_s(d)
    if d.jitter_ms:  # enough probes for the distribution's quantiles (and the ones left out)
        seconds = max(seconds, min(JITTER_PROBE_S, (JITTER_PROBES + SKIP) * interval))
    probe = _Probe(net, src, dst, seconds, interval, port=port)
    probe.go()
    r = probe.result()
    owd = r.get("owd_ms", [])
    model = jitter.simulate(max(2, len(owd)), d.delay_ms, d.jitter_ms, d.distribution, interval * 1e3, OWD_RUNS)
    owd_c = owd_check(owd, model, delay_tolerance_ms(d.delay_ms))
    loss = loss_check(r.get("sent", 0) - r.get("unique", 0), r.get("sent", 0), d.loss)
    return {"probe_sent": r.get("sent", 0), "probe_received": r.get("unique", 0), "probe_interval_ms": interval * 1e3,
            "measured_delay_ms": r.get("owd_p50_ms"), "measured_jitter_ms": r.get("owd_std_ms"),
            "expected_jitter_ms": jitter.std_ms(d.delay_ms, d.jitter_ms, d.distribution),
            "probe_owd_mean_ms": r.get("owd_mean_ms"), "probe_owd_p99_ms": r.get("owd_p99_ms"),
            # median, mean |delay - median|, median - 10 % quantile, 90 % quantile - median (owd_stats):
            # measured, expected, allowed |difference|
            "owd_stats_ms": owd_c["measured"], "expected_owd_stats_ms": owd_c["expected"],
            "allowed_owd_stats_ms": owd_c["allowed"],
            "checks": {"delay": owd_c["delay"], "jitter": owd_c["jitter"], "loss": loss.pop("ok")},
            **loss}


def udp_payload(d, method: str) -> int:
    """iperf3's datagram payload for the queue check: UDP_PAYLOAD, or where a full byte FIFO
    of those would leave less room than a probe's frame (``queue_pkts`` x 1514 mod 1510 < 106:
    queues under 27 packets) the largest payload that leaves room -- else a probe gets in only
    in the moment after a departure (a 10-packet queue: 0 of 39 probes in one direction, 37
    in the other).  netem's limit counts packets: UDP_PAYLOAD."""
    if METHODS[method].leaf != "bfifo":
        return UDP_PAYLOAD
    limit = d.queue_pkts * (MTU + 14)
    return next((p for p in range(UDP_PAYLOAD, 0, -1) if limit % (p + UDP_HEADERS) >= PROBE_FRAME
                 and limit >= p + UDP_HEADERS), UDP_PAYLOAD)


def _queue_and_udp_rate(net, src: str, dst: str, seconds: float, port: int = BASE_PORT,
                        probe_port: int = PROBE_PORT + 1) -> dict:
    """iperf3 UDP at OVERLOAD x the rate keeps the sender's queue full: receiver goodput =
    link rate; probes through the same queue measure the standing-queue delay."""
    dirn = net.directions[(src, dst)]
    d = dirn.spec
    payload = udp_payload(d, dirn.method)
    frame = payload + UDP_HEADERS
    expect_q = standing_queue_ms(d, dirn.method, frame, PROBE_FRAME)
    interval = _queue_probe_interval_s(d, expect_q)
    seconds = max(seconds, QUEUE_PROBES * interval + 0.5)
    fill_s = 2.5 * expect_q / 1e3 / (OVERLOAD - 1) + 0.5  # time for the excess to fill the queue
    total = fill_s + seconds  # iperf3's -t: counted from its first datagram
    # which comes only after its TCP control connection and stream set-up, a few round trips
    # over this very link (0.8 s each on GScale's 400 ms links): the probes must wait for it too
    setup_s = IPERF_SETUP_RTTS * (d.delay_ms + net.directions[(dst, src)].spec.delay_ms) / 1e3
    probe, srv, cli, full, tries, total = _start_udp_load(net, src, dst, payload, seconds, interval, total,
                                                          setup_s + fill_s + 10, port, probe_port)
    full_after = full[0] if full else None
    r, overflow = _probe_full_queue(net, src, dst, probe, full, full[2] + total if full else 0.0, interval)
    cli.wait(timeout=setup_s + total + 30)
    out, _ = srv.communicate(timeout=30)
    mbps, per_interval = _udp_goodput(out, fill_s, total)
    expect_mbps = d.rate_mbps * payload / frame * carried_share(dirn)
    frame_ms = frame * 8 / (d.rate_mbps * 1e3)
    queue_jitter = queue_jitter_ms(d, dirn.method, frame_ms, interval * 1e3, r.get("owd_n", 0))
    queue = r["owd_p50_ms"] - d.delay_ms if r.get("owd_p50_ms") is not None else None
    ratio = mbps / expect_mbps if mbps else None
    why = {} if full_after is not None else {"queue": f"never seen full in {tries} tries: not measured"}
    if full_after is not None and not r:
        why = {"queue": f"seen full {full_after:g} s after the load's start, too late to probe it: not measured"}
    if overflow is not None and overflow < QUEUE_FULL_OVERFLOW:
        queue, why = None, {"queue": f"not kept full ({overflow:.0%} of arrivals overflowed, "
                                     f"{1 - 1 / OVERLOAD:.0%} if full): not measured"}
    return {"measured_mbps": mbps, "rate_method": "udp", "rate_ratio": ratio, "udp_mbps_per_interval": per_interval,
            "measured_queue_ms": queue, "expected_queue_ms": expect_q, "queue_probes": r.get("owd_n", 0),
            "queue_jitter_ms": queue_jitter,
            "queue_full_after_s": full_after, "queue_overflow": overflow, "udp_start_tries": tries,
            "checks": {"rate": rate_ok(ratio), "queue": queue_ok(queue, expect_q, frame_ms, queue_jitter)},
            "why": why, "udp_payload": payload}


def _queue_probe_interval_s(d, expect_q: float) -> float:
    """Spacing of the standing-queue probes.  They go in the same (bulk) queue, started before
    the load so that they go exactly when the queue is full and end before the load; spaced
    wider than the queue's delay (and the jitter's FIFO-free spacing), so that no probe ever
    waits behind another."""
    # each probe in the queue holds one of its places (netem's limit counts packets), and at 50
    # a second the probes ahead of a probe made the queue read 2-12 % short on slow links
    # (measured in the VM).  Small, not iperf3-sized: in a byte-limited FIFO (htb, relay) a
    # small probe fits where a full-size one is dropped; in netem's a probe gets in only where a
    # datagram left and none came yet, so fewer arrive (`queue_probes`).  QUEUE_PROBES sent, all
    # counted (the neighbour is resolved by now): with the idle probe's first 10 left out, a
    # 2 Mbit/s link's 4 s gave none
    return max(0.02, (expect_q + jitter.fifo_free_spacing_ms(d.jitter_ms, d.distribution)) / 1e3)


def _start_udp_load(net, src: str, dst: str, payload: int, seconds: float, interval: float, total: float,
                    wait_s: float, port: int, probe_port: int) -> tuple:
    """The queue probes (waiting to go) and iperf3 UDP at OVERLOAD x the rate for ``total`` s,
    all started again (up to UDP_START_TRIES times) while the queue is not seen full within
    ``wait_s``, or is seen full so late that fewer than QUEUE_PROBES probes fit before the load
    ends (on several servers each poll is a process started over SSH): then with the load
    longer by that wait.  (probe, iperf3 server, client, :func:`_await_full_queue`'s answer,
    tries, the load's ``total`` s)."""
    d = net.directions[(src, dst)].spec
    # the sender's socket buffer must hold the whole queue (about 2.3 KB of kernel memory per
    # queued datagram), else it throttles iperf3 before the queue is full
    sndbuf = min(16 << 20, max(2 << 20, 3 * d.queue_pkts * (MTU + 14)))
    for tries in range(1, UDP_START_TRIES + 1):
        probe = _Probe(net, src, dst, seconds - 0.5, interval, port=probe_port, skip=0)
        srv = net.popen(dst, ["iperf3", "-s", "-1", "-p", str(port), "-J", "-i", "0.5"],
                        stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)
        cli = net.popen(src, ["iperf3", "-c", net.peer_address(src, dst), "-p", str(port), "-u", "-w",
                              str(sndbuf), "-b", f"{OVERLOAD * d.rate_mbps * 1e6:.0f}", "-l", str(payload),
                              "-t", f"{total:.1f}"])
        full = _await_full_queue(net, src, dst, payload + UDP_HEADERS, wait_s)
        late = full and full[2] + total - time.monotonic() - LOAD_END_MARGIN_S < QUEUE_PROBES * interval
        if (full and not late) or tries == UDP_START_TRIES:
            break
        _kill((cli, srv, probe.tx, probe.rx))
        if late:
            seconds, total = seconds + full[0], total + full[0]
    return probe, srv, cli, full, tries, total


def _probe_full_queue(net, src: str, dst: str, probe: "_Probe", full: tuple | None, load_end: float,
                      interval: float) -> tuple[dict, float | None]:
    """The probes' statistics through the full queue and the share of arrivals that overflowed
    it since it was seen full ({} and None where it never was, or was seen so late that the
    load, ending at ``load_end`` (monotonic) at the earliest, leaves no time for QUEUE_MIN_PROBES
    probes).  The probes stop with the load: seen full late (on several servers each poll is a
    process started over SSH), probes for a fixed time would go on after the load and read an
    empty queue."""
    dirn = net.directions[(src, dst)]
    overflow = None
    window = load_end - time.monotonic() - LOAD_END_MARGIN_S
    if full is None or window < QUEUE_MIN_PROBES * interval:  # never seen full: probes now would
        _kill((probe.tx, probe.rx))  # go after the load has ended (the Debian guest under TCG, 40
        return {}, overflow  # Mbit/s: iperf3 sends in bursts and the queue peaked between polls;
        # they read 0.4-0.8 ms for 30): not measured
    probe.go(min(window, probe.seconds))
    r = probe.result()
    after = _leaf_counts(net, src, dirn.intf)
    if after:  # the Debian guest under TCG: seen full once, then iperf3 fell
        # short of the rate (36-39 Mbit/s for 38.9) and the probes read 0.4-1.7 ms for 29.9
        overflow = queue_overflow(full[1], after, 0.0 if METHODS[dirn.method].loss_takes_rate else dirn.spec.loss)
    return r, overflow


def _udp_goodput(out: str, fill_s: float, total: float) -> tuple[float | None, list[float]]:
    """The iperf3 server's goodput (Mbit/s) over its intervals with the queue full, and each
    interval's; (None, []) where its report is unreadable or has no such interval."""
    try:
        ivals = [i["sum"] for i in json.loads(out)["intervals"]]
        # from a full queue on, and ending half an interval before the sender stops: the
        # receiver's last intervals are the tail (e.g. six at 13.1-13.6 Mbit/s for 13.6, the
        # last at 6.0; equinix-like-20 at scale 0.01: 1.93-1.95 of 1.94, then 1.64, 0.0)
        ivals = [i for i in ivals if i["start"] >= fill_s and i["end"] <= total - 0.5]
        mbps = sum(i["bits_per_second"] * (i["end"] - i["start"]) for i in ivals) / sum(
            i["end"] - i["start"] for i in ivals) / 1e6
        per_interval = [round(i["bits_per_second"] / 1e6, 3) for i in ivals]  # where a dip was, if any
    except (ValueError, KeyError, TypeError, ZeroDivisionError):
        mbps, per_interval = None, []
    return mbps, per_interval


def _await_full_queue(net, src: str, dst: str, frame: int, timeout_s: float) -> tuple[float, dict, float] | None:
    """Seconds until the sender's bulk queue (leaf ``10:``, see ``shaping.shape_commands``) is
    within two datagrams of its limit, polled with ``tc -s``, its counts then
    (:func:`_leaf_counts`), and the latest (monotonic) time the load had not begun (a poll
    that found at most CONTROL_PKTS sent since the first, else the start); None if it never was
    full within ``timeout_s``.  The standing-queue
    probes go then: a fixed wait for iperf3's set-up and the fill read an empty queue when
    starting took longer (equinix-like-20 at scale 0.01, eight directions checked at once:
    0.03-0.06 ms for 70 ms)."""
    intf = net.directions[(src, dst)].intf
    t0 = quiet = time.monotonic()
    first = None
    while time.monotonic() - t0 < timeout_s:
        polled = time.monotonic()
        q = _leaf_counts(net, src, intf)
        first = first or q
        if q and q["sent_pkts"] - first["sent_pkts"] <= CONTROL_PKTS:
            quiet = polled
        if q and (q["backlog_b"] if q["in_bytes"] else q["backlog_p"]) >= q["limit"] - 2 * (
                frame if q["in_bytes"] else 1):
            return round(time.monotonic() - t0, 3), q, quiet
        time.sleep(0.05)
    return None


def _leaf_counts(net, src: str, intf: str) -> dict | None:
    """The sender's bulk queue (leaf ``10:``) as ``tc -s`` shows it: its limit (in bytes or
    packets), packets sent and dropped so far, and its backlog; None if not found."""
    out, _ = net.popen(src, ["tc", "-s", "qdisc", "show", "dev", intf], stdout=subprocess.PIPE,
                       text=True).communicate(timeout=30)
    m = re.search(r"qdisc \S+ 10: .*?limit (\d+)(b?).*?Sent \d+ bytes (\d+) pkt \(dropped (\d+)"
                  r".*?backlog (\d+)b (\d+)p", out, re.S)
    return m and {"limit": int(m[1]), "in_bytes": m[2] == "b", "sent_pkts": int(m[3]), "dropped": int(m[4]),
                  "backlog_b": int(m[5]), "backlog_p": int(m[6])}


def _loaded_row(net, src, dst, phase, tcp: dict, verdict_cc: str | None, ack_mbps: float = 0.0) -> dict:
    """Row fields from a TCP + ping measurement; ``verdict_cc`` if the goodput is the rate check,
    ``ack_mbps`` the reverse flow's ACKs, which this direction carried too (its L2 bytes)."""
    d, back = net.directions[(src, dst)], net.directions[(dst, src)]
    expect_owd = (d.spec.delay_ms + back.spec.delay_ms) / 2
    # FIFO order under load brings the delay towards the top of the jitter's range
    slack = (_top_ms(d.spec) - d.spec.delay_ms + _top_ms(back.spec) - back.spec.delay_ms) / 2
    row = {"phase": phase, **d.report(), "loaded_owd_ms": tcp["owd_ms"], "expected_owd_ms": expect_owd,
           "checks": {"loaded_delay": delay_ok(tcp["owd_ms"], expect_owd, slack)}}
    if verdict_cc:
        # the L2 bytes HTB passed: the data (its retransmissions included) and the reverse flow's ACKs
        ratio = (tcp["mbps"] / (TCP_SHARE * carried_share(d)) + ack_mbps) / d.spec.rate_mbps if tcp["mbps"] else None
        row.update({"measured_mbps": tcp["mbps"], "rate_method": f"tcp-{verdict_cc}", "rate_ratio": ratio,
                    "reverse_ack_mbps": ack_mbps, "tcp_mbps_per_s": tcp["per_s"]})  # where a dip was, if any
        row["checks"]["rate"] = rate_ok(ratio)
    return row


def _single(net, src: str, dst: str, seconds: float, tcp_cc: str, slot: int = 0) -> dict:
    """Every check of one direction; ``slot`` k picks its ports, so that directions of other
    links can be checked at the same time (:func:`single_batches`)."""
    probe_s = max(2.0, seconds / 2)
    idle = _idle_probe(net, src, dst, probe_s, port=PROBE_PORT + 2 * slot)
    tcp = _tcp(net, [(src, dst)], seconds, "single", {(src, dst): tcp_cc}, port=BASE_PORT + slot)[0]
    row = _loaded_row(net, src, dst, "single", tcp, None)
    row.update({"tcp_cc": tcp_cc, "tcp_goodput_mbps": tcp["mbps"]})
    udp = _queue_and_udp_rate(net, src, dst, min(seconds, 4.0), port=BASE_PORT + slot,
                              probe_port=PROBE_PORT + 2 * slot + 1)
    checks = {**idle.pop("checks"), **row.pop("checks"), **udp.pop("checks")}
    return {**row, **idle, **udp, "checks": checks}


def single_parallel(n_directions: int) -> int:
    """How many directions the link-by-link phase checks at once by default: one while a
    topology has at most SINGLE_ROUNDS directions, else enough to finish in about
    SINGLE_ROUNDS rounds (a direction takes 15-30 s: equinix-like-20's 282 one at a time
    took over two hours)."""
    return max(1, math.ceil(n_directions / SINGLE_ROUNDS))


def single_batches(rtt_ms: dict, parallel: int) -> list[list]:
    """The directions (keys of ``rtt_ms``, their round-trip times) in rounds of at most
    ``parallel``, no datacenter in two directions of one round: each is then measured on its
    own link, queue and hosts (a direction and its reverse share a link, never a round), and
    only the machine's CPU is shared, which the keep-up verdict watches.  Longest round trips
    first, first fit, so that a round's directions take about as long.  ``parallel`` 1: one
    at a time, in the given order."""
    if parallel <= 1:
        return [[sd] for sd in rtt_ms]
    rounds: list[tuple[set, list]] = []
    for sd in sorted(rtt_ms, key=lambda sd: -rtt_ms[sd]):
        for used, batch in rounds:
            if len(batch) < parallel and not used & set(sd):
                used.update(sd)
                batch.append(sd)
                break
        else:
            rounds.append((set(sd), [sd]))
    return [batch for _, batch in rounds]


def cubic_regrowth_s(d, back) -> float:
    """How long CUBIC takes to regrow its window after one loss on direction ``d`` (``back``
    the reverse direction) where the queue is too short to keep the link busy meanwhile
    (queue < (1 - beta) / beta x the bandwidth-delay product): K = cbrt(W_max (1 - beta) / C),
    W_max = BDP + queue in segments, beta 0.7, C 0.4 (RFC 9438 §4.2); 0 where the queue
    suffices.  A loss-based flow measured over less than K reads its sawtooth, not the link:
    GScale's g2->g5 (130 Mbit/s, 0.8 s round trip, 1000 packets; K 19 s) read 0.926 in 1 of 5
    concurrent checks of 6 s."""
    beta, c = 0.7, 0.4
    bdp = d.rate_mbps * 1e6 / 8 * (d.delay_ms + back.delay_ms) / 1e3 / (MTU + 14)
    if d.queue_pkts >= bdp * (1 - beta) / beta:
        return 0.0
    return ((bdp + d.queue_pkts) * (1 - beta) / c) ** (1 / 3)


def _concurrent(net, directions, seconds: float, tcp_cc: str) -> list[dict]:
    avail = Path("/proc/sys/net/ipv4/tcp_available_congestion_control").read_text().split()
    lossy = LOSSY_CC if LOSSY_CC in avail else tcp_cc  # no tcp_bbr module: the rate row says tcp-<cc>
    cc = {(s, d): lossy if net.directions[(s, d)].spec.loss > 0 else tcp_cc for s, d in directions}
    seconds = max([seconds] + [math.ceil(cubic_regrowth_s(net.directions[(s, d)].spec, net.directions[(d, s)].spec))
                               for s, d in directions if cc[(s, d)] != LOSSY_CC])  # loss-based flows
    verdict = dict(zip(directions, _tcp(net, directions, seconds, "concurrent", cc)))
    rows = [_loaded_row(net, s, d, "concurrent", m, cc[(s, d)], verdict.get((d, s), {}).get("ack_mbps", 0.0))
            for (s, d), m in verdict.items()]
    info = list(verdict.values()) if all(c == tcp_cc for c in cc.values()) else \
        _tcp(net, directions, seconds, "concurrent", {k: tcp_cc for k in directions})
    for row, m in zip(rows, info):
        row.update({"tcp_cc": tcp_cc, "tcp_goodput_mbps": m["mbps"], "tcp_seconds": seconds})
    return rows


def _rx_bytes(net, host: str) -> tuple[float, dict[str, int]]:
    """(when, bytes received per interface) in ``host``'s namespace, read from the root
    namespace through its shell's ``/proc/PID/net/dev``: no process to start, so the windows
    of all hosts line up (starting ``ip -s link`` in each took up to hundreds of ms under load,
    reading a 30 Mbit/s direction up to 6 % short over 3 s)."""
    text = Path(f"/proc/{net.hosts[host].pid}/net/dev").read_text()
    when = time.monotonic()
    rx = {}
    for line in text.splitlines()[2:]:
        name, _, fields = line.partition(":")
        rx[name.strip()] = int(fields.split()[0])
    return when, rx


def _udp_client(net, src: str, dst: str, port: int, seconds: float) -> list[str]:
    """The held iperf3 UDP client of one direction at UDP_LOAD_OVERLOAD x its rate."""
    bps = UDP_LOAD_OVERLOAD * net.directions[(src, dst)].spec.rate_mbps * 1e6 * UDP_PAYLOAD / UDP_FRAME
    return ["sh", "-c", f"read go && exec iperf3 -c {net.peer_address(src, dst)} -p {port} "
                        f"-u -b {bps:.0f} -l {UDP_PAYLOAD} -t {seconds:.1f}"]


def _udp_concurrent(net, directions, seconds: float) -> list[dict]:
    """Every direction loaded at once by iperf3 UDP at UDP_LOAD_OVERLOAD x its rate; its rate is
    the L2 bytes the receiving interface counted in one window common to all directions (veth
    and HTB both count the Ethernet header), against rate x (1 - loss).  A packet per 1.5 KB and
    no GSO: this measures how many packets the emulation host carries, not what TCP gets.  The
    reference for HTB alone (``bench emulator``): TCP over a near-zero round trip reads the ACKs
    of a loaded asymmetric link starving behind the slow direction's data, not the shaper.
    A direction whose receiver counted under a tenth of its rate by the end of the warm-up
    (iperf3's UDP set-up lost on a lossy link) is started again, up to UDP_START_TRIES times,
    before the window."""
    rtt_s = max((net.directions[sd].spec.delay_ms + net.directions[sd[::-1]].spec.delay_ms) / 1e3 for sd in directions)
    warm = IPERF_SETUP_RTTS * rtt_s + 1.0  # every client connected and sending
    check_s = 0.5  # how long a direction must bring a tenth of its rate to count as started
    run_s = UDP_START_TRIES * (warm + check_s) + seconds + 5  # a client started last outlasts the window
    port = {sd: BASE_PORT + k for k, sd in enumerate(directions)}
    intf = {(s, d): net.directions[(d, s)].intf for s, d in directions}  # the receiver's end of the link
    receivers = sorted({d for _, d in directions})
    servers, clients, tries, todo = {}, {}, {}, list(directions)
    for attempt in range(1, UDP_START_TRIES + 1):
        for s, d in todo:
            servers[(s, d)] = net.popen(d, ["iperf3", "-s", "-1", "-p", str(port[(s, d)])])
        time.sleep(0.5)
        for s, d in todo:  # started ahead, held until all are (GScale's 38 took seconds)
            clients[(s, d)] = net.popen(s, _udp_client(net, s, d, port[(s, d)], run_s), stdin=subprocess.PIPE, text=True)
            tries[(s, d)] = attempt
        _release([clients[sd] for sd in todo])
        time.sleep(warm)
        before = {h: _rx_bytes(net, h)[1] for h in receivers}
        time.sleep(check_s)
        first = {h: _rx_bytes(net, h) for h in receivers}  # the window starts here unless a direction restarts
        # an idle link still carries a few hundred bytes a second (IPv6 neighbour discovery)
        todo = [(s, d) for s, d in directions if first[d][1][intf[(s, d)]] - before[d][intf[(s, d)]]
                < 0.1 * check_s * net.directions[(s, d)].spec.rate_mbps * 1e6 / 8]
        if not todo or attempt == UDP_START_TRIES:
            break
        for sd in todo:  # next to nothing arrived: start this direction's pair again
            _kill((clients[sd], servers[sd]))
    time.sleep(seconds)
    last = {h: _rx_bytes(net, h) for h in receivers}
    for p in [*clients.values(), *servers.values()]:
        p.terminate()
    rows = []
    for s, d in directions:
        dirn = net.directions[(s, d)]
        (t0, b0), (t1, b1) = first[d], last[d]
        mbps = (b1[intf[(s, d)]] - b0[intf[(s, d)]]) * 8 / (t1 - t0) / 1e6
        ratio = mbps / (dirn.spec.rate_mbps * carried_share(dirn))
        rows.append({"phase": "concurrent", **dirn.report(), "measured_mbps": mbps, "rate_method": "udp-l2",
                     "rate_ratio": ratio, "udp_start_tries": tries[(s, d)], "checks": {"rate": rate_ok(ratio)}})
    return rows


def run_linkcheck(topo, *, seconds: float = 6.0, phases=("single", "concurrent"), method: str = "auto",
                  max_late_ms: float = 2.0, tcp_cc: str = DEFAULT_TCP_CC, parallel: int = 0, load: str = "tcp",
                  progress=print, network=None) -> dict:
    """``parallel``: directions checked at once link by link (0: :func:`single_parallel`);
    ``load``: what loads every direction at once, "tcp" (:func:`_concurrent`) or "udp"
    (:func:`_udp_concurrent`); ``network``: what builds the network (default
    :class:`~.network.WanNetwork`; the same keywords), e.g. one spread over several servers."""
    from testbed.emulator.network import WanNetwork

    before = tcp_memory()
    if load not in ("tcp", "udp"):
        raise ValueError(f"linkcheck load must be tcp or udp, not {load!r}")
    result: dict = {"topology": topo.name, "scale": topo.scale, "tcp_cc": tcp_cc, "concurrent_load": load,
                    "directions": [], "load_before": os.getloadavg(), "tcp_memory_before": before}
    if before["mem_mb"] > 0.1 * before["marks_mb"][1]:
        progress(f"warning: TCP already holds {before['mem_mb']:g} MB ({before['orphans']} orphaned sockets), "
                 f"against memory pressure at {before['marks_mb'][1]:g} MB: long-RTT links may read short")
    with (network or WanNetwork)(topo, method=method, log=progress, icmp_priority=True, tcp_cc=tcp_cc) as net:
        result["method"], result["memory_hold"] = net.method, net.memory_hold
        all_dirs = list(net.directions)
        whole = CpuMeter().start()
        if "single" in phases:
            result["single_parallel"] = parallel = parallel or single_parallel(len(all_dirs))
            result["directions"] += _single_phase(net, seconds, tcp_cc, parallel, progress)
        if "concurrent" in phases:
            progress(f"concurrent: all {len(all_dirs)} directions loaded at once ({load})")
            net.reset_relay_window()
            cpu = CpuMeter().start()
            result["directions"] += (_udp_concurrent(net, all_dirs, seconds) if load == "udp"
                                     else _concurrent(net, all_dirs, seconds, tcp_cc))
            result["concurrent_cpu_util"], result["concurrent_steal"] = cpu.stop()
        result["cpu_util"], result["steal"] = whole.stop()
        result["load_after"], result["tcp_memory_after"] = os.getloadavg(), tcp_memory()
        result["relay"] = net.relay_stats()
        result["relay_layout"] = net.relay_layout  # keep-up window: the concurrent phase if there was one
        result.update(_frame_cost(result))
        result["emulation_kept_up"] = _kept_up(result["relay"], max_late_ms, result["steal"])
        if hasattr(net, "placement"):  # over several servers: each direction's two, and their health
            result["cluster"] = net.report(max_late_ms)
            for d in result["directions"]:
                d["servers"] = [net.server_of(d["src"]), net.server_of(d["dst"])]
    for d in result["directions"]:
        d["ok"] = all(d["checks"].values())
    result["total_capacity_mbps"] = sum(d["rate_mbps"] for d in result["directions"] if d["phase"] == phases[0])
    result["directions_ok"] = all(d["ok"] for d in result["directions"])
    # an overloaded emulator's figures are not the link's (lateness shifts delay, queues, TCP): fail the check
    result["ok"] = result["directions_ok"] and result["emulation_kept_up"]["ok"]
    return result


def _single_phase(net, seconds: float, tcp_cc: str, parallel: int, progress) -> list[dict]:
    """Link by link: every direction checked alone, ``parallel`` at once (:func:`single_batches`),
    its row in the order of ``net.directions``."""
    all_dirs = list(net.directions)
    rows, done = {}, 0
    rtt = {sd: net.directions[sd].spec.delay_ms + net.directions[sd[::-1]].spec.delay_ms for sd in all_dirs}
    for batch in single_batches(rtt, parallel):
        progress(f"single {done + 1}/{len(all_dirs)}: " + ", ".join(f"{s} -> {d}" for s, d in batch))
        with ThreadPoolExecutor(len(batch)) as pool:
            futures = {sd: pool.submit(_single, net, *sd, seconds, tcp_cc, k) for k, sd in enumerate(batch)}
        rows.update({sd: f.result() for sd, f in futures.items()})
        done += len(batch)
    return [rows[sd] for sd in all_dirs]


def _frame_cost(result: dict) -> dict:
    """What one relayed frame (data or ACK) cost this machine in the concurrent phase, relay and
    TCP endpoints together, and how many there were a second ({} without that phase or frames)."""
    frames = sum(s.get("win_frames_out", 0) for s in result["relay"])
    if "concurrent_cpu_util" not in result or not frames:
        return {}
    # the same check's keep-up follows the cost, and the frame rate, not the bit rate, is the
    # load (under BBR a flow sends about one TSO frame per ms whatever its rate;
    # docs/measurements/emulator-log.md, "What one frame costs" and "Frames, not bits")
    window = max(s["window_s"] for s in result["relay"])
    return {"concurrent_frames_per_s": frames / window,
            "concurrent_cpu_us_per_frame": (result["concurrent_cpu_util"] * (os.cpu_count() or 1)
                                            * window / frames * 1e6)}


def _kept_up(stats: list[dict], max_late_ms: float, steal: float) -> dict:
    from testbed.emulator.relay import kept_up

    reasons = [why for ok, why in (kept_up(s, max_p99_late_ms=max_late_ms) for s in stats) if not ok]
    if steal > STEAL_MAX:
        reasons.append(f"the hypervisor took {steal:.1%} of the CPU time (steal)")
    return {"ok": not reasons, "reasons": reasons}


def _f(x, fmt: str, width: int) -> str:
    return f"{x:{width}{fmt}}" if x is not None else f"{'-':>{width}}"


def format_table(result: dict) -> str:
    """One line per direction and phase; FAIL names the checks that failed (and why, where a
    check could not measure); over several servers, a direction between two says which."""
    lines = [f"{'phase':10} {'src':>6} {'dst':>6} {'rate':>7} {'meas':>7} {'ratio':>6} {'by':>8} "
             f"{'delay':>6} {'meas':>7} {'loaded':>7} {'jitter':>6} {'meas':>6} {'loss':>7} {'meas':>7} "
             f"{'queue':>6} {'meas':>6} {'tcp':>7} {'cc':>5}  verdict"]
    for d in result["directions"]:
        bad = [k + (f" ({d['why'][k]})" if k in d.get("why", {}) else "") for k, v in d["checks"].items() if not v]
        lines.append(
            f"{d['phase']:10} {d['src']:>6} {d['dst']:>6} {d['rate_mbps']:7.1f} {_f(d.get('measured_mbps'), '.1f', 7)} "
            f"{_f(d.get('rate_ratio'), '.3f', 6)} {d.get('rate_method', '-'):>8} {d['delay_ms']:6.1f} "
            f"{_f(d.get('measured_delay_ms'), '.2f', 7)} {_f(d.get('loaded_owd_ms'), '.2f', 7)} "
            f"{d['jitter_ms']:6.2f} {_f(d.get('measured_jitter_ms'), '.2f', 6)} {d['loss']:7.4%} "
            f"{_f(d.get('measured_loss'), '.4%', 7)} {_f(d.get('expected_queue_ms'), '.0f', 6)} "
            f"{_f(d.get('measured_queue_ms'), '.0f', 6)} {_f(d.get('tcp_goodput_mbps'), '.1f', 7)} "
            f"{d.get('tcp_cc', '-'):>5}  {'ok' if d['ok'] else 'FAIL ' + ','.join(bad)}"
            + (f"  ({' -> '.join(d['servers'])})" if len(set(d.get("servers", ()))) == 2 else ""))
    return "\n".join(lines)
