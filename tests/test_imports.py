"""The import graph of testbed/ and agents/ (read with ast, nothing imported): no module
imports another module's private (_underscore) names or reaches into another object's
private members (``obj._name``), no lower layer imports an upper one, no import cycles
(imports inside functions count too: they are cycles all the same)."""

import ast
import re
from pathlib import Path

import networkx as nx
import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("testbed", "agents")
# Lower layers and the upper modules they must not import (the orchestration and the CLI).
UPPER = ("testbed.experiment", "testbed.runtime", "testbed.cli", "testbed.deploy", "testbed.bench")
LOWER = ("testbed.emulator", "testbed.planners", "agents", "testbed.plan", "testbed.wan", "testbed.checks",
         "testbed.topology", "testbed.topogen", "testbed.hosts")
# What an agent may import of the harness (deploy copies exactly these files to real hosts).
AGENT_HARNESS = {"testbed", "testbed.plan", "testbed.errors"}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for f in sorted((REPO / pkg).rglob("*.py")):
            parts = list(f.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = f
    return mods


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, str, int]]:
    """(imported module, imported name or '', line) for every import in ``path``; names
    that are submodules resolve to the submodule."""
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, "", node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[:len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub, "", node.lineno) if sub in MODULES else (base, a.name, node.lineno))
    return [(m, n, line) for m, n, line in out if m.split(".")[0] in PACKAGES]


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _under(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_the_graph_is_read():
    assert "testbed.experiment" in MODULES and "agents.agent" in MODULES
    assert any(m == "testbed.hosts" for m, _, _ in GRAPH["testbed.experiment"])
    assert any(m == "testbed.topogen" for m, _, _ in GRAPH["testbed.topology"])  # "from testbed import topogen"


def test_no_private_names_imported_from_other_modules():
    bad = [f"{mod}:{line} imports {name} from {m}" for mod, imps in GRAPH.items() for m, name, line in imps
           if name.startswith("_") and not name.startswith("__") and m != mod]
    assert not bad, "\n".join(bad)


# ``x._name`` that is no access to a private member: a namedtuple's public API.
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make"}


def _private_access(source: str) -> list[tuple[str, int]]:
    """(``obj._name``, line) for every access to a private attribute of anything but ``self``
    or ``cls`` (the class's own members) in ``source``; a line marked ``# noqa: SLF001 -- why``
    (ruff's code for the same rule, with the reason: a library with no public API for it) is
    an exception."""
    lines = source.splitlines()
    out = [(expr, line) for expr, line in _private_access_all(source)
           if not re.search(r"noqa: [A-Z0-9, ]*SLF001[A-Z0-9, ]* -- \S", lines[line - 1])]
    return out


def _private_access_all(source: str) -> list[tuple[str, int]]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                and node.attr not in NAMEDTUPLE_API \
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            out.append((ast.unparse(node), node.lineno))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) and str(node.args[1].value).startswith("_") \
                and not str(node.args[1].value).startswith("__") \
                and not (isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls")):
            out.append((ast.unparse(node), node.lineno))
    return out


def test_no_private_members_used_from_outside():
    """Nothing touches another object's or module's ``_private`` members: classes offer a
    public API (the coordinator's and the agent's driver API) for what others need."""
    bad = [f"{mod}:{line}: {expr}" for mod, path in MODULES.items()
           for expr, line in _private_access(path.read_text())]
    assert not bad, "\n".join(bad)


def test_no_upward_imports():
    bad = [f"{mod}:{line} imports {m}" for mod, imps in GRAPH.items() if _under(mod, LOWER)
           for m, _, line in imps if _under(m, UPPER)]
    assert not bad, "\n".join(bad)


def test_agents_import_only_the_harness_deploy_copies():
    # agents.coordinator runs on this machine (its command line writes with testbed.results)
    bad = [f"{mod}:{line} imports {m}" for mod, imps in GRAPH.items()
           if _under(mod, ("agents",)) and mod != "agents.coordinator"
           for m, _, line in imps if m.startswith("testbed") and m not in AGENT_HARNESS]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    g = nx.DiGraph()
    for mod, imps in GRAPH.items():
        g.add_node(mod)
        for m, _, _ in imps:
            # a package's __init__ is its own module; importing a name from a package is an
            # edge to that package, importing a submodule an edge to the submodule
            if m in MODULES and m != mod:
                g.add_edge(mod, m)
    cycles = sorted(sorted(c) for c in nx.simple_cycles(g))
    assert not cycles, f"import cycles: {cycles}"


@pytest.mark.parametrize("source, private, upward, member", [
    ("from testbed.config import _merge\n", True, False, False),
    ("from testbed.experiment import run_experiment\n", False, True, False),
    ("def f(coord):\n    coord._send('n', {})\n", False, False, True),
    ("import os\nos._exit(0)\n", False, False, True),
    ("def f(o):\n    return getattr(o, '_closing', False)\n", False, False, True),
    ("def f(p):\n    return p._actions  # noqa: SLF001 -- argparse has no public API\n", False, False, False),
    ("def f(p):\n    return p._actions  # noqa: SLF001\n", False, False, True),
    ("class A:\n    def f(self, h):\n        return self._x, h._replace(a=1)\n", False, False, False),
])
def test_the_checks_can_fail(tmp_path, source, private, upward, member):
    """The rules above catch what they are meant to (on a module written here)."""
    f = tmp_path / "probe.py"
    f.write_text(source)
    imps = _imports("testbed.emulator.probe", f)
    assert any(n.startswith("_") for _, n, _ in imps) == private
    assert any(_under(m, UPPER) for m, _, _ in imps) == upward
    assert bool(_private_access(source)) == member
