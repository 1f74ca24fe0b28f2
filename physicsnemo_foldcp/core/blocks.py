"""Local blocks of co-sharded ShardTensors: layout checks, block offsets, wrapping, collectives.

Every op handler of this package works on the local blocks of ShardTensors over the 2-D
``(cp0, cp1)`` domain mesh. The conventions it relies on, shared with the scatter:

* a *single* (token, atom or r-set leading feature ``[B, L, ...]``) is ``(Shard(d),
  Replicate())``: row block ``i`` of its length lives on the ranks ``(i, *)``;
* a *pair tile* ``[B, N, M, ...]`` is ``(Shard(d), Shard(d + 1))``: rank ``(i, j)`` holds
  the rows of row block ``i`` and the columns of column block ``j``. Column blocks are the
  row blocks when ``cp0 == cp1``, otherwise the padded length split into ``cp1`` blocks
  that differ by at most one (:func:`physicsnemo_foldcp.sharding.plan.column_block_sizes`).

Collectives are the functional collectives of :mod:`physicsnemo_foldcp.core.compat` on a
``(mesh, mesh_dim)`` group, so ``CommDebugMode`` counts them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate, Shard

from physicsnemo_foldcp.core import compat, partial_grads

ROWS = 0
"""Mesh dim of the token row blocks (``cp0``)."""
COLUMNS = 1
"""Mesh dim of the token column blocks (``cp1``)."""


class ShardingLayoutError(ValueError):
    """An op's operand is not laid out as the op needs (type, placements, shapes, blocks)."""


class MapLayoutError(ShardingLayoutError):
    """An atom<->token map has entries outside the block of the rank that holds its row."""


def rank_label(mesh: DeviceMesh) -> str:
    """``"global rank r at (cp0, cp1) = (i, j)"`` for messages."""
    coordinate = mesh.get_coordinate()
    where = f" at (cp0, cp1) = {tuple(coordinate)}" if coordinate is not None else ""
    rank = dist.get_rank() if dist.is_initialized() else 0
    return f"global rank {rank}{where}"


def describe(x: object) -> str:
    """Type, global shape and placements of an operand, for messages."""
    if isinstance(x, (ShardTensor, DTensor)):
        return (
            f"{type(x).__name__} of global shape {tuple(x.shape)}, placements "
            f"{tuple(x.placements)}, local shape {tuple(compat.local_tensor(x).shape)}"
        )
    if isinstance(x, torch.Tensor):
        return f"plain tensor of shape {tuple(x.shape)}"
    return type(x).__name__


def require_shard_tensor(x: object, op: str, arg: str) -> ShardTensor:
    """Return ``x`` if it is a ShardTensor over a 2-D mesh; raise a clear error otherwise."""
    if not isinstance(x, ShardTensor):
        hint = (
            " (a plain tensor meeting a ShardTensor is promoted to a Replicate DTensor: "
            "scatter it, or build it with ShardTensor.from_local at the registry's placements)"
            if isinstance(x, (DTensor, torch.Tensor))
            else ""
        )
        raise ShardingLayoutError(f"{op}: {arg} must be a ShardTensor, got {describe(x)}{hint}")
    if x.device_mesh.ndim != 2:
        raise ShardingLayoutError(
            f"{op}: {arg} lives on a {x.device_mesh.ndim}-D mesh; the ops need the 2-D "
            f"(cp0, cp1) domain mesh (FoldMesh.domain_mesh), got {describe(x)}"
        )
    if compat.sharding_shapes(x) is None:
        raise ShardingLayoutError(
            f"{op}: {arg} carries no sharding shapes; build it with explicit sharding_shapes"
        )
    return x


def row_dim(x: ShardTensor, op: str, arg: str, expected: int | None = None) -> int:
    """Tensor dim of ``x`` split over ``cp0``; ``x`` must be ``(Shard(d), Replicate())``.

    Parameters
    ----------
    x : ShardTensor
        A single: rows over ``cp0``, replicated over ``cp1``.
    op, arg : str
        Names for the error message.
    expected : int, optional
        The dim ``d`` the op needs.

    Raises
    ------
    ShardingLayoutError
        If the placements are not ``(Shard(d), Replicate())`` (with ``d == expected``).
    """
    rows, columns = x.placements
    if (
        not isinstance(rows, Shard)
        or not isinstance(columns, Replicate)
        or (expected is not None and rows.dim != expected)
    ):
        need = (
            f"(Shard({expected}), Replicate())"
            if expected is not None
            else "(Shard(d), Replicate())"
        )
        raise ShardingLayoutError(
            f"{op}: {arg} must be sharded {need} over (cp0, cp1) like a scattered "
            f"token/atom feature, got {describe(x)} on {rank_label(x.device_mesh)}"
        )
    return rows.dim


