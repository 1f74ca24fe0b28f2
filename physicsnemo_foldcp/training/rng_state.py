"""Random generator states of a job as tensors and plain data, and their restore on a mesh.

A checkpoint keeps every rank's torch CPU (and CUDA) generator state as ``uint8`` tensors
and Python's ``random`` and NumPy's global states as plain lists and integers, so that
``torch.load(weights_only=True)`` reads them back.

Restore (:func:`restore_job_rng`):

* same mesh shape as the checkpoint: each rank gets its own saved states back (exact
  resume);
* another mesh: the ranks of a domain group share one random stream
  (:func:`~physicsnemo_foldcp.init_mesh` gives them their source's torch states), so the
  states are restored by ``ddp`` replica: every rank of replica ``r`` gets the states of
  the source rank of the checkpoint's replica ``r``. Replicas the checkpoint did not have
  (a larger ``ddp``) keep the states they started with, and the caller is told which.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from physicsnemo_foldcp.distributed.mesh import FoldMesh


def rng_state() -> dict[str, Any]:
    """This process's generator states as tensors and plain data.

    Returns
    -------
    dict[str, Any]
        ``torch``: ``uint8`` tensor; ``cuda``: ``[devices, n]`` ``uint8`` tensor (only
        when CUDA is initialised); ``python``: ``[version, [ints], gauss]``; ``numpy``:
        ``{"name", "key" (int64 tensor), "pos", "has_gauss", "cached_gaussian"}``.
    """
    version, internal, gauss = random.getstate()
    name, key, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state().clone(),
        "python": [int(version), [int(v) for v in internal], gauss],
        "numpy": {
            "name": str(name),
            "key": torch.from_numpy(np.asarray(key, dtype=np.int64).copy()),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` returned (on this process)."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((int(version), tuple(int(v) for v in internal), gauss))
    numpy = state["numpy"]
    np.random.set_state(
        (
            numpy["name"],
            numpy["key"].numpy().astype(np.uint32),
            int(numpy["pos"]),
            int(numpy["has_gauss"]),
            float(numpy["cached_gaussian"]),
        )
    )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))


def gather_job_rng(mesh: FoldMesh) -> dict[str, Any]:
    """Every rank's states and the source rank of each replica, on rank 0 (collective).

    Returns
    -------
    dict[str, Any]
        ``states``: one :func:`rng_state` per global rank (on rank 0; ``None`` entries on
        the others, which do not write them); ``replica_sources``: the global rank of the
        source of each ``ddp`` replica; ``mesh``: the mesh shape.
    """
    rank0 = dist.get_rank() == 0
    states: list[Any] = [None] * dist.get_world_size()
    dist.gather_object(rng_state(), states if rank0 else None, dst=0)
    sources = [int(mesh.mesh.mesh[r, 0, 0]) for r in range(mesh.ddp_size)]
    return {"states": states, "replica_sources": sources, "mesh": list(mesh.shape)}


def restore_job_rng(saved: Mapping[str, Any], mesh: FoldMesh) -> str | None:
    """Restore this rank's generators from :func:`gather_job_rng`'s record (no communication).

    Parameters
    ----------
    saved : Mapping
        What :func:`gather_job_rng` returned when the checkpoint was written.
    mesh : FoldMesh
        This job's mesh.

    Returns
    -------
    str or None
        ``None`` when this rank's states were restored; otherwise why not (a replica the
        checkpoint did not have).
    """
    states: Sequence[Mapping[str, Any]] = saved["states"]
    if tuple(saved["mesh"]) == tuple(mesh.shape) and len(states) == mesh.world_size:
        set_rng_state(states[mesh.rank])
        return None
    sources = list(saved["replica_sources"])
    if mesh.ddp_rank >= len(sources):
        return (
            f"replica {mesh.ddp_rank} of mesh {tuple(mesh.shape)} has no counterpart in the "
            f"checkpoint's mesh {tuple(saved['mesh'])}: its generators keep their states"
        )
    set_rng_state(states[sources[mesh.ddp_rank]])
    return None


__all__ = ["gather_job_rng", "restore_job_rng", "rng_state", "set_rng_state"]
