"""Reading ``torch.distributed.checkpoint`` directories without unpickling arbitrary objects.

DCP's ``FileSystemReader`` reads a checkpoint's ``.metadata`` with ``pickle.load``, and its
default load planner unpickles non-tensor entries without restriction: either runs code
from a crafted checkpoint. (Tensor entries are read with ``weights_only=True``.) Here

* :func:`read_metadata` unpickles ``.metadata`` with an unpickler that resolves only the
  DCP metadata records, torch dtypes and path classes
  (:func:`~physicsnemo_foldcp.core.compat.checkpoint_metadata_globals`) and refuses any
  other global before calling it;
* :class:`SafeReader` hands DCP that already-read metadata instead of reading it again;
* :class:`TensorOnlyLoadPlanner` refuses non-tensor entries (the checkpoints of this
  package keep their plain data in a separate ``weights_only`` file).
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from physicsnemo_foldcp.core.compat import checkpoint_metadata_globals

METADATA_NAME = ".metadata"
"""The DCP metadata file of a checkpoint directory."""


PATH_GLOBALS = {
    ("pathlib", name): getattr(pathlib, name)
    for name in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")
}
"""Path classes: ``FileSystemWriter`` records the directory it wrote as a path object."""


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint file refers to something a checkpoint never holds; nothing was run."""


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
                f"{self.source} refers to {module}.{name}, which a checkpoint's metadata "
                "never holds: refused without running it"
            )
        return found


def read_metadata(directory: str | os.PathLike) -> Metadata:
    """The DCP metadata of ``directory``, read with the restricted unpickler.

    Raises
    ------
    UnsafeCheckpointError
        When the file refers to any other global, or does not hold DCP ``Metadata``.
    FileNotFoundError
        When there is no ``.metadata``.
    """
    path = Path(directory) / METADATA_NAME
    with open(path, "rb") as f:
        try:
            metadata = _MetadataUnpickler(f, path).load()
        except UnsafeCheckpointError:
            raise
        except Exception as err:  # noqa: BLE001 - any malformed pickle
            raise UnsafeCheckpointError(
                f"{path} is not a readable DCP metadata file: {err}"
            ) from err
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(
            f"{path} holds a {type(metadata).__name__}, not torch.distributed.checkpoint Metadata"
        )
    return metadata


def non_tensor_entries(metadata: Metadata, prefixes: tuple[str, ...]) -> list[str]:
    """Keys under ``prefixes`` that the checkpoint stores as pickled bytes, not tensors."""
    return sorted(
        key
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(prefixes) and not isinstance(entry, TensorStorageMetadata)
    )


class SafeReader(FileSystemReader):
    """A ``FileSystemReader`` that hands DCP metadata read by :func:`read_metadata`.

    Parameters
    ----------
    path : path
        The checkpoint directory.
    metadata : Metadata
        Its metadata, from :func:`read_metadata`.
    """

    def __init__(self, path: str | os.PathLike, metadata: Metadata):
        super().__init__(str(path))
        self.checked_metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checked metadata (never unpickled again)."""
        if kwargs.get("rank") is not None:
            raise FileNotFoundError("checkpoints of this package have no per-rank metadata")
        metadata = self.checked_metadata
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class TensorOnlyLoadPlanner(DefaultLoadPlanner):
    """A ``DefaultLoadPlanner`` that refuses to unpickle non-tensor entries."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Refuse: a checkpoint's non-tensor data lives in its ``weights_only`` file."""
        raise UnsafeCheckpointError(
            f"checkpoint entry {read_item.dest_index.fqn!r} is pickled data, not a tensor: "
            "refused without unpickling it"
        )


__all__ = [
    "METADATA_NAME",
    "SafeReader",
    "TensorOnlyLoadPlanner",
    "UnsafeCheckpointError",
    "non_tensor_entries",
    "read_metadata",
]
