"""Pair masks from token masks, and masked global reductions whose value is the serial one.

* :func:`pair_mask` is a single -> pair op (the communication of
  :mod:`~physicsnemo_foldcp.ops.single_pair`: one all-gather over ``cp0`` forward).
* :func:`masked_mean` reduces a co-sharded quantity and its mask over any dims. The result
  is never ``Partial``: the handler sums the local numerator and denominator, then ONE
  ``all_reduce`` per mesh dim that shards a reduced axis (both sums in one buffer), so
  ``.item()`` / ``float()`` / ``.to_local()`` on every rank read the serial value. Backward
  needs no communication (every rank holds the one global value and its gradient). Pad
  positions contribute nothing as long as the mask is 0 there (the scattered masks are).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor.placement_types import Replicate, Shard
from torch.overrides import handle_torch_function, has_torch_function

from physicsnemo_foldcp.core.blocks import (
    ShardingLayoutError,
    SumToReplicate,
    describe,
    local_of,
    mesh_sizes,
    rank_label,
    require_shard_tensor,
)
from physicsnemo_foldcp.core.compat import global_shape, sharding_shapes
from physicsnemo_foldcp.core.tensor import register_own, wrap
from physicsnemo_foldcp.ops.single_pair import pair_from_singles

DEFAULT_EPS = 1e-6
"""Added to the mask total of :func:`masked_mean`."""


def _pair_mask_local(rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    return rows[:, :, None] * columns[:, None, :]


def pair_mask(token_mask: torch.Tensor) -> torch.Tensor:
    """Pair mask from a token mask: ``m[:, :, None] * m[:, None, :]``.

    Parameters
    ----------
    token_mask : torch.Tensor
        ``[B, N]`` (float or bool). Distributed: ``(Shard(1), Replicate())``.

    Returns
    -------
    torch.Tensor
        ``[B, N, N]``, same dtype. Distributed: the pair tile ``(Shard(1), Shard(2))``.

    Notes
    -----
    Communication: forward, ONE all-gather over ``cp0`` of the ``[B, N_i]`` mask rows;
    backward (a mask rarely needs one), one reduce-scatter over ``cp0`` and one all-reduce
    over ``cp1``.
    """
    if has_torch_function((token_mask,)):
        return handle_torch_function(pair_mask, (token_mask,), token_mask)
    return _pair_mask_local(token_mask, token_mask)


def _pair_mask_handler(func, types, args, kwargs):
    (token_mask,) = args
    return pair_from_singles(token_mask, token_mask, _pair_mask_local, "pair_mask", "token_mask")


def _reduced_dims(dim: int | Sequence[int] | None, ndim: int) -> tuple[int, ...]:
    if dim is None:
        return tuple(range(ndim))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    if not dims:
        raise ValueError("masked_mean: dim must name at least one axis (or be None for all)")
    out = tuple(sorted({int(d) % ndim for d in dims}))
    if len(out) != len(dims):
        raise ValueError(f"masked_mean: dim {dim} repeats an axis")
    return out


def masked_mean(
    x: torch.Tensor,
    mask: torch.Tensor,
    dim: int | Sequence[int] | None = None,
    keepdim: bool = False,
    eps: float = DEFAULT_EPS,
) -> torch.Tensor:
    """Masked mean: ``(x * mask).sum(dim) / (broadcast_to(mask, x.shape).sum(dim) + eps)``.

    Parameters
    ----------
    x : torch.Tensor
        Any pair or single quantity (e.g. ``[B, N, N]`` or ``[B, N, C]``).
    mask : torch.Tensor
        Broadcastable to ``x`` (same trailing alignment); cast to ``x.dtype``.
        Distributed: co-sharded with ``x`` (the same placements and blocks along every
        axis it does not broadcast).
    dim : int or sequence of int, optional
        Axes to reduce; all axes when ``None``.
    keepdim : bool, default False
        Keep the reduced axes with length 1.
    eps : float, default 1e-6
        Added to the denominator.

    Returns
    -------
    torch.Tensor
        The masked mean. Distributed: a ShardTensor that is ``Replicate`` along every mesh
        dim that sharded a reduced axis (and keeps the other shardings), so its local value
        is the serial value on every rank; never ``Partial``.

    Notes
    -----
    Communication: forward, ONE all-reduce (numerator and denominator together) per mesh
    dim that shards a reduced axis; backward, none.
    """
    if has_torch_function((x, mask)):
        return handle_torch_function(masked_mean, (x, mask), x, mask, dim, keepdim, eps)
    dims = _reduced_dims(dim, x.ndim)
    m = mask.to(x.dtype)
    numerator = (x * m).sum(dim=dims, keepdim=keepdim)
    denominator = torch.broadcast_to(m, x.shape).sum(dim=dims, keepdim=keepdim)
    return numerator / (denominator + eps)


def _check_co_sharded(x: ShardTensor, mask: ShardTensor, op: str) -> None:
    x_shape, m_shape = global_shape(x), global_shape(mask)
    lead = len(x_shape) - len(m_shape)
    if lead < 0:
        raise ShardingLayoutError(
            f"{op}: mask has more dims than x: {describe(mask)} vs {describe(x)}"
        )
    for d, size in enumerate(m_shape):
        if size not in (1, x_shape[d + lead]):
            raise ShardingLayoutError(
                f"{op}: mask {tuple(m_shape)} does not broadcast to x {tuple(x_shape)}"
            )
    for mesh_dim, (px, pm) in enumerate(zip(x.placements, mask.placements)):
        if px.is_partial() or pm.is_partial():
            raise ShardingLayoutError(
                f"{op}: Partial operand (reduce it first): x {describe(x)}, mask {describe(mask)}"
            )
        mesh_name = ("cp0", "cp1")[mesh_dim]
        if isinstance(px, Shard):
            dm = px.dim - lead
            broadcast = dm < 0 or m_shape[dm] == 1
            if broadcast and x_shape[px.dim] == 1 and pm == Shard(dm):
                broadcast = False  # a size-1 axis of both, sharded alike: co-sharded
            if broadcast and not isinstance(pm, Replicate):
                raise ShardingLayoutError(
                    f"{op}: mask broadcasts along x's axis {px.dim}, sharded over {mesh_name}, "
                    f"so it must be Replicate there: {describe(mask)}"
                )
            if not broadcast and (
                pm != Shard(dm) or mesh_sizes(mask, mesh_dim, dm) != mesh_sizes(x, mesh_dim, px.dim)
            ):
                raise ShardingLayoutError(
                    f"{op}: mask is not co-sharded with x over {mesh_name}: x "
                    f"{describe(x)}, mask {describe(mask)} [{rank_label(x.device_mesh)}]"
                )
        elif not isinstance(pm, Replicate):
            raise ShardingLayoutError(
                f"{op}: mask is sharded over {mesh_name} where x is not: x {describe(x)}, "
                f"mask {describe(mask)}"
            )


def _masked_mean_handler(func, types, args, kwargs):
    x, mask, dim, keepdim, eps = args
    op = "masked_mean"
    x = require_shard_tensor(x, op, "x")
    mask = require_shard_tensor(mask, op, "mask")
    if x.device_mesh != mask.device_mesh:
        raise ShardingLayoutError(f"{op}: x and mask live on different meshes")
    _check_co_sharded(x, mask, op)
    ndim = len(global_shape(x))
    dims = _reduced_dims(dim, ndim)
    mesh = x.device_mesh
    x_local = local_of(x)
    m_local = local_of(mask).to(x_local.dtype)
    numerator = (x_local * m_local).sum(dim=dims, keepdim=keepdim)
    denominator = torch.broadcast_to(m_local, x_local.shape).sum(dim=dims, keepdim=keepdim)
    reduce_over = tuple(
        k for k, p in enumerate(x.placements) if isinstance(p, Shard) and p.dim in dims
    )
    both = torch.cat([numerator.reshape(-1), denominator.reshape(-1)])
    both = SumToReplicate.apply(both, mesh, reduce_over)
    numerator = both[: numerator.numel()].view(numerator.shape)
    denominator = both[numerator.numel() :].view(denominator.shape)
    out_local = numerator / (denominator + eps)

    def out_dim(d: int) -> int:
        return d if keepdim else d - sum(1 for r in dims if r < d)

    def out_shape(shape: Sequence[int]) -> tuple[int, ...]:
        if keepdim:
            return tuple(1 if d in dims else s for d, s in enumerate(shape))
        return tuple(s for d, s in enumerate(shape) if d not in dims)

    placements, shapes = [], {}
    for k, p in enumerate(x.placements):
        if isinstance(p, Shard) and p.dim not in dims:
            placements.append(Shard(out_dim(p.dim)))
            shapes[k] = [out_shape(s) for s in sharding_shapes(x)[k]]
        else:
            placements.append(Replicate())
    return wrap(out_local, mesh, placements, shapes)


register_own(pair_mask, _pair_mask_handler)
register_own(masked_mean, _masked_mean_handler)

__all__ = ["DEFAULT_EPS", "masked_mean", "pair_mask"]
