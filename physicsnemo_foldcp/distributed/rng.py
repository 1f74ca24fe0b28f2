"""One random stream per domain group: the ranks of a domain draw the same numbers.

A model run under CP draws its random tensors from the *global* shape on every rank of
the domain (Boltz's dropout masks: ``torch.rand(z[:, :, 0:1, 0:1].shape)``, where a
ShardTensor's ``shape`` is global) and keeps the local block of the result. That equals the
serial draw only while every rank of the domain holds the same generator state. Torch
seeds each new process differently, so :func:`~physicsnemo_foldcp.init_mesh` calls
:func:`sync_rng_over_domain` when it builds a mesh; a later ``torch.manual_seed`` must
then give every rank of a domain the same seed (replicas may differ, e.g.
``seed + mesh.ddp_rank``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from physicsnemo_foldcp.distributed.mesh import FoldMesh


def _broadcast_state(state: torch.Tensor, mesh: FoldMesh) -> torch.Tensor:
    """``state`` (a CPU byte tensor) of the domain source, on every rank of its group."""
    on_device = state.to(mesh.device)
    dist.broadcast(on_device, src=mesh.domain_source_rank, group=mesh.domain_group)
    return on_device.cpu()


def sync_rng_over_domain(mesh: FoldMesh) -> None:
    """Give every rank of a domain group its source's torch generator states.

    The CPU generator and, on CUDA, the generator of ``mesh.device`` are set to the
    domain source's (a rank whose states already agree keeps them). Each domain group
    keeps its own stream. Call on every rank of the job.

    Communication: one broadcast per generator over the flattened ``cp0 x cp1`` group
    (none on a 1x1 domain mesh).
    """
    if mesh.domain_size == 1:
        return
    torch.set_rng_state(_broadcast_state(torch.get_rng_state(), mesh))
    if mesh.device.type == "cuda":
        state = torch.cuda.get_rng_state(mesh.device)
        torch.cuda.set_rng_state(_broadcast_state(state, mesh), mesh.device)


__all__ = ["sync_rng_over_domain"]
