"""A transposed pair tile meeting the tile layout (``z + z.transpose(1, 2)``), piece by piece.

Exact against serial (values and gradients), no collective and no gather event, and each
rank receives its tile less its own piece, in point-to-point messages, forward and
backward; on 1x2 to 3x3 meshes with even and skewed row blocks.
"""

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode

from physicsnemo_foldcp.core import events
from physicsnemo_foldcp.core.blocks import block_starts, overlap
from physicsnemo_foldcp.sharding.plan import column_block_sizes
from physicsnemo_foldcp.testing import collective_assert
from physicsnemo_foldcp.testing.collectives import collective_counts, count_p2p
from physicsnemo_foldcp.testing.layouts import TokenLayout

pytestmark = pytest.mark.multigpu_static
MESHES = [(2, 1, 2), (2, 2, 1), (1, 2, 2), (1, 2, 3), (1, 3, 2), (1, 3, 3)]
PAIR = ("tokens", "tokens", None)
CHANNELS = 3


def skewed_bounds(n: int, cp0: int) -> tuple[int, ...]:
    """Row blocks of lengths 1, 2, ... and the rest last."""
    bounds = [0]
    for k in range(1, cp0):
        bounds.append(bounds[-1] + k)
    return (*bounds, n)


def expected_received(n_bytes: int, rows: list[int], columns: list[int], i: int, j: int) -> int:
    """Bytes of tile ``(i, j)`` that live on other ranks of the transposed layout."""
    own = overlap(block_starts(columns)[j], columns[j], block_starts(rows)[i], rows[i])
    own *= overlap(block_starts(rows)[i], rows[i], block_starts(columns)[j], columns[j])
    return (rows[i] * columns[j] - own) * CHANNELS * n_bytes


@pytest.mark.parametrize("fold_mesh", MESHES, indirect=True, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("rows", ["even", "skewed"])
def test_a_tile_plus_its_transpose_moves_one_tile_and_matches_serial(fold_mesh, rows):
    n = 23
    _, cp0, cp1 = fold_mesh.shape
    layout = TokenLayout(fold_mesh, n, skewed_bounds(n, cp0) if rows == "skewed" else None)
    row_sizes = layout.plan.row_sizes("tokens")
    col_sizes = column_block_sizes(row_sizes, cp1)
    g = torch.Generator().manual_seed(3)
    z = torch.randn(1, n, n, CHANNELS, generator=g)
    weight = torch.randn(1, n, n, CHANNELS, generator=g)
    z_st, z_leaf = layout.shard(z, PAIR, requires_grad=True)
    w_st, _ = layout.shard(weight, PAIR)

    gathers: list = []
    with events.observe(gathers.append), CommDebugMode() as forward, count_p2p() as p2p:
        y = z_st + z_st.transpose(1, 2)
    with CommDebugMode() as backward, count_p2p() as p2p_back:
        (y * w_st).sum().backward()

    z_ref = z.clone().requires_grad_(True)
    y_ref = z_ref + z_ref.transpose(1, 2)
    (y_ref * weight).sum().backward()
    i, j = fold_mesh.domain_coordinate
    received = expected_received(z.element_size(), row_sizes, col_sizes, i, j)
    collective_assert(torch.equal(y.full_tensor(), y_ref.detach()), "z + z^T differs from serial")
    collective_assert(
        torch.allclose(z_leaf.grad, layout.local(z_ref.grad, PAIR), rtol=1e-6, atol=1e-6),
        "gradient of z differs from serial",
    )
    collective_assert(
        not collective_counts(forward) and not gathers,
        f"forward: collectives {collective_counts(forward)}, gathers {gathers}",
    )
    collective_assert(
        p2p["received"] == received and p2p_back["received"] == received,
        f"rank {(i, j)} received {p2p['received']} B forward and {p2p_back['received']} B "
        f"backward, expected {received} B (its tile less its own piece)",
    )
    # Backward: the exchange back, plus the sum's own reductions (no all-gather).
    collective_assert(
        "all_gather" not in collective_counts(backward),
        f"backward gathered: {collective_counts(backward)}",
    )
