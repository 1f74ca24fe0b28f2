"""Reading ``torch.distributed.checkpoint`` directories as untrusted input.

DCP's ``FileSystemReader`` reads a checkpoint's ``.metadata`` with ``pickle.load``, opens
whatever file path the metadata names, and its default load planner unpickles non-tensor
entries without restriction. Here a checkpoint directory is read as input from anyone:

* every file is opened as a regular file of the directory itself (:class:`CheckpointFiles`):
  a name with a path separator, ``..`` or an absolute path, a symbolic link, a FIFO or a
  device is refused before it is opened for reading (``O_NOFOLLOW | O_NONBLOCK``, checked
  again with ``fstat`` on the open descriptor);
* :func:`read_metadata` reads ``.metadata`` (at most :data:`MAX_METADATA_BYTES`) with an
  unpickler that resolves only the DCP metadata records, torch dtypes and path classes
  (:func:`~physicsnemo_foldcp.core.compat.checkpoint_metadata_globals`), then checks every
  record (:func:`check_metadata`): at most :data:`MAX_ENTRIES` entries and
  :data:`MAX_CHUNKS` chunks, each tensor's chunks inside it and tiling it exactly (no
  overlap, no gap: a chunk list repeated by reference is refused before DCP plans it),
  every chunk's record in a shard file named ``*.distcp`` of the directory, each record at
  most :data:`MAX_RECORD_OVERHEAD` bytes longer than its tensor data;
* :func:`check_shard_files` checks that every shard file is there, regular and as long as
  the metadata's records need (a truncated shard is refused before anything is read);
* :class:`SafeReader` hands DCP that checked metadata instead of reading it again, and
  opens shard files only through :class:`CheckpointFiles`; a failure while reading names
  the shard file;
* :class:`TensorOnlyLoadPlanner` refuses non-tensor entries (the checkpoints of this
  package keep their plain data in a separate ``weights_only`` file) and records which
  records hold NaN or infinite values.

Every refusal is an :class:`UnsafeCheckpointError` whose message starts with the file.
"""

from __future__ import annotations

import io
import math
import os
import pathlib
import pickle
import stat
from bisect import bisect_left
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem

from physicsnemo_foldcp.core.compat import (
    checkpoint_metadata_globals,
    checkpoint_storage_info_type,
    replace_reader_file_system,
)

METADATA_NAME = ".metadata"
"""The DCP metadata file of a checkpoint directory."""

SHARD_SUFFIX = ".distcp"
"""The ending of every shard file name ``FileSystemWriter`` writes (``__<rank>_<n>.distcp``)."""

MAX_METADATA_BYTES = 256 * 2**20
"""Largest ``.metadata`` read (a checkpoint of 10^5 tensors on 100 ranks needs a few MB)."""

MAX_ENTRIES = 100_000
"""Most entries (parameter and optimizer-state tensors) a checkpoint's metadata may list."""

MAX_CHUNKS = 1_000_000
"""Most chunks (all tensors together, repeats counted) and storage records in a checkpoint;
also bounds the grid cells the tiling check of the chunks may use."""

MAX_DIMS = 64
"""Most dimensions of a checkpoint tensor."""

MAX_RECORD_OVERHEAD = 2**20
"""Bytes a shard record may hold beyond its tensor data (``torch.save``'s zip framing)."""

