"""Memory checks for tests: local tensor sizes, and tensors kept alive by reference cycles.

Context parallelism exists so that no rank ever holds a full ``N x N`` pair tensor or an
``N x N x N`` score tensor. :class:`LocalSizeGuard` is a ``TorchDispatchMode`` that looks at
every tensor an op produces during a forward and backward, measures what this rank really
holds (the local block of a ShardTensor or DTensor, a plain tensor as it is) and records
every one over the bound, with the op that made it.

:func:`tensors_in_reference_cycles` finds the tensors a call leaves in reference cycles:
those outlive their last use until Python's garbage collector happens to run, so they
raise the peak memory of a step by an amount that changes from step to step.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from physicsnemo_foldcp.core import compat


def local_numel(t: torch.Tensor) -> int:
    """Elements this rank holds of ``t`` (its local block for a distributed tensor)."""
    if isinstance(t, (ShardTensor, DTensor)):
        return int(compat.local_tensor(t).numel())
    return int(t.numel())


@dataclass
class LocalSizeGuard(TorchDispatchMode):
    """Record every op output whose local size exceeds ``limit`` elements.

    Parameters
    ----------
    limit : int
        The largest local tensor allowed, in elements.

    Attributes
    ----------
    largest : int
        The largest local tensor seen.
    violations : list[tuple[str, tuple[int, ...], int]]
        ``(op, local shape, elements)`` of every output over the limit.
    """

    limit: int
    largest: int = 0
    violations: list[tuple[str, tuple[int, ...], int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                n = local_numel(t)
                self.largest = max(self.largest, n)
                if n > self.limit:
                    shape = tuple(
                        compat.local_tensor(t).shape
                        if isinstance(t, (ShardTensor, DTensor))
                        else t.shape
                    )
                    self.violations.append((str(func), shape, n))
        return out


def tensors_in_reference_cycles(run: Callable[[], Any]) -> list[torch.Tensor]:
    """The tensors that ``run()`` leaves reachable only through reference cycles.

    The garbage collector is off while ``run`` executes; afterwards one collection with
    ``gc.DEBUG_SAVEALL`` keeps what it would have freed, and the tensors among it are
    returned. The collector's state is restored.

    Parameters
    ----------
    run : callable
        The code to check (for example one forward and backward); its result is dropped.

    Returns
    -------
    list[torch.Tensor]
        Empty when every tensor ``run`` made was freed by reference counting.
    """
    gc.collect()
    enabled, flags = gc.isenabled(), gc.get_debug()
    gc.disable()
    try:
        run()
        gc.set_debug(flags | gc.DEBUG_SAVEALL)
        gc.collect()
        return [o for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.garbage.clear()
        gc.set_debug(flags)
        if enabled:
            gc.enable()


__all__ = ["LocalSizeGuard", "local_numel", "tensors_in_reference_cycles"]
