"""Train with Lightning's Trainer over the ddp x cp0 x cp1 mesh (Hydra app, conf/train.yaml).

    python examples/lightning_train.py                                        # 1 process
    torchrun --standalone --nproc-per-node 4 examples/lightning_train.py mesh.cp=[2,2]
    torchrun --standalone --nproc-per-node 8 examples/lightning_train.py mesh.cp=[2,2] \
        train.wrapper=fsdp2

The configuration is examples/train.py's (conf/train.yaml), read the same way, and the
same overrides give the same per-step losses and parameters. The model (the model group's
_target_) is wrapped in a FoldModule; the data come from a FoldCPDataModule; the Trainer
runs with FoldCPStrategy. Rank 0 writes ${run_dir}/metrics.jsonl as examples/train.py
does (and MLflow / W&B with logging.mlflow / logging.wandb). Checkpoints: a
step_<k>.ckpt/ directory in train.checkpoint_dir every train.checkpoint_every steps (at
the last step when 0). train.resume=auto or latest continues from the newest one there,
a step_<k>.ckpt path from that one, null starts over.

Not taken from the train group: compile (Lightning runs the model eagerly here: refused
unless none), overwrite and summary_file; a checkpoint directory is not tied to a run as
in examples/train.py, so use one run_dir per run. As in examples/train.py, one run at a
time holds the run directory (its lock, training/runlock.py), and a metrics file that a
run did not write (a file of yours there) is refused before anything is written.
"""

import dataclasses
import logging
import re
import warnings
from pathlib import Path

import hydra
import pytorch_lightning as pl
from omegaconf import DictConfig, OmegaConf
from pytorch_lightning.callbacks import ModelCheckpoint

import physicsnemo_foldcp as fc
from physicsnemo_foldcp.distributed.errors import on_rank_zero
from physicsnemo_foldcp.lightning import FoldCPStrategy, FoldModule, StepMetrics
from physicsnemo_foldcp.training.config import (
    TrainAppConfig,
    build_dataset,
    build_mesh,
    build_model,
    data_config,
    loader_options,
    sharding_options,
    typed,
)
from physicsnemo_foldcp.training.logs import MetricLogger, setup_logging
from physicsnemo_foldcp.training.loop import set_precision
from physicsnemo_foldcp.training.rundir import check_own_file
from physicsnemo_foldcp.training.runlock import JobLock, lock_path

warnings.filterwarnings("ignore", message=".*is deprecated")
warnings.filterwarnings("ignore", message=".*sequential all_reduce operations")
warnings.filterwarnings("ignore", message=".*val_dataloader.*validation_step")

LIGHTNING_PRECISION = {"fp32": "32-true", "tf32": "32-true", "bf16": "bf16-mixed"}
"""train.precision -> Lightning's precision (TF32 is set by set_precision)."""

CHECKPOINT_NAME = re.compile(r"^step_(\d+)\.ckpt$")


def resume_path(resume: str | None, checkpoint_dir: str | None) -> str | None:
    """The checkpoint ``train.resume`` names: the newest in ``checkpoint_dir`` for auto/latest."""
    if resume is None:
        return None
    if resume not in ("auto", "latest"):
        return resume
    found = {}
    if checkpoint_dir and Path(checkpoint_dir).is_dir():
        for path in Path(checkpoint_dir).iterdir():
            match = CHECKPOINT_NAME.match(path.name)
            if match and path.is_dir():
                found[int(match.group(1))] = path
    return str(found[max(found)]) if found else None


@hydra.main(config_path="../conf", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    conf = typed(TrainAppConfig, cfg, None)
    settings = conf.train
    if settings.compile != "none":
        raise ValueError(
            f"train.compile={settings.compile!r}: examples/lightning_train.py runs the model "
            "eagerly; use examples/train.py to compile"
        )
    setup_logging(conf.logging.level)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    data = data_config(conf.data)
    sharding = sharding_options(conf.sharding)
    set_precision(settings.precision)
    mesh = build_mesh(conf.mesh)
    metric_logger = None
    lock = None
    try:
        lock = JobLock(lock_path(settings.checkpoint_dir, settings.metrics_file))
        if settings.metrics_file:  # StepMetrics trims it on resume: it must be a run's
            on_rank_zero(
                lambda: check_own_file(settings.metrics_file, "train.metrics_file", None),
                "checking the metrics file",
            )
        config = OmegaConf.to_container(cfg, resolve=True)
        metric_logger = MetricLogger(conf.logging, conf.run_dir, config)
        registry = fc.FeatureRegistry.from_config(dataclasses.asdict(conf.registry))
        model = build_model(conf.model, settings.seed)
        dataset = build_dataset(data, model)
        module = FoldModule(
            model,
            optimizer=conf.optimizer,
            loss=settings.loss,
            fsdp_units=settings.fsdp_units,
        )
        datamodule = fc.FoldCPDataModule(
            dataset,
            registry=registry,
            seed=settings.seed,
            **loader_options(sharding, num_workers=data.num_workers),
        )
        callbacks: list[pl.Callback] = []
        if settings.metrics_file:
            callbacks.append(StepMetrics(settings.metrics_file, metric_logger=metric_logger))
        if settings.checkpoint_dir:
            every = settings.checkpoint_every or settings.steps
            callbacks.append(
                ModelCheckpoint(
                    dirpath=settings.checkpoint_dir,
                    filename="step_{step:08d}",
                    auto_insert_metric_name=False,
                    every_n_train_steps=every,
                    save_top_k=-1,
                )
            )
        trainer = pl.Trainer(
            strategy=FoldCPStrategy(
                mesh=mesh,
                wrapper=settings.wrapper,
                grad_bucket_mib=settings.grad_bucket_mib,
                ema_decay=settings.ema_decay,
            ),
            accelerator="gpu" if mesh.device.type == "cuda" else "cpu",
            devices=1,
            precision=LIGHTNING_PRECISION[settings.precision],
            max_steps=settings.steps,
            logger=False,
            callbacks=callbacks,
            enable_checkpointing=bool(settings.checkpoint_dir),
            enable_progress_bar=settings.progress,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        ckpt_path = resume_path(settings.resume, settings.checkpoint_dir)
        if mesh.rank == 0:
            logging.info("%s", dataset)
            logging.info("resuming from %s", ckpt_path or "nothing: starting from scratch")
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    finally:
        if metric_logger is not None:
            metric_logger.close()
        if lock is not None:
            lock.release()
        fc.shutdown()


if __name__ == "__main__":
    main()
