"""Pack several tensors into one byte buffer and back, so one message carries a rank's shards."""

from __future__ import annotations

from collections.abc import Sequence

import torch

ALIGNMENT = 16
"""Byte alignment of every tensor inside a packed buffer (any dtype can be viewed there)."""


def _aligned(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    numel = 1
    for s in shape:
        numel *= int(s)
    return numel * torch.empty((), dtype=dtype).element_size()


def packed_size(layout: Sequence[tuple[Sequence[int], torch.dtype]]) -> int:
    """Bytes of a buffer holding tensors of these ``(shape, dtype)``, each aligned."""
    return sum(_aligned(_nbytes(shape, dtype)) for shape, dtype in layout)


def pack(tensors: Sequence[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """Copy ``tensors`` into one ``uint8`` buffer, each at an aligned offset.

    Parameters
    ----------
    tensors : sequence of torch.Tensor
        Tensors of any dtype and shape (non-contiguous ones are copied in order).
    device : torch.device, optional
        Device of the buffer; the tensors' device by default.

    Returns
    -------
    torch.Tensor
        uint8 ``[packed_size]`` buffer.
    """
    layout = [(t.shape, t.dtype) for t in tensors]
    device = device or (tensors[0].device if tensors else torch.device("cpu"))
    buffer = torch.zeros(packed_size(layout), dtype=torch.uint8, device=device)
    offset = 0
    for t in tensors:
        n = _nbytes(t.shape, t.dtype)
        if n:
            flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
            buffer[offset : offset + n].copy_(flat)
        offset += _aligned(n)
    return buffer


def unpack(
    buffer: torch.Tensor, layout: Sequence[tuple[Sequence[int], torch.dtype]]
) -> list[torch.Tensor]:
    """Views into ``buffer`` with the given ``(shape, dtype)`` each (no copy).

    Raises
    ------
    ValueError
        If the buffer's size is not the packed size of ``layout``.
    """
    expected = packed_size(layout)
    if buffer.numel() != expected:
        raise ValueError(f"packed buffer has {buffer.numel()} bytes, layout needs {expected}")
    out = []
    offset = 0
    for shape, dtype in layout:
        n = _nbytes(shape, dtype)
        chunk = buffer[offset : offset + n]
        out.append(chunk.view(dtype).reshape(tuple(shape)))
        offset += _aligned(n)
    return out
