"""Boltz's ``OuterProductMean`` from a scattered MSA to pair tiles.

The layer turns the MSA ``m [B, S, N, c_in]`` into a pair update::

    a[s, i] = proj_a(norm(m))[s, i] * mask[s, i]          (c = c_hidden channels)
    b[s, j] = proj_b(norm(m))[s, j] * mask[s, j]
    count[i, j] = max(1, sum_s mask[s, i] mask[s, j])
    out[i, j] = proj_o(flatten_cd(sum_s a[s, i, c] b[s, j, d]) / count[i, j])

Why the op-by-op path fails
---------------------------
The MSA has its rows ``s`` on ``cp0`` (blocks ``S_p``) and its tokens on ``cp1`` (the
pair's column blocks ``C_q``); the result is a pair tile, token rows ``R_p`` on ``cp0`` and
columns ``C_q`` on ``cp1``. The ``einsum("bsic,bsjd->bijcd")`` contracts the sharded ``s``
axis and puts the token axis, sharded over ``cp1`` in both operands, on two result axes: run
op by op it gathers, and its ``[N, N, c^2]`` result is ``c^2 / c_out`` times a pair tensor.

The algorithm, its collectives and its memory are those of the kernel,
:mod:`physicsnemo_foldcp.kernels.outer_product`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
    tile_shapes,
)
from physicsnemo_foldcp.core.tensor import wrap
from physicsnemo_foldcp.kernels.outer_product import (
    MsaLayout,
    MsaOperands,
    OuterProductTile,
    pair_row_sizes,
)
from physicsnemo_foldcp.ops import ShardingLayoutError
from physicsnemo_foldcp.ops.modules import submodule_caller, tile_parameters

# -- the handler -----------------------------------------------------------------------------


def outer_product_mean(
    module: torch.nn.Module,
    m: torch.Tensor,
    mask: torch.Tensor,
    chunk_size: int | None = None,
    *,
    row_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """``OuterProductMean.forward`` on FoldTensors (see the module docstring).

    Parameters
    ----------
    module : boltz.model.layers.outer_product_mean.OuterProductMean
        The Boltz module (its parameters are used as they are).
    m : torch.Tensor
        ``[B, S, N, c_in]`` MSA, ``(Shard(1), Shard(2))``: rows over ``cp0``, tokens over
        ``cp1`` in the pair's column blocks.
    mask : torch.Tensor
        ``[B, S, N]`` MSA mask, co-sharded with ``m``.
    chunk_size : int, optional
        Boltz's eval-mode chunk of hidden channels: used as the contraction's chunk in eval
        mode (the result is the same).
    row_sizes : sequence of int, optional
        The pair's token row blocks over ``cp0`` (module docstring, last section).

    Returns
    -------
    torch.Tensor
        ``[B, N, N, c_out]`` pair tile ``(Shard(1), Shard(2))``: rows ``R_p``, columns
        ``C_q``.

    Raises
    ------
    ShardingLayoutError
        When the operands are not laid out as above.
    """
    op = "OuterProductMean (context parallel)"
    m = require_shard_tensor(m, op, "m")
    mask = require_shard_tensor(mask, op, "mask")
    mesh = m.device_mesh
    for name, t in (("m", m), ("mask", mask)):
        if tuple(t.placements) != (Shard(1), Shard(2)) or t.device_mesh != mesh:
            raise ShardingLayoutError(
                f"{op}: {name} must be (Shard(1), Shard(2)) over the MSA's mesh, got "
                f"{describe(t)} [{rank_label(mesh)}]"
            )
    msa_sizes, col_sizes = mesh_sizes(m, ROWS, 1), mesh_sizes(m, COLUMNS, 2)
    if mesh_sizes(mask, ROWS, 1) != msa_sizes or mesh_sizes(mask, COLUMNS, 2) != col_sizes:
        raise ShardingLayoutError(
            f"{op}: the mask's blocks must be the MSA's, got {describe(mask)} and "
            f"{describe(m)} [{rank_label(mesh)}]"
        )
    cp0 = mesh.size(ROWS)
    rows = list(row_sizes) if row_sizes is not None else pair_row_sizes(col_sizes, cp0)
    if len(rows) != cp0 or sum(rows) != sum(col_sizes):
        raise ShardingLayoutError(
            f"{op}: row blocks {rows} do not split the {sum(col_sizes)} tokens over "
            f"cp0 = {cp0} [{rank_label(mesh)}]"
        )
    p, q = coordinate(mesh)
    layout = MsaLayout(mesh, tuple(msa_sizes), tuple(rows), tuple(col_sizes), p, q)

    params = tile_parameters(module, mesh)
    call = submodule_caller(module, params)
    m_local = local_of(m)
    keep = compat.local_tensor(mask).detach().to(m_local.dtype)
    normed = call("norm", m_local)
    a = call("proj_a", normed) * keep.unsqueeze(-1)
    b = call("proj_b", normed) * keep.unsqueeze(-1)
    a_rows, b_cols, mask_rows, mask_cols = MsaOperands.apply(a, b, keep, layout)
    count = torch.einsum("bsi,bsj->bij", mask_rows.float(), mask_cols.float()).clamp(min=1)

    c = module.c_hidden
    weight, bias = params["proj_o.weight"], params["proj_o.bias"]
    if chunk_size is not None and not module.training:
        chunk = max(1, int(chunk_size))
    else:
        chunk = max(1, weight.shape[0] // c)
    out = OuterProductTile.apply(a_rows, b_cols, weight, count, chunk)
    out = out.to(m_local.dtype) + bias
    shapes = tile_shapes(out.shape, 1, rows, col_sizes, (p, q))
    return wrap(out, mesh, (Shard(1), Shard(2)), shapes)


def handlers() -> list[tuple[type, Callable[..., Any]]]:
    """``[(OuterProductMean, outer_product_mean)]``."""
    from boltz.model.layers.outer_product_mean import OuterProductMean

    return [(OuterProductMean, outer_product_mean)]


__all__ = [
    "MsaLayout",
    "MsaOperands",
    "OuterProductTile",
    "handlers",
    "outer_product_mean",
    "pair_row_sizes",
]
