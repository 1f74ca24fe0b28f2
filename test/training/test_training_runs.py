"""In-process training, resume, prediction and batch checks on the mesh; the moving
average of the weights."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from physicsnemo_foldcp import ShardingOptions
from physicsnemo_foldcp.data import ShardedLoader
from physicsnemo_foldcp.distributed.wrappers import unwrap
from physicsnemo_foldcp.models import ModelConfig, ReferenceFoldModel, reference_loss
from physicsnemo_foldcp.models.reference import TrunkBlock
from physicsnemo_foldcp.testing import collective_assert
from physicsnemo_foldcp.training import (
    BatchSizeError,
    CheckpointError,
    OptimizerSettings,
    SyntheticComplexes,
    TrainSettings,
    WeightAverage,
    latest_checkpoint,
    load_checkpoint,
    predict,
    read_distogram,
    train,
)
from physicsnemo_foldcp.training.checkpoint import checkpoint_path
from physicsnemo_foldcp.training.predict import OutputNameError
from physicsnemo_foldcp.training.rundir import RunDirectoryError

pytestmark = pytest.mark.multigpu_static

CONFIG = ModelConfig(c_atom=8, c_token=16, c_pair=8, n_blocks=1, n_heads=2)
DECAY = 0.9
"""Decay of the moving average in the EMA tests (fast, so that it moves in 4 steps)."""
mesh_id = lambda s: "x".join(map(str, s))  # noqa: E731


def fresh_model(seed=5):
    torch.manual_seed(seed)
    return ReferenceFoldModel(CONFIG)


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


@pytest.mark.parametrize(
    "fold_mesh,wrapper",
    # the 2x2 CP mesh without ddp is resumed by the Hydra app in test_apps.py
    [((2, 1, 2), "fsdp2"), ((3, 1, 2), "ddp"), ((1, 3, 3), "none")],
    indirect=["fold_mesh"],
    ids=str,
)
def test_resume_continues_with_the_same_losses(fold_mesh, wrapper, shared_dir):
    """4 steps straight == 2 steps, checkpoint, new process state, resume for 2 more.

    Bit for bit with AdamW when the gradient all-reduce sums at most two values (sums of
    two floats commute); over 3 DDP ranks gloo's ring order depends on the bucket layout,
    which DDP rebuilds after its first step, so that case uses SGD with momentum and the
    fp32 noise floor.
    """
    mesh = fold_mesh
    dataset = SyntheticComplexes(3 * mesh.ddp_size, 9, 17, seed=11, msa_rows=2)
    exact = mesh.ddp_size <= 2
    opt = OptimizerSettings(lr=1e-2) if exact else OptimizerSettings("sgd", 0.05, momentum=0.9)
    common = dict(wrapper=wrapper, seed=2, progress=False, log_every=0)
    straight = train(
        fresh_model(),
        mesh,
        dataset,
        TrainSettings(steps=4, checkpoint_every=2, checkpoint_dir=str(shared_dir / "a"), **common),
        optimizer=opt,
    )
    torch.manual_seed(12345)  # the checkpoint must restore the generators, not this seed
    resumed = train(
        fresh_model(seed=99),  # other initial weights: the checkpoint must replace them
        mesh,
        dataset,
        TrainSettings(
            steps=4,
            checkpoint_dir=str(shared_dir / "b"),
            resume=str(checkpoint_path(shared_dir / "a", 2)),
            **common,
        ),
        optimizer=opt,
    )
    problems = []
    if resumed.start_step != 2 or resumed.end_step != 4:
        problems.append(f"resumed steps {resumed.start_step}..{resumed.end_step}, expected 2..4")
    same = (
        (lambda a, b: torch.equal(a, b))
        if exact
        else (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6))
    )
    if not same(torch.tensor(resumed.losses), torch.tensor(straight.losses[2:])):
        problems.append(f"resumed losses {resumed.losses} != {straight.losses[2:]}")
    if resumed.indices != straight.indices[2:]:
        problems.append(f"resumed samples {resumed.indices} != {straight.indices[2:]}")
    a = dict(unwrap(straight.model).named_parameters())
    for name, p in unwrap(resumed.model).named_parameters():
        if not same(full(p.detach()), full(a[name].detach())):
            problems.append(f"parameter {name} differs after resume")
    if latest_checkpoint(shared_dir / "b") != checkpoint_path(shared_dir / "b", 4):
        problems.append(f"latest checkpoint is {latest_checkpoint(shared_dir / 'b')}")
    collective_assert(not problems, "; ".join(problems[:5]))


@pytest.mark.parametrize("fold_mesh", [(1, 2, 2), (1, 2, 3), (1, 3, 3)], indirect=True, ids=mesh_id)
def test_a_batch_of_two_stops_before_any_step(fold_mesh):
    """Samples with a batch axis of 2 are refused on every rank; no parameter moves."""
    mesh = fold_mesh

    class BatchOfTwo(SyntheticComplexes):
        def __getitem__(self, index):
            x = super().__getitem__(index)
            return {
                k: torch.cat([v, v]) if isinstance(v, torch.Tensor) else v for k, v in x.items()
            }

    model = fresh_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(Exception, match=r"batch size 2 per domain group"):
        train(model, mesh, BatchOfTwo(2, 9, 12, seed=1), TrainSettings(steps=2, progress=False))
    moved = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
    collective_assert(not moved, f"parameters changed: {moved}")
    with pytest.raises(BatchSizeError, match=r"batch size must be 1.*mesh.ddp"):
        train(model, mesh, SyntheticComplexes(2, 9, 12), TrainSettings(steps=2, batch_size=2))


@pytest.mark.parametrize("fold_mesh", [(1, 2, 2)], indirect=True, ids=mesh_id)
def test_a_step_adds_no_object_collective_to_the_loaders(fold_mesh, monkeypatch):
    """The scatter tags the atom<->token maps once; a training step does not tag them again.

    Re-tagging with a check costs one object all-gather per step; the loop's object
    collectives are the loader's (scatter metadata, order checks) plus one at the end (peak
    memory of every rank).
    """
    mesh = fold_mesh
    dataset = SyntheticComplexes(4, 9, 13, seed=1, msa_rows=2)
    calls = []
    gather = dist.all_gather_object

    def counted(*args, **kwargs):
        calls.append(1)
        return gather(*args, **kwargs)

    monkeypatch.setattr(dist, "all_gather_object", counted)
    loader = ShardedLoader(dataset, mesh, mode="train", seed=2)
    steps = [item.index for _, item in zip(range(3), loader)]
    by_loader = len(calls)
    calls.clear()
    settings = TrainSettings(steps=3, seed=2, progress=False, log_every=0)
    result = train(fresh_model(), mesh, dataset, settings)
    by_train = len(calls)
    monkeypatch.undo()
    collective_assert(
        result.indices == steps and by_train == by_loader + 1,
        f"train ran {result.indices} with {by_train} object all-gathers; the loader alone "
        f"ran {steps} with {by_loader} (+1 expected for the peak memory)",
    )


class TwiceTheLoss(nn.Module):
    """A model the loop does not know: the reference model inside, its own loss and units."""

    fsdp_units = (TrunkBlock,)

    def __init__(self):
        super().__init__()
        self.inner = ReferenceFoldModel(CONFIG)

    def forward(self, **features):
        return self.inner(**features)

    def loss(self, outputs, features):
        return 2 * reference_loss(outputs, features)


@pytest.mark.parametrize("fold_mesh", [(2, 1, 2)], indirect=True, ids=mesh_id)
def test_another_model_trains_with_its_own_loss_and_fsdp_units(fold_mesh):
    """The loop takes the loss and the FSDP2 units from the model class it is given."""
    mesh = fold_mesh
    dataset = SyntheticComplexes(2 * mesh.ddp_size, 9, 13, seed=4, msa_rows=2)
    common = dict(steps=1, seed=3, wrapper="fsdp2", progress=False, log_every=0)
    torch.manual_seed(5)
    other = train(TwiceTheLoss(), mesh, dataset, TrainSettings(**common))
    reference = train(fresh_model(), mesh, dataset, TrainSettings(**common))
    model = unwrap(other.model)
    units = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    problems = []
    if not torch.allclose(torch.tensor(other.losses), 2 * torch.tensor(reference.losses)):
        problems.append(f"losses {other.losses} != 2 x {reference.losses}")
    if len(units) != CONFIG.n_blocks or not all(isinstance(m, TrunkBlock) for m in units):
        problems.append(f"FSDP2 units {units}, expected the {CONFIG.n_blocks} trunk block(s)")
    collective_assert(not problems, "; ".join(problems))


@pytest.mark.parametrize(
    # the 2x2 CP mesh is predicted by the Hydra app in test_apps.py
    "fold_mesh",
    [(2, 1, 2), (1, 2, 3), (3, 1, 3)],
    indirect=True,
    ids=mesh_id,
)
def test_prediction_writes_the_serial_distograms(fold_mesh, shared_dir):
    mesh = fold_mesh
    dataset = SyntheticComplexes(mesh.ddp_size + 1, 9, 19, seed=21, msa_rows=2)
    model = fresh_model()
    loader_options = {"options": ShardingOptions(token_multiple=2)}
    result = predict(model, mesh, dataset, shared_dir, loader_options=loader_options)
    dist.barrier()
    problems = []
    model = model.cpu()
    with torch.no_grad():
        for index in range(len(dataset)):
            sample = dataset[index]
            path = shared_dir / f"{sample['record_id']}.npz"
            if not path.is_file():
                problems.append(f"{path.name} was not written")
                continue
            expected = model(**sample)["pdistogram"][0]
            got = read_distogram(path)
            if got.shape != expected.shape:
                problems.append(f"{path.name}: shape {tuple(got.shape)} != {tuple(expected.shape)}")
            elif not torch.allclose(got, expected, rtol=1e-5, atol=1e-5):
                problems.append(f"{path.name}: max diff {float((got - expected).abs().max()):.2e}")
    written = [None] * dist.get_world_size()
    dist.all_gather_object(written, result.files)
    every = sorted(f for files in written for f in files)
    if len(every) != len(dataset) or len(set(every)) != len(dataset):
        problems.append(f"files written {every}: each sample must be written once")
    collective_assert(not problems, "; ".join(problems[:5]))


class OneComplex(SyntheticComplexes):
    """Every index is the same complex, so any ddp size averages equal gradients."""

    def __getitem__(self, index):
        sample = super().__getitem__(0)
        sample["record_id"] = self.record_id(index)
        return sample


RESUME_OPTIMIZER = OptimizerSettings(lr=1e-2)
"""AdamW of the runs resumed on another mesh."""


def straight_fsdp2_run(mesh, directory, **settings):
    """4 AdamW steps with FSDP2 on one complex, checkpointed in ``directory`` at 2 and 4.

    Returns the run's result, its dataset and the settings a resumed run shares with it.
    """
    dataset = OneComplex(4, 9, 15, seed=3, msa_rows=2)
    common = dict(steps=4, seed=2, progress=False, log_every=0, **settings)
    result = train(
        fresh_model(),
        mesh,
        dataset,
        TrainSettings(wrapper="fsdp2", checkpoint_every=2, checkpoint_dir=str(directory), **common),
        optimizer=RESUME_OPTIMIZER,
    )
    return result, dataset, common


SINGLE_PROCESS_RESUME = """
import json, sys, torch
import physicsnemo_foldcp as fc
from physicsnemo_foldcp.models import ModelConfig, ReferenceFoldModel
from physicsnemo_foldcp.training import OptimizerSettings, SyntheticComplexes, TrainSettings, train

