"""The wire format of the scatter: what one rank's buffer holds, how it is written and read.

The source rank holds a :class:`PreparedSample` (the validated serial features and their
plan, from :func:`physicsnemo_foldcp.sharding.prepare.prepare_sample`). For each rank it
writes the rank's block of every feature, in sorted key order, straight from the serial
tensors into one byte buffer (:func:`pack_rank`; the byte-buffer helpers are in
:mod:`physicsnemo_foldcp.sharding.packing`), so the padded layout of the whole sample is
never built. :func:`wire_layout` says, from the metadata every rank holds, the
``(shape, dtype)`` of each feature in that buffer; :func:`expand_wire_blocks` turns the
received tensors into the local blocks. A dense 0/1 map travels as one int64 per local row
(its ``wire_rows`` form) and is expanded to its dense block on arrival. Which positions of a
block are real and which are pads is asked of the plan
(:meth:`~physicsnemo_foldcp.sharding.plan.ShardingPlan.block_runs`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from physicsnemo_foldcp.features.spec import PASSTHROUGH, FeatureSpec
from physicsnemo_foldcp.sharding.maps import pad_map_index
from physicsnemo_foldcp.sharding.packing import pack_into
from physicsnemo_foldcp.sharding.plan import Coordinate, ShardingPlan

WireLayout = list[tuple[tuple[int, ...], torch.dtype]]
"""``(shape, dtype)`` of every tensor in one rank's buffer, in buffer order."""


@dataclass(frozen=True)
class FeatureMeta:
    """What every rank must know about one tensor feature to rebuild it.

    Attributes
    ----------
    name : str
        Feature key.
    dtype : torch.dtype
        Its dtype (preserved by the scatter).
    serial_shape : tuple[int, ...]
        Unbatched shape as the featurizer gave it.
    padded_shape : tuple[int, ...]
        Unbatched global shape in the padded layout (what ``full_tensor()`` has).
    compact_of : torch.dtype or None
        For a one-hot map sent in the compact index layout: the dtype of the dense map
        (``dtype`` is then int64); ``None`` otherwise.
    wire_rows : bool
        A dense map of exact 0s and 1s (integer or bool, at most one 1 per row) that
        travels as int64 ``[local rows]``, the local column of each row's 1 (-1 for
        none), and is expanded to its dense block on arrival (:func:`expand_wire_blocks`).
        Its ShardTensor is the dense map either way.
    """

    name: str
    dtype: torch.dtype
    serial_shape: tuple[int, ...]
    padded_shape: tuple[int, ...]
    compact_of: torch.dtype | None = None
    wire_rows: bool = False


class _PaddedFeatures(Mapping):
    """Name -> feature in the padded layout, each built on first access and kept."""

    def __init__(self, prepared: PreparedSample) -> None:
        self._prepared = prepared
        self._cache: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._cache:
            self._cache[name] = self._prepared.padded_feature(name)
        return self._cache[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._prepared.sources)

    def __len__(self) -> int:
        return len(self._prepared.sources)


