"""Ranges of numeric options: one check, one message naming the option, its value and range.

Every settings dataclass of a run (the Hydra schemas of :mod:`~physicsnemo_foldcp.training.
config`, :class:`~physicsnemo_foldcp.training.loop.TrainSettings`,
:class:`~physicsnemo_foldcp.training.loop.OptimizerSettings`) checks its numeric fields
with :func:`check_range` when it is built, so a value out of range stops a run before its
first file is written (the apps build every group before any work).
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Any

MAX_SEED = 2**63 - 1
"""Largest seed (``torch.manual_seed`` takes a 64-bit value)."""


class OptionRangeError(ValueError):
    """A numeric option outside its valid range; the message names option, value and range."""


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _range_text(
    low: float | None, high: float | None, low_open: bool, high_open: bool, integer: bool
) -> str:
    kind = "an integer" if integer else "a finite number"
    if low is not None and high is not None:
        left, right = "(" if low_open else "[", ")" if high_open else "]"
        return f"{kind} in {left}{_num(low)}, {_num(high)}{right}"
    if low is not None:
        return f"{kind} {'>' if low_open else '>='} {_num(low)}"
    if high is not None:
        return f"{kind} {'<' if high_open else '<='} {_num(high)}"
    return kind


def check_range(
    option: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    integer: bool = False,
) -> None:
    """Raise :class:`OptionRangeError` unless ``value`` is a number in the range.

    Parameters
    ----------
    option : str
        The option's name as a user writes it (``optimizer.lr``).
    value : Any
        Its value (a bool is not a number here; NaN and infinities are out of any range).
    low, high : float, optional
        Bounds; ``None``: unbounded on that side.
    low_open, high_open : bool, default False
        Exclude the bound itself.
    integer : bool, default False
        The value must be an ``int``.

    Raises
    ------
    OptionRangeError
        ``"<option>=<value> is out of range: it must be <range>"``.
    """
    text = _range_text(low, high, low_open, high_open, integer)
    number = isinstance(value, Real) and not isinstance(value, bool)
    ok = number and (isinstance(value, int) or not integer) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        raise OptionRangeError(f"{option}={value!r} is out of range: it must be {text}")


def check_seed(option: str, value: Any) -> None:
    """:func:`check_range` for a seed: an integer in ``[0, MAX_SEED]``."""
    check_range(option, value, low=0, high=MAX_SEED, integer=True)


__all__ = ["MAX_SEED", "OptionRangeError", "check_range", "check_seed"]
