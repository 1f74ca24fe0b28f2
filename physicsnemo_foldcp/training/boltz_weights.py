"""Boltz-2's released weights (a Lightning ``.ckpt``), read as untrusted input.

A Lightning checkpoint is a ``torch.save`` pickle: the model's ``state_dict``, its
``hyper_parameters`` (``Boltz2.__init__``'s arguments) and Lightning's own entries (epoch,
loops, callback and optimizer states). Unpickling it as Lightning and ``boltz predict`` do
(without ``weights_only``) runs whatever code the file names; nothing here does. Here
(:func:`read_boltz_weights`):

* the file is opened as a regular file of its directory (not a symbolic link, FIFO or
  device) and refused when larger than ``max_bytes`` (:data:`MAX_WEIGHTS_BYTES` by default)
  before anything is read (:class:`~physicsnemo_foldcp.training.safe_dcp.CheckpointFiles`,
  the rule every checkpoint of the package is read under);
* it must be a ``torch.save`` archive whose records are stored uncompressed (as
  ``torch.save`` writes them), so the tensors it holds take no more memory than the file;
* it is unpickled with ``torch.serialization.load(..., weights_only=True)``, allowing
  besides torch's own records only :data:`WEIGHTS_GLOBALS`: the records of the Hydra
  (omegaconf) configs that Boltz's training saves as hyperparameters. A file that names
  any other global is refused with the names and how to re-save its weights as plain
  records (where loading that file is acceptable). ``torch.load``
  itself is not called: ``boltz predict`` replaces it in its process by one that turns
  ``weights_only`` off;
* the state dict must map names to dense tensors, with finite values (unless
  ``allow_nonfinite``); the ``_orig_mod`` parts that ``torch.compile`` adds to names (a
  leading ``_orig_mod.`` for a compiled model, ``pairformer_module._orig_mod.`` for
  Boltz's ``compile_pairformer``) are removed (:func:`strip_compile_prefix`).

:func:`boltz2_model` builds :class:`~physicsnemo_foldcp.models.boltz2.Boltz2Model` from the
checkpoint itself (its hyperparameters through
:func:`~physicsnemo_foldcp.models.boltz2_hparams.boltz2_config_from_hparams`, with the
prediction settings of the project's config) and loads the weights with ``strict=True``;
:func:`convert_boltz_weights` writes that model as the project's own checkpoint directory
(:func:`~physicsnemo_foldcp.training.checkpoint.write_checkpoint`, read by
:func:`~physicsnemo_foldcp.training.checkpoint.load_checkpoint`), with its config in the
checkpoint's ``extra`` (:func:`boltz2_config_from_checkpoint`). The command line is
``python -m physicsnemo_foldcp.cli.convert_boltz_weights``.
"""

from __future__ import annotations

import collections
import os
import pickle
import re
import typing
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import torch
import torch.distributed as dist
from omegaconf import DictConfig, ListConfig
from omegaconf.base import ContainerMetadata, Metadata
from omegaconf.nodes import AnyNode

from physicsnemo_foldcp.distributed.bootstrap import init_mesh, shutdown
from physicsnemo_foldcp.distributed.mesh import FoldMesh
from physicsnemo_foldcp.models.boltz2_config import Boltz2Config
from physicsnemo_foldcp.models.boltz2_hparams import (
    HyperparameterError,
    boltz2_config_from_hparams,
)
from physicsnemo_foldcp.training.checkpoint import (
    STATE_NAME,
    CheckpointError,
    read_state,
    write_checkpoint,
)
from physicsnemo_foldcp.training.safe_dcp import CheckpointFiles, UnsafeCheckpointError

if TYPE_CHECKING:
    from physicsnemo_foldcp.models.boltz2 import Boltz2Model

MAX_WEIGHTS_BYTES = 16 * 2**30
"""Largest weights file read by default (16 GiB). Boltz-2's ``boltz2_conf.ckpt`` is a few
GB; the bound keeps a crafted file from taking the host's memory. Pass ``max_bytes``
(``--max-bytes``) for a larger one."""

COMPILE_PART = "_orig_mod"
"""The name part ``torch.compile``'s wrapper adds to the parameter names it holds."""

