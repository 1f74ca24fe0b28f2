"""Checkpoints of a training run: model, optimizer, data position and RNG, for exact resume.

One file per checkpoint, ``<dir>/step_<k>.pt``, written by global rank 0:

* ``model`` / ``optimizer``: full (unsharded) state dicts keyed by parameter name, taken
  with ``torch.distributed.checkpoint.state_dict.get_state_dict``, so a checkpoint is the
  same whatever the wrapper (none, DDP, FSDP2) and loads into any of them;
* ``loader``: the :class:`~physicsnemo_foldcp.data.ShardedLoader` position (epoch, steps
  consumed, order signature);
* ``rng``: every rank's CPU (and CUDA) generator state, Python's and NumPy's, by global
  rank;
* ``step``, ``mesh`` shape, ``world_size`` and an optional ``extra`` dict (the run's
  configuration, losses so far).

Saving is collective (FSDP2 gathers its shards; the RNG states are gathered); loading
reads the file on every rank.
"""

from __future__ import annotations

import os
import random
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from physicsnemo_foldcp.distributed.mesh import FoldMesh

CHECKPOINT_PATTERN = re.compile(r"^step_(\d+)\.pt$")
"""File names of checkpoints: ``step_<k>.pt``."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be found, read, or applied to this run."""


def checkpoint_path(directory: str | os.PathLike, step: int) -> Path:
    """``<directory>/step_<step:08d>.pt``."""
    return Path(directory) / f"step_{step:08d}.pt"


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The checkpoint of the highest step in ``directory``, or ``None`` if there is none."""
    root = Path(directory)
    if not root.is_dir():
        return None
    found = [
        (int(m.group(1)), p) for p in root.iterdir() if (m := CHECKPOINT_PATTERN.match(p.name))
    ]
    return max(found)[1] if found else None


def rng_state() -> dict[str, Any]:
    """This process's generator states: torch CPU (and CUDA), Python ``random``, NumPy."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _options() -> StateDictOptions:
    return StateDictOptions(full_state_dict=True, cpu_offload=True)


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
    """Write the checkpoint of ``step`` (collective: call on every rank).

    Parameters
    ----------
    directory : path
        Where to write ``step_<step>.pt`` (created on rank 0 if missing).
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
        Anything else to keep (picklable).

    Returns
    -------
    Path
        The file written (on every rank).
    """
    model_state, optim_state = get_state_dict(model, optimizer, options=_options())
    rngs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rngs, rng_state())
    path = checkpoint_path(directory, step)
    if dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "step": int(step),
            "model": model_state,
            "optimizer": optim_state,
            "loader": dict(loader_state) if loader_state is not None else None,
            "rng": rngs,
            "mesh": mesh.shape,
            "world_size": dist.get_world_size(),
            "extra": dict(extra or {}),
        }
        tmp = path.with_suffix(".tmp")
        torch.save(payload, tmp)
        os.replace(tmp, path)
    dist.barrier()
    return path


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint into a (wrapped) model and optimizer, on every rank.

    Parameters
    ----------
    path : path
        A file written by :func:`save_checkpoint`.
    model : nn.Module
        The model, wrapped as for training (none, DDP or FSDP2).
    optimizer : torch.optim.Optimizer, optional
        Its optimizer; ``None`` loads the model only (prediction).
    restore_rng : bool, default True
        Restore this rank's generator states (when the world size matches).

    Returns
    -------
    dict[str, Any]
        The checkpoint's ``step``, ``loader`` state, ``mesh``, ``world_size`` and ``extra``.

    Raises
    ------
    CheckpointError
        If the file is missing or unreadable, or its parameters do not fit the model.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:
        raise CheckpointError(f"cannot read checkpoint {path}: {err}") from err
    options = StateDictOptions(full_state_dict=True, strict=True)
    try:
        if optimizer is None:
            set_model_state_dict(model, payload["model"], options=options)
        else:
            set_state_dict(
                model,
                optimizer,
                model_state_dict=payload["model"],
                optim_state_dict=payload["optimizer"],
                options=options,
            )
    except (RuntimeError, KeyError, ValueError) as err:
        raise CheckpointError(
            f"checkpoint {path} does not fit this model/optimizer: {err}"
        ) from err
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if restore_rng:
        if payload.get("world_size") == world and payload.get("rng"):
            set_rng_state(payload["rng"][rank])
        else:
            warnings.warn(
                f"checkpoint {path} was written by {payload.get('world_size')} ranks, this run "
                f"has {world}: random generator states are not restored",
                stacklevel=2,
            )
    return {k: payload.get(k) for k in ("step", "loader", "mesh", "world_size", "extra")}


__all__ = [
    "CHECKPOINT_PATTERN",
    "CheckpointError",
    "checkpoint_path",
    "latest_checkpoint",
    "load_checkpoint",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
]
