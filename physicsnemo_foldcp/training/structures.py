"""Structure prediction: Boltz-2 over a dataset, written by Boltz's own writer.

For every sample, each domain group runs ``Boltz2Model.predict_step``
(:class:`~physicsnemo_foldcp.models.boltz2.Boltz2Model`) on the scattered features; the
prediction is brought to the group's source rank (:func:`prediction_at_source`) and
written there by ``boltz.data.write.writer.BoltzWriter`` as ``boltz predict`` writes it,
under ``<out_dir>/<record id>/``: ``<id>_model_<k>.cif`` (or ``.pdb``) ranked by
confidence, ``confidence_<id>_model_<k>.json``, ``plddt_<id>_model_<k>.npz`` and, when
``predict_args`` asks for them, ``pae_...npz`` / ``pde_...npz``.

What moves to the source: the coordinates are already plain on every rank; token vectors
(pLDDT ``[M, N]``) are all-gathered over ``cp0`` (O(N)); the ``N x N`` maps (PAE, PDE) come
tile by tile, point to point, into one buffer on the source, so no other rank ever holds
more than its own tile. The trunk's ``s`` and ``z`` are not moved (Boltz writes them only
with ``--write_embeddings``, which is refused here).

Each record's samples are drawn from ``torch.manual_seed(seed + index)`` on every rank of
its domain: the serial ``Boltz2.predict_step`` of record ``index`` after the same seed
gives the same structures.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from physicsnemo.domain_parallel import ShardTensor
from torch import nn

from physicsnemo_foldcp.core.blocks import (
    COLUMNS,
    ROWS,
    ShardingLayoutError,
    block,
    local_of,
    mesh_ranks,
    mesh_sizes,
)
from physicsnemo_foldcp.core.compat import global_shape
from physicsnemo_foldcp.core.whole import whole_of_rows
from physicsnemo_foldcp.data.loader import ShardedLoader
from physicsnemo_foldcp.distributed.mesh import FoldMesh
from physicsnemo_foldcp.distributed.wrappers import sync_over_domain
from physicsnemo_foldcp.features.registry import FeatureRegistry
from physicsnemo_foldcp.training.loop import autocast, set_precision
from physicsnemo_foldcp.training.predict import PredictionResult

logger = logging.getLogger("physicsnemo_foldcp.training")

#: ``predict_step`` outputs that are not written (the trunk's representations).
NOT_WRITTEN = ("s", "z")
#: Output formats of Boltz's writer.
OUTPUT_FORMATS = ("mmcif", "pdb")


#: The longest file name most file systems take (bytes).
NAME_MAX = 255


class OutputDirError(FileExistsError):
    """A record's output directory is already there; nothing was written for it."""


class OutputNameTooLong(ValueError):
    """A record id makes a file name Boltz's writer cannot write; nothing was written."""


def check_structure_outputs(
    record_ids: list[str], out_dir: str | os.PathLike, samples: int, overwrite: bool
) -> None:
    """Refuse, before any prediction, what Boltz's writer could not write or would replace.

    Boltz's writer names each file after the record id (``confidence_<id>_model_<k>.json``
    is the longest); the names cannot be changed without changing Boltz's layout, so an id
    too long for the file system is refused, as is a record directory already in
    ``out_dir`` (unless ``overwrite``). Every rank reads the same directory and raises
    alike.

    Raises
    ------
    OutputNameTooLong
        Naming the record and the length.
    OutputDirError
        Naming the existing directory.
    """
    for record_id in record_ids:
        longest = f"confidence_{record_id}_model_{max(samples - 1, 0)}.json"
        if len(longest.encode()) > NAME_MAX:
            raise OutputNameTooLong(
                f"record id {record_id[:40]!r}... ({len(record_id)} characters) makes Boltz's "
                f"file name {len(longest.encode())} bytes long, over {NAME_MAX}: rename the "
                "input"
            )
        target = Path(out_dir) / record_id
        if (target.exists() or target.is_symlink()) and not overwrite:
            raise OutputDirError(
                f"{target} already exists: predict.overwrite=true replaces its structure files"
            )


