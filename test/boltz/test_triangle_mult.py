"""Boltz's triangle multiplication on pair tiles: serial parity, gradients, communication.

The module is Boltz's own, unmodified: after ``physicsnemo_foldcp.boltz.install()`` it is
called on the scatter's layout of ``x`` and ``mask`` (pair tiles with uneven row blocks
and the plan's column blocks) and compared with the same weights run serially.
"""

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard
from torch.distributed.tensor.debug import CommDebugMode

import physicsnemo_foldcp.boltz
from physicsnemo_foldcp.boltz.triangle_mult import handlers
from physicsnemo_foldcp.core.blocks import tile_shapes
from physicsnemo_foldcp.core.compat import sharding_shapes
from physicsnemo_foldcp.kernels.budget import DEFAULT_WORK_BUDGET_MIB, work_budget
from physicsnemo_foldcp.kernels.triangle_product import PANEL_BUFFERS, panel_count, panel_plan
from physicsnemo_foldcp.ops import ShardingLayoutError, wrap
from physicsnemo_foldcp.sharding.plan import column_block_sizes, split_sizes
from physicsnemo_foldcp.testing import collective_assert, collective_assert_close
from physicsnemo_foldcp.testing.collectives import collective_counts, count_p2p

triangular_mult = pytest.importorskip("boltz.model.layers.triangular_mult")
CLASSES = {
    "outgoing": triangular_mult.TriangleMultiplicationOutgoing,
    "incoming": triangular_mult.TriangleMultiplicationIncoming,
}
DIM = 16
TINY_BUDGET_MIB = 1 / (1 << 20)
"""One byte: every contraction takes the most panels, max(cp0, cp1)."""

MESHES = [(2, 1, 2), (2, 2, 1), (1, 2, 2), (1, 2, 3), (1, 3, 2), (1, 3, 3)]
mesh_param = pytest.mark.parametrize(
    "fold_mesh", MESHES, indirect=True, ids=lambda s: "x".join(map(str, s))
)
direction_param = pytest.mark.parametrize("direction", list(CLASSES))
distributed = pytest.mark.multigpu_static


# -- helpers ---------------------------------------------------------------------------------


def skewed_sizes(n: int, parts: int) -> list[int]:
    """Row blocks that differ by more than one token (a balanced plan's boundaries)."""
    sizes = split_sizes(n, parts)
    if parts > 1:
        sizes[0] += 3
        sizes[-1] -= 3
    return sizes


def blocks(n: int, cp0: int, cp1: int, rows: str) -> tuple[list[int], list[int]]:
    """``(row sizes, column sizes)`` of the pair tile, as the scatter's plan cuts them."""
    row_sizes = skewed_sizes(n, cp0) if rows == "skewed" else split_sizes(n, cp0)
    return row_sizes, column_block_sizes(row_sizes, cp1)


def tile(full, fold_mesh, row_sizes, col_sizes, requires_grad=False):
    """``(FoldTensor pair tile, its local leaf)`` of a serial ``[B, N, N, ...]`` tensor."""
    i, j = fold_mesh.domain_coordinate
    r0, c0 = sum(row_sizes[:i]), sum(col_sizes[:j])
    local = full[:, r0 : r0 + row_sizes[i], c0 : c0 + col_sizes[j]].clone()
    leaf = local.to(fold_mesh.device).requires_grad_(requires_grad)
    shapes = tile_shapes(leaf.shape, 1, row_sizes, col_sizes, (i, j))
    return wrap(leaf, fold_mesh.domain_mesh, (Shard(1), Shard(2)), shapes), leaf


def local_block(full, fold_mesh, row_sizes, col_sizes):
    i, j = fold_mesh.domain_coordinate
    r0, c0 = sum(row_sizes[:i]), sum(col_sizes[:j])
    return full[:, r0 : r0 + row_sizes[i], c0 : c0 + col_sizes[j]]


def boltz_module(direction: str, seed: int = 0):
    """A Boltz triangle multiplication with random weights (Boltz zero-initialises p_out)."""
    torch.manual_seed(seed)
    module = CLASSES[direction](DIM)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if name.startswith("norm") and name.endswith("weight"):
                p.copy_(1 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))
    return module


