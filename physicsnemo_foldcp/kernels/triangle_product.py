"""Triangle products of pair tiles, panel by panel: ``sum_k a[i,k] b[j,k]`` and ``a[k,i] b[k,j]``.

The two contractions of a triangle multiplication (AlphaFold / Boltz), on pair tiles
``(Shard(1), Shard(2))`` over the ``(cp0, cp1)`` mesh: rank ``(i, j)`` holds rows of row
block ``i`` (lengths ``R``, over ``cp0``) and columns of column block ``j`` (lengths ``C``,
over ``cp1``; both partitions of the same ``N``, uneven, ``C != R`` when ``cp0 != cp1``)::

    outgoing  out[b, x, y, d] = sum_k a[b, x, k, d] b[b, y, k, d]
    incoming  out[b, x, y, d] = sum_k a[b, k, x, d] b[b, k, y, d]

The output is a pair tile with the inputs' blocks.

Algorithm (outgoing; SUMMA in its ``A B^T`` form, with ``a`` stationary)
------------------------------------------------------------------------
Rank ``(i, j)`` keeps its tile ``a[R_i, C_j]``, which holds the ``k in C_j`` terms of
every output ``out[R_i, y]``. It needs ``b[y, C_j]`` for all ``y``: the tiles of its own
mesh column, so one all-gather over ``cp0`` brings them, whatever the blocks. Its partial
``a[R_i, C_j] b[:, C_j]^T`` is a contribution to the whole output row block ``R_i``; summed
over the mesh row (``cp1``), each rank keeping its column block ``C_j``, it is the
output: one reduce-scatter over ``cp1``.

Done at once, this would hold ``cp0`` tiles of ``b`` and ``cp1`` tiles of partial output.
So ``y`` is cut into ``S = max(cp0, cp1)`` panels, and the loop runs gather -> product ->
reduce-scatter per panel. The blocks over ``cp0`` (``R``, gathered) and over ``cp1`` (``C``,
scattered) differ on a non-square mesh, so a panel is cut from the *common refinement*
of the two partitions: every segment ``[s, e)`` between consecutive boundaries of ``R`` or
``C`` lies in one block of each, and panel ``p`` takes the ``p``-th of ``S`` near-equal
slices of every segment. Each panel then holds about ``1/S`` of every row block and of
every column block, in token order (grouped by ``R`` and by ``C`` at the same time), so
the all-gather (pieces padded to the largest, as everywhere in the package) and the
reduce-scatter stay balanced with uneven blocks and non-square meshes.

Incoming is the same computation on the local transposes: ``out^T[y, x] = sum_k
b^T[y, k] a^T[x, k]`` with ``b`` stationary, ``a``'s column blocks all-gathered over
``cp1`` and the partial output reduce-scattered over ``cp0`` by row blocks.

Backward (``g`` the output tile's gradient; outgoing shown): ``grad_a[x, k] = sum_y g[x, y]
b[y, k]`` and ``grad_b[y, k] = sum_x g[x, y] a[x, k]``, per panel: ``g``'s panel columns
all-gathered over ``cp1`` (adjoint of the reduce-scatter), ``b``'s panel rows all-gathered
over ``cp0`` again (not stored: memory stays bounded), ``grad_a`` accumulated locally, and
``grad_b``'s partial reduce-scattered over ``cp0`` (adjoint of the all-gather).

Cost per call
-------------
``P0 = cp0``, ``P1 = cp1``, ``S`` panels (:func:`panel_count`: ``max(P0, P1)`` at most,
fewer when the work budget holds larger panels, one for a tile that fits); a *tile* is the
``n x m x D`` fp32
values of one rank's ``a`` (or ``b``) block, ``n ~ N / P0``, ``m ~ N / P1``; bytes are
those a rank *receives*, as ring algorithms move them; a collective over a mesh dim of
size 1 is skipped.

=========  ==========================================  =====================================
outgoing   collectives                                 received per rank
=========  ==========================================  =====================================
forward    ``S`` all-gathers over cp0 (``b``),          ``(P0 - 1) + (P1 - 1)`` tiles
           ``S`` reduce-scatters over cp1 (output)
backward   ``S`` all-gathers over cp1 (``g``),          ``(P1 - 1) + 2 (P0 - 1)`` tiles
           ``S`` all-gathers over cp0 (``b``, only
           for ``grad_a``), ``S`` reduce-scatters over
           cp0 (``grad_b``, only when needed)
=========  ==========================================  =====================================

Incoming: the same with cp0 and cp1 exchanged. On a square ``P x P`` mesh the forward
receives ``2 (P - 1)`` tiles per rank, what Cannon's algorithm shifts (``P - 1`` tiles of
``a`` and ``P - 1`` of ``b``, before its initial skew and the transpose of ``b`` an
``a b^T`` product needs). On 2x3 it receives ``1 + 2 = 3`` tiles per rank in either
direction (measured: 3.12 for ``N = 48``, tiles of ``24 x 16``; 3.06 for ``N = 96``; the
excess is the rounding of blocks into ``S`` panels, each collective padding its pieces
to the largest).

The pieces of one collective are padded to the largest, so uneven blocks cost a little
more: blocks that differ by one token (the plan's default) a few percent (``N = 23`` on
2x2: 2.09 tiles per rank on average), skewed blocks more (row blocks ``[15, 8]`` on 2x2:
2.61). A stationary-output SUMMA (both ``a`` and ``b`` brought to ``(i, j)``) receives at
least ``2 P - 1`` tiles on a ``P x P`` mesh: a rank off the diagonal holds none of the
``b`` rows it needs.

Overlap: the next panel's all-gathers start before the current panel's product, and a
panel's reduce-scatter travels while the next panel is computed (functional collectives
started and waited later, :func:`~physicsnemo_foldcp.core.blocks.start_gather_blocks`); the
arithmetic is the one of the one-panel-at-a-time loop, so results do not change. Blocks are
padded and unpadded with one copy each way.

Peak extra memory: the gathered panel of the moving operand (``N / S x m x D``) of this
panel and of the next, one partial output panel (``n x N / S x D``) and the padded buffer
its reduce-scatter sends; in backward also the gradient's panels. The panels' buffers
(:data:`PANEL_BUFFERS` of them) fit the work budget
(:mod:`~physicsnemo_foldcp.kernels.budget`) or, at ``S = max(P0, P1)`` when it is smaller,
are each at most about one tile: about four tile-sized buffers in forward, five in
backward, whatever the mesh size, besides the inputs, the output and the gradients
themselves. With one panel nothing is prefetched. No panel is stored for backward (each
is gathered again).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable
from torch.distributed.device_mesh import DeviceMesh

from physicsnemo_foldcp.core.blocks import (
    COLUMNS,
    ROWS,
    block_starts,
    coordinate,
    gathered_blocks,
    reduce_scattered_blocks,
    start_gather_blocks,
    start_reduce_scatter_blocks,
)
from physicsnemo_foldcp.kernels.autocast import backward_in_forward_autocast
from physicsnemo_foldcp.kernels.budget import pieces_count, report_pieces
from physicsnemo_foldcp.sharding.plan import split_sizes

PANEL_BUFFERS = 5
"""Panel-sized buffers alive together (backward: the gradient's panel, the next panel's
gradient and moving rows, travelling while this panel is computed, a partial product and
the buffer its reduce-scatter sends)."""

OUTGOING = "outgoing"
INCOMING = "incoming"
DIRECTIONS = (OUTGOING, INCOMING)


@dataclass(frozen=True)
class Panel:
    """One panel of the token axis: slices of every segment of the two block partitions.

    Attributes
    ----------
    runs : tuple[tuple[int, int], ...]
        ``(start, length)`` of its token runs, in token order.
    gathered_counts : tuple[int, ...]
        Tokens of the panel in each block of the gathered partition.
    scattered_counts : tuple[int, ...]
        Tokens of the panel in each block of the scattered partition.
    """

    runs: tuple[tuple[int, int], ...]
    gathered_counts: tuple[int, ...]
    scattered_counts: tuple[int, ...]

    @property
    def size(self) -> int:
        """Tokens in the panel."""
        return sum(n for _, n in self.runs)

    def local_positions(self, sizes: Sequence[int], index: int) -> list[int]:
        """Positions of the panel's tokens inside block ``index`` of ``sizes``, in order."""
        start = sum(sizes[:index])
        stop = start + sizes[index]
        out: list[int] = []
        for s, n in self.runs:
            if start <= s < stop:
                out.extend(range(s - start, s - start + n))
        return out


