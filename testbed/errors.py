"""Error types shared by every layer.

A ``ConfigError`` is bad *input* (experiment or topology file, command-line override):
the CLI prints it as one line ``error: FILE: key.path: message`` and exits 2.
A ``RunError`` is a failure while running (agent died, wrong result, emulator
problem): the CLI prints it and exits 1.  Neither should ever surface as a traceback.
"""


class TestbedError(Exception):
    """Base class of every error the command line reports without a traceback."""

    exit_code = 1


class ConfigError(TestbedError):
    """Invalid experiment/topology input.  ``source`` is the file (or '<inline>'),
    ``key`` the dotted key path inside it (e.g. ``links[3].rate_mbps``)."""

    exit_code = 2

    def __init__(self, message: str, *, source: str = "", key: str = ""):
        self.message, self.source, self.key = message, source, key
        where = ": ".join(p for p in (source, key) if p)
        super().__init__(f"{where}: {message}" if where else message)


class RunError(TestbedError):
    """A run failed (an agent died or timed out, a result was wrong, the emulator broke)."""

    exit_code = 1
