"""The lint contract's inline parts (ruff itself runs in .ci/run with pyproject.toml's
configuration): every ``# noqa`` says why, no function is longer than ``MAX_LINES``
unless its ``def`` line says why, and none is longer than ``HARD_MAX_LINES`` at all."""

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FILES = sorted(p for d in ("testbed", "agents", "tests") for p in (REPO / d).rglob("*.py"))
MAX_LINES = 50
HARD_MAX_LINES = 100
NOQA = re.compile(r"#\s*noqa\b(?::\s*[A-Z]+[0-9]+(?:\s*,\s*[A-Z]+[0-9]+)*)?(.*)$")


def comments(text: str) -> dict[int, str]:
    """Line -> its comment (code comments only, not strings)."""
    return {t.start[0]: t.string for t in tokenize.generate_tokens(io.StringIO(text).readline)
            if t.type == tokenize.COMMENT}


def noqa_without_reason(text: str) -> list[int]:
    """Lines whose ``# noqa`` names no reason after its codes (``-- why``)."""
    out = []
    for i, comment in comments(text).items():
        m = NOQA.search(comment)
        if m and not re.match(r"\s*--\s*\S", m.group(1)):
            out.append(i)
    return out


def long_functions(text: str) -> list[tuple[str, int, int]]:
    """(name, line, length) of every function over ``HARD_MAX_LINES`` lines, and of every one
    over ``MAX_LINES`` whose def line gives no reason (a comment ``... -- why``)."""
    notes = comments(text)
    out = []
    for n in ast.walk(ast.parse(text)):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = n.end_lineno - n.lineno + 1
            why = re.search(r"--\s*\S", notes.get(n.lineno, ""))
            if length > HARD_MAX_LINES or (length > MAX_LINES and not why):
                out.append((n.name, n.lineno, length))
    return out


def test_every_noqa_says_why():
    bad = [f"{f.relative_to(REPO)}:{i}" for f in FILES for i in noqa_without_reason(f.read_text())]
    assert not bad, "a # noqa without '-- reason':\n" + "\n".join(bad)


def test_no_long_function_without_a_reason():
    bad = [f"{f.relative_to(REPO)}:{line} {name} ({n} lines)" for f in FILES
           for name, line, n in long_functions(f.read_text())]
    assert not bad, (f"functions over {MAX_LINES} lines without a reason on their def line, or over "
                     f"{HARD_MAX_LINES} with one:\n" + "\n".join(bad))


@pytest.mark.parametrize("text, noqa, long", [
    ("x = 1  # noqa: E731\n", [1], []),
    ("x = 1  # noqa: E731 -- a table of lambdas\n", [], []),
    ("def f():\n" + "    x = 1\n" * MAX_LINES, [], [("f", 1, MAX_LINES + 1)]),
    ("def f():  # noqa: PLR0915 -- one state machine\n" + "    x = 1\n" * MAX_LINES, [], []),
    ("def f():  # -- one state machine\n" + "    x = 1\n" * HARD_MAX_LINES, [], [("f", 1, HARD_MAX_LINES + 1)]),
])
def test_the_checks_can_fail(text, noqa, long):
    assert noqa_without_reason(text) == noqa
    assert long_functions(text) == long
