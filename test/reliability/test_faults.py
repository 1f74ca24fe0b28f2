"""Fault injection inside a job: a failure on one rank ends in an error, never a hang."""

import time

import pytest
import torch.distributed as dist

import physicsnemo_foldcp as fc
from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.sharding import scatter as scatter_module
from physicsnemo_foldcp.testing import collective_assert

pytestmark = pytest.mark.multigpu_static

FAULT_TIMEOUT_S = 8.0


class InjectedFault(RuntimeError):
    pass


@pytest.mark.parametrize("fold_mesh", [(1, 2, 2), (1, 2, 3), (1, 3, 3)], indirect=True, ids=str)
def test_non_source_rank_failing_during_the_scatter(fold_mesh, monkeypatch):
    """Domain rank 1 fails after the metadata arrives; its source times out within the bound.

    Every other rank still gets its blocks, and the source's error names the rank its
    send did not reach.
    """
    ddp, cp0, cp1 = fold_mesh.shape
    # The same shape with a short timeout: separate groups, so the job's stay healthy.
    mesh = fc.init_mesh(ddp=ddp, cp=(cp0, cp1), timeout_s=FAULT_TIMEOUT_S)
    x = make_complex(40, seed=1, msa_rows=4) if mesh.is_domain_source else None
    if mesh.domain_rank == 1:

        def fail(*args, **kwargs):
            raise InjectedFault("rank 1 cannot allocate its receive buffer")

        monkeypatch.setattr(scatter_module, "packed_size", fail)
    start = time.monotonic()
    outcome = "ok"
    try:
        fc.scatter_features(x, mesh)
    except InjectedFault:
        outcome = "injected"
    except RuntimeError as err:  # the source's send to rank 1 times out
        outcome = f"error: {err}"
    elapsed = time.monotonic() - start
    not_reached = f"global rank(s) {mesh.domain_global_rank(*divmod(1, cp1))} did not complete"
    ok = {
        1: outcome == "injected",
        0: outcome.startswith("error") and not_reached in outcome,
    }.get(mesh.domain_rank, outcome == "ok")
    ok = ok and elapsed < FAULT_TIMEOUT_S + 20
    message = f"domain rank {mesh.domain_rank}: {outcome[:300]} after {elapsed:.1f} s"
    collective_assert(ok, message)
    # The job's other groups are unaffected: the world still agrees.
    dist.barrier()
