"""Distributed bootstrap, the ``ddp x cp0 x cp1`` mesh and bounded collectives."""

from physicsnemo_foldcp.distributed.bootstrap import (
    DEFAULT_TIMEOUT_S,
    init_mesh,
    resolve_mesh_shape,
    shutdown,
)
from physicsnemo_foldcp.distributed.mesh import MESH_DIM_NAMES, FoldMesh
from physicsnemo_foldcp.distributed.wrappers import param_groups, unwrap, wrap_model

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "MESH_DIM_NAMES",
    "FoldMesh",
    "init_mesh",
    "param_groups",
    "resolve_mesh_shape",
    "shutdown",
    "unwrap",
    "wrap_model",
]
