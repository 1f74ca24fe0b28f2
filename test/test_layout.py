"""Validation of a sample on the source rank: every bad input gets an error naming it."""

import pytest
import torch

from physicsnemo_foldcp import ShardingOptions
from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.features import FeatureRegistry, UnknownFeatureError
from physicsnemo_foldcp.sharding.maps import dense_map_to_index, index_map_to_dense
from physicsnemo_foldcp.sharding.packing import pack, unpack
from physicsnemo_foldcp.sharding.plan import local_block
from physicsnemo_foldcp.sharding.prepare import prepare_sample
from physicsnemo_foldcp.sharding.validation import FeatureValidationError
from physicsnemo_foldcp.sharding.wire import expand_wire_blocks, pack_rank

REG = {p: FeatureRegistry.preset(p) for p in ("boltz1", "boltz2")}


@pytest.fixture(scope="module")
def sample():
    return make_complex(23, seed=5, preset="boltz2", msa_rows=5, n_conformers=2)


def prepare(x, cp=(2, 2), options=None):
    return prepare_sample(x, REG["boltz2"], cp, options=options)


@pytest.mark.parametrize("preset", ["boltz1", "boltz2"])
@pytest.mark.parametrize("kw", [{}, {"max_tokens": 40, "atom_multiple": 32}])
def test_synthetic_samples_validate(preset, kw):
    x = make_complex(31, seed=1, preset=preset, **kw)
    prepared = prepare_sample(x, REG[preset], (3, 2), options=ShardingOptions(atom_multiple=8))
    assert {m.name for m in prepared.metas} == set(x)


def test_unknown_feature(sample):
    with pytest.raises(UnknownFeatureError, match=r"\['my_extra'\] are not in the 'boltz2'"):
        prepare({**sample, "my_extra": torch.zeros(3)})


def test_token_axes_that_disagree(sample):
    x = {**sample, "res_type": sample["res_type"][:-1]}
    with pytest.raises(
        FeatureValidationError,
        match=r"tokens axes .* different lengths \[22, 23\]: 22 in res_type\[axis 0\]; 23 in",
    ):
        prepare(x)
    # With align_lengths the short axis is padded to the longest.
    prepared = prepare(x, options=ShardingOptions(align_lengths=True))
    assert prepared.padded["res_type"].shape[0] == 23


def test_pair_feature_not_square(sample):
    x = {**sample, "token_bonds": sample["token_bonds"][:, :-2]}
    with pytest.raises(FeatureValidationError, match=r"'token_bonds' is not square: .* 23 and 21"):
        prepare(x)


def test_atom_axes_that_disagree(sample):
    x = {**sample, "ref_pos": sample["ref_pos"][:-3]}
    with pytest.raises(FeatureValidationError, match=r"atoms axes .* different lengths"):
        prepare(x)


def test_map_not_one_hot(sample):
    a2t = sample["atom_to_token"].clone()
    a2t[4, 7] = 1
    with pytest.raises(FeatureValidationError, match=r"atom_to_token is not one-hot: atom 4"):
        prepare({**sample, "atom_to_token": a2t})


def test_atom_with_no_token(sample):
    a2t = sample["atom_to_token"].clone()
    a2t[10] = 0
    with pytest.raises(FeatureValidationError, match=r"assigns atom 10 to no token"):
        prepare({**sample, "atom_to_token": a2t})


def test_atoms_of_a_token_not_contiguous(sample):
    a2t = sample["atom_to_token"].clone()
    a2t[[2, 12]] = a2t[[12, 2]]
    with pytest.raises(FeatureValidationError, match=r"contiguous and in token order"):
        prepare({**sample, "atom_to_token": a2t})


def test_rep_atom_of_another_token(sample):
    t2r = sample["token_to_rep_atom"].clone()
    t2r[[0, 5]] = t2r[[5, 0]]
    with pytest.raises(FeatureValidationError, match=r"token_to_rep_atom maps token 0 to atom"):
        prepare({**sample, "token_to_rep_atom": t2r})


def test_index_out_of_range(sample):
    frames = sample["frames_idx"].clone()
    frames[0, 3, 1] = sample["ref_pos"].shape[0]
    with pytest.raises(
        FeatureValidationError,
        match=rf"'frames_idx' holds atoms indices, but value {frames[0, 3, 1]}",
    ):
        prepare({**sample, "frames_idx": frames})


def test_index_feature_with_float_dtype(sample):
    with pytest.raises(
        FeatureValidationError,
        match=r"'frames_idx' has dtype float32; the registry accepts int64, int32",
    ):
        prepare({**sample, "frames_idx": sample["frames_idx"].float()})


