"""Prediction file names fit the file system, and a prediction never replaces a user's file.

One process; each refusal is checked for the file it names and for writing nothing.
"""

import hashlib

import numpy as np
import pytest
import torch

import physicsnemo_foldcp as fc
from physicsnemo_foldcp.models import ModelConfig, ReferenceFoldModel
from physicsnemo_foldcp.training import SyntheticComplexes, predict
from physicsnemo_foldcp.training.predict import (
    MAX_STEM,
    OutputExistsError,
    output_names,
    record_stem,
)

CONFIG = ModelConfig(c_atom=8, c_token=16, c_pair=8, n_blocks=1, n_heads=2)
LONG = "x" * 300


@pytest.fixture(scope="module")
def mesh():
    mesh = fc.init_mesh()
    yield mesh
    fc.shutdown()


class Named(SyntheticComplexes):
    """Synthetic complexes with the record ids given."""

    def __init__(self, ids):
        super().__init__(len(ids), 9, 11, seed=1, msa_rows=2)
        self.ids = list(ids)

    def record_id(self, index):
        return self.ids[index]


def model():
    torch.manual_seed(5)
    return ReferenceFoldModel(CONFIG)


def test_a_long_record_id_is_shortened_with_a_hash_of_the_whole_id():
    digest = hashlib.sha256(LONG.encode()).hexdigest()[:16]
    stem = record_stem(LONG, 0)
    assert stem == "x" * (MAX_STEM - 17) + "-" + digest and len(stem) == MAX_STEM
    assert record_stem(LONG, 5) == stem  # deterministic, whatever the index
    other = record_stem(LONG[:-1] + "y", 0)
    assert other != stem and other.startswith("x" * (MAX_STEM - 17) + "-")
    assert record_stem("x" * MAX_STEM, 0) == "x" * MAX_STEM  # at the limit: kept as it is
    names = output_names([LONG, LONG + "!", "short/id"])
    assert names[2] == "short_id.npz" and len(set(names)) == 3
    assert all(len(f".{n}.tmp.0123456789ab".encode()) <= 255 for n in names)


def test_a_long_record_id_is_predicted_into_its_shortened_file(mesh, tmp_path):
    result = predict(model(), mesh, Named([LONG, "b"]), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{record_stem(LONG, 0)}.npz", "b.npz"]
    )
    with np.load(tmp_path / f"{record_stem(LONG, 0)}.npz") as data:
        assert str(data["record_id"]) == LONG  # the file keeps the whole id
    assert len(result.files) == 2


def test_a_users_file_in_out_dir_is_refused_before_anything_is_written(mesh, tmp_path):
    mine = tmp_path / "b.npz"
    mine.write_bytes(b"my own results")
    for overwrite in (False, True):
        with pytest.raises(OutputExistsError) as err:
            predict(model(), mesh, Named(["a", "b"]), tmp_path, overwrite=overwrite)
        assert f"predict out_dir {tmp_path}" in str(err.value) and "(b.npz)" in str(err.value)
        assert "nothing was written" in str(err.value)
    assert mine.read_bytes() == b"my own results"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.npz"]  # a.npz was not written


def test_earlier_predictions_are_refused_unless_overwrite(mesh, tmp_path):
    predict(model(), mesh, Named(["a"]), tmp_path)
    before = (tmp_path / "a.npz").read_bytes()
    with pytest.raises(OutputExistsError, match=r"already holds 1 of the files .*\(a.npz\)"):
        predict(model(), mesh, Named(["a"]), tmp_path)
    assert (tmp_path / "a.npz").read_bytes() == before
    predict(model(), mesh, Named(["a"]), tmp_path, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npz"]


def test_a_symlink_at_a_planned_name_is_refused_even_with_overwrite(mesh, tmp_path):
    outside = tmp_path / "outside.npz"
    outside.write_bytes(b"elsewhere")
    out = tmp_path / "p"
    out.mkdir()
    (out / "a.npz").symlink_to(outside)
    with pytest.raises(OutputExistsError, match=r"not predictions this project wrote \(a.npz\)"):
        predict(model(), mesh, Named(["a"]), out, overwrite=True)
    assert outside.read_bytes() == b"elsewhere" and (out / "a.npz").is_symlink()
