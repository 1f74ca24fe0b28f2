"""Build a run's pieces from its (Hydra) configuration: settings, dataset, model, options.

The functions take plain mappings (``OmegaConf.to_container`` of the Hydra config), so
they are used the same way by ``examples/train.py``, ``examples/predict.py`` and tests.
The groups are those of ``conf/``: ``mesh``, ``data``, ``model``, ``optimizer``,
``train`` (and ``predict``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from physicsnemo_foldcp.data.datasets import BatchedFiles, SyntheticComplexes
from physicsnemo_foldcp.models.reference import ModelConfig, ReferenceFoldModel
from physicsnemo_foldcp.training.loop import BatchSizeError, OptimizerSettings, TrainSettings

DATA_KINDS = ("synthetic", "files")
"""Values of ``data.kind``."""

_LOADER_KEYS = ("token_multiple", "atom_multiple", "num_workers")


def _known(section: str, values: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(values) - set(allowed))
    if unknown:
        raise ValueError(f"unknown {section} option(s) {unknown}; known: {sorted(allowed)}")


def check_data_batch(data: Mapping[str, Any]) -> None:
    """Raise :class:`BatchSizeError` unless ``data.batch_size`` is 1 (or absent)."""
    size = data.get("batch_size", 1)
    if size != 1:
        raise BatchSizeError(
            f"per-domain-group batch size must be 1, got data.batch_size={size}: each domain "
            "group trains on one complex per step; grow the global batch over the ddp mesh "
            "axis (mesh.ddp) instead"
        )


def build_dataset(data: Mapping[str, Any]) -> SyntheticComplexes | BatchedFiles:
    """The serial, batched dataset of a ``data`` config group.

    Parameters
    ----------
    data : Mapping[str, Any]
        ``kind: synthetic`` with ``n_samples``, ``min_tokens``, ``max_tokens``, ``seed``,
        ``preset``, ``msa_rows``, ``n_conformers``; or ``kind: files`` with ``path`` (a
        directory or file of samples) and ``validate``. Loader options (``batch_size``,
        ``token_multiple``, ``atom_multiple``, ``map_layout``, ``num_workers``,
        ``balance``) may sit alongside.

    Raises
    ------
    BatchSizeError
        When ``batch_size`` is not 1.
    ValueError
        For an unknown ``kind`` or option.
    """
    check_data_batch(data)
    kind = data.get("kind", "synthetic")
    loader_keys = ("kind", "batch_size", "map_layout", "balance", *_LOADER_KEYS)
    if kind == "synthetic":
        keys = ("n_samples", "min_tokens", "max_tokens", "seed", "preset", "msa_rows")
        _known("data", data, (*loader_keys, *keys, "n_conformers"))
        return SyntheticComplexes(
            int(data.get("n_samples", 16)),
            int(data.get("min_tokens", 16)),
            int(data.get("max_tokens", 32)),
            seed=int(data.get("seed", 0)),
            preset=str(data.get("preset", "boltz2")),
            msa_rows=int(data.get("msa_rows", 4)),
            n_conformers=int(data.get("n_conformers", 1)),
        )
    if kind == "files":
        _known("data", data, (*loader_keys, "path", "validate"))
        if not data.get("path"):
            raise ValueError("data.kind=files needs data.path (a directory or file of samples)")
        return BatchedFiles(str(data["path"]), validate=bool(data.get("validate", True)))
    raise ValueError(f"data.kind must be one of {DATA_KINDS}, got {kind!r}")


def loader_options(data: Mapping[str, Any]) -> dict[str, Any]:
    """:class:`~physicsnemo_foldcp.data.ShardedLoader` arguments of a ``data`` group."""
    out: dict[str, Any] = {k: int(data[k]) for k in _LOADER_KEYS if k in data}
    if "map_layout" in data:
        out["scatter_options"] = {"map_layout": str(data["map_layout"])}
    if data.get("balance") is not None:
        balance = dict(data["balance"])
        _known("data.balance", balance, ("mode", "pair_weight", "atom_weight"))
        out["balance"] = str(balance.get("mode", "even"))
        out["pair_weight"] = float(balance.get("pair_weight", 0.0))
        out["atom_weight"] = float(balance.get("atom_weight", 1.0))
    return out


def train_settings(
    train: Mapping[str, Any], data: Mapping[str, Any] | None = None
) -> TrainSettings:
    """:class:`TrainSettings` of a ``train`` group, checked (and ``data.batch_size``)."""
    values = dict(train)
    allowed = tuple(TrainSettings.__dataclass_fields__)
    _known("train", values, allowed)
    if data is not None:
        check_data_batch(data)
    settings = TrainSettings(**values)
    settings.check()
    return settings


def optimizer_settings(optimizer: Mapping[str, Any]) -> OptimizerSettings:
    """:class:`OptimizerSettings` of an ``optimizer`` group."""
    values = dict(optimizer)
    _known("optimizer", values, tuple(OptimizerSettings.__dataclass_fields__))
    if "betas" in values:
        values["betas"] = tuple(float(b) for b in values["betas"])
    return OptimizerSettings(**values)


def build_model(model: Mapping[str, Any], seed: int) -> ReferenceFoldModel:
    """The reference model of a ``model`` group, initialised from ``seed`` (same on every rank)."""
    values = dict(model)
    _known("model", values, tuple(ModelConfig.__dataclass_fields__))
    torch.manual_seed(seed)
    return ReferenceFoldModel(ModelConfig(**values))


__all__ = [
    "DATA_KINDS",
    "build_dataset",
    "build_model",
    "check_data_batch",
    "loader_options",
    "optimizer_settings",
    "train_settings",
]
