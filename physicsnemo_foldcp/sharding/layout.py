"""Validate one sample's feature dict against the registry and lay it out on the plan.

This is the source rank's half of the scatter, and pure tensor code: no communication.
:func:`prepare_sample` checks the features and builds the :class:`ShardingPlan`; the
:class:`PreparedSample` it returns writes the block of any rank straight from the serial
tensors (:meth:`PreparedSample.write_block`, :func:`pack_rank`), so the padded layout of
the whole sample is never built unless asked for (:attr:`PreparedSample.padded`).
:func:`local_block` / :func:`local_shape` / :func:`sharding_shapes` cut a padded-layout
tensor into the block of one rank.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from physicsnemo_foldcp.features.registry import FeatureRegistry
from physicsnemo_foldcp.features.spec import (
    ATOMS,
    LAYOUT_AXES,
    MSA,
    PASSTHROUGH,
    RSET,
    TOKENS,
    FeatureSpec,
)
from physicsnemo_foldcp.sharding.packing import pack_into
from physicsnemo_foldcp.sharding.plan import (
    FeatureValidationError,
    ShardingPlan,
    atom_tokens_from_map,
    binary_rows,
    build_plan,
    check_map_within_tokens,
)

CHECKED_AXES = (TOKENS, ATOMS, MSA, RSET)
"""Axis meanings whose lengths must agree across features (they are sharded)."""


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

    def local_layout(self, coord: tuple[int, int]) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """``(shape, dtype)`` of every feature (sorted by name) in the buffer for ``coord``."""
        return wire_layout(self.metas, self.specs, self.plan, coord)

    def write_wire_rows(self, name: str, coord: tuple[int, int], out: torch.Tensor) -> None:
        """Write the wire form of map ``name``'s block at ``coord``: int64 ``[local rows]``.

        Entry ``r`` is the block-local column of local row ``r``'s 1, or -1 when the row
        has none inside the block's columns.
        """
        (row_start, row_stop), (column_start, column_stop) = self._block_ranges(name, coord)
        columns = self._padded_map_rows(name)[row_start:row_stop].to(out.device)
        inside = (columns >= column_start) & (columns < column_stop)
        out.copy_(torch.where(inside, columns - column_start, -1))

    def write_block(self, name: str, coord: tuple[int, int], out: torch.Tensor) -> None:
        """Write the block of feature ``name`` held at domain coordinate ``coord`` into ``out``.

        Equal to ``local_block(spec, self.padded[name], plan, coord)``, but written
        straight from the serial tensor: each run of real positions is copied once, the
        pad value is written only at the positions the plan inserted.

        Parameters
        ----------
        name : str
            Feature key.
        coord : tuple[int, int]
            Domain coordinate ``(i, j)`` of the rank.
        out : torch.Tensor
            Destination of the block's local shape and the feature's dtype (any device).
        """
        spec, source = self.specs[name], self.sources[name]
        if spec.mode == PASSTHROUGH:
            out.copy_(source)
            return
        if name in self.laid_out:
            out.copy_(local_block(spec, source, self.plan, coord))
            return
        ranges = self._block_ranges(name, coord)
        real: list[list[tuple[int, int, int]]] = []
        for dim, (axis, (start, stop)) in enumerate(zip(spec.axes, ranges)):
            runs, pads = _layout_runs(self.plan, axis, start, stop)
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

    def _block_ranges(self, name: str, coord: tuple[int, int]) -> list[tuple[int, int]]:
        """``(start, stop)`` in the padded layout of every dim of the block at ``coord``."""
        spec, source = self.specs[name], self.sources[name]
        sharded = {dim: mesh_dim for mesh_dim, dim in spec.sharded_axes.items()}
        ranges = []
        for dim, axis in enumerate(spec.axes):
            if dim in sharded:
                ranges.append(self.plan.block(axis, sharded[dim], coord[sharded[dim]]))
            elif axis in LAYOUT_AXES and self.plan.has_padding(axis):
                ranges.append((0, self.plan.padded_length(axis)))
            else:
                ranges.append((0, int(source.shape[dim])))
        return ranges

    def _padded_map_rows(self, name: str) -> torch.Tensor:
        """``map_rows[name]`` in the padded layout (rows and column values), kept."""
        if name not in self._padded_rows:
            spec = self.specs[name]
            self._padded_rows[name] = _pad_map_index(self.plan, spec, self.map_rows[name])
        return self._padded_rows[name]


def _layout_runs(
    plan: ShardingPlan, axis: str | None, start: int, stop: int
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
    """Real and pad runs of the padded positions ``[start, stop)`` of one axis.

    Returns
    -------
    tuple[list[tuple[int, int, int]], list[tuple[int, int]]]
        ``(local offset, serial start, length)`` of every run of real positions and
        ``(local offset, length)`` of every run of inserted pads, offsets from ``start``.
    """
    if axis not in LAYOUT_AXES or not plan.has_padding(axis):
        return ([(0, start, stop - start)] if stop > start else []), []
    real: list[tuple[int, int, int]] = []
    pads: list[tuple[int, int]] = []
    row_start = 0
    for row, size in enumerate(plan.row_sizes(axis)):
        serial_start, serial_stop = plan.serial_range(axis, row)
        real_stop = row_start + serial_stop - serial_start
        low, high = max(start, row_start), min(stop, real_stop)
        if high > low:
            real.append((low - start, serial_start + low - row_start, high - low))
        low, high = max(start, real_stop), min(stop, row_start + size)
        if high > low:
            pads.append((low - start, high - low))
        row_start += size
    return real, pads


def pack_rank(
    prepared: PreparedSample,
    coord: tuple[int, int],
    device: torch.device | None = None,
) -> torch.Tensor:
    """One rank's packed buffer: its block of every feature, written in place.

    Laid out by :func:`wire_layout`: the rank's ``local_block`` of every padded feature,
    except that a ``wire_rows`` map is its row vector (:meth:`PreparedSample.write_wire_rows`),
    without building the padded layout or any block in between.

    Parameters
    ----------
    prepared : PreparedSample
        From :func:`prepare_sample`.
    coord : tuple[int, int]
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
    coord: tuple[int, int],
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """``(shape, dtype)`` of every feature in the buffer sent to the rank at ``coord``.

    The local block's shape and dtype, except for a map with ``wire_rows``: int64
    ``[local rows]``.

    Parameters
    ----------
    metas : Sequence[FeatureMeta]
        The sample's features, in buffer order.
    specs : Mapping[str, FeatureSpec]
        Registry entry of every feature (a :class:`FeatureRegistry` works).
    plan : ShardingPlan
        The sample's plan.
    coord : tuple[int, int]
        Domain coordinate ``(i, j)`` of the receiving rank.
    """
    out: list[tuple[tuple[int, ...], torch.dtype]] = []
    for f in metas:
        spec = specs[f.name]
        if spec.mode == PASSTHROUGH:
            out.append((f.padded_shape, f.dtype))
            continue
        shape = local_shape(spec, f.padded_shape, plan, coord)
        out.append(((shape[0],), torch.int64) if f.wire_rows else (shape, f.dtype))
    return out


