"""A ``Boltz2Config`` from a ``Boltz2``'s saved hyperparameters.

:func:`boltz2_config_from_hparams` reads a Lightning checkpoint's ``hyper_parameters``
into a :class:`~physicsnemo_foldcp.models.boltz2_config.Boltz2Config`. What the model *is*
comes from the checkpoint; how it *predicts* comes from the project's configuration.
``boltz predict`` does the same: it loads ``Boltz2`` from its checkpoint with
``diffusion_process_args``, ``predict_args``, ``steering_args``, ``use_kernels``,
``use_flash_attn``, ``ema=False`` and new ``pairformer_args`` / ``msa_args`` of its own in
place of the training-time values saved in the file. Here:

* the architecture (widths, depths, heads, feature flags, the confidence and diffusion
  module arguments: every field of :data:`~physicsnemo_foldcp.models.boltz2.BOLTZ2_HPARAMS`
  but those below) is the checkpoint's, so the model built from it has the checkpoint's
  parameter shapes. A field the checkpoint lacks (a file written by an older Boltz) takes
  ``Boltz2.__init__``'s default, as Boltz's own loading does;
* :data:`PREDICTION_FIELDS` (and ``recycling_steps``) are the ``prediction`` config's,
  never the checkpoint's;
* in ``pairformer_args`` and ``msa_args``, the keys that only change how the module runs,
  not its parameters (:data:`PREDICTION_KEYS`: dropouts, activation checkpointing, MSA
  subsampling), are the ``prediction`` config's where it has them and otherwise left to
  the module's default: the checkpoint's training-time values are dropped. Boltz's
  ``boltz predict`` replaces these two dictionaries whole with its released model's sizes,
  which equal the released checkpoint's; taking the sizes from the checkpoint gives the
  same model for the released weights and the right one for any other checkpoint;
* ``ema`` is not a field: the weights are the checkpoint's ``state_dict``, as
  ``boltz predict`` (``ema=False``) loads them.

The values are read as plain data: Hydra's ``DictConfig`` / ``ListConfig`` (Boltz's
training passes its config as such) become dicts and lists without resolving
interpolations, and a value that is still an interpolation (``${...}``) is refused.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from physicsnemo_foldcp.models.boltz2_config import Boltz2Config

PREDICTION_FIELDS: tuple[str, ...] = (
    "diffusion_process_args",
    "predict_args",
    "steering_args",
    "use_kernels",
    "use_flash_attn",
)
"""Fields of :class:`Boltz2Config` taken from the prediction config, not the checkpoint
(those ``boltz predict`` passes to ``Boltz2.load_from_checkpoint``)."""

PREDICTION_KEYS: dict[str, tuple[str, ...]] = {
    "pairformer_args": ("dropout", "activation_checkpointing"),
    "msa_args": (
        "msa_dropout",
        "z_dropout",
        "activation_checkpointing",
        "subsample_msa",
        "num_subsampled_msa",
    ),
}
"""Keys of ``pairformer_args`` / ``msa_args`` that change how the module runs, not its
parameters: the prediction config's, never the checkpoint's training-time values."""

MAX_DEPTH = 32
"""Deepest nesting of dicts and lists read from a hyperparameter value."""


class HyperparameterError(ValueError):
    """A checkpoint's hyperparameters do not describe a ``Boltz2Config`` (entry named)."""


def plain_value(value: Any, where: str, depth: int = 0) -> Any:
    """``value`` as plain data: dicts with str keys, lists, str, int, float, bool, None.

    Parameters
    ----------
    value : Any
        A hyperparameter as unpickled: plain data, or Hydra's ``DictConfig`` /
        ``ListConfig`` (converted without resolving interpolations).
    where : str
        Its name in messages (``hyper_parameters.msa_args``).
    depth : int
        Nesting level of ``value`` (bounded by :data:`MAX_DEPTH`).

    Raises
    ------
    HyperparameterError
        For another type, a non-str key, an unresolved interpolation, a non-finite float
        or nesting deeper than :data:`MAX_DEPTH`; the message names the entry.
    """
    if depth > MAX_DEPTH:
        raise HyperparameterError(f"{where}: nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, (DictConfig, ListConfig)):
        value = _container_data(value, where)
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise HyperparameterError(f"{where} is {value}, not a finite number")
        return value
    if isinstance(value, str):
        if "${" in value:
            raise HyperparameterError(
                f"{where} is {value!r}, an unresolved interpolation: a Boltz-2 checkpoint "
                "holds resolved values"
            )
        return value
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise HyperparameterError(f"{where}: key {key!r} is not a str")
            out[key] = plain_value(item, f"{where}.{key}", depth + 1)
        return out
    if isinstance(value, (list, tuple)):
        return [plain_value(item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value)]
    raise HyperparameterError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}, not plain data "
        "(dicts, lists, str, int, float, bool, None)"
    )


