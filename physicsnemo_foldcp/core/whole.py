"""Small tensors between the scattered layout and a plain copy on every rank of the domain.

Some of a prediction is O(N) or O(A) and runs serially on every rank of the domain, the
same everywhere: the sampler's coordinates ``[M, A, 3]``, the frames of the confidence
heads. These helpers move such tensors between that plain, replicated form (serial order:
the scatter keeps it unless atoms are padded per shard) and the row blocks of a scattered
feature, and say what each move costs. None of them is for a pair tensor, except
:func:`block_of_whole`, a view of a whole tensor that is already there (a gradient
autograd materialised at the global shape).
"""

from __future__ import annotations

from typing import Any

import torch
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Replicate, Shard

from physicsnemo_foldcp.core.blocks import (
    ROWS,
    ShardingLayoutError,
    block,
    coordinate,
    gather_rows,
    local_of,
    mesh_sizes,
    row_dim,
    row_shapes,
)
from physicsnemo_foldcp.core.tensor import FoldTensor, wrap


class _RowsOfWhole(torch.autograd.Function):
    """Plain replicated -> this rank's row block along ``dim`` (a slice, no communication).

    Backward: the row blocks' gradients gathered over ``cp0`` (every rank then holds the
    whole gradient of the replicated input).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, sizes: tuple[int, ...], mesh: DeviceMesh):
        """The forward pass (see the class docstring)."""
        ctx.dim, ctx.sizes, ctx.mesh = dim, sizes, mesh
        start, length = block(sizes, coordinate(mesh)[0])
        return x.narrow(dim, start, length).clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """The adjoint of :meth:`forward`."""
        whole = gather_rows(grad.contiguous(), ctx.dim, ctx.sizes, ctx.mesh)
        return whole, None, None, None


class _WholeOfRows(torch.autograd.Function):
    """This rank's row block along ``dim`` -> the whole tensor on every rank.

    Forward: ONE all-gather over ``cp0``. Backward: this rank's rows of the gradient.
    """

    @staticmethod
    def forward(ctx, local: torch.Tensor, dim: int, sizes: tuple[int, ...], mesh: DeviceMesh):
        """The forward pass (see the class docstring)."""
        ctx.dim = dim
        ctx.start, ctx.length = block(sizes, coordinate(mesh)[0])
        return gather_rows(local.contiguous(), dim, sizes, mesh)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """The adjoint of :meth:`forward`."""
        return grad.narrow(ctx.dim, ctx.start, ctx.length).contiguous(), None, None, None


def block_of_whole(whole: torch.Tensor, like: ShardTensor) -> torch.Tensor:
    """This rank's block of ``whole``, a plain tensor of ``like``'s global shape.

    A view of ``whole``, cut along each sharded dim by ``like``'s (uneven) block sizes.
    """
    coords = like.device_mesh.get_coordinate()
    for mesh_dim, placement in enumerate(like.placements):
        if placement.is_shard():
            dim = placement.dim
            start, length = block(mesh_sizes(like, mesh_dim, dim), int(coords[mesh_dim]))
            whole = whole.narrow(dim, start, length)
    return whole


def rows_of_whole(x: torch.Tensor, like: ShardTensor, dim: int = 1) -> FoldTensor:
    """A plain tensor, the same on every rank, cut into the row blocks of ``like``.

    Parameters
    ----------
    x : torch.Tensor
        Whole, replicated over the domain; ``x.shape[dim]`` is ``like``'s row length.
    like : ShardTensor
        A scattered single (``[B, N, ...]`` or ``[B, A, ...]``, ``(Shard(d), Replicate())``)
        whose row blocks ``x`` takes.
    dim : int, default 1
        The row dim of ``x``.

    Returns
    -------
    FoldTensor
        ``x`` with dim ``dim`` split over ``cp0`` as ``like``'s rows, replicated over
        ``cp1``. No communication (backward: one all-gather over ``cp0``).
    """
    like_dim = row_dim(like, "rows_of_whole", "like")
    sizes = tuple(mesh_sizes(like, ROWS, like_dim))
    dim = dim % x.ndim
    if x.shape[dim] != sum(sizes):
        raise ShardingLayoutError(
            f"rows_of_whole: {tuple(x.shape)} has {x.shape[dim]} rows along dim {dim}, the "
            f"scattered layout {sum(sizes)}"
        )
    mesh = like.device_mesh
    local = _RowsOfWhole.apply(x, dim, sizes, mesh)
    return wrap(local, mesh, (Shard(dim), Replicate()), row_shapes(local.shape, dim, sizes))


def whole_of_rows(x: ShardTensor) -> torch.Tensor:
    """A row-sharded ``(Shard(d), Replicate())`` tensor as one plain tensor on every rank.

    ONE all-gather over ``cp0`` (differentiable: backward keeps this rank's rows).
    """
    dim = row_dim(x, "whole_of_rows", "x")
    return _WholeOfRows.apply(local_of(x), dim, tuple(mesh_sizes(x, ROWS, dim)), x.device_mesh)


def whole(x: Any) -> Any:
    """Any scattered tensor as one plain tensor on every rank; anything else as it is.

    Row-sharded tensors take :func:`whole_of_rows`; others PhysicsNeMo's ``full_tensor``.
    """
    if not isinstance(x, ShardTensor):
        return x
    if sum(p.is_shard() for p in x.placements) == 1 and x.placements[ROWS].is_shard():
        return whole_of_rows(x)
    return x.full_tensor()


__all__ = ["rows_of_whole", "whole", "whole_of_rows"]
