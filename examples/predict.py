"""Predict distograms, or Boltz-2 structures, over the ddp x cp0 x cp1 mesh (conf/predict.yaml).

    python examples/predict.py predict.checkpoint=runs/train/checkpoints/step_00000030
    torchrun --standalone --nproc-per-node 4 examples/predict.py mesh.cp=[2,2] \
        predict.checkpoint=runs/train/checkpoints/step_00000030

predict.checkpoint is a step_<k>/ directory written by training, on any mesh and wrapper
(read safely: nothing in it is unpickled as code). Each domain group predicts its share of
the samples; its source rank writes <predict.out_dir>/<record_id>.npz holding pdistogram
[N, N, bins] (serial token layout), the same files whatever the mesh. Two record ids that
map to one file name, or a file of that name already in out_dir (unless
predict.overwrite=true, which replaces earlier predictions only), stop the run before
anything is written.

With model=boltz2 and data=boltz_inputs (Boltz's YAML / FASTA), it predicts structures and
writes Boltz's own files under <predict.out_dir>/<record_id>/ (mmCIF or PDB, confidence
JSON, pLDDT / PAE / PDE), as boltz predict does:
    torchrun --standalone --nproc-per-node 4 examples/predict.py mesh.cp=[2,2] model=boltz2 \
        data=boltz_inputs data.inputs=my_inputs data.library_dir=~/.boltz/mols
"""

import dataclasses
import logging
import warnings

import hydra
from omegaconf import DictConfig

import physicsnemo_foldcp as fc
from physicsnemo_foldcp.training import load_checkpoint, predict
from physicsnemo_foldcp.training.config import (
    PredictAppConfig,
    build_dataset,
    build_mesh,
    build_model,
    data_config,
    loader_options,
    sharding_options,
    typed,
)
from physicsnemo_foldcp.training.logs import setup_logging
from physicsnemo_foldcp.training.structures import predict_structures

warnings.filterwarnings("ignore", message=".*is deprecated")


@hydra.main(config_path="../conf", config_name="predict", version_base=None)
def main(cfg: DictConfig) -> None:
    setup_logging("INFO")
    # Every option is checked here, before any work: keys, types and values.
    conf = typed(PredictAppConfig, cfg, None)
    data = data_config(conf.data)
    sharding = sharding_options(conf.sharding)
    options = conf.predict
    mesh = build_mesh(conf.mesh)
    try:
        registry = fc.FeatureRegistry.from_config(dataclasses.asdict(conf.registry))
        model = build_model(conf.model, options.seed).to(mesh.device)
        dataset = build_dataset(data, model)
        if options.checkpoint:
            load_checkpoint(options.checkpoint, model, restore_rng=False, weights=options.weights)
        common = dict(
            registry=registry,
            precision=options.precision,
            overwrite=options.overwrite,
            loader_options=loader_options(sharding, num_workers=data.num_workers),
        )
        if getattr(model, "predicts_structures", False):  # model=boltz2: Boltz's files
            result = predict_structures(
                model,
                mesh,
                dataset,
                options.out_dir,
                output_format=options.output_format,
                seed=options.seed,
                **common,
            )
        else:
            result = predict(model, mesh, dataset, options.out_dir, **common)
        if mesh.rank == 0:
            logging.info("rank 0 wrote %s", ", ".join(result.files) or "nothing")
    finally:
        fc.shutdown()


if __name__ == "__main__":
    main()