@dataclass
class PreparedSample:
    """A validated sample and its plan (source rank only).

    The features stay in the serial layout (index values remapped, index-layout maps
    already converted); :meth:`write_block` writes any rank's block of a feature straight
    into a given tensor, padding only where the plan inserts pads. A dense one-hot map of
    exact 0s and 1s travels as its row vector (:meth:`write_wire_rows`).

    Attributes
    ----------
    plan : ShardingPlan
        Blocks per rank.
    metas : list[FeatureMeta]
        One per tensor feature, sorted by name.
    sources : dict[str, torch.Tensor]
        Unbatched features the blocks are cut from: the serial layout, except the names
        in ``laid_out``.
    specs : dict[str, FeatureSpec]
        Registry entry of every feature.
    values : dict[str, Any]
        Non-tensor entries, passed through unchanged.
    batched : bool
        Whether the features carried a leading batch axis of 1.
    laid_out : frozenset[str]
        Features whose source is already in the padded layout.
    map_rows : dict[str, torch.Tensor]
        For each dense one-hot map with an integer or bool dtype, only 0s and 1s, at most
        one 1 per row and pad value 0: int64 ``[rows]``, the serial column of each serial
        row's 1 (-1 for none). Its wire form is written from this vector.
    """

    plan: ShardingPlan
    metas: list[FeatureMeta]
    sources: dict[str, torch.Tensor]
    specs: dict[str, FeatureSpec]
    values: dict[str, Any] = field(default_factory=dict)
    batched: bool = False
    laid_out: frozenset[str] = frozenset()
    map_rows: dict[str, torch.Tensor] = field(default_factory=dict)
    _padded: _PaddedFeatures | None = field(default=None, init=False, repr=False)
    _padded_rows: dict[str, torch.Tensor] = field(default_factory=dict, init=False, repr=False)

    @property
    def padded(self) -> Mapping[str, torch.Tensor]:
        """Unbatched features in the padded layout (built per feature on first access)."""
        if self._padded is None:
            self._padded = _PaddedFeatures(self)
        return self._padded

    def meta(self, name: str) -> FeatureMeta:
        """The :class:`FeatureMeta` of feature ``name``."""
        for f in self.metas:
            if f.name == name:
                return f
        raise KeyError(name)

    def padded_feature(self, name: str) -> torch.Tensor:
        """One feature in the padded layout (a new tensor unless the layout is the serial one).

        Parameters
        ----------
        name : str
            Feature key.

        Returns
        -------
        torch.Tensor
            The unbatched feature as ``full_tensor()`` holds it.
        """
        spec, source = self.specs[name], self.sources[name]
        if spec.mode == PASSTHROUGH or name in self.laid_out:
            return source
        return self.plan.to_padded(source, spec.axes, spec.pad_value)

    def local_layout(self, coord: Coordinate) -> WireLayout:
        """``(shape, dtype)`` of every feature (sorted by name) in the buffer for ``coord``."""
        return wire_layout(self.metas, self.specs, self.plan, coord)

    def write_wire_rows(self, name: str, coord: Coordinate, out: torch.Tensor) -> None:
        """Write the wire form of map ``name``'s block at ``coord``: int64 ``[local rows]``.

        Entry ``r`` is the block-local column of local row ``r``'s 1, or -1 when the row
        has none inside the block's columns.
        """
        ranges = self.plan.block_ranges(self.specs[name], self.meta(name).padded_shape, coord)
        (row_start, row_stop), (column_start, column_stop) = ranges
        columns = self._padded_map_rows(name)[row_start:row_stop].to(out.device)
        inside = (columns >= column_start) & (columns < column_stop)
        out.copy_(torch.where(inside, columns - column_start, -1))

    def write_block(self, name: str, coord: Coordinate, out: torch.Tensor) -> None:
        """Write the block of feature ``name`` held at domain coordinate ``coord`` into ``out``.

        Equal to ``plan.local_block(spec, self.padded[name], coord)``, but written straight
        from the serial tensor: each run of real positions is copied once, the pad value is
        written only at the positions the plan inserted (:meth:`ShardingPlan.block_runs`).

        Parameters
        ----------
        name : str
            Feature key.
        coord : Coordinate
            Domain coordinate ``(i, j)`` of the rank.
        out : torch.Tensor
            Destination of the block's local shape and the feature's dtype (any device).
        """
        spec, source = self.specs[name], self.sources[name]
        if spec.mode == PASSTHROUGH:
            out.copy_(source)
            return
        if name in self.laid_out:
            out.copy_(self.plan.local_block(spec, source, coord))
            return
        real = []
        for dim, (runs, pads) in enumerate(
            self.plan.block_runs(spec, self.meta(name).padded_shape, coord)
        ):
            real.append(runs)
            if pads:
                fill = torch.full((), spec.pad_value, dtype=out.dtype)
                for offset, length in pads:
                    out.narrow(dim, offset, length).fill_(fill)
        for combo in itertools.product(*real):
            dst, src = out, source
            for dim, (offset, serial_start, length) in enumerate(combo):
                dst = dst.narrow(dim, offset, length)
                src = src.narrow(dim, serial_start, length)
            dst.copy_(src)

    def _padded_map_rows(self, name: str) -> torch.Tensor:
        """``map_rows[name]`` in the padded layout (rows and column values), kept."""
        if name not in self._padded_rows:
            self._padded_rows[name] = pad_map_index(
                self.plan, self.specs[name], self.map_rows[name]
            )
        return self._padded_rows[name]