def _container_data(value: DictConfig | ListConfig, where: str) -> Any:
    try:
        return OmegaConf.to_container(value, resolve=False, throw_on_missing=False)
    except Exception as err:  # noqa: BLE001 - a malformed config object
        raise HyperparameterError(
            f"{where}: a {type(value).__name__} that cannot be read as data: "
            f"{type(err).__name__}: {err}"
        ) from err


def boltz2_defaults() -> dict[str, Any]:
    """``Boltz2.__init__``'s default arguments (needs the ``boltz`` extra).

    Returns
    -------
    dict[str, Any]
        Argument name -> default, for the arguments that have one.
    """
    from boltz.model.models.boltz2 import Boltz2

    params = inspect.signature(Boltz2.__init__).parameters.values()
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


def boltz2_config_from_hparams(
    hparams: Mapping[str, Any],
    prediction: Boltz2Config | None = None,
    *,
    source: str = "hyper_parameters",
) -> Boltz2Config:
    """The :class:`Boltz2Config` of a ``Boltz2`` checkpoint, with ``prediction``'s settings.

    Which fields come from where is in the module's description.

    Parameters
    ----------
    hparams : Mapping[str, Any]
        The checkpoint's ``hyper_parameters`` (``Boltz2.__init__``'s arguments).
    prediction : Boltz2Config, optional
        Where :data:`PREDICTION_FIELDS`, ``recycling_steps`` and the
        :data:`PREDICTION_KEYS` come from; ``Boltz2Config()`` by default, whose
        diffusion parameters are those ``boltz predict`` uses for Boltz-2.
    source : str
        The checkpoint entry's name in messages (``<file>: hyper_parameters``).

    Returns
    -------
    Boltz2Config
        The checkpoint's architecture with ``prediction``'s settings. An entry that is
        ``None`` keeps ``Boltz2Config``'s default, as
        :meth:`~physicsnemo_foldcp.models.boltz2.Boltz2Model.from_boltz2` does. Needs the
        ``boltz`` extra (the field list is ``Boltz2Model``'s).

    Raises
    ------
    HyperparameterError
        When ``hparams`` is not a mapping, an entry used is not plain data (naming it), or
        the values do not make a valid ``Boltz2Config``.
    """
    from physicsnemo_foldcp.models.boltz2 import BOLTZ2_HPARAMS

    if not isinstance(hparams, Mapping):
        raise HyperparameterError(f"{source} is a {type(hparams).__name__}, not a mapping")
    prediction = prediction if prediction is not None else Boltz2Config()
    wanted = [name for name in BOLTZ2_HPARAMS if name not in PREDICTION_FIELDS]
    missing = [name for name in wanted if name not in hparams]
    defaults = boltz2_defaults() if missing else {}
    architecture: dict[str, Any] = {}
    for name in wanted:
        if name not in hparams and name not in defaults:
            raise HyperparameterError(
                f"{source} lacks {name!r}, which Boltz2.__init__ needs (it has no default)"
            )
        value = hparams[name] if name in hparams else defaults[name]
        value = plain_value(value, f"{source}.{name}")
        if value is None:
            continue  # Boltz2Config's own default (an absent optional module's arguments)
        if name in PREDICTION_KEYS:
            value = _run_settings(value, getattr(prediction, name), name, source)
        architecture[name] = value
    try:
        return dataclasses.replace(prediction, **architecture)
    except (TypeError, ValueError) as err:
        raise HyperparameterError(f"{source}: not a valid Boltz2Config: {err}") from err


def _run_settings(
    saved: Any, configured: Mapping[str, Any], name: str, source: str
) -> dict[str, Any]:
    """``saved`` without its run-time keys, with those of ``configured``."""
    if not isinstance(saved, dict):
        raise HyperparameterError(f"{source}.{name} is a {type(saved).__name__}, not a mapping")
    keys = PREDICTION_KEYS[name]
    out = {k: v for k, v in saved.items() if k not in keys}
    out.update({k: configured[k] for k in keys if k in configured})
    return out


__all__ = [
    "MAX_DEPTH",
    "PREDICTION_FIELDS",
    "PREDICTION_KEYS",
    "HyperparameterError",
    "boltz2_config_from_hparams",
    "boltz2_defaults",
    "plain_value",
]
