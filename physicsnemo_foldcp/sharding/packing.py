"""Pack several tensors into one byte buffer and back, so one message carries a rank's shards."""

from __future__ import annotations

from collections.abc import Callable, Sequence

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


def pack_into(
    layout: Sequence[tuple[Sequence[int], torch.dtype]],
    write: Callable[[int, torch.Tensor], None],
    device: torch.device | None = None,
) -> torch.Tensor:
    """Allocate a packed buffer for ``layout`` and let ``write`` fill each tensor's slot.

    The slots are those of :func:`unpack`; the alignment gaps between them are zero, so
    the buffer holds the same bytes as :func:`pack` of the written tensors.

    Parameters
    ----------
    layout : sequence of (shape, dtype)
        The tensors of the buffer, in order.
    write : callable
        ``write(index, slot)`` writes tensor ``index`` into ``slot``, a view of the buffer
        with that tensor's shape and dtype; called once per non-empty tensor, in order.
    device : torch.device, optional
        Device of the buffer (CPU by default).

    Returns
    -------
    torch.Tensor
        uint8 ``[packed_size(layout)]`` buffer.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    size = packed_size(layout)
    buffer = torch.empty(size, dtype=torch.uint8, device=device)
    offset = 0
    for index, ((shape, dtype), slot) in enumerate(zip(layout, unpack(buffer, layout))):
        n = _nbytes(shape, dtype)
        if n:
            write(index, slot)
        if _aligned(n) > n:
            buffer[offset + n : offset + _aligned(n)].zero_()
        offset += _aligned(n)
    return buffer


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
        uint8 ``[packed_size]`` buffer (alignment gaps zeroed).
    """
    layout = [(tuple(t.shape), t.dtype) for t in tensors]
    device = device or (tensors[0].device if tensors else torch.device("cpu"))
    return pack_into(layout, lambda i, slot: slot.copy_(tensors[i].detach()), device=device)


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
