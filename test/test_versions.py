"""The tested upstream range is checked at import: an error naming it, or a warning on request."""

import os
import subprocess
import sys

import pytest

from physicsnemo_foldcp import versions


def test_installed_versions_are_tested():
    assert versions.untested() == []


def test_range_bounds():
    assert versions.in_range("2.2.2", "2.2.2", "2.3")
    assert versions.in_range("2.2.9+cu130", "2.2.2", "2.3")
    assert not versions.in_range("2.2.1", "2.2.2", "2.3")
    assert not versions.in_range("2.3.0", "2.2.2", "2.3")
    assert versions.in_range("2.14.1+cu130", "2.10", "3")
    assert not versions.in_range("2.9.1", "2.10", "3")


def test_outside_the_range_raises_one_error_naming_it(monkeypatch):
    monkeypatch.delenv(versions.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(ImportError, match=r"nvidia-physicsnemo>=2\.2\.2,<2\.3.*2\.3\.0"):
        versions.check({"nvidia-physicsnemo": "2.3.0", "torch": "2.14.1"})
    with pytest.raises(ImportError, match="torch is not installed"):
        versions.check({"nvidia-physicsnemo": "2.2.2", "torch": None})


def test_the_environment_variable_turns_it_into_a_warning(monkeypatch):
    monkeypatch.setenv(versions.ALLOW_UNTESTED_ENV, "1")
    with pytest.warns(UserWarning, match="2.3.0"):
        versions.check({"nvidia-physicsnemo": "2.3.0", "torch": "2.14.1"})


IMPORT_WITH_FAKE_VERSION = (
    "import importlib.metadata as m\n"
    "real = m.version\n"
    "m.version = lambda name: '2.3.1' if name == 'nvidia-physicsnemo' else real(name)\n"
    "import physicsnemo_foldcp\n"
    "print('imported')\n"
)


@pytest.mark.parametrize("allow", [False, True], ids=["refused", "allowed"])
def test_importing_the_package_checks_first(allow):
    env = {k: v for k, v in os.environ.items() if k != versions.ALLOW_UNTESTED_ENV}
    if allow:
        env[versions.ALLOW_UNTESTED_ENV] = "1"
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_WITH_FAKE_VERSION],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    if allow:
        assert done.returncode == 0, done.stderr
        assert "imported" in done.stdout and "2.3.1" in done.stderr
    else:
        assert done.returncode != 0
        assert "ImportError: physicsnemo-foldcp is tested with" in done.stderr
        assert "2.3.1" in done.stderr and "imported" not in done.stdout
