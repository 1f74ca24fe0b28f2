"""Validate one sample's feature dict against the registry and lay it out on the plan.

This is the source rank's half of the scatter, and pure tensor code: no communication.
:func:`prepare_sample` checks the features, builds the :class:`ShardingPlan`, and returns
every feature in the padded layout; :func:`local_block` / :func:`local_shape` /
:func:`sharding_shapes` cut that layout into the block of one rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from physicsnemo_foldcp.features.registry import FeatureRegistry
from physicsnemo_foldcp.features.spec import (
    ATOMS,
    MSA,
    PASSTHROUGH,
    RSET,
    TOKENS,
    FeatureSpec,
)
from physicsnemo_foldcp.plan import (
    FeatureValidationError,
    ShardingPlan,
    atom_tokens_from_map,
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
    """

    name: str
    dtype: torch.dtype
    serial_shape: tuple[int, ...]
    padded_shape: tuple[int, ...]
    compact_of: torch.dtype | None = None


@dataclass
class PreparedSample:
    """A validated sample in the padded layout (source rank only).

    Attributes
    ----------
    plan : ShardingPlan
        Blocks per rank.
    metas : list[FeatureMeta]
        One per tensor feature, sorted by name.
    padded : dict[str, torch.Tensor]
        Unbatched features in the padded layout (index values remapped).
    values : dict[str, Any]
        Non-tensor entries, passed through unchanged.
    batched : bool
        Whether the features carried a leading batch axis of 1.
    """

    plan: ShardingPlan
    metas: list[FeatureMeta]
    padded: dict[str, torch.Tensor]
    values: dict[str, Any] = field(default_factory=dict)
    batched: bool = False


MAP_LAYOUTS = ("dense", "index")
"""Layouts of the one-hot atom<->token maps: the serial dense map, or an index vector."""


def dense_map_to_index(dense: torch.Tensor) -> torch.Tensor:
    """``[X, Y]`` one-hot map -> int64 ``[X]``: the column of each row's 1, or -1 for none."""
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
    low, high = int(t.min()), int(t.max())
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
    """Validate a serial sample and lay out every feature on its sharding plan.

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
                check_map_within_tokens(name, tensors[name], atom_tokens)

    padded: dict[str, torch.Tensor] = {}
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
        if spec.mode != PASSTHROUGH:
            t = plan.to_padded(t, spec.axes, spec.pad_value)
        compact_of = None
        if spec.one_hot and map_layout == "index":
            compact_of, t = t.dtype, dense_map_to_index(t)
        padded[name] = t
        metas.append(FeatureMeta(name, t.dtype, serial_shapes[name], tuple(t.shape), compact_of))
    return PreparedSample(plan, metas, padded, values, batched)


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
