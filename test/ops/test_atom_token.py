"""atom <-> token ops on scattered complexes: serial parity of outputs and gradients, no comm."""

import copy
import dataclasses
import time

import pytest
import torch
from physicsnemo.domain_parallel import ShardTensor
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

from physicsnemo_foldcp.ops import (
    MapLayoutError,
    ShardingLayoutError,
    atoms_to_tokens_mean,
    map_tag,
    masked_mean,
    representative_atoms,
    tag_maps,
    tokens_to_atoms,
    wrap,
)
from physicsnemo_foldcp.sharding.scatter import ShardedFeatures
from physicsnemo_foldcp.testing import collective_assert, collective_assert_close

pytestmark = pytest.mark.multigpu_static

MESHES = [(2, 1, 2), (1, 2, 2), (1, 2, 3), (1, 3, 3)]
ROW_SPLIT_MESHES = [(1, 2, 2), (1, 2, 3), (1, 3, 3)]
mesh_id = "x".join

# op, map feature, input axes, output axes, output mask feature
OPS = {
    "tokens_to_atoms": (tokens_to_atoms, "atom_to_token", "tokens", "atoms", "atom_pad_mask"),
    "atoms_to_tokens_mean": (
        atoms_to_tokens_mean,
        "atom_to_token",
        "atoms",
        "tokens",
        "token_pad_mask",
    ),
    "representative_atoms": (
        representative_atoms,
        "token_to_rep_atom",
        "atoms",
        "tokens",
        "token_pad_mask",
    ),
    "r_set_representative_atoms": (
        representative_atoms,
        "r_set_to_rep_atom",
        "atoms",
        "rset",
        None,
    ),
}


def serial_map(case, name, layout):
    dense = case.serial[name]
    if layout == "dense":
        return dense
    has = (dense != 0).any(-1)
    return torch.where(has, (dense != 0).to(torch.int8).argmax(-1), -1)


def call(op, x, m, case):
    if op is atoms_to_tokens_mean:
        return op(x, m, 1e-6, case.n_tokens)
    return op(x, m)


def axis_length(case, axis):
    return {
        "tokens": case.n_tokens,
        "atoms": case.n_atoms,
        "rset": case.serial["r_set_to_rep_atom"].shape[1],
    }[axis]


def output_mask(case, mask_name, out_axis):
    if mask_name is None:
        return torch.ones(1, axis_length(case, out_axis))
    return case.serial[mask_name].float()


@pytest.mark.parametrize("fold_mesh", MESHES, indirect=True, ids=lambda s: mesh_id(map(str, s)))
@pytest.mark.parametrize("padding", ["no-pad", "pad-4-32"])
@pytest.mark.parametrize("layout", ["dense", "index"])
@pytest.mark.parametrize("name", list(OPS))
def test_op_matches_serial_output_and_gradients(fold_mesh, padding, layout, name, ops_case):
    """Linear -> op -> Linear -> masked loss: outputs, input and weight grads equal serial."""
    case = ops_case(fold_mesh, padding)
    op, map_name, in_axis, out_axis, mask_name = OPS[name]
    in_axes, out_axes = (in_axis, None), (out_axis, None)
    torch.manual_seed(11)
    lin_in, lin_out = nn.Linear(5, 8), nn.Linear(8, 3)
    d_in, d_out = copy.deepcopy(lin_in).to(case.device), copy.deepcopy(lin_out).to(case.device)
    x = case.randn(1, axis_length(case, in_axis), 5)
    w = case.randn(1, axis_length(case, out_axis), 3)
    mask = output_mask(case, mask_name, out_axis)

    x_param = nn.Parameter(x.clone())
    out_s = call(op, lin_in(x_param), serial_map(case, map_name, layout), case)
    loss_s = masked_mean(lin_out(out_s) * w, mask[..., None])
    loss_s.backward()

    xs, leaf = case.shard(x, in_axes, requires_grad=True)
    ws, _ = case.shard(w, out_axes)
    ms, _ = case.shard(mask, (out_axis,))
    features = case.sharded if layout == "dense" else case.index
    out_d = call(op, d_in(xs), features[map_name], case)
    loss_d = masked_mean(d_out(out_d) * ws, ms.unsqueeze(-1))
    loss_d.backward()

    collective_assert(
        tuple(out_d.placements) == (Shard(1), Replicate()), f"placements {out_d.placements}"
    )
    collective_assert_close(case.unpadded(out_d, out_axes), out_s.detach(), "output")
    full = out_d.full_tensor().detach().cpu()
    pads = case.pads((out_axis,))[..., None].expand_as(full)
    collective_assert(bool((full[pads] == 0).all()), "pad rows of the output are not zero")
    collective_assert_close(loss_d.to_local().detach().cpu(), loss_s.detach(), "loss")
    collective_assert_close(
        leaf.grad.cpu(), case.expected_local(x_param.grad, in_axes), "input grad", atol=1e-6
    )
    for (label, p_d), p_s in zip(
        list(d_in.named_parameters()) + list(d_out.named_parameters()),
        list(lin_in.parameters()) + list(lin_out.parameters()),
    ):
        collective_assert_close(p_d.grad.cpu(), p_s.grad, f"grad of {label}", atol=1e-6)


