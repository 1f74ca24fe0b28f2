"""Op families: how each generic torch function relates its operands' dims to its result's.

Each function here reads one call's arguments and returns the
:class:`~physicsnemo_foldcp.dispatch.blockwise.DimMap` that
:func:`~physicsnemo_foldcp.dispatch.blockwise.run` needs to compute the call on local blocks
(or ``NotImplemented`` when the call is not of the family's form, e.g. ``max(x, y)`` is
elementwise while ``max(x, dim)`` reduces). The table of which function belongs to which
family is :mod:`physicsnemo_foldcp.dispatch.rules`.

Shapes are global; ``shapes[k]`` is the shape of the call's ``k``-th tensor (lists of
tensors flattened, in call order).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from physicsnemo_foldcp.core.leaves import tensor_leaves
from physicsnemo_foldcp.dispatch import blockwise
from physicsnemo_foldcp.dispatch.blockwise import DimMap

Handler = Callable[[Callable, tuple, dict], Any]


def _arg(args: tuple, kwargs: dict, position: int, names: Sequence[str], default: Any) -> Any:
    if len(args) > position:
        return args[position]
    for name in names:
        if name in kwargs:
            return kwargs[name]
    return default


def _shapes(args: tuple, kwargs: dict) -> list[tuple[int, ...]]:
    return [blockwise.shape_of(t) for _, t in tensor_leaves(args, kwargs)]


def _name(func: Callable) -> str:
    """The function's name; for a property's getter (``Tensor.mT``), the property's."""
    owner = getattr(func, "__self__", None)
    if type(func).__name__ == "method-wrapper" and owner is not None:
        return str(getattr(owner, "__name__", ""))
    return str(getattr(func, "__name__", ""))


def _dims(dim: Any, ndim: int) -> tuple[int, ...] | None:
    """Normalised dims of a ``dim`` argument; ``None`` for "all dims"."""
    if dim is None or (isinstance(dim, (tuple, list)) and len(dim) == 0):
        return None
    if isinstance(dim, (tuple, list)):
        return tuple(sorted({int(d) % ndim for d in dim}))
    if isinstance(dim, int):
        return (int(dim) % max(ndim, 1),)
    return None


def _run(func: Callable, args: tuple, kwargs: dict, dims: DimMap, **extra: Any) -> Any:
    return blockwise.run(func, args, kwargs, dims, **extra)


# -- elementwise -----------------------------------------------------------------------------


def elementwise(func: Callable, args: tuple, kwargs: dict) -> Any:
    """Pointwise ops with broadcasting (arithmetic, activations, comparisons, casts, where)."""
    if "out" in kwargs:
        return NotImplemented
    shapes = _shapes(args, kwargs)
    out_ndim = max(len(s) for s in shapes)
    lead = [out_ndim - len(s) for s in shapes]
    return _run(func, args, kwargs, DimMap(lambda k, d: d + lead[k]))


