"""A transposed pair tile brought back to the tile layout: ``z + z.transpose(1, 2)``.

Transposing a pair tile ``z [B, N, N, ...]`` ``(Shard(1), Shard(2))`` is local: the
result ``y`` is ``(Shard(2), Shard(1))``, rank ``(p, q)`` holding ``y[C_q, R_p]``. An
elementwise op of ``y`` with a tile (Boltz's distogram head symmetrises the pair this
way) needs ``y``'s values on the tile layout, rank ``(i, j)`` holding ``y[R_i, C_j]``.
The generic path all-gathers ``y`` over both mesh dims (the full pair on every rank);
:func:`mirror_tile` moves only the pieces: from rank ``(p, q)`` to rank ``(i, j)`` goes
``y[C_q ∩ R_i, R_p ∩ C_j]``. On a square mesh with equal blocks that is one tile from the
mirror rank ``(j, i)``; on any ``cp0 x cp1`` mesh with uneven blocks, a few pieces whose
sizes add up to one tile.

Communication per call, forward and backward alike: point-to-point sends and receives
(one ``batch_isend_irecv``) of the non-empty pieces, about one tile received and one sent
per rank; none for the rank's own piece. Peak extra memory: one tile (the received pieces
and the assembled result).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from physicsnemo_foldcp.core.blocks import block_starts, coordinate, mesh_ranks, overlap


def _span(a_sizes: Sequence[int], a: int, b_sizes: Sequence[int], b: int) -> tuple[int, int]:
    """``(start, length)`` of block ``a`` of one partition ∩ block ``b`` of another."""
    a_start, b_start = block_starts(a_sizes)[a], block_starts(b_sizes)[b]
    start = max(a_start, b_start)
    return start, overlap(a_start, a_sizes[a], b_start, b_sizes[b])


def _exchange(
    local: torch.Tensor,
    a: int,
    b: int,
    rows: Sequence[int],
    columns: Sequence[int],
    mesh: DeviceMesh,
) -> torch.Tensor:
    """Move ``local`` from the transposed layout to the tile layout.

    In: dim ``a`` in ``columns`` blocks (over cp1), dim ``b`` in ``rows`` blocks (over cp0).
    Out: dim ``a`` in ``rows`` blocks (over cp0), dim ``b`` in ``columns`` blocks (over cp1).
    """
    p, q = coordinate(mesh)
    ranks = mesh_ranks(mesh)
    me = ranks[p][q]
    out_shape = list(local.shape)
    out_shape[a], out_shape[b] = rows[p], columns[q]
    out = local.new_empty(out_shape)
    a_in, b_in = block_starts(columns)[q], block_starts(rows)[p]
    a_out, b_out = block_starts(rows)[p], block_starts(columns)[q]
    sends, receives, ops = [], [], []
    for i in range(len(rows)):
        for j in range(len(columns)):
            peer = ranks[i][j]
            # What this rank (p, q) sends to (i, j): y[C_q ∩ R_i, R_p ∩ C_j].
            sa, na = _span(columns, q, rows, i)
            sb, nb = _span(rows, p, columns, j)
            if na and nb:
                piece = local.narrow(a, sa - a_in, na).narrow(b, sb - b_in, nb)
                if peer == me:
                    sends.append(None)
                    own = piece
                else:
                    piece = piece.contiguous()
                    sends.append(piece)
                    ops.append(dist.P2POp(dist.isend, piece, peer))
            # What (i, j), as a source, sends to this rank: y[C_j ∩ R_p, R_i ∩ C_q].
            ra, ma = _span(columns, j, rows, p)
            rb, mb = _span(rows, i, columns, q)
            if ma and mb and peer != me:
                shape = list(local.shape)
                shape[a], shape[b] = ma, mb
                buffer = local.new_empty(shape)
                receives.append((buffer, ra - a_out, rb - b_out))
                ops.append(dist.P2POp(dist.irecv, buffer, peer))
            elif ma and mb:
                receives.append((None, ra - a_out, rb - b_out))
    for work in dist.batch_isend_irecv(ops) if ops else ():
        work.wait()
    for buffer, at_a, at_b in receives:
        piece = own if buffer is None else buffer
        out.narrow(a, at_a, piece.shape[a]).narrow(b, at_b, piece.shape[b]).copy_(piece)
    return out


class MirrorTile(torch.autograd.Function):
    """:func:`mirror_tile` with its adjoint (the same exchange with ``a`` and ``b`` swapped)."""

    @staticmethod
    def forward(ctx, local, a, b, rows, columns, mesh):
        """See :func:`mirror_tile`."""
        ctx.args = (a, b, rows, columns, mesh)
        return _exchange(local, a, b, rows, columns, mesh)

    @staticmethod
    def backward(ctx, grad):
        """The gradient sent back along the same pieces."""
        a, b, rows, columns, mesh = ctx.args
        return _exchange(grad.contiguous(), b, a, rows, columns, mesh), None, None, None, None, None


def mirror_tile(
    local: torch.Tensor,
    a: int,
    b: int,
    rows: Sequence[int],
    columns: Sequence[int],
    mesh: DeviceMesh,
) -> torch.Tensor:
    """This rank's tile of a transposed pair, from its block of the transposed layout.

    Parameters
    ----------
    local : torch.Tensor
        Rank ``(p, q)``'s block of ``y`` (e.g. ``z.transpose(1, 2)`` of a pair tile):
        dim ``a`` holds column block ``C_q`` (length ``columns[q]``), dim ``b`` row block
        ``R_p`` (``rows[p]``).
    a, b : int
        The two token dims of ``y``; ``a`` becomes the row dim of the tile.
    rows, columns : sequence of int
        The pair's row blocks over ``cp0`` and column blocks over ``cp1`` (both add up to
        ``N``).
    mesh : DeviceMesh
        The 2-D ``(cp0, cp1)`` domain mesh.

    Returns
    -------
    torch.Tensor
        Rank ``(i, j)``'s tile of ``y``: dim ``a`` of length ``rows[i]``, dim ``b`` of
        length ``columns[j]``; differentiable.
    """
    return MirrorTile.apply(local, a, b, tuple(rows), tuple(columns), mesh)


__all__ = ["MirrorTile", "mirror_tile"]
