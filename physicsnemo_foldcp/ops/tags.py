"""ShardTensors that carry what the plugin knows about them: scattered maps, broadcast views.

Placements and shapes alone cannot tell an atom<->token map from any other
``(Shard, Replicate)`` tensor. :class:`TaggedShardTensor` is a ShardTensor subclass with one
extra attribute, ``foldcp_tag``:

* a :class:`MapTag` on an atom<->token incidence map as scattered (``atom_to_token``,
  ``token_to_rep_atom``, ``token_to_center_atom``, ``r_set_to_rep_atom``; see
  :func:`physicsnemo_foldcp.ops.maps.tag_maps`), and on tensors derived from one;
* a :class:`ViewTag` on ``s[:, :, None]`` / ``s[:, None, :]`` of a row-sharded single
  (see :mod:`physicsnemo_foldcp.ops.single_pair`).

A tagged tensor is a complete, truthful ShardTensor: every op that this package has no rule
for runs exactly as on a plain ShardTensor (PhysicsNeMo's handlers or its DTensor fallback)
and returns an untagged result. The rules keep the tag through the ops that cannot change
what it says: dtype casts, ``detach``, ``clone``, ``contiguous`` (here), transposes, sums
and scalings of maps (:mod:`~physicsnemo_foldcp.ops.maps`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
from physicsnemo.domain_parallel import ShardTensor
from physicsnemo.domain_parallel.shard_tensor import _conversion_active, _is_tracing

from physicsnemo_foldcp.ops import _dispatch  # noqa: F401 - PhysicsNeMo's handlers first
from physicsnemo_foldcp.ops._blocks import local_of, wrap

Rule = Callable[[Callable, tuple, dict], Any]
AfterHook = Callable[[Callable, tuple, dict, Any], Any]

_RULES: dict[Callable, list[Rule]] = {}
_AFTER: list[AfterHook] = []


@dataclass(frozen=True)
class MapTag:
    """What a scattered atom<->token map is, and where its nonzero entries are.

    A map ``M`` of feature ``name`` relates axis ``axes[0]`` (its rows, split over ``cp0``
    like every single of that axis) to axis ``axes[1]`` (its columns, full length). Atoms
    follow their tokens, so on the ranks of row block ``i`` every nonzero column of the
    local block lies in block ``i`` of ``axes[1]`` (length ``block_sizes[i]``, padded
    layout).

    Attributes
    ----------
    name : str
        Feature key (``"atom_to_token"``, ...).
    axes : tuple[str, str]
        Axis meanings ``(rows, columns)`` as the registry declares them.
    layout : str
        ``"dense"`` (one-hot ``[B, R, C]``) or ``"index"`` (``[B, R]`` int64 global column
        position, ``-1`` for none).
    sharded_dim : int
        Tensor dim of the rows (split over ``cp0``).
    block_dim : int or None
        Tensor dim of the columns (dense layout); ``None`` for the index layout.
    block_sizes : tuple[int, ...]
        Padded length of each ``cp0`` block of the column axis.
    checked : bool
        Whether the content was checked to lie in the blocks (so handlers skip the check).
    derived_by : str or None
        Set when an op the plugin cannot follow made this tensor from a map; such a tensor
        is still correct data, but the contraction handlers refuse it with a clear error.
    """

    name: str
    axes: tuple[str, str]
    layout: str
    sharded_dim: int
    block_dim: int | None
    block_sizes: tuple[int, ...]
    checked: bool = False
    derived_by: str | None = None

    def transposed(self, dim0: int, dim1: int) -> MapTag:
        """The tag after swapping tensor dims ``dim0`` and ``dim1`` (the map's two axes)."""
        swap = {dim0: dim1, dim1: dim0}
        return replace(
            self,
            sharded_dim=swap.get(self.sharded_dim, self.sharded_dim),
            block_dim=swap.get(self.block_dim, self.block_dim),
        )

    def derived(self, how: str) -> MapTag:
        """The tag of a tensor made from the map by ``how``, which the plugin cannot follow."""
        return replace(self, derived_by=self.derived_by or how)

    def column_block(self, row_block: int) -> tuple[int, int]:
        """``(start, length)`` of the column block of ``cp0`` block ``row_block``."""
        return int(sum(self.block_sizes[:row_block])), int(self.block_sizes[row_block])


@dataclass(frozen=True)
class ViewTag:
    """``s[:, :, None]`` (``kind="rows"``) or ``s[:, None, :]`` (``"columns"``) of a single.

    The single ``s`` is ``(Shard(token_dim), Replicate())``; the view inserts a unit axis
    after (rows) or before (columns) its token axis. A rows view and a columns view
    combined elementwise give the ``(Shard(token_dim), Shard(token_dim + 1))`` pair tile.

    Attributes
    ----------
    kind : str
        ``"rows"`` or ``"columns"``.
    token_dim : int
        Token axis of the single (the tile's row axis).
    """

    kind: str
    token_dim: int


class TaggedShardTensor(ShardTensor):
    """A ShardTensor with a ``foldcp_tag`` (:class:`MapTag` or :class:`ViewTag`).

    Rules registered with :func:`register_rule` see each op first; an op without a rule
    runs as it would on a plain ShardTensor.
    """

    foldcp_tag: MapTag | ViewTag

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        active = not _conversion_active() and not _is_tracing(args, kwargs)
        if active:
            for rule in _RULES.get(func, ()):
                out = rule(func, args, kwargs)
                if out is not NotImplemented:
                    return out
        result = super().__torch_function__(func, types, args, kwargs)
        if active:
            for hook in _AFTER:
                result = hook(func, args, kwargs, result)
        return result


def register_rule(funcs: Iterable[Callable], rule: Rule) -> None:
    """Let ``rule(func, args, kwargs)`` see ``funcs`` on tagged tensors first.

    The rule returns ``NotImplemented`` for calls it does not handle.
    """
    for func in funcs:
        if func is not None:
            _RULES.setdefault(func, []).append(rule)


def register_after(hook: AfterHook) -> None:
    """Let ``hook(func, args, kwargs, result)`` post-process results of ops without a rule."""
    _AFTER.append(hook)


def tag_of(x: object) -> MapTag | ViewTag | None:
    """The tag of ``x``, or ``None``."""
    return getattr(x, "foldcp_tag", None) if isinstance(x, TaggedShardTensor) else None


def map_tag(x: object) -> MapTag | None:
    """The :class:`MapTag` of ``x``, or ``None``."""
    tag = tag_of(x)
    return tag if isinstance(tag, MapTag) else None


def view_tag(x: object) -> ViewTag | None:
    """The :class:`ViewTag` of ``x``, or ``None``."""
    tag = tag_of(x)
    return tag if isinstance(tag, ViewTag) else None


def tagged(x: ShardTensor, tag: MapTag | ViewTag) -> TaggedShardTensor:
    """Make ``x`` a :class:`TaggedShardTensor` carrying ``tag`` (in place; returns it)."""
    x.__class__ = TaggedShardTensor
    x.foldcp_tag = tag
    return x


def global_shape(x: ShardTensor) -> tuple[int, ...]:
    """Global shape, read from the spec (no dispatch)."""
    return tuple(int(s) for s in x._spec.tensor_meta.shape)


def _has_tensor(values: Iterable[object]) -> bool:
    return any(isinstance(v, torch.Tensor) for v in values)


def _keep_tag(func: Callable, args: tuple, kwargs: dict):
    """Dtype casts, ``detach``, ``clone``, ``contiguous``: same blocks, same tag."""
    x = args[0] if args else None
    tag = tag_of(x)
    if tag is None or _has_tensor(args[1:]) or _has_tensor(kwargs.values()):
        return NotImplemented
    local = x._local_tensor if func is torch.Tensor.detach else local_of(x)
    new = func(local, *args[1:], **kwargs)
    if not isinstance(new, torch.Tensor) or new.shape != local.shape or new.device != local.device:
        return NotImplemented
    out = wrap(new, x.device_mesh, x.placements, dict(x._spec._sharding_shapes))
    return tagged(out, tag)


KEEP_TAG_FUNCS: tuple[Callable, ...] = tuple(
    getattr(torch.Tensor, name)
    for name in (
        "float",
        "double",
        "half",
        "bfloat16",
        "long",
        "int",
        "short",
        "bool",
        "to",
        "detach",
        "clone",
        "contiguous",
    )
)
"""Ops after which a tagged tensor keeps its tag (computed locally, no communication)."""

register_rule(KEEP_TAG_FUNCS, _keep_tag)

__all__ = [
    "KEEP_TAG_FUNCS",
    "MapTag",
    "TaggedShardTensor",
    "ViewTag",
    "global_shape",
    "map_tag",
    "register_after",
    "register_rule",
    "tag_of",
    "tagged",
    "view_tag",
]