class OneComplex(SyntheticComplexes):
    def __getitem__(self, index):
        return super().__getitem__(0)

mesh = fc.init_mesh(cp=(1, 1))
torch.manual_seed(99)
model = ReferenceFoldModel(ModelConfig(c_atom=8, c_token=16, c_pair=8, n_blocks=1, n_heads=2))
settings = TrainSettings(steps=4, seed=2, progress=False, log_every=0, resume=sys.argv[1])
result = train(model, mesh, OneComplex(4, 9, 15, seed=3, msa_rows=2), settings,
               optimizer=OptimizerSettings(lr=1e-2))
print("LOSSES", json.dumps(result.losses))
fc.shutdown()
"""


def resume_on_one_process(checkpoint):
    """Losses of a one-process run resumed from ``checkpoint`` (or the error, as text)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in list(env):
        if var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"):
            env.pop(var)
        elif var.startswith(("TORCHELASTIC", "LOCAL_WORLD", "ROLE_", "GROUP_WORLD")):
            env.pop(var)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", SINGLE_PROCESS_RESUME, str(checkpoint)],
            capture_output=True,
            text=True,
            timeout=150,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return "the one-process resume did not finish in 150 s"
    for line in proc.stdout.splitlines():
        if line.startswith("LOSSES "):
            return json.loads(line[len("LOSSES ") :])
    return f"rc={proc.returncode}: {proc.stderr[-2000:]}"


