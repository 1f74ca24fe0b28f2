"""Serial Boltz-2 models for tests: Boltz's own ``Boltz2`` built from a :class:`Boltz2Config`.

The ground truth of every Boltz-2 prediction test is ``boltz.model.models.boltz2.Boltz2``
itself, built with the same hyperparameters as the project's
:class:`~physicsnemo_foldcp.models.boltz2.Boltz2Model` and random weights; the project's
model then loads its state dict (``strict=True``). Needs the ``boltz`` extra.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from boltz.model.models.boltz2 import Boltz2
from torch import nn

from physicsnemo_foldcp.models.boltz2 import BOLTZ2_HPARAMS, Boltz2Model
from physicsnemo_foldcp.models.boltz2_config import Boltz2Config


def boltz2_kwargs(config: Boltz2Config) -> dict[str, Any]:
    """``Boltz2.__init__`` keyword arguments equal to ``config`` (no validators, no EMA).

    Parameters
    ----------
    config : Boltz2Config
        The hyperparameters.

    Returns
    -------
    dict[str, Any]
        Every field of ``config`` that ``Boltz2`` takes, ``atom_feature_dim`` resolved,
        and empty ``training_args`` / ``validation_args`` / ``diffusion_loss_args``.
    """
    kwargs = {name: getattr(config, name) for name in BOLTZ2_HPARAMS}
    if kwargs["atom_feature_dim"] is None:
        kwargs["atom_feature_dim"] = Boltz2Model(config).atom_feature_dim
    return {
        **kwargs,
        "training_args": {},
        "validation_args": {},
        "diffusion_loss_args": {},
        "validate_structure": False,
        "ema": False,
    }


def serial_boltz2(config: Boltz2Config | None = None, seed: int = 0) -> nn.Module:
    """Boltz's ``Boltz2`` with ``config``'s hyperparameters and seeded random weights.

    Parameters
    ----------
    config : Boltz2Config, optional
        The hyperparameters (the small defaults if None).
    seed : int
        Seed of the weight initialisation.

    Returns
    -------
    nn.Module
        A ``boltz.model.models.boltz2.Boltz2`` in eval mode.
    """
    config = config or Boltz2Config()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Boltz2(**boltz2_kwargs(config))
    return model.eval()


def model_pair(config: Boltz2Config | None = None, seed: int = 0) -> tuple[nn.Module, Boltz2Model]:
    """Boltz's ``Boltz2`` and a :class:`Boltz2Model` holding the same weights.

    Parameters
    ----------
    config : Boltz2Config, optional
        The hyperparameters (the small defaults if None).
    seed : int
        Seed of the weight initialisation.

    Returns
    -------
    tuple[nn.Module, Boltz2Model]
        ``(boltz2, ours)``, both in eval mode.
    """
    boltz2 = serial_boltz2(config, seed)
    return boltz2, Boltz2Model.from_boltz2(boltz2).eval()


def save_lightning_checkpoint(model: nn.Module, path: Path) -> None:
    """``model`` (a ``Boltz2``) as Lightning writes it: ``Trainer.save_checkpoint`` on the CPU.

    Offline: no logger, no callbacks; needs ``pytorch_lightning`` (the ``boltz`` extra).
    """
    import pytorch_lightning as pl

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(Path(path).parent),
    )
    trainer.strategy.connect(model)
    trainer.save_checkpoint(str(path))


__all__ = ["boltz2_kwargs", "model_pair", "save_lightning_checkpoint", "serial_boltz2"]
