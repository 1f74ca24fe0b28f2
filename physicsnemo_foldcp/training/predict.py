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
``record_id`` (rank 0 reads every sample once for it). A record id is made file-safe
(characters other than letters, digits, ``.``, ``_`` and ``-`` become ``_``), so two ids
such as ``a/b`` and ``a_b`` would share a file: that, or two samples with one id, is an
:class:`OutputNameError` naming both, raised on every rank before any file is written. Each
file is written under a temporary name and moved into place.
"""

from __future__ import annotations

import logging
import os
import re
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


class OutputNameError(ValueError):
    """Two samples would write the same prediction file; nothing was written."""


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


def output_name(record_id: Any, index: int) -> str:
    """File name of a sample's prediction: its record id (made file-safe), or its index."""
    if record_id is None or str(record_id) == "":
        return f"sample_{index:06d}.npz"
    return _SAFE.sub("_", str(record_id)) + ".npz"


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
                f"samples {j} (record id {record_ids[j]!r}) and {i} (record id "
                f"{record_ids[i]!r}) would both be written to {name}: record ids must stay "
                "distinct once made file-safe; nothing was written"
            )
        first[name] = i
    return names


def planned_names(dataset: Any, mesh: FoldMesh) -> list[str]:
    """:func:`output_names` decided on rank 0, the same names or error on every rank."""
    return on_rank_zero(
        lambda: output_names(dataset_record_ids(dataset)), "planning the prediction files"
    )


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

    Returns
    -------
    PredictionResult
        Files written by this rank, indices predicted, samples skipped.

    Raises
    ------
    OutputNameError
        Before anything is written, when two samples would write the same file.
    """
    names = planned_names(dataset, mesh)
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
    "OutputNameError",
    "PredictionResult",
    "dataset_record_ids",
    "output_name",
    "output_names",
    "planned_names",
    "predict",
    "predict_item",
    "read_distogram",
    "serial_distogram",
    "write_distogram",
    "write_prediction",
]
