"""``torch.compile`` for context-parallel models: whole-model on 1x1, regional otherwise.

* ``whole`` (a ``1 x 1`` CP mesh): each feature's ShardTensor holds the whole tensor, so
  the loop passes the local tensors (:func:`local_features`) and the model runs, and is
  compiled (``nn.Module.compile(dynamic=False)``), as plain PyTorch. Any wrapper works.
* ``regional`` (a larger CP mesh): the ops that communicate (the cross-axis ops, the
  pair-biased attention) stay eager; only regions that compute on local blocks are
  compiled: the module types the model declares as ``compile_regions`` (the reference
  model's transitions and distogram head), or ``train.compile_regions``
  (:mod:`~physicsnemo_foldcp.training.hooks`). A compiled region hands
  its plain weights a ``Partial`` ShardTensor gradient (PhysicsNeMo 2.2 with torch 2.14)
  instead of the reduced plain tensor of eager mode; :func:`reduce_partial_gradients`
  reduces them after ``backward`` (one all-reduce per partial mesh dim and weight, as in
  eager mode). DDP and FSDP2 reduce gradients inside ``backward``, before that step can
  run, so regional compile needs ``ddp == 1`` (wrapper ``none``).

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

from physicsnemo.domain_parallel import ShardTensor
from torch import nn
from torch.distributed.tensor import DTensor

from physicsnemo_foldcp.distributed.mesh import FoldMesh
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
            model.get_submodule(name).compile(dynamic=False, backend=backend)
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


def reduce_partial_gradients(model: nn.Module) -> int:
    """Turn ``Partial`` ShardTensor gradients of plain parameters into reduced plain tensors.

    Collective over the domain group: ONE all-reduce per partial mesh dim of each such
    gradient (none when there is none). Every rank must call it after the same backward.

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
    for p in model.parameters():
        g = p.grad
        if g is None or isinstance(p, DTensor) or not isinstance(g, (ShardTensor, DTensor)):
            continue
        p.grad = g.full_tensor() if any(pl.is_partial() for pl in g.placements) else g.to_local()
        reduced += 1
    return reduced


__all__ = [
    "COMPILE_MODES",
    "compile_model",
    "local_features",
    "reduce_partial_gradients",
    "resolve_compile_mode",
]