def expand_wire_blocks(
    blocks: Sequence[torch.Tensor],
    metas: Sequence[FeatureMeta],
    specs: Mapping[str, FeatureSpec],
    plan: ShardingPlan,
    coord: tuple[int, int],
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
            shape = local_shape(specs[f.name], f.padded_shape, plan, coord)
            columns = blocks[index]
            dense = torch.zeros(shape, dtype=f.dtype, device=columns.device)
            rows = (columns >= 0).nonzero().flatten()
            dense[rows, columns[rows]] = 1
            out[index] = dense
    return out


MAP_LAYOUTS = ("dense", "index")
"""Layouts of the one-hot atom<->token maps: the serial dense map, or an index vector."""


def dense_map_to_index(dense: torch.Tensor) -> torch.Tensor:
    """``[X, Y]`` one-hot map -> int64 ``[X]``: the column of each row's 1, or -1 for none."""
    rows = binary_rows(dense)
    if rows is not None:
        return torch.where(rows[0] > 0, rows[1], -1)
    nonzero = dense != 0
    return torch.where(nonzero.any(-1), nonzero.to(torch.int8).argmax(-1), -1)


def index_map_to_dense(index: torch.Tensor, columns: int, dtype: torch.dtype) -> torch.Tensor:
    """int64 ``[X]`` index vector (-1: no column) -> ``[X, columns]`` one-hot map."""
    dense = torch.zeros(*index.shape, columns, dtype=dtype, device=index.device)
    rows = (index >= 0).nonzero(as_tuple=True)
    dense[rows + (index[rows],)] = 1
    return dense


def _detect_batch(tensors: Mapping[str, torch.Tensor], registry: FeatureRegistry) -> bool:
    """True when every feature has a leading batch axis of size 1; errors otherwise."""
    batched_names, plain_names = [], []
    for name, t in tensors.items():
        n = len(registry[name].axes)
        if t.ndim == n:
            plain_names.append(name)
        elif t.ndim == n + 1:
            batched_names.append(name)
        else:
            raise FeatureValidationError(
                f"feature {name!r} has shape {tuple(t.shape)}, but its registry axes "
                f"{registry[name].axes} need {n} dims (or {n + 1} with a leading batch of 1)"
            )
    if batched_names and plain_names:
        raise FeatureValidationError(
            "some features carry a batch axis and some do not: e.g. "
            f"{batched_names[0]!r} {tuple(tensors[batched_names[0]].shape)} vs "
            f"{plain_names[0]!r} {tuple(tensors[plain_names[0]].shape)}"
        )
    if batched_names:
        sizes = {int(tensors[n].shape[0]) for n in batched_names}
        if sizes != {1}:
            raise FeatureValidationError(
                f"batch size {max(sizes)} per domain group: a domain group shards ONE sample; "
                "grow the batch over the ddp axis instead (init_mesh(ddp=...), one sample per "
                "domain group per step)"
            )
    return bool(batched_names)


def _check_dtype(spec: FeatureSpec, t: torch.Tensor) -> None:
    if spec.dtypes is not None and t.dtype not in spec.dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in spec.dtypes)
        raise FeatureValidationError(
            f"feature {spec.name!r} has dtype {str(t.dtype).removeprefix('torch.')}; "
            f"the registry accepts {allowed}"
        )
    if spec.index_of is not None and (t.dtype.is_floating_point or t.dtype == torch.bool):
        raise FeatureValidationError(
            f"feature {spec.name!r} holds {spec.index_of} indices and needs an integer dtype, "
            f"got {str(t.dtype).removeprefix('torch.')}"
        )


