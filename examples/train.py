"""Train a model over the ddp x cp0 x cp1 mesh (Hydra app, config conf/train.yaml).

    python examples/train.py                                                  # 1 process
    torchrun --standalone --nproc-per-node 4 examples/train.py mesh.cp=[2,2]
    torchrun --standalone --nproc-per-node 4 examples/train.py mesh.cp=[1,2] train.wrapper=fsdp2
    torchrun --standalone --nproc-per-node 4 examples/train.py mesh.cp=[2,2] train.resume=latest

The model is the model group's _target_ (the reference model by default). Rank 0 shows the
progress bar and the losses (console level: logging.level), writes
${run_dir}/metrics.jsonl (one line per step; also sent to MLflow / W&B with
logging.mlflow=true or logging.wandb=true) and ${run_dir}/summary.json (train.summary_file);
checkpoints go to train.checkpoint_dir (step_<k>/ directories and the run manifest
run.json). With the
default train.resume=auto, running the same command again (or a torchrun --max-restarts
restart) continues the run from its newest checkpoint; a run_dir holding another run's
checkpoints is refused unless train.overwrite=true, a second run while one runs there is
refused (the run directory's lock), and a file there that a run did not write (your own
summary.json, say) is refused even then. The run is identified by the data,
model, optimizer, registry and sharding groups and train.{seed,precision,batch_size,loss}.
"""

import dataclasses
import logging
import warnings

import hydra
from omegaconf import DictConfig, OmegaConf

import physicsnemo_foldcp as fc
from physicsnemo_foldcp.training import train
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

warnings.filterwarnings("ignore", message=".*is deprecated")
warnings.filterwarnings("ignore", message=".*sequential all_reduce operations")

RUN_GROUPS = ("data", "model", "optimizer", "registry", "sharding")
"""Config groups that identify a run (with train.seed/precision/batch_size/loss)."""


@hydra.main(config_path="../conf", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    # Every option is checked here, before any work: keys, types and values.
    conf = typed(TrainAppConfig, cfg, None)
    setup_logging(conf.logging.level)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    config = OmegaConf.to_container(cfg, resolve=True)
    data = data_config(conf.data)
    sharding = sharding_options(conf.sharding)
    mesh = build_mesh(conf.mesh)
    metric_logger = None
    try:
        registry = fc.FeatureRegistry.from_config(dataclasses.asdict(conf.registry))
        model = build_model(conf.model, conf.train.seed)
        dataset = build_dataset(data, model)
        # The first output (MLflow's store) only once every group has been built.
        metric_logger = MetricLogger(conf.logging, conf.run_dir, config)
        if mesh.rank == 0:
            logging.info("%s", dataset)
        train(
            model,
            mesh,
            dataset,
            conf.train,
            optimizer=conf.optimizer,
            registry=registry,
            loader_options=loader_options(sharding, num_workers=data.num_workers),
            extra={"config": config},
            run_config={k: config[k] for k in RUN_GROUPS},
            metric_logger=metric_logger,
        )
    finally:
        if metric_logger is not None:
            metric_logger.close()
        fc.shutdown()


if __name__ == "__main__":
    main()
