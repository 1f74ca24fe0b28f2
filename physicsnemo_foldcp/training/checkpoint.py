"""Checkpoints of a training run: sharded model and optimizer, data position, step and RNG.

One directory per checkpoint, ``<dir>/step_<k:08d>/``:

* the model and optimizer tensors, written with ``torch.distributed.checkpoint`` (DCP):
  each rank writes its part (under FSDP2 its shards, nothing is gathered), keyed by
  parameter name (``model.<fqn>``, ``optimizer.state.<fqn>.<name>``), so a checkpoint
  loads into any wrapper (none, DDP, FSDP2) on any mesh, resharded by DCP;
* ``state.pt`` (:data:`STATE_NAME`), plain data and tensors only: ``step``, the mesh
  shape and world size it was written on, the optimizer's ``param_groups`` (and any other
  non-tensor optimizer state), the :class:`~physicsnemo_foldcp.data.ShardedLoader`
  position, every rank's random generator states
  (:mod:`~physicsnemo_foldcp.training.rng_state`) and ``extra`` (e.g. the run's
  configuration).

Saving is collective: every rank writes its DCP part into ``.step_<k>.tmp/``; after a
barrier rank 0 adds ``state.pt`` and renames the directory to ``step_<k>/``, so a
``step_<k>/`` directory is always complete.

Loading never unpickles arbitrary objects: ``state.pt`` is read with
``torch.load(weights_only=True)``, DCP's ``.metadata`` with an unpickler that resolves only
DCP's metadata records (:mod:`~physicsnemo_foldcp.training.safe_dcp`), and non-tensor DCP
entries are refused. Anything else given as a checkpoint (a file, a directory without
these two files, a crafted pickle) is refused with :class:`CheckpointError` before any of
it is read.

Random generators are restored exactly on the same mesh shape, and by ``ddp`` replica on
another one (see :mod:`~physicsnemo_foldcp.training.rng_state`).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from physicsnemo_foldcp.distributed.errors import on_rank_zero
from physicsnemo_foldcp.distributed.mesh import FoldMesh
from physicsnemo_foldcp.training.atomic import (
    replace_directory,
    temporary_sibling,
)
from physicsnemo_foldcp.training.rng_state import gather_job_rng, restore_job_rng
from physicsnemo_foldcp.training.safe_dcp import (
    METADATA_NAME,
    SafeReader,
    TensorOnlyLoadPlanner,
    UnsafeCheckpointError,
    non_tensor_entries,
    read_metadata,
)

logger = logging.getLogger("physicsnemo_foldcp.training")

CHECKPOINT_PATTERN = re.compile(r"^step_(\d+)$")
"""Directory names of checkpoints: ``step_<k>``."""

STATE_NAME = "state.pt"
"""The plain-data file of a checkpoint directory (read with ``weights_only=True``)."""

FORMAT_VERSION = 2
"""Version of the checkpoint layout (1: one pickled ``step_<k>.pt`` file, no longer read)."""

PLAIN_TYPES = (str, int, float, bool, type(None))


class CheckpointError(RuntimeError):
    """A checkpoint cannot be found, read, or applied to this run."""


def checkpoint_path(directory: str | os.PathLike, step: int) -> Path:
    """``<directory>/step_<step:08d>``, the checkpoint directory of ``step``."""
    return Path(directory) / f"step_{step:08d}"


def list_checkpoints(directory: str | os.PathLike) -> dict[int, Path]:
    """Step -> checkpoint directory, for every complete ``step_<k>/`` in ``directory``."""
    root = Path(directory)
    if not root.is_dir():
        return {}
    found = {}
    for p in root.iterdir():
        m = CHECKPOINT_PATTERN.match(p.name)
        if m and p.is_dir() and (p / STATE_NAME).is_file() and (p / METADATA_NAME).is_file():
            found[int(m.group(1))] = p
    return dict(sorted(found.items()))


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The checkpoint of the highest step in ``directory``, or ``None`` if there is none."""
    found = list_checkpoints(directory)
    return found[max(found)] if found else None


def split_plain(tree: Mapping[str, Any], where: str = "") -> tuple[dict, dict]:
    """Split a nested state dict into its tensors and its plain values (same nesting).

    Raises
    ------
    CheckpointError
        For a value that is neither a tensor, a mapping, nor plain data that
        ``torch.load(weights_only=True)`` reads back.
    """
    tensors: dict[str, Any] = {}
    plain: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{where}.{key}" if where else str(key)
        if isinstance(value, torch.Tensor):
            tensors[key] = value
        elif isinstance(value, Mapping):
            t, p = split_plain(value, name)
            if t:
                tensors[key] = t
            if p:
                plain[key] = p
        else:
            check_plain(value, name)
            plain[key] = value
    return tensors, plain


