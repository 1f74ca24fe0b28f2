"""Checkpoints of a training run: sharded model and optimizer, data position, step and RNG.

One directory per checkpoint, ``<dir>/step_<k:08d>/``:

* the model and optimizer tensors, written with ``torch.distributed.checkpoint`` (DCP):
  each rank writes its part (under FSDP2 its shards, nothing is gathered), keyed by
  parameter name (``model.<fqn>``, ``optimizer.state.<fqn>.<name>``), so a checkpoint
  loads into any wrapper (none, DDP, FSDP2) on any mesh, resharded by DCP; with an
  exponential moving average of the weights
  (:class:`~physicsnemo_foldcp.training.ema.WeightAverage`), its tensors too
  (``ema.<fqn>``), keyed and resharded like the model's;
* ``state.pt`` (:data:`STATE_NAME`), plain data and tensors only: ``step``, the mesh
  shape and world size it was written on, the optimizer's ``param_groups`` (and any other
  non-tensor optimizer state), the :class:`~physicsnemo_foldcp.data.ShardedLoader`
  position, every rank's random generator states
  (:mod:`~physicsnemo_foldcp.training.rng_state`), ``extra`` (e.g. the run's
  configuration) and ``ema_step``, the step the average last took in (absent without
  an average).

Saving is collective: every rank writes its DCP part into ``.step_<k>.tmp.<id>/`` (a
name unique to this save, chosen by rank 0, so two jobs never share one); after a barrier
rank 0 adds ``state.pt`` and renames the directory to ``step_<k>/``, so a ``step_<k>/``
directory is always complete. A temporary directory left by a save that did not finish is
deleted when the next run takes the directory's lock
(:func:`~physicsnemo_foldcp.training.rundir.remove_leftovers`).

Loading never unpickles arbitrary objects: ``state.pt`` is read with
``torch.load(weights_only=True)``, DCP's ``.metadata`` with an unpickler that resolves only
DCP's metadata records (:mod:`~physicsnemo_foldcp.training.safe_dcp`), and non-tensor DCP
entries are refused. Anything else given as a checkpoint (a file, a directory without
these two files, a crafted pickle) is refused with :class:`CheckpointError` before any of
it is read. A checkpoint is untrusted input: only regular files directly inside its
directory are read, within the size and count limits of
:mod:`~physicsnemo_foldcp.training.safe_dcp` and :data:`MAX_STATE_BYTES`; ``state.pt``
must be complete and of its directory's step; the whole checkpoint is read into fresh
tensors and checked (fit, finite values unless ``allow_nonfinite``) before anything is
copied into the model or the optimizer; every failure is one :class:`CheckpointError`
naming the file, raised on every rank.

Random generators are restored exactly on the same mesh shape, and by ``ddp`` replica on
another one (see :mod:`~physicsnemo_foldcp.training.rng_state`).
"""

from __future__ import annotations

import io
import logging
import os
import random
import re
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.nn.parallel import DistributedDataParallel

