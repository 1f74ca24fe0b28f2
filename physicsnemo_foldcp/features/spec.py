"""Axis semantics of one feature, and the placement over ``(cp0, cp1)`` derived from them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import Placement, Replicate, Shard

from physicsnemo_foldcp.features.axes import (
    ATOMS,
    AXES,
    ENSEMBLE,
    MSA,
    RSET,
    TEMPLATES,
    TOKENS,
    Axis,
    find_axis,
    registered_axis,
)

OTHER_INDEX_TARGETS: frozenset[str] = frozenset({"chains"})
"""What the VALUES of an index-valued feature may point into besides an axis whose
:attr:`~physicsnemo_foldcp.features.axes.Axis.index_target` is set (chain ids are kept)."""


def index_targets() -> list[str]:
    """Every name ``FeatureSpec.index_of`` accepts, sorted."""
    return sorted({a.name for a in AXES.values() if a.index_target} | OTHER_INDEX_TARGETS)


SHARD = "shard"
"""Mode: sharded over the domain mesh at the placement derived from its axes."""
REPLICATE = "replicate"
"""Mode: a ``Replicate()`` ShardTensor on every rank of the domain group."""
PASSTHROUGH = "passthrough"
"""Mode: a plain tensor, the same on every rank of the domain group."""

MODES: frozenset[str] = frozenset({SHARD, REPLICATE, PASSTHROUGH})

_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "long": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float": torch.float32,
    "float64": torch.float64,
}


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    """``"int64"`` / ``"torch.int64"`` / ``torch.int64`` -> ``torch.int64``."""
    if isinstance(name, torch.dtype):
        return name
    key = str(name).removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[key]


@dataclass(frozen=True)
class FeatureSpec:
    """What each axis of one (unbatched) feature means, and how it is distributed.

    Parameters
    ----------
    name : str
        Feature key, as the featurizer emits it.
    axes : tuple of (str, Axis or None)
        Meaning of every axis of the unbatched feature: the name of one of :data:`AXES` (or
        the :class:`~physicsnemo_foldcp.features.axes.Axis` itself), or ``None`` for channels
        and other free axes. ``("tokens", "tokens", None)`` is a pair feature. Stored as the
        :class:`~physicsnemo_foldcp.features.axes.Axis` objects, which compare equal to
        their names.
    pad_value : bool, int or float, default 0
        Value written at pad positions (per-shard and cross-axis padding).
    dtypes : tuple of torch.dtype, optional
        Accepted dtypes; ``None`` accepts any.
    index_of : str, optional
        The VALUES index this axis (one of :func:`index_targets`): indices into a layout
        axis (atoms, tokens; :attr:`index_axis`) are range-checked and remapped into its
        padded layout and back; ensemble and chain indices are kept.
    one_hot : bool, default False
        The feature is a 0/1 incidence map between its first two axes (atom<->token maps).
    mode : str, default "shard"
        ``"shard"``, ``"replicate"`` or ``"passthrough"`` (see :data:`MODES`).
    description : str
        One line on what the feature is.
    allow_nonfinite : bool, default False
        The feature may hold NaN or infinite values; a feature file holding them in any
        other floating feature is refused
        (:func:`~physicsnemo_foldcp.data.files.validate_sample`).
    """

    name: str
    axes: tuple[Axis | None, ...]
    pad_value: bool | int | float = 0
    dtypes: tuple[torch.dtype, ...] | None = None
    index_of: str | None = None
    one_hot: bool = False
    mode: str = SHARD
    description: str = ""
    allow_nonfinite: bool = False
    _placements: tuple[Placement, Placement] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.dtypes is not None:
            object.__setattr__(self, "dtypes", tuple(dtype_from_name(d) for d in self.dtypes))
        where = f"feature {self.name!r}"
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"feature name must be a non-empty string, got {self.name!r}")
        written = tuple(self.axes)
        axes = tuple(None if a is None else registered_axis(a) for a in written)
        bad_axes = [a for a, axis in zip(written, axes) if a is not None and axis is None]
        if bad_axes:
            raise ValueError(f"{where}: unknown axis meaning(s) {bad_axes}; use {sorted(AXES)}")
        object.__setattr__(self, "axes", axes)
        if self.index_of is not None:
            object.__setattr__(self, "index_of", str(self.index_of))
        if self.mode not in MODES:
            raise ValueError(f"{where}: mode {self.mode!r} is not one of {sorted(MODES)}")
        if self.index_of is not None and self.index_of not in index_targets():
            raise ValueError(f"{where}: index_of={self.index_of!r} is not one of {index_targets()}")
        if self.index_of is not None and self.dtypes is not None:
            floating = [d for d in self.dtypes if d.is_floating_point or d == torch.bool]
            if floating:
                raise ValueError(f"{where}: an index-valued feature cannot have dtype {floating}")
        if self.one_hot and (len(self.axes) != 2 or ATOMS not in self.axes):
            raise ValueError(f"{where}: a one-hot map must have two axes, one of them atoms")
        object.__setattr__(self, "_placements", self._derive_placements())

    def _derive_placements(self) -> tuple[Placement, Placement]:
        """Placement rules over ``(cp0, cp1)`` (design decision 2), asked of the first axis.

        Its :meth:`~physicsnemo_foldcp.features.axes.Axis.lead_placements`: a pair (tokens,
        tokens) or an MSA (msa, tokens) is a tile ``(Shard(0), Shard(1))``; a leading
        tokens, atoms or rset axis is split in row blocks ``(Shard(0), Replicate())``; an
        ensemble or template stack splits its token or atom axis ``(Shard(1), Replicate())``.
        """
        if self.mode != SHARD:
            return (Replicate(), Replicate())
        axes = self.axes
        first = axes[0] if axes else None
        second = axes[1] if len(axes) > 1 else None
        placements = first.lead_placements(second) if first is not None else None
        if placements is not None:
            return placements
        raise ValueError(
            f"feature {self.name!r} with axes {axes} has no sharded placement: a sharded "
            "feature must lead with tokens, atoms or rset (or msa/ensemble/templates "
            "followed by tokens or atoms); declare it mode='replicate' or 'passthrough'"
        )

    @property
    def placements(self) -> tuple[Placement, Placement]:
        """Placements over ``(cp0, cp1)`` of the unbatched feature."""
        return self._placements

    def batched_placements(self, batched: bool) -> tuple[Placement, Placement]:
        """Placements when a leading batch axis of size 1 is present (shard dims + 1)."""
        if not batched:
            return self._placements
        return tuple(  # type: ignore[return-value]
            Shard(p.dim + 1) if isinstance(p, Shard) else p for p in self._placements
        )

    @property
    def sharded_axes(self) -> dict[int, int]:
        """``{mesh_dim: tensor_axis}`` for every mesh dim that shards this feature."""
        return {m: p.dim for m, p in enumerate(self._placements) if isinstance(p, Shard)}

    @property
    def index_axis(self) -> Axis | None:
        """The layout axis its VALUES index (range-checked and remapped), else ``None``."""
        target = find_axis(self.index_of)
        return target if target is not None and target.layout else None

    def axes_of(self, meaning: str | Axis) -> list[int]:
        """Positions of the axes with this meaning."""
        return [i for i, a in enumerate(self.axes) if a == meaning]

    def to_config(self) -> dict[str, Any]:
        """Plain-data form, the inverse of :meth:`from_config`."""
        axes = [None if a is None else a.name for a in self.axes]
        out: dict[str, Any] = {"axes": axes, "pad_value": self.pad_value}
        if self.dtypes is not None:
            out["dtypes"] = [str(d).removeprefix("torch.") for d in self.dtypes]
        for key in ("index_of", "description"):
            if getattr(self, key):
                out[key] = getattr(self, key)
        if self.one_hot:
            out["one_hot"] = True
        if self.mode != SHARD:
            out["mode"] = self.mode
        if self.allow_nonfinite:
            out["allow_nonfinite"] = True
        return out

    @classmethod
    def from_config(cls, name: str, config: Mapping[str, Any]) -> FeatureSpec:
        """Build a spec from plain data (a Hydra/YAML mapping).

        Parameters
        ----------
        name : str
            Feature key.
        config : Mapping
            ``axes`` (list of axis names or null) and optionally ``pad_value``,
            ``dtypes`` (names such as ``"int64"``), ``index_of``, ``one_hot``, ``mode``,
            ``description``, ``allow_nonfinite``.
        """
        known = {
            "axes",
            "pad_value",
            "dtypes",
            "index_of",
            "one_hot",
            "mode",
            "description",
            "allow_nonfinite",
        }
        unknown = set(config) - known
        if unknown:
            raise ValueError(f"feature {name!r}: unknown spec field(s) {sorted(unknown)}")
        if "axes" not in config:
            raise ValueError(f"feature {name!r}: a spec needs 'axes'")
        axes = config["axes"]
        if isinstance(axes, str) or not isinstance(axes, Sequence):
            raise ValueError(f"feature {name!r}: 'axes' must be a list, got {axes!r}")
        dtypes = config.get("dtypes")
        return cls(
            name=name,
            axes=tuple(None if a in (None, "null", "None") else str(a) for a in axes),
            pad_value=config.get("pad_value", 0),
            dtypes=tuple(dtype_from_name(d) for d in dtypes) if dtypes is not None else None,
            index_of=config.get("index_of"),
            one_hot=bool(config.get("one_hot", False)),
            mode=config.get("mode", SHARD),
            description=config.get("description", ""),
            allow_nonfinite=bool(config.get("allow_nonfinite", False)),
        )


__all__ = [
    "ATOMS",
    "AXES",
    "ENSEMBLE",
    "MODES",
    "MSA",
    "OTHER_INDEX_TARGETS",
    "PASSTHROUGH",
    "REPLICATE",
    "RSET",
    "SHARD",
    "TEMPLATES",
    "TOKENS",
    "Axis",
    "FeatureSpec",
    "dtype_from_name",
    "index_targets",
]
