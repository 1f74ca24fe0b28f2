"""Data-parallel wrapping over the ``ddp`` axis, following PhysicsNeMo's harness patterns.

* Domain-only (``ddp == 1``): no wrapper. Parameters are broadcast over the 2-D domain
  mesh once, and ShardTensor's weight promotion all-reduces their gradients over it.
* ``ddp > 1`` with plain parameters: ``DistributedDataParallel`` over the ddp group.
* ``fsdp2``: ``fully_shard(model, mesh=ddp_mesh)`` (FSDP2). FSDP1 is never used.

In every case the parameters are first made equal over the domain group (neither DDP nor
FSDP2 syncs over it), so each domain group starts from its source's values.

Gradients: each plain parameter's gradient is summed over the domain mesh during
``backward``, per module call (an all-reduce over every mesh dim that shards the activation
it met) or, with :func:`~physicsnemo_foldcp.core.grad_buckets.attach_gradient_buckets`, in a
few buckets per step; DDP and FSDP2 then average over ``ddp``. The step therefore optimises
the mean over domain groups of their samples' losses.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from physicsnemo_foldcp.distributed.mesh import FoldMesh

WRAPPERS = ("auto", "none", "ddp", "fsdp2")
"""Choices of :func:`wrap_model`."""


def resolve_wrapper(wrapper: str, mesh: FoldMesh) -> str:
    """``"auto"`` -> ``"none"`` for ``ddp == 1``, ``"ddp"`` otherwise; validates the rest."""
    if wrapper not in WRAPPERS:
        raise ValueError(f"wrapper must be one of {WRAPPERS}, got {wrapper!r}")
    if wrapper == "auto":
        return "none" if mesh.ddp_size == 1 else "ddp"
    if wrapper == "none" and mesh.ddp_size > 1:
        raise ValueError(
            f"wrapper='none' with ddp={mesh.ddp_size} would let the {mesh.ddp_size} replicas "
            "drift apart: use 'ddp' or 'fsdp2' (or 'auto')"
        )
    return wrapper


@torch.no_grad()
def sync_over_domain(module: nn.Module, mesh: FoldMesh) -> None:
    """Broadcast plain parameters and buffers from the domain source to its group.

    Communication: one broadcast per plain tensor over the flattened ``cp0 x cp1`` group
    (none on a 1x1 domain mesh). DTensor parameters are left as they are.
    """
    if mesh.domain_size == 1:
        return
    tensors: Iterable[torch.Tensor] = list(module.parameters()) + list(module.buffers())
    for t in tensors:
        if not isinstance(t, DTensor):
            dist.broadcast(t.data, src=mesh.domain_source_rank, group=mesh.domain_group)


def wrap_model(
    model: nn.Module,
    mesh: FoldMesh,
    wrapper: str = "auto",
    *,
    shard_modules: Sequence[type[nn.Module]] = (),
) -> nn.Module:
    """Sync ``model`` over its domain group and wrap it for the ``ddp`` axis.

    Parameters
    ----------
    model : nn.Module
        A plain (serial) model, already on ``mesh.device``.
    mesh : FoldMesh
        The job's mesh.
    wrapper : {"auto", "none", "ddp", "fsdp2"}
        See the module docstring; ``"auto"`` picks ``"none"`` or ``"ddp"``.
    shard_modules : Sequence[type], optional
        ``fsdp2`` only: submodules of these types are ``fully_shard``-ed first (their
        parameters are gathered and freed block by block), then the root.

    Returns
    -------
    nn.Module
        The model itself (``none``, ``fsdp2``: sharded in place) or a DDP wrapper.

    Raises
    ------
    ValueError
        For an unknown wrapper, ``none`` with ``ddp > 1``, or a model with a parameter
        off ``mesh.device``.
    """
    choice = resolve_wrapper(wrapper, mesh)
    for name, p in model.named_parameters():
        if p.device != mesh.device:
            raise ValueError(
                f"parameter {name!r} is on {p.device}, the mesh computes on {mesh.device}: "
                "move the model with model.to(mesh.device) before wrapping it"
            )
    sync_over_domain(model, mesh)
    if choice == "none":
        return model
    if choice == "ddp":
        device_ids = [mesh.device.index] if mesh.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(
            model, device_ids=device_ids, process_group=mesh.ddp_mesh.get_group()
        )
    from torch.distributed.fsdp import fully_shard

    for p in model.parameters():
        if not p.is_contiguous():
            p.data = p.data.contiguous()
    kinds = tuple(shard_modules)
    if kinds:
        # Innermost first: a unit inside another unit (Boltz's MSALayer holds a
        # PairformerNoSeqLayer) is sharded before its parent, which then skips its params.
        for module in reversed(list(model.modules())):
            if module is not model and isinstance(module, kinds):
                fully_shard(module, mesh=mesh.ddp_mesh)
    fully_shard(model, mesh=mesh.ddp_mesh)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a DDP wrapper (FSDP2 shards in place: returned as is)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def param_groups(model: nn.Module, **options: Any) -> list[dict[str, Any]]:
    """Optimizer parameter groups split by device mesh (plain params, then each mesh).

    Foreach optimizers (AdamW's default) cannot mix plain tensors and DTensors, or DTensors
    on different meshes, in one group.
    """
    groups: dict[Any, list[nn.Parameter]] = {}
    for p in model.parameters():
        if p.requires_grad:
            key = id(p.device_mesh) if isinstance(p, DTensor) else None
            groups.setdefault(key, []).append(p)
    return [{"params": params, **options} for params in groups.values()]
