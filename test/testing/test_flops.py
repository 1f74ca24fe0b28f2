"""LocalFlops counts what each rank computes: the ranks' counts add up to the serial op's."""

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from physicsnemo_foldcp.testing import collective_assert
from physicsnemo_foldcp.testing.flops import LocalFlops
from physicsnemo_foldcp.testing.layouts import TokenLayout

N, C, C_OUT = 13, 8, 6  # 13 tokens: uneven blocks on every mesh here


def linear_step(layer: nn.Linear, z: torch.Tensor) -> None:
    """Forward and backward of a linear layer on the pair ``z`` ``[1, N, N, C]``."""
    layer(z).pow(2).sum().backward()


def test_plain_tensors_count_as_torch_counts_them():
    torch.manual_seed(0)
    layer = nn.Linear(C, C_OUT)
    z = torch.randn(1, N, N, C, requires_grad=True)
    with LocalFlops() as local:
        linear_step(layer, z)
    with FlopCounterMode(display=False) as reference:
        linear_step(layer, z)
    assert local.total == reference.get_total_flops() > 0


@pytest.mark.multigpu_static
@pytest.mark.parametrize("fold_mesh", [(1, 2, 2), (1, 2, 3)], indirect=True, ids=str)
def test_the_ranks_count_add_up_to_the_serial_count(fold_mesh):
    torch.manual_seed(0)
    layer = nn.Linear(C, C_OUT).to(fold_mesh.device)
    serial = torch.randn(1, N, N, C)
    with LocalFlops() as whole:
        linear_step(layer, serial.to(fold_mesh.device).requires_grad_(True))
    z, _ = TokenLayout(fold_mesh, N).shard(serial, ("tokens", "tokens", None), True)
    with LocalFlops() as mine:
        linear_step(layer, z)
    counts = torch.tensor([mine.total], dtype=torch.float64, device=fold_mesh.device)
    torch.distributed.all_reduce(counts, group=fold_mesh.domain_group)
    collective_assert(
        int(counts.item()) == whole.total,
        f"the ranks of {fold_mesh.cp} count {int(counts.item())} FLOPs, serial {whole.total}",
    )
