"""Run directories: which run a checkpoint directory belongs to, and what a new run may do there.

A run is identified by its *fingerprint*: a hash of what decides its trajectory (the
seed, precision and loss, the optimizer settings, the model's class and parameter shapes,
the dataset's type and length, and the configuration the caller adds, e.g. the Hydra app's
``data``, ``model``, ``optimizer``, ``registry`` and ``sharding`` groups). Options that a
restarted job may change are left out: ``steps``, ``resume``, ``overwrite``, logging,
checkpoint cadence and paths, ``compile``, ``wrapper`` and the mesh.

The first run in a checkpoint directory writes ``<checkpoint_dir>/run.json`` (the
*manifest*: fingerprint, the values hashed, creation time). At the start of every run,
rank 0 compares the directory with the run's fingerprint and ``train.resume``:

===============  ===================================================================
``resume``       what happens
===============  ===================================================================
``auto``         resume from the newest checkpoint when the manifest is this run's;
                 start from scratch when there is no checkpoint; refuse another run's
                 checkpoints (or checkpoints without a manifest)
``latest``       resume from the newest checkpoint whatever run wrote it (the manifest
                 becomes this run's); start from scratch when there is none
a path           resume from that ``step_<k>/``; refuse checkpoints in the directory of
                 another run or of later steps (an abandoned continuation)
``None``         start from scratch; refuse any checkpoint in the directory
===============  ===================================================================

``overwrite=True`` deletes what would be refused instead (logged with its names). The
metrics file follows the checkpoints: on resume at step ``s`` its lines of steps after
``s`` are dropped before new ones are appended (so no step is logged twice); a fresh start
empties it only when it is this run's or ``overwrite`` is set, and refuses it otherwise.
The summary file is treated like the metrics file (it is replaced when the run ends).

The project rewrites or deletes only files it made. The manifest keeps an inventory
(``"files"``: the metrics and summary files of the run, absolute paths); a metrics or
summary file is the project's when an inventory lists it, or, for a file no manifest
lists, when its content is what the project writes (every line a metrics record
``{"step", "loss", "seconds"}``, but for a last line cut short; a summary object with
its keys). Any other file there (a user's), or a symlink or other non-regular file, is
refused by name even with ``overwrite``. Checkpoint directories to delete must be real
directories of the checkpoint directory: a symlinked ``step_<k>`` is refused before
anything is deleted. One run at a time holds the directory
(:mod:`~physicsnemo_foldcp.training.runlock`); under that lock, temporary checkpoint
directories left by a run that died (``.step_<k>.tmp.<id>``) are deleted.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from physicsnemo_foldcp.distributed.errors import on_rank_zero
from physicsnemo_foldcp.training.atomic import write_text_atomic
from physicsnemo_foldcp.training.checkpoint import (
    list_checkpoints,
    read_state,
)

logger = logging.getLogger("physicsnemo_foldcp.training")

MANIFEST_NAME = "run.json"
"""The run manifest of a checkpoint directory."""

SUMMARY_KEYS = frozenset(
    {"start_step", "end_step", "losses", "seconds", "steps_per_s", "peak_memory_bytes"}
)
"""Keys of the summary the training loop writes (how an unlisted summary is recognised)."""

METRICS_KEYS = frozenset({"step", "loss", "seconds"})
"""Keys of every metrics line the training loop writes."""

LEFTOVER_PATTERN = re.compile(r"^\.step_\d+\.tmp(\.[0-9a-f]+)?$")
"""Temporary checkpoint directories of a save that did not finish."""

RESUME_MODES = ("auto", "latest")
"""Named values of ``train.resume`` (besides a checkpoint path and ``None``)."""


class RunDirectoryError(RuntimeError):
    """A run directory holds another run's outputs; nothing was changed."""


