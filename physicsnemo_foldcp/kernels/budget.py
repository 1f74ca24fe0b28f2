"""The per-rank memory budget of the kernels' transient buffers, and the sizes it gives.

The pair kernels cut their work into pieces so that no rank holds a row's ``N x N``
scores or a whole row of pair tiles: the triangle attention computes its logits one key
sub-chunk at a time, the triangle product one panel at a time. Small pieces bound memory
but cost time (more, smaller matrix products and collectives); a tile that fits should run
in one piece, as Boltz's own module runs. The budget says how many bytes the transient
buffers of one piece may take on a rank; each kernel asks :func:`pieces_width` or
:func:`pieces_count` for the largest piece that fits, and never cuts finer than that.

The budget is process-wide (like ``torch.backends`` flags): :func:`set_work_budget`, or
:func:`work_budget` as a context manager; the apps set it from ``mesh.work_budget_mib``.
The kernels say what they chose (:func:`report_pieces`); :func:`recorded_pieces` collects
it, e.g. for a benchmark's table.

What backward recomputes
------------------------
By default the kernels keep nothing of a piece for backward: the triangle attention
recomputes its logits from the saved softmax statistics, the outer product mean its outer
product (flash-attention style). That costs one more matrix product per piece (about 9 %
more FLOPs in a trunk step) and holds activations of a few tiles. With
:func:`set_kernel_recompute` ``(False)`` (``mesh.kernel_recompute=false``) they keep those
tensors instead, as Boltz's own modules do: the probabilities ``[B, n, H, m, N]`` of each
triangle attention and the outer product ``[B, n, m, c^2]`` of each outer product mean
(``1 / P`` of what the serial module keeps on a ``P``-rank mesh), and do exactly the
serial step's FLOPs. Keep them where they fit; recompute where the crop is large.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

DEFAULT_WORK_BUDGET_MIB = 64.0
"""Default budget: 64 MiB of transient buffers per kernel piece and rank."""

_MIB = 1 << 20
_budget_mib = DEFAULT_WORK_BUDGET_MIB
_records: list[dict[str, set[str]]] = []
_recompute = True


def _checked(mib: float) -> float:
    value = float(mib)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"work_budget_mib must be a finite number > 0, got {mib!r}")
    return value


def work_budget_mib() -> float:
    """The budget now in force, in MiB."""
    return _budget_mib


def set_work_budget(mib: float) -> float:
    """Set the per-rank budget of one kernel piece's transient buffers.

    Parameters
    ----------
    mib : float
        Budget in MiB (``> 0``). Larger: fewer, larger pieces (faster while they fit);
        smaller: the peak memory of the pair kernels falls towards a few pair tiles.

    Returns
    -------
    float
        The previous budget in MiB.

    Raises
    ------
    ValueError
        When ``mib`` is not a finite positive number.
    """
    global _budget_mib
    previous, _budget_mib = _budget_mib, _checked(mib)
    return previous


@contextlib.contextmanager
def work_budget(mib: float) -> Iterator[float]:
    """Run a block under budget ``mib`` (MiB), restoring the previous one after it."""
    previous = set_work_budget(mib)
    try:
        yield mib
    finally:
        set_work_budget(previous)


def kernel_recompute() -> bool:
    """Whether the kernels recompute in backward what a piece computed (default True)."""
    return _recompute


def set_kernel_recompute(enabled: bool) -> bool:
    """Choose between recomputing in backward (``True``) and keeping for it (``False``).

    Parameters
    ----------
    enabled : bool
        ``True``: the triangle attention's logits and the outer product mean's product
        are recomputed in backward (least memory). ``False``: they are kept from forward
        (the serial modules' FLOPs; memory of the kept tensors, see the module docstring).

    Returns
    -------
    bool
        The previous setting.
    """
    global _recompute
    if not isinstance(enabled, bool):
        raise TypeError(f"kernel_recompute must be a bool, got {enabled!r}")
    previous, _recompute = _recompute, enabled
    return previous


@contextlib.contextmanager
def recompute_in_backward(enabled: bool) -> Iterator[bool]:
    """Run a block with :func:`set_kernel_recompute` ``(enabled)``, restoring it after."""
    previous = set_kernel_recompute(enabled)
    try:
        yield enabled
    finally:
        set_kernel_recompute(previous)


def pieces_width(total: int, bytes_per_unit: int) -> int:
    """The widest piece of ``total`` units whose buffers fit the budget (at least 1).

    Parameters
    ----------
    total : int
        Units to cover (e.g. the keys of one streamed step).
    bytes_per_unit : int
        Transient bytes one unit of a piece costs (all buffers alive together).

    Returns
    -------
    int
        ``min(total, floor(budget / bytes_per_unit))``, at least 1.
    """
    fits = int(_budget_mib * _MIB) // max(1, int(bytes_per_unit))
    return max(1, min(int(total), fits))


def pieces_count(total_bytes: int, least: int = 1) -> int:
    """How many equal pieces bring ``total_bytes`` of transient buffers within the budget.

    Parameters
    ----------
    total_bytes : int
        Transient bytes of the whole work done in one piece.
    least : int
        The fewest pieces the caller accepts.

    Returns
    -------
    int
        ``max(least, ceil(total_bytes / budget))``.
    """
    return max(int(least), -(-int(total_bytes) // int(_budget_mib * _MIB)))


def fits(total_bytes: int) -> bool:
    """Whether ``total_bytes`` of transient buffers fit the budget in one piece."""
    return int(total_bytes) <= int(_budget_mib * _MIB)


def report_pieces(kernel: str, choice: str) -> None:
    """Tell every :func:`recorded_pieces` block that ``kernel`` cut its work as ``choice``."""
    for record in _records:
        record.setdefault(kernel, set()).add(choice)


@contextlib.contextmanager
def recorded_pieces() -> Iterator[dict[str, set[str]]]:
    """Collect, per kernel, the distinct piece sizes chosen inside the block.

    Yields
    ------
    dict[str, set[str]]
        ``{"triangle attention": {"key chunk 64 of 64"}, ...}``, filled as the kernels run.
    """
    record: dict[str, set[str]] = {}
    _records.append(record)
    try:
        yield record
    finally:
        _records.remove(record)


__all__ = [
    "DEFAULT_WORK_BUDGET_MIB",
    "fits",
    "kernel_recompute",
    "pieces_count",
    "pieces_width",
    "recompute_in_backward",
    "recorded_pieces",
    "report_pieces",
    "set_kernel_recompute",
    "set_work_budget",
    "work_budget",
    "work_budget_mib",
]
