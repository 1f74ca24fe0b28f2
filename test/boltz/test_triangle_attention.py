"""Boltz's TriangleAttention (starting and ending node) on pair tiles: serial parity.

The unmodified Boltz module, after ``physicsnemo_foldcp.boltz.install()``, runs on
FoldTensor pair tiles with uneven row and column blocks; output, input gradient and every
parameter gradient equal the serial module's on the full tensors (fp32, TF32 off), in
train mode and in eval mode with Boltz's row chunking; the collectives are the ones the
handler's docstring states, and no local tensor much larger than the local pair tile is
ever allocated.
"""

import copy
import dataclasses
import math

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.placement_types import Shard
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import physicsnemo_foldcp.boltz
from physicsnemo_foldcp.core.blocks import tile_shapes
from physicsnemo_foldcp.kernels.budget import (
    recompute_in_backward,
    recorded_pieces,
    work_budget,
)
from physicsnemo_foldcp.kernels.triangle_attention import (
    SCORE_COPIES,
    Layout,
    Stream,
    StreamedAttention,
)
from physicsnemo_foldcp.ops import wrap
from physicsnemo_foldcp.sharding.plan import column_block_sizes, split_sizes
from physicsnemo_foldcp.testing import collective_assert
from physicsnemo_foldcp.testing.collectives import collective_counts
from physicsnemo_foldcp.testing.flops import LocalFlops, summed_over_mesh

attention = pytest.importorskip("boltz.model.layers.triangular_attention.attention")

distributed = pytest.mark.multigpu_static

MESHES = [(2, 1, 2), (2, 2, 1), (1, 2, 2), (1, 2, 3), (1, 3, 2), (1, 3, 3)]
mesh_param = pytest.mark.parametrize(
    "fold_mesh", MESHES, indirect=True, ids=lambda s: "x".join(map(str, s))
)
NODES = pytest.mark.parametrize("starting", [True, False], ids=["starting", "ending"])
C_IN, HIDDEN, HEADS = 16, 8, 2
PADDED_TOKENS = 3
EVAL_CHUNK = 4
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}
LARGEST_LOCAL = 4
"""No local tensor of the distributed forward + backward exceeds this many local pair
tiles (elements): the streamed key/value/mask buffer is about ``(2 H c + 1) / C`` (~2) key
tiles of the rank's rows, and a key tile may be wider than the rank's own column block."""


def uneven_rows(n: int, cp0: int) -> list[int]:
    """Row blocks that differ by more than one (the first two blocks skewed by 2)."""
    sizes = split_sizes(n, cp0)
    if cp0 > 1:
        sizes[0] += 2
        sizes[1] -= 2
    return sizes


def make_module(starting: bool) -> torch.nn.Module:
    """A small Boltz module with random weights (Boltz zero-initialises the gate and output)."""
    torch.manual_seed(0)
    cls = (
        attention.TriangleAttentionStartingNode
        if starting
        else attention.TriangleAttentionEndingNode
    )
    module = cls(C_IN, HIDDEN, HEADS)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn_like(p) * 0.5 + (1.0 if name == "layer_norm.weight" else 0.0))
    return module


