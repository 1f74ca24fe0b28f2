"""Training Boltz-2's trunk under ddp x cp0 x cp1 equals serial training: three SGD steps.

The training loop (what ``examples/train.py model=boltz2_trunk`` runs) against a serial
run of the same trunk on the same samples: every step's loss, every parameter gradient
of the last step and every parameter after it (fp32, TF32 off), on (1, 2, 2) unwrapped
and on (2, 2, 2) with FSDP2 (the trunk's MSA and Pairformer layers as units) and with
DDP over ``ddp``. Dropout is off (the random draws themselves are compared in
``test_trunk.py``), and the Pairformer has one block. The parameters are randomised:
with Boltz's zero-initialised projections, serial runs of the same steps in two
processes already differ by about 1 % in the second step's loss.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from physicsnemo_foldcp.distributed.wrappers import unwrap
from physicsnemo_foldcp.models.boltz2_config import DEFAULT_MSA_ARGS, DEFAULT_PAIRFORMER_ARGS
from physicsnemo_foldcp.testing import collective_assert
from physicsnemo_foldcp.testing.parity import close, randomize_parameters
from physicsnemo_foldcp.training import (
    OptimizerSettings,
    SyntheticComplexes,
    TrainSettings,
    build_optimizer,
    train,
)

pytest.importorskip("boltz")

from physicsnemo_foldcp.models.boltz2_trunk import Boltz2Trunk  # noqa: E402

pytestmark = pytest.mark.multigpu_static
STEPS = 3
NO_DROPOUT = {
    "msa_args": {**DEFAULT_MSA_ARGS, "msa_dropout": 0.0, "z_dropout": 0.0},
    "pairformer_args": {**DEFAULT_PAIRFORMER_ARGS, "dropout": 0.0, "num_blocks": 1},
}


def make_trunk() -> Boltz2Trunk:
    torch.manual_seed(0)
    return randomize_parameters(Boltz2Trunk(**NO_DROPOUT), 4, scale=0.3)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (an FSDP2 parameter or gradient is gathered over ddp)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def serial_run(dataset, indices_per_group, opt_settings):
    """Serial steps: each step's loss is the mean over the domain groups' samples."""
    model = make_trunk()
    opt = build_optimizer(model, opt_settings)
    losses, grads = [], {}
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for group in indices_per_group:
            sample = dataset[group[step]]
            loss = model.loss(model(**sample), sample) / len(indices_per_group)
            loss.backward()
            total += float(loss.detach())
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        losses.append(total)
    return model, losses, grads


@pytest.mark.parametrize(
    "fold_mesh,wrapper",
    [((1, 2, 2), "auto"), ((2, 2, 2), "fsdp2"), ((2, 2, 2), "ddp")],
    indirect=["fold_mesh"],
    ids=str,
)
def test_trunk_training_steps_match_serial(fold_mesh, wrapper):
    mesh = fold_mesh
    dataset = SyntheticComplexes(2 * mesh.ddp_size, 11, 19, seed=3, msa_rows=3, atom_multiple=32)
    opt_settings = OptimizerSettings(name="sgd", lr=0.05, momentum=0.9)
    settings = TrainSettings(steps=STEPS, wrapper=wrapper, seed=7, progress=False, log_every=0)
    result = train(make_trunk(), mesh, dataset, settings, optimizer=opt_settings)

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (mesh.ddp_rank, result.indices))
    per_group = dict(gathered)
    reference, losses, grads = serial_run(
        dataset, [per_group[g] for g in range(mesh.ddp_size)], opt_settings
    )

    problems: list[str] = []
    close(torch.tensor(result.losses), torch.tensor(losses), "losses", problems, 1e-5, 1e-6)
    trained = unwrap(result.model)
    if wrapper == "fsdp2" and not all(isinstance(p, DTensor) for p in trained.parameters()):
        problems.append("fsdp2 left plain parameters")
    distributed = dict(trained.named_parameters())
    # The single path's gradients are zero (the distogram does not read s); most others
    # must not be, or the comparison proves little.
    zero = [n for n, g in grads.items() if float(g.abs().max()) <= 1e-6]
    if len(zero) > 0.3 * len(grads):
        problems.append(f"{len(zero)} of {len(grads)} serial gradients are zero: {zero}")
    for name, p in distributed.items():
        if (p.grad is None) != (name not in grads):
            problems.append(f"{name}: gradient in one run only")
        elif p.grad is not None:
            close(full(p.grad), grads[name], f"grad {name}", problems)
    for name, expected in reference.named_parameters():
        close(full(distributed[name].detach()), expected.detach(), f"param {name}", problems)
    collective_assert(not problems, "; ".join(problems[:6]))
