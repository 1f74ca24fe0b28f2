"""The feature registry: the single source of truth for axes, placements and padding."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from physicsnemo_foldcp.features.axes import Axis, axis_of
from physicsnemo_foldcp.features.spec import FeatureSpec


class UnknownFeatureError(KeyError):
    """A feature key that the registry does not describe."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown feature"


class FeatureRegistry:
    """Name -> :class:`FeatureSpec` for every feature a featurizer may emit.

    A registry validates itself at construction (and on every change): names are
    unique, every sharded feature has a placement, one-hot maps connect atoms to
    another layout axis. Every rank of a job must use an equal registry; the
    :attr:`fingerprint` lets the scatter check that.

    Parameters
    ----------
    specs : iterable of FeatureSpec
        The features.
    name : str
        Label used in messages (e.g. ``"boltz2"``).

    Examples
    --------
    >>> reg = FeatureRegistry.preset("boltz2")
    >>> reg.register(FeatureSpec("my_token_feat", axes=("tokens", None)))
    >>> reg["my_token_feat"].placements
    (Shard(dim=0), Replicate())
    """

    def __init__(self, specs: Iterable[FeatureSpec] = (), name: str = "custom"):
        self.name = name
        self._specs: dict[str, FeatureSpec] = {}
        for spec in specs:
            self.register(spec)

    # -- construction -------------------------------------------------------------------

    @classmethod
    def preset(cls, name: str) -> FeatureRegistry:
        """A fresh copy of a built-in preset: ``"boltz1"`` or ``"boltz2"``."""
        from physicsnemo_foldcp.features import boltz

        presets = {"boltz1": boltz.boltz1_specs, "boltz2": boltz.boltz2_specs}
        if name not in presets:
            raise ValueError(f"unknown registry preset {name!r}; choose one of {sorted(presets)}")
        return cls(presets[name](), name=name)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> FeatureRegistry:
        """Build a registry from plain data, e.g. a Hydra node.

        Parameters
        ----------
        config : Mapping
            ``preset`` (optional, a preset name to start from), ``features`` (optional,
            ``{name: spec fields}``, see :meth:`FeatureSpec.from_config`; a name already
            in the preset replaces it) and ``remove`` (optional list of names to drop).
        """
        unknown = set(config) - {"preset", "features", "remove"}
        if unknown:
            raise ValueError(f"registry config: unknown key(s) {sorted(unknown)}")
        preset = config.get("preset")
        registry = cls.preset(preset) if preset else cls(name="custom")
        for name in config.get("remove") or ():
            registry.unregister(name)
        for name, fields in (config.get("features") or {}).items():
            registry.register(FeatureSpec.from_config(str(name), fields), replace=True)
        return registry

    def register(self, spec: FeatureSpec, *, replace: bool = False) -> None:
        """Add a feature; ``replace=True`` overrides an existing one of the same name."""
        if not isinstance(spec, FeatureSpec):
            raise TypeError(f"register() takes a FeatureSpec, got {type(spec).__name__}")
        if spec.name in self._specs and not replace:
            raise ValueError(
                f"feature {spec.name!r} is already registered in {self.name!r}; "
                "pass replace=True to override it"
            )
        self._specs[spec.name] = spec

    def unregister(self, name: str) -> None:
        """Remove a feature."""
        if name not in self._specs:
            raise UnknownFeatureError(f"feature {name!r} is not registered in {self.name!r}")
        del self._specs[name]

    def copy(self) -> FeatureRegistry:
        """An independent copy (specs are immutable and shared)."""
        return FeatureRegistry(self._specs.values(), name=self.name)

    # -- lookup -------------------------------------------------------------------------

    def __getitem__(self, name: str) -> FeatureSpec:
        try:
            return self._specs[name]
        except KeyError:
            raise UnknownFeatureError(self._unknown_message([name])) from None

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._specs))

    def __len__(self) -> int:
        return len(self._specs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FeatureRegistry) and self.fingerprint == other.fingerprint

    def __repr__(self) -> str:
        return f"FeatureRegistry({self.name!r}, {len(self)} features)"

    def specs(self) -> list[FeatureSpec]:
        """Every spec, sorted by name."""
        return [self._specs[k] for k in sorted(self._specs)]

    def _unknown_message(self, names: Iterable[str]) -> str:
        names = sorted(names)
        return (
            f"feature(s) {names} are not in the {self.name!r} registry. Register each one "
            "with its axis meanings, e.g. registry.register(FeatureSpec("
            f"{names[0]!r}, axes=('tokens', None))), or in the Hydra config under "
            "registry.features; declare mode='replicate' or 'passthrough' for a feature "
            "that must not be sharded"
        )

    def check_keys(self, keys: Iterable[str]) -> None:
        """Raise :class:`UnknownFeatureError` naming every key the registry lacks."""
        unknown = [k for k in keys if k not in self._specs]
        if unknown:
            raise UnknownFeatureError(self._unknown_message(unknown))

    @property
    def fingerprint(self) -> str:
        """Hash of every spec; equal registries have equal fingerprints on every rank."""
        payload = json.dumps(
            {name: self._specs[name].to_config() for name in sorted(self._specs)},
            sort_keys=True,
            default=str,
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def to_config(self) -> dict[str, Any]:
        """Plain-data form (``{"features": {name: fields}}``), for YAML or Hydra."""
        return {"features": {s.name: s.to_config() for s in self.specs()}}

    def table(self) -> str:
        """The feature -> axes -> placement table, one line per feature."""
        rows = [f"{'feature':<28} {'axes':<34} {'placement (cp0, cp1)':<26} notes"]
        for s in self.specs():
            axes = "[" + ", ".join(a.name if a is not None else "-" for a in s.axes) + "]"
            placement = ", ".join(
                type(p).__name__ + (f"({p.dim})" if hasattr(p, "dim") else "") for p in s.placements
            )
            notes = [s.mode] if s.mode != "shard" else []
            if s.index_of:
                notes.append(f"values index {s.index_of}")
            if s.one_hot:
                notes.append("one-hot map")
            rows.append(f"{s.name:<28} {axes:<34} {placement:<26} {', '.join(notes)}")
        return "\n".join(rows)

    def uses_layout(self, names: Iterable[str]) -> set[Axis]:
        """Layout axes (tokens, atoms, rset) that the named features carry or index.

        With every axis whose row blocks those follow (atoms follow their tokens).
        """
        used: set[Axis] = set()
        for name in names:
            spec = self[name]
            used.update(a for a in spec.axes if a is not None and a.layout)
            if spec.index_axis is not None:
                used.add(spec.index_axis)
        pending = list(used)
        while pending:
            follows = pending.pop().follows
            if follows is not None and follows not in used:
                used.add(axis_of(follows))
                pending.append(axis_of(follows))
        return used
