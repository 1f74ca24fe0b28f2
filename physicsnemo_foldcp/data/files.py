"""Feature dicts on disk: one sample per ``.pt`` or ``.npz`` file, validated against a registry.

A user gets such files by dumping a Boltz featurizer's output for each record, e.g.
``save_sample(featurizer.process(...), out_dir / f"{record.id}.pt")``. :class:`FeatureFileDataset`
reads them back as a map-style dataset, the serial dataset that
:class:`~physicsnemo_foldcp.data.loader.ShardedLoader` wraps.

* ``.pt``: ``torch.save`` of the dict (tensors and plain Python values such as a record id
  string); read with ``weights_only=True`` by default.
* ``.npz``: one numpy array per tensor, dtypes kept (``bool`` included; ``bfloat16`` has no
  numpy dtype and must go to ``.pt``); string values are stored as 0-d unicode arrays and
  come back as ``str``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from physicsnemo_foldcp.features.registry import FeatureRegistry, UnknownFeatureError
from physicsnemo_foldcp.sharding.prepare import prepare_sample
from physicsnemo_foldcp.sharding.validation import FeatureValidationError

SAMPLE_SUFFIXES = (".pt", ".npz")
"""File suffixes that hold one sample each."""

PathLike = str | os.PathLike


class FeatureFileError(FeatureValidationError):
    """A sample file that cannot be read or does not match the registry; names the file."""


def _suffix(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in SAMPLE_SUFFIXES:
        raise FeatureFileError(
            f"{path}: unsupported sample file suffix {path.suffix!r}; use one of "
            f"{', '.join(SAMPLE_SUFFIXES)}"
        )
    return suffix


def _to_numpy(name: str, value: Any, path: Path) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bfloat16 or value.is_complex():
            raise FeatureFileError(
                f"{path}: feature {name!r} has dtype {value.dtype}, which .npz cannot hold; "
                "save the sample as .pt"
            )
        return value.detach().cpu().contiguous().numpy()
    if isinstance(value, str):
        return np.array(value)
    raise FeatureFileError(
        f"{path}: entry {name!r} is a {type(value).__name__}; an .npz sample holds tensors "
        "and strings only (save it as .pt to keep other Python values)"
    )


def save_sample(features: Mapping[str, Any], path: PathLike) -> Path:
    """Write one sample's feature dict to ``path`` (``.pt`` or ``.npz`` by suffix).

    Parameters
    ----------
    features : Mapping[str, Any]
        Feature name -> tensor (any shape and dtype), plus plain values (a record id string;
        for ``.pt`` any value ``torch.load(weights_only=True)`` can read back).
    path : str or os.PathLike
        Destination; its parent directory is created if needed.

    Returns
    -------
    pathlib.Path
        The written file.

    Raises
    ------
    FeatureFileError
        For an unsupported suffix, or a value the format cannot hold (named).
    """
    path = Path(path)
    suffix = _suffix(path)
    if not isinstance(features, Mapping):
        raise FeatureFileError(f"{path}: a sample is a mapping, got {type(features).__name__}")
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".pt":
        torch.save(
            {
                k: v.detach().cpu() if isinstance(v, torch.Tensor) else v
                for k, v in features.items()
            },
            path,
        )
        return path
    arrays = {str(k): _to_numpy(str(k), v, path) for k, v in features.items()}
    with open(path, "wb") as handle:
        np.savez(handle, **arrays)
    return path


def _from_numpy(array: np.ndarray) -> Any:
    if array.dtype.kind in "US" and array.ndim == 0:
        return str(array.item())
    if array.dtype.kind in "USO":
        raise TypeError(f"array of dtype {array.dtype} is not a tensor feature")
    return torch.from_numpy(np.array(array, copy=True))


def validate_sample(
    features: Mapping[str, Any], registry: FeatureRegistry, *, source: str = "sample"
) -> None:
    """Check a serial sample against ``registry`` (keys, dtypes, axis lengths, index ranges).

    Parameters
    ----------
    features : Mapping[str, Any]
        The sample, unbatched or with a leading batch axis of 1.
    registry : FeatureRegistry
        Axis meanings of every feature.
    source : str
        Where the sample came from (a file name), put first in the error message.

    Raises
    ------
    FeatureFileError
        Naming ``source`` and the feature, axis, shape or value at fault.
    """
    try:
        prepare_sample(features, registry, (1, 1))
    except (FeatureValidationError, UnknownFeatureError) as err:
        raise FeatureFileError(f"{source}: {err}") from err


def load_sample(
    path: PathLike,
    registry: FeatureRegistry | None = None,
    *,
    weights_only: bool = True,
) -> dict[str, Any]:
    """Read one sample written by :func:`save_sample` (or by ``torch.save`` / ``np.savez``).

    Parameters
    ----------
    path : str or os.PathLike
        A ``.pt`` or ``.npz`` file.
    registry : FeatureRegistry, optional
        When given, the sample is validated against it (see :func:`validate_sample`).
    weights_only : bool, default True
        Passed to ``torch.load`` for ``.pt`` files: only tensors and plain containers and
        values are unpickled. ``False`` allows arbitrary objects (trusted files only).

    Returns
    -------
    dict[str, Any]
        Feature name -> CPU tensor with the stored dtype and shape, plus stored strings /
        plain values.

    Raises
    ------
    FeatureFileError
        When the file is missing, unreadable, not a dict, or (with ``registry``) invalid;
        the message names the file and, for validation errors, the feature.
    """
    path = Path(path)
    suffix = _suffix(path)
    if not path.is_file():
        raise FeatureFileError(f"{path}: no such sample file")
    try:
        if suffix == ".pt":
            loaded = torch.load(path, map_location="cpu", weights_only=weights_only)
            if not isinstance(loaded, Mapping):
                raise FeatureFileError(
                    f"{path}: holds a {type(loaded).__name__}, not a dict of features"
                )
            sample = dict(loaded)
        else:
            sample = {}
            with np.load(path, allow_pickle=False) as archive:
                for name in archive.files:
                    try:
                        sample[name] = _from_numpy(archive[name])
                    except TypeError as err:
                        raise FeatureFileError(f"{path}: entry {name!r}: {err}") from err
    except FeatureFileError:
        raise
    except Exception as err:  # noqa: BLE001 - any reader failure names the file
        raise FeatureFileError(
            f"{path}: cannot read the sample ({type(err).__name__}: {err})"
        ) from err
    if registry is not None:
        validate_sample(sample, registry, source=str(path))
    return sample


def list_sample_files(source: PathLike | Iterable[PathLike]) -> list[Path]:
    """The sample files of a directory (sorted by name) or of an explicit list (in order).

    Parameters
    ----------
    source : path or iterable of paths
        A directory, whose ``.pt`` / ``.npz`` files are taken (not recursive), or a list of
        files.

    Returns
    -------
    list[pathlib.Path]

    Raises
    ------
    FeatureFileError
        When the directory holds no sample file, a listed file is missing, or a listed file
        has another suffix.
    """
    if isinstance(source, (str, os.PathLike)):
        root = Path(source)
        if root.is_dir():
            files = sorted(
                (p for p in root.iterdir() if p.is_file() and p.suffix.lower() in SAMPLE_SUFFIXES),
                key=lambda p: p.name,
            )
            if not files:
                raise FeatureFileError(
                    f"{root}: directory holds no sample file ({', '.join(SAMPLE_SUFFIXES)})"
                )
            return files
        paths = [root]
    else:
        paths = [Path(p) for p in source]
    if not paths:
        raise FeatureFileError("the list of sample files is empty")
    for path in paths:
        _suffix(path)
        if not path.is_file():
            raise FeatureFileError(f"{path}: no such sample file")
    return paths


class FeatureFileDataset(Dataset):
    """Map-style dataset of feature dicts stored one per file.

    Parameters
    ----------
    source : path or sequence of paths
        A directory of ``.pt`` / ``.npz`` files (sorted by file name) or a list of files.
    registry : FeatureRegistry, optional
        Validate each sample on load against it (the Boltz-2 preset by default); pass
        ``validate=False`` to skip.
    validate : bool, default True
        Whether to validate each sample as it is loaded.
    record_key : str or None, default "record_id"
        When the stored dict lacks this key, it is set to the file's stem, so the sample
        carries its record id through the scatter. ``None`` leaves samples as stored.
    weights_only : bool, default True
        See :func:`load_sample`.

    Examples
    --------
    >>> ds = FeatureFileDataset("features/")  # doctest: +SKIP
    >>> loader = ShardedLoader(ds, mesh, mode="inference")  # doctest: +SKIP
    """

    def __init__(
        self,
        source: PathLike | Sequence[PathLike],
        registry: FeatureRegistry | None = None,
        *,
        validate: bool = True,
        record_key: str | None = "record_id",
        weights_only: bool = True,
    ):
        self.paths = list_sample_files(source)
        self.registry = registry if registry is not None else FeatureRegistry.preset("boltz2")
        self.validate = validate
        self.record_key = record_key
        self.weights_only = weights_only

    def __len__(self) -> int:
        return len(self.paths)

    def record_id(self, index: int) -> str:
        """The record id of sample ``index``: its file's stem."""
        return self.paths[index].stem

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample index {index} out of range for {len(self)} files")
        path = self.paths[index]
        sample = load_sample(
            path, self.registry if self.validate else None, weights_only=self.weights_only
        )
        if self.record_key is not None and self.record_key not in sample:
            sample[self.record_key] = path.stem
        return sample

    def __repr__(self) -> str:
        return f"FeatureFileDataset({len(self)} files, registry={self.registry.name!r})"


__all__ = [
    "SAMPLE_SUFFIXES",
    "FeatureFileDataset",
    "FeatureFileError",
    "list_sample_files",
    "load_sample",
    "save_sample",
    "validate_sample",
]
