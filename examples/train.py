"""Train the reference model over the ddp x cp0 x cp1 mesh (Hydra app, config conf/train.yaml).

    python examples/train.py                                                  # 1 process
    torchrun --standalone --nproc-per-node 4 examples/train.py mesh.cp=[2,2]
    torchrun --standalone --nproc-per-node 4 examples/train.py mesh.cp=[1,2] train.wrapper=fsdp2
    torchrun --standalone --nproc-per-node 4 examples/train.py mesh.cp=[2,2] train.resume=latest

Rank 0 shows the progress bar and the losses, writes ${run_dir}/metrics.jsonl (one line per
step) and ${run_dir}/summary.json; checkpoints go to train.checkpoint_dir.
"""

import logging
import warnings
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

import physicsnemo_foldcp as fc
from physicsnemo_foldcp.training import train, write_summary
from physicsnemo_foldcp.training.config import (
    build_dataset,
    build_model,
    loader_options,
    optimizer_settings,
    train_settings,
)

warnings.filterwarnings("ignore", message=".*is deprecated")
warnings.filterwarnings("ignore", message=".*sequential all_reduce operations")


@hydra.main(config_path="../conf", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    conf = OmegaConf.to_container(cfg, resolve=True)
    settings = train_settings(conf["train"], conf["data"])
    optimizer = optimizer_settings(conf["optimizer"])
    mesh = fc.init_mesh(
        ddp=conf["mesh"]["ddp"], cp=tuple(conf["mesh"]["cp"]), timeout_s=conf["mesh"]["timeout_s"]
    )
    try:
        registry = fc.FeatureRegistry.from_config(conf["registry"])
        dataset = build_dataset(conf["data"])
        model = build_model(conf["model"], settings.seed)
        if mesh.rank == 0:
            logging.info("%s", dataset)
        result = train(
            model,
            mesh,
            dataset,
            settings,
            optimizer=optimizer,
            registry=registry,
            loader_options=loader_options(conf["data"]),
            extra={"config": conf},
        )
        if mesh.rank == 0:
            write_summary(result, Path(conf["run_dir"]) / "summary.json")
    finally:
        fc.shutdown()


if __name__ == "__main__":
    main()
