"""``testbed linkcheck``: are the emulated links what the topology says?

For every direction of every link: rate with iperf3 (TCP goodput at the receiver, the
first ~10 round trips omitted so slow start does not count; see ``_streams`` for how many
parallel flows) and delay with ping (RTT/2), first link by link (``single``), then with
every direction loaded at once (``concurrent``).  During the check ICMP has its own
priority class on each link (see ``shaping.shape_commands``), so under load ping measures
propagation plus emulator delay, not the bulk queue's queueing delay.

Pass rule (per direction): measured/configured rate in [0.93, 1.02] and
|RTT/2 − (delay_ab + delay_ba)/2| <= max(1 ms, 3 %).  Note that TCP goodput is at most
1448/1514 ≈ 0.956 of the L2 rate HTB enforces at MTU 1500.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import time

from testbed.emulator import DEFAULT_TCP_CC
from testbed.results import STEAL_MAX, CpuMeter

RATE_OK = (0.93, 1.02)
BASE_PORT = 5201


def _ping_rtt_ms(text: str) -> float | None:
    m = re.search(r"= [\d.]+/([\d.]+)/", text)
    return float(m.group(1)) if m else None


def _iperf_mbps(text: str) -> float | None:
    try:
        end = json.loads(text)["end"]
        return end["sum_received"]["bits_per_second"] / 1e6
    except (ValueError, KeyError, TypeError):
        return None


def _warmup_s(net, directions) -> int:
    """Seconds iperf3 omits: TCP needs ~10 round trips to reach the rate of a long link."""
    rtt = max((net.directions[(s, d)].spec.delay_ms + net.directions[(d, s)].spec.delay_ms) / 1e3
               for s, d in directions)
    return min(15, max(1, math.ceil(10 * rtt)))


def _streams(net, src: str, dst: str, phase: str) -> int:
    """Parallel TCP streams for one direction.  Link by link: on a long fat pipe whose queue
    is far below its bandwidth-delay product (GScale: 1000 packets against 0.8 s x 130
    Mbit/s), one cubic flow needs tens of seconds to regrow its window after a loss, so it
    measures TCP's own dynamics, not the link; four flows share the back-off.  With every
    link loaded at once, one flow per direction: four would quadruple the TCP work on the
    emulation host's cores (152 flows on GScale) and measure the CPU instead."""
    rtt_ms = net.directions[(src, dst)].spec.delay_ms + net.directions[(dst, src)].spec.delay_ms
    return 4 if phase == "single" and rtt_ms >= 100 else 1


def _measure(net, directions, seconds: float, phase: str) -> list[dict]:
    """Run iperf3 + ping on ``directions`` (a list of (src, dst)) at the same time."""
    servers, clients, pings = [], [], []
    omit = _warmup_s(net, directions)
    for k, (src, dst) in enumerate(directions):
        port = BASE_PORT + k
        servers.append(net.popen(dst, ["iperf3", "-s", "-1", "-p", str(port)]))
    time.sleep(0.5)
    for k, (src, dst) in enumerate(directions):
        ip = net.peer_address(src, dst)
        clients.append(net.popen(src, ["iperf3", "-c", ip, "-p", str(BASE_PORT + k), "-t", str(seconds + omit),
                                       "-O", str(omit), "-P", str(_streams(net, src, dst, phase)), "-J"],
                                 stdout=subprocess.PIPE, text=True))
    time.sleep(omit)  # ping once the load is on (also in the single phase, for one code path)
    count = max(5, int(seconds / 0.2))
    for src, dst in directions:
        pings.append(net.popen(src, ["ping", "-n", "-q", "-c", str(count), "-i", "0.2", net.peer_address(src, dst)],
                               stdout=subprocess.PIPE, text=True))
    rows = []
    for (src, dst), c, p in zip(directions, clients, pings):
        out_c, _ = c.communicate(timeout=seconds + omit + 60)
        out_p, _ = p.communicate(timeout=seconds + omit + 60)
        d = net.directions[(src, dst)]
        back = net.directions[(dst, src)]
        rtt = _ping_rtt_ms(out_p)
        mbps = _iperf_mbps(out_c)
        expect_owd = (d.spec.delay_ms + back.spec.delay_ms) / 2
        row = {"phase": phase, **d.report(), "measured_mbps": mbps,
               "measured_owd_ms": rtt / 2 if rtt is not None else None, "expected_owd_ms": expect_owd}
        row["rate_ratio"] = mbps / d.spec.rate_mbps if mbps else None
        row["ok"] = bool(
            row["rate_ratio"] is not None and RATE_OK[0] <= row["rate_ratio"] <= RATE_OK[1]
            and rtt is not None and abs(rtt / 2 - expect_owd) <= max(1.0, 0.03 * expect_owd))
        rows.append(row)
    for s in servers:
        try:
            s.wait(timeout=5)
        except subprocess.TimeoutExpired:
            s.kill()
    return rows