def _axis_lengths(
    tensors: Mapping[str, torch.Tensor], registry: FeatureRegistry, align: bool
) -> dict[str, int]:
    """One length per sharded axis meaning; raises when features disagree (unless aligning)."""
    seen: dict[str, list[tuple[str, int, int]]] = {}
    for name, t in tensors.items():
        spec = registry[name]
        if spec.mode == PASSTHROUGH:
            continue
        pair = spec.axes_of(TOKENS)
        if not align and len(pair) == 2 and t.shape[pair[0]] != t.shape[pair[1]]:
            raise FeatureValidationError(
                f"pair feature {name!r} is not square: its token axes have lengths "
                f"{t.shape[pair[0]]} and {t.shape[pair[1]]} (shape {tuple(t.shape)})"
            )
        for dim, axis in enumerate(spec.axes):
            if axis in CHECKED_AXES:
                seen.setdefault(axis, []).append((name, dim, int(t.shape[dim])))
    lengths = {}
    for axis, entries in seen.items():
        values = {n for _, _, n in entries}
        if len(values) > 1 and not align:
            groups: dict[int, list[str]] = {}
            for name, dim, n in entries:
                groups.setdefault(n, []).append(f"{name}[axis {dim}]")
            listing = "; ".join(
                f"{n} in {', '.join(names[:4])}"
                + (f" (+{len(names) - 4} more)" if len(names) > 4 else "")
                for n, names in sorted(groups.items(), key=lambda kv: len(kv[1]))
            )
            raise FeatureValidationError(
                f"the {axis} axes of the features have different lengths {sorted(values)}: "
                f"{listing}. Every {axis} axis must have one length: pad them in the "
                "featurizer, or pass align_lengths=True to pad each to the longest"
            )
        lengths[axis] = max(values)
    return lengths


