"""Lightning's Trainer with FoldCPStrategy equals the training loop: losses, parameters, files.

Each run starts from the same seed and data as :func:`~physicsnemo_foldcp.training.train`
(what ``examples/train.py`` runs). Checked exactly (``torch.equal``: the same ops in the
same order): the per-step losses, every parameter and the moving average of the weights
after 3 steps on (1,2,2) and on (2,2,2) with FSDP2 and DDP, a run resumed from a Lightning
checkpoint, the distograms of
``Trainer.predict`` against :func:`~physicsnemo_foldcp.training.predict`, a checkpoint
written on (2,2,2) with FSDP2 predicted from on another mesh, and metric logging of
``Partial`` values.
"""

import pytest
import torch
import torch.distributed as dist

pl = pytest.importorskip("pytorch_lightning")

from physicsnemo.domain_parallel import ShardTensor  # noqa: E402
from pytorch_lightning.callbacks import ModelCheckpoint  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.distributed.tensor.placement_types import Partial  # noqa: E402

from physicsnemo_foldcp import FoldCPDataModule  # noqa: E402
from physicsnemo_foldcp.distributed.wrappers import unwrap  # noqa: E402
from physicsnemo_foldcp.lightning import (  # noqa: E402
    DistogramWriter,
    FoldCPStrategy,
    FoldModule,
)
from physicsnemo_foldcp.models import ModelConfig, ReferenceFoldModel  # noqa: E402
from physicsnemo_foldcp.testing import collective_assert  # noqa: E402
from physicsnemo_foldcp.training import (  # noqa: E402
    OptimizerSettings,
    SyntheticComplexes,
    TrainSettings,
    predict,
    read_distogram,
    train,
)
from physicsnemo_foldcp.training.checkpoint import CheckpointError  # noqa: E402
from physicsnemo_foldcp.training.predict import dataset_record_ids, output_names  # noqa: E402

pytestmark = pytest.mark.multigpu_static

CONFIG = ModelConfig(c_atom=8, c_token=16, c_pair=8, n_blocks=1, n_heads=2)
SEED, STEPS = 7, 3
EMA_DECAY = 0.9
"""Decay of the moving average the fit/resume runs keep (fast: it moves in 3 steps)."""
OPTIMIZER = OptimizerSettings(name="adamw", lr=3e-3)
CASES = [((1, 2, 2), "auto"), ((2, 2, 2), "fsdp2"), ((2, 2, 2), "ddp")]
mesh_id = lambda s: "x".join(map(str, s)) if isinstance(s, tuple) else str(s)  # noqa: E731


class StepLosses(pl.Callback):
    """The ``loss`` Lightning reports after each optimizer step (every rank)."""

    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["loss"]))


def dataset(mesh):
    return SyntheticComplexes(2 * mesh.ddp_size + 1, 11, 23, seed=3, msa_rows=2)


def full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()


def trainer(mesh, wrapper, steps, callbacks=(), strategy=None, ema_decay=0.0, **options):
    return pl.Trainer(
        strategy=strategy or FoldCPStrategy(mesh=mesh, wrapper=wrapper, ema_decay=ema_decay),
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
        **options,
    )


def lightning_fit(
    mesh,
    wrapper,
    steps,
    *,
    ckpt_path=None,
    save_to=None,
    model_seed=SEED,
    callbacks=(),
    ema_decay=0.0,
):
    """Fit a fresh FoldModule; return (module, step losses, the strategy's moving average);
    optionally save a checkpoint."""
    torch.manual_seed(model_seed)
    module = FoldModule(ReferenceFoldModel(CONFIG), optimizer=OPTIMIZER)
    data = FoldCPDataModule(dataset(mesh), seed=SEED)
    losses = StepLosses()
    run = trainer(mesh, wrapper, steps, [losses, *callbacks], ema_decay=ema_decay)
    run.fit(module, datamodule=data, ckpt_path=ckpt_path)
    if save_to is not None:
        run.save_checkpoint(save_to)
    return module, losses.losses, run.strategy.ema


def loop_fit(mesh, wrapper, ema_decay=0.0):
    torch.manual_seed(SEED)
    model = ReferenceFoldModel(CONFIG)
    settings = TrainSettings(
        steps=STEPS, wrapper=wrapper, seed=SEED, progress=False, log_every=0, ema_decay=ema_decay
    )
    return train(model, mesh, dataset(mesh), settings, optimizer=OPTIMIZER)


