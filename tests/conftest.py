import os
import shutil

import pytest


def _can_emulate() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc)"
    if not shutil.which("mnexec"):
        return "mnexec missing (run testbed/setup.sh)"
    return None


@pytest.fixture
def netenv():
    """Skip unless this machine can build emulated networks; afterwards assert that the
    test left nothing behind (processes, interfaces, namespaces that were not there
    before it started)."""
    why = _can_emulate()
    if why:
        pytest.skip(why)
    from testbed.emulator.cleanup import leftovers

    before = {k: set(v) for k, v in leftovers().items()}
    yield before
    left = {k: sorted(set(v) - before[k]) for k, v in leftovers().items()}
    assert not any(left.values()), f"left behind: {left}"

