"""Axis meanings: each one object with its rules; a new meaning is one declaration.

The built-in meanings' rules are stated here one by one (block rule, pad multiple,
placement, validation, report group, random-sample size). Then a test declares a new
meaning in one ``register_axis`` call and shows that a feature using it is placed, planned,
validated, reported and (on 4 ranks) scattered like the built-in meaning it resembles.
"""

import pickle

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from physicsnemo_foldcp.features import (
    ATOMS,
    AXES,
    ENSEMBLE,
    MSA,
    RSET,
    TEMPLATES,
    TOKENS,
    Axis,
    FeatureSpec,
    axis_of,
    register_axis,
    unregister_axis,
)
from physicsnemo_foldcp.features.axes import BOUNDS, EVEN, LEAD_ROWS, STACK, TILE
from physicsnemo_foldcp.sharding.options import ShardingOptions
from physicsnemo_foldcp.sharding.plan import build_plan, split_sizes
from physicsnemo_foldcp.sharding.plan_report import feature_group, plan_report
from physicsnemo_foldcp.sharding.prepare import prepare_sample
from physicsnemo_foldcp.sharding.validation import FeatureValidationError
from physicsnemo_foldcp.testing.random_sample import (
    RandomSampleSpec,
    random_registry,
    random_sample,
)

ROW = (Shard(0), Replicate())
PAIR_TILE = (Shard(0), Shard(1))
STACK_ROW = (Shard(1), Replicate())

# name: blocks, plan bounds field, pad multiple, columns, leads, stackable, follows,
#       index target, report group, random-sample size
RULES = {
    "tokens": (BOUNDS, "token_bounds", "token_multiple", True, (TILE, LEAD_ROWS), True, None,
               True, "token", "n_tokens"),
    "atoms": (BOUNDS, "atom_bounds", "atom_multiple", False, (LEAD_ROWS,), True, "tokens",
              True, "atom", "n_atoms"),
    "rset": (BOUNDS, "rset_bounds", None, False, (LEAD_ROWS,), False, "tokens",
             False, "atom", "rset_rows"),
    "msa": (EVEN, None, None, False, (TILE,), False, None, False, "msa", "msa_rows"),
    "ensemble": (None, None, None, False, (STACK,), False, None, True, None, "conformers"),
    "templates": (None, None, None, False, (STACK,), False, None, False, None, "templates"),
}  # fmt: skip
FIELDS = ("blocks", "bounds", "multiple", "columns", "leads", "stackable", "follows",
          "index_target", "group", "sample_size")  # fmt: skip


def test_the_built_in_meanings_are_registered():
    assert set(AXES) == set(RULES)
    for constant in (TOKENS, ATOMS, MSA, ENSEMBLE, TEMPLATES, RSET):
        assert AXES[constant.name] is constant


@pytest.mark.parametrize("name", sorted(RULES))
def test_each_axis_carries_its_rules(name):
    axis = AXES[name]
    assert tuple(getattr(axis, f) for f in FIELDS) == RULES[name]
    assert axis.split == (RULES[name][0] is not None)
    assert axis.layout == (RULES[name][0] == BOUNDS)


def test_an_axis_is_its_name_for_lookups_comparisons_and_messages():
    assert TOKENS == "tokens" and "tokens" == TOKENS and TOKENS != "atoms"
    assert hash(TOKENS) == hash("tokens")
    assert {"tokens": 1}[TOKENS] == 1 and {TOKENS: 1}["tokens"] == 1
    assert str(TOKENS) == "tokens" and repr(TOKENS) == "'tokens'" and f"{MSA:>5}" == "  msa"
    assert sorted([TOKENS, ATOMS, "msa"]) == ["atoms", "msa", "tokens"]
    assert pickle.loads(pickle.dumps(TOKENS)) == TOKENS
    assert axis_of("atoms") is ATOMS and axis_of(ATOMS) is ATOMS
    with pytest.raises(ValueError, match="unknown axis meaning 'residues'"):
        axis_of("residues")


