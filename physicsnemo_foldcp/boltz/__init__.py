"""Boltz's own modules under context parallelism (the ``boltz`` extra: ``boltz-community``).

One call, :func:`install`, registers a distributed forward for each Boltz layer whose
op-by-op run would gather (:mod:`physicsnemo_foldcp.ops.modules`); everything else in a
Boltz model runs op by op through the plugin's dispatch. After it, Boltz's modules, built
and called as Boltz builds and calls them, compute on the scattered features' local
blocks; called with plain tensors they are unchanged. :func:`uninstall` undoes it.

Each handler module (``HANDLER_MODULES``) defines ``handlers()``: the ``(Boltz class,
handler)`` pairs it provides; a module may also define ``function_handlers()``:
``(Boltz module, function name, wrap)`` for a Boltz function that its callers look up by
name, replaced by ``wrap(original)``, which runs ``original`` unchanged on plain tensors.
"""

from __future__ import annotations

import importlib

from torch import nn

from physicsnemo_foldcp.ops.modules import register_module_handler, unregister_module_handler

HANDLER_MODULES: tuple[str, ...] = (
    "atom_attention",
    "attention_pair_bias",
    "checkpointed_layers",
    "confidence",
    "contact_conditioning",
    "diffusion",
    "outer_product_mean",
    "pair_averaging",
    "templates",
    "triangle_attention",
    "triangle_mult",
)
"""Modules of this package that provide Boltz module handlers."""

_installed: list[type] = []
_patched: list[tuple[object, str, object]] = []


def _require_boltz() -> None:
    try:
        importlib.import_module("boltz.model.layers.pairformer")
    except ImportError as err:
        raise ImportError(
            "physicsnemo_foldcp.boltz needs Boltz's model code: pip install -e '.[boltz]' "
            f"(PyPI boltz-community, import name boltz); importing it failed: {err}"
        ) from err


def install() -> list[str]:
    """Register the distributed forwards of Boltz's layers (idempotent).

    Returns
    -------
    list[str]
        The Boltz classes that now have a distributed forward.

    Raises
    ------
    ImportError
        When Boltz's model code is not installed (the message names the extra).
    """
    _require_boltz()
    for name in HANDLER_MODULES:
        module = importlib.import_module(f"physicsnemo_foldcp.boltz.{name}")
        for cls, handler in module.handlers():
            register_module_handler(cls, handler)
            if cls not in _installed:
                _installed.append(cls)
        for owner_name, attr, wrap in getattr(module, "function_handlers", list)():
            owner = importlib.import_module(owner_name)
            current = getattr(owner, attr)
            if getattr(current, "foldcp_original", None) is None:
                setattr(owner, attr, wrap(current))
                _patched.append((owner, attr, current))
    return [f"{cls.__module__}.{cls.__qualname__}" for cls in _installed]


def holds_boltz_modules(model: nn.Module) -> bool:
    """Whether any submodule of ``model`` is a class of Boltz's package (``boltz.*``)."""
    return any(type(m).__module__.split(".")[0] == "boltz" for m in model.modules())


def install_for(model: nn.Module) -> bool:
    """:func:`install` when ``model`` holds Boltz modules (what the apps' model builder does).

    Returns
    -------
    bool
        Whether the handlers were installed.
    """
    if not holds_boltz_modules(model):
        return False
    install()
    return True


def uninstall() -> None:
    """Give every Boltz class its own forward back, and every patched function."""
    while _installed:
        unregister_module_handler(_installed.pop())
    while _patched:
        owner, attr, original = _patched.pop()
        setattr(owner, attr, original)


__all__ = ["HANDLER_MODULES", "holds_boltz_modules", "install", "install_for", "uninstall"]
