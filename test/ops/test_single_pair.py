"""single -> pair ops, pair masks and masked means: serial parity, gradients, stated comm."""

import copy

import pytest
import torch
from physicsnemo.domain_parallel import ShardTensor
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

from physicsnemo_foldcp.ops import (
    ShardingLayoutError,
    masked_mean,
    outer_sum,
    pair_distances,
    pair_mask,
    relative_position_encoding,
    relpos_width,
    representative_atoms,
)
from physicsnemo_foldcp.testing import (
    collective_assert,
    collective_assert_close,
    collective_assert_equal,
)

pytestmark = pytest.mark.multigpu_static

MESHES = [(2, 1, 2), (1, 2, 2), (1, 2, 3), (1, 3, 3)]
mesh_id = "x".join
mesh_param = pytest.mark.parametrize(
    "fold_mesh", MESHES, indirect=True, ids=lambda s: mesh_id(map(str, s))
)
padding_param = pytest.mark.parametrize("padding", ["no-pad", "pad-4-32"])
PAIR = ("tokens", "tokens")
RELPOS_KEYS = ("residue_index", "token_index", "asym_id", "entity_id", "sym_id")


def assert_params_close(distributed, serial):
    for (label, p_d), p_s in zip(distributed.named_parameters(), serial.parameters()):
        collective_assert_close(p_d.grad.cpu(), p_s.grad, f"grad of {label}", atol=1e-6)


def assert_is_scatter_tile(case, tile):
    """Placements and blocks equal those of a scattered pair feature (token_bonds)."""
    bonds = case.sharded["token_bonds"]
    expected = {k: [tuple(s[:3]) for s in v] for k, v in bonds._spec._sharding_shapes.items()}
    got = {k: [tuple(s[:3]) for s in v] for k, v in tile._spec._sharding_shapes.items()}
    collective_assert(
        tuple(tile.placements) == (Shard(1), Shard(2)) and got == expected,
        f"tile placements {tile.placements} blocks {got}, scatter's {expected}",
    )


@mesh_param
@padding_param
def test_outer_sum_matches_serial_output_and_gradients(fold_mesh, padding, ops_case):
    case = ops_case(fold_mesh, padding)
    torch.manual_seed(5)
    lin_a, lin_b, lin_z = nn.Linear(5, 6), nn.Linear(5, 6), nn.Linear(6, 2)
    serial = nn.ModuleList([lin_a, lin_b, lin_z])
    distributed = copy.deepcopy(serial).to(case.device)
    s = case.randn(1, case.n_tokens, 5)
    w = case.randn(1, case.n_tokens, case.n_tokens, 2)
    token_mask = case.serial["token_pad_mask"]

    s_param = nn.Parameter(s.clone())
    z_s = outer_sum(lin_a(s_param), lin_b(s_param))
    loss_s = masked_mean(lin_z(z_s) * w, pair_mask(token_mask)[..., None])
    loss_s.backward()

    ss, leaf = case.shard(s, ("tokens", None), requires_grad=True)
    ws, _ = case.shard(w, (*PAIR, None))
    ms, _ = case.shard(token_mask, ("tokens",))
    d_a, d_b, d_z = distributed
    z_d = outer_sum(d_a(ss), d_b(ss))
    loss_d = masked_mean(d_z(z_d) * ws, pair_mask(ms).unsqueeze(-1))
    loss_d.backward()

    assert_is_scatter_tile(case, z_d)
    collective_assert_close(case.unpadded(z_d, (*PAIR, None)), z_s.detach(), "pair")
    collective_assert_close(loss_d.to_local().detach().cpu(), loss_s.detach(), "loss")
    collective_assert_close(
        leaf.grad.cpu(), case.expected_local(s_param.grad, ("tokens", None)), "grad of s", atol=1e-6
    )
    assert_params_close(distributed, serial)


