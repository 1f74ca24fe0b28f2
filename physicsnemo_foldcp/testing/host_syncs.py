"""Counting the tensor-to-host conversions a block of code makes (each one stalls a GPU).

A step on GPUs is as fast as its waits: ``.item()``, ``.tolist()``, ``bool(t)``,
``int(t)``, ``float(t)``, ``t.numpy()`` and data-dependent shapes (``nonzero``,
``masked_select``, ``unique``, indexing with a boolean mask) each make the host wait for the
device. On CPU nothing waits, so tests count the calls instead: :func:`count_host_syncs`
replaces the conversion methods on ``torch.Tensor`` for the duration of the block (every
caller, the plugin's code, PhysicsNeMo's, torch's Python code and the model's alike) and
counts the data-dependent ATen ops below autograd with a dispatch mode.
"""

from __future__ import annotations

import contextlib
import functools
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

CONVERSIONS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")
"""``torch.Tensor`` methods that copy a value to the host."""

DATA_DEPENDENT_OPS = ("nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive")
"""ATen ops whose output shape depends on the data (the host reads it before going on)."""

HOST_READS = ("_local_scalar_dense", "equal", "is_nonzero")
"""ATen ops that hand a tensor's value to the host (what the conversions run below)."""

COPIES = ("_to_copy", "copy_")
"""ATen copies; one from a non-CPU device to the CPU waits for the device."""


@dataclass
class HostSyncs:
    """What :func:`count_host_syncs` saw.

    Attributes
    ----------
    by_kind : Counter
        ``{"item": n, "nonzero": n, ...}``.
    where : list[str]
        For each call, the innermost frame outside torch that made it (``file:line``).
    """

    by_kind: Counter = field(default_factory=Counter)
    where: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        """All calls counted."""
        return sum(self.by_kind.values())

    def format(self) -> str:
        """One line per kind, then the distinct call sites with their counts."""
        sites = Counter(self.where)
        lines = [f"{kind}: {n}" for kind, n in sorted(self.by_kind.items())]
        lines += [f"  {n} x {site}" for site, n in sites.most_common()]
        return "\n".join(lines) or "no host synchronisation"


def _call_site() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in frame.filename and "host_syncs.py" not in frame.filename:
            return f"{frame.filename}:{frame.lineno}"
    return "?"


def _has_mask(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


def _to_host(func_name: str, args: tuple, kwargs: dict, out: object) -> bool:
    """Whether a copy moved data from a non-CPU device to the CPU."""
    if func_name == "copy_":
        target, source = args[0], args[1]
    else:
        target, source = out, args[0]
    return (
        isinstance(source, torch.Tensor)
        and isinstance(target, torch.Tensor)
        and source.device.type != "cpu"
        and target.device.type == "cpu"
    )


class _DataDependentOps(TorchDispatchMode):
    def __init__(self, syncs: HostSyncs, depth: list[int]) -> None:
        super().__init__()
        self.syncs = syncs
        self.depth = depth

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        out = func(*args, **kwargs)
        if name in ("index", "index_put") and _has_mask(args):
            name = "boolean mask index"
        elif name in COPIES:
            name = "copy to host" if _to_host(name, args, kwargs, out) else name
        counted = name in DATA_DEPENDENT_OPS or name in ("boolean mask index", "copy to host")
        if counted or (name in HOST_READS and self.depth[0] == 0):
            self.syncs.by_kind[name] += 1
            self.syncs.where.append(_call_site())
        return out


@contextlib.contextmanager
def count_host_syncs() -> Iterator[HostSyncs]:
    """Count host synchronisations made inside the block.

    A conversion that runs another one inside it (``tolist`` of a 0-d tensor calling
    ``item``, ``item`` reading the value with ``_local_scalar_dense``) counts once; a
    host read from C++ (``torch.equal``, a scalar read inside an ATen op) counts too, as
    does a copy from a device to the CPU.

    Yields
    ------
    HostSyncs
        Filled in as calls happen; complete when the block ends.
    """
    syncs = HostSyncs()
    saved = {name: getattr(torch.Tensor, name) for name in CONVERSIONS}
    own = {name for name in CONVERSIONS if name in vars(torch.Tensor)}
    depth = [0]

    def counting(name, original):
        @functools.wraps(original)
        def call(self, *args, **kwargs):
            if depth[0] == 0:
                syncs.by_kind[name] += 1
                syncs.where.append(_call_site())
            depth[0] += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                depth[0] -= 1

        return call

    for name, original in saved.items():
        setattr(torch.Tensor, name, counting(name, original))
    try:
        with _DataDependentOps(syncs, depth):
            yield syncs
    finally:
        for name, original in saved.items():
            if name in own:
                setattr(torch.Tensor, name, original)
            else:
                delattr(torch.Tensor, name)


__all__ = [
    "CONVERSIONS",
    "COPIES",
    "DATA_DEPENDENT_OPS",
    "HOST_READS",
    "HostSyncs",
    "count_host_syncs",
]
