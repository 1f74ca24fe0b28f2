"""Counting the collectives a block of code issues, for tests that state them.

``CommDebugMode`` counts functional collectives by their full op name and does not see
point-to-point calls; these helpers key the counts by family and count the latter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.distributed.tensor.debug import CommDebugMode

COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")
P2P_FUNCS = ("send", "recv", "isend", "irecv", "batch_isend_irecv")


def collective_counts(mode: CommDebugMode) -> dict[str, int]:
    """Non-zero collective counts of ``mode``, keyed by family.

    Parameters
    ----------
    mode : CommDebugMode
        A mode that has been exited.

    Returns
    -------
    dict[str, int]
        ``{"all_gather": n, "reduce_scatter": n, ...}``; an op outside
        :data:`COLLECTIVE_KINDS` keeps its full name.
    """
    out: dict[str, int] = {}
    for op, n in mode.get_comm_counts().items():
        name = next((k for k in COLLECTIVE_KINDS if k in str(op)), str(op))
        out[name] = out.get(name, 0) + n
    return {k: v for k, v in out.items() if v}


@contextlib.contextmanager
def count_p2p() -> Iterator[dict[str, int]]:
    """Count point-to-point calls (``send``, ``recv``, ``isend``, ...) and their bytes.

    The functions are replaced in ``torch.distributed`` and in its ``distributed_c10d``
    module alike, so ``dist.P2POp(dist.isend, ...)`` built inside the block is accepted,
    and each send or receive of a ``batch_isend_irecv`` counts as a call too.

    Yields
    ------
    dict[str, int]
        ``{"calls": n, "sent": bytes, "received": bytes}``, updated as calls happen.
    """
    counts = {"calls": 0, "sent": 0, "received": 0}
    namespaces = (dist, distributed_c10d)
    saved = {name: getattr(dist, name) for name in P2P_FUNCS}

    def counting(name, original):
        def call(*args, **kwargs):
            counts["calls"] += 1
            tensor = args[0] if args else kwargs.get("tensor")
            if name in ("send", "isend", "recv", "irecv") and tensor is not None:
                key = "sent" if "send" in name else "received"
                counts[key] += tensor.numel() * tensor.element_size()
            return original(*args, **kwargs)

        return call

    wrappers = {name: counting(name, original) for name, original in saved.items()}
    for namespace in namespaces:
        for name, wrapper in wrappers.items():
            setattr(namespace, name, wrapper)
    try:
        yield counts
    finally:
        for namespace in namespaces:
            for name, original in saved.items():
                setattr(namespace, name, original)