@mesh_param
@padding_param
def test_pair_distances_of_representative_atoms(fold_mesh, padding, ops_case):
    """x_atoms -> representative atoms -> pair distances -> Linear: values and gradients."""
    case = ops_case(fold_mesh, padding)
    torch.manual_seed(6)
    lin = nn.Linear(1, 3)
    d_lin = copy.deepcopy(lin).to(case.device)
    x = 10 * case.randn(1, case.n_atoms, 3)
    w = case.randn(1, case.n_tokens, case.n_tokens, 3)
    token_mask = case.serial["token_pad_mask"]

    x_param = nn.Parameter(x.clone())
    rep_s = representative_atoms(x_param, case.serial["token_to_rep_atom"])
    dist_s = pair_distances(rep_s, rep_s)
    loss_s = masked_mean(lin(dist_s[..., None]) * w, pair_mask(token_mask)[..., None])
    loss_s.backward()

    xs, leaf = case.shard(x, ("atoms", None), requires_grad=True)
    ws, _ = case.shard(w, (*PAIR, None))
    ms, _ = case.shard(token_mask, ("tokens",))
    rep_d = representative_atoms(xs, case.sharded["token_to_rep_atom"])
    dist_d = pair_distances(rep_d, rep_d)
    loss_d = masked_mean(d_lin(dist_d.unsqueeze(-1)) * ws, pair_mask(ms).unsqueeze(-1))
    loss_d.backward()

    assert_is_scatter_tile(case, dist_d)
    collective_assert_close(case.unpadded(dist_d, PAIR), dist_s.detach(), "distances")
    collective_assert_close(loss_d.to_local().detach().cpu(), loss_s.detach(), "loss")
    collective_assert_close(
        leaf.grad.cpu(), case.expected_local(x_param.grad, ("atoms", None)), "grad of x", atol=1e-5
    )
    assert_params_close(d_lin, lin)


@mesh_param
@padding_param
def test_relative_position_encoding_matches_serial(fold_mesh, padding, ops_case):
    case = ops_case(fold_mesh, padding)
    torch.manual_seed(7)
    lin = nn.Linear(relpos_width(), 4)
    d_lin = copy.deepcopy(lin).to(case.device)
    w = case.randn(1, case.n_tokens, case.n_tokens, 4)
    token_mask = case.serial["token_pad_mask"]

    feats_s = relative_position_encoding(*(case.serial[k] for k in RELPOS_KEYS))
    loss_s = masked_mean(lin(feats_s) * w, pair_mask(token_mask)[..., None])
    loss_s.backward()

    feats_d = relative_position_encoding(*(case.sharded[k] for k in RELPOS_KEYS))
    ws, _ = case.shard(w, (*PAIR, None))
    ms, _ = case.shard(token_mask, ("tokens",))
    loss_d = masked_mean(d_lin(feats_d) * ws, pair_mask(ms).unsqueeze(-1))
    loss_d.backward()

    assert_is_scatter_tile(case, feats_d)
    collective_assert_equal(case.unpadded(feats_d, (*PAIR, None)), feats_s, "relpos features")
    collective_assert_close(loss_d.to_local().detach().cpu(), loss_s.detach(), "loss")
    assert_params_close(d_lin, lin)


