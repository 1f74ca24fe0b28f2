"""Counting the bytes a block of code moves without computing: copies, joins, pads, casts.

A kernel that re-lays out its operands (``cat``, ``contiguous``, padding, casts, gathers of
rows) spends memory bandwidth and launches on work a view or a preallocated buffer could
save. :class:`CopyBytes` counts the bytes those ops write on this rank's plain (local)
tensors, forward and backward, so a benchmark can compare a distributed step's copies with
the serial module's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

MOVES = (
    "cat",
    "stack",
    "clone",
    "_to_copy",
    "constant_pad_nd",
    "index_select",
    "narrow_copy",
    "copy_",
    "index_copy_",
    "index_copy",
)
"""ATen ops that only move data (``contiguous`` and a ``reshape`` that cannot be a view
arrive here as ``clone``)."""

_IN_PLACE_SOURCE = {"copy_": 1, "index_copy_": 3, "index_copy": 3}
"""In-place moves: the argument whose elements are written (in the destination's dtype)."""


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


class CopyBytes(TorchDispatchMode):
    """Bytes written by the data-moving ops (:data:`MOVES`) on plain tensors in the block.

    Ops on distributed tensors are left to the subclass (whose local ops come back here
    on plain tensors), as :class:`~physicsnemo_foldcp.testing.flops.LocalFlops` does.

    Parameters
    ----------
    where : callable, optional
        Names the part of the model running; the bytes go to :attr:`by_part` under it too.

    Attributes
    ----------
    by_op : Counter
        ``{aten op name: bytes}``.
    calls : Counter
        ``{aten op name: calls}``.
    by_part : Counter
        ``{where(): bytes}`` (empty without ``where``).
    """

    def __init__(self, where: Callable[[], str] | None = None) -> None:
        super().__init__()
        self._where = where
        self.by_op: Counter = Counter()
        self.calls: Counter = Counter()
        self.by_part: Counter = Counter()

    @property
    def total(self) -> int:
        """Bytes counted so far."""
        return sum(self.by_op.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **kwargs)
        name = func._overloadpacket.__name__
        if name in MOVES:
            source = _IN_PLACE_SOURCE.get(name)
            if source is None:
                written = _nbytes(out)
            else:
                written = args[source].numel() * args[0].element_size()
            self.by_op[name] += written
            self.calls[name] += 1
            if self._where is not None:
                self.by_part[self._where()] += written
        return out


__all__ = ["MOVES", "CopyBytes"]