def test_a_spec_holds_the_axis_objects_of_the_names_written():
    spec = FeatureSpec("pair", axes=("tokens", TOKENS, None))
    assert spec.axes == ("tokens", "tokens", None)
    assert spec.axes[0] is TOKENS and spec.axes[1] is TOKENS
    config = spec.to_config()
    assert config["axes"] == ["tokens", "tokens", None]
    assert all(type(a) is str for a in config["axes"] if a is not None)
    assert FeatureSpec.from_config("pair", config) == spec
    assert FeatureSpec("idx", ("tokens",), index_of=ATOMS).index_of == "atoms"


def test_an_axis_of_a_registered_name_with_other_rules_is_refused():
    impostor = Axis("tokens", blocks=EVEN, leads=(TILE,))
    with pytest.raises(ValueError, match="registered with other rules"):
        FeatureSpec("x", (impostor, None))


@pytest.mark.parametrize(
    "axes, placements",
    [
        (("tokens", "tokens", None), PAIR_TILE),  # tokens: tile before a column axis
        (("tokens", "atoms"), ROW),  # ... else row blocks
        (("tokens",), ROW),
        (("msa", "tokens", None), PAIR_TILE),  # msa: tile only
        (("atoms", "tokens"), ROW),  # atoms never tile: row blocks, columns whole
        (("rset", "atoms"), ROW),
        (("ensemble", "atoms", None), STACK_ROW),  # stack: its stackable axis split
        (("templates", "tokens"), STACK_ROW),
    ],
)
def test_placement_is_the_leading_axis_rule(axes, placements):
    assert FeatureSpec("x", axes).placements == placements
    second = axis_of(axes[1]) if len(axes) > 1 and axes[1] is not None else None
    assert axis_of(axes[0]).lead_placements(second) == placements


@pytest.mark.parametrize(
    "axes",
    [("msa", None), ("msa", "atoms"), ("ensemble", "rset"), ("ensemble", "msa"), ("templates",)],
)
def test_no_leading_rule_applies(axes):
    with pytest.raises(ValueError, match="has no sharded placement"):
        FeatureSpec("x", axes)


def test_index_targets_come_from_the_axes():
    for target in ("atoms", "tokens", "ensemble", "chains"):
        FeatureSpec("x", ("tokens",), index_of=target)
    assert FeatureSpec("x", ("tokens",), index_of="atoms").index_axis is ATOMS
    assert FeatureSpec("x", ("tokens",), index_of="ensemble").index_axis is None  # kept
    for target in ("msa", "rset", "templates"):
        with pytest.raises(ValueError, match=f"index_of='{target}' is not one of"):
            FeatureSpec("x", ("tokens",), index_of=target)


def test_the_plan_asks_each_axis_for_its_block_rule():
    # 5 tokens of 1, 2, 0, 3, 1 atoms and 2 trailing pad atoms, on cp0 x cp1 = 2 x 3.
    atom_tokens = torch.tensor([0, 1, 1, 3, 3, 3, 4, -1, -1])
    plan = build_plan(
        {"tokens": 5, "atoms": 9, "msa": 7, "ensemble": 2},
        (2, 3),
        atom_tokens=atom_tokens,
        token_multiple=4,
        atom_multiple=2,
    )
    assert plan.row_sizes(TOKENS) == [4, 4]  # bounds (0, 3, 5), padded to 4
    assert plan.row_sizes("atoms") == [4, 6]  # bounds (0, 3, 9), padded to 2
    assert plan.row_sizes(MSA) == split_sizes(7, 2) == [4, 3]  # even, never padded
    assert plan.even_lengths == (("msa", 7),) and plan.msa_rows == 7
    assert plan.sizes(TOKENS, 1) == [3, 3, 2]  # column blocks of the padded token axis
    with pytest.raises(ValueError, match="only the token axis is split over cp1"):
        plan.sizes(ATOMS, 1)
    with pytest.raises(ValueError, match="axis 'ensemble' has no row blocks"):
        plan.row_sizes(ENSEMBLE)
    with pytest.raises(FeatureValidationError, match=r"no rset axis \(no r_set feature\)"):
        plan.row_sizes(RSET)
    assert [plan.has_padding(a) for a in ("tokens", "atoms", "msa", "ensemble", None)] == [
        True,
        True,
        False,
        False,
        False,
    ]


