"""``FoldTensor``: the ShardTensors this plugin makes, and the only entry to its dispatch.

Every ShardTensor the plugin creates (the scatter's features, every op result computed
from one) is a :class:`FoldTensor`: a complete, truthful ShardTensor (same data, same
placements, same uneven sharding shapes) whose ``__torch_function__`` sends each call
through :func:`physicsnemo_foldcp.ops.dispatch.dispatch`. A ShardTensor the plugin did
not make keeps PhysicsNeMo's dispatch untouched; it joins the plugin's only when a
FoldTensor is an operand of the same call (torch picks the subclass's
``__torch_function__``).

A FoldTensor may carry a ``foldcp_tag`` saying more than placements can: a
:class:`~physicsnemo_foldcp.ops.tags.MapTag` on a scattered atom<->token map, a
:class:`~physicsnemo_foldcp.ops.tags.ViewTag` on a broadcast view of a single.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement

from physicsnemo_foldcp.ops import compat
from physicsnemo_foldcp.ops.tags import MapTag, ViewTag

SHARDING_SHAPES = dict[int, list[tuple[int, ...]]]


class FoldTensor(ShardTensor):
    """A ShardTensor made by this plugin; its torch functions go through the plugin's dispatch.

    Attributes
    ----------
    foldcp_tag : MapTag, ViewTag or None
        What the plugin knows about the tensor beyond its placements.
    """

    foldcp_tag: MapTag | ViewTag | None = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        from physicsnemo_foldcp.ops.dispatch import dispatch

        return dispatch(func, types, args, kwargs or {})

    @classmethod
    def upstream_torch_function(cls, func, types, args=(), kwargs=None):
        """PhysicsNeMo's ``ShardTensor.__torch_function__``, as it is at call time."""
        return super().__torch_function__(func, types, args, kwargs)


def fold(x: ShardTensor, tag: MapTag | ViewTag | None = None) -> FoldTensor:
    """Make ``x`` (a ShardTensor the plugin just created) a :class:`FoldTensor`, in place.

    Parameters
    ----------
    x : ShardTensor
        A new ShardTensor that nobody else holds yet (an op result, a scattered feature).
    tag : MapTag or ViewTag, optional
        Set as ``foldcp_tag``; ``None`` keeps the tag ``x`` already has.
    """
    if type(x) is not FoldTensor:
        x.__class__ = FoldTensor
    if tag is not None:
        x.foldcp_tag = tag
    return x


def wrap(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    shapes: SHARDING_SHAPES,
    tag: MapTag | ViewTag | None = None,
) -> FoldTensor:
    """``ShardTensor.from_local`` with explicit sharding shapes, as a FoldTensor.

    Differentiable (the gradient of the result reaches ``local``); no communication.

    Parameters
    ----------
    local : torch.Tensor
        This rank's block.
    mesh : DeviceMesh
        The 2-D ``(cp0, cp1)`` domain mesh.
    placements : sequence of Placement
        One per mesh dim.
    shapes : dict[int, list[tuple[int, ...]]]
        ``{mesh_dim: [local shape of rank r along mesh_dim]}`` for every sharded mesh dim
        (empty when nothing is sharded).
    tag : MapTag or ViewTag, optional
        The result's ``foldcp_tag``.
    """
    out = ShardTensor.from_local(local, mesh, tuple(placements), sharding_shapes=shapes)
    return fold(out, tag)


def adopt(x: ShardTensor) -> FoldTensor:
    """A FoldTensor over the same block and layout as a ShardTensor made elsewhere.

    ``x`` itself is not changed; the result shares its local block and passes gradients
    to it. Use it to bring a ShardTensor built with ``ShardTensor.from_local`` (explicit
    sharding shapes) under the plugin's dispatch.

    Raises
    ------
    ValueError
        If ``x`` carries no sharding shapes (build it with explicit ``sharding_shapes``).
    """
    if isinstance(x, FoldTensor):
        return x
    shapes = compat.sharding_shapes(x)
    if shapes is None:
        raise ValueError(
            "adopt: the ShardTensor carries no sharding shapes; build it with "
            "ShardTensor.from_local(..., sharding_shapes={mesh_dim: [shape per rank]})"
        )
    local = x.to_local() if torch.is_grad_enabled() and x.requires_grad else compat.local_tensor(x)
    return wrap(local, x.device_mesh, x.placements, {m: list(s) for m, s in shapes.items()})


def tag_of(x: Any) -> MapTag | ViewTag | None:
    """The ``foldcp_tag`` of ``x``, or ``None``."""
    return x.foldcp_tag if isinstance(x, FoldTensor) else None


def map_tag(x: Any) -> MapTag | None:
    """The :class:`MapTag` of ``x``, or ``None``."""
    tag = tag_of(x)
    return tag if isinstance(tag, MapTag) else None


def view_tag(x: Any) -> ViewTag | None:
    """The :class:`ViewTag` of ``x``, or ``None``."""
    tag = tag_of(x)
    return tag if isinstance(tag, ViewTag) else None


__all__ = ["FoldTensor", "adopt", "fold", "map_tag", "tag_of", "view_tag", "wrap"]
