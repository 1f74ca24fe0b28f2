"""What the plugin's dispatch reports while it runs: gathers that a local rule could not avoid.

When an op on a :class:`~physicsnemo_foldcp.core.tensor.FoldTensor` cannot be computed on
the local blocks (it reads along a sharded axis, or the plugin has no rule for it), the
dispatch all-gathers the operands it must and computes the serial result
(:mod:`physicsnemo_foldcp.dispatch.blockwise`). Each such gather is reported here as a
:class:`GatherEvent`, so :func:`~physicsnemo_foldcp.training.validate_model` (or any
caller of :func:`observe`) can name the op.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

FALLBACK = "fallback"
"""Kind of a gather made because an op reads along a sharded axis or has no rule."""
TILE = "tile"
"""Kind of the all-gather of a single that becomes the columns of a pair tile (expected)."""


@dataclass(frozen=True)
class GatherEvent:
    """One gather of one operand of one op call (forward).

    Attributes
    ----------
    op : str
        The torch function (``"Tensor.softmax"``, ``"torch.matmul"``, ...).
    kind : str
        :data:`FALLBACK` or :data:`TILE`.
    operand : int
        Position of the operand among the call's tensors.
    mesh_dims : tuple[int, ...]
        Mesh dims gathered over (0: ``cp0``, 1: ``cp1``).
    shape : tuple[int, ...]
        Global shape of the operand.
    reason : str
        Why the op could not stay local.
    """

    op: str
    kind: str
    operand: int
    mesh_dims: tuple[int, ...]
    shape: tuple[int, ...]
    reason: str


_observers: list[Callable[[GatherEvent], None]] = []


def emit(event: GatherEvent) -> None:
    """Pass ``event`` to every active observer."""
    for observer in tuple(_observers):
        observer(event)


@contextlib.contextmanager
def observe(callback: Callable[[GatherEvent], None]) -> Iterator[None]:
    """Call ``callback(event)`` for every gather made inside the ``with`` block."""
    _observers.append(callback)
    try:
        yield
    finally:
        _observers.remove(callback)


def op_name(func: Callable) -> str:
    """A readable name of a torch function (``"Tensor.softmax"``, ``"torch.einsum"``)."""
    owner = getattr(func, "__self__", None)
    if type(func).__name__ == "method-wrapper" and owner is not None:
        return f"Tensor.{getattr(owner, '__name__', owner)}"  # a property's getter
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or str(func)
    name = name.replace("_TensorBase.", "Tensor.").replace("TensorBase.", "Tensor.")
    name = name.replace("_VariableFunctionsClass.", "torch.")
    module = getattr(func, "__module__", None) or ""
    if module.startswith("torch.nn.functional") or module == "torch._C._nn":
        return f"F.{name}"
    if "." not in name and module.startswith("torch"):
        return f"torch.{name}"
    return name


__all__ = ["FALLBACK", "TILE", "GatherEvent", "emit", "observe", "op_name"]
