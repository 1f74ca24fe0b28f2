"""Dtype casts and other same-shape local ops that keep a ShardTensor's uneven blocks.

PhysicsNeMo 2.2 runs ``x.float()``, ``x.to(dtype)``, ``x.bool()``... through its DTensor
fallback, which reuses the input's sharding only when the result has the same dtype; for a
cast it infers ``torch.chunk``-style blocks instead, and any uneven ShardTensor whose blocks
differ from those (atoms following their tokens, per-shard padding, ``tensor_split`` rows)
fails with a local-shape mismatch. These handlers compute the op on the local block and
keep the input's placements and sharding shapes.

Communication: none in forward or backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from physicsnemo.domain_parallel import ShardTensor

from physicsnemo_foldcp.ops._blocks import local_of, wrap
from physicsnemo_foldcp.ops._dispatch import register_chained

SAME_BLOCK_FUNCS: tuple[Callable, ...] = tuple(
    getattr(torch.Tensor, name)
    for name in (
        "float", "double", "half", "bfloat16", "long", "int", "short", "bool", "to", "type_as",
    )
)  # fmt: skip
"""Tensor methods handled here (local, same shape, same blocks)."""


def _same_blocks(func, types, args, kwargs):
    x = args[0] if args else None
    if type(x) is not ShardTensor or any(p.is_partial() for p in x.placements):
        return NotImplemented
    others = list(args[1:]) + list(kwargs.values())
    if func is torch.Tensor.type_as:
        if len(others) != 1 or not isinstance(others[0], torch.Tensor):
            return NotImplemented
        return _same_blocks(torch.Tensor.to, types, (x, others[0].dtype), {})
    if any(isinstance(v, torch.Tensor) for v in others):
        return NotImplemented
    local = local_of(x)
    new = func(local, *args[1:], **kwargs)
    if not isinstance(new, torch.Tensor) or new.shape != local.shape:
        return NotImplemented
    return wrap(new, x.device_mesh, x.placements, dict(x._spec._sharding_shapes))


register_chained(SAME_BLOCK_FUNCS, _same_blocks, "foldcp.same_blocks")