@pytest.mark.parametrize("fold_mesh", [(2, 1, 2)], indirect=True, ids=mesh_id)
def test_an_fsdp2_checkpoint_resumes_on_another_mesh_and_one_process(
    fold_mesh, fold_mesh_factory, shared_dir
):
    """Sharded FSDP2 state saved on (2,1,2) resumes on (1,2,2) and on 1 process: same losses.

    Every sample is the same complex, so the mean over 2 replicas equals one replica's
    loss and gradient; the next two losses check the parameters (step 3) and the AdamW
    moments (step 4), to the fp32 noise of another CP reduction order.
    """
    straight, dataset, common = straight_fsdp2_run(fold_mesh, shared_dir / "a")
    start = checkpoint_path(shared_dir / "a", 2)
    on_cp = train(
        fresh_model(seed=99),
        fold_mesh_factory(1, 2, 2),
        dataset,
        TrainSettings(resume=str(start), **common),
        optimizer=RESUME_OPTIMIZER,
    )
    single = [resume_on_one_process(start) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(single, src=0)
    problems = []
    files = sorted(p.name for p in start.iterdir())
    if ".metadata" not in files or len([f for f in files if f.endswith(".distcp")]) < 2:
        problems.append(f"{start} holds {files}: expected DCP files written by several ranks")
    expected = torch.tensor(straight.losses[2:])
    for name, got in (("(1,2,2)", on_cp.losses), ("one process", single[0])):
        if not isinstance(got, list):
            problems.append(f"{name}: {got}")
        elif not torch.allclose(torch.tensor(got), expected, rtol=1e-4, atol=1e-5):
            problems.append(f"{name} resumed losses {got} != {straight.losses[2:]}")
    collective_assert(not problems, "; ".join(problems))


@pytest.mark.parametrize("fold_mesh", [(1, 2, 2)], indirect=True, ids=mesh_id)
def test_a_run_directory_holds_one_run(fold_mesh, shared_dir):
    """Another run is refused on every rank; this run resumes by itself, logging each step once."""
    mesh = fold_mesh
    dataset = SyntheticComplexes(3, 9, 13, seed=1, msa_rows=2)
    where = dict(checkpoint_dir=str(shared_dir / "ck"), metrics_file=str(shared_dir / "m.jsonl"))
    common = dict(seed=2, progress=False, log_every=0, checkpoint_every=1, **where)
    train(fresh_model(), mesh, dataset, TrainSettings(steps=2, **common))
    metrics = shared_dir / "m.jsonl"
    dist.barrier()
    before = metrics.read_text()
    problems = []
    with pytest.raises(RunDirectoryError) as refused:
        train(fresh_model(), mesh, dataset, TrainSettings(steps=2, **{**common, "seed": 3}))
    message = str(refused.value)
    if str(shared_dir / "ck") not in message or "2 checkpoint(s), steps 1, 2" not in message:
        problems.append(f"the refusal does not name the directory and its contents: {message}")
    if metrics.read_text() != before or latest_checkpoint(shared_dir / "ck") is None:
        problems.append("the refused run changed the directory")
    dist.barrier()
    if dist.get_rank() == 0:  # a step logged after the last checkpoint, then a crash
        with open(metrics, "a") as f:
            f.write(json.dumps({"step": 3, "loss": -1.0, "seconds": 0.0}) + "\n")
    dist.barrier()
    again = train(fresh_model(seed=7), mesh, dataset, TrainSettings(steps=4, **common))
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    if again.start_step != 2 or steps != [1, 2, 3, 4]:
        problems.append(f"auto resume started at {again.start_step}, metrics steps {steps}")
    if -1.0 in [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]:
        problems.append("the line of the lost step 3 was kept")
    dist.barrier()
    settings = TrainSettings(steps=1, overwrite=True, **{**common, "seed": 3})
    other = train(fresh_model(), mesh, dataset, settings)
    dist.barrier()
    left = sorted(p.name for p in (shared_dir / "ck").iterdir() if p.name.startswith("step_"))
    if other.start_step != 0 or left != ["step_00000001"]:
        problems.append(f"overwrite started at {other.start_step} and left {left}")
    collective_assert(not problems, "; ".join(problems))


@pytest.mark.parametrize("fold_mesh", [(1, 2, 2)], indirect=True, ids=mesh_id)
def test_colliding_prediction_names_stop_before_any_file(fold_mesh, shared_dir):
    class Colliding(SyntheticComplexes):
        def record_id(self, index):
            return ["a/b", "x", "a_b"][index]

    with pytest.raises(OutputNameError, match=r"'a/b'.*'a_b'.*a_b.npz"):
        predict(fresh_model(), fold_mesh, Colliding(3, 9, 12, seed=1), shared_dir / "p")
    written = list((shared_dir / "p").glob("*")) if (shared_dir / "p").exists() else []
    collective_assert(not written, f"files written: {written}")


def whole(weights):
    return {k: full(v).detach().clone() for k, v in weights.items()}


@pytest.mark.parametrize("fold_mesh", [(2, 1, 2)], indirect=True, ids=mesh_id)
def test_the_average_resumes_exactly_reshards_and_is_predicted_with(
    fold_mesh, fold_mesh_factory, shared_dir
):
    """The moving average of the weights in training runs: resumed exactly, resharded, predicted.

    A run with ``train.ema_decay`` checkpoints its average beside the weights; a run resumed
    from step 2 ends with the straight run's average bit for bit (FSDP2 over 2 replicas: the
    sums over the replicas add two values); the same checkpoint resumes on another mesh and
    wrapper (1x2x2, no wrapper) to the fp32 noise of another reduction order; prediction
    loads the average (``weights="auto"`` / ``"ema"``) or the weights (``"model"``).
    """
    straight, dataset, common = straight_fsdp2_run(fold_mesh, shared_dir / "a", ema_decay=DECAY)
    start = checkpoint_path(shared_dir / "a", 2)
    resumed = train(
        fresh_model(seed=99),
        fold_mesh,
        dataset,
        TrainSettings(wrapper="fsdp2", resume=str(start), **common),
        optimizer=RESUME_OPTIMIZER,
    )
    expected = whole(straight.ema.weights)
    weights = {k: full(v).detach().clone() for k, v in unwrap(straight.model).state_dict().items()}
    problems = []
    if straight.ema.step != 4 or resumed.ema.step != 4:
        problems.append(f"average steps {straight.ema.step}, resumed {resumed.ema.step}")
    moved = [k for k in expected if not torch.equal(expected[k], weights[k])]
    if len(moved) < len(expected) // 2:
        problems.append(f"the average equals the weights in {len(expected) - len(moved)} entries")
    for name, value in whole(resumed.ema.weights).items():
        if not torch.equal(value, expected[name]):
            problems.append(f"resumed average of {name} differs")

    on_cp = train(
        fresh_model(seed=98),
        fold_mesh_factory(1, 2, 2),
        dataset,
        TrainSettings(resume=str(start), **common),
        optimizer=RESUME_OPTIMIZER,
    )
    for name, value in whole(on_cp.ema.weights).items():
        if not torch.allclose(value, expected[name], rtol=1e-4, atol=1e-6):
            problems.append(f"average of {name} resumed on 1x2x2 differs")

    last = checkpoint_path(shared_dir / "a", 4)
    for mode, reference, loaded in (("auto", expected, "ema"), ("ema", expected, "ema"),
                                    ("model", weights, "model")):  # fmt: skip
        model = fresh_model(seed=97)
        info = load_checkpoint(last, model, restore_rng=False, weights=mode)
        if info["weights"] != loaded or info["ema_step"] != 4:
            problems.append(f"weights={mode}: loaded {info['weights']}, step {info['ema_step']}")
        for name, value in model.state_dict().items():
            if name in reference and not torch.equal(value, reference[name]):
                problems.append(f"weights={mode}: {name} is not the checkpoint's {loaded}")
    collective_assert(not problems, "; ".join(problems[:6]))


@pytest.mark.parametrize("fold_mesh", [(1, 2, 2)], indirect=True, ids=mesh_id)
def test_a_checkpoint_without_an_average_is_refused_where_one_is_asked_for(fold_mesh, shared_dir):
    """Restoring or loading an average a checkpoint lacks names its file; ``auto`` loads the
    weights."""
    dataset = SyntheticComplexes(2, 9, 13, seed=4, msa_rows=2)
    run = train(
        fresh_model(),
        fold_mesh,
        dataset,
        TrainSettings(
            steps=1, seed=2, progress=False, log_every=0, checkpoint_dir=str(shared_dir / "a")
        ),  # fmt: skip
    )
    path = checkpoint_path(shared_dir / "a", 1)
    problems = []
    if run.ema is not None:
        problems.append("a run without ema_decay kept an average")
    for kwargs in ({"ema": WeightAverage(fresh_model())}, {"weights": "ema"}):
        try:
            load_checkpoint(path, fresh_model(seed=9), restore_rng=False, **kwargs)
            problems.append(f"{kwargs} loaded a checkpoint without an average")
        except CheckpointError as err:
            if "no moving average" not in str(err) or "state.pt" not in str(err):
                problems.append(f"{kwargs}: {err}")
    model = fresh_model(seed=9)
    info = load_checkpoint(path, model, restore_rng=False, weights="auto")
    trained = {k: full(v) for k, v in unwrap(run.model).state_dict().items()}
    if info["weights"] != "model" or info["ema_step"] is not None:
        problems.append(f"weights=auto without an average: {info['weights']}")
    if not all(torch.equal(v, trained[k]) for k, v in model.state_dict().items()):
        problems.append("weights=auto did not load the trained weights")
    collective_assert(not problems, "; ".join(problems))
