"""Feature axis semantics, the registry, and the Boltz presets."""

from physicsnemo_foldcp.features.registry import FeatureRegistry, UnknownFeatureError
from physicsnemo_foldcp.features.spec import (
    ATOMS,
    AXES,
    ENSEMBLE,
    MSA,
    PASSTHROUGH,
    REPLICATE,
    RSET,
    SHARD,
    TEMPLATES,
    TOKENS,
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
    "FeatureRegistry",
    "FeatureSpec",
    "UnknownFeatureError",
]
