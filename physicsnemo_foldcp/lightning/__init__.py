"""Lightning on the ``ddp x cp0 x cp1`` mesh (needs ``pytorch_lightning``: the ``boltz`` extra).

* :class:`FoldCPStrategy` (:mod:`~physicsnemo_foldcp.lightning.strategy`): mesh, wrapping,
  metric reduction and checkpoints for Lightning's ``Trainer``.
* :class:`FoldModule` (:mod:`~physicsnemo_foldcp.lightning.module`): a fold model, its loss
  and optimizer as a LightningModule.
* :class:`StepMetrics`, :class:`DistogramWriter`
  (:mod:`~physicsnemo_foldcp.lightning.callbacks`): the training loop's metrics file and
  prediction files.

With :class:`~physicsnemo_foldcp.data.FoldCPDataModule` as the data module, a Lightning
run gives the losses and parameters of :func:`~physicsnemo_foldcp.training.train`.
"""

try:
    import pytorch_lightning  # noqa: F401
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        "physicsnemo_foldcp.lightning needs PyTorch Lightning: pip install -e '.[boltz]' "
        f"(or pip install pytorch-lightning); importing it failed: {err}"
    ) from err

from physicsnemo_foldcp.lightning.callbacks import DistogramWriter, StepMetrics
from physicsnemo_foldcp.lightning.module import FoldModule, Prediction
from physicsnemo_foldcp.lightning.strategy import FoldCPStrategy

__all__ = ["DistogramWriter", "FoldCPStrategy", "FoldModule", "Prediction", "StepMetrics"]
