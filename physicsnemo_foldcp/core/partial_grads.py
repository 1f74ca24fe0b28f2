"""Where a parameter's partial gradient goes: reduced at once, or kept for a bucket.

A parameter used on a rank's own blocks receives, in backward, the part of its gradient
that those blocks produce; the ranks along the mesh dims that split the blocks must sum
these parts. :class:`~physicsnemo_foldcp.core.blocks.TileParameters` and
:class:`~physicsnemo_foldcp.dispatch.blockwise.ReplicatedPart` do it with an all-reduce
per call. When a :class:`~physicsnemo_foldcp.core.grad_buckets.GradientBuckets`
owns the parameter, the part is added to the parameter's slot of a flat bucket instead
(no communication), and the bucket is reduced once per step with the other parameters'
parts, as DDP reduces its buckets.

A part is replicated over the mesh dims that do not split the blocks (the ranks along
them computed the same part); only the rank at coordinate 0 along those dims adds it, so
the sum over the whole domain counts it once, exactly.

This module is the registry the backward functions ask: ``parameter -> slot``. Nothing is
registered unless a ``GradientBuckets`` is attached, so the plugin's default behaviour is
the per-call all-reduce.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch
from torch.distributed.device_mesh import DeviceMesh


class PartialSlot(Protocol):
    """The place a parameter's partial gradients are summed before one bucket reduction."""

    def take(
        self,
        grad: torch.Tensor,
        mesh: DeviceMesh,
        reduce_dims: Sequence[int],
        narrows: Sequence[tuple[int, int, int]] = (),
    ) -> bool:
        """Keep ``grad`` (partial over ``reduce_dims`` of ``mesh``); ``False`` to refuse.

        ``narrows`` (``(dim, start, length)`` each) place ``grad`` in a region of the
        parameter's shape. A slot refuses a mesh it does not reduce over; the caller then
        reduces at once.
        """
        ...


_SLOTS: dict[int, tuple[weakref.ref, PartialSlot]] = {}


def attach(param: torch.Tensor, slot: PartialSlot) -> None:
    """Send ``param``'s partial gradients to ``slot`` from now on (replaces an earlier one)."""
    _SLOTS[id(param)] = (weakref.ref(param), slot)


def detach_slots(slots: set) -> None:
    """Detach every parameter attached to one of ``slots``."""
    for key in [k for k, (_, slot) in _SLOTS.items() if slot in slots]:
        del _SLOTS[key]


def any_attached() -> bool:
    """Whether any parameter is attached (otherwise nothing needs looking up)."""
    return bool(_SLOTS)


def slot_of(tensor: torch.Tensor) -> PartialSlot | None:
    """The slot ``tensor`` is attached to, if it is an attached parameter itself."""
    entry = _SLOTS.get(id(tensor))
    if entry is None or entry[0]() is not tensor:
        return None
    return entry[1]


def kept(
    tensor: torch.Tensor,
    grad: torch.Tensor,
    mesh: DeviceMesh,
    reduce_dims: Sequence[int],
    narrows: Sequence[tuple[int, int, int]] = (),
) -> bool:
    """Whether ``grad``, ``tensor``'s partial gradient over ``reduce_dims``, went to its slot.

    ``False`` when ``tensor`` has no slot (an activation, or a parameter of a model without
    buckets) or the slot refuses ``mesh``: the caller reduces ``grad`` itself.
    """
    if not _SLOTS or not reduce_dims:
        return False
    slot = slot_of(tensor)
    return slot is not None and slot.take(grad, mesh, reduce_dims, narrows)


def kept_gradient(grad: torch.Tensor) -> torch.Tensor:
    """What a backward returns for a parameter whose part went to its slot: zeros.

    Autograd still accumulates into the parameter (so its hooks, and DDP's and FSDP2's,
    fire as they would), but adds nothing; an expanded scalar costs no memory here.
    """
    return grad.new_zeros(()).expand(grad.shape)


_counters: list[dict[str, int]] = []


def note_reduced_per_call(collectives: int) -> None:
    """Record that a backward reduced parameter gradients itself (``collectives`` calls)."""
    for counter in _counters:
        counter["collectives"] += collectives
        counter["calls"] += 1


@contextlib.contextmanager
def count_reduced_per_call() -> Iterator[dict[str, int]]:
    """Count the per-call reductions of parameter gradients made inside the block.

    Yields
    ------
    dict[str, int]
        ``{"calls": backward calls that reduced parameter gradients themselves,
        "collectives": the all-reduces they issued}``, updated as they happen.
    """
    counter = {"calls": 0, "collectives": 0}
    _counters.append(counter)
    try:
        yield counter
    finally:
        _counters.remove(counter)


__all__ = [
    "count_reduced_per_call",
    "note_reduced_per_call",
    "PartialSlot",
    "any_attached",
    "attach",
    "detach_slots",
    "kept",
    "kept_gradient",
    "slot_of",
]
