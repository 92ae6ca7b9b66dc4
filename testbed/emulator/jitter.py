"""What a jittery link direction does to each packet's one-way delay: one definition, which
both shaping paths carry out (netem in the kernel, ``tbrelay`` in user space) and which
``linkcheck`` measures against.

A direction with ``delay_ms`` D, ``jitter_ms`` J and ``distribution`` T gives each packet
(each frame the sender's queue hands on; a TSO frame is one) the delay

    D + J x X,   X drawn from T with mean 0 and standard deviation 1,

never less than 0 (a packet does not leave before it arrived), and keeps FIFO order: a packet
leaves no earlier than the one before it.  So ``delay_ms`` is the mean and ``jitter_ms`` the
standard deviation of the delay of packets spaced wider than the jitter's range, whatever the
distribution.  T is one of netem's tables (iproute2's ``normal``, ``pareto``, ``paretonormal``
``.dist`` files, read from where ``tc`` reads them) or netem's built-in ``uniform``; netem's own
parameters (``delay MU SIGMA distribution T``: MU + SIGMA x table value / 8192) are derived
from D and J so that the table's mean and standard deviation come out as D and J
(:func:`netem_params`), and the relay draws from the same table by netem's formula
(``tabledist`` in sch_netem.c), so the two paths give the same distribution.  The tables'
ranges (in standard deviations from the mean): normal -4.0..+3.5, uniform +-1.73, pareto
-0.77..+4.9 (a long right tail; its median is 0.35 below the mean), paretonormal -1.77..+4.7.

FIFO order (real WAN paths very rarely reorder; reordering makes TCP see spurious losses):
a packet arriving ``s`` ms after the one before it is held back whenever that one's delay
exceeds its own by more than ``s``.  Packets spaced wider than the jitter's range see the
distribution above; a stream of packets ``s`` apart sees delays whose distribution function
is the product of ``F(x + m s)`` over the packets ahead (m = 0, 1, ...; :func:`fifo_cdf`):
a back-to-back stream at a link's rate sees delays close to the top of the range, with
little spread.  netem does the same (given a ``rate``, it dates each packet from the one
before it: ``shaping._leaf``), as does the relay (``tbrelay.c``).
"""

from __future__ import annotations

import math
import os
from functools import lru_cache
from pathlib import Path

import numpy as np

from testbed.errors import RunError
from testbed.wan import DEFAULT_DISTRIBUTION, DISTRIBUTIONS

__all__ = ["DISTRIBUTIONS", "DEFAULT_DISTRIBUTION", "NETEM_DIST_SCALE", "table_path", "table", "netem_params",
           "draws", "fifo_cdf", "quantiles", "simulate", "std_ms", "range_ms", "fifo_free_spacing_ms"]

NETEM_DIST_SCALE = 8192  # a table value t means t / 8192 sigmas (include/uapi/linux/pkt_sched.h)
UNIFORM_DRAWS = 4096  # points standing for netem's built-in uniform (its tables have 4096 values)


def _tc_lib_dirs() -> list[Path]:
    """Where ``tc`` looks for ``.dist`` tables: $TC_LIB_DIR, else its build's LIBDIR/tc
    (Debian: /usr/lib/<multiarch>/tc; others /usr/lib/tc, /usr/lib64/tc)."""
    dirs = [Path(os.environ["TC_LIB_DIR"])] if os.environ.get("TC_LIB_DIR") else []
    dirs += sorted(Path("/usr/lib").glob("*-linux-gnu*/tc"))
    return dirs + [Path(p) for p in ("/usr/lib/tc", "/usr/lib64/tc", "/usr/local/lib/tc")]


def table_path(name: str) -> Path | None:
    """The iproute2 table file of distribution ``name`` (None for ``uniform``, netem's own)."""
    if name not in DISTRIBUTIONS:
        raise ValueError(f"unknown jitter distribution {name!r} (expected one of: {', '.join(DISTRIBUTIONS)})")
    if name == "uniform":
        return None
    for d in _tc_lib_dirs():
        if (d / f"{name}.dist").is_file():
            return d / f"{name}.dist"
    raise RunError(f"netem's jitter table {name}.dist not found (looked in "
                   f"{', '.join(str(d) for d in _tc_lib_dirs())}; it comes with iproute2's tc)")


@lru_cache(maxsize=None)
def table(name: str) -> np.ndarray | None:
    """The table's integer values (None for ``uniform``), as tc reads them: '#' lines are
    comments, the rest whitespace-separated integers."""
    path = table_path(name)
    if path is None:
        return None
    vals = [int(x) for line in path.read_text().splitlines() if not line.lstrip().startswith("#")
            for x in line.split()]
    if not vals:
        raise RunError(f"netem's jitter table {path} is empty")
    return np.asarray(vals, dtype=np.int64)


def _moments(name: str) -> tuple[float, float]:
    """Mean and standard deviation of one table value, in sigmas (``uniform``: 0, 1/sqrt 3)."""
    t = table(name)
    if t is None:
        return 0.0, 1 / math.sqrt(3)
    x = t / NETEM_DIST_SCALE
    return float(x.mean()), float(x.std())