@mesh_param
@padding_param
def test_pair_mask_and_masked_means_give_the_serial_value(fold_mesh, padding, ops_case):
    case = ops_case(fold_mesh, padding)
    token_mask = case.serial["token_pad_mask"].clone()
    token_mask[0, ::5] = 0
    ms, _ = case.shard(token_mask, ("tokens",))
    pair_s = pair_mask(token_mask)
    pair_d = pair_mask(ms)
    assert_is_scatter_tile(case, pair_d)
    collective_assert_equal(case.unpadded(pair_d, PAIR), pair_s, "pair mask")

    values = case.randn(1, case.n_tokens, case.n_tokens, 3)
    singles = case.randn(1, case.n_tokens, 4)
    v_param, t_param = nn.Parameter(values.clone()), nn.Parameter(singles.clone())
    vs, v_leaf = case.shard(values, (*PAIR, None), requires_grad=True)
    ts, t_leaf = case.shard(singles, ("tokens", None), requires_grad=True)
    pair_ms, pair_md = pair_s[..., None], pair_d.unsqueeze(-1)
    cases = {
        "pair, all axes": (
            masked_mean(v_param, pair_ms),
            masked_mean(vs, pair_md),
            (Replicate(), Replicate()),
        ),
        "tokens, all axes": (
            masked_mean(t_param, token_mask[..., None]),
            masked_mean(ts, ms.unsqueeze(-1)),
            (Replicate(), Replicate()),
        ),
        "pair, columns": (
            masked_mean(v_param, pair_ms, dim=2),
            masked_mean(vs, pair_md, dim=2),
            (Shard(1), Replicate()),
        ),
        "pair, rows and channels, keepdim": (
            masked_mean(v_param, pair_ms, dim=(1, 3), keepdim=True),
            masked_mean(vs, pair_md, dim=(1, 3), keepdim=True),
            (Replicate(), Shard(2)),
        ),
    }
    weights = {}
    total_s, total_d = 0.0, 0.0
    for label, (serial, distributed, placements) in cases.items():
        collective_assert(
            tuple(distributed.placements) == placements,
            f"{label}: placements {distributed.placements}, expected {placements}",
        )
        if all(isinstance(p, Replicate) for p in placements):
            collective_assert_close(
                torch.tensor(distributed.item()), serial.detach(), f"{label}: .item()"
            )
            full = distributed.to_local()
        else:
            full = distributed.full_tensor()
        keep = [d for d in range(1, serial.ndim) if serial.shape[d] == case.n_tokens]
        trimmed = full
        for d in keep:
            trimmed = trimmed.index_select(d, case.plan.positions("tokens").to(full.device))
        collective_assert_close(trimmed.detach().cpu(), serial.detach(), f"{label}: value")
        weights[label] = case.randn(*serial.shape)
        total_s = total_s + (serial * weights[label]).sum()
        total_d = (
            total_d + (full * _padded_weight(case, weights[label], keep).to(full.device)).sum()
        )
    total_s.backward()
    total_d.backward()
    collective_assert_close(
        v_leaf.grad.cpu(),
        case.expected_local(v_param.grad, (*PAIR, None)),
        "grad of pair",
        atol=1e-6,
    )
    collective_assert_close(
        t_leaf.grad.cpu(), case.expected_local(t_param.grad, ("tokens", None)), "grad", atol=1e-6
    )


def _padded_weight(case, weight, token_dims):
    """A serial weight grown to the padded token layout along ``token_dims`` (pads 0)."""
    out = weight
    for d in token_dims:
        shape = list(out.shape)
        shape[d] = case.plan.padded_length("tokens")
        grown = torch.zeros(shape)
        out = grown.index_copy_(d, case.plan.positions("tokens"), out)
    return out


def _expected_pair_comm(cp0, cp1, backward=True):
    forward = {"all_gather": 1} if cp0 > 1 else {}
    back = {}
    if backward and cp0 > 1:
        back["reduce_scatter"] = 1
    if backward and cp1 > 1:
        back["all_reduce"] = 1
    return forward, back


