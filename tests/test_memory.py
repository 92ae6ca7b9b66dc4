"""Holding a VM's free memory from its hypervisor (testbed.emulator.memory)."""

import pytest

from testbed.emulator import memory


class _Param:
    """A kernel's page_reporting_order: accepts orders up to ``most`` (upstream: 10)."""

    def __init__(self, value: int, most: int):
        self.value, self.most = value, most

    def exists(self) -> bool:
        return True

    def read_text(self) -> str:
        return f"{self.value}\n"

    def write_text(self, text: str) -> None:
        if int(text) > self.most:
            raise OSError(22, "Invalid argument")
        self.value = int(text)


@pytest.mark.parametrize("most, held, full", [(11, 11, True), (10, 10, False), (9, None, False)])
def test_hold_raises_the_order_as_far_as_the_kernel_allows_and_warms_once(most, held, full):
    param = _Param(9, most)
    rec = memory.hold(param, warm_mib=8)
    assert (rec["page_reporting_order"], rec["held_at"], rec["full"]) == (9, held, full)
    assert param.value == (held or 9)
    assert rec["warmed_mib"] == (8 if held else 0)
    assert (rec["note"] is None) == full  # a partial hold, or none, says so
    again = memory.hold(param, warm_mib=8)  # the next network: held already, nothing to warm
    assert (again["held_at"], again["full"], again["warmed_mib"]) == (held, full, 0)


def test_no_reporting_device_no_hold(tmp_path):
    assert memory.hold(tmp_path / "absent") is None
