"""Boltz's ``AttentionPairBias`` (attentionv2) over tokens, on scattered singles and pair tiles.

Run op by op, the module's ``einsum`` of queries and keys makes the logits tile, but its
``softmax`` over keys reads along the column axis that ``cp1`` shards, and the ``einsum``
with the values contracts the key axis, so both gather: a row of logit tiles
(``N_i x N x H``) and the values. The distributed forward here keeps the module's own
projections (``proj_q``, ``proj_k``, ``proj_v``, ``proj_g``, ``proj_z``, ``proj_o``, run on
the local blocks) and replaces the attention core by
:func:`physicsnemo_foldcp.ops.pair_bias_attention`, whose softmax normalises over the
``cp1`` key blocks with a running maximum, so no rank holds more than its own
``N_i x M_j x H`` logits.

Layouts (over ``(cp0, cp1)``): ``s``, ``k_in`` ``[B, N, c_s]`` and ``mask`` ``[B, N]``
are row-sharded ``(Shard(1), Replicate())``; ``z`` ``[B, N, N, c_z]`` is the pair tile
``(Shard(1), Shard(2))``; the output ``[B, N, c_s]`` is row-sharded like ``s``.

Communication per call, forward / backward (none along a mesh dim of size 1):
:func:`~physicsnemo_foldcp.ops.pair_bias_attention`'s (one all-gather over ``cp0`` of the
keys, values and key mask; two all-reduces over ``cp1`` of ``N_i x H`` maxima and of the
``N_i x H x (D + 1)`` sums / one reduce-scatter over ``cp0``, one all-reduce over
``cp1``), plus the all-reduce of each weight's gradient over the mesh dims its input is
sharded on (as for any weight applied to sharded activations). Peak extra memory: the
``N_i x M_j x H`` logits tile and ``N x H x D`` gathered keys and values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from physicsnemo_foldcp.ops import ShardingLayoutError, pair_bias_attention


def attention_pair_bias(
    module: torch.nn.Module,
    s: torch.Tensor,
    z: torch.Tensor,
    mask: torch.Tensor,
    k_in: torch.Tensor,
    multiplicity: int = 1,
    use_flash_attn: bool = False,
) -> torch.Tensor:
    """``AttentionPairBias.forward`` on FoldTensors (see the module docstring).

    Parameters
    ----------
    module : boltz.model.layers.attentionv2.AttentionPairBias
        The Boltz module (its parameters are used as they are).
    s, k_in : torch.Tensor
        ``[B, N, c_s]`` queries' and keys' single, row-sharded.
    z : torch.Tensor
        ``[B, N, N, c_z]`` pair tile (or, with ``compute_pair_bias=False``, the bias
        ``[B, N, N, H]``).
    mask : torch.Tensor
        ``[B, N]`` key mask, row-sharded.
    multiplicity : int, default 1
        Samples ``M`` per batch element of ``z``: ``s`` is ``[B M, N, c_s]``, ``z`` stays
        ``[B, N, N, c]`` and its bias is broadcast over the samples (Boltz repeats it;
        here no tile is copied).
    use_flash_attn : bool, default False
        Must be ``False`` under context parallelism.

    Returns
    -------
    torch.Tensor
        ``[B, N, c_s]``, row-sharded like ``s``.

    Raises
    ------
    ShardingLayoutError
        For ``use_flash_attn=True``.
    """
    if use_flash_attn:
        raise ShardingLayoutError(
            "AttentionPairBias under context parallelism runs Boltz's float32 attention: "
            "use_flash_attn must be False (the SDPA path is not distributed)"
        )
    batch = s.shape[0]
    heads, width = module.num_heads, module.head_dim
    q = module.proj_q(s).view(batch, -1, heads, width)
    k = module.proj_k(k_in).view(batch, -1, heads, width)
    v = module.proj_v(k_in).view(batch, -1, heads, width)
    bias = module.proj_z(z)  # [B / M, H, N, N], the tile, broadcast over the M samples
    g = module.proj_g(s).sigmoid()
    o = pair_bias_attention(
        q.float(), k.float(), v.float(), bias.float().permute(0, 2, 3, 1), mask.float(),
        inf=module.inf,
    ).to(v.dtype)  # fmt: skip
    return module.proj_o(g * o.reshape(batch, -1, module.c_s))


def handlers() -> list[tuple[type, Callable[..., Any]]]:
    """``[(AttentionPairBias, attention_pair_bias)]``."""
    from boltz.model.layers.attentionv2 import AttentionPairBias

    return [(AttentionPairBias, attention_pair_bias)]


__all__ = ["attention_pair_bias", "handlers"]
