"""Rows of an MSA picked by a replicated index: ``m[:, idx]``, the rows sent to where they go.

Boltz-2's ``MSAModule`` subsamples the MSA with ``idx = torch.randperm(S)[:k]`` and then
``m[:, idx]``, ``msa_mask[:, idx]``. An MSA ``[B, S, N, ...]`` has its rows on ``cp0``
(blocks ``S_t``) and its tokens on ``cp1`` (blocks ``C_q``); ``idx`` is a plain 1-D integer
tensor, the same on every rank of the domain (the ranks of a domain draw the same numbers,
:mod:`physicsnemo_foldcp.distributed.rng`).

Why the generic path fails
--------------------------
The generic indexing rule (:func:`physicsnemo_foldcp.dispatch.families.getitem`) treats an
integer tensor on a sharded dim as reading along it (and every dim after an advanced index
as moved): it all-gathers the whole MSA over ``cp0`` and ``cp1``, indexes the full tensor
on every rank, reports a gather, and returns the result ``(Shard(2), Replicate())``, no
longer laid out as an MSA. Boltz's next layers (``PairWeightedAveraging``,
``OuterProductMean``) need ``(Shard(1), Shard(2))`` and refuse it
(``ShardingLayoutError``).

What happens instead (rank ``(p, q)``)
--------------------------------------
The result ``[B, k, N, ...]`` is an MSA again: its rows in the plan's MSA row blocks for
the new depth ``k`` (:func:`~physicsnemo_foldcp.sharding.plan.msa_row_sizes`, blocks
``O_p``), its other dims as the input's (tokens on ``cp1`` unchanged). Output row ``o`` is
input row ``idx[o]``, held by the ranks ``(t, *)`` with ``idx[o]`` in ``S_t``. Since every
rank knows ``idx`` and the blocks, every rank knows who sends what to whom without any
metadata exchange: rank ``(t, q)`` sends to ``(p, q)`` the rows ``idx[o]`` for ``o`` in
``O_p`` that it holds; its own rows it copies.

Communication per call, forward and backward alike: point-to-point sends and receives
(one ``batch_isend_irecv``) among the ranks of one ``cp0`` column (the same token block
``C_q``), only of non-empty pieces; rank ``(p, q)`` receives exactly the rows of ``O_p``
held by other ranks (``B x |C_q| x ...`` elements each), none over ``cp1``. Backward sends
the gradient rows back along the same pieces and adds them at their source rows (a row
picked more than once accumulates its gradients). Peak extra memory: the pieces sent (one
row per use of a local row by another rank) and received (at most one output block).

The rule applies to ``x[:, ..., idx, ...]`` with full slices elsewhere and to
``torch.index_select(x, d, idx)``, where ``d`` is the dim ``x`` shards over ``cp0``, ``idx``
a plain 1-D integer tensor, and ``x`` is sharded over ``cp1`` on another dim (the MSA
layout; a single ``(Shard(d), Replicate())`` keeps the generic path, whose replicated
result still meets token-sharded features). The index must be the same on every rank of
the domain; the rule cannot see a rank whose index differs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard

from physicsnemo_foldcp.core import compat
from physicsnemo_foldcp.core.blocks import (
    COLUMNS,
    ROWS,
    block_starts,
    coordinate,
    local_of,
    mesh_ranks,
    mesh_sizes,
)
from physicsnemo_foldcp.core.tensor import DERIVE, FoldTensor, Rule, register_rules, tag_of, wrap
from physicsnemo_foldcp.ops.row_routes import RouteRows, RowRoute, plan_route, with_length
from physicsnemo_foldcp.sharding.plan import msa_row_sizes

# -- routing ---------------------------------------------------------------------------------


def plan_msa_route(
    index: Sequence[int] | torch.Tensor,
    in_sizes: Sequence[int],
    p: int,
    peers: Sequence[int],
    device: torch.device,
) -> RowRoute:
    """The :class:`~physicsnemo_foldcp.ops.row_routes.RowRoute` of rank ``p`` for ``x[:, idx]``.

    ``index`` (``k`` ints, or int64 ``[k]`` on the CPU, the same on every rank) picks input
    rows; output row block ``t`` holds ``index`` over :func:`msa_row_sizes` blocks of
    ``k``. The other arguments are :func:`~physicsnemo_foldcp.ops.row_routes.plan_route`'s.
    """
    rows = index.tolist() if isinstance(index, torch.Tensor) else list(index)
    out_starts = block_starts(msa_row_sizes(len(rows), len(in_sizes)))
    wanted = [rows[a:b] for a, b in zip(out_starts, [*out_starts[1:], len(rows)])]
    return plan_route(wanted, in_sizes, p, peers, device)


# -- the rule --------------------------------------------------------------------------------


def _row_index(x: ShardTensor, key: Any) -> tuple[int, torch.Tensor] | None:
    """``(d, idx)`` when ``key`` is full slices and a plain 1-D integer ``idx`` at dim ``d``."""
    rows, columns = x.placements
    if not isinstance(rows, Shard) or not isinstance(columns, Shard) or rows.dim == columns.dim:
        return None
    ndim = len(compat.global_shape(x))
    entries = key if isinstance(key, tuple) else (key,)
    if sum(1 for e in entries if e is Ellipsis) > 1:
        return None
    if Ellipsis in entries:
        at = next(i for i, e in enumerate(entries) if e is Ellipsis)
        fill = (slice(None),) * (ndim - len(entries) + 1)
        entries = entries[:at] + fill + entries[at + 1 :]
    if len(entries) > ndim or rows.dim >= len(entries):
        return None
    index = entries[rows.dim]
    if (
        not isinstance(index, torch.Tensor)
        or isinstance(index, (ShardTensor, DTensor))
        or index.ndim != 1
        or index.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
    ):
        return None
    others = (e for i, e in enumerate(entries) if i != rows.dim)
    if any(not (isinstance(e, slice) and e == slice(None)) for e in others):
        return None
    return rows.dim, index


def pick_rows(x: FoldTensor, dim: int, index: torch.Tensor, negative: bool = True) -> FoldTensor:
    """``x`` indexed by ``index`` on its ``cp0``-sharded dim, laid out as an MSA again.

    Parameters
    ----------
    x : FoldTensor
        ``[B, S, N, ...]`` (any dims), dim ``dim`` sharded over ``cp0`` in blocks ``S_t``,
        another dim sharded over ``cp1`` (``(Shard(1), Shard(2))`` for an MSA).
    dim : int
        The dim sharded over ``cp0``.
    index : torch.Tensor
        Plain 1-D integer ``[k]``, the same on every rank of the domain; it may live on
        the CPU.
    negative : bool, default True
        Whether negative values count from the end (indexing) or are out of range
        (``index_select``).

    Returns
    -------
    FoldTensor
        ``[B, k, N, ...]``, the placements of ``x``; rows in the blocks of
        :func:`~physicsnemo_foldcp.sharding.plan.msa_row_sizes` for ``k``; differentiable.

    Raises
    ------
    IndexError
        When a value of ``index`` is out of range (on every rank alike: they hold the same
        index).
    """
    mesh: DeviceMesh = x.device_mesh
    depth = compat.global_shape(x)[dim]
    # The index is read once (the rows each rank sends depend on its values).
    values = index.detach().to("cpu", torch.int64).tolist()
    low = -depth if negative else 0
    bad = next((v for v in values if v < low or v >= depth), None)
    if bad is not None:
        raise IndexError(f"index {bad} is out of bounds for dimension {dim} with size {depth}")
    values = [v + depth if v < 0 else v for v in values]
    in_sizes = mesh_sizes(x, ROWS, dim)
    p, q = coordinate(mesh)
    peers = [row[q] for row in mesh_ranks(mesh)]
    local = local_of(x)
    route = plan_msa_route(values, in_sizes, p, peers, local.device)
    out = RouteRows.apply(local, dim, route)
    shapes = compat.sharding_shapes(x)
    out_shapes = {
        ROWS: [tuple(with_length(s, dim, n)) for s, n in zip(shapes[ROWS], route.out_sizes)],
        COLUMNS: [tuple(with_length(s, dim, route.out_sizes[p])) for s in shapes[COLUMNS]],
    }
    return wrap(out, mesh, x.placements, out_shapes)


def _msa_laid_out(x: Any) -> bool:
    """Whether ``x`` is an untagged FoldTensor with blocks over both mesh dims."""
    if not isinstance(x, FoldTensor) or tag_of(x) is not None or x.device_mesh.ndim != 2:
        return False
    shapes = compat.sharding_shapes(x)
    return shapes is not None and ROWS in shapes and COLUMNS in shapes


def row_index_rule(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``x[:, idx]`` of an MSA-laid-out FoldTensor: :func:`pick_rows`; else not this rule."""
    if len(args) != 2 or kwargs or not _msa_laid_out(args[0]):
        return NotImplemented
    found = _row_index(args[0], args[1])
    if found is None:
        return NotImplemented
    return pick_rows(args[0], *found)


def index_select_rule(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``torch.index_select(x, d, idx)`` / ``x.index_select(d, idx)`` on the row dim ``d``."""
    names = ("input", "dim", "index")
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    x, dim, index = (bound.get(name) for name in names)
    if len(bound) != len(args) + len(kwargs) or not _msa_laid_out(x) or not isinstance(dim, int):
        return NotImplemented
    dim %= len(compat.global_shape(x))
    if index is None or _row_index(x, (slice(None),) * dim + (index,)) is None:
        return NotImplemented
    return pick_rows(x, dim, index, negative=False)


register_rules(
    Rule(DERIVE, (torch.Tensor.__getitem__,), row_index_rule,
         "m[:, idx]: MSA rows sent to new blocks"),
    Rule(DERIVE, (torch.index_select, torch.Tensor.index_select), index_select_rule,
         "index_select of MSA rows: as m[:, idx]"),
)  # fmt: skip


__all__ = [
    "index_select_rule",
    "pick_rows",
    "plan_msa_route",
    "row_index_rule",
]
