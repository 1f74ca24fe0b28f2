"""Boltz's windowed atom attention geometry on atoms sharded with their tokens.

Boltz's atom transformer attends within windows: the atom axis ``[B, A, ...]`` (``A`` a
multiple of ``W``) is cut into ``K = A / W`` windows of ``W`` query atoms, and window
``k`` attends to the ``H`` key atoms ``[kW - h, kW + W + h)`` with the halo
``h = (H - W) / 2``; keys outside ``[0, A)`` are zeros. Boltz builds the keys with
``single_to_keys``: an ``einsum`` of the atoms, cut into half-windows, with a dense
``2K x (H/W * 2) K`` indexing matrix, and the queries with ``view(B, K, W, ...)``.

Why the generic path fails
--------------------------
Scattered atoms follow their tokens: row block ``p`` of ``cp0`` holds the atoms of its
tokens, ``A_p`` of them, which is not a multiple of ``W`` and does not start at a window
boundary. ``view(B, K, W, ...)`` of such a block cuts other windows than the serial ones,
and the ``einsum`` with the indexing matrix contracts the sharded atom axis (a gather of
every atom on every rank, and an ``O(K^2)`` matrix).

What happens instead
--------------------
:class:`AtomWindows` re-cuts the atom axis at window boundaries: row block ``p`` computes
the windows that START in its atom block, so its window-aligned block is the atoms
``[floor(a_p / W) W, floor(a_{p+1} / W) W)`` (``a_p`` the atom block starts). The atoms of a
window that straddles two row blocks move to the rank that computes it
(:meth:`AtomWindows.to_windows`), and the results move back
(:meth:`AtomWindows.to_atoms`): fewer than ``W`` atoms per block boundary. The keys of a
rank's windows are its window-aligned atoms with ``h`` halo atoms on each side, fetched
from the neighbouring ranks (:meth:`AtomWindows.keys`); a rank's windows and keys are
then exactly the serial ones. All moves are :class:`~physicsnemo_foldcp.ops.row_routes.RouteRows`
(point to point among the ranks of one ``cp0`` column, differentiable: backward sends the
gradient rows back and adds them).

The ``cp1`` ranks of a row block hold the same atoms, so they split its ``K_p`` windows
among them instead of each computing all of them: rank ``(p, l)`` *owns* the ``l``-th of
``cp1`` consecutive runs of them (:attr:`AtomWindows.owned_counts`; in rank order the
owned runs are the windows in order), when every row block has at least ``cp1`` windows
(:attr:`AtomWindows.split_over_columns`; else each rank owns its row block's windows).
:func:`own_windows` cuts a rank's run out of a window-aligned block (a slice; its
backward all-gathers the runs' gradients over ``cp1``, so the block's gradient is whole
on every ``cp1`` rank, as for any replicated tensor); :func:`gather_windows` joins the
runs back into the block (ONE all-gather over ``cp1``; backward: the slice). The keys of
an owned run take their halos from the neighbouring runs, across ``cp1`` and ``cp0``
(:meth:`AtomWindows.owned_keys`, point to point).

Layouts: the atom tensors are ``(Shard(1), Replicate())`` over ``(cp0, cp1)``; the
window-aligned blocks are plain local tensors ``[B, K_p W, ...]`` (or ``[B, K_p, W, ...]``),
the same on the ranks of one ``cp0`` row block; the owned runs ``[B, K_pl W, ...]`` differ
from rank to rank.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.device_mesh import DeviceMesh

from physicsnemo_foldcp.core import compat
from physicsnemo_foldcp.core.blocks import (
    COLUMNS,
    ROWS,
    ShardingLayoutError,
    block_starts,
    coordinate,
    gather_blocks,
    local_of,
    mesh_ranks,
    mesh_sizes,
    rank_label,
    row_dim,
    row_shapes,
)
from physicsnemo_foldcp.core.tensor import FoldTensor, map_tag, wrap
from physicsnemo_foldcp.features.spec import ATOMS
from physicsnemo_foldcp.ops.row_routes import RouteRows, RowRoute, plan_route

ATOM_DIM = 1
"""The atom dim of Boltz's batched atom tensors ``[B, A, ...]``."""


