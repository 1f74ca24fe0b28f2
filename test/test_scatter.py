"""Distributed scatter/gather of whole Boltz samples: parity, placements, padding, bytes."""

import itertools
import math

import pytest
import torch
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import Shard
from torch.distributed.tensor.debug import CommDebugMode

from physicsnemo_foldcp import gather_features, scatter_features
from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.features import FeatureRegistry, FeatureSpec, UnknownFeatureError
from physicsnemo_foldcp.sharding.balance import balanced_token_bounds
from physicsnemo_foldcp.sharding.options import BalanceOptions, ShardingOptions
from physicsnemo_foldcp.sharding.scatter import RegistryMismatchError
from physicsnemo_foldcp.sharding.validation import FeatureValidationError
from physicsnemo_foldcp.testing import collective_assert

pytestmark = pytest.mark.multigpu_static

MESHES = [
    (4, 1, 1),
    (2, 1, 2),
    (2, 2, 1),
    (1, 2, 2),  # world 4: 1x1, 1x2, 2x1, 2x2
    (1, 2, 3),
    (3, 1, 2),  # world 6: 2x3, 1x2
    (9, 1, 1),
    (1, 3, 3),  # world 9: 1x1, 3x3
]
PADDINGS = [dict(), dict(token_multiple=4, atom_multiple=32)]
mesh_id = "x".join  # noqa: E731


def sample(preset, seed=0, n_tokens=37):
    """37 tokens, 1..24 atoms per token, ligand tokens of one atom, MSA of 11, 2 conformers."""
    return make_complex(n_tokens, seed=seed, preset=preset, msa_rows=11, n_conformers=2)


def reference_positions(block_sizes, multiple):
    """Padded position of each serial item, from first principles."""
    positions, offset = [], 0
    for size in block_sizes:
        positions += range(offset, offset + size)
        offset += math.ceil(size / multiple) * multiple
    return torch.tensor(positions, dtype=torch.long), offset


def reference_layout(x, cp0, token_multiple=1, atom_multiple=1):
    """Token and atom positions of the padded layout, computed without the plan."""
    n = x["atom_to_token"].shape[1]
    token_blocks = [len(b) for b in torch.arange(n).tensor_split(cp0)]
    atoms_per_token = x["atom_to_token"].sum(0)
    atom_blocks = [int(atoms_per_token[b].sum()) for b in torch.arange(n).tensor_split(cp0)]
    atom_blocks[-1] += x["atom_to_token"].shape[0] - sum(atom_blocks)  # trailing pad atoms
    tok, n_pad = reference_positions(token_blocks, token_multiple)
    atm, a_pad = reference_positions(atom_blocks, atom_multiple)
    return {"tokens": (tok, n_pad), "atoms": (atm, a_pad)}


def expected_full(spec, value, layout):
    """The serial feature in the documented padded layout."""
    out = value
    if spec.index_of == "atoms":
        out = layout["atoms"][0][out.long()].to(out.dtype)
    if spec.mode != "shard" and spec.mode != "replicate":
        return out
    for dim, axis in enumerate(spec.axes):
        if axis in ("tokens", "atoms"):
            pos, length = layout[axis]
            shape = list(out.shape)
            shape[dim] = length
            grown = torch.full(shape, spec.pad_value, dtype=out.dtype)
            out = grown.index_copy_(dim, pos, out)
    return out


def problems_of_round_trip(x, sharded, mesh, padding):
    """Every way the sharded sample can differ from the serial one, as messages."""
    problems = []
    registry = sharded.registry
    layout = reference_layout(x, mesh.cp[0], **padding)
    gathered = gather_features(sharded)
    if set(gathered) != set(x):
        problems.append(f"keys differ: {set(gathered) ^ set(x)}")
    for name, value in x.items():
        if not torch.equal(gathered[name], value) or gathered[name].dtype != value.dtype:
            problems.append(f"gather_features({name}) != serial")
        st = sharded[name]
        spec = registry[name]
        if not isinstance(st, ShardTensor):
            problems.append(f"{name} is a {type(st).__name__}, not a ShardTensor")
            continue
        if st.placements != spec.placements:
            problems.append(f"{name} placements {st.placements} != {spec.placements}")
        full = st.full_tensor()
        if not torch.equal(full, expected_full(spec, value, layout)):
            problems.append(f"{name}.full_tensor() != serial in the padded layout")
        local = st.to_local()
        for mesh_dim, placement in enumerate(st.placements):
            if isinstance(placement, Shard) and full.shape[placement.dim] > 1:
                d, size = placement.dim, mesh.cp[mesh_dim]
                sharded_ok = (
                    local.shape[d] < full.shape[d] if size > 1 else local.shape[d] == full.shape[d]
                )
                if not sharded_ok:
                    problems.append(
                        f"{name}: local {tuple(local.shape)} vs global {tuple(full.shape)}"
                    )
    return problems