def run_linkcheck(topo, *, seconds: float = 6.0, phases=("single", "concurrent"), method: str = "auto",
                  max_late_ms: float = 2.0, tcp_cc: str = DEFAULT_TCP_CC, progress=print) -> dict:
    from testbed.emulator.network import WanNetwork

    result: dict = {"topology": topo.name, "scale": topo.scale, "tcp_cc": tcp_cc, "directions": []}
    with WanNetwork(topo, method=method, log=progress, icmp_priority=True, tcp_cc=tcp_cc) as net:
        result["method"] = net.method
        all_dirs = list(net.directions)
        whole = CpuMeter().start()
        if "single" in phases:
            for k, (src, dst) in enumerate(all_dirs):
                progress(f"single {k + 1}/{len(all_dirs)}: {src} -> {dst}")
                result["directions"] += _measure(net, [(src, dst)], seconds, "single")
        if "concurrent" in phases:
            progress(f"concurrent: all {len(all_dirs)} directions loaded at once")
            net.reset_relay_window()
            cpu = CpuMeter().start()
            result["directions"] += _measure(net, all_dirs, seconds, "concurrent")
            result["concurrent_cpu_util"] = cpu.stop()[0]
        result["steal"] = whole.stop()[1]
        result["relay"] = net.relay_stats()  # keep-up window: the concurrent phase if there was one
        result["emulation_kept_up"] = _kept_up(result["relay"], max_late_ms, result["steal"])
    result["total_capacity_mbps"] = sum(d["rate_mbps"] for d in result["directions"] if d["phase"] == phases[0])
    result["ok"] = all(d["ok"] for d in result["directions"])
    return result


def _kept_up(stats: list[dict], max_late_ms: float, steal: float) -> dict:
    from testbed.emulator.relay import kept_up

    reasons = [why for ok, why in (kept_up(s, max_p99_late_ms=max_late_ms) for s in stats) if not ok]
    if steal > STEAL_MAX:
        reasons.append(f"the hypervisor took {steal:.1%} of the CPU time (steal)")
    return {"ok": not reasons, "reasons": reasons}


def format_table(result: dict) -> str:
    lines = [f"{'phase':10} {'src':>6} {'dst':>6} {'rate':>8} {'meas':>8} {'ratio':>6} "
             f"{'owd':>7} {'meas':>7}  ok"]
    for d in result["directions"]:
        meas = f"{d['measured_mbps']:.1f}" if d["measured_mbps"] is not None else "-"
        ratio = f"{d['rate_ratio']:.3f}" if d["rate_ratio"] is not None else "-"
        owd = f"{d['measured_owd_ms']:.2f}" if d["measured_owd_ms"] is not None else "-"
        lines.append(f"{d['phase']:10} {d['src']:>6} {d['dst']:>6} {d['rate_mbps']:8.1f} {meas:>8} {ratio:>6} "
                     f"{d['expected_owd_ms']:7.2f} {owd:>7}  {'ok' if d['ok'] else 'FAIL'}")
    return "\n".join(lines)