def check_plain(value: Any, where: str) -> None:
    """Raise :class:`CheckpointError` unless ``value`` is plain data (or CPU tensors)."""
    if isinstance(value, PLAIN_TYPES) or isinstance(value, torch.Tensor):
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                raise CheckpointError(f"{where}: key {k!r} is not a str or int")
            check_plain(v, f"{where}.{k}")
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_plain(v, f"{where}[{i}]")
        return
    raise CheckpointError(
        f"{where} is a {type(value).__name__}: a checkpoint keeps tensors and plain data "
        "(str, int, float, bool, None, lists, tuples, dicts) only"
    )


def merge_plain(tensors: Mapping[str, Any], plain: Mapping[str, Any]) -> dict[str, Any]:
    """Undo :func:`split_plain`."""
    out: dict[str, Any] = dict(tensors)
    for key, value in plain.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge_plain(out[key], value)
        else:
            out[key] = value
    return out


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, Mapping):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(
    directory: str | os.PathLike,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    mesh: FoldMesh,
    *,
    loader_state: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write the checkpoint of ``step`` as ``<directory>/step_<step>/`` (collective).

    Parameters
    ----------
    directory : path
        Where ``step_<step>/`` goes (created if missing).
    step : int
        Optimizer steps taken so far.
    model : nn.Module
        The (wrapped) model being trained.
    optimizer : torch.optim.Optimizer
        Its optimizer.
    mesh : FoldMesh
        The job's mesh.
    loader_state : Mapping, optional
        ``ShardedLoader.state_dict()`` after the step.
    extra : Mapping, optional
        Anything else to keep: plain data (str, int, float, bool, None, lists, dicts) and
        tensors only, so that it loads with ``weights_only=True``.

    Returns
    -------
    Path
        The checkpoint directory (on every rank).

    Raises
    ------
    CheckpointError
        When ``extra`` or the loader state holds anything but plain data (checked before
        anything is written).
    """
    final = checkpoint_path(directory, step)
    write_checkpoint(final, step, model, optimizer, mesh, loader_state=loader_state, extra=extra)
    return final


def write_checkpoint(
    path: str | os.PathLike,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    mesh: FoldMesh,
    *,
    loader_state: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Write a checkpoint directory at ``path``, whatever its name (collective).

    The layout and parameters are those of :func:`save_checkpoint`, which names the
    directory ``step_<k>``; an existing checkpoint at ``path`` is replaced. With
    ``optimizer=None`` only the model is written (``load_checkpoint`` with an optimizer
    then refuses it: the optimizer's tensors are missing).
    """
    extra = dict(extra or {})
    loader = dict(loader_state) if loader_state is not None else None
    check_plain(extra, "extra")
    check_plain(loader, "loader state")
    if optimizer is None:
        model_state, optim_state = get_model_state_dict(model), {}
    else:
        model_state, optim_state = get_state_dict(model, optimizer, options=StateDictOptions())
    model_tensors, model_plain = split_plain(model_state, "model")
    optim_tensors, optim_plain = split_plain(optim_state, "optimizer")
    rng = gather_job_rng(mesh)
    final = Path(path)
    tmp = temporary_sibling(final, unique=False)

    def make_room() -> None:
        final.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a save that did not finish
            shutil.rmtree(tmp)

    def finish() -> None:
        payload = {
            "format": FORMAT_VERSION,
            "step": int(step),
            "mesh": list(mesh.shape),
            "world_size": int(mesh.world_size),
            "model_plain": _to_cpu(model_plain),
            "optimizer_plain": _to_cpu(optim_plain),
            "loader": loader,
            "rng": rng,
            "extra": _to_cpu(extra),
        }
        torch.save(payload, tmp / STATE_NAME)
        replace_directory(tmp, final)

    on_rank_zero(make_room, f"preparing checkpoint {final}")
    dcp.save(
        {"model": model_tensors, "optimizer": optim_tensors},
        storage_writer=FileSystemWriter(str(tmp)),
    )
    _barrier()
    on_rank_zero(finish, f"writing checkpoint {final}")


def read_state(path: str | os.PathLike) -> dict[str, Any]:
    """The plain-data part of the checkpoint at ``path`` (``state.pt``), safely.

    Raises
    ------
    CheckpointError
        When ``path`` is not a checkpoint directory, or ``state.pt`` holds anything but
        tensors and plain data (a crafted pickle is refused, not run).
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}")
    if (
        not path.is_dir()
        or not (path / STATE_NAME).is_file()
        or not (path / METADATA_NAME).is_file()
    ):
        kind = "a file" if path.is_file() else "a directory without state.pt and .metadata"
        raise CheckpointError(
            f"{path} is {kind}, not a checkpoint: a checkpoint is a step_<k>/ directory "
            f"written by save_checkpoint (DCP files, {METADATA_NAME} and {STATE_NAME}); "
            "other files are not read (an older step_<k>.pt pickle is not loaded)"
        )
    try:
        state = torch.load(path / STATE_NAME, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unpickling failure
        raise CheckpointError(
            f"cannot read {path / STATE_NAME} with weights_only=True (refused, nothing in it "
            f"was run): {str(err).splitlines()[0]}"
        ) from err
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path / STATE_NAME} is not a format-{FORMAT_VERSION} checkpoint state "
            f"(format {state.get('format') if isinstance(state, dict) else None!r})"
        )
    return state


def _checked_metadata(path: Path, prefixes: tuple[str, ...]) -> Any:
    try:
        metadata = read_metadata(path)
    except (UnsafeCheckpointError, OSError) as err:
        raise CheckpointError(f"cannot read checkpoint {path}: {err}") from err
    pickled = non_tensor_entries(metadata, prefixes)
    if pickled:
        raise CheckpointError(
            f"checkpoint {path} stores {pickled[:3]} as pickled data, not tensors: refused"
        )
    return metadata


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    mesh: FoldMesh | None = None,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint into a (wrapped) model and optimizer (collective: every rank).

    Parameters
    ----------
    path : path
        A ``step_<k>/`` directory written by :func:`save_checkpoint`, on any mesh and
        with any wrapper.
    model : nn.Module
        The model, wrapped as for training (none, DDP or FSDP2), or unwrapped.
    optimizer : torch.optim.Optimizer, optional
        Its optimizer; ``None`` loads the model only (prediction).
    mesh : FoldMesh, optional
        This job's mesh; needed to restore the random generators.
    restore_rng : bool, default True
        Restore the generator states: each rank's own on the checkpoint's mesh shape, by
        ``ddp`` replica on another (see :mod:`~physicsnemo_foldcp.training.rng_state`).

    Returns
    -------
    dict[str, Any]
        The checkpoint's ``step``, ``loader`` state, ``mesh``, ``world_size`` and ``extra``.

    Raises
    ------
    CheckpointError
        If ``path`` is not a checkpoint directory, a file in it is unsafe or unreadable,
        or its tensors do not fit the model/optimizer (missing, extra or of another shape).
    """
    path = Path(path)
    state = read_state(path)
    prefixes = ("model.",) if optimizer is None else ("model.", "optimizer.")
    metadata = _checked_metadata(path, prefixes)
    if optimizer is None:
        model_state = get_model_state_dict(model)
        optim_state: dict[str, Any] = {}
    else:
        model_state, optim_state = get_state_dict(model, optimizer)
    model_tensors, _ = split_plain(model_state, "model")
    optim_tensors, _ = split_plain(optim_state, "optimizer")
    stored = {k[len("model.") :] for k in metadata.state_dict_metadata if k.startswith("model.")}
    extra_keys = sorted(stored - set(model_tensors))
    if extra_keys:
        raise CheckpointError(
            f"checkpoint {path} has parameters this model does not: {extra_keys[:5]}"
        )
    request = {"model": model_tensors}
    if optimizer is not None:
        request["optimizer"] = optim_tensors
    try:
        dcp.load(
            request, storage_reader=SafeReader(path, metadata), planner=TensorOnlyLoadPlanner()
        )
    except Exception as err:  # noqa: BLE001 - DCP wraps per-rank errors in its own type
        raise CheckpointError(
            f"checkpoint {path} (step {state['step']}, mesh {tuple(state['mesh'])}) does not "
            f"fit this model/optimizer: {str(err).strip().splitlines()[-1][:500]}"
        ) from err
    options = StateDictOptions(strict=True)
    model_full = merge_plain(request["model"], state["model_plain"])
    try:
        if optimizer is None:
            set_model_state_dict(model, model_full, options=options)
        else:
            optim_full = merge_plain(request["optimizer"], state["optimizer_plain"])
            set_state_dict(
                model,
                optimizer,
                model_state_dict=model_full,
                optim_state_dict=optim_full,
                options=options,
            )
    except (RuntimeError, KeyError, ValueError) as err:
        raise CheckpointError(
            f"checkpoint {path} does not fit this model/optimizer: {err}"
        ) from err
    if restore_rng:
        _restore_rng(path, state, mesh)
    return {k: state.get(k) for k in ("step", "loader", "mesh", "world_size", "extra")}


def _restore_rng(path: Path, state: Mapping[str, Any], mesh: FoldMesh | None) -> None:
    if mesh is None:
        warnings.warn(
            f"checkpoint {path}: no mesh given, random generator states are not restored",
            stacklevel=3,
        )
        return
    why = restore_job_rng(state["rng"], mesh)
    if tuple(state["mesh"]) != tuple(mesh.shape) and mesh.rank == 0:
        logger.info(
            "checkpoint %s was written on mesh %s, this run is on %s: random generators "
            "restored by ddp replica (each domain group takes the states of the "
            "checkpoint's replica of the same index)",
            path,
            tuple(state["mesh"]),
            tuple(mesh.shape),
        )
    if why is not None and mesh.is_domain_source:
        warnings.warn(f"checkpoint {path}: {why}", stacklevel=3)


__all__ = [
    "CHECKPOINT_PATTERN",
    "FORMAT_VERSION",
    "STATE_NAME",
    "CheckpointError",
    "checkpoint_path",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "read_state",
    "save_checkpoint",
    "write_checkpoint",
]