@pytest.mark.parametrize("fold_mesh", MESHES, indirect=True, ids=lambda s: mesh_id(map(str, s)))
@pytest.mark.parametrize("preset", ["boltz1", "boltz2"])
@pytest.mark.parametrize("padding", PADDINGS, ids=["no-pad", "pad-4-32"])
def test_round_trip_is_exact_for_every_feature(fold_mesh, preset, padding):
    x = sample(preset, seed=fold_mesh.ddp_rank)
    sharded = scatter_features(
        x if fold_mesh.is_domain_source else None,
        fold_mesh,
        registry=FeatureRegistry.preset(preset),
        options=ShardingOptions(**padding),
    )
    problems = problems_of_round_trip(x, sharded, fold_mesh, padding)
    collective_assert(not problems, "; ".join(problems[:6]))


@pytest.mark.parametrize("fold_mesh", MESHES, indirect=True, ids=lambda s: mesh_id(map(str, s)))
@pytest.mark.parametrize("padding", PADDINGS, ids=["no-pad", "pad-4-32"])
def test_masks_lengths_and_atom_ownership(fold_mesh, padding):
    x = sample("boltz2", seed=7)
    sharded = scatter_features(
        x if fold_mesh.is_domain_source else None, fold_mesh, options=ShardingOptions(**padding)
    )
    layout = reference_layout(x, fold_mesh.cp[0], **padding)
    (tok_pos, n_pad), (atom_pos, a_pad) = layout["tokens"], layout["atoms"]
    problems = []
    # Masks mark exactly the pad positions.
    tmask = sharded["token_pad_mask"].full_tensor()
    expected_tmask = torch.zeros(n_pad)
    expected_tmask[tok_pos] = x["token_pad_mask"]
    if not torch.equal(tmask, expected_tmask):
        problems.append("token_pad_mask does not mark exactly the pads")
    amask = sharded["atom_pad_mask"].full_tensor()
    expected_amask = torch.zeros(a_pad)
    expected_amask[atom_pos] = x["atom_pad_mask"]
    if not torch.equal(amask, expected_amask):
        problems.append("atom_pad_mask does not mark exactly the pads")
    # Every axis of one meaning has one length.
    registry = sharded.registry
    for name, st in sharded.items():
        spec = registry[name]
        for dim, axis in enumerate(spec.axes):
            want = {"tokens": n_pad, "atoms": a_pad}.get(axis)
            if want is not None and st.shape[dim] != want:
                problems.append(f"{name} axis {dim} ({axis}) has {st.shape[dim]}, not {want}")
    # Each rank's atoms are exactly the atoms of its row-block tokens.
    i = fold_mesh.domain_coordinate[0]
    row_tokens = torch.arange(x["atom_to_token"].shape[1]).tensor_split(fold_mesh.cp[0])[i]
    expected_atoms = int(x["atom_to_token"][:, row_tokens].sum())
    local_map = sharded["atom_to_token"].to_local()
    owners = local_map.nonzero()[:, 1]
    row_start = int(tok_pos[row_tokens[0]]) if len(row_tokens) else 0
    row_stop = int(tok_pos[row_tokens[-1]]) + 1 if len(row_tokens) else 0
    if owners.numel() != expected_atoms or not bool(
        ((owners >= row_start) & (owners < row_stop)).all()
    ):
        problems.append(
            f"rank holds {owners.numel()} atoms, expected the {expected_atoms} of its tokens"
        )
    # Remapped atom indices point at the same atoms.
    ref_pos = sharded["ref_pos"].full_tensor()
    frames = sharded["frames_idx"].full_tensor()[:, tok_pos]
    if not torch.equal(ref_pos[frames], x["ref_pos"][x["frames_idx"]]):
        problems.append("frames_idx does not point at the same atoms after the remap")
    collective_assert(not problems, "; ".join(problems[:6]))


