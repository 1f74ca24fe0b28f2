"""Boltz's triangle attention (starting and ending node) on pair tiles, without N^3 scores.

Boltz's ``TriangleAttention`` (``TriangleAttentionStartingNode``; the ending node is the
subclass with ``starting=False``) computes, for every row ``r`` of the pair ``x [B, N, N, C]``
and every head ``h``, attention of the row's entries over the same row::

    xn = layer_norm(x)
    logits[r, h, q, k] = <Wq xn[r, q], Wk xn[r, k]>_h / sqrt(c)
                         + inf * (mask[r, k] - 1) + (W_b xn)[q, k, h]
    o[r, q, h] = sum_k softmax_k(logits[r, h, q, :]) (Wv xn[r, k])_h
    out[r, q] = Wo (sigmoid(Wg xn[r, q]) * o[r, q])

The triangle bias ``W_b xn`` is indexed by ``(q, k)``: the same pair-shaped bias for every
row. The ending node is the same on ``x.transpose(-2, -3)`` and ``mask.transpose(-1, -2)``,
its output transposed back.

Why the op-by-op path fails
---------------------------
On a pair tile ``(Shard(1), Shard(2))`` rank ``(i, j)`` holds rows ``R_i`` and columns
``C_j``. Run op by op, the module's ``q @ k^T`` contracts the channel axis of two operands
that both shard the column axis and keep it on different result axes: the rule table would
all-gather the keys' full pair rows over ``cp1`` and produce ``[n_i, H, N, N]`` scores (the
``N x N x N`` score tensor split only over ``cp0``); the bias, whose rows are the *queries*
``q``, has to be read in the transposed layout; ``softmax`` over the key axis reads along a
sharded axis; and Boltz's eval-mode ``chunk_layer`` slices the flattened ``(B, rows)`` axis,
a sharded axis. Each would gather, so the module has this handler instead.

The algorithm, its collectives and its memory are those of the kernel,
:mod:`physicsnemo_foldcp.kernels.triangle_attention`.
"""

from __future__ import annotations

import math

import torch
from physicsnemo.domain_parallel import ShardTensor
from torch import nn
from torch.distributed.tensor.placement_types import Shard

from physicsnemo_foldcp.core import compat
from physicsnemo_foldcp.core.blocks import (
    COLUMNS,
    ROWS,
    ShardingLayoutError,
    coordinate,
    describe,
    local_of,
    mesh_sizes,
    rank_label,
    require_shard_tensor,
    tile_shapes,
)
from physicsnemo_foldcp.core.tensor import wrap
from physicsnemo_foldcp.kernels.triangle_attention import (
    Layout,
    QueryStrip,
    Stream,
    StreamedAttention,
)
from physicsnemo_foldcp.ops.modules import submodule_caller, tile_parameters


def _require_tile(t: object, op: str, arg: str, ndim: int) -> ShardTensor:
    t = require_shard_tensor(t, op, arg)
    if tuple(t.placements) != (Shard(1), Shard(2)) or len(compat.global_shape(t)) != ndim:
        raise ShardingLayoutError(
            f"{op}: {arg} must be a {ndim}-D pair tile (Shard(1), Shard(2)) over (cp0, cp1), "
            f"got {describe(t)} [{rank_label(t.device_mesh)}]"
        )
    return t


