"""Every numeric option with a valid range is checked when the configuration is read.

The message names the option, its value and the range; the apps read the configuration
before they write anything (the train app's function shows it: ``optimizer.lr=-1`` leaves
no run dir).
"""

import importlib.util
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from physicsnemo_foldcp.training import OptimizerSettings, TrainSettings
from physicsnemo_foldcp.training.bounds import OptionRangeError, check_range
from physicsnemo_foldcp.training.config import (
    PredictAppConfig,
    ScatterAppConfig,
    TrainAppConfig,
    data_config,
    sharding_options,
    typed,
)

ROOT = Path(__file__).resolve().parents[2]

APPS = {"train": TrainAppConfig, "predict": PredictAppConfig, "scatter": ScatterAppConfig}


def read(app, overrides):
    """What the app does first: compose, then build every group's dataclass."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name=app, overrides=overrides)
    conf = typed(APPS[app], cfg, None)
    if app != "scatter":
        data_config(conf.data)
    sharding_options(conf.sharding)


FINITE, INTEGER = "a finite number", "an integer"
SEED = f"{INTEGER} in [0, 9223372036854775807]"
CASES = [
    ("train", ["optimizer.lr=-1"], "optimizer.lr=-1.0", f"{FINITE} > 0"),
    ("train", ["optimizer.lr=nan"], "optimizer.lr=nan", f"{FINITE} > 0"),
    ("train", ["optimizer.weight_decay=-0.5"], "optimizer.weight_decay=-0.5", f"{FINITE} >= 0"),
    ("train", ["optimizer.betas=[0.9,1.5]"], "optimizer.betas[1]=1.5", f"{FINITE} in [0, 1)"),
    ("train", ["optimizer=sgd", "optimizer.momentum=2"], "optimizer.momentum=2.0",
     f"{FINITE} in [0, 1]"),
    ("train", ["train.steps=-1"], "train.steps=-1", f"{INTEGER} >= 0"),
    ("train", ["train.seed=-3"], "train.seed=-3", SEED),
    ("train", ["train.log_every=-1"], "train.log_every=-1", f"{INTEGER} >= 0"),
    ("train", ["train.checkpoint_every=-2"], "train.checkpoint_every=-2", f"{INTEGER} >= 0"),
    ("train", ["mesh.timeout_s=0"], "mesh.timeout_s=0.0", f"{FINITE} > 0"),
    ("predict", ["mesh.work_budget_mib=0"], "mesh.work_budget_mib=0.0", f"{FINITE} > 0"),
    ("train", ["mesh.work_budget_mib=inf"], "mesh.work_budget_mib=inf", f"{FINITE} > 0"),
    ("train", ["data.n_samples=0"], "data.n_samples=0", f"{INTEGER} >= 1"),
    ("train", ["data.max_tokens=3"], "data.max_tokens=3", f"{INTEGER} >= 16"),
    ("train", ["data.msa_rows=0"], "data.msa_rows=0", f"{INTEGER} >= 1"),
    ("train", ["data.num_workers=-1"], "data.num_workers=-1", f"{INTEGER} >= 0"),
    ("train", ["data=files", "data.path=x", "data.max_sample_bytes=0"],
     "data.max_sample_bytes=0", f"{INTEGER} >= 1"),
    ("predict", ["predict.seed=-1"], "predict.seed=-1", SEED),
    ("scatter", ["sample.n_tokens=0"], "sample.n_tokens=0", f"{INTEGER} >= 1"),
]  # fmt: skip
"""(app, overrides, ``option=value`` as shown, range)."""


@pytest.mark.parametrize(("app", "overrides", "shown", "bounds"), CASES)
def test_an_option_out_of_range_is_named_with_its_value_and_range(app, overrides, shown, bounds):
    message = f"{shown} is out of range: it must be {bounds}"
    with pytest.raises(ValueError, match=re.escape(message)):
        read(app, overrides)


@pytest.mark.parametrize(("override", "value"), [("token", 1000000000), ("atom", 0)])
def test_a_pad_multiple_out_of_range_is_named_with_its_value_and_range(override, value):
    message = (
        f"sharding.{override}_multiple must be an integer >= 1, got {value}: the range is [1, 4096]"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        read("train", [f"sharding.{override}_multiple={value}"])


def test_the_settings_classes_check_their_ranges_without_hydra():
    with pytest.raises(OptionRangeError, match=re.escape("optimizer.lr=0 is out of range")):
        OptimizerSettings(lr=0)
    with pytest.raises(OptionRangeError, match=re.escape("train.steps=1.5 is out of range")):
        TrainSettings(steps=1.5)
    with pytest.raises(OptionRangeError, match=re.escape("x=True is out of range")):
        check_range("x", True, low=0)
    check_range("x", 0.5, low=0, high=1, high_open=True)


def test_a_bad_learning_rate_stops_the_app_before_it_writes_anything(tmp_path):
    """The train app's own function, on the composed configuration (no process group yet)."""
    spec = importlib.util.spec_from_file_location("train_app", ROOT / "examples" / "train.py")
    app = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(app)
    run_dir = tmp_path / "run"
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="train", overrides=["optimizer.lr=-1", f"run_dir={run_dir}"])
    with pytest.raises(ValueError, match=re.escape("optimizer.lr=-1.0 is out of range")):
        app.main.__wrapped__(cfg)
    assert not run_dir.exists()
