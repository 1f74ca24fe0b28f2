"""The moving average of the weights in training runs: resumed exactly, resharded, predicted.

A run with ``train.ema_decay`` checkpoints its average beside the weights; a run resumed
from step 2 ends with the straight run's average bit for bit (FSDP2 over 2 replicas: the
sums over the replicas add two values); the same checkpoint resumes on another mesh and
wrapper (1x2x2, no wrapper) to the fp32 noise of another reduction order; prediction
loads the average (``weights="auto"`` / ``"ema"``) or the weights (``"model"``); a
checkpoint without an average is refused, naming its file, where one is asked for.
"""

import pytest
import torch
from torch.distributed.tensor import DTensor

from physicsnemo_foldcp.distributed.wrappers import unwrap
from physicsnemo_foldcp.models import ModelConfig, ReferenceFoldModel
from physicsnemo_foldcp.testing import collective_assert
from physicsnemo_foldcp.training import (
    CheckpointError,
    OptimizerSettings,
    SyntheticComplexes,
    TrainSettings,
    WeightAverage,
    load_checkpoint,
    train,
)
from physicsnemo_foldcp.training.checkpoint import checkpoint_path

pytestmark = pytest.mark.multigpu_static

CONFIG = ModelConfig(c_atom=8, c_token=16, c_pair=8, n_blocks=1, n_heads=2)
DECAY = 0.9
mesh_id = lambda s: "x".join(map(str, s))  # noqa: E731


def fresh_model(seed=5):
    torch.manual_seed(seed)
    return ReferenceFoldModel(CONFIG)


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def whole(weights):
    return {k: full(v).detach().clone() for k, v in weights.items()}


class OneComplex(SyntheticComplexes):
    """Every index is the same complex, so any ddp size averages equal gradients."""

    def __getitem__(self, index):
        sample = super().__getitem__(0)
        sample["record_id"] = self.record_id(index)
        return sample


@pytest.mark.parametrize("fold_mesh", [(2, 1, 2)], indirect=True, ids=mesh_id)
def test_the_average_resumes_exactly_reshards_and_is_predicted_with(
    fold_mesh, fold_mesh_factory, shared_dir
):
    dataset = OneComplex(4, 9, 15, seed=3, msa_rows=2)
    opt = OptimizerSettings(lr=1e-2)
    common = dict(steps=4, seed=2, progress=False, log_every=0, ema_decay=DECAY)
    straight = train(
        fresh_model(),
        fold_mesh,
        dataset,
        TrainSettings(
            wrapper="fsdp2", checkpoint_every=2, checkpoint_dir=str(shared_dir / "a"), **common
        ),
        optimizer=opt,
    )
    start = checkpoint_path(shared_dir / "a", 2)
    resumed = train(
        fresh_model(seed=99),
        fold_mesh,
        dataset,
        TrainSettings(wrapper="fsdp2", resume=str(start), **common),
        optimizer=opt,
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
        optimizer=opt,
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
