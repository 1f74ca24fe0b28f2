"""Boltz's activation checkpointing and bf16 autocast in a trunk training step under CP.

Checkpointing: ``activation_checkpointing`` on in the input embedder (its atom
transformer's ``DiffusionTransformer`` layers), the MSA module and the Pairformer; Boltz
then recomputes those layers in backward through the reentrant ``torch.utils.checkpoint``
on ShardTensors. The step's loss and every parameter gradient must equal the unchecked
step's on the same mesh (same weights, sample and dropout draws) and the serial
checkpointed step's.

bf16: the same step under ``torch.autocast(dtype=torch.bfloat16)`` (CPU bf16 here), the
kernels' backward under the forward's autocast state; the loss must be close to serial
Boltz's bf16 loss and every gradient finite.
"""

import pytest
import torch

from physicsnemo_foldcp import scatter_features
from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.models.boltz2_config import (
    DEFAULT_EMBEDDER_ARGS,
    DEFAULT_MSA_ARGS,
    DEFAULT_PAIRFORMER_ARGS,
)
from physicsnemo_foldcp.testing import collective_assert
from physicsnemo_foldcp.testing.parity import close, randomize_parameters
from physicsnemo_foldcp.training import batched
from physicsnemo_foldcp.training.loop import autocast

pytest.importorskip("boltz")

from physicsnemo_foldcp.models.boltz2_trunk import Boltz2Trunk  # noqa: E402

pytestmark = pytest.mark.multigpu_static
mesh_id = lambda s: "x".join(map(str, s))  # noqa: E731

BF16_LOSS_RTOL = 2e-3
"""Loss of a bf16 step under CP against serial bf16 (bf16 keeps 8 bits of mantissa; the
sums run in another order on the blocks)."""


def make_trunk(checkpointing: bool) -> Boltz2Trunk:
    """A small trunk, the same weights on every rank and with or without checkpointing."""
    torch.manual_seed(0)
    flag = {"activation_checkpointing": checkpointing}
    trunk = Boltz2Trunk(
        embedder_args={**DEFAULT_EMBEDDER_ARGS, **flag},
        msa_args={**DEFAULT_MSA_ARGS, **flag},
        pairformer_args={**DEFAULT_PAIRFORMER_ARGS, **flag},
    )
    return randomize_parameters(trunk, 3).train()


def step(model: Boltz2Trunk, feats, precision: str = "fp32"):
    """Forward, distogram loss and backward; the loss and the parameter gradients."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(11)  # the dropout draws
    with autocast(precision, torch.device("cpu")):
        loss = model.loss(model(**feats), feats)
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return float(loss.detach()), grads


def sample():
    # 37 tokens: uneven row blocks, atom windows that straddle them; 5 MSA rows.
    return batched(make_complex(37, seed=7, msa_rows=5, atom_multiple=32))


@pytest.mark.parametrize("fold_mesh", [(1, 2, 2), (1, 2, 3)], indirect=True, ids=mesh_id)
def test_a_checkpointed_trunk_step_equals_the_unchecked_one(fold_mesh):
    whole = sample()
    feats = scatter_features(whole if fold_mesh.is_domain_source else None, fold_mesh)
    loss_plain, plain = step(make_trunk(False), feats)
    loss_checked, checked = step(make_trunk(True), feats)
    loss_serial, serial = step(make_trunk(True), whole)
    problems = []
    if loss_checked != loss_plain or abs(loss_checked - loss_serial) > 1e-6 * abs(loss_serial):
        problems.append(f"loss {loss_checked}, unchecked {loss_plain}, serial {loss_serial}")
    for name, grad in checked.items():
        present = {grad is not None, plain[name] is not None, serial[name] is not None}
        if present != {True}:
            if present != {False}:  # none at all: a frozen parameter (Boltz's Fourier proj)
                problems.append(f"{name}: a gradient in some of the three steps only")
            continue
        close(grad, plain[name], f"{name} (against unchecked)", problems, rtol=1e-6, atol=1e-7)
        close(grad, serial[name], f"{name} (against serial)", problems)
    collective_assert(not problems, "; ".join(problems[:8]))


@pytest.mark.parametrize("fold_mesh", [(1, 2, 2)], indirect=True, ids=mesh_id)
def test_a_bf16_trunk_step_is_close_to_serial_bf16(fold_mesh):
    whole = sample()
    feats = scatter_features(whole if fold_mesh.is_domain_source else None, fold_mesh)
    loss, grads = step(make_trunk(False), feats, "bf16")
    loss_serial, _ = step(make_trunk(False), whole, "bf16")
    loss_fp32, _ = step(make_trunk(False), whole)
    problems = []
    rel = abs(loss - loss_serial) / abs(loss_serial)
    if not rel <= BF16_LOSS_RTOL:
        problems.append(f"bf16 loss {loss} vs serial bf16 {loss_serial} (rel. {rel:.1e})")
    if loss == loss_fp32:
        problems.append(f"the bf16 loss equals the fp32 loss {loss_fp32}: autocast did not run")
    bad = [n for n, g in grads.items() if g is not None and not torch.isfinite(g).all()]
    if bad:
        problems.append(f"missing or non-finite gradients: {bad[:5]}")
    collective_assert(not problems, "; ".join(problems))