@pytest.mark.parametrize(
    "fold_mesh",
    [(1, 2, 2), (1, 2, 3), (1, 3, 3)],
    indirect=True,
    ids=lambda s: mesh_id(map(str, s)),
)
def test_non_source_ranks_receive_only_their_own_shards(fold_mesh):
    x = sample("boltz2", seed=2, n_tokens=48)
    total_bytes = sum(v.numel() * v.element_size() for v in x.values())
    with CommDebugMode() as comm:
        sharded = scatter_features(x if fold_mesh.is_domain_source else None, fold_mesh)
    stats = sharded.stats
    alignment_slack = 16 * len(x)
    # On the wire, an integer 0/1 map is one int64 per local row; the rest is its block.
    registry = FeatureRegistry.preset("boltz2")
    wire_bytes = 0
    for name in x:
        local = sharded[name]
        local = local.to_local() if isinstance(local, ShardTensor) else local
        if registry[name].one_hot and not local.dtype.is_floating_point:
            wire_bytes += local.shape[-2] * 8
        else:
            wire_bytes += local.numel() * local.element_size()
    if fold_mesh.is_domain_source:
        ok = stats.bytes_received == 0 and stats.messages_received == 0
    else:
        ok = (
            stats.messages_received == 1
            and wire_bytes <= stats.bytes_received <= wire_bytes + alignment_slack
            and stats.bytes_received < stats.local_bytes
            and stats.bytes_received < total_bytes / 2
        )
    collective_assert(ok, f"stats {stats}, wire {wire_bytes} B, sample {total_bytes} bytes")
    # The only collective is the metadata all-gather of objects; no tensor is broadcast.
    counts = {str(k): v for k, v in comm.get_comm_counts().items()}
    tensor_collectives = {
        k: v for k, v in counts.items() if "broadcast" in k or "scatter" in k or "all_reduce" in k
    }
    collective_assert(not tensor_collectives, f"unexpected collectives {counts}")


@pytest.mark.parametrize(
    "fold_mesh", [(1, 4, 1), (1, 1, 4)], indirect=True, ids=lambda s: mesh_id(map(str, s))
)
def test_six_tokens_on_four_ranks(fold_mesh):
    """N=6 on 4 ranks, where torch.chunk and PhysicsNeMo's spec disagree, works by default."""
    x = make_complex(6, seed=4, preset="boltz2", msa_rows=3)
    sharded = scatter_features(x if fold_mesh.is_domain_source else None, fold_mesh)
    problems = problems_of_round_trip(x, sharded, fold_mesh, {})
    collective_assert(not problems, "; ".join(problems[:6]))
    token_only = {k: x[k] for k in ("res_type", "token_bonds", "token_index")}
    if fold_mesh.cp[0] == 4:
        with pytest.raises(
            ValueError,
            match=r"method='scatter_tensor' cannot place feature "
            r"'res_type'.*cut \[2, 2, 2, 0\] by torch.chunk",
        ):
            scatter_features(
                token_only if fold_mesh.is_domain_source else None,
                fold_mesh,
                options=ShardingOptions(method="scatter_tensor"),
            )


@pytest.mark.parametrize(
    "fold_mesh",
    [(1, 2, 2), (1, 3, 3), (1, 2, 3)],
    indirect=True,
    ids=lambda s: mesh_id(map(str, s)),
)
def test_scatter_tensor_path_where_its_chunking_agrees(fold_mesh):
    x = sample("boltz2", seed=3, n_tokens=36)
    token_only = {k: x[k] for k in ("res_type", "token_bonds", "disto_target", "token_pad_mask")}
    baseline = scatter_features(
        token_only if fold_mesh.is_domain_source else None,
        fold_mesh,
        options=ShardingOptions(method="scatter_tensor"),
    )
    ours = scatter_features(token_only if fold_mesh.is_domain_source else None, fold_mesh)
    problems = [
        k
        for k in token_only
        if not torch.equal(baseline[k].to_local(), ours[k].to_local())
        or baseline[k].placements != ours[k].placements
    ]
    collective_assert(not problems, f"scatter_tensor differs from p2p for {problems}")
    # The baseline receives whole tensors; the true scatter only the shard.
    if not fold_mesh.is_domain_source:
        collective_assert(
            baseline.stats.bytes_received > ours.stats.bytes_received,
            f"{baseline.stats} vs {ours.stats}",
        )
    else:
        collective_assert(True)
    with pytest.raises(ValueError, match=r"cannot place feature '\w+': its atoms axis"):
        scatter_features(
            x if fold_mesh.is_domain_source else None,
            fold_mesh,
            options=ShardingOptions(method="scatter_tensor"),
        )