def _block_of(position: int, sizes: Sequence[int]) -> int:
    for k, start in enumerate(block_starts(sizes)):
        if start <= position < start + sizes[k]:
            return k
    raise ValueError(f"position {position} outside blocks {list(sizes)}")


def panel_plan(
    gathered_sizes: Sequence[int], scattered_sizes: Sequence[int], panels: int
) -> list[Panel]:
    """Cut a token axis, split two ways, into ``panels`` panels balanced for both splits.

    Parameters
    ----------
    gathered_sizes, scattered_sizes : sequence of int
        Two partitions of the same length ``N`` into consecutive blocks (the blocks of the
        mesh dim the moving operand is gathered over, and of the one the result is
        scattered over).
    panels : int
        Number of panels ``S >= 1``.

    Returns
    -------
    list[Panel]
        The non-empty panels. Every token is in exactly one; panel ``p`` holds the ``p``-th
        of ``S`` near-equal slices (:func:`~physicsnemo_foldcp.sharding.plan.split_sizes`)
        of every segment between consecutive block boundaries of either partition.

    Raises
    ------
    ValueError
        If the partitions have different totals or ``panels < 1``.
    """
    n = sum(gathered_sizes)
    if n != sum(scattered_sizes):
        raise ValueError(
            f"block sizes {list(gathered_sizes)} and {list(scattered_sizes)} cut different lengths"
        )
    if panels < 1:
        raise ValueError(f"panels must be >= 1, got {panels}")
    bounds = sorted(set(block_starts(gathered_sizes)) | set(block_starts(scattered_sizes)) | {n})
    segments = [(s, e - s) for s, e in zip(bounds, bounds[1:]) if e > s]
    out = []
    for p in range(panels):
        runs = []
        gathered = [0] * len(gathered_sizes)
        scattered = [0] * len(scattered_sizes)
        for start, length in segments:
            slices = split_sizes(length, panels)
            width = slices[p]
            if not width:
                continue
            runs.append((start + sum(slices[:p]), width))
            gathered[_block_of(start, gathered_sizes)] += width
            scattered[_block_of(start, scattered_sizes)] += width
        if runs:
            out.append(Panel(tuple(runs), tuple(gathered), tuple(scattered)))
    return out


