"""tests/fidelity.py's rule: a failure fails only when it repeats on a machine not stolen from."""

import pytest
from fidelity import fidelity

from testbed.results import STEAL_MAX

CALM, STOLEN = 0.0, STEAL_MAX * 2


def measurer(outcomes):
    """measure() giving (ok, steal) for each attempt in turn; problems() lists the failed."""
    it = iter(outcomes)
    return (lambda: next(it)), (lambda ok: [] if ok else ["out"])


def test_a_pass_returns_and_a_pass_after_one_failure_warns():
    assert fidelity(*measurer([(True, CALM)])) is True
    with pytest.warns(UserWarning, match="out of tolerance once, then within"):
        assert fidelity(*measurer([(False, CALM), (True, CALM)])) is True


def test_two_failures_not_stolen_fail():
    with pytest.raises(AssertionError, match="twice out of tolerance"):
        fidelity(*measurer([(False, CALM), (False, STOLEN), (False, CALM)]))


@pytest.mark.parametrize("outcomes, says", [
    ([(False, STOLEN)] * 3, "during each attempt"),
    ([(False, CALM), (False, STOLEN), (False, STOLEN)], "out of tolerance once, then not measurable again"),
])
def test_undecided_is_skipped_saying_why(outcomes, says):
    with pytest.raises(pytest.skip.Exception, match=says):
        fidelity(*measurer(outcomes))