def tile_at_source(x: ShardTensor) -> torch.Tensor | None:
    """A pair tile ``(Shard(d), Shard(d + 1))`` whole on the domain source, None elsewhere.

    Every other rank of the domain sends its local tile to the source (point to point);
    the source places each into one buffer of the global shape. Block sizes come from the
    tile's sharding shapes (no host sync, no collective of the whole).
    """
    mesh = x.device_mesh
    rows_dim, cols_dim = x.placements[ROWS].dim, x.placements[COLUMNS].dim
    row_sizes = mesh_sizes(x, ROWS, rows_dim)
    col_sizes = mesh_sizes(x, COLUMNS, cols_dim)
    ranks = mesh_ranks(mesh)
    source = ranks[0][0]
    local = local_of(x).detach().contiguous()
    if dist.get_rank() != source:
        dist.send(local, dst=source)
        return None
    full = local.new_empty(global_shape(x))
    for i, row in enumerate(ranks):
        for j, rank in enumerate(row):
            r0, rn = block(row_sizes, i)
            c0, cn = block(col_sizes, j)
            target = full.narrow(rows_dim, r0, rn).narrow(cols_dim, c0, cn)
            if rank == source:
                target.copy_(local)
            else:
                shape = list(local.shape)
                shape[rows_dim], shape[cols_dim] = rn, cn
                received = local.new_empty(shape)
                dist.recv(received, src=rank)
                target.copy_(received)
    return full


