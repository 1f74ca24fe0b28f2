"""Tensor primitives shared by the feature families: padding, one-hot, index lists, draws.

The scalar draws (:func:`randint`, :func:`uniform`) take the complex's local generator, so
the order of calls across modules is the order of the random stream.
"""

from __future__ import annotations

import torch
from torch import Tensor


def randint(g: torch.Generator, low: int, high: int) -> int:
    """Integer uniform in ``[low, high]``."""
    return int(torch.randint(low, high + 1, (1,), generator=g))


def uniform(g: torch.Generator) -> float:
    """Float uniform in ``[0, 1)``."""
    return float(torch.rand((), generator=g))


def pad(x: Tensor, dim: int, length: int, value: float = 0) -> Tensor:
    """Right-pad ``x`` along ``dim`` to ``length`` with ``value`` (unchanged if long enough)."""
    missing = length - x.shape[dim]
    if missing <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x, torch.full(shape, value, dtype=x.dtype)], dim=dim)


def one_hot(index: Tensor, classes: int, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """Return zeros of ``(*shape, classes)``, one-hot of ``index`` in the leading corner."""
    out = torch.zeros(*shape, classes, dtype=dtype)
    corner = out[tuple(slice(0, size) for size in index.shape)]
    corner.scatter_(-1, index.unsqueeze(-1), 1)
    return out


def index_list(rows: list[tuple[int, ...]], width: int) -> Tensor:
    """``[width, P]`` long tensor of ``P`` rows of ``width`` indices (``[width, 0]`` if none)."""
    if not rows:
        return torch.empty((width, 0), dtype=torch.long)
    return torch.tensor(rows, dtype=torch.long).T.contiguous()
