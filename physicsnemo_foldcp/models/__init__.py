"""Reference model: serial PyTorch code that runs unchanged on scattered ShardTensors.

``Boltz2Trunk`` (Boltz-2's trunk from Boltz's own modules) and ``Boltz2Model`` (the
whole Boltz-2 for prediction) are resolved lazily: they need the optional ``boltz``
package, which ``import physicsnemo_foldcp`` does not import.
"""

from typing import Any

from physicsnemo_foldcp.models.boltz2_config import Boltz2Config, Boltz2TrunkConfig
from physicsnemo_foldcp.models.reference import (
    ModelConfig,
    ReferenceFoldModel,
    distogram_loss,
    reference_loss,
)

_LAZY = {
    "Boltz2Trunk": "physicsnemo_foldcp.models.boltz2_trunk",
    "Boltz2Model": "physicsnemo_foldcp.models.boltz2",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Boltz2Config",
    "Boltz2Model",
    "Boltz2Trunk",
    "Boltz2TrunkConfig",
    "ModelConfig",
    "ReferenceFoldModel",
    "distogram_loss",
    "reference_loss",
]
