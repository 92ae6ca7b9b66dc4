"""testbed/emulator/load.py: linkcheck's TCP load, one process per datacenter, over real
loopback sockets (the emulated use is in tests/test_emulator.py's all-at-once check)."""

from __future__ import annotations

import json
import select
import socket
import subprocess
import sys
import time

import pytest

from testbed.emulator.load import HEADER_LEN, header, parse_header, rcvlowat

LOAD = [sys.executable, "-m", "testbed.emulator.load"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(port, name, bind, *flows, seconds=1.5, omit=0.3):
    p = subprocess.Popen([*LOAD, str(port), "--name", name, "--bind", bind, "--omit", str(omit), "--seconds",
                          str(seconds), *(a for f in flows for a in ("--flow", f))],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert select.select([p.stdout], [], [], 30)[0] and p.stdout.readline().strip() == "ready"
    return p


def test_header_round_trip_and_malformed_headers_refused():
    h = header("n12", 26.0)
    assert len(h) == HEADER_LEN and parse_header(h) == ("n12", 26.0)
    for bad in (b"x" * HEADER_LEN, b"n1 fast".ljust(HEADER_LEN), b"n1 -3".ljust(HEADER_LEN), b" ".ljust(HEADER_LEN)):
        with pytest.raises(ValueError):
            parse_header(bad)
    with pytest.raises(ValueError, match="too long"):
        header("n" * 70, 1.0)
    assert rcvlowat(0.1) == 4096 and rcvlowat(20.0) == 25000 and rcvlowat(125.0) == 32 << 10


def test_each_datacenter_counts_what_each_neighbour_sent_in_the_window():
    """Two datacenters load each other (two streams one way): each reports the other's goodput
    over the counted window only, per second too; a stranger's garbage connection is refused
    and counted, and spoils nothing."""
    port = _free_port()
    a = _start(port, "a", "127.0.0.2", "127.0.0.3,100,cubic,2")
    b = _start(port, "b", "127.0.0.3", "127.0.0.2,50,reno,1")
    try:
        t0 = time.time() + 0.3
        for p in (a, b):
            p.stdin.write(f"go {t0:.6f}\n")
            p.stdin.flush()
        time.sleep(0.5)
        with socket.create_connection(("127.0.0.3", port), timeout=5) as s:  # hostile: no valid header
            s.sendall(b"\xff" * HEADER_LEN + b"junk")
        got = {n: json.loads(p.communicate(timeout=30)[0]) for n, p in (("a", a), ("b", b))}
    finally:
        for p in (a, b):
            p.kill()
            p.wait()
    assert set(got["a"]["received"]) == {"b"} and set(got["b"]["received"]) == {"a"}
    assert got["b"]["refused"] == 1 and got["a"]["refused"] == 0
    for rx in (got["a"]["received"]["b"], got["b"]["received"]["a"]):
        assert rx["bytes"] > 0 and len(rx["per_s"]) == 2  # 1.5 s window: two per-second slots
        assert rx["mbps"] == pytest.approx(rx["bytes"] * 8 / 1.5 / 1e6)
        assert 0 < rx["acks"] < rx["bytes"] / 1448  # the receiver's ACKs in the window: fewer than segments


def test_no_go_means_a_clear_exit_within_its_deadline(monkeypatch):
    from testbed.emulator import load

    monkeypatch.setattr(load, "READY_WAIT_S", 0.5)
    r, w = socket.socketpair()
    with r, w, r.makefile("r") as stdin, pytest.raises(SystemExit, match="no 'go T0'"):
        load.run(_free_port(), "a", [], 0.0, 1.0, bind="127.0.0.1", stdin=stdin, emit=lambda *a, **k: None)


def _lingering(port: int) -> list[str]:
    """TCP sockets to or from ``port`` in this namespace (ss) that are neither listening nor open."""
    out = subprocess.run(["ss", "-Htan", f"( sport = :{port} or dport = :{port} )"], capture_output=True,
                         text=True, timeout=10).stdout
    return [l for l in out.splitlines() if l.strip() and not l.startswith(("LISTEN", "ESTAB"))]


def test_queued_data_is_dropped_not_orphaned_at_the_end():
    """A receiver that never reads leaves the sender's queue full; when the load ends its
    connection is reset, so no orphaned socket keeps that data (and its memory) afterwards."""
    port = _free_port()
    with socket.socket() as sink:
        sink.bind(("127.0.0.5", port))
        sink.listen(4)
        sink.settimeout(10)
        a = _start(port, "a", "127.0.0.4", "127.0.0.5,100,cubic,1", seconds=0.5, omit=0.1)
        try:
            a.stdin.write(f"go {time.time():.6f}\n")
            a.stdin.flush()
            got = json.loads(a.communicate(timeout=30)[0])
        finally:
            a.kill()
            a.wait()
        conn, _ = sink.accept()
        with conn:
            assert got["received"] == {} and conn.recv(HEADER_LEN)  # it did connect and send
            deadline = time.monotonic() + 5
            while (left := _lingering(port)) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not left, f"the sender's socket outlived the load: {left}"
