"""Boltz's OuterProductMean, unmodified, from a scattered MSA to pair tiles.

Serial vs distributed with the same weights: the output (``full_tensor`` and this rank's
tile), the MSA's gradient and every parameter gradient (TF32 off), train and eval mode
(eval with Boltz's ``chunk_size``), on 1x2 to 3x3 meshes with uneven blocks, an MSA depth
that does not divide evenly, masked padded tokens and masked MSA entries; no gather event,
and the forward's collectives as the handler states them.
"""

import copy

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode

from physicsnemo_foldcp.core import events
from physicsnemo_foldcp.kernels.budget import recompute_in_backward
from physicsnemo_foldcp.sharding.plan import column_block_sizes
from physicsnemo_foldcp.testing import collective_assert
from physicsnemo_foldcp.testing.collectives import collective_counts
from physicsnemo_foldcp.testing.flops import LocalFlops, summed_over_mesh
from physicsnemo_foldcp.testing.layouts import TokenLayout
from physicsnemo_foldcp.testing.parity import close, randomize_parameters

outer_product_mean = pytest.importorskip("boltz.model.layers.outer_product_mean")

pytestmark = pytest.mark.multigpu_static
MESHES = [(2, 1, 2), (2, 2, 1), (1, 2, 2), (1, 2, 3), (1, 3, 2), (1, 3, 3)]
mesh_id = lambda s: "x".join(map(str, s))  # noqa: E731
C_M, C_H, C_Z, MSA_ROWS = 8, 4, 16, 7
MSA = ("msa", "tokens", None)
PAIR = ("tokens", "tokens", None)


def stated_forward_collectives(fold_mesh, rows: list[int]) -> dict[str, int]:
    """The handler's docstring: ONE all-to-all over cp0; over cp1 ONE all-gather of the
    pieces ``R_p ∩ C_l`` of ``a``'s strip, or ONE all-reduce when padding them to the
    widest would more than double the strip."""
    _, cp0, cp1 = fold_mesh.shape
    columns = column_block_sizes(rows, cp1)
    p, _ = fold_mesh.domain_coordinate
    row_start = sum(rows[:p])
    pieces = []
    for col in range(cp1):
        col_start = sum(columns[:col])
        low = max(row_start, col_start)
        high = min(row_start + rows[p], col_start + columns[col])
        pieces.append(max(0, high - low))
    expected = {"all_to_all": int(cp0 > 1)}
    if cp1 > 1:
        by_sum = cp1 * max(pieces) > 2 * sum(pieces)
        expected["all_reduce" if by_sum else "all_gather"] = 1
    return {k: v for k, v in expected.items() if v}


