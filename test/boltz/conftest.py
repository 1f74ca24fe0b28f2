"""Boltz-under-CP tests: Boltz's layers get their distributed forwards for every test here."""

import pytest

import physicsnemo_foldcp.boltz as fc_boltz


@pytest.fixture(scope="module", autouse=True)
def boltz_installed():
    """``physicsnemo_foldcp.boltz.install()`` once per test module."""
    fc_boltz.install()
    yield