from physicsnemo_foldcp.distributed.errors import on_every_rank, on_rank_zero
from physicsnemo_foldcp.distributed.mesh import FoldMesh
from physicsnemo_foldcp.training.atomic import (
    replace_directory,
    temporary_sibling,
)
from physicsnemo_foldcp.training.ema import WeightAverage
from physicsnemo_foldcp.training.rng_state import gather_job_rng, restore_job_rng
from physicsnemo_foldcp.training.safe_dcp import (
    METADATA_NAME,
    CheckpointFiles,
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

MAX_STATE_BYTES = 256 * 2**20
"""Largest ``state.pt`` read (every rank's generator states take about 20 kB)."""

PLAIN_TYPES = (str, int, float, bool, type(None))

LOADED_WEIGHTS = ("model", "ema", "auto")
"""What :func:`load_checkpoint` puts into the model (see its ``weights``)."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be found, read, or applied to this run."""


def _state_dict_owner(model: nn.Module) -> nn.Module:
    """The module whose state is saved and loaded: the wrapped one of a DDP model.

    ``get_model_state_dict`` strips DDP's ``module.`` prefix, but ``set_model_state_dict``
    maps keys back through ``named_parameters()``, which lists a module registered under
    two names once; its second name then keeps no prefix and a strict load fails (Boltz's
    ``DiffusionTransformerLayer`` registers its output projection twice). The wrapped
    module holds the same parameters under the same, unprefixed names. FSDP2 does not
    wrap the module, so it is its own owner.

    Parameters
    ----------
    model : nn.Module
        The model as trained: plain, FSDP2-sharded or wrapped in DDP.

    Returns
    -------
    nn.Module
        ``model.module`` for a ``DistributedDataParallel``, else ``model``.
    """
    return model.module if isinstance(model, DistributedDataParallel) else model


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
    ema: WeightAverage | None = None,
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
    ema : WeightAverage, optional
        The run's moving average of the weights, stored beside them.

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
    write_checkpoint(
        final, step, model, optimizer, mesh, loader_state=loader_state, extra=extra, ema=ema
    )
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
    ema: WeightAverage | None = None,
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
    model = _state_dict_owner(model)
    if optimizer is None:
        model_state, optim_state = get_model_state_dict(model), {}
    else:
        model_state, optim_state = get_state_dict(model, optimizer, options=StateDictOptions())
    model_tensors, model_plain = split_plain(model_state, "model")
    optim_tensors, optim_plain = split_plain(optim_state, "optimizer")
    rng = gather_job_rng(mesh)
    final = Path(path)

    def make_room() -> str:
        final.parent.mkdir(parents=True, exist_ok=True)
        return str(temporary_sibling(final))  # unique to this save: rank 0 names it for all

    tmp = Path(on_rank_zero(make_room, f"preparing checkpoint {final}"))

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
        if ema is not None:
            payload["ema_step"] = ema.step
        torch.save(payload, tmp / STATE_NAME)
        replace_directory(tmp, final)

    tensors = {"model": model_tensors, "optimizer": optim_tensors}
    if ema is not None:
        tensors["ema"] = ema.weights
    dcp.save(tensors, storage_writer=FileSystemWriter(str(tmp)))
    _barrier()
    on_rank_zero(finish, f"writing checkpoint {final}")


def read_state(path: str | os.PathLike) -> dict[str, Any]:
    """The plain-data part of the checkpoint at ``path`` (``state.pt``), safely.

    ``state.pt`` is read as a regular file of the directory (not a link, at most
    :data:`MAX_STATE_BYTES`) with ``torch.load(weights_only=True)``; its ``format`` and its
    ``step`` are checked, and in a ``step_<k>/`` directory the step must be ``k``.

    Raises
    ------
    CheckpointError
        When ``path`` is not a checkpoint directory, ``state.pt`` is unsafe or unreadable,
        holds anything but tensors and plain data (a crafted pickle is refused, not run), or
        claims another step than its directory's name. The message names the file.
    """
    return _read_state(CheckpointFiles(_checkpoint_directory(path)))


def _checkpoint_directory(path: str | os.PathLike) -> Path:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}")
    if not path.is_dir() or not (path / STATE_NAME).exists() or not (path / METADATA_NAME).exists():
        kind = "a file" if path.is_file() else "a directory without state.pt and .metadata"
        raise CheckpointError(
            f"{path} is {kind}, not a checkpoint: a checkpoint is a step_<k>/ directory "
            f"written by save_checkpoint (DCP files, {METADATA_NAME} and {STATE_NAME}); "
            "other files are not read (an older step_<k>.pt pickle is not loaded)"
        )
    return path


