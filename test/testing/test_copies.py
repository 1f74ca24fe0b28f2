"""CopyBytes counts the bytes that data-moving ops write, and nothing else."""

import torch

from physicsnemo_foldcp.testing.copies import CopyBytes


def test_moves_count_their_written_bytes_and_compute_counts_nothing():
    a, b = torch.randn(3, 4), torch.randn(5, 4)
    with CopyBytes(where=lambda: "here") as seen:
        joined = torch.cat([a, b])  # 8 x 4 fp32
        joined.t().contiguous()  # a clone: 8 x 4 fp32
        torch.zeros(2, 4).copy_(a[:2])  # 2 x 4 written
        a.to(torch.float64)  # 3 x 4 fp64
        a @ b.t()  # compute: not counted
        a.view(12)  # a view: not counted
    assert seen.by_op == {"cat": 128, "clone": 128, "copy_": 32, "_to_copy": 96}
    assert seen.calls == {"cat": 1, "clone": 1, "copy_": 1, "_to_copy": 1}
    assert seen.total == seen.by_part["here"] == 384


def test_backward_copies_are_counted_too():
    x = torch.randn(4, 3, requires_grad=True)
    with CopyBytes() as seen:
        torch.cat([x, x]).sum().backward()  # forward cat; backward: slices of the ones
    assert seen.by_op["cat"] == 2 * 4 * 3 * 4
    assert seen.total >= seen.by_op["cat"]