@pytest.mark.parametrize("fold_mesh", MESHES, indirect=True, ids=lambda s: mesh_id(map(str, s)))
@pytest.mark.parametrize("layout", ["dense", "index"])
def test_ops_communicate_nothing_in_forward_and_backward(
    fold_mesh, layout, ops_case, p2p_counter, collectives
):
    case = ops_case(fold_mesh, "pad-4-32")
    features = case.sharded if layout == "dense" else case.index
    problems = []
    for name, (op, map_name, in_axis, out_axis, _) in OPS.items():
        xs, leaf = case.shard(case.randn(1, axis_length(case, in_axis), 4), (in_axis, None), True)
        with CommDebugMode() as forward, p2p_counter() as p2p_forward:
            out = call(op, xs, features[map_name], case)
        grad, _ = case.shard(case.randn(1, axis_length(case, out_axis), 4), (out_axis, None))
        with CommDebugMode() as backward, p2p_counter() as p2p_backward:
            out.backward(grad)
        seen = {
            "forward": collectives(forward),
            "backward": collectives(backward),
            "p2p": p2p_forward["calls"] + p2p_backward["calls"],
        }
        if seen["forward"] or seen["backward"] or seen["p2p"] or leaf.grad is None:
            problems.append(f"{name}: {seen}, grad {'missing' if leaf.grad is None else 'ok'}")
    collective_assert(not problems, "; ".join(problems))


def _outside_column(case, name):
    """A column of map ``name`` outside this rank's block, in the padded layout."""
    rows_axis, columns_axis = {
        "atom_to_token": ("atoms", "tokens"),
        "token_to_rep_atom": ("tokens", "atoms"),
    }[name]
    i = case.mesh.domain_coordinate[0]
    start, stop = case.plan.block(columns_axis, 0, i)
    return start - 1 if start > 0 else stop


def _from_local(local, like):
    return ShardTensor.from_local(
        local,
        like.device_mesh,
        like.placements,
        sharding_shapes={k: list(v) for k, v in like._spec._sharding_shapes.items()},
    )


@pytest.mark.parametrize(
    "fold_mesh", ROW_SPLIT_MESHES, indirect=True, ids=lambda s: mesh_id(map(str, s))
)
def test_a_map_with_atoms_outside_the_rank_tokens_is_refused(fold_mesh, ops_case):
    case = ops_case(fold_mesh)
    s, _ = case.shard(case.randn(1, case.n_tokens, 4), ("tokens", None))
    x, _ = case.shard(case.randn(1, case.n_atoms, 3), ("atoms", None))
    column = _outside_column(case, "atom_to_token")
    dense = case.sharded["atom_to_token"]._local_tensor.clone()
    dense[0, 0].zero_()
    dense[0, 0, column] = 1
    with pytest.raises(MapLayoutError, match=rf"column {column} outside this rank's column block"):
        tokens_to_atoms(s, _from_local(dense, case.sharded["atom_to_token"]))
    index = case.index["atom_to_token"]._local_tensor.clone()
    index[0, 0] = column
    with pytest.raises(MapLayoutError, match=rf"position {column} .* outside this rank's block"):
        tokens_to_atoms(s, _from_local(index, case.index["atom_to_token"]))
    rep_column = _outside_column(case, "token_to_rep_atom")
    rep = case.sharded["token_to_rep_atom"]._local_tensor.clone()
    rep[0, 0].zero_()
    rep[0, 0, rep_column] = 1
    with pytest.raises(MapLayoutError, match="outside this rank's column block"):
        representative_atoms(x, _from_local(rep, case.sharded["token_to_rep_atom"]))


