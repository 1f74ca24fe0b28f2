"""atom <-> token ops: tokens -> atoms broadcast, atoms -> tokens mean, representative atoms.

Each op is a plain-torch function with the serial semantics of Boltz, and a ShardTensor
handler registered at import. Atoms follow their tokens, so the handlers multiply co-sharded
local blocks: **no collective in forward or backward** for the activations. The map is data
(no gradient); a map that requires grad is refused with a clear error. A map that
:func:`~physicsnemo_foldcp.sharding.map_tags.tag_maps` has not checked (untagged, or
with a tag built elsewhere with ``checked=False``) is checked on each call: one
``all_reduce`` of a flag over each mesh dim, so a block with entries outside its rank's
tokens fails every rank at once with that rank's message
(:func:`~physicsnemo_foldcp.core.blocks.raise_on_every_rank`).

Shapes (batched ``[B, ...]`` as Boltz uses them; the unbatched forms drop ``B``):

* single ``s [B, N, C]``, atom single ``q [B, A, C]``, coordinates ``x [B, A, 3]``;
* dense maps: ``atom_to_token [B, A, N]``, ``token_to_rep_atom [B, N, A]`` (also
  ``token_to_center_atom``, and ``r_set_to_rep_atom [B, R, A]``), one-hot;
* index maps (the scatter's ``map_layout="index"``): ``atom_to_token [B, A]`` int64 token
  position of each atom, ``token_to_rep_atom [B, N]`` int64 atom position of each token,
  ``-1`` for none. A map is dense when it has as many dims as the other operand.

Distributed placements over ``(cp0, cp1)`` (batched; unbatched dims are one less): singles
and maps ``(Shard(1), Replicate())``, outputs ``(Shard(1), Replicate())`` with the row
blocks of the output axis.
"""

from __future__ import annotations

import torch
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor.placement_types import Replicate, Shard
from torch.overrides import handle_torch_function, has_torch_function

from physicsnemo_foldcp.core.blocks import (
    ROWS,
    MapLayoutError,
    ShardingLayoutError,
    block,
    coordinate,
    describe,
    local_of,
    mesh_sizes,
    raise_on_every_rank,
    require_shard_tensor,
    row_dim,
    row_shapes,
)
from physicsnemo_foldcp.core.compat import global_shape, local_tensor
from physicsnemo_foldcp.core.tags import MapTag
from physicsnemo_foldcp.core.tensor import map_tag, register_own, wrap
from physicsnemo_foldcp.sharding.map_tags import dense_block_problem, index_block_problem

DEFAULT_EPS = 1e-6
"""Boltz's ``eps`` in the atoms -> tokens mean."""


# -- plain-torch kernels, shared by the serial path and the handlers (on local blocks) ------