CONVERT_COMMAND = "python -m physicsnemo_foldcp.cli.convert_boltz_weights"
"""The conversion command (named in refusals)."""

WEIGHTS_GLOBALS: tuple[Any, ...] = (
    # Boltz trains from a Hydra config and hands its sections to Boltz2.__init__ as they
    # are, so the released checkpoint's hyper_parameters hold omegaconf containers: the
    # mapping and the list. Unpickling one calls its __setstate__, which only stores the
    # given dicts (nothing is resolved or imported); they are read back with
    # OmegaConf.to_container(resolve=False).
    DictConfig,
    ListConfig,
    # The metadata of each container and of each node (dataclasses, rebuilt by setting
    # their fields).
    ContainerMetadata,
    Metadata,
    # The node that holds each leaf value of a config composed from YAML.
    AnyNode,
    # Values of the metadata's type fields: typing.Any (ref_type, key_type, element_type of
    # untyped configs), int (a list's key_type), dict and list (object_type). dict is also
    # the factory of the resolver cache below. Calling them builds plain containers only.
    typing.Any,
    dict,
    list,
    int,
    # The metadata's resolver cache: collections.defaultdict(dict), empty.
    collections.defaultdict,
)
"""The globals, besides torch's own tensor records, that a weights file may name: no more
than a Lightning checkpoint of Boltz's ``Boltz2`` with Hydra-config hyperparameters needs
(a checkpoint with plain-dict hyperparameters needs none of them)."""


@dataclass(frozen=True)
class BoltzWeights:
    """What :func:`read_boltz_weights` read from a Lightning checkpoint.

    Attributes
    ----------
    path : Path
        The file.
    size : int
        Its size in bytes.
    state_dict : dict[str, torch.Tensor]
        The model's tensors, ``_orig_mod`` parts removed from the names, on the CPU.
    hyper_parameters : dict[str, Any]
        The checkpoint's ``hyper_parameters`` as unpickled (``{}`` when it has none).
    compiled_keys : int
        How many names had ``_orig_mod`` parts removed.
    """

    path: Path
    size: int
    state_dict: dict[str, torch.Tensor]
    hyper_parameters: dict[str, Any]
    compiled_keys: int


def read_boltz_weights(
    path: str | os.PathLike,
    *,
    max_bytes: int = MAX_WEIGHTS_BYTES,
    allow_nonfinite: bool = False,
) -> BoltzWeights:
    """The state dict and hyperparameters of a Lightning checkpoint, read safely.

    Parameters
    ----------
    path : path
        A Lightning ``.ckpt`` (e.g. Boltz's ``~/.boltz/boltz2_conf.ckpt``).
    max_bytes : int
        Larger files are refused before they are read.
    allow_nonfinite : bool, default False
        Accept tensors holding NaN or infinite values.

    Returns
    -------
    BoltzWeights
        The tensors (names without ``_orig_mod`` parts) and the hyperparameters.

    Raises
    ------
    CheckpointError
        Naming the file: missing, not a regular file of its directory, larger than
        ``max_bytes``, not a ``torch.save`` archive of stored records, naming a global
        outside :data:`WEIGHTS_GLOBALS` (the names and the conversion command are given;
        nothing in the file was run), without a ``state_dict`` of tensors, with names that
        clash once ``_orig_mod`` is removed, or with non-finite values.
    """
    path = Path(path)
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    files = CheckpointFiles(path.parent)
    try:
        stream, size = files.open(path.name, max_bytes, "max_bytes")
    except UnsafeCheckpointError as err:
        raise CheckpointError(str(err)) from None
    with stream:
        _check_archive(stream, size, path)
        checkpoint = _unpickle(stream, path)
    if not isinstance(checkpoint, Mapping) or not isinstance(checkpoint.get("state_dict"), Mapping):
        kind = type(checkpoint).__name__
        raise CheckpointError(
            f"{path}: holds a {kind} without a 'state_dict' mapping, not a Lightning checkpoint"
        )
    hparams = checkpoint.get("hyper_parameters", {})
    if not isinstance(hparams, Mapping):
        raise CheckpointError(
            f"{path}: 'hyper_parameters' is a {type(hparams).__name__}, not a mapping"
        )
    state, renamed = strip_compile_prefix(checkpoint["state_dict"], path)
    _check_tensors(state, path, allow_nonfinite)
    return BoltzWeights(path, size, state, dict(hparams), renamed)


