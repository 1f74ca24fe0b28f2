"""Fixtures of the data tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def boltz_library(tmp_path_factory):
    """Boltz's molecule directory (``mols/<CODE>.pkl``) of the canonical residues, built offline."""
    pytest.importorskip("rdkit")
    from physicsnemo_foldcp.testing.boltz_library import write_library

    return write_library(tmp_path_factory.mktemp("boltz_cache"))