def triangle_attention(
    module: nn.Module,
    x: torch.Tensor,
    mask: torch.Tensor | None = None,
    chunk_size: int | None = None,
    use_kernels: bool = False,
    use_flash_attn: bool = False,
) -> ShardTensor:
    """Boltz's ``TriangleAttention.forward`` on pair tiles (starting or ending node).

    Parameters
    ----------
    module : TriangleAttention
        Boltz's module (``module.starting`` selects the node); its parameters are used as
        they are.
    x : ShardTensor
        ``[B, N, N, C_in]``, the pair tile ``(Shard(1), Shard(2))`` over ``(cp0, cp1)``.
    mask : ShardTensor, optional
        ``[B, N, N]``, co-sharded with ``x``; all ones by default. Not differentiated.
    chunk_size : int, optional
        Boltz's eval-mode row chunking: accepted and not used (the streaming bounds memory).
    use_kernels, use_flash_attn : bool
        Must be ``False``: the cuequivariance and SDPA paths are not supported under
        context parallelism.

    Returns
    -------
    ShardTensor
        ``[B, N, N, C_in]``, a pair tile with the blocks of ``x``.

    Raises
    ------
    ValueError
        For ``use_kernels`` or ``use_flash_attn``.
    ShardingLayoutError
        When ``x`` or ``mask`` is not a pair tile of the expected shape and blocks.

    Notes
    -----
    Collectives, bytes and memory: see the module docstring.
    """
    op = f"{type(module).__name__} (context parallel)"
    if use_kernels or use_flash_attn:
        raise ValueError(
            f"{op}: use_kernels={use_kernels}, use_flash_attn={use_flash_attn}: the "
            "cuequivariance and SDPA paths are not supported under context parallelism yet; "
            "call the module with use_kernels=False and use_flash_attn=False"
        )
    x = _require_tile(x, op, "x", 4)
    mesh = x.device_mesh
    where = rank_label(mesh)
    b, n_tokens, n_columns, c_in = compat.global_shape(x)
    row_sizes, col_sizes = mesh_sizes(x, ROWS, 1), mesh_sizes(x, COLUMNS, 2)
    if n_tokens != n_columns or sum(row_sizes) != n_tokens or sum(col_sizes) != n_tokens:
        raise ShardingLayoutError(
            f"{op}: x must be a square pair [B, N, N, C] cut into row blocks {row_sizes} and "
            f"column blocks {col_sizes}, got {describe(x)} [{where}]"
        )
    if c_in != module.c_in:
        raise ShardingLayoutError(
            f"{op}: x has {c_in} channels, the module expects c_in = {module.c_in} [{where}]"
        )
    x_local = local_of(x)
    if mask is None:
        mask_local = x_local.new_ones(x_local.shape[:-1])
    else:
        mask = _require_tile(mask, op, "mask", 3)
        if (
            mask.device_mesh != mesh
            or compat.global_shape(mask) != (b, n_tokens, n_tokens)
            or mesh_sizes(mask, ROWS, 1) != row_sizes
            or mesh_sizes(mask, COLUMNS, 2) != col_sizes
        ):
            raise ShardingLayoutError(
                f"{op}: mask must be [B, N, N] = {(b, n_tokens, n_tokens)} co-sharded with x "
                f"(blocks {row_sizes} x {col_sizes}), got {describe(mask)} [{where}]"
            )
        mask_local = compat.local_tensor(mask).detach()

    i, j = coordinate(mesh)
    if module.starting:
        layout = Layout(mesh, ROWS, COLUMNS, tuple(row_sizes), tuple(col_sizes), i, j)
        tile, key_mask = x_local, mask_local
    else:
        layout = Layout(mesh, COLUMNS, ROWS, tuple(col_sizes), tuple(row_sizes), j, i)
        tile, key_mask = x_local.transpose(1, 2), mask_local.transpose(1, 2)

    mha = module.mha
    heads, hidden = mha.no_heads, mha.c_hidden
    call = submodule_caller(module, tile_parameters(module, mesh))
    _, n, m, _ = tile.shape

    normed = call("layer_norm", tile)
    strip = QueryStrip.apply(call("linear", normed), layout)
    q = call("mha.linear_q", normed).view(b, n, m, heads, hidden).transpose(2, 3)
    q = q.contiguous() / math.sqrt(hidden)  # head-major once: every key chunk reads it
    k = call("mha.linear_k", normed)
    v = call("mha.linear_v", normed)
    score_bytes_per_key = b * n * heads * m * q.element_size()
    key_column_bytes = b * n * heads * (2 * hidden + 1) * k.element_size()
    stream = Stream.of(layout, score_bytes_per_key, module.inf, key_column_bytes)
    o = StreamedAttention.apply(
        q, k, v, key_mask.to(k.dtype).contiguous(), strip, stream
    ).transpose(2, 3)
    if mha.linear_g is not None:
        gate = mha.sigmoid(call("mha.linear_g", normed))
        o = o * gate.view(b, n, m, heads, hidden)
    out = call("mha.linear_o", o.reshape(b, n, m, heads * hidden))
    if not module.starting:
        out = out.transpose(1, 2)
    out = out.contiguous()
    shapes = tile_shapes(out.shape, 1, row_sizes, col_sizes, (i, j))
    return wrap(out, mesh, (Shard(1), Shard(2)), shapes)


def handlers() -> list[tuple[type[nn.Module], object]]:
    """``[(TriangleAttention, triangle_attention)]`` (the ending node subclasses it)."""
    from boltz.model.layers.triangular_attention.attention import TriangleAttention

    return [(TriangleAttention, triangle_attention)]


__all__ = [
    "Layout",
    "QueryStrip",
    "Stream",
    "StreamedAttention",
    "handlers",
    "triangle_attention",
]
