"""The sharding subsystem: how one sample's features are laid out on the ``cp0 x cp1`` mesh.

One concern per module:

* :mod:`~physicsnemo_foldcp.sharding.options`: :class:`ShardingOptions`, every option of
  the sharding with its one default.
* :mod:`~physicsnemo_foldcp.sharding.plan`: :class:`ShardingPlan`, the owner of every
  geometric question (row/column blocks, real and pad runs, local shapes, sharding shapes).
* :mod:`~physicsnemo_foldcp.sharding.balance`: balanced row-block boundaries.
* :mod:`~physicsnemo_foldcp.sharding.validation`: checking a serial sample against the
  registry.
* :mod:`~physicsnemo_foldcp.sharding.maps`: dense and index layouts of the one-hot maps.
* :mod:`~physicsnemo_foldcp.sharding.prepare`: the source rank's step (validate, plan).
* :mod:`~physicsnemo_foldcp.sharding.wire`: what one rank's buffer holds, written and read;
  :mod:`~physicsnemo_foldcp.sharding.packing`: the byte buffers themselves.
* :mod:`~physicsnemo_foldcp.sharding.scatter`: the transfer protocol, and the way back.
* :mod:`~physicsnemo_foldcp.sharding.report`, :mod:`~physicsnemo_foldcp.sharding.plan_report`:
  what each rank holds, after and before a scatter.
"""

from physicsnemo_foldcp.sharding.options import BalanceOptions, ShardingOptions
from physicsnemo_foldcp.sharding.plan import ShardingPlan, build_plan, column_block_sizes
from physicsnemo_foldcp.sharding.scatter import (
    RegistryMismatchError,
    ShardedFeatures,
    gather_features,
    scatter_features,
)
from physicsnemo_foldcp.sharding.validation import FeatureValidationError

__all__ = [
    "BalanceOptions",
    "FeatureValidationError",
    "RegistryMismatchError",
    "ShardedFeatures",
    "ShardingOptions",
    "ShardingPlan",
    "build_plan",
    "column_block_sizes",
    "gather_features",
    "scatter_features",
]
