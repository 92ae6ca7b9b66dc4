"""The documentation says what the code does.

* the generated regions of the reference pages equal what ``python3 -m testbed.docgen``
  makes of the code now, and every key, column and field the code has is described;
* the README is short; the README and the user pages carry no dated measurement, issue
  number or machine-specific remark, and every command they show is one a user types;
* every YAML example validates, and every relative link (and its anchor) resolves;
* every file under docs/measurements/ names its date, commit, machine and command;
* the planner guide's example passes the checks every registered scheme gets;
* the tutorial's first steps run as written on small-3 (``net``: a real emulated WAN), their
  sample output matches, and every results.json field they produce is documented.
"""

import json
import os
import re
import shlex
import subprocess
import sys
import types
import unicodedata
from pathlib import Path

import pytest
from test_schemes import GRAPHS, _bad_values, _inputs

from testbed import config, docgen
from testbed.errors import ConfigError
from testbed.plan import check_allreduce
from testbed.planners import REGISTRY, make_plan, schemes

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
README = REPO / "README.md"
USER_PAGES = [README] + sorted(p for p in DOCS.rglob("*.md") if "measurements" not in p.parts)
ALL_PAGES = [README] + sorted(DOCS.rglob("*.md"))
GENERATED = re.compile(r"<!-- BEGIN GENERATED: ([a-z0-9-]+) -->.*?<!-- END GENERATED: \1 -->", re.S)
# What a user types: the testbed's verbs as root from the repository root, the set-up script,
# the tests, the docs' generator and site, the lint, the VM's and Vagrant's commands.
COMMAND_PREFIXES = ("sudo python3 -m testbed", "sudo bash testbed/setup.sh", "sudo python3 -m pytest",
                    "python3 -m pytest", "python3 -m testbed.docgen", "sudo GLOO_SOCKET_IFNAME=tbnode python3 -m testbed",
                    "sudo PYTHON=", "sudo apt-get install", "vagrant ", "mkdocs ", "ruff check", "pip install",
                    "sudo bash testbed/vm/")


def _rel(p: Path) -> str:
    return str(p.relative_to(REPO))


def _code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def test_generated_reference_matches_the_code():
    problems = docgen.generate(write=False)
    assert not problems, "\n".join(problems)


def test_every_generated_section_describes_what_the_code_has():
    assert not docgen.stale_key_docs()
    for name, make in docgen.SECTIONS.items():
        assert docgen.UNDOCUMENTED not in make(), f"section {name}: an entry the code has is not described"
    assert {c for cols in docgen._columns().values() for c in cols}  # the code's column lists were found


def test_the_readme_is_short():
    assert len(README.read_text().splitlines()) <= 150


@pytest.mark.parametrize("page", USER_PAGES, ids=_rel)
def test_user_pages_carry_no_dated_measurement_issue_number_or_machine_remark(page):
    text = re.sub(r"\]\([^)]*\)", "]", page.read_text())  # a link may name a dated measurement file
    text = re.sub(r"measurements/20\d\d-\d\d-\d\d-", "measurements/", text)  # and so may a path
    prose = GENERATED.sub("", text)
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), "a date: dated measurements go in docs/measurements/"
    assert not re.search(r"\bissues? #?\d+|(?<![\w/&])#\d+\b", text, re.I), "an issue number"
    for remark in ("this machine", "2-core", "two-core", "this VM", "here, on", "on this platform"):
        assert remark.lower() not in prose.lower(), f"a machine-specific remark: {remark!r}"


@pytest.mark.parametrize("page", ALL_PAGES, ids=_rel)
def test_every_command_shown_is_one_a_user_types(page):
    if "measurements" in page.parts:  # the logs record the commands as they were run
        return
    for block in _code_blocks(page.read_text(), "sh"):
        for line in block.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            assert line.startswith(COMMAND_PREFIXES), f"{_rel(page)}: not a command a user types: {line}"
            for wrapper in ("flock", "PYTHONPATH", "timeout "):
                assert wrapper not in line, f"{_rel(page)}: {wrapper!r} in {line}"


