"""Counting what the ATen ops on this rank's local blocks do, inside a block of code.

A distributed tensor (a ``DTensor`` or the plugin's ``ShardTensor``) reaches a dispatch mode
before its subclass has run the op on the local blocks; counted there, an op would count at
the global shape, as if this rank did the whole op, and the local ops the subclass then
runs would go uncounted. :class:`LocalCounter` leaves every op on a distributed tensor to
the subclass (a mode that returns ``NotImplemented`` stays on for what the subclass runs)
and counts only ops on plain tensors, which are the local blocks; a subclass says what an
op amounts to (:meth:`LocalCounter.measure`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode


class LocalCounter(TorchDispatchMode):
    """An amount per ATen op on plain (local) tensors run inside the block, forward and backward.

    Parameters
    ----------
    where : callable, optional
        Names the part of the model running (called at each counted op); the amounts go to
        :attr:`by_part` under that name too.

    Attributes
    ----------
    by_op : Counter
        ``{aten op name: amount}``.
    calls : Counter
        ``{aten op name: counted calls}``.
    by_part : Counter
        ``{where(): amount}`` (empty without ``where``).
    """

    def __init__(self, where: Callable[[], str] | None = None) -> None:
        super().__init__()
        self._where = where
        self.by_op: Counter = Counter()
        self.calls: Counter = Counter()
        self.by_part: Counter = Counter()

    @property
    def total(self) -> int:
        """The amount counted so far."""
        return sum(self.by_op.values())

    def run(self, func, args: tuple, kwargs: dict) -> Any:
        """Run one op (a subclass may decompose it first, inside the mode)."""
        return func(*args, **kwargs)

    def measure(self, func, args: tuple, kwargs: dict, out: Any) -> int:
        """What one op amounts to; 0 counts nothing."""
        raise NotImplementedError

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # the subclass runs its local ops, which come back here
        out = self.run(func, args, kwargs)
        amount = int(self.measure(func, args, kwargs, out))
        if amount:
            name = func._overloadpacket.__name__
            self.by_op[name] += amount
            self.calls[name] += 1
            if self._where is not None:
                self.by_part[self._where()] += amount
        return out


__all__ = ["LocalCounter"]
