"""The agents' data plane on loopback, without Mininet: what one transfer costs the executor.

:func:`loopback_chain` runs a three-node chain a -> b -> c (b adds each chunk of a into its
own and forwards the sum, as an interior node of a reduce tree does; c adds it into its
own) in three processes joined by loopback TCP, one executor each, ``chunks`` chunks of
``chunk_bytes`` per iteration, and reports per node the wall time and the process's CPU
time (user + system) of each iteration, and whether c ended with the exact sum.  The CPU
time of b per chunk is the per-transfer cost of an interior node (receive, add, forward);
of c, of a leaf's receive.  :func:`iperf3_loopback` is the kernel's reference on the same
loopback.  Used by ``bench dataplane`` and by the tests that hold executor variants
(cut-through or not, sub-block sizes) to the same result.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import resource
import socket
import subprocess
import time

NODES = ("a", "b", "c")


def chain_plan(chunks: int, elems: int):
    from testbed.plan import Plan, ProgramBuilder

    b = ProgramBuilder(list(NODES))
    for k in range(chunks):
        _, r = b.transfer("a", "b", k * elems, elems, reduce=True, chunk=k)
        b.transfer("b", "c", k * elems, elems, reduce=True, send_deps=[r], chunk=k)
    return Plan("chain", list(NODES), chunks * elems, b.programs, receivers=["c"])


def _node(name: str, chunks: int, elems: int, iterations: int, options: dict, ports, out, barrier) -> None:
    import numpy as np

    from agents.executor import Executor

    plan = chain_plan(chunks, elems)
    ex = lst = None
    try:
        ex = Executor(name, plan.programs[name], length=plan.length, timeout_s=60, **options)
        if name != "a":
            lst = socket.create_server(("127.0.0.1", 0))
            ports[name] = lst.getsockname()[1]
        barrier.wait(30)
        if name != "c":
            nxt = NODES[NODES.index(name) + 1]
            s = socket.create_connection(("127.0.0.1", ports[nxt]), timeout=30)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.settimeout(None)
            s.sendall(name.encode())
            ex.attach_outgoing(nxt, 0, s)
        if lst is not None:
            lst.settimeout(30)
            c, _ = lst.accept()
            c.settimeout(None)
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ex.attach_incoming(c.recv(1).decode(), 0, c)
        x = np.ones(plan.length, np.float32)
        rows = []
        for it in range(iterations):
            ex.prepare(x)
            barrier.wait(60)
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            ex.run(it)
            t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            rows.append([t1 - t0, r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime])
            barrier.wait(60)
        exact = bool((ex.bufs["x"] == 3).all()) if name == "c" else True
        out.put((name, {"rows": rows, "exact": exact}))
    except BaseException as e:  # the parent reports it
        out.put((name, {"error": f"{type(e).__name__}: {e}"}))
        barrier.abort()
    finally:
        if ex is not None:
            ex.close()
        if lst is not None:
            lst.close()


def loopback_chain(chunk_bytes: int, chunks: int, iterations: int = 3, **options) -> dict:
    """Run the chain (module doc) ``iterations`` times; per node the best (least) wall and
    CPU seconds of an iteration after the first (the first also pays page faults and TCP's
    ramp-up), CPU per chunk, and goodput (bytes of the chunks over c's wall time).
    ``options`` go to every :class:`agents.executor.Executor`."""
    elems = max(1, chunk_bytes // 4)
    ctx = mp.get_context("spawn")
    with ctx.Manager() as m:
        ports, out, barrier = m.dict(), m.Queue(), m.Barrier(3)
        procs = [ctx.Process(target=_node, args=(n, chunks, elems, iterations, options, ports, out, barrier),
                             daemon=True) for n in NODES]
        for p in procs:
            p.start()
        res = {}
        deadline = time.monotonic() + 120 + iterations * (10 + chunks * elems * 4 / 50e6)
        while len(res) < 3 and time.monotonic() < deadline:
            try:
                name, r = out.get(timeout=1)
                res[name] = r
            except Exception:
                if not any(p.is_alive() for p in procs) and out.empty():
                    break
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
    errors = {n: r["error"] for n, r in res.items() if "error" in r}
    if len(res) < 3 or errors:
        raise RuntimeError(f"loopback chain failed: {errors or 'nodes ' + str(sorted(set(NODES) - set(res)))}")
    nbytes = chunks * elems * 4
    result = {"chunk_bytes": elems * 4, "chunks": chunks, "iterations": iterations, "options": options,
              "exact": res["c"]["exact"]}
    for n in NODES:
        rows = res[n]["rows"][1:] or res[n]["rows"]
        wall, cpu = min(r[0] for r in rows), min(r[1] for r in rows)
        result[n] = {"wall_s": wall, "cpu_s": cpu, "cpu_per_chunk_ms": cpu / chunks * 1e3,
                     "transfers_per_s": chunks / wall, "goodput_mbps": nbytes * 8 / wall / 1e6}
    return result


def iperf3_loopback(nbytes: int, port: int = 5298) -> float:
    """iperf3's goodput (Mbit/s) for ``nbytes`` over loopback TCP."""
    srv = subprocess.Popen(["iperf3", "-s", "-1", "-p", str(port), "-B", "127.0.0.1"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.3)
        out = subprocess.run(["iperf3", "-c", "127.0.0.1", "-p", str(port), "-n", str(nbytes), "-J"],
                             capture_output=True, text=True, timeout=120)
        return json.loads(out.stdout)["end"]["sum_received"]["bits_per_second"] / 1e6
    finally:
        srv.wait(timeout=10) if srv.poll() is not None else (srv.kill(), srv.wait())
