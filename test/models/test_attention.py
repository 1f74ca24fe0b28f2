"""Pair-biased attention: serial semantics, and the CP handler against the serial op."""

import math

import pytest
import torch
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.placement_types import Replicate, Shard

from physicsnemo_foldcp.core.blocks import (
    ShardingLayoutError,
    row_shapes,
    tile_shapes,
)
from physicsnemo_foldcp.ops.attention import pair_bias_attention
from physicsnemo_foldcp.sharding.plan import column_block_sizes, split_sizes
from physicsnemo_foldcp.testing import collective_assert, collective_assert_close

MESHES = [(2, 1, 2), (1, 2, 2), (1, 2, 3), (1, 3, 3)]
mesh_id = lambda s: "x".join(map(str, s))  # noqa: E731


def inputs(n, heads=2, dim=4, seed=0, masked=(3, 7)):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, n, heads, dim, generator=g, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(1, n, n, heads, generator=g, dtype=torch.float64)
    mask = torch.ones(1, n, dtype=torch.float64)
    mask[0, list(masked)] = 0
    return q, k, v, bias, mask


def test_serial_matches_explicit_softmax():
    q, k, v, bias, mask = inputs(9)
    out = pair_bias_attention(q, k, v, bias, mask)
    expected = torch.zeros_like(out)
    for h in range(q.shape[2]):
        for i in range(9):
            logits = torch.tensor(
                [
                    float(q[0, i, h] @ k[0, j, h]) / math.sqrt(q.shape[-1])
                    + float(bias[0, i, j, h])
                    for j in range(9)
                ],
                dtype=torch.float64,
            )
            keep = mask[0] > 0
            w = torch.zeros(9, dtype=torch.float64)
            w[keep] = torch.softmax(logits[keep], 0)
            expected[0, i, h] = w @ v[0, :, h]
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_masked_keys_do_not_matter():
    q, k, v, bias, mask = inputs(8)
    out = pair_bias_attention(q, k, v, bias, mask)
    k2, v2, b2 = k.clone(), v.clone(), bias.clone()
    k2[0, 3] += 5.0
    v2[0, 7] -= 3.0
    b2[:, :, 3] += 2.0
    torch.testing.assert_close(pair_bias_attention(q, k2, v2, b2, mask), out)


def test_serial_shape_errors():
    q, k, v, bias, mask = inputs(6, masked=(3,))
    with pytest.raises(ValueError, match="bias must be"):
        pair_bias_attention(q, k, v, bias[:, :5], mask)
    with pytest.raises(ValueError, match="key_mask must be"):
        pair_bias_attention(q, k, v, bias, mask[:, :5])


# -- distributed ----------------------------------------------------------------------------


def shard_rows(x, mesh, sizes):
    i, _ = mesh.domain_coordinate
    start = sum(sizes[:i])
    local = x.narrow(1, start, sizes[i]).clone().to(mesh.device)
    local.requires_grad_(x.is_floating_point())
    st = ShardTensor.from_local(
        local,
        mesh.domain_mesh,
        (Shard(1), Replicate()),
        sharding_shapes=row_shapes(local.shape, 1, sizes),
    )
    return st, local


def shard_tile(x, mesh, rows, cols):
    i, j = mesh.domain_coordinate
    local = x.narrow(1, sum(rows[:i]), rows[i]).narrow(2, sum(cols[:j]), cols[j])
    local = local.clone().to(mesh.device).requires_grad_(True)
    shapes = tile_shapes(local.shape, 1, rows, cols, (i, j))
    st = ShardTensor.from_local(
        local, mesh.domain_mesh, (Shard(1), Shard(2)), sharding_shapes=shapes
    )
    return st, local


def rows_of(x, sizes, i):
    return x.narrow(1, sum(sizes[:i]), sizes[i])


@pytest.mark.multigpu_static
@pytest.mark.parametrize("fold_mesh", MESHES, indirect=True, ids=mesh_id)
@pytest.mark.parametrize("n", [11, 2])
def test_distributed_matches_serial_forward_and_gradients(fold_mesh, n):
    """Uneven N (11 over 2 or 3 blocks, N < cp1 for N = 2): output and every input gradient."""
    mesh = fold_mesh
    cp0, cp1 = mesh.cp
    masked = [t for t in (3, 7) if t < n - 1]
    q, k, v, bias, mask = (t.float() for t in inputs(n, masked=masked))
    g = torch.Generator().manual_seed(1)
    upstream = torch.randn(1, n, 2, 4, generator=g)
    serial = [t.clone().requires_grad_(True) for t in (q, k, v, bias)]
    out = pair_bias_attention(*serial, mask)
    (out * upstream).sum().backward()

    rows = split_sizes(n, cp0)
    cols = column_block_sizes(rows, cp1)
    i, j = mesh.domain_coordinate
    (qs, ql), (ks, kl), (vs, vl) = (shard_rows(t, mesh, rows) for t in (q, k, v))
    ms, _ = shard_rows(mask, mesh, rows)
    bs, bl = shard_tile(bias, mesh, rows, cols)
    with CommDebugMode() as forward_comm:
        dout = pair_bias_attention(qs, ks, vs, bs, ms)
    collective_assert(isinstance(dout, ShardTensor), f"output is {type(dout).__name__}")
    collective_assert(
        tuple(dout.placements) == (Shard(1), Replicate()), f"placements {dout.placements}"
    )
    collective_assert_close(dout.to_local().cpu(), rows_of(out.detach(), rows, i), "output rows")
    with CommDebugMode() as backward_comm:
        (dout.to_local() * rows_of(upstream, rows, i).to(mesh.device)).sum().backward()
    for name, local, full in (("q", ql, serial[0]), ("k", kl, serial[1]), ("v", vl, serial[2])):
        collective_assert(local.grad is not None, f"{name} got no gradient")
        collective_assert_close(local.grad.cpu(), rows_of(full.grad, rows, i), f"grad {name}")
    tile = rows_of(serial[3].grad, rows, i).narrow(2, sum(cols[:j]), cols[j])
    collective_assert_close(bl.grad.cpu(), tile, "grad bias tile")

    counts = {str(k_).split(".")[-1]: c for k_, c in forward_comm.get_comm_counts().items()}
    expected = {}
    if cp0 > 1:
        expected["all_gather_into_tensor"] = 1
    if cp1 > 1:
        expected["all_reduce"] = 2
    collective_assert(counts == expected, f"forward collectives {counts}, expected {expected}")
    counts = {str(k_).split(".")[-1]: c for k_, c in backward_comm.get_comm_counts().items()}
    expected = {}
    if cp0 > 1:
        expected["reduce_scatter_tensor"] = 1
    if cp1 > 1:
        expected["all_reduce"] = 1
    collective_assert(counts == expected, f"backward collectives {counts}, expected {expected}")


@pytest.mark.multigpu_static
@pytest.mark.parametrize("fold_mesh", [(1, 2, 2), (1, 2, 3)], indirect=True, ids=mesh_id)
def test_distributed_refuses_a_replicated_bias(fold_mesh):
    mesh = fold_mesh
    n = 6
    q, k, v, bias, mask = (t.float() for t in inputs(n, masked=()))
    rows = split_sizes(n, mesh.cp[0])
    (qs, _), (ks, _), (vs, _), (ms, _), (bs, _) = (
        shard_rows(t, mesh, rows) for t in (q, k, v, mask, bias)
    )
    with pytest.raises(ShardingLayoutError, match=r"bias must be the pair tile"):
        pair_bias_attention(qs, ks, vs, bs, ms)
