"""Pair-biased attention over tokens, with a ShardTensor handler registered at import.

Serial semantics (Boltz's ``AttentionPairBias`` core): for queries, keys and values
``q, k, v [B, N, H, D]``, a pair bias ``bias [B, N, N, H]`` and a key mask ``[B, N]``,

    logits[b, h, i, j] = <q[b, i, h], k[b, j, h]> / sqrt(D) + bias[b, i, j, h]
                         - inf * (1 - key_mask[b, j])
    out[b, i, h] = sum_j softmax_j(logits[b, h, i, :]) v[b, j, h]

Distributed over the 2-D ``(cp0, cp1)`` domain mesh, rank ``(i, j)`` holds query rows
``i`` (``q``, ``k``, ``v``, ``key_mask`` are ``(Shard(1), Replicate())``) and the bias
tile of rows ``i`` and key columns ``j`` (``(Shard(1), Shard(2))``). It computes the logits
of its tile and a numerically stable softmax whose normalisation spans the ``cp1`` key
blocks of its rows, so no rank ever holds more than its ``N_i x M_j`` tile of logits.
"""

from __future__ import annotations

import math

import torch
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Replicate, Shard
from torch.overrides import handle_torch_function, has_torch_function

from physicsnemo_foldcp.core.blocks import (
    COLUMNS,
    ROWS,
    RowsAndColumns,
    ShardingLayoutError,
    SumToReplicate,
    all_reduce,
    block,
    coordinate,
    describe,
    local_of,
    mesh_sizes,
    rank_label,
    require_shard_tensor,
    row_dim,
    row_shapes,
)
from physicsnemo_foldcp.core.compat import global_shape, local_tensor
from physicsnemo_foldcp.core.tensor import register_own, wrap

DEFAULT_INF = 1e6
"""Magnitude of the additive logit penalty on masked keys (Boltz's ``inf``)."""


