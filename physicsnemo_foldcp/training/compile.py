"""``torch.compile`` for context-parallel models: whole-model on 1x1, regional otherwise.

* ``whole`` (a ``1 x 1`` CP mesh): each feature's ShardTensor holds the whole tensor, so
  the loop passes the local tensors (:func:`local_features`) and the model runs, and is
  compiled (``nn.Module.compile(dynamic=False)``), as plain PyTorch. Any wrapper works.
* ``regional`` (a larger CP mesh): the ops that communicate (the cross-axis ops, the
  pair-biased attention) stay eager; only regions that compute on local blocks are
  compiled: the module types the model declares as ``compile_regions`` (the reference
  model's transitions and distogram head), or ``train.compile_regions``
  (:mod:`~physicsnemo_foldcp.training.hooks`). A region's forward becomes a
  :class:`LocalRegion`: the compiled module runs on the local blocks of its ShardTensor
  inputs (plain tensors, so the plugin's dispatch stays out of the graph) and its result
  is wrapped in the inputs' layout. Its weights then hold this rank's part of their
  gradient; :func:`reduce_region_gradients` sums them over the mesh dims the inputs were
  sharded on after ``backward`` (one all-reduce per such mesh dim and weight, as in eager
  mode). DDP and FSDP2 reduce gradients inside ``backward``, before that step can run, so
  regional compile needs ``ddp == 1`` (wrapper ``none``).

``dynamic=False`` keeps symbolic shapes out of the ShardTensor specs (PhysicsNeMo's
advice); every new complex size recompiles. Compiling the whole model on ShardTensor
inputs fails in AOTAutograd with these versions (``placement[0] doesn't have a matching
shard in shard_order``), hence the local tensors of the ``whole`` mode.

On this CPU machine inductor builds C++ kernels: compiling one transition (forward and
backward) took about 100 s on 2 cores. ``backend="aot_eager"`` traces the same graphs
without generating code; the tests use it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from physicsnemo.domain_parallel import ShardTensor
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from physicsnemo_foldcp.core import compat
from physicsnemo_foldcp.core.blocks import all_reduce, local_of
from physicsnemo_foldcp.distributed.mesh import FoldMesh
from physicsnemo_foldcp.ops import wrap
from physicsnemo_foldcp.training.hooks import module_types

logger = logging.getLogger("physicsnemo_foldcp.training")

COMPILE_MODES = ("none", "auto", "whole", "regional")
"""Choices of :func:`compile_model`."""


def resolve_compile_mode(mode: str, cp: Sequence[int]) -> str:
    """``"auto"`` -> ``"whole"`` on a 1x1 CP mesh, ``"regional"`` otherwise.

    Parameters
    ----------
    mode : {"none", "auto", "whole", "regional"}
        The requested mode.
    cp : Sequence[int]
        ``(cp0, cp1)``.

    Returns
    -------
    str
        ``"none"``, ``"whole"`` or ``"regional"``.

    Raises
    ------
    ValueError
        For an unknown mode, or ``"whole"`` on a CP mesh larger than 1x1 (the communicating
        ops cannot live in a compiled graph).
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode must be one of {COMPILE_MODES}, got {mode!r}")
    single = tuple(cp) == (1, 1)
    if mode == "auto":
        return "whole" if single else "regional"
    if mode == "whole" and not single:
        raise ValueError(
            f"compile='whole' needs a 1x1 CP mesh, this one is {cp[0]}x{cp[1]}: the "
            "cross-axis ops and the pair-biased attention communicate and stay eager; use "
            "'regional' (or 'auto')"
        )
    return mode


def compile_model(
    model: nn.Module,
    mesh: FoldMesh,
    mode: str = "auto",
    *,
    regions: Sequence[type[nn.Module]] | None = None,
    backend: str = "inductor",
) -> list[str]:
    """Compile ``model`` in place for ``mesh``'s CP shape.

    Parameters
    ----------
    model : nn.Module
        The unwrapped model (compile before or after DDP/FSDP2 wrapping; in place).
    mesh : FoldMesh
        The job's mesh.
    mode : {"none", "auto", "whole", "regional"}
        See :func:`resolve_compile_mode`.
    regions : Sequence[type], optional
        Module types compiled by the regional mode; by default the model class's
        ``compile_regions``.
    backend : str, default "inductor"
        ``torch.compile`` backend.

    Returns
    -------
    list[str]
        Names of the compiled modules (``""`` for the whole model); empty for ``"none"``.
    """
    choice = resolve_compile_mode(mode, mesh.cp)
    if choice == "none":
        return []
    if choice == "whole":
        model.compile(dynamic=False, backend=backend)
        compiled = [""]
    else:
        kinds = module_types(model, "compile_regions", regions)
        compiled = [name for name, m in model.named_modules() if isinstance(m, kinds)]
        for name in compiled:
            module = model.get_submodule(name)
            module.forward = LocalRegion(module, backend)
    if mesh.rank == 0:
        logger.info(
            "torch.compile (%s, backend %s): %s",
            choice,
            backend,
            "whole model" if compiled == [""] else ", ".join(compiled) or "no module matched",
        )
    return compiled


