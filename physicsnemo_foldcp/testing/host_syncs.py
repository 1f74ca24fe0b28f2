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


class _DataDependentOps(TorchDispatchMode):
    def __init__(self, syncs: HostSyncs) -> None:
        super().__init__()
        self.syncs = syncs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("index", "index_put") and _has_mask(args):
            name = "boolean mask index"
        if name in DATA_DEPENDENT_OPS or name == "boolean mask index":
            self.syncs.by_kind[name] += 1
            self.syncs.where.append(_call_site())
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_host_syncs() -> Iterator[HostSyncs]:
    """Count host synchronisations made inside the block.

    A conversion that runs another one inside it (``tolist`` of a 0-d tensor calling
    ``item``) counts once.

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
        with _DataDependentOps(syncs):
            yield syncs
    finally:
        for name, original in saved.items():
            if name in own:
                setattr(torch.Tensor, name, original)
            else:
                delattr(torch.Tensor, name)


__all__ = ["CONVERSIONS", "DATA_DEPENDENT_OPS", "HostSyncs", "count_host_syncs"]
