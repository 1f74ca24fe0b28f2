"""A checkpoint refused on one rank is refused on every rank, at once (4 ranks, FSDP2)."""

import os
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from physicsnemo_foldcp.distributed.wrappers import wrap_model
from physicsnemo_foldcp.testing import collective_assert
from physicsnemo_foldcp.training.checkpoint import (
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
)

pytestmark = pytest.mark.multigpu_static

SECONDS = 20
"""A refusal reaches every rank well within this (the mesh timeout is minutes)."""


def sharded(mesh, seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 8), nn.Linear(8, 4)).to(mesh.device)
    return wrap_model(model, mesh, "fsdp2")


def local_parameters(model):
    return {name: p.to_local().detach().clone() for name, p in model.named_parameters()}


def outcome(path, model):
    """(message or None, seconds, parameters unchanged) of loading ``path`` into ``model``."""
    before = local_parameters(model)
    start = time.monotonic()
    try:
        load_checkpoint(path, model, restore_rng=False)
        message = None
    except CheckpointError as err:
        message = str(err)
    seconds = time.monotonic() - start
    after = local_parameters(model)
    return message, seconds, all(torch.equal(after[k], before[k]) for k in before)


def problems_of(result, names):
    message, seconds, unchanged = result
    if message is None:
        return ["loaded without a CheckpointError"]
    problems = [f"{n!r} not in {message!r}" for n in names if n not in message]
    if seconds > SECONDS:
        problems.append(f"refused after {seconds:.1f} s")
    if not unchanged:
        problems.append("parameters written before the refusal")
    return problems


@pytest.mark.parametrize("fold_mesh", [(4, 1, 1)], indirect=True, ids=str)
def test_a_refusal_found_on_one_rank_is_raised_on_every_rank_within_seconds(fold_mesh, shared_dir):
    """A NaN in the rows only rank 3 holds is found by rank 3 alone: every rank refuses,
    naming rank 3's shard; a shard replaced by a FIFO is refused, not opened, by every rank."""
    mesh = fold_mesh
    model = sharded(mesh, 0)
    if mesh.rank == 3:
        with torch.no_grad():
            model[0].weight.to_local()[-1, 0] = float("nan")
    optimizer = torch.optim.AdamW(model.parameters())
    path = save_checkpoint(shared_dir, 1, model, optimizer, mesh)
    target = sharded(mesh, 1)
    names = [str(path / "__3_0.distcp"), "model.0.weight", "allow_nonfinite"]
    problems = problems_of(outcome(path, target), names)
    collective_assert(not problems, "; ".join(problems))

    fifo = path / "__2_0.distcp"
    if mesh.rank == 0:
        fifo.unlink()
        os.mkfifo(fifo)
    dist.barrier()
    problems = problems_of(outcome(path, target), [str(fifo), "FIFO"])
    collective_assert(not problems, "; ".join(problems))