PATH_GLOBALS = {
    ("pathlib", name): getattr(pathlib, name)
    for name in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")
}
"""Path classes: ``FileSystemWriter`` records the directory it wrote as a path object."""


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint file is refused (outside, not regular, too large, malformed).

    Nothing in it was run or applied.
    """


_MISSING = object()


def is_shard_name(name: object) -> bool:
    """Whether ``name`` is a shard file name this reader opens: ``<name>.distcp``, no path."""
    return (
        isinstance(name, str)
        and name.endswith(SHARD_SUFFIX)
        and len(name) > len(SHARD_SUFFIX)
        and not name.startswith(".")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
        and os.path.basename(name) == name
    )


class CheckpointFiles:
    """Opens the files of one checkpoint directory: regular files directly inside it only.

    Parameters
    ----------
    directory : path
        The checkpoint directory as given; messages name files under this spelling, files
        are opened under its resolved path (taken once, here).
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.root = self.directory.resolve()

    def shown(self, name: str) -> Path:
        """``name`` under the directory as given (for messages)."""
        return self.directory / name

    def open(
        self, name: str, limit: int | None = None, limit_name: str = ""
    ) -> tuple[BinaryIO, int]:
        """Open ``name`` for reading; return the file and its size.

        Raises
        ------
        UnsafeCheckpointError
            When ``name`` is not a plain file name, the file is missing, a symbolic link,
            not a regular file (a FIFO, a device, a directory), or larger than ``limit``.
        """
        shown = self.shown(name) if isinstance(name, str) else f"{self.directory}/{name!r}"
        if not isinstance(name, str) or name in ("", ".", "..") or os.path.basename(name) != name:
            raise UnsafeCheckpointError(
                f"{shown}: not a file name inside {self.directory}: refused"
            )
        path = self.root / name
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            raise UnsafeCheckpointError(f"{shown}: no such file") from None
        except OSError as err:
            raise UnsafeCheckpointError(f"{shown}: cannot be read: {err}") from err
        _check_regular(info.st_mode, shown)
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        try:
            fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
        except OSError as err:
            raise UnsafeCheckpointError(f"{shown}: cannot be opened: {err}") from err
        try:
            info = os.fstat(fd)
            _check_regular(info.st_mode, shown)  # replaced since the lstat
            if limit is not None and info.st_size > limit:
                raise UnsafeCheckpointError(
                    f"{shown}: {info.st_size} bytes, more than {limit_name} = {limit}: refused "
                    "before reading it"
                )
            os.set_blocking(fd, True)
            return os.fdopen(fd, "rb"), info.st_size
        except BaseException:
            os.close(fd)
            raise

    def read(self, name: str, limit: int, limit_name: str) -> bytes:
        """The whole of ``name`` (at most ``limit`` bytes), as :meth:`open` allows it."""
        stream, size = self.open(name, limit, limit_name)
        with stream:
            data = stream.read(limit + 1)
        if len(data) > limit:
            raise UnsafeCheckpointError(
                f"{self.shown(name)}: more than {limit_name} = {limit} bytes: refused"
            )
        return data


