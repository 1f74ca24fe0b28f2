"""Distributed forwards of whole modules, for modules whose op-by-op run would gather.

Most of a model runs under context parallelism op by op (:mod:`physicsnemo_foldcp.dispatch.rules`).
A few modules cannot: run op by op, a triangle multiplication would gather a full pair
tensor and a triangle attention ``N x N x N`` scores. For those, a *module handler* computes
the module's forward distributed, with the module's own parameters (so its
``state_dict`` and the user's code stay as they are).

:func:`register_module_handler` wraps the class's ``forward``: a call with a ShardTensor
among its arguments first makes every ShardTensor argument a
:class:`~physicsnemo_foldcp.core.tensor.FoldTensor` (:func:`~physicsnemo_foldcp.core.tensor.wrap`:
the same blocks, gradients passed through), then runs ``handler(module, *args, **kwargs)``,
or the class's own ``forward`` when the handler is :data:`OWN_FORWARD`; every other call
runs the class's own ``forward`` unchanged. :func:`unregister_module_handler` puts the
original back.

:data:`OWN_FORWARD` serves container layers whose own forward is right under the
plugin's dispatch but whose inputs may arrive as plain ShardTensors: a reentrant
``torch.utils.checkpoint`` saves a layer's inputs and hands the recomputation ShardTensors
without the plugin's class.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from physicsnemo.domain_parallel import ShardTensor
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.func import functional_call

from physicsnemo_foldcp.core.blocks import COLUMNS, ROWS, TileParameters
from physicsnemo_foldcp.core.leaves import replace_leaves, tensor_leaves
from physicsnemo_foldcp.core.tensor import wrap

ModuleHandler = Callable[..., Any]
"""``handler(module, *args, **kwargs)``: the module's forward on FoldTensor inputs."""

MODULE_HANDLERS: dict[type[nn.Module], ModuleHandler | None] = {}
"""Classes with a registered handler (subclasses inherit it unless they have their own)."""

OWN_FORWARD = None
"""The handler that runs the class's own forward, on inputs made FoldTensors first."""


