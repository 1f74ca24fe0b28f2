"""Three fixes to ShardTensor's generic paths for uneven shards (the plan's blocks).

**Spec resolution of the DTensor fallback.** An op without a ShardTensor handler runs
through PhysicsNeMo's fallback: the operands are converted to DTensors, the op runs, and
each result is converted back. The spec of a
result is copied from an operand only when the two have the same global shape, stride,
dtype and placements; otherwise it is inferred from ``torch.chunk`` of the global shape.
With uneven shards (the plan's token and atom blocks) the chunk guess is wrong, so common
model steps such as ``torch.cat([...], dim=-1)``, ``x.sum(-1)``, ``x.mean(-1)`` or
``x[..., :k]`` either raise
``ValueError: Rank r expected local shape ... does not match`` or silently carry wrong
sharding shapes.

:func:`install` wraps the fallback's spec resolution: when an operand ShardTensor on the
same mesh has the same placements and the same global length along every sharded tensor
dim, the result's sharding shapes are taken from that operand's (the sharded dims), with
the result's own lengths on every other dim. Anything else keeps PhysicsNeMo's behaviour.
No communication is added.

**Flatten and unflatten of unsharded trailing dims.** ``x.flatten(-2)`` and
``x.unflatten(-1, (H, D))`` reach PhysicsNeMo's ``aten.view`` handler with explicit global
sizes, from which it derives ``torch.chunk`` local lengths. :func:`install` registers
handlers for ``torch.flatten`` / ``Tensor.flatten`` and ``torch.unflatten`` /
``Tensor.unflatten`` that, when every sharded dim lies before the dims they touch, apply the
op to the local block and keep the blocks (differentiable, no communication). Flattening
a sharded dim still goes to PhysicsNeMo, which refuses it.

**Module backward hooks.** A module with full backward hooks (``CommDebugMode`` installs
global ones) passes its outputs through ``BackwardHookFunction``; through the fallback that
identity ends in ``Tensor.view_as(x, x)``, which the fallback runs as a DTensor view with
even-chunk local shapes, failing on uneven shards. :func:`install` registers a
``view_as`` handler that, for equal shapes, goes straight to PhysicsNeMo's ``aten.view``
dispatch handler (uneven-aware); other calls keep their previous path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from physicsnemo.domain_parallel import ShardTensor
from physicsnemo.domain_parallel import shard_tensor as _shard_tensor_module
from physicsnemo.domain_parallel._shard_tensor_spec import (
    _infer_shard_tensor_spec_from_local_chunks,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard

from physicsnemo_foldcp.ops._blocks import local_of, wrap

_ORIGINAL: Callable | None = None
_PREVIOUS_VIEW_AS: Callable | None = None
_FLATTEN = (torch.flatten, torch.Tensor.flatten)
_UNFLATTEN = (torch.unflatten, torch.Tensor.unflatten)
_PREVIOUS_RESHAPES: dict[Callable, Callable] = {}


def _sharded_dims(placements: Sequence) -> set[int]:
    return {p.dim for p in placements if isinstance(p, Shard)}


def sharding_shapes_like(
    reference: ShardTensor, global_shape: Sequence[int], placements: Sequence
) -> dict[int, list[tuple[int, ...]]] | None:
    """Sharding shapes of a result that is sharded like ``reference``, or ``None``.

    Parameters
    ----------
    reference : ShardTensor
        An operand of the op.
    global_shape : Sequence[int]
        Global shape of the result.
    placements : Sequence
        Placements of the result.

    Returns
    -------
    dict[int, list[tuple[int, ...]]] or None
        ``{mesh_dim: [shape of rank k along mesh_dim]}``, with ``reference``'s lengths on
        the sharded tensor dims and ``global_shape``'s elsewhere; ``None`` when the
        placements differ, a sharded dim is missing from either tensor, its global length
        differs, or ``reference`` carries no sharding shapes.
    """
    if tuple(reference.placements) != tuple(placements):
        return None
    shapes = reference._spec._sharding_shapes
    if not shapes:
        return None
    ref_shape = tuple(reference._spec.tensor_meta.shape)
    dims = _sharded_dims(placements)
    if any(d >= len(global_shape) or d >= len(ref_shape) for d in dims):
        return None
    if any(int(global_shape[d]) != int(ref_shape[d]) for d in dims):
        return None
    out: dict[int, list[tuple[int, ...]]] = {}
    for mesh_dim, per_rank in shapes.items():
        out[mesh_dim] = [
            tuple(
                int(shape[d]) if d in dims else int(global_shape[d])
                for d in range(len(global_shape))
            )
            for shape in per_rank
        ]
    return out


def _local_matches(dtensor: DTensor, shapes: dict[int, list[tuple[int, ...]]]) -> bool:
    coordinate = dtensor._spec.mesh.get_coordinate()
    if coordinate is None:
        return False
    local = tuple(dtensor._local_tensor.shape)
    return all(tuple(per_rank[coordinate[m]]) == local for m, per_rank in shapes.items())


def _shard_tensors(values: object) -> list[ShardTensor]:
    """ShardTensors among ``values``, looking into (nested) lists, tuples and dicts."""
    if isinstance(values, ShardTensor):
        return [values]
    if isinstance(values, dict):
        values = list(values.values())
    if isinstance(values, (list, tuple)):
        return [t for v in values for t in _shard_tensors(v)]
    return []


def _resolve_spec(dtensor: DTensor, input_args: tuple = ()):
    for arg in input_args:
        if (
            isinstance(arg, ShardTensor)
            and dtensor._spec.tensor_meta == arg._spec.tensor_meta
            and dtensor._spec.placements == arg._spec.placements
        ):
            return arg._spec
    if _sharded_dims(dtensor._spec.placements):
        for arg in _shard_tensors(input_args):
            if arg._spec.mesh != dtensor._spec.mesh:
                continue
            shapes = sharding_shapes_like(arg, dtensor.shape, dtensor._spec.placements)
            if shapes is None or not _local_matches(dtensor, shapes):
                continue
            spec = _infer_shard_tensor_spec_from_local_chunks(
                dtensor._local_tensor,
                dtensor._spec.mesh,
                dtensor._spec.placements,
                sharding_shapes=shapes,
            )
            return dataclasses.replace(spec, tensor_meta=dtensor._spec.tensor_meta)
    assert _ORIGINAL is not None
    return _ORIGINAL(dtensor, input_args)


def _view_as_handler(func, types, args, kwargs):
    self, other = (list(args) + list((kwargs or {}).values()))[:2]
    if (
        isinstance(self, ShardTensor)
        and isinstance(other, torch.Tensor)
        and tuple(self.shape) == tuple(other.shape)
    ):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))
    assert _PREVIOUS_VIEW_AS is not None
    return _PREVIOUS_VIEW_AS(func, types, args, kwargs)


def _first_touched_dim(func, args: tuple, kwargs: dict, ndim: int) -> int | None:
    if func in _FLATTEN:
        start = args[1] if len(args) > 1 else kwargs.get("start_dim", 0)
    else:
        start = args[1] if len(args) > 1 else kwargs.get("dim")
    if not isinstance(start, int):
        return None
    return start + ndim if start < 0 else start


def _trailing_reshape_handler(func, types, args, kwargs):
    kwargs = kwargs or {}
    x = args[0] if args else kwargs.get("input")
    previous = _PREVIOUS_RESHAPES.get(func, _fallback)
    if type(x) is not ShardTensor or any(p.is_partial() for p in x.placements):
        return previous(func, types, args, kwargs)
    first = _first_touched_dim(func, args, kwargs, x.dim())
    sharded = _sharded_dims(x.placements)
    shapes = x._spec._sharding_shapes
    if first is None or not shapes or any(d >= first for d in sharded):
        return previous(func, types, args, kwargs)
    local = local_of(x)
    new = func(local, *args[1:], **kwargs)
    new_shapes = {
        mesh_dim: [(*tuple(shape)[:first], *new.shape[first:]) for shape in per_rank]
        for mesh_dim, per_rank in shapes.items()
    }
    return wrap(new, x.device_mesh, x.placements, new_shapes)


def _fallback(func, types, args, kwargs):
    return _shard_tensor_module._torch_function_fallback_via_dtensor(func, args, kwargs)


def install() -> None:
    """Install the three fixes (idempotent; they affect every ShardTensor of the process)."""
    global _ORIGINAL, _PREVIOUS_VIEW_AS
    registry = ShardTensor._function_registry
    for func in (*_FLATTEN, *_UNFLATTEN):
        if registry.get(func) is not _trailing_reshape_handler:
            _PREVIOUS_RESHAPES[func] = registry.get(func, _fallback)
            ShardTensor.register_function_handler(func, _trailing_reshape_handler)
    if registry.get(torch.Tensor.view_as) is not _view_as_handler:
        _PREVIOUS_VIEW_AS = registry.get(torch.Tensor.view_as, _fallback)
        ShardTensor.register_function_handler(torch.Tensor.view_as, _view_as_handler)
    current = _shard_tensor_module._resolve_spec_for_dtensor
    if current is _resolve_spec:
        return
    _ORIGINAL = current
    _shard_tensor_module._resolve_spec_for_dtensor = _resolve_spec


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    return _shard_tensor_module._resolve_spec_for_dtensor is _resolve_spec


__all__ = ["install", "installed", "sharding_shapes_like"]
