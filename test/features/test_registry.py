"""The registry: presets, placement rules, validation, extension from Python and config."""

import pytest
import torch
from omegaconf import OmegaConf
from torch.distributed.tensor import Replicate, Shard

from physicsnemo_foldcp.data.synthetic import PRESET_KEYS
from physicsnemo_foldcp.features import FeatureRegistry, FeatureSpec, UnknownFeatureError

ROW = (Shard(0), Replicate())
TILE = (Shard(0), Shard(1))
ENSEMBLE_ROW = (Shard(1), Replicate())
REPLICATED = (Replicate(), Replicate())


@pytest.mark.parametrize("preset", ["boltz1", "boltz2"])
def test_preset_covers_every_feature_the_featurizer_emits(preset):
    registry = FeatureRegistry.preset(preset)
    missing = PRESET_KEYS[preset] - set(registry)
    assert not missing


@pytest.mark.parametrize(
    "preset, name, placements",
    [
        ("boltz2", "res_type", ROW),  # leading tokens axis
        ("boltz2", "ref_pos", ROW),  # leading atoms axis
        ("boltz2", "atom_to_token", ROW),  # atoms rows, token axis kept whole
        ("boltz2", "token_to_rep_atom", ROW),
        ("boltz2", "r_set_to_rep_atom", ROW),
        ("boltz2", "disto_target", TILE),  # tokens x tokens
        ("boltz2", "token_bonds", TILE),
        ("boltz2", "msa", TILE),  # msa rows on cp0, token columns on cp1
        ("boltz1", "msa", TILE),
        ("boltz2", "coords", ENSEMBLE_ROW),  # ensemble-leading: atoms on cp0
        ("boltz2", "frames_idx", ENSEMBLE_ROW),
        ("boltz1", "frames_idx", ROW),
        ("boltz2", "disto_coords_ensemble", ENSEMBLE_ROW),
        ("boltz2", "template_restype", ENSEMBLE_ROW),
        ("boltz2", "rdkit_bounds_index", REPLICATED),
        ("boltz2", "ensemble_ref_idxs", REPLICATED),
    ],
)
def test_placements_follow_the_axis_rules(preset, name, placements):
    assert FeatureRegistry.preset(preset)[name].placements == placements


def test_batched_placements_shift_past_the_batch_axis():
    spec = FeatureRegistry.preset("boltz2")["disto_target"]
    assert spec.batched_placements(True) == (Shard(1), Shard(2))
    assert spec.batched_placements(False) == TILE


def test_atom_index_features_are_declared():
    reg = FeatureRegistry.preset("boltz2")
    atom_indexed = {s.name for s in reg.specs() if s.index_of == "atoms"}
    assert {
        "frames_idx",
        "rdkit_bounds_index",
        "chiral_atom_index",
        "stereo_bond_index",
        "planar_bond_index",
        "planar_ring_5_index",
        "planar_ring_6_index",
        "connected_atom_index",
        "contact_pair_index",
    } <= atom_indexed
    assert reg["msa"].pad_value == 1
    assert reg["res_type"].pad_value == 0


def test_unknown_keys_are_named_with_how_to_register_them():
    reg = FeatureRegistry.preset("boltz2")
    with pytest.raises(UnknownFeatureError) as info:
        reg.check_keys(["res_type", "my_feature", "another_one"])
    message = str(info.value)
    assert "['another_one', 'my_feature']" in message
    assert "registry.register(FeatureSpec(" in message


def test_register_replace_and_unregister():
    reg = FeatureRegistry.preset("boltz2")
    reg.register(FeatureSpec("my_feature", axes=("tokens", None)))
    assert reg["my_feature"].placements == ROW
    with pytest.raises(ValueError, match="already registered"):
        reg.register(FeatureSpec("my_feature", axes=("atoms",)))
    reg.register(FeatureSpec("my_feature", axes=("tokens", "tokens")), replace=True)
    assert reg["my_feature"].placements == TILE
    reg.unregister("my_feature")
    assert "my_feature" not in reg


def test_fingerprint_tells_registries_apart():
    a, b = FeatureRegistry.preset("boltz2"), FeatureRegistry.preset("boltz2")
    assert a.fingerprint == b.fingerprint and a == b
    b.register(FeatureSpec("extra", axes=("tokens",)))
    assert a.fingerprint != b.fingerprint
    assert FeatureRegistry.preset("boltz1").fingerprint != a.fingerprint


def test_registry_from_yaml_config():
    cfg = OmegaConf.create(
        """
        preset: boltz2
        remove: [plddt]
        features:
          my_pair_bias: {axes: [tokens, tokens, null], pad_value: 0.0, dtypes: [float32]}
          my_atom_list: {axes: [null], index_of: atoms, mode: replicate, dtypes: [int64]}
        """
    )
    reg = FeatureRegistry.from_config(cfg)
    assert "plddt" not in reg
    assert reg["my_pair_bias"].placements == TILE
    assert reg["my_pair_bias"].dtypes == (torch.float32,)
    assert reg["my_atom_list"].placements == REPLICATED
    assert reg["my_atom_list"].index_of == "atoms"
    # Round trip through plain data.
    assert FeatureRegistry.from_config(reg.to_config()) == reg


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(axes=("residues",)), "unknown axis meaning"),
        (dict(axes=(None, "tokens")), "has no sharded placement"),
        (dict(axes=("tokens",), mode="scatter"), "mode 'scatter' is not one of"),
        (
            dict(axes=("tokens",), index_of="atoms", dtypes=(torch.float32,)),
            "index-valued feature cannot have dtype",
        ),
        (dict(axes=("tokens",), index_of="residues"), "index_of='residues'"),
        (dict(axes=("tokens",), one_hot=True), "one-hot map must have two axes"),
    ],
)
def test_invalid_specs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FeatureSpec("bad", **kwargs)


def test_config_with_unknown_fields_is_refused():
    with pytest.raises(ValueError, match=r"unknown spec field\(s\) \['axis'\]"):
        FeatureRegistry.from_config({"features": {"x": {"axis": ["tokens"]}}})
    with pytest.raises(ValueError, match="unknown registry preset 'boltz3'"):
        FeatureRegistry.from_config({"preset": "boltz3"})


def test_table_lists_every_feature():
    reg = FeatureRegistry.preset("boltz1")
    table = reg.table().splitlines()
    assert len(table) == len(reg) + 1
    assert any(line.startswith("frames_idx") and "values index atoms" in line for line in table)