def check_window_sizes(queries: int, keys: int) -> int:
    """The key halo ``(keys - queries) / 2`` of Boltz's windows, after Boltz's own checks.

    Raises
    ------
    ValueError
        When ``queries`` is odd or ``keys`` is not a multiple of ``queries`` (Boltz's
        ``get_indexing_matrix`` asserts the same).
    """
    if queries < 2 or queries % 2 or keys < queries or keys % queries:
        raise ValueError(
            f"atom windows of {queries} queries and {keys} keys: Boltz needs an even query "
            "window and a key window that is a multiple of it"
        )
    return (keys - queries) // 2


@dataclass(frozen=True)
class AtomWindows:
    """The windows of one scattered atom axis, and the moves between its two layouts.

    Attributes
    ----------
    atom_sizes : tuple[int, ...]
        Atoms of each ``cp0`` row block (the scattered layout, atoms with their tokens).
    queries, keys : int
        Boltz's ``W`` (atoms per window of queries) and ``H`` (keys per window).
    mesh : DeviceMesh
        The ``(cp0, cp1)`` domain mesh.
    """

    atom_sizes: tuple[int, ...]
    queries: int
    keys: int
    mesh: DeviceMesh

    @classmethod
    def of(cls, x: ShardTensor, queries: int, keys: int, name: str = "atoms") -> AtomWindows:
        """The windows of ``x`` ``[B, A, ...]``, ``(Shard(1), Replicate())``.

        Raises
        ------
        ShardingLayoutError
            When ``x`` is not laid out as scattered atoms, or ``A`` is not a multiple of
            ``queries`` (Boltz pads atoms to whole windows; so must the sample).
        """
        row_dim(x, "atom windows", name, expected=ATOM_DIM)
        check_window_sizes(queries, keys)
        sizes = tuple(mesh_sizes(x, ROWS, ATOM_DIM))
        if sum(sizes) % queries:
            raise ShardingLayoutError(
                f"atom windows: {name} has {sum(sizes)} atoms, not a multiple of the "
                f"{queries}-atom window (pad the sample's atoms to whole windows, as Boltz's "
                "featurizer does)"
            )
        return cls(sizes, queries, keys, x.device_mesh)

    # -- geometry ----------------------------------------------------------------------

    @property
    def n_atoms(self) -> int:
        """``A``, the atoms of the sample (a multiple of ``queries``)."""
        return sum(self.atom_sizes)

    @property
    def halo(self) -> int:
        """Key atoms on each side of a window: ``(H - W) / 2``."""
        return (self.keys - self.queries) // 2

    @property
    def atom_bounds(self) -> tuple[int, ...]:
        """``cp0 + 1`` boundaries of the scattered atom blocks."""
        return (*block_starts(self.atom_sizes), self.n_atoms)

    @property
    def window_bounds(self) -> tuple[int, ...]:
        """``cp0 + 1`` boundaries of the window-aligned blocks.

        The scattered block starts rounded down to a window start; the last is ``A``.
        """
        w = self.queries
        return (*(b // w * w for b in self.atom_bounds[:-1]), self.n_atoms)

    @property
    def window_atom_sizes(self) -> tuple[int, ...]:
        """Atoms of each window-aligned block (whole windows)."""
        b = self.window_bounds
        return tuple(b[i + 1] - b[i] for i in range(len(b) - 1))

    @property
    def window_counts(self) -> tuple[int, ...]:
        """Windows each ``cp0`` row block computes (``K_p``, may be 0)."""
        return tuple(n // self.queries for n in self.window_atom_sizes)

    @property
    def p(self) -> int:
        """This rank's ``cp0`` coordinate."""
        return coordinate(self.mesh)[0]

    @property
    def split_over_columns(self) -> bool:
        """Whether the ``cp1`` ranks of a row block split its windows among them.

        They do when ``cp1 > 1`` and every row block has at least ``cp1`` windows (every
        rank then owns one or more); otherwise every ``cp1`` rank of a row block owns all
        of its windows (a sample of a few windows per row block: the work is repeated).
        """
        parts = self.mesh.size(COLUMNS)
        return parts > 1 and min(self.window_counts) >= parts

    @property
    def window_mesh_dims(self) -> tuple[int, ...]:
        """Mesh dims over which the parameters used on the owned windows sum their parts."""
        return (ROWS, COLUMNS) if self.split_over_columns else (ROWS,)

    @property
    def owned_counts(self) -> tuple[tuple[int, ...], ...]:
        """Windows each rank owns: ``owned_counts[p][l]`` of row block ``p``'s ``K_p``.

        Split over ``cp1`` (:attr:`split_over_columns`): consecutive runs that differ by at
        most one (the first runs the longer); otherwise ``(K_p,)``, one run per row block.
        """
        if not self.split_over_columns:
            return tuple((k,) for k in self.window_counts)
        parts = self.mesh.size(COLUMNS)
        return tuple(
            tuple(k // parts + (1 if j < k % parts else 0) for j in range(parts))
            for k in self.window_counts
        )

    @property
    def owned_span(self) -> tuple[int, int]:
        """``(first window, windows)`` this rank owns, within its row block's windows."""
        p, q = coordinate(self.mesh)
        counts = self.owned_counts[p]
        q = q if self.split_over_columns else 0
        return sum(counts[:q]), counts[q]

    @property
    def owned_count(self) -> int:
        """Windows this rank owns (``K_pl``, or ``K_p`` when not split)."""
        return self.owned_span[1]

    # -- routes ------------------------------------------------------------------------

    def _route(self, kind: str, device: torch.device) -> RowRoute:
        """The route of a move (``"to_windows"``, ``"to_atoms"``, ``"keys"``, ``"owned_keys"``).

        Planned from the atom blocks (Python ints from the sharding shapes) once per
        geometry and device, and shared by every call and every module with the same
        windows (:func:`_window_route`).
        """
        return _window_route(self, kind, device)

    def _key_rows(self, start: int, end: int) -> list[int]:
        """Atoms ``[start - h, end + h)`` (``-1`` outside ``[0, A)``), none for no window."""
        if end == start:
            return []
        rows = range(start - self.halo, end + self.halo)
        return [r if 0 <= r < self.n_atoms else -1 for r in rows]

    def _move(self, local: torch.Tensor, kind: str) -> torch.Tensor:
        return RouteRows.apply(local, ATOM_DIM, self._route(kind, local.device))

    # -- moves -------------------------------------------------------------------------

    def to_windows(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's window-aligned atoms ``[B, K_p W, ...]`` of scattered atoms.

        ``x`` is the ShardTensor, or its local block ``[B, A_p, ...]``.
        """
        local = local_of(x) if isinstance(x, ShardTensor) else x
        return self._move(local, "to_windows")

    def to_atoms(self, local: torch.Tensor, like: ShardTensor) -> FoldTensor:
        """Window-aligned atoms ``[B, K_p W, ...]`` back in the layout of ``like``."""
        out = self._move(local, "to_atoms")
        return wrap(
            out, self.mesh, like.placements, row_shapes(out.shape, ATOM_DIM, self.atom_sizes)
        )

    def window_keys(self, local: torch.Tensor) -> torch.Tensor:
        """Keys ``[B, K_p, H, ...]`` of this rank's windows from window-aligned atoms.

        Equal to Boltz's ``single_to_keys`` of the whole atom axis, restricted to this
        rank's windows: the halos come from the neighbouring ranks, zeros outside
        ``[0, A)``.
        """
        return self._unfold_keys(self._move(local, "keys"), self.window_counts[self.p])

    def _unfold_keys(self, extended: torch.Tensor, windows: int) -> torch.Tensor:
        """``[B, K, H, ...]`` keys of ``K`` windows from their atoms with both halos."""
        b, length, rest = extended.shape[0], extended.shape[1], extended.shape[2:]
        if not windows:
            return extended.new_zeros((b, 0, self.keys, *rest))
        flat = extended.reshape(b, length, -1).unfold(1, self.keys, self.queries)
        return flat.transpose(2, 3).reshape(b, windows, self.keys, *rest)

    def owned_keys(self, owned: torch.Tensor) -> torch.Tensor:
        """Keys ``[B, K_pl, H, ...]`` of this rank's owned windows ``[B, K_pl W, ...]``.

        :meth:`window_keys` for owned runs: the halos come from the neighbouring runs (on
        the other ``cp1`` ranks of the row block, or the next row block's), point to point.
        """
        if not self.split_over_columns:
            return self.window_keys(owned)
        extended = self._move(owned, "owned_keys")
        return self._unfold_keys(extended, self.owned_count)

    def windows_of(self, local: torch.Tensor, count: int | None = None) -> torch.Tensor:
        """``[B, K W, ...]`` viewed as ``[B, K, W, ...]`` (``K``: ``K_p``, or ``count``)."""
        shape = local.shape
        count = self.window_counts[self.p] if count is None else count
        return local.reshape(shape[0], count, self.queries, *shape[2:])

    def wrap_windows(self, local: torch.Tensor, like: ShardTensor) -> FoldTensor:
        """A per-window tensor ``[B, K_p, ...]`` as a FoldTensor sharded on its window dim."""
        return wrap(
            local, self.mesh, like.placements, row_shapes(local.shape, 1, self.window_counts)
        )

    def check_padding(self, atom_mask: ShardTensor, atom_to_token: object = None) -> None:
        """Refuse pad atoms inside the atom axis (per-shard padding): they move the windows.

        Decided from the plan when ``atom_to_token`` is the scatter's map (its
        :class:`~physicsnemo_foldcp.core.tags.MapTag` carries the pads the plan inserted
        in each atom row block): no communication, no host sync. Otherwise read from
        ``atom_mask``: one small all-gather over ``cp0`` and a few host reads. Every rank
        raises alike.

        Parameters
        ----------
        atom_mask : ShardTensor
            ``atom_pad_mask [B, A]``, laid out as the atoms.
        atom_to_token : FoldTensor, optional
            The scattered ``atom_to_token`` map of the same sample.

        Raises
        ------
        ShardingLayoutError
            When a row block ends with pad atoms and a later block holds real atoms.
        """
        pads = self._planned_pads(atom_to_token)
        if pads is not None:
            real = [n - pad for n, pad in zip(self.atom_sizes, pads)]
            flags = [(pad > 0, n > 0) for pad, n in zip(pads, real)]
        else:
            flags = self._mask_flags(atom_mask)
        for p, (ends_with_pad, _) in enumerate(flags[:-1]):
            if ends_with_pad and any(holds_real for _, holds_real in flags[p + 1 :]):
                raise ShardingLayoutError(
                    f"atom windows: atom row block {p} ends with pad atoms and a later block "
                    "holds real atoms: per-shard atom padding (sharding.atom_multiple > 1) "
                    f"moves Boltz's {self.queries}-atom windows; scatter with "
                    f"atom_multiple=1 (windows that straddle row blocks are exchanged), seen "
                    f"on {rank_label(self.mesh)}"
                )

    def _planned_pads(self, atom_to_token: object) -> tuple[int, ...] | None:
        """The plan's inserted pads per atom row block, from the map's tag, if it has them."""
        tag = map_tag(atom_to_token)
        if tag is None or tag.row_pads is None or tag.axes[0] != ATOMS:
            return None
        if mesh_sizes(atom_to_token, ROWS, tag.sharded_dim) != list(self.atom_sizes):
            return None
        return tag.row_pads

    def _mask_flags(self, atom_mask: ShardTensor) -> list[tuple[bool, bool]]:
        """``(ends with a pad atom, holds a real atom)`` of every row block, from the mask."""
        real = compat.local_tensor(atom_mask).bool()
        real = real.reshape(real.shape[0], -1)
        ends_with_pad = real.shape[1] > 0 and not bool(real[:, -1].all())
        flags = torch.tensor([int(ends_with_pad), int(bool(real.any()))], device=real.device)
        gathered = [torch.zeros_like(flags) for _ in self.atom_sizes]
        dist.all_gather(gathered, flags, group=self.mesh.get_group(ROWS))
        return [(bool(g[0]), bool(g[1])) for g in torch.stack(gathered).tolist()]


class _OwnWindows(torch.autograd.Function):
    """This rank's run of a row block's windows; backward joins the runs' gradients."""

    @staticmethod
    def forward(ctx, block: torch.Tensor, windows: AtomWindows, unit: int) -> torch.Tensor:
        """``block`` ``[B, K_p u, ...]`` -> ``[B, K_pl u, ...]`` (``u``: rows per window)."""
        ctx.windows, ctx.unit = windows, unit
        first, count = windows.owned_span
        return block.narrow(ATOM_DIM, first * unit, count * unit).clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """ONE all-gather over ``cp1`` of the runs' gradients."""
        return _join_runs(grad.contiguous(), ctx.windows, ctx.unit), None, None


class _GatherWindows(torch.autograd.Function):
    """A row block's windows joined from the runs of its ``cp1`` ranks; backward: the slice."""

    @staticmethod
    def forward(ctx, owned: torch.Tensor, windows: AtomWindows, unit: int) -> torch.Tensor:
        """``owned`` ``[B, K_pl u, ...]`` -> ``[B, K_p u, ...]``: ONE all-gather over ``cp1``."""
        ctx.windows, ctx.unit = windows, unit
        return _join_runs(owned.contiguous(), windows, unit)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """This rank's run of the (whole, replicated) gradient."""
        first, count = ctx.windows.owned_span
        unit = ctx.unit
        return grad.narrow(ATOM_DIM, first * unit, count * unit).contiguous(), None, None


def _join_runs(owned: torch.Tensor, windows: AtomWindows, unit: int) -> torch.Tensor:
    sizes = [k * unit for k in windows.owned_counts[windows.p]]
    return gather_blocks(owned, ATOM_DIM, sizes, windows.mesh, COLUMNS)


def own_windows(block: torch.Tensor, windows: AtomWindows, unit: int = 1) -> torch.Tensor:
    """This rank's owned run of a window-aligned block (dim 1 counts ``unit`` rows a window).

    Parameters
    ----------
    block : torch.Tensor
        ``[B, K_p u, ...]``: the row block's windows, the same on its ``cp1`` ranks
        (``u = W`` for window-aligned atoms, 1 for ``[B, K_p, ...]`` per-window tensors).
    windows : AtomWindows
        The windows.
    unit : int, default 1
        Rows of dim 1 per window.

    Returns
    -------
    torch.Tensor
        ``[B, K_pl u, ...]``. No communication forward; backward ONE all-gather over
        ``cp1`` (none when the windows are not split, :attr:`AtomWindows.split_over_columns`).
    """
    if not windows.split_over_columns:
        return block
    return _OwnWindows.apply(block, windows, unit)


def gather_windows(owned: torch.Tensor, windows: AtomWindows, unit: int = 1) -> torch.Tensor:
    """The row block's windows ``[B, K_p u, ...]`` from every ``cp1`` rank's owned run.

    The inverse of :func:`own_windows`: ONE all-gather over ``cp1`` forward (none when the
    windows are not split), the slice backward.
    """
    if not windows.split_over_columns:
        return owned
    return _GatherWindows.apply(owned, windows, unit)


@functools.lru_cache(maxsize=64)
def _window_route(windows: AtomWindows, kind: str, device: torch.device) -> RowRoute:
    """:meth:`AtomWindows._route`, planned once per geometry (no tensor is read)."""
    p, q = coordinate(windows.mesh)
    a, w = windows.atom_bounds, windows.window_bounds
    blocks = range(len(a) - 1)
    if kind == "owned_keys":  # every rank's run, in rank order: the windows in order
        runs = [(w[t] // windows.queries, counts) for t, counts in enumerate(windows.owned_counts)]
        starts = [first + sum(counts[:j]) for first, counts in runs for j in range(len(counts))]
        sizes = [k for _, counts in runs for k in counts]
        wanted = [
            windows._key_rows(s * windows.queries, (s + k) * windows.queries)
            for s, k in zip(starts, sizes)
        ]
        peers = [rank for row in mesh_ranks(windows.mesh) for rank in row]
        in_sizes = [k * windows.queries for k in sizes]
        return plan_route(wanted, in_sizes, p * windows.mesh.size(COLUMNS) + q, peers, device)
    peers = [row[q] for row in mesh_ranks(windows.mesh)]
    if kind == "to_windows":
        wanted = [range(w[t], w[t + 1]) for t in blocks]
        in_sizes = windows.atom_sizes
    elif kind == "to_atoms":
        wanted = [range(a[t], a[t + 1]) for t in blocks]
        in_sizes = windows.window_atom_sizes
    else:
        wanted = [windows._key_rows(w[t], w[t + 1]) for t in blocks]
        in_sizes = windows.window_atom_sizes
    return plan_route(wanted, in_sizes, p, peers, device)


__all__ = ["ATOM_DIM", "AtomWindows", "check_window_sizes", "gather_windows", "own_windows"]