@pytest.mark.parametrize(
    "fold_mesh", ROW_SPLIT_MESHES, indirect=True, ids=lambda s: mesh_id(map(str, s))
)
def test_a_map_bad_on_one_rank_fails_every_rank_at_once(fold_mesh, ops_case, request):
    """An unchecked map corrupted on ONE rank: every rank raises that rank's message, fast."""
    case = ops_case(fold_mesh)
    s, _ = case.shard(case.randn(1, case.n_tokens, 4), ("tokens", None))
    x, _ = case.shard(case.randn(1, case.n_atoms, 3), ("atoms", None))
    culprit = fold_mesh.domain_global_rank(1, 0)
    guilty = fold_mesh.domain_coordinate == (1, 0)
    column = _outside_column(case, "atom_to_token")

    dense = case.sharded["atom_to_token"]._local_tensor.clone()
    index = case.index["atom_to_token"]._local_tensor.clone()
    if guilty:
        dense[0, 0].zero_()
        dense[0, 0, column] = 1
        index[0, 0] = column
    untagged_dense = _from_local(dense, case.sharded["atom_to_token"])
    untagged_index = _from_local(index, case.index["atom_to_token"])
    features = ShardedFeatures(case.sharded)
    for attr in ("plan", "meta", "registry", "mesh", "stats"):
        setattr(features, attr, getattr(case.sharded, attr))
    # A tag the plugin did not check itself (tag_maps checks every map it tags).
    unchecked_tag = dataclasses.replace(map_tag(case.sharded["atom_to_token"]), checked=False)
    unchecked = wrap(_from_local(dense, case.sharded["atom_to_token"]), tag=unchecked_tag)

    calls = {
        "dense, untagged": lambda: tokens_to_atoms(s, untagged_dense),
        "index, untagged": lambda: tokens_to_atoms(s, untagged_index),
        "dense, tagged unchecked": lambda: atoms_to_tokens_mean(x, unchecked, 1e-6),
    }
    timeout = request.config.getoption("--foldcp-timeout")
    for what, run in calls.items():
        started = time.monotonic()
        with pytest.raises(MapLayoutError) as info:
            run()
        elapsed = time.monotonic() - started
        message = str(info.value)
        collective_assert(
            f"global rank {culprit} at (cp0, cp1) = (1, 0): " in message
            and "outside this rank's" in message,
            f"{what}: the message does not name the culprit rank {culprit}: {message}",
        )
        collective_assert(
            elapsed < min(10.0, timeout / 2),
            f"{what}: raised after {elapsed:.1f} s (collective timeout {timeout} s)",
        )


@pytest.mark.parametrize(
    "fold_mesh", ROW_SPLIT_MESHES, indirect=True, ids=lambda s: mesh_id(map(str, s))
)
def test_tag_maps_refuses_a_bad_map_on_every_rank(fold_mesh, ops_case):
    """A map corrupted on ONE rank, or with a shape off the plan, fails tag_maps everywhere."""
    case = ops_case(fold_mesh)

    def fresh_features(**replace):
        out = ShardedFeatures(case.sharded)
        for attr in ("plan", "meta", "registry", "mesh", "stats"):
            setattr(out, attr, getattr(case.sharded, attr))
        for name in ("atom_to_token", "token_to_rep_atom", "token_to_center_atom"):
            out[name] = _from_local(case.sharded[name]._local_tensor, case.sharded[name])
        out.update(replace)
        return out

    a2t = case.sharded["atom_to_token"]
    local = a2t._local_tensor.clone()
    culprit = fold_mesh.domain_global_rank(1, 0)
    if fold_mesh.domain_coordinate == (1, 0):
        local[0, 0].zero_()
        local[0, 0, _outside_column(case, "atom_to_token")] = 1
    features = fresh_features(atom_to_token=_from_local(local, a2t))
    with pytest.raises(
        MapLayoutError, match=rf"rank {culprit} \(cp0, cp1\) = \(1, 0\): atom_to_token"
    ):
        tag_maps(features)

    narrow = a2t._local_tensor[..., :-1].clone()
    shapes = {0: [tuple(s[:-1]) + (s[-1] - 1,) for s in a2t._spec._sharding_shapes[0]]}
    short = ShardTensor.from_local(narrow, a2t.device_mesh, a2t.placements, sharding_shapes=shapes)
    with pytest.raises(
        MapLayoutError, match="atom_to_token: global shape .* disagrees with the plan"
    ):
        tag_maps(fresh_features(atom_to_token=short))