def _gather_rows(index: torch.Tensor, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """``out[..., r, :] = x[..., index[r] - offset, :]``, zero where ``index[r] < 0``."""
    valid = index >= 0
    position = torch.where(valid, index - offset, torch.zeros_like(index))
    if x.ndim == 2:
        out = x.index_select(0, position)
    else:
        expanded = position.unsqueeze(-1).expand(*position.shape, x.shape[-1])
        out = torch.gather(x, -2, expanded)
    return torch.where(valid.unsqueeze(-1), out, torch.zeros_like(out))


def _index_mean(
    index: torch.Tensor, q: torch.Tensor, n_tokens: int, eps: float, offset: int = 0
) -> torch.Tensor:
    """Index-layout atoms -> tokens mean: ``sum_{a: index[a] = t} q[a] / (count[t] + eps)``."""
    valid = index >= 0
    position = torch.where(valid, index - offset, torch.zeros_like(index))
    weight = valid.to(q.dtype)
    counts = q.new_zeros((*index.shape[:-1], n_tokens)).scatter_add(-1, position, weight)
    per_atom = weight / (torch.gather(counts, -1, position) + eps)
    out_shape = (*q.shape[:-2], n_tokens, q.shape[-1])
    contribution = q * per_atom.unsqueeze(-1)
    expanded = position.unsqueeze(-1).expand(*position.shape, q.shape[-1])
    return q.new_zeros(out_shape).scatter_add(-2, expanded, contribution)


def _dense_mean_weights(block: torch.Tensor, eps: float) -> torch.Tensor:
    """``a2t / (a2t.sum(-2, keepdim=True) + eps)`` (Boltz's normalization of the map)."""
    return block / (block.sum(dim=-2, keepdim=True) + eps)


# -- checks ----------------------------------------------------------------------------------


def _map_layout(m: ShardTensor, x: ShardTensor, op: str, m_arg: str) -> str:
    m_dims, x_dims = len(global_shape(m)), len(global_shape(x))
    if m_dims == x_dims:
        return "dense"
    if m_dims == x_dims - 1:
        return "index"
    raise ShardingLayoutError(
        f"{op}: {m_arg} must have as many dims as the other operand (dense one-hot map) or "
        f"one fewer (index map), got {describe(m)} with {describe(x)}"
    )


def _check_map_operand(m: ShardTensor, op: str, m_arg: str) -> MapTag | None:
    if m.requires_grad:
        raise ShardingLayoutError(
            f"{op}: {m_arg} requires grad; under context parallelism the atom<->token maps "
            "are data (their dense gradient is not local to a rank): detach the map"
        )
    tag = map_tag(m)
    if tag is not None and tag.derived_by is not None:
        raise ShardingLayoutError(
            f"{op}: {m_arg} was derived from the scattered map {tag.name!r} by "
            f"{tag.derived_by}, which the plugin cannot follow; pass the map itself"
        )
    return tag


def _same_mesh(a: ShardTensor, b: ShardTensor, op: str) -> None:
    if a.device_mesh != b.device_mesh:
        raise ShardingLayoutError(
            f"{op}: operands live on different meshes: {a.device_mesh} and {b.device_mesh}"
        )


def contract_rows(
    m: ShardTensor, x: ShardTensor, op: str, m_arg: str, x_arg: str, *, cast: bool
) -> ShardTensor:
    """Distributed ``m @ x`` for a map whose rows are sharded (dense or index layout).

    ``m [B, R, L]`` (or index ``[B, R]``) is ``(Shard(1), Replicate())`` over its rows; its
    nonzero columns on the ranks of row block ``i`` lie in block ``i`` of ``L``, the local
    rows of ``x [B, L, C]`` ``(Shard(1), Replicate())``. The output ``[B, R, C]`` is
    ``(Shard(1), Replicate())`` with the row blocks of ``m``. No communication in forward
    or backward: the local product is ``m_local[..., block] @ x_local``.
    """
    x = require_shard_tensor(x, op, x_arg)
    m = require_shard_tensor(m, op, m_arg)
    _same_mesh(m, x, op)
    tag = _check_map_operand(m, op, m_arg)
    x_shape, m_shape = global_shape(x), global_shape(m)
    if len(x_shape) not in (2, 3):
        raise ShardingLayoutError(f"{op}: {x_arg} must be [B, L, C] or [L, C], got {describe(x)}")
    if tag is not None and tag.layout == "dense" and tag.sharded_dim != len(m_shape) - 2:
        raise ShardingLayoutError(
            f"{op}: {m_arg} is the transposed map {tag.name!r}; this form contracts over "
            f"its column axis, so pass the map as scattered, got {describe(m)}"
        )
    xd = row_dim(x, op, x_arg, expected=len(x_shape) - 2)
    layout = _map_layout(m, x, op, m_arg)
    md = row_dim(m, op, m_arg, expected=len(x_shape) - 2)
    if layout == "dense":
        if m_shape[-1] != x_shape[xd] or m_shape[:-2] != x_shape[:-2]:
            raise ShardingLayoutError(
                f"{op}: shapes disagree: {m_arg} {tuple(m_shape)} has {m_shape[-1]} columns "
                f"but {x_arg} {tuple(x_shape)} has {x_shape[xd]} rows (padded layout; batch "
                f"dims {tuple(m_shape[:-2])} vs {tuple(x_shape[:-2])})"
            )
    elif m_shape[:-1] != x_shape[:-2]:
        raise ShardingLayoutError(
            f"{op}: batch dims disagree: {m_arg} {tuple(m_shape)}, {x_arg} {tuple(x_shape)}"
        )
    mesh = x.device_mesh
    i, _ = coordinate(mesh)
    x_sizes = mesh_sizes(x, ROWS, xd)
    if tag is not None and tuple(tag.block_sizes) != tuple(x_sizes):
        raise ShardingLayoutError(
            f"{op}: {x_arg} is not co-sharded with the columns of {tag.name!r}: its cp0 row "
            f"blocks are {x_sizes}, the map's {tag.axes[1]} blocks are {list(tag.block_sizes)}"
        )
    start, length = block(x_sizes, i)
    m_local = local_tensor(m)
    x_local = local_of(x)
    what = f"{op}: {m_arg} ({tag.name!r})" if tag else f"{op}: {m_arg}"
    if layout == "dense":
        if tag is None or not tag.checked:
            problem = dense_block_problem(m_local, m_local.ndim - 1, start, length, what)
            raise_on_every_rank(problem, mesh, MapLayoutError)
        block_local = m_local.narrow(-1, start, length)
        if cast:
            block_local = block_local.to(x_local.dtype)
        out_local = torch.matmul(block_local, x_local)
    else:
        if tag is None or not tag.checked:
            problem = index_block_problem(m_local, start, length, what)
            raise_on_every_rank(problem, mesh, MapLayoutError)
        out_local = _gather_rows(m_local, x_local, start)
    out_sizes = mesh_sizes(m, ROWS, md)
    return wrap(
        out_local,
        mesh,
        (Shard(xd), Replicate()),
        row_shapes(out_local.shape, xd, out_sizes),
    )


def contract_columns(
    m: ShardTensor,
    x: ShardTensor,
    op: str,
    m_arg: str,
    x_arg: str,
    *,
    weights: str | None = None,
    eps: float = DEFAULT_EPS,
    cast: bool,
) -> ShardTensor:
    """Distributed ``m^T @ x`` (or of the Boltz mean weights of ``m``) over the map's rows.

    ``m`` is a tagged map with its rows sharded (``[B, A, N]``, the scattered layout) or its
    transpose ``[B, N, A]``; either way the contraction runs over ``A``, the local rows of
    ``x [B, A, C]`` ``(Shard(1), Replicate())``. The output ``[B, N, C]`` is ``(Shard(1),
    Replicate())`` with the map's column blocks. No communication in forward or backward.

    Parameters
    ----------
    m : ShardTensor
        The tagged map (dense or index layout).
    x : ShardTensor
        ``[B, A, C]`` rows of the map's row axis.
    op, m_arg, x_arg : str
        Names for error messages.
    weights : {None, "mean"}
        ``"mean"`` uses ``m / (m.sum(rows) + eps)`` (Boltz's atoms -> tokens mean).
    eps : float
        The mean's ``eps``.
    cast : bool
        Cast the map to ``x``'s dtype (the plugin functions) or not (``torch.bmm`` forms).
    """
    x = require_shard_tensor(x, op, x_arg)
    m = require_shard_tensor(m, op, m_arg)
    _same_mesh(m, x, op)
    tag = _check_map_operand(m, op, m_arg)
    if tag is None:
        raise ShardingLayoutError(
            f"{op}: {m_arg} carries no map tag, so the token row blocks of its columns are "
            "unknown on this rank; pass the map as returned by scatter_features (tagged by "
            f"physicsnemo_foldcp.ops.tag_maps), got {describe(m)}"
        )
    x_shape, m_shape = global_shape(x), global_shape(m)
    if len(x_shape) not in (2, 3):
        raise ShardingLayoutError(f"{op}: {x_arg} must be [B, L, C] or [L, C], got {describe(x)}")
    xd = row_dim(x, op, x_arg, expected=len(x_shape) - 2)
    layout = _map_layout(m, x, op, m_arg)
    md = row_dim(m, op, m_arg, expected=tag.sharded_dim)
    if m_shape[md] != x_shape[xd]:
        raise ShardingLayoutError(
            f"{op}: shapes disagree: {m_arg} {tuple(m_shape)} has {m_shape[md]} "
            f"{tag.axes[0]} but {x_arg} {tuple(x_shape)} has {x_shape[xd]} rows (padded layout)"
        )
    mesh = x.device_mesh
    i, _ = coordinate(mesh)
    m_sizes, x_sizes = mesh_sizes(m, ROWS, md), mesh_sizes(x, ROWS, xd)
    if m_sizes != x_sizes:
        raise ShardingLayoutError(
            f"{op}: {x_arg} is not co-sharded with the rows of {tag.name!r}: cp0 blocks "
            f"{x_sizes} vs {m_sizes}"
        )
    start, length = tag.column_block(i)
    m_local = local_tensor(m)
    x_local = local_of(x)
    what = f"{op}: {m_arg} ({tag.name!r})"
    if layout == "index":
        if not tag.checked:
            problem = index_block_problem(m_local, start, length, what)
            raise_on_every_rank(problem, mesh, MapLayoutError)
        if weights != "mean":
            raise ShardingLayoutError(f"{op}: an index map supports the mean only")
        out_local = _index_mean(m_local, x_local, length, eps, start)
    else:
        if not tag.checked:
            problem = dense_block_problem(m_local, tag.block_dim, start, length, what)
            raise_on_every_rank(problem, mesh, MapLayoutError)
        block_local = m_local.narrow(tag.block_dim, start, length)
        if cast:
            block_local = block_local.to(x_local.dtype)
        by_rows = block_local if tag.block_dim == len(m_shape) - 1 else block_local.mT
        if weights == "mean":
            by_rows = _dense_mean_weights(by_rows, eps)
        out_local = torch.matmul(by_rows.mT, x_local)
    return wrap(
        out_local,
        mesh,
        (Shard(xd), Replicate()),
        row_shapes(out_local.shape, xd, tag.block_sizes),
    )


# -- public ops ------------------------------------------------------------------------------


def tokens_to_atoms(s: torch.Tensor, atom_to_token: torch.Tensor) -> torch.Tensor:
    """Broadcast a token single to the atoms of each token: ``bmm(atom_to_token, s)``.

    Parameters
    ----------
    s : torch.Tensor
        ``[B, N, C]`` (or ``[N, C]``). Distributed: ``(Shard(1), Replicate())``.
    atom_to_token : torch.Tensor
        Dense one-hot ``[B, A, N]`` (cast to ``s.dtype``) or index ``[B, A]`` (``-1``: no
        token). Distributed: ``(Shard(1), Replicate())``, as scattered.

    Returns
    -------
    torch.Tensor
        ``[B, A, C]``; zero for atoms without a token. Distributed: ``(Shard(1),
        Replicate())`` with the atom row blocks.

    Notes
    -----
    Communication: none in forward or backward (the local block of the map multiplies the
    local token rows; the gradient of ``s`` is the local transpose product).
    """
    if has_torch_function((s, atom_to_token)):
        return handle_torch_function(tokens_to_atoms, (s, atom_to_token), s, atom_to_token)
    if atom_to_token.ndim == s.ndim:
        return torch.matmul(atom_to_token.to(s.dtype), s)
    return _gather_rows(atom_to_token, s)


def atoms_to_tokens_mean(
    q: torch.Tensor,
    atom_to_token: torch.Tensor,
    eps: float = DEFAULT_EPS,
    n_tokens: int | None = None,
) -> torch.Tensor:
    """Mean of the atoms of each token: ``bmm((a2t / (a2t.sum(1, keepdim=True) + eps)).mT, q)``.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, A, C]`` (or ``[A, C]``). Distributed: ``(Shard(1), Replicate())``.
    atom_to_token : torch.Tensor
        Dense one-hot ``[B, A, N]`` (cast to ``q.dtype``) or index ``[B, A]``. Distributed:
        the tagged map as scattered (its tag gives the token row blocks).
    eps : float, default 1e-6
        Added to each token's atom count.
    n_tokens : int, optional
        ``N``; required for an index map on plain tensors (dense maps carry it).

    Returns
    -------
    torch.Tensor
        ``[B, N, C]``; zero for tokens without atoms. Distributed: ``(Shard(1),
        Replicate())`` with the token row blocks.

    Notes
    -----
    Communication: none in forward or backward (every atom of a token is on the ranks that
    hold the token, so the counts and the sums are local).
    """
    if has_torch_function((q, atom_to_token)):
        return handle_torch_function(
            atoms_to_tokens_mean, (q, atom_to_token), q, atom_to_token, eps, n_tokens
        )
    if atom_to_token.ndim == q.ndim:
        weights = _dense_mean_weights(atom_to_token.to(q.dtype), eps)
        return torch.matmul(weights.mT, q)
    if n_tokens is None:
        raise ValueError("atoms_to_tokens_mean: an index map needs n_tokens (N)")
    return _index_mean(atom_to_token, q, int(n_tokens), eps)


def representative_atoms(x_atoms: torch.Tensor, token_to_rep_atom: torch.Tensor) -> torch.Tensor:
    """Pick each token's representative atom: ``bmm(token_to_rep_atom, x_atoms)``.

    Also serves ``token_to_center_atom`` and ``r_set_to_rep_atom`` (rows: r-set).

    Parameters
    ----------
    x_atoms : torch.Tensor
        ``[B, A, C]`` (coordinates ``C = 3``, or features). Distributed: ``(Shard(1),
        Replicate())``.
    token_to_rep_atom : torch.Tensor
        Dense one-hot ``[B, N, A]`` (cast to ``x_atoms.dtype``) or index ``[B, N]``
        (``-1``: none). Distributed: ``(Shard(1), Replicate())``, as scattered.

    Returns
    -------
    torch.Tensor
        ``[B, N, C]``; zero for tokens without a representative atom. Distributed:
        ``(Shard(1), Replicate())`` with the map's row blocks.

    Notes
    -----
    Communication: none in forward or backward.
    """
    if has_torch_function((x_atoms, token_to_rep_atom)):
        return handle_torch_function(
            representative_atoms, (x_atoms, token_to_rep_atom), x_atoms, token_to_rep_atom
        )
    if token_to_rep_atom.ndim == x_atoms.ndim:
        return torch.matmul(token_to_rep_atom.to(x_atoms.dtype), x_atoms)
    return _gather_rows(token_to_rep_atom, x_atoms)


# -- handlers --------------------------------------------------------------------------------


def _tokens_to_atoms_handler(func, types, args, kwargs):
    s, atom_to_token = args
    return contract_rows(atom_to_token, s, "tokens_to_atoms", "atom_to_token", "s", cast=True)


def _atoms_to_tokens_mean_handler(func, types, args, kwargs):
    q, atom_to_token, eps, _n_tokens = args
    return contract_columns(
        atom_to_token,
        q,
        "atoms_to_tokens_mean",
        "atom_to_token",
        "q",
        weights="mean",
        eps=eps,
        cast=True,
    )


def _representative_atoms_handler(func, types, args, kwargs):
    x_atoms, token_to_rep_atom = args
    return contract_rows(
        token_to_rep_atom,
        x_atoms,
        "representative_atoms",
        "token_to_rep_atom",
        "x_atoms",
        cast=True,
    )


register_own(tokens_to_atoms, _tokens_to_atoms_handler)
register_own(atoms_to_tokens_mean, _atoms_to_tokens_mean_handler)
register_own(representative_atoms, _representative_atoms_handler)

__all__ = [
    "DEFAULT_EPS",
    "atoms_to_tokens_mean",
    "contract_columns",
    "contract_rows",
    "representative_atoms",
    "tokens_to_atoms",
]
