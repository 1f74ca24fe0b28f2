"""The sharding plan: which tokens, atoms and rows each rank of a ``cp0 x cp1`` mesh holds.

This module owns every geometric question, and nothing else (no validation of tensor
values, no communication). Token row blocks go over ``cp0`` (contiguous, uneven allowed),
token column blocks over ``cp1`` (:func:`column_block_sizes`); each row block's atoms are
exactly the atoms of its tokens (atoms follow their tokens), so atom<->token products are
local. Optional per-shard padding rounds each row block's tokens and atoms up to a
multiple; the resulting *padded layout* is the global layout of every sharded feature
(``full_tensor()``), and :meth:`ShardingPlan.to_padded` / :meth:`ShardingPlan.from_padded`
convert between it and the serial layout exactly.

:class:`ShardingPlan` answers, for any feature (its :class:`FeatureSpec` and padded shape)
and any rank: its block's ranges (:meth:`~ShardingPlan.block_ranges`), the runs of real
and inserted pad positions in them (:meth:`~ShardingPlan.layout_runs`,
:meth:`~ShardingPlan.block_runs`, :meth:`~ShardingPlan.pad_elements`), its local shape and
block (:meth:`~ShardingPlan.local_shape`, :meth:`~ShardingPlan.local_block`) and the
sharding shapes of ``ShardTensor.from_local`` (:meth:`~ShardingPlan.sharding_shapes`).

A plan is small, picklable, and the same on every rank of a domain group.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from physicsnemo_foldcp.features.axes import ATOMS, EVEN, MSA, TOKENS, Axis, find_axis, is_layout
from physicsnemo_foldcp.features.spec import PASSTHROUGH, FeatureSpec
from physicsnemo_foldcp.sharding.options import positive_int
from physicsnemo_foldcp.sharding.validation import FeatureValidationError

Coordinate = tuple[int, int]
"""Domain coordinate ``(i, j)`` of a rank: row block ``i`` over ``cp0``, column block ``j``."""

Range = tuple[int, int]
"""``(start, stop)`` of a block along one dim."""

RealRun = tuple[int, int, int]
"""``(local offset, serial start, length)`` of a run of real positions in a block."""

PadRun = tuple[int, int]
"""``(local offset, length)`` of a run of positions the plan inserted (per-shard pads)."""


def split_sizes(length: int, parts: int) -> list[int]:
    """Sizes of ``parts`` contiguous blocks of ``length`` items, the larger blocks first.

    The same rule as :func:`torch.tensor_split`: sizes differ by at most one.
    """
    base, extra = divmod(length, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def column_block_sizes(row_sizes: Sequence[int], cp1: int) -> list[int]:
    """Token column blocks over ``cp1`` of a token axis cut into ``row_sizes`` row blocks.

    The one rule for the second token axis of a pair tile: the column blocks are the row
    blocks when ``cp0 == cp1`` (``len(row_sizes) == cp1``), so rank ``(i, i)`` holds a
    diagonal tile; otherwise the (padded) token length ``sum(row_sizes)`` is split into
    ``cp1`` blocks that differ by at most one (:func:`split_sizes`).

    Parameters
    ----------
    row_sizes : Sequence[int]
        Length of each of the ``cp0`` row blocks (padded layout, per-shard pads included).
    cp1 : int
        Number of column blocks.

    Returns
    -------
    list[int]
        ``cp1`` column block lengths summing to ``sum(row_sizes)``.
    """
    if cp1 == len(row_sizes):
        return [int(s) for s in row_sizes]
    return split_sizes(int(sum(row_sizes)), cp1)


def msa_row_sizes(depth: int, cp0: int) -> list[int]:
    """MSA row blocks over ``cp0`` of an MSA of ``depth`` rows: the one rule for the msa axis.

    The scatter lays out an MSA feature by it (:meth:`ShardingPlan.row_sizes`), and an op
    that makes an MSA of a new depth (rows picked by an index,
    :mod:`physicsnemo_foldcp.ops.msa_rows`) lays out its result by it: :func:`split_sizes`,
    blocks that differ by at most one, the larger first.

    Parameters
    ----------
    depth : int
        MSA depth S (rows).
    cp0 : int
        Number of row blocks.

    Returns
    -------
    list[int]
        ``cp0`` block lengths summing to ``depth`` (some are 0 when ``depth < cp0``).
    """
    return split_sizes(int(depth), int(cp0))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _bounds(sizes: Sequence[int]) -> tuple[int, ...]:
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return tuple(out)


def even_token_bounds(n_tokens: int, cp0: int) -> tuple[int, ...]:
    """The default boundaries: ``cp0`` blocks whose token counts differ by at most one.

    Parameters
    ----------
    n_tokens : int
        Token count N.
    cp0 : int
        Number of row blocks.

    Returns
    -------
    tuple[int, ...]
        ``cp0 + 1`` boundaries from 0 to N (what :func:`build_plan` uses when given none).
    """
    if cp0 < 1:
        raise ValueError(f"cp0 must be >= 1, got {cp0}")
    return _bounds(split_sizes(int(n_tokens), cp0))


def check_token_bounds(bounds: Sequence[int], cp0: int, n_tokens: int) -> tuple[int, ...]:
    """``bounds`` as a tuple of ints, if they are ``cp0 + 1`` steps from 0 to N; else raise.

    Raises
    ------
    ValueError
        If the boundaries do not run from 0 to ``n_tokens`` in ``cp0`` non-decreasing steps.
    """
    out = tuple(int(b) for b in bounds)
    if (
        len(out) != cp0 + 1
        or out[0] != 0
        or out[-1] != n_tokens
        or any(b > c for b, c in zip(out, out[1:]))
    ):
        raise ValueError(
            f"token_bounds {out} must be {cp0 + 1} non-decreasing boundaries from 0 to N={n_tokens}"
        )
    return out


def _dim_axes(spec: FeatureSpec, ndim: int) -> list[Axis | None]:
    """Axis meaning of every dim of a feature in the padded layout.

    ``None`` where the plan does not lay the dim out (a passed-through feature keeps its
    serial layout).
    """
    if spec.mode == PASSTHROUGH:
        return [None] * ndim
    return list(spec.axes[:ndim])  # a compact (index-layout) map keeps its first axis


@dataclass(frozen=True)
class ShardingPlan:
    """Blocks per rank for one sample on a ``(cp0, cp1)`` domain mesh.

    Parameters
    ----------
    cp : tuple[int, int]
        ``(cp0, cp1)``.
    token_bounds : tuple[int, ...]
        ``cp0 + 1`` serial token boundaries: row block ``i`` holds serial tokens
        ``token_bounds[i]:token_bounds[i + 1]``.
    atom_bounds : tuple[int, ...]
        ``cp0 + 1`` serial atom boundaries: the atoms of row block ``i``'s tokens (the
        last block also holds trailing atoms that belong to no token: serial pad atoms).
    rset_bounds : tuple[int, ...] or None
        ``cp0 + 1`` boundaries of the rows of ``rset`` features (rows follow their token).
    even_lengths : tuple[tuple[str, int], ...]
        ``(axis name, length)`` of every axis of the sample whose block rule is ``"even"``
        (the MSA depth S), each split over ``cp0`` in :func:`msa_row_sizes` blocks.
    token_multiple : int
        Each row block's token count is padded up to a multiple of this.
    atom_multiple : int
        Each row block's atom count is padded up to a multiple of this.
    """

    cp: tuple[int, int]
    token_bounds: tuple[int, ...]
    atom_bounds: tuple[int, ...]
    rset_bounds: tuple[int, ...] | None = None
    even_lengths: tuple[tuple[str, int], ...] = ()
    token_multiple: int = 1
    atom_multiple: int = 1

    # -- sizes --------------------------------------------------------------------------

    @property
    def n_tokens(self) -> int:
        """Serial token count N."""
        return self.token_bounds[-1]

    @property
    def n_atoms(self) -> int:
        """Serial atom count A."""
        return self.atom_bounds[-1]

    @property
    def msa_rows(self) -> int | None:
        """MSA depth S, or ``None`` when the sample has no MSA."""
        return dict(self.even_lengths).get(MSA.name)

    def _serial_bounds(self, axis: str | Axis) -> tuple[int, ...]:
        meaning = find_axis(axis)
        if meaning is None or not meaning.layout:
            raise ValueError(f"axis {axis!r} has no row blocks")
        bounds = getattr(self, meaning.bounds)
        if bounds is None:
            raise FeatureValidationError(
                f"the plan has no {meaning.name} axis ({meaning.missing()})"
            )
        return bounds

    def _multiple(self, axis: Axis) -> int:
        return getattr(self, axis.multiple) if axis.multiple is not None else 1

    def row_sizes(self, axis: str | Axis) -> list[int]:
        """Padded local length of ``axis`` on each ``cp0`` row block (its block rule)."""
        meaning = find_axis(axis)
        if meaning is not None and meaning.blocks == EVEN:
            length = dict(self.even_lengths).get(meaning.name)
            if length is None:
                raise FeatureValidationError(
                    f"the plan has no {meaning.name} axis ({meaning.missing()})"
                )
            return msa_row_sizes(length, self.cp[0])
        b = self._serial_bounds(axis)
        m = self._multiple(meaning)
        return [_round_up(b[i + 1] - b[i], m) for i in range(self.cp[0])]

    def padded_length(self, axis: str) -> int:
        """Global length of ``axis`` in the padded layout."""
        return sum(self.row_sizes(axis))

    def column_sizes(self) -> list[int]:
        """Local length of the token axis on each ``cp1`` column block.

        :func:`column_block_sizes` of the padded token row blocks: the same blocks as the
        rows when ``cp0 == cp1``; otherwise the padded token axis split into ``cp1`` blocks
        that differ by at most one.
        """
        return column_block_sizes(self.row_sizes(TOKENS), self.cp[1])

    def sizes(self, axis: str | Axis, mesh_dim: int) -> list[int]:
        """Local lengths of ``axis`` over the blocks of ``mesh_dim`` (0: cp0, 1: cp1).

        Over ``cp1`` only an axis with column blocks (the token axis) is split:
        :func:`column_block_sizes` of its row blocks.
        """
        if mesh_dim == 0:
            return self.row_sizes(axis)
        meaning = find_axis(axis)
        if meaning is None or not meaning.columns:
            raise ValueError(f"only the token axis is split over cp1, not {axis!r}")
        return column_block_sizes(self.row_sizes(meaning), self.cp[1])

    def block(self, axis: str, mesh_dim: int, index: int) -> tuple[int, int]:
        """``(start, stop)`` of block ``index`` of ``axis`` over ``mesh_dim``, padded layout."""
        b = _bounds(self.sizes(axis, mesh_dim))
        return b[index], b[index + 1]

    def serial_range(self, axis: str, row: int) -> tuple[int, int]:
        """``(start, stop)`` of row block ``row`` of ``axis`` in the SERIAL layout."""
        b = self._serial_bounds(axis)
        return b[row], b[row + 1]

    @property
    def coordinates(self) -> list[Coordinate]:
        """Domain coordinate of every rank, row-major (domain rank ``i * cp1 + j``)."""
        return [(i, j) for i in range(self.cp[0]) for j in range(self.cp[1])]

    # -- one feature's block on one rank ------------------------------------------------

    def layout_runs(
        self, axis: str | Axis | None, start: int, stop: int
    ) -> tuple[list[RealRun], list[PadRun]]:
        """Real and pad runs of the padded positions ``[start, stop)`` of one axis.

        Parameters
        ----------
        axis : str or None
            Axis meaning; an axis the plan does not pad (or ``None``) is one real run.
        start, stop : int
            Range in the padded layout (e.g. one block of :meth:`block_ranges`).

        Returns
        -------
        tuple[list[RealRun], list[PadRun]]
            ``(local offset, serial start, length)`` of every run of real positions and
            ``(local offset, length)`` of every run of inserted pads, offsets from
            ``start``, in order. Together they tile ``[0, stop - start)``.
        """
        if not self.has_padding(axis):
            return ([(0, start, stop - start)] if stop > start else []), []
        real: list[RealRun] = []
        pads: list[PadRun] = []
        row_start = 0
        for row, size in enumerate(self.row_sizes(axis)):
            serial_start, serial_stop = self.serial_range(axis, row)
            real_stop = row_start + serial_stop - serial_start
            low, high = max(start, row_start), min(stop, real_stop)
            if high > low:
                real.append((low - start, serial_start + low - row_start, high - low))
            low, high = max(start, real_stop), min(stop, row_start + size)
            if high > low:
                pads.append((low - start, high - low))
            row_start += size
        return real, pads

    def real_count(self, axis: str | Axis | None, start: int, stop: int) -> int:
        """Positions of ``[start, stop)`` of ``axis`` (padded layout) that are not pads."""
        return sum(length for _, _, length in self.layout_runs(axis, start, stop)[0])

    def padded_shape(self, spec: FeatureSpec, shape: Sequence[int]) -> tuple[int, ...]:
        """Unbatched shape of a serial-layout feature in the padded layout.

        Parameters
        ----------
        spec : FeatureSpec
            The feature's registry entry.
        shape : Sequence[int]
            Its unbatched serial shape.
        """
        return tuple(
            self.padded_length(axis) if self.has_padding(axis) else int(n)
            for axis, n in zip(_dim_axes(spec, len(shape)), shape)
        )

    def block_ranges(
        self, spec: FeatureSpec, padded_shape: Sequence[int], coord: Coordinate
    ) -> list[Range]:
        """``(start, stop)`` in the padded layout of every dim of the block at ``coord``.

        Parameters
        ----------
        spec : FeatureSpec
            The feature's registry entry (its placements say which dims are split).
        padded_shape : Sequence[int]
            Unbatched global shape in the padded layout (``FeatureMeta.padded_shape``).
        coord : Coordinate
            Domain coordinate ``(i, j)`` of the rank.

        Returns
        -------
        list[Range]
            One range per dim: the rank's row/column block on a split dim, the whole
            length otherwise.
        """
        sharded = {dim: mesh_dim for mesh_dim, dim in spec.sharded_axes.items()}
        return [
            self.block(spec.axes[dim], sharded[dim], coord[sharded[dim]])
            if dim in sharded
            else (0, int(n))
            for dim, n in enumerate(padded_shape)
        ]

    def block_runs(
        self, spec: FeatureSpec, padded_shape: Sequence[int], coord: Coordinate
    ) -> list[tuple[list[RealRun], list[PadRun]]]:
        """:meth:`layout_runs` of every dim of the block at ``coord`` (see :meth:`block_ranges`).

        The block is the product of the real runs (copied from the serial tensor) and, on
        each dim, its pad runs (filled with the pad value).
        """
        axes = _dim_axes(spec, len(padded_shape))
        ranges = self.block_ranges(spec, padded_shape, coord)
        return [self.layout_runs(axis, start, stop) for axis, (start, stop) in zip(axes, ranges)]

    def local_shape(
        self, spec: FeatureSpec, padded_shape: Sequence[int], coord: Coordinate
    ) -> tuple[int, ...]:
        """Unbatched local shape of a feature on the rank at domain coordinate ``coord``.

        Parameters
        ----------
        spec : FeatureSpec
            The feature's registry entry.
        padded_shape : Sequence[int]
            Unbatched global shape in the padded layout.
        coord : Coordinate
            Domain coordinate ``(i, j)`` of the rank.
        """
        shape = [int(n) for n in padded_shape]
        for mesh_dim, dim in spec.sharded_axes.items():
            shape[dim] = self.sizes(spec.axes[dim], mesh_dim)[coord[mesh_dim]]
        return tuple(shape)

    def local_block(
        self, spec: FeatureSpec, padded: torch.Tensor, coord: Coordinate
    ) -> torch.Tensor:
        """The block (a view) of an unbatched padded-layout feature held at ``coord``."""
        out = padded
        for mesh_dim, dim in spec.sharded_axes.items():
            start, stop = self.block(spec.axes[dim], mesh_dim, coord[mesh_dim])
            out = out.narrow(dim, start, stop - start)
        return out

    def pad_elements(
        self, spec: FeatureSpec, padded_shape: Sequence[int], coord: Coordinate
    ) -> int:
        """Elements of the block at ``coord`` that sit at positions the plan inserted."""
        real = math.prod(
            sum(length for _, _, length in runs)
            for runs, _ in self.block_runs(spec, padded_shape, coord)
        )
        return math.prod(self.local_shape(spec, padded_shape, coord)) - real

    def sharding_shapes(
        self,
        spec: FeatureSpec,
        padded_shape: Sequence[int],
        coord: Coordinate,
        batched: bool = False,
    ) -> dict[int, list[tuple[int, ...]]]:
        """``ShardTensor.from_local`` shapes: ``{mesh_dim: [local shape of rank r on it]}``.

        Entry ``r`` of mesh dim ``m`` is the local shape of the rank at coordinate ``r`` on
        ``m`` and at this rank's coordinate on the other mesh dim.

        Parameters
        ----------
        spec : FeatureSpec
            The feature's registry entry.
        padded_shape : Sequence[int]
            Unbatched global shape in the padded layout.
        coord : Coordinate
            Domain coordinate ``(i, j)`` of this rank.
        batched : bool, default False
            Prefix every shape with a batch axis of 1.
        """
        prefix = (1,) if batched else ()
        out: dict[int, list[tuple[int, ...]]] = {}
        for mesh_dim in spec.sharded_axes:
            shapes = []
            for r in range(self.cp[mesh_dim]):
                other = list(coord)
                other[mesh_dim] = r
                shapes.append(prefix + self.local_shape(spec, padded_shape, tuple(other)))
            out[mesh_dim] = shapes
        return out

    # -- layout maps --------------------------------------------------------------------

    def has_padding(self, axis: str | Axis | None) -> bool:
        """Whether the padded layout of ``axis`` differs from the serial one.

        Only a layout axis (:attr:`~physicsnemo_foldcp.features.axes.Axis.layout`) is ever
        padded; any other meaning (or ``None``) is not.
        """
        if not is_layout(axis):
            return False
        return self.padded_length(axis) != self._serial_bounds(axis)[-1]

    def positions(self, axis: str) -> torch.Tensor:
        """Padded-layout position of every serial index of ``axis`` (int64, ``[length]``)."""
        serial = self._serial_bounds(axis)
        padded = _bounds(self.row_sizes(axis))
        pieces = [
            torch.arange(serial[i], serial[i + 1], dtype=torch.int64) - serial[i] + padded[i]
            for i in range(self.cp[0])
        ]
        return torch.cat(pieces)

    def is_pad(self, axis: str) -> torch.Tensor:
        """Bool ``[padded_length]``: True at positions the plan inserted (per-shard pads)."""
        mask = torch.ones(self.padded_length(axis), dtype=torch.bool)
        mask[self.positions(axis)] = False
        return mask

    def to_padded(
        self,
        tensor: torch.Tensor,
        axes: Sequence[str | Axis | None],
        pad_value: float | int | bool,
    ) -> torch.Tensor:
        """Serial layout -> padded layout along every tokens/atoms/rset axis of ``tensor``.

        Parameters
        ----------
        tensor : torch.Tensor
            An unbatched feature in the serial layout.
        axes : sequence of (str, Axis or None)
            Its axis meanings (``FeatureSpec.axes``).
        pad_value : bool, int or float
            Value written at the inserted positions.
        """
        out = tensor
        for dim, axis in enumerate(axes):
            if self.has_padding(axis):
                shape = list(out.shape)
                shape[dim] = self.padded_length(axis)
                grown = torch.full(shape, pad_value, dtype=out.dtype, device=out.device)
                out = grown.index_copy_(dim, self.positions(axis).to(out.device), out)
        return out

    def from_padded(self, tensor: torch.Tensor, axes: Sequence[str | Axis | None]) -> torch.Tensor:
        """Padded layout -> serial layout (drops the positions the plan inserted)."""
        out = tensor
        for dim, axis in enumerate(axes):
            if self.has_padding(axis):
                out = out.index_select(dim, self.positions(axis).to(out.device))
        return out

    def remap_index_values(self, values: torch.Tensor, axis: str) -> torch.Tensor:
        """Serial indices into ``axis`` -> indices into its padded layout."""
        if not self.has_padding(axis):
            return values
        return self.positions(axis).to(values.device)[values.long()].to(values.dtype)

    def unmap_index_values(self, values: torch.Tensor, axis: str) -> torch.Tensor:
        """Padded-layout indices into ``axis`` -> serial indices (inverse of the remap)."""
        if not self.has_padding(axis):
            return values
        inverse = torch.full((self.padded_length(axis),), -1, dtype=torch.int64)
        inverse[self.positions(axis)] = torch.arange(self._serial_bounds(axis)[-1])
        out = inverse.to(values.device)[values.long()]
        if (out < 0).any():
            raise FeatureValidationError(f"an index points at a pad position of axis {axis!r}")
        return out.to(values.dtype)

    def describe(self) -> str:
        """Per-row-block token, atom and MSA ranges, one line each."""
        lines = [
            f"plan on cp0 x cp1 = {self.cp[0]} x {self.cp[1]}: {self.n_tokens} tokens "
            f"(padded {self.padded_length(TOKENS)}), {self.n_atoms} atoms "
            f"(padded {self.padded_length(ATOMS)}), token columns {self.column_sizes()}"
        ]
        msa = self.row_sizes(MSA) if self.msa_rows is not None else None
        for i in range(self.cp[0]):
            t0, t1 = self.serial_range(TOKENS, i)
            a0, a1 = self.serial_range(ATOMS, i)
            line = (
                f"  row {i}: tokens [{t0}, {t1}) -> {self.row_sizes(TOKENS)[i]} local, "
                f"atoms [{a0}, {a1}) -> {self.row_sizes(ATOMS)[i]} local"
            )
            if msa is not None:
                line += f", msa rows {msa[i]}"
            lines.append(line)
        return "\n".join(lines)


# -- functions of the plan, for callers that hold a plan rather than call it --------------


def local_shape(
    spec: FeatureSpec, padded_shape: Sequence[int], plan: ShardingPlan, coord: Coordinate
) -> tuple[int, ...]:
    """:meth:`ShardingPlan.local_shape` (the unbatched local shape at ``coord``)."""
    return plan.local_shape(spec, padded_shape, coord)


def local_block(
    spec: FeatureSpec, padded: torch.Tensor, plan: ShardingPlan, coord: Coordinate
) -> torch.Tensor:
    """:meth:`ShardingPlan.local_block` (the block of a padded-layout feature at ``coord``)."""
    return plan.local_block(spec, padded, coord)


def sharding_shapes(
    spec: FeatureSpec,
    padded_shape: Sequence[int],
    plan: ShardingPlan,
    coord: Coordinate,
    batched: bool,
) -> dict[int, list[tuple[int, ...]]]:
    """:meth:`ShardingPlan.sharding_shapes` (the shapes for ``ShardTensor.from_local``)."""
    return plan.sharding_shapes(spec, padded_shape, coord, batched)


# -- building a plan ----------------------------------------------------------------------


def _rset_bounds(
    name: str, row_tokens: torch.Tensor, token_bounds: Sequence[int]
) -> tuple[int, ...]:
    """Row boundaries of an ``rset`` axis whose rows follow their tokens.

    Parameters
    ----------
    name : str
        The feature that defines the rows (for the message).
    row_tokens : torch.Tensor
        int64 ``[R]`` token of each row, ``-1`` for an empty row (it goes last).
    token_bounds : Sequence[int]
        ``cp0 + 1`` token boundaries of the row blocks.
    """
    bounds = torch.tensor(token_bounds[1:-1], dtype=torch.int64)
    blocks = torch.bucketize(row_tokens, bounds, right=True)
    blocks = torch.where(row_tokens < 0, len(token_bounds) - 2, blocks)
    if blocks.numel() > 1 and bool((blocks[1:] < blocks[:-1]).any()):
        r = int((blocks[1:] < blocks[:-1]).nonzero()[0]) + 1
        raise FeatureValidationError(
            f"{name}: rows must be in token order with empty rows last; row {r} is out of order"
        )
    per_block = torch.bincount(blocks, minlength=len(token_bounds) - 1)
    return _bounds(per_block.tolist())


def build_plan(
    lengths: Mapping[str, int],
    cp: tuple[int, int],
    *,
    atom_tokens: torch.Tensor | None = None,
    rset_rows: tuple[str, torch.Tensor] | None = None,
    token_multiple: int = 1,
    atom_multiple: int = 1,
    token_bounds: Sequence[int] | None = None,
) -> ShardingPlan:
    """Make the plan for one sample.

    Parameters
    ----------
    lengths : Mapping[str, int]
        Length of every axis meaning the sample uses (``tokens`` required; ``atoms``,
        ``msa``, ``rset`` when present). The length of every axis with the ``"even"`` block
        rule (``msa``) is kept in the plan; names no axis has are ignored.
    cp : tuple[int, int]
        ``(cp0, cp1)``.
    atom_tokens : torch.Tensor, optional
        int64 ``[A]`` token of each atom (-1 for trailing pads), from
        :func:`~physicsnemo_foldcp.sharding.validation.atom_tokens_from_map`; required when
        the sample has atoms.
    rset_rows : tuple[str, torch.Tensor], optional
        ``(name, int64 [R] token of each row)`` of the feature that defines the rset rows
        (:func:`~physicsnemo_foldcp.sharding.validation.rset_row_tokens`).
    token_multiple, atom_multiple : int, default 1
        Per-shard padding multiples.
    token_bounds : sequence of int, optional
        Explicit ``cp0 + 1`` row-block token boundaries (a balanced plan); the default
        splits tokens into blocks that differ by at most one (:func:`even_token_bounds`).
    """
    positive_int("token_multiple", token_multiple)
    positive_int("atom_multiple", atom_multiple)
    cp0 = cp[0]
    n_tokens = int(lengths[TOKENS])
    if token_bounds is None:
        token_bounds = even_token_bounds(n_tokens, cp0)
    token_bounds = check_token_bounds(token_bounds, cp0, n_tokens)
    if ATOMS in lengths:
        if atom_tokens is None:
            raise FeatureValidationError("atom features need atom_to_token to place their atoms")
        per_token = torch.bincount(atom_tokens[atom_tokens >= 0], minlength=n_tokens)
        starts = _bounds(per_token.tolist())
        atom_bounds = tuple(starts[b] for b in token_bounds[:-1]) + (int(lengths[ATOMS]),)
    else:
        atom_bounds = (0,) * (cp0 + 1)
    rset_bounds = None
    if rset_rows is not None and atom_tokens is not None:
        rset_bounds = _rset_bounds(*rset_rows, token_bounds)
    meanings = {name: find_axis(name) for name in lengths}
    even_lengths = sorted(
        (axis.name, int(lengths[name]))
        for name, axis in meanings.items()
        if axis is not None and axis.blocks == EVEN
    )
    return ShardingPlan(
        cp=(int(cp[0]), int(cp[1])),
        token_bounds=token_bounds,
        atom_bounds=atom_bounds,
        rset_bounds=rset_bounds,
        even_lengths=tuple(even_lengths),
        token_multiple=token_multiple,
        atom_multiple=atom_multiple,
    )


__all__ = [
    "Coordinate",
    "PadRun",
    "Range",
    "RealRun",
    "ShardingPlan",
    "build_plan",
    "check_token_bounds",
    "column_block_sizes",
    "even_token_bounds",
    "local_block",
    "local_shape",
    "msa_row_sizes",
    "sharding_shapes",
    "split_sizes",
]
