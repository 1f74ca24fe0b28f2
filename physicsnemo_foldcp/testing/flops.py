"""Counting the floating-point operations a block of code runs on this rank's local blocks.

A distributed step repeats no work when the FLOPs of its ranks add up to the serial
step's. torch's ``FlopCounterMode`` cannot say so: it sees an op on a distributed tensor
(a ``DTensor`` or the plugin's ``ShardTensor``) before the tensor subclass does and
counts it at the global shape. :class:`LocalFlops` counts only the ops on the local blocks
(:class:`~physicsnemo_foldcp.testing.counting.LocalCounter`), with torch's own FLOP
formulas.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.flop_counter import FlopCounterMode

from physicsnemo_foldcp.core.blocks import all_reduce
from physicsnemo_foldcp.testing.counting import LocalCounter


class LocalFlops(LocalCounter):
    """Floating-point operations of the ops on plain (local) tensors run inside the block.

    Forward and backward alike (the backward runs the mode's ops on the calling thread
    on CPU; on CUDA too, as autograd propagates dispatch modes). Ops without a FLOP
    formula in torch (element-wise ops, norms, copies, collectives) count nothing: the
    count covers matrix products, convolutions and attention, which set the cost.
    ``by_op``, ``by_part`` and ``total`` are in FLOPs (:class:`LocalCounter`, whose
    ``where`` it takes).
    """

    def __init__(self, where: Callable[[], str] | None = None) -> None:
        super().__init__(where)
        self._formulas = FlopCounterMode(display=False).flop_registry

    def run(self, func, args: tuple, kwargs: dict) -> Any:
        """An op without a formula is decomposed, so that the products inside it count."""
        if func._overloadpacket not in self._formulas:
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)

    def measure(self, func, args: tuple, kwargs: dict, out: Any) -> int:
        """The op's FLOPs by torch's formula, 0 without one."""
        formula = self._formulas.get(func._overloadpacket)
        return 0 if formula is None else formula(*args, **kwargs, out_val=out)


def summed_over_mesh(count: int, mesh: DeviceMesh) -> int:
    """``count`` (e.g. :attr:`LocalFlops.total`) summed over every rank of ``mesh``.

    ONE all-reduce per mesh dim of size > 1, of one float64 (exact below ``2^53``).
    """
    total = torch.tensor([count], dtype=torch.float64, device=torch.device(mesh.device_type))
    for mesh_dim in range(mesh.ndim):
        total = all_reduce(total, mesh, mesh_dim)
    return int(total.item())


__all__ = ["LocalFlops", "summed_over_mesh"]