def pack_rank(
    prepared: PreparedSample,
    coord: Coordinate,
    device: torch.device | None = None,
) -> torch.Tensor:
    """One rank's packed buffer: its block of every feature, written in place.

    Laid out by :func:`wire_layout`: the rank's local block of every padded feature,
    except that a ``wire_rows`` map is its row vector (:meth:`PreparedSample.write_wire_rows`),
    without building the padded layout or any block in between.

    Parameters
    ----------
    prepared : PreparedSample
        From :func:`~physicsnemo_foldcp.sharding.prepare.prepare_sample`.
    coord : Coordinate
        Domain coordinate ``(i, j)`` of the rank.
    device : torch.device, optional
        Device of the buffer (CPU by default).

    Returns
    -------
    torch.Tensor
        uint8 buffer laid out as ``packed_size(prepared.local_layout(coord))``.
    """
    metas = prepared.metas

    def write(index: int, slot: torch.Tensor) -> None:
        if metas[index].wire_rows:
            prepared.write_wire_rows(metas[index].name, coord, slot)
        else:
            prepared.write_block(metas[index].name, coord, slot)

    return pack_into(prepared.local_layout(coord), write, device=device)


def wire_layout(
    metas: Sequence[FeatureMeta],
    specs: Mapping[str, FeatureSpec],
    plan: ShardingPlan,
    coord: Coordinate,
) -> WireLayout:
    """``(shape, dtype)`` of every feature in the buffer sent to the rank at ``coord``.

    The local block's shape (:meth:`ShardingPlan.local_shape`) and dtype, except for a map
    with ``wire_rows``: int64 ``[local rows]``.

    Parameters
    ----------
    metas : Sequence[FeatureMeta]
        The sample's features, in buffer order.
    specs : Mapping[str, FeatureSpec]
        Registry entry of every feature (a :class:`FeatureRegistry` works).
    plan : ShardingPlan
        The sample's plan.
    coord : Coordinate
        Domain coordinate ``(i, j)`` of the receiving rank.
    """
    out: WireLayout = []
    for f in metas:
        shape = plan.local_shape(specs[f.name], f.padded_shape, coord)
        out.append(((shape[0],), torch.int64) if f.wire_rows else (shape, f.dtype))
    return out


def expand_wire_blocks(
    blocks: Sequence[torch.Tensor],
    metas: Sequence[FeatureMeta],
    specs: Mapping[str, FeatureSpec],
    plan: ShardingPlan,
    coord: Coordinate,
) -> list[torch.Tensor]:
    """Local blocks from the buffer's tensors: each ``wire_rows`` map expanded to dense.

    Parameters
    ----------
    blocks : Sequence[torch.Tensor]
        The buffer's tensors, laid out by :func:`wire_layout` (same order as ``metas``).
    metas, specs, plan, coord
        As for :func:`wire_layout`.

    Returns
    -------
    list[torch.Tensor]
        Every feature's local block at ``coord``; an expanded map is a new tensor of the
        map's dtype and local shape (zeros, and a 1 at each listed column).
    """
    out = list(blocks)
    for index, f in enumerate(metas):
        if f.wire_rows:
            shape = plan.local_shape(specs[f.name], f.padded_shape, coord)
            columns = blocks[index]
            dense = torch.zeros(shape, dtype=f.dtype, device=columns.device)
            rows = (columns >= 0).nonzero().flatten()
            dense[rows, columns[rows]] = 1
            out[index] = dense
    return out


__all__ = [
    "FeatureMeta",
    "PreparedSample",
    "WireLayout",
    "expand_wire_blocks",
    "pack_rank",
    "wire_layout",
]