def mesh_sizes(x: ShardTensor, mesh_dim: int, dim: int) -> list[int]:
    """Local lengths of tensor dim ``dim`` on the ranks along ``mesh_dim``."""
    shapes = compat.sharding_shapes(x)[mesh_dim]
    return [int(s[dim]) for s in shapes]


def block(sizes: Sequence[int], index: int) -> tuple[int, int]:
    """``(start, length)`` of block ``index`` of consecutive blocks of ``sizes``."""
    return int(sum(sizes[:index])), int(sizes[index])


def block_starts(sizes: Sequence[int]) -> list[int]:
    """Start of each block of a partition into blocks of ``sizes``."""
    out, at = [], 0
    for size in sizes:
        out.append(at)
        at += int(size)
    return out


def overlap(a_start: int, a_len: int, b_start: int, b_len: int) -> int:
    """Length of the intersection of ``[a_start, a_start + a_len)`` and the ``b`` range."""
    return max(0, min(a_start + a_len, b_start + b_len) - max(a_start, b_start))


def coordinate(mesh: DeviceMesh) -> tuple[int, int]:
    """This rank's ``(i, j)`` on the 2-D domain mesh."""
    i, j = mesh.get_coordinate()
    return int(i), int(j)


@functools.lru_cache(maxsize=64)
def mesh_ranks(mesh: DeviceMesh) -> tuple[tuple[int, ...], ...]:
    """Global rank of every ``(i, j)`` of the 2-D domain mesh: ``mesh_ranks(mesh)[i][j]``.

    Python ints, read from ``mesh.mesh`` once per mesh (a handler that picks its peers per
    call reads no tensor).
    """
    return tuple(tuple(int(r) for r in row) for row in mesh.mesh.tolist())


