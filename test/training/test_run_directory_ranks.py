"""A run or prediction directory held by another run, or holding a user's file, stops every
rank at once."""

import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from physicsnemo_foldcp.models import ModelConfig, ReferenceFoldModel
from physicsnemo_foldcp.testing import collective_assert
from physicsnemo_foldcp.training import SyntheticComplexes, TrainSettings, predict, train
from physicsnemo_foldcp.training.runlock import LOCK_NAME

pytestmark = pytest.mark.multigpu_static

CONFIG = ModelConfig(c_atom=8, c_token=16, c_pair=8, n_blocks=1, n_heads=2)
SECONDS = 20
"""A refusal reaches every rank well within this (the mesh timeout is minutes)."""

HOLDER = """
import sys, time
from physicsnemo_foldcp.training.runlock import RunLock
lock = RunLock(sys.argv[1])
print("held", flush=True)
time.sleep(120)
"""


def attempt(mesh, run_dir):
    """(message or None, seconds) of starting a one-step run in ``run_dir``."""
    torch.manual_seed(5)
    settings = TrainSettings(
        steps=1,
        progress=False,
        log_every=0,
        checkpoint_dir=str(run_dir / "checkpoints"),
        metrics_file=str(run_dir / "metrics.jsonl"),
        summary_file=str(run_dir / "summary.json"),
    )
    start = time.monotonic()
    try:
        train(ReferenceFoldModel(CONFIG), mesh, SyntheticComplexes(2, 9, 11, seed=1), settings)
        message = None
    except Exception as err:  # noqa: BLE001 - the test reads the message of any error
        message = f"{type(err).__name__}: {err}"
    return message, time.monotonic() - start


def problems_of(message, seconds, names):
    if message is None:
        return ["the run started"]
    problems = [f"{n!r} not in {message!r}" for n in names if n not in message]
    if seconds > SECONDS:
        problems.append(f"refused after {seconds:.1f} s")
    return problems


@pytest.mark.parametrize("fold_mesh", [(1, 2, 2)], indirect=True, ids=str)
def test_a_held_run_directory_is_refused_on_every_rank(fold_mesh, shared_dir):
    lock = shared_dir / "checkpoints" / LOCK_NAME
    child = None
    if dist.get_rank() == 0:
        child = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(lock)], stdout=subprocess.PIPE, text=True
        )
        child.stdout.readline()
    dist.barrier()
    try:
        message, seconds = attempt(fold_mesh, shared_dir)
    finally:
        if child is not None:
            child.kill()
            child.wait()
    names = ["RunLockedError", str(shared_dir / "checkpoints"), str(lock), "is in use"]
    problems = problems_of(message, seconds, names)
    collective_assert(not problems, "; ".join(problems))


@pytest.mark.parametrize("fold_mesh", [(1, 2, 2)], indirect=True, ids=str)
def test_a_users_summary_is_refused_on_every_rank_and_kept(fold_mesh, shared_dir):
    summary = shared_dir / "summary.json"
    if dist.get_rank() == 0:
        summary.write_text("mine\n")
    dist.barrier()
    message, seconds = attempt(fold_mesh, shared_dir)
    problems = problems_of(message, seconds, ["RunDirectoryError", f"={summary} is a file"])
    if summary.read_text() != "mine\n":
        problems.append("the user's summary was changed")
    collective_assert(not problems, "; ".join(problems))


@pytest.mark.parametrize("fold_mesh", [(1, 2, 2)], indirect=True, ids=str)
def test_a_users_file_in_the_prediction_dir_is_refused_on_every_rank(fold_mesh, shared_dir):
    mine = shared_dir / "b.npz"
    if dist.get_rank() == 0:
        mine.write_bytes(b"mine")
    dist.barrier()

    class Named(SyntheticComplexes):
        def record_id(self, index):
            return ["a", "b"][index]

    torch.manual_seed(5)
    start = time.monotonic()
    try:
        predict(ReferenceFoldModel(CONFIG), fold_mesh, Named(2, 9, 11, seed=1), shared_dir)
        message = None
    except Exception as err:  # noqa: BLE001 - the test reads the message of any error
        message = f"{type(err).__name__}: {err}"
    names = ["OutputExistsError", f"predict out_dir {shared_dir}", "(b.npz)"]
    problems = problems_of(message, time.monotonic() - start, names)
    if sorted(p.name for p in shared_dir.iterdir()) != ["b.npz"] or mine.read_bytes() != b"mine":
        problems.append("the refused prediction changed the directory")
    collective_assert(not problems, "; ".join(problems))