def _with(x, **changes):
    return {**x, **changes}


BAD_INPUTS = {
    "unknown feature": (
        lambda x: _with(x, my_extra=torch.zeros(3)),
        UnknownFeatureError,
        r"\['my_extra'\] are not in the 'boltz2' registry",
    ),
    "token lengths differ": (
        lambda x: _with(x, res_type=x["res_type"][:-1]),
        FeatureValidationError,
        r"tokens axes .* different lengths",
    ),
    "map not one-hot": (
        lambda x: _with(x, atom_to_token=x["atom_to_token"] * 2),
        FeatureValidationError,
        r"atom_to_token is not one-hot",
    ),
    "atom with no token": (
        lambda x: _with(x, atom_to_token=x["atom_to_token"].index_fill(0, torch.tensor([3]), 0)),
        FeatureValidationError,
        r"assigns atom 3 to no token",
    ),
    "batch of 2": (
        lambda x: {k: torch.stack([v, v]) for k, v in x.items()},
        FeatureValidationError,
        r"batch size 2 per domain group",
    ),
    "features None": (lambda x: None, FeatureValidationError, r"passed features=None"),
    "pair not square": (
        lambda x: _with(x, token_bonds=x["token_bonds"][:, :-1]),
        FeatureValidationError,
        r"pair feature 'token_bonds' is not square: .* 13 and 12",
    ),
    "atom lengths differ": (
        lambda x: _with(x, ref_pos=x["ref_pos"][:-2]),
        FeatureValidationError,
        r"the atoms axes of the features have different lengths",
    ),
    "atoms of a token not contiguous": (
        lambda x: _with(
            x,
            atom_to_token=x["atom_to_token"][
                [0, 1, 2, -1] + list(range(3, len(x["atom_to_token"]) - 1))
            ],
        ),
        FeatureValidationError,
        r"the atoms of each token must be contiguous and in token order",
    ),
    "index out of range": (
        lambda x: _with(x, frames_idx=x["frames_idx"] + len(x["ref_pos"])),
        FeatureValidationError,
        r"'frames_idx' holds atoms indices, but value \d+ is out of range",
    ),
    "index feature with float dtype": (
        lambda x: _with(x, chiral_atom_index=x["chiral_atom_index"].float()),
        FeatureValidationError,
        r"'chiral_atom_index' has dtype float32; the registry accepts int64, int32",
    ),
    "wrong number of dims": (
        lambda x: _with(x, msa=x["msa"][0]),
        FeatureValidationError,
        r"feature 'msa' has shape \(13,\), but its registry axes",
    ),
}


@pytest.mark.parametrize("fold_mesh", [(1, 2, 2), (1, 2, 3), (1, 3, 3)], indirect=True, ids=str)
def test_non_contiguous_and_strided_inputs_are_sent_exactly(fold_mesh):
    """Views (transposed, sliced, expanded) are accepted and arrive with their values."""
    x = sample("boltz2", seed=4, n_tokens=17)
    x["disto_coords_ensemble"] = (
        x["disto_coords_ensemble"].permute(1, 0, 2).contiguous().permute(1, 0, 2)
    )
    x["ref_pos"] = torch.cat([x["ref_pos"], x["ref_pos"]], 1)[:, ::2]
    x["token_bonds"] = x["token_bonds"][:, :, :1].expand(-1, -1, 1)
    assert not x["disto_coords_ensemble"].is_contiguous() and not x["ref_pos"].is_contiguous()
    sharded = scatter_features(x if fold_mesh.is_domain_source else None, fold_mesh)
    gathered = gather_features(sharded)
    differ = [k for k in x if not torch.equal(gathered[k], x[k])]
    collective_assert(not differ, f"differ: {differ}")