def test_split_axes_need_one_length_and_stack_axes_do_not():
    registry = random_registry()
    x = random_sample(RandomSampleSpec(atoms_per_token=(2, 1, 3), msa_rows=2, conformers=2))
    x["template_feat"] = torch.randn(3, 3)  # 3 templates, 2 conformers: stack axes are free
    prepare_sample(x, registry, (2, 2))
    x["msa"] = x["msa"][:, :2]
    with pytest.raises(FeatureValidationError, match="the tokens axes of the features have"):
        prepare_sample(x, registry, (2, 2))


def test_report_groups_come_from_the_axes():
    assert feature_group(("tokens", "tokens", None)) == "pair"
    assert feature_group((MSA, TOKENS)) == "msa"
    assert feature_group(("ensemble", "atoms", None)) == "atom"
    assert feature_group(("rset", "atoms")) == "atom"
    assert feature_group(("templates", "tokens")) == "token"
    assert feature_group((None, None)) == "other"


def test_random_sample_lengths_are_the_sizes_the_axes_name():
    spec = RandomSampleSpec(
        atoms_per_token=(0, 2, 1), trailing_pad_atoms=3, msa_rows=4, conformers=2, templates=5
    )
    lengths = {name: spec.length(name) for name in RULES}
    assert lengths == {
        "tokens": 3, "atoms": 6, "rset": 2, "msa": 4, "ensemble": 2, "templates": 5,
    }  # fmt: skip
    x = random_sample(spec)
    assert x["r_set_to_rep_atom"].shape == (2, 6) and x["template_feat"].shape == (5, 3)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(blocks="cyclic"), "blocks='cyclic' is not one of"),
        (dict(blocks=BOUNDS), "blocks='bounds' and a plan bounds field go together"),
        (dict(blocks=EVEN, multiple="x_multiple"), "only an axis with blocks='bounds'"),
        (dict(leads=("diagonal",)), "unknown leading rule"),
        (dict(leads=(LEAD_ROWS,)), "needs a block rule"),
        (dict(blocks=EVEN, leads=(STACK,)), "a stack axis is never split"),
        (dict(columns=True), "column blocks need a block rule"),
    ],
)
def test_an_axis_with_inconsistent_rules_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        Axis("new", **fields)


# -- a new meaning: one declaration ------------------------------------------------------


@pytest.fixture
def samples_axis():
    """Diffusion samples: a stack, like the conformer ensemble. The whole declaration."""
    axis = register_axis(Axis("samples", leads=(STACK,), sample_size="samples"))
    yield axis
    unregister_axis(axis)


@pytest.fixture
def paired_msa_axis():
    """Rows of a second (paired) MSA: split over cp0 like the MSA. The whole declaration."""
    axis = register_axis(
        Axis("paired_msa", blocks=EVEN, leads=(TILE,), group="msa", sample_size="paired")
    )
    yield axis
    unregister_axis(axis)


def _blocks(prepared, name):
    """The block of ``name`` every rank is sent, written from the serial tensor."""
    plan, spec, meta = prepared.plan, prepared.specs[name], prepared.meta(name)
    out = {}
    for coord in plan.coordinates:
        block = torch.empty(plan.local_shape(spec, meta.padded_shape, coord), dtype=meta.dtype)
        prepared.write_block(name, coord, block)
        assert torch.equal(block, plan.local_block(spec, prepared.padded[name], coord))
        out[coord] = block
    return out


