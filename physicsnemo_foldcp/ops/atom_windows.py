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

Layouts: the atom tensors are ``(Shard(1), Replicate())`` over ``(cp0, cp1)``; the
window-aligned blocks are plain local tensors ``[B, K_p W, ...]`` (or ``[B, K_p, W, ...]``),
the same on the ranks of one ``cp0`` row block.
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
    ROWS,
    ShardingLayoutError,
    block_starts,
    coordinate,
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

    # -- routes ------------------------------------------------------------------------

    def _route(self, kind: str, device: torch.device) -> RowRoute:
        """The route of a move (``"to_windows"``, ``"to_atoms"``, ``"keys"``).

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
        extended = self._move(local, "keys")
        b, length, rest = extended.shape[0], extended.shape[1], extended.shape[2:]
        windows = self.window_counts[self.p]
        if not windows:
            return extended.new_zeros((b, 0, self.keys, *rest))
        flat = extended.reshape(b, length, -1).unfold(1, self.keys, self.queries)
        return flat.transpose(2, 3).reshape(b, windows, self.keys, *rest)

    def windows_of(self, local: torch.Tensor) -> torch.Tensor:
        """``[B, K_p W, ...]`` viewed as ``[B, K_p, W, ...]``."""
        shape = local.shape
        return local.reshape(shape[0], self.window_counts[self.p], self.queries, *shape[2:])

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


@functools.lru_cache(maxsize=64)
def _window_route(windows: AtomWindows, kind: str, device: torch.device) -> RowRoute:
    """:meth:`AtomWindows._route`, planned once per geometry (no tensor is read)."""
    p, q = coordinate(windows.mesh)
    peers = [row[q] for row in mesh_ranks(windows.mesh)]
    a, w = windows.atom_bounds, windows.window_bounds
    blocks = range(len(a) - 1)
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


__all__ = ["ATOM_DIM", "AtomWindows", "check_window_sizes"]
