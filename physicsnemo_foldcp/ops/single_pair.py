"""single -> pair ops: outer sum, relative-position encoding, pair distances, broadcast views.

A pair tile ``(Shard(1), Shard(2))`` on rank ``(i, j)`` needs the rows of row block ``i``
of one single (local: singles are ``(Shard(1), Replicate())``) and the entries of column
block ``j`` of another (held by other rows of the mesh). Every handler here therefore moves
exactly the column operand, through :class:`~physicsnemo_foldcp.core.blocks.RowsAndColumns`:

* forward: ONE ``all_gather_into_tensor`` over ``cp0`` of the column single ``O(N x C)``
  (none when ``cp0 == 1``);
* backward (only when an input requires grad): ONE ``reduce_scatter_tensor`` over ``cp0``
  (none when ``cp0 == 1``) and ONE ``all_reduce`` over ``cp1`` of the two singles'
  gradients together (none when ``cp1 == 1``).

Boltz's own expressions work too: ``s[:, :, None]`` / ``s.unsqueeze(2)`` and ``s[:, None, :]``
/ ``s[:, None]`` / ``s.unsqueeze(1)`` of a row-sharded single return broadcast *views*
(:class:`~physicsnemo_foldcp.core.tags.ViewTag`; correct ``(Shard, Replicate)`` ShardTensors
with no communication), and an elementwise op (``+ - * /``, comparisons, logical and bitwise
ops, ``maximum``, ``minimum``, ``pow``) between a rows view and a columns view returns the
pair tile through the same machinery, e.g. ``z = f(s)[:, :, None] + g(s)[:, None, :]`` and
``m[:, :, None] * m[:, None, :]``. ``torch.cdist(x1, x2)`` of two row-sharded ``[B, L, D]``
singles returns the tile as well (with the algorithm torch would pick for the full
matrix). Any other use of a view, or of these callables, is an ordinary op on a FoldTensor
(:mod:`physicsnemo_foldcp.dispatch.rules`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor.placement_types import Replicate, Shard
from torch.overrides import handle_torch_function, has_torch_function

from physicsnemo_foldcp.core.blocks import (
    COLUMNS,
    ROWS,
    RowsAndColumns,
    ShardingLayoutError,
    block,
    coordinate,
    describe,
    local_of,
    mesh_sizes,
    require_shard_tensor,
    row_dim,
    tile_shapes,
)
from physicsnemo_foldcp.core.compat import global_shape, local_tensor, sharding_shapes
from physicsnemo_foldcp.core.tags import ViewTag
from physicsnemo_foldcp.core.tensor import (
    DERIVE,
    Rule,
    register_own,
    register_rules,
    tag_of,
    view_tag,
    wrap,
)
from physicsnemo_foldcp.sharding.plan import column_block_sizes

RELPOS_KEYS = ("residue_index", "token_index", "asym_id", "entity_id", "sym_id")
"""Order of the token features of :func:`relative_position_encoding`."""

CDIST_DEFAULT_MODE = "use_mm_for_euclid_dist_if_necessary"
_MM_THRESHOLD = 25


def _rows_by_trailing(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``[*lead, L, *trail] -> [prod(lead), L, prod(trail)]`` (a view when possible)."""
    lead = math.prod(t.shape[:dim])
    trail = math.prod(t.shape[dim + 1 :])
    return t.reshape(lead, t.shape[dim], trail)


