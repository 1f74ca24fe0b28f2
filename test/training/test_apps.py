"""The Hydra apps end to end: train on 4 ranks, resume, compile on 1 process, predict, refuse.

Each test launches ``examples/train.py`` / ``examples/predict.py`` as a subprocess (one
process, or 4 with ``torchrun``) with their default configuration, in a temporary run dir.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from physicsnemo_foldcp.training import read_distogram
from physicsnemo_foldcp.training.checkpoint import checkpoint_path
from physicsnemo_foldcp.training.config import build_dataset, build_model

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 900


def launch(script, overrides, ranks=1):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = [sys.executable]
    if ranks > 1:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    cmd += [str(ROOT / "examples" / script), *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT, env=env)


def losses(run_dir):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def tail(proc):
    return f"rc={proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The default training run on 4 ranks, 2x2 CP mesh (a checkpoint every 5 steps)."""
    run_dir = tmp_path_factory.mktemp("train") / "a"
    overrides = ["mesh.cp=[2,2]", f"run_dir={run_dir}", "train.progress=false"]
    proc = launch("train.py", [*overrides, "train.checkpoint_every=5"], 4)
    assert proc.returncode == 0, tail(proc)
    return run_dir, proc


def test_training_on_4_ranks_lowers_the_loss(trained):
    run_dir, proc = trained
    curve = losses(run_dir)
    assert sorted(curve) == list(range(1, 31)), sorted(curve)
    first = sum(curve[s] for s in range(1, 6)) / 5
    last = sum(curve[s] for s in range(26, 31)) / 5
    assert last < first - 0.2, (first, last)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["end_step"] == 30 and summary["steps_per_s"] > 0
    assert len(summary["peak_memory_bytes"]) == 4 and min(summary["peak_memory_bytes"]) > 0
    assert "peak memory per rank" in proc.stdout + proc.stderr
    assert checkpoint_path(run_dir / "checkpoints", 30).is_file()


def test_resume_on_4_ranks_continues_with_the_same_losses(trained, tmp_path):
    run_dir, _ = trained
    resumed = tmp_path / "b"
    start = checkpoint_path(run_dir / "checkpoints", 25)
    proc = launch(
        "train.py",
        ["mesh.cp=[2,2]", f"run_dir={resumed}", "train.progress=false", f"train.resume={start}"],
        4,
    )
    assert proc.returncode == 0, tail(proc)
    straight, again = losses(run_dir), losses(resumed)
    assert sorted(again) == list(range(26, 31)), sorted(again)
    assert [again[s] for s in again] == [straight[s] for s in again]


def test_whole_model_compile_on_one_process_gives_the_2x2_losses(trained, tmp_path):
    """1 process (1x1 CP: whole-model compile) and 2x2 CP see the same samples (ddp = 1).

    One step: every new complex size is a new graph (``dynamic=False``), traced again.
    """
    run_dir, _ = trained
    single = tmp_path / "c"
    overrides = [
        f"run_dir={single}",
        "train.steps=1",
        "train.compile=auto",
        "train.compile_backend=aot_eager",
        "train.checkpoint_dir=null",
        "train.progress=false",
    ]
    proc = launch("train.py", overrides)
    assert proc.returncode == 0, tail(proc)
    assert "torch.compile (whole" in proc.stdout + proc.stderr
    compiled, cp = losses(single), losses(run_dir)
    assert sorted(compiled) == [1], compiled
    torch.testing.assert_close(torch.tensor(compiled[1]), torch.tensor(cp[1]))


def test_prediction_on_4_ranks_writes_the_serial_distograms(trained, tmp_path):
    run_dir, _ = trained
    checkpoint = checkpoint_path(run_dir / "checkpoints", 30)
    out = tmp_path / "p"
    overrides = ["mesh.cp=[2,2]", f"predict.checkpoint={checkpoint}", f"predict.out_dir={out}"]
    proc = launch("predict.py", overrides, 4)
    assert proc.returncode == 0, tail(proc)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = OmegaConf.to_container(compose(config_name="predict"), resolve=True)
    dataset = build_dataset(cfg["data"])
    model = build_model(cfg["model"], 0)
    model.load_state_dict(torch.load(checkpoint, weights_only=False)["model"])
    assert len(list(out.glob("*.npz"))) == len(dataset) == 4
    with torch.no_grad():
        for index in range(len(dataset)):
            sample = dataset[index]
            expected = model(**sample)["pdistogram"][0]
            got = read_distogram(out / f"{sample['record_id']}.npz")
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_mesh_that_does_not_fit_stops_before_any_work(tmp_path):
    proc = launch("train.py", ["mesh.ddp=1", "mesh.cp=[2,2]", f"run_dir={tmp_path / 'x'}"])
    assert proc.returncode != 0
    assert "1 x 2 x 2 = 4 ranks does not match the world size 1" in proc.stderr, tail(proc)
    assert not (tmp_path / "x").exists()


def test_a_batch_of_two_stops_before_any_work(tmp_path):
    proc = launch("train.py", ["train.batch_size=2", f"run_dir={tmp_path / 'y'}"])
    assert proc.returncode != 0
    assert "per-domain-group batch size must be 1" in proc.stderr, tail(proc)
    assert "mesh.ddp" in proc.stderr
    assert not (tmp_path / "y").exists()


def test_an_unknown_or_bad_option_stops_before_any_work(tmp_path):
    """Keys added with + are refused like any unknown key; bad values name their option."""
    for override, message in (
        ("+sharding.tokn_multiple=2", "sharding.tokn_multiple: Key 'tokn_multiple' not in"),
        ("sharding.balance.mode=odd", "sharding.balance.mode must be one of"),
    ):
        proc = launch("train.py", [override, f"run_dir={tmp_path / 'z'}"])
        assert proc.returncode != 0
        assert message in proc.stderr, tail(proc)
        assert not (tmp_path / "z").exists()
