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
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
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

    Raises
    ------
    RunDirectoryError
        When the directory holds checkpoints or metrics this run would not continue
        from and ``overwrite`` is off; the message names the directory and what is in it.
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
    if conflict:
        if not overwrite:
            raise RunDirectoryError(
                f"checkpoint directory {checkpoint_dir} holds {_describe(conflict)} of "
                f"{owner if not ours else 'this run, after the resumed step'}, which "
                f"train.resume={resume} would not continue from; pass train.overwrite=true "
                "to delete them, train.resume=latest to continue from the newest, or choose "
                "another directory (run_dir / train.checkpoint_dir)"
            )
        plan.discard = [str(p) for p in conflict.values()]
        plan.notes.append(
            f"train.overwrite=true: deleting {_describe(conflict)} in {checkpoint_dir}"
        )
    lines = _metric_lines(metrics_file)
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
) -> RunPlan:
    """:func:`plan_run` on rank 0, the same plan (or error) on every rank (collective)."""
    return on_rank_zero(
        lambda: plan_run(checkpoint_dir, metrics_file, run_fingerprint, resume, overwrite),
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


def prepare_run(
    plan: RunPlan,
    checkpoint_dir: str | None,
    metrics_file: str | None,
    run_fingerprint: str,
    identity: Mapping[str, Any],
) -> None:
    """Carry out ``plan`` on rank 0: delete, write the manifest, trim the metrics.

    Call on every rank: it ends when rank 0 is done, and an error there is raised on every
    rank (:func:`~physicsnemo_foldcp.distributed.errors.on_rank_zero`).
    """

    def carry_out() -> None:
        for note in plan.notes:
            logger.info("%s", note)
        for path in plan.discard:
            shutil.rmtree(path)
        if checkpoint_dir:
            old = read_manifest(checkpoint_dir) if plan.resume is not None else None
            same = old is not None and old.get("fingerprint") == run_fingerprint
            manifest = {
                "fingerprint": run_fingerprint,
                "created": old["created"] if same else _now(),
                "identity": json.loads(json.dumps(identity, sort_keys=True, default=str)),
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
    "MANIFEST_NAME",
    "RESUME_MODES",
    "RunDirectoryError",
    "RunPlan",
    "decide",
    "fingerprint",
    "plan_run",
    "prepare_run",
    "read_manifest",
    "trim_metrics",
]
