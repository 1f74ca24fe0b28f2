"""Training and prediction runs on the ``ddp x cp0 x cp1`` mesh, and model validation.

* :func:`train`: the training loop (DDP / FSDP2 over ``ddp``, checkpoints, exact resume).
* :mod:`~physicsnemo_foldcp.training.checkpoint`: sharded DCP checkpoints, read without
  unpickling arbitrary objects; :mod:`~physicsnemo_foldcp.training.rundir`: which run a
  directory belongs to (``train.resume=auto``, ``train.overwrite``) and which of its files
  a run may rewrite; :mod:`~physicsnemo_foldcp.training.runlock`: one run per directory.
* :mod:`~physicsnemo_foldcp.training.boltz_weights`: Boltz-2's released Lightning weights,
  read without running code from them and converted to a checkpoint directory.
* :class:`WeightAverage`: the moving average of the weights Boltz trains with
  (``train.ema_decay``), checkpointed beside them.
* :func:`predict`: distograms of a dataset, written in the serial layout.
* :func:`validate_model`: serial vs distributed comparison of your own model.
* :func:`compile_model`: whole-model or regional ``torch.compile`` by CP shape.
* :mod:`~physicsnemo_foldcp.training.hooks`: what the loop reads from a model (its FSDP2
  units, compile regions and loss); :mod:`~physicsnemo_foldcp.training.config`: the Hydra
  schemas of the apps.
"""

from physicsnemo_foldcp.data.datasets import BatchedFiles, SyntheticComplexes, batched
from physicsnemo_foldcp.training.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from physicsnemo_foldcp.training.compile import compile_model, resolve_compile_mode
from physicsnemo_foldcp.training.ema import WeightAverage
from physicsnemo_foldcp.training.hooks import model_loss, module_types
from physicsnemo_foldcp.training.loop import (
    BatchSizeError,
    OptimizerSettings,
    TrainResult,
    TrainSettings,
    build_optimizer,
    check_batch,
    forward_backward,
    train,
    write_summary,
)
from physicsnemo_foldcp.training.predict import (
    OutputExistsError,
    OutputNameError,
    PredictionResult,
    predict,
    read_distogram,
    serial_distogram,
)
from physicsnemo_foldcp.training.rundir import RunDirectoryError
from physicsnemo_foldcp.training.runlock import RunLockedError
from physicsnemo_foldcp.training.validate import ValidationReport, validate_model

__all__ = [
    "BatchSizeError",
    "BatchedFiles",
    "CheckpointError",
    "OptimizerSettings",
    "OutputExistsError",
    "OutputNameError",
    "PredictionResult",
    "RunDirectoryError",
    "RunLockedError",
    "SyntheticComplexes",
    "TrainResult",
    "TrainSettings",
    "ValidationReport",
    "WeightAverage",
    "batched",
    "build_optimizer",
    "check_batch",
    "compile_model",
    "forward_backward",
    "latest_checkpoint",
    "load_checkpoint",
    "model_loss",
    "module_types",
    "predict",
    "read_distogram",
    "resolve_compile_mode",
    "save_checkpoint",
    "serial_distogram",
    "train",
    "validate_model",
    "write_summary",
]
