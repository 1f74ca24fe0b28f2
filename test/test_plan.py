"""The sharding plan: blocks, padding, layout maps and atom<->token validation (serial)."""

import itertools
import math

import pytest
import torch

from physicsnemo_foldcp.features import FeatureSpec
from physicsnemo_foldcp.sharding.plan import build_plan, column_block_sizes, split_sizes
from physicsnemo_foldcp.sharding.validation import (
    FeatureValidationError,
    atom_tokens_from_map,
    check_map_within_tokens,
    rset_row_tokens,
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
        rset_rows=("r_set_to_rep_atom", rset_row_tokens("r_set_to_rep_atom", rset, tokens)),
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


# -- the plan's geometry against a computation from first principles ------------------------

GEOMETRY_SPECS = [
    FeatureSpec("pair", axes=("tokens", "tokens", None), pad_value=-1),
    FeatureSpec("single", axes=("tokens", None)),
    FeatureSpec("atom_feat", axes=("atoms", None)),
    FeatureSpec("a2t", axes=("atoms", "tokens"), one_hot=True),
    FeatureSpec("t2a", axes=("tokens", "atoms"), one_hot=True),
    FeatureSpec("msa", axes=("msa", "tokens")),
    FeatureSpec("coords", axes=("ensemble", "atoms", None)),
    FeatureSpec("pair_whole", axes=("tokens", "tokens"), mode="replicate"),
    FeatureSpec("plain", axes=("tokens", None), mode="passthrough"),
]
# (cp0, cp1, atoms per token, trailing pad atoms, token_multiple, atom_multiple, bounds)
GEOMETRY_CASES = [
    (1, 1, [2, 1, 3], 0, 1, 1, None),
    (2, 2, [3, 0, 2, 1, 4], 2, 2, 4, None),
    (2, 3, [1, 2, 3, 4, 5, 6, 7], 1, 1, 1, None),
    (2, 3, [1, 2, 3, 4, 5, 6, 7], 1, 4, 8, None),
    (3, 2, [5, 1, 1, 1, 2, 0, 3, 2], 0, 3, 1, None),
    (3, 3, [2] * 7, 3, 2, 4, (0, 1, 6, 7)),
    (4, 1, [1, 3, 2, 2, 1, 1], 0, 1, 2, None),
    (1, 4, [1, 3, 2, 2, 1, 1], 0, 1, 2, None),
    (3, 1, [4, 1], 0, 2, 2, None),  # more row blocks than tokens: empty blocks
]
MSA_ROWS = 5


def _reference_layout(sizes, multiple):
    """Padded position of each serial item and the padded block lengths, by hand."""
    positions, padded_sizes, offset = [], [], 0
    for size in sizes:
        positions += range(offset, offset + size)
        padded = math.ceil(size / multiple) * multiple
        padded_sizes.append(padded)
        offset += padded
    is_pad = torch.ones(offset, dtype=torch.bool)
    is_pad[positions] = False
    return positions, padded_sizes, is_pad


def _reference(case):
    """Row/column blocks and pad masks of every axis, without the plan."""
    cp0, cp1, per_token, trailing, tm, am, bounds = case
    n = len(per_token)
    if bounds is None:
        bounds = [0] + list(itertools.accumulate(len(b) for b in torch.arange(n).tensor_split(cp0)))
    token_sizes = [bounds[i + 1] - bounds[i] for i in range(cp0)]
    atom_sizes = [sum(per_token[bounds[i] : bounds[i + 1]]) for i in range(cp0)]
    atom_sizes[-1] += trailing
    tok_pos, tok_rows, tok_pad = _reference_layout(token_sizes, tm)
    atom_pos, atom_rows, atom_pad = _reference_layout(atom_sizes, am)
    padded_n = sum(tok_rows)
    if cp0 == cp1:
        tok_cols = list(tok_rows)
    else:
        tok_cols = [len(c) for c in torch.arange(padded_n).tensor_split(cp1)]
    msa_rows = [len(c) for c in torch.arange(MSA_ROWS).tensor_split(cp0)]
    return {
        "rows": {"tokens": tok_rows, "atoms": atom_rows, "msa": msa_rows},
        "cols": tok_cols,
        "pad": {"tokens": tok_pad, "atoms": atom_pad},
        "serial": {"tokens": tok_pos, "atoms": atom_pos},
        "lengths": {"tokens": padded_n, "atoms": sum(atom_rows), "msa": MSA_ROWS},
        "atom_tokens": [t for t, k in enumerate(per_token) for _ in range(k)] + [-1] * trailing,
        "bounds": tuple(bounds),
    }


def _ranges(sizes):
    starts = [0] + list(itertools.accumulate(sizes))
    return [(starts[k], starts[k + 1]) for k in range(len(sizes))]


def _reference_block_ranges(spec, shape, ref, coord):
    """Per dim: the rank's block of a split dim, the whole length of any other."""
    placements = [(m, p.dim) for m, p in enumerate(spec.placements) if hasattr(p, "dim")]
    ranges = [(0, n) for n in shape]
    for mesh_dim, dim in placements:
        axis = spec.axes[dim]
        sizes = ref["rows"][axis] if mesh_dim == 0 else ref["cols"]
        ranges[dim] = _ranges(sizes)[coord[mesh_dim]]
    return ranges


@pytest.mark.parametrize("case", GEOMETRY_CASES, ids=lambda c: f"{c[0]}x{c[1]}-{c[4]}-{c[5]}")
def test_plan_geometry_matches_first_principles(case):
    cp0, cp1, per_token, trailing, tm, am, bounds = case
    ref = _reference(case)
    n, a = len(per_token), len(ref["atom_tokens"])
    plan = build_plan(
        {"tokens": n, "atoms": a, "msa": MSA_ROWS},
        (cp0, cp1),
        atom_tokens=torch.tensor(ref["atom_tokens"], dtype=torch.long),
        token_multiple=tm,
        atom_multiple=am,
        token_bounds=bounds,
    )
    assert plan.token_bounds == ref["bounds"]
    for axis in ("tokens", "atoms", "msa"):
        assert plan.row_sizes(axis) == ref["rows"][axis], axis
    assert plan.column_sizes() == ref["cols"]
    assert column_block_sizes(ref["rows"]["tokens"], cp1) == ref["cols"]
    assert plan.coordinates == [(i, j) for i in range(cp0) for j in range(cp1)]
    for axis in ("tokens", "atoms"):
        assert plan.positions(axis).tolist() == ref["serial"][axis]
        assert torch.equal(plan.is_pad(axis), ref["pad"][axis])

    for spec in GEOMETRY_SPECS:
        serial_shape = tuple(
            {"tokens": n, "atoms": a, "msa": MSA_ROWS, "ensemble": 2}.get(x, 3) for x in spec.axes
        )
        shape = plan.padded_shape(spec, serial_shape)
        laid_out = spec.mode != "passthrough"
        assert shape == tuple(
            ref["lengths"][x] if laid_out and x in ("tokens", "atoms") else s
            for x, s in zip(spec.axes, serial_shape)
        ), spec.name
        padded = torch.arange(math.prod(shape)).reshape(shape)
        for coord in plan.coordinates:
            ranges = _reference_block_ranges(spec, shape, ref, coord)
            expected = padded[tuple(slice(*r) for r in ranges)]
            where = (spec.name, coord)
            assert plan.block_ranges(spec, shape, coord) == ranges, where
            assert plan.local_shape(spec, shape, coord) == tuple(expected.shape), where
            assert torch.equal(plan.local_block(spec, padded, coord), expected), where
            # Pads: the product of the per-dim pad masks, cut to the block.
            real = torch.ones(shape, dtype=torch.bool)
            for dim, axis in enumerate(spec.axes):
                if laid_out and axis in ("tokens", "atoms"):
                    view = [1] * len(shape)
                    view[dim] = -1
                    real = real & ~ref["pad"][axis].reshape(view)
            block_real = real[tuple(slice(*r) for r in ranges)]
            assert plan.pad_elements(spec, shape, coord) == int((~block_real).sum()), where
            # Runs: real runs point at the right serial items, pad runs at inserted pads,
            # and together they cover the block's range of every dim exactly once.
            for dim, ((start, stop), (runs, pads)) in enumerate(
                zip(ranges, plan.block_runs(spec, shape, coord))
            ):
                axis = spec.axes[dim] if laid_out else None
                covered = torch.zeros(stop - start, dtype=torch.long)
                for offset, serial_start, length in runs:
                    covered[offset : offset + length] += 1
                    if axis in ("tokens", "atoms"):
                        got = list(range(start + offset, start + offset + length))
                        assert got == ref["serial"][axis][serial_start : serial_start + length]
                    else:
                        assert serial_start == start + offset
                for offset, length in pads:
                    covered[offset : offset + length] += 1
                    assert bool(ref["pad"][axis][start + offset : start + offset + length].all())
                assert bool((covered == 1).all()), (where, dim)
            # Sharding shapes: rank r's local shape on each split mesh dim.
            shapes = plan.sharding_shapes(spec, shape, coord, batched=True)
            assert set(shapes) == {m for m, p in enumerate(spec.placements) if hasattr(p, "dim")}
            for mesh_dim, per_rank in shapes.items():
                for r, got in enumerate(per_rank):
                    other = list(coord)
                    other[mesh_dim] = r
                    want = [b - s for s, b in _reference_block_ranges(spec, shape, ref, other)]
                    assert got == (1, *want), (where, mesh_dim, r)


def test_column_rule_is_the_one_of_the_ops():
    """Square meshes reuse the (uneven, padded) row blocks; others split evenly."""
    assert column_block_sizes([4, 2], 2) == [4, 2]
    assert column_block_sizes([4, 2], 3) == [2, 2, 2]
    assert column_block_sizes([3, 3, 1], 2) == [4, 3]
    assert column_block_sizes([0, 5], 1) == [5]
