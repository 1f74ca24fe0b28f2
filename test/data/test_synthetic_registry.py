"""Synthetic samples pass registry validation for both presets and lay out exactly."""

from __future__ import annotations

import pytest
import torch

from physicsnemo_foldcp.data.files import FeatureFileError, validate_sample
from physicsnemo_foldcp.data.synthetic import PRESET_KEYS, make_complex
from physicsnemo_foldcp.features import FeatureRegistry, UnknownFeatureError
from physicsnemo_foldcp.sharding.prepare import prepare_sample
from physicsnemo_foldcp.sharding.validation import FeatureValidationError

PRESETS = ["boltz1", "boltz2"]
CASES = [
    dict(n_tokens=1),
    dict(n_tokens=13, msa_rows=1),
    dict(n_tokens=40, msa_rows=5, n_conformers=2),
    dict(n_tokens=29, atom_multiple=32, max_tokens=37),
    dict(n_tokens=33, seed=3, composition={"protein": 0.5, "ligand": 0.5}),
]
CASE_IDS = ["1", "13-msa1", "40-msa5-e2", "29-pad", "33-ligands"]


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("cp", [(1, 1), (2, 3)], ids=lambda c: f"{c[0]}x{c[1]}")
def test_samples_pass_validation_and_round_trip_the_layout(preset, case, cp):
    if preset == "boltz1" and case.get("n_conformers", 1) > 1:
        case = {k: v for k, v in case.items() if k != "n_conformers"}
    x = make_complex(preset=preset, **case)
    registry = FeatureRegistry.preset(preset)
    assert set(x) == PRESET_KEYS[preset] and set(x) <= set(registry)
    prepared = prepare_sample(x, registry, cp)
    plan = prepared.plan
    assert plan.n_tokens == x["atom_to_token"].shape[1]
    assert plan.n_atoms == x["atom_to_token"].shape[0]
    assert {m.name for m in prepared.metas} == set(x)
    for meta in prepared.metas:
        spec, value = registry[meta.name], x[meta.name]
        assert meta.serial_shape == tuple(value.shape) and meta.dtype == value.dtype, meta.name
        padded = prepared.padded[meta.name]
        if spec.mode != "passthrough":
            padded = plan.from_padded(padded, spec.axes)
        if spec.index_of in ("atoms", "tokens"):
            padded = plan.unmap_index_values(padded, spec.index_of)
        assert torch.equal(padded, value), f"{meta.name} does not round-trip the layout"


@pytest.mark.parametrize("preset", PRESETS)
def test_batched_samples_validate_too(preset):
    x = make_complex(17, preset=preset, msa_rows=3)
    batched = {k: v.unsqueeze(0) for k, v in x.items()}
    assert prepare_sample(batched, FeatureRegistry.preset(preset), (2, 2)).batched


def test_validation_tells_the_presets_apart():
    boltz1 = make_complex(17, preset="boltz1", msa_rows=3)
    with pytest.raises(UnknownFeatureError, match="pocket_feature"):
        prepare_sample(boltz1, FeatureRegistry.preset("boltz2"), (1, 1))
    boltz2 = make_complex(17, preset="boltz2", msa_rows=3)
    with pytest.raises(UnknownFeatureError, match="affinity_token_mask"):
        prepare_sample(boltz2, FeatureRegistry.preset("boltz1"), (1, 1))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda x: x.update(atom_to_token=x["atom_to_token"][:, :-1]), "tokens axes"),
        (lambda x: x.update(frames_idx=x["frames_idx"] + 10_000), "'frames_idx' holds atoms"),
        (lambda x: x.update(coords=x["coords"][0]), "'coords' has shape"),
    ],
    ids=["short-map", "index-out-of-range", "missing-axis"],
)
def test_a_broken_sample_fails_validation_with_the_feature_named(change, match):
    x = make_complex(21, preset="boltz2", msa_rows=3)
    change(x)
    with pytest.raises(FeatureFileError, match=rf"^sample 21: .*{match}") as info:
        validate_sample(x, FeatureRegistry.preset("boltz2"), source="sample 21")
    assert isinstance(info.value, FeatureValidationError)
