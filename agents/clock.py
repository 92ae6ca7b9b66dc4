"""The agent's wall clock, as the harness measures it.

``python3 -m agents.clock [--offset-ms X]`` answers every line on stdin with ``T1 T2``,
this host's wall clock (ns) when the line arrived and when the answer left: the remote
half of the NTP-style exchange :mod:`testbed.clock` turns into a clock offset.  It exits
at end of input.

:func:`shift` moves this process's wall clock (``time.time`` and ``time.time_ns``, which
every timestamp an agent reports comes from) by ``offset_ms``, as libfaketime would: the
agent option ``clock_offset_ms`` uses it to stand for a host whose clock is off, so tests
can check that the harness corrects timings for it.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time

offset_ns = 0  # this process's shift (kernel timestamps, e.g. SO_TIMESTAMPNS, are not shifted)
SO_TIMESTAMPNS = 35  # linux/asm-generic/socket.h (Python's socket module does not export it)


def kernel_rx_ns(ancdata: list) -> int | None:
    """The kernel's receive time (ns, the host's wall clock, not shifted) of a datagram, from
    ``recvmsg``'s ancillary data on a socket with SO_TIMESTAMPNS set; None if absent."""
    return next((int.from_bytes(d[:8], sys.byteorder) * 10**9 + int.from_bytes(d[8:16], sys.byteorder)
                 for lvl, typ, d in ancdata if lvl == socket.SOL_SOCKET and typ == SO_TIMESTAMPNS), None)


def shift(offset_ms: float) -> None:
    """From now on this process's wall clock reads ``offset_ms`` later than the host's."""
    global offset_ns
    if not offset_ms:
        return
    delta_ns, real_ns, real_s = int(offset_ms * 1e6), time.time_ns, time.time
    offset_ns += delta_ns
    time.time_ns = lambda: real_ns() + delta_ns
    time.time = lambda: real_s() + delta_ns / 1e9


def echo(inp, out) -> None:
    while inp.readline():
        t1 = time.time_ns()
        out.write(f"{t1} {time.time_ns()}\n".encode())
        out.flush()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m agents.clock", description=__doc__.splitlines()[0])
    ap.add_argument("--offset-ms", type=float, default=0.0, help="shift this clock (as the agent option)")
    shift(ap.parse_args(argv).offset_ms)
    echo(sys.stdin.buffer, sys.stdout.buffer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
