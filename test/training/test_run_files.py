"""Run files on one process: safe checkpoint reading, run directories, names, atomic writes."""

import json
import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from physicsnemo_foldcp.data.sampling import reshard_training_state
from physicsnemo_foldcp.training.atomic import replace_directory, write_atomic, write_text_atomic
from physicsnemo_foldcp.training.checkpoint import (
    STATE_NAME,
    CheckpointError,
    checkpoint_path,
    load_checkpoint,
    read_state,
)
from physicsnemo_foldcp.training.predict import OutputNameError, output_names
from physicsnemo_foldcp.training.rng_state import rng_state, set_rng_state
from physicsnemo_foldcp.training.rundir import (
    MANIFEST_NAME,
    RunDirectoryError,
    plan_run,
    trim_metrics,
)
from physicsnemo_foldcp.training.safe_dcp import METADATA_NAME


class CreatesMarker:
    """Unpickling this object creates the file ``path`` (what a crafted checkpoint does)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def crafted_pickle(path, marker):
    """Write a pickle at ``path`` whose loading creates ``marker``."""
    Path(path).write_bytes(pickle.dumps({"model": CreatesMarker(marker)}))


def fake_checkpoint(directory, step, state=None):
    """A ``step_<k>/`` directory with the two files ``list_checkpoints`` looks for."""
    path = checkpoint_path(directory, step)
    path.mkdir(parents=True)
    (path / METADATA_NAME).write_bytes(b"")
    torch.save(state or {"format": 2, "step": step}, path / STATE_NAME)
    return path


@pytest.mark.parametrize("where", ["file", "state", "metadata"])
def test_a_crafted_pickle_is_refused_and_not_run(tmp_path, where):
    """A pickle that creates a file when loaded is refused; the file is never created."""
    marker = tmp_path / "marker"
    if where == "file":
        target = tmp_path / "step_00000001.pt"
        crafted_pickle(target, marker)
        message = "is a file, not a checkpoint"
    else:
        target = tmp_path / "step_00000001"
        target.mkdir()
        if where == "state":
            (target / METADATA_NAME).write_bytes(b"")
            crafted_pickle(target / STATE_NAME, marker)
            message = "weights_only=True.*nothing in it was run"
        else:
            torch.save({"format": 2, "step": 1, "mesh": [1, 1, 1]}, target / STATE_NAME)
            crafted_pickle(target / METADATA_NAME, marker)
            message = r"refers to pathlib.Path.touch|refers to .*touch.*refused"
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(target, nn.Linear(2, 2), restore_rng=False)
    assert not marker.exists()


def test_the_rng_states_load_with_weights_only(tmp_path):
    """Torch, Python and NumPy generator states survive a weights_only round trip."""
    torch.manual_seed(3)
    random.seed(4)
    np.random.seed(5)
    torch.save(rng_state(), tmp_path / "rng.pt")
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(again[0], expected[0]) and again[1:] == expected[1:]


def test_a_state_file_that_is_not_a_checkpoint_state_is_refused(tmp_path):
    path = fake_checkpoint(tmp_path, 1, state={"format": 1})
    with pytest.raises(CheckpointError, match="not a format-2 checkpoint state"):
        read_state(path)


# -- run directories ---------------------------------------------------------------------------


def manifest(directory, run_id):
    Path(directory).mkdir(parents=True, exist_ok=True)
    (Path(directory) / MANIFEST_NAME).write_text(json.dumps({"fingerprint": run_id}))


def test_auto_resumes_this_runs_newest_checkpoint(tmp_path):
    fake_checkpoint(tmp_path, 5)
    newest = fake_checkpoint(tmp_path, 10)
    manifest(tmp_path, "mine")
    plan = plan_run(str(tmp_path), None, "mine", "auto", False)
    assert (plan.resume, plan.resume_step, plan.discard) == (str(newest), 10, [])


def test_another_runs_checkpoints_are_refused_naming_the_directory(tmp_path):
    fake_checkpoint(tmp_path, 5)
    manifest(tmp_path, "theirs")
    for resume in ("auto", None):
        with pytest.raises(RunDirectoryError) as err:
            plan_run(str(tmp_path), None, "mine", resume, False)
        assert str(tmp_path) in str(err.value) and "1 checkpoint(s), steps 5" in str(err.value)
        assert "run theirs" in str(err.value) and "train.overwrite=true" in str(err.value)
    assert checkpoint_path(tmp_path, 5).is_dir()
    plan = plan_run(str(tmp_path), None, "mine", "auto", True)
    assert plan.resume is None and plan.discard == [str(checkpoint_path(tmp_path, 5))]


def test_checkpoints_without_a_manifest_are_not_this_run(tmp_path):
    fake_checkpoint(tmp_path, 5)
    with pytest.raises(RunDirectoryError, match="no run manifest"):
        plan_run(str(tmp_path), None, "mine", "auto", False)
    plan = plan_run(str(tmp_path), None, "mine", "latest", False)
    assert plan.resume_step == 5


def test_a_path_resume_refuses_later_checkpoints_of_the_run(tmp_path):
    start = fake_checkpoint(tmp_path, 5)
    fake_checkpoint(tmp_path, 10)
    manifest(tmp_path, "mine")
    with pytest.raises(RunDirectoryError, match="after the resumed step"):
        plan_run(str(tmp_path), None, "mine", str(start), False)
    plan = plan_run(str(tmp_path), None, "mine", str(start), True)
    assert plan.resume_step == 5 and plan.discard == [str(checkpoint_path(tmp_path, 10))]


def test_another_runs_metrics_are_refused_and_this_runs_trimmed(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    lines = ({"step": s, "loss": 1.0, "seconds": 0.1} for s in (1, 2, 3))
    metrics.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(RunDirectoryError, match=rf"metrics file {metrics} holds 3 line"):
        plan_run(None, str(metrics), "mine", "auto", False)
    assert plan_run(None, str(metrics), "mine", "auto", True).metrics == "empty"
    with open(metrics, "a") as f:
        f.write('{"step": 4, "lo')  # a line cut short by a crash
    assert trim_metrics(metrics, 2) == 2
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [1, 2]


def test_the_loader_position_maps_to_another_ddp_size():
    state = {
        "mode": "train",
        "epoch": 1,
        "position": 3,
        "signature": ["train", 8, 2, 0, True, "wrap"],
    }
    mapped, note = reshard_training_state(state, 1)
    assert mapped["position"] == 6 and mapped["signature"][2] == 1 and "ddp=2" in note
    mapped, note = reshard_training_state(state, 4)
    assert mapped["position"] == 1 and "2 sample(s) of this epoch are seen again" in note
    assert reshard_training_state(state, 2) == (state, None)
    end = {
        "mode": "train",
        "epoch": 0,
        "position": 2,
        "signature": ["train", 3, 2, 0, True, "wrap"],
    }
    assert reshard_training_state(end, 1)[0]["position"] == 3  # the wrapped step is the end


# -- prediction names and atomic writes ----------------------------------------------------------


def test_prediction_names_are_unique_per_id():
    assert output_names(["a", "b/c", None]) == ["a.npz", "b_c.npz", "sample_000002.npz"]
    with pytest.raises(OutputNameError, match=r"samples 0 \(record id 'a/b'\) and 1 .*a_b.npz"):
        output_names(["a/b", "a_b"])
    with pytest.raises(OutputNameError, match="would both be written"):
        output_names(["x", "x"])


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "summary.json"
    write_text_atomic(path, "old")

    def broken(tmp):
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, broken)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["summary.json"]


def test_a_directory_is_replaced_whole(tmp_path):
    final, new = tmp_path / "step_1", tmp_path / ".step_1.tmp"
    final.mkdir()
    (final / "a").write_text("old")
    new.mkdir()
    (new / "b").write_text("new")
    replace_directory(new, final)
    assert os.listdir(tmp_path) == ["step_1"] and os.listdir(final) == ["b"]
