"""Callbacks that give a Lightning run the training loop's outputs.

* :class:`StepMetrics`: ``metrics.jsonl``, one line per optimizer step (``step``,
  ``loss``, ``seconds``), written by rank 0 as the loop writes it.
* :class:`DistogramWriter`: ``<out_dir>/<record_id>.npz`` per predicted sample, written by
  each domain group's source, with the file names of
  :func:`~physicsnemo_foldcp.training.predict` (planned before anything is written).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.callbacks import BasePredictionWriter, Callback

from physicsnemo_foldcp.training.logs import MetricLogger
from physicsnemo_foldcp.training.predict import planned_names, write_prediction
from physicsnemo_foldcp.training.rundir import trim_metrics


def _mesh(trainer: pl.Trainer) -> Any:
    mesh = getattr(trainer.strategy, "mesh", None)
    if mesh is None:
        raise TypeError(
            f"{type(trainer.strategy).__name__} has no mesh: these callbacks need "
            "Trainer(strategy=FoldCPStrategy(...))"
        )
    return mesh


class StepMetrics(Callback):
    """Rank 0 writes each step's logged ``loss`` as a JSON line, as the training loop does.

    Parameters
    ----------
    path : path
        The metrics file. A resumed run first drops the lines of steps after the one it
        resumes from, then appends.
    key : str, default "loss"
        The logged metric written as ``loss``.
    metric_logger : MetricLogger, optional
        Also receives each line's ``loss`` and ``seconds`` (MLflow / W&B, rank 0).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        key: str = "loss",
        metric_logger: MetricLogger | None = None,
    ) -> None:
        self.path = Path(path)
        self.key = key
        self.metric_logger = metric_logger
        self._start = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Trim the file to the steps before this run's first, then start the clock."""
        self._start = time.perf_counter()
        if not trainer.is_global_zero:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            trim_metrics(self.path, trainer.global_step)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """Append the step's line (rank 0)."""
        value = trainer.callback_metrics.get(self.key)
        if value is None:  # checked on every rank: the module logs on every rank
            raise KeyError(f"StepMetrics: the module logged no {self.key!r} this step")
        if not trainer.is_global_zero:
            return
        line = {
            "step": int(trainer.global_step),
            "loss": float(value),
            "seconds": time.perf_counter() - self._start,
        }
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")
        if self.metric_logger is not None:
            self.metric_logger.log({"loss": line["loss"], "seconds": line["seconds"]}, line["step"])


class DistogramWriter(BasePredictionWriter):
    """Write each predicted distogram as ``<out_dir>/<name>.npz`` (domain sources).

    Takes :class:`~physicsnemo_foldcp.lightning.FoldModule`'s predictions; the names come
    from the data module's predict dataset, planned on rank 0 before any file is written
    (two record ids that map to one file, or a file of that name already in ``out_dir``,
    stop the run; see :func:`~physicsnemo_foldcp.training.predict.check_out_dir`).

    Parameters
    ----------
    out_dir : path
        Directory of the files.
    overwrite : bool, default False
        Replace earlier predictions of this project in ``out_dir`` instead of refusing them.
    """

    def __init__(self, out_dir: str | os.PathLike, overwrite: bool = False) -> None:
        super().__init__(write_interval="batch")
        self.out_dir = Path(out_dir)
        self.overwrite = overwrite
        self.files: list[str] = []
        self._names: list[str] = []

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Plan every file name (rank 0 decides, every rank learns the names or the error)."""
        datamodule = trainer.datamodule
        dataset = getattr(datamodule, "datasets", {}).get("predict")
        if dataset is None:
            raise TypeError("DistogramWriter needs a FoldCPDataModule with a predict dataset")
        self._names = planned_names(dataset, _mesh(trainer), self.out_dir, self.overwrite)
        self.files = []

    def write_on_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        prediction: Any,
        batch_indices: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        """Write one prediction (its domain group's source only)."""
        if prediction is None or not _mesh(trainer).is_domain_source:
            return
        path = write_prediction(self.out_dir, self._names, prediction.item, prediction.distogram)
        self.files.append(str(path))


__all__ = ["DistogramWriter", "StepMetrics"]
