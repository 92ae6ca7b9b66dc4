"""Auxiliary multipath transmission (NetStorm §VI): chunks overflowing a busy primary path go
over auxiliary paths through forward-only relays.  The paths and the dispatch bounds are
plan data (``plan.aux``, from :mod:`testbed.planners.auxpaths`, re-computed at every
re-plan); the agents dispatch, relay and recover (:mod:`agents.executor`).  Here: what a
run sent over them.  Scheme block: ``aux``."""

from __future__ import annotations

from agents.protocol import transfer_rows

from . import Feature, feature


@feature("multipath")
class Multipath(Feature):
    def summarise(self, result: dict, record: dict) -> dict:
        aux = aux_use(result.get("transfers"))
        return {"aux": aux} if aux else {}


def aux_use(transfers: dict | None) -> dict | None:
    """Auxiliary transmission in a run: chunks and bytes sent over auxiliary paths, bytes each
    hop carried for them and bytes each relay forwarded; None if none."""
    hops: dict[tuple, int] = {}
    relayed: dict[str, int] = {}
    chunks = total = 0
    for row in transfer_rows(transfers):
        path = row.route.split(">") if row.route else []
        if path:
            chunks, total = chunks + 1, total + row.bytes
            for a, b in zip(path, path[1:]):
                hops[(a, b)] = hops.get((a, b), 0) + row.bytes
            for r in path[1:-1]:
                relayed[r] = relayed.get(r, 0) + row.bytes
    return {"chunks": chunks, "bytes": total, "forwarded": relayed,
            "hops": [{"src": a, "dst": b, "bytes": n} for (a, b), n in sorted(hops.items())]} if chunks else None
