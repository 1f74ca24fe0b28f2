"""Boltz's triangle multiplication (outgoing and incoming) on pair tiles.

``TriangleMultiplicationOutgoing`` / ``Incoming`` (``boltz.model.layers.triangular_mult``)
compute, on a pair ``x [B, N, N, D]`` with mask ``[B, N, N]``::

    x = norm_in(x); x_in = x
    x = p_in(x) * sigmoid(g_in(x)) * mask[..., None]
    a, b = chunk(x.float(), 2, -1)
    x = einsum("bikd,bjkd->bijd", a, b)        # incoming: einsum("bkid,bkjd->bijd", a, b)
    out = p_out(norm_out(x)) * sigmoid(g_out(x_in))

Why op by op is not enough
--------------------------
Everything but the einsum is local on a pair tile ``(Shard(1), Shard(2))``. The einsum
reads ``b`` along its row axis ``j``, which is sharded over ``cp0`` but must come out
sharded over ``cp1``: the rule table all-gathers ``b`` over ``cp0`` (with ``cp1 == 1`` the
full pair tensor; in general an ``N x N / cp1`` panel, ``cp0`` tiles per rank) and all-reduces
the partial product over ``cp1`` as the whole ``N / cp0 x N`` row panel (``cp1`` tiles,
then ``norm_out`` and ``p_out`` run ``cp1`` times over on it). Memory grows with the mesh
instead of shrinking with it.

What runs instead
-----------------
The handlers below run the module's own submodules (``torch.func.functional_call`` with
its own parameters) on the local blocks, and the contraction panel by panel
(:func:`physicsnemo_foldcp.kernels.triangle_product.triangle_product`; outgoing: ``a``
stays, ``b``'s panel rows are all-gathered over ``cp0``, each partial output panel is
reduce-scattered over ``cp1``; incoming: the same with the axes exchanged). Peak extra
memory about three tile-sized buffers forward and four backward, whatever the mesh; no
communication but the contraction's in forward.

Collectives per call, ``S`` panels (``max(cp0, cp1)`` at most, fewer when the work budget
holds larger ones: :func:`~physicsnemo_foldcp.kernels.triangle_product.panel_count`; a
collective over a mesh dim of size 1 is skipped; "tile" = one rank's ``a`` block, bytes
received per rank):

* forward, outgoing: ``S`` all-gathers over cp0 and ``S`` reduce-scatters over cp1,
  ``(cp0 - 1) + (cp1 - 1)`` tiles; incoming: the same with cp0 and cp1 exchanged. On a
  square ``P x P`` mesh ``2 (P - 1)`` tiles, as Cannon's shifts; on 2x3, 3 tiles.
* backward, outgoing: ``S`` all-gathers over cp1, ``2 S`` collectives over cp0 (an
  all-gather and a reduce-scatter), ``(cp1 - 1) + 2 (cp0 - 1)`` tiles; incoming exchanged;
  plus ONE all-reduce per mesh dim of all the module's parameter gradients together
  (:func:`~physicsnemo_foldcp.ops.modules.tile_parameters`).

``use_kernels=True`` (Boltz's cuequivariance kernels) is refused on sharded inputs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Shard

from physicsnemo_foldcp.core.blocks import (
    COLUMNS,
    ROWS,
    ShardingLayoutError,
    coordinate,
    describe,
    local_of,
    mesh_sizes,
    require_shard_tensor,
    tile_shapes,
)
from physicsnemo_foldcp.core.compat import global_shape
from physicsnemo_foldcp.core.tensor import FoldTensor, wrap
from physicsnemo_foldcp.kernels.triangle_product import INCOMING, OUTGOING, triangle_product
from physicsnemo_foldcp.ops.modules import submodule_caller, tile_parameters

TILE = (Shard(1), Shard(2))


def pair_tile_layout(
    x: Any, mask: Any, op: str
) -> tuple[DeviceMesh, tuple[int, ...], tuple[int, ...]]:
    """Check ``x [B, N, N, D]`` and ``mask [B, N, N]`` are co-sharded pair tiles.

    Returns
    -------
    tuple
        ``(mesh, row_sizes, col_sizes)``: the 2-D domain mesh and the tiles' blocks.

    Raises
    ------
    ShardingLayoutError
        If either is not a ShardTensor ``(Shard(1), Shard(2))`` over the 2-D mesh with
        explicit sharding shapes, or their shapes or blocks disagree.
    """
    x = require_shard_tensor(x, op, "x")
    mask = require_shard_tensor(mask, op, "mask")
    if x.device_mesh != mask.device_mesh:
        raise ShardingLayoutError(f"{op}: x and mask live on different meshes")
    for t, arg, ndim in ((x, "x", 4), (mask, "mask", 3)):
        shape = global_shape(t)
        if tuple(t.placements) != TILE or len(shape) != ndim or shape[1] != shape[2]:
            dims = "[B, N, N, D]" if ndim == 4 else "[B, N, N]"
            raise ShardingLayoutError(
                f"{op}: {arg} must be a pair tile {dims} sharded (Shard(1), Shard(2)) over "
                f"(cp0, cp1), as the scatter lays out pair features; got {describe(t)}"
            )
    rows = tuple(mesh_sizes(x, ROWS, 1))
    cols = tuple(mesh_sizes(x, COLUMNS, 2))
    n = global_shape(x)[1]
    same = (
        global_shape(mask)[:3] == global_shape(x)[:3]
        and tuple(mesh_sizes(mask, ROWS, 1)) == rows
        and tuple(mesh_sizes(mask, COLUMNS, 2)) == cols
    )
    if not same or sum(rows) != n or sum(cols) != n:
        raise ShardingLayoutError(
            f"{op}: mask is not co-sharded with x: {describe(mask)} vs {describe(x)} "
            f"(row blocks {list(rows)}, column blocks {list(cols)})"
        )
    return x.device_mesh, rows, cols


def triangle_multiplication(
    module: nn.Module, x: Any, mask: Any, use_kernels: bool, direction: str
) -> FoldTensor:
    """Boltz's triangle multiplication forward on pair tiles (see the module docstring).

    Parameters
    ----------
    module : nn.Module
        A Boltz ``TriangleMultiplicationOutgoing`` / ``Incoming`` (its submodules
        ``norm_in, p_in, g_in, norm_out, p_out, g_out`` and their parameters are used).
    x : FoldTensor
        ``[B, N, N, D]`` pair tile ``(Shard(1), Shard(2))``.
    mask : FoldTensor
        ``[B, N, N]`` pair tile with the same blocks.
    use_kernels : bool
        Must be ``False``.
    direction : {"outgoing", "incoming"}
        Which contraction.

    Returns
    -------
    FoldTensor
        ``[B, N, N, D]``, the pair tile with ``x``'s blocks.

    Raises
    ------
    ValueError
        For ``use_kernels=True``.
    ShardingLayoutError
        If ``x`` and ``mask`` are not co-sharded pair tiles.
    """
    op = type(module).__name__
    if use_kernels:
        raise ValueError(
            f"{op}(..., use_kernels=True): the cuequivariance triangle multiplication "
            "kernels are not supported under context parallelism yet; call it with "
            "use_kernels=False on sharded pair features"
        )
    mesh, rows, cols = pair_tile_layout(x, mask, op)
    call = submodule_caller(module, tile_parameters(module, mesh))

    h = call("norm_in", local_of(x))
    h_in = h
    h = call("p_in", h) * call("g_in", h).sigmoid()
    h = h * local_of(mask).unsqueeze(-1)
    a, b = torch.chunk(h.float(), 2, dim=-1)
    z = triangle_product(a, b, direction, mesh, rows, cols)
    out = call("p_out", call("norm_out", z)) * call("g_out", h_in).sigmoid()
    shapes = tile_shapes(out.shape, 1, rows, cols, coordinate(mesh))
    return wrap(out, mesh, TILE, shapes)


def outgoing_handler(module: nn.Module, x: Any, mask: Any, use_kernels: bool = False):
    """``TriangleMultiplicationOutgoing.forward`` on pair tiles."""
    return triangle_multiplication(module, x, mask, use_kernels, OUTGOING)


def incoming_handler(module: nn.Module, x: Any, mask: Any, use_kernels: bool = False):
    """``TriangleMultiplicationIncoming.forward`` on pair tiles."""
    return triangle_multiplication(module, x, mask, use_kernels, INCOMING)


def handlers() -> list[tuple[type[nn.Module], Any]]:
    """The Boltz classes this module handles, with their handlers."""
    from boltz.model.layers.triangular_mult import (
        TriangleMultiplicationIncoming,
        TriangleMultiplicationOutgoing,
    )

    return [
        (TriangleMultiplicationOutgoing, outgoing_handler),
        (TriangleMultiplicationIncoming, incoming_handler),
    ]


__all__ = [
    "handlers",
    "incoming_handler",
    "outgoing_handler",
    "pair_tile_layout",
    "triangle_multiplication",
]