def pair_from_singles(
    a: ShardTensor,
    b: ShardTensor,
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    op: str,
    a_arg: str = "a",
    b_arg: str = "b",
    token_dim: int = 1,
) -> ShardTensor:
    """The pair tile ``fn(rows of a, columns of b)`` on every rank.

    Parameters
    ----------
    a, b : ShardTensor
        Singles ``[*B, L_a, ...]`` and ``[*B, L_b, ...]``, ``(Shard(token_dim),
        Replicate())`` over ``(cp0, cp1)``, with equal leading dims.
    fn : callable
        ``fn(rows, columns) -> tile`` on plain tensors: ``rows`` is ``a``'s local row block
        ``[*B, n_i, ...]``, ``columns`` is column block ``j`` of ``b`` ``[*B, m_j, ...]``;
        the tile must be ``[*B, n_i, m_j, ...]``.
    op, a_arg, b_arg : str
        Names for error messages.
    token_dim : int, default 1
        The singles' token axis.

    Returns
    -------
    ShardTensor
        ``[*B, L_a, L_b, ...]``, ``(Shard(token_dim), Shard(token_dim + 1))``; column blocks
        of ``b`` as the plan cuts them (the row blocks when ``cp0 == cp1``).

    Notes
    -----
    Communication: see the module docstring (one all-gather over ``cp0`` forward; one
    reduce-scatter over ``cp0`` and one all-reduce over ``cp1`` backward).
    """
    a = require_shard_tensor(a, op, a_arg)
    b = require_shard_tensor(b, op, b_arg)
    if a.device_mesh != b.device_mesh:
        raise ShardingLayoutError(f"{op}: {a_arg} and {b_arg} live on different meshes")
    row_dim(a, op, a_arg, expected=token_dim)
    row_dim(b, op, b_arg, expected=token_dim)
    a_shape, b_shape = global_shape(a), global_shape(b)
    if a_shape[:token_dim] != b_shape[:token_dim]:
        raise ShardingLayoutError(
            f"{op}: leading dims disagree: {a_arg} {tuple(a_shape)}, {b_arg} {tuple(b_shape)}"
        )
    mesh = a.device_mesh
    i, j = coordinate(mesh)
    a_sizes = mesh_sizes(a, ROWS, token_dim)
    b_sizes = mesh_sizes(b, ROWS, token_dim)
    col_sizes = column_block_sizes(b_sizes, mesh.size(COLUMNS))
    col_block = block(col_sizes, j)
    a_local, b_local = local_of(a), local_of(b)
    rows, columns = RowsAndColumns.apply(
        _rows_by_trailing(a_local, token_dim),
        _rows_by_trailing(b_local, token_dim),
        mesh,
        tuple(b_sizes),
        col_block,
    )
    rows = rows.reshape(a_local.shape)
    columns = columns.reshape(
        *b_local.shape[:token_dim], col_block[1], *b_local.shape[token_dim + 1 :]
    )
    tile = fn(rows, columns)
    shapes = tile_shapes(tile.shape, token_dim, a_sizes, col_sizes, (i, j))
    return wrap(tile, mesh, (Shard(token_dim), Shard(token_dim + 1)), shapes)


# -- outer sum -------------------------------------------------------------------------------


