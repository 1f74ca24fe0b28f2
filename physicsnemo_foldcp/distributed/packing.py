"""Pack several tensors into one byte buffer and back, so one message carries a rank's shards."""

from __future__ import annotations

import mmap
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


HUGE_PAGE = 1 << 21
"""Size of a transparent huge page on x86-64 and arm64 Linux."""


def zeroed_buffer(nbytes: int, device: torch.device | None = None) -> torch.Tensor:
    """Zero-filled uint8 ``[nbytes]`` buffer whose zeros cost nothing until touched.

    On the CPU, a buffer of at least :data:`HUGE_PAGE` bytes is an anonymous memory map
    (zero-filled by the kernel, one page at a time, when the page is first used) marked
    for transparent huge pages where the platform has them: filling it takes one page fault
    per 2 MiB instead of one per 4 KiB, and a page that is only read (to be sent) is the
    kernel's shared zero page. So a writer may leave zeros unwritten. The map is released
    when the last tensor viewing it is freed. On other devices, for smaller buffers, and
    where no such mapping can be made, it is ``torch.zeros``.

    Parameters
    ----------
    nbytes : int
        Size in bytes.
    device : torch.device, optional
        Device of the buffer (CPU by default).

    Returns
    -------
    torch.Tensor
        uint8 ``[nbytes]``, all zeros.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cpu" and nbytes >= HUGE_PAGE:
        try:
            region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except (OSError, ValueError, AttributeError):
            region = None
        if region is not None:
            try:
                region.madvise(mmap.MADV_HUGEPAGE)
            except (OSError, ValueError, AttributeError):
                pass  # small pages: still zero-filled and lazily allocated
            return torch.frombuffer(region, dtype=torch.uint8)
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


def pack_into(
    layout: Sequence[tuple[Sequence[int], torch.dtype]],
    write: Callable[[int, torch.Tensor], None],
    device: torch.device | None = None,
    *,
    zeroed: bool = False,
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
    zeroed : bool, default False
        Start from :func:`zeroed_buffer` (``write`` may then skip zeros) instead of an
        uninitialised ``torch.empty``.

    Returns
    -------
    torch.Tensor
        uint8 ``[packed_size(layout)]`` buffer.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    size = packed_size(layout)
    if zeroed:
        buffer = zeroed_buffer(size, device)
    else:
        buffer = torch.empty(size, dtype=torch.uint8, device=device)
    offset = 0
    for index, ((shape, dtype), slot) in enumerate(zip(layout, unpack(buffer, layout))):
        n = _nbytes(shape, dtype)
        if n:
            write(index, slot)
        if not zeroed and _aligned(n) > n:
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
