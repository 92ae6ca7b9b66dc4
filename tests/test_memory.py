"""Holding a VM's free memory from its hypervisor (testbed.emulator.memory)."""

from pathlib import Path

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


def _virtio(tmp_path, device: str = "0x0005", features: str = "0110010100") -> Path:
    """A sysfs virtio bus with one device (default: a balloon that offers page reporting, bit 5;
    the features of this project's VMs)."""
    dev = tmp_path / "virtio" / "virtio0"
    dev.mkdir(parents=True)
    (dev / "device").write_text(device + "\n")
    (dev / "features").write_text(features + "0" * 54 + "\n")
    return tmp_path / "virtio"


@pytest.mark.parametrize("most, held, full", [(11, 11, True), (10, 10, False), (9, None, False)])
def test_hold_raises_the_order_as_far_as_the_kernel_allows_and_warms_once(most, held, full, tmp_path):
    param, warmed, devices = _Param(9, most), tmp_path / "warmed", _virtio(tmp_path)
    rec = memory.hold(param, warm_mib=8, warmed=warmed, devices=devices)
    assert (rec["page_reporting_order"], rec["held_at"], rec["full"]) == (9, held, full)
    assert param.value == (held or 9)
    assert rec["warmed_mib"] == (8 if held else 0)
    assert (rec["note"] is None) == full  # a partial hold, or none, says so
    again = memory.hold(param, warm_mib=8, warmed=warmed, devices=devices)  # the next network: held already, nothing to warm
    assert (again["held_at"], again["full"], again["warmed_mib"]) == (held, full, 0)


def test_memory_held_from_boot_is_warmed_once_per_boot(tmp_path):
    """A platform that raises the order on the boot command line holds memory never touched:
    still cold, so the first network of each boot warms it (the order alone does not say so)."""
    param, warmed, devices = _Param(11, 11), tmp_path / "warmed", _virtio(tmp_path)
    first = memory.hold(param, warm_mib=8, warmed=warmed, devices=devices)
    assert (first["page_reporting_order"], first["held_at"], first["full"], first["warmed_mib"]) == (11, 11, True, 8)
    assert memory.hold(param, warm_mib=8, warmed=warmed, devices=devices)["warmed_mib"] == 0
    warmed.write_text("the id of an earlier boot\n")  # the marker outlives a reboot where /run is on disk
    assert memory.hold(param, warm_mib=8, warmed=warmed, devices=devices)["warmed_mib"] == 8


@pytest.mark.parametrize("device, features", [("0x0005", "0110000100"), ("0x0002", "0110010100")])
def test_no_reporting_device_no_hold(tmp_path, device, features):
    """The order's file alone is no device (Debian's kernel in CI's guest reads 11 with none):
    a balloon without page reporting, or another device with bit 5, holds and warms nothing."""
    param = _Param(11, 11)
    assert memory.hold(tmp_path / "absent", devices=_virtio(tmp_path / "balloon")) is None
    assert memory.hold(param, warm_mib=8, warmed=tmp_path / "warmed", devices=_virtio(tmp_path, device, features)) is None
    assert not (tmp_path / "warmed").exists()


def test_warming_takes_at_most_half_the_available_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "available_mib", lambda: 10)  # a small VM: 4 GiB would not fit
    rec = memory.hold(_Param(9, 11), warm_mib=8, warmed=tmp_path / "warmed", devices=_virtio(tmp_path))
    assert rec["warmed_mib"] == 5