def _check_archive(stream: BinaryIO, size: int, path: Path) -> None:
    """A ``torch.save`` zip archive whose records are stored, at most ``size`` bytes in all."""
    try:
        if not zipfile.is_zipfile(stream):
            raise CheckpointError(
                f"{path}: not a torch.save archive (a zip file); files in torch's legacy "
                "format are not read: load and save it again with a current torch, in a "
                "trusted environment"
            )
        stream.seek(0)
        with zipfile.ZipFile(stream) as archive:
            records = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as err:
        raise CheckpointError(f"{path}: not a readable zip archive: {err}") from None
    packed = [r.filename for r in records if r.compress_type != zipfile.ZIP_STORED]
    if packed:
        raise CheckpointError(
            f"{path}: records {packed[:3]} are compressed, which torch.save never writes: "
            "refused (their size is not bounded by the file's)"
        )
    total = sum(r.file_size for r in records)
    if total > size:
        raise CheckpointError(
            f"{path}: its records claim {total} bytes, more than the file's {size}: refused"
        )
    stream.seek(0)


def _unpickle(stream: BinaryIO, path: Path) -> Any:
    present = torch.serialization.get_safe_globals()
    added = [g for g in WEIGHTS_GLOBALS if g not in present]  # leave the host's own list
    with torch.serialization.safe_globals(added):
        try:
            return torch.serialization.load(stream, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            names = _unsafe_globals(stream, err)
            if not names:
                raise CheckpointError(
                    f"{path}: cannot be read with weights_only=True (refused, nothing in it "
                    f"was run): {_first_line(err)}"
                ) from None
            raise CheckpointError(
                f"{path}: refers to {', '.join(names)}, outside the globals a weights file "
                "may use (WEIGHTS_GLOBALS: torch's tensor records and the omegaconf config "
                "records of Boltz's hyperparameters): refused, nothing in it was run. If "
                "the file comes from a source you trust, re-save it where loading it is "
                "acceptable as {'state_dict': ..., 'hyper_parameters': ...} of plain tensors, "
                f"dicts, lists and numbers, then run {CONVERT_COMMAND} on that file"
            ) from None
        except Exception as err:  # noqa: BLE001 - any unreadable file
            raise CheckpointError(
                f"{path}: cannot be read with weights_only=True (refused, nothing in it was "
                f"run): {_first_line(err)}"
            ) from None


_GLOBAL_IN_MESSAGE = re.compile(r"GLOBAL ([\w.]+)")


def _unsafe_globals(stream: BinaryIO, err: BaseException) -> list[str]:
    """The globals of the pickle outside the allowed ones (statically, nothing run)."""
    try:
        stream.seek(0)
        found = torch.serialization.get_unsafe_globals_in_checkpoint(stream)
    except Exception:  # noqa: BLE001 - fall back on the unpickler's message
        found = _GLOBAL_IN_MESSAGE.findall(str(err))
    return sorted(set(found))


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:300]}" if lines else type(err).__name__


def strip_compile_prefix(
    state_dict: Mapping[str, Any], source: str | os.PathLike = "state_dict"
) -> tuple[dict[str, Any], int]:
    """``state_dict`` with the ``_orig_mod`` name parts of ``torch.compile`` removed.

    Parameters
    ----------
    state_dict : Mapping[str, Any]
        Names -> values; a compiled model's names start with ``_orig_mod.``, a compiled
        submodule's have it after the submodule's name.
    source : path or str
        The file, for messages.

    Returns
    -------
    tuple[dict[str, Any], int]
        The renamed dict (same values, same order) and how many names changed.

    Raises
    ------
    CheckpointError
        For a name that is not a str, or two names that become one.
    """
    out: dict[str, Any] = {}
    renamed = 0
    original: dict[str, str] = {}
    for key, value in state_dict.items():
        if not isinstance(key, str):
            raise CheckpointError(f"{source}: state_dict key {key!r} is not a str")
        name = ".".join(part for part in key.split(".") if part != COMPILE_PART)
        if name in out:
            raise CheckpointError(
                f"{source}: state_dict keys {original[name]!r} and {key!r} are the same "
                f"parameter {name!r} once {COMPILE_PART!r} is removed: refused"
            )
        renamed += name != key
        original[name] = key
        out[name] = value
    return out, renamed


