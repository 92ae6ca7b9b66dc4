"""One clock for timings taken on several machines: NTP-style clock-offset estimation.

An exchange is four timestamps ``(t0, t1, t2, t3)`` in ns: ``t0`` when this machine sent
the probe, ``t1``/``t2`` when the remote received it and answered (the remote's clock),
``t3`` when the answer arrived (this machine's clock).  As in NTP (RFC 5905, §8), the
offset is ``((t1 - t0) + (t2 - t3)) / 2`` and the round-trip delay ``(t3 - t0) - (t2 - t1)``;
the offset is exact when both directions take equally long and off by at most half the
delay otherwise.  Of several exchanges the one with the least delay is used (NTP's clock
filter, §10): it waited least in queues, so its error bound is smallest.

Pure functions: the exchange itself is the caller's (``testbed.deploy`` runs it over each
host's SSH connection against ``python3 -m agents.clock``).
"""

from __future__ import annotations

from typing import Iterable, NamedTuple


class Offset(NamedTuple):
    offset_ns: int  # remote clock minus this machine's clock
    rtt_ns: int  # round-trip delay of the exchange used (the offset's error is at most half of it)


def estimate(exchanges: Iterable[tuple[int, int, int, int]]) -> Offset:
    """The offset of the remote clock from the min-delay exchange of ``exchanges``."""
    best = None
    for t0, t1, t2, t3 in exchanges:
        if t3 < t0 or t2 < t1:
            raise ValueError(f"exchange {(t0, t1, t2, t3)}: a clock ran backwards")
        rtt = (t3 - t0) - (t2 - t1)
        if best is None or rtt < best.rtt_ns:
            best = Offset(((t1 - t0) + (t2 - t3)) // 2, max(rtt, 0))
    if best is None:
        raise ValueError("no exchanges to estimate a clock offset from")
    return best
