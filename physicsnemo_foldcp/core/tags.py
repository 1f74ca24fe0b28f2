"""What the plugin knows about a FoldTensor beyond its placements: map and view tags.

Placements and shapes alone cannot tell an atom<->token map from any other
``(Shard, Replicate)`` tensor, nor a broadcast view ``s[:, :, None]`` from any unit axis.
A :class:`~physicsnemo_foldcp.core.tensor.FoldTensor` may carry one tag in ``foldcp_tag``:

* a :class:`MapTag` on an atom<->token incidence map as scattered (``atom_to_token``,
  ``token_to_rep_atom``, ``token_to_center_atom``, ``r_set_to_rep_atom``; see
  :func:`physicsnemo_foldcp.ops.maps.tag_maps`), and on views derived from one;
* a :class:`ViewTag` on ``s[:, :, None]`` / ``s[:, None, :]`` of a row-sharded single
  (see :mod:`physicsnemo_foldcp.ops.single_pair`).

Which ops keep, change or drop a tag is written in :mod:`physicsnemo_foldcp.dispatch.rules`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class MapTag:
    """What a scattered atom<->token map is, and where its nonzero entries are.

    A map ``M`` of feature ``name`` relates axis ``axes[0]`` (its rows, split over ``cp0``
    like every single of that axis) to axis ``axes[1]`` (its columns, full length). Atoms
    follow their tokens, so on the ranks of row block ``i`` every nonzero column of the
    local block lies in block ``i`` of ``axes[1]`` (length ``block_sizes[i]``, padded
    layout).

    Attributes
    ----------
    name : str
        Feature key (``"atom_to_token"``, ...).
    axes : tuple[str, str]
        Axis meanings ``(rows, columns)`` as the registry declares them.
    layout : str
        ``"dense"`` (one-hot ``[B, R, C]``) or ``"index"`` (``[B, R]`` int64 global column
        position, ``-1`` for none).
    sharded_dim : int
        Tensor dim of the rows (split over ``cp0``).
    block_dim : int or None
        Tensor dim of the columns (dense layout); ``None`` for the index layout.
    block_sizes : tuple[int, ...]
        Padded length of each ``cp0`` block of the column axis.
    checked : bool
        Whether the content was checked to lie in the blocks (so handlers skip the check).
    derived_by : str or None
        Set when an op the plugin cannot follow made this tensor from a map; such a tensor
        is still correct data, but the contraction handlers refuse it with a clear error.
    row_pads : tuple[int, ...] or None
        Positions the plan inserted at the end of each ``cp0`` block of the row axis
        (per-shard padding; all zeros without it), so a handler knows the layout of the
        row axis without reading a mask; ``None`` when not known.
    """

    name: str
    axes: tuple[str, str]
    layout: str
    sharded_dim: int
    block_dim: int | None
    block_sizes: tuple[int, ...]
    checked: bool = False
    derived_by: str | None = None
    row_pads: tuple[int, ...] | None = None

    def transposed(self, dim0: int, dim1: int) -> MapTag:
        """The tag after swapping tensor dims ``dim0`` and ``dim1`` (the map's two axes)."""
        swap = {dim0: dim1, dim1: dim0}
        return replace(
            self,
            sharded_dim=swap.get(self.sharded_dim, self.sharded_dim),
            block_dim=swap.get(self.block_dim, self.block_dim),
        )

    def shifted(self, by: int) -> MapTag:
        """The tag after ``by`` unit dims were inserted before the map's two dims."""
        block_dim = None if self.block_dim is None else self.block_dim + by
        return replace(self, sharded_dim=self.sharded_dim + by, block_dim=block_dim)

    def derived(self, how: str) -> MapTag:
        """The tag of a tensor made from the map by ``how``, which the plugin cannot follow."""
        return replace(self, derived_by=self.derived_by or how)

    def column_block(self, row_block: int) -> tuple[int, int]:
        """``(start, length)`` of the column block of ``cp0`` block ``row_block``."""
        return int(sum(self.block_sizes[:row_block])), int(self.block_sizes[row_block])


@dataclass(frozen=True)
class ViewTag:
    """``s[:, :, None]`` (``kind="rows"``) or ``s[:, None, :]`` (``"columns"``) of a single.

    The single ``s`` is ``(Shard(token_dim), Replicate())``; the view inserts a unit axis
    after (rows) or before (columns) its token axis. A rows view and a columns view
    combined elementwise give the ``(Shard(token_dim), Shard(token_dim + 1))`` pair tile.

    Attributes
    ----------
    kind : str
        ``"rows"`` or ``"columns"``.
    token_dim : int
        Token axis of the single (the tile's row axis).
    """

    kind: str
    token_dim: int


__all__ = ["MapTag", "ViewTag"]
