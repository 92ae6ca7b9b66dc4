"""The Vagrantfile as `vagrant validate` reads it (vagrant and vagrant-libvirt installed; CI
installs them: testbed/vm/vagrant-stage.sh validate).  The full `vagrant up` cycle is CI's
Vagrant stage (testbed/vm/vagrant-stage.sh cycle)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("vagrant") is None, reason="vagrant not installed")


def _validate(tmp_path, vagrantfile: str, driver: str | None = None):
    project = tmp_path / "project"
    project.mkdir(exist_ok=True)
    (project / "Vagrantfile").write_text(vagrantfile)
    env = {k: v for k, v in os.environ.items() if k != "TESTBED_LIBVIRT_DRIVER"}
    env["VAGRANT_HOME"] = str(tmp_path / "vagrant.d")
    if driver is not None:
        env["TESTBED_LIBVIRT_DRIVER"] = driver
    return subprocess.run(["vagrant", "validate"], cwd=project, env=env, capture_output=True, text=True,
                          timeout=180)


@pytest.mark.parametrize("driver", [None, "kvm", "qemu"])
def test_the_vagrantfile_validates_with_either_libvirt_driver(tmp_path, driver):
    r = _validate(tmp_path, (REPO / "Vagrantfile").read_text(), driver)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_bad_driver_or_a_broken_vagrantfile_fails_validation(tmp_path):
    text = (REPO / "Vagrantfile").read_text()
    r = _validate(tmp_path, text, "bogus")
    assert r.returncode != 0 and "TESTBED_LIBVIRT_DRIVER=bogus: expected kvm or qemu" in r.stdout + r.stderr
    r = _validate(tmp_path, text.replace("lv.cpus = 2", "lv.no_such_option = 2"))
    assert r.returncode != 0, r.stdout
    r = _validate(tmp_path, text + "\nend\n")  # a syntax error
    assert r.returncode != 0, r.stdout
