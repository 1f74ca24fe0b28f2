"""The rule table: what every torch function does when a FoldTensor is among its operands.

The table is the registry of :mod:`physicsnemo_foldcp.core.tensor`. This module registers
its generic rows (metadata, backward, PhysicsNeMo's path, in-place refusals and the ``local``
families) and the fallback; the cross-axis op modules of :mod:`physicsnemo_foldcp.ops`
register the rows of their own tags and views next to their handlers. One row per group of
functions, in the order the rules are tried (the first rule that applies to a call wins; a
rule passes when the call is not of its form)::

    category   what
    ---------  ----------------------------------------------------------------------
    plain      metadata of the wrapper (shape, dtype, device, ...): no dispatch at all
    backward   ``Tensor.backward``: torch's own backward with the plugin's dispatch left on
               (a checkpointed layer recomputes its forward through it)
    upstream   autograd-identity and serialisation functions: PhysicsNeMo's dispatch
    refuse     in-place ops and out=: a clear error, nothing is half-written
    keep tag   casts, detach, clone, contiguous of a map or view: same blocks, same tag
    derive     map transposes, unit dims, sums, scalings and products; broadcast views
               of singles and the pair tiles made from them; cdist; MSA rows picked by
               a replicated index (:mod:`~physicsnemo_foldcp.ops.msa_rows`): a new
               layout or tag
    local      elementwise ops, reductions, softmax-like ops, norms, linear, einsum /
               matmul, dim moves, reshapes of trailing dims, indexing, cat, split:
               computed on local blocks (:mod:`physicsnemo_foldcp.dispatch.blockwise`),
               gathering only what an op reads along a sharded axis
    (no row)   a handler registered for the function with PhysicsNeMo's
               ``ShardTensor.register_function_handler`` if there is one; otherwise (and
               when no rule of a listed function applies) all operands gathered, the
               serial function on full tensors, reported as a fallback

:func:`table` prints the whole table with every function it lists.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from physicsnemo.domain_parallel import ShardTensor

from physicsnemo_foldcp.core import compat
from physicsnemo_foldcp.core.blocks import ShardingLayoutError, describe
from physicsnemo_foldcp.core.events import op_name
from physicsnemo_foldcp.core.tensor import (
    BACKWARD,
    LOCAL,
    PLAIN,
    REFUSE,
    UPSTREAM,
    Rule,
    register_fallback,
    register_rules,
    registered_rules,
)
from physicsnemo_foldcp.core.whole import block_of_whole
from physicsnemo_foldcp.dispatch import blockwise, families


def _funcs(*names: str, on: tuple[Any, ...] = (torch, torch.Tensor)) -> tuple[Callable, ...]:
    """The callables named ``names`` on each of ``on`` (properties as their getters)."""
    out = []
    for owner in on:
        for name in names:
            attr = getattr(owner, name, None)
            if attr is None:
                continue
            if not callable(attr) and hasattr(attr, "__get__"):
                out.append(attr.__get__)  # a property: __torch_function__ sees its getter
            elif callable(attr):
                out.append(attr)
    return tuple(dict.fromkeys(out))


_ARITHMETIC = (
    "add", "sub", "subtract", "mul", "multiply", "div", "divide", "true_divide",
    "floor_divide", "remainder", "fmod", "pow", "neg", "negative", "abs", "absolute", "exp",
    "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "square", "sigmoid",
    "tanh", "relu", "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh",
    "erf", "erfc", "erfinv", "clamp", "clip", "clamp_min", "clamp_max", "where", "masked_fill",
    "eq", "ne", "lt", "le", "gt", "ge", "greater", "less", "greater_equal", "less_equal",
    "logical_and", "logical_or", "logical_xor", "logical_not", "bitwise_and", "bitwise_or",
    "bitwise_xor", "bitwise_not", "maximum", "minimum", "fmax", "fmin", "reciprocal", "sign",
    "sgn", "floor", "ceil", "round", "trunc", "frac", "isnan", "isinf", "isfinite",
    "nan_to_num", "lerp", "addcmul", "addcdiv", "hypot", "logaddexp", "xlogy", "softplus",
    "positive", "signbit", "copysign", "heaviside", "logit",
)  # fmt: skip
_CASTS = (
    "float", "double", "half", "bfloat16", "long", "int", "short", "char", "byte", "bool",
    "to", "detach", "clone", "contiguous", "cpu", "cuda", "zeros_like", "ones_like",
    "full_like", "empty_like", "rand_like", "randn_like",
)  # fmt: skip
_DUNDERS = (
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
    "__rtruediv__", "__div__", "__rdiv__", "__floordiv__", "__rfloordiv__", "__mod__",
    "__rmod__", "__pow__", "__rpow__", "__neg__", "__pos__", "__abs__", "__invert__",
    "__and__", "__rand__", "__or__", "__ror__", "__xor__", "__rxor__", "__eq__", "__ne__",
    "__lt__", "__le__", "__gt__", "__ge__", "__lshift__", "__rshift__",
)  # fmt: skip
_ACTIVATIONS = (
    "relu", "relu6", "gelu", "silu", "mish", "elu", "selu", "celu", "leaky_relu", "softplus",
    "softsign", "sigmoid", "tanh", "hardtanh", "hardsigmoid", "hardswish", "logsigmoid",
    "tanhshrink", "threshold", "dropout",
)  # fmt: skip

ELEMENTWISE = (
    _funcs(*_ARITHMETIC, *_CASTS)
    + _funcs(*_DUNDERS, on=(torch.Tensor,))
    + _funcs(*_ACTIVATIONS, on=(F,))
)
"""Pointwise functions (broadcasting): computed on local blocks."""

REDUCTIONS = _funcs(
    "sum", "nansum", "mean", "amax", "amin", "prod", "logsumexp", "all", "any", "argmax",
    "argmin", "std", "var", "count_nonzero",
)  # fmt: skip
"""Reductions over ``dim``: local over unsharded dims; sum/mean summed over the mesh."""

MAX_MIN = _funcs("max", "min")
"""``max`` / ``min``: elementwise with a tensor operand, a reduction with ``dim``."""

SOFTMAX_LIKE = _funcs("softmax", "log_softmax", "cumsum", "cumprod", "logcumsumexp") + _funcs(
    "softmax", "log_softmax", on=(F,)
)
"""Functions that keep the shape and read along one ``dim`` (argument 1)."""

SWAP_FUNCS = (
    torch.Tensor.transpose,
    torch.transpose,
    torch.Tensor.swapaxes,
    torch.swapaxes,
    torch.Tensor.swapdims,
    torch.swapdims,
    torch.Tensor.permute,
    torch.permute,
    torch.Tensor.mT.__get__,
    torch.Tensor.t,
    torch.t,
    torch.Tensor.T.__get__,
)
"""Functions that swap two dims (a map's tag swaps with them)."""
CONTRACTION_FUNCS: tuple[Callable, ...] = (
    torch.bmm,
    torch.Tensor.bmm,
    torch.matmul,
    torch.Tensor.matmul,
    torch.Tensor.__matmul__,
    torch.mm,
    torch.Tensor.mm,
    torch.einsum,
)
"""Callables whose ShardTensor handlers route products with a tagged map."""

SWAPS = SWAP_FUNCS + _funcs("movedim", "moveaxis", "adjoint", "mH", "H")
PRODUCTS = CONTRACTION_FUNCS + (torch.Tensor.__rmatmul__,)
MATMULS = tuple(f for f in PRODUCTS if f is not torch.einsum)
RESHAPES = _funcs("reshape", "view", "flatten", "unflatten", "view_as", "reshape_as")
EXPANDS = _funcs("expand", "expand_as", "broadcast_to")
GETITEM = (torch.Tensor.__getitem__,)
SPLITS_KEEPING_DIM = _funcs("chunk", "split", "tensor_split")
NARROW = _funcs("narrow")
SPLITS_REMOVING_DIM = _funcs("unbind", "select")

METADATA = _funcs(
    "shape", "size", "dim", "ndimension", "ndim", "numel", "nelement", "dtype", "device",
    "layout", "is_floating_point", "is_complex", "is_signed", "element_size", "stride",
    "is_contiguous", "__len__", "get_device", "is_cuda", "is_cpu", "is_meta", "is_sparse",
    "is_quantized", "itemsize", "nbytes", "new_zeros", "new_ones", "new_full", "new_empty",
    "new_tensor", "__hash__",
    on=(torch.Tensor,),
)  # fmt: skip
"""Answered by the wrapper itself (global shape, dtype, device) without any dispatch."""

AUTOGRAD_IDENTITY = _funcs(
    "register_hook",
    "register_post_accumulate_grad_hook",
    "retain_grad",
    "__reduce_ex__",
    "__deepcopy__",
    "__setstate__",
    "data",
    "grad",
    "is_leaf",
    "grad_fn",
    "requires_grad",
    "requires_grad_",
    "untyped_storage",
    "storage",
    on=(torch.Tensor,),
) + (torch.autograd.grad,)
"""Bound to the tensor object itself (hooks, gradients, pickling): PhysicsNeMo's dispatch."""

IN_PLACE = tuple(
    getattr(torch.Tensor, name)
    for name in dir(torch.Tensor)
    if callable(getattr(torch.Tensor, name, None))
    and (
        (name.endswith("_") and not name.startswith("_") and name != "requires_grad_")
        or name in ("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__",
                    "__ifloordiv__", "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__",
                    "__ilshift__", "__irshift__", "__idiv__")
    )
)  # fmt: skip
"""In-place methods: refused on FoldTensors (write the out-of-place form)."""


def _as_tuple(value: Any) -> tuple:
    if value is None:
        return (None,)
    return (value,) if isinstance(value, torch.Tensor) else tuple(value)


def _backward(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``loss.backward(...)`` / ``torch.autograd.backward(...)`` from the local blocks.

    The backward starts from each output's local block (``to_local()``, whose backward
    hands the wrapper its gradient) with the gradients' local blocks, so torch runs it as
    for plain tensors. PhysicsNeMo's generic path would run the whole backward with
    torch-function dispatch disabled, and a layer recomputed inside it
    (``torch.utils.checkpoint``) would then skip the plugin's rules.
    """
    if func is torch.Tensor.backward:
        names = ("tensors", "grad_tensors", "retain_graph", "create_graph", "inputs")
        bound = dict(zip(names, args))
        bound.update({"grad_tensors" if k == "gradient" else k: v for k, v in kwargs.items()})
    else:
        names = ("tensors", "grad_tensors", "retain_graph", "create_graph", "grad_variables")
        bound = dict(zip(names, args))
        bound.update(kwargs)
    tensors = _as_tuple(bound["tensors"])
    given = bound.get("grad_tensors")
    grads = _as_tuple(given if given is not None else bound.get("grad_variables"))
    if len(grads) == 1 and len(tensors) > 1 and grads[0] is None:
        grads = (None,) * len(tensors)

    def local(t: Any, differentiable: bool) -> Any:
        if not isinstance(t, ShardTensor):
            return t
        return t.to_local() if differentiable else compat.local_tensor(t)

    def local_grad(t: Any, g: Any) -> Any:
        # Autograd materialises a plain gradient of the global shape (zeros) for an output
        # nothing used, e.g. a checkpointed layer's last MSA track: this rank's block of it.
        plain = isinstance(g, torch.Tensor) and not isinstance(g, ShardTensor)
        if plain and isinstance(t, ShardTensor) and g.shape == t.shape:
            return block_of_whole(g, t)
        return local(g, False)

    return torch.autograd.backward(
        [local(t, True) for t in tensors],
        [local_grad(t, g) for t, g in zip(tensors, grads, strict=False)],
        bound.get("retain_graph"),
        bound.get("create_graph", False),
        inputs=bound.get("inputs"),
    )


def _refuse_in_place(func: Callable, args: tuple, kwargs: dict) -> Any:
    target = args[0] if args else None
    raise ShardingLayoutError(
        f"{op_name(func)} writes in place into {describe(target)}; in-place ops are not "
        "supported on sharded features under context parallelism (each rank holds blocks "
        "of uneven size): use the out-of-place form, e.g. x = x + y instead of x += y"
    )


TABLE: tuple[Rule, ...] = (
    Rule(PLAIN, METADATA, None, "metadata of the wrapper: global shape, dtype, device"),
    Rule(BACKWARD, (torch.Tensor.backward, torch.autograd.backward), _backward,
         "backward from the local blocks, the plugin's dispatch on"),
    Rule(UPSTREAM, AUTOGRAD_IDENTITY, None, "hooks, gradients, pickling: PhysicsNeMo's path"),
    Rule(REFUSE, IN_PLACE, _refuse_in_place, "in-place ops: error naming op and layout"),
    Rule(LOCAL, _funcs("to", "type_as", on=(torch.Tensor,)), families.cast_to_tensor,
         "x.to(other), x.type_as(other): a cast"),
    Rule(LOCAL, ELEMENTWISE, families.elementwise, "pointwise with broadcasting"),
    Rule(LOCAL, MAX_MIN, families.extremum_along_sharded_dim,
         "max/min(x, dim) along a split dim: all-reduced values and first index"),
    Rule(LOCAL, MAX_MIN, families.binary_or_reduction, "max/min: pointwise or reduction"),
    Rule(LOCAL, REDUCTIONS, families.reduction, "reductions (sum/mean over the mesh)"),
    Rule(LOCAL, SOFTMAX_LIKE, families.along_dim(1), "softmax, log_softmax, cumsum"),
    Rule(LOCAL, (F.normalize,), families.along_dim(2, default=1), "F.normalize"),
    Rule(LOCAL, _funcs("layer_norm", "rms_norm", on=(F,)), families.layer_norm,
         "layer / RMS norm over trailing dims"),
    Rule(LOCAL, (F.linear,), families.linear, "F.linear over the last dim"),
    Rule(LOCAL, (torch.einsum,), families.einsum, "einsum: kept indices local"),
    Rule(LOCAL, MATMULS, families.matmul, "matmul / bmm / mm / @ as einsum"),
    Rule(LOCAL, SWAPS, families.permutation, "transpose, permute, movedim, mT, t"),
    Rule(LOCAL, _funcs("unsqueeze"), families.unsqueeze, "unsqueeze"),
    Rule(LOCAL, _funcs("squeeze"), families.squeeze, "squeeze"),
    Rule(LOCAL, RESHAPES, families.reshape, "reshapes of dims after the sharded ones"),
    Rule(LOCAL, EXPANDS, families.expand, "expand / broadcast_to"),
    Rule(LOCAL, GETITEM, families.masked_selection,
         "x[mask] of a row-sharded single: gathered (data-dependent length), plain"),
    Rule(LOCAL, GETITEM, families.getitem, "indexing of unsharded dims"),
    Rule(LOCAL, (torch.unique, torch.Tensor.unique), families.unique,
         "unique of a row-sharded single: gathered, plain"),
    Rule(LOCAL, _funcs("cat", "concat", "concatenate", on=(torch,)), families.cat, "cat"),
    Rule(LOCAL, _funcs("stack", on=(torch,)), families.stack, "stack"),
    Rule(LOCAL, SPLITS_KEEPING_DIM, families.split(False, 2), "chunk / split"),
    Rule(LOCAL, NARROW, families.split(False, 1), "narrow"),
    Rule(LOCAL, SPLITS_REMOVING_DIM, families.split(True, 1), "unbind / select"),
    Rule(LOCAL, (F.one_hot,), families.one_hot, "F.one_hot with num_classes"),
    Rule(LOCAL, (F.embedding,), families.embedding, "F.embedding: table rows of local indices"),
    Rule(LOCAL, _funcs("repeat_interleave"), families.repeat_interleave, "repeat_interleave"),
)  # fmt: skip
"""The generic rows, in the order rules are tried within a category."""

register_rules(*TABLE)
register_fallback(lambda func, args, kwargs: blockwise.run(func, args, kwargs, None))


def table() -> str:
    """The whole rule table as text: category, what, and the functions of every row."""
    lines = []
    for rule in registered_rules():
        names = ", ".join(sorted({op_name(f) for f in rule.funcs}))
        lines.append(f"{rule.category:<9} {rule.what}\n          {names}")
    lines.append(
        "(no row)  a handler registered with PhysicsNeMo if any, else gathered: the serial "
        "function on full tensors, reported as a fallback"
    )
    return "\n".join(lines)


__all__ = ["CONTRACTION_FUNCS", "SWAP_FUNCS", "TABLE", "table"]
