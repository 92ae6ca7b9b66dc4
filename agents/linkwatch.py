"""CREW's link heartbeats (Luo et al., §IV-B, "heartbeat and timeout": both ends of a
connection get the same view), in a process of their own.

A busy agent runs dozens of executor threads; every system call of a heartbeat thread in
that process would wait for the interpreter lock behind them, and at 31 peers a round of
beats can take seconds, so every peer would hear the agent go silent at once: a link outage
that is the agent's scheduling.  :class:`LinkWatch` (the agent's side) starts ``python -m
agents.linkwatch`` (:func:`watch`), which beats and listens on its own and reports each
peer it stops or starts hearing, one line each, read by a thread of the agent.  The process
ends when the agent closes its stdin, or dies."""

from __future__ import annotations

import json
import logging
import select
import socket
import subprocess
import sys
import threading
import time

from .protocol import Msg, message

log = logging.getLogger("agents.crew")

MAGIC = b"crew-hb "
START_S = 10.0  # the watch process's deadline to bind its socket and say so
END_S = 3.0  # the watch process's deadline to end once told (then once killed)


class LinkWatch:
    """The agent's side: a UDP heartbeat to every peer's data address every ``timeout_s``/8,
    over the data network (the path its chunks take); a peer silent for ``timeout_s`` (or
    never heard within ``timeout_s`` of the start) is reported ``link_lost``, heard again
    ``link_back``.  The UDP port is the agent's TCP data port.  A heartbeat is the sender's
    name, unauthenticated (a forged one can only make a broken link look alive)."""

    def __init__(self, agent, peers: dict, timeout_s: float):
        self.agent = agent
        self.down: set[str] = set()
        spec = {"name": agent.name, "bind": [agent.listener.getsockname()[0], agent.data_port],
                "peers": {p: [str(a[0]), int(a[1])] for p, a in peers.items()}, "timeout_s": float(timeout_s)}
        self.proc = subprocess.Popen([sys.executable, "-m", "agents.linkwatch", json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = select.select([self.proc.stdout], [], [], START_S)[0] and self.proc.stdout.readline().strip()
        if ready != "ready":
            self._end()
            self.proc.stdout.close()
            raise RuntimeError(f"link heartbeats: {ready or f'no answer within {START_S:g} s'} "
                               "(groups.link_timeout_s: 0 turns them off)")
        self.thread = threading.Thread(target=self._read, daemon=True, name="crew-linkwatch")
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            what, _, peer = line.strip().partition(" ")
            if what not in ("lost", "back"):
                log.error("link heartbeats: %s", line.strip())
                continue
            lost = what == "lost"
            (self.down.add if lost else self.down.discard)(peer)
            msg = message(Msg.LINK_LOST if lost else Msg.LINK_BACK, peer=peer)
            log.warning("%s: %s", msg["msg"], peer)
            try:
                self.agent.send(msg)
            except Exception as e:  # the control connection's own loss is handled elsewhere
                log.error("cannot report %s %s: %s", msg["msg"], peer, e)

    def _end(self) -> None:
        """Close the watch's stdin (it ends), else kill it; never raises: the end of the
        heartbeats fails no run (on a loaded machine a killed process may take seconds to
        be reaped)."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        for stop in (None, self.proc.kill):
            if stop:
                stop()
            try:
                self.proc.wait(timeout=END_S)
                return
            except subprocess.TimeoutExpired:
                pass
        log.warning("link heartbeats: the watch process %d did not end within %g s of its kill", self.proc.pid, END_S)

    def close(self) -> None:
        self._end()
        self.thread.join(timeout=1.0)
        self.proc.stdout.close()


def watch(name: str, bind: tuple[str, int], peers: dict[str, tuple[str, int]], timeout_s: float, control,
          out) -> None:
    """Beat to and hear ``peers`` until ``control`` (a readable file) ends; write ``lost
    PEER`` / ``back PEER`` lines to ``out``.  Each peer's heartbeats leave from a socket of
    their own, which never waits: a heartbeat sits in its link's queue charged to the socket
    that sent it until it leaves, so through one shared socket the full, slow queues of some
    peers' links would hold back every other peer's; one that finds its socket's buffer full
    is dropped, as one lost on its link would be."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    sock.bind(bind)
    senders = {p: socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for p in peers}
    for s in senders.values():
        s.setblocking(False)
        s.bind((bind[0], 0))  # from the data address, routed as the chunks are
    print("ready", file=out, flush=True)
    heard = {p: time.monotonic() for p in peers}  # a peer never heard is lost too
    down: set[str] = set()
    every, me, nxt = timeout_s / 8, MAGIC + name.encode(), 0.0

    def report(what: str, peer: str) -> None:
        (down.add if what == "lost" else down.discard)(peer)
        print(what, peer, file=out, flush=True)

    while True:
        now = time.monotonic()
        if now >= nxt:
            for peer, addr in peers.items():
                try:
                    senders[peer].sendto(me, addr)
                except OSError:  # no route (the link is down) or the buffer full: not sent
                    pass
            nxt = now + every
        readable = select.select([sock, control], [], [], max(0.01, nxt - time.monotonic()))[0]
        if control in readable and not control.readline():
            return
        for peer in _heard(sock, peers) if sock in readable else ():
            heard[peer] = time.monotonic()
            if peer in down:
                report("back", peer)
        now = time.monotonic()
        for peer, t in heard.items():
            if now - t > timeout_s and peer not in down:
                report("lost", peer)


def _heard(sock: socket.socket, peers: dict) -> list[str]:
    """The peers of every heartbeat waiting on ``sock``."""
    out = []
    while True:
        try:
            data, _ = sock.recvfrom(512)
        except OSError:  # none left (BlockingIOError) or an ICMP error queued by a send
            return out
        name = data[len(MAGIC):].decode(errors="replace") if data.startswith(MAGIC) else ""
        if name in peers:
            out.append(name)


def main() -> int:
    spec = json.loads(sys.argv[1])
    try:
        watch(spec["name"], tuple(spec["bind"]), {p: tuple(a) for p, a in spec["peers"].items()},
              spec["timeout_s"], sys.stdin, sys.stdout)
    except OSError as e:  # before "ready": the agent reports it
        print(f"cannot bind UDP {spec['bind'][0]}:{spec['bind'][1]} (the data port): {e}", flush=True)
        return 1
    except (BrokenPipeError, KeyboardInterrupt):  # the agent is gone
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