def _read_state(files: CheckpointFiles) -> dict[str, Any]:
    file = files.shown(STATE_NAME)
    try:
        data = files.read(STATE_NAME, MAX_STATE_BYTES, "MAX_STATE_BYTES")
    except UnsafeCheckpointError as err:
        raise CheckpointError(str(err)) from err
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unpickling failure
        first = next(iter(str(err).strip().splitlines()), "")[:300]
        raise CheckpointError(
            f"{file}: cannot be read with weights_only=True (refused, nothing in it was "
            f"run): {type(err).__name__}{': ' + first if first else ''}"
        ) from err
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"{file} is not a format-{FORMAT_VERSION} checkpoint state "
            f"(format {state.get('format') if isinstance(state, dict) else None!r})"
        )
    step = state.get("step")
    if type(step) is not int or step < 0:
        raise CheckpointError(f"{file}: 'step' is {_kind(state, 'step')}, not an int >= 0: refused")
    named = CHECKPOINT_PATTERN.match(files.directory.name)
    if named and int(named.group(1)) != step:
        raise CheckpointError(
            f"{file}: says step {step}, but its directory {files.directory.name} is the "
            f"checkpoint of step {int(named.group(1))}: refused (a state file of another "
            "checkpoint?)"
        )
    return state


def _kind(state: Mapping[str, Any], key: str) -> str:
    return "missing" if key not in state else f"a {type(state[key]).__name__}"


STATE_FIELDS: dict[str, tuple[type, ...]] = {
    "mesh": (list, tuple),
    "world_size": (int,),
    "model_plain": (Mapping,),
    "optimizer_plain": (Mapping,),
    "loader": (Mapping, type(None)),
    "rng": (Mapping,),
    "extra": (Mapping,),
}
"""The entries of ``state.pt`` besides ``format`` and ``step``, and the types they have."""


def _check_state(state: Mapping[str, Any], file: Path) -> None:
    """Every entry :func:`write_checkpoint` writes, of its type (the message names the key)."""
    for key, kinds in STATE_FIELDS.items():
        if key not in state or not isinstance(state[key], kinds):
            expected = " or ".join("None" if k is type(None) else k.__name__ for k in kinds)
            raise CheckpointError(
                f"{file}: {key!r} is {_kind(state, key)}, expected {expected}: an incomplete "
                "checkpoint state, refused"
            )
    shape = state["mesh"]
    if len(shape) != 3 or not all(type(n) is int and n >= 1 for n in shape):
        raise CheckpointError(f"{file}: 'mesh' is {shape!r}, not (ddp, cp0, cp1): refused")


def _check_rng(saved: Mapping[str, Any], mesh: FoldMesh, file: Path) -> None:
    """The generator states this rank will take are complete (tried on spare generators)."""
    try:
        states, sources = saved["states"], saved["replica_sources"]
        if not isinstance(states, (list, tuple)) or not isinstance(sources, (list, tuple)):
            raise TypeError("'states' and 'replica_sources' must be lists")
        if tuple(saved["mesh"]) == tuple(mesh.shape) and len(states) == mesh.world_size:
            index = mesh.rank
        elif mesh.ddp_rank >= len(sources):
            return
        else:
            index = sources[mesh.ddp_rank]
        if type(index) is not int or not 0 <= index < len(states):
            raise IndexError(f"no state {index!r} among {len(states)}")
        state = states[index]
        torch.Generator().set_state(state["torch"])
        version, internal, gauss = state["python"]
        random.Random().setstate((int(version), tuple(int(v) for v in internal), gauss))
        numpy = state["numpy"]
        np.random.RandomState().set_state(
            (
                numpy["name"],
                numpy["key"].numpy().astype(np.uint32),
                int(numpy["pos"]),
                int(numpy["has_gauss"]),
                float(numpy["cached_gaussian"]),
            )
        )
        cuda = state.get("cuda")
        if cuda is not None and (
            not isinstance(cuda, torch.Tensor) or cuda.dtype != torch.uint8 or cuda.dim() != 2
        ):
            raise TypeError("'cuda' is not a [devices, n] uint8 tensor")
        if cuda is not None and cuda.shape[0] > torch.cuda.device_count():
            raise ValueError(
                f"'cuda' holds {cuda.shape[0]} device states, this rank sees "
                f"{torch.cuda.device_count()} devices"
            )
    except Exception as err:  # noqa: BLE001 - any malformed record
        raise CheckpointError(
            f"{file}: 'rng' cannot restore the generators of rank {mesh.rank}: "
            f"{type(err).__name__}: {err}: refused"
        ) from err


