"""Rows of a ``cp0``-sharded dim moved between ranks by their global positions.

Two ops move whole rows of one dim that ``cp0`` shards into another row layout:
:mod:`~physicsnemo_foldcp.ops.msa_rows` (the MSA rows a subsampling index picks) and
:mod:`~physicsnemo_foldcp.ops.atom_windows` (atoms re-cut at window boundaries, and the
key halos of the windows). Both describe their result the same way: for every rank ``t``
of ``cp0``, the global positions of the rows its output block holds, in order (``-1`` for a
row of zeros). Every rank can compute every rank's wishes, so every rank knows who sends
what to whom without any metadata exchange.

Communication per call, forward and backward alike: ONE ``batch_isend_irecv`` among the
ranks of one ``cp0`` column (the same ``cp1`` coordinate), only of non-empty pieces; a rank
receives exactly the rows of its output held by other ranks, and copies its own.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from physicsnemo_foldcp.core.blocks import block_starts


@dataclass(frozen=True)
class RowRoute:
    """Which rows rank ``p`` of ``cp0`` sends, receives and copies for one move.

    Positions are local: ``send`` / ``own_source`` index this rank's input block,
    ``receive`` / ``own_target`` this rank's output block. Index tensors are int64 on the
    device of the local block.

    Attributes
    ----------
    peers : tuple[int, ...]
        Global rank of ``(t, q)`` for every ``t`` of ``cp0``.
    p : int
        This rank's coordinate on ``cp0``.
    out_sizes : tuple[int, ...]
        Output row blocks over ``cp0``.
    send : tuple[torch.Tensor, ...]
        For every ``t``: the local input rows rank ``t`` needs, in its output order.
    receive : tuple[torch.Tensor, ...]
        For every ``t``: the output positions that rank ``t``'s rows fill, in order.
    """

    peers: tuple[int, ...]
    p: int
    out_sizes: tuple[int, ...]
    send: tuple[torch.Tensor, ...]
    receive: tuple[torch.Tensor, ...]

    @property
    def own_source(self) -> torch.Tensor:
        """Local input rows this rank copies into its own output block."""
        return self.send[self.p]

    @property
    def own_target(self) -> torch.Tensor:
        """Output positions those copies fill."""
        return self.receive[self.p]

    def received_rows(self) -> int:
        """Rows this rank receives from other ranks (per call, forward or backward)."""
        return sum(int(r.numel()) for t, r in enumerate(self.receive) if t != self.p)


def plan_route(
    wanted: Sequence[Sequence[int] | torch.Tensor],
    in_sizes: Sequence[int],
    p: int,
    peers: Sequence[int],
    device: torch.device,
) -> RowRoute:
    """The :class:`RowRoute` of rank ``p`` of ``cp0``.

    Plain Python arithmetic on ints: no tensor is read, so planning a route makes no host
    synchronisation (a 1-D tensor in ``wanted`` is read once, with ``tolist``).

    Parameters
    ----------
    wanted : sequence of sequences of int
        For every ``t`` of ``cp0``: the global input row of each row of ``t``'s output
        block, ``-1`` for a row of zeros (a ``range``, a list, or an int64 ``[O_t]`` CPU
        tensor). The same on every rank.
    in_sizes : sequence of int
        Input row blocks over ``cp0``.
    p : int
        This rank's coordinate on ``cp0``.
    peers : sequence of int
        Global rank of ``(t, q)`` for every ``t``.
    device : torch.device
        Where the index tensors of the route go (the local block's device); an index made
        of a few contiguous runs is built there with ``arange``, without a copy from the
        host.
    """
    in_starts = block_starts(in_sizes)
    ends = [s + int(n) for s, n in zip(in_starts, in_sizes)]
    rows = [w.tolist() if isinstance(w, torch.Tensor) else w for w in wanted]

    def owner(row: int) -> int:
        return bisect.bisect_right(ends, row) if row >= 0 else -1

    send = [[r - in_starts[p] for r in rs if owner(r) == p] for rs in rows]
    mine = [owner(r) for r in rows[p]]
    receive = [[o for o, t_of in enumerate(mine) if t_of == t] for t in range(len(rows))]
    return RowRoute(
        tuple(int(r) for r in peers),
        p,
        tuple(len(rs) for rs in rows),
        tuple(index_on(v, device) for v in send),
        tuple(index_on(v, device) for v in receive),
    )


ARANGE_RUNS = 8
"""Most contiguous runs an index is built from with ``arange`` on its device."""


def index_on(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``.

    A few contiguous runs (the atom windows' moves: one or two) are ``arange`` s made on
    the device; anything else is one copy from the host.
    """
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][0] + runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
            if len(runs) > ARANGE_RUNS:
                return torch.tensor(list(values), dtype=torch.int64, device=device)
    if not runs:
        return torch.empty(0, dtype=torch.int64, device=device)
    parts = [torch.arange(a, a + n, dtype=torch.int64, device=device) for a, n in runs]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _exchange(
    pieces: Sequence[torch.Tensor | None],
    shapes: Sequence[Sequence[int]],
    route: RowRoute,
    like: torch.Tensor,
) -> list[torch.Tensor | None]:
    """Send ``pieces[t]`` to every other ``t``; return the pieces of ``shapes`` received.

    Empty pieces are neither sent nor received; the own entry is ``None``. ONE
    ``batch_isend_irecv`` (nothing when no piece moves).
    """
    received: list[torch.Tensor | None] = [None] * len(pieces)
    ops = []
    for t, peer in enumerate(route.peers):
        if t == route.p:
            continue
        piece = pieces[t]
        if piece is not None and piece.numel():
            ops.append(dist.P2POp(dist.isend, piece.contiguous(), peer))
        shape = list(shapes[t])
        if all(shape):
            buffer = like.new_empty(shape)
            received[t] = buffer
            ops.append(dist.P2POp(dist.irecv, buffer, peer))
    for work in dist.batch_isend_irecv(ops) if ops else ():
        work.wait()
    return received


