"""A run directory holds one run at a time, and a run touches only files the project made.

One process: the lock is held by a child process where a second run is needed; every
refusal is checked for the file or directory it names and for leaving the files as they
were (compared byte for byte).
"""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

import physicsnemo_foldcp as fc
from physicsnemo_foldcp.models import ModelConfig, ReferenceFoldModel
from physicsnemo_foldcp.training import (
    OptimizerSettings,
    SyntheticComplexes,
    TrainSettings,
    build_optimizer,
    train,
)
from physicsnemo_foldcp.training.checkpoint import (
    CheckpointError,
    checkpoint_path,
    load_checkpoint,
    save_checkpoint,
    write_checkpoint,
)
from physicsnemo_foldcp.training.rundir import (
    MANIFEST_NAME,
    RunDirectoryError,
    plan_run,
    prepare_run,
    read_manifest,
)
from physicsnemo_foldcp.training.runlock import LOCK_NAME, RunLock, RunLockedError

CONFIG = ModelConfig(c_atom=8, c_token=16, c_pair=8, n_blocks=1, n_heads=2)

HOLDER = """
import sys, time
from physicsnemo_foldcp.training.runlock import RunLock
lock = RunLock(sys.argv[1])
print("held", flush=True)
time.sleep(60)
"""
"""A child process that takes a run directory's lock and keeps it until killed."""


@pytest.fixture(scope="module")
def mesh():
    mesh = fc.init_mesh()
    yield mesh
    fc.shutdown()


def settings(run_dir, **kw):
    values = dict(
        steps=1,
        seed=2,
        progress=False,
        log_every=0,
        checkpoint_every=1,
        checkpoint_dir=str(run_dir / "checkpoints"),
        metrics_file=str(run_dir / "metrics.jsonl"),
        summary_file=str(run_dir / "summary.json"),
    )
    return TrainSettings(**{**values, **kw})


def run(mesh, run_dir, **kw):
    torch.manual_seed(5)
    dataset = SyntheticComplexes(2, 9, 11, seed=1, msa_rows=2)
    return train(ReferenceFoldModel(CONFIG), mesh, dataset, settings(run_dir, **kw))


def contents(directory):
    return {
        str(p.relative_to(directory)): p.read_bytes() if p.is_file() else None
        for p in sorted(directory.rglob("*"))
    }


@pytest.fixture
def holder(tmp_path):
    """Start a child holding ``<run_dir>/checkpoints/run.lock``; yield (process, path)."""
    started = []

    def start(lock):
        child = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(lock)], stdout=subprocess.PIPE, text=True
        )
        assert child.stdout.readline().strip() == "held"
        started.append(child)
        return child

    yield start
    for child in started:
        child.kill()
        child.wait()


def test_a_second_run_in_a_held_directory_is_refused_then_takes_over_a_dead_holders_lock(
    mesh, tmp_path, holder, caplog
):
    lock = tmp_path / "checkpoints" / LOCK_NAME
    child = holder(lock)
    before = contents(tmp_path)
    start = time.monotonic()
    with pytest.raises(RunLockedError) as err:
        run(mesh, tmp_path)
    message = str(err.value)
    assert f"run directory {tmp_path / 'checkpoints'} is in use by another run" in message
    assert f"pid {child.pid} on host" in message and str(lock) in message
    assert time.monotonic() - start < 5
    assert contents(tmp_path) == before  # nothing written, no metrics, no manifest
    child.kill()
    child.wait()
    caplog.set_level("INFO", logger="physicsnemo_foldcp.training")
    result = run(mesh, tmp_path)
    assert result.end_step == 1
    assert f"taking over the lock left by pid {child.pid}" in caplog.text
    assert lock.read_text() == ""  # released: the record is cleared


def test_the_lock_is_exclusive_within_a_process_and_released_on_exit(tmp_path):
    with RunLock(tmp_path / LOCK_NAME) as first:
        assert first.held
        with pytest.raises(RunLockedError, match=f"pid {os.getpid()} on host"):
            RunLock(tmp_path / LOCK_NAME)
    with RunLock(tmp_path / LOCK_NAME) as again:
        assert again.held


def test_a_users_summary_and_metrics_files_are_refused_even_with_overwrite(mesh, tmp_path):
    summary = tmp_path / "summary.json"
    summary.write_text('{"my": "results"}\n')
    for overwrite in (False, True):
        with pytest.raises(RunDirectoryError) as err:
            run(mesh, tmp_path, overwrite=overwrite)
        assert f"train.summary_file={summary} is a file this project did not write" in str(
            err.value
        )
    assert summary.read_text() == '{"my": "results"}\n'
    assert not (tmp_path / "metrics.jsonl").exists()
    assert not (tmp_path / "checkpoints" / MANIFEST_NAME).exists()
    summary.unlink()
    notes = tmp_path / "metrics.jsonl"
    notes.write_text("my notes, not metrics\n")
    with pytest.raises(RunDirectoryError, match=rf"train.metrics_file={notes} is a file this"):
        run(mesh, tmp_path, overwrite=True)
    assert notes.read_text() == "my notes, not metrics\n"


