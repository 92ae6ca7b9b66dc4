"""Progress lines for long commands: ``[  12.3s] message`` on stderr.  Library functions
take any ``progress(msg)`` callable; the command line passes a :class:`Progress`."""

from __future__ import annotations

import sys
import time


class Progress:
    """Prints ``[  12.3s] message`` lines so long runs show where they are."""

    def __init__(self, quiet: bool = False, stream=sys.stderr):
        self.t0, self.quiet, self.stream = time.monotonic(), quiet, stream

    def __call__(self, msg: str) -> None:
        if not self.quiet:
            print(f"[{time.monotonic() - self.t0:7.1f}s] {msg}", file=self.stream, flush=True)


def time_left(elapsed_s: float, done: float, total: float) -> str:
    """``"12s elapsed, about 340s left"``: the work not yet done (``total - done``, in any unit,
    e.g. estimated seconds) at the pace so far (the estimate itself before anything is done)."""
    if done <= 0:
        left = total
    else:
        left = (total - done) * elapsed_s / done
    return f"{elapsed_s:.0f}s elapsed, about {max(0.0, left):.0f}s left"