def local_of(x: ShardTensor) -> torch.Tensor:
    """The local block, differentiable when ``x`` requires grad (no communication)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return x.to_local()
    return compat.local_tensor(x)


def row_shapes(
    local_shape: Sequence[int], dim: int, sizes: Sequence[int]
) -> dict[int, list[tuple[int, ...]]]:
    """Sharding shapes of a ``(Shard(dim), Replicate())`` tensor with row lengths ``sizes``."""
    out = []
    for size in sizes:
        shape = list(local_shape)
        shape[dim] = int(size)
        out.append(tuple(shape))
    return {ROWS: out}


def tile_shapes(
    local_shape: Sequence[int],
    dim: int,
    row_sizes: Sequence[int],
    col_sizes: Sequence[int],
    here: tuple[int, int],
) -> dict[int, list[tuple[int, ...]]]:
    """Sharding shapes of a ``(Shard(dim), Shard(dim + 1))`` tile on rank ``here``."""

    def shape(n: int, m: int) -> tuple[int, ...]:
        out = list(local_shape)
        out[dim], out[dim + 1] = int(n), int(m)
        return tuple(out)

    i, j = here
    return {
        ROWS: [shape(n, col_sizes[j]) for n in row_sizes],
        COLUMNS: [shape(row_sizes[i], m) for m in col_sizes],
    }


def start_gather_blocks(
    local: torch.Tensor, dim: int, sizes: Sequence[int], mesh: DeviceMesh, mesh_dim: int
) -> torch.Tensor:
    """Start :func:`gather_blocks` and return at once; :func:`gathered_blocks` finishes it.

    The block is padded to the largest along ``dim`` (a copy only when it is shorter) and
    ONE ``all_gather_into_tensor`` over ``mesh_dim`` starts; compute issued before
    :func:`gathered_blocks` overlaps the transfer. Arguments as :func:`gather_blocks`.
    """
    if len(sizes) == 1:
        return local
    widest = max(sizes)
    padded = local
    if local.shape[dim] < widest:
        pad_shape = list(local.shape)
        pad_shape[dim] = widest - local.shape[dim]
        padded = torch.cat([local, local.new_zeros(pad_shape)], dim=dim)
    return compat.start_all_gather(padded, mesh, mesh_dim)


def _rank_major(shape: Sequence[int], dim: int, sizes: Sequence[int]) -> bool:
    """Whether a tensor of ``shape`` cut into ``sizes`` along ``dim`` is its blocks stacked.

    True for even blocks with only dims of length one before ``dim``: block ``r`` is then
    the ``r``-th equal slice of the memory, as the collectives lay the ranks out.
    """
    return len(set(sizes)) == 1 and all(int(n) == 1 for n in shape[:dim])


def gathered_blocks(started: torch.Tensor, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    """Finish :func:`start_gather_blocks`: wait, then join the unpadded blocks.

    One copy, none when the gathered buffer is already the joined tensor (even blocks,
    only dims of length one before ``dim``).
    """
    if len(sizes) == 1:
        return started
    gathered = compat.wait(started)
    per_rank = gathered.unflatten(0, (len(sizes), gathered.shape[0] // len(sizes)))
    dim %= per_rank.dim() - 1
    if _rank_major(per_rank.shape[1:], dim, sizes):
        shape = list(per_rank.shape[1:])
        shape[dim] *= len(sizes)
        return gathered.view(shape)
    return torch.cat([per_rank[r].narrow(dim, 0, n) for r, n in enumerate(sizes)], dim=dim)


def gather_blocks(
    local: torch.Tensor, dim: int, sizes: Sequence[int], mesh: DeviceMesh, mesh_dim: int
) -> torch.Tensor:
    """All-gather uneven blocks over ``mesh_dim``: ONE ``all_gather_into_tensor``.

    Each block is padded to the largest along ``dim``, gathered, then unpadded.

    Parameters
    ----------
    local : torch.Tensor
        This rank's block (length ``sizes[k]`` along ``dim`` at coordinate ``k``).
    dim : int
        Tensor dim of the blocks.
    sizes : sequence of int
        Block lengths of the ranks along ``mesh_dim``.
    mesh : DeviceMesh
        The domain mesh.
    mesh_dim : int
        Mesh dim the blocks are spread over.

    Returns
    -------
    torch.Tensor
        The full length ``sum(sizes)`` along ``dim``, identical on the ranks along
        ``mesh_dim`` (no communication when there is one block).
    """
    return gathered_blocks(start_gather_blocks(local, dim, sizes, mesh, mesh_dim), dim, sizes)


def start_reduce_scatter_blocks(
    full: torch.Tensor, dim: int, sizes: Sequence[int], mesh: DeviceMesh, mesh_dim: int
) -> torch.Tensor:
    """Start :func:`reduce_scatter_blocks`; :func:`reduce_scattered_blocks` finishes it.

    The blocks of ``full`` are copied once into a ``[ranks, ...]`` buffer, each padded to
    the largest (no copy when ``full`` already is that buffer: even blocks, only dims of
    length one before ``dim``), and ONE ``reduce_scatter_tensor`` over ``mesh_dim`` starts
    on it.
    Arguments as :func:`reduce_scatter_blocks`.
    """
    if len(sizes) == 1:
        return full
    widest = max(sizes)
    dim %= full.dim()
    if _rank_major(full.shape, dim, sizes):  # the blocks are already stacked rank by rank
        shape = list(full.shape)
        shape[dim] = widest
        return compat.start_reduce_scatter(
            full.reshape(len(sizes) * shape[0], *shape[1:]), mesh, mesh_dim
        )
    shape = [len(sizes), *full.shape]
    shape[dim + 1] = widest
    buffer = full.new_zeros(shape)
    for r, (start, n) in enumerate(zip(block_starts(sizes), sizes)):
        buffer[r].narrow(dim, 0, n).copy_(full.narrow(dim, start, n))
    return compat.start_reduce_scatter(buffer.flatten(0, 1), mesh, mesh_dim)


def reduce_scattered_blocks(
    started: torch.Tensor, dim: int, sizes: Sequence[int], mesh: DeviceMesh, mesh_dim: int
) -> torch.Tensor:
    """Finish :func:`start_reduce_scatter_blocks`: wait, then cut this rank's block (a view)."""
    if len(sizes) == 1:
        return started
    return compat.wait(started).narrow(dim, 0, sizes[mesh.get_coordinate()[mesh_dim]])