def _check_regular(mode: int, shown: Any) -> None:
    if stat.S_ISREG(mode):
        return
    kinds = (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    )
    kind = next((text for test, text in kinds if test(mode)), "not a regular file")
    raise UnsafeCheckpointError(
        f"{shown}: is {kind}; a checkpoint holds regular files only, read from its own "
        "directory: refused without opening it"
    )


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only DCP metadata records and torch dtypes."""

    def __init__(self, file: io.BufferedIOBase, source: Path):
        super().__init__(file)
        self.source = source
        self.allowed = {**checkpoint_metadata_globals(), **PATH_GLOBALS}

    def find_class(self, module: str, name: str) -> Any:
        found = self.allowed.get((module, name))
        if found is None and module == "torch":
            candidate = getattr(torch, name, None)
            found = candidate if isinstance(candidate, torch.dtype) else None
        if found is None:
            raise UnsafeCheckpointError(
                f"{self.source}: refers to {module}.{name}, which a checkpoint's metadata "
                "never holds: refused without running it"
            )
        return found


def read_metadata(directory: str | os.PathLike | CheckpointFiles) -> Metadata:
    """The DCP metadata of ``directory``, read with the restricted unpickler and checked.

    The records are checked with :func:`check_metadata`, the shard files they name with
    :func:`check_shard_files`.

    Raises
    ------
    UnsafeCheckpointError
        When ``.metadata`` is missing, not a regular file of the directory, larger than
        :data:`MAX_METADATA_BYTES`, refers to any other global, or does not hold DCP
        ``Metadata`` that :func:`check_metadata` accepts; when a shard file is missing,
        not a regular file of the directory or shorter than its records.
    """
    files = directory if isinstance(directory, CheckpointFiles) else CheckpointFiles(directory)
    source = files.shown(METADATA_NAME)
    data = files.read(METADATA_NAME, MAX_METADATA_BYTES, "MAX_METADATA_BYTES")
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data), source).load()
    except UnsafeCheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - any malformed pickle
        raise UnsafeCheckpointError(
            f"{source}: not a readable DCP metadata file: {type(err).__name__}: {err}"
        ) from err
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(
            f"{source}: holds a {type(metadata).__name__}, not torch.distributed.checkpoint "
            "Metadata"
        )
    check_shard_files(files, check_metadata(metadata, source))
    return metadata


def _field(record: Any, name: str, kinds: type | tuple[type, ...], where: str) -> Any:
    value = getattr(record, name, _MISSING)
    if value is _MISSING or not isinstance(value, kinds):
        got = "missing" if value is _MISSING else f"a {type(value).__name__}"
        raise UnsafeCheckpointError(f"{where}.{name} is {got}")
    return value


def _shape(value: Any, ndim: int | None, where: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or len(value) > MAX_DIMS:
        raise UnsafeCheckpointError(f"{where} is not a shape of at most {MAX_DIMS} dims")
    if ndim is not None and len(value) != ndim:
        raise UnsafeCheckpointError(f"{where} has {len(value)} dims, the tensor has {ndim}")
    if not all(type(v) is int and v >= 0 for v in value):
        raise UnsafeCheckpointError(f"{where} = {value!r} is not a shape of integers >= 0")
    return tuple(value)


def check_metadata(metadata: Metadata, source: str | os.PathLike) -> dict[str, int]:
    """Check every record of DCP ``metadata``; return shard file name -> bytes needed.

    Accepted: at most :data:`MAX_ENTRIES` entries, tensor entries whose chunks (at most
    :data:`MAX_CHUNKS` in all) lie inside their tensor and tile it exactly, each non-empty
    chunk with a storage record in a ``*.distcp`` file of the directory (no path), of at
    most its tensor bytes plus :data:`MAX_RECORD_OVERHEAD`, and no stream transforms.

    Raises
    ------
    UnsafeCheckpointError
        Naming ``source`` and the first record refused.
    """
    try:
        return _check_metadata(metadata)
    except UnsafeCheckpointError as err:
        raise UnsafeCheckpointError(f"{source}: {err}: refused") from None


def _check_metadata(metadata: Metadata) -> dict[str, int]:
    entries = _field(metadata, "state_dict_metadata", dict, "metadata")
    storage = _field(metadata, "storage_data", dict, "metadata")
    if len(entries) > MAX_ENTRIES:
        raise UnsafeCheckpointError(
            f"{len(entries)} entries, more than MAX_ENTRIES = {MAX_ENTRIES}"
        )
    if len(storage) > MAX_CHUNKS:
        raise UnsafeCheckpointError(
            f"{len(storage)} storage records, more than MAX_CHUNKS = {MAX_CHUNKS}"
        )
    planner_data = getattr(metadata, "planner_data", None)
    if planner_data is not None and (
        not isinstance(planner_data, dict) or len(planner_data) > MAX_ENTRIES
    ):
        raise UnsafeCheckpointError("metadata.planner_data is not a mapping of the entries")
    storage_meta = getattr(metadata, "storage_meta", None)
    if storage_meta is not None and not isinstance(storage_meta, StorageMeta):
        raise UnsafeCheckpointError(f"metadata.storage_meta is a {type(storage_meta).__name__}")
    chunk_count = 0
    for key, entry in entries.items():
        if not isinstance(key, str):
            raise UnsafeCheckpointError(f"entry key {key!r} is not a str")
        if isinstance(entry, BytesStorageMetadata):
            continue
        if not isinstance(entry, TensorStorageMetadata):
            raise UnsafeCheckpointError(f"entry {key!r} is a {type(entry).__name__}")
        chunk_count += len(_field(entry, "chunks", list, f"entry {key!r}"))
        if chunk_count > MAX_CHUNKS:
            raise UnsafeCheckpointError(
                f"more than MAX_CHUNKS = {MAX_CHUNKS} chunks (entry {key!r} lists "
                f"{len(entry.chunks)})"
            )
    needed = _check_storage(storage)
    cells = [0]
    for key, entry in entries.items():
        if isinstance(entry, TensorStorageMetadata):
            _check_tensor(key, entry, storage, cells)
    return needed


def _check_storage(storage: dict) -> dict[str, int]:
    info_type = checkpoint_storage_info_type()
    needed: dict[str, int] = {}
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(getattr(index, "fqn", None), str):
            raise UnsafeCheckpointError(f"storage key {index!r} is not a MetadataIndex")
        where = f"storage record of {index.fqn!r}"
        if not isinstance(info, info_type):
            raise UnsafeCheckpointError(f"{where} is a {type(info).__name__}")
        name = _field(info, "relative_path", str, where)
        offset = _field(info, "offset", int, where)
        length = _field(info, "length", int, where)
        if not is_shard_name(name):
            raise UnsafeCheckpointError(
                f"{where} names shard file {name!r}, which is not a *{SHARD_SUFFIX} file name "
                "inside the checkpoint directory (no path, no '..')"
            )
        if offset < 0 or length < 0:
            raise UnsafeCheckpointError(f"{where} has offset {offset}, length {length}")
        if getattr(info, "transform_descriptors", None):
            raise UnsafeCheckpointError(
                f"{where} uses stream transforms {info.transform_descriptors!r}, which "
                "checkpoints of this package never do"
            )
        needed[name] = max(needed.get(name, 0), offset + length)
    return needed


def _check_tensor(key: str, entry: TensorStorageMetadata, storage: dict, cells: list[int]) -> None:
    where = f"entry {key!r}"
    properties = _field(entry, "properties", TensorProperties, where)
    dtype = _field(properties, "dtype", torch.dtype, f"{where}.properties")
    size = _shape(getattr(entry, "size", None), None, f"{where}.size")
    boxes = []
    for i, chunk in enumerate(entry.chunks):
        at = f"{where}.chunks[{i}]"
        if not isinstance(chunk, ChunkStorageMetadata):
            raise UnsafeCheckpointError(f"{at} is a {type(chunk).__name__}")
        offsets = _shape(getattr(chunk, "offsets", None), len(size), f"{at}.offsets")
        sizes = _shape(getattr(chunk, "sizes", None), len(size), f"{at}.sizes")
        if any(o + s > n for o, s, n in zip(offsets, sizes, size)):
            raise UnsafeCheckpointError(
                f"{at} (offsets {list(offsets)}, sizes {list(sizes)}) lies outside the tensor "
                f"of size {list(size)}"
            )
        volume = math.prod(sizes)
        if volume == 0:
            continue
        info = storage.get(MetadataIndex(key, offsets))
        if info is None:
            raise UnsafeCheckpointError(f"{at} (offsets {list(offsets)}) has no storage record")
        if info.length > volume * dtype.itemsize + MAX_RECORD_OVERHEAD:
            raise UnsafeCheckpointError(
                f"{at}: its record in {info.relative_path} is {info.length} bytes, more than "
                f"its {volume} {dtype} values need (+ MAX_RECORD_OVERHEAD = "
                f"{MAX_RECORD_OVERHEAD})"
            )
        boxes.append((offsets, sizes, volume))
    problem = _tiling_problem(size, boxes, cells)
    if problem:
        raise UnsafeCheckpointError(f"{where} (size {list(size)}): its chunks {problem}")


Box = tuple[tuple[int, ...], tuple[int, ...], int]
"""A chunk: offsets, sizes, number of elements."""


def _tiling_problem(size: tuple[int, ...], boxes: list[Box], cells: list[int]) -> str | None:
    """Why the boxes (inside ``size``) do not tile it exactly, or ``None``.

    The boxes' boundaries cut the tensor into a grid; every cell must be covered once.
    ``cells[0]`` counts the grid cells used so far, bounded by :data:`MAX_CHUNKS`.
    """
    numel = math.prod(size)
    covered = sum(volume for _, _, volume in boxes)
    if covered != numel:
        kind = "overlap (a chunk listed twice?)" if covered > numel else "leave a gap"
        return f"cover {covered} elements of {numel}: they {kind}"
    if len(boxes) <= 1:
        return None
    cuts = [
        sorted({0, n} | {o[d] for o, _, _ in boxes} | {o[d] + s[d] for o, s, _ in boxes})
        for d, n in enumerate(size)
    ]
    shape = [len(c) - 1 for c in cuts]
    cells[0] += math.prod(shape)
    if cells[0] > MAX_CHUNKS:
        return f"cut the tensors into more than MAX_CHUNKS = {MAX_CHUNKS} grid cells"
    counts = np.zeros(shape, dtype=np.int32)
    for offsets, sizes, _ in boxes:
        region = tuple(
            slice(bisect_left(c, o), bisect_left(c, o + s)) for c, o, s in zip(cuts, offsets, sizes)
        )
        counts[region] += 1
    if (counts != 1).any():
        return "overlap and leave a gap"
    return None


def check_shard_files(files: CheckpointFiles, needed: dict[str, int]) -> None:
    """Every shard file is a regular file of the directory, as long as its records need.

    Raises
    ------
    UnsafeCheckpointError
        Naming the first shard file that is missing, not regular, or too short.
    """
    for name, length in sorted(needed.items()):
        stream, size = files.open(name)
        stream.close()
        if size < length:
            raise UnsafeCheckpointError(
                f"{files.shown(name)}: {size} bytes, but {METADATA_NAME} places records up to "
                f"byte {length}: the shard is truncated"
            )


def non_tensor_entries(metadata: Metadata, prefixes: tuple[str, ...]) -> list[str]:
    """Keys under ``prefixes`` that the checkpoint stores as pickled bytes, not tensors."""
    return sorted(
        key
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(prefixes) and not isinstance(entry, TensorStorageMetadata)
    )


class ConfinedFileSystem(FileSystem):
    """The ``FileSystem`` of a :class:`SafeReader`.

    It opens shard files through :class:`CheckpointFiles`, only for reading, only directly
    inside the directory.
    """

    def __init__(self, files: CheckpointFiles):
        super().__init__()
        self.files = files
        self.opened: Path | None = None

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        """Open ``path`` (``<directory>/<shard name>``) for reading, as checked files only."""
        path = Path(path)
        if mode != "rb" or path.parent != self.files.directory or not is_shard_name(path.name):
            raise UnsafeCheckpointError(
                f"{path}: not a shard file of {self.files.directory} opened for reading "
                f"(mode {mode!r}): refused"
            )
        self.opened = path
        stream, _ = self.files.open(path.name)
        with stream:
            yield stream  # type: ignore[misc]


class SafeReader(FileSystemReader):
    """A ``FileSystemReader`` that hands DCP checked metadata and opens only checked files.

    Parameters
    ----------
    files : CheckpointFiles
        The checkpoint directory.
    metadata : Metadata
        Its metadata, from :func:`read_metadata`.
    """

    def __init__(self, files: CheckpointFiles, metadata: Metadata):
        super().__init__(files.directory)
        self.checked_metadata = metadata
        self.confined = ConfinedFileSystem(files)
        replace_reader_file_system(self, self.confined)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checked metadata (never unpickled again)."""
        if kwargs.get("rank") is not None:
            raise FileNotFoundError("checkpoints of this package have no per-rank metadata")
        metadata = self.checked_metadata
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any:
        """DCP's read, with any failure named by the shard file it happened in."""
        try:
            return super().read_data(plan, planner)
        except UnsafeCheckpointError:
            raise
        except Exception as err:  # noqa: BLE001 - a record that does not hold its tensor
            where = self.confined.opened or self.files_directory
            text = " ".join(str(err).split())[:500] or type(err).__name__
            raise UnsafeCheckpointError(
                f"{where}: a record does not hold the tensor the metadata says "
                f"({type(err).__name__}: {text})"
            ) from err

    @property
    def files_directory(self) -> Path:
        """The checkpoint directory as given."""
        return self.confined.files.directory


