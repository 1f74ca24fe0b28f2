"""Training under ddp x cp0 x cp1 equals the serial model: losses, every gradient, parameters."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from physicsnemo_foldcp.distributed.wrappers import unwrap
from physicsnemo_foldcp.models import ModelConfig, ReferenceFoldModel, reference_loss
from physicsnemo_foldcp.models.reference import TrunkBlock
from physicsnemo_foldcp.testing import collective_assert
from physicsnemo_foldcp.training import (
    OptimizerSettings,
    SyntheticComplexes,
    TrainSettings,
    build_optimizer,
    train,
)
from physicsnemo_foldcp.training.compile import LocalRegion

pytestmark = pytest.mark.multigpu_static

# (ddp, cp0, cp1, wrapper): worlds 4, 6, 8 and 9.
# The compiled case traces with backend="aot_eager" (inductor's C++ build takes minutes per
# region on this CPU machine). Whole-model compile on a 1x1 CP mesh is covered by
# test/training/test_apps.py (one process against the 2x2 run's losses).
CASES = [
    ((1, 2, 2), "auto", "none"),
    ((2, 1, 2), "ddp", "none"),
    ((2, 1, 2), "fsdp2", "none"),
    ((1, 2, 2), "none", "regional"),
    ((1, 2, 3), "auto", "none"),
    ((3, 1, 2), "ddp", "none"),
    ((2, 1, 3), "fsdp2", "none"),
    ((2, 2, 2), "ddp", "none"),
    ((2, 2, 2), "fsdp2", "none"),
    ((1, 3, 3), "auto", "none"),
    ((3, 1, 3), "fsdp2", "none"),
]
STEPS = 3
CONFIG = ModelConfig(c_atom=8, c_token=16, c_pair=8, n_blocks=1, n_heads=2)


def full(t):
    """The whole tensor on the CPU (an FSDP2 parameter or gradient is gathered over ddp)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).cpu()


def mismatch(name, actual, expected, rtol=1e-5, atol=1e-5):
    """[] when close, else one message.

    fp32 noise floor: ``|a - e| <= rtol |e| + atol max|e| + 1e-7`` (sums of many terms,
    reduced in another order over the ranks, differ by a few ulps of their largest term).
    """
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    tol = atol * scale + 1e-7
    if actual.shape == expected.shape and torch.allclose(actual, expected, rtol, tol):
        return []
    if actual.shape != expected.shape:
        return [f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"]
    return [f"{name}: max abs difference {float((actual - expected).abs().max()):.3e}"]


def serial_reference(dataset, indices_per_group, opt_settings, seed):
    """The serial run: every step, the mean loss over the domain groups' samples."""
    torch.manual_seed(seed)
    model = ReferenceFoldModel(CONFIG)
    opt = build_optimizer(model, opt_settings)
    losses, grads = [], None
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for group in indices_per_group:
            sample = dataset[group[step]]
            loss = reference_loss(model(**sample), sample) / len(indices_per_group)
            loss.backward()
            total += float(loss.detach())
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(total)
    return model, losses, grads


@pytest.mark.parametrize("fold_mesh,wrapper,compile", CASES, indirect=["fold_mesh"], ids=str)
def test_training_steps_match_serial(fold_mesh, wrapper, compile):
    mesh = fold_mesh
    seed = 7
    dataset = SyntheticComplexes(2 * mesh.ddp_size, 11, 23, seed=3, msa_rows=2)
    # SGD: Adam divides by sqrt(v), so gradients at the rounding-noise level (~1e-9) would
    # become full-size steps of random sign; SGD keeps a parameter check at the noise floor.
    # AdamW's exact resume is checked in test_training_runs.py and test_apps.py.
    opt_settings = OptimizerSettings(name="sgd", lr=0.05, momentum=0.9)
    torch.manual_seed(seed)
    model = ReferenceFoldModel(CONFIG)
    settings = TrainSettings(
        steps=STEPS,
        wrapper=wrapper,
        seed=seed,
        progress=False,
        log_every=0,
        compile=compile,
        compile_backend="aot_eager",
    )
    result = train(model, mesh, dataset, settings, optimizer=opt_settings)

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (mesh.ddp_rank, result.indices))
    per_group = dict(gathered)
    indices = [per_group[g] for g in range(mesh.ddp_size)]
    reference, losses, grads = serial_reference(dataset, indices, opt_settings, seed)

    problems = []
    if len(result.losses) != STEPS:
        problems.append(f"{len(result.losses)} losses for {STEPS} steps")
    elif not torch.allclose(
        torch.tensor(result.losses), torch.tensor(losses), rtol=1e-5, atol=1e-6
    ):
        problems.append(f"losses {result.losses} != serial {losses}")
    trained = unwrap(result.model)
    compiled = [
        m
        for m in trained.modules()
        if getattr(m, "_compiled_call_impl", None)
        or isinstance(m.__dict__.get("forward"), LocalRegion)
    ]
    if (compile != "none") != bool(compiled):
        problems.append(f"compile={compile} but {len(compiled)} compiled module(s)")
    if not all(isinstance(m, ReferenceFoldModel.compile_regions) for m in compiled):
        problems.append(f"compiled modules outside the model's regions: {compiled}")
    if wrapper == "fsdp2" and not all(isinstance(p, DTensor) for p in trained.parameters()):
        problems.append("fsdp2 left plain parameters")
    units = [m for m in trained.modules() if isinstance(m, FSDPModule) and m is not trained]
    expected_units = CONFIG.n_blocks if wrapper == "fsdp2" else 0
    if len(units) != expected_units or not all(isinstance(m, TrunkBlock) for m in units):
        problems.append(f"FSDP2 units {units}: the model declares its trunk blocks")
    distributed = dict(trained.named_parameters())
    if set(distributed) != set(grads):
        problems.append(f"parameter names differ: {sorted(set(distributed) ^ set(grads))}")
    for name, expected in grads.items():
        p = distributed[name]
        if p.grad is None:
            problems.append(f"{name} has no gradient")
            continue
        problems += mismatch(f"grad {name}", full(p.grad), expected)
        if expected.abs().max() <= 1e-6:
            problems.append(f"serial gradient of {name} is zero: the check proves nothing")
    for name, expected in reference.named_parameters():
        problems += mismatch(f"param {name}", full(distributed[name].detach()), expected.detach())
    collective_assert(not problems, "; ".join(problems[:6]))
