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

A feature file is untrusted input. Before anything in it is decompressed, the sizes it
declares (each zip member's size, and for ``.npz`` each array's shape and dtype) are
summed and checked against ``max_bytes`` (:data:`MAX_SAMPLE_BYTES` by default; the
``data.max_sample_bytes`` option), and an array that declares more bytes than its member
holds is refused; after a ``.pt`` is read, its tensors' sizes are checked again (a small
storage can be viewed as a large tensor). Only regular files are read (a symlink is
followed to one; a FIFO or a dangling or looping symlink is refused by name). With a
registry, :func:`validate_sample` checks the keys, dtypes (the presets declare the dtypes
of ids, one-hot maps and coordinates), axis lengths, index ranges and maps, refuses an
empty complex (0 tokens), and refuses NaN and infinite values in floating features unless
the registry allows them for that feature (``FeatureSpec.allow_nonfinite``). Every
refusal is a :class:`FeatureFileError` whose message names the file (and the feature).
"""

from __future__ import annotations

import math
import os
import stat
import zipfile
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

MAX_SAMPLE_BYTES = 4 * 2**30
"""Default bound on one sample's decompressed size (4 GiB: a Boltz-2 sample of about
2,000 tokens, with its ``[N, N, K, 64]`` distogram target, takes about 1 GiB)."""

NPY_HEADER_BYTES = 2**16
"""Largest ``.npy`` header read from an ``.npz`` member (numpy's own limit is 10 kB)."""

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


def _size(n: int) -> str:
    return f"{n} bytes ({n / 2**20:.1f} MiB)"


def _too_large(path: Path, declared: int, max_bytes: int, what: str) -> FeatureFileError:
    return FeatureFileError(
        f"{path}: {what} declare {_size(declared)} once decompressed, more than the limit "
        f"of {_size(max_bytes)}: refused before decompressing (raise data.max_sample_bytes "
        "/ max_bytes= for a larger sample)"
    )


def _npy_bytes(archive: zipfile.ZipFile, info: zipfile.ZipInfo, path: Path) -> int:
    """Bytes the ``.npy`` member ``info`` declares (shape x itemsize), read from its header."""
    with archive.open(info) as member:
        try:
            version = np.lib.format.read_magic(member)
            if version == (1, 0):
                shape, _, dtype = np.lib.format.read_array_header_1_0(
                    member, max_header_size=NPY_HEADER_BYTES
                )
            else:
                shape, _, dtype = np.lib.format.read_array_header_2_0(
                    member, max_header_size=NPY_HEADER_BYTES
                )
        except (ValueError, OSError, zipfile.BadZipFile) as err:
            raise FeatureFileError(
                f"{path}: member {info.filename!r} is not a readable .npy array ({err})"
            ) from err
        header = member.tell() if member.seekable() else 0
    if dtype.hasobject:
        raise FeatureFileError(
            f"{path}: member {info.filename!r} holds Python objects (dtype {dtype}): refused"
        )
    declared = math.prod(shape) * dtype.itemsize
    if header and declared > info.file_size - header:
        raise FeatureFileError(
            f"{path}: member {info.filename!r} declares shape {tuple(shape)} {dtype} "
            f"({_size(declared)}) but holds {_size(info.file_size - header)}: refused"
        )
    return declared


def check_declared_size(path: PathLike, max_bytes: int = MAX_SAMPLE_BYTES) -> int:
    """The decompressed size a sample file declares; refuse it above ``max_bytes``.

    Reads the zip directory and the ``.npy`` headers only: nothing is decompressed beyond
    a header. A ``.pt`` that is not a zip archive (the legacy format) is its own size.

    Parameters
    ----------
    path : str or os.PathLike
        A ``.pt`` or ``.npz`` sample file (a regular file).
    max_bytes : int
        The limit.

    Returns
    -------
    int
        The declared size in bytes.

    Raises
    ------
    FeatureFileError
        Naming the file, when the declared size is over the limit, an array declares more
        bytes than its member holds, or the archive cannot be read.
    """
    path = Path(path)
    suffix = _suffix(path)
    if suffix == ".pt" and not zipfile.is_zipfile(path):
        size = path.stat().st_size
        if size > max_bytes:
            raise _too_large(path, size, max_bytes, "its bytes")
        return size
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
            declared = sum(info.file_size for info in members)
            if declared > max_bytes:
                raise _too_large(path, declared, max_bytes, f"its {len(members)} member(s)")
            if suffix == ".npz":
                arrays = sum(_npy_bytes(archive, info, path) for info in members)
                if arrays > max_bytes:
                    raise _too_large(path, arrays, max_bytes, "its arrays' shapes")
    except zipfile.BadZipFile as err:
        raise FeatureFileError(f"{path}: not a readable {suffix} archive ({err})") from err
    return declared


def _check_tensor_bytes(sample: Mapping[str, Any], path: Path, max_bytes: int) -> None:
    """The loaded tensors' sizes (a view of a small storage can be large) are within the limit."""
    total = sum(
        v.numel() * v.element_size() for v in sample.values() if isinstance(v, torch.Tensor)
    )
    if total > max_bytes:
        raise _too_large(path, total, max_bytes, "its tensors")


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
    check_finite(features, registry, source=source)


def check_finite(
    features: Mapping[str, Any], registry: FeatureRegistry, *, source: str = "sample"
) -> None:
    """Refuse NaN and infinite values in every floating feature the registry does not allow.

    Parameters
    ----------
    features : Mapping[str, Any]
        The sample (names the registry knows).
    registry : FeatureRegistry
        ``FeatureSpec.allow_nonfinite`` marks the features that may hold them.
    source : str
        Where the sample came from, put first in the message.

    Raises
    ------
    FeatureFileError
        Naming ``source``, the feature, how many values are NaN / infinite, and the first.
    """
    for name in sorted(features):
        t = features[name]
        if not isinstance(t, torch.Tensor) or not (t.is_floating_point() or t.is_complex()):
            continue
        if name in registry and registry[name].allow_nonfinite:
            continue
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            first = tuple(int(i) for i in bad.nonzero()[0])
            raise FeatureFileError(
                f"{source}: feature {name!r} holds {int(t.isnan().sum())} NaN and "
                f"{int(t.isinf().sum())} infinite value(s) (first at index {first}: "
                f"{t[first].item()}): refused (a registry spec with allow_nonfinite=true "
                "accepts them for a feature)"
            )


def load_sample(
    path: PathLike,
    registry: FeatureRegistry | None = None,
    *,
    weights_only: bool = True,
    max_bytes: int = MAX_SAMPLE_BYTES,
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
    max_bytes : int, default MAX_SAMPLE_BYTES
        Largest decompressed size (see :func:`check_declared_size`).

    Returns
    -------
    dict[str, Any]
        Feature name -> CPU tensor with the stored dtype and shape, plus stored strings /
        plain values.

    Raises
    ------
    FeatureFileError
        When the file is missing, not a regular file, larger than ``max_bytes`` once
        decompressed, unreadable, not a dict, or (with ``registry``) invalid; the message
        names the file and, for validation errors, the feature.
    """
    path = Path(path)
    suffix = _suffix(path)
    _check_regular(path)
    check_declared_size(path, max_bytes)
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
    _check_tensor_bytes(sample, path, max_bytes)
    if registry is not None:
        validate_sample(sample, registry, source=str(path))
    return sample


def _check_regular(path: Path) -> None:
    """Refuse a missing path, a dangling or looping symlink, and anything but a regular file."""
    try:
        mode = path.stat().st_mode  # follows a symlink
    except OSError as err:
        if path.is_symlink():
            raise FeatureFileError(
                f"{path}: a dangling or looping symlink (to {os.readlink(path)}: "
                f"{err.strerror}): refused"
            ) from err
        raise FeatureFileError(f"{path}: no such sample file") from err
    if not stat.S_ISREG(mode):
        raise FeatureFileError(
            f"{path}: not a regular file (a directory, FIFO or device): refused, a sample "
            "is a .pt or .npz file"
        )


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
        When the path is empty or missing, the directory holds no sample file or a
        dangling or looping symlink (symlinks to files are followed), a listed file is
        missing or not a regular file, or a listed file has another suffix.
    """
    if isinstance(source, (str, os.PathLike)):
        if not os.fspath(source):
            raise FeatureFileError(
                "the sample path is empty: give a directory of .pt / .npz files or one file "
                "(data.path=...)"
            )
        root = Path(source)
        if root.is_dir():
            return _directory_files(root)
        if not os.path.lexists(root):
            raise FeatureFileError(
                f"{root}: no such file or directory (the sample path, data.path): give a "
                "directory of .pt / .npz files or one file"
            )
        paths = [root]
    else:
        paths = [Path(p) for p in source]
    if not paths:
        raise FeatureFileError("the list of sample files is empty")
    for path in paths:
        _suffix(path)
        _check_regular(path)
    return paths


def _directory_files(root: Path) -> list[Path]:
    """The sample files of ``root`` by name; a broken symlink there is refused, not skipped."""
    files = []
    for entry in sorted(root.iterdir(), key=lambda p: p.name):
        if entry.is_symlink():
            try:
                entry.stat()
            except OSError as err:
                raise FeatureFileError(
                    f"{entry}: a dangling or looping symlink in the sample directory {root} "
                    f"(to {os.readlink(entry)}: {err.strerror}): remove it or fix its target"
                ) from err
        if entry.suffix.lower() in SAMPLE_SUFFIXES and entry.is_file():
            files.append(entry)
    if not files:
        raise FeatureFileError(
            f"{root}: directory holds no sample file ({', '.join(SAMPLE_SUFFIXES)})"
        )
    return files


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
    max_bytes : int, default MAX_SAMPLE_BYTES
        Largest decompressed size of one sample (see :func:`check_declared_size`).

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
        max_bytes: int = MAX_SAMPLE_BYTES,
    ):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes={max_bytes!r} is out of range: it must be an int >= 1")
        self.paths = list_sample_files(source)
        self.registry = registry if registry is not None else FeatureRegistry.preset("boltz2")
        self.validate = validate
        self.record_key = record_key
        self.weights_only = weights_only
        self.max_bytes = max_bytes

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
            path,
            self.registry if self.validate else None,
            weights_only=self.weights_only,
            max_bytes=self.max_bytes,
        )
        if self.record_key is not None and self.record_key not in sample:
            sample[self.record_key] = path.stem
        return sample

    def __repr__(self) -> str:
        return f"FeatureFileDataset({len(self)} files, registry={self.registry.name!r})"


__all__ = [
    "MAX_SAMPLE_BYTES",
    "SAMPLE_SUFFIXES",
    "FeatureFileDataset",
    "FeatureFileError",
    "check_declared_size",
    "check_finite",
    "list_sample_files",
    "load_sample",
    "save_sample",
    "validate_sample",
]
