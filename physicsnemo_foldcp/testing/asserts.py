"""Collective asserts: a failure on any rank fails every rank, with that rank's message.

Every helper here first sums a one-element flag over the group (the world by default)
and, only when some rank failed, all-gathers the failures as objects; all ranks see the
same flag, so they issue the same collectives. All ranks must call a helper the same
number of times, in the same order. The wait is bounded by the process group's timeout
(see :func:`physicsnemo_foldcp.init_mesh`).
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


class CollectiveAssertionError(AssertionError):
    """Raised on every rank when an assert failed on at least one rank.

    Attributes
    ----------
    failures : dict[int, str]
        Global rank -> message, for every rank whose check failed.
    """

    def __init__(self, failures: dict[int, str]):
        self.failures = dict(sorted(failures.items()))
        ranks = ", ".join(str(r) for r in self.failures)
        details = "\n".join(f"  rank {r}: {msg}" for r, msg in self.failures.items())
        super().__init__(f"check failed on rank(s) {ranks}:\n{details}")


def gather_failures(message: T | None, group: dist.ProcessGroup | None = None) -> dict[int, T]:
    """All-gather each rank's failure (``None`` for success).

    Parameters
    ----------
    message : picklable or None
        This rank's failure (a message, or any picklable record), or ``None`` if its check
        passed.
    group : ProcessGroup, optional
        Group to gather over; the world by default.

    Returns
    -------
    dict[int, object]
        Global rank -> failure for every failing rank (the same dict on every rank).
    """
    if not dist.is_available() or not dist.is_initialized():
        return {} if message is None else {0: message}
    device = torch.device("cpu")
    if dist.get_backend(group) == dist.Backend.NCCL:
        device = torch.device("cuda", torch.cuda.current_device())
    failed = torch.tensor([0 if message is None else 1], dtype=torch.int32, device=device)
    dist.all_reduce(failed, group=group)
    if not int(failed.item()):  # every rank passed: one small collective, no pickling
        return {}
    size = dist.get_world_size(group)
    gathered: list[T | None] = [None] * size
    dist.all_gather_object(gathered, message, group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else range(size)
    return {int(r): msg for r, msg in zip(ranks, gathered) if msg is not None}


def collective_assert(
    condition: bool, message: str = "", group: dist.ProcessGroup | None = None
) -> None:
    """Assert ``condition`` on every rank; raise on all ranks if it fails on any.

    Parameters
    ----------
    condition : bool
        This rank's check.
    message : str
        Message reported for this rank when ``condition`` is false.
    group : ProcessGroup, optional
        Group whose ranks fail together; the world by default.

    Raises
    ------
    CollectiveAssertionError
        On every rank of ``group`` if the condition is false on at least one rank; the
        message lists every failing rank with its own message.
    """
    failures = gather_failures(None if condition else (message or "assertion failed"), group)
    if failures:
        raise CollectiveAssertionError(failures)


def _describe_mismatch(actual: torch.Tensor, expected: torch.Tensor) -> str | None:
    if actual.shape != expected.shape:
        return f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    if actual.dtype != expected.dtype:
        return f"dtype {actual.dtype} != expected {expected.dtype}"
    return None


def collective_assert_equal(
    actual: torch.Tensor,
    expected: torch.Tensor,
    name: str = "tensor",
    group: dist.ProcessGroup | None = None,
) -> None:
    """Collectively assert ``torch.equal(actual, expected)`` (same shape, dtype, values).

    Parameters
    ----------
    actual, expected : torch.Tensor
        Plain (local) tensors to compare on this rank.
    name : str
        What is compared, for the message.
    group : ProcessGroup, optional
        Group whose ranks fail together; the world by default.
    """
    problem = _describe_mismatch(actual, expected)
    if problem is None and not torch.equal(actual, expected):
        differ = (actual != expected) & ~(actual.isnan() & expected.isnan())
        first = tuple(int(i) for i in differ.nonzero()[0]) if differ.any() else None
        problem = f"{int(differ.sum())} element(s) differ, first at index {first}"
    collective_assert(problem is None, f"{name}: {problem}", group)


def collective_assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    name: str = "tensor",
    *,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Collectively assert ``torch.allclose(actual, expected, rtol, atol)``.

    Parameters
    ----------
    actual, expected : torch.Tensor
        Plain (local) floating-point tensors to compare on this rank.
    name : str
        What is compared, for the message.
    rtol, atol : float
        Tolerances, as in :func:`torch.allclose`.
    group : ProcessGroup, optional
        Group whose ranks fail together; the world by default.
    """
    problem = _describe_mismatch(actual, expected)
    if problem is None and not torch.allclose(actual, expected, rtol=rtol, atol=atol):
        err = (actual.double() - expected.double()).abs().max().item()
        problem = f"max abs difference {err:.3e} exceeds rtol={rtol}, atol={atol}"
    collective_assert(problem is None, f"{name}: {problem}", group)
