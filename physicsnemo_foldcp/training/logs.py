"""Run logging: console messages from rank 0, and per-step metrics to MLflow or W&B.

Console: :func:`setup_logging` gives the root logger one handler with a
:class:`RankZeroFilter`, as PhysicsNeMo's ``RankZeroLoggingWrapper`` does for its
loggers: records below ``WARNING`` are kept on global rank 0 only; warnings and errors
are kept on every rank, tagged ``[rank r]`` on the others, so a problem on one rank is
never hidden. Code logs with the standard library and needs no rank test of its own.

Metrics: :class:`MetricLogger` sends each step's metrics (``loss``, ``seconds``) from
global rank 0 to the backends that :class:`LoggingSettings` enables: MLflow
(``pip install mlflow``) and Weights & Biases (``wandb``, installed with the ``boltz``
extra; ``offline`` by default, so nothing leaves the machine unless asked). The run's
``metrics.jsonl`` and summary are written by the training loop whatever is enabled.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
"""Accepted ``level`` names."""
WANDB_MODES = ("offline", "online", "disabled")
"""Accepted ``wandb_mode`` values (``wandb.init``'s ``mode``)."""


def global_rank() -> int:
    """This process's global rank (``RANK`` before the process group starts, else 0)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


class RankZeroFilter(logging.Filter):
    """Keep records below ``WARNING`` on rank 0 only; tag the others' warnings ``[rank r]``.

    Sets ``record.rank_tag`` (``""`` on rank 0) for the handler's format.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether this rank emits ``record``."""
        rank = global_rank()
        record.rank_tag = f"[rank {rank}] " if rank else ""
        return rank == 0 or record.levelno >= logging.WARNING


class ConsoleHandler(logging.StreamHandler):
    """A stream handler that writes to ``sys.stderr`` as it is when each record is emitted.

    A plain ``StreamHandler()`` keeps the ``sys.stderr`` of the moment it was made; when the
    program replaces ``sys.stderr`` later (a test runner's capture, a notebook), it would
    write into the replaced, possibly closed, stream. ``setStream`` still sets a stream of
    the caller's; setting ``sys.stderr`` itself goes back to following it.
    """

    def __init__(self) -> None:
        self._chosen = None
        super().__init__()

    @property
    def stream(self):  # noqa: D102 - the attribute logging.StreamHandler reads and sets
        return self._chosen if self._chosen is not None else sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        self._chosen = None if value is sys.stderr else value


def setup_logging(level: str = "INFO") -> logging.Handler:
    """Give the root logger one stream handler with :class:`RankZeroFilter` (idempotent).

    Parameters
    ----------
    level : {"DEBUG", "INFO", "WARNING", "ERROR"}
        Level of the root logger.

    Returns
    -------
    logging.Handler
        The handler (the same one on every call).
    """
    if level not in LEVELS:
        raise ValueError(f"logging level must be one of {LEVELS}, got {level!r}")
    root = logging.getLogger()
    root.setLevel(level)
    for handler in root.handlers:
        if getattr(handler, "foldcp_rank_zero", False):
            return handler
    handler = ConsoleHandler()
    handler.addFilter(RankZeroFilter())
    handler.setFormatter(logging.Formatter("%(rank_tag)s%(message)s"))
    handler.foldcp_rank_zero = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    return handler


@dataclass
class LoggingSettings:
    """Console level and metric backends of a run (the ``logging`` config group).

    Parameters
    ----------
    level : str
        Console level (:data:`LEVELS`).
    mlflow : bool
        Log metrics to MLflow.
    mlflow_tracking_uri : str or None
        MLflow tracking URI; ``None``: ``<run_dir>/mlruns``.
    wandb : bool
        Log metrics to Weights & Biases.
    wandb_mode : str
        ``wandb.init``'s mode (:data:`WANDB_MODES`); ``offline`` writes under the run
        directory only.
    project : str
        MLflow experiment and W&B project name.
    run_name : str or None
        Name of the run in the backends (theirs by default).
    """

    level: str = "INFO"
    mlflow: bool = False
    mlflow_tracking_uri: str | None = None
    wandb: bool = False
    wandb_mode: str = "offline"
    project: str = "physicsnemo-foldcp"
    run_name: str | None = None

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"logging.level must be one of {LEVELS}, got {self.level!r}")
        if self.wandb_mode not in WANDB_MODES:
            raise ValueError(
                f"logging.wandb_mode must be one of {WANDB_MODES}, got {self.wandb_mode!r}"
            )
        for enabled, package in ((self.mlflow, "mlflow"), (self.wandb, "wandb")):
            if enabled and importlib.util.find_spec(package) is None:
                raise ImportError(
                    f"logging.{package}=true needs the {package} package: pip install {package}"
                )


class MetricLogger:
    """Per-step metrics to the enabled backends, from global rank 0 (no-op elsewhere).

    Parameters
    ----------
    settings : LoggingSettings
        What to enable.
    run_dir : str or PathLike
        The run's directory (MLflow's default store, W&B's files).
    config : Mapping, optional
        The run's configuration, logged as parameters / W&B config.
    rank : int, optional
        Global rank (:func:`global_rank` by default).
    """

    def __init__(
        self,
        settings: LoggingSettings,
        run_dir: str | os.PathLike,
        config: Mapping[str, Any] | None = None,
        rank: int | None = None,
    ) -> None:
        self.settings = settings
        self._mlflow: Any = None
        self._wandb: Any = None
        if (global_rank() if rank is None else rank) != 0:
            return
        run_dir = Path(run_dir)
        flat = _flatten(config or {})
        if settings.mlflow:
            mlflow = importlib.import_module("mlflow")
            uri = settings.mlflow_tracking_uri or (run_dir / "mlruns").resolve().as_uri()
            mlflow.set_tracking_uri(uri)
            mlflow.set_experiment(settings.project)
            mlflow.start_run(run_name=settings.run_name)
            if flat:
                mlflow.log_params(flat)
            self._mlflow = mlflow
        if settings.wandb:
            wandb = importlib.import_module("wandb")
            run_dir.mkdir(parents=True, exist_ok=True)
            self._wandb = wandb.init(
                project=settings.project,
                name=settings.run_name,
                mode=settings.wandb_mode,
                dir=str(run_dir),
                config=dict(config or {}),
            )

    @property
    def active(self) -> bool:
        """Whether any backend receives metrics on this rank."""
        return self._mlflow is not None or self._wandb is not None

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Send ``metrics`` of optimizer step ``step`` to every enabled backend."""
        values = {k: float(v) for k, v in metrics.items()}
        if self._mlflow is not None:
            self._mlflow.log_metrics(values, step=step)
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def close(self) -> None:
        """End the backends' runs (idempotent)."""
        if self._mlflow is not None:
            self._mlflow.end_run()
            self._mlflow = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a.b": value}`` of a nested mapping (MLflow parameters are flat)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


__all__ = [
    "LEVELS",
    "WANDB_MODES",
    "LoggingSettings",
    "MetricLogger",
    "RankZeroFilter",
    "global_rank",
    "setup_logging",
]
