"""Run-time features: what a run adds to a plan on the agents, one module each.

A planner turns a graph into a plan (:mod:`testbed.planners`); a run-time feature changes
how a plan *runs*: the closed loop (:mod:`.closed_loop`: probing, re-planning), auxiliary
multipath transmission (:mod:`.multipath`), CREW's groups (:mod:`.groups`).  Each is a
:class:`Feature` subclass registered with :func:`feature`; for every run
:func:`testbed.experiment.run_variants` asks every feature for its options for the
coordinator and agents (:meth:`Feature.options`: keywords of
:func:`testbed.hosts.run_agents`) and, after the run, for its part of the run's record in
results.json (:meth:`Feature.summarise`), of the progress line (:meth:`Feature.note`), of a
variant's summary (:meth:`Feature.variant_summary`) and of a failed run's record
(:meth:`Feature.failure`).  A feature that does not apply to a scheme returns nothing.

To add a run-time feature: a module here with a ``@feature("name")`` subclass of
:class:`Feature` overriding what it needs; its scheme block is a key of
``config.RUN_TIME_KEYS`` checked in ``config._scheme``.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable

from testbed.config import Experiment
from testbed.plan import Plan


@dataclass(frozen=True)
class RunContext:
    """One run of one variant: the experiment, the variant's scheme and plan (version 0),
    ``truth(src, dst)`` (the emulator's current rate and delay; None: unknown), the run's
    seed and the iterations it runs (warm-up included)."""

    exp: Experiment
    scheme: dict
    plan: Plan
    truth: Callable[[str, str], dict | None] | None
    seed: int
    iterations: int


class Feature:
    """A run-time feature; every hook's default: nothing to add."""

    name = ""

    def check_plan(self, exp: Experiment, scheme: dict, plan: Plan, source: str, key: str) -> None:
        """ConfigError (at ``key``, the scheme's, in ``source``) if this feature cannot work
        with ``plan``; checked when the experiment is planned, before any run."""

    def options(self, ctx: RunContext) -> dict:
        """Keywords of :func:`testbed.hosts.run_agents` for this run ({}: off)."""
        return {}

    def summarise(self, result: dict, record: dict) -> dict:
        """Keys to add to (or replace in) a run's ``record`` from the coordinator's ``result``."""
        return {}

    def note(self, record: dict) -> str:
        """Text for the run's progress line ("" none)."""
        return ""

    def variant_summary(self, runs: list[dict]) -> dict:
        """Keys of a variant's summary from its runs' records."""
        return {}

    def failure(self, results: dict) -> dict:
        """Keys of a failed run's record from what completed (the coordinator's results)."""
        return {}


_FEATURES: dict[str, Feature] = {}


def feature(name: str):
    """Register the decorated :class:`Feature` subclass under ``name``."""
    def register(cls: type[Feature]) -> type[Feature]:
        if name in _FEATURES:
            raise ValueError(f"run-time feature {name!r} registered twice")
        inst = cls()
        inst.name = name
        _FEATURES[name] = inst
        return cls
    return register


def features() -> dict[str, Feature]:
    """Every registered feature, by name (the modules of this package, imported once)."""
    for m in pkgutil.iter_modules(__path__):  # (a module imported before registered itself then)
        importlib.import_module(f"{__name__}.{m.name}")
    return dict(_FEATURES)


def check_plan(exp: Experiment, scheme: dict, plan: Plan, *, source: str, key: str) -> None:
    """Every feature's :meth:`Feature.check_plan`."""
    for f in features().values():
        f.check_plan(exp, scheme, plan, source, key)


def options(ctx: RunContext) -> dict:
    """Every feature's options for a run, merged; ValueError if two set the same keyword."""
    out: dict = {}
    for f in features().values():
        for k, v in f.options(ctx).items():
            if k in out:
                raise ValueError(f"run-time features set {k!r} twice ({f.name})")
            out[k] = v
    return out


def summarise(result: dict, record: dict) -> dict:
    """``record`` with every feature's part added."""
    for f in features().values():
        record.update(f.summarise(result, record))
    return record


def notes(record: dict) -> str:
    """Every feature's part of a run's progress line."""
    return "".join(f.note(record) for f in features().values())


def variant_summary(runs: list[dict]) -> dict:
    out: dict = {}
    for f in features().values():
        out.update(f.variant_summary(runs))
    return out


def failure(results: dict) -> dict:
    out: dict = {}
    for f in features().values():
        out.update(f.failure(results))
    return out
