"""Prediction: run the model over a dataset and write each predicted distogram to a file.

Every domain group takes its share of the samples (each sample once, in order,
:class:`~physicsnemo_foldcp.data.ShardedLoader` in ``"inference"`` mode); for each one the
distributed ``forward`` gives the distogram logits as a ``(Shard(1), Shard(2))`` tile, which
is gathered over the domain group, mapped back from the padded to the serial token layout,
and written by the group's source rank to ``<out_dir>/<record_id>.npz`` as
``pdistogram`` (``[N, N, bins]`` float32 logits, serial layout) with ``record_id``. The file
is the same whatever the mesh: a serial prediction writes it too.

File names are planned before anything is written (:func:`output_names`): from
``dataset.record_id(index)`` when the dataset has that method, otherwise from each sample's
``record_id`` (rank 0 reads every sample once for it). :func:`record_stem` owns the rule
from a record id to a file name, for every writer of per-record files: characters other
than letters, digits, ``.``, ``_`` and ``-`` become ``_``, and an id longer than
:data:`MAX_STEM` characters is cut and given a hash of the whole id, so every name fits a
file system's 255-byte limit. Two ids such as ``a/b`` and ``a_b`` would share a file: that,
or two samples with one id, is an :class:`OutputNameError` naming both, raised on every
rank before any file is written. So is a planned file that already exists in ``out_dir``
(:class:`OutputExistsError`) unless ``overwrite`` is set, and even then a file there that is
not a prediction this project wrote, or a symlink, is refused. Each file is written under a
temporary name and moved into place.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from physicsnemo.domain_parallel import ShardTensor
from torch import nn

from physicsnemo_foldcp.data.loader import ShardedLoader, ShardedSample
from physicsnemo_foldcp.distributed.errors import on_rank_zero
from physicsnemo_foldcp.distributed.mesh import FoldMesh
from physicsnemo_foldcp.distributed.wrappers import sync_over_domain
from physicsnemo_foldcp.features.registry import FeatureRegistry
from physicsnemo_foldcp.features.spec import TOKENS
from physicsnemo_foldcp.sharding.scatter import ShardedFeatures
from physicsnemo_foldcp.training.atomic import write_atomic
from physicsnemo_foldcp.training.loop import autocast, check_batch, set_precision

logger = logging.getLogger("physicsnemo_foldcp.training")

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")

MAX_STEM = 200
"""Longest file-name stem :func:`record_stem` gives (ASCII, so bytes): with a suffix and the
temporary name's extra 18 characters it stays within the usual 255-byte name limit."""

HASH_CHARS = 16
"""Hex digits of the SHA-256 of the record id that end a shortened stem."""

PREDICTION_MEMBERS = frozenset({"pdistogram.npy", "record_id.npy"})
"""The members of a prediction file :func:`write_distogram` writes."""


class OutputNameError(ValueError):
    """Two samples would write the same prediction file; nothing was written."""


class OutputExistsError(OutputNameError):
    """A prediction file to write is already in the output directory; nothing was written."""


@dataclass
class PredictionResult:
    """What a prediction run wrote.

    Attributes
    ----------
    files : list[str]
        Files written by this rank (only domain sources write).
    indices : list[int]
        Dataset indices this rank's domain group predicted.
    failed : dict[int, str]
        Indices skipped under ``on_error="skip"``, with their error.
    """

    files: list[str] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)


def record_stem(record_id: Any, index: int) -> str:
    """The file-name stem of one record's outputs (the one naming rule of every writer).

    Parameters
    ----------
    record_id : Any
        The record's id (``str(record_id)`` is used); ``None`` or ``""``: none.
    index : int
        The sample's dataset index, for a record without an id.

    Returns
    -------
    str
        ``sample_<index:06d>`` without an id; otherwise the id with every run of characters
        other than ``A-Z a-z 0-9 . _ -`` replaced by ``_``. A result longer than
        :data:`MAX_STEM` is cut to ``MAX_STEM - HASH_CHARS - 1`` characters and ends in
        ``-`` and the first :data:`HASH_CHARS` hex digits of the SHA-256 of the whole id,
        so it is deterministic, fits any file system's name limit with a suffix, and two
        long ids that share their beginning still differ. A writer adds its suffix
        (``.npz``, ``_model_0.cif``, ...) of at most ``255 - MAX_STEM - 19`` characters.
    """
    if record_id is None or str(record_id) == "":
        return f"sample_{index:06d}"
    text = str(record_id)
    stem = _SAFE.sub("_", text)
    if len(stem) > MAX_STEM:
        digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
        stem = f"{stem[: MAX_STEM - HASH_CHARS - 1]}-{digest[:HASH_CHARS]}"
    return stem


def output_name(record_id: Any, index: int) -> str:
    """File name of a sample's prediction: ``record_stem(record_id, index) + ".npz"``."""
    return record_stem(record_id, index) + ".npz"