def _align(t: torch.Tensor, spec: FeatureSpec, lengths: Mapping[str, int]) -> torch.Tensor:
    """Pad every checked axis of ``t`` at its end to the common length."""
    for dim, axis in enumerate(spec.axes):
        if axis in lengths and t.shape[dim] < lengths[axis]:
            shape = list(t.shape)
            shape[dim] = lengths[axis] - t.shape[dim]
            t = torch.cat([t, torch.full(shape, spec.pad_value, dtype=t.dtype)], dim=dim)
    return t


def _find_map(registry: FeatureRegistry, names, axes: tuple[str, str]) -> str | None:
    for name in sorted(names):
        spec = registry[name]
        if spec.one_hot and spec.axes == axes:
            return name
    return None


def _check_index_range(name: str, t: torch.Tensor, target: str, length: int) -> None:
    if t.numel() == 0:
        return
    low, high = (int(v) for v in torch.aminmax(t))
    if low < 0 or high >= length:
        bad = low if low < 0 else high
        raise FeatureValidationError(
            f"feature {name!r} holds {target} indices, but value {bad} is out of range "
            f"[0, {length}) for the sample's {length} {target}"
        )


def prepare_sample(
    features: Mapping[str, Any] | None,
    registry: FeatureRegistry,
    cp: tuple[int, int],
    *,
    token_multiple: int = 1,
    atom_multiple: int = 1,
    align_lengths: bool = False,
    token_bounds: tuple[int, ...] | None = None,
    map_layout: str = "dense",
) -> PreparedSample:
    """Validate a serial sample and plan the layout of every feature.

    Each dense map is scanned once for validation (a few reductions, no copies of it);
    no feature is copied into the padded layout here: the blocks are written from the
    serial tensors when packed (:meth:`PreparedSample.write_block`).

    Parameters
    ----------
    features : Mapping[str, Any]
        One sample: tensors unbatched or with a leading batch axis of 1, plus any
        non-tensor values (passed through).
    registry : FeatureRegistry
        Axis meanings of every tensor feature.
    cp : tuple[int, int]
        ``(cp0, cp1)``.
    token_multiple, atom_multiple : int, default 1
        Per-shard padding multiples.
    align_lengths : bool, default False
        Pad every tokens/atoms/msa/rset axis to the longest of its meaning instead of
        raising when they differ.
    token_bounds : tuple[int, ...], optional
        Explicit row-block token boundaries (see :func:`build_plan`).
    map_layout : {"dense", "index"}, default "dense"
        ``"index"`` sends every one-hot map as an int64 vector over its first axis
        (:func:`dense_map_to_index`, global positions in the padded layout).

    Returns
    -------
    PreparedSample
        The plan, metadata and sources; ``padded`` builds the padded layout on access.

    Raises
    ------
    FeatureValidationError
        With a message naming the feature, axis, shape or value at fault.
    UnknownFeatureError
        For tensor keys the registry lacks.
    """
    if map_layout not in MAP_LAYOUTS:
        raise ValueError(f"map_layout must be one of {MAP_LAYOUTS}, got {map_layout!r}")
    if features is None:
        raise FeatureValidationError(
            "the source rank of the domain group passed features=None: the source must pass "
            "the sample's feature dict (other ranks pass None)"
        )
    if not isinstance(features, Mapping):
        raise FeatureValidationError(
            f"features must be a mapping of name -> tensor, got {type(features).__name__}"
        )
    tensors = {k: v for k, v in features.items() if isinstance(v, torch.Tensor)}
    values = {k: v for k, v in features.items() if not isinstance(v, torch.Tensor)}
    if not tensors:
        raise FeatureValidationError("the feature dict holds no tensors")
    registry.check_keys(tensors)
    batched = _detect_batch(tensors, registry)
    if batched:
        tensors = {k: v[0] for k, v in tensors.items()}
    for name, t in tensors.items():
        _check_dtype(registry[name], t)
    lengths = _axis_lengths(tensors, registry, align_lengths)
    serial_shapes = {k: tuple(int(s) for s in v.shape) for k, v in tensors.items()}
    if align_lengths:
        tensors = {k: _align(v, registry[k], lengths) for k, v in tensors.items()}
    if TOKENS not in lengths:
        raise FeatureValidationError(
            "the sample has no sharded feature with a token axis; nothing to plan from"
        )

    map_index: dict[str, torch.Tensor] = {}
    atom_tokens = None
    if ATOMS in lengths:
        map_name = _find_map(registry, tensors, (ATOMS, TOKENS))
        if map_name is None:
            raise FeatureValidationError(
                "the sample has atom features but no one-hot (atoms, tokens) map such as "
                "atom_to_token to place its atoms with their tokens"
            )
        pad_mask = tensors.get("atom_pad_mask")
        try:
            atom_tokens = atom_tokens_from_map(tensors[map_name], pad_mask)
        except FeatureValidationError as err:
            raise FeatureValidationError(str(err).replace("atom_to_token", map_name)) from None
        map_index[map_name] = atom_tokens
    rset_name = _find_map(registry, tensors, (RSET, ATOMS))
    plan = build_plan(
        lengths,
        cp,
        atom_tokens=atom_tokens,
        rset_bounds_from=(rset_name, tensors[rset_name]) if rset_name else None,
        token_multiple=token_multiple,
        atom_multiple=atom_multiple,
        token_bounds=token_bounds,
    )
    if atom_tokens is not None:
        for name in sorted(tensors):
            spec = registry[name]
            if spec.one_hot and spec.axes == (TOKENS, ATOMS):
                map_index[name] = check_map_within_tokens(name, tensors[name], atom_tokens)

    sources: dict[str, torch.Tensor] = {}
    laid_out: set[str] = set()
    map_rows: dict[str, torch.Tensor] = {}
    metas: list[FeatureMeta] = []
    for name in sorted(tensors):
        spec, t = registry[name], tensors[name]
        if spec.index_of in (ATOMS, TOKENS):
            if spec.index_of not in lengths:
                raise FeatureValidationError(
                    f"feature {name!r} holds {spec.index_of} indices but the sample has no "
                    f"{spec.index_of} axis"
                )
            _check_index_range(name, t, spec.index_of, lengths[spec.index_of])
            t = plan.remap_index_values(t, spec.index_of)
        compact_of = None
        if spec.one_hot and map_layout == "index":
            compact_of, t = t.dtype, _padded_index_map(plan, spec, t, map_index.get(name))
            laid_out.add(name)
            padded_shape = tuple(int(n) for n in t.shape)
        else:
            padded_shape = _padded_shape(plan, spec, t.shape)
            if (
                spec.one_hot
                and spec.mode != PASSTHROUGH
                and spec.pad_value == 0
                and not (t.dtype.is_floating_point or t.dtype.is_complex)
                and t.numel()
            ):
                # Validated maps are exact 0/1 with one 1 per row at most: reuse their index.
                rows = map_index[name] if name in map_index else _exact_map_rows(t)
                if rows is not None:
                    map_rows[name] = rows
        sources[name] = t
        metas.append(
            FeatureMeta(
                name, t.dtype, serial_shapes[name], padded_shape, compact_of, name in map_rows
            )
        )
    specs = {name: registry[name] for name in sources}
    return PreparedSample(
        plan, metas, sources, specs, values, batched, frozenset(laid_out), map_rows
    )


