"""Planners: pure functions from a WAN graph and parameters to a :class:`~testbed.plan.Plan`.

Every planner module in this package registers its schemes with :func:`planner`.  A
planner is called as ``func(graph, length, elem_bytes=..., **params)`` where ``graph`` is
the topology's ``nx.DiGraph`` (directed edges with ``rate_mbps`` and ``delay_ms``),
``length`` the number of vector elements and ``params`` the scheme's parameters.  Call
planners through :func:`make_plan`: it checks the parameters against the declared
:class:`Param` table (types, choices, bounds, datacenter names) once, for the experiment
loader and direct callers alike, times the planner and stamps ``params``, ``planner_s``
and ``reference`` into ``plan.meta``.  Planners never touch sockets or Mininet; what they
share lives in :mod:`.common`.

To add a scheme: a module here with ``@planner("name", "paper, section", param=Param(type,
default, doc, choices=..., kind=..., ge=...))`` on a function returning a Plan; the
experiment loader, ``plan``/``run`` and ``tests/test_schemes.py`` (exactness on small WANs,
parameter checks, an emulated run) pick it up from the registry.
"""

from __future__ import annotations

import functools
import importlib
import operator
import pkgutil
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import networkx as nx

from testbed.checks import Checker
from testbed.errors import ConfigError
from testbed.plan import Plan

NODE, NODES, NODE_MAP = "node", "nodes", "node-map"
_BOUNDS = {"ge": (">=", operator.ge), "gt": (">", operator.gt), "le": ("<=", operator.le), "lt": ("<", operator.lt)}


class ParamError(ConfigError):
    """A planner's objection to a parameter value that only planning can find (a ring order
    that misses a member, a roots count above the number of nodes); :func:`make_plan`
    re-raises it as a :class:`ConfigError` at the parameter's key path."""

    def __init__(self, param: str, message: str):
        super().__init__(message, key=param)
        self.param = param


@dataclass(frozen=True)
class Param:
    """One scheme parameter: its type(s), default and meaning, and the values it takes:
    ``choices``; ``kind`` ``"node"`` (a datacenter name; empty = the planner chooses) or
    ``"nodes"`` (a list of datacenter names; null = every node) or ``"node-map"`` (a mapping
    of datacenter names to datacenter names); numeric bounds ``ge``,
    ``gt``, ``le``, ``lt`` (>=, >, <=, <)."""

    type: type | tuple
    default: Any
    doc: str
    choices: tuple = ()
    kind: str = ""
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def check(self, value, key: str, nodes: Sequence[str], source: str = "") -> Any:
        """``value`` if it is valid for this parameter (ints widened to float, tuples to lists
        where the type asks for it), else ConfigError naming ``key``."""

        c = Checker(source)
        types = self.type if isinstance(self.type, tuple) else (self.type,)
        if float in types and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if list in types and isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            c.fail(key, f"expected {' or '.join(t.__name__ for t in types)}, got {value!r}")
        if self.choices:
            c.choice(value, key, self.choices)
        bounds = [(sign, test, getattr(self, name)) for name, (sign, test) in _BOUNDS.items()
                  if getattr(self, name) is not None]
        if not all(test(value, b) for _, test, b in bounds):
            c.fail(key, f"must be {' and '.join(f'{sign} {b}' for sign, _, b in bounds)}, got {value!r}")
        if self.kind == NODE and value:
            c.node(value, key, nodes)
        if self.kind == NODES and value is not None:
            c.nodes(value, key, nodes)
        if self.kind == NODE_MAP:
            for a, b in value.items():
                c.node(a, key, nodes)
                c.node(b, f"{key}.{a}", nodes)
        return value


@dataclass
class PlannerSpec:
    name: str
    func: Callable[..., Plan]
    reference: str
    params: dict[str, Param] = field(default_factory=dict)
    doc: str = ""


REGISTRY: dict[str, PlannerSpec] = {}


def planner(name: str, reference: str, **params: Param):
    """Register ``func`` as the planner of scheme ``name`` (``reference``: the paper section
    or source it follows) with parameter table ``params``."""

    def register(func):
        if name in REGISTRY:
            raise RuntimeError(f"scheme {name!r} registered twice")
        REGISTRY[name] = PlannerSpec(name, func, reference, params, (func.__doc__ or "").strip())
        return func

    return register


@functools.cache
def _load_all() -> None:
    for mod in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{mod.name}")


def schemes() -> dict[str, PlannerSpec]:
    """All registered schemes (importing every planner module on first use; a non-empty
    registry is not enough: a caller may have imported one planner module directly)."""
    _load_all()
    return REGISTRY


def resolve_scheme(scheme: dict, nodes: Sequence[str], *, source: str = "", key: str = "scheme") -> dict:
    """Check ``{name: ..., <param>: ...}`` against the scheme's parameter table and return
    it with every default filled in; errors are ConfigErrors at ``key.name`` / ``key.<param>``."""
    name = scheme.get("name")
    known = schemes()
    if name not in known:
        raise ConfigError(f"unknown scheme {name!r} (known: {', '.join(sorted(known))})",
                          source=source, key=f"{key}.name")
    spec = known[name]
    params = {}
    for k, v in scheme.items():
        if k == "name":
            continue
        if k not in spec.params:
            raise ConfigError(f"scheme {name!r} has no parameter {k!r} "
                              f"(parameters: {', '.join(spec.params) or 'none'})", source=source, key=f"{key}.{k}")
        params[k] = spec.params[k].check(v, f"{key}.{k}", list(nodes), source)
    return {"name": name, **{k: p.default for k, p in spec.params.items()}, **params}


def make_plan(name: str, graph: nx.DiGraph, length: int, params: dict | None = None,
              *, elem_bytes: int = 4, source: str = "", key: str = "scheme", aux: dict | None = None) -> Plan:
    """Check the parameters (:func:`resolve_scheme`), call the planner, and stamp
    ``params``, ``planner_s`` (its wall time) and ``reference`` into ``plan.meta``; with
    ``aux`` (:func:`.auxpaths.attach`'s options) add the plan's auxiliary paths.
    Bad parameters raise ConfigError at ``key.<param>`` (``source`` names the file)."""
    full = resolve_scheme({**(params or {}), "name": name}, list(graph.nodes), source=source, key=key)
    del full["name"]
    spec = REGISTRY[name]
    t0 = time.perf_counter()
    try:
        plan = spec.func(graph, length, elem_bytes=elem_bytes, **full)
    except ParamError as e:
        raise ConfigError(e.message, source=source, key=f"{key}.{e.param}") from None
    if aux:
        from .auxpaths import attach
        plan.aux = attach(plan, graph, **aux)
    plan.meta.update(params=full, planner_s=time.perf_counter() - t0, reference=spec.reference)
    return plan