def dataset_record_ids(dataset: Any) -> list[Any]:
    """The record id of every sample: ``dataset.record_id(i)``, else ``dataset[i]["record_id"]``."""
    if callable(getattr(dataset, "record_id", None)):
        return [dataset.record_id(i) for i in range(len(dataset))]
    ids = []
    for i in range(len(dataset)):
        sample = dataset[i]
        ids.append(sample.get("record_id") if isinstance(sample, dict) else None)
    return ids


def output_names(record_ids: Sequence[Any]) -> list[str]:
    """The file name of every sample (by index), each used once.

    Raises
    ------
    OutputNameError
        When two samples get the same name (the same id, or ids equal once made
        file-safe, such as ``a/b`` and ``a_b``), naming both.
    """
    names = [output_name(r, i) for i, r in enumerate(record_ids)]
    first: dict[str, int] = {}
    for i, name in enumerate(names):
        if name in first:
            j = first[name]
            raise OutputNameError(
                f"samples {j} (record id {_shown(record_ids[j])}) and {i} (record id "
                f"{_shown(record_ids[i])}) would both be written to {name}: record ids must "
                "stay distinct once made file-safe; nothing was written"
            )
        first[name] = i
    return names


def _shown(record_id: Any) -> str:
    text = repr(record_id)
    return text if len(text) <= 80 else f"{text[:60]}...({len(str(record_id))} characters)"


def is_prediction_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a regular file holding exactly what :func:`write_distogram` writes.

    Reads the zip directory only (nothing is decompressed).
    """
    path = Path(path)
    if path.is_symlink() or not path.is_file():
        return False
    try:
        with zipfile.ZipFile(path) as archive:
            return set(archive.namelist()) == PREDICTION_MEMBERS
    except (OSError, zipfile.BadZipFile):
        return False


def check_out_dir(out_dir: str | os.PathLike, names: Sequence[str], overwrite: bool) -> None:
    """Refuse a planned prediction file that is already in ``out_dir`` (reads only).

    Parameters
    ----------
    out_dir : path
        The prediction directory (it need not exist).
    names : sequence of str
        The planned file names (:func:`output_names`).
    overwrite : bool
        Replace earlier predictions of this project; a file that is not one (a user's, a
        symlink) is refused all the same.

    Raises
    ------
    OutputExistsError
        Naming the directory and the first files at fault.
    """
    out_dir = Path(out_dir)
    if os.path.lexists(out_dir) and not out_dir.is_dir():
        raise OutputExistsError(
            f"predict out_dir {out_dir} is not a directory: nothing was written"
        )
    if not out_dir.is_dir():
        return
    present = [n for n in names if os.path.lexists(out_dir / n)]
    if not present:
        return
    foreign = [n for n in present if not is_prediction_file(out_dir / n)]
    if overwrite and not foreign:
        return
    shown = foreign if overwrite else present
    listing = ", ".join(shown[:5]) + (f" and {len(shown) - 5} more" if len(shown) > 5 else "")
    if overwrite:
        raise OutputExistsError(
            f"predict out_dir {out_dir} holds {len(shown)} file(s) under the names this run "
            f"writes that are not predictions this project wrote ({listing}): refused even "
            "with overwrite, so that no file of yours is replaced; nothing was written"
        )
    raise OutputExistsError(
        f"predict out_dir {out_dir} already holds {len(shown)} of the files this run writes "
        f"({listing}): nothing was written; pass overwrite=True (predict.overwrite=true) to "
        "replace earlier predictions, or choose another out_dir"
    )


def planned_names(
    dataset: Any, mesh: FoldMesh, out_dir: str | os.PathLike | None = None, overwrite: bool = False
) -> list[str]:
    """:func:`output_names` decided on rank 0, the same names or error on every rank.

    With ``out_dir``, the names are also checked against the files there
    (:func:`check_out_dir`).
    """

    def plan() -> list[str]:
        names = output_names(dataset_record_ids(dataset))
        if out_dir is not None:
            check_out_dir(out_dir, names, overwrite)
        return names

    return on_rank_zero(plan, "planning the prediction files")


def serial_distogram(pdistogram: torch.Tensor, features: Mapping[str, Any]) -> torch.Tensor:
    """The distogram of one sample in the serial token layout, ``[N, N, bins]`` float32.

    Collective over the domain group when ``pdistogram`` is a ShardTensor (one all-gather
    of the tile, through ``full_tensor()``).

    Parameters
    ----------
    pdistogram : torch.Tensor
        ``[1, N_padded, N_padded, bins]`` logits: a plain tensor, or the
        ``(Shard(1), Shard(2))`` tile.
    features : Mapping[str, Any]
        The sample the model read (a :class:`~physicsnemo_foldcp.ShardedFeatures` carries
        the plan that undoes per-shard padding).
    """
    full = pdistogram.full_tensor() if isinstance(pdistogram, ShardTensor) else pdistogram
    full = full.detach()[0]
    if isinstance(features, ShardedFeatures):
        full = features.plan.from_padded(full, (TOKENS, TOKENS, None))
    return full.float().cpu()


def write_distogram(path: str | os.PathLike, distogram: torch.Tensor, record_id: Any) -> Path:
    """Write ``{"pdistogram": [N, N, bins] float32, "record_id": str}`` as ``.npz`` (atomically)."""

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.savez(f, pdistogram=distogram.numpy(), record_id=np.array(str(record_id)))

    return write_atomic(path, write)


def read_distogram(path: str | os.PathLike) -> torch.Tensor:
    """The ``pdistogram`` array of a file written by :func:`write_distogram`."""
    with np.load(path) as data:
        return torch.from_numpy(data["pdistogram"].copy())


@torch.no_grad()
def predict_item(
    model: nn.Module,
    item: ShardedSample,
    *,
    precision: str = "fp32",
    output_key: str = "pdistogram",
) -> torch.Tensor | None:
    """The serial-layout distogram of one loader item (every rank of its domain).

    Parameters
    ----------
    model : nn.Module
        The model, in eval mode, synced over the domain group.
    item : ShardedSample
        From an inference :class:`~physicsnemo_foldcp.data.ShardedLoader`.
    precision : {"fp32", "tf32", "bf16"}, default "fp32"
        Numerics of the forward pass (autocast for ``bf16``).
    output_key : str, default "pdistogram"
        Entry of the model's output dict.

    Returns
    -------
    torch.Tensor or None
        ``[N, N, bins]`` on every rank of the domain (:func:`serial_distogram`); ``None``
        for a padding item or a skipped sample.
    """
    if item.is_padding or not item.has_features:
        return None
    features = item.features
    check_batch(features)
    parameter = next(model.parameters(), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    with autocast(precision, device):
        outputs = model(**features)
    return serial_distogram(outputs[output_key], features)


def write_prediction(
    out_dir: str | os.PathLike,
    names: Sequence[str],
    item: ShardedSample,
    distogram: torch.Tensor,
) -> Path:
    """Write ``item``'s distogram as ``<out_dir>/<names[item.index]>`` (the domain source)."""
    name = names[int(item.index)]
    return write_distogram(Path(out_dir) / name, distogram, item.record_id or item.index)