def _outer_sum_local(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a[:, :, None] + b[:, None, :]


def outer_sum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pair from two singles: ``a[:, :, None] + b[:, None, :]``.

    Parameters
    ----------
    a, b : torch.Tensor
        ``[B, N, ...]`` and ``[B, M, ...]`` with broadcastable trailing dims.
        Distributed: ``(Shard(1), Replicate())``.

    Returns
    -------
    torch.Tensor
        ``[B, N, M, ...]``. Distributed: the pair tile ``(Shard(1), Shard(2))``.

    Notes
    -----
    Communication: forward, ONE all-gather over ``cp0`` of ``b``'s row blocks; backward,
    ONE reduce-scatter over ``cp0`` and ONE all-reduce over ``cp1`` (module docstring).
    """
    if has_torch_function((a, b)):
        return handle_torch_function(outer_sum, (a, b), a, b)
    return _outer_sum_local(a, b)


def _outer_sum_handler(func, types, args, kwargs):
    a, b = args
    return pair_from_singles(a, b, _outer_sum_local, "outer_sum", "a", "b")


# -- relative position encoding --------------------------------------------------------------


def relpos_width(r_max: int = 32, s_max: int = 2) -> int:
    """Channels of :func:`relative_position_encoding`: ``4 (r_max + 1) + 2 (s_max + 1) + 1``."""
    return 4 * (r_max + 1) + 2 * (s_max + 1) + 1


def _relpos_local(
    rows: torch.Tensor,
    columns: torch.Tensor,
    r_max: int,
    s_max: int,
    fix_sym_check: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Boltz's relative-position features from stacked ids ``[B, n, 5]`` x ``[B, m, 5]``."""
    res_i, tok_i, asym_i, ent_i, sym_i = (v[:, :, None] for v in rows.unbind(-1))
    res_j, tok_j, asym_j, ent_j, sym_j = (v[:, None, :] for v in columns.unbind(-1))
    same_chain = asym_i == asym_j
    same_residue = res_i == res_j
    same_entity = ent_i == ent_j

    far = 2 * r_max + 1
    d_residue = torch.clip(res_i - res_j + r_max, 0, 2 * r_max)
    d_residue = torch.where(same_chain, d_residue, torch.full_like(d_residue, far))
    d_token = torch.clip(tok_i - tok_j + r_max, 0, 2 * r_max)
    d_token = torch.where(same_chain & same_residue, d_token, torch.full_like(d_token, far))
    d_chain = torch.clip(sym_i - sym_j + s_max, 0, 2 * s_max)
    other_chain = ~same_entity if fix_sym_check else same_chain
    d_chain = torch.where(other_chain, torch.full_like(d_chain, 2 * s_max + 1), d_chain)
    return torch.cat(
        [
            F.one_hot(d_residue.long(), 2 * r_max + 2).to(dtype),
            F.one_hot(d_token.long(), 2 * r_max + 2).to(dtype),
            same_entity.unsqueeze(-1).to(dtype),
            F.one_hot(d_chain.long(), 2 * s_max + 2).to(dtype),
        ],
        dim=-1,
    )


def relative_position_encoding(
    residue_index: torch.Tensor,
    token_index: torch.Tensor,
    asym_id: torch.Tensor,
    entity_id: torch.Tensor,
    sym_id: torch.Tensor,
    r_max: int = 32,
    s_max: int = 2,
    fix_sym_check: bool = False,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Boltz / AF3 relative-position features of every token pair (input of a Linear).

    Concatenates, along the last axis: one-hot ``clip(res_i - res_j + r_max, 0, 2 r_max)``
    (bin ``2 r_max + 1`` for different chains), one-hot
    ``clip(tok_i - tok_j + r_max, 0, 2 r_max)`` (bin ``2 r_max + 1`` unless same chain and
    same residue), the same-entity flag, and one-hot ``clip(sym_i - sym_j + s_max, 0,
    2 s_max)`` (bin ``2 s_max + 1`` for the same chain, or for different entities when
    ``fix_sym_check``), as Boltz's ``RelativePositionEncoder`` builds them.

    Parameters
    ----------
    residue_index, token_index, asym_id, entity_id, sym_id : torch.Tensor
        Integer ``[B, N]``. Distributed: ``(Shard(1), Replicate())``, co-sharded.
    r_max, s_max : int, default 32, 2
        Clipping of the residue/token and chain offsets.
    fix_sym_check : bool, default False
        Boltz's option: the chain bin marks different entities instead of the same chain.
    dtype : torch.dtype, default float32
        Dtype of the features.

    Returns
    -------
    torch.Tensor
        ``[B, N, N, 4 (r_max + 1) + 2 (s_max + 1) + 1]``. Distributed: the pair tile
        ``(Shard(1), Shard(2))``.

    Notes
    -----
    Communication: forward, ONE all-gather over ``cp0`` of the five stacked ``[B, N_i]``
    id rows; no backward (integer inputs).
    """
    ids = (residue_index, token_index, asym_id, entity_id, sym_id)
    if has_torch_function(ids):
        return handle_torch_function(
            relative_position_encoding,
            ids,
            *ids,
            r_max,
            s_max,
            fix_sym_check,
            dtype,
        )
    stacked = torch.stack([t.long() for t in ids], dim=-1)
    return _relpos_local(stacked, stacked, r_max, s_max, fix_sym_check, dtype)


def _relpos_handler(func, types, args, kwargs):
    *ids, r_max, s_max, fix_sym_check, dtype = args
    op = "relative_position_encoding"
    singles = [require_shard_tensor(t, op, name) for t, name in zip(ids, RELPOS_KEYS)]
    first = singles[0]
    row_dim(first, op, RELPOS_KEYS[0], expected=1)
    sizes = mesh_sizes(first, ROWS, 1)
    for t, name in zip(singles[1:], RELPOS_KEYS[1:]):
        row_dim(t, op, name, expected=1)
        if global_shape(t) != global_shape(first) or mesh_sizes(t, ROWS, 1) != sizes:
            raise ShardingLayoutError(
                f"{op}: {name} is not co-sharded with residue_index: {describe(t)} vs "
                f"{describe(first)}"
            )
    stacked_local = torch.stack([local_tensor(t).long() for t in singles], dim=-1)
    shapes = {ROWS: [tuple(s) + (len(ids),) for s in sharding_shapes(first)[ROWS]]}
    stacked = wrap(stacked_local, first.device_mesh, first.placements, shapes)

    def features(rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        return _relpos_local(rows, columns, r_max, s_max, fix_sym_check, dtype)

    return pair_from_singles(stacked, stacked, features, op, "ids", "ids")


# -- pair distances --------------------------------------------------------------------------


def _resolved_mode(compute_mode: str, p: float, rows: int, columns: int) -> str:
    """The algorithm torch would use for the whole ``rows x columns`` matrix."""
    if compute_mode != CDIST_DEFAULT_MODE or p != 2:
        return compute_mode
    if rows > _MM_THRESHOLD or columns > _MM_THRESHOLD:
        return "use_mm_for_euclid_dist"
    return "donot_use_mm_for_euclid_dist"


def pair_distances(
    x_rows: torch.Tensor,
    x_cols: torch.Tensor,
    compute_mode: str = "donot_use_mm_for_euclid_dist",
) -> torch.Tensor:
    """Euclidean distances between row and column points: ``torch.cdist(x_rows, x_cols)``.

    Parameters
    ----------
    x_rows, x_cols : torch.Tensor
        ``[B, N, D]`` and ``[B, M, D]`` (e.g. representative-atom coordinates).
        Distributed: ``(Shard(1), Replicate())``.
    compute_mode : str, default "donot_use_mm_for_euclid_dist"
        As in :func:`torch.cdist`. The default computes the differences directly, so a tile
        holds bitwise the values of the full matrix; ``"use_mm_for_euclid_dist_if_necessary"``
        picks the algorithm from the full matrix's size, on every tile.

    Returns
    -------
    torch.Tensor
        ``[B, N, M]``. Distributed: the pair tile ``(Shard(1), Shard(2))``.

    Notes
    -----
    Communication: forward, ONE all-gather over ``cp0`` of ``x_cols``; backward, ONE
    reduce-scatter over ``cp0`` and ONE all-reduce over ``cp1``.
    """
    if has_torch_function((x_rows, x_cols)):
        return handle_torch_function(pair_distances, (x_rows, x_cols), x_rows, x_cols, compute_mode)
    return torch.cdist(x_rows, x_cols, compute_mode=compute_mode)


def _pair_distances_handler(func, types, args, kwargs):
    x_rows, x_cols, compute_mode = args
    return _distributed_cdist(x_rows, x_cols, 2.0, compute_mode, "pair_distances")


def _distributed_cdist(
    x1: ShardTensor, x2: ShardTensor, p: float, compute_mode: str, op: str
) -> ShardTensor:
    x1 = require_shard_tensor(x1, op, "x1")
    x2 = require_shard_tensor(x2, op, "x2")
    mode = _resolved_mode(compute_mode, p, global_shape(x1)[-2], global_shape(x2)[-2])

    def distances(rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        return torch.cdist(rows, columns, p=p, compute_mode=mode)

    return pair_from_singles(x1, x2, distances, op, "x1", "x2")


def cdist_rule(func: Callable, args: tuple, kwargs: dict):
    """``torch.cdist(x1, x2)`` of two row-sharded ``[B, L, D]`` singles: the pair tile."""
    names = ("x1", "x2", "p", "compute_mode")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    x1, x2 = bound.get("x1"), bound.get("x2")
    if set(bound) - set(names) or not _is_plain_row_single(x1) or not _is_plain_row_single(x2):
        return NotImplemented
    if len(global_shape(x1)) != 3 or len(global_shape(x2)) != 3:
        return NotImplemented
    p = float(bound.get("p", 2.0))
    mode = bound.get("compute_mode", CDIST_DEFAULT_MODE) or CDIST_DEFAULT_MODE
    return _distributed_cdist(x1, x2, p, mode, "torch.cdist")


def _is_plain_row_single(x: Any) -> bool:
    if not isinstance(x, ShardTensor) or tag_of(x) is not None or x.device_mesh.ndim != 2:
        return False
    if sharding_shapes(x) is None:
        return False
    rows, columns = x.placements
    return (
        isinstance(rows, Shard)
        and isinstance(columns, Replicate)
        and (rows.dim == len(global_shape(x)) - 2)
    )


# -- broadcast views of singles --------------------------------------------------------------


def _view_kind(x: ShardTensor, key: Any) -> str | None:
    """``"rows"`` for ``x[:, :, None]``, ``"columns"`` for ``x[:, None]``, else ``None``."""
    rows, columns = x.placements
    if not isinstance(rows, Shard) or not isinstance(columns, Replicate):
        return None
    token = rows.dim
    ndim = len(global_shape(x))
    entries = list(key) if isinstance(key, tuple) else [key]
    full = slice(None)
    if any(
        not (e is None or e is Ellipsis or (isinstance(e, slice) and e == full)) for e in entries
    ):
        return None
    if sum(e is Ellipsis for e in entries) > 1 or sum(e is None for e in entries) != 1:
        return None
    if Ellipsis in entries:
        at = entries.index(Ellipsis)
        fill = ndim - (len(entries) - 2)
        if fill < 0:
            return None
        entries = entries[:at] + [full] * fill + entries[at + 1 :]
    if len(entries) > ndim + 1:
        return None
    before = entries.index(None)
    if before == token + 1:
        return "rows"
    if before == token:
        return "columns"
    return None


def broadcast_view(x: ShardTensor, kind: str) -> ShardTensor:
    """``x[:, :, None]`` (``"rows"``) or ``x[:, None]`` (``"columns"``) of a row-sharded single.

    No communication. The result is a tagged ``(Shard, Replicate)`` ShardTensor: a rows
    view keeps the token axis at ``t`` (unit axis at ``t + 1``), a columns view moves it to
    ``t + 1``.
    """
    token = x.placements[ROWS].dim
    new_axis = token + 1 if kind == "rows" else token
    local = local_of(x).unsqueeze(new_axis)
    sharded = token if kind == "rows" else token + 1

    def grown(shape: tuple[int, ...]) -> tuple[int, ...]:
        out = list(shape)
        out.insert(new_axis, 1)
        return tuple(out)

    shapes = {ROWS: [grown(s) for s in sharding_shapes(x)[ROWS]]}
    tag = ViewTag(kind=kind, token_dim=token)
    return wrap(local, x.device_mesh, (Shard(sharded), Replicate()), shapes, tag)


def getitem_view_rule(func: Callable, args: tuple, kwargs: dict):
    """``s[:, :, None]`` / ``s[:, None]`` of a row-sharded single: a broadcast view."""
    if len(args) != 2 or kwargs:
        return NotImplemented
    x, key = args
    if not isinstance(x, ShardTensor) or tag_of(x) is not None or x.device_mesh.ndim != 2:
        return NotImplemented
    if sharding_shapes(x) is None:
        return NotImplemented
    kind = _view_kind(x, key)
    return broadcast_view(x, kind) if kind else NotImplemented


def unsqueeze_view_rule(func: Callable, args: tuple, kwargs: dict):
    """``s.unsqueeze(t + 1)`` / ``s.unsqueeze(t)`` of a row-sharded single: a broadcast view."""
    x = args[0] if args else kwargs.get("input")
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if not isinstance(x, ShardTensor) or tag_of(x) is not None or x.device_mesh.ndim != 2:
        return NotImplemented
    if not isinstance(dim, int) or sharding_shapes(x) is None:
        return NotImplemented
    rows, columns = x.placements
    if not isinstance(rows, Shard) or not isinstance(columns, Replicate):
        return NotImplemented
    dim %= len(global_shape(x)) + 1
    if dim == rows.dim + 1:
        return broadcast_view(x, "rows")
    if dim == rows.dim:
        return broadcast_view(x, "columns")
    return NotImplemented


def view_pair_rule(func: Callable, args: tuple, kwargs: dict):
    """An elementwise op of a rows view and a columns view: the pair tile."""
    if any(isinstance(v, torch.Tensor) for v in kwargs.values()):
        return NotImplemented
    positions = [k for k, a in enumerate(args) if isinstance(a, torch.Tensor)]
    if len(positions) != 2:
        return NotImplemented
    tags = [view_tag(args[k]) for k in positions]
    if None in tags or {t.kind for t in tags} != {"rows", "columns"}:
        return NotImplemented
    if tags[0].token_dim != tags[1].token_dim:
        return NotImplemented
    token = tags[0].token_dim
    k_rows, k_cols = positions if tags[0].kind == "rows" else positions[::-1]
    rows_view, cols_view = args[k_rows], args[k_cols]
    if rows_view.device_mesh != cols_view.device_mesh:
        return NotImplemented
    rows_single = _view_single(rows_view, token + 1)
    cols_single = _view_single(cols_view, token)

    def combine(rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        call = list(args)
        call[k_rows] = rows.unsqueeze(token + 1)
        call[k_cols] = columns.unsqueeze(token)
        return func(*call, **kwargs)

    name = getattr(func, "__name__", str(func))
    return pair_from_singles(rows_single, cols_single, combine, name, "rows", "columns", token)


def _view_single(view: ShardTensor, unit_axis: int) -> ShardTensor:
    """The single behind a broadcast view (drop its unit axis; no communication)."""
    local = local_of(view).squeeze(unit_axis)
    sharded = view.placements[ROWS].dim
    if sharded > unit_axis:
        sharded -= 1

    def shrunk(shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(s for d, s in enumerate(shape) if d != unit_axis)

    shapes = {ROWS: [shrunk(s) for s in sharding_shapes(view)[ROWS]]}
    return wrap(local, view.device_mesh, (Shard(sharded), Replicate()), shapes)


_ELEMENTWISE_NAMES = (
    "add",
    "sub",
    "mul",
    "div",
    "true_divide",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "logical_and",
    "logical_or",
    "logical_xor",
    "bitwise_and",
    "bitwise_or",
    "bitwise_xor",
    "maximum",
    "minimum",
    "pow",
)
_DUNDERS = (
    "__add__",
    "__radd__",
    "__sub__",
    "__rsub__",
    "__mul__",
    "__rmul__",
    "__truediv__",
    "__rtruediv__",
    "__rdiv__",
    "__eq__",
    "__ne__",
    "__lt__",
    "__le__",
    "__gt__",
    "__ge__",
    "__and__",
    "__or__",
    "__xor__",
    "__pow__",
)
VIEW_PAIR_FUNCS: tuple[Callable, ...] = tuple(
    f
    for f in (
        *(getattr(torch.Tensor, n, None) for n in _ELEMENTWISE_NAMES + _DUNDERS),
        *(getattr(torch, n, None) for n in _ELEMENTWISE_NAMES),
    )
    if f is not None
)
"""Elementwise callables that turn a rows view and a columns view into a pair tile."""

register_own(outer_sum, _outer_sum_handler)
register_own(relative_position_encoding, _relpos_handler)
register_own(pair_distances, _pair_distances_handler)

register_rules(
    Rule(DERIVE, (torch.Tensor.__getitem__,), getitem_view_rule,
         "s[:, :, None], s[:, None]: views"),
    Rule(DERIVE, (torch.unsqueeze, torch.Tensor.unsqueeze), unsqueeze_view_rule,
         "s.unsqueeze: views"),
    Rule(DERIVE, VIEW_PAIR_FUNCS, view_pair_rule, "rows (op) columns"),
    Rule(DERIVE, (torch.cdist,), cdist_rule, "cdist of two singles: pair tile"),
)  # fmt: skip


__all__ = [
    "RELPOS_KEYS",
    "VIEW_PAIR_FUNCS",
    "broadcast_view",
    "cdist_rule",
    "getitem_view_rule",
    "unsqueeze_view_rule",
    "view_pair_rule",
    "outer_sum",
    "pair_distances",
    "pair_from_singles",
    "relative_position_encoding",
    "relpos_width",
]