def reduce_scatter_blocks(
    full: torch.Tensor, dim: int, sizes: Sequence[int], mesh: DeviceMesh, mesh_dim: int
) -> torch.Tensor:
    """Adjoint of :func:`gather_blocks`: ONE ``reduce_scatter_tensor`` over ``mesh_dim``.

    Parameters
    ----------
    full : torch.Tensor
        A full-length (``sum(sizes)`` along ``dim``) contribution on every rank.
    dim : int
        Tensor dim of the blocks.
    sizes : sequence of int
        Block lengths of the ranks along ``mesh_dim``.
    mesh : DeviceMesh
        The domain mesh.
    mesh_dim : int
        Mesh dim the blocks are spread over.

    Returns
    -------
    torch.Tensor
        This rank's block of the sum of the contributions over ``mesh_dim``.
    """
    started = start_reduce_scatter_blocks(full, dim, sizes, mesh, mesh_dim)
    return reduce_scattered_blocks(started, dim, sizes, mesh, mesh_dim)


def gather_rows(
    local: torch.Tensor, dim: int, sizes: Sequence[int], mesh: DeviceMesh
) -> torch.Tensor:
    """:func:`gather_blocks` over ``cp0`` (the token row blocks)."""
    return gather_blocks(local, dim, sizes, mesh, ROWS)


def reduce_scatter_rows(
    full: torch.Tensor, dim: int, sizes: Sequence[int], mesh: DeviceMesh
) -> torch.Tensor:
    """:func:`reduce_scatter_blocks` over ``cp0`` (the token row blocks)."""
    return reduce_scatter_blocks(full, dim, sizes, mesh, ROWS)


def all_reduce(t: torch.Tensor, mesh: DeviceMesh, mesh_dim: int, op: str = "sum") -> torch.Tensor:
    """Reduce over the ranks along ``mesh_dim``: ONE ``all_reduce`` (none when the dim is 1)."""
    if mesh.size(mesh_dim) == 1:
        return t
    return compat.all_reduce(t, op, mesh, mesh_dim)


def raise_on_every_rank(
    problem: str | None, mesh: DeviceMesh, error: type[Exception] = ShardingLayoutError
) -> None:
    """Raise ``error`` on every rank of ``mesh`` when any of its ranks found a problem.

    A check that fails on one rank only would leave the others waiting in the op's next
    collective until the timeout; with this, every rank raises at once, with the message
    of each rank that failed (prefixed with :func:`rank_label`).

    Communication: ONE ``all_reduce`` of one int over each mesh dim of size > 1; after a
    failure, one ``all_gather_object`` of the messages over each of them.
    """
    flag = torch.tensor([1 if problem else 0], device=torch.device(mesh.device_type))
    for mesh_dim in range(mesh.ndim):
        flag = all_reduce(flag, mesh, mesh_dim, op="max")
    if not int(flag.item()):
        return
    messages = [f"{rank_label(mesh)}: {problem}"] if problem else []
    for mesh_dim in range(mesh.ndim):
        if mesh.size(mesh_dim) == 1:
            continue
        parts: list[list[str] | None] = [None] * mesh.size(mesh_dim)
        dist.all_gather_object(parts, messages, group=mesh.get_group(mesh_dim))
        messages = [m for part in parts for m in part or []]
    raise error("; ".join(messages))


