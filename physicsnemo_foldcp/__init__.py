"""Context parallelism for AlphaFold3-style structure models on PhysicsNeMo ShardTensor.

One complex's token, atom, MSA and pair features are sharded over a 2-D ``(cp0, cp1)``
mesh of ranks; the serial featurizer and model stay as they are. Importing the package
checks the installed PhysicsNeMo and torch against the tested range
(:mod:`physicsnemo_foldcp.versions`) before anything else, then registers the handlers of
the plugin's own ops (:mod:`physicsnemo_foldcp.ops`); ShardTensors the plugin did not make
keep PhysicsNeMo's dispatch unchanged.
"""

from physicsnemo_foldcp import versions

versions.check()

from physicsnemo_foldcp import ops
from physicsnemo_foldcp.core.grad_buckets import attach_gradient_buckets
from physicsnemo_foldcp.data import ShardedLoader, ShardedSample
from physicsnemo_foldcp.distributed import FoldMesh, init_mesh, shutdown, wrap_model
from physicsnemo_foldcp.features import FeatureRegistry, FeatureSpec
from physicsnemo_foldcp.kernels.budget import (
    recompute_in_backward,
    set_kernel_recompute,
    set_work_budget,
    work_budget,
)
from physicsnemo_foldcp.sharding.options import BalanceOptions, ShardingOptions
from physicsnemo_foldcp.sharding.scatter import ShardedFeatures, gather_features, scatter_features

__version__ = "0.1.0"

__all__ = [
    "BalanceOptions",
    "ShardingOptions",
    "FeatureRegistry",
    "FoldCPDataModule",
    "ShardedLoader",
    "ShardedSample",
    "ops",
    "FeatureSpec",
    "FoldMesh",
    "ShardedFeatures",
    "__version__",
    "attach_gradient_buckets",
    "gather_features",
    "init_mesh",
    "recompute_in_backward",
    "scatter_features",
    "set_kernel_recompute",
    "set_work_budget",
    "shutdown",
    "work_budget",
    "wrap_model",
]


def __getattr__(name: str):
    # FoldCPDataModule subclasses Lightning's data module when Lightning is installed: it
    # is imported on first use, so that importing the package does not import Lightning.
    if name == "FoldCPDataModule":
        from physicsnemo_foldcp.data.datamodule import FoldCPDataModule

        return FoldCPDataModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
