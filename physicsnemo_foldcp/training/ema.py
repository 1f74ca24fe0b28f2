"""Exponential moving average of a model's weights, as Boltz keeps it while training.

Boltz-2 trains with ``ema=True``: its ``EMA`` callback (``boltz.model.optim.ema``) copies
the model's ``state_dict`` when training starts and, after every optimizer step ``k``
(``global_step``, counted from 1), moves each entry towards the weights,
``ema -= (ema - w) * (1 - d)`` with ``d = min(decay, (1 + k) / (10 + k))`` (the warm
start), integer entries left alone. :class:`WeightAverage` does the same on the entries
:func:`torch.distributed.checkpoint.state_dict.get_model_state_dict` gives, so under FSDP2
each rank averages its own shards and the checkpoint stores the average beside the model
(``ema.<fqn>``), resharded by DCP on another mesh like the model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from physicsnemo_foldcp.distributed.wrappers import unwrap


class WeightAverage:
    """The moving average of ``model``'s weights (every rank: its own entries and shards).

    Parameters
    ----------
    model : nn.Module
        The model as trained (unwrapped, DDP, or FSDP2-sharded: the average holds the same
        DTensor shards).
    decay : float, default 0.999
        Boltz's ``ema_decay``, in ``[0, 1]``.
    warm_start : bool, default True
        Boltz's warm start: the decay is at most ``(1 + k) / (10 + k)`` at step ``k``.

    Attributes
    ----------
    weights : dict[str, torch.Tensor]
        The average of every tensor entry, keyed as ``get_model_state_dict(model)``.
    step : int or None
        The optimizer step last averaged in (``None`` before the first).
    """

    def __init__(self, model: nn.Module, decay: float = 0.999, warm_start: bool = True) -> None:
        if not 0 <= decay <= 1:
            raise ValueError(f"EMA decay must be in [0, 1], got {decay}")
        self.decay = float(decay)
        self.warm_start = warm_start
        self.weights = {
            k: v.detach().clone() for k, v in _state(model).items() if isinstance(v, torch.Tensor)
        }
        self.step: int | None = None

    @torch.no_grad()
    def update(self, model: nn.Module, step: int) -> None:
        """Average in the weights after optimizer step ``step`` (counted from 1; once).

        Parameters
        ----------
        model : nn.Module
            The model the average was made from (same keys, shapes and placements).
        step : int
            Optimizer steps taken, as Lightning's ``global_step`` after the step.
        """
        if step == self.step:
            return
        self.step = step
        decay = self.decay
        if self.warm_start:
            decay = min(decay, (1 + step) / (10 + step))
        state = _state(model)
        for key, average in self.weights.items():
            weight = state[key]
            if average.dtype == torch.long or weight.dtype == torch.long:
                continue
            difference = average - weight
            difference.mul_(1.0 - decay)
            average.sub_(difference)

    def state_dict(self) -> dict[str, Any]:
        """``{"step": ..., "weights": {...}}`` (the tensors as held: shards under FSDP2)."""
        return {"step": self.step, "weights": self.weights}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Copy a :meth:`state_dict` in (same keys and shapes)."""
        missing = sorted(set(self.weights) ^ set(state["weights"]))
        if missing:
            raise KeyError(f"EMA state does not fit the model: {missing[:5]}")
        for key, value in state["weights"].items():
            self.weights[key].copy_(value)
        self.step = state["step"]


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's entries as the checkpoint keys them."""
    return get_model_state_dict(unwrap(model))


__all__ = ["WeightAverage"]