def msa_inputs(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``m [1, S, n, C_M]`` and its mask: padded tokens, random masked entries, one empty row."""
    g = torch.Generator().manual_seed(1)
    m = torch.randn(1, MSA_ROWS, n, C_M, generator=g)
    tokens = torch.ones(1, 1, n)
    tokens[..., -3:] = 0
    mask = (torch.rand(1, MSA_ROWS, n, generator=g) > 0.25).float() * tokens
    mask[:, 0] = tokens[:, 0]  # the query row sees every real token
    mask[:, 4] = 0  # an MSA row with no entries
    return m, mask


def run_and_compare(fold_mesh, layout, module, n, training, row_sizes=None) -> list[str]:
    """Run serial and distributed, return the differences found (empty when they agree)."""
    serial = copy.deepcopy(module)
    m, mask = msa_inputs(n)
    chunk_size = None if training else 2
    m_st, m_leaf = layout.shard(m, MSA, requires_grad=True)
    mask_st, _ = layout.shard(mask, ("msa", "tokens"))
    extra = {} if row_sizes is None else {"row_sizes": row_sizes}
    gathers: list = []
    with events.observe(gathers.append), CommDebugMode() as forward:
        out = module(m_st, mask_st, chunk_size, **extra)
    out.pow(2).sum().backward()

    m_ref = m.clone().requires_grad_(True)
    ref = serial(m_ref, mask, chunk_size)
    ref.pow(2).sum().backward()

    problems: list[str] = []
    close(out.to_local().detach(), layout.local(ref.detach(), PAIR), "output tile", problems)
    close(out.full_tensor().detach(), ref.detach(), "output", problems)
    close(m_leaf.grad, layout.local(m_ref.grad, MSA), "grad m", problems)
    for (name, p), (_, q) in zip(module.named_parameters(), serial.named_parameters()):
        close(p.grad, q.grad, f"grad {name}", problems)
    if gathers:
        problems.append(f"gathered: {[(e.op, e.reason) for e in gathers]}")
    expected = stated_forward_collectives(fold_mesh, layout.plan.row_sizes("tokens"))
    if collective_counts(forward) != expected:
        problems.append(f"forward collectives {collective_counts(forward)}, stated {expected}")
    return problems


def make_module(training: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    module = outer_product_mean.OuterProductMean(c_in=C_M, c_hidden=C_H, c_out=C_Z)
    return randomize_parameters(module, 5).train(training)


@pytest.mark.parametrize("fold_mesh", MESHES, indirect=True, ids=mesh_id)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("n", [23, 37])
def test_outer_product_mean_matches_serial(fold_mesh, training, n):
    layout = TokenLayout(fold_mesh, n, n_msa=MSA_ROWS)
    problems = run_and_compare(fold_mesh, layout, make_module(training), n, training)
    collective_assert(not problems, "; ".join(problems))


@pytest.mark.parametrize("fold_mesh", [(1, 2, 3), (1, 3, 2)], indirect=True, ids=mesh_id)
def test_outer_product_mean_on_balanced_row_blocks(fold_mesh):
    """Row blocks that are not the even split (a balanced plan) on a non-square mesh: the
    handler takes them from ``row_sizes``."""
    n = 23
    cp0 = fold_mesh.shape[1]
    bounds = [0, 5, 23] if cp0 == 2 else [0, 4, 15, 23]
    layout = TokenLayout(fold_mesh, n, token_bounds=bounds, n_msa=MSA_ROWS)
    rows = layout.plan.row_sizes("tokens")
    problems = run_and_compare(fold_mesh, layout, make_module(True), n, True, row_sizes=rows)
    collective_assert(not problems, "; ".join(problems))


@pytest.mark.parametrize("fold_mesh", [(1, 2, 3)], indirect=True, ids=mesh_id)
def test_kept_outer_product_matches_serial(fold_mesh):
    """The outer product kept from forward for the weight's gradient, not recomputed."""
    n = 37
    layout = TokenLayout(fold_mesh, n, n_msa=MSA_ROWS)
    with recompute_in_backward(False):
        problems = run_and_compare(fold_mesh, layout, make_module(True), n, True)
    collective_assert(not problems, "; ".join(problems))


@pytest.mark.parametrize("fold_mesh", [(1, 2, 2)], indirect=True, ids=mesh_id)
def test_kept_outer_product_does_the_serial_modules_flops(fold_mesh):
    """FLOPs of all ranks' forward + backward (torch's formulas on local blocks): kept, the
    serial module's exactly; recomputed, the outer product once more (more).

    The mask count ``sum_s mask[s, i] mask[s, j]`` is the same work on both sides, but
    Boltz forms it with element-wise products (no FLOPs in torch's formulas) and the tiles
    with a matrix product (``2 S N^2`` FLOPs in all), which is added to the serial count.
    """
    n = 23
    m, mask = msa_inputs(n)
    with LocalFlops() as counted:
        make_module(True)(m.clone().requires_grad_(True), mask, None).pow(2).sum().backward()
    want = counted.total + 2 * MSA_ROWS * n * n
    layout = TokenLayout(fold_mesh, n, n_msa=MSA_ROWS)
    totals = {}
    for recompute in (False, True):
        module = make_module(True)
        m_st, _ = layout.shard(m, MSA, requires_grad=True)
        mask_st, _ = layout.shard(mask, ("msa", "tokens"))
        with recompute_in_backward(recompute), LocalFlops() as counted:
            module(m_st, mask_st, None).to_local().pow(2).sum().backward()
        totals[recompute] = summed_over_mesh(counted.total, fold_mesh.domain_mesh)
    collective_assert(
        totals[False] == want and totals[True] > want,
        f"FLOPs of all ranks: kept {totals[False]}, recomputed {totals[True]}; serial {want}",
    )
