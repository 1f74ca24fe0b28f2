"""A feature file is untrusted input: bounded before it is decompressed, checked before use.

Every refusal is a ``FeatureFileError`` whose message names the file (and the feature).
"""

import io
import os
import tracemalloc
import zipfile

import numpy as np
import pytest
import torch

from physicsnemo_foldcp.data.files import (
    FeatureFileDataset,
    FeatureFileError,
    list_sample_files,
    load_sample,
    save_sample,
)
from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.features import FeatureRegistry
from physicsnemo_foldcp.training.config import build_dataset

MIB = 2**20
BOMB = 64 * MIB
"""Decompressed size of the bombs (each file is well under 1 MiB)."""
LIMIT = 8 * MIB


@pytest.fixture(scope="module")
def registry():
    return FeatureRegistry.preset("boltz2")


@pytest.fixture(scope="module")
def sample():
    return make_complex(9, seed=3, msa_rows=2)


def test_an_npz_bomb_is_refused_before_it_is_inflated(tmp_path):
    path = tmp_path / "bomb.npz"
    with open(path, "wb") as f:
        np.savez_compressed(f, res_type=np.zeros(BOMB // 8, dtype=np.int64))
    assert path.stat().st_size < MIB
    tracemalloc.start()
    try:
        with pytest.raises(FeatureFileError) as err:
            load_sample(path, max_bytes=LIMIT)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    with zipfile.ZipFile(path) as archive:
        declared = archive.getinfo("res_type.npy").file_size
    assert str(err.value).startswith(
        f"{path}: its 1 member(s) declare {declared} bytes (64.0 MiB) once decompressed, "
        f"more than the limit of {LIMIT} bytes (8.0 MiB): refused before decompressing"
    )
    assert peak < MIB, f"{peak} bytes allocated while refusing"


def test_an_npz_array_that_declares_more_than_it_holds_is_refused(tmp_path):
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f4", "fortran_order": False, "shape": (2**28,)}
    )
    path = tmp_path / "liar.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("ref_pos.npy", header.getvalue() + b"\0" * 64)
    with pytest.raises(FeatureFileError) as err:
        load_sample(path)
    message = str(err.value)
    assert str(path) in message and "'ref_pos.npy' declares shape (268435456,)" in message
    assert "holds 64 bytes" in message


def test_a_pt_bomb_is_refused_before_torch_reads_it(tmp_path, monkeypatch):
    plain = io.BytesIO()
    torch.save({"res_type": torch.zeros(BOMB // 8, dtype=torch.int64)}, plain)
    path = tmp_path / "bomb.pt"
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    assert path.stat().st_size < MIB

    def never(*args, **kwargs):
        raise AssertionError("torch.load was called on a file over the limit")

    monkeypatch.setattr(torch, "load", never)
    with pytest.raises(FeatureFileError) as err:
        FeatureFileDataset(tmp_path, validate=False, max_bytes=LIMIT)[0]
    assert str(path) in str(err.value) and "more than the limit of 8388608 bytes" in str(err.value)


def test_a_small_storage_viewed_as_a_large_tensor_is_refused(tmp_path):
    path = tmp_path / "view.pt"
    torch.save({"ref_pos": torch.zeros(1).expand(BOMB // 4)}, path)
    assert path.stat().st_size < MIB
    with pytest.raises(FeatureFileError, match=r"its tensors declare 67108864 bytes"):
        load_sample(path, max_bytes=LIMIT)


@pytest.mark.parametrize(
    ("name", "dtype", "accepted"),
    [
        ("res_type", torch.float64, "int64, int32, int16, int8, uint8"),
        ("ref_pos", torch.int64, "float32, bfloat16, float16"),
        ("coords", torch.float64, "float32, bfloat16, float16"),
        ("asym_id", torch.float32, "int64, int32, int16, int8, uint8"),
        ("ensemble_ref_idxs", torch.float32, "int64, int32"),
    ],
)
def test_a_feature_of_the_wrong_dtype_is_refused(tmp_path, registry, sample, name, dtype, accepted):
    path = save_sample({**sample, name: sample[name].to(dtype)}, tmp_path / "x.pt")
    with pytest.raises(FeatureFileError) as err:
        load_sample(path, registry)
    wanted = f"{path}: feature {name!r} has dtype {str(dtype).removeprefix('torch.')}; "
    assert str(err.value) == wanted + f"the registry accepts {accepted}"


@pytest.mark.parametrize(
    ("name", "value", "counts"),
    [
        ("ref_pos", float("nan"), "1 NaN and 0 infinite"),
        ("coords", float("inf"), "0 NaN and 1 infinite"),
        ("token_pad_mask", float("-inf"), "0 NaN and 1 infinite"),
        ("disto_target", float("nan"), "1 NaN and 0 infinite"),
    ],
)
def test_nan_and_inf_are_refused_naming_the_file_and_feature(
    tmp_path, registry, sample, name, value, counts
):
    bad = sample[name].clone()
    bad.view(-1)[1] = value
    path = save_sample({**sample, name: bad}, tmp_path / "x.npz")
    with pytest.raises(FeatureFileError) as err:
        load_sample(path, registry)
    assert str(err.value).startswith(f"{path}: feature {name!r} holds {counts} value(s)")


def test_the_registry_may_allow_nonfinite_values_for_a_feature(tmp_path, sample):
    allowing = FeatureRegistry.from_config(
        {"preset": "boltz2", "features": {"bfactor": {"axes": ["atoms"], "allow_nonfinite": True}}}
    )
    bfactor = sample["bfactor"].clone()
    bfactor[0] = float("nan")
    path = save_sample({**sample, "bfactor": bfactor}, tmp_path / "x.pt")
    assert torch.isnan(load_sample(path, allowing)["bfactor"][0])
    with pytest.raises(FeatureFileError, match=r"feature 'bfactor' holds 1 NaN"):
        load_sample(path, FeatureRegistry.preset("boltz2"))


def test_an_empty_complex_is_refused_by_name(tmp_path, registry):
    empty = {
        "token_pad_mask": torch.zeros(0),
        "res_type": torch.zeros(0, 33, dtype=torch.int64),
        "asym_id": torch.zeros(0, dtype=torch.int64),
    }
    path = save_sample(empty, tmp_path / "empty.pt")
    with pytest.raises(FeatureFileError) as err:
        load_sample(path, registry)
    assert str(err.value) == (
        f"{path}: the sample is an empty complex: its token axes have length 0 (e.g. "
        "'asym_id'); a complex needs at least one token"
    )


def test_negative_ensemble_indices_are_refused(tmp_path, registry, sample):
    path = save_sample({**sample, "ensemble_ref_idxs": torch.tensor([-3])}, tmp_path / "x.pt")
    with pytest.raises(FeatureFileError) as err:
        load_sample(path, registry)
    assert str(err.value) == (
        f"{path}: feature 'ensemble_ref_idxs' holds ensemble indices, but value -3 is out of "
        "range: indices must be >= 0"
    )


def test_a_missing_or_empty_data_path_is_named(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FeatureFileError) as err:
        build_dataset({"kind": "files", "path": str(missing)})
    assert str(err.value).startswith(f"{missing}: no such file or directory (the sample path")
    with pytest.raises(FeatureFileError, match="the sample path is empty"):
        FeatureFileDataset("")
    with pytest.raises(FeatureFileError, match="the sample path is empty"):
        list_sample_files(os.fsencode("").decode())


@pytest.mark.parametrize("kind", ["dangling", "looping"])
def test_a_broken_symlink_in_a_data_directory_is_reported(tmp_path, sample, kind):
    save_sample(sample, tmp_path / "a.pt")
    link = tmp_path / "b.pt"
    if kind == "dangling":
        link.symlink_to(tmp_path / "gone.pt")
    else:
        link.symlink_to(tmp_path / "c.pt")
        (tmp_path / "c.pt").symlink_to(link)
    with pytest.raises(FeatureFileError) as err:
        FeatureFileDataset(tmp_path)
    assert str(err.value).startswith(
        f"{link}: a dangling or looping symlink in the sample directory {tmp_path}"
    )


def test_a_symlink_to_a_sample_is_followed(tmp_path, registry, sample):
    real = save_sample(sample, tmp_path / "store" / "real.pt")
    data = tmp_path / "data"
    data.mkdir()
    (data / "linked.pt").symlink_to(real)
    dataset = FeatureFileDataset(data, registry)
    assert len(dataset) == 1 and torch.equal(dataset[0]["res_type"], sample["res_type"])


def test_a_fifo_is_refused_without_opening_it(tmp_path):
    fifo = tmp_path / "x.pt"
    os.mkfifo(fifo)
    with pytest.raises(FeatureFileError, match=rf"{fifo}: not a regular file"):
        load_sample(fifo)
