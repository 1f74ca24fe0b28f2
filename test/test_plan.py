"""The sharding plan: blocks, padding, layout maps and atom<->token validation (serial)."""

import pytest
import torch

from physicsnemo_foldcp.sharding.plan import (
    FeatureValidationError,
    atom_tokens_from_map,
    build_plan,
    check_map_within_tokens,
    split_sizes,
)


def one_hot_map(owner, n_tokens):
    """[A, N] map from the owning token of each atom (-1: no token)."""
    a2t = torch.zeros(len(owner), n_tokens, dtype=torch.long)
    for a, t in enumerate(owner):
        if t >= 0:
            a2t[a, t] = 1
    return a2t


def test_split_sizes_matches_tensor_split():
    for n in range(0, 12):
        for parts in range(1, 5):
            expected = [len(c) for c in torch.arange(n).tensor_split(parts)]
            assert split_sizes(n, parts) == expected


def test_six_tokens_on_four_row_blocks():
    plan = build_plan({"tokens": 6}, (4, 1))
    assert plan.row_sizes("tokens") == [2, 2, 1, 1]
    assert [plan.block("tokens", 0, i) for i in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 6)]


def test_atoms_follow_their_tokens_and_trailing_pads_go_last():
    # 5 tokens with 3, 0, 2, 1, 4 atoms, then 2 pad atoms with no token.
    owner = [0, 0, 0, 2, 2, 3, 4, 4, 4, 4, -1, -1]
    tokens = atom_tokens_from_map(one_hot_map(owner, 5))
    assert tokens.tolist() == owner
    plan = build_plan({"tokens": 5, "atoms": 12}, (2, 3), atom_tokens=tokens)
    assert plan.token_bounds == (0, 3, 5)
    assert plan.atom_bounds == (0, 5, 12)  # row 1 = atoms of tokens 3, 4 + both pads
    assert plan.column_sizes() == [2, 2, 1]  # non-square: columns split on their own


def test_per_shard_padding_layout_against_a_hand_built_one():
    owner = [0, 0, 1, 1, 1, 2, 3, 3, 4]
    tokens = atom_tokens_from_map(one_hot_map(owner, 5))
    plan = build_plan(
        {"tokens": 5, "atoms": 9}, (2, 2), atom_tokens=tokens, token_multiple=2, atom_multiple=4
    )
    # Rows: tokens [0,3) -> 4 local, [3,5) -> 2 local; atoms [0,6) -> 8, [6,9) -> 4.
    assert plan.row_sizes("tokens") == [4, 2] and plan.row_sizes("atoms") == [8, 4]
    assert plan.positions("tokens").tolist() == [0, 1, 2, 4, 5]
    assert plan.positions("atoms").tolist() == [0, 1, 2, 3, 4, 5, 8, 9, 10]
    assert plan.column_sizes() == [4, 2]  # square mesh: columns are the row blocks
    x = torch.arange(5 * 5).reshape(5, 5)
    padded = plan.to_padded(x, ("tokens", "tokens"), -1)
    expected = torch.full((6, 6), -1)
    keep = [0, 1, 2, 4, 5]
    for a, pa in enumerate(keep):
        for b, pb in enumerate(keep):
            expected[pa, pb] = x[a, b]
    assert torch.equal(padded, expected)
    assert torch.equal(plan.from_padded(padded, ("tokens", "tokens")), x)
    assert plan.is_pad("tokens").tolist() == [False, False, False, True, False, False]


def test_index_values_remap_and_back():
    owner = [0, 0, 1, 2, 2, 2]
    plan = build_plan(
        {"tokens": 3, "atoms": 6},
        (3, 1),
        atom_tokens=atom_tokens_from_map(one_hot_map(owner, 3)),
        atom_multiple=4,
    )
    idx = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    mapped = plan.remap_index_values(idx, "atoms")
    assert mapped.dtype == torch.int32
    assert mapped.tolist() == [[0, 1, 4], [8, 9, 10]]
    assert torch.equal(plan.unmap_index_values(mapped, "atoms"), idx)
    with pytest.raises(FeatureValidationError, match="pad position"):
        plan.unmap_index_values(torch.tensor([3]), "atoms")


@pytest.mark.parametrize(
    "a2t, mask, message",
    [
        ([[1, 0], [2, 0]], None, r"not one-hot: value 2 at atom 1, token 0"),
        ([[1, 0], [1, 1]], None, r"atom 1 belongs to 2 tokens"),
        ([[1, 0], [0, 0], [0, 1]], None, r"assigns atom 1 to no token, but atom 2 after it"),
        ([[1, 0], [0, 1], [0, 0]], [1, 1, 1], r"atom 2 to no token, but atom_pad_mask marks it"),
        ([[0, 1], [1, 0]], None, r"atom 1 belongs to token 0, after an atom of token 1"),
        ([[1, 0, 0], [0, 0, 1], [1, 0, 0]], None, r"contiguous"),
    ],
)
def test_bad_atom_to_token_maps(a2t, mask, message):
    mask = None if mask is None else torch.tensor(mask)
    with pytest.raises(FeatureValidationError, match=message):
        atom_tokens_from_map(torch.tensor(a2t), mask)


def test_token_to_atom_map_must_pick_an_atom_of_the_token():
    tokens = torch.tensor([0, 0, 1, 1])
    good = torch.tensor([[0, 1, 0, 0], [0, 0, 1, 0]])
    check_map_within_tokens("token_to_rep_atom", good, tokens)
    bad = torch.tensor([[0, 1, 0, 0], [1, 0, 0, 0]])
    with pytest.raises(
        FeatureValidationError, match="maps token 1 to atom 0, which belongs to token 0"
    ):
        check_map_within_tokens("token_to_rep_atom", bad, tokens)


def test_rset_rows_follow_their_tokens():
    owner = [0, 0, 1, 2, 2, 3]
    tokens = atom_tokens_from_map(one_hot_map(owner, 4))
    rset = torch.zeros(4, 6, dtype=torch.long)
    rset[0, 1] = rset[1, 3] = rset[2, 5] = 1  # tokens 0, 2, 3; last row empty (pad)
    plan = build_plan(
        {"tokens": 4, "atoms": 6, "rset": 4},
        (2, 1),
        atom_tokens=tokens,
        rset_bounds_from=("r_set_to_rep_atom", rset),
    )
    assert plan.rset_bounds == (0, 1, 4)  # row block 0 = tokens 0, 1; block 1 = 2, 3 + pad


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(token_multiple=0), "token_multiple must be an integer >= 1"),
        (dict(atom_multiple=-2), "atom_multiple must be an integer >= 1"),
        (dict(token_bounds=(0, 5, 3)), "non-decreasing boundaries"),
        (dict(token_bounds=(0, 2)), "3 non-decreasing boundaries"),
    ],
)
def test_bad_plan_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_plan({"tokens": 4}, (2, 1), **kwargs)


def test_explicit_token_bounds():
    plan = build_plan({"tokens": 10}, (3, 1), token_bounds=(0, 1, 8, 10))
    assert plan.row_sizes("tokens") == [1, 7, 2]
