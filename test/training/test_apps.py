"""The Hydra apps end to end: train on 4 ranks, rerun, restart, compile, predict, refuse.

Each test launches ``examples/train.py`` / ``examples/predict.py`` as a subprocess (one
process, or 4 with ``torchrun``) with their default configuration, in a temporary run dir.
"""

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from physicsnemo_foldcp.data import save_sample
from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.training import read_distogram
from physicsnemo_foldcp.training.checkpoint import checkpoint_path, load_checkpoint
from physicsnemo_foldcp.training.config import build_dataset, build_model

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
TIMEOUT_S = 900


def launch(script, overrides, ranks=1, *, env=None, restarts=0, timeout=TIMEOUT_S):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1", **(env or {})}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = [sys.executable]
    if ranks > 1:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
        cmd += [f"--max-restarts={restarts}"] if restarts else []
    cmd += [str(ROOT / "examples" / script), *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def crash_once_env(tmp_path, step):
    """Environment of a run of ``crashing_model.CrashOnce`` that fails once, at ``step``."""
    return {
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "FOLDCP_TEST_CRASH_AT": str(step),
        "FOLDCP_TEST_CRASH_MARKER": str(tmp_path / "crashed"),
    }


def losses(run_dir):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def tail(proc):
    return f"rc={proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"


FAKE_BACKENDS = {
    "mlflow": """
import json, os

def _record(*call):
    with open(os.environ["FOLDCP_BACKEND_LOG"], "a") as f:
        f.write(json.dumps(["mlflow", os.getpid(), *call]) + "\\n")

def set_tracking_uri(uri): _record("set_tracking_uri", uri)
def set_experiment(name): _record("set_experiment", name)
def start_run(run_name=None): _record("start_run", run_name)
def log_params(params): _record("log_params", sorted(params))
def log_metrics(metrics, step=None): _record("log_metrics", metrics, step)
def end_run(): _record("end_run")
""",
    "wandb": """
import json, os

def _record(*call):
    with open(os.environ["FOLDCP_BACKEND_LOG"], "a") as f:
        f.write(json.dumps(["wandb", os.getpid(), *call]) + "\\n")

class AlertLevel:  # read by physicsnemo.utils.logging when it is imported
    INFO, WARN, ERROR = "INFO", "WARN", "ERROR"

class _Run:
    def log(self, metrics, step=None): _record("log", metrics, step)
    def finish(self): _record("finish")

def init(**kwargs):
    _record("init", kwargs["mode"], sorted(kwargs["config"]))
    return _Run()
""",
}
"""Stand-ins for MLflow and W&B (first on the app's path) that record their calls."""


def backend_calls(run_dir):
    """The calls the stand-in backends recorded during the ``trained`` run."""
    lines = (Path(run_dir).parent / "backends.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The default training run on 4 ranks, 2x2 CP mesh (a checkpoint every 5 steps).

    MLflow and W&B logging are on, served by :data:`FAKE_BACKENDS`.
    """
    run_dir = tmp_path_factory.mktemp("train") / "a"
    fake = tmp_path_factory.mktemp("backends")
    for name, source in FAKE_BACKENDS.items():
        (fake / name).mkdir()
        (fake / name / "__init__.py").write_text(source)
    path = os.pathsep.join(p for p in (str(fake), os.environ.get("PYTHONPATH", "")) if p)
    env = {"PYTHONPATH": path, "FOLDCP_BACKEND_LOG": str(run_dir.parent / "backends.jsonl")}
    overrides = ["mesh.cp=[2,2]", f"run_dir={run_dir}", "train.progress=false"]
    overrides += ["train.checkpoint_every=5", "logging.mlflow=true", "logging.wandb=true"]
    proc = launch("train.py", overrides, 4, env=env)
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
    assert checkpoint_path(run_dir / "checkpoints", 30).is_dir()
    assert json.loads((run_dir / "checkpoints" / "run.json").read_text())["fingerprint"]


def test_rank_zero_sends_every_step_to_mlflow_and_wandb(trained):
    run_dir, _ = trained
    calls = backend_calls(run_dir)
    assert len({pid for _, pid, *_ in calls}) == 1, "more than one rank logged metrics"
    curve = losses(run_dir)
    for backend, log_call in (("mlflow", "log_metrics"), ("wandb", "log")):
        mine = [call for name, _, *call in calls if name == backend]
        logged = {step: metrics["loss"] for kind, metrics, step in
                  (c for c in mine if c[0] == log_call)}  # fmt: skip
        assert logged == curve, f"{backend}: {logged} != metrics.jsonl {curve}"
    names = [(name, call[0]) for name, _, *call in calls if call[0] not in ("log", "log_metrics")]
    assert names == [
        ("mlflow", "set_tracking_uri"), ("mlflow", "set_experiment"), ("mlflow", "start_run"),
        ("mlflow", "log_params"), ("wandb", "init"), ("mlflow", "end_run"), ("wandb", "finish"),
    ], names  # fmt: skip
    wandb_init = next(call for name, _, *call in calls if name == "wandb" and call[0] == "init")
    assert wandb_init[1] == "offline" and "train" in wandb_init[2]


LIGHTNING_STEPS = 5
"""Steps of the Lightning app's run: the first steps of the ``trained`` run."""


@pytest.fixture(scope="module")
def lightning_trained(tmp_path_factory):
    """``examples/lightning_train.py`` with the ``trained`` run's overrides, metrics off."""
    pytest.importorskip("pytorch_lightning")
    run_dir = tmp_path_factory.mktemp("lightning") / "a"
    overrides = ["mesh.cp=[2,2]", f"run_dir={run_dir}", "train.progress=false"]
    overrides += ["train.checkpoint_every=5", f"train.steps={LIGHTNING_STEPS}"]
    proc = launch("lightning_train.py", overrides, 4)
    assert proc.returncode == 0, tail(proc)
    return run_dir


def float32(curve):
    """Losses as Lightning logs them (float32; the loop averages in float64)."""
    return {s: float(torch.tensor(v, dtype=torch.float32)) for s, v in curve.items()}


def test_the_lightning_app_gives_the_training_apps_losses_and_parameters(
    trained, lightning_trained
):
    from physicsnemo_foldcp.lightning import FoldModule

    run_dir, _ = trained
    first = {s: v for s, v in losses(run_dir).items() if s <= LIGHTNING_STEPS}
    assert losses(lightning_trained) == float32(first)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        model_config = OmegaConf.to_container(compose(config_name="train"), resolve=True)["model"]
    loop_model = build_model(model_config, 0)
    loop_checkpoint = checkpoint_path(run_dir / "checkpoints", LIGHTNING_STEPS)
    load_checkpoint(loop_checkpoint, loop_model, restore_rng=False)
    module = FoldModule(build_model(model_config, 1))
    path = lightning_trained / "checkpoints" / f"step_{LIGHTNING_STEPS:08d}.ckpt"
    load_checkpoint(path, module, restore_rng=False)
    theirs = loop_model.state_dict()
    for name, value in module.model.state_dict().items():
        assert torch.equal(value, theirs[name]), name


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
    model = build_model(cfg["model"], 0)
    assert_serial_distograms(out, model, build_dataset(cfg["data"]), checkpoint)


def assert_serial_distograms(out, model, dataset, checkpoint):
    """The 4 distograms in ``out`` are the serial ``model``'s, loaded from ``checkpoint``."""
    load_checkpoint(checkpoint, model, restore_rng=False)
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
        ("train.ema_decay=1.5", "train.ema_decay=1.5 is out of range"),
    ):
        proc = launch("train.py", [override, f"run_dir={tmp_path / 'z'}"])
        assert proc.returncode != 0
        assert message in proc.stderr, tail(proc)
        assert not (tmp_path / "z").exists()


class CreatesMarker:
    """Unpickling this object creates the file ``path``."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


@pytest.mark.parametrize("script", ["train.py", "predict.py"])
def test_a_crafted_checkpoint_is_refused_by_resume_and_predict(trained, tmp_path, script):
    """A real checkpoint whose .metadata was replaced by a pickle: nothing is run.

    A pickle file in place of the directory is refused by the same loader
    (``test_run_files.py``).
    """
    run_dir, _ = trained
    marker = tmp_path / "marker"
    evil_dir = tmp_path / "step_00000030"
    shutil.copytree(checkpoint_path(run_dir / "checkpoints", 30), evil_dir)
    (evil_dir / ".metadata").write_bytes(pickle.dumps(CreatesMarker(marker)))
    if script == "train.py":
        overrides = [f"train.resume={evil_dir}", f"run_dir={tmp_path / 'r'}"]
    else:
        overrides = [f"predict.checkpoint={evil_dir}", f"predict.out_dir={tmp_path / 'p'}"]
    proc = launch(script, overrides)
    assert proc.returncode != 0
    assert "CheckpointError" in proc.stderr and "refers to pathlib.Path.touch" in proc.stderr, tail(
        proc
    )
    assert not marker.exists()
    assert not (tmp_path / "p").exists() or not list((tmp_path / "p").glob("*.npz"))


def test_another_run_in_the_run_dir_is_refused(trained):
    run_dir, _ = trained
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    proc = launch("train.py", [f"run_dir={run_dir}", "train.seed=1", "train.progress=false"])
    assert proc.returncode != 0
    message = f"checkpoint directory {run_dir / 'checkpoints'} holds 6 checkpoint(s), steps 5,"
    assert message in proc.stderr and "train.overwrite=true" in proc.stderr, tail(proc)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before


def test_running_a_failed_job_again_continues_the_run(trained, tmp_path):
    """The job fails at step 7; the same command again resumes at step 5 (resume=auto).

    The losses are those of the uninterrupted run and each step is logged once.
    """
    run_dir, _ = trained
    restarted = tmp_path / "r"
    overrides = [
        "mesh.cp=[2,2]",
        f"run_dir={restarted}",
        "train.progress=false",
        "train.steps=8",
        "train.checkpoint_every=5",
        "model._target_=crashing_model.CrashOnce",
    ]
    env = crash_once_env(tmp_path, 7)
    failed = launch("train.py", overrides, 4, env=env)
    assert failed.returncode != 0 and "injected failure at step 7" in failed.stderr, tail(failed)
    proc = launch("train.py", overrides, 4, env=env)
    assert proc.returncode == 0, tail(proc)
    assert "resumed from" in proc.stdout + proc.stderr and "step 5" in proc.stdout + proc.stderr
    lines = (restarted / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines]
    assert steps == list(range(1, 9)), steps
    straight, again = losses(run_dir), losses(restarted)
    assert [again[s] for s in range(1, 9)] == [straight[s] for s in range(1, 9)]


def test_a_job_restarted_by_torchrun_continues_the_run(tmp_path):
    """torchrun --max-restarts=1 on 2 ranks: a worker fails at step 7, the restart resumes at 5.

    The restarted workers create their process group in the agent's store that the failed
    attempt used; they must not hang on its keys (mesh.timeout_s bounds that wait). Each
    step is logged once.
    """
    run_dir = tmp_path / "r"
    overrides = [
        "mesh.cp=[1,2]",
        "mesh.timeout_s=60",
        f"run_dir={run_dir}",
        "train.progress=false",
        "train.steps=7",
        "train.checkpoint_every=5",
        "model._target_=crashing_model.CrashOnce",
    ]
    env = crash_once_env(tmp_path, 7)
    proc = launch("train.py", overrides, 2, env=env, restarts=1, timeout=400)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, tail(proc)
    assert "injected failure at step 7" in output, tail(proc)
    resumed = f"resumed from {run_dir / 'checkpoints' / 'step_00000005'} at step 5"
    assert resumed in output, tail(proc)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 8))


def test_the_boltz2_trunk_trains_and_predicts_on_feature_files_with_ddp(tmp_path):
    """``model=boltz2_trunk data=files``: Boltz's own trunk modules, trained by the app.

    Training runs with DDP on ``ddp 2 x cp 1x2`` from feature files that hold atoms padded
    to whole windows, as Boltz's featurizer writes them; the loss falls, and ``predict.py``
    on a 2x2 mesh writes the serial trunk's distograms of the files. That DDP steps equal
    serial steps is shown in ``test/boltz/test_trunk_training.py``; that such a model (a
    module under two names) resumes under DDP, in ``test_checkpoint_safety.py``.
    """
    pytest.importorskip("boltz")
    samples, run_dir, out = (tmp_path / name for name in ("samples", "a", "p"))
    samples.mkdir()
    for i, n in enumerate((19, 23, 26, 21)):
        sample = make_complex(n, seed=i, msa_rows=4, atom_multiple=32)
        save_sample({**sample, "record_id": f"file{i}"}, samples / f"{i}.pt")
    data = ["model=boltz2_trunk", "data=files", f"data.path={samples}"]
    train = [*data, "mesh.cp=[1,2]", "train.wrapper=ddp", "train.progress=false"]
    train += ["train.steps=3"]
    proc = launch("train.py", [*train, f"run_dir={run_dir}"], 4)
    assert proc.returncode == 0, tail(proc)
    assert "wrapped as DistributedDataParallel" in proc.stdout + proc.stderr, tail(proc)
    curve = losses(run_dir)
    assert sorted(curve) == [1, 2, 3], curve
    assert curve[3] < curve[1] - 0.5, curve

    checkpoint = checkpoint_path(run_dir / "checkpoints", 3)
    predict = ["mesh.cp=[2,2]", f"predict.checkpoint={checkpoint}", f"predict.out_dir={out}"]
    proc = launch("predict.py", [*data, *predict], 4)
    assert proc.returncode == 0, tail(proc)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = OmegaConf.to_container(compose(config_name="predict", overrides=data), resolve=True)
    model = build_model(cfg["model"], 0).eval()
    assert_serial_distograms(out, model, build_dataset(cfg["data"], model), checkpoint)
