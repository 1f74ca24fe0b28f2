"""Distributed forwards of whole modules, for modules whose op-by-op run would gather.

Most of a model runs under context parallelism op by op (:mod:`physicsnemo_foldcp.ops.rules`).
A few modules cannot: run op by op, a triangle multiplication would gather a full pair
tensor and a triangle attention ``N x N x N`` scores. For those, a *module handler* computes
the module's forward distributed, with the module's own parameters (so its
``state_dict`` and the user's code stay as they are).

:func:`register_module_handler` wraps the class's ``forward``: a call with a
:class:`~physicsnemo_foldcp.ops.tensor.FoldTensor` among its arguments runs
``handler(module, *args, **kwargs)``; every other call runs the class's own ``forward``
unchanged. :func:`unregister_module_handler` puts the original back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

from physicsnemo_foldcp.ops.blockwise import tensor_leaves
from physicsnemo_foldcp.ops.tensor import FoldTensor

ModuleHandler = Callable[..., Any]
"""``handler(module, *args, **kwargs)``: the module's forward on FoldTensor inputs."""

MODULE_HANDLERS: dict[type[nn.Module], ModuleHandler] = {}
"""Classes with a registered handler (subclasses inherit it unless they have their own)."""


def has_fold_tensor(args: tuple, kwargs: dict) -> bool:
    """Whether a FoldTensor is among ``args`` / ``kwargs`` (lists looked into)."""
    return any(isinstance(t, FoldTensor) for _, t in tensor_leaves(args, kwargs))


def register_module_handler(cls: type[nn.Module], handler: ModuleHandler) -> None:
    """Run ``handler(module, *args, **kwargs)`` for ``cls.forward`` calls on FoldTensors.

    Idempotent: registering again replaces the handler and keeps the original forward.

    Parameters
    ----------
    cls : type[nn.Module]
        The module class (e.g. a Boltz layer).
    handler : callable
        ``handler(module, *args, **kwargs)`` with the arguments of ``cls.forward``.
    """
    MODULE_HANDLERS[cls] = handler
    current = cls.__dict__.get("forward")
    if getattr(current, "foldcp_original", None) is not None:
        return
    original = cls.forward

    @functools.wraps(original)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if has_fold_tensor(args, kwargs):
            return MODULE_HANDLERS[cls](self, *args, **kwargs)
        return original(self, *args, **kwargs)

    forward.foldcp_original = original
    forward.foldcp_own = current is not None
    cls.forward = forward


def unregister_module_handler(cls: type[nn.Module]) -> None:
    """Give ``cls`` its own ``forward`` back (no-op when nothing is registered)."""
    MODULE_HANDLERS.pop(cls, None)
    current = cls.__dict__.get("forward")
    if getattr(current, "foldcp_original", None) is None:
        return
    if current.foldcp_own:
        cls.forward = current.foldcp_original
    else:
        delattr(cls, "forward")


__all__ = [
    "MODULE_HANDLERS",
    "ModuleHandler",
    "has_fold_tensor",
    "register_module_handler",
    "unregister_module_handler",
]
