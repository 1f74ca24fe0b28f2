"""Generic ops on FoldTensors: computed on the local blocks when they can be, gathered when not.

PhysicsNeMo's generic path for an op without a handler converts ShardTensors to DTensors,
whose sharding propagation assumes ``torch.chunk`` blocks. The plan's blocks are not those
(atoms follow their tokens, balanced boundaries, per-shard padding), so that path fails
("expected local shape ... does not match") or, where DTensor redistributes an operand by
its own block sizes, aborts the collective. This module replaces it for FoldTensors.

An op is described by a :class:`DimMap`: which result dim each operand dim becomes, and
which dims the op reads along (reductions, softmax, contractions, concatenation). Then,
for every mesh dim ``m`` (``cp0``, ``cp1``):

* operands sharded along ``m`` on a dim that becomes a result dim, with equal blocks, stay
  local: the result is sharded the same way (``Shard``);
* a replicated operand spanning that result dim is cut to this rank's block (no
  communication forward; its gradient is summed over ``m`` in backward, as is that of a
  replicated operand that broadcasts over it, e.g. a weight);
* operands sharded along ``m`` on a dim the op reads along are all-gathered over ``m``
  (ONE all-gather each; backward: the matching slice, or a reduce-scatter when the result
  stays sharded along ``m``); for ops that keep the operand's shape (softmax, cumsum) the
  result is cut back to the blocks afterwards (backward: one all-gather);
* a contraction (einsum, matmul, sum) over a dim that every operand holding it shards
  alike along ``m`` is summed locally, then ONE all-reduce over ``m`` (backward: none);
* a product of two singles sharded along ``cp0`` on different result dims (``q @ k.mT``,
  an outer product) becomes the ``(Shard, Shard)`` pair tile: the second operand is
  all-gathered over ``cp0`` and cut to column block ``j`` over ``cp1``, as is a single
  that meets a tile on its column dim (``d / period`` broadcast over the columns);
* a transposed pair tile meeting the tile layout (``z + z.transpose(1, 2)``) is moved to
  it piece by piece (:mod:`physicsnemo_foldcp.dispatch.mirror`), about one tile per rank.

Every gather made because an op reads along a sharded axis (or has no
:class:`DimMap` at all, in which case every sharded operand is gathered and the serial op
runs on full tensors) is reported through :mod:`physicsnemo_foldcp.core.events`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate, Shard

from physicsnemo_foldcp.core import compat, events, partial_grads
from physicsnemo_foldcp.core.blocks import (
    ShardingLayoutError,
    SumToReplicate,
    all_reduce,
    describe,
    gather_blocks,
    local_of,
    rank_label,
    reduce_scatter_blocks,
)
from physicsnemo_foldcp.core.leaves import replace_leaves, tensor_leaves
from physicsnemo_foldcp.core.tensor import wrap
from physicsnemo_foldcp.dispatch.mirror import mirror_tile
from physicsnemo_foldcp.sharding.plan import column_block_sizes

OutDim = Callable[[int, int], "int | None"]
Label = Callable[[int, int], "str | None"]


@dataclass(frozen=True)
class DimMap:
    """How an op's operand dims relate to its result dims.

    Attributes
    ----------
    out_dim : callable
        ``out_dim(k, d)``: the result dim that dim ``d`` of tensor operand ``k`` (in call
        order, lists flattened) becomes, or ``None`` when the op reads along ``d``
        (reduces, normalises, contracts, concatenates or indexes it).
    summed : callable
        ``summed(k, d)``: for a dim the op only sums over (a contraction index, a sum), a
        label shared by the operand dims summed together; ``None`` otherwise.
    same_shape : bool
        The result has operand 0's dims (softmax, cumsum, normalisation): a dim gathered
        because the op reads along it is cut back to its blocks afterwards.
    resized : callable, optional
        ``resized(k, d, sizes)``: the result's block lengths along the result dim of
        operand ``k``'s dim ``d``, given the operand's (a slice of a sharded dim keeps
        each rank's part of the slice); the operand's own blocks when absent.
    """

    out_dim: OutDim
    summed: Label = field(default=lambda k, d: None)
    same_shape: bool = False
    resized: Callable[[int, int, tuple[int, ...]], tuple[int, ...]] | None = None

    def out_sizes(self, k: int, d: int, sizes: tuple[int, ...]) -> tuple[int, ...]:
        """Block lengths of the result along the result dim of operand ``k``'s dim ``d``."""
        return tuple(self.resized(k, d, sizes)) if self.resized is not None else sizes


# -- operands --------------------------------------------------------------------------------


@dataclass
class Operand:
    """A tensor argument of a call, with its global layout.

    Attributes
    ----------
    index : int
        Position among the call's tensors.
    path : tuple
        Where it sits in ``(args, kwargs)``.
    value : torch.Tensor
        The argument.
    shape : tuple[int, ...]
        Global shape.
    placements : tuple or None
        Placements over the domain mesh; ``None`` for a plain tensor (replicated).
    sizes : dict[int, tuple[int, ...]]
        ``{mesh_dim: block length of rank r}`` along the dim sharded over ``mesh_dim``.
    """

    index: int
    path: tuple
    value: torch.Tensor
    shape: tuple[int, ...]
    placements: tuple | None
    sizes: dict[int, tuple[int, ...]]

    def shard_dim(self, mesh_dim: int) -> int | None:
        """The tensor dim sharded over ``mesh_dim``, or ``None``."""
        if self.placements is None:
            return None
        p = self.placements[mesh_dim]
        return p.dim if isinstance(p, Shard) else None

    def is_partial(self, mesh_dim: int) -> bool:
        """Whether the operand is a pending sum over ``mesh_dim``."""
        return self.placements is not None and self.placements[mesh_dim].is_partial()


def operands(args: tuple, kwargs: dict) -> tuple[list[Operand], DeviceMesh | None]:
    """The call's tensors with their layouts, and the domain mesh of its ShardTensors.

    Raises
    ------
    ShardingLayoutError
        If distributed operands live on different meshes.
    """
    out: list[Operand] = []
    mesh = None
    for k, (path, value) in enumerate(tensor_leaves(args, kwargs)):
        if isinstance(value, (ShardTensor, DTensor)):
            if mesh is None:
                mesh = value.device_mesh
            elif value.device_mesh != mesh:
                raise ShardingLayoutError(
                    f"operands live on different meshes: {describe(out[0].value)} and "
                    f"{describe(value)}"
                )
            placements = tuple(value.placements)
            sizes: dict[int, tuple[int, ...]] = {}
            shapes = compat.sharding_shapes(value) if isinstance(value, ShardTensor) else None
            for m, p in enumerate(placements):
                if isinstance(p, Shard):
                    if shapes is None or m not in shapes:
                        sizes = {}
                        placements = None  # layout unknown here: replicate it first
                        break
                    sizes[m] = tuple(int(s[p.dim]) for s in shapes[m])
            out.append(Operand(k, path, value, compat.global_shape(value), placements, sizes))
        else:
            out.append(Operand(k, path, value, tuple(value.shape), None, {}))
    return out, mesh


# -- autograd pieces -------------------------------------------------------------------------


def _coordinate(mesh: DeviceMesh, mesh_dim: int) -> int:
    return int(mesh.get_coordinate()[mesh_dim])


class GatherOver(torch.autograd.Function):
    """All-gather uneven blocks over one mesh dim (ONE all-gather).

    Backward: this rank's slice of the gradient when the op's result is replicated over
    the mesh dim (every rank computed the same result), or ONE reduce-scatter when the
    result stays sharded over it (every rank contributed to every block).
    """

    @staticmethod
    def forward(ctx, local, dim, sizes, mesh, mesh_dim, sum_backward):
        """All-gather ``local`` (``sizes[k]`` long along ``dim``) over ``mesh_dim``."""
        ctx.args = (dim, sizes, mesh, mesh_dim, sum_backward)
        return gather_blocks(local, dim, sizes, mesh, mesh_dim)

    @staticmethod
    def backward(ctx, grad):
        """This rank's slice of ``grad``, summed over ``mesh_dim`` first if required."""
        dim, sizes, mesh, mesh_dim, sum_backward = ctx.args
        if sum_backward:
            out = reduce_scatter_blocks(grad, dim, sizes, mesh, mesh_dim)
        else:
            k = _coordinate(mesh, mesh_dim)
            out = grad.narrow(dim, sum(sizes[:k]), sizes[k])
        return out, None, None, None, None, None


class ReplicatedPart(torch.autograd.Function):
    """This rank's part of a replicated operand: cut to blocks, gradient summed over ranks.

    Forward: ``narrow`` along each ``(dim, start, length)`` (no communication). Backward:
    the gradient placed back into a zero tensor of the full shape, then ONE all-reduce
    per mesh dim in ``reduce_dims`` (the ranks along it each hold part of the gradient).
    A parameter attached to gradient buckets (:mod:`~physicsnemo_foldcp.core.partial_grads`)
    leaves its part in its bucket instead, reduced once per step with the others.
    """

    @staticmethod
    def forward(ctx, full, narrows, reduce_dims, mesh):
        """``full`` cut to ``narrows`` (``(dim, start, length)`` each)."""
        ctx.args = (tuple(full.shape), narrows, reduce_dims, mesh)
        # Only an attached parameter is kept on ctx (an activation would be held alive).
        ctx.param = full if reduce_dims and partial_grads.slot_of(full) is not None else None
        ctx.is_parameter = full.is_leaf and full.requires_grad
        out = full
        for dim, start, length in narrows:
            out = out.narrow(dim, start, length)
        return out.contiguous() if narrows else full.view_as(full)

    @staticmethod
    def backward(ctx, grad):
        """``grad`` placed back into the full shape and summed over ``reduce_dims``."""
        shape, narrows, reduce_dims, mesh = ctx.args
        if ctx.param is not None and partial_grads.kept(
            ctx.param, grad, mesh, reduce_dims, narrows
        ):
            return partial_grads.kept_gradient(ctx.param), None, None, None
        if narrows:
            full = grad.new_zeros(shape)
            region = full
            for dim, start, length in narrows:
                region = region.narrow(dim, start, length)
            region.copy_(grad)
            grad = full
        for mesh_dim in reduce_dims:
            grad = all_reduce(grad, mesh, mesh_dim)
        if ctx.is_parameter and reduce_dims:
            partial_grads.note_reduced_per_call(len(reduce_dims))
        return grad, None, None, None


class SliceBack(torch.autograd.Function):
    """Cut a result computed in full on every rank back to this rank's block.

    Forward: ``narrow`` (no communication). Backward: ONE all-gather of the block
    gradients over the mesh dim, so the full result's gradient is complete on every rank.
    """

    @staticmethod
    def forward(ctx, full, dim, sizes, mesh, mesh_dim):
        """This rank's block of ``full`` along ``dim``."""
        ctx.args = (dim, sizes, mesh, mesh_dim)
        k = _coordinate(mesh, mesh_dim)
        return full.narrow(dim, sum(sizes[:k]), sizes[k]).contiguous()

    @staticmethod
    def backward(ctx, grad):
        """The block gradients all-gathered over ``mesh_dim``."""
        dim, sizes, mesh, mesh_dim = ctx.args
        full = gather_blocks(grad.contiguous(), dim, sizes, mesh, mesh_dim)
        return full, None, None, None, None


# -- the decision ----------------------------------------------------------------------------


@dataclass
class _Decision:
    """Per mesh dim: the result's sharded dim and blocks, and what each operand does."""

    out: dict[int, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    gather: dict[tuple[int, int], str] = field(default_factory=dict)  # (k, m) -> kind
    summed: dict[int, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    sliced: dict[int, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    reasons: dict[tuple[int, int], str] = field(default_factory=dict)
    mirrored: dict[int, tuple[int, int]] = field(default_factory=dict)  # k -> (a, b)


def _decide(ops: list[Operand], dims: DimMap | None, mesh: DeviceMesh) -> _Decision:
    decision = _Decision()
    conflicts: dict[int, list[tuple[Operand, int, int]]] = {}
    for m in range(mesh.ndim):
        kept, touched = [], []
        for o in ops:
            d = o.shard_dim(m)
            if d is None:
                continue
            od = None if dims is None else dims.out_dim(o.index, d)
            (kept if od is not None else touched).append((o, d, od))
        if touched and not kept and dims is not None:
            labels = {dims.summed(o.index, d) for o, d, _ in touched}
            sizes = {o.sizes[m] for o, _, _ in touched}
            if None not in labels and len(labels) == 1 and len(sizes) == 1:
                decision.summed[m] = (labels.pop(), sizes.pop())
                continue
        for o, d, _ in touched:
            decision.gather[(o.index, m)] = events.FALLBACK
            decision.reasons[(o.index, m)] = f"the op reads along its sharded dim {d}"
        # A result dim can be sharded over one mesh dim only: the first operand dim
        # that maps to a result dim no other mesh dim shards sets the layout (an operand
        # sharded over more mesh dims, a pair tile, before a single).
        claimed = {od for od, _ in decision.out.values()}
        free = [(o, d, od) for o, d, od in kept if od not in claimed]
        free.sort(key=lambda c: -len(c[0].sizes))
        if kept:
            conflicts[m] = list(kept)
        if free:
            first, d0, od0 = free[0]
            blocks = dims.out_sizes(first.index, d0, first.sizes[m])
            decision.out[m] = (od0, blocks)
            conflicts[m] = [
                (o, d, od)
                for o, d, od in kept
                if (od, dims.out_sizes(o.index, d, o.sizes[m])) != (od0, blocks)
            ]
    _promote_tile(decision, conflicts, mesh)
    _mirror_transposed_tiles(decision, conflicts, dims)
    _singles_as_columns(decision, conflicts, dims)
    for m, rest in conflicts.items():
        for o, d, _ in rest:
            decision.gather[(o.index, m)] = events.FALLBACK
            decision.reasons[(o.index, m)] = (
                f"its dim {d} is sharded over mesh dim {m} unlike the result"
            )
    if dims is not None and dims.same_shape:
        for (k, m), _kind in list(decision.gather.items()):
            if m not in decision.out and m not in decision.sliced:
                o = ops[k]
                decision.sliced[m] = (o.shard_dim(m), o.sizes[m])
    return decision


def _promote_tile(decision: _Decision, conflicts: dict, mesh: DeviceMesh) -> None:
    """Two singles on different result dims, both sharded over cp0: make the pair tile."""
    rest = conflicts.get(0)
    if mesh.ndim != 2 or not rest or 1 in decision.out or 1 in decision.summed:
        return
    ods = {od for _, _, od in rest}
    sizes = {o.sizes[0] for o, _, _ in rest}
    if len(ods) != 1 or len(sizes) != 1 or any(o.shard_dim(1) is not None for o, _, _ in rest):
        return
    if any(o.is_partial(1) for o, _, _ in rest):
        return
    rows = sizes.pop()
    decision.out[1] = (ods.pop(), tuple(column_block_sizes(rows, mesh.size(1))))
    for o, _, _ in rest:
        decision.gather[(o.index, 0)] = events.TILE
        decision.reasons[(o.index, 0)] = "columns of the pair tile"
    conflicts[0] = []


def _mirror_transposed_tiles(decision: _Decision, conflicts: dict, dims: DimMap | None) -> None:
    """A transposed pair tile meeting the tile layout: moved by :func:`mirror_tile`.

    The operand shards over ``cp0`` the dim that becomes the result's ``cp1`` dim and
    over ``cp1`` the one that becomes its ``cp0`` dim, with the result's blocks swapped
    (``z.transpose(1, 2)`` of a tile ``z``).
    """
    if dims is None or dims.resized is not None or 0 not in decision.out or 1 not in decision.out:
        return
    (row_dim, rows), (col_dim, columns) = decision.out[0], decision.out[1]
    in_both = {o.index for o, _, _ in conflicts.get(0, [])} & {
        o.index for o, _, _ in conflicts.get(1, [])
    }
    for o, d0, _ in list(conflicts.get(0, [])):
        if o.index not in in_both or o.is_partial(0) or o.is_partial(1):
            continue
        d1 = o.shard_dim(1)
        swapped = dims.out_dim(o.index, d0) == col_dim and dims.out_dim(o.index, d1) == row_dim
        if swapped and o.sizes[0] == rows and o.sizes[1] == columns:
            decision.mirrored[o.index] = (d1, d0)
            for m in (0, 1):
                conflicts[m] = [c for c in conflicts[m] if c[0].index != o.index]


def _singles_as_columns(decision: _Decision, conflicts: dict, dims: DimMap | None) -> None:
    """A row-sharded single on the tile's column dim: its column block, as for a tile.

    ``d / period`` with ``d [B, N, N]`` a tile and ``period [B, N]`` broadcast over the
    columns: the single is all-gathered over ``cp0`` (O(N), the kind :data:`events.TILE`)
    and cut to column block ``j``.
    """
    if dims is None or 1 not in decision.out:
        return
    col_dim, columns = decision.out[1]
    for o, _, od in list(conflicts.get(0, [])):
        if o.shard_dim(1) is not None or o.is_partial(1) or od != col_dim:
            continue
        if sum(o.sizes[0]) != sum(columns):
            continue
        decision.gather[(o.index, 0)] = events.TILE
        decision.reasons[(o.index, 0)] = "columns of the pair tile"
        conflicts[0] = [c for c in conflicts[0] if c[0].index != o.index]


# -- running it ------------------------------------------------------------------------------


def _replicated_dim(o: Operand, dims: DimMap | None, od: int) -> int | None:
    if dims is None:
        return None
    for d in range(len(o.shape)):
        if dims.out_dim(o.index, d) == od:
            return d
    return None


def _summed_dim(o: Operand, dims: DimMap | None, label: str) -> int | None:
    if dims is None:
        return None
    for d in range(len(o.shape)):
        if dims.summed(o.index, d) == label:
            return d
    return None


def _prepare(
    o: Operand, decision: _Decision, dims: DimMap | None, mesh: DeviceMesh, op: str
) -> Any:
    """This operand's local tensor for the op (gathered, cut, or as it is)."""
    value = o.value
    if o.placements is None and isinstance(value, (ShardTensor, DTensor)):
        local = value.full_tensor()
    elif isinstance(value, ShardTensor):
        local = local_of(value)
    elif isinstance(value, DTensor):
        local = value.to_local() if value.requires_grad else compat.local_tensor(value)
    else:
        local = value
    partial = tuple(m for m in range(mesh.ndim) if o.is_partial(m))
    if partial:
        local = SumToReplicate.apply(local, mesh, partial)
    if o.index in decision.mirrored:
        a, b = decision.mirrored[o.index]
        return mirror_tile(local, a, b, decision.out[0][1], decision.out[1][1], mesh)
    for m in range(mesh.ndim):
        kind = decision.gather.get((o.index, m))
        if kind is None or mesh.size(m) == 1:
            continue
        d = o.shard_dim(m)
        sum_backward = m in decision.out and m not in decision.sliced
        local = GatherOver.apply(local, d, o.sizes[m], mesh, m, sum_backward)
        events.emit(
            events.GatherEvent(op, kind, o.index, (m,), o.shape, decision.reasons[(o.index, m)])
        )
    narrows, reduce_dims = [], []
    for m in range(mesh.ndim):
        gathered = (o.index, m) in decision.gather
        if (o.shard_dim(m) is not None and not gathered) or m in decision.sliced:
            continue
        k = _coordinate(mesh, m)
        # A replicated operand's gradient is summed over the ranks along m when each of
        # them computed a different part of the result; a gathered one's is already
        # summed by GatherOver.
        shared = local.requires_grad and mesh.size(m) > 1 and not gathered
        if m in decision.out:
            od, sizes = decision.out[m]
            d = _replicated_dim(o, dims, od)
            if d is not None and o.shape[d] == sum(sizes) and sum(sizes) != 1:
                narrows.append((d, sum(sizes[:k]), sizes[k]))
            elif d is not None and o.shape[d] not in (1, sum(sizes)):
                raise ShardingLayoutError(
                    f"{op}: operand {o.index} ({describe(o.value)}) has length {o.shape[d]} "
                    f"along the result's dim {od}, which is sharded into blocks {list(sizes)}"
                )
            if shared:
                reduce_dims.append(m)
        elif m in decision.summed:
            label, sizes = decision.summed[m]
            d = _summed_dim(o, dims, label)
            if d is not None and o.shape[d] == sum(sizes):
                narrows.append((d, sum(sizes[:k]), sizes[k]))
            if shared:
                reduce_dims.append(m)
    if narrows or reduce_dims:
        local = ReplicatedPart.apply(local, tuple(narrows), tuple(reduce_dims), mesh)
    return local


def _result_layout(
    local: torch.Tensor, decision: _Decision, mesh: DeviceMesh, op: str
) -> tuple[list, dict[int, list[tuple[int, ...]]]]:
    placements: list = [Replicate()] * mesh.ndim
    shapes: dict[int, list[tuple[int, ...]]] = {}
    for m, (od, sizes) in {**decision.out, **decision.sliced}.items():
        k = _coordinate(mesh, m)
        if od >= local.ndim or local.shape[od] != sizes[k]:
            raise ShardingLayoutError(
                f"{op}: the local result {tuple(local.shape)} does not hold block {k} "
                f"({sizes[k]} of {list(sizes)}) along dim {od} [{rank_label(mesh)}]"
            )
        placements[m] = Shard(od)
        shapes[m] = [(*local.shape[:od], n, *local.shape[od + 1 :]) for n in sizes]
    return placements, shapes


FLAG_REDUCTIONS = {"any": "max", "all": "min"}
"""Labels of :attr:`DimMap.summed` for ``any`` / ``all``: combined over the mesh by this op."""


def _finish(local: torch.Tensor, decision: _Decision, mesh: DeviceMesh, op: str) -> Any:
    if decision.summed:
        mesh_dims = tuple(sorted(decision.summed))
        labels = {label for label, _ in decision.summed.values()}
        if labels <= FLAG_REDUCTIONS.keys() and len(labels) == 1:
            reduce_op = FLAG_REDUCTIONS[labels.pop()]
            flags = local.to(torch.int32)
            for m in mesh_dims:
                flags = all_reduce(flags, mesh, m, op=reduce_op)
            local = flags.to(local.dtype)
        else:
            local = SumToReplicate.apply(local, mesh, mesh_dims)
    for m, (d, sizes) in decision.sliced.items():
        local = SliceBack.apply(local, d, sizes, mesh, m)
    placements, shapes = _result_layout(local, decision, mesh, op)
    return wrap(local, mesh, placements, shapes)


def _slice_like_reference(ops: list[Operand], result: torch.Tensor, decision: _Decision) -> None:
    """Generic path: cut a full result back to the blocks of an operand of the same shape."""
    for o in ops:
        if o.placements is None or not o.sizes:
            continue
        if tuple(result.shape) == o.shape and not any(p.is_partial() for p in o.placements):
            for m, sizes in o.sizes.items():
                decision.sliced[m] = (o.shard_dim(m), sizes)
        return


def run(
    func: Callable,
    args: tuple,
    kwargs: dict,
    dims: DimMap | None,
    *,
    op: str | None = None,
    local_func: Callable | None = None,
    post: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Any:
    """Run ``func`` on FoldTensor operands blockwise (see the module docstring).

    Parameters
    ----------
    func : callable
        The torch function called.
    args, kwargs
        Its arguments.
    dims : DimMap or None
        How the op relates operand and result dims; ``None`` when unknown: every sharded
        operand is gathered and ``func`` runs on full tensors (reported).
    op : str, optional
        Name for messages and events (default: the function's name).
    local_func : callable, optional
        Called on the local tensors instead of ``func``.
    post : callable, optional
        Applied to each local tensor result before it is wrapped.

    Returns
    -------
    Any
        ``func``'s result with every tensor a FoldTensor (non-tensor results as they are).
    """
    op = op or events.op_name(func)
    ops, mesh = operands(args, kwargs)
    if mesh is None:
        return (local_func or func)(*args, **kwargs)
    decision = _decide(ops, dims, mesh)
    locals_ = {o.path: _prepare(o, decision, dims, mesh, op) for o in ops}
    call_args, call_kwargs = replace_leaves(args, kwargs, locals_)
    result = (local_func or func)(*call_args, **call_kwargs)

    def finish(r: Any) -> Any:
        if not isinstance(r, torch.Tensor):
            return r
        if post is not None:
            r = post(r)
        if dims is None:
            _slice_like_reference(ops, r, decision)
        return _finish(r, decision, mesh, op)

    if isinstance(result, torch.Tensor):
        return finish(result)
    if type(result).__module__ == torch.return_types.__name__:
        return type(result)(finish(r) for r in result)
    if isinstance(result, (tuple, list)):
        return type(result)(finish(r) for r in result)
    return result


def block_sizes(x: ShardTensor, mesh_dim: int) -> tuple[int, ...]:
    """Block lengths, over the ranks along ``mesh_dim``, of the dim it shards in ``x``."""
    dim = x.placements[mesh_dim].dim
    return tuple(int(s[dim]) for s in compat.sharding_shapes(x)[mesh_dim])


def shape_of(t: torch.Tensor) -> tuple[int, ...]:
    """Global shape of a ShardTensor or DTensor (from its spec), or a plain tensor's shape."""
    if isinstance(t, (ShardTensor, DTensor)):
        return compat.global_shape(t)
    return tuple(int(s) for s in t.shape)


def numel_of(shape: Sequence[int], dims: Sequence[int]) -> int:
    """Number of elements a reduction over ``dims`` of ``shape`` combines."""
    return math.prod(int(shape[d]) for d in dims)


__all__ = [
    "DimMap",
    "GatherOver",
    "Operand",
    "ReplicatedPart",
    "SliceBack",
    "block_sizes",
    "numel_of",
    "operands",
    "run",
    "shape_of",
]
