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
