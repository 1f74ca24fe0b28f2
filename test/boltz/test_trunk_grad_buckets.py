"""Parameter gradients summed over the domain in buckets: the same gradients, few reductions.

A trunk training step (forward, distogram loss, backward) on a scattered sample, with
and without :func:`~physicsnemo_foldcp.core.grad_buckets.attach_gradient_buckets`, on the
same weights and dropout draws: every parameter gradient agrees, no backward reduces a
parameter gradient on its own when the buckets are attached, and the step's all-reduces
are those of the per-call step less its per-call parameter reductions plus one per
bucket. Without a wrapper (2x2, 2x3, with Boltz's reentrant activation checkpointing too)
and with DDP and FSDP2 over ``ddp`` (2 x 1x2).
"""

from collections import Counter

import pytest
import torch
from torch.distributed.tensor import DTensor

from physicsnemo_foldcp import scatter_features
from physicsnemo_foldcp.core import compat
from physicsnemo_foldcp.core.grad_buckets import (
    GradientBuckets,
    attach_gradient_buckets,
    attached_buckets,
)
from physicsnemo_foldcp.core.partial_grads import count_reduced_per_call
from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.distributed.wrappers import unwrap, wrap_model
from physicsnemo_foldcp.models.boltz2_config import (
    DEFAULT_EMBEDDER_ARGS,
    DEFAULT_MSA_ARGS,
    DEFAULT_PAIRFORMER_ARGS,
)
from physicsnemo_foldcp.testing import collective_assert
from physicsnemo_foldcp.testing.parity import close, randomize_parameters
from physicsnemo_foldcp.training import batched

pytest.importorskip("boltz")

from physicsnemo_foldcp.models.boltz2_trunk import Boltz2Trunk  # noqa: E402

pytestmark = pytest.mark.multigpu_static
mesh_id = lambda s: "x".join(map(str, s))  # noqa: E731


def make_trunk(checkpointing: bool = False) -> Boltz2Trunk:
    """A small trunk (one Pairformer block), the same weights on every rank."""
    torch.manual_seed(0)
    flag = {"activation_checkpointing": checkpointing}
    trunk = Boltz2Trunk(
        embedder_args={**DEFAULT_EMBEDDER_ARGS, **flag},
        msa_args={**DEFAULT_MSA_ARGS, **flag},
        pairformer_args={**DEFAULT_PAIRFORMER_ARGS, "num_blocks": 1, **flag},
    )
    return randomize_parameters(trunk, 3).train()


def counted_step(model, feats) -> tuple[dict[str, torch.Tensor], Counter, dict[str, int]]:
    """A warm step, then a counted one: its gradients, all-reduces and per-call reductions."""

    def step():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(11)  # the dropout draws
        unwrap(model).loss(model(**feats), feats).backward()

    step()
    with compat.comm_counter() as comm, count_reduced_per_call() as per_call:
        step()
    counts = Counter()
    for op, n in comm.get_comm_counts().items():
        counts["all_reduce" if "all_reduce" in str(op) or "allreduce" in str(op) else "other"] += n
    grads = {}
    for name, p in unwrap(model).named_parameters():
        if p.grad is not None:
            grads[name] = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
    return grads, counts, dict(per_call)


def compare(mesh, wrapper: str, checkpointing: bool = False) -> None:
    sample = batched(make_complex(37, seed=7, msa_rows=5, atom_multiple=32))
    feats = scatter_features(sample if mesh.is_domain_source else None, mesh)
    per_call_model = wrap_model(make_trunk(checkpointing), mesh, wrapper)
    expected, counts, per_call = counted_step(per_call_model, feats)
    bucketed_model = wrap_model(make_trunk(checkpointing), mesh, wrapper)
    buckets = attach_gradient_buckets(bucketed_model, mesh)
    got, bucketed_counts, bucketed_per_call = counted_step(bucketed_model, feats)

    problems = []
    if not isinstance(buckets, GradientBuckets) or attached_buckets(bucketed_model) is not buckets:
        problems.append(f"no buckets attached: {buckets!r}")
    if per_call["collectives"] <= buckets.reductions:
        problems.append(f"per-call step made {per_call} parameter reductions only")
    if bucketed_per_call["calls"]:
        problems.append(f"with buckets, {bucketed_per_call} parameter reductions per call")
    if not 1 <= buckets.reductions <= len(buckets.buckets):
        problems.append(f"{buckets.reductions} bucket reductions, {buckets.describe()}")
    # DDP's own reductions (over ddp) are in both steps; the buckets' come on top.
    expected_reduces = counts["all_reduce"] - per_call["collectives"] + buckets.reductions
    if bucketed_counts["all_reduce"] != expected_reduces:
        problems.append(
            f"all-reduces per step: {bucketed_counts['all_reduce']} with buckets, "
            f"{counts['all_reduce']} per call of which {per_call['collectives']} reduced "
            f"parameter gradients, {buckets.reductions} bucket reductions"
        )
    if bucketed_counts["other"] != counts["other"]:
        problems.append(f"other collectives {bucketed_counts} vs {counts}")
    if set(got) != set(expected) or len(got) < 100:
        problems.append(f"gradients of {sorted(set(got) ^ set(expected))[:4]} in one run only")
    for name in sorted(set(got) & set(expected)):
        close(got[name], expected[name], f"grad {name}", problems, rtol=1e-5, atol=1e-6)
    collective_assert(
        not problems,
        f"{wrapper} on {mesh.shape}, {buckets.describe() if buckets else ''}: "
        + "; ".join(problems[:6]),
    )


@pytest.mark.parametrize("fold_mesh", [(1, 2, 2), (1, 2, 3)], indirect=True, ids=mesh_id)
def test_bucketed_gradients_equal_per_call_ones_with_few_reductions(fold_mesh):
    compare(fold_mesh, "none")


@pytest.mark.parametrize("fold_mesh", [(1, 2, 2)], indirect=True, ids=mesh_id)
def test_buckets_hold_under_reentrant_activation_checkpointing(fold_mesh):
    compare(fold_mesh, "none", checkpointing=True)


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
@pytest.mark.parametrize("fold_mesh", [(2, 1, 2)], indirect=True, ids=mesh_id)
def test_buckets_compose_with_ddp_and_fsdp2(fold_mesh, wrapper):
    compare(fold_mesh, wrapper)
