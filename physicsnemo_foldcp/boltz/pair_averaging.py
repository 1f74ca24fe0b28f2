"""Boltz's ``PairWeightedAveraging`` on a scattered MSA and pair tile.

The layer averages MSA rows over tokens with weights from the pair::

    w[h, i, j] = softmax_j(proj_z(norm_z(z))[i, j, h] - inf * (1 - mask[i, j]))
    o[s, i, h] = sum_j w[h, i, j] proj_m(norm_m(m))[s, j, h]
    out[s, i]  = proj_o(sigmoid(proj_g(norm_m(m))[s, i]) * o[s, i])

Why the op-by-op path fails
---------------------------
The MSA ``m [B, S, N, C]`` has its rows on ``cp0`` (blocks ``S_p``) and its tokens on
``cp1`` (the pair's column blocks ``C_q``); the pair tile ``z`` has token rows ``R_p`` on
``cp0``. The softmax reads along ``j``, a sharded axis, and the ``einsum`` of ``w``
``[B, H, N_i, N_j]`` with the values ``[B, H, S, N_j, D]`` shards two result axes (``i``
and ``s``) over ``cp0``: run op by op, both gather.

The algorithm (rank ``(p, q)``)
-------------------------------
Rank ``(p, q)`` computes its own MSA block ``out[S_p, C_q]``:

1. the layer norms and projections run on the local blocks with the module's own
   parameters (each rank's part of a parameter's gradient is summed over the mesh in
   backward);
2. the weights of this rank's tokens ``C_q`` over all ``j``: the bias rows ``C_q`` are
   brought together from the tiles that hold them (the triangle attention's
   :class:`~physicsnemo_foldcp.boltz.triangle_attention.QueryStrip`), masked, and
   normalised by a local softmax over the whole row;
3. the values of the MSA rows ``S_p`` for all tokens: ONE all-gather over ``cp1``
   (backward: ONE reduce-scatter);
4. the average and the output projection are local.

Communication per call, forward / backward: the bias strip's (ONE all-to-all over
``cp1``, ONE all-gather or all-reduce over ``cp0`` / their adjoints), ONE all-gather over
``cp1`` of ``S_p x N x H x D`` values / ONE reduce-scatter of their gradient, and one
all-reduce per mesh dim of the parameter gradients. Peak extra memory: the strip
``|C_q| x N x H`` and the values ``S_p x N x H x D``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor.placement_types import Shard

from physicsnemo_foldcp.core import compat
from physicsnemo_foldcp.core.blocks import (
    COLUMNS,
    ROWS,
    coordinate,
    describe,
    local_of,
    mesh_sizes,
    rank_label,
    require_shard_tensor,
)
from physicsnemo_foldcp.core.tensor import wrap
from physicsnemo_foldcp.dispatch.blockwise import GatherOver
from physicsnemo_foldcp.kernels.triangle_attention import Layout, QueryStrip
from physicsnemo_foldcp.ops import ShardingLayoutError
from physicsnemo_foldcp.ops.modules import submodule_caller, tile_parameters


def pair_weighted_averaging(
    module: torch.nn.Module,
    m: torch.Tensor,
    z: torch.Tensor,
    mask: torch.Tensor,
    chunk_heads: bool = False,
) -> torch.Tensor:
    """``PairWeightedAveraging.forward`` on FoldTensors (see the module docstring).

    Parameters
    ----------
    module : boltz.model.layers.pair_averaging.PairWeightedAveraging
        The Boltz module (its parameters are used as they are).
    m : torch.Tensor
        ``[B, S, N, c_m]`` MSA, ``(Shard(1), Shard(2))``: rows over ``cp0``, tokens over
        ``cp1`` in the pair's column blocks.
    z : torch.Tensor
        ``[B, N, N, c_z]`` pair tile ``(Shard(1), Shard(2))``.
    mask : torch.Tensor
        ``[B, N, N]`` pair mask, co-sharded with ``z``.
    chunk_heads : bool, default False
        Boltz's eval-mode head chunking: accepted and not used (the result is the same).

    Returns
    -------
    torch.Tensor
        ``[B, S, N, c_m]``, with the blocks of ``m``.

    Raises
    ------
    ShardingLayoutError
        When the operands are not laid out as above.
    """
    op = "PairWeightedAveraging (context parallel)"
    m = require_shard_tensor(m, op, "m")
    z = require_shard_tensor(z, op, "z")
    mask = require_shard_tensor(mask, op, "mask")
    mesh = z.device_mesh
    row_sizes, col_sizes = mesh_sizes(z, ROWS, 1), mesh_sizes(z, COLUMNS, 2)
    for name, t in (("m", m), ("z", z), ("mask", mask)):
        if tuple(t.placements) != (Shard(1), Shard(2)) or t.device_mesh != mesh:
            raise ShardingLayoutError(
                f"{op}: {name} must be (Shard(1), Shard(2)) over the pair's mesh, got "
                f"{describe(t)} [{rank_label(mesh)}]"
            )
    if mesh_sizes(m, COLUMNS, 2) != col_sizes or mesh_sizes(mask, COLUMNS, 2) != col_sizes:
        raise ShardingLayoutError(
            f"{op}: the MSA's and the mask's token blocks over cp1 must be the pair's "
            f"column blocks {col_sizes}, got {describe(m)} and {describe(mask)} "
            f"[{rank_label(mesh)}]"
        )
    i, j = coordinate(mesh)
    heads, width = module.num_heads, module.c_h
    call = submodule_caller(module, tile_parameters(module, mesh))
    m_local, z_local = local_of(m), local_of(z)
    b, s, n_q, _ = m_local.shape

    normed_m = call("norm_m", m_local)
    values = call("proj_m", normed_m).view(b, s, n_q, heads, width)
    bias = call("proj_z", call("norm_z", z_local))  # [B, R_i, C_j, H]
    keep = compat.local_tensor(mask).detach().to(bias.dtype)
    bias = bias + (1 - keep[..., None]) * -module.inf
    layout = Layout(mesh, ROWS, COLUMNS, tuple(row_sizes), tuple(col_sizes), i, j)
    weights = torch.softmax(QueryStrip.apply(bias, layout), dim=-1)  # [B, H, C_j, N]
    all_values = GatherOver.apply(values, 2, tuple(col_sizes), mesh, COLUMNS, True)
    o = torch.einsum("bhij,bsjhd->bsihd", weights, all_values)
    gate = call("proj_g", normed_m).sigmoid()
    out = call("proj_o", gate * o.reshape(b, s, n_q, heads * width))
    shapes = {k: [tuple(shape) for shape in v] for k, v in compat.sharding_shapes(m).items()}
    return wrap(out, mesh, (Shard(1), Shard(2)), shapes)


def handlers() -> list[tuple[type, Callable[..., Any]]]:
    """``[(PairWeightedAveraging, pair_weighted_averaging)]``."""
    from boltz.model.layers.pair_averaging import PairWeightedAveraging

    return [(PairWeightedAveraging, pair_weighted_averaging)]


__all__ = ["handlers", "pair_weighted_averaging"]
