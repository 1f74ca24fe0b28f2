"""Streamed triangle attention on pair tiles: no rank holds a row's N x N scores.

The kernel of :mod:`physicsnemo_foldcp.boltz.triangle_attention` (Boltz's
``TriangleAttention`` under context parallelism, which states why the op-by-op path
fails): the query bias strip, the key stream and the online-softmax attention, as
autograd functions on local blocks.

The algorithm (starting node; rank ``(i, j)``)
----------------------------------------------
Rank ``(i, j)`` computes the outputs of its own tile: rows ``r in R_i``, queries
``q in C_j``. With ``n = |R_i|``, ``m = |C_j|``, ``P = cp0`` (the row mesh dim) and
``Q = cp1`` (the key mesh dim):

1. ``layer_norm`` and the ``linear`` / ``linear_q, k, v, g`` projections run on the local
   tile with the module's own parameters (Boltz's own ``forward`` of each submodule through
   :func:`torch.func.functional_call`). Each rank's parameter gradient is a part of the sum,
   so one autograd function sums all of them over the mesh in backward.
2. The queries' bias strip ``bias[q in C_j, k in 0..N, h]`` (:class:`QueryStrip`): the bias
   rows ``C_j`` are spread over the ranks whose *row* block meets ``C_j``. ONE all-to-all
   over ``Q`` sends, from rank ``(p, l)``, the rows ``R_p ∩ C_t`` of its bias tile to rank
   ``(p, t)``, which then holds ``bias[R_p ∩ C_t, all k]``; these pieces are joined over
   ``P`` into ``bias[C_t, all k]`` on every rank of mesh column ``t``: ONE all-gather of
   the uneven pieces, or, when padding them to the widest would more than double the strip
   (square meshes, where one row block holds all of ``C_t``), ONE all-reduce of the pieces
   placed in a zeroed strip. No assumption on ``cp0 == cp1`` or on equal blocks.
3. Keys, values and the key mask of rows ``R_i`` live on the ranks of mesh row ``i``
   (``(i, l)`` holds keys ``C_l``). They are streamed over ``Q`` in ``S`` steps: in step
   ``s`` every rank contributes columns ``[s w, (s + 1) w)`` of its tile (``w =
   ceil(max_l |C_l| / cp1)``, pieces padded to ``w``), ONE all-gather over ``Q`` per step,
   so a rank holds about one key tile at a time, never a full row of key tiles. Every key
   sub-chunk of width ``kc`` (the widest that fits the work budget,
   :mod:`~physicsnemo_foldcp.kernels.budget`) gives ``[B, n, H, m, kc]`` logits
   (``q k^T``, then the mask bias, then the triangle bias, in Boltz's order), merged into
   an online softmax (running max, running sum, running weighted values). When four
   streamed buffers fit the work budget (:attr:`Stream.overlap`), the next step's
   all-gather is started before the current step is computed, so the transfer overlaps
   the compute; each rank's piece is copied once into the send buffer and the gathered
   pieces are read in place (no re-layout).
4. Backward recomputes the logits the same way (flash-attention style, from the saved
   running max and sum), or reads the probabilities ``[B, n, H, m, N]`` that forward kept
   (``set_kernel_recompute(False)``, :mod:`~physicsnemo_foldcp.kernels.budget`): the
   gradients of the streamed keys and values are reduce-scattered back over ``Q`` per step
   (with the overlap, while the next step is computed, into the other of two buffers),
   the bias strip's gradient goes back through the adjoint of step 2 (ONE reduce-scatter,
   or all-reduce, over ``P``; ONE all-to-all over ``Q``).

The ending node runs the same algorithm on the locally transposed tile with the mesh dims
swapped (``P = cp1``, ``Q = cp0``): rows are the pair's columns ``C_j``, queries and keys
its rows, keys streamed over ``cp0``. No tile transpose is communicated.

Collectives per call (starting node; the ending node swaps cp0 and cp1; none along a mesh
dim of size 1), with ``F = H (2 c + 1)`` (keys, values, the mask per head) and
``o_p = |R_p ∩ C_j|``:

* forward: ONE all-to-all over ``cp1`` (sends the ``n x m x H`` bias tile, receives
  ``o_i x N x H``); over ``cp0``, ONE all-gather (``cp0 max_p o_p x N x H``, the
  ``m x N x H`` strip when the pieces are even) or ONE all-reduce of the ``m x N x H``
  strip; ``S <= cp1`` all-gathers over ``cp1`` (each ``cp1 w x n x F``, about
  ``n x N x F`` in all);
* backward: ``S`` all-gathers over ``cp1`` again (recompute) and ``S`` reduce-scatters over
  ``cp1`` of the key/value gradients (``cp1 w x n x 2 H c`` each, about ``n x N x 2 H c``
  in all); for the bias strip ONE reduce-scatter (or all-reduce) over ``cp0`` of the
  ``m x N x H`` strip gradient and ONE all-to-all over ``cp1`` (the forward's sizes
  reversed); ONE all-reduce over ``cp0`` and ONE over ``cp1`` of all parameter gradients
  together (``|theta|`` elements).

Memory, in units of the local pair tile ``n x m x C`` (``C`` channels): autograd keeps
tile-sized activations, as the serial module does per row (the normalised tile, ``q``,
``k``, ``v``, the gate, the attention output and the input of ``linear_o``, ``H c / C``
tiles each), the bias tile (``H / C``) and the strip (``(N / n) H / C``; at most twice
that while it is assembled), and two ``n x H x m`` softmax statistics. The peak extra
while the attention runs is the streamed buffer ``cp1 w x n x F`` (about
``H (2 c + 1) / C`` tiles of ``w``-padded key columns, i.e. ~2 tiles for Boltz's
``H c = C``; two of them with the overlap, which is on only while they fit the work
budget), a few sub-chunk score tensors of ``n x H x m x kc`` elements (two of them,
the probabilities and their gradient in backward, within the work budget; one key column
at least) and the ``n x H x m x c`` accumulator; in backward also
the key/value gradient buffer ``cp1 w x n x 2 H c`` and ``dq, dk, dv`` (a tile each). No
rank ever holds the ``N x N`` scores of a row, or a row of key tiles, unless the
probabilities are kept for backward (then ``n x H x m x N`` from forward to backward:
``1 / (cp0 cp1)`` of what Boltz's module keeps).

``chunk_size`` (Boltz's eval-mode row chunking) only bounds memory, which the streaming
already bounds, so it is accepted and not used. ``use_kernels`` / ``use_flash_attn`` are
not supported under context parallelism yet (ValueError). The mask is not differentiated.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from physicsnemo_foldcp.core import compat
from physicsnemo_foldcp.core.blocks import (
    all_reduce,
    block_starts,
    gather_blocks,
    overlap,
    reduce_scatter_blocks,
)
from physicsnemo_foldcp.kernels.autocast import backward_in_forward_autocast
from physicsnemo_foldcp.kernels.budget import (
    fits,
    kernel_recompute,
    pieces_width,
    report_pieces,
)

SCORE_COPIES = 2
"""Sub-chunk score tensors alive together: the probabilities and, in backward, their
gradient (the logits become the probabilities in place)."""

OVERLAP_BUFFERS = 4
"""Streamed buffers of ``cp w`` key columns alive together when the steps overlap: this
step's and the next step's gathered keys, and in backward two key-gradient buffers."""


# -- geometry --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """The attention's view of the mesh: rows over ``row_dim``, queries and keys over ``key_dim``.

    In this view the local tile is ``[B, n, m, C]``: rows ``r`` of row block ``p`` (of
    ``row_sizes``), queries (and this rank's keys) of key block ``q`` (of ``key_sizes``).
    The starting node is the pair tile as it is (``row_dim = cp0``, ``key_dim = cp1``); the
    ending node is the locally transposed tile (``row_dim = cp1``, ``key_dim = cp0``).

    Attributes
    ----------
    mesh : DeviceMesh
        The 2-D domain mesh.
    row_dim, key_dim : int
        Mesh dims of the rows and of the queries / keys.
    row_sizes, key_sizes : tuple[int, ...]
        Block lengths along ``row_dim`` and ``key_dim``; both sum to ``N``.
    p, q : int
        This rank's coordinates along ``row_dim`` and ``key_dim``.
    """

    mesh: DeviceMesh
    row_dim: int
    key_dim: int
    row_sizes: tuple[int, ...]
    key_sizes: tuple[int, ...]
    p: int
    q: int

    def strip_pieces(self) -> list[int]:
        """``|R_a ∩ C_q|`` for every row block ``a``: the query strip's rows per rank."""
        rows, keys = block_starts(self.row_sizes), block_starts(self.key_sizes)
        return [
            overlap(rows[a], self.row_sizes[a], keys[self.q], self.key_sizes[self.q])
            for a in range(len(self.row_sizes))
        ]

    def strip_by_sum(self) -> bool:
        """Whether the strip is assembled over ``row_dim`` by an all-reduce of placed pieces.

        An all-gather pads every piece to the widest: ``cp x widest`` rows move and are held.
        When that exceeds twice the strip (e.g. a square mesh, where one row block holds the
        whole strip and the others none), an all-reduce of the pieces placed in a zeroed
        strip moves about twice the strip and holds exactly one.
        """
        pieces = self.strip_pieces()
        return len(pieces) > 1 and len(pieces) * max(pieces) > 2 * sum(pieces)

    def split_of_rows(self) -> list[int]:
        """``|R_p ∩ C_t|`` for every key block ``t``: this rank's bias rows per destination."""
        rows, keys = block_starts(self.row_sizes), block_starts(self.key_sizes)
        return [
            overlap(rows[self.p], self.row_sizes[self.p], keys[t], self.key_sizes[t])
            for t in range(len(self.key_sizes))
        ]


# -- parameters ------------------------------------------------------------------------------


# -- the bias strip --------------------------------------------------------------------------


@backward_in_forward_autocast
class QueryStrip(torch.autograd.Function):
    """From the bias tile to the bias rows of this rank's queries, all keys.

    Input ``[B, n, m, H]``: the bias of rows ``R_p`` and columns ``C_q`` (the layout's
    blocks). Output ``[B, H, m, N]``: the bias of rows ``C_q`` (this rank's queries) and
    every column, identical on the ranks along ``row_dim``.

    Forward: ONE all-to-all over ``key_dim`` (rank ``(p, l)`` sends rows ``R_p ∩ C_t`` to
    ``(p, t)``), then the pieces ``R_a ∩ C_q`` joined over ``row_dim``: ONE all-gather
    (pieces padded to the widest), or ONE all-reduce of the pieces placed in a zeroed strip
    when padding would more than double it (:meth:`Layout.strip_by_sum`). Backward: the
    adjoint, ONE reduce-scatter (or all-reduce) over ``row_dim`` and ONE all-to-all over
    ``key_dim``.
    """

    @staticmethod
    def forward(ctx, tile: torch.Tensor, layout: Layout) -> torch.Tensor:
        """``[B, n, m, H]`` bias tile -> ``[B, H, m, N]`` strip of this rank's queries."""
        ctx.layout = layout
        b, n, m, h = tile.shape
        ctx.tile_shape = (b, n, m, h)
        rows_first = tile.permute(1, 0, 2, 3)  # [n, B, m, H]
        own = layout.split_of_rows()[layout.q]
        ks = layout.key_sizes
        if len(ks) > 1:
            send = [rows * b * m * h for rows in layout.split_of_rows()]
            receive = [own * b * width * h for width in ks]
            got = compat.all_to_all(
                rows_first.reshape(-1), receive, send, layout.mesh, layout.key_dim
            )
            pieces = got.split(receive)
            strip_rows = torch.cat(
                [piece.view(own, b, width, h) for piece, width in zip(pieces, ks)], dim=2
            )
        else:
            strip_rows = rows_first
        pieces = layout.strip_pieces()
        if layout.strip_by_sum():
            strip = strip_rows.new_zeros((m,) + tuple(strip_rows.shape[1:]))
            strip.narrow(0, sum(pieces[: layout.p]), own).copy_(strip_rows)
            strip = all_reduce(strip, layout.mesh, layout.row_dim)
        else:
            strip = gather_blocks(strip_rows, 0, pieces, layout.mesh, layout.row_dim)
        return strip.permute(1, 3, 0, 2).contiguous()  # [B, H, m, N]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """The strip's gradient summed over ``row_dim`` and sent back to the bias tiles."""
        layout: Layout = ctx.layout
        b, n, m, h = ctx.tile_shape
        ks = layout.key_sizes
        rows = grad.permute(2, 0, 3, 1)  # [m, B, N, H]
        pieces = layout.strip_pieces()
        if layout.strip_by_sum():
            total = all_reduce(rows.contiguous(), layout.mesh, layout.row_dim)
            mine = total.narrow(0, sum(pieces[: layout.p]), pieces[layout.p])
        else:
            mine = reduce_scatter_blocks(rows, 0, pieces, layout.mesh, layout.row_dim)
        # mine: [o, B, N, H], the rows R_p ∩ C_q of the strip's gradient
        if len(ks) > 1:
            own = mine.shape[0]
            send = [own * b * width * h for width in ks]
            receive = [r * b * m * h for r in layout.split_of_rows()]
            flat = torch.cat([piece.reshape(-1) for piece in mine.split(list(ks), dim=2)])
            got = compat.all_to_all(flat, receive, send, layout.mesh, layout.key_dim)
            rows_first = got.view(n, b, m, h)
        else:
            rows_first = mine
        return rows_first.permute(1, 0, 2, 3).contiguous(), None


# -- streamed attention ----------------------------------------------------------------------


@dataclass(frozen=True)
class Stream:
    """How keys are streamed over ``layout.key_dim``.

    Attributes
    ----------
    layout : Layout
        Rows, queries and keys on the mesh.
    width : int
        Key columns each rank contributes per step (``w``).
    steps : int
        Number of steps (one all-gather each).
    key_chunk : int
        Keys per logits sub-chunk (``kc``): the widest whose :data:`SCORE_COPIES` score
        tensors fit the work budget, at most ``width``.
    inf : float
        Boltz's mask penalty (``module.inf``).
    overlap : bool
        Whether the next step's keys are gathered while this step computes (and, in
        backward, a step's key gradients reduce-scattered while the next one computes):
        two key buffers and two gradient buffers instead of one each. On when there are
        several steps and those buffers fit the work budget.
    """

    layout: Layout
    width: int
    steps: int
    key_chunk: int
    inf: float
    overlap: bool = False

    @classmethod
    def of(
        cls, layout: Layout, score_bytes_per_key: int, inf: float, key_column_bytes: int
    ) -> Stream:
        """``w = ceil(widest key block / ranks)``: about one key tile gathered per step.

        ``score_bytes_per_key`` is the size of one key's logits ``[B, n, H, m]``; the key
        sub-chunk is the widest that the work budget allows (:func:`pieces_width`).
        ``key_column_bytes`` is the size of one key column of a rank's keys, values and
        mask (``B x n x H (2 c + 1)`` elements); the steps overlap when two gathered
        buffers and two gradient buffers of ``cp w`` columns each fit the budget.
        """
        widest = max(layout.key_sizes)
        ranks = len(layout.key_sizes)
        width = max(1, -(-widest // ranks))
        steps = -(-widest // width)
        key_chunk = pieces_width(width, SCORE_COPIES * score_bytes_per_key)
        overlap = steps > 1 and fits(OVERLAP_BUFFERS * ranks * width * key_column_bytes)
        choice = f"key chunk {key_chunk} of {width}" + (", steps overlapped" if overlap else "")
        report_pieces("triangle attention", choice)
        return cls(layout, width, steps, key_chunk, float(inf), overlap)

    def lengths(self, step: int) -> list[int]:
        """Key columns each rank contributes in ``step``."""
        at = step * self.width
        return [max(0, min(self.width, size - at)) for size in self.layout.key_sizes]

    def local_span(self, step: int, size: int) -> tuple[int, int]:
        """``(start, length)`` of this rank's key columns in ``step`` (``size`` local keys)."""
        return min(step * self.width, size), self.lengths(step)[self.layout.q]

    def start_gather(
        self, step: int, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, heads: int
    ) -> torch.Tensor:
        """Start gathering every rank's keys, values and mask of ``step``.

        This rank's columns of the step are copied once into a head-major ``[B, n, H,
        (2 c + 1) w]`` buffer (per head: the keys transposed ``[c, w]``, the values
        ``[w, c]``, the mask ``[w]``, repeated per head; zero past its own length), the
        layouts the matrix products read in place (:func:`_key_views`); then ONE
        all-gather over ``key_dim`` starts (none when it has one rank). Read the result
        through :meth:`arrived`.
        """
        at, length = self.local_span(step, k.shape[2])
        hidden = k.shape[-1] // heads
        piece = k.new_zeros((*k.shape[:2], heads, (2 * hidden + 1) * self.width))
        keys_t, values, key_mask = _key_views(piece, hidden)
        by_head = (*k.shape[:2], length, heads, hidden)  # [B, n, length, H, c]
        keys_t[..., :length].copy_(k.narrow(2, at, length).view(by_head).permute(0, 1, 3, 4, 2))
        values[..., :length, :].copy_(v.narrow(2, at, length).view(by_head).transpose(2, 3))
        key_mask[..., :length].copy_(mask.narrow(2, at, length).unsqueeze(2))
        if len(self.layout.key_sizes) == 1:
            return piece
        return compat.start_all_gather(piece, self.layout.mesh, self.layout.key_dim)

    def arrived(self, started: torch.Tensor) -> torch.Tensor:
        """``[cp, B, n, H, (2 c + 1) w]``: the step's pieces of every rank along ``key_dim``."""
        gathered = compat.wait(started)
        return gathered.view(len(self.layout.key_sizes), -1, *gathered.shape[1:])

    def chunks(self, step: int) -> Iterator[tuple[int, int, int, int]]:
        """``(rank, offset in its piece, global key index, width)`` of each sub-chunk."""
        starts = block_starts(self.layout.key_sizes)
        for rank, length in enumerate(self.lengths(step)):
            for a in range(0, length, self.key_chunk):
                width = min(self.key_chunk, length - a)
                yield rank, a, starts[rank] + step * self.width + a, width

    def gathered_steps(
        self, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, heads: int
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """``(step, [cp, B, n, H, (2 c + 1) w] keys)`` for every step, in order.

        With :attr:`overlap` the next step's all-gather starts before the current step's
        keys are handed out, so its transfer overlaps the current step's compute; without
        it, only once the caller has dropped them (one key buffer alive).
        """
        started = self.start_gather(0, k, v, mask, heads)
        for step in range(self.steps):
            gathered = self.arrived(started)
            if self.overlap and step + 1 < self.steps:
                started = self.start_gather(step + 1, k, v, mask, heads)
            yield step, gathered
            del gathered
            if not self.overlap and step + 1 < self.steps:
                started = self.start_gather(step + 1, k, v, mask, heads)


def _key_views(piece: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of a ``[B, n, H, (2 c + 1) w]`` key piece.

    Returns ``k^T [B, n, H, c, w]``, ``v [B, n, H, w, c]`` and the mask ``[B, n, H, w]``:
    the layouts the matrix products read without a copy: row-major ``c x kc`` and
    ``kc x c`` matrices, as contiguous copies would lay them out, so that the products
    and their rounding are those of contiguous operands.
    """
    width = piece.shape[-1] // (2 * hidden + 1)
    keys_t = piece[..., : hidden * width].unflatten(-1, (hidden, width))
    values = piece[..., hidden * width : 2 * hidden * width].unflatten(-1, (width, hidden))
    return keys_t, values, piece[..., 2 * hidden * width :]


def _key_chunk(
    piece: torch.Tensor, hidden: int, at: int, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys ``at .. at + width`` of a key piece, as views.

    Returns ``k^T [B, n, H, c, kc]``, ``v [B, n, H, kc, c]`` and the mask ``[B, n, kc]``.
    """
    keys_t, values, key_mask = _key_views(piece, hidden)
    return (
        keys_t.narrow(-1, at, width),
        values.narrow(-2, at, width),
        key_mask[:, :, 0].narrow(-1, at, width),
    )


def _logits(
    q: torch.Tensor,
    k_t: torch.Tensor,
    key_mask: torch.Tensor,
    strip: torch.Tensor,
    key: int,
    width: int,
    inf: float,
) -> torch.Tensor:
    """``[B, n, H, m, kc]`` logits: ``q k^T`` + mask bias + triangle bias, in Boltz's order."""
    logits = torch.matmul(q, k_t)
    logits += (inf * (key_mask - 1))[:, :, None, None, :]
    logits += strip.narrow(-1, key, width).unsqueeze(1)
    return logits


def _attend_step(
    stream: Stream,
    step: int,
    gathered: torch.Tensor,
    q: torch.Tensor,
    strip: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    kept: tuple[torch.Tensor, list] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge one step's keys ``[cp, B, n, w, F]`` into the online softmax.

    ``state`` is ``(running max [B, n, H, m], running sum [B, n, H, m], weighted values
    [B, n, H, m, c])``; returns the updated state. With ``kept = (probabilities
    [B, n, H, m, N], maxes)``, each sub-chunk's ``exp(logits - running max)`` is written at
    its keys and ``(key, width, running max)`` appended to ``maxes``
    (:func:`_normalise_kept` makes them the probabilities).
    """
    running_max, running_sum, acc = state
    hidden = q.shape[-1]
    for rank, at, key, width in stream.chunks(step):
        k_t, v_sub, key_mask = _key_chunk(gathered[rank], hidden, at, width)
        logits = _logits(q, k_t, key_mask, strip, key, width, stream.inf)
        new_max = torch.maximum(running_max, logits.amax(-1))
        rescale = torch.exp(running_max - new_max)
        p = logits.sub_(new_max.unsqueeze(-1).to(logits.dtype)).exp_()
        if kept is not None:
            kept[0].narrow(-1, key, width).copy_(p)
            kept[1].append((key, width, new_max))
        running_sum = running_sum * rescale + p.sum(-1)
        acc = acc * rescale.unsqueeze(-1) + torch.matmul(p, v_sub)
        running_max = new_max
    return running_max, running_sum, acc


def _normalise_kept(
    probabilities: torch.Tensor, maxes: list, running_max: torch.Tensor, running_sum: torch.Tensor
) -> None:
    """Rescale the kept sub-chunks to the softmax: ``* exp(max then - max) / sum`` in place."""
    for key, width, chunk_max in maxes:
        scale = torch.exp(chunk_max - running_max) / running_sum
        probabilities.narrow(-1, key, width).mul_(scale.unsqueeze(-1).to(probabilities.dtype))


def _backprop_step(
    stream: Stream,
    step: int,
    gathered: torch.Tensor,
    q: torch.Tensor,
    strip: torch.Tensor,
    grad_out: torch.Tensor,
    saved: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None],
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    """One step of the backward: the softmax of its keys, kept or recomputed.

    ``saved`` is ``(delta, running max, running sum, kept)``: the first three
    ``[B, n, H, m, 1]`` (``delta = sum(grad_out * out, -1)``), ``kept`` the forward's
    probabilities ``[B, n, H, m, N]`` or None (then recomputed from the saved statistics).
    ``grads`` is ``(grad_q [B, n, H, m, c], grad_strip [B, H, m, N], grad_kv
    [cp, B, n, H, w, 2 c])``: the step adds to the first two and writes the keys' and
    values' gradients into the third at their gathered positions.
    """
    delta, mx, total, kept = saved
    grad_q, grad_strip, grad_kv = grads
    hidden = q.shape[-1]
    for rank, at, key, width in stream.chunks(step):
        k_t, v_sub, key_mask = _key_chunk(gathered[rank], hidden, at, width)
        if kept is not None:
            p = kept.narrow(-1, key, width)
        else:
            logits = _logits(q, k_t, key_mask, strip, key, width, stream.inf)
            p = logits.sub_(mx.to(logits.dtype)).exp_().div_(total.to(logits.dtype))
        grad_v_sub = torch.matmul(p.transpose(-1, -2), grad_out)  # [B, n, H, kc, c]
        grad_s = torch.matmul(grad_out, v_sub.transpose(-1, -2).contiguous())  # [B, n, H, m, kc]
        grad_s.sub_(delta).mul_(p)
        del p
        grad_q += torch.matmul(grad_s, k_t.transpose(-1, -2).contiguous())
        grad_k_sub = torch.matmul(grad_s.transpose(-1, -2), q)  # [B, n, H, kc, c]
        grad_strip.narrow(-1, key, width).add_(grad_s.sum(1))
        place = grad_kv[rank].narrow(3, at, width)
        place[..., :hidden].copy_(grad_k_sub)
        place[..., hidden:].copy_(grad_v_sub)


def _add_key_gradients(
    stream: Stream, step: int, reduced: torch.Tensor, grad_k: torch.Tensor, grad_v: torch.Tensor
) -> None:
    """Add a step's reduced ``[B, n, H, w, 2 c]`` key/value gradient to this rank's columns."""
    reduced = compat.wait(reduced)
    at, length = stream.local_span(step, grad_k.shape[2])
    heads, hidden = reduced.shape[2], reduced.shape[-1] // 2
    for grad, part in ((grad_k, reduced[..., :hidden]), (grad_v, reduced[..., hidden:])):
        columns = grad.narrow(2, at, length).unflatten(-1, (heads, hidden))  # [B, n, len, H, c]
        columns.add_(part.narrow(3, 0, length).transpose(2, 3))


@backward_in_forward_autocast
class StreamedAttention(torch.autograd.Function):
    """Softmax attention over keys streamed along a mesh dim, with an online softmax.

    Inputs (local blocks of the layout's tile ``[B, n, m, ...]``): ``q [B, n, H, m, c]``
    (scaled by ``1 / sqrt(c)``), ``k, v [B, n, m, H c]``, ``mask [B, n, m]`` (the keys'),
    ``strip [B, H, m, N]`` (the triangle bias of this rank's queries). Output
    ``[B, n, H, m, c]``. Communication: see the module docstring.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, strip, stream: Stream):
        """The streaming loop; saves the running max and sum for the backward.

        Unless the kernels recompute (:func:`~physicsnemo_foldcp.kernels.budget.kernel_recompute`),
        it also keeps the probabilities ``[B, n, H, m, N]`` for the backward.
        """
        b, n, heads, m, hidden = q.shape
        acc_dtype = torch.promote_types(q.dtype, torch.float32)
        running_max = q.new_full((b, n, heads, m), -torch.inf, dtype=acc_dtype)
        running_sum = q.new_zeros((b, n, heads, m), dtype=acc_dtype)
        acc = q.new_zeros((b, n, heads, m, hidden), dtype=acc_dtype)
        state = (running_max, running_sum, acc)
        kept = None
        if not kernel_recompute():
            kept = (q.new_empty((b, n, heads, m, strip.shape[-1])), [])
        for step, gathered in stream.gathered_steps(k, v, mask, q.shape[2]):
            state = _attend_step(stream, step, gathered, q, strip, state, kept)
            del gathered  # no view of it outlives the step: the buffer is free for the next
        running_max, running_sum, acc = state
        out = (acc / running_sum.unsqueeze(-1)).to(q.dtype)
        ctx.stream = stream
        saved = [q, k, v, mask, strip, out, running_max, running_sum]
        if kept is not None:
            _normalise_kept(kept[0], kept[1], running_max, running_sum)
            saved.append(kept[0])
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        """Streams the keys again; the softmax kept, or recomputed from the max and sum."""
        q, k, v, mask, strip, out, running_max, running_sum, *kept = ctx.saved_tensors
        stream: Stream = ctx.stream
        layout = stream.layout
        b, n, heads, m, hidden = q.shape
        grad_out = grad_out.contiguous()
        delta = (grad_out * out).sum(-1, keepdim=True)  # [B, n, H, m, 1]
        grad_q = torch.zeros_like(q)
        grad_k = torch.zeros_like(k)
        grad_v = torch.zeros_like(v)
        grad_strip = torch.zeros_like(strip)
        mx = running_max.unsqueeze(-1)
        total = running_sum.unsqueeze(-1)
        ranks = len(layout.key_sizes)
        # key/value gradients, [cp, B, n, H, w, 2 c]: with overlap two buffers, one
        # reduce-scattered while the next step fills the other
        buffers = [
            k.new_empty((ranks, b, n, heads, stream.width, 2 * hidden))
            for _ in range(2 if stream.overlap else 1)
        ]
        pending: tuple[int, torch.Tensor] | None = None
        for step, gathered in stream.gathered_steps(k, v, mask, q.shape[2]):
            grad_kv = buffers[step % len(buffers)].zero_()
            saved = (delta, mx, total, kept[0] if kept else None)
            _backprop_step(
                stream, step, gathered, q, strip, grad_out, saved, (grad_q, grad_strip, grad_kv)
            )
            del gathered
            started = grad_kv[0]
            if ranks > 1:
                started = compat.start_reduce_scatter(
                    grad_kv.flatten(0, 1), layout.mesh, layout.key_dim
                )
            if pending is not None:
                _add_key_gradients(stream, *pending, grad_k, grad_v)
            pending = (step, started)
            if not stream.overlap:
                _add_key_gradients(stream, *pending, grad_k, grad_v)
                pending = None
        if pending is not None:
            _add_key_gradients(stream, *pending, grad_k, grad_v)
        return grad_q, grad_k, grad_v, None, grad_strip, None


# -- the handler -----------------------------------------------------------------------------