def _slug(heading: str) -> str:
    """Python-Markdown's toc slug (what mkdocs and a repository page link to)."""
    value = unicodedata.normalize("NFKD", re.sub(r"[`*]", "", heading)).encode("ascii", "ignore").decode()
    value = re.sub(r"[^\w\s-]", "", value).strip().lower()
    return re.sub(r"[-\s]+", "-", value)


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


@pytest.mark.parametrize("page", ALL_PAGES, ids=_rel)
def test_every_relative_link_and_anchor_resolves(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{_rel(page)}: link to missing {target}"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest), f"{_rel(page)}: no heading #{anchor} in {_rel(dest)}"


def test_every_page_is_in_the_site_navigation():
    nav = (REPO / "mkdocs.yml").read_text()
    for page in DOCS.rglob("*.md"):
        assert str(page.relative_to(DOCS)) in nav, f"{_rel(page)} is not in mkdocs.yml's nav"


@pytest.mark.parametrize("page", sorted((DOCS / "measurements").glob("*.md")), ids=_rel)
def test_every_measurement_log_names_its_date_commit_machine_and_command(page):
    if page.name == "index.md":
        assert all(f.name in page.read_text() for f in page.parent.glob("*.md") if f.name != "index.md")
        return
    head = "\n".join(page.read_text().splitlines()[:12])
    for field in ("Date", "Commit", "Machine", "Command"):
        assert f"**{field}:**" in head, f"{_rel(page)}: no {field} in its header"
    assert re.search(r"\b[0-9a-f]{7,40}\b", head), f"{_rel(page)}: no commit id"


def test_readme_and_site_home_cite_the_same_papers():
    def papers(text):
        return text.split("## Papers implemented\n")[1].split("\n## ")[0].split("\nWhich section")[0].strip()
    assert papers(README.read_text()) == papers((DOCS / "index.md").read_text())
    readme = " ".join(README.read_text().split())
    for title in ("Multiple Trees", "Topology-adaptive", "Partial Reduce With", "Auxiliary Route", "Co-Design"):
        assert title in readme


SNIPPET_TOPOLOGIES = ("small-3", "crew-mesh-8", "netstorm-internet2-9")


@pytest.mark.parametrize("page", USER_PAGES, ids=_rel)
def test_every_yaml_example_validates(page, tmp_path):
    """A complete experiment validates as it stands; a topology loads; a snippet of experiment
    keys validates inside a minimal experiment on one of the shipped topologies."""
    import yaml

    for block in _code_blocks(GENERATED.sub("", page.read_text()), "yaml"):
        data = yaml.safe_load(block)
        if not isinstance(data, dict):
            continue
        if "datacenters" in data or "generator" in data:
            (tmp_path / f"{data.get('name', 'topo')}.yaml").write_text(block)  # for the experiments after it
            from testbed.topology import load_topology
            load_topology(data, source=_rel(page))
        elif {"name", "topology", "scheme"} <= set(data):
            config.validate(data, str(tmp_path / "example.yaml"))
        elif set(data) <= config.TOP_KEYS:
            errors = []
            for topology in SNIPPET_TOPOLOGIES:
                try:
                    config.validate({"name": "snippet", "topology": topology, "scheme": {"name": "ring"}, **data},
                                    _rel(page))
                    break
                except ConfigError as e:
                    errors.append(str(e))
            else:
                pytest.fail(f"{_rel(page)}: a snippet valid on no shipped topology: {errors}")


def _planner_example() -> str:
    text = (DOCS / "guides" / "writing-a-planner.md").read_text()
    return _code_blocks(text.split("<!-- planner-guide: example -->", 1)[1], "python")[0]


def test_the_planner_guides_example_passes_the_checks_every_scheme_gets():
    source = _planner_example()
    name = re.search(r'@planner\(\s*"([^"]+)"', source).group(1)
    assert name not in schemes(), f"the guide's example {name!r} collides with a registered scheme"
    module = types.ModuleType("testbed.planners._guide_example")
    try:
        exec(compile(source, "writing-a-planner.md", "exec"), module.__dict__)
        spec = schemes()[name]
        assert spec.reference and spec.doc
        for graph in GRAPHS.values():
            g = graph()
            plan = make_plan(name, g, 1009)
            plan.validate()
            assert set(plan.finishing()) == set(plan.contributing()) == set(g.nodes)
            check_allreduce(plan, _inputs(plan))
        plan = make_plan(name, GRAPHS["quick-5"](), 100)
        assert plan.meta["params"] == {k: p.default for k, p in spec.params.items()}
        for param, p in spec.params.items():
            for value, key, message in _bad_values(param, p):
                with pytest.raises(ConfigError, match=message) as e:
                    make_plan(name, GRAPHS["quick-5"](), 10, {param: value})
                assert e.value.key == f"scheme.{key}"
        exp = config.validate({"name": "t", "topology": "quick-5", "scheme": {"name": name, "chunks": 8}}, "x.yaml")
        assert exp.scheme["chunks"] == 8
    finally:
        REGISTRY.pop(name, None)


def _tutorial_region() -> str:
    text = (DOCS / "tutorial.md").read_text()
    return text.split("<!-- tutorial: tested -->", 1)[1].split("<!-- tutorial: end tested -->", 1)[0]


def test_the_tutorials_tested_steps_are_found():
    region = _tutorial_region()
    yaml_blocks = _code_blocks(region, "yaml")
    commands = [l for b in _code_blocks(region, "sh") for l in b.splitlines() if l.startswith("sudo")]
    assert len(yaml_blocks) == 1 and yaml_blocks[0].startswith("# my-compare.yaml")
    assert [c.split()[4] for c in commands] == ["validate", "plan", "run"]
    exp = config.validate(__import__("yaml").safe_load(yaml_blocks[0]), "my-compare.yaml")
    assert exp.topology.name == "small-3" and len(exp.variants) == 2


@pytest.mark.net
def test_the_tutorials_first_steps_run_as_written_on_small_3(netenv, tmp_path):
    """What the tutorial tells a new user to type, run in a fresh folder: the commands are
    the page's, with `sudo python3` this interpreter (the test runs as root already)."""
    region = _tutorial_region()
    (tmp_path / "my-compare.yaml").write_text(_code_blocks(region, "yaml")[0])
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # the checkout, from the user's folder
    outputs = []
    for block in _code_blocks(region, "sh"):
        for line in block.splitlines():
            if not line.startswith("sudo python3 -m testbed"):
                continue
            args = shlex.split(line.split("#")[0])[1:]
            args[0] = sys.executable
            res = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
            assert res.returncode == 0, f"{line}: exit {res.returncode}\n{res.stderr[-3000:]}"
            outputs.append(res.stdout)
    run_dir, = (tmp_path / "results").glob("*-my-compare")
    results = json.loads((run_dir / "results.json").read_text())
    assert results["summary"]["correct"] is True
    assert [v["label"] for v in results["variants"]] == ["ring", "ps"]
    assert (run_dir / "report.html").is_file() and (run_dir / "variants.csv").is_file()
    sample = region.split("<!-- tutorial: sample-run -->", 1)[1]
    sample_header = _code_blocks(sample, "text")[0].splitlines()[0]
    printed_header = next(l for l in outputs[-1].splitlines() if l.startswith("variant"))
    assert sample_header.split() == printed_header.split(), "the tutorial's sample output no longer matches"
    assert outputs[-1].splitlines()[-1].startswith("report: results/")
    assert not docgen.undocumented_results_fields(results), "results.json fields missing from docgen.RESULTS_FIELDS"