@pytest.mark.parametrize("fold_mesh", MESHES, indirect=True, ids=lambda s: mesh_id(map(str, s)))
def test_operands_that_disagree_with_the_layout_are_refused(fold_mesh, ops_case):
    case = ops_case(fold_mesh, "pad-4-32")
    a2t = case.sharded["atom_to_token"]
    s, _ = case.shard(case.randn(1, case.n_tokens, 4), ("tokens", None))
    q, _ = case.shard(case.randn(1, case.n_atoms, 4), ("atoms", None))
    with pytest.raises(ShardingLayoutError, match="shapes disagree: atom_to_token"):
        tokens_to_atoms(q, a2t)
    with pytest.raises(ShardingLayoutError, match="s must be a ShardTensor"):
        tokens_to_atoms(torch.zeros(1, s.shape[1], 4, device=case.device), a2t)
    swapped = ShardTensor.from_local(
        s._local_tensor.transpose(1, 2).contiguous(),
        s.device_mesh,
        (Shard(2), Replicate()),
        sharding_shapes={0: [(1, 4, n[1]) for n in s._spec._sharding_shapes[0]]},
    )
    with pytest.raises(
        ShardingLayoutError, match=r"s must be sharded \(Shard\(1\), Replicate\(\)\)"
    ):
        tokens_to_atoms(swapped, a2t)
    untagged = _from_local(a2t._local_tensor, a2t)
    with pytest.raises(ShardingLayoutError, match="carries no map tag"):
        atoms_to_tokens_mean(q, untagged)
    needs_grad = _from_local(a2t._local_tensor.float().requires_grad_(True), a2t)
    with pytest.raises(ShardingLayoutError, match="atom_to_token requires grad"):
        tokens_to_atoms(s, needs_grad)


@pytest.mark.parametrize(
    "fold_mesh", ROW_SPLIT_MESHES, indirect=True, ids=lambda s: mesh_id(map(str, s))
)
def test_a_single_cut_differently_from_the_map_is_refused(fold_mesh, ops_case):
    case = ops_case(fold_mesh)
    sizes = list(case.plan.row_sizes("tokens"))
    shifted = [sizes[0] + 1, sizes[1] - 1, *sizes[2:]]
    i = fold_mesh.domain_coordinate[0]
    padded = case.padded(case.randn(1, case.n_tokens, 4), ("tokens", None))
    local = padded[:, sum(shifted[:i]) : sum(shifted[: i + 1])].clone()
    s = ShardTensor.from_local(
        local,
        fold_mesh.domain_mesh,
        (Shard(1), Replicate()),
        sharding_shapes={0: [(1, n, 4) for n in shifted]},
    )
    with pytest.raises(
        ShardingLayoutError, match="s is not co-sharded with the columns of 'atom_to_token'"
    ):
        tokens_to_atoms(s, case.sharded["atom_to_token"])


@pytest.mark.parametrize("fold_mesh", MESHES, indirect=True, ids=lambda s: mesh_id(map(str, s)))
def test_tagged_maps_and_what_they_derive_locally_are_truthful(fold_mesh, ops_case):
    """Each locally computed map result is a correct ShardTensor: full_tensor() is serial."""
    case = ops_case(fold_mesh, "pad-4-32")
    a2t = case.sharded["atom_to_token"].float()
    dense = case.padded(case.serial["atom_to_token"], ("atoms", "tokens")).float()
    counts = a2t.sum(1, keepdim=True)
    results = {
        "map": (a2t, dense, True),
        "transpose": (a2t.transpose(1, 2), dense.transpose(1, 2), True),
        "mT": (a2t.mT, dense.mT, True),
        "permute": (a2t.permute(0, 2, 1), dense.permute(0, 2, 1), True),
        "atoms per token": (counts, dense.sum(1, keepdim=True), False),
        "tokens per atom": (a2t.sum(2), dense.sum(2), False),
        "normalized": (a2t / (counts + 1e-6), dense / (dense.sum(1, keepdim=True) + 1e-6), True),
        "scaled": (2.0 * a2t, 2 * dense, True),
        "repeat_interleave(1, 0)": (a2t.repeat_interleave(1, 0), dense, True),
        "index map": (case.index["atom_to_token"], _padded_index(case), True),
    }
    problems = []
    for label, (distributed, serial, keeps_tag) in results.items():
        full = distributed.full_tensor().cpu()
        if full.shape != serial.shape or not torch.equal(full, serial.to(full.dtype)):
            problems.append(f"{label}: full_tensor() differs from serial")
        if (map_tag(distributed) is not None) != keeps_tag:
            problems.append(f"{label}: tag {map_tag(distributed)}")
    collective_assert(not problems, "; ".join(problems))


