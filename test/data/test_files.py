"""Serial tests of feature dicts on disk: round trips, listing, validation errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from physicsnemo_foldcp.data.files import (
    FeatureFileDataset,
    FeatureFileError,
    list_sample_files,
    load_sample,
    save_sample,
    validate_sample,
)
from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.features import FeatureRegistry
from physicsnemo_foldcp.sharding.validation import FeatureValidationError


def assert_same_sample(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for name, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert isinstance(got[name], torch.Tensor), name
            assert got[name].dtype == value.dtype, (name, got[name].dtype, value.dtype)
            assert got[name].shape == value.shape, name
            assert torch.equal(got[name], value), name
        else:
            assert got[name] == value, name


@pytest.mark.parametrize("preset", ["boltz1", "boltz2"])
@pytest.mark.parametrize("suffix", [".pt", ".npz"])
def test_round_trip_keeps_values_dtypes_and_record_id(tmp_path, preset, suffix):
    x = make_complex(23, seed=4, preset=preset, msa_rows=3, atom_multiple=32)
    x["record_id"] = "1abc_A"
    dtypes = {v.dtype for v in x.values() if isinstance(v, torch.Tensor)}
    assert torch.bool in dtypes and torch.float32 in dtypes and torch.int64 in dtypes
    path = save_sample(x, tmp_path / f"sample{suffix}")
    assert path == tmp_path / f"sample{suffix}" and path.is_file()
    assert_same_sample(load_sample(path, FeatureRegistry.preset(preset)), x)


def test_npz_keeps_small_integer_and_half_dtypes(tmp_path):
    x = {
        "a": torch.tensor([1, -2], dtype=torch.int8),
        "b": torch.tensor([3], dtype=torch.int32),
        "c": torch.tensor([0.5], dtype=torch.float16),
        "d": torch.tensor([[True], [False]]),
        "e": torch.empty(2, 0, dtype=torch.int64),
    }
    assert_same_sample(load_sample(save_sample(x, tmp_path / "x.npz")), x)


def test_npz_refuses_what_it_cannot_hold(tmp_path):
    with pytest.raises(FeatureFileError, match=r"x\.npz: feature 'w' has dtype torch.bfloat16"):
        save_sample({"w": torch.zeros(2, dtype=torch.bfloat16)}, tmp_path / "x.npz")
    with pytest.raises(FeatureFileError, match=r"entry 'meta' is a dict"):
        save_sample({"meta": {"a": 1}}, tmp_path / "x.npz")
    with pytest.raises(FeatureFileError, match=r"unsupported sample file suffix '\.json'"):
        save_sample({"a": torch.zeros(1)}, tmp_path / "x.json")


def test_validation_error_names_the_file_and_the_feature(tmp_path):
    registry = FeatureRegistry.preset("boltz2")
    x = make_complex(15, seed=1, msa_rows=3)
    bad_dtype = {**x, "frames_idx": x["frames_idx"].float()}
    path = save_sample(bad_dtype, tmp_path / "bad_dtype.pt")
    with pytest.raises(
        FeatureFileError, match=r"bad_dtype\.pt: .*feature 'frames_idx' has dtype float32"
    ) as info:
        load_sample(path, registry)
    assert isinstance(info.value, FeatureValidationError)
    unknown = save_sample({**x, "my_feature": torch.zeros(15)}, tmp_path / "unknown.npz")
    with pytest.raises(FeatureFileError, match=r"unknown\.npz: .*\['my_feature'\]"):
        load_sample(unknown, registry)
    assert "my_feature" in load_sample(unknown), "without a registry nothing is validated"
    short = {**x, "res_type": x["res_type"][:-1]}
    with pytest.raises(FeatureFileError, match=r"^rec7: the tokens axes .*res_type"):
        validate_sample(short, registry, source="rec7")


def test_unreadable_files_are_named(tmp_path):
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(FeatureFileError, match=r"garbage\.pt: cannot read the sample"):
        load_sample(garbage)
    torch.save([torch.zeros(1)], tmp_path / "list.pt")
    with pytest.raises(FeatureFileError, match=r"list\.pt: holds a list, not a dict"):
        load_sample(tmp_path / "list.pt")
    with pytest.raises(FeatureFileError, match=r"missing\.npz: no such sample file"):
        load_sample(tmp_path / "missing.npz")
    np.savez(tmp_path / "objects.npz", names=np.array(["a", "b"]))
    with pytest.raises(FeatureFileError, match=r"objects\.npz: entry 'names'"):
        load_sample(tmp_path / "objects.npz")


def test_listing_sorts_a_directory_and_keeps_a_list_in_order(tmp_path):
    for name in ("b.npz", "a.pt", "c.pt"):
        save_sample({"token_index": torch.arange(3)}, tmp_path / name)
    (tmp_path / "notes.txt").write_text("ignored")
    (tmp_path / "sub.pt").mkdir()
    assert [p.name for p in list_sample_files(tmp_path)] == ["a.pt", "b.npz", "c.pt"]
    given = [tmp_path / "c.pt", tmp_path / "a.pt"]
    assert list_sample_files(given) == given
    assert list_sample_files(tmp_path / "c.pt") == [tmp_path / "c.pt"]
    with pytest.raises(FeatureFileError, match="no such sample file"):
        list_sample_files([tmp_path / "c.pt", tmp_path / "zz.pt"])
    with pytest.raises(FeatureFileError, match="unsupported sample file suffix"):
        list_sample_files([tmp_path / "notes.txt"])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FeatureFileError, match="holds no sample file"):
        list_sample_files(empty)
    with pytest.raises(FeatureFileError, match="list of sample files is empty"):
        list_sample_files([])


def test_dataset_reads_files_validates_and_adds_record_ids(tmp_path):
    samples = [make_complex(n, seed=n, msa_rows=2) for n in (11, 14)]
    save_sample(samples[0], tmp_path / "t0.pt")
    save_sample({**samples[1], "record_id": "kept"}, tmp_path / "t1.npz")
    dataset = FeatureFileDataset(tmp_path)
    assert len(dataset) == 2 and dataset.registry.name == "boltz2"
    assert [dataset.record_id(i) for i in range(2)] == ["t0", "t1"]
    assert_same_sample(dataset[0], {**samples[0], "record_id": "t0"})
    assert_same_sample(dataset[-1], {**samples[1], "record_id": "kept"})
    assert "record_id" not in FeatureFileDataset(tmp_path, record_key=None)[0]
    with pytest.raises(IndexError, match="sample index 2 out of range for 2 files"):
        dataset[2]
    save_sample({**samples[0], "token_index": samples[0]["token_index"][:-1]}, tmp_path / "t2.pt")
    dataset = FeatureFileDataset(tmp_path)
    with pytest.raises(FeatureFileError, match=r"t2\.pt: .*token_index"):
        dataset[2]
    assert dataset[0]["record_id"] == "t0"
    assert "token_index" in FeatureFileDataset(tmp_path, validate=False)[2]
