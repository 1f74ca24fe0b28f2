"""The plugin's one dispatch path: every torch function called with a FoldTensor comes here.

:meth:`FoldTensor.__torch_function__ <physicsnemo_foldcp.ops.tensor.FoldTensor>` calls
:func:`dispatch`, which

1. defers to PhysicsNeMo's ``ShardTensor.__torch_function__`` *as it is at call time*
   while PhysicsNeMo converts tensors itself or ``torch.compile`` traces (a compiled
   region sees a FoldTensor exactly as a ShardTensor);
2. runs the plugin's own functions (``outer_sum``, ``tokens_to_atoms``, ...) through
   their handlers (:func:`register_own`);
3. looks the function up in the rule table (:mod:`physicsnemo_foldcp.ops.rules`) and
   runs its rules in order, the first that applies wins;
4. for a function the table does not list, runs the handler registered for it with
   PhysicsNeMo's ``ShardTensor.register_function_handler`` (PhysicsNeMo's own, or a
   user's), if any;
5. otherwise gathers every sharded operand and runs the serial function on the full
   tensors (:func:`physicsnemo_foldcp.ops.blockwise.run` without a dim map), reported as
   a fallback through :mod:`physicsnemo_foldcp.ops.events`.

Nothing here is installed into PhysicsNeMo's dispatch: a ShardTensor the plugin did not
make reaches this code only when a FoldTensor is an operand of the same call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from physicsnemo.domain_parallel import ShardTensor

from physicsnemo_foldcp.ops import blockwise, compat
from physicsnemo_foldcp.ops.tensor import FoldTensor

Handler = Callable[[Callable, tuple, tuple, dict], Any]

OWN: dict[Callable, Handler] = {}
"""The plugin's own functions and their ShardTensor handlers."""


def register_own(func: Callable, handler: Handler) -> None:
    """Register the handler of one of this package's own functions (e.g. ``outer_sum``).

    The handler is registered with PhysicsNeMo's public
    ``ShardTensor.register_function_handler`` too, so the function also runs on
    ShardTensors made elsewhere; it changes nothing for any other function.

    Parameters
    ----------
    func : callable
        A function of this package that calls ``handle_torch_function``.
    handler : callable
        ``handler(func, types, args, kwargs)``.
    """
    OWN[func] = handler
    ShardTensor.register_function_handler(func, handler)


def upstream(func: Callable, types: tuple, args: tuple, kwargs: dict) -> Any:
    """PhysicsNeMo's dispatch of the call, with ShardTensor results made FoldTensors."""
    result = FoldTensor.upstream_torch_function(func, types, args, kwargs)
    inputs = {id(t) for _, t in blockwise.tensor_leaves(args, kwargs)}

    def adopt(r: Any) -> Any:
        if isinstance(r, ShardTensor) and not isinstance(r, FoldTensor) and id(r) not in inputs:
            r.__class__ = FoldTensor
        return r

    if isinstance(result, (tuple, list)):
        for r in result:
            adopt(r)
        return result
    return adopt(result)


def dispatch(func: Callable, types: tuple, args: tuple, kwargs: dict) -> Any:
    """Run one torch function call that has a FoldTensor among its operands.

    Parameters
    ----------
    func : callable
        The torch function (``torch.matmul``, ``torch.Tensor.softmax``, ...).
    types : tuple
        As ``__torch_function__`` received them.
    args, kwargs
        The call's arguments.

    Returns
    -------
    Any
        The result; every ShardTensor in it is a FoldTensor.

    Raises
    ------
    ShardingLayoutError
        When the rule table refuses the call (in-place ops, ``out=``, unsupported uses of
        a scattered map), with the op and the layout named.
    """
    from physicsnemo_foldcp.ops import rules

    if (
        compat.conversion_active()
        or torch.compiler.is_compiling()
        or compat.is_tracing(args, kwargs)
    ):
        return FoldTensor.upstream_torch_function(func, types, args, kwargs)
    own = OWN.get(func)
    if own is not None:
        return own(func, types, args, kwargs)
    table_rules = rules.rules_for(func, kwargs)
    for rule in table_rules:
        out = rule.apply(func, types, args, kwargs)
        if out is not NotImplemented:
            return out
    if not table_rules and compat.registered_function_handler(func) is not None:
        result = upstream(func, types, args, kwargs)
        return rules.after_generic(func, args, kwargs, result)
    return rules.after_generic(func, args, kwargs, blockwise.run(func, args, kwargs, None))


__all__ = ["OWN", "dispatch", "register_own", "upstream"]
