"""A rank that never joins a collective: its peers raise within the mesh's timeout.

Each case builds a mesh with a short timeout of its own (a new mesh, so the job's groups
stay healthy), lets the domain's last rank skip one collective, and measures how long
the ranks that share the collective with it wait before they raise. The bound is
``TIMEOUT_S + MARGIN_S``; a wait shorter than the timeout would mean something other than
the timeout ended it, so the lower bound is checked too. Ranks that do not share the
collective with the missing rank finish it normally.
"""

import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

import physicsnemo_foldcp as fc
from physicsnemo_foldcp.distributed.mesh import FoldMesh
from physicsnemo_foldcp.ops import wrap
from physicsnemo_foldcp.testing import collective_assert

pytestmark = pytest.mark.multigpu_static

TIMEOUT_S = 4.0
"""Timeout of the meshes built here, in seconds."""
MARGIN_S = 10.0
"""Stated margin: a waiting rank raises at most this long after ``TIMEOUT_S``."""


def _domain_all_reduce(mesh: FoldMesh) -> None:
    dist.all_reduce(torch.ones(3), group=mesh.domain_group)


def _cp1_all_reduce(mesh: FoldMesh) -> None:
    dist.all_reduce(torch.ones(3), group=mesh.domain_mesh.get_group(1))


def _rows(mesh: FoldMesh) -> torch.Tensor:
    """A row-sharded single ``[1, N, 2]`` with uneven cp0 blocks."""
    sizes = [3 + r for r in range(mesh.cp[0])]
    local = torch.ones(1, sizes[mesh.domain_coordinate[0]], 2)
    return wrap(local, mesh.domain_mesh, (Shard(1), Replicate()), {0: [(1, n, 2) for n in sizes]})


def _rows_full_tensor(mesh: FoldMesh) -> None:
    """ShardTensor's own all-gather over ``cp0``."""
    _rows(mesh).full_tensor()


def _rows_sum(mesh: FoldMesh) -> None:
    """The plugin's sum over the token rows: an all-reduce over ``cp0``."""
    float(_rows(mesh).sum())


# name -> (collective, the domain ranks (cp0, cp1) that share it with the missing rank)
CASES: dict[str, tuple[Callable[[FoldMesh], None], Callable[[tuple, tuple], bool]]] = {
    "domain group all_reduce": (_domain_all_reduce, lambda me, missing: True),
    "cp1 group all_reduce": (_cp1_all_reduce, lambda me, missing: me[0] == missing[0]),
    "ShardTensor full_tensor over cp0": (
        _rows_full_tensor,
        lambda me, missing: me[1] == missing[1],
    ),
    "plugin sum over the rows": (_rows_sum, lambda me, missing: me[1] == missing[1]),
}


@pytest.mark.parametrize("case", list(CASES), ids=lambda c: c.replace(" ", "-"))
@pytest.mark.parametrize("fold_mesh", [(1, 2, 2), (1, 2, 3), (1, 3, 3)], indirect=True, ids=str)
def test_a_rank_missing_a_collective_makes_its_peers_raise_in_time(fold_mesh, case):
    collective, shares = CASES[case]
    ddp, cp0, cp1 = fold_mesh.shape
    # A timeout no other test uses: a new mesh with its own groups (init_mesh caches by it).
    timeout = TIMEOUT_S + list(CASES).index(case) / 1000
    mesh = fc.init_mesh(ddp=ddp, cp=(cp0, cp1), timeout_s=timeout)
    missing = (cp0 - 1, cp1 - 1)
    me = mesh.domain_coordinate
    if me == missing:
        collective_assert(True)
        return
    started = time.monotonic()
    outcome = "finished"
    try:
        collective(mesh)
    except RuntimeError as err:
        outcome = f"raised {type(err).__name__}"
    elapsed = time.monotonic() - started
    if shares(me, missing):
        ok = outcome.startswith("raised") and timeout - 0.5 <= elapsed <= timeout + MARGIN_S
        expected = f"raise after {timeout:.1f}..{timeout + MARGIN_S:.1f} s"
    else:
        ok = outcome == "finished" and elapsed < timeout
        expected = "finish before the timeout"
    collective_assert(
        ok, f"{case}: rank at {me} {outcome} after {elapsed:.1f} s, expected to {expected}"
    )