def netem_params(delay_ms: float, jitter_ms: float, distribution: str) -> tuple[float, float]:
    """netem's ``delay MU SIGMA`` (ms) for a direction of mean ``delay_ms`` and standard
    deviation ``jitter_ms`` under ``distribution``: SIGMA = jitter / the table's standard
    deviation, MU = delay - SIGMA x the table's mean (every table's mean is <= 0).  Both
    shaping paths take these."""
    if not jitter_ms:
        return float(delay_ms), 0.0
    mean, sd = _moments(distribution)
    sigma = jitter_ms / sd
    return max(0.0, delay_ms - sigma * mean), sigma


def draws(delay_ms: float, jitter_ms: float, distribution: str = DEFAULT_DISTRIBUTION) -> np.ndarray:
    """The delays (ms) one packet may be given, equally likely, sorted: netem's formula on
    every table value (``uniform``: UNIFORM_DRAWS evenly spaced points), never below 0."""
    mu, sigma = netem_params(delay_ms, jitter_ms, distribution)
    t = table(distribution) if jitter_ms else None
    if not jitter_ms:
        x = np.array([mu])
    elif t is None:
        x = mu - sigma + 2 * sigma * (np.arange(UNIFORM_DRAWS) + 0.5) / UNIFORM_DRAWS
    else:
        x = mu + sigma * t / NETEM_DIST_SCALE
    return np.sort(np.maximum(x, 0.0))


def fifo_cdf(x, delay_ms: float, jitter_ms: float, distribution: str = DEFAULT_DISTRIBUTION,
             spacing_ms: float = math.inf) -> np.ndarray:
    """P(delay <= x) for a packet of a stream spaced ``spacing_ms`` apart, in FIFO order: the
    product of F(x + m s) over the packets ahead of it (m = 0, 1, ...), F the distribution
    of one draw.  ``spacing_ms`` inf: F itself."""
    d = draws(delay_ms, jitter_ms, distribution)
    x = np.asarray(x, dtype=float)

    def f(v):
        return np.searchsorted(d, v, side="right") / d.size

    out = f(x)
    if math.isfinite(spacing_ms) and spacing_ms > 0:
        ahead = int(math.ceil((d[-1] - d[0]) / spacing_ms))
        for m in range(1, ahead + 1):
            out = out * f(x + m * spacing_ms)
    return out


def quantiles(qs, delay_ms: float, jitter_ms: float, distribution: str = DEFAULT_DISTRIBUTION,
              spacing_ms: float = math.inf) -> np.ndarray:
    """The ``qs`` quantiles (ms) of :func:`fifo_cdf`, to 1 us."""
    d = draws(delay_ms, jitter_ms, distribution)
    grid = np.arange(d[0], d[-1] + 0.001, 0.001)
    cdf = fifo_cdf(grid, delay_ms, jitter_ms, distribution, spacing_ms)
    idx = np.searchsorted(cdf, np.asarray(qs, dtype=float), side="left")
    return grid[np.minimum(idx, grid.size - 1)]


def simulate(n: int, delay_ms: float, jitter_ms: float, distribution: str = DEFAULT_DISTRIBUTION,
             spacing_ms: float = math.inf, runs: int = 1, seed: int = 0) -> np.ndarray:
    """The delays (ms) of ``runs`` streams of ``n`` packets ``spacing_ms`` apart, each an
    array row, as both shaping paths give them: a draw each, never below 0, FIFO order."""
    d = draws(delay_ms, jitter_ms, distribution)
    x = np.random.default_rng(seed).choice(d, (runs, n))
    if not math.isfinite(spacing_ms):
        return x
    t = np.arange(n) * spacing_ms
    return np.maximum.accumulate(t + x, axis=1) - t


def std_ms(delay_ms: float, jitter_ms: float, distribution: str = DEFAULT_DISTRIBUTION) -> float:
    """Standard deviation of one packet's delay (ms): ``jitter_ms``, less where the delay
    would fall below 0."""
    return float(draws(delay_ms, jitter_ms, distribution).std())


def range_ms(delay_ms: float, jitter_ms: float, distribution: str = DEFAULT_DISTRIBUTION) -> tuple[float, float]:
    """The least and greatest delay (ms) a packet may be given."""
    d = draws(delay_ms, jitter_ms, distribution)
    return float(d[0]), float(d[-1])


def fifo_free_spacing_ms(jitter_ms: float, distribution: str = DEFAULT_DISTRIBUTION, p: float = 1e-3) -> float:
    """The least spacing (ms) at which FIFO order holds a packet behind the one before it
    with probability <= ``p``: P(X1 - X2 > s) <= p for two draws (the delay itself does not
    matter, a delay below 0 aside)."""
    if not jitter_ms:
        return 0.0
    d = draws(1e6, jitter_ms, distribution)  # far from 0: never clamped
    def held(s):  # P(X1 > X2 + s), X1, X2 independent draws
        return float((d.size - np.searchsorted(d, d + s, side="right")).sum()) / d.size ** 2

    lo, hi = 0.0, float(d[-1] - d[0])
    while hi - lo > 1e-3 * jitter_ms:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if held(mid) > p else (lo, mid)
    return hi