def prediction_at_source(prediction: Mapping[str, Any], is_source: bool) -> dict[str, Any] | None:
    """``predict_step``'s output as plain tensors on the domain source (call on every rank).

    Row-sharded tensors are all-gathered over ``cp0``, tiles go to the source
    (:func:`tile_at_source`), plain values stay; :data:`NOT_WRITTEN` are dropped.

    Returns
    -------
    dict or None
        On the source, the prediction as Boltz's writer reads it; None elsewhere.
    """

    def convert(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {k: convert(v) for k, v in value.items()}
        if not isinstance(value, ShardTensor):
            return value
        sharded = [p for p in value.placements if p.is_shard()]
        if len(sharded) == 2:
            return tile_at_source(value)
        if len(sharded) == 1 and value.placements[ROWS].is_shard():
            return whole_of_rows(value)
        if not sharded:
            return local_of(value)
        raise ShardingLayoutError(f"prediction: no move to the source for {value.placements}")

    out = {k: convert(v) for k, v in prediction.items() if k not in NOT_WRITTEN}
    return out if is_source else None


def write_structures(
    prediction: Mapping[str, Any],
    record: Any,
    structures_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    output_format: str = "mmcif",
    overwrite: bool = False,
) -> Path:
    """Write one record's prediction with Boltz's own writer (the domain source).

    Parameters
    ----------
    prediction : Mapping[str, Any]
        :func:`prediction_at_source`'s output.
    record : boltz.data.types.Record
        The record (``batch["record"][0]`` of Boltz's loader).
    structures_dir : path
        Boltz's ``processed/structures`` (holds ``<id>.npz``).
    out_dir : path
        Where ``<record id>/`` is written.
    output_format : {"mmcif", "pdb"}
        As ``boltz predict --output_format``.
    overwrite : bool
        Replace an existing ``<out_dir>/<record id>/`` (only the files Boltz's writer
        writes there are replaced).

    Returns
    -------
    Path
        ``<out_dir>/<record id>``.

    Raises
    ------
    OutputDirError
        When ``<out_dir>/<record id>`` exists and ``overwrite`` is False.
    """
    from boltz.data.write.writer import BoltzWriter

    if output_format not in OUTPUT_FORMATS:
        raise ValueError(f"output_format must be one of {OUTPUT_FORMATS}, got {output_format!r}")
    target = Path(out_dir) / str(record.id)
    if target.exists() and not overwrite:
        raise OutputDirError(
            f"{target} already exists: predict.overwrite=true replaces its structure files"
        )
    writer = BoltzWriter(
        data_dir=str(structures_dir),
        output_dir=str(out_dir),
        output_format=output_format,
        boltz2=True,
    )
    writer.write_on_batch_end(None, None, dict(prediction), None, {"record": [record]}, 0, 0)
    return target


def predict_structures(
    model: nn.Module,
    mesh: FoldMesh,
    dataset: Any,
    out_dir: str | os.PathLike,
    *,
    registry: FeatureRegistry | None = None,
    precision: str = "fp32",
    loader_options: Mapping[str, Any] | None = None,
    output_format: str = "mmcif",
    overwrite: bool = False,
    seed: int = 0,
) -> PredictionResult:
    """Predict every record of ``dataset`` once and write it as Boltz does (every rank).

    Parameters
    ----------
    model : Boltz2Model
        With its weights; synced over the domain group from its source first.
    mesh : FoldMesh
        From :func:`physicsnemo_foldcp.init_mesh`.
    dataset : BoltzInputs
        Boltz-2 inference samples with their ``record`` and a ``structures_dir``.
    out_dir : path
        Where each record's directory is written.
    registry : FeatureRegistry, optional
        Axis meanings of the features (Boltz-2 preset by default).
    precision : {"fp32", "tf32", "bf16"}, default "fp32"
        Numerics of the trunk (the sampler runs in float32, as in Boltz).
    loader_options : Mapping, optional
        Further :class:`~physicsnemo_foldcp.data.ShardedLoader` arguments.
    output_format : {"mmcif", "pdb"}, default "mmcif"
        The structure files' format.
    overwrite : bool, default False
        Replace records' directories of an earlier run.
    seed : int, default 0
        Record ``index`` is sampled after ``torch.manual_seed(seed + index)``.

    Returns
    -------
    PredictionResult
        The record directories written by this rank, indices predicted, samples skipped.
    """
    if output_format not in OUTPUT_FORMATS:
        raise ValueError(f"output_format must be one of {OUTPUT_FORMATS}, got {output_format!r}")
    structures_dir = getattr(dataset, "structures_dir", None)
    if structures_dir is None:
        raise ValueError(
            "predict_structures: the dataset has no structures_dir (Boltz's processed "
            "structures); use data=boltz_inputs"
        )
    record_ids = [str(dataset.record_id(i)) for i in range(len(dataset))]
    samples = int(model.config.predict_args["diffusion_samples"])
    check_structure_outputs(record_ids, out_dir, samples, overwrite)
    set_precision(precision)
    model = model.to(mesh.device)
    sync_over_domain(model, mesh)
    model.eval()
    loader = ShardedLoader(
        dataset, mesh, mode="inference", registry=registry, **dict(loader_options or {})
    )
    result = PredictionResult()
    for item in loader:
        if item.is_padding:
            continue
        if not item.has_features:
            result.failed[int(item.index)] = str(item.error)
            continue
        features = item.features
        torch.manual_seed(seed + int(item.index))
        with autocast(precision, mesh.device):
            prediction = model.predict_step(features)
        at_source = prediction_at_source(prediction, mesh.is_domain_source)
        result.indices.append(int(item.index))
        if at_source is not None:
            record = features["record"][0]
            path = write_structures(
                at_source, record, structures_dir, out_dir, output_format, overwrite
            )
            result.files.append(str(path))
    if mesh.rank == 0:
        logger.info("wrote %d structure prediction(s) to %s (rank 0)", len(result.files), out_dir)
    return result


__all__ = [
    "NOT_WRITTEN",
    "OUTPUT_FORMATS",
    "NAME_MAX",
    "OutputDirError",
    "OutputNameTooLong",
    "check_structure_outputs",
    "predict_structures",
    "prediction_at_source",
    "tile_at_source",
    "write_structures",
]