def make_inputs(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [1, N, N, C]``, pair mask ``[1, N, N]`` (last tokens padded), loss weights."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(1, n, n, C_IN, generator=g)
    tokens = torch.ones(n)
    tokens[-PADDED_TOKENS:] = 0
    weights = torch.randn(1, n, n, C_IN, generator=g)
    return x, (tokens[:, None] * tokens[None, :])[None], weights


class Tiles:
    """The pair blocks of this rank: uneven rows, the plan's column blocks."""

    def __init__(self, fold_mesh, n: int):
        cp0, cp1 = fold_mesh.domain_mesh.shape
        self.mesh = fold_mesh.domain_mesh
        self.device = fold_mesh.device
        self.rows = uneven_rows(n, cp0)
        self.cols = column_block_sizes(self.rows, cp1)
        self.here = fold_mesh.domain_coordinate
        i, j = self.here
        self.r0, self.c0 = sum(self.rows[:i]), sum(self.cols[:j])
        self.n, self.m = self.rows[i], self.cols[j]

    def cut(self, full: torch.Tensor) -> torch.Tensor:
        return full[:, self.r0 : self.r0 + self.n, self.c0 : self.c0 + self.m]

    def tile(self, full: torch.Tensor, requires_grad: bool = False):
        leaf = self.cut(full).clone().to(self.device).requires_grad_(requires_grad)
        shapes = tile_shapes(leaf.shape, 1, self.rows, self.cols, self.here)
        return wrap(leaf, self.mesh, (Shard(1), Shard(2)), shapes), leaf


def expected_collectives(tiles: Tiles, starting: bool) -> dict[str, int]:
    """The handler docstring's counts for one forward + backward."""
    cp0, cp1 = tiles.mesh.shape
    row_ranks, key_ranks = (cp0, cp1) if starting else (cp1, cp0)
    keys = tiles.cols if starting else tiles.rows
    width = math.ceil(max(keys) / key_ranks)
    steps = math.ceil(max(keys) / width) if key_ranks > 1 else 0
    # the query strip's pieces over the row axis: gathered, or summed when padding them
    # to the widest would more than double the strip
    i, j = tiles.here
    rows, queries = (tiles.rows, keys) if starting else (tiles.cols, tiles.rows)
    q = j if starting else i
    q0, q1 = sum(queries[:q]), sum(queries[: q + 1])
    pieces = [
        max(0, min(r1, q1) - max(r0, q0))
        for r0, r1 in ((sum(rows[:a]), sum(rows[: a + 1])) for a in range(len(rows)))
    ]
    summed = row_ranks > 1 and row_ranks * max(pieces) > 2 * sum(pieces)
    gathered = row_ranks > 1 and not summed
    out = {
        "all_gather": 2 * steps + gathered,
        "reduce_scatter": steps + gathered,
        "all_to_all": 2 * (key_ranks > 1),
        "all_reduce": (cp0 > 1) + (cp1 > 1) + 2 * summed,
    }
    return {k: v for k, v in out.items() if v}


def problem(name: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    """``None`` when ``got`` equals ``want`` up to rounding, else what differs.

    The tolerance follows the tensor's scale: a parameter gradient sums ``N^2`` terms in a
    different order on every mesh, so its error is a few ulps of its largest entry.
    """
    got = got.detach().cpu()
    if got.shape != want.shape:
        return f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    tolerance = TOLERANCE[want.dtype]
    atol = tolerance * max(1.0, want.abs().max().item())
    if not torch.allclose(got, want, rtol=tolerance, atol=atol):
        err = (got - want).abs().max().item()
        return f"{name}: max abs difference {err:.3e} (largest |value| {want.abs().max():.3e})"
    return None


@pytest.fixture(autouse=True)
def installed():
    physicsnemo_foldcp.boltz.install()
    yield


# -- geometry (serial) ------------------------------------------------------------------------

SIZES = [
    ([37], [19, 18]),
    ([21, 16], [37]),
    ([15, 10, 12], [15, 10, 12]),
    ([21, 16], [13, 12, 12]),
    ([15, 10, 12], [19, 18]),
    ([3, 30, 4], [5, 5, 5, 5, 17]),
]


MIB = 1 << 20


@pytest.mark.parametrize("row_sizes, key_sizes", SIZES)
def test_stream_visits_every_key_once(row_sizes, key_sizes):
    for q in range(len(key_sizes)):
        layout = Layout(None, 0, 1, tuple(row_sizes), tuple(key_sizes), 0, q)
        with work_budget(4 * SCORE_COPIES / MIB):  # 4 keys of one byte each
            stream = Stream.of(layout, score_bytes_per_key=1, inf=1e9, key_column_bytes=1)
        assert stream.key_chunk == min(4, stream.width)
        seen = []
        for step in range(stream.steps):
            for rank, offset, key, width in stream.chunks(step):
                assert offset + width <= stream.width
                assert key == sum(key_sizes[:rank]) + step * stream.width + offset
                seen.extend(range(key, key + width))
        assert sorted(seen) == list(range(sum(key_sizes)))  # each key once, in any order
        assert stream.width * len(key_sizes) <= max(key_sizes) + len(key_sizes) - 1


def test_key_chunk_is_the_widest_that_fits_the_budget():
    layout = Layout(None, 0, 1, (64,), (64,), 0, 0)
    per_key = 1 * 64 * 4 * 64 * 4  # [B, n, H, m] fp32 logits of one key
    for budget_keys, chunk in ((0.5, 1), (1, 1), (5, 5), (64, 64), (1000, 64)):
        with work_budget(budget_keys * SCORE_COPIES * per_key / MIB), recorded_pieces() as seen:
            assert Stream.of(layout, per_key, inf=1e9, key_column_bytes=1).key_chunk == chunk, (
                budget_keys
            )
        assert seen == {"triangle attention": {f"key chunk {chunk} of 64"}}
    with pytest.raises(ValueError, match="work_budget_mib"):
        with work_budget(0):
            pass


@pytest.mark.parametrize("row_sizes, key_sizes", SIZES)
def test_bias_strip_pieces_cover_the_query_block(row_sizes, key_sizes):
    for p in range(len(row_sizes)):
        for q in range(len(key_sizes)):
            layout = Layout(None, 0, 1, tuple(row_sizes), tuple(key_sizes), p, q)
            assert sum(layout.strip_pieces()) == key_sizes[q]
            assert sum(layout.split_of_rows()) == row_sizes[p]
            assert layout.split_of_rows()[q] == layout.strip_pieces()[p]
    square = Layout(None, 0, 1, (15, 10, 12), (15, 10, 12), 1, 1)
    assert square.strip_pieces() == [0, 10, 0] and square.strip_by_sum()


# -- on the mesh ------------------------------------------------------------------------------


@distributed
@mesh_param
@NODES
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("n_tokens", [23, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_matches_serial_module(fold_mesh, starting, mode, n_tokens, dtype):
    check_against_serial(fold_mesh, starting, mode, n_tokens, dtype)


@distributed
@pytest.mark.parametrize(
    "fold_mesh", [(1, 2, 3), (1, 3, 3)], indirect=True, ids=lambda s: "x".join(map(str, s))
)
@NODES
def test_matches_serial_module_in_single_key_chunks(fold_mesh, starting):
    # a budget below one key's scores: every sub-chunk is one key, merged by the online softmax
    with work_budget(1 / MIB):
        check_against_serial(fold_mesh, starting, "train", 37, torch.float32)


@distributed
@pytest.mark.parametrize("fold_mesh", [(1, 2, 3)], indirect=True, ids=["2x3"])
@NODES
@pytest.mark.parametrize("budget_mib", [64.0, 1 / MIB], ids=["one-chunk", "single-keys"])
def test_kept_probabilities_match_serial_module(fold_mesh, starting, budget_mib):
    # kept from forward instead of recomputed; with single-key chunks, each chunk's kept
    # exp(logits - max then) is rescaled to the final softmax
    with recompute_in_backward(False), work_budget(budget_mib):
        check_against_serial(fold_mesh, starting, "train", 37, torch.float32)


@distributed
@pytest.mark.parametrize("fold_mesh", [(1, 2, 2)], indirect=True, ids=["2x2"])
@NODES
def test_kept_probabilities_do_the_serial_modules_flops(fold_mesh, starting):
    """FLOPs of all ranks' forward + backward (torch's formulas on local blocks): kept, the
    serial module's exactly; recomputed, one more ``q k^T`` product (more)."""
    n = 37
    serial = make_module(starting)
    x, mask, weights = make_inputs(n)
    with LocalFlops() as counted:
        x_serial = x.clone().requires_grad_(True)
        (serial(x_serial, mask=mask) * weights).sum().backward()
    want = counted.total
    tiles = Tiles(fold_mesh, n)
    totals = {}
    for recompute in (False, True):
        module = make_module(starting).to(fold_mesh.device)
        xs, _ = tiles.tile(x, requires_grad=True)
        ms, _ = tiles.tile(mask)
        with recompute_in_backward(recompute), LocalFlops() as counted:
            out = module(xs, mask=ms)
            (out.to_local() * tiles.cut(weights).to(fold_mesh.device)).sum().backward()
        totals[recompute] = summed_over_mesh(counted.total, fold_mesh.domain_mesh)
    collective_assert(
        totals[False] == want and totals[True] > want,
        f"FLOPs of all ranks: kept {totals[False]}, recomputed {totals[True]}; serial {want}",
    )


def check_against_serial(fold_mesh, starting, mode, n_tokens, dtype):
    """Output, input and parameter gradients and collectives against the serial module."""
    serial = make_module(starting).to(dtype)
    distributed = copy.deepcopy(serial).to(fold_mesh.device)
    chunk_size = EVAL_CHUNK if mode == "eval" else None
    if mode == "eval":
        serial.eval()
        distributed.eval()
    x, mask, weights = (t.to(dtype) for t in make_inputs(n_tokens))

    x_serial = x.clone().requires_grad_(True)
    out_serial = serial(x_serial, mask=mask, chunk_size=chunk_size)
    (out_serial * weights).sum().backward()

    tiles = Tiles(fold_mesh, n_tokens)
    xs, leaf = tiles.tile(x, requires_grad=True)
    ms, _ = tiles.tile(mask)
    with CommDebugMode() as comm:
        out = distributed(xs, mask=ms, chunk_size=chunk_size)
        (out.to_local() * tiles.cut(weights).to(fold_mesh.device)).sum().backward()

    problems = [
        problem("output", out.full_tensor(), out_serial.detach()),
        problem("grad of x", leaf.grad, tiles.cut(x_serial.grad)),
    ]
    for (name, p_d), p_s in zip(distributed.named_parameters(), serial.parameters()):
        problems.append(problem(f"grad of {name}", p_d.grad, p_s.grad))
    counts = collective_counts(comm)
    if counts != expected_collectives(tiles, starting):
        problems.append(f"collectives {counts}, stated {expected_collectives(tiles, starting)}")
    if tuple(out.placements) != (Shard(1), Shard(2)) or out.to_local().shape != leaf.shape:
        problems.append(f"output tile {out.placements} {tuple(out.to_local().shape)}")
    problems = [p for p in problems if p]
    collective_assert(not problems, "; ".join(problems))


@distributed
@pytest.mark.parametrize("fold_mesh", [(1, 2, 2)], indirect=True, ids=["2x2"])
@pytest.mark.parametrize("flag", ["use_kernels", "use_flash_attn"])
def test_kernel_paths_are_refused(fold_mesh, flag):
    module = make_module(True).to(fold_mesh.device)
    x, mask, _ = make_inputs(23)
    tiles = Tiles(fold_mesh, 23)
    xs, _ = tiles.tile(x)
    ms, _ = tiles.tile(mask)
    with pytest.raises(ValueError, match="not supported under context parallelism"):
        module(xs, mask=ms, **{flag: True})
    serial = module(x, mask=mask)  # plain tensors: Boltz's own forward, untouched
    collective_assert(serial.shape == x.shape, f"serial output {tuple(serial.shape)}")


class LargestLocalTensor(TorchDispatchMode):
    """Records the largest plain tensor any op outputs (element count) and the op."""

    def __init__(self):
        super().__init__()
        self.numel, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if type(t) is torch.Tensor and t.numel() > self.numel:
                self.numel, self.op = t.numel(), str(func)
        return out


@distributed
@pytest.mark.parametrize("fold_mesh", [(1, 3, 3)], indirect=True, ids=["3x3"])
@NODES
def test_no_local_tensor_grows_past_a_few_tiles(fold_mesh, starting):
    n_tokens = 37
    module = make_module(starting).to(fold_mesh.device)
    x, mask, weights = make_inputs(n_tokens)
    tiles = Tiles(fold_mesh, n_tokens)
    xs, leaf = tiles.tile(x, requires_grad=True)
    ms, _ = tiles.tile(mask)
    w_local = tiles.cut(weights).to(fold_mesh.device)
    bound = LARGEST_LOCAL * leaf.numel()

    with LargestLocalTensor() as seen:
        out = module(xs, mask=ms)
        (out.to_local() * w_local).sum().backward()
    with torch.no_grad(), LargestLocalTensor() as serial_seen:  # the probe sees the N^3 scores
        module(x.to(fold_mesh.device), mask=mask.to(fold_mesh.device))

    collective_assert(
        seen.numel <= bound < serial_seen.numel,
        f"largest local tensor {seen.numel} elements ({seen.op}), bound {bound} "
        f"({LARGEST_LOCAL} tiles of {leaf.numel()}), serial largest {serial_seen.numel}",
    )


@distributed
@pytest.mark.parametrize(
    "fold_mesh", [(1, 2, 2), (1, 2, 3)], indirect=True, ids=lambda s: "x".join(map(str, s))
)
@NODES
def test_overlapped_steps_give_the_same_bits_and_collectives(fold_mesh, starting):
    """Gathering the next step's keys (and reducing a step's key gradients) while the
    current step computes changes neither a bit of the results nor the collectives; the
    overlap is on when its four key buffers fit the work budget, off when they do not."""
    cp0, cp1 = fold_mesh.domain_mesh.shape
    i, j = fold_mesh.domain_coordinate
    rows, keys = uneven_rows(37, cp0), column_block_sizes(uneven_rows(37, cp0), cp1)
    if starting:
        layout = Layout(fold_mesh.domain_mesh, 0, 1, tuple(rows), tuple(keys), i, j)
    else:
        layout = Layout(fold_mesh.domain_mesh, 1, 0, tuple(keys), tuple(rows), j, i)
    n, m = layout.row_sizes[layout.p], layout.key_sizes[layout.q]
    g = torch.Generator().manual_seed(7 + torch.distributed.get_rank())
    q = torch.randn(1, n, HEADS, m, HIDDEN, generator=g)
    k, v = (torch.randn(1, n, m, HEADS * HIDDEN, generator=g) for _ in range(2))
    mask = (torch.rand(1, n, m, generator=g) > 0.2).float()
    strip = torch.randn(1, HEADS, m, 37, generator=g)
    grad_out = torch.randn(1, n, HEADS, m, HIDDEN, generator=g)
    column = n * HEADS * (2 * HIDDEN + 1) * 4

    with recorded_pieces() as seen:
        on = Stream.of(layout, score_bytes_per_key=1, inf=1e9, key_column_bytes=column)
    with work_budget(3 * len(layout.key_sizes) * on.width * column / MIB):  # 3 buffers, not 4
        tight = Stream.of(layout, score_bytes_per_key=1, inf=1e9, key_column_bytes=column)
    off = dataclasses.replace(on, overlap=False)

    def run(stream: Stream):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, strip)]
        with CommDebugMode() as comm:
            out = StreamedAttention.apply(leaves[0], leaves[1], leaves[2], mask, leaves[3], stream)
            out.backward(grad_out)
        return [out.detach()] + [t.grad for t in leaves], collective_counts(comm)

    results_on, counts_on = run(on)
    results_off, counts_off = run(off)
    problems = []
    if not (on.overlap and not tight.overlap and on.steps > 1):
        problems.append(f"overlap chosen {on.overlap} / {tight.overlap}, {on.steps} steps")
    if not any("steps overlapped" in c for c in seen["triangle attention"]):
        problems.append(f"the overlap was not reported: {seen}")
    names = ["output", "grad q", "grad k", "grad v", "grad strip"]
    problems += [
        f"{name} differs"
        for name, a, b in zip(names, results_on, results_off)
        if not torch.equal(a, b)
    ]
    if counts_on != counts_off:
        problems.append(f"collectives {counts_on} with overlap, {counts_off} without")
    collective_assert(not problems, "; ".join(problems))