def _padded_index(case):
    """Serial atom -> token index in the padded layout (token positions, -1 for none)."""
    dense = case.serial["atom_to_token"]
    has = (dense != 0).any(-1)
    index = torch.where(has, case.plan.positions("tokens")[(dense != 0).int().argmax(-1)], -1)
    padded = torch.full((1, case.plan.padded_length("atoms")), -1, dtype=torch.int64)
    padded[:, case.plan.positions("atoms")] = index
    return padded


DERIVED_VIEWS = {
    "float().unsqueeze(0)": lambda m: m.float().unsqueeze(0),
    "to(float32)[None]": lambda m: m.to(torch.float32)[None],
    "float()[None, ...]": lambda m: m.float()[None, ...],
    "float()[None].repeat_interleave(1, 0)": lambda m: m.float()[None].repeat_interleave(1, 0),
}


@pytest.mark.parametrize("fold_mesh", MESHES, indirect=True, ids=lambda s: mesh_id(map(str, s)))
@pytest.mark.parametrize("view", list(DERIVED_VIEWS))
def test_derived_views_of_unbatched_maps_stay_local(fold_mesh, ops_case, view, p2p_counter):
    """Boltz's forms on a view of an unbatched scattered map: exact, 0 collectives both ways.

    ``bmm(view, s)``, the normalised mean ``bmm((w / (w.sum(1, keepdim=True) + eps))
    .transpose(-1, -2), q)`` and its ``.mT`` spelling, on ``w`` = the view of
    ``atom_to_token`` ``[A, N]`` as scattered without a batch axis.
    """
    case = ops_case(fold_mesh, batched=False)
    derive = DERIVED_VIEWS[view]
    a2t = case.sharded["atom_to_token"]
    s_serial = case.randn(case.n_tokens, 5)
    q_serial = case.randn(case.n_atoms, 4)
    s, s_leaf = case.shard(s_serial, ("tokens", None), requires_grad=True)
    q, q_leaf = case.shard(q_serial, ("atoms", None), requires_grad=True)
    with CommDebugMode() as forward, p2p_counter() as p2p:
        w = derive(a2t)
        normalised = w / (w.sum(1, keepdim=True) + 1e-6)
        outs = {
            "bmm": torch.bmm(w, s.unsqueeze(0)),
            "mean.transpose": torch.bmm(normalised.transpose(-1, -2), q.unsqueeze(0)),
            "mean.mT": torch.bmm(normalised.mT, q.unsqueeze(0)),
        }
        loss_local = sum((o.to_local() ** 2).sum() for o in outs.values())
    with CommDebugMode() as backward, p2p_counter() as p2p_back:
        loss_local.backward()
    serial_w = derive(case.serial["atom_to_token"])
    serial_s, serial_q = s_serial.requires_grad_(True), q_serial.requires_grad_(True)
    serial_norm = serial_w / (serial_w.sum(1, keepdim=True) + 1e-6)
    expected = {
        "bmm": torch.bmm(serial_w, serial_s.unsqueeze(0)),
        "mean.transpose": torch.bmm(serial_norm.transpose(-1, -2), serial_q.unsqueeze(0)),
        "mean.mT": torch.bmm(serial_norm.mT, serial_q.unsqueeze(0)),
    }
    problems = [] if map_tag(w) is not None else [f"{view}: the view lost its map tag"]
    for name, out in outs.items():
        axes = ("atoms", None) if name == "bmm" else ("tokens", None)
        if not torch.allclose(case.expected_local(expected[name][0], axes), out.to_local()[0]):
            problems.append(f"{view} {name}: local block differs from serial")
    sum((e**2).sum() for e in expected.values()).backward()
    leaves = (("s", s_leaf, serial_s, "tokens"), ("q", q_leaf, serial_q, "atoms"))
    for label, leaf, serial, axis in leaves:
        if not torch.allclose(leaf.grad, case.expected_local(serial.grad, (axis, None)), atol=1e-5):
            problems.append(f"{view}: gradient of {label} differs")
    counts = (sum(forward.get_comm_counts().values()), sum(backward.get_comm_counts().values()))
    if counts != (0, 0) or p2p["calls"] or p2p_back["calls"]:
        problems.append(f"{view}: collectives {counts}, p2p {p2p['calls']} + {p2p_back['calls']}")
    collective_assert(not problems, "; ".join(problems))