def _padded_shape(
    plan: ShardingPlan, spec: FeatureSpec, shape: tuple[int, ...] | torch.Size
) -> tuple[int, ...]:
    """Shape of a serial-layout feature in the padded layout (what ``to_padded`` gives)."""
    if spec.mode == PASSTHROUGH:
        return tuple(int(n) for n in shape)
    return tuple(
        plan.padded_length(axis) if axis in LAYOUT_AXES and plan.has_padding(axis) else int(n)
        for axis, n in zip(spec.axes, shape)
    )


def _padded_index_map(
    plan: ShardingPlan, spec: FeatureSpec, dense: torch.Tensor, index: torch.Tensor | None
) -> torch.Tensor:
    """``dense_map_to_index`` of a one-hot map in the padded layout, from the serial map.

    Parameters
    ----------
    plan : ShardingPlan
        The sample's plan.
    spec : FeatureSpec
        The map's registry entry.
    dense : torch.Tensor
        ``[X, Y]`` map in the serial layout.
    index : torch.Tensor or None
        ``dense_map_to_index(dense)`` when validation already computed it.

    Returns
    -------
    torch.Tensor
        int64 ``[X padded]``: padded-layout column of each padded row's 1, -1 for none.
    """
    if spec.mode == PASSTHROUGH:
        return index if index is not None else dense_map_to_index(dense)
    if spec.pad_value != 0:
        return dense_map_to_index(plan.to_padded(dense, spec.axes, spec.pad_value))
    return _pad_map_index(plan, spec, index if index is not None else dense_map_to_index(dense))