class TensorOnlyLoadPlanner(DefaultLoadPlanner):
    """A ``DefaultLoadPlanner`` that refuses non-tensor entries and notes non-finite records.

    :meth:`nonfinite_records` lists, after the load, the records (storage keys) that held
    a NaN or an infinite value; the check costs one host sync per device for the load.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.finite_flags: list[tuple[MetadataIndex, torch.Tensor]] = []

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Refuse: a checkpoint's non-tensor data lives in its ``weights_only`` file."""
        raise UnsafeCheckpointError(
            f"checkpoint entry {read_item.dest_index.fqn!r} is pickled data, not a tensor: "
            "refused without unpickling it"
        )

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """Note whether the values just read are all finite (floating and complex only)."""
        super().commit_tensor(read_item, tensor)
        if tensor.is_floating_point() or tensor.is_complex():
            self.finite_flags.append((read_item.storage_index, torch.isfinite(tensor).all()))

    def nonfinite_records(self) -> list[MetadataIndex]:
        """Storage keys of the records read that hold NaN or infinite values."""
        by_device: dict[torch.device, list[int]] = {}
        for i, (_, flag) in enumerate(self.finite_flags):
            by_device.setdefault(flag.device, []).append(i)
        bad = []
        for indices in by_device.values():
            flags = torch.stack([self.finite_flags[i][1] for i in indices]).tolist()
            bad += [i for i, finite in zip(indices, flags) if not finite]
        return [self.finite_flags[i][0] for i in sorted(bad)]


__all__ = [
    "MAX_CHUNKS",
    "MAX_DIMS",
    "MAX_ENTRIES",
    "MAX_METADATA_BYTES",
    "MAX_RECORD_OVERHEAD",
    "METADATA_NAME",
    "SHARD_SUFFIX",
    "CheckpointFiles",
    "SafeReader",
    "TensorOnlyLoadPlanner",
    "UnsafeCheckpointError",
    "check_metadata",
    "check_shard_files",
    "is_shard_name",
    "non_tensor_entries",
    "read_metadata",
]
