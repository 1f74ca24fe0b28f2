"""Parameter gradients summed over the domain in a few buckets per step, as DDP does.

Without buckets, every module that runs on local blocks sums its parameters' gradient
parts over the domain mesh in its own backward: one all-reduce per module call and mesh
dim (about 150 per step of a two-block trunk on 2x2). With :class:`GradientBuckets`
attached, those parts are added to flat per-bucket buffers instead
(:mod:`~physicsnemo_foldcp.core.partial_grads`), and each bucket is reduced ONCE over the
flattened ``cp0 x cp1`` group:

* ``none`` (``ddp == 1``): a bucket's all-reduce starts, asynchronously, as soon as every
  parameter in it has accumulated its gradient (in bucket order, the same on every rank),
  so it overlaps the rest of the backward where the backend allows; the end of the
  backward waits for them and writes the sums into ``.grad``.
* ``ddp``: DDP averages what autograd accumulated over ``ddp``, as always; the parts go
  to the buckets here, each reduced ONCE over every rank (``ddp`` and the domain
  together) as soon as its parameters are ready, and added to ``.grad``, divided by
  ``ddp``, once DDP has written its average. The buckets keep one layout from the first
  step on (DDP re-lays its own out after its first step), so a resumed run sums in the
  order the run it continues did.
* ``fsdp2``: FSDP2 reduce-scatters what autograd accumulated (the gradients of uses that
  were not split over the domain); at the end of the backward each bucket of parts is
  reduced ONCE over every rank, divided by ``ddp``, and this rank's FSDP2 shard of it is
  added to the sharded gradient.

Exactness: a part is added on the ranks that computed it, once per distinct part (the
ranks along mesh dims that did not split the blocks hold copies: only coordinate 0 adds
it), and what autograd accumulated without a part (uses on plain or replicated tensors) is
added by the domain's origin only. Summing over the domain therefore counts everything
once; only the order of the additions differs from the per-module reductions.

With buckets attached, parameter gradients are only complete in ``.grad`` after
``backward`` returns (``torch.autograd.grad`` with respect to parameters sees the zeros
that stand for the parts in the graph).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from physicsnemo_foldcp.core import compat, partial_grads
from physicsnemo_foldcp.core.leaves import tensor_leaves
from physicsnemo_foldcp.distributed.mesh import FoldMesh
from physicsnemo_foldcp.distributed.wrappers import unwrap

DEFAULT_BUCKET_MIB = 25.0
"""Bucket size cap, as DDP's default ``bucket_cap_mb``."""

MODES = ("none", "ddp", "fsdp2")
"""The data-parallel wrappers the buckets compose with (see the module docstring)."""


@dataclass(eq=False)
class _Slot:
    """One parameter's place in a bucket."""

    owner: GradientBuckets
    name: str
    bucket: _Bucket
    offset: int
    shape: torch.Size
    target: nn.Parameter
    ready: bool = False
    kept: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def view(self) -> torch.Tensor:
        """This parameter's part of the bucket's buffer (allocated on first use)."""
        return self.bucket.flat().narrow(0, self.offset, self.numel).view(self.shape)

    def take(
        self,
        grad: torch.Tensor,
        mesh: DeviceMesh,
        reduce_dims: Sequence[int],
        narrows: Sequence[tuple[int, int, int]] = (),
    ) -> bool:
        """See :class:`~physicsnemo_foldcp.core.partial_grads.PartialSlot`."""
        return self.owner._take(self, grad, mesh, reduce_dims, narrows)


@dataclass(eq=False)
class _Bucket:
    """Parameters of one dtype whose parts are reduced together."""

    index: int
    dtype: torch.dtype
    device: torch.device
    slots: list[_Slot] = field(default_factory=list)
    numel: int = 0
    buffer: torch.Tensor | None = None
    ready: int = 0
    work: Any = None
    launched: bool = False

    def flat(self) -> torch.Tensor:
        if self.buffer is None:
            self.buffer = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        return self.buffer


