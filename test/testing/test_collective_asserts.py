"""The harness itself: collective asserts fail every rank, and no collective waits forever."""

import pytest
import torch
import torch.distributed as dist

from physicsnemo_foldcp.testing import (
    CollectiveAssertionError,
    collective_assert,
    collective_assert_close,
    collective_assert_equal,
)
from physicsnemo_foldcp.testing.plugin import sync_outcome

pytestmark = pytest.mark.multigpu_static


def test_collective_assert_fails_every_rank_when_one_rank_fails(fold_world):
    rank = dist.get_rank()
    with pytest.raises(CollectiveAssertionError) as info:
        collective_assert(rank != 1, f"deliberate failure on rank {rank}")
    # Every rank sees exactly rank 1's failure with rank 1's own message.
    assert info.value.failures == {1: "deliberate failure on rank 1"}
    assert "rank 1: deliberate failure on rank 1" in str(info.value)


def test_collective_assert_passes_when_every_rank_passes(fold_world):
    collective_assert(True, "never shown")


def test_equal_and_close_asserts_report_the_failing_rank(fold_world):
    rank = dist.get_rank()
    last = dist.get_world_size() - 1
    x = torch.arange(6.0)
    y = x.clone()
    if rank == last:
        y[4] += 1
    with pytest.raises(
        CollectiveAssertionError,
        match=rf"rank {last}: x: 1 element\(s\) differ, first at index \(4,\)",
    ):
        collective_assert_equal(y, x, "x")
    with pytest.raises(
        CollectiveAssertionError, match=rf"rank {last}: x: max abs difference 1.000e\+00"
    ):
        collective_assert_close(y, x, "x")
    collective_assert_close(x + 1e-9, x, "x")


def test_test_outcome_is_shared_across_ranks(fold_world):
    """What the plugin does after each test: one rank's failure fails all the others."""
    rank = dist.get_rank()
    error = RuntimeError("boom on rank 0") if rank == 0 else None
    with pytest.raises((RuntimeError, CollectiveAssertionError)) as info:
        sync_outcome(error)
    if rank == 0:
        assert info.value is error
    else:
        assert info.value.failures == {0: "RuntimeError: boom on rank 0"}


def test_a_skip_on_one_rank_is_not_a_failure_elsewhere(fold_world):
    rank = dist.get_rank()
    if rank == 0:
        with pytest.raises(pytest.skip.Exception):
            sync_outcome(pytest.skip.Exception("skipped on rank 0 only"))
    else:
        sync_outcome(None)


def test_a_failure_elsewhere_fails_a_rank_that_skipped(fold_world):
    rank = dist.get_rank()
    error = {0: pytest.skip.Exception("skipped on rank 0"), 1: RuntimeError("boom on rank 1")}
    with pytest.raises((RuntimeError, CollectiveAssertionError)) as info:
        sync_outcome(error.get(rank))
    if rank == 1:
        assert info.value is error[1]
    else:
        assert info.value.failures == {1: "RuntimeError: boom on rank 1"}


def test_a_skip_in_setup_on_one_rank_skips_every_rank(fold_world):
    """A rank that skipped setup runs no call, so its peers must skip the call too."""
    rank = dist.get_rank()
    error = pytest.skip.Exception("skipped on rank 0") if rank == 0 else None
    with pytest.raises(pytest.skip.Exception) as info:
        sync_outcome(error, phase="setup")
    if rank == 0:
        assert info.value is error
    else:
        assert info.value.msg == "skipped in setup on rank(s) 0: skipped on rank 0"
