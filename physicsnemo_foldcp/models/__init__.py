"""Reference model: serial PyTorch code that runs unchanged on scattered ShardTensors."""

from physicsnemo_foldcp.models.reference import (
    ModelConfig,
    ReferenceFoldModel,
    distogram_loss,
    reference_loss,
)

__all__ = ["ModelConfig", "ReferenceFoldModel", "distogram_loss", "reference_loss"]
