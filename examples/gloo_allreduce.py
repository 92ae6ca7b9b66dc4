"""PyTorch's own all-reduce (``torch.distributed``, ``gloo`` backend) timed in every datacenter,
written against the environment ``testbed exec`` (and torchrun) sets: RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT.  Gloo picks its address by interface name: run it with
``GLOO_SOCKET_IFNAME=tbnode`` (the interface ``exec`` adds, carrying the node address).

    GLOO_SOCKET_IFNAME=tbnode python3 -m testbed exec experiments/netstorm-baselines.yaml -- \\
        python3 examples/gloo_allreduce.py --size-mb 16 --warmup 1 --iterations 1

Every rank's input is integer-valued (exact in float32 up to 2^24), so the sum is checked
exactly.  Each iteration starts after a barrier; its time is the slowest rank's (every rank
prints its own).  Prints one JSON line ``{"rank", "dc", "times_s", "warmup", "correct"}``;
exit 1 on a wrong sum.  ``bench peers`` runs it beside the testbed's schemes.
"""

import argparse
import json
import os
import sys
import time
from datetime import timedelta


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, default=16.0, help="vector size in MB (float32)")
    ap.add_argument("--warmup", type=int, default=1, help="iterations run first and reported apart")
    ap.add_argument("--iterations", type=int, default=1, help="measured iterations")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="gloo's timeout for every operation")
    args = ap.parse_args()
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=timedelta(seconds=args.timeout_s))
    n = int(args.size_mb * 1e6) // 4
    base = (torch.arange(n, dtype=torch.int64) % 1000).to(torch.float32)
    want = base * sum(r + 1 for r in range(world))
    times, correct = [], True
    for _ in range(args.warmup + args.iterations):
        x = base * (rank + 1)
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t0)
        correct = correct and bool(torch.equal(x, want))
    dist.destroy_process_group()
    print(json.dumps({"rank": rank, "dc": os.environ.get("TESTBED_DC", ""), "times_s": times,
                      "warmup": args.warmup, "correct": correct}), flush=True)
    return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main())