def with_length(shape: Sequence[int], dim: int, length: int) -> list[int]:
    """``shape`` with dim ``dim`` set to ``length``."""
    out = list(shape)
    out[dim] = int(length)
    return out


class RouteRows(torch.autograd.Function):
    """This rank's output block of a :class:`RowRoute` from every rank's input block.

    Forward: this rank's rows copied, the others received from their holders, rows of
    zeros where the route says ``-1``. Backward: the gradient rows sent back to their
    holders and added at their source rows (``index_add``), so a row used twice gets both
    gradients.
    """

    @staticmethod
    def forward(ctx, local: torch.Tensor, dim: int, route: RowRoute) -> torch.Tensor:
        """``[.., O_p, ..]`` from ``local`` ``[.., S_p, ..]`` (dim ``dim``)."""
        ctx.dim, ctx.route, ctx.in_length = dim, route, local.shape[dim]
        pieces = [local.index_select(dim, rows) for rows in route.send]
        shapes = [with_length(local.shape, dim, r.numel()) for r in route.receive]
        received = _exchange(pieces, shapes, route, local)
        out = local.new_zeros(with_length(local.shape, dim, route.out_sizes[route.p]))
        out.index_copy_(dim, route.own_target, pieces[route.p])
        for t, buffer in enumerate(received):
            if buffer is not None:
                out.index_copy_(dim, route.receive[t], buffer)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """The gradient rows home, summed at their source rows."""
        dim, route = ctx.dim, ctx.route
        grad = grad.contiguous()
        pieces = [grad.index_select(dim, positions) for positions in route.receive]
        shapes = [with_length(grad.shape, dim, rows.numel()) for rows in route.send]
        received = _exchange(pieces, shapes, route, grad)
        out = grad.new_zeros(with_length(grad.shape, dim, ctx.in_length))
        out.index_add_(dim, route.own_source, pieces[route.p])
        for t, buffer in enumerate(received):
            if buffer is not None:
                out.index_add_(dim, route.send[t], buffer)
        return out, None, None


__all__ = ["ARANGE_RUNS", "RouteRows", "RowRoute", "index_on", "plan_route", "with_length"]