def predict(
    model: nn.Module,
    mesh: FoldMesh,
    dataset: Any,
    out_dir: str | os.PathLike,
    *,
    registry: FeatureRegistry | None = None,
    precision: str = "fp32",
    loader_options: Mapping[str, Any] | None = None,
    output_key: str = "pdistogram",
    overwrite: bool = False,
) -> PredictionResult:
    """Predict every sample of ``dataset`` once and write its distogram (call on every rank).

    Parameters
    ----------
    model : nn.Module
        The serial model with its trained weights (unwrapped); synced over the domain
        group from its source before the first sample.
    mesh : FoldMesh
        From :func:`physicsnemo_foldcp.init_mesh`.
    dataset : map-style dataset
        Serial, batched samples (``[1, ...]``) with a ``record_id``.
    out_dir : path
        Directory of the ``<record_id>.npz`` files.
    registry : FeatureRegistry, optional
        Axis meanings of the features (Boltz-2 preset by default).
    precision : {"fp32", "tf32", "bf16"}, default "fp32"
        Numerics of the forward pass.
    loader_options : Mapping, optional
        Further :class:`~physicsnemo_foldcp.data.ShardedLoader` arguments.
    output_key : str, default "pdistogram"
        Entry of the model's output dict to write.
    overwrite : bool, default False
        Replace prediction files of an earlier run in ``out_dir`` instead of refusing them
        (files that are not this project's predictions are refused all the same).

    Returns
    -------
    PredictionResult
        Files written by this rank, indices predicted, samples skipped.

    Raises
    ------
    OutputNameError
        Before anything is written, when two samples would write the same file.
    OutputExistsError
        Before anything is written, when a file to write is already in ``out_dir`` (see
        :func:`check_out_dir`).
    """
    names = planned_names(dataset, mesh, out_dir, overwrite)
    set_precision(precision)
    model = model.to(mesh.device)
    sync_over_domain(model, mesh)
    model.eval()
    loader = ShardedLoader(
        dataset, mesh, mode="inference", registry=registry, **dict(loader_options or {})
    )
    result = PredictionResult()
    for item in loader:
        if not item.is_padding and not item.has_features:
            result.failed[int(item.index)] = str(item.error)
            continue
        distogram = predict_item(model, item, precision=precision, output_key=output_key)
        if distogram is None:
            continue
        result.indices.append(int(item.index))
        if mesh.is_domain_source:
            path = write_prediction(out_dir, names, item, distogram)
            result.files.append(str(path))
    if mesh.rank == 0:
        logger.info("wrote %d distogram(s) to %s (rank 0)", len(result.files), out_dir)
    return result


__all__ = [
    "HASH_CHARS",
    "MAX_STEM",
    "PREDICTION_MEMBERS",
    "OutputExistsError",
    "OutputNameError",
    "PredictionResult",
    "check_out_dir",
    "dataset_record_ids",
    "is_prediction_file",
    "output_name",
    "output_names",
    "planned_names",
    "predict",
    "predict_item",
    "read_distogram",
    "record_stem",
    "serial_distogram",
    "write_distogram",
    "write_prediction",
]
