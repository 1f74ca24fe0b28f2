"""Scattered atom<->token maps in Boltz's own code: ``torch.bmm`` / ``matmul`` / ``einsum``.

:func:`~physicsnemo_foldcp.sharding.map_tags.tag_maps` (the scatter calls it) marks the
one-hot maps of a scattered sample (``atom_to_token``, ``token_to_rep_atom``,
``token_to_center_atom``, ``r_set_to_rep_atom``, dense or index layout) with a
:class:`~physicsnemo_foldcp.core.tags.MapTag`. With the tag, Boltz's serial
expressions run on the local co-sharded blocks, with **no communication** in forward or
backward (``a2t`` is ``atom_to_token``, ``t2r`` is ``token_to_rep_atom``):

* ``torch.bmm(a2t, s)``, ``torch.matmul(a2t, s)``, ``a2t @ s``, ``a2t.bmm(s)``: the
  :func:`~physicsnemo_foldcp.ops.tokens_to_atoms` computation;
* ``torch.bmm(t2r, x)`` (also the center-atom and r-set maps): the
  :func:`~physicsnemo_foldcp.ops.representative_atoms` computation;
* ``torch.bmm((a2t / (a2t.sum(1, keepdim=True) + eps)).transpose(1, 2), q)``: the
  :func:`~physicsnemo_foldcp.ops.atoms_to_tokens_mean` computation;
* ``torch.einsum`` with two operands, one of them a map, contracting either map axis with
  the row axis of the other: ``"bat,btc->bac"``, ``"bat,bac->btc"``, ``"bta,btc->bac"``
  (any letters; unbatched ``"at,tc->ac"``);
* ``torch.mm`` / ``torch.matmul`` of unbatched 2-D maps.

The right operand must be a ShardTensor ``(Shard(1), Replicate())`` whose row blocks are
the blocks of the contracted map axis (what the scatter gives every token/atom feature).

The tag survives, computed locally: dtype casts (``.float()``, ``.to(dtype)``),
``detach``, ``clone``, ``contiguous``; unit dims before the map's axes (``.unsqueeze(0)``,
``[None]`` on an unbatched map); swapping the map's two axes (``transpose``,
``swapaxes``, ``permute``, ``.mT``, ``.t()``, ``.T``); multiplying or dividing by a number
or by a tensor that broadcasts over the map and is replicated, or row-sharded like the map
axis it spans (Boltz's normalization). ``map.sum(dim)`` over either map axis is local too
and returns the sums row-sharded ``(Shard, Replicate)``, not ``Partial``.

Refused with :class:`~physicsnemo_foldcp.ops.ShardingLayoutError` instead of silently
all-gathering: a right operand laid out otherwise; the map as the right operand; an index
map in a product; a map that requires grad; and a product with a tensor derived from a map
by an op the plugin cannot follow (``view``, ``reshape``, indexing, ``+``), e.g. Boltz's
windowed ``einsum("bijd,bwki,bwlj->bwkld", z, a2t_queries, a2t_keys)``. Every other use of
a map is an ordinary op on a FoldTensor (:mod:`physicsnemo_foldcp.dispatch.rules`).

The rules here are rows of the rule table; they return ``NotImplemented`` for calls that
are not of their form.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import torch
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate, Shard

from physicsnemo_foldcp.core.blocks import (
    COLUMNS,
    ROWS,
    ShardingLayoutError,
    coordinate,
    describe,
    local_of,
    mesh_sizes,
    row_shapes,
)
from physicsnemo_foldcp.core.compat import global_shape, local_tensor, sharding_shapes
from physicsnemo_foldcp.core.tags import MapTag
from physicsnemo_foldcp.core.tensor import (
    DERIVE,
    KEEP_TAG,
    FoldTensor,
    Rule,
    map_tag,
    register_result_hook,
    register_rules,
    tag_of,
    wrap,
)
from physicsnemo_foldcp.dispatch.rules import CONTRACTION_FUNCS, SWAP_FUNCS
from physicsnemo_foldcp.ops.atom_token import contract_columns, contract_rows

SUPPORTED_FORMS = (
    "torch.bmm / torch.matmul / torch.mm / Tensor.bmm / @ with the map as LEFT operand and "
    "a row-sharded right operand (contracting either map axis, e.g. bmm(a2t, s), "
    "bmm(t2r, x), bmm(a2t_normalized.transpose(1, 2), q)); torch.einsum with two operands, "
    "one of them the map, of the forms 'bij,bjc->bic' / 'bji,bjc->bic' (any letters, or "
    "unbatched 'ij,jc->ic'); and the functions tokens_to_atoms, atoms_to_tokens_mean, "
    "representative_atoms"
)
"""The map products that run distributed (also listed in this module's docstring)."""


def _unsupported(what: str, tag: MapTag | None) -> ShardingLayoutError:
    name = f"the scattered map {tag.name!r}" if tag is not None else "a scattered map"
    return ShardingLayoutError(
        f"{what} is not supported on {name} under context parallelism (it would need other "
        f"ranks' blocks of the map). Supported: {SUPPORTED_FORMS}"
    )


# -- rules that keep a map's tag -------------------------------------------------------------


KEEP_TAG_FUNCS: tuple[Callable, ...] = tuple(
    getattr(torch.Tensor, name)
    for name in (
        "float", "double", "half", "bfloat16", "long", "int", "short", "bool", "to",
        "detach", "clone", "contiguous", "repeat_interleave",
    )
) + (torch.repeat_interleave,)  # fmt: skip
"""Ops after which a tagged tensor keeps its tag (computed locally, no communication).

``repeat_interleave`` qualifies here only when it keeps the shape (``repeats=1``), a copy;
:func:`keep_tag_rule` declines any call that changes the local shape. Repeats along the
batch dim (Boltz's ``atom_to_token.repeat_interleave(multiplicity, 0)`` for diffusion
samples) are :func:`repeat_batch_rule`'s."""


def keep_tag_rule(func: Callable, args: tuple, kwargs: dict):
    """Casts, copies, shape-keeping ``repeat_interleave`` of a tagged tensor: same tag."""
    x = args[0] if args else None
    tag = tag_of(x)
    others = list(args[1:]) + list(kwargs.values())
    if tag is None or any(isinstance(v, torch.Tensor) for v in others):
        return NotImplemented
    local = local_tensor(x) if func is torch.Tensor.detach else local_of(x)
    new = func(local, *args[1:], **kwargs)
    if not isinstance(new, torch.Tensor) or new.shape != local.shape or new.device != local.device:
        return NotImplemented
    shapes = {k: list(v) for k, v in sharding_shapes(x).items()}
    return wrap(new, x.device_mesh, x.placements, shapes, tag)


REPEAT_FUNCS = (torch.Tensor.repeat_interleave, torch.repeat_interleave)
"""``repeat_interleave``: of a map along a dim that is neither of its axes, the tag stays."""


def repeat_batch_rule(func: Callable, args: tuple, kwargs: dict):
    """``map.repeat_interleave(M, dim)`` along a leading dim (the batch): same tag, no comm.

    Boltz repeats ``atom_to_token`` over the ``M`` diffusion samples; the copies keep the
    blocks of the map, so they keep its tag (every sharding shape's ``dim`` grows ``M``
    fold). Declined for a tensor ``repeats``, no ``dim``, or a ``dim`` that is one of the
    map's axes.
    """
    x = args[0] if args else None
    tag = map_tag(x)
    if tag is None:
        return NotImplemented
    repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    if not isinstance(repeats, int) or isinstance(repeats, bool) or not isinstance(dim, int):
        return NotImplemented
    if set(kwargs) - {"repeats", "dim"}:
        return NotImplemented
    ndim = len(global_shape(x))
    dim = dim % ndim
    if dim in (tag.sharded_dim, tag.block_dim):
        return NotImplemented
    local = local_of(x).repeat_interleave(repeats, dim)
    shapes = {
        k: [tuple(n * repeats if d == dim else n for d, n in enumerate(s)) for s in v]
        for k, v in sharding_shapes(x).items()
    }
    return wrap(local, x.device_mesh, x.placements, shapes, tag)


UNSQUEEZE_FUNCS = (torch.Tensor.unsqueeze, torch.unsqueeze, torch.Tensor.__getitem__)
"""Ops that insert unit dims; before a map's two axes they keep its tag (shifted)."""


def _leading_units(func: Callable, args: tuple, kwargs: dict, ndim: int) -> int | None:
    """How many unit dims the call inserts before every existing dim, or ``None``."""
    if func is torch.Tensor.__getitem__:
        key = args[1] if len(args) == 2 and isinstance(args[1], tuple) else args[1:]
        leading = 0
        while leading < len(key) and key[leading] is None:
            leading += 1
        rest = key[leading:]
        full = slice(None)
        if not leading or any(e is not Ellipsis and e != full for e in rest):
            return None
        return leading
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    return 1 if isinstance(dim, int) and dim % (ndim + 1) == 0 else None


def unsqueeze_rule(func: Callable, args: tuple, kwargs: dict):
    """``map.unsqueeze(0)`` / ``map[None]`` of an unbatched map: the tag shifts, no comm."""
    x = args[0] if args else None
    tag = map_tag(x)
    if tag is None:
        return NotImplemented
    ndim = len(global_shape(x))
    units = _leading_units(func, args, kwargs, ndim)
    if not units:
        return NotImplemented
    local = local_of(x).reshape((1,) * units + tuple(local_tensor(x).shape))
    shapes = {k: [(1,) * units + tuple(s) for s in v] for k, v in sharding_shapes(x).items()}
    placements = (Shard(tag.sharded_dim + units), Replicate())
    return wrap(local, x.device_mesh, placements, shapes, tag.shifted(units))


def _dims_of_swap(func: Callable, args: tuple, kwargs: dict, ndim: int) -> tuple[int, int] | None:
    """The two tensor dims a transposing call swaps, or ``None`` if it is not a swap."""
    if func == torch.Tensor.mT.__get__:
        return ndim - 2, ndim - 1
    if func in (torch.Tensor.t, torch.t, torch.Tensor.T.__get__):
        return (0, 1) if ndim == 2 else None
    if func in (torch.Tensor.permute, torch.permute):
        order = args[1:] if len(args) > 2 else args[1] if len(args) > 1 else kwargs.get("dims")
        order = [int(d) % ndim for d in order]
        moved = [d for d, o in enumerate(order) if d != o]
        if len(moved) == 2 and order[moved[0]] == moved[1]:
            return moved[0], moved[1]
        return None
    values = list(args[1:3]) + [
        kwargs[k] for k in ("dim0", "dim1", "axis0", "axis1") if k in kwargs
    ]
    if len(values) != 2:
        return None
    return int(values[0]) % ndim, int(values[1]) % ndim


def swap_rule(func: Callable, args: tuple, kwargs: dict):
    """Swapping a map's two axes (``transpose``, ``permute``, ``mT``, ``t``): the tag swaps."""
    x = args[0]
    tag = map_tag(x)
    if tag is None or tag.layout != "dense":
        return NotImplemented
    ndim = len(global_shape(x))
    dims = _dims_of_swap(func, args, kwargs, ndim)
    if dims is None or set(dims) != {tag.sharded_dim, tag.block_dim}:
        return NotImplemented
    d0, d1 = dims
    new_tag = tag.transposed(d0, d1)
    local = local_of(x).transpose(d0, d1)

    def swapped(shape: tuple[int, ...]) -> tuple[int, ...]:
        out = list(shape)
        out[d0], out[d1] = out[d1], out[d0]
        return tuple(out)

    shapes = {ROWS: [swapped(s) for s in sharding_shapes(x)[ROWS]]}
    return wrap(local, x.device_mesh, (Shard(new_tag.sharded_dim), Replicate()), shapes, new_tag)


def _sum_arguments(args: tuple, kwargs: dict) -> tuple[Any, bool, Any] | None:
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    extra = set(kwargs) - {"dim", "keepdim", "dtype"}
    if dim is None or extra or isinstance(dim, torch.dtype):
        return None
    if isinstance(dim, (tuple, list)):
        if len(dim) != 1:
            return None
        dim = dim[0]
    return int(dim), bool(keepdim), kwargs.get("dtype")


def sum_rule(func: Callable, args: tuple, kwargs: dict):
    """``map.sum(axis)`` over either map axis: local row-sharded sums (never ``Partial``)."""
    x = args[0]
    tag = map_tag(x)
    parsed = _sum_arguments(args, kwargs)
    if tag is None or tag.layout != "dense" or tag.derived_by or parsed is None:
        return NotImplemented
    dim, keepdim, dtype = parsed
    ndim = len(global_shape(x))
    dim %= ndim
    if dim not in (tag.sharded_dim, tag.block_dim):
        return NotImplemented
    local = local_of(x)
    mesh = x.device_mesh
    if dim == tag.block_dim:
        kept, sizes = tag.sharded_dim, mesh_sizes(x, ROWS, tag.sharded_dim)
    else:
        i, _ = coordinate(mesh)
        start, length = tag.column_block(i)
        local = local.narrow(tag.block_dim, start, length)
        kept, sizes = tag.block_dim, list(tag.block_sizes)
    out_local = local.sum(dim, keepdim=keepdim, dtype=dtype)
    if not keepdim and dim < kept:
        kept -= 1
    return wrap(
        out_local, mesh, (Shard(kept), Replicate()), row_shapes(out_local.shape, kept, sizes)
    )


MUL_FUNCS = (torch.Tensor.mul, torch.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__)
DIV_FUNCS = (
    torch.Tensor.div,
    torch.div,
    torch.Tensor.true_divide,
    torch.true_divide,
    torch.Tensor.__truediv__,
)


def _factor_part(
    other: Any, m: ShardTensor, tag: MapTag, rows: tuple[int, int], columns: tuple[int, int]
) -> torch.Tensor | float | None:
    """``other``'s values on this rank's (rows, column block) of the map, or ``None``."""
    if isinstance(other, (int, float, bool)):
        return other
    if not isinstance(other, torch.Tensor):
        return None
    if isinstance(other, (ShardTensor, DTensor)):
        placements = tuple(other.placements)
        if any(p.is_partial() for p in placements) or not isinstance(
            placements[COLUMNS], Replicate
        ):
            return None
        local = local_tensor(other)
        o_shape = (
            tuple(int(s) for s in other.shape)
            if isinstance(other, DTensor)
            else global_shape(other)
        )
        row_placement = placements[ROWS]
    else:
        local, o_shape, row_placement = other, tuple(other.shape), Replicate()
    if other.requires_grad and isinstance(other, (ShardTensor, DTensor)):
        local = local_of(other) if isinstance(other, ShardTensor) else other.to_local()
    m_shape = global_shape(m)
    lead = len(m_shape) - len(o_shape)
    if lead < 0:
        return None
    for d, size in enumerate(o_shape):
        md = d + lead
        if size == 1:
            if isinstance(row_placement, Shard) and row_placement.dim == d:
                return None
            continue
        if size != m_shape[md]:
            return None
        sharded_here = isinstance(row_placement, Shard) and row_placement.dim == d
        if md == tag.sharded_dim:
            if sharded_here:
                if mesh_sizes(other, ROWS, d) != mesh_sizes(m, ROWS, tag.sharded_dim):
                    return None
            else:
                local = local.narrow(d, *rows)
        elif md == tag.block_dim:
            if sharded_here:
                if mesh_sizes(other, ROWS, d) != list(tag.block_sizes):
                    return None
            else:
                local = local.narrow(d, *columns)
        elif sharded_here:
            return None
    return local


def scale_rule(func: Callable, args: tuple, kwargs: dict):
    """``map * factor`` / ``map / factor`` (Boltz's normalisation): same blocks, same tag."""
    if len(args) != 2 or set(kwargs) - {"out"} or "out" in kwargs:
        return NotImplemented
    first, second = args
    divide = func in DIV_FUNCS
    if map_tag(first) is not None:
        m, other, map_first = first, second, True
    elif map_tag(second) is not None and not divide:
        m, other, map_first = second, first, False
    else:
        return NotImplemented
    tag = map_tag(m)
    if tag.layout != "dense" or tag.derived_by or map_tag(other) is not None:
        return NotImplemented
    mesh = m.device_mesh
    i, _ = coordinate(mesh)
    row_sizes = mesh_sizes(m, ROWS, tag.sharded_dim)
    rows = (int(sum(row_sizes[:i])), int(row_sizes[i]))
    columns = tag.column_block(i)
    part = _factor_part(other, m, tag, rows, columns)
    if part is None:
        return NotImplemented
    local = local_of(m)
    start, length = columns
    block = local.narrow(tag.block_dim, start, length)
    result = func(block, part) if map_first else func(part, block)
    total = local.shape[tag.block_dim]
    pieces = []
    if start:
        shape = list(result.shape)
        shape[tag.block_dim] = start
        pieces.append(result.new_zeros(shape))
    pieces.append(result)
    if total - start - length:
        shape = list(result.shape)
        shape[tag.block_dim] = total - start - length
        pieces.append(result.new_zeros(shape))
    out_local = torch.cat(pieces, dim=tag.block_dim) if len(pieces) > 1 else result
    if tuple(out_local.shape) != tuple(local.shape):
        return NotImplemented
    shapes = {k: list(v) for k, v in sharding_shapes(m).items()}
    return wrap(out_local, mesh, m.placements, shapes, tag)


def mark_derived(func: Callable, args: tuple, kwargs: dict, result: Any) -> Any:
    """Results of ops without a rule that carry a whole map's data keep a 'derived' tag."""
    if func in CONTRACTION_FUNCS:
        return result
    sources = [a for a in args if map_tag(a) is not None]
    sources += [a for v in args if isinstance(v, (list, tuple)) for a in v if map_tag(a)]
    if not sources:
        return result
    source = sources[0]
    tag = map_tag(source)
    numel = math.prod(global_shape(source))
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or str(func)

    def mark(r: Any) -> None:
        if isinstance(r, FoldTensor) and tag_of(r) is None and math.prod(global_shape(r)) == numel:
            r.foldcp_tag = tag.derived(name)

    if isinstance(result, (tuple, list)):
        for r in result:
            mark(r)
    else:
        mark(result)
    return result


# -- products with a map ---------------------------------------------------------------------


def _contract(m: ShardTensor, x: Any, contracted: int, op: str, m_arg: str = "map") -> ShardTensor:
    """``m`` contracted over its tensor dim ``contracted`` with ``x``'s rows."""
    tag = map_tag(m)
    if tag.derived_by is not None:
        raise _unsupported(f"{op} on a tensor derived from it by {tag.derived_by}", tag)
    if tag.layout != "dense":
        raise _unsupported(f"{op} with the index layout (use tokens_to_atoms & co.)", tag)
    if not isinstance(x, ShardTensor):
        raise _unsupported(
            f"{op} with a right operand that is not a ShardTensor ({describe(x)})", tag
        )
    if contracted == tag.block_dim:
        if tag.block_dim != len(global_shape(m)) - 1:
            m = m.transpose(tag.sharded_dim, tag.block_dim)
        return contract_rows(m, x, op, m_arg, "the right operand", cast=False)
    return contract_columns(m, x, op, m_arg, "the right operand", cast=False)


def _route_product(func: Callable, args: tuple, kwargs: dict) -> ShardTensor:
    op = f"torch.{getattr(func, '__name__', func)}"
    if kwargs:
        raise _unsupported(f"{op} with keyword arguments {sorted(kwargs)}", map_tag(args[0]))
    if len(args) != 2:
        raise _unsupported(f"{op} with {len(args)} operands", None)
    m, x = args
    if map_tag(m) is None:
        raise _unsupported(f"{op} with the map as the right operand ({describe(x)})", map_tag(x))
    if map_tag(x) is not None:
        raise _unsupported(f"{op} of two maps", map_tag(m))
    m_dims, x_dims = len(global_shape(m)), len(x.shape)
    need = {torch.bmm: 3, torch.Tensor.bmm: 3, torch.mm: 2, torch.Tensor.mm: 2}.get(func)
    if m_dims != x_dims or (need is not None and m_dims != need) or m_dims not in (2, 3):
        raise _unsupported(f"{op} of a {m_dims}-D map with a {x_dims}-D operand", map_tag(m))
    return _contract(m, x, m_dims - 1, op)


_EQUATION = re.compile(r"^([a-zA-Z]+),([a-zA-Z]+)->([a-zA-Z]+)$")


def _route_einsum(args: tuple, kwargs: dict) -> ShardTensor:
    equation = args[0]
    operands = (
        list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
    )
    tags = [map_tag(o) for o in operands]
    first_tag = next((t for t in tags if t is not None), None)
    op = f"torch.einsum({equation!r})"
    match = _EQUATION.match(equation.replace(" ", "")) if isinstance(equation, str) else None
    if kwargs or match is None or len(operands) != 2 or all(tags):
        raise _unsupported(f"{op} with {len(operands)} operand(s)", first_tag)
    k = 0 if tags[0] is not None else 1
    m, x = operands[k], operands[1 - k]
    m_sub, x_sub, out_sub = match.group(1 + k), match.group(2 - k), match.group(3)
    if not (
        len(m_sub) == len(x_sub) == len(out_sub) == len(global_shape(m)) and len(m_sub) in (2, 3)
    ):
        raise _unsupported(op, first_tag)
    batch = m_sub[:-2]
    contracted, feature = x_sub[-2], x_sub[-1]
    if (
        x_sub[:-2] != batch
        or contracted not in m_sub[-2:]
        or feature in m_sub
        or len(set(m_sub)) != len(m_sub)
        or len(set(x_sub)) != len(x_sub)
    ):
        raise _unsupported(op, first_tag)
    kept = m_sub[-2] if contracted == m_sub[-1] else m_sub[-1]
    if out_sub != batch + kept + feature:
        raise _unsupported(op, first_tag)
    return _contract(m, x, m_sub.index(contracted), op)


def contraction_rule(func: Callable, args: tuple, kwargs: dict):
    """``bmm`` / ``matmul`` / ``mm`` / ``@`` / ``einsum`` with a tagged map: local, or refused."""
    if func is torch.einsum:
        operands = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
        if not any(map_tag(o) is not None for o in operands):
            return NotImplemented
        return _route_einsum(args, kwargs)
    if not any(map_tag(a) is not None for a in args):
        return NotImplemented
    return _route_product(func, args, kwargs)


register_rules(
    Rule(KEEP_TAG, KEEP_TAG_FUNCS, keep_tag_rule, "casts/copies of a map or view"),
    Rule(DERIVE, REPEAT_FUNCS, repeat_batch_rule, "repeats of a map along the batch dim"),
    Rule(DERIVE, SWAP_FUNCS, swap_rule, "swapping a map's axes swaps its tag"),
    Rule(DERIVE, UNSQUEEZE_FUNCS, unsqueeze_rule, "unit dims before a map's axes"),
    Rule(DERIVE, (torch.sum, torch.Tensor.sum), sum_rule, "map.sum(axis): row-sharded local sums"),
    Rule(DERIVE, MUL_FUNCS + DIV_FUNCS, scale_rule, "map * / factor: same tag"),
    Rule(DERIVE, CONTRACTION_FUNCS + (torch.Tensor.__rmatmul__,), contraction_rule,
         "products with a map: local, or refused"),
)  # fmt: skip
register_result_hook(mark_derived)


__all__ = [
    "SUPPORTED_FORMS",
    "contraction_rule",
    "keep_tag_rule",
    "repeat_batch_rule",
    "mark_derived",
    "scale_rule",
    "sum_rule",
    "swap_rule",
    "unsqueeze_rule",
]