def _pad_map_index(plan: ShardingPlan, spec: FeatureSpec, index: torch.Tensor) -> torch.Tensor:
    """Serial index vector of a one-hot map (pad value 0) -> that of its padded layout."""
    rows_axis, columns_axis = spec.axes
    if columns_axis in LAYOUT_AXES and plan.has_padding(columns_axis):
        positions = plan.positions(columns_axis).to(index.device)
        index = torch.where(index >= 0, positions[index.clamp(min=0)], -1)
    if rows_axis in LAYOUT_AXES and plan.has_padding(rows_axis):
        index = plan.to_padded(index, (rows_axis,), -1)
    return index


def _exact_map_rows(t: torch.Tensor) -> torch.Tensor | None:
    """Index vector of a map of exact 0s and 1s with at most one 1 per row; else ``None``."""
    rows = binary_rows(t)
    if rows is None or bool((rows[0] > 1).any()):
        return None
    return torch.where(rows[0] > 0, rows[1], -1)


def local_shape(
    spec: FeatureSpec, padded_shape: tuple[int, ...], plan: ShardingPlan, coord: tuple[int, int]
) -> tuple[int, ...]:
    """Unbatched local shape of a feature on the rank at domain coordinate ``coord``."""
    shape = list(padded_shape)
    for mesh_dim, dim in spec.sharded_axes.items():
        shape[dim] = plan.sizes(spec.axes[dim], mesh_dim)[coord[mesh_dim]]
    return tuple(shape)


def local_block(
    spec: FeatureSpec, padded: torch.Tensor, plan: ShardingPlan, coord: tuple[int, int]
) -> torch.Tensor:
    """The block of an unbatched padded-layout feature held at domain coordinate ``coord``."""
    out = padded
    for mesh_dim, dim in spec.sharded_axes.items():
        start, stop = plan.block(spec.axes[dim], mesh_dim, coord[mesh_dim])
        out = out.narrow(dim, start, stop - start)
    return out


def sharding_shapes(
    spec: FeatureSpec,
    padded_shape: tuple[int, ...],
    plan: ShardingPlan,
    coord: tuple[int, int],
    batched: bool,
) -> dict[int, list[tuple[int, ...]]]:
    """``ShardTensor.from_local`` shapes: ``{mesh_dim: [local shape of rank r on it]}``.

    Entry ``r`` of mesh dim ``m`` is the local shape of the rank at coordinate ``r`` on
    ``m`` and at this rank's coordinate on the other mesh dim.
    """
    prefix = (1,) if batched else ()
    out: dict[int, list[tuple[int, ...]]] = {}
    for mesh_dim in spec.sharded_axes:
        shapes = []
        for r in range(plan.cp[mesh_dim]):
            other = list(coord)
            other[mesh_dim] = r
            shapes.append(prefix + local_shape(spec, padded_shape, plan, tuple(other)))
        out[mesh_dim] = shapes
    return out