def _check_tensors(state: Mapping[str, Any], path: Path, allow_nonfinite: bool) -> None:
    bad = [
        f"{k} ({type(v).__name__})"
        for k, v in state.items()
        if not isinstance(v, torch.Tensor) or v.layout != torch.strided or v.is_meta
    ]
    if bad:
        raise CheckpointError(
            f"{path}: state_dict entries that are not dense tensors: {bad[:5]}: refused"
        )
    if allow_nonfinite:
        return
    nonfinite = [
        k
        for k, v in state.items()
        if (v.is_floating_point() or v.is_complex()) and not bool(torch.isfinite(v).all())
    ]
    if nonfinite:
        raise CheckpointError(
            f"{path}: state_dict entries with NaN or infinite values: {nonfinite[:5]}: "
            "refused (allow_nonfinite=True, --allow-nonfinite, reads them anyway)"
        )


def weights_config(weights: BoltzWeights, prediction: Boltz2Config | None = None) -> Boltz2Config:
    """The :class:`Boltz2Config` of ``weights``: its architecture, ``prediction``'s settings.

    See :func:`~physicsnemo_foldcp.models.boltz2_hparams.boltz2_config_from_hparams`.

    Raises
    ------
    CheckpointError
        Naming the file and the hyperparameter when they do not make a ``Boltz2Config``.
    """
    if not weights.hyper_parameters:
        raise CheckpointError(
            f"{weights.path}: has no hyper_parameters, so the model cannot be built from it"
        )
    try:
        return boltz2_config_from_hparams(
            weights.hyper_parameters, prediction, source=f"{weights.path}: hyper_parameters"
        )
    except HyperparameterError as err:
        raise CheckpointError(str(err)) from None


def boltz2_model(weights: BoltzWeights, prediction: Boltz2Config | None = None) -> Boltz2Model:
    """A ``Boltz2Model`` built from ``weights``' own hyperparameters, holding its tensors.

    The config is :func:`weights_config`'s; the tensors are loaded with ``strict=True``.

    The names and shapes are compared before anything is copied into the model. The
    model is built (and initialised, as Boltz does, with host memory for each weight)
    before that comparison: hyperparameters that describe a model far larger than the
    file's tensors cost that memory before they are refused.

    Raises
    ------
    CheckpointError
        Naming the file, when the config cannot be built, the model refuses it, or the
        tensors do not fit it (names missing or extra, other shapes).
    """
    from physicsnemo_foldcp.models.boltz2 import Boltz2Model, UnsupportedBoltz2Option

    config = weights_config(weights, prediction)
    try:
        model = Boltz2Model(config)
    except UnsupportedBoltz2Option as err:
        raise CheckpointError(f"{weights.path}: {err}") from None
    except (TypeError, ValueError, KeyError) as err:
        raise CheckpointError(
            f"{weights.path}: the model cannot be built from its hyper_parameters: "
            f"{type(err).__name__}: {err}"
        ) from None
    _check_fit(model.state_dict(), weights)
    model.load_state_dict(weights.state_dict, strict=True)
    return model


def _check_fit(expected: Mapping[str, torch.Tensor], weights: BoltzWeights) -> None:
    given = weights.state_dict
    extra = sorted(set(given) - set(expected))
    missing = sorted(set(expected) - set(given))
    shapes = [
        f"{k} {list(given[k].shape)} (model: {list(v.shape)})"
        for k, v in expected.items()
        if k in given and tuple(given[k].shape) != tuple(v.shape)
    ]
    problems = []
    if missing:
        problems.append(f"lacks {len(missing)} tensor(s) of the model: {missing[:5]}")
    if extra:
        problems.append(f"has {len(extra)} tensor(s) the model does not: {extra[:5]}")
    if shapes:
        problems.append(f"has tensors of other shapes: {shapes[:5]}")
    if problems:
        raise CheckpointError(
            f"{weights.path}: does not fit the Boltz2Model built from its hyper_parameters: "
            + "; ".join(problems)
        )


EXTRA_CONFIG = "boltz2_config"
"""The ``extra`` entry of a converted checkpoint that holds its :class:`Boltz2Config`."""