def fingerprint(identity: Mapping[str, Any]) -> str:
    """A short hash of ``identity`` (JSON with sorted keys; other values by ``str``)."""
    text = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_manifest(checkpoint_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The manifest of ``checkpoint_dir``, or ``None`` when there is none.

    Raises
    ------
    RunDirectoryError
        When ``run.json`` is not a JSON object.
    """
    path = Path(checkpoint_dir) / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise RunDirectoryError(f"cannot read the run manifest {path}: {err}") from err
    if not isinstance(manifest, dict):
        raise RunDirectoryError(f"the run manifest {path} is not a JSON object")
    return manifest


@dataclass
class RunPlan:
    """What a run does with its directory, decided on rank 0 before any work.

    Attributes
    ----------
    resume : str or None
        The checkpoint to resume from; ``None``: start from scratch.
    resume_step : int
        Its step (0 when starting from scratch).
    discard : list[str]
        Checkpoint directories to delete first (only with ``overwrite``).
    metrics : {"keep", "trim", "empty"}
        ``trim``: drop the metrics lines after ``resume_step``; ``empty``: start the
        metrics file anew; ``keep``: no metrics file, or nothing to do.
    notes : list[str]
        What rank 0 logs about the decision.
    """

    resume: str | None = None
    resume_step: int = 0
    discard: list[str] = field(default_factory=list)
    metrics: str = "keep"
    notes: list[str] = field(default_factory=list)


def inventory(manifest: Mapping[str, Any] | None) -> set[str] | None:
    """The absolute paths of the files a manifest lists as its run's, ``None`` if it lists none.

    A manifest written before the inventory existed (or no manifest) gives ``None``.
    """
    if manifest is None or not isinstance(manifest.get("files"), Mapping):
        return None
    return {os.path.abspath(str(p)) for p in manifest["files"].values() if p}


def _looks_like_metrics(path: Path) -> bool:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except ValueError:
            if 0 < i == len(lines) - 1 and line.startswith("{"):  # cut short by a crash
                continue
            return False
        if not isinstance(record, dict) or not METRICS_KEYS <= set(record):
            return False
        if type(record["step"]) is not int:
            return False
    return True


def _looks_like_summary(path: Path) -> bool:
    try:
        summary = json.loads(path.read_text(errors="replace"))
    except ValueError:
        return False
    return isinstance(summary, dict) and SUMMARY_KEYS <= set(summary)


def check_own_file(path: str | os.PathLike, option: str, listed: set[str] | None) -> bool:
    """Whether ``path`` may be rewritten: absent, empty, or a file this project made.

    Parameters
    ----------
    path : path
        A metrics or summary file of the run.
    option : str
        The option that names it (``train.metrics_file``), for the message.
    listed : set of str or None
        :func:`inventory` of the directory's manifest.

    Returns
    -------
    bool
        ``False`` when there is nothing there (absent or empty), ``True`` for a file the
        project made (listed by the inventory, or with the content the project writes).

    Raises
    ------
    RunDirectoryError
        For a symlink or another non-regular file, or a file the project did not make;
        ``overwrite`` does not lift this refusal.
    """
    path = Path(path)
    if not os.path.lexists(path):
        return False
    if path.is_symlink() or not path.is_file():
        kind = "a symlink" if path.is_symlink() else "not a regular file"
        raise RunDirectoryError(
            f"{option}={path} is {kind}: refused (a run writes its own regular files and "
            "does not follow links); remove it or choose another path"
        )
    if path.stat().st_size == 0:
        return False
    if listed is not None and os.path.abspath(path) in listed:
        return True
    looks = _looks_like_metrics if option.endswith("metrics_file") else _looks_like_summary
    if looks(path):
        return True
    raise RunDirectoryError(
        f"{option}={path} is a file this project did not write (not in the run manifest's "
        "inventory, and not what a run writes there): refused, even with "
        "train.overwrite=true, so that no file of yours is replaced; move it or choose "
        f"another path for {option}"
    )


def _check_discard(checkpoint_dir: str, paths: Mapping[int, Path]) -> None:
    """Every checkpoint to delete is a real directory inside ``checkpoint_dir``."""
    root = Path(checkpoint_dir).resolve()
    for path in paths.values():
        if path.is_symlink() or path.resolve().parent != root:
            target = os.readlink(path) if path.is_symlink() else path.resolve()
            raise RunDirectoryError(
                f"checkpoint directory {path} is a symlink (to {target}), not a directory of "
                f"{checkpoint_dir}: train.overwrite=true deletes only the run directory's own "
                "checkpoints and does not follow links; nothing was deleted. Remove the link "
                "or choose another directory"
            )


def _describe(found: Mapping[int, Path]) -> str:
    steps = list(found)
    shown = ", ".join(map(str, steps[:6])) + (", ..." if len(steps) > 6 else "")
    return f"{len(steps)} checkpoint(s), steps {shown}"


def _metric_lines(metrics_file: str | None) -> int:
    if not metrics_file or not Path(metrics_file).is_file():
        return 0
    return sum(1 for line in Path(metrics_file).read_text().splitlines() if line.strip())


def plan_run(
    checkpoint_dir: str | None,
    metrics_file: str | None,
    run_fingerprint: str,
    resume: str | None,
    overwrite: bool,
    summary_file: str | None = None,
) -> RunPlan:
    """Decide where a run starts and what it may replace (reads files only).

    Parameters
    ----------
    checkpoint_dir : str or None
        The run's checkpoint directory.
    metrics_file : str or None
        The run's metrics file.
    run_fingerprint : str
        :func:`fingerprint` of the run.
    resume : str or None
        ``"auto"``, ``"latest"``, a checkpoint directory, or ``None`` (from scratch).
    overwrite : bool
        Delete another run's checkpoints and metrics instead of refusing them.
    summary_file : str or None
        The run's summary file (replaced when the run ends).

    Raises
    ------
    RunDirectoryError
        When the directory holds checkpoints or metrics this run would not continue
        from and ``overwrite`` is off; the message names the directory and what is in it.
        Whatever ``overwrite``: when the metrics or summary file is not the project's
        (:func:`check_own_file`), or a checkpoint to delete is a symlink.
    CheckpointError
        When ``resume`` names something that is not a checkpoint.
    """
    plan = RunPlan()
    found = list_checkpoints(checkpoint_dir) if checkpoint_dir else {}
    manifest = read_manifest(checkpoint_dir) if checkpoint_dir else None
    theirs = None if manifest is None else manifest.get("fingerprint")
    ours = theirs == run_fingerprint
    owner = (
        "no run manifest" if manifest is None else f"run {theirs} (this run is {run_fingerprint})"
    )
    conflict: dict[int, Path] = {}
    if resume == "auto":
        if found and ours:
            plan.resume_step = max(found)
            plan.resume = str(found[plan.resume_step])
        elif found:
            conflict = dict(found)
    elif resume == "latest":
        if found:
            plan.resume_step = max(found)
            plan.resume = str(found[plan.resume_step])
            if not ours:
                plan.notes.append(
                    f"train.resume=latest continues {plan.resume} of {owner}; the manifest "
                    "becomes this run's"
                )
    elif resume:
        state = read_state(resume)
        plan.resume, plan.resume_step = str(resume), int(state["step"])
        given = Path(resume).resolve()
        conflict = {
            step: path
            for step, path in found.items()
            if path.resolve() != given and (not ours or step > plan.resume_step)
        }
    else:
        conflict = dict(found)
    listed = inventory(manifest)
    metrics_made = bool(metrics_file) and check_own_file(metrics_file, "train.metrics_file", listed)
    summary_made = bool(summary_file) and check_own_file(summary_file, "train.summary_file", listed)
    if conflict:
        if not overwrite:
            raise RunDirectoryError(
                f"checkpoint directory {checkpoint_dir} holds {_describe(conflict)} of "
                f"{owner if not ours else 'this run, after the resumed step'}, which "
                f"train.resume={resume} would not continue from; pass train.overwrite=true "
                "to delete them, train.resume=latest to continue from the newest, or choose "
                "another directory (run_dir / train.checkpoint_dir)"
            )
        _check_discard(checkpoint_dir, conflict)
        plan.discard = [str(p) for p in conflict.values()]
        plan.notes.append(
            f"train.overwrite=true: deleting {_describe(conflict)} in {checkpoint_dir}"
        )
    lines = _metric_lines(metrics_file) if metrics_made else 0
    if summary_made and not (ours or overwrite or conflict):
        raise RunDirectoryError(
            f"summary file {summary_file} is another run's ({owner}) and this run would "
            "replace it when it ends; pass train.overwrite=true to replace it, or choose "
            "another directory (run_dir / train.summary_file)"
        )
    if plan.resume is not None:
        plan.metrics = "trim" if lines else "keep"
    elif lines:
        if not (ours or overwrite or conflict):
            raise RunDirectoryError(
                f"metrics file {metrics_file} holds {lines} line(s) of another run ({owner}) "
                "and this run starts from scratch; pass train.overwrite=true to replace it, "
                "or choose another directory (run_dir / train.metrics_file)"
            )
        plan.metrics = "empty"
        plan.notes.append(f"starting {metrics_file} anew (it held {lines} line(s))")
    return plan


def decide(
    checkpoint_dir: str | None,
    metrics_file: str | None,
    run_fingerprint: str,
    resume: str | None,
    overwrite: bool,
    summary_file: str | None = None,
) -> RunPlan:
    """:func:`plan_run` on rank 0, the same plan (or error) on every rank (collective)."""
    return on_rank_zero(
        lambda: plan_run(
            checkpoint_dir, metrics_file, run_fingerprint, resume, overwrite, summary_file
        ),
        "deciding the run's start",
    )


def trim_metrics(metrics_file: str | os.PathLike, last_step: int) -> int:
    """Keep the metrics lines of steps ``<= last_step`` (atomically); return how many dropped.

    A line that is not JSON (a line cut short by a crash) is dropped too.
    """
    path = Path(metrics_file)
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            dropped += 1
            continue
        if step <= last_step:
            kept.append(line)
        else:
            dropped += 1
    write_text_atomic(path, "".join(f"{line}\n" for line in kept))
    return dropped


def remove_leftovers(checkpoint_dir: str | os.PathLike) -> list[str]:
    """Delete the temporary directories of saves that did not finish; return their names.

    Only names :data:`LEFTOVER_PATTERN` matches, and only real directories (not links).
    Call with the run directory's lock held (:mod:`~physicsnemo_foldcp.training.runlock`):
    then no other run is writing them.
    """
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    gone = []
    for entry in sorted(root.iterdir()):
        if LEFTOVER_PATTERN.match(entry.name) and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
            gone.append(entry.name)
    return gone


def prepare_run(
    plan: RunPlan,
    checkpoint_dir: str | None,
    metrics_file: str | None,
    run_fingerprint: str,
    identity: Mapping[str, Any],
    summary_file: str | None = None,
) -> None:
    """Carry out ``plan`` on rank 0: delete, write the manifest, trim the metrics.

    Call on every rank, with the run directory's lock held: it ends when rank 0 is done,
    and an error there is raised on every rank
    (:func:`~physicsnemo_foldcp.distributed.errors.on_rank_zero`). The manifest's
    inventory lists ``metrics_file`` and ``summary_file`` as this run's.
    """

    def carry_out() -> None:
        for note in plan.notes:
            logger.info("%s", note)
        for path in plan.discard:
            shutil.rmtree(path)
        if checkpoint_dir:
            for name in remove_leftovers(checkpoint_dir):
                logger.info(
                    "deleted %s/%s, left by a save that did not finish", checkpoint_dir, name
                )
            old = read_manifest(checkpoint_dir) if plan.resume is not None else None
            same = old is not None and old.get("fingerprint") == run_fingerprint
            created = old.get("created") if same else None
            files = {"metrics": metrics_file, "summary": summary_file}
            manifest = {
                "fingerprint": run_fingerprint,
                "created": created if isinstance(created, str) else _now(),
                "identity": json.loads(json.dumps(identity, sort_keys=True, default=str)),
                "files": {k: os.path.abspath(v) for k, v in files.items() if v},
            }
            write_text_atomic(Path(checkpoint_dir) / MANIFEST_NAME, json.dumps(manifest, indent=2))
        if metrics_file and plan.metrics == "trim":
            dropped = trim_metrics(metrics_file, plan.resume_step)
            if dropped:
                logger.info(
                    "dropped %d line(s) after step %d from %s",
                    dropped,
                    plan.resume_step,
                    metrics_file,
                )
        elif metrics_file and plan.metrics == "empty":
            write_text_atomic(metrics_file, "")

    on_rank_zero(carry_out, "preparing the run directory")


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


__all__ = [
    "LEFTOVER_PATTERN",
    "MANIFEST_NAME",
    "METRICS_KEYS",
    "RESUME_MODES",
    "SUMMARY_KEYS",
    "RunDirectoryError",
    "RunPlan",
    "check_own_file",
    "decide",
    "fingerprint",
    "inventory",
    "plan_run",
    "prepare_run",
    "read_manifest",
    "remove_leftovers",
    "trim_metrics",
]