def _checked_metadata(files: CheckpointFiles, prefixes: tuple[str, ...]) -> Any:
    try:
        metadata = read_metadata(files)
    except UnsafeCheckpointError as err:
        raise CheckpointError(str(err)) from err
    pickled = non_tensor_entries(metadata, prefixes)
    if pickled:
        raise CheckpointError(
            f"{files.shown(METADATA_NAME)}: stores {pickled[:3]} as pickled data, not "
            "tensors: refused"
        )
    return metadata


def _fresh(tree: Mapping[str, Any]) -> dict[str, Any]:
    """Tensors like those of ``tree`` (same nesting, shapes, placements), not yet written."""
    return {
        k: _fresh(v) if isinstance(v, Mapping) else torch.empty_like(v) for k, v in tree.items()
    }


def _flat(tree: Mapping[str, Any], where: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """``(dcp key, tensor)``: the keys DCP flattens a nested state dict to."""
    for key, value in tree.items():
        name = f"{where}.{key}" if where else str(key)
        if isinstance(value, Mapping):
            yield from _flat(value, name)
        else:
            yield name, value


def _check_fit(files: CheckpointFiles, metadata: Any, request: Mapping[str, Any]) -> None:
    """Every tensor asked for is in the checkpoint, of the same shape; no parameter is extra."""
    source = files.shown(METADATA_NAME)
    entries = metadata.state_dict_metadata
    wanted = dict(_flat(request))
    checked = ("model.", "ema.") if "ema" in request else ("model.",)
    stored = {k for k in entries if k.startswith(checked)}
    extra = sorted(stored - set(wanted))
    if extra:
        raise CheckpointError(
            f"{source}: the checkpoint has parameters this model does not: {extra[:5]}"
        )
    missing = sorted(k for k in wanted if k not in entries)
    if missing:
        raise CheckpointError(
            f"{source}: the checkpoint lacks {len(missing)} tensor(s) this model/optimizer "
            f"has: {missing[:5]}"
        )
    shapes = [
        f"{k} {list(entries[k].size)} (this run: {list(t.shape)})"
        for k, t in wanted.items()
        if tuple(entries[k].size) != tuple(t.shape)
    ]
    if shapes:
        raise CheckpointError(
            f"{source}: tensors of another shape than this model/optimizer's: {shapes[:5]}"
        )


def _check_param_groups(stored: Mapping[str, Any], current: Mapping[str, Any], file: Path) -> None:
    """The optimizer's parameter groups in ``state.pt`` are this optimizer's, same params."""
    saved_groups, groups = stored.get("param_groups"), current.get("param_groups", [])
    if not isinstance(saved_groups, (list, tuple)) or len(saved_groups) != len(groups):
        raise CheckpointError(
            f"{file}: 'optimizer_plain.param_groups' is "
            f"{_describe_groups(saved_groups)}, this optimizer has {len(groups)} group(s)"
        )
    for i, (saved, group) in enumerate(zip(saved_groups, groups)):
        where = f"{file}: 'optimizer_plain.param_groups[{i}]'"
        if not isinstance(saved, Mapping):
            raise CheckpointError(f"{where} is a {type(saved).__name__}, not a mapping")
        params = saved.get("params")
        if not isinstance(params, (list, tuple)) or sorted(map(str, params)) != sorted(
            map(str, group.get("params", []))
        ):
            raise CheckpointError(
                f"{where} holds other parameters than group {i} of this optimizer: the "
                "checkpoint does not fit this optimizer"
            )
        for key, value in group.items():
            theirs = saved.get(key, value)
            if isinstance(value, (int, float, torch.Tensor)) and not isinstance(value, bool):
                ok = isinstance(theirs, (int, float, torch.Tensor)) and not isinstance(theirs, bool)
            elif isinstance(value, bool):
                ok = isinstance(theirs, bool)
            else:
                ok = True
            if not ok:
                raise CheckpointError(
                    f"{where}: {key!r} is a {type(theirs).__name__}, this optimizer's is a "
                    f"{type(value).__name__}"
                )


def _describe_groups(groups: Any) -> str:
    if isinstance(groups, (list, tuple)):
        return f"{len(groups)} group(s)"
    return "missing" if groups is None else f"a {type(groups).__name__}"


def _dcp_failure(err: BaseException) -> str:
    """The first rank's own error inside DCP's ``CheckpointException`` (or ``err``)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, Mapping) and failures:
        rank = min(failures)
        inner = failures[rank]
        inner = inner[0] if isinstance(inner, tuple) and inner else inner
        text = " ".join(str(inner).split()) or type(inner).__name__
        return f"{text[:800]} (rank {rank})"
    return " ".join(str(err).split())[:800] or type(err).__name__


def _nonfinite_message(files: CheckpointFiles, metadata: Any, records: list[Any]) -> str:
    where = []
    for index in records[:3]:
        info = metadata.storage_data.get(index)
        name = files.shown(info.relative_path) if info is not None else files.directory
        where.append(f"{name}: entry {index.fqn} (chunk at {list(index.offset or ())})")
    more = f" and {len(records) - 3} more record(s)" if len(records) > 3 else ""
    return (
        f"{'; '.join(where)}{more}: NaN or infinite values: refused "
        "(load_checkpoint(..., allow_nonfinite=True) loads them anyway)"
    )


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    mesh: FoldMesh | None = None,
    restore_rng: bool = True,
    allow_nonfinite: bool = False,
    ema: WeightAverage | None = None,
    weights: str = "model",
) -> dict[str, Any]:
    """Load a checkpoint into a (wrapped) model and optimizer (collective: every rank).

    The whole checkpoint is read and checked before the model or the optimizer is touched:
    ``state.pt`` and ``.metadata`` (see :func:`read_state`,
    :mod:`~physicsnemo_foldcp.training.safe_dcp`), the shard files (regular files of the
    directory, long enough), the fit of every tensor (present, same shape), the optimizer's
    parameter groups and, when restoring them, this rank's generator states; then the
    tensors are read into fresh tensors (which costs a second copy of the model and
    optimizer state for the length of the load) and checked for NaN and infinite values;
    only then are they copied into the model and the optimizer. A failure on any rank
    raises the same :class:`CheckpointError` on every rank.

    Parameters
    ----------
    path : path
        A ``step_<k>/`` directory written by :func:`save_checkpoint` (or any directory
        :func:`write_checkpoint` wrote), on any mesh and with any wrapper.
    model : nn.Module
        The model, wrapped as for training (none, DDP or FSDP2), or unwrapped.
    optimizer : torch.optim.Optimizer, optional
        Its optimizer; ``None`` loads the model only (prediction).
    mesh : FoldMesh, optional
        This job's mesh; needed to restore the random generators.
    restore_rng : bool, default True
        Restore the generator states: each rank's own on the checkpoint's mesh shape, by
        ``ddp`` replica on another (see :mod:`~physicsnemo_foldcp.training.rng_state`).
    allow_nonfinite : bool, default False
        Load tensors holding NaN or infinite values instead of refusing them.
    ema : WeightAverage, optional
        The run's moving average of the weights, restored from the checkpoint's (which
        must have one).
    weights : {"model", "ema", "auto"}, default "model"
        What goes into the model: the trained weights, their moving average (the
        checkpoint must have one), or the average when the checkpoint has one (for
        prediction, as Boltz's EMA callback predicts with it).

    Returns
    -------
    dict[str, Any]
        The checkpoint's ``step``, ``loader`` state, ``mesh``, ``world_size``, ``extra`` and
        ``ema_step`` (``None`` without an average), and ``weights``: ``"model"`` or
        ``"ema"``, what the model now holds.

    Raises
    ------
    CheckpointError
        On every rank, naming the file and the problem, when ``path`` is not a checkpoint
        directory, a file in it is unsafe, unreadable or incomplete, its tensors do not fit
        the model/optimizer (missing, extra or of another shape) or hold non-finite values.
        The model and the optimizer are then as they were (an optimizer that has not
        stepped yet holds the zero state ``get_state_dict`` gives it).
    """
    path = Path(path)
    if weights not in LOADED_WEIGHTS:
        raise ValueError(f"weights must be one of {LOADED_WEIGHTS}, got {weights!r}")
    prefixes = ("model.", "ema.") if optimizer is None else ("model.", "optimizer.", "ema.")

    def read_files() -> tuple[dict[str, Any], CheckpointFiles, Any]:
        files = CheckpointFiles(_checkpoint_directory(path))
        state = _read_state(files)
        metadata = _checked_metadata(files, prefixes)
        _check_state(state, files.shown(STATE_NAME))
        if restore_rng and mesh is not None:
            _check_rng(state["rng"], mesh, files.shown(STATE_NAME))
        return state, files, metadata

    state, files, metadata = on_every_rank(read_files, f"reading checkpoint {path}")
    model = _state_dict_owner(model)
    if optimizer is None:
        model_state = get_model_state_dict(model)
        optim_state: dict[str, Any] = {}
    else:
        model_state, optim_state = get_state_dict(model, optimizer)

    def plan() -> dict[str, Any]:
        model_tensors, _ = split_plain(model_state, "model")
        optim_tensors, optim_plain = split_plain(optim_state, "optimizer")
        request = {"model": _fresh(model_tensors)}
        if optimizer is not None:
            request["optimizer"] = _fresh(optim_tensors)
        _check_fit(files, metadata, request)
        if optimizer is not None:
            _check_param_groups(state["optimizer_plain"], optim_plain, files.shown(STATE_NAME))
        return request

    has_ema = "ema_step" in state
    use_ema = has_ema and weights != "model"

    def plan_average() -> None:
        if not has_ema and (ema is not None or weights == "ema"):
            wanted = "restore" if ema is not None else "load"
            raise CheckpointError(
                f"{files.shown(STATE_NAME)}: no moving average of the weights to {wanted} "
                "(the run that wrote it kept none: train.ema_decay = 0)"
            )
        if ema is not None or use_ema:
            request["ema"] = _fresh(split_plain(model_state, "model")[0])
            _check_fit(files, metadata, request)

    request = on_every_rank(plan, f"checking checkpoint {path} against the model")
    on_every_rank(plan_average, f"checking checkpoint {path} against the model")
    planner = TensorOnlyLoadPlanner()

    def read() -> None:
        try:
            dcp.load(request, storage_reader=SafeReader(files, metadata), planner=planner)
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP's own type too
            raise CheckpointError(
                f"checkpoint {path} (step {state['step']}) cannot be loaded: {_dcp_failure(err)}"
            ) from None
        if not allow_nonfinite:
            records = planner.nonfinite_records()
            if records:
                raise CheckpointError(_nonfinite_message(files, metadata, records))

    on_every_rank(read, f"reading checkpoint {path}")

    def apply() -> None:
        options = StateDictOptions(strict=True)
        loaded = request["ema"] if use_ema else request["model"]
        model_full = merge_plain(loaded, state["model_plain"])
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
        except (RuntimeError, KeyError, ValueError, TypeError) as err:
            raise CheckpointError(
                f"checkpoint {path} does not fit this model/optimizer: {err}"
            ) from err

    on_every_rank(apply, f"loading checkpoint {path}")
    if ema is not None:
        ema.load_state_dict({"step": state["ema_step"], "weights": request["ema"]})
    if restore_rng:
        on_every_rank(lambda: _restore_rng(path, state, mesh), f"restoring generators of {path}")
    info = {k: state.get(k) for k in ("step", "loader", "mesh", "world_size", "extra", "ema_step")}
    return {**info, "weights": "ema" if use_ema else "model"}


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
    "MAX_STATE_BYTES",
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
