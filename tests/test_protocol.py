"""The control protocol is named in one place (agents/protocol.py): every message kind has its
row in the field table, messages are built only through it, and every message built in the
agents' code uses only the fields its row lists (read with ast, nothing run)."""

import ast
from pathlib import Path

import pytest

from agents.protocol import FIELDS, Msg, Transfer, kind_of, message, transfer_rows

AGENTS = Path(__file__).resolve().parent.parent / "agents"


def _message_calls():
    """(file:line, kind names, keyword names) of every ``message(Msg.KIND, ...)`` in agents/
    (``message(Msg.A if x else Msg.B, ...)``: both kinds)."""
    for f in sorted(AGENTS.glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "message" and node.args:
                names = [a.attr for a in ast.walk(node.args[0])
                         if isinstance(a, ast.Attribute) and getattr(a.value, "id", "") == "Msg"]
                yield f"{f.name}:{node.lineno}", names, [k.arg for k in node.keywords if k.arg]


def test_every_kind_has_its_row():
    assert set(FIELDS) == set(Msg)
    assert all(k.direction in ("c>a", "a>c", "both", "local") and k.meaning for k in FIELDS.values())
    assert all((k.direction == "local") == m.value.startswith("_") for m, k in FIELDS.items())


def test_messages_in_the_code_use_only_the_fields_of_their_row():
    calls = list(_message_calls())
    assert len(calls) > 30, "message() calls not found"
    bad = [f"{where}: {names} {fields}" for where, names, fields in calls
           if not names or any(not set(fields) <= set(FIELDS[Msg[n]].fields) for n in names)]
    assert not bad, "\n".join(bad)


def test_no_message_is_spelled_by_hand():
    """No ``{"msg": ...}`` literal outside agents/protocol.py: kinds are Msg members."""
    bad = [f"{f.name}:{node.lineno}" for f in sorted(AGENTS.glob("*.py")) if f.name != "protocol.py"
           for node in ast.walk(ast.parse(f.read_text())) if isinstance(node, ast.Dict)
           and any(isinstance(k, ast.Constant) and k.value == "msg" for k in node.keys)]
    assert not bad, bad


def test_message_refuses_a_field_its_row_does_not_list():
    assert message(Msg.GO, iteration=3, version=1) == {"msg": "go", "iteration": 3, "version": 1}
    with pytest.raises(ValueError, match="GO has no field round"):
        message(Msg.GO, iteration=3, round=1)
    assert kind_of({"msg": "task_done"}) is Msg.TASK_DONE and kind_of({"msg": "nonsense"}) is None


def test_transfer_rows_by_name():
    row = [0, 1, "a", "b", 0, 0, 0, "reduce", 8, 1, 2, 3, 4, 5, 6, "a>c>b"]
    t, = transfer_rows({"columns": list(Transfer._fields), "rows": [row]})
    assert (t.src, t.dst, t.bytes, t.route) == ("a", "b", 8, "a>c>b")
    old, = transfer_rows({"columns": list(Transfer._fields)[:-1], "rows": [row[:-1]]})  # before routes
    assert old.route == "" and old.recv_end_ns == 5
    assert transfer_rows(None) == transfer_rows({"columns": [], "rows": []}) == []
