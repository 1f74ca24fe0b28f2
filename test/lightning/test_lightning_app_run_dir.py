"""The Lightning app holds its run directory like examples/train.py and keeps a user's file.

The app's own function runs in this process on the composed configuration; each refusal
comes before the Trainer starts and leaves the files as they were.
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from physicsnemo_foldcp.training.rundir import RunDirectoryError
from physicsnemo_foldcp.training.runlock import LOCK_NAME, RunLockedError

pytest.importorskip("pytorch_lightning")

ROOT = Path(__file__).resolve().parents[2]

HOLDER = """
import sys, time
from physicsnemo_foldcp.training.runlock import RunLock
lock = RunLock(sys.argv[1])
print("held", flush=True)
time.sleep(60)
"""


@pytest.fixture(scope="module")
def app():
    path = ROOT / "examples" / "lightning_train.py"
    spec = importlib.util.spec_from_file_location("lightning_train_app", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def start(app, run_dir):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="train", overrides=[f"run_dir={run_dir}", "train.steps=1"])
    app.main.__wrapped__(cfg)


def test_a_users_metrics_file_is_refused_before_training(app, tmp_path):
    notes = tmp_path / "metrics.jsonl"
    notes.write_text("my notes\n")
    with pytest.raises(RunDirectoryError, match=rf"train.metrics_file={notes} is a file this"):
        start(app, tmp_path)
    assert notes.read_text() == "my notes\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "metrics.jsonl"]


def test_a_held_run_directory_is_refused(app, tmp_path):
    lock = tmp_path / "checkpoints" / LOCK_NAME
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == b"held"
        with pytest.raises(RunLockedError, match=f"pid {child.pid} on host"):
            start(app, tmp_path)
    finally:
        child.kill()
        child.wait()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [LOCK_NAME]
    assert not (tmp_path / "metrics.jsonl").exists()