class RowsAndColumns(torch.autograd.Function):
    """The operands of a pair tile: row block ``i`` of a single, column block ``j`` of another.

    Both singles ``[B, L, F]`` are ``(Shard(1), Replicate())``. On rank ``(i, j)``:

    * forward: the row operand is used as is (no communication); the column operand's row
      blocks are all-gathered over ``cp0`` (ONE ``all_gather_into_tensor`` of ``O(L x F)``,
      none when ``cp0 == 1``) and column block ``j`` is cut out;
    * backward: the column gradient is placed at block ``j`` of a full-length buffer and
      reduce-scattered over ``cp0`` (ONE ``reduce_scatter_tensor``, none when ``cp0 == 1``);
      then the row and column gradients, partial sums over the tiles of a row of the mesh,
      are summed over ``cp1`` together (ONE ``all_reduce`` of both, none when ``cp1 == 1``),
      so each single receives its complete ``(Shard(1), Replicate())`` gradient.
    """

    @staticmethod
    def forward(
        ctx,
        rows: torch.Tensor,
        columns: torch.Tensor,
        mesh: DeviceMesh,
        column_row_sizes: tuple[int, ...],
        column_block: tuple[int, int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward pass (see the class docstring)."""
        ctx.mesh = mesh
        ctx.column_row_sizes = column_row_sizes
        ctx.column_block = column_block
        full = gather_rows(columns, 1, column_row_sizes, mesh)
        start, length = column_block
        return rows.view_as(rows), full.narrow(1, start, length).contiguous()

    @staticmethod
    def backward(ctx, grad_rows: torch.Tensor | None, grad_columns: torch.Tensor | None):
        """The adjoint of :meth:`forward`."""
        mesh = ctx.mesh
        sizes = ctx.column_row_sizes
        need_rows, need_columns = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        parts: list[torch.Tensor] = []
        if need_rows:
            parts.append(grad_rows.contiguous())
        if need_columns:
            start, length = ctx.column_block
            shape = list(grad_columns.shape)
            shape[1] = sum(sizes)
            full = grad_columns.new_zeros(shape)
            full.narrow(1, start, length).copy_(grad_columns)
            parts.append(reduce_scatter_rows(full, 1, sizes, mesh).contiguous())
        if not parts:
            return None, None, None, None, None
        flat = torch.cat([p.reshape(-1) for p in parts])
        flat = all_reduce(flat, mesh, COLUMNS)
        out, offset = [], 0
        for p in parts:
            out.append(flat.narrow(0, offset, p.numel()).view(p.shape))
            offset += p.numel()
        grads = iter(out)
        g_rows = next(grads) if need_rows else None
        g_columns = next(grads) if need_columns else None
        return g_rows, g_columns, None, None, None


class SumToReplicate(torch.autograd.Function):
    """Sum a local partial value over mesh dims; the result is the same on every rank.

    Forward: ONE ``all_reduce`` per mesh dim in ``mesh_dims`` (of size > 1). Backward: the
    identity, because every rank's output is the one global value and every rank receives
    the one global gradient of it.
    """

    @staticmethod
    def forward(ctx, partial: torch.Tensor, mesh: DeviceMesh, mesh_dims: tuple[int, ...]):
        """The forward pass (see the class docstring)."""
        out = partial
        for mesh_dim in mesh_dims:
            out = all_reduce(out, mesh, mesh_dim)
        return out.clone() if out is partial else out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """The adjoint of :meth:`forward`."""
        return grad, None, None


class TileParameters(torch.autograd.Function):
    """Parameters used on every rank's tile: their gradients summed over the mesh.

    A module applied to the local blocks of sharded inputs computes, on each rank, the
    part of every parameter's gradient that comes from its own blocks. Forward: the
    parameters as they are (no communication). Backward: the gradients of all of them
    flattened into one buffer, then ONE ``all_reduce`` of it per mesh dim in
    ``mesh_dims`` (none for a dim of size 1), so every rank holds the serial gradient.
    A parameter attached to gradient buckets (:mod:`~physicsnemo_foldcp.core.partial_grads`)
    leaves its part in its bucket instead, reduced once per step with the others.
    """

    @staticmethod
    def forward(ctx, mesh: DeviceMesh, mesh_dims: tuple[int, ...], *params: torch.Tensor):
        """``params`` unchanged (as views, so autograd routes their gradients here)."""
        ctx.mesh, ctx.mesh_dims = mesh, mesh_dims
        ctx.params = params if partial_grads.any_attached() else ()
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        """The gradients, summed over ``mesh_dims`` in one flat buffer per mesh dim."""
        dims = tuple(m for m in ctx.mesh_dims if ctx.mesh.size(m) > 1)
        out: list[torch.Tensor | None] = [None] * len(grads)
        immediate = []
        for i, g in enumerate(grads):  # unused outputs: zeros (materialized)
            if ctx.params and partial_grads.kept(ctx.params[i], g, ctx.mesh, dims):
                out[i] = partial_grads.kept_gradient(g)
            else:
                immediate.append(i)
        if immediate:
            flat = torch.cat([grads[i].reshape(-1) for i in immediate])
            for mesh_dim in dims:
                flat = all_reduce(flat, ctx.mesh, mesh_dim)
            if dims:
                partial_grads.note_reduced_per_call(len(dims))
            offset = 0
            for i in immediate:
                out[i] = flat.narrow(0, offset, grads[i].numel()).view(grads[i].shape)
                offset += grads[i].numel()
        return (None, None, *out)
