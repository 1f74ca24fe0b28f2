"""Counting the bytes a block of code moves without computing: copies, joins, pads, casts.

A kernel that re-lays out its operands (``cat``, ``contiguous``, padding, casts, gathers of
rows) spends memory bandwidth and launches on work a view or a preallocated buffer could
save. :class:`CopyBytes` counts the bytes those ops write on this rank's plain (local)
tensors, forward and backward, so a benchmark can compare a distributed step's copies with
the serial module's.
"""

from __future__ import annotations

from typing import Any

import torch

from physicsnemo_foldcp.testing.counting import LocalCounter

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


class CopyBytes(LocalCounter):
    """Bytes written by the data-moving ops (:data:`MOVES`) on plain tensors in the block.

    Ops on distributed tensors are left to the subclass, whose local ops come back here
    on plain tensors (:class:`~physicsnemo_foldcp.testing.counting.LocalCounter`, whose
    ``where`` it takes; ``by_op``, ``by_part`` and ``total`` are in bytes).
    """

    def measure(self, func, args: tuple, kwargs: dict, out: Any) -> int:
        """Bytes a data-moving op writes, 0 for any other op."""
        name = func._overloadpacket.__name__
        if name not in MOVES:
            return 0
        source = _IN_PLACE_SOURCE.get(name)
        if source is None:
            return _nbytes(out)
        return args[source].numel() * args[0].element_size()


__all__ = ["MOVES", "CopyBytes"]
