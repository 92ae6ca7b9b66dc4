"""Ring all-reduce over plain TCP sockets, written against the environment ``testbed exec``
(and torchrun) sets: RANK, WORLD_SIZE, MASTER_PORT, plus TESTBED_NODE_ADDRS for the peers'
addresses.  Needs only numpy.

    python3 -m testbed exec experiments/quickstart.yaml -- python3 examples/ring_allreduce.py --size-mb 4

Rank r listens on its node address, port MASTER_PORT + 1 + r, sends to rank r+1 and receives
from rank r-1: reduce-scatter then all-gather, WORLD_SIZE - 1 steps each (Patarasuk & Yuan).
Every rank's input is integer-valued (exact in float32 up to 2^24), so the sum is checked
exactly.  Prints one line ``rank R dc DC: ok ...`` (exit 0) or ``... WRONG ...`` (exit 1).
"""

import argparse
import os
import socket
import sys
import threading
import time

import numpy as np


def inputs(rank: int, n: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.int64) * (rank + 3) + rank) % 1000).astype(np.float32)


def connect(addr: str, port: int, deadline: float) -> socket.socket:
    while True:
        try:
            return socket.create_connection((addr, port), timeout=5)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def recv_exact(sock: socket.socket, buf: memoryview) -> None:
    got = 0
    while got < len(buf):
        n = sock.recv_into(buf[got:])
        if not n:
            raise ConnectionError("peer closed the connection")
        got += n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=float, default=4.0, help="vector size in MB of float32 (default 4)")
    ap.add_argument("--iterations", type=int, default=1)
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    port0 = int(os.environ["MASTER_PORT"]) + 1
    addrs = [a.split("=", 1)[1] for a in os.environ["TESTBED_NODE_ADDRS"].split(",")]
    dc = os.environ.get("TESTBED_DC", str(rank))
    n = max(world, int(args.size_mb * 1e6) // 4)

    srv = socket.create_server((addrs[rank], port0 + rank))
    deadline = time.monotonic() + 60
    right = connect(addrs[(rank + 1) % world], port0 + (rank + 1) % world, deadline)
    srv.settimeout(60)
    left, _ = srv.accept()
    for s in (left, right):
        s.settimeout(120)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    bounds = np.linspace(0, n, world + 1).astype(int)
    times = []
    for _ in range(args.iterations):
        x = inputs(rank, n)
        t0 = time.perf_counter()
        for phase in ("reduce-scatter", "all-gather"):
            for step in range(world - 1):
                # reduce-scatter: send block (rank - step), receive block (rank - step - 1) and add
                # all-gather: send block (rank + 1 - step), receive block (rank - step) and copy
                off = 0 if phase == "reduce-scatter" else 1
                sb, rb = (rank - step + off) % world, (rank - step - 1 + off) % world
                out = x[bounds[sb]:bounds[sb + 1]].tobytes()
                sender = threading.Thread(target=right.sendall, args=(out,))
                sender.start()
                buf = np.empty(bounds[rb + 1] - bounds[rb], dtype=np.float32)
                recv_exact(left, memoryview(buf).cast("B"))
                sender.join()
                if phase == "reduce-scatter":
                    x[bounds[rb]:bounds[rb + 1]] += buf
                else:
                    x[bounds[rb]:bounds[rb + 1]] = buf
        times.append(time.perf_counter() - t0)
        want = sum(inputs(r, n) for r in range(world))
        if not np.array_equal(x, want):
            bad = int(np.count_nonzero(x != want))
            print(f"rank {rank} dc {dc}: WRONG result, {bad} of {n} elements differ", flush=True)
            return 1
    print(f"rank {rank} dc {dc}: ok, sum of {world} vectors of {n} float32 correct; "
          f"all-reduce {' '.join(f'{t:.3f}' for t in times)} s", flush=True)
    for s in (left, right, srv):
        s.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
