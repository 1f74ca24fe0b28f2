"""Run 14 generic ops on ShardTensors made by PhysicsNeMo's ``scatter_tensor``; write results.

    torchrun --standalone --nproc-per-node 4 test/ops/equivalence_probe.py plain OUT.json
    torchrun --standalone --nproc-per-node 4 test/ops/equivalence_probe.py plugin OUT.json

``plugin`` imports ``physicsnemo_foldcp`` first; ``plain`` never does. Both build the same
2x2 gloo mesh through ``DistributedManager`` and call PhysicsNeMo's ``register_custom_ops``
(as it does itself when CUDA is available). Rank 0 writes, per op and per layout (even and
uneven shards), the result of ``full_tensor()`` (or the error) and the collectives counted
by ``CommDebugMode``, so
``test_import_equivalence.py`` can check that importing the plugin changes nothing for
ShardTensors it did not make.
"""

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

if sys.argv[1] == "plugin":
    import physicsnemo_foldcp  # noqa: F401

from physicsnemo.distributed import DistributedManager
from physicsnemo.domain_parallel import ShardTensor, register_custom_ops, scatter_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.placement_types import Replicate, Shard


def ops(single, tile, linear, n):
    index = torch.tensor([0, 2, n - 1])
    return {
        "linear": lambda: linear(single),
        "matmul": lambda: single @ single.mT,
        "einsum": lambda: torch.einsum("bic,bjc->bij", single, single),
        "bmm": lambda: torch.bmm(single, single.transpose(1, 2)),
        "slicing": lambda: single[..., :3],
        "indexing": lambda: single[:, index],
        "sum": lambda: single.sum(-1),
        "mean": lambda: tile.mean(),
        "softmax": lambda: single.softmax(1),
        "layer_norm": lambda: F.layer_norm(single, (6,)),
        "cat": lambda: torch.cat([single, 2 * single], dim=-1),
        "reshape": lambda: single.reshape(1, n, 2, 3),
        "casts": lambda: single.double(),
        "cdist": lambda: torch.cdist(single, single),
    }


def record(fn):
    with CommDebugMode() as mode:
        try:
            out = fn()
            value = out.full_tensor() if isinstance(out, ShardTensor) else out
            result = {"type": type(out).__name__, "value": value.tolist()}
        except Exception as error:  # noqa: BLE001 - the error itself is the result
            result = {"error": f"{type(error).__name__}: {error}"}
    result["collectives"] = {str(k): int(v) for k, v in mode.get_comm_counts().items()}
    return result


def start_manager():
    """``DistributedManager.initialize()`` on CPU: drop the CPU ``device_id`` torch refuses."""
    original = dist.init_process_group

    def init_process_group(*args, **kwargs):
        if kwargs.get("device_id") is not None and torch.device(kwargs["device_id"]).type == "cpu":
            del kwargs["device_id"]
        return original(*args, **kwargs)

    dist.init_process_group = init_process_group
    try:
        DistributedManager.initialize()
    finally:
        dist.init_process_group = original


def main():
    mode, out_path = sys.argv[1], sys.argv[2]
    start_manager()
    register_custom_ops()
    mesh = DistributedManager().initialize_mesh((2, 2), ("cp0", "cp1"))
    results = {"mode": mode}
    for label, n in (("even", 8), ("uneven", 7)):
        torch.manual_seed(0)
        x, pair = torch.randn(1, n, 6), torch.randn(1, n, n, 4)
        linear = torch.nn.Linear(6, 5)
        single = scatter_tensor(x, 0, mesh, (Shard(1), Replicate()), global_shape=x.shape)
        tile = scatter_tensor(pair, 0, mesh, (Shard(1), Shard(2)), global_shape=pair.shape)
        for name, fn in ops(single, tile, linear, n).items():
            results[f"{label}/{name}"] = record(fn)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    DistributedManager.cleanup()


if __name__ == "__main__":
    main()