def _masked_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    bias: torch.Tensor,
    key_mask: torch.Tensor,
    inf: float,
) -> torch.Tensor:
    """``[B, H, n, m]`` logits of queries ``q [B, n, H, D]`` against keys ``k [B, m, H, D]``.

    ``bias`` is ``[B, n, m, H]``, or ``[B / M, n, m, H]`` for ``M`` samples per batch
    element (``q``'s batch ``b M + s`` reads bias ``b``, Boltz's ``repeat_interleave``
    order), added as a broadcast view: no ``M``-fold copy.
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    logits = torch.einsum("bihd,bjhd->bhij", q * scale, k)
    per_bias = logits.shape[0] // bias.shape[0]
    if per_bias == 1:
        logits = logits + bias.permute(0, 3, 1, 2)
    else:
        grouped = logits.view(bias.shape[0], per_bias, *logits.shape[1:])
        logits = (grouped + bias.permute(0, 3, 1, 2)[:, None]).view(logits.shape)
    penalty = (1.0 - key_mask.to(logits.dtype)) * (-inf)
    return logits + penalty[:, None, None, :]


def _bias_batch_fits(batch: int, bias_batch: int) -> bool:
    """Whether a bias of ``bias_batch`` serves queries of ``batch`` (``M`` samples each)."""
    return bias_batch > 0 and batch % bias_batch == 0


def pair_bias_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    inf: float = DEFAULT_INF,
) -> torch.Tensor:
    """Multi-head attention over tokens with an additive pair bias and a key mask.

    Parameters
    ----------
    q, k, v : torch.Tensor
        ``[B, N, H, D]`` queries, keys, values. Distributed: ``(Shard(1), Replicate())``
        over ``(cp0, cp1)``, co-sharded (the token row blocks).
    bias : torch.Tensor
        ``[B, N, N, H]`` pair bias, added to the logits of query ``i`` and key ``j``; or
        ``[B / M, N, N, H]``, one bias for ``M`` consecutive batch elements (diffusion
        samples, Boltz's ``repeat_interleave(M, 0)`` order), broadcast without a copy.
        Distributed: the pair tile ``(Shard(1), Shard(2))`` with the same row blocks as
        ``q``.
    key_mask : torch.Tensor, optional
        ``[B, N]``, 1 for keys to attend to, 0 for masked keys (they get ``-inf`` added
        to their logits). All keys by default. Distributed: ``(Shard(1), Replicate())``,
        co-sharded with ``k``. Never differentiated.
    inf : float, default 1e6
        Penalty added to the logits of masked keys.

    Returns
    -------
    torch.Tensor
        ``[B, N, H, D]``. Distributed: ``(Shard(1), Replicate())`` with ``q``'s row blocks.

    Notes
    -----
    Communication of the distributed handler on rank ``(i, j)`` (none along a mesh dim of
    size 1):

    * forward: ONE all-gather over ``cp0`` of ``k``, ``v`` and ``key_mask`` stacked
      (``O(N x (2 H D + 1))``), of which key column block ``j`` is kept; ONE all-reduce
      (MAX) over ``cp1`` of the detached row maxima of the logits ``[B, H, N_i]``; ONE
      all-reduce (SUM) over ``cp1`` of the local exp-sums and exp-weighted values
      together (``O(N_i x H x (D + 1))``);
    * backward: ONE reduce-scatter over ``cp0`` of the gradients of the gathered ``k`` and
      ``v`` blocks, then ONE all-reduce over ``cp1`` of the ``q``, ``k``, ``v`` gradients
      together. The bias tile's gradient is local.

    Gradient conventions: a ``(Shard, Replicate)`` tensor's gradient is complete on every
    ``cp1`` rank. The forward sum over ``cp1`` therefore has the identity as backward;
    ``q`` (used by every ``cp1`` rank against a different key block) gets the sum over
    ``cp1``; ``k`` and ``v`` (gathered over ``cp0``) get the sum over ``cp1`` and over
    ``cp0``, restricted to the rank's own rows.
    """
    if key_mask is None:
        if has_torch_function((q, k, v, bias)):
            return handle_torch_function(
                pair_bias_attention, (q, k, v, bias), q, k, v, bias, key_mask, inf
            )
    elif has_torch_function((q, k, v, bias, key_mask)):
        return handle_torch_function(
            pair_bias_attention, (q, k, v, bias, key_mask), q, k, v, bias, key_mask, inf
        )
    _check_serial_shapes(q, k, v, bias, key_mask)
    if key_mask is None:
        key_mask = q.new_ones(q.shape[:2])
    logits = _masked_logits(q, k, bias, key_mask, inf)
    weights = torch.softmax(logits, dim=-1)
    return torch.einsum("bhij,bjhd->bihd", weights, v)


def _check_serial_shapes(q, k, v, bias, key_mask) -> None:
    if q.ndim != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            "pair_bias_attention: q, k, v must share one shape [B, N, H, D], got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    b, n, h, _ = q.shape
    if tuple(bias.shape[1:]) != (n, n, h) or not _bias_batch_fits(b, bias.shape[0]):
        raise ValueError(
            f"pair_bias_attention: bias must be [B / M, N, N, H] with (B, N, H) = "
            f"{(b, n, h)}, got {tuple(bias.shape)}"
        )
    if key_mask is not None and tuple(key_mask.shape) != (b, n):
        raise ValueError(
            f"pair_bias_attention: key_mask must be [B, N] = {(b, n)}, got {tuple(key_mask.shape)}"
        )


def _row_max(logits: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Detached row maxima ``[B, H, n, 1]`` over all key blocks: ONE all-reduce MAX over cp1."""
    with torch.no_grad():
        if logits.shape[-1] == 0:
            local = logits.new_full(logits.shape[:-1] + (1,), -torch.inf)
        else:
            local = logits.amax(dim=-1, keepdim=True)
        return all_reduce(local, mesh, COLUMNS, "max")


def _require_rows(x: object, op: str, arg: str) -> ShardTensor:
    x = require_shard_tensor(x, op, arg)
    row_dim(x, op, arg, expected=1)
    return x


def _attention_handler(func, types, args, kwargs):
    q, k, v, bias, key_mask, inf = args
    op = "pair_bias_attention"
    q = _require_rows(q, op, "q")
    k = _require_rows(k, op, "k")
    v = _require_rows(v, op, "v")
    bias = require_shard_tensor(bias, op, "bias")
    mesh = q.device_mesh
    where = rank_label(mesh)
    for name, t in (("k", k), ("v", v), ("bias", bias)):
        if t.device_mesh != mesh:
            raise ShardingLayoutError(f"{op}: q and {name} live on different meshes [{where}]")
    q_shape = global_shape(q)
    if len(q_shape) != 4 or global_shape(k) != q_shape or global_shape(v) != q_shape:
        raise ShardingLayoutError(
            f"{op}: q, k, v must share one global shape [B, N, H, D], got {describe(q)}, "
            f"{describe(k)}, {describe(v)} [{where}]"
        )
    b, n, h, d = q_shape
    if tuple(bias.placements) != (Shard(1), Shard(2)):
        raise ShardingLayoutError(
            f"{op}: bias must be the pair tile (Shard(1), Shard(2)) over (cp0, cp1), got "
            f"{describe(bias)} [{where}]"
        )
    bias_shape = global_shape(bias)
    if tuple(bias_shape[1:]) != (n, n, h) or not _bias_batch_fits(b, bias_shape[0]):
        raise ShardingLayoutError(
            f"{op}: bias must be [B / M, N, N, H] with (B, N, H) = {(b, n, h)}, got "
            f"{describe(bias)} [{where}]"
        )
    row_sizes = mesh_sizes(q, ROWS, 1)
    for name, t in (("k", k), ("v", v)):
        if mesh_sizes(t, ROWS, 1) != row_sizes:
            raise ShardingLayoutError(
                f"{op}: {name} is not co-sharded with q: cp0 row blocks "
                f"{mesh_sizes(t, ROWS, 1)} vs {row_sizes} [{where}]"
            )
    if mesh_sizes(bias, ROWS, 1) != row_sizes:
        raise ShardingLayoutError(
            f"{op}: the bias tile's row blocks {mesh_sizes(bias, ROWS, 1)} differ from q's "
            f"{row_sizes} [{where}]"
        )
    col_sizes = mesh_sizes(bias, COLUMNS, 2)
    if sum(col_sizes) != n:
        raise ShardingLayoutError(
            f"{op}: the bias tile's cp1 column blocks {col_sizes} do not cover N = {n} [{where}]"
        )
    if key_mask is not None:
        key_mask = _require_rows(key_mask, op, "key_mask")
        if global_shape(key_mask) != (b, n) or mesh_sizes(key_mask, ROWS, 1) != row_sizes:
            raise ShardingLayoutError(
                f"{op}: key_mask must be [B, N] = {(b, n)} co-sharded with k, got "
                f"{describe(key_mask)} [{where}]"
            )

    _, j = coordinate(mesh)
    q_local, k_local, v_local = local_of(q), local_of(k), local_of(v)
    n_i = q_local.shape[1]
    if key_mask is None:
        mask_local = q_local.new_ones(b, n_i)
    else:
        mask_local = local_tensor(key_mask).detach().to(q_local.dtype)
    keys = torch.cat(
        [
            k_local.reshape(b, n_i, h * d),
            v_local.reshape(b, n_i, h * d),
            mask_local.reshape(b, n_i, 1),
        ],
        dim=-1,
    )
    col_start, col_len = block(col_sizes, j)
    rows, columns = RowsAndColumns.apply(
        q_local.reshape(b, n_i, h * d), keys, mesh, tuple(row_sizes), (col_start, col_len)
    )
    q_rows = rows.reshape(b, n_i, h, d)
    k_cols = columns[..., : h * d].reshape(b, col_len, h, d)
    v_cols = columns[..., h * d : 2 * h * d].reshape(b, col_len, h, d)
    mask_cols = columns[..., -1].detach()

    logits = _masked_logits(q_rows, k_cols, local_of(bias), mask_cols, inf)
    weights = torch.exp(logits - _row_max(logits, mesh))
    exp_sum = weights.sum(dim=-1).permute(0, 2, 1)
    weighted = torch.einsum("bhij,bjhd->bihd", weights, v_cols)
    both = torch.cat([exp_sum.reshape(-1), weighted.reshape(-1)])
    both = SumToReplicate.apply(both, mesh, (COLUMNS,))
    exp_sum = both[: exp_sum.numel()].view(exp_sum.shape)
    weighted = both[exp_sum.numel() :].view(weighted.shape)
    out_local = weighted / exp_sum[..., None]
    return wrap(out_local, mesh, (Shard(1), Replicate()), row_shapes(out_local.shape, 1, row_sizes))


register_own(pair_bias_attention, _attention_handler)

__all__ = ["DEFAULT_INF", "pair_bias_attention"]
