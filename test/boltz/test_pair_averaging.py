"""Boltz's PairWeightedAveraging, unmodified, on a scattered MSA and pair tile.

Serial vs distributed with the same weights: the output (``full_tensor``), the MSA's and the
pair's gradients and every parameter gradient (TF32 off), train and eval mode, on 1x2 to
3x3 meshes with uneven blocks, an MSA depth that does not divide evenly and masked padded
tokens; no gather event, and the forward's collectives as the handler states them.
"""

import copy

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode

from physicsnemo_foldcp.core import events
from physicsnemo_foldcp.kernels.triangle_attention import Layout
from physicsnemo_foldcp.sharding.plan import column_block_sizes
from physicsnemo_foldcp.testing import collective_assert
from physicsnemo_foldcp.testing.collectives import collective_counts
from physicsnemo_foldcp.testing.layouts import TokenLayout
from physicsnemo_foldcp.testing.parity import close, randomize_parameters

pair_averaging = pytest.importorskip("boltz.model.layers.pair_averaging")

pytestmark = pytest.mark.multigpu_static
MESHES = [(2, 1, 2), (2, 2, 1), (1, 2, 2), (1, 2, 3), (1, 3, 2), (1, 3, 3)]
mesh_id = lambda s: "x".join(map(str, s))  # noqa: E731
C_M, C_Z, MSA_ROWS = 8, 16, 7
MSA = ("msa", "tokens", None)
PAIR = ("tokens", "tokens", None)


def stated_forward_collectives(fold_mesh, layout) -> dict[str, int]:
    """The handler's docstring: the bias strip's all-to-all over cp1 and its all-gather (or
    all-reduce) over cp0, and one all-gather of the values over cp1."""
    _, cp0, cp1 = fold_mesh.shape
    rows = layout.plan.row_sizes("tokens")
    columns = column_block_sizes(rows, cp1)
    i, j = fold_mesh.domain_coordinate
    strip = Layout(fold_mesh.domain_mesh, 0, 1, tuple(rows), tuple(columns), i, j)
    expected = {"all_to_all": int(cp1 > 1), "all_gather": int(cp1 > 1), "all_reduce": 0}
    if cp0 > 1:
        expected["all_reduce" if strip.strip_by_sum() else "all_gather"] += 1
    return {k: v for k, v in expected.items() if v}


@pytest.mark.parametrize("fold_mesh", MESHES, indirect=True, ids=mesh_id)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("n", [23, 37])
def test_pair_weighted_averaging_matches_serial(fold_mesh, training, n):
    torch.manual_seed(0)
    module = pair_averaging.PairWeightedAveraging(c_m=C_M, c_z=C_Z, c_h=4, num_heads=2)
    module = randomize_parameters(module, 5).train(training)
    serial = copy.deepcopy(module)
    g = torch.Generator().manual_seed(1)
    m = torch.randn(1, MSA_ROWS, n, C_M, generator=g)
    z = torch.randn(1, n, n, C_Z, generator=g)
    tokens = torch.ones(1, n)
    tokens[:, -3:] = 0
    mask = tokens[:, :, None] * tokens[:, None, :]

    layout = TokenLayout(fold_mesh, n, n_msa=MSA_ROWS)
    m_st, m_leaf = layout.shard(m, MSA, requires_grad=True)
    z_st, z_leaf = layout.shard(z, PAIR, requires_grad=True)
    mask_st, _ = layout.shard(mask, ("tokens", "tokens"))
    gathers: list = []
    with events.observe(gathers.append), CommDebugMode() as forward:
        out = module(m_st, z_st, mask_st, chunk_heads=not training)
    out.pow(2).sum().backward()

    m_ref, z_ref = m.clone().requires_grad_(True), z.clone().requires_grad_(True)
    ref = serial(m_ref, z_ref, mask, chunk_heads=not training)
    ref.pow(2).sum().backward()

    problems: list[str] = []
    close(out.full_tensor().detach(), ref.detach(), "output", problems)
    close(m_leaf.grad, layout.local(m_ref.grad, MSA), "grad m", problems)
    close(z_leaf.grad, layout.local(z_ref.grad, PAIR), "grad z", problems)
    for (name, p), (_, q) in zip(module.named_parameters(), serial.named_parameters()):
        close(p.grad, q.grad, f"grad {name}", problems)
    if gathers:
        problems.append(f"gathered: {[(e.op, e.reason) for e in gathers]}")
    expected = stated_forward_collectives(fold_mesh, layout)
    if collective_counts(forward) != expected:
        problems.append(f"forward collectives {collective_counts(forward)}, stated {expected}")
    collective_assert(not problems, "; ".join(problems))