def local_features(features: Mapping[str, Any]) -> dict[str, Any]:
    """Each ShardTensor's local tensor (the whole feature on a 1x1 CP mesh), others as is."""
    return {k: v.to_local() if isinstance(v, ShardTensor) else v for k, v in features.items()}


class LocalRegion:
    """A compiled region's forward: the compiled module on the local blocks of its inputs.

    Every ShardTensor argument must have the same layout (mesh, placements, sharding
    shapes); the module must keep the sharded dims (it acts on trailing dims only, as a
    transition or a head does). Plain-tensor calls run the compiled module as they are.

    Parameters
    ----------
    module : nn.Module
        The region; its ``forward`` is compiled with ``torch.compile(dynamic=False)``.
    backend : str
        ``torch.compile`` backend.

    Attributes
    ----------
    sharded_over : tuple[DeviceMesh, tuple[int, ...]] or None
        The mesh and the mesh dims the inputs of the last call were sharded over, whose
        ranks each hold part of the weights' gradients.
    """

    def __init__(self, module: nn.Module, backend: str):
        self.name = type(module).__name__
        self.compiled = torch.compile(module.forward, dynamic=False, backend=backend)
        self.sharded_over: tuple[DeviceMesh, tuple[int, ...]] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the compiled module on local blocks; the result has the inputs' layout."""
        sharded = [a for a in args if isinstance(a, ShardTensor)]
        if not sharded:
            return self.compiled(*args, **kwargs)
        ref = sharded[0]
        shapes = compat.sharding_shapes(ref) or {}
        for other in sharded[1:]:
            if (other.device_mesh, tuple(other.placements)) != (
                ref.device_mesh,
                tuple(ref.placements),
            ) or compat.sharding_shapes(other) != compat.sharding_shapes(ref):
                raise ValueError(
                    f"compiled region {self.name}: its ShardTensor inputs have different "
                    f"layouts ({ref.placements} and {other.placements})"
                )
        local = [local_of(a) if isinstance(a, ShardTensor) else a for a in args]
        out = self.compiled(*local, **kwargs)
        sharded_dims = {m: p.dim for m, p in enumerate(ref.placements) if p.is_shard()}
        self.sharded_over = (ref.device_mesh, tuple(sharded_dims))

        held = compat.local_tensor(ref).shape

        def layout(t: torch.Tensor) -> dict[int, list[tuple[int, ...]]]:
            new = {}
            for m, dim in sharded_dims.items():
                if t.ndim <= dim or t.shape[dim] != held[dim]:
                    raise ValueError(
                        f"compiled region {self.name}: its result {tuple(t.shape)} does not "
                        f"keep the sharded dim {dim} of its input {tuple(held)}"
                    )
                new[m] = [(*t.shape[:dim], s[dim], *t.shape[dim + 1 :]) for s in shapes[m]]
            return new

        return wrap(out, ref.device_mesh, ref.placements, layout(out))


def reduce_region_gradients(model: nn.Module) -> int:
    """Sum the weights' gradients of every compiled region over the mesh dims it ran sharded on.

    Collective over the domain group: ONE all-reduce per sharded mesh dim of each weight of
    a :class:`LocalRegion` called with ShardTensors (none otherwise). Every rank must call
    it after the same backward.

    Parameters
    ----------
    model : nn.Module
        The (unwrapped) model.

    Returns
    -------
    int
        How many gradients were reduced.
    """
    reduced = 0
    for module in model.modules():
        region = module.__dict__.get("forward")
        if not isinstance(region, LocalRegion) or region.sharded_over is None:
            continue
        mesh, dims = region.sharded_over
        for p in module.parameters():
            if p.grad is None:
                continue
            for m in dims:
                p.grad = all_reduce(p.grad, mesh, m)
            reduced += 1
    return reduced


__all__ = [
    "COMPILE_MODES",
    "compile_model",
    "local_features",
    "LocalRegion",
    "reduce_region_gradients",
    "resolve_compile_mode",
]
