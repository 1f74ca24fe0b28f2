"""Balanced row blocks: exact optimum of the cost model, the atom-balance target, the hook."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from physicsnemo_foldcp import BalanceOptions, ShardingOptions, gather_features, scatter_features
from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.sharding.balance import (
    atoms_per_token,
    balanced_token_bounds,
    even_token_bounds,
    plan_cost,
    plan_token_bounds,
)
from physicsnemo_foldcp.sharding.plan import build_plan
from physicsnemo_foldcp.sharding.validation import FeatureValidationError
from physicsnemo_foldcp.testing import collective_assert

RNA_LIGAND = {"protein": 0.4, "rna": 0.4, "ligand": 0.2}


def columns_of(row_tokens, n, cp0, cp1):
    """Token columns per cp1 block: the rows on a square mesh, else an even split."""
    if cp1 == cp0:
        return list(row_tokens)
    return [len(c) for c in torch.arange(n).tensor_split(cp1)]


def worst_rank_cost(bounds, atoms, cp0, cp1, pair_weight, atom_weight):
    """Largest pair_weight * N_i * C_j + atom_weight * A_i over the ranks, from scratch."""
    rows = [bounds[i + 1] - bounds[i] for i in range(cp0)]
    row_atoms = [sum(atoms[bounds[i] : bounds[i + 1]]) for i in range(cp0)]
    cols = columns_of(rows, len(atoms), cp0, cp1)
    return max(pair_weight * n * c + atom_weight * a for n, a in zip(rows, row_atoms) for c in cols)


def all_bounds(n, cp0):
    """Every set of cp0 contiguous (possibly empty) blocks of n tokens."""
    for cuts in itertools.combinations_with_replacement(range(n + 1), cp0 - 1):
        yield (0, *cuts, n)


def test_even_bounds_are_the_default_plan():
    for n in range(0, 14):
        for cp0 in range(1, 5):
            assert even_token_bounds(n, cp0) == build_plan({"tokens": n}, (cp0, 1)).token_bounds


@settings(max_examples=150, deadline=None)
@given(
    atoms=st.lists(st.integers(0, 25), min_size=1, max_size=9),
    cp0=st.integers(1, 4),
    cp1=st.sampled_from([None, 1, 2, 3]),
    weights=st.sampled_from([(0.0, 1.0), (1.0, 0.0), (1.0, 3.0), (0.5, 2.0), (2.0, 0.25)]),
)
def test_balanced_bounds_are_optimal_against_brute_force(atoms, cp0, cp1, weights):
    pair_weight, atom_weight = weights
    mesh_cp1 = cp0 if cp1 is None else cp1
    bounds = balanced_token_bounds(
        torch.tensor(atoms), cp0, cp1=cp1, pair_weight=pair_weight, atom_weight=atom_weight
    )
    assert len(bounds) == cp0 + 1 and bounds[0] == 0 and bounds[-1] == len(atoms)
    assert all(a <= b for a, b in zip(bounds, bounds[1:]))
    best = min(
        worst_rank_cost(b, atoms, cp0, mesh_cp1, pair_weight, atom_weight)
        for b in all_bounds(len(atoms), cp0)
    )
    got = worst_rank_cost(bounds, atoms, cp0, mesh_cp1, pair_weight, atom_weight)
    assert got == pytest.approx(best, rel=1e-12, abs=1e-12)


def test_plan_cost_by_hand():
    # 5 tokens with 3, 0, 2, 1, 4 atoms; rows [0, 3) and [3, 5) on a 2 x 3 mesh.
    cost = plan_cost((0, 3, 5), torch.tensor([3, 0, 2, 1, 4]), (2, 3), pair_weight=1, atom_weight=2)
    assert cost.row_tokens == (3, 2) and cost.row_atoms == (5, 5)
    assert cost.column_tokens == (2, 2, 1)
    assert cost.rank_atoms == [5, 5, 5, 5, 5, 5]
    assert cost.rank_pair == [6, 6, 3, 4, 4, 2]
    assert cost.rank_cost == [16, 16, 13, 14, 14, 12]
    assert cost.atom_imbalance == 1.0
    assert cost.pair_imbalance == pytest.approx(6 / (25 / 6))
    assert cost.cost_imbalance == pytest.approx(16 / (85 / 6))
    square = plan_cost((0, 3, 5), torch.tensor([3, 0, 2, 1, 4]), (2, 2))
    assert square.column_tokens == (3, 2)  # square mesh: columns are the rows
    assert square.rank_pair == [9, 6, 6, 4]
    text = cost.format()
    assert "row 0: tokens [0, 3) (3), 5 atoms" in text and "atoms 1.000" in text


def test_atoms_per_token_counts_the_map():
    x = make_complex(50, seed=3, atom_multiple=32)  # trailing pad atoms with no token
    expected = x["atom_to_token"].sum(0)
    counts = atoms_per_token(x)
    assert counts.dtype == torch.int64 and torch.equal(counts, expected)
    assert int(counts.sum()) == int(x["atom_pad_mask"].sum()) < x["atom_to_token"].shape[0]
    batched = {"atom_to_token": x["atom_to_token"][None]}
    assert torch.equal(atoms_per_token(batched), expected)
    owner = torch.where(x["atom_to_token"].sum(1) > 0, x["atom_to_token"].argmax(1), -1)
    compact = {"atom_to_token": owner, "token_pad_mask": x["token_pad_mask"]}
    assert torch.equal(atoms_per_token(compact), expected)
    with pytest.raises(FeatureValidationError, match="has no 'atom_to_token'"):
        atoms_per_token({"ref_pos": x["ref_pos"]})
    with pytest.raises(FeatureValidationError, match="one sample"):
        atoms_per_token({"atom_to_token": x["atom_to_token"][None].expand(2, -1, -1)})


@pytest.mark.parametrize("cp0", [2, 3, 4])
def test_balanced_plan_meets_the_atom_target_on_rna_and_ligands(cp0):
    x = make_complex(384, seed=1, composition=RNA_LIGAND, msa_rows=2)
    per_token = x["atom_to_token"].sum(0).tolist()
    bounds = balanced_token_bounds(atoms_per_token(x), cp0)
    row_atoms = [sum(per_token[bounds[i] : bounds[i + 1]]) for i in range(cp0)]
    even = even_token_bounds(384, cp0)
    even_atoms = [sum(per_token[even[i] : even[i + 1]]) for i in range(cp0)]
    mean = sum(per_token) / cp0
    assert max(row_atoms) / mean <= 1.05
    assert max(even_atoms) / mean > 1.05  # the complex is one the even split cannot balance
    cost = plan_cost(bounds, atoms_per_token(x), (cp0, cp0))
    assert list(cost.row_atoms) == row_atoms
    assert cost.atom_imbalance == pytest.approx(max(row_atoms) / mean)
    plan = build_plan(
        {"tokens": 384, "atoms": x["atom_to_token"].shape[0]},
        (cp0, cp0),
        atom_tokens=x["atom_to_token"].argmax(1),
        token_bounds=bounds,
    )
    assert [plan.row_sizes("atoms")[i] for i in range(cp0)] == row_atoms


def test_ties_keep_blocks_near_an_even_share():
    # Any cut between the two heavy tokens is optimal; the middle one is chosen.
    assert balanced_token_bounds(torch.tensor([5, 0, 0, 0, 0, 0, 5]), 2)[1] in (3, 4)
    # Equal atoms per token: the balanced plan is the even split, whatever the weights.
    for weights in [(0.0, 1.0), (1.0, 0.0), (1.0, 1.0)]:
        bounds = balanced_token_bounds(
            torch.full((10,), 4), 3, pair_weight=weights[0], atom_weight=weights[1]
        )
        assert sorted(b - a for a, b in zip(bounds, bounds[1:])) == [3, 3, 4]


def test_invalid_inputs_raise_clear_errors():
    good = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="1-D tensor"):
        balanced_token_bounds(torch.ones(2, 2, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="integers"):
        balanced_token_bounds(torch.ones(3), 2)
    with pytest.raises(ValueError, match="negative at token 1"):
        balanced_token_bounds(torch.tensor([1, -2, 3]), 2)
    with pytest.raises(ValueError, match="cp0 must be an integer >= 1"):
        balanced_token_bounds(good, 0)
    with pytest.raises(ValueError, match="both 0"):
        balanced_token_bounds(good, 2, pair_weight=0, atom_weight=0)
    with pytest.raises(ValueError, match="pair_weight must be a finite number"):
        balanced_token_bounds(good, 2, pair_weight=-1)
    with pytest.raises(ValueError, match="3 non-decreasing boundaries from 0 to N=3"):
        plan_cost((0, 2, 1), good, (2, 2))
    with pytest.raises(TypeError, match="unexpected keyword argument 'balance'"):
        plan_token_bounds(  # type: ignore[call-arg]
            {"atom_to_token": torch.eye(3, dtype=torch.long)}, (2, 2), balance="balanced"
        )


def test_plan_token_bounds_is_the_config_hook():
    x = make_complex(60, seed=2, composition=RNA_LIGAND)
    assert plan_token_bounds(x, (3, 3)) is None  # the default stays the even split
    balanced = BalanceOptions(mode="balanced", pair_weight=1.0, atom_weight=4.0)
    got = plan_token_bounds(x, (3, 2), options=ShardingOptions(balance=balanced))
    assert got == balanced_token_bounds(
        x["atom_to_token"].sum(0), 3, cp1=2, pair_weight=1.0, atom_weight=4.0
    )


@pytest.mark.multigpu_static
@pytest.mark.parametrize(
    "fold_mesh", [(2, 1, 2), (1, 2, 2), (1, 2, 3), (1, 3, 3)], indirect=True, ids=str
)
def test_balanced_scatter_holds_balanced_atoms_and_round_trips(fold_mesh):
    x = make_complex(60, seed=5, composition=RNA_LIGAND, msa_rows=4)
    cp0 = fold_mesh.cp[0]
    bounds = balanced_token_bounds(x["atom_to_token"].sum(0), cp0, cp1=fold_mesh.cp[1])
    sharded = scatter_features(
        x if fold_mesh.is_domain_source else None, fold_mesh, token_bounds=bounds
    )
    i = fold_mesh.domain_coordinate[0]
    per_token = x["atom_to_token"].sum(0)
    expected_atoms = int(per_token[bounds[i] : bounds[i + 1]].sum())
    problems = []
    if sharded.plan.token_bounds != bounds:
        problems.append(f"plan bounds {sharded.plan.token_bounds} != {bounds}")
    held_atoms = int(sharded["atom_pad_mask"].to_local().sum())
    if held_atoms != expected_atoms:
        problems.append(f"row {i} holds {held_atoms} atoms, expected {expected_atoms}")
    held_tokens = sharded["token_pad_mask"].to_local().shape[0]
    if held_tokens != bounds[i + 1] - bounds[i]:
        problems.append(f"row {i} holds {held_tokens} tokens, expected {bounds[i + 1] - bounds[i]}")
    gathered = gather_features(sharded)
    bad = [k for k, v in x.items() if not torch.equal(gathered[k], v)]
    if bad:
        problems.append(f"round trip differs for {bad[:5]}")
    collective_assert(not problems, "; ".join(problems))
