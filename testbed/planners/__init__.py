"""Planners: pure functions from a WAN graph and parameters to a :class:`~testbed.plan.Plan`.

Every planner module in this package registers its schemes with :func:`planner`.  A
planner is called as ``func(graph, length, elem_bytes=..., **params)`` where ``graph`` is
the topology's ``nx.DiGraph`` (directed edges with ``rate_mbps`` and ``delay_ms``),
``length`` the number of vector elements and ``params`` the scheme's parameters from the
experiment file (validated against the declared :class:`Param` table first).  Planners
never touch sockets or Mininet.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable

import networkx as nx

from testbed.plan import Plan


@dataclass(frozen=True)
class Param:
    """One scheme parameter: its type(s), default, meaning and (optionally) allowed values."""

    type: type | tuple
    default: Any
    doc: str
    choices: tuple = ()


@dataclass
class PlannerSpec:
    name: str
    func: Callable[..., Plan]
    params: dict[str, Param] = field(default_factory=dict)
    doc: str = ""


REGISTRY: dict[str, PlannerSpec] = {}


def planner(name: str, **params: Param):
    """Register ``func`` as the planner of scheme ``name`` with parameter table ``params``."""

    def register(func):
        if name in REGISTRY:
            raise RuntimeError(f"scheme {name!r} registered twice")
        REGISTRY[name] = PlannerSpec(name, func, params, (func.__doc__ or "").strip())
        return func

    return register


def _load_all() -> None:
    for mod in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{mod.name}")


def schemes() -> dict[str, PlannerSpec]:
    """All registered schemes (importing every planner module on first use)."""
    if not REGISTRY:
        _load_all()
    return REGISTRY


def make_plan(name: str, graph: nx.DiGraph, length: int, params: dict | None = None,
              *, elem_bytes: int = 4) -> Plan:
    """Resolve defaults and call the planner.  Parameter validation with file/key context
    is done by the experiment loader; here unknown names raise KeyError."""
    spec = schemes()[name]
    full = {k: p.default for k, p in spec.params.items()}
    full.update(params or {})
    unknown = set(full) - set(spec.params)
    if unknown:
        raise KeyError(f"scheme {name!r} has no parameter(s) {sorted(unknown)}")
    plan = spec.func(graph, length, elem_bytes=elem_bytes, **full)
    plan.meta.setdefault("params", full)
    return plan