class GradientBuckets:
    """Buckets of parameter-gradient parts, reduced over the domain once per step.

    Parameters
    ----------
    model : nn.Module
        The user's model (for ``fsdp2``: after ``fully_shard``, the root FSDP module).
    mesh : FoldMesh
        The job's mesh; the buckets reduce over ``mesh.domain_group`` (``none``) or over
        every rank (``ddp``, ``fsdp2``).
    mode : {"none", "ddp", "fsdp2"}
        The ``ddp``-axis wrapper the model is under (:func:`attach_gradient_buckets`
        picks it).
    bucket_mib : float, default 25
        Largest bucket, in MiB of gradient.

    Attributes
    ----------
    reductions : int
        Bucket reductions issued in the last backward.
    """

    def __init__(
        self,
        model: nn.Module,
        mesh: FoldMesh,
        mode: str = "none",
        bucket_mib: float = DEFAULT_BUCKET_MIB,
    ):
        if mode not in MODES:
            raise ValueError(f"gradient buckets compose with {MODES}, got {mode!r}")
        if not bucket_mib > 0:
            raise ValueError(f"bucket_mib must be positive, got {bucket_mib}")
        if mode != "none" and mesh.mesh.size() != dist.get_world_size():
            raise ValueError(
                f"gradient buckets with {mode} reduce over every rank: the mesh "
                f"{mesh.shape} must span the world of {dist.get_world_size()} ranks"
            )
        self.mesh, self.mode, self._model = mesh, mode, model
        self.domain_mesh = mesh.domain_mesh
        self._coordinate = mesh.domain_coordinate
        self._origin = self._coordinate == (0, 0)
        self._meshes: set[int] = set()
        self.buckets: list[_Bucket] = []
        self.slots: dict[str, _Slot] = {}
        self._next = 0
        self._active = False
        self._queued = False
        self._after_ddp = False
        self.reductions = 0
        cap = bucket_mib * 2**20
        # Reverse registration order: backward meets the last layers first, as DDP orders.
        for name, p in reversed(list(model.named_parameters())):
            if not p.requires_grad:
                continue
            bucket = self.buckets[-1] if self.buckets else None
            nbytes = p.numel() * p.element_size()
            if (
                bucket is None
                or bucket.dtype != p.dtype
                or (bucket.numel and (bucket.numel * p.element_size() + nbytes) > cap)
            ):
                bucket = _Bucket(len(self.buckets), p.dtype, _local(p).device)
                self.buckets.append(bucket)
            slot = _Slot(self, name, bucket, bucket.numel, p.shape, p)
            bucket.slots.append(slot)
            bucket.numel += p.numel()
            self.slots[name] = slot
        self._by_param = {id(s.target): s for s in self.slots.values()}
        self._handles: list[Any] = []
        if mode == "fsdp2":
            self._attach_fsdp_units(model)
        else:
            for slot in self.slots.values():
                partial_grads.attach(slot.target, slot)
        if mode != "fsdp2":
            for slot in self.slots.values():
                self._handles.append(
                    slot.target.register_post_accumulate_grad_hook(self._ready_hook(slot))
                )
        self._handles.append(model.register_forward_hook(self._forward_done))

    # -- attaching -------------------------------------------------------------------------

    def _attach_fsdp_units(self, model: nn.Module) -> None:
        """Attach each FSDP2 unit's unsharded parameters when the unit has gathered them."""
        from torch.distributed.fsdp import FSDPModule

        prefixes = {id(m): name for name, m in model.named_modules()}

        def attach_unit(unit: nn.Module, args: Any) -> None:
            prefix = prefixes[id(unit)]
            for name, p in unit.named_parameters():
                slot = self.slots.get(f"{prefix}.{name}" if prefix else name)
                if slot is not None and not isinstance(p, DTensor):
                    partial_grads.attach(p, slot)

        for unit in model.modules():
            if isinstance(unit, FSDPModule):
                self._handles.append(unit.register_forward_pre_hook(attach_unit))

    def detach(self) -> None:
        """Reduce per module call again: detach every parameter and remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        partial_grads.detach_slots(set(self.slots.values()))
        if getattr(self._model, "foldcp_gradient_buckets", None) is self:
            del self._model.foldcp_gradient_buckets

    # -- backward --------------------------------------------------------------------------

    def _forward_done(self, module: nn.Module, args: Any, output: Any) -> None:
        self.watch(output)

    def watch(self, output: Any) -> None:
        """Reduce the buckets at the end of any backward that starts from ``output``.

        The model's forward outputs are watched already; a caller that runs the model
        some other way (Lightning calls ``training_step``, not ``forward``) watches
        what it will call ``backward`` on. Watching the same step twice is harmless.

        Parameters
        ----------
        output : Any
            A tensor, or lists, tuples and mappings of them (e.g. ``{"loss": loss}``).
        """
        tensors = [t for _, t in tensor_leaves((output,), {}) if t.requires_grad]
        if tensors and torch.is_grad_enabled():
            hook = self._backward_started
            torch.autograd.graph.register_multi_grad_hook(tensors, hook, mode="any")

    def _backward_started(self, grad: torch.Tensor | None) -> None:
        if not self._queued:
            self._queued = True
            self.reductions = 0
            compat.at_end_of_backward(self._finish)

    def _take(
        self,
        slot: _Slot,
        grad: torch.Tensor,
        mesh: DeviceMesh,
        reduce_dims: Sequence[int],
        narrows: Sequence[tuple[int, int, int]],
    ) -> bool:
        if id(mesh) not in self._meshes:
            if mesh != self.domain_mesh:
                return False
            self._meshes.add(id(mesh))
        if slot.bucket.launched:
            raise RuntimeError(
                f"parameter {slot.name!r} received a gradient part after its bucket "
                f"{slot.bucket.index} was reduced: a parameter used again after its "
                "gradient accumulated (e.g. in two checkpointed regions) cannot share a "
                "bucket; detach the gradient buckets for this model"
            )
        copies = any(
            m not in reduce_dims and self.domain_mesh.size(m) > 1 and self._coordinate[m]
            for m in range(2)
        )
        if not copies:
            region = slot.view()
            for dim, start, length in narrows:
                region = region.narrow(dim, start, length)
            region.add_(grad)
        slot.kept = True
        if not self._active:
            self._active = True
            self._launch_ready()
        return True

    def _ready_hook(self, slot: _Slot):
        def ready(param: torch.Tensor) -> None:
            if not slot.ready:
                slot.ready = True
                slot.bucket.ready += 1
                if self._active:
                    self._launch_ready()

        return ready

    def _launch_ready(self) -> None:
        """Start the all-reduce of every bucket whose parameters are all ready, in order."""
        if self.mode == "fsdp2":
            return
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if bucket.ready < len(bucket.slots):
                return
            self._launch(bucket)
            self._next += 1

    def _launch(self, bucket: _Bucket) -> None:
        """Start the bucket's all-reduce.

        ``none``: over the domain, the accumulated gradients folded in by the origin;
        ``ddp``: over every rank, the parts only (DDP reduces the rest).
        """
        bucket.launched = True
        if not any(s.kept or s.target.grad is not None for s in bucket.slots):
            return
        flat = bucket.flat()
        group = self.mesh.domain_group
        if self.mode == "ddp":
            group = dist.group.WORLD
        elif self._origin:
            for slot in bucket.slots:
                if slot.target.grad is not None:
                    slot.view().add_(slot.target.grad)
        bucket.work = dist.all_reduce(flat, group=group, async_op=True)
        self.reductions += 1

    def _finish(self) -> None:
        """End of the backward: reduce what is left, write ``.grad``, reset for the next."""
        if self.mode == "ddp" and self._active and not self._after_ddp:
            # DDP queued its own end-of-backward (which writes .grad) after this one: go
            # after it. The engine runs callbacks queued while it runs its callbacks.
            self._after_ddp = True
            compat.at_end_of_backward(self._finish)
            return
        try:
            if not self._active:
                return
            if self.mode == "fsdp2":
                self._finish_fsdp2()
                return
            while self._next < len(self.buckets):
                self._launch(self.buckets[self._next])
                self._next += 1
            for bucket in self.buckets:
                if bucket.work is None:
                    continue
                bucket.work.wait()
                if self.mode == "ddp":
                    bucket.flat().div_(self.mesh.ddp_size)
                for slot in bucket.slots:
                    grad = slot.target.grad
                    if grad is None:
                        continue
                    if self.mode == "ddp":
                        grad.add_(slot.view())
                    else:
                        grad.copy_(slot.view())
        finally:
            self._reset()

    def _finish_fsdp2(self) -> None:
        ddp = self.mesh.ddp_size
        for bucket in self.buckets:
            if not any(s.kept for s in bucket.slots):
                continue
            flat = bucket.flat()
            dist.all_reduce(flat, group=dist.group.WORLD)
            self.reductions += 1
            flat.div_(ddp)
            for slot in bucket.slots:
                grad = slot.target.grad
                if grad is None:
                    raise RuntimeError(f"FSDP2 left no gradient on {slot.name!r}")
                local = grad.to_local() if isinstance(grad, DTensor) else grad
                part = _fsdp_shard(slot.view(), self.mesh.ddp_rank, ddp)
                if part.shape != local.shape:
                    raise RuntimeError(
                        f"{slot.name!r}: FSDP2 shard {tuple(local.shape)} on ddp rank "
                        f"{self.mesh.ddp_rank} is not dim-0 chunk {tuple(part.shape)}"
                    )
                local.add_(part)

    def _reset(self) -> None:
        for bucket in self.buckets:
            if bucket.buffer is not None:
                bucket.buffer.zero_()
            bucket.ready, bucket.work, bucket.launched = 0, None, False
        for slot in self.slots.values():
            slot.ready = slot.kept = False
        self._next, self._active, self._queued, self._after_ddp = 0, False, False, False

    def describe(self) -> str:
        """``"3 gradient buckets (25.0, 25.0, 4.2 MiB)"``."""
        sizes = ", ".join(f"{b.numel * b.dtype.itemsize / 2**20:.1f}" for b in self.buckets)
        return f"{len(self.buckets)} gradient buckets ({sizes} MiB)"


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _fsdp_shard(full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s dim-0 chunk of ``full``, as FSDP2's ``Shard(0)`` splits it."""
    chunks = torch.chunk(full, size, dim=0)
    if rank < len(chunks):
        return chunks[rank]
    return full.narrow(0, full.shape[0], 0) if full.ndim else full