def binary_or_reduction(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``max`` / ``min``: elementwise with a tensor second operand, else a reduction."""
    other = _arg(args, kwargs, 1, ("other",), None)
    if isinstance(other, torch.Tensor):
        return elementwise(func, args, kwargs)
    return reduction(func, args, kwargs)


def extremum_along_sharded_dim(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``max(x, dim)`` / ``min(x, dim)`` (values and indices) along a dim split over the mesh.

    Each rank takes the extremum of its block; over the mesh dim that splits ``dim``: ONE
    all-reduce (max / min) of the values, ONE all-reduce (min) of the global index of the
    first rank's extremum that equals it (Boltz's serial ``torch.max`` tie rule: the first
    index), and ONE sum of the winning rank's values (so the values are differentiable:
    the gradient goes to the winning element, as in serial). The result is replicated
    over that mesh dim and keeps the operand's sharding elsewhere.
    """
    from torch.distributed.tensor.placement_types import Replicate, Shard

    from physicsnemo_foldcp.core.blocks import SumToReplicate, all_reduce, local_of
    from physicsnemo_foldcp.core.compat import sharding_shapes
    from physicsnemo_foldcp.core.tensor import wrap

    x = args[0]
    dim = _arg(args, kwargs, 1, ("dim",), None)
    keepdim = bool(_arg(args, kwargs, 2, ("keepdim",), False))
    placements = getattr(x, "placements", None)
    if not isinstance(dim, int) or isinstance(dim, bool) or placements is None or "out" in kwargs:
        return NotImplemented
    shape = _shapes(args, kwargs)[0]
    dim %= len(shape)
    along = [m for m, p in enumerate(placements) if p.is_shard() and p.dim == dim]
    if len(along) != 1 or any(p.is_partial() for p in placements):
        return NotImplemented
    (m,) = along
    name = _name(func)
    mesh = x.device_mesh
    sizes = blockwise.block_sizes(x, m)
    k = int(mesh.get_coordinate()[m])
    local = local_of(x)
    values, indices = (torch.max if name == "max" else torch.min)(local, dim, keepdim=True)
    best = all_reduce(values.detach(), mesh, m, "max" if name == "max" else "min")
    sentinel = torch.iinfo(torch.int64).max
    candidate = torch.where(values.detach() == best, indices + sum(sizes[:k]), sentinel)
    first = all_reduce(candidate, mesh, m, "min")
    mine = candidate == first
    values = SumToReplicate.apply(torch.where(mine, values, torch.zeros_like(values)), mesh, (m,))
    if not keepdim:
        values, first = values.squeeze(dim), first.squeeze(dim)

    def moved(p: Any) -> Any:
        if not p.is_shard() or p.dim == dim:
            return Replicate()
        return Shard(p.dim - 1 if (p.dim > dim and not keepdim) else p.dim)

    out_placements = tuple(moved(p) for p in placements)
    shapes = {}
    for mesh_dim, per_rank in (sharding_shapes(x) or {}).items():
        if mesh_dim == m:
            shapes[mesh_dim] = [tuple(values.shape)] * mesh.size(m)
            continue
        shapes[mesh_dim] = [
            tuple(n for d, n in enumerate(s) if d != dim) if not keepdim
            else tuple(1 if d == dim else n for d, n in enumerate(s))
            for s in per_rank
        ]  # fmt: skip
    kept = {mesh_dim: v for mesh_dim, v in shapes.items() if out_placements[mesh_dim].is_shard()}
    result = type(torch.max(torch.zeros(1), 0))  # torch.return_types.max / .min alike
    out_values = wrap(values, mesh, out_placements, kept)
    out_indices = wrap(first, mesh, out_placements, kept)
    return result((out_values, out_indices))


def _one_sharded_dim(x: Any) -> int | None:
    """The mesh dim of a tensor sharded along exactly one mesh dim (over one tensor dim)."""
    placements = getattr(x, "placements", None)
    if placements is None or any(p.is_partial() for p in placements):
        return None
    sharded = [m for m, p in enumerate(placements) if p.is_shard()]
    return sharded[0] if len(sharded) == 1 else None


def unique(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``torch.unique(x)`` of a row-sharded single: the sorted distinct values, plain.

    The values of a token or atom vector (chain ids): ONE all-gather of the operand over
    its mesh dim (O(N)), then the serial ``unique``; the result, of data-dependent length,
    is a plain tensor, the same on every rank. Declined (the generic path) for a tensor
    sharded over both mesh dims, and with ``return_inverse`` / ``return_counts`` / ``dim``.
    """
    from physicsnemo_foldcp.core.whole import whole

    x = args[0] if args else None
    if _one_sharded_dim(x) is None or len(args) > 1:
        return NotImplemented
    if (
        any(kwargs.get(k) for k in ("return_inverse", "return_counts"))
        or kwargs.get("dim") is not None
    ):
        return NotImplemented
    return torch.unique(whole(x), sorted=kwargs.get("sorted", True))


def masked_selection(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``x[mask]`` with a boolean ``mask`` of ``x``'s shape, both row-sharded singles alike.

    The selection has a data-dependent length and the serial (row-major) order, so it
    cannot stay in blocks: ONE all-gather each of ``x`` and ``mask`` over the mesh dim
    (O(N)), then the serial selection; the result is plain, the same on every rank.
    """
    from physicsnemo_foldcp.core.whole import whole

    if len(args) != 2 or kwargs:
        return NotImplemented
    x, mask = args
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        return NotImplemented
    if _one_sharded_dim(x) is None or _one_sharded_dim(mask) is None:
        return NotImplemented
    if tuple(getattr(x, "placements", ())) != tuple(getattr(mask, "placements", ())):
        return NotImplemented
    if blockwise.shape_of(x) != blockwise.shape_of(mask):
        return NotImplemented
    return whole(x)[whole(mask)]


# -- along dims ------------------------------------------------------------------------------

SUM_LIKE = {"sum", "nansum", "mean"}


def reduction(func: Callable, args: tuple, kwargs: dict) -> Any:
    """Reductions over ``dim`` (sum, mean, amax, prod, all, argmax, std, max/min with dim).

    A sum or mean over a sharded dim is computed locally and summed over the mesh dim
    (ONE all-reduce; the result is replicated there, never ``Partial``); ``any`` / ``all``
    likewise, combined with a max / min all-reduce.
    """
    if "out" in kwargs:
        return NotImplemented
    name = _name(func)
    ndim = len(_shapes(args, kwargs)[0])
    dim = _arg(args, kwargs, 1, ("dim", "axis"), None)
    if isinstance(dim, torch.dtype):
        dim = None
    keepdim = bool(_arg(args, kwargs, 2, ("keepdim",), False))
    dims = _dims(dim, ndim)
    reduced = set(range(ndim)) if dims is None else set(dims)

    def out_dim(k: int, d: int) -> int | None:
        if k != 0 or d in reduced:
            return None
        return d if keepdim else d - sum(1 for r in reduced if r < d)

    label = "sum" if name in SUM_LIKE else name if name in blockwise.FLAG_REDUCTIONS else None
    summed = (
        (lambda k, d: label if k == 0 and d in reduced else None)
        if label is not None
        else (lambda k, d: None)
    )
    extra: dict[str, Any] = {}
    if name == "mean":
        # The local sums are added over the mesh; divide by the global count afterwards.
        count = blockwise.numel_of(_shapes(args, kwargs)[0], sorted(reduced))
        extra = {
            "local_func": lambda x, *a, **k: torch.sum(x, *a, **k),
            "post": lambda r: r / count,
        }
    return _run(func, args, kwargs, DimMap(out_dim, summed), **extra)


def along_dim(position: int, default: Any = None, names: Sequence[str] = ("dim",)) -> Handler:
    """Ops that keep their input's shape and read along one ``dim`` (softmax, cumsum)."""

    def handler(func: Callable, args: tuple, kwargs: dict) -> Any:
        ndim = len(_shapes(args, kwargs)[0])
        dim = _arg(args, kwargs, position, names, default)
        if not isinstance(dim, int):
            return NotImplemented
        touched = dim % ndim if ndim else 0

        def out_dim(k: int, d: int) -> int | None:
            return d if k == 0 and d != touched else None

        return _run(func, args, kwargs, DimMap(out_dim, same_shape=True))

    return handler


def layer_norm(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``F.layer_norm`` / ``F.rms_norm``: reads along the last ``len(normalized_shape)`` dims."""
    shapes = _shapes(args, kwargs)
    ndim = len(shapes[0])
    normalized = _arg(args, kwargs, 1, ("normalized_shape",), None)
    k_dims = len(normalized) if isinstance(normalized, (tuple, list, torch.Size)) else 1
    first = ndim - k_dims

    def out_dim(k: int, d: int) -> int | None:
        if k == 0:
            return d if d < first else None
        return None

    return _run(func, args, kwargs, DimMap(out_dim, same_shape=True))


def linear(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``F.linear(x, W, b)``: reads along ``x``'s last dim; ``W`` and ``b`` broadcast."""
    shapes = _shapes(args, kwargs)
    last = len(shapes[0]) - 1

    def out_dim(k: int, d: int) -> int | None:
        if k == 0:
            return d if d < last else None
        if k == 2:
            return last
        return None

    return _run(func, args, kwargs, DimMap(out_dim))


# -- contractions ----------------------------------------------------------------------------

_LETTERS = re.compile(r"[a-zA-Z]|\.\.\.")


def _parse_equation(equation: str, ndims: Sequence[int]) -> tuple[list[list[str]], list[str]]:
    """Labels of every operand dim and of the result, ``...`` expanded (``#i`` labels)."""
    equation = equation.replace(" ", "")
    if "->" in equation:
        inputs, output = equation.split("->")
    else:
        inputs, output = equation, None
    terms = inputs.split(",")
    if len(terms) != len(ndims):
        raise ValueError(f"einsum: {len(terms)} operand terms for {len(ndims)} operands")
    parsed = [_LETTERS.findall(t) for t in terms]
    ellipsis = max((n - (len(p) - 1) for p, n in zip(parsed, ndims) if "..." in p), default=0)
    labels = []
    for p, n in zip(parsed, ndims):
        if "..." in p:
            width = n - (len(p) - 1)
            at = p.index("...")
            filler = [f"#{ellipsis - width + i}" for i in range(width)]
            p = p[:at] + filler + p[at + 1 :]
        labels.append(p)
    if output is None:
        counts: dict[str, int] = {}
        for p in labels:
            for label in p:
                counts[label] = counts.get(label, 0) + 1
        dots = [f"#{i}" for i in range(ellipsis)]
        out = dots + sorted(x for x, c in counts.items() if c == 1 and not x.startswith("#"))
    else:
        found = _LETTERS.findall(output)
        out = []
        for label in found:
            out += [f"#{i}" for i in range(ellipsis)] if label == "..." else [label]
    return labels, out


def _contraction_map(labels: list[list[str]], out: list[str]) -> DimMap:
    position = {label: i for i, label in enumerate(out)}

    def out_dim(k: int, d: int) -> int | None:
        return position.get(labels[k][d])

    def summed(k: int, d: int) -> str | None:
        label = labels[k][d]
        return None if label in position else label

    return DimMap(out_dim, summed)


def einsum(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``torch.einsum(equation, *operands)``: kept indices local, contracted ones summed."""
    if kwargs or not args or not isinstance(args[0], str):
        return NotImplemented
    ndims = [len(s) for s in _shapes(args, kwargs)]
    try:
        labels, out = _parse_equation(args[0], ndims)
    except ValueError:
        return NotImplemented
    return _run(func, args, kwargs, _contraction_map(labels, out))


def matmul(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``matmul`` / ``bmm`` / ``mm`` / ``@`` as the einsum of the operands' ranks."""
    if kwargs or len(args) != 2:
        return NotImplemented
    a, b = (len(s) for s in _shapes(args, kwargs))
    swapped = _name(func) == "__rmatmul__"  # args are (b, a)
    if swapped:
        a, b = b, a
    if a == 0 or b == 0:
        return NotImplemented
    if a == 1 and b == 1:
        equation = "k,k->"
    elif a == 1:
        equation = "k,...kn->...n"
    elif b == 1:
        equation = "...mk,k->...m"
    else:
        equation = "...mk,...kn->...mn"
    labels, out = _parse_equation(equation, [a, b])
    if swapped:
        labels = labels[::-1]
    return _run(func, args, kwargs, _contraction_map(labels, out))


# -- moving dims -----------------------------------------------------------------------------


def _permutation(func: Callable, args: tuple, kwargs: dict, ndim: int) -> list[int] | None:
    """``order`` with ``result.dim(i) = input.dim(order[i])``, or ``None``."""
    name = _name(func)
    if name in ("mT", "mH") or name in ("adjoint",):
        order = list(range(ndim))
        order[-2], order[-1] = order[-1], order[-2]
        return order
    if name in ("t", "T", "H"):
        return list(reversed(range(ndim))) if ndim <= 2 else None
    if name == "permute":
        rest = args[1:] if len(args) > 2 else (args[1] if len(args) > 1 else kwargs.get("dims"))
        return [int(d) % ndim for d in rest]
    if name == "movedim" or name == "moveaxis":
        src = _arg(args, kwargs, 1, ("source",), None)
        dst = _arg(args, kwargs, 2, ("destination",), None)
        src = [src] if isinstance(src, int) else list(src)
        dst = [dst] if isinstance(dst, int) else list(dst)
        src, dst = [s % ndim for s in src], [d % ndim for d in dst]
        order: list[int | None] = [None] * ndim
        for s, d in zip(src, dst):
            order[d] = s
        rest_dims = iter(d for d in range(ndim) if d not in src)
        return [o if o is not None else next(rest_dims) for o in order]
    d0 = _arg(args, kwargs, 1, ("dim0", "axis0"), None)
    d1 = _arg(args, kwargs, 2, ("dim1", "axis1"), None)
    if isinstance(d0, int) and isinstance(d1, int):
        order = list(range(ndim))
        order[d0 % ndim], order[d1 % ndim] = order[d1 % ndim], order[d0 % ndim]
        return order
    return None


def permutation(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``transpose`` / ``permute`` / ``movedim`` / ``mT`` / ``t``: dims move, nothing is read."""
    ndim = len(_shapes(args, kwargs)[0])
    order = _permutation(func, args, kwargs, ndim)
    if order is None or sorted(order) != list(range(ndim)):
        return NotImplemented
    where = {source: i for i, source in enumerate(order)}
    return _run(func, args, kwargs, DimMap(lambda k, d: where[d] if k == 0 else None))


def unsqueeze(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``unsqueeze(dim)``: a unit dim inserted, the others shift."""
    ndim = len(_shapes(args, kwargs)[0])
    dim = _arg(args, kwargs, 1, ("dim",), None)
    if not isinstance(dim, int):
        return NotImplemented
    at = dim % (ndim + 1)

    def out_dim(k: int, d: int) -> int | None:
        return (d if d < at else d + 1) if k == 0 else None

    return _run(func, args, kwargs, DimMap(out_dim))


def squeeze(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``squeeze(dim)``: unit dims removed, the others shift."""
    shape = _shapes(args, kwargs)[0]
    dim = _arg(args, kwargs, 1, ("dim",), None)
    dims = _dims(dim, len(shape))
    candidates = range(len(shape)) if dims is None else dims
    removed = {d for d in candidates if shape[d] == 1}

    def out_dim(k: int, d: int) -> int | None:
        if k != 0 or d in removed:
            return None
        return d - sum(1 for r in removed if r < d)

    return _run(func, args, kwargs, DimMap(out_dim))


# -- reshapes --------------------------------------------------------------------------------


def _last_sharded_dim(x: Any) -> int:
    placements = getattr(x, "placements", ())
    dims = [p.dim for p in placements if p.is_shard()] if placements else []
    return max(dims) if dims else -1


def _resolve(sizes: Sequence[int], numel: int) -> list[int]:
    sizes = [int(s) for s in sizes]
    if -1 in sizes:
        known = 1
        for s in sizes:
            if s != -1:
                known *= s
        sizes[sizes.index(-1)] = numel // known if known else 0
    return sizes


def _sizes_arg(args: tuple, kwargs: dict, position: int, name: str) -> list[int] | None:
    rest = args[position:]
    if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)):
        rest = tuple(rest[0])
    if not rest and name in kwargs:
        rest = tuple(kwargs[name])
    if not all(isinstance(s, int) for s in rest):
        return None
    return list(rest)


def reshape(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``reshape`` / ``view`` / ``flatten`` / ``unflatten`` / ``view_as`` / ``reshape_as``.

    Local when every dim up to the last sharded one keeps its length (the reshape acts on
    trailing dims only); the target sizes of those dims are then taken locally.
    """
    x = args[0]
    shape = _shapes(args, kwargs)[0]
    name = _name(func)
    numel = 1
    for s in shape:
        numel *= s
    last = _last_sharded_dim(x)
    leading = DimMap(lambda k, d: d if k == 0 and d <= last else None)
    if name in ("view", "reshape"):
        sizes = _sizes_arg(args, kwargs, 1, "shape")
        if sizes is None:
            return NotImplemented
        target = _resolve(sizes, numel)
    elif name in ("view_as", "reshape_as"):
        other = _arg(args, kwargs, 1, ("other",), None)
        same = torch.Tensor.view if name == "view_as" else torch.Tensor.reshape
        return reshape(same, (x, *blockwise.shape_of(other)), {})
    elif name == "flatten":
        start = _arg(args, kwargs, 1, ("start_dim",), 0) % max(len(shape), 1)
        return _run(func, args, kwargs, leading) if start > last else NotImplemented
    elif name == "unflatten":
        dim = _arg(args, kwargs, 1, ("dim",), None)
        if not isinstance(dim, int) or dim % len(shape) <= last:
            return NotImplemented
        return _run(func, args, kwargs, leading)
    else:
        return NotImplemented
    if list(target[: last + 1]) != list(shape[: last + 1]):
        return _reshape_around_sharded(func, args, kwargs, shape, target)

    def local_func(local: torch.Tensor, *rest: Any, **_: Any) -> torch.Tensor:
        local_target = list(local.shape[: last + 1]) + list(target[last + 1 :])
        if name == "reshape":
            return local.reshape(local_target)
        return local.view(local_target)

    return _run(func, args, kwargs, leading, local_func=local_func)


def _prefix(sizes: Sequence[int], end: int) -> int:
    out = 1
    for n in sizes[:end]:
        out *= n
    return out


def _reshape_around_sharded(
    func: Callable, args: tuple, kwargs: dict, shape: Sequence[int], target: Sequence[int]
) -> Any:
    """A reshape that keeps every sharded dim whole and in order (local, no communication).

    The dims before, between and after the sharded dims may be merged or split
    (``[1, 1, N] -> [1, N]``, ``[B M, A, 3] -> [B, M, A, 3]``) as long as each sharded
    dim ``d`` of length ``n`` becomes a target dim ``d'`` of length ``n`` with as many
    elements before it (``prod(shape[:d]) == prod(target[:d'])``).
    """
    x = args[0]
    sharded = sorted({p.dim for p in getattr(x, "placements", ()) if p.is_shard()})
    if not sharded:
        return NotImplemented
    moved: dict[int, int] = {}
    start = 0
    for d in sharded:
        before = _prefix(shape, d)
        found = next(
            (
                t
                for t in range(start, len(target))
                if target[t] == shape[d] and _prefix(target, t) == before
            ),
            None,
        )
        if found is None:
            return NotImplemented
        moved[d], start = found, found + 1

    def local_func(local: torch.Tensor, *rest: Any, **_: Any) -> torch.Tensor:
        local_target = list(target)
        for d, t in moved.items():
            local_target[t] = local.shape[d]
        if _name(func) == "view":
            return local.view(local_target)
        return local.reshape(local_target)

    dims = DimMap(lambda k, d: moved.get(d) if k == 0 else None)
    return _run(func, args, kwargs, dims, local_func=local_func)


def expand(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``expand`` / ``expand_as`` / ``broadcast_to``: unit dims grow; sharded dims keep size."""
    shape = _shapes(args, kwargs)[0]
    name = _name(func)
    if name == "expand_as":
        return expand(torch.Tensor.expand, (args[0], *blockwise.shape_of(args[1])), {})
    else:
        sizes = _sizes_arg(args, kwargs, 1, "size" if name == "expand" else "shape")
        if sizes is None:
            return NotImplemented
        target = sizes
    lead = len(target) - len(shape)
    if lead < 0:
        return NotImplemented

    def local_func(local: torch.Tensor, *rest: Any, **_: Any) -> torch.Tensor:
        sizes = [-1 if d >= lead and shape[d - lead] == t else t for d, t in enumerate(target)]
        return local.expand(sizes)

    return _run(
        func, args, kwargs, DimMap(lambda k, d: d + lead if k == 0 else None), local_func=local_func
    )


# -- indexing and joining --------------------------------------------------------------------


def _is_full(entry: slice, length: int) -> bool:
    start, stop, step = entry.start, entry.stop, entry.step
    return (
        (start is None or start == 0)
        and (stop is None or (isinstance(stop, int) and stop >= length))
        and (step is None or step == 1)
    )


def _consumed(entry: Any) -> int:
    """How many input dims one index entry consumes."""
    if entry is None:
        return 0
    if isinstance(entry, torch.Tensor) and entry.dtype == torch.bool:
        return entry.ndim
    return 1


def _slice_bounds(entry: slice, length: int) -> tuple[int, int] | None:
    """``(start, stop)`` of a step-1 slice with integer (or absent) bounds, else ``None``."""
    if entry.step not in (None, 1):
        return None
    if not all(b is None or isinstance(b, int) for b in (entry.start, entry.stop)):
        return None
    start, stop, _ = entry.indices(length)
    return start, max(start, stop)


def _parts(sizes: Sequence[int], start: int, stop: int) -> tuple[int, ...]:
    """Each block's part of the range ``[start, stop)`` of consecutive blocks of ``sizes``."""
    out, offset = [], 0
    for n in sizes:
        out.append(max(0, min(stop, offset + n) - max(start, offset)))
        offset += n
    return tuple(out)


def getitem(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``x[key]`` with basic indexing (and advanced indices after every sharded dim).

    A step-1 slice of a sharded dim keeps, on each rank, its part of the slice: the result
    is sharded with the parts as blocks (some may be empty), with no communication.
    """
    if len(args) != 2 or kwargs:
        return NotImplemented
    x = args[0]
    shape = _shapes(args, kwargs)[0]
    key = args[1] if isinstance(args[1], tuple) else (args[1],)
    if any(e is Ellipsis for e in key):
        at = key.index(Ellipsis)
        consumed = sum(_consumed(e) for e in key if e is not Ellipsis)
        key = key[:at] + (slice(None),) * (len(shape) - consumed) + key[at + 1 :]
    sharded = {p.dim: m for m, p in enumerate(getattr(x, "placements", ())) if p.is_shard()}
    mapping: dict[int, int | None] = {}
    ranges: dict[int, tuple[int, int]] = {}
    slots: dict[int, int] = {}
    i = o = 0
    advanced = False
    for slot, entry in enumerate(key):
        if advanced:
            if entry is None or isinstance(entry, torch.Tensor):
                return NotImplemented
            mapping[i] = None
            i += 1
            continue
        if entry is None:
            o += 1
        elif isinstance(entry, bool):
            return NotImplemented
        elif isinstance(entry, int):
            mapping[i] = None
            i += 1
        elif isinstance(entry, slice):
            bounds = None if _is_full(entry, shape[i]) else _slice_bounds(entry, shape[i])
            if _is_full(entry, shape[i]) or (bounds is not None and i in sharded):
                mapping[i] = o
                if bounds is not None:
                    ranges[i], slots[i] = bounds, slot
            else:
                mapping[i] = None
            i += 1
            o += 1
        elif isinstance(entry, torch.Tensor):
            advanced = True
            for _ in range(_consumed(entry)):
                mapping[i] = None
                i += 1
        else:
            return NotImplemented
    for d in range(i, len(shape)):
        mapping[d] = None if advanced else o + (d - i)

    def out_dim(k: int, d: int) -> int | None:
        return mapping.get(d) if k == 0 else None

    if not ranges:
        return _run(func, args, kwargs, DimMap(out_dim))

    def resized(k: int, d: int, sizes: tuple[int, ...]) -> tuple[int, ...]:
        return _parts(sizes, *ranges[d]) if k == 0 and d in ranges else sizes

    def local_func(local: torch.Tensor, local_key: Any) -> Any:
        entries = list(local_key if isinstance(local_key, tuple) else (local_key,))
        for d, (start, stop) in ranges.items():
            mesh_dim = sharded[d]
            sizes = blockwise.block_sizes(x, mesh_dim)
            k = int(x.device_mesh.get_coordinate()[mesh_dim])
            offset = sum(sizes[:k])
            low = min(max(start - offset, 0), sizes[k])
            entries[slots[d]] = slice(low, low + _parts(sizes, start, stop)[k])
        return local[tuple(entries)]

    dims = DimMap(out_dim, resized=resized)
    return _run(func, (x, key), {}, dims, local_func=local_func)


def cat(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``torch.cat(tensors, dim)``: reads along ``dim``; the operands must be co-sharded."""
    ndim = max(len(s) for s in _shapes(args, kwargs))
    dim = _arg(args, kwargs, 1, ("dim", "axis"), 0) % ndim
    return _run(func, args, kwargs, DimMap(lambda k, d: None if d == dim else d))


def stack(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``torch.stack(tensors, dim)``: a new dim at ``dim``."""
    ndim = max(len(s) for s in _shapes(args, kwargs))
    at = _arg(args, kwargs, 1, ("dim",), 0) % (ndim + 1)
    return _run(func, args, kwargs, DimMap(lambda k, d: d if d < at else d + 1))


def split(removes_dim: bool, position: int, default: Any = 0) -> Handler:
    """``chunk`` / ``split`` / ``narrow`` (``dim`` kept) or ``unbind`` / ``select`` (removed)."""

    def handler(func: Callable, args: tuple, kwargs: dict) -> Any:
        ndim = len(_shapes(args, kwargs)[0])
        dim = _arg(args, kwargs, position, ("dim",), default)
        if not isinstance(dim, int):
            return NotImplemented
        dim %= ndim

        def out_dim(k: int, d: int) -> int | None:
            if k != 0 or d == dim:
                return None
            return d - 1 if removes_dim and d > dim else d

        return _run(func, args, kwargs, DimMap(out_dim))

    return handler


def one_hot(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``F.one_hot(x, num_classes)`` with an explicit ``num_classes``: a new last dim."""
    classes = _arg(args, kwargs, 1, ("num_classes",), -1)
    if not isinstance(classes, int) or classes < 0:
        return NotImplemented
    return _run(func, args, kwargs, DimMap(lambda k, d: d if k == 0 else None))


def embedding(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``F.embedding(indices, table)``: one table row per local index, a new last dim.

    The table is a plain (replicated) parameter; each rank looks up its own indices, so
    the result keeps the indices' blocks (a pair tile of bond types gives a pair tile).
    ``max_norm`` renormalises the table in place from the looked-up rows: refused here.
    """
    if _arg(args, kwargs, 3, ("max_norm",), None) is not None:
        return NotImplemented
    return _run(func, args, kwargs, DimMap(lambda k, d: d if k == 0 else None))


def repeat_interleave(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``repeat_interleave(repeats, dim)`` with an integer ``repeats``: reads along ``dim``."""
    repeats = _arg(args, kwargs, 1, ("repeats",), None)
    dim = _arg(args, kwargs, 2, ("dim",), None)
    if not isinstance(repeats, int) or not isinstance(dim, int):
        return NotImplemented
    ndim = len(_shapes(args, kwargs)[0])
    dim %= ndim
    return _run(func, args, kwargs, DimMap(lambda k, d: d if k == 0 and d != dim else None))


def cast_to_tensor(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``x.to(other)`` / ``x.type_as(other)``: the cast, without reading ``other``'s layout."""
    other = _arg(args, kwargs, 1, ("other",), None)
    if not isinstance(other, torch.Tensor) or len(args) > 2:
        return NotImplemented
    return elementwise(torch.Tensor.to, (args[0], other.dtype), {})


__all__ = [
    "along_dim",
    "binary_or_reduction",
    "cast_to_tensor",
    "cat",
    "einsum",
    "elementwise",
    "expand",
    "getitem",
    "layer_norm",
    "linear",
    "matmul",
    "one_hot",
    "embedding",
    "permutation",
    "reduction",
    "repeat_interleave",
    "reshape",
    "split",
    "squeeze",
    "stack",
    "unsqueeze",
]