def compare_averages(ema, loop_ema, problems, what):
    ours = {n.removeprefix("model."): full(v) for n, v in ema.weights.items()}
    theirs = {n: full(v) for n, v in loop_ema.weights.items()}
    if set(ours) != set(theirs) or ema.step != loop_ema.step:
        problems.append(f"{what}: averages of steps {ema.step} / {loop_ema.step}, keys differ")
    for name, value in theirs.items():
        if name in ours and not torch.equal(ours[name], value):
            problems.append(f"{what}: moving average of {name} differs")


def compare_parameters(module, loop_model, problems, what):
    ours = {n.removeprefix("model."): full(p) for n, p in module.named_parameters()}
    theirs = {n: full(p) for n, p in loop_model.named_parameters()}
    if set(ours) != set(theirs):
        problems.append(f"{what}: parameter names differ: {sorted(set(ours) ^ set(theirs))}")
    for name, value in theirs.items():
        if name in ours and not torch.equal(ours[name], value):
            diff = float((ours[name] - value).abs().max())
            problems.append(f"{what}: parameter {name} differs by {diff:.3e}")


@pytest.mark.parametrize("fold_mesh,wrapper", CASES, indirect=["fold_mesh"], ids=mesh_id)
def test_fit_and_resume_give_the_training_loops_losses_and_parameters(
    fold_mesh, wrapper, shared_dir
):
    mesh = fold_mesh
    reference = loop_fit(mesh, wrapper, EMA_DECAY)
    every_2 = ModelCheckpoint(
        shared_dir,
        "step_{step}",
        every_n_train_steps=2,
        save_top_k=-1,
        auto_insert_metric_name=False,
    )
    module, losses, ema = lightning_fit(
        mesh, wrapper, STEPS, callbacks=[every_2], ema_decay=EMA_DECAY
    )

    # Lightning logs float32; the loop averages over ddp in float64.
    expected = torch.tensor(reference.losses, dtype=torch.float32).tolist()
    problems = []
    if losses != expected:
        problems.append(f"Lightning losses {losses} != loop losses {expected}")
    compare_parameters(module, unwrap(reference.model), problems, "fit")
    compare_averages(ema, reference.ema, problems, "fit")

    # The run checkpointed at step 2; a model initialised otherwise resumes from there.
    checkpoint = shared_dir / "step_2.ckpt"
    resumed, rest, resumed_ema = lightning_fit(
        mesh, wrapper, STEPS, ckpt_path=checkpoint, model_seed=99, ema_decay=EMA_DECAY
    )
    if losses[:2] + rest != expected:
        problems.append(f"resumed losses {losses[:2]} + {rest} != {expected}")
    compare_parameters(resumed, unwrap(reference.model), problems, "resumed")
    compare_averages(resumed_ema, reference.ema, problems, "resumed")
    collective_assert(not problems, "; ".join(problems))


@pytest.mark.parametrize("fold_mesh", [(1, 2, 2), (2, 2, 2)], indirect=True, ids=mesh_id)
def test_predict_writes_the_distograms_of_the_prediction_loop(fold_mesh, shared_dir):
    mesh = fold_mesh
    data = dataset(mesh)
    torch.manual_seed(SEED)
    expected = predict(ReferenceFoldModel(CONFIG), mesh, data, shared_dir / "loop")

    torch.manual_seed(SEED)
    module = FoldModule(ReferenceFoldModel(CONFIG))
    writer = DistogramWriter(shared_dir / "lightning")
    run = trainer(mesh, "auto", 1, [writer])
    run.predict(module, datamodule=FoldCPDataModule(predict_dataset=data), return_predictions=False)

    dist.barrier()  # every source has written its files
    problems = []
    if sorted(writer.files) != sorted(p.replace("/loop/", "/lightning/") for p in expected.files):
        problems.append(f"files {writer.files} != {expected.files}")
    for name in output_names(dataset_record_ids(data)):
        a = read_distogram(shared_dir / "loop" / name)
        b = read_distogram(shared_dir / "lightning" / name)
        if not torch.equal(a, b):
            problems.append(f"{name}: distograms differ")
    collective_assert(not problems, "; ".join(problems))