@pytest.mark.parametrize("padding", [dict(), dict(token_multiple=4, atom_multiple=8)])
def test_a_new_stack_axis_is_planned_like_the_ensemble(samples_axis, padding):
    registry = random_registry()
    registry.register(FeatureSpec("sample_coords", ("samples", "atoms", None)))
    assert registry["sample_coords"].placements == STACK_ROW
    spec = RandomSampleSpec(
        atoms_per_token=(3, 0, 1, 5, 2), trailing_pad_atoms=2, sizes=(("samples", 4),)
    )
    x = random_sample(spec, seed=1, registry=registry)
    assert x["sample_coords"].shape == (4, 13, 3)
    options = ShardingOptions(**padding)
    prepared = prepare_sample(x, registry, (2, 3), options=options)
    # The same tensor declared with the built-in meaning it resembles lays out the same.
    twin = random_registry()
    twin.register(FeatureSpec("sample_coords", ("ensemble", "atoms", None)))
    ours = _blocks(prepared, "sample_coords")
    theirs = _blocks(prepare_sample(x, twin, (2, 3), options=options), "sample_coords")
    assert all(torch.equal(ours[c], theirs[c]) for c in ours)
    if not padding:  # and, without per-shard pads, it is the atoms of each row block
        plan = prepared.plan
        for (i, _), block in ours.items():
            start, stop = plan.serial_range(ATOMS, i)
            assert torch.equal(block, x["sample_coords"][:, start:stop])
    report = plan_report(x, (2, 3), registry=registry, options=options)
    assert report.format() == plan_report(x, (2, 3), registry=twin, options=options).format()


def test_a_new_row_axis_is_split_over_cp0_like_the_msa(paired_msa_axis):
    registry = random_registry()
    registry.register(FeatureSpec("paired", ("paired_msa", "tokens", None), pad_value=1))
    assert registry["paired"].placements == PAIR_TILE
    spec = RandomSampleSpec(atoms_per_token=(1, 2, 1, 1, 3, 1, 2), sizes=(("paired", 5),))
    x = random_sample(spec, seed=2, registry=registry)
    prepared = prepare_sample(x, registry, (2, 3))
    plan = prepared.plan
    assert dict(plan.even_lengths) == {"msa": 1, "paired_msa": 5}
    assert plan.row_sizes("paired_msa") == split_sizes(5, 2)
    rows = torch.arange(5).tensor_split(2)
    for (i, j), block in _blocks(prepared, "paired").items():
        start, stop = plan.block(TOKENS, 1, j)
        assert torch.equal(block, x["paired"][rows[i]][:, start:stop])
    report = plan_report(x, (2, 3), registry=registry)  # its group: "msa", as the axis says
    assert sum(r.group_bytes["msa"] for r in report.ranks) == sum(
        x[k].numel() * x[k].element_size() for k in ("msa", "paired")
    )
    registry.register(FeatureSpec("paired_mask", ("paired_msa", "tokens")))
    x["paired_mask"] = torch.ones(4, 7)  # 4 rows where "paired" has 5: one length per axis
    with pytest.raises(FeatureValidationError, match="paired_msa axes of the features have"):
        prepare_sample(x, registry, (2, 3))


@pytest.mark.multigpu_static
@pytest.mark.parametrize("fold_mesh", [(1, 2, 2)], indirect=True, ids=["1x2x2"])
def test_a_new_axis_scatters_and_gathers_exactly(fold_mesh, samples_axis, paired_msa_axis):
    from physicsnemo_foldcp import gather_features, scatter_features

    registry = random_registry()
    registry.register(FeatureSpec("sample_coords", ("samples", "atoms", None)))
    registry.register(FeatureSpec("paired", ("paired_msa", "tokens", None), pad_value=1))
    spec = RandomSampleSpec(atoms_per_token=(3, 0, 1, 5, 2), sizes=(("samples", 3), ("paired", 5)))
    x = random_sample(spec, seed=3, registry=registry)
    options = ShardingOptions(token_multiple=2, atom_multiple=4)
    sharded = scatter_features(
        x if fold_mesh.is_domain_source else None, fold_mesh, registry=registry, options=options
    )
    assert sharded["sample_coords"].placements == STACK_ROW
    assert sharded["paired"].placements == PAIR_TILE
    gathered = gather_features(sharded)
    assert all(torch.equal(gathered[k], x[k]) for k in x)