@mesh_param
def test_single_to_pair_ops_use_exactly_the_stated_collectives(
    fold_mesh, ops_case, p2p_counter, collectives
):
    case = ops_case(fold_mesh, "pad-4-32")
    cp0, cp1 = fold_mesh.cp
    problems = []

    def measure(label, build, grad_axes, backward=True, expected_forward=None):
        with CommDebugMode() as fwd, p2p_counter() as p2p:
            out = build()
        seen_backward = {}
        if backward:
            grad, _ = case.shard(case.randn(1, *grad_axes[1]), grad_axes[0])
            with CommDebugMode() as bwd, p2p_counter() as p2p_back:
                out.backward(grad)
            seen_backward = collectives(bwd)
            p2p["calls"] += p2p_back["calls"]
        want_forward, want_backward = _expected_pair_comm(cp0, cp1, backward)
        if expected_forward is not None:
            want_forward, want_backward = expected_forward, {}
        seen = (collectives(fwd), seen_backward, p2p["calls"])
        if seen != (want_forward, want_backward, 0):
            problems.append(f"{label}: saw {seen}, expected {(want_forward, want_backward, 0)}")

    n = case.n_tokens
    pair_grad = ((*PAIR, None), (n, n, 3))
    a, _ = case.shard(case.randn(1, n, 3), ("tokens", None), requires_grad=True)
    b, _ = case.shard(case.randn(1, n, 3), ("tokens", None), requires_grad=True)
    mask, _ = case.shard(case.serial["token_pad_mask"], ("tokens",), requires_grad=True)
    measure("outer_sum", lambda: outer_sum(a, b), pair_grad)
    measure("view expression", lambda: a[:, :, None] + b[:, None, :], pair_grad)
    measure("pair_distances", lambda: pair_distances(a, b), (PAIR, (n, n)))
    measure("torch.cdist", lambda: torch.cdist(a, b), (PAIR, (n, n)))
    measure("pair_mask", lambda: pair_mask(mask), (PAIR, (n, n)))
    ids = [case.sharded[k] for k in RELPOS_KEYS]
    measure("relpos", lambda: relative_position_encoding(*ids), None, backward=False)

    values, _ = case.shard(case.randn(1, n, n, 3), (*PAIR, None), requires_grad=True)
    pair_m = pair_mask(case.sharded["token_pad_mask"]).unsqueeze(-1)
    reduced = {"all_reduce": (cp0 > 1) + (cp1 > 1)} if cp0 * cp1 > 1 else {}
    measure("masked_mean", lambda: masked_mean(values, pair_m), None, False, reduced)
    with CommDebugMode() as bwd:
        masked_mean(values, pair_m).backward()
    if collectives(bwd) != ({"all_reduce": (cp0 > 1) + (cp1 > 1)} if cp0 * cp1 > 1 else {}):
        problems.append(f"masked_mean forward+backward: {collectives(bwd)}")
    collective_assert(not problems, "; ".join(problems))


@mesh_param
def test_pair_ops_refuse_operands_laid_out_otherwise(fold_mesh, ops_case):
    case = ops_case(fold_mesh)
    n = case.n_tokens
    s, _ = case.shard(case.randn(1, n, 3), ("tokens", None))
    tile, _ = case.shard(case.randn(1, n, n, 3), (*PAIR, None))
    with pytest.raises(ShardingLayoutError, match=r"outer_sum: a must be sharded \(Shard\(1\)"):
        outer_sum(tile, s)
    rows = case.padded(case.randn(1, n, n, 1), (*PAIR, None))
    start, stop = case.plan.block("tokens", 0, fold_mesh.domain_coordinate[0])
    full_rows = ShardTensor.from_local(
        rows[:, start:stop].clone(),
        fold_mesh.domain_mesh,
        (Shard(1), Replicate()),
        sharding_shapes={
            0: [(1, size, rows.shape[2], 1) for size in case.plan.row_sizes("tokens")]
        },
    )
    with pytest.raises(
        ShardingLayoutError, match="masked_mean: mask is not co-sharded with x over cp1"
    ):
        masked_mean(tile, full_rows)
    with pytest.raises(ShardingLayoutError, match="pair_distances: x2 must be a ShardTensor"):
        pair_distances(s, torch.zeros(1, s.shape[1], 3, device=case.device))
    wrong = ShardTensor.from_local(
        case.sharded["asym_id"]._local_tensor[:, :1].clone(),
        fold_mesh.domain_mesh,
        (Shard(1), Replicate()),
        sharding_shapes={0: [(1, 1)] * fold_mesh.cp[0]},
    )
    ids = [case.sharded[k] for k in RELPOS_KEYS[:2]] + [wrong]
    ids += [case.sharded[k] for k in RELPOS_KEYS[3:]]
    with pytest.raises(ShardingLayoutError, match="asym_id is not co-sharded with residue_index"):
        relative_position_encoding(*ids)