@pytest.mark.parametrize("fold_mesh", [(2, 2, 2)], indirect=True, ids=mesh_id)
def test_an_fsdp2_checkpoint_loads_and_predicts_alike_on_another_mesh(
    fold_mesh, fold_mesh_factory, shared_dir
):
    checkpoint = shared_dir / "fsdp2.ckpt"
    module, _, _ = lightning_fit(fold_mesh, "fsdp2", 2, save_to=checkpoint)
    trained = {n: full(p) for n, p in module.named_parameters()}
    data = dataset(fold_mesh)
    problems = []
    try:  # the sharded module itself cannot predict over ddp (padding rounds)
        trainer(fold_mesh, "fsdp2", 1).predict(
            module, datamodule=FoldCPDataModule(predict_dataset=data), return_predictions=False
        )
        problems.append("predicting with the FSDP2-sharded module was accepted")
    except RuntimeError as err:
        if "FSDP2" not in str(err) or "ckpt_path" not in str(err):
            problems.append(f"unclear error: {err}")

    for shape in [(2, 2, 2), (1, 2, 4)]:
        mesh = fold_mesh_factory(*shape)
        torch.manual_seed(123)
        fresh = FoldModule(ReferenceFoldModel(CONFIG))
        writer = DistogramWriter(shared_dir / mesh_id(shape))
        trainer(mesh, "auto", 1, [writer]).predict(
            fresh,
            datamodule=FoldCPDataModule(predict_dataset=data),
            ckpt_path=checkpoint,
            return_predictions=False,
        )
        for name, p in fresh.named_parameters():
            if not torch.equal(full(p), trained[name]):
                problems.append(f"{mesh_id(shape)}: parameter {name} is not the trained one")
    dist.barrier()  # every source has written its files
    # Another domain mesh sums in another order: equal to fp32 rounding, not bit for bit.
    for name in output_names(dataset_record_ids(data)):
        a = read_distogram(shared_dir / "2x2x2" / name)
        b = read_distogram(shared_dir / "1x2x4" / name)
        if not torch.allclose(a, b, rtol=1e-5, atol=1e-5):
            diff = float((a - b).abs().max())
            problems.append(f"{name}: distograms differ by {diff:.2e} on 2x2x2 and 1x2x4")
    collective_assert(not problems, "; ".join(problems))


@pytest.mark.parametrize("fold_mesh", [(1, 2, 2)], indirect=True, ids=mesh_id)
def test_a_partial_value_is_logged_whole(fold_mesh):
    """A ShardTensor logged with Partial placements is its summed value, on every rank."""
    mesh = fold_mesh
    rank_value = float(mesh.domain_rank + 1)
    expected = sum(range(1, mesh.domain_size + 1))

    class Logs(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(()))
            self.seen = {}

        def training_step(self, batch, batch_idx):
            local = torch.tensor(rank_value)
            value = ShardTensor.from_local(
                local, mesh.domain_mesh, [Partial(), Partial()], sharding_shapes="infer"
            )
            self.log("partial", value, on_step=True, batch_size=1)
            self.log("synced", value, on_step=True, sync_dist=True, batch_size=1)
            return (self.weight - 1) ** 2

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.seen = {k: float(v) for k, v in self.trainer.callback_metrics.items()}

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return [0]

    module = Logs()
    strategy = FoldCPStrategy(cp=mesh.cp)  # builds (here: finds) the mesh itself
    trainer(mesh, "auto", 1, strategy=strategy).fit(module)
    seen = module.seen
    collective_assert(
        strategy.mesh is mesh
        and seen.get("partial") == expected
        and seen.get("synced") == expected,
        f"logged {seen}, expected {expected} for both (rank value {rank_value})",
    )


@pytest.mark.parametrize("fold_mesh", [(1, 2, 2)], indirect=True, ids=mesh_id)
def test_a_plain_dataloader_and_a_foreign_checkpoint_are_refused(fold_mesh, shared_dir):
    module = FoldModule(ReferenceFoldModel(CONFIG))
    loader = torch.utils.data.DataLoader(dataset(fold_mesh))
    problems = []
    try:
        trainer(fold_mesh, "auto", 1).fit(module, train_dataloaders=loader)
        problems.append("a plain DataLoader was accepted")
    except TypeError as err:
        if "ShardedLoader" not in str(err):
            problems.append(f"unclear error: {err}")
    reference = loop_fit(fold_mesh, "auto")
    from physicsnemo_foldcp.training.checkpoint import save_checkpoint

    path = save_checkpoint(shared_dir, 3, reference.model, reference.optimizer, fold_mesh)
    try:
        trainer(fold_mesh, "auto", STEPS + 1).fit(
            FoldModule(ReferenceFoldModel(CONFIG)),
            datamodule=FoldCPDataModule(dataset(fold_mesh)),
            ckpt_path=path,
        )
        problems.append("a training-loop checkpoint was resumed by Lightning")
    except CheckpointError as err:
        if "FoldCPStrategy" not in str(err) and "does not" not in str(err):
            problems.append(f"unclear error: {err}")
    collective_assert(not problems, "; ".join(problems))
