"""MSA rows picked by a replicated index (``m[:, idx]``): sent from their holders, no gather.

Serial vs distributed on 1x2 to 3x3 meshes (two replicas on the 1x2 and 2x1 ones), MSA
depths 7 and 13 (uneven row blocks), N = 23: a random permutation prefix (Boltz-2's
subsampling), a full permutation, and repeated and negative indices. The forward is exact
(``torch.equal``) and laid out as the plan lays out an MSA of the new depth; the input
gradient matches serial; there is no gather event and no collective in the forward, and
each rank receives, forward, exactly the rows of its output block held by other ranks and,
backward, the gradients of the rows it sent.
"""

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.placement_types import Shard

from physicsnemo_foldcp.core import events
from physicsnemo_foldcp.core.blocks import block_starts
from physicsnemo_foldcp.testing import collective_assert
from physicsnemo_foldcp.testing.collectives import collective_counts, count_p2p
from physicsnemo_foldcp.testing.layouts import TokenLayout
from physicsnemo_foldcp.testing.parity import close

pytestmark = pytest.mark.multigpu_static
MESHES = [(2, 1, 2), (2, 2, 1), (1, 2, 2), (1, 2, 3), (1, 3, 2), (1, 3, 3)]
mesh_id = lambda s: "x".join(map(str, s))  # noqa: E731
N, CHANNELS = 23, 3
MSA = ("msa", "tokens", None)
MSA_MASK = ("msa", "tokens")


def make_index(kind: str, depth: int) -> torch.Tensor:
    """The index of one case, the same on every rank."""
    g = torch.Generator().manual_seed(depth)
    if kind == "prefix":
        return torch.randperm(depth, generator=g)[:5]
    if kind == "permutation":
        return torch.randperm(depth, generator=g)
    picks = torch.randint(0, depth, (depth + 4,), generator=g)
    picks[1] = picks[-1] = picks[0]  # one row three times
    picks[2] = -1  # the last row, counted from the end
    return picks


def owner_of(rows: list[int], value: int) -> int:
    """The cp0 block holding row ``value`` of an MSA in blocks ``rows``."""
    starts = block_starts(rows)
    return max(t for t in range(len(rows)) if starts[t] <= value and rows[t] > 0)


def expected_rows(index: torch.Tensor, depth: int, rows_in, rows_out, p: int) -> tuple[int, int]:
    """``(rows received forward, rows received backward)`` by cp0 block ``p``."""
    owners = [owner_of(rows_in, int(v) % depth) for v in index]
    start = block_starts(rows_out)
    mine = range(start[p], start[p] + rows_out[p])
    forward = sum(1 for o in mine if owners[o] != p)
    backward = sum(1 for o, t in enumerate(owners) if t == p and o not in mine)
    return forward, backward


@pytest.mark.parametrize("fold_mesh", MESHES, indirect=True, ids=mesh_id)
@pytest.mark.parametrize(
    "depth,kind", [(7, "prefix"), (7, "repeated"), (13, "permutation"), (13, "repeated")]
)
def test_msa_rows_picked_by_an_index_match_serial_without_a_gather(fold_mesh, depth, kind):
    index = make_index(kind, depth)
    k = index.numel()
    g = torch.Generator().manual_seed(2)
    m = torch.randn(1, depth, N, CHANNELS, generator=g)
    mask = (torch.rand(1, depth, N, generator=g) > 0.3).float()
    weight = torch.randn(1, k, N, CHANNELS, generator=g)
    before = TokenLayout(fold_mesh, N, n_msa=depth)
    after = TokenLayout(fold_mesh, N, n_msa=k)  # the plan of an MSA of the new depth
    m_st, m_leaf = before.shard(m, MSA, requires_grad=True)
    mask_st, _ = before.shard(mask, MSA_MASK)
    w_st, _ = after.shard(weight, MSA)

    gathers: list = []
    with events.observe(gathers.append), CommDebugMode() as forward, count_p2p() as p2p:
        picked = m_st[:, index]
        picked_mask = mask_st[:, index]
    with count_p2p() as p2p_back:
        (picked * w_st).sum().backward()

    m_ref = m.clone().requires_grad_(True)
    ref = m_ref[:, index]
    (ref * weight).sum().backward()

    problems: list[str] = []
    if tuple(picked.placements) != (Shard(1), Shard(2)) or tuple(picked.shape) != ref.shape:
        problems.append(f"layout {picked.placements} {tuple(picked.shape)}")
    if not torch.equal(picked.full_tensor(), ref.detach()):
        problems.append("forward differs from serial")
    if not torch.equal(picked.to_local(), after.local(ref.detach(), MSA)):
        problems.append("the local block is not the plan's block of the new depth")
    if not torch.equal(picked_mask.to_local(), after.local(mask[:, index], MSA_MASK)):
        problems.append("mask block differs from serial")
    close(m_leaf.grad, before.local(m_ref.grad, MSA), "grad m", problems, rtol=1e-6, atol=1e-6)
    if gathers or collective_counts(forward):
        problems.append(f"forward gathered {gathers}, collectives {collective_counts(forward)}")

    p, q = fold_mesh.domain_coordinate
    rows_in, rows_out = before.plan.row_sizes("msa"), after.plan.row_sizes("msa")
    rows_forward, rows_backward = expected_rows(index, depth, rows_in, rows_out, p)
    columns = before.plan.column_sizes()[q]
    row_bytes = columns * (CHANNELS * m.element_size() + mask.element_size())
    if p2p["received"] != rows_forward * row_bytes:
        problems.append(f"received {p2p['received']} B forward, expected {rows_forward} rows")
    if p2p_back["received"] != rows_backward * columns * CHANNELS * m.element_size():
        problems.append(
            f"received {p2p_back['received']} B backward, expected {rows_backward} rows"
        )
    collective_assert(not problems, f"rank {(p, q)}: " + "; ".join(problems))


