"""The sharding subsystem: how one sample's features are laid out on the ``cp0 x cp1`` mesh.

* :mod:`~physicsnemo_foldcp.sharding.plan`: :class:`ShardingPlan`, the owner of every
  geometric question (row/column blocks, padding, local shapes).
* :mod:`~physicsnemo_foldcp.sharding.balance`: balanced row-block boundaries.
* :mod:`~physicsnemo_foldcp.sharding.layout`: validation of a serial sample and its blocks.
* :mod:`~physicsnemo_foldcp.sharding.packing`: the byte buffers the blocks travel in.
* :mod:`~physicsnemo_foldcp.sharding.scatter`: the transfer protocol, and the way back.
* :mod:`~physicsnemo_foldcp.sharding.report`, :mod:`~physicsnemo_foldcp.sharding.plan_report`:
  what each rank holds, before and after a scatter.
"""

from physicsnemo_foldcp.sharding.plan import FeatureValidationError, ShardingPlan, build_plan
from physicsnemo_foldcp.sharding.scatter import (
    RegistryMismatchError,
    ShardedFeatures,
    gather_features,
    scatter_features,
)

__all__ = [
    "FeatureValidationError",
    "RegistryMismatchError",
    "ShardedFeatures",
    "ShardingPlan",
    "build_plan",
    "gather_features",
    "scatter_features",
]
