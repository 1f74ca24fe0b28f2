"""Feature axis semantics, the registry, and the Boltz presets."""

from physicsnemo_foldcp.features.axes import (
    ATOMS,
    AXES,
    ENSEMBLE,
    MSA,
    RSET,
    TEMPLATES,
    TOKENS,
    Axis,
    axis_of,
    register_axis,
    unregister_axis,
)
from physicsnemo_foldcp.features.registry import FeatureRegistry, UnknownFeatureError
from physicsnemo_foldcp.features.spec import (
    PASSTHROUGH,
    REPLICATE,
    SHARD,
    FeatureSpec,
)

__all__ = [
    "ATOMS",
    "AXES",
    "ENSEMBLE",
    "MSA",
    "PASSTHROUGH",
    "REPLICATE",
    "RSET",
    "SHARD",
    "TEMPLATES",
    "TOKENS",
    "Axis",
    "FeatureRegistry",
    "FeatureSpec",
    "UnknownFeatureError",
    "axis_of",
    "register_axis",
    "unregister_axis",
]