@pytest.mark.parametrize(
    "fold_mesh",
    [(1, 2, 2), (1, 2, 3), (1, 3, 3)],
    indirect=True,
    ids=lambda s: mesh_id(map(str, s)),
)
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_raises_the_same_error_on_every_rank(fold_mesh, case):
    make_bad, error, message = BAD_INPUTS[case]
    x = sample("boltz2", seed=1, n_tokens=13)
    with pytest.raises(error, match=message):
        scatter_features(make_bad(x) if fold_mesh.is_domain_source else None, fold_mesh)
    # The group is still in step: the next sample scatters fine.
    sharded = scatter_features(x if fold_mesh.is_domain_source else None, fold_mesh)
    collective_assert(
        torch.equal(gather_features(sharded)["res_type"], x["res_type"]), "scatter after an error"
    )


@pytest.mark.parametrize(
    "fold_mesh",
    [(1, 2, 2), (1, 2, 3), (1, 3, 3)],
    indirect=True,
    ids=lambda s: mesh_id(map(str, s)),
)
def test_different_registries_are_detected_by_fingerprint(fold_mesh):
    registry = FeatureRegistry.preset("boltz2")
    if fold_mesh.domain_rank == 1:
        registry.register(FeatureSpec("only_on_rank_1", axes=("tokens",)))
    x = sample("boltz2", seed=1, n_tokens=13)
    with pytest.raises(RegistryMismatchError, match=r"different feature registries"):
        scatter_features(x if fold_mesh.is_domain_source else None, fold_mesh, registry=registry)


@pytest.mark.parametrize(
    "fold_mesh",
    [(2, 1, 2), (1, 2, 2), (1, 2, 3), (1, 3, 3)],
    indirect=True,
    ids=lambda s: mesh_id(map(str, s)),
)
def test_batched_input_dtypes_and_values_pass_through(fold_mesh):
    x = sample("boltz2", seed=6, n_tokens=19)
    x = {k: v.unsqueeze(0) for k, v in x.items()}
    x["ref_pos"] = x["ref_pos"].to(torch.bfloat16)
    x["ref_charge"] = x["ref_charge"].to(torch.int8)
    x["method_feature"] = x["method_feature"].to(torch.int32)
    x["record_id"] = "complex-19"
    sharded = scatter_features(x if fold_mesh.is_domain_source else None, fold_mesh)
    gathered = gather_features(sharded)
    problems = [
        k
        for k, v in x.items()
        if isinstance(v, torch.Tensor)
        and not (torch.equal(gathered[k], v) and gathered[k].dtype == v.dtype)
    ]
    problems += [] if sharded["record_id"] == "complex-19" else ["record_id"]
    problems += [] if sharded["disto_target"].placements == (Shard(1), Shard(2)) else ["placement"]
    collective_assert(not problems, f"differ: {problems}")


@pytest.mark.parametrize(
    "fold_mesh", [(2, 1, 2), (1, 2, 2), (1, 2, 3), (1, 3, 3)], indirect=True, ids=str
)
@pytest.mark.parametrize("padding", PADDINGS, ids=["no-pad", "pad-4-32"])
def test_compact_map_layout(fold_mesh, padding):
    x = sample("boltz2", seed=11)
    source = x if fold_mesh.is_domain_source else None
    compact = scatter_features(
        source, fold_mesh, options=ShardingOptions(map_layout="index", **padding)
    )
    dense = scatter_features(source, fold_mesh, options=ShardingOptions(**padding))
    layout = reference_layout(x, fold_mesh.cp[0], **padding)
    (tok_pos, _), (atom_pos, a_pad) = layout["tokens"], layout["atoms"]
    problems = []
    gathered = gather_features(compact)
    problems += [k for k in x if not torch.equal(gathered[k], x[k])]
    # atom_to_token as an index: the padded token position of each atom, -1 for pads.
    owner = x["atom_to_token"].argmax(1)
    has_token = x["atom_to_token"].sum(1) > 0
    expected = torch.full((a_pad,), -1, dtype=torch.long)
    expected[atom_pos[has_token]] = tok_pos[owner[has_token]]
    if not torch.equal(compact["atom_to_token"].full_tensor(), expected):
        problems.append("atom_to_token index != padded token positions")
    rep = x["token_to_rep_atom"]
    expected_rep = torch.full((compact["token_to_rep_atom"].shape[0],), -1, dtype=torch.long)
    has_rep = rep.sum(1) > 0
    expected_rep[tok_pos[has_rep]] = atom_pos[rep.argmax(1)[has_rep]]
    if not torch.equal(compact["token_to_rep_atom"].full_tensor(), expected_rep):
        problems.append("token_to_rep_atom index != padded atom positions")
    for name in ("atom_to_token", "token_to_rep_atom", "r_set_to_rep_atom"):
        c, d = compact[name].to_local(), dense[name].to_local()
        if c.numel() * c.element_size() >= d.numel() * d.element_size() or c.dtype != torch.long:
            problems.append(f"{name}: compact {tuple(c.shape)} {c.dtype} vs dense {tuple(d.shape)}")
    collective_assert(not problems, "; ".join(map(str, problems[:6])))