EXTRA_SOURCE = "converted_from"
"""The ``extra`` entry of a converted checkpoint that names the file it came from."""


def convert_boltz_weights(
    source: str | os.PathLike,
    out: str | os.PathLike,
    *,
    mesh: FoldMesh | None = None,
    prediction: Boltz2Config | None = None,
    max_bytes: int = MAX_WEIGHTS_BYTES,
    allow_nonfinite: bool = False,
) -> Path:
    """Write a Lightning checkpoint of ``Boltz2`` as the project's checkpoint directory.

    The weights are read (:func:`read_boltz_weights`) and loaded into a
    :class:`~physicsnemo_foldcp.models.boltz2.Boltz2Model` built from the checkpoint's own
    hyperparameters (:func:`boltz2_model`) before anything is written; the directory is
    then written by :func:`~physicsnemo_foldcp.training.checkpoint.write_checkpoint`
    (step 0, no optimizer), with the config under ``extra["boltz2_config"]``.

    Parameters
    ----------
    source : path
        The Lightning ``.ckpt``.
    out : path
        The checkpoint directory to write; must not exist.
    mesh : FoldMesh, optional
        The job's mesh; by default a one-process job is started for the write and ended
        after it (a job already started is used, and left running).
    prediction : Boltz2Config, optional
        Where the prediction settings come from (see :func:`weights_config`).
    max_bytes, allow_nonfinite
        As in :func:`read_boltz_weights`.

    Returns
    -------
    Path
        ``out``.

    Raises
    ------
    CheckpointError
        When ``out`` exists, or the weights are refused (see :func:`read_boltz_weights`,
        :func:`boltz2_model`); nothing is written then.
    """
    out = Path(out)
    if out.exists() or out.is_symlink():
        raise CheckpointError(
            f"{out} exists: the conversion writes a new directory and replaces nothing; "
            "choose another name or remove it"
        )
    weights = read_boltz_weights(source, max_bytes=max_bytes, allow_nonfinite=allow_nonfinite)
    model = boltz2_model(weights, prediction)
    extra = {
        EXTRA_CONFIG: model.config.to_dict(),
        EXTRA_SOURCE: {
            "file": weights.path.name,
            "bytes": weights.size,
            "tensors": len(weights.state_dict),
            "compiled_keys": weights.compiled_keys,
        },
    }
    del weights
    started = mesh is None and not dist.is_initialized()
    try:
        mesh = mesh if mesh is not None else init_mesh(ddp=1, cp=(1, 1))
        write_checkpoint(out, 0, model, None, mesh, extra=extra)
    finally:
        if started:
            shutdown()
    return out


def boltz2_config_from_checkpoint(path: str | os.PathLike) -> Boltz2Config:
    """The :class:`Boltz2Config` kept in a checkpoint written by :func:`convert_boltz_weights`.

    Parameters
    ----------
    path : path
        The checkpoint directory (its ``state.pt`` is read with ``weights_only=True``).

    Raises
    ------
    CheckpointError
        Naming ``state.pt`` when it holds no such config, or one that is not valid.
    """
    state = read_state(path)
    where = Path(path) / STATE_NAME
    extra = state.get("extra")
    config = extra.get(EXTRA_CONFIG) if isinstance(extra, Mapping) else None
    if not isinstance(config, Mapping):
        raise CheckpointError(
            f"{where}: has no extra[{EXTRA_CONFIG!r}]: not a checkpoint written by "
            f"{CONVERT_COMMAND}"
        )
    try:
        return Boltz2Config(**config)
    except (TypeError, ValueError) as err:
        raise CheckpointError(
            f"{where}: extra[{EXTRA_CONFIG!r}] is not a Boltz2Config: {err}"
        ) from None


__all__ = [
    "COMPILE_PART",
    "CONVERT_COMMAND",
    "EXTRA_CONFIG",
    "EXTRA_SOURCE",
    "MAX_WEIGHTS_BYTES",
    "WEIGHTS_GLOBALS",
    "BoltzWeights",
    "boltz2_config_from_checkpoint",
    "boltz2_model",
    "convert_boltz_weights",
    "read_boltz_weights",
    "strip_compile_prefix",
    "weights_config",
]
