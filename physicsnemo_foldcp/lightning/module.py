"""``FoldModule``: a fold model, its loss and its optimizer as a LightningModule.

The model is any model the training loop takes (:mod:`~physicsnemo_foldcp.training.hooks`):
``model(**features)`` returns a dict of outputs, its ``loss`` (or a given loss function)
turns them into a scalar, and its class may declare ``fsdp_units``, which
:class:`~physicsnemo_foldcp.lightning.FoldCPStrategy` reads from here. One step is the
loop's step (:func:`~physicsnemo_foldcp.training.forward_backward`): forward on one
scattered sample, the loss, backward, the optimizer of
:func:`~physicsnemo_foldcp.training.build_optimizer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn

from physicsnemo_foldcp.data.loader import ShardedSample
from physicsnemo_foldcp.training.hooks import LossFn, model_loss, module_types
from physicsnemo_foldcp.training.loop import OptimizerSettings, build_optimizer, check_batch
from physicsnemo_foldcp.training.predict import predict_item


@dataclass
class Prediction:
    """What :meth:`FoldModule.predict_step` returns for one sample.

    Attributes
    ----------
    item : ShardedSample
        The loader item (dataset index, record id, features).
    distogram : torch.Tensor
        ``[N, N, bins]`` in the serial token layout, on every rank of the domain.
    """

    item: ShardedSample
    distogram: torch.Tensor


class FoldModule(pl.LightningModule):
    """A fold model trained and run by Lightning on scattered samples.

    Parameters
    ----------
    model : nn.Module
        The serial model (e.g. :class:`~physicsnemo_foldcp.models.ReferenceFoldModel`),
        initialised the same way on every rank.
    optimizer : OptimizerSettings, optional
        The optimizer; AdamW with the loop's defaults otherwise.
    loss : str or callable, optional
        ``loss(outputs, features)`` or its path; the model's ``loss`` method otherwise.
    fsdp_units : Sequence[str or type], optional
        Submodule types FSDP2 shards one by one; the model class's ``fsdp_units`` otherwise.
    output_key : str, default "pdistogram"
        Output predicted by :meth:`predict_step`.

    Attributes
    ----------
    model : nn.Module
        The model (state dict keys ``model.<name>``).
    fsdp_units : tuple[type, ...]
        Read by :class:`~physicsnemo_foldcp.lightning.FoldCPStrategy`.

    Notes
    -----
    Each training step logs ``loss``: the domain group's loss, averaged over ``ddp`` (the
    value the training loop reports).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        optimizer: OptimizerSettings | None = None,
        loss: str | LossFn | None = None,
        fsdp_units: Any = None,
        output_key: str = "pdistogram",
    ) -> None:
        super().__init__()
        self.model = model
        self.optimizer_settings = optimizer or OptimizerSettings()
        self.loss_fn = model_loss(model, loss)
        self.fsdp_units = module_types(model, "fsdp_units", fsdp_units)
        self.output_key = output_key

    def forward(self, **features: Any) -> Any:
        """The model's outputs for one sample's features."""
        return self.model(**features)

    def training_step(self, batch: ShardedSample, batch_idx: int) -> torch.Tensor:
        """Forward and loss of one scattered sample; logs ``loss``.

        Returns
        -------
        torch.Tensor
            The scalar loss (a replicated ShardTensor on a domain mesh).
        """
        features = batch.features
        check_batch(features)
        loss = self.loss_fn(self.model(**features), features)
        self.log("loss", loss, on_step=True, prog_bar=True, sync_dist=True, batch_size=1)
        return loss

    def predict_step(self, batch: ShardedSample, batch_idx: int) -> Prediction | None:
        """The serial-layout distogram of one sample (``None`` for padding or a skip)."""
        distogram = predict_item(self.model, batch, output_key=self.output_key)
        if distogram is None:
            return None
        return Prediction(batch, distogram)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """The loop's optimizer over the model (built after the strategy wrapped it)."""
        return build_optimizer(self.model, self.optimizer_settings)


__all__ = ["FoldModule", "Prediction"]