def attach_gradient_buckets(
    model: nn.Module, mesh: FoldMesh, bucket_mib: float = DEFAULT_BUCKET_MIB
) -> GradientBuckets | None:
    """Reduce ``model``'s parameter gradients over the domain in buckets from now on.

    Parameters
    ----------
    model : nn.Module
        What :func:`~physicsnemo_foldcp.distributed.wrap_model` returned: the model itself
        (no wrapper, or FSDP2 sharded in place) or its DDP wrapper.
    mesh : FoldMesh
        The job's mesh.
    bucket_mib : float, default 25
        Largest bucket, in MiB of gradient.

    Returns
    -------
    GradientBuckets or None
        The buckets (also :func:`attached_buckets` of ``model``); ``None`` on a 1x1 domain,
        where nothing is reduced over it.
    """
    from torch.distributed.fsdp import FSDPModule

    if mesh.domain_size == 1:
        return None
    inner = unwrap(model)
    if attached_buckets(model) is not None:
        raise ValueError("gradient buckets are already attached to this model")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        mode = "ddp"
    elif isinstance(inner, FSDPModule):
        mode = "fsdp2"
    elif mesh.ddp_size > 1:
        raise ValueError(
            f"ddp = {mesh.ddp_size}: wrap the model for the ddp axis (wrap_model) "
            "before attaching gradient buckets"
        )
    else:
        mode = "none"
    buckets = GradientBuckets(inner, mesh, mode, bucket_mib)
    inner.foldcp_gradient_buckets = buckets
    return buckets


def attached_buckets(model: nn.Module) -> GradientBuckets | None:
    """The buckets attached to ``model`` (or to the module its DDP wrapper holds)."""
    return getattr(unwrap(model), "foldcp_gradient_buckets", None)


__all__ = [
    "DEFAULT_BUCKET_MIB",
    "GradientBuckets",
    "attach_gradient_buckets",
    "attached_buckets",
]