@dataclass(frozen=True)
class _Local:
    """This rank's index tensors for every panel (``None``: the whole block, in order)."""

    gathered: list[torch.Tensor | None]
    scattered: list[torch.Tensor | None]


def _take(t: torch.Tensor, dim: int, index: torch.Tensor | None) -> torch.Tensor:
    """The panel's positions of ``t`` along ``dim`` (``t`` itself for the whole block)."""
    return t if index is None else t.index_select(dim, index)


def _local_indices(
    plan: list[Panel],
    gathered_sizes: Sequence[int],
    scattered_sizes: Sequence[int],
    here: tuple[int, int],
    device: torch.device,
) -> _Local:
    g, s = here

    def index(positions: list[int], size: int) -> torch.Tensor | None:
        if positions == list(range(size)):  # one panel: no gather of rows, no scatter back
            return None
        return torch.tensor(positions, dtype=torch.long, device=device)

    return _Local(
        [index(p.local_positions(gathered_sizes, g), gathered_sizes[g]) for p in plan],
        [index(p.local_positions(scattered_sizes, s), scattered_sizes[s]) for p in plan],
    )


@backward_in_forward_autocast
class PanelProduct(torch.autograd.Function):
    """``out[x, y] = sum_k s[x, k] m[y, k]`` of two pair tiles, ``s`` stationary.

    ``s``, ``m`` and the result are local tiles ``[B, n, m, D]`` of one layout: axis 1 cut
    into ``gathered_sizes`` blocks over mesh dim ``gather_dim``, axis 2 into
    ``scattered_sizes`` blocks over ``scatter_dim``. Per panel of ``y`` (:func:`panel_plan`):
    ONE all-gather over ``gather_dim`` of ``m``'s panel rows, the local product, ONE
    reduce-scatter over ``scatter_dim`` of the partial output panel. Backward: per panel,
    ONE all-gather over ``scatter_dim`` of the gradient's panel columns, ONE all-gather
    over ``gather_dim`` of ``m``'s panel rows (when ``s`` needs a gradient) and ONE
    reduce-scatter over ``gather_dim`` of ``m``'s partial gradient (when ``m`` needs one).
    See the module docstring for bytes and memory.
    """

    @staticmethod
    def forward(
        ctx,
        stationary: torch.Tensor,
        moving: torch.Tensor,
        mesh: DeviceMesh,
        gather_dim: int,
        gathered_sizes: tuple[int, ...],
        scattered_sizes: tuple[int, ...],
        panels: int,
    ) -> torch.Tensor:
        """The panel loop: gather ``m``'s panel rows, multiply, reduce-scatter the result."""
        here = coordinate(mesh)
        plan = panel_plan(gathered_sizes, scattered_sizes, panels)
        scatter_dim = 1 - gather_dim
        local = _local_indices(
            plan,
            gathered_sizes,
            scattered_sizes,
            (here[gather_dim], here[scatter_dim]),
            stationary.device,
        )
        out = None

        def start_moving(p: int) -> torch.Tensor:
            piece = _take(moving, 1, local.gathered[p])
            return start_gather_blocks(piece, 1, plan[p].gathered_counts, mesh, gather_dim)

        def place(reducing: torch.Tensor, counts: tuple[int, ...], columns: torch.Tensor | None):
            nonlocal out
            mine = reduce_scattered_blocks(reducing, 2, counts, mesh, scatter_dim)
            if columns is None:  # the whole result
                out = mine.contiguous()
                return
            if out is None:  # the result has the stationary tile's blocks
                out = mine.new_zeros(stationary.shape)
            out.index_copy_(2, columns, mine)

        started = start_moving(0) if plan else None
        pending = None
        for p, (panel, columns) in enumerate(zip(plan, local.scattered)):
            m_panel = gathered_blocks(started, 1, panel.gathered_counts)
            if p + 1 < len(plan):  # the next panel's rows travel during this product
                started = start_moving(p + 1)
            partial = torch.einsum("bxkd,bykd->bxyd", stationary, m_panel)
            del m_panel
            reducing = start_reduce_scatter_blocks(
                partial, 2, panel.scattered_counts, mesh, scatter_dim
            )
            del partial
            if pending is not None:
                place(*pending)
            pending = (reducing, panel.scattered_counts, columns)
        if pending is not None:
            place(*pending)
        ctx.save_for_backward(stationary, moving)
        ctx.plan = (mesh, gather_dim, plan, local)
        return out if out is not None else stationary.new_zeros(stationary.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        """``grad_s = g m`` and ``grad_m = g^T s``, panel by panel with the adjoint collectives."""
        stationary, moving = ctx.saved_tensors
        mesh, gather_dim, plan, local = ctx.plan
        scatter_dim = 1 - gather_dim
        need_s, need_m = ctx.needs_input_grad[:2]
        grad_s = torch.zeros_like(stationary) if need_s else None
        grad_m = None
        if not (need_s or need_m):
            return None, None, None, None, None, None, None

        def start_panel(p: int) -> tuple[torch.Tensor, torch.Tensor | None]:
            g_piece = _take(grad, 2, local.scattered[p])
            g = start_gather_blocks(g_piece, 2, plan[p].scattered_counts, mesh, scatter_dim)
            m = None
            if need_s:
                m_piece = _take(moving, 1, local.gathered[p])
                m = start_gather_blocks(m_piece, 1, plan[p].gathered_counts, mesh, gather_dim)
            return g, m

        def place(reducing: torch.Tensor, counts: tuple[int, ...], rows: torch.Tensor | None):
            nonlocal grad_m
            mine = reduce_scattered_blocks(reducing, 1, counts, mesh, gather_dim)
            if rows is None:  # the whole gradient
                grad_m = mine.to(moving.dtype).contiguous()
                return
            if grad_m is None:
                grad_m = torch.zeros_like(moving)
            grad_m.index_copy_(1, rows, mine.to(grad_m.dtype))

        started = start_panel(0) if plan else None
        pending = None
        for p, (panel, rows) in enumerate(zip(plan, local.gathered)):
            g_started, m_started = started
            g_panel = gathered_blocks(g_started, 2, panel.scattered_counts)
            m_panel = gathered_blocks(m_started, 1, panel.gathered_counts) if need_s else None
            if p + 1 < len(plan):  # the next panel's gradient and rows travel meanwhile
                started = start_panel(p + 1)
            if need_s:
                grad_s += torch.einsum("bxyd,bykd->bxkd", g_panel, m_panel)
                del m_panel
            if need_m:
                if pending is not None:  # the previous panel's sum travelled meanwhile
                    place(*pending)
                partial = torch.einsum("bxyd,bxkd->bykd", g_panel, stationary)
                reducing = start_reduce_scatter_blocks(
                    partial, 1, panel.gathered_counts, mesh, gather_dim
                )
                del partial
                pending = (reducing, panel.gathered_counts, rows)
            del g_panel
        if pending is not None:
            place(*pending)
        if need_m and grad_m is None:
            grad_m = torch.zeros_like(moving)
        return grad_s, grad_m, None, None, None, None, None


def panel_count(
    row_sizes: Sequence[int], col_sizes: Sequence[int], batch: int, dim: int, itemsize: int
) -> int:
    """Panels of the contraction: the fewest whose buffers fit the work budget.

    One panel of the token axis (``N / S`` tokens) costs :data:`PANEL_BUFFERS` buffers of
    ``batch x N / S x widest block x dim`` elements of ``itemsize`` bytes. The count is
    between 1 (the whole contraction at once, as Boltz does it) and ``max(cp0, cp1)`` (each
    buffer about one tile, the kernel's memory floor), and the same on every rank (it reads
    only the global block sizes).

    Parameters
    ----------
    row_sizes, col_sizes : sequence of int
        The row blocks (over ``cp0``) and column blocks (over ``cp1``).
    batch, dim : int
        Batch size and channels of the tiles.
    itemsize : int
        Bytes per element of the contraction (fp32: 4).

    Returns
    -------
    int
        ``S``.
    """
    n = sum(row_sizes)
    whole = PANEL_BUFFERS * batch * n * max(*row_sizes, *col_sizes) * dim * itemsize
    return min(max(len(row_sizes), len(col_sizes)), pieces_count(whole))


def triangle_product(
    a: torch.Tensor,
    b: torch.Tensor,
    direction: str,
    mesh: DeviceMesh,
    row_sizes: Sequence[int],
    col_sizes: Sequence[int],
    panels: int | None = None,
) -> torch.Tensor:
    """The triangle contraction of two local pair tiles (differentiable; see module docstring).

    Parameters
    ----------
    a, b : torch.Tensor
        This rank's blocks ``[B, n_i, m_j, D]`` of two ``[B, N, N, D]`` pair tiles with the
        same blocks.
    direction : {"outgoing", "incoming"}
        ``einsum("bikd,bjkd->bijd")`` or ``einsum("bkid,bkjd->bijd")``.
    mesh : DeviceMesh
        The 2-D ``(cp0, cp1)`` domain mesh.
    row_sizes, col_sizes : sequence of int
        The row blocks (over ``cp0``) and column blocks (over ``cp1``) of the tiles.
    panels : int, optional
        Number of panels; by default the fewest that fit the work budget
        (:func:`panel_count`).

    Returns
    -------
    torch.Tensor
        This rank's block ``[B, n_i, m_j, D]`` of the product.

    Raises
    ------
    ValueError
        For an unknown direction.
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    rows, cols = tuple(int(s) for s in row_sizes), tuple(int(s) for s in col_sizes)
    count = panels or panel_count(rows, cols, a.shape[0], a.shape[-1], a.element_size())
    report_pieces("triangle multiplication", f"{count} panels")
    if direction == OUTGOING:
        return PanelProduct.apply(a, b, mesh, ROWS, rows, cols, count)
    out_t = PanelProduct.apply(
        b.transpose(1, 2), a.transpose(1, 2), mesh, COLUMNS, cols, rows, count
    )
    return out_t.transpose(1, 2)


__all__ = [
    "DIRECTIONS",
    "INCOMING",
    "OUTGOING",
    "Panel",
    "PanelProduct",
    "panel_count",
    "panel_plan",
    "triangle_product",
]
