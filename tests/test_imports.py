"""The import graph of testbed/ and agents/ (read with ast, nothing imported): no module
imports another module's private (_underscore) names, no lower layer imports an upper one,
no import cycles (imports inside functions count too: they are cycles all the same)."""

import ast
from pathlib import Path

import networkx as nx
import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("testbed", "agents")
# Lower layers and the upper modules they must not import (the orchestration and the CLI).
UPPER = ("testbed.experiment", "testbed.runner", "testbed.cli", "testbed.deploy", "testbed.bench")
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


def test_no_upward_imports():
    bad = [f"{mod}:{line} imports {m}" for mod, imps in GRAPH.items() if _under(mod, LOWER)
           for m, _, line in imps if _under(m, UPPER)]
    assert not bad, "\n".join(bad)


def test_agents_import_only_the_harness_deploy_copies():
    bad = [f"{mod}:{line} imports {m}" for mod, imps in GRAPH.items() if _under(mod, ("agents",))
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


@pytest.mark.parametrize("source, private, upward", [
    ("from testbed.config import _merge\n", True, False),
    ("from testbed.experiment import run_experiment\n", False, True),
])
def test_the_checks_can_fail(tmp_path, source, private, upward):
    """The rules above catch what they are meant to (on a module written here)."""
    f = tmp_path / "probe.py"
    f.write_text(source)
    imps = _imports("testbed.emulator.probe", f)
    assert any(n.startswith("_") for _, n, _ in imps) == private
    assert any(_under(m, UPPER) for m, _, _ in imps) == upward