def test_batch_of_two_points_to_ddp(sample):
    x = {k: torch.stack([v, v]) for k, v in sample.items()}
    with pytest.raises(FeatureValidationError, match=r"batch size 2 per domain group.*ddp"):
        prepare(x)


def test_batch_of_one_is_accepted(sample):
    x = {k: v.unsqueeze(0) for k, v in sample.items()}
    assert prepare(x).batched


def test_mixed_batched_and_unbatched(sample):
    x = {**sample, "res_type": sample["res_type"].unsqueeze(0)}
    with pytest.raises(FeatureValidationError, match=r"some features carry a batch axis"):
        prepare(x)


def test_wrong_number_of_dims(sample):
    with pytest.raises(FeatureValidationError, match=r"'res_type' has shape \(23,\)"):
        prepare({**sample, "res_type": sample["res_type"][:, 0]})


def test_features_none_on_the_source():
    with pytest.raises(FeatureValidationError, match=r"source rank .* passed features=None"):
        prepare(None)


def test_atom_features_without_a_map(sample):
    x = {k: v for k, v in sample.items() if k != "atom_to_token"}
    with pytest.raises(FeatureValidationError, match=r"no one-hot \(atoms, tokens\) map"):
        prepare(x)


def test_non_tensor_values_pass_through(sample):
    prepared = prepare({**sample, "record_id": "1abc", "meta": {"resolution": 2.1}})
    assert prepared.values == {"record_id": "1abc", "meta": {"resolution": 2.1}}


def test_index_values_are_remapped_into_the_padded_atom_layout(sample):
    prepared = prepare(sample, options=ShardingOptions(atom_multiple=32))
    plan = prepared.plan
    # The padded frame atoms point at the same reference positions as the serial ones.
    padded_pos = prepared.padded["ref_pos"]
    assert torch.equal(
        padded_pos[prepared.padded["frames_idx"]], sample["ref_pos"][sample["frames_idx"]]
    )
    assert plan.padded_length("atoms") % 32 == 0 or plan.cp[0] > 1


def test_dense_and_index_map_layouts_round_trip(sample):
    for name in ("atom_to_token", "token_to_rep_atom", "r_set_to_rep_atom"):
        dense = sample[name]
        index = dense_map_to_index(dense)
        assert index.dtype == torch.int64 and index.shape == dense.shape[:1]
        rows_with_one = dense.sum(1) > 0
        assert torch.equal(index[rows_with_one], dense.argmax(1)[rows_with_one])
        assert bool((index[~rows_with_one] == -1).all())
        assert torch.equal(index_map_to_dense(index, dense.shape[1], dense.dtype), dense)


@pytest.mark.parametrize("kw", [{}, {"token_multiple": 4, "atom_multiple": 32}])
def test_packed_buffers_hold_the_blocks_of_the_padded_layout(kw):
    x = make_complex(160, seed=2, preset="boltz2", msa_rows=8)
    prepared = prepare(x, (2, 2), ShardingOptions(**kw))
    names = [f.name for f in prepared.metas]
    for coord in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        blocks = [
            local_block(REG["boltz2"][f.name], prepared.padded[f.name], prepared.plan, coord)
            for f in prepared.metas
        ]
        sent = pack_rank(prepared, coord)
        layout = prepared.local_layout(coord)
        got = expand_wire_blocks(
            unpack(sent, layout), prepared.metas, prepared.specs, prepared.plan, coord
        )
        for f, block, expected in zip(prepared.metas, got, blocks):
            assert block.dtype == expected.dtype and torch.equal(block, expected), f.name
        # 0/1 maps travel as one int64 per local row, everything else as its block.
        wire = {f.name: shape for f, (shape, _) in zip(prepared.metas, layout)}
        assert wire["atom_to_token"] == (blocks[names.index("atom_to_token")].shape[0],)
        assert sent.numel() < pack(blocks).numel()


def test_fast_map_checks_raise_the_element_wise_messages(sample):
    # Integer maps take the reduction path, float maps the element-wise one: same errors.
    for dtype in (torch.int64, torch.float32):
        bad = {k: v.clone() for k, v in sample.items() if isinstance(v, torch.Tensor)}
        bad["atom_to_token"] = bad["atom_to_token"].to(dtype)
        bad["atom_to_token"][3, 0] = 2
        with pytest.raises(FeatureValidationError, match="value 2.* at atom 3, token 0"):
            prepare(bad)
        bad = {k: v.clone() for k, v in sample.items() if isinstance(v, torch.Tensor)}
        bad["token_to_rep_atom"] = bad["token_to_rep_atom"].to(dtype)
        bad["token_to_rep_atom"][1, 0] = 1
        with pytest.raises(FeatureValidationError, match="token_to_rep_atom is not one-hot"):
            prepare(bad)
