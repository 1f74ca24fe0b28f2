"""Settings and configuration are checked before any work, with messages that say what to do."""

from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from physicsnemo_foldcp.distributed.wrappers import resolve_wrapper
from physicsnemo_foldcp.training import BatchSizeError, SyntheticComplexes, TrainSettings
from physicsnemo_foldcp.training.compile import resolve_compile_mode
from physicsnemo_foldcp.training.config import (
    build_dataset,
    build_model,
    loader_options,
    optimizer_settings,
    train_settings,
)

ROOT = Path(__file__).resolve().parents[2]


def config(name, overrides=()):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return OmegaConf.to_container(
            compose(config_name=name, overrides=list(overrides)), resolve=True
        )


def test_wrapper_choice():
    one, two = SimpleNamespace(ddp_size=1), SimpleNamespace(ddp_size=2)
    assert resolve_wrapper("auto", one) == "none"
    assert resolve_wrapper("auto", two) == "ddp"
    assert resolve_wrapper("fsdp2", two) == "fsdp2"
    with pytest.raises(ValueError, match="drift apart"):
        resolve_wrapper("none", two)
    with pytest.raises(ValueError, match="wrapper must be one of"):
        resolve_wrapper("fsdp1", one)


def test_compile_mode_choice():
    assert resolve_compile_mode("auto", (1, 1)) == "whole"
    assert resolve_compile_mode("auto", (2, 3)) == "regional"
    assert resolve_compile_mode("none", (2, 2)) == "none"
    with pytest.raises(ValueError, match="needs a 1x1 CP mesh"):
        resolve_compile_mode("whole", (1, 2))
    with pytest.raises(ValueError, match="compile mode must be one of"):
        resolve_compile_mode("max", (1, 1))


def test_train_settings_are_checked():
    with pytest.raises(BatchSizeError, match="batch size must be 1.*mesh.ddp"):
        TrainSettings(batch_size=2).check()
    with pytest.raises(ValueError, match="precision"):
        TrainSettings(precision="fp8").check()
    with pytest.raises(ValueError, match="resume=latest needs train.checkpoint_dir"):
        TrainSettings(resume="latest").check()


def test_default_configs_compose():
    cfg = config("train")
    settings = train_settings(cfg["train"], cfg["data"])
    assert settings.steps == 30 and settings.wrapper == "auto" and settings.batch_size == 1
    assert settings.checkpoint_dir == "runs/train/checkpoints"
    assert optimizer_settings(cfg["optimizer"]).name == "adamw"
    dataset = build_dataset(cfg["data"])
    assert isinstance(dataset, SyntheticComplexes) and len(dataset) == 8
    assert 16 <= min(dataset.sizes) and max(dataset.sizes) <= 32
    assert loader_options(cfg["data"]) == {
        "token_multiple": 1,
        "atom_multiple": 1,
        "num_workers": 0,
        "scatter_options": {"map_layout": "dense"},
        "balance": "even",
        "pair_weight": 0.0,
        "atom_weight": 1.0,
    }
    model = build_model(cfg["model"], 0)
    assert model.config.c_token == 32 and len(model.blocks) == 2
    predict = config("predict")
    assert predict["data"]["n_samples"] == 4 and predict["predict"]["checkpoint"] is None


def test_bad_options_are_named():
    cfg = config("train", ["data.batch_size=2"])
    with pytest.raises(BatchSizeError, match="data.batch_size=2"):
        train_settings(cfg["train"], cfg["data"])
    with pytest.raises(BatchSizeError):
        build_dataset(cfg["data"])
    cfg = config("train", ["+train.stepz=3"])
    with pytest.raises(ValueError, match=r"unknown train option\(s\) \['stepz'\]"):
        train_settings(cfg["train"])
    with pytest.raises(ValueError, match="data.kind=files needs data.path"):
        build_dataset({"kind": "files"})
    with pytest.raises(ValueError, match="data.kind must be one of"):
        build_dataset({"kind": "pdb"})


def test_balance_is_selected_in_the_data_config():
    even = loader_options(config("train")["data"])
    assert (even["balance"], even["pair_weight"], even["atom_weight"]) == ("even", 0.0, 1.0)
    overrides = ["data.balance.mode=balanced", "data.balance.pair_weight=0.5"]
    chosen = loader_options(config("train", overrides)["data"])
    assert (chosen["balance"], chosen["pair_weight"]) == ("balanced", 0.5)
    with pytest.raises(ValueError, match=r"unknown data.balance option\(s\) \['weight'\]"):
        loader_options({"balance": {"mode": "balanced", "weight": 1.0}})
    scatter = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "scatter.yaml"))
    assert scatter["balance"]["mode"] == "even" and "balance" not in scatter["scatter"]
