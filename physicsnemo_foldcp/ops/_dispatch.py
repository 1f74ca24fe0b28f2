"""Registration of this package's ShardTensor function handlers, chained to what was there.

Importing this module first registers PhysicsNeMo's own ShardTensor handlers (upstream does
so at import only when CUDA is available), so that a handler registered here for a callable
PhysicsNeMo also handles (``Tensor.unsqueeze``) wraps PhysicsNeMo's instead of being
overwritten by it later.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from physicsnemo.domain_parallel import ShardTensor
from physicsnemo.domain_parallel.shard_tensor import _torch_function_fallback_via_dtensor

from physicsnemo_foldcp.distributed.bootstrap import register_shard_tensor_ops

register_shard_tensor_ops()

Handler = Callable[[Callable, tuple, tuple, dict], Any]


def default_path(func: Callable, types: tuple, args: tuple, kwargs: dict, previous: Handler | None):
    """What ShardTensor would do without this package: the previous handler, or the fallback."""
    if previous is not None:
        return previous(func, types, args, kwargs)
    return _torch_function_fallback_via_dtensor(func, args, kwargs)


def register_chained(funcs: Iterable[Callable], handler: Handler, name: str) -> None:
    """Register ``handler`` for each of ``funcs``; ``NotImplemented`` defers to the default.

    Parameters
    ----------
    funcs : iterable of callables
        The exact callables (``torch.bmm``, ``torch.Tensor.bmm``, ...) to intercept.
    handler : callable
        ``handler(func, types, args, kwargs)``; returns ``NotImplemented`` when the call is
        not one it handles, and the call then goes where it went before (the handler
        previously registered for ``func``, else PhysicsNeMo's DTensor fallback).
    name : str
        Identifies the handler: registering the same name again replaces it instead of
        chaining to itself.
    """
    for func in funcs:
        previous = ShardTensor._function_registry.get(func)
        while getattr(previous, "_foldcp_name", None) == name:
            previous = previous._foldcp_previous

        def chained(f, types, args, kwargs, _previous=previous):
            out = handler(f, types, args, kwargs)
            if out is NotImplemented:
                return default_path(f, types, args, kwargs, _previous)
            return out

        chained._foldcp_name = name
        chained._foldcp_previous = previous
        ShardTensor.register_function_handler(func, chained)


def register_own(func: Callable, handler: Handler) -> None:
    """Register the handler of one of this package's own functions."""
    ShardTensor.register_function_handler(func, handler)