@pytest.mark.parametrize("fold_mesh", [(1, 2, 2), (1, 3, 3)], indirect=True, ids=mesh_id)
def test_index_select_of_msa_rows_takes_the_same_path(fold_mesh):
    index = make_index("prefix", 13)
    m = torch.randn(1, 13, N, CHANNELS, generator=torch.Generator().manual_seed(5))
    layout = TokenLayout(fold_mesh, N, n_msa=13)
    problems: list[str] = []
    for label, pick in (
        ("torch.index_select", lambda x: torch.index_select(x, 1, index)),
        ("Tensor.index_select", lambda x: x.index_select(-3, index=index)),
    ):
        m_st, m_leaf = layout.shard(m, MSA, requires_grad=True)
        gathers: list = []
        with events.observe(gathers.append):
            out = pick(m_st)
        out.pow(2).sum().backward()
        m_ref = m.clone().requires_grad_(True)
        ref = pick(m_ref)
        ref.pow(2).sum().backward()
        if gathers or not torch.equal(out.full_tensor(), ref.detach()):
            problems.append(f"{label}: gathers {gathers} or a forward that differs")
        close(m_leaf.grad, layout.local(m_ref.grad, MSA), f"{label}: grad m", problems)
    collective_assert(not problems, "; ".join(problems))


@pytest.mark.parametrize("fold_mesh", [(1, 2, 2)], indirect=True, ids=mesh_id)
def test_an_out_of_range_index_raises_on_every_rank(fold_mesh):
    layout = TokenLayout(fold_mesh, N, n_msa=7)
    m_st, _ = layout.shard(torch.zeros(1, 7, N, CHANNELS), MSA)
    for bad in (torch.tensor([0, 7]), torch.tensor([-8])):
        with pytest.raises(IndexError, match="out of bounds"):
            m_st[:, bad]
    with pytest.raises(IndexError, match="out of bounds"):
        m_st.index_select(1, torch.tensor([-1]))


@pytest.mark.parametrize("fold_mesh", [(1, 2, 2)], indirect=True, ids=mesh_id)
def test_a_token_single_indexed_by_a_tensor_keeps_the_generic_path(fold_mesh):
    """A single's rows are tokens: the replicated result still meets token features."""
    layout = TokenLayout(fold_mesh, N)
    s = torch.randn(1, N, CHANNELS, generator=torch.Generator().manual_seed(4))
    s_st, _ = layout.shard(s, ("tokens", None))
    index = torch.tensor([3, 0, 22, 3])
    gathers: list = []
    with events.observe(gathers.append):
        out = s_st[:, index]
    collective_assert(torch.equal(out.full_tensor(), s[:, index]), "single[:, idx] differs")
    collective_assert(
        bool(gathers) and not isinstance(out.placements[0], Shard),
        f"expected the generic gather, got {gathers}, {out.placements}",
    )
