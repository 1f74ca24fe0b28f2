"""The outer product mean of a scattered MSA, tile by tile: no rank holds ``[N, N, c^2]``.

The kernel of :mod:`physicsnemo_foldcp.boltz.outer_product_mean` (Boltz's
``OuterProductMean`` under context parallelism, which states why the op-by-op path fails):
the MSA operands brought to each tile and the chunked product, as autograd functions on
local blocks.

The algorithm (rank ``(p, q)``)
-------------------------------
Rank ``(p, q)`` computes its own tile ``out[R_p, C_q]``, which needs ``a`` of the tokens
``R_p`` and ``b`` of the tokens ``C_q`` for every MSA row. With ``n = |R_p|``,
``m = |C_q|``, ``o = |R_p ∩ C_q|``, ``P = cp0``, ``Q = cp1``:

1. ``norm``, ``proj_a`` and ``proj_b`` run on the local block ``[S_p, C_q]`` with the
   module's own parameters (each rank's part of a parameter's gradient is summed over the
   mesh in backward); the mask multiplies ``a`` and ``b`` as in Boltz.
2. :class:`MsaOperands` brings the operands together, the mask travelling with them as one
   more channel: ONE all-to-all over ``cp0`` sends, from rank ``(t, q)``, the whole
   ``b | mask`` block ``[S_t, C_q]`` and the ``a | mask`` columns ``R_p ∩ C_q`` to rank
   ``(p, q)``, which then holds ``b[all S, C_q]`` and ``a[all S, R_p ∩ C_q]``; the
   pieces ``R_p ∩ C_l`` of the ranks ``(p, l)`` are joined over ``cp1`` into
   ``a[all S, R_p]``: ONE all-gather of the uneven pieces, or ONE all-reduce of the pieces
   placed in a zeroed strip when padding them to the widest would more than double the
   strip (square meshes with ``cp1 > 2``, as the triangle attention's bias strip).
3. The mask count of the tile is local (``einsum`` of the gathered mask rows and columns):
   no further reduction. :class:`OuterProductTile` contracts over ``s`` in chunks of ``k``
   hidden channels of ``a`` and applies the matching columns of ``proj_o.weight`` to each
   chunk at once, so the ``n x m x k c`` chunk is the only ``c^2``-wide tensor and it is
   not saved: backward recomputes it (unless the kernels keep it,
   :mod:`~physicsnemo_foldcp.kernels.budget`). Division by the count commutes with the linear
   projection and is applied after it; ``proj_o.bias`` is added once per tile. The
   contraction accumulates in fp32, as Boltz's ``a.float()`` does.

Why this scheme: a rank needs ``S (n + m) c`` operand elements, which this moves (about
``S (n + m) (c + 1)`` with the mask). The alternative, every rank ``(t, q)`` contracting
its own rows ``S_t`` for all ``N`` token rows after an all-gather of ``a`` over ``cp1``, then
a reduce-scatter over ``cp0`` of the ``N x m x c_out`` partial sums, moves
``S_t N c + N m c_out`` and holds ``P`` output tiles; with Boltz's ``c = 32``,
``c_out = 128`` it is the larger whenever ``N > S / 4``, and it never holds less.

Communication per call (none along a mesh dim of size 1):

* forward: ONE all-to-all over ``cp0`` (receives ``(S - S_p) (m + o) (c + 1)`` elements);
  ONE all-gather over ``cp1`` (``Q max_l |R_p ∩ C_l| S (c + 1)``; ``n S (c + 1)`` when the
  pieces are even) or ONE all-reduce of the ``S x n x (c + 1)`` strip;
* backward: the adjoints without the mask channel: ONE reduce-scatter (or all-reduce) over
  ``cp1`` of ``a``'s strip gradient, ONE all-to-all over ``cp0`` (``b``'s gradient summed
  over the tiles of the mesh column, ``a``'s pieces sent home); ONE all-reduce over ``cp0``
  and ONE over ``cp1`` of all parameter gradients together.

Memory: autograd keeps the gathered operands ``S (n + m) c`` (``P`` times the local
``a``, ``b`` when ``cp0 == cp1``), the masks, the count ``n x m`` and the output tile. The
peak extra while contracting is one chunk ``n x m x k c`` and its projection
``n x m x c_out``, with ``k = max(1, c_out // c)`` (about one output tile; twice that while
``einsum`` reorders it) unless Boltz's eval-mode ``chunk_size`` asks for another ``k``;
backward also holds the chunk's gradient (the same size) and the operand gradients.
``chunk_size`` changes only the chunking, not the result.

The pair's row blocks
---------------------
The MSA carries the column blocks ``C_q`` but not the pair's row blocks. They are the
column blocks when ``cp0 == cp1`` (the plan's rule); otherwise the plan's default even
split of the token axis over ``cp0`` is assumed, unless ``row_sizes`` is given (a plan with
balanced token bounds or per-shard token padding on a non-square mesh needs it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from physicsnemo_foldcp.core import compat
from physicsnemo_foldcp.core.blocks import (
    COLUMNS,
    ROWS,
    all_reduce,
    block_starts,
    gather_blocks,
    overlap,
    reduce_scatter_blocks,
)
from physicsnemo_foldcp.kernels.autocast import backward_in_forward_autocast
from physicsnemo_foldcp.kernels.budget import kernel_recompute
from physicsnemo_foldcp.sharding.plan import split_sizes

# -- geometry --------------------------------------------------------------------------------


@dataclass(frozen=True)
class MsaLayout:
    """Where the MSA blocks and the pair tile lie on the ``(cp0, cp1)`` mesh.

    Attributes
    ----------
    mesh : DeviceMesh
        The 2-D domain mesh.
    msa_sizes : tuple[int, ...]
        MSA row blocks ``S_t`` over ``cp0``.
    row_sizes : tuple[int, ...]
        The pair's token row blocks ``R_t`` over ``cp0``.
    col_sizes : tuple[int, ...]
        The token column blocks ``C_l`` over ``cp1`` (the MSA's token blocks).
    p, q : int
        This rank's coordinates.
    """

    mesh: DeviceMesh
    msa_sizes: tuple[int, ...]
    row_sizes: tuple[int, ...]
    col_sizes: tuple[int, ...]
    p: int
    q: int

    def meet(self, row_block: int, col_block: int) -> tuple[int, int]:
        """``(start within C_col_block, length)`` of ``R_row_block ∩ C_col_block``."""
        rows, cols = block_starts(self.row_sizes), block_starts(self.col_sizes)
        length = overlap(
            rows[row_block],
            self.row_sizes[row_block],
            cols[col_block],
            self.col_sizes[col_block],
        )
        start = max(rows[row_block], cols[col_block]) - cols[col_block] if length else 0
        return start, length

    def strip_pieces(self) -> list[int]:
        """``|R_p ∩ C_l|`` for every column block ``l``: the pieces of ``a``'s strip."""
        return [self.meet(self.p, col)[1] for col in range(len(self.col_sizes))]

    def strip_by_sum(self) -> bool:
        """Whether the strip is joined over ``cp1`` by an all-reduce of placed pieces.

        An all-gather pads every piece to the widest (``Q x widest`` columns move); when
        that is more than twice the strip, an all-reduce of a zeroed strip holding this
        rank's piece moves less.
        """
        pieces = self.strip_pieces()
        return len(pieces) > 1 and len(pieces) * max(pieces) > 2 * sum(pieces)


def pair_row_sizes(col_sizes: Sequence[int], cp0: int) -> list[int]:
    """The pair's row blocks given its column blocks (see the module docstring)."""
    if len(col_sizes) == cp0:
        return [int(s) for s in col_sizes]
    return split_sizes(int(sum(col_sizes)), cp0)


# -- communication ---------------------------------------------------------------------------


@backward_in_forward_autocast
class MsaOperands(torch.autograd.Function):
    """``a`` of the tile's token rows and ``b`` of its columns, for every MSA row.

    Inputs on rank ``(p, q)``: ``a``, ``b`` ``[B, S_p, m, c]`` and the mask ``[B, S_p, m]``
    of the local MSA block. Outputs: ``a_rows [B, S, n, c]`` (tokens ``R_p``),
    ``b_cols [B, S, m, c]`` (tokens ``C_q``), ``mask_rows [B, S, n]``, ``mask_cols
    [B, S, m]`` (not differentiable).

    Forward: ONE all-to-all over ``cp0``, then ONE all-gather (or all-reduce) over ``cp1``
    (module docstring, step 2). Backward: ONE reduce-scatter (or all-reduce) over ``cp1``,
    ONE all-to-all over ``cp0``.
    """

    @staticmethod
    def forward(ctx, a, b, mask, layout: MsaLayout):
        """Bring the operands together (see the class docstring)."""
        ctx.layout = layout
        batch, _, m, c = a.shape
        lay = layout
        n_dest = len(lay.row_sizes)
        with_mask_a = torch.cat([a, mask.to(a.dtype).unsqueeze(-1)], dim=-1)
        with_mask_b = torch.cat([b, mask.to(b.dtype).unsqueeze(-1)], dim=-1)
        width = c + 1
        own_piece = lay.meet(lay.p, lay.q)[1]
        if n_dest > 1:
            send, send_sizes = [], []
            for t in range(n_dest):
                start, length = lay.meet(t, lay.q)
                send.append(with_mask_b.reshape(-1))
                send.append(with_mask_a.narrow(2, start, length).reshape(-1))
                send_sizes.append(
                    with_mask_b.numel() + with_mask_a.shape[1] * length * batch * width
                )
            receive = [batch * s_t * (m + own_piece) * width for s_t in lay.msa_sizes]
            got = compat.all_to_all(torch.cat(send), receive, send_sizes, lay.mesh, ROWS)
            b_parts, a_parts = [], []
            for s_t, piece in zip(lay.msa_sizes, got.split(receive)):
                b_part, a_part = piece.split(
                    [batch * s_t * m * width, batch * s_t * own_piece * width]
                )
                b_parts.append(b_part.view(batch, s_t, m, width))
                a_parts.append(a_part.view(batch, s_t, own_piece, width))
            b_full = torch.cat(b_parts, dim=1)
            a_piece = torch.cat(a_parts, dim=1)
        else:
            start, length = lay.meet(lay.p, lay.q)
            b_full, a_piece = with_mask_b, with_mask_a.narrow(2, start, length)
        pieces = lay.strip_pieces()
        if lay.strip_by_sum():
            strip = a_piece.new_zeros(batch, a_piece.shape[1], sum(pieces), width)
            strip.narrow(2, sum(pieces[: lay.q]), own_piece).copy_(a_piece)
            a_full = all_reduce(strip, lay.mesh, COLUMNS)
        else:
            a_full = gather_blocks(a_piece.contiguous(), 2, pieces, lay.mesh, COLUMNS)
        a_rows, mask_rows = a_full[..., :c].contiguous(), a_full[..., c].contiguous()
        b_cols, mask_cols = b_full[..., :c].contiguous(), b_full[..., c].contiguous()
        ctx.mark_non_differentiable(mask_rows, mask_cols)
        ctx.shapes = (tuple(a.shape), tuple(b.shape))
        return a_rows, b_cols, mask_rows, mask_cols

    @staticmethod
    def backward(ctx, grad_a_rows, grad_b_cols, _grad_mask_rows, _grad_mask_cols):
        """Sum the operand gradients over the tiles that used them and send them home."""
        lay: MsaLayout = ctx.layout
        a_shape, b_shape = ctx.shapes
        batch, s_p, m, c = a_shape
        pieces = lay.strip_pieces()
        own_piece = pieces[lay.q]
        if lay.strip_by_sum():
            total = all_reduce(grad_a_rows.contiguous(), lay.mesh, COLUMNS)
            grad_piece = total.narrow(2, sum(pieces[: lay.q]), own_piece)
        else:
            grad_piece = reduce_scatter_blocks(grad_a_rows, 2, pieces, lay.mesh, COLUMNS)
        n_dest = len(lay.row_sizes)
        if n_dest == 1:
            start, length = lay.meet(lay.p, lay.q)
            grad_a = grad_a_rows.new_zeros(a_shape)
            grad_a.narrow(2, start, length).copy_(grad_piece)
            return grad_a, grad_b_cols, None, None
        send, send_sizes = [], []
        msa_starts = block_starts(lay.msa_sizes)
        for t, s_t in enumerate(lay.msa_sizes):
            send.append(grad_b_cols.narrow(1, msa_starts[t], s_t).reshape(-1))
            send.append(grad_piece.narrow(1, msa_starts[t], s_t).reshape(-1))
            send_sizes.append(batch * s_t * (m + own_piece) * c)
        lengths = [lay.meet(t, lay.q)[1] for t in range(n_dest)]
        receive = [batch * s_p * (m + length) * c for length in lengths]
        got = compat.all_to_all(torch.cat(send), receive, send_sizes, lay.mesh, ROWS)
        grad_b = grad_b_cols.new_zeros(b_shape)
        grad_a = grad_b_cols.new_zeros(a_shape)
        for t, piece in enumerate(got.split(receive)):
            g_b, g_a = piece.split([batch * s_p * m * c, batch * s_p * lengths[t] * c])
            grad_b += g_b.view(b_shape)
            start, length = lay.meet(t, lay.q)
            grad_a.narrow(2, start, length).copy_(g_a.view(batch, s_p, length, c))
        return grad_a, grad_b, None, None


# -- the local contraction -------------------------------------------------------------------


@backward_in_forward_autocast
class OuterProductTile(torch.autograd.Function):
    """``sum_s a[s, i] (x) b[s, j]`` projected by ``weight``, divided by ``count``: local.

    Inputs: ``a [B, S, n, c]``, ``b [B, S, m, c]``, ``weight [c_out, c * c]`` and
    ``count [B, n, m]`` (not differentiable). Output ``[B, n, m, c_out]`` in fp32.

    Forward and backward loop over chunks of ``chunk`` hidden channels of ``a``; a chunk's
    ``[B, n, m, chunk * c]`` outer product is projected at once and recomputed in backward
    for the weight's gradient, unless the kernels keep it
    (:func:`~physicsnemo_foldcp.kernels.budget.set_kernel_recompute` ``(False)``: the
    chunks, ``[B, n, m, c^2]`` in all, are kept from forward). No communication.
    """

    @staticmethod
    def forward(ctx, a, b, weight, count, chunk: int):
        """The projected outer-product mean of the tile (see the class docstring)."""
        a32, b32, w32 = a.float(), b.float(), weight.float()
        c = a.shape[-1]
        out = None
        keep = weight.requires_grad and not kernel_recompute()
        kept = []
        for start in range(0, c, chunk):
            width = min(chunk, c - start)
            z = chunk_product(a32, b32, start, width)
            part = z @ w32[:, start * c : (start + width) * c].T
            out = part if out is None else out + part
            if keep:
                kept.append(z)
        out = out / count.unsqueeze(-1)
        ctx.save_for_backward(a, b, weight, count, *kept)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, grad):
        """Chunk by chunk: the outer product kept or recomputed, its gradient formed and used."""
        a, b, weight, count, *kept = ctx.saved_tensors
        chunk = ctx.chunk
        a32, b32, w32 = a.float(), b.float(), weight.float()
        batch, _, n, c = a.shape
        m = b.shape[2]
        g = grad.float() / count.unsqueeze(-1)  # [B, n, m, c_out]
        grad_a = torch.zeros_like(a32) if ctx.needs_input_grad[0] else None
        grad_b = torch.zeros_like(b32) if ctx.needs_input_grad[1] else None
        grad_w = torch.zeros_like(w32) if ctx.needs_input_grad[2] else None
        for index, start in enumerate(range(0, c, chunk)):
            width = min(chunk, c - start)
            cols = slice(start * c, (start + width) * c)
            if grad_w is not None:
                z = kept[index] if kept else chunk_product(a32, b32, start, width)
                grad_w[:, cols] = torch.einsum("bijo,bijx->ox", g, z)
                del z
            gz = (g @ w32[:, cols]).view(batch, n, m, width, c)
            if grad_a is not None:
                grad_a[..., start : start + width] = torch.einsum("bijcd,bsjd->bsic", gz, b32)
            if grad_b is not None:
                a_chunk = a32[..., start : start + width]
                grad_b += torch.einsum("bijcd,bsic->bsjd", gz, a_chunk)
        return (
            None if grad_a is None else grad_a.to(a.dtype),
            None if grad_b is None else grad_b.to(b.dtype),
            None if grad_w is None else grad_w.to(weight.dtype),
            None,
            None,
        )


def chunk_product(a: torch.Tensor, b: torch.Tensor, start: int, width: int) -> torch.Tensor:
    """``[B, n, m, width * c]``: the outer product of ``a``'s channels ``start:start+width``."""
    z = torch.einsum("bsic,bsjd->bijcd", a[..., start : start + width], b)
    return z.reshape(*z.shape[:3], -1)
