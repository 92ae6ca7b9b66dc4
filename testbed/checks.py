"""Input checks shared by every loader: key paths, type names, numbers with bounds, choices,
datacenter and datacenter-list references, mappings with allowed keys.

Every failure is a :class:`~testbed.errors.ConfigError` naming the file (``source``) and
the key path, so the command line prints one line and exits 2.  Two message styles exist
and are kept (tests and users rely on them): :class:`Checker` (experiment and hosts files,
scheme parameters: ``expected a number, got 'x'``, ``must be > 0``) and
:func:`check_number` (topology files and generators: ``expected a rate in Mbit/s > 0``)."""

from __future__ import annotations

import difflib
import math
import re
from typing import Any, Iterable, Mapping, Sequence

from testbed.errors import ConfigError


def key_path(prefix: str, sub: str) -> str:
    """Join key paths: key_path('topology', 'links[2]') -> 'topology.links[2]'."""
    if not prefix:
        return sub
    if not sub:
        return prefix
    return prefix + sub if sub.startswith("[") else f"{prefix}.{sub}"


def typename(x: Any) -> str:
    if x is None:
        return "null"
    if isinstance(x, bool):
        return f"boolean {x!r}".lower()
    if isinstance(x, str):
        return f"string {x!r}"
    if isinstance(x, Mapping):
        return "a mapping"
    if isinstance(x, (list, tuple)):
        return "a list"
    return f"{type(x).__name__} {x!r}"


def unknown_key_msg(what: str, k: Any, allowed: Iterable[str]) -> str:
    allowed = list(allowed)
    hint = difflib.get_close_matches(str(k), allowed, n=1)
    did = f"; did you mean {hint[0]!r}?" if hint else ""
    return f"unknown key {k!r} in {what} (expected one of: {', '.join(allowed)}){did}"


def describe_names(names: Iterable[str], limit: int = 12) -> str:
    """Compact list for error messages: 'h1..h9' for a numbered run, else a comma list."""
    names = list(names)
    if not names:
        return "none"
    m = [re.fullmatch(r"(.*?)(\d+)", n) for n in names]
    if len(names) >= 3 and all(m):
        prefixes = {x.group(1) for x in m}  # type: ignore[union-attr]
        nums = [int(x.group(2)) for x in m]  # type: ignore[union-attr]
        if len(prefixes) == 1 and nums == list(range(nums[0], nums[0] + len(nums))) and all(
            str(v) == x.group(2) for v, x in zip(nums, m)  # type: ignore[union-attr]
        ):
            p = prefixes.pop()
            return f"{p}{nums[0]}..{p}{nums[-1]}"
    if len(names) > limit:
        return ", ".join(names[:limit]) + f", ... ({len(names)} in total)"
    return ", ".join(names)


def check_number(x: Any, *, source: str = "", key: str = "", integer: bool = False,
                 minimum: float | None = None, min_open: bool = False,
                 maximum: float | None = None, max_open: bool = False,
                 what: str = "") -> float | int:
    """Validate a YAML scalar as a finite number (bools and strings rejected) in an
    optionally open/closed range; returns it (as int if ``integer``).  Shared with the
    generators so every parameter error reads the same way."""
    kind = "an integer" if integer else "a number"
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ConfigError(f"expected {what or kind}, got {typename(x)}", source=source, key=key)
    if not math.isfinite(x):
        raise ConfigError(f"expected a finite number, got {x!r}", source=source, key=key)
    if integer:
        if isinstance(x, float) and not x.is_integer():
            raise ConfigError(f"expected an integer, got {x!r}", source=source, key=key)
        x = int(x)
    lo_bad = minimum is not None and (x <= minimum if min_open else x < minimum)
    hi_bad = maximum is not None and (x >= maximum if max_open else x > maximum)
    if lo_bad or hi_bad:
        lo = "" if minimum is None else ("(" if min_open else "[") + f"{minimum:g}"
        hi = "" if maximum is None else f"{maximum:g}" + (")" if max_open else "]")
        if minimum is not None and maximum is not None:
            rng = f"in {lo}, {hi}"
        elif minimum is not None:
            rng = f"{'>' if min_open else '>='} {minimum:g}"
        else:
            rng = f"{'<' if max_open else '<='} {maximum:g}"
        raise ConfigError(f"expected {what or kind} {rng}, got {x!r}", source=source, key=key)
    return x


def known_nodes(nodes: Sequence[str]) -> str:
    """The ``known: ...`` list of an unknown-datacenter message (first 12 names)."""
    return ", ".join(nodes[:12]) + (" ..." if len(nodes) > 12 else "")


class Checker:
    """Checks of one document (``source``: its file name); each method returns the value
    checked or raises ConfigError at ``key``."""

    def __init__(self, source: str = ""):
        self.source = source

    def fail(self, key: str, msg: str):
        raise ConfigError(msg, source=self.source, key=key)

    def mapping(self, value, key: str, allowed: set[str] | None = None) -> dict:
        if not isinstance(value, dict):
            self.fail(key, f"expected a mapping, got {type(value).__name__}")
        if allowed is not None:
            extra = sorted(set(value) - allowed)
            if extra:
                self.fail(f"{key}.{extra[0]}" if key else extra[0],
                          f"unknown key (allowed: {', '.join(sorted(allowed))})")
        return value

    def number(self, value, key: str, *, integer=False, minimum=None, positive=False):
        ok = isinstance(value, int) if integer else isinstance(value, (int, float))
        if not ok or isinstance(value, bool):
            self.fail(key, f"expected {'an integer' if integer else 'a number'}, got {value!r}")
        if positive and value <= 0:
            self.fail(key, f"must be > 0, got {value!r}")
        if minimum is not None and value < minimum:
            self.fail(key, f"must be >= {minimum}, got {value!r}")
        return value

    def choice(self, value, key: str, choices):
        if value not in choices:
            self.fail(key, f"expected one of {', '.join(map(str, choices))}, got {value!r}")
        return value

    def node(self, value, key: str, nodes: Sequence[str]):
        if value not in nodes:
            self.fail(key, f"unknown datacenter {value!r} (known: {known_nodes(list(nodes))})")
        return value

    def nodes(self, values, key: str, nodes: Sequence[str]) -> list:
        """A list of datacenter names, each checked at ``key[i]``."""
        for i, n in enumerate(values):
            self.node(n, f"{key}[{i}]", nodes)
        return values