RNA_LIGAND = {"protein": 0.4, "rna": 0.4, "ligand": 0.2}


@pytest.mark.parametrize(
    "fold_mesh",
    [(1, 2, 2), (1, 2, 3), (1, 3, 3)],
    indirect=True,
    ids=lambda s: mesh_id(map(str, s)),
)
@pytest.mark.parametrize("padding", PADDINGS, ids=["no-pad", "pad-4-32"])
def test_balanced_option_plans_on_the_source_and_round_trips(fold_mesh, padding):
    """The source computes the balanced row blocks itself; the sample comes back bit-exact."""
    x = make_complex(40, seed=12, composition=RNA_LIGAND, msa_rows=4)
    cp0, cp1 = fold_mesh.cp
    per_token = x["atom_to_token"].sum(0)
    expected = balanced_token_bounds(per_token, cp0, cp1=cp1, pair_weight=0.5)
    even = (0, *itertools.accumulate(len(b) for b in torch.arange(40).tensor_split(cp0)))
    assert tuple(expected) != even, "the sample must balance differently from the even split"
    options = ShardingOptions(balance=BalanceOptions(mode="balanced", pair_weight=0.5), **padding)
    source = x if fold_mesh.is_domain_source else None
    sharded = scatter_features(source, fold_mesh, options=options)
    explicit = scatter_features(
        source, fold_mesh, token_bounds=expected, options=ShardingOptions(**padding)
    )
    problems = []
    if sharded.plan.token_bounds != tuple(expected):
        problems.append(f"plan bounds {sharded.plan.token_bounds} != balanced {expected}")
    i = fold_mesh.domain_coordinate[0]
    row_atoms = int(per_token[expected[i] : expected[i + 1]].sum())
    if int(sharded["atom_pad_mask"].to_local().sum()) != row_atoms:
        problems.append(f"row {i} does not hold the {row_atoms} atoms of its balanced tokens")
    for name in x:
        ours, theirs = sharded[name].to_local(), explicit[name].to_local()
        if not (ours.dtype == theirs.dtype and torch.equal(ours, theirs)):
            problems.append(f"{name}: local block differs from the explicit-bounds scatter")
    gathered = gather_features(sharded)
    problems += [
        k
        for k, v in x.items()
        if not (gathered[k].dtype == v.dtype and torch.equal(gathered[k], v))
    ]
    collective_assert(not problems, "; ".join(map(str, problems[:6])))


@pytest.mark.parametrize(
    "fold_mesh", [(1, 2, 2), (1, 2, 3)], indirect=True, ids=lambda s: mesh_id(map(str, s))
)
def test_invalid_options_raise_on_every_rank(fold_mesh):
    x = sample("boltz2", seed=1, n_tokens=13)
    source = x if fold_mesh.is_domain_source else None
    # Options that are no ShardingOptions on one rank only (not the source): every rank
    # raises that rank's error.
    bad = {"token_multiple": 4} if fold_mesh.domain_rank == 1 else None
    with pytest.raises(TypeError, match=r"scatter_features: options must be ShardingOptions"):
        scatter_features(source, fold_mesh, options=bad)  # type: ignore[arg-type]
    # An option given as a keyword is Python's own error, before any communication.
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'atom_multiple'"):
        scatter_features(source, fold_mesh, atom_multiple=8)  # type: ignore[call-arg]
    # The group is still in step.
    sharded = scatter_features(source, fold_mesh, options=ShardingOptions(atom_multiple=32))
    collective_assert(
        torch.equal(gather_features(sharded)["ref_pos"], x["ref_pos"]), "scatter after an error"
    )
