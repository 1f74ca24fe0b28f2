"""What the training loop reads from a model: its FSDP2 units, compile regions and loss.

A model plugs into :func:`~physicsnemo_foldcp.training.train`,
:func:`~physicsnemo_foldcp.training.forward_backward` and
:func:`~physicsnemo_foldcp.training.validate_model` without any change to them. It
declares, on its class:

* ``fsdp_units`` (class attribute, tuple of ``nn.Module`` types): submodules that
  ``wrapper=fsdp2`` shards one by one before the root (their parameters are gathered
  and freed in turn); none declared: the root alone is one unit;
* ``compile_regions`` (class attribute, tuple of ``nn.Module`` types): the submodules
  ``compile=regional`` compiles, which must compute on local blocks only (no cross-axis
  op); none declared: regional compile compiles nothing;
* ``loss(outputs, features) -> Tensor`` (method): the scalar loss of
  ``outputs = model(**features)``, replicated over the domain group (reduce with
  :func:`~physicsnemo_foldcp.ops.masked_mean` or ``full_tensor()``).

For a model class that cannot be changed (e.g. one imported from its own package),
``train.fsdp_units`` and ``train.compile_regions`` (lists of class paths) and
``train.loss`` (a function path) give the same from the configuration, and take
precedence over the class's.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

LossFn = Callable[[Mapping[str, torch.Tensor], Mapping[str, Any]], torch.Tensor]
"""``loss_fn(outputs, features)`` -> scalar loss."""


def locate(path: str, option: str) -> Any:
    """The object a dotted path names (``"package.module.Name"``, nested names allowed).

    Parameters
    ----------
    path : str
        Dotted path: the longest importable module prefix, then attributes.
    option : str
        The option that gave the path, for the error message.

    Raises
    ------
    ValueError
        Naming ``option`` and ``path`` when no module prefix imports or an attribute is
        missing.
    """
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
        except AttributeError:
            break
        return obj
    raise ValueError(f"{option}: cannot import {path!r} (expected package.module.Name)")


def module_types(
    model: nn.Module, attribute: str, values: Sequence[str | type] | None = None
) -> tuple[type[nn.Module], ...]:
    """The module types of ``train.<attribute>``, or else the model's own declaration.

    Parameters
    ----------
    model : nn.Module
        The (unwrapped) model.
    attribute : {"fsdp_units", "compile_regions"}
        Which declaration.
    values : Sequence[str or type], optional
        From the configuration: class paths or classes; ``None`` reads
        ``type(model).<attribute>`` (empty when the class declares none).

    Raises
    ------
    ValueError
        When a path does not import, or names something that is not an ``nn.Module`` type.
    """
    option = f"train.{attribute}"
    declared = getattr(type(model), attribute, ()) if values is None else values
    types = tuple(locate(v, option) if isinstance(v, str) else v for v in declared)
    for t in types:
        if not (isinstance(t, type) and issubclass(t, nn.Module)):
            raise ValueError(f"{option}: {t!r} is not an nn.Module class")
    return types


def model_loss(model: nn.Module, loss: str | LossFn | None = None) -> LossFn:
    """``loss`` (a function or its path), or else the model's ``loss`` method.

    Parameters
    ----------
    model : nn.Module
        The (unwrapped) model.
    loss : str or callable, optional
        ``loss(outputs, features)`` -> scalar loss, or its dotted path (``train.loss``).

    Raises
    ------
    ValueError
        When ``loss`` does not import or is not callable.
    TypeError
        When neither ``loss`` nor a ``loss`` method of the model is there.
    """
    if loss is not None:
        fn = locate(loss, "train.loss") if isinstance(loss, str) else loss
        if not callable(fn):
            raise ValueError(f"train.loss: {fn!r} is not callable")
        return fn
    method = getattr(model, "loss", None)
    if not callable(method):
        raise TypeError(
            f"{type(model).__name__} has no loss(outputs, features) method: define one on "
            "the model class, or set train.loss to the path of a loss function (loss_fn= "
            "in Python)"
        )
    return method


__all__ = ["LossFn", "locate", "model_loss", "module_types"]