def adopted(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """``(args, kwargs)`` with every ShardTensor a FoldTensor, or ``None`` if there is none."""
    found = {path: t for path, t in tensor_leaves(args, kwargs) if isinstance(t, ShardTensor)}
    if not found:
        return None
    return replace_leaves(args, kwargs, {path: wrap(t) for path, t in found.items()})


def register_module_handler(cls: type[nn.Module], handler: ModuleHandler | None) -> None:
    """Run ``handler(module, *args, **kwargs)`` for ``cls.forward`` calls on ShardTensors.

    Idempotent: registering again replaces the handler and keeps the original forward.

    Parameters
    ----------
    cls : type[nn.Module]
        The module class (e.g. a Boltz layer).
    handler : callable or OWN_FORWARD
        ``handler(module, *args, **kwargs)`` with the arguments of ``cls.forward``, its
        ShardTensors made FoldTensors; :data:`OWN_FORWARD` runs the class's own forward
        on them.
    """
    MODULE_HANDLERS[cls] = handler
    current = cls.__dict__.get("forward")
    if getattr(current, "foldcp_original", None) is not None:
        return
    original = cls.forward

    @functools.wraps(original)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        converted = adopted(args, kwargs)
        if converted is None:
            return original(self, *args, **kwargs)
        handler = MODULE_HANDLERS[cls]
        return (handler or original)(self, *converted[0], **converted[1])

    forward.foldcp_original = original
    forward.foldcp_own = current is not None
    cls.forward = forward


def unregister_module_handler(cls: type[nn.Module]) -> None:
    """Give ``cls`` its own ``forward`` back (no-op when nothing is registered)."""
    MODULE_HANDLERS.pop(cls, None)
    current = cls.__dict__.get("forward")
    if getattr(current, "foldcp_original", None) is None:
        return
    if current.foldcp_own:
        cls.forward = current.foldcp_original
    else:
        delattr(cls, "forward")


def tile_parameters(
    module: nn.Module,
    mesh: DeviceMesh,
    mesh_dims: tuple[int, ...] = (ROWS, COLUMNS),
    submodule_dims: Mapping[str, tuple[int, ...]] | None = None,
) -> dict[str, torch.Tensor]:
    """The module's parameters for use on every rank's own blocks.

    Each rank computes, from its blocks, a part of every parameter's gradient; the
    returned tensors (views of the parameters) sum those parts in backward: ONE all-reduce
    per mesh dim of ``mesh_dims`` of all gradients flattened together
    (:class:`~physicsnemo_foldcp.core.blocks.TileParameters`). Without grad, the
    parameters themselves.

    Parameters
    ----------
    module : nn.Module
        The module whose parameters are used.
    mesh : DeviceMesh
        The ``(cp0, cp1)`` domain mesh.
    mesh_dims : tuple[int, ...], default (cp0, cp1)
        The mesh dims whose ranks compute different parts: both for a pair tile, ``cp0``
        only for row blocks that the ranks of ``cp1`` compute alike.
    submodule_dims : mapping of str to tuple[int, ...], optional
        Other mesh dims for the parameters of the named direct submodules (one more
        flat reduction per distinct set of dims).
    """
    params = parameter_slots(module)
    unique = dict(module.named_parameters())
    trained = [name for name, p in unique.items() if p.requires_grad]
    if not (torch.is_grad_enabled() and trained):
        return params
    special = dict(submodule_dims or {})
    groups: dict[tuple[int, ...], list[str]] = {}
    for name in trained:
        dims = special.get(name.split(".", 1)[0], mesh_dims)
        groups.setdefault(tuple(dims), []).append(name)
    view_of: dict[int, torch.Tensor] = {}
    for dims, names in groups.items():
        shared = TileParameters.apply(mesh, dims, *(unique[n] for n in names))
        view_of.update({id(unique[name]): view for name, view in zip(names, shared)})
    return {name: view_of.get(id(p), p) for name, p in params.items()}


def parameter_slots(module: nn.Module) -> dict[str, torch.Tensor]:
    """One name per place a parameter is held: ``(submodule, attribute)``.

    A submodule registered under two names (Boltz's ``output_projection_linear`` is also
    ``output_projection.0``) holds its parameters once, so only its first name is kept;
    a parameter shared by two submodules (tied weights) is listed under both. Passed to
    ``functional_call(..., tie_weights=False)``, every place is swapped and restored once:
    torch's weight tying swaps a twice-registered submodule twice and leaves the swapped
    tensor in it.
    """
    slots: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, str]] = set()
    for name, p in module.named_parameters(remove_duplicate=False):
        owner, _, attr = name.rpartition(".")
        place = (id(module.get_submodule(owner)), attr)
        if place not in seen:
            seen.add(place)
            slots[name] = p
    return slots


def submodule_caller(
    module: nn.Module, params: dict[str, torch.Tensor]
) -> Callable[..., torch.Tensor]:
    """``call(name, *inputs, **kwargs)``: submodule ``name``'s own forward with ``params``.

    ``name=""`` calls ``module`` itself.

    ``params`` are keyed like :func:`parameter_slots` (e.g. :func:`tile_parameters`);
    the submodule runs through :func:`torch.func.functional_call`, so its own forward (and
    dtype handling) is kept.
    """

    def call(name: str, *inputs: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        prefix = f"{name}." if name else ""
        own = {k[len(prefix) :]: v for k, v in params.items() if k.startswith(prefix)}
        return functional_call(module.get_submodule(name), own, inputs, kwargs, tie_weights=False)

    return call


__all__ = [
    "MODULE_HANDLERS",
    "OWN_FORWARD",
    "ModuleHandler",
    "adopted",
    "register_module_handler",
    "parameter_slots",
    "submodule_caller",
    "tile_parameters",
    "unregister_module_handler",
]
