"""Ops without a handler keep the uneven blocks of their operands through the DTensor fallback.

Without :mod:`physicsnemo_foldcp.ops.uneven_fallback`, PhysicsNeMo infers a result's local
shapes from ``torch.chunk`` of its global shape, which disagrees with the plan's blocks
(7 tokens on 3 rows are 3, 2, 2; ``torch.chunk`` gives 3, 3, 1).
"""

import pytest
import torch
from torch.distributed.tensor.placement_types import Shard

from physicsnemo_foldcp import scatter_features
from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.ops import uneven_fallback
from physicsnemo_foldcp.testing import collective_assert
from physicsnemo_foldcp.testing.asserts import gather_failures

pytestmark = pytest.mark.multigpu_static


def shape_changing_steps():
    """(name, fn) pairs of model steps on ``[L, C]`` (``L`` sharded) that change ``C``'s
    length or split it, as a model's heads and concatenations do."""
    return [
        ("cat", lambda t: torch.cat([t, 2 * t], dim=-1)),
        ("unflatten", lambda t: t.unflatten(-1, (1, t.shape[-1]))),
        ("flatten", lambda t: t.unflatten(-1, (1, t.shape[-1])).flatten(-2)),
        ("sum", lambda t: t.sum(-1)),
        ("mean", lambda t: t.mean(-1, keepdim=True)),
        ("slice", lambda t: t[..., :1]),
    ]


@pytest.mark.parametrize("fold_mesh", [(1, 2, 2), (1, 3, 2), (1, 3, 3)], indirect=True, ids=str)
def test_shape_changing_ops_on_uneven_blocks_match_serial(fold_mesh):
    x = make_complex(7, seed=5, preset="boltz2", msa_rows=2)
    sharded = scatter_features(x if fold_mesh.is_domain_source else None, fold_mesh)
    problems = []
    if not uneven_fallback.installed():
        problems.append("the fallback fix is not installed by importing the package")
    for name in ("ref_pos", "coords", "profile"):
        st, serial = sharded[name].float(), x[name].float()
        sharded_dims = {p.dim for p in st.placements if isinstance(p, Shard)}
        for step, fn in shape_changing_steps():
            local_problem = None
            try:
                out = fn(st)
                lengths = [out.to_local().shape[d] for d in sharded_dims]
                if lengths != [st.to_local().shape[d] for d in sharded_dims]:
                    local_problem = f"{name}.{step}: local lengths {lengths} left the blocks"
            except Exception as error:  # noqa: BLE001 - reported collectively
                local_problem = f"{name}.{step}: {type(error).__name__}: {error}"
            failures = gather_failures(local_problem)  # full_tensor only if every rank can
            if failures:
                problems += [f"rank {r}: {m}" for r, m in failures.items()]
            elif not torch.equal(out.full_tensor(), fn(serial)):
                problems.append(f"{name}.{step}: values differ from serial")
    collective_assert(not problems, "; ".join(problems))


@pytest.mark.parametrize("fold_mesh", [(1, 3, 2)], indirect=True, ids=str)
def test_sharding_shapes_follow_an_operand_only_when_its_sharded_lengths_hold(fold_mesh):
    x = make_complex(7, seed=5, preset="boltz2", msa_rows=2)
    st = scatter_features(x if fold_mesh.is_domain_source else None, fold_mesh)["ref_pos"]
    shape = list(st.shape)
    widened = uneven_fallback.sharding_shapes_like(st, [*shape[:-1], 5], st.placements)
    expected = {
        m: [(*s[:-1], 5) for s in per_rank] for m, per_rank in st._spec.sharding_shapes().items()
    }
    problems = []
    if widened != expected:
        problems.append(f"widened result: {widened} != {expected}")
    shorter = list(shape)
    shorter[st.placements[0].dim] -= 1  # the sharded atoms axis changes length
    if uneven_fallback.sharding_shapes_like(st, shorter, st.placements) is not None:
        problems.append("a changed sharded length still copied the operand's blocks")
    collective_assert(not problems, "; ".join(problems))
