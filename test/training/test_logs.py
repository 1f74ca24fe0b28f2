"""Run logging: rank-zero console records, metrics to MLflow / W&B, clear errors."""

import importlib.machinery
import importlib.util
import io
import logging
import sys
import types
from pathlib import Path

import pytest

from physicsnemo_foldcp.training import logs
from physicsnemo_foldcp.training.logs import LoggingSettings, MetricLogger, setup_logging


@pytest.fixture
def console(monkeypatch):
    """``emit(rank, level, message) -> text written by the run's console handler``."""
    handler = setup_logging("INFO")
    stream = io.StringIO()
    previous = handler.setStream(stream)
    log = logging.getLogger("physicsnemo_foldcp.test_logs")

    def emit(rank: int, level: int, message: str) -> str:
        monkeypatch.setattr(logs, "global_rank", lambda: rank)
        stream.seek(0)
        stream.truncate()
        log.log(level, message)
        return stream.getvalue()

    yield emit
    handler.setStream(previous)
    logging.getLogger().removeHandler(handler)


def test_the_console_follows_a_replaced_stderr(monkeypatch):
    handler = setup_logging("INFO")
    try:
        first, second = io.StringIO(), io.StringIO()
        monkeypatch.setattr(sys, "stderr", first)
        logging.getLogger("physicsnemo_foldcp.test_logs").warning("to the first")
        first.close()
        monkeypatch.setattr(sys, "stderr", second)
        logging.getLogger("physicsnemo_foldcp.test_logs").warning("to the second")
        assert second.getvalue() == "to the second\n"
    finally:
        logging.getLogger().removeHandler(handler)


def test_info_is_written_by_rank_zero_only_and_warnings_by_every_rank(console):
    assert console(0, logging.INFO, "step 3 loss 1.25") == "step 3 loss 1.25\n"
    assert console(1, logging.INFO, "step 3 loss 1.25") == ""
    assert console(0, logging.WARNING, "slow step") == "slow step\n"
    assert console(2, logging.WARNING, "slow step") == "[rank 2] slow step\n"
    assert console(3, logging.ERROR, "bad map") == "[rank 3] bad map\n"


def test_setup_logging_adds_one_handler():
    root = logging.getLogger()
    first = setup_logging("INFO")
    try:
        assert setup_logging("WARNING") is first
        assert sum(getattr(h, "foldcp_rank_zero", False) for h in root.handlers) == 1
        assert root.level == logging.WARNING
    finally:
        root.removeHandler(first)
        root.setLevel(logging.WARNING)


class _Recorder(types.ModuleType):
    """A stand-in ``mlflow`` module that records its calls."""

    def __init__(self) -> None:
        super().__init__("mlflow")
        self.__spec__ = importlib.machinery.ModuleSpec("mlflow", None)
        self.calls: list[tuple] = []
        for name in (
            "set_tracking_uri", "set_experiment", "start_run", "log_params", "log_metrics",
            "end_run",
        ):  # fmt: skip
            setattr(self, name, self._record(name))

    def _record(self, name):
        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))

        return call


def test_metrics_reach_mlflow_from_rank_zero(tmp_path, monkeypatch):
    mlflow = _Recorder()
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)
    settings = LoggingSettings(mlflow=True, project="fold", run_name="r1")
    config = {"train": {"steps": 3}, "seed": 0}

    MetricLogger(settings, tmp_path, config, rank=1).log({"loss": 1.0}, step=1)
    assert mlflow.calls == [], "a rank other than 0 must not log"

    run = MetricLogger(settings, tmp_path, config, rank=0)
    run.log({"loss": 2.5, "seconds": 0.5}, step=1)
    run.log({"loss": 2.0, "seconds": 1.0}, step=2)
    run.close()
    run.close()
    assert mlflow.calls == [
        ("set_tracking_uri", ((tmp_path / "mlruns").resolve().as_uri(),), {}),
        ("set_experiment", ("fold",), {}),
        ("start_run", (), {"run_name": "r1"}),
        ("log_params", ({"train.steps": 3, "seed": 0},), {}),
        ("log_metrics", ({"loss": 2.5, "seconds": 0.5},), {"step": 1}),
        ("log_metrics", ({"loss": 2.0, "seconds": 1.0},), {"step": 2}),
        ("end_run", (), {}),
    ]


def test_metrics_reach_wandb_offline_under_the_run_directory(tmp_path):
    pytest.importorskip("wandb", reason="wandb comes with the boltz extra")
    run = MetricLogger(LoggingSettings(wandb=True, project="fold"), tmp_path, {"seed": 0}, rank=0)
    assert run.active
    for step in (1, 2):
        run.log({"loss": 3.0 - step}, step=step)
    run.close()
    offline = list(Path(tmp_path, "wandb").glob("offline-run-*"))
    assert len(offline) == 1, f"expected one offline run under {tmp_path}/wandb: {offline}"
    assert list(offline[0].glob("*.wandb")), "the offline run holds no history file"


def test_a_backend_that_is_not_installed_is_named(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a)
    )
    with pytest.raises(ImportError, match="logging.mlflow=true needs the mlflow package"):
        LoggingSettings(mlflow=True)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"level": "LOUD"}, "logging.level must be one of"),
        ({"wandb_mode": "cloud"}, "logging.wandb_mode must be one of"),
    ],
)
def test_bad_settings_are_refused(values, message):
    with pytest.raises(ValueError, match=message):
        LoggingSettings(**values)
