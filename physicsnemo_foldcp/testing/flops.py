"""Counting the floating-point operations a block of code runs on this rank's local blocks.

A distributed step repeats no work when the FLOPs of its ranks add up to the serial
step's. torch's ``FlopCounterMode`` cannot say so: it sees an op on a distributed tensor
(a ``DTensor`` or the plugin's ``ShardTensor``) before the tensor subclass does and
counts it at the global shape, as if this rank computed the whole op, and the local ops
the subclass then runs go uncounted. :class:`LocalFlops` leaves every op on a distributed
tensor to the subclass (a dispatch mode that returns ``NotImplemented`` stays on for what
the subclass runs) and counts only ops on plain tensors, which are the local blocks, with
torch's own FLOP formulas.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode


class LocalFlops(TorchDispatchMode):
    """Floating-point operations of the ops on plain (local) tensors run inside the block.

    Forward and backward alike (the backward runs the mode's ops on the calling thread
    on CPU; on CUDA too, as autograd propagates dispatch modes). Ops without a FLOP
    formula in torch (element-wise ops, norms, copies, collectives) count nothing: the
    count covers matrix products, convolutions and attention, which set the cost.

    Parameters
    ----------
    where : callable, optional
        Names the part of the model running (called at each counted op); the counts go to
        :attr:`by_part` under that name too.

    Attributes
    ----------
    by_op : Counter
        ``{aten op name: FLOPs}``.
    by_part : Counter
        ``{where(): FLOPs}`` (empty without ``where``).
    """

    def __init__(self, where: Callable[[], str] | None = None) -> None:
        super().__init__()
        self._formulas = FlopCounterMode(display=False).flop_registry
        self._where = where
        self.by_op: Counter = Counter()
        self.by_part: Counter = Counter()

    @property
    def total(self) -> int:
        """FLOPs counted so far."""
        return sum(self.by_op.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # the subclass runs its local ops, which come back here
        packet = func._overloadpacket
        if packet not in self._formulas:
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        formula = self._formulas.get(packet)
        if formula is not None:
            flops = int(formula(*args, **kwargs, out_val=out))
            self.by_op[packet.__name__] += flops
            if self._where is not None:
                self.by_part[self._where()] += flops
        return out


__all__ = ["LocalFlops"]