def test_a_run_records_its_files_and_resumes_over_them(mesh, tmp_path):
    run(mesh, tmp_path)
    manifest = read_manifest(tmp_path / "checkpoints")
    assert manifest["files"] == {
        "metrics": str(tmp_path / "metrics.jsonl"),
        "summary": str(tmp_path / "summary.json"),
    }
    assert json.loads((tmp_path / "summary.json").read_text())["end_step"] == 1
    again = run(mesh, tmp_path, steps=2)
    assert again.start_step == 1 and again.end_step == 2
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    assert json.loads((tmp_path / "summary.json").read_text())["end_step"] == 2


def test_a_resumed_run_does_not_empty_a_metrics_file_that_is_not_its_own(mesh, tmp_path):
    run(mesh, tmp_path)
    other = tmp_path / "notes.txt"
    other.write_text("line one\nline two\n")
    with pytest.raises(RunDirectoryError, match=rf"train.metrics_file={other} is a file"):
        run(mesh, tmp_path, steps=2, metrics_file=str(other))
    assert other.read_text() == "line one\nline two\n"


def test_a_symlinked_metrics_file_is_refused(tmp_path):
    outside = tmp_path / "outside.jsonl"
    outside.write_text(json.dumps({"step": 1, "loss": 1.0, "seconds": 0.1}) + "\n")
    link = tmp_path / "run" / "metrics.jsonl"
    link.parent.mkdir()
    link.symlink_to(outside)
    with pytest.raises(RunDirectoryError, match=rf"train.metrics_file={link} is a symlink"):
        plan_run(None, str(link), "mine", None, True)


def test_overwrite_refuses_a_symlinked_step_directory_before_deleting_anything(mesh, tmp_path):
    outside = tmp_path / "elsewhere"
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    save_checkpoint(outside, 7, model, optimizer, mesh)
    ck = tmp_path / "checkpoints"
    save_checkpoint(ck, 1, model, optimizer, mesh)
    link = checkpoint_path(ck, 7)
    link.symlink_to(checkpoint_path(outside, 7), target_is_directory=True)
    before, before_outside = contents(ck), contents(outside)
    with pytest.raises(RunDirectoryError) as err:
        plan_run(str(ck), None, "mine", None, True)
    assert f"checkpoint directory {link} is a symlink" in str(err.value)
    assert "nothing was deleted" in str(err.value)
    assert contents(ck) == before and contents(outside) == before_outside


def test_each_save_has_its_own_temporary_name_and_leftovers_go_under_the_lock(mesh, tmp_path):
    ck = tmp_path / "checkpoints"
    other = ck / ".step_00000001.tmp"  # another job's save in progress (the old shared name)
    other.mkdir(parents=True)
    (other / "part").write_text("theirs")
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    save_checkpoint(ck, 1, model, optimizer, mesh)
    assert (other / "part").read_text() == "theirs"
    assert sorted(p.name for p in ck.iterdir()) == [".step_00000001.tmp", "step_00000001"]
    dead = ck / ".step_00000002.tmp.0123456789ab"
    dead.mkdir()
    keep = ck / ".step_notes"
    keep.mkdir()
    plan = plan_run(str(ck), None, "mine", "latest", False)
    prepare_run(plan, str(ck), None, "mine", {})
    names = sorted(p.name for p in ck.iterdir())
    assert names == [".step_notes", "run.json", "step_00000001"]


def test_a_resume_refuses_a_checkpoint_with_nonfinite_weights(mesh, tmp_path):
    """``train()`` loads with ``allow_nonfinite=False``: a NaN weight stops the resume."""
    run(mesh, tmp_path)
    path = checkpoint_path(tmp_path / "checkpoints", 1)
    model = ReferenceFoldModel(CONFIG)
    optimizer = build_optimizer(model, OptimizerSettings())
    state = load_checkpoint(path, model, optimizer, restore_rng=False)
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] = float("nan")
    write_checkpoint(
        path, 1, model, optimizer, mesh, loader_state=state["loader"], extra=state["extra"]
    )
    with pytest.raises(CheckpointError) as err:
        run(mesh, tmp_path, steps=2)
    assert "NaN or infinite values: refused" in str(err.value) and str(path) in str(err.value)
    assert "allow_nonfinite=True" in str(err.value)