def sample(n: int, padded: int = 3, seed: int = 1):
    """``x [1, N, N, D]``, the pair mask of N tokens whose last ``padded`` are padding, weights."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(1, n, n, DIM, generator=generator)
    tokens = torch.ones(n)
    tokens[n - padded :] = 0
    mask = (tokens[:, None] * tokens[None, :]).unsqueeze(0)
    weights = torch.randn(1, n, n, DIM, generator=generator)
    return x, mask, weights


def assert_close(actual, expected, name):
    """fp32 parity: rtol 1e-5 with an absolute tolerance scaled to the tensor."""
    atol = 1e-5 * float(expected.detach().abs().max()) + 1e-7
    collective_assert_close(actual.detach().cpu(), expected.detach(), name, rtol=1e-5, atol=atol)


@pytest.fixture(autouse=True)
def installed():
    physicsnemo_foldcp.boltz.install()
    yield
    physicsnemo_foldcp.boltz.uninstall()


class BytesReceived(CommDebugMode):
    """CommDebugMode that also adds up the bytes each collective delivers to this rank.

    A rank receives ``(g - 1) x input`` from an all-gather over ``g`` ranks and ``input -
    output`` (``(g - 1)`` pieces) from a reduce-scatter, as ring algorithms move them.
    """

    def __init__(self):
        super().__init__()
        self.received = 0
        self.largest = 0  # bytes of the largest buffer a collective writes or reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is NotImplemented:
            return out
        name = str(func)
        if "all_gather_into_tensor" in name:
            self.received += out.nbytes - args[0].nbytes
            self.largest = max(self.largest, out.nbytes)
        elif "reduce_scatter_tensor" in name:
            self.received += args[0].nbytes - out.nbytes
            self.largest = max(self.largest, args[0].nbytes)
        elif "all_reduce" in name or "broadcast" in name or "all_to_all" in name:
            raise AssertionError(f"unexpected collective {name} in the contraction's forward")
        return out


# -- the panels (single process) ---------------------------------------------------------------


@pytest.mark.parametrize(
    "rows, cols, panels",
    [([12, 11], [12, 11], 2), ([15, 8], [8, 8, 7], 3), ([10, 8, 5], [12, 11], 3), ([7], [7], 1)],
)
def test_panels_cover_every_token_once_and_split_both_partitions_evenly(rows, cols, panels):
    plan = panel_plan(rows, cols, panels)
    covered = [t for p in plan for s, n in p.runs for t in range(s, s + n)]
    assert sorted(covered) == list(range(sum(rows)))
    for sizes, counts in ((rows, "gathered_counts"), (cols, "scattered_counts")):
        for k, size in enumerate(sizes):
            per_panel = [getattr(p, counts)[k] for p in plan]
            assert sum(per_panel) == size
            # every panel takes ~1/S of every block: at most one token per segment off
            assert max(per_panel) - min(per_panel) <= len(rows) + len(cols)
            positions = [q for p in plan for q in p.local_positions(sizes, k)]
            assert sorted(positions) == list(range(size))


def test_panel_count_is_the_fewest_that_fit_the_budget_within_the_mesh_bounds():
    rows, cols = [20, 20, 20], [30, 30]  # N = 60, widest block 30
    one_panel = PANEL_BUFFERS * 2 * 60 * 30 * DIM * 4  # batch 2, fp32
    mib = 1 << 20
    for budget_bytes, panels in (
        (one_panel, 1),
        (one_panel - 1, 2),
        (one_panel // 2, 2),
        (one_panel // 2 - 1, 3),
        (1, 3),  # never more than max(cp0, cp1)
    ):
        with work_budget(budget_bytes / mib):
            assert panel_count(rows, cols, 2, DIM, 4) == panels, budget_bytes


def test_the_handlers_cover_both_directions():
    assert [cls for cls, _ in handlers()] == list(CLASSES.values())
    installed = physicsnemo_foldcp.boltz.install()
    assert all(
        f"triangular_mult.{cls.__qualname__}" in " ".join(installed) for cls in CLASSES.values()
    )


@direction_param
def test_plain_tensors_still_run_boltz_forward(direction):
    module = boltz_module(direction)
    x, mask, _ = sample(9)
    physicsnemo_foldcp.boltz.uninstall()
    expected = module(x, mask)
    physicsnemo_foldcp.boltz.install()
    assert torch.equal(module(x, mask), expected)


# -- distributed -------------------------------------------------------------------------------


@distributed
@mesh_param
@direction_param
@pytest.mark.parametrize(
    "n, rows, budget_mib",
    [(23, "skewed", None), (23, "skewed", TINY_BUDGET_MIB), (37, "even", None)],
    ids=["n23-skewed", "n23-skewed-most-panels", "n37-even"],
)
def test_matches_serial_output_input_and_parameter_gradients(
    fold_mesh, direction, n, rows, budget_mib
):
    with work_budget(budget_mib or DEFAULT_WORK_BUDGET_MIB):
        check_against_serial(fold_mesh, direction, n, rows)


def check_against_serial(fold_mesh, direction, n, rows):
    """Output, input gradient and parameter gradients of one call against the serial module."""
    _, cp0, cp1 = fold_mesh.shape
    row_sizes, col_sizes = blocks(n, cp0, cp1, rows)
    serial = boltz_module(direction)
    module = copy.deepcopy(serial).to(fold_mesh.device)
    x, mask, weights = sample(n)

    x_serial = x.clone().requires_grad_(True)
    out_serial = serial(x_serial, mask)
    (out_serial * weights).sum().backward()

    x_tile, x_leaf = tile(x, fold_mesh, row_sizes, col_sizes, requires_grad=True)
    mask_tile, _ = tile(mask, fold_mesh, row_sizes, col_sizes)
    w_local = local_block(weights, fold_mesh, row_sizes, col_sizes).to(fold_mesh.device)
    out = module(x_tile, mask=mask_tile)
    (out.to_local() * w_local).sum().backward()

    expected_shapes = tile_shapes(
        out.to_local().shape, 1, row_sizes, col_sizes, fold_mesh.domain_coordinate
    )
    collective_assert(
        tuple(out.placements) == (Shard(1), Shard(2))
        and {k: list(v) for k, v in sharding_shapes(out).items()} == expected_shapes,
        f"output layout {out.placements} {sharding_shapes(out)}, expected {expected_shapes}",
    )
    assert_close(out.full_tensor(), out_serial, "output")
    assert_close(
        x_leaf.grad, local_block(x_serial.grad, fold_mesh, row_sizes, col_sizes), "grad of x"
    )
    for (name, p), p_serial in zip(module.named_parameters(), serial.parameters()):
        assert_close(p.grad, p_serial.grad, f"grad of {name}")


def expected_counts(direction, cp0, cp1, panels):
    """Collectives per call as the docstring states them: (forward, backward)."""
    gathered, scattered = (cp0, cp1) if direction == "outgoing" else (cp1, cp0)
    forward = {"all_gather": panels * (gathered > 1), "reduce_scatter": panels * (scattered > 1)}
    backward = {
        "all_gather": panels * (scattered > 1) + panels * (gathered > 1),
        "reduce_scatter": panels * (gathered > 1),
        "all_reduce": (cp0 > 1) + (cp1 > 1),
    }
    return {k: v for k, v in forward.items() if v}, {k: v for k, v in backward.items() if v}


@distributed
@mesh_param
@direction_param
@pytest.mark.parametrize("budget_mib", [TINY_BUDGET_MIB, None], ids=["most-panels", "one-panel"])
def test_forward_receives_cannon_volume_and_states_its_collectives(
    fold_mesh, direction, budget_mib
):
    """Bytes received per rank in forward: (cp0 - 1) + (cp1 - 1) tiles, within 10 %.

    On a square P x P mesh that is 2 (P - 1) tiles, what Cannon's algorithm shifts for the
    same tiles; on 2x3 and 3x2, 3 tiles (N = 48, tiles of 24 x 16: 3.12 measured). With a
    budget below one tile (max(cp0, cp1) panels) no buffer a collective fills is larger
    than about one tile, whatever the mesh; with the default budget the small tiles take
    one panel: the same bytes in one collective of each kind.
    """
    _, cp0, cp1 = fold_mesh.shape
    n = 48
    row_sizes, col_sizes = blocks(n, cp0, cp1, "even")
    module = boltz_module(direction).to(fold_mesh.device)
    x, mask, weights = sample(n)
    x_tile, _ = tile(x, fold_mesh, row_sizes, col_sizes, requires_grad=True)
    mask_tile, _ = tile(mask, fold_mesh, row_sizes, col_sizes)
    tile_bytes = (n // cp0) * (n // cp1) * DIM * 4

    panels = max(cp0, cp1) if budget_mib else 1
    with work_budget(budget_mib or DEFAULT_WORK_BUDGET_MIB):
        with count_p2p() as p2p, BytesReceived() as forward:
            out = module(x_tile, mask_tile)
        w_local = local_block(weights, fold_mesh, row_sizes, col_sizes).to(fold_mesh.device)
        with count_p2p() as p2p_backward, CommDebugMode() as backward:
            (out.to_local() * w_local).sum().backward()

    tiles = forward.received / tile_bytes
    stated = (cp0 - 1) + (cp1 - 1)
    collective_assert(
        abs(tiles - stated) <= 0.1 * max(stated, 1),
        f"forward received {tiles:.3f} tiles per rank, stated {stated}",
    )
    largest = 1.25 * (1 if budget_mib else max(cp0, cp1)) * tile_bytes
    collective_assert(
        forward.largest <= largest,
        f"a collective buffer holds {forward.largest / tile_bytes:.3f} tiles ({panels} panels)",
    )
    if cp0 == cp1:
        cannon = 2 * (cp0 - 1)
        collective_assert(
            abs(tiles - cannon) <= 0.1 * cannon,
            f"forward received {tiles:.3f} tiles, Cannon shifts {cannon}",
        )
    want_forward, want_backward = expected_counts(direction, cp0, cp1, panels)
    got_forward, got_backward = collective_counts(forward), collective_counts(backward)
    collective_assert(
        (got_forward, got_backward) == (want_forward, want_backward),
        f"collectives forward {got_forward}, backward {got_backward}; stated "
        f"{want_forward}, {want_backward}",
    )
    collective_assert(
        p2p["calls"] == 0 and p2p_backward["calls"] == 0,
        f"point-to-point calls: {p2p['calls']} forward, {p2p_backward['calls']} backward",
    )


@distributed
@pytest.mark.parametrize("fold_mesh", [(1, 2, 2), (1, 3, 3)], indirect=True, ids=["1x2x2", "1x3x3"])
@direction_param
def test_uneven_tiles_receive_within_ten_percent_of_cannon(fold_mesh, direction):
    """N = 23 on a square mesh (blocks differing by one token): the domain's total bytes
    against Cannon's 2 (P - 1) N^2 D fp32 values for the same tiles."""
    _, p, _ = fold_mesh.shape
    n = 23
    row_sizes, col_sizes = blocks(n, p, p, "even")
    module = boltz_module(direction).to(fold_mesh.device)
    x, mask, _ = sample(n)
    x_tile, _ = tile(x, fold_mesh, row_sizes, col_sizes)
    mask_tile, _ = tile(mask, fold_mesh, row_sizes, col_sizes)
    with torch.no_grad(), BytesReceived() as forward:
        module(x_tile, mask_tile)
    total = torch.tensor([float(forward.received)])
    dist.all_reduce(total)  # the world is the one domain group
    cannon = 2 * (p - 1) * n * n * DIM * 4
    ratio = float(total) / cannon
    collective_assert(abs(ratio - 1) <= 0.1, f"domain received {ratio:.3f} x Cannon's volume")


@distributed
@pytest.mark.parametrize("fold_mesh", [(1, 2, 2)], indirect=True, ids=["1x2x2"])
@direction_param
def test_refuses_kernels_and_mislaid_inputs(fold_mesh, direction):
    row_sizes, col_sizes = blocks(10, 2, 2, "even")
    module = boltz_module(direction)
    x, mask, _ = sample(10)
    x_tile, _ = tile(x, fold_mesh, row_sizes, col_sizes)
    mask_tile, _ = tile(mask, fold_mesh, row_sizes, col_sizes)
    outcomes = {}
    for label, call, error in (
        ("kernels", lambda: module(x_tile, mask_tile, use_kernels=True), ValueError),
        ("plain mask", lambda: module(x_tile, mask), ShardingLayoutError),
    ):
        try:
            call()
            outcomes[label] = "no error"
        except error as err:
            outcomes[label] = str(err)
    collective_assert(
        "not supported under context parallelism" in outcomes["kernels"]
        and "cuequivariance" in outcomes["kernels"],
        f"use_kernels=True: {outcomes['kernels']}",
    )
    collective_assert(
        "mask must be a ShardTensor" in outcomes["plain mask"], outcomes["plain mask"]
    )
