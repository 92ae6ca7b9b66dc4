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
def test_hold_raises_the_order_as_far_as_the_kernel_allows_and_warms_once(most, held, full, tmp_path):
    param, warmed = _Param(9, most), tmp_path / "warmed"
    rec = memory.hold(param, warm_mib=8, warmed=warmed)
    assert (rec["page_reporting_order"], rec["held_at"], rec["full"]) == (9, held, full)
    assert param.value == (held or 9)
    assert rec["warmed_mib"] == (8 if held else 0)
    assert (rec["note"] is None) == full  # a partial hold, or none, says so
    again = memory.hold(param, warm_mib=8, warmed=warmed)  # the next network: held already, nothing to warm
    assert (again["held_at"], again["full"], again["warmed_mib"]) == (held, full, 0)


def test_memory_held_from_boot_is_warmed_once_per_boot(tmp_path):
    """A platform that raises the order on the boot command line holds memory never touched:
    still cold, so the first network of each boot warms it (the order alone does not say so)."""
    param, warmed = _Param(11, 11), tmp_path / "warmed"
    first = memory.hold(param, warm_mib=8, warmed=warmed)
    assert (first["page_reporting_order"], first["held_at"], first["full"], first["warmed_mib"]) == (11, 11, True, 8)
    assert memory.hold(param, warm_mib=8, warmed=warmed)["warmed_mib"] == 0
    warmed.write_text("the id of an earlier boot\n")  # the marker outlives a reboot where /run is on disk
    assert memory.hold(param, warm_mib=8, warmed=warmed)["warmed_mib"] == 8


def test_no_reporting_device_no_hold(tmp_path):
    assert memory.hold(tmp_path / "absent") is None
