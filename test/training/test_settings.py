"""Settings and configuration are checked before any work, with messages that say what to do."""

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from torch import nn

from physicsnemo_foldcp.distributed.bootstrap import init_mesh
from physicsnemo_foldcp.distributed.wrappers import resolve_wrapper
from physicsnemo_foldcp.kernels.budget import DEFAULT_WORK_BUDGET_MIB
from physicsnemo_foldcp.models import (
    Boltz2TrunkConfig,
    ModelConfig,
    ReferenceFoldModel,
    reference_loss,
)
from physicsnemo_foldcp.models.reference import DistogramHead, Transition, TrunkBlock
from physicsnemo_foldcp.sharding.options import ShardingOptions
from physicsnemo_foldcp.training import (
    BatchSizeError,
    OptimizerSettings,
    SyntheticComplexes,
    TrainSettings,
)
from physicsnemo_foldcp.training.compile import resolve_compile_mode
from physicsnemo_foldcp.training.config import (
    MeshConfig,
    PredictAppConfig,
    ScatterAppConfig,
    TrainAppConfig,
    build_dataset,
    build_model,
    data_config,
    loader_options,
    optimizer_settings,
    sharding_options,
    train_settings,
    typed,
)
from physicsnemo_foldcp.training.hooks import model_loss, module_types

ROOT = Path(__file__).resolve().parents[2]


def node(name, overrides=()):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose(config_name=name, overrides=list(overrides))


def config(name, overrides=()):
    return OmegaConf.to_container(node(name, overrides), resolve=True)


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
    with pytest.raises(ValueError, match="optimizer.name must be one of"):
        OptimizerSettings(name="adam")


def test_default_configs_compose():
    cfg = config("train")
    settings = train_settings(cfg["train"])
    assert settings.steps == 30 and settings.wrapper == "auto" and settings.batch_size == 1
    assert settings.resume == "auto" and settings.overwrite is False
    assert settings.checkpoint_dir == "runs/train/checkpoints"
    assert settings.metrics_file == "runs/train/metrics.jsonl"
    assert optimizer_settings(cfg["optimizer"]).name == "adamw"
    dataset = build_dataset(cfg["data"])
    assert isinstance(dataset, SyntheticComplexes) and len(dataset) == 8
    assert 16 <= min(dataset.sizes) and max(dataset.sizes) <= 32
    options = sharding_options(cfg["sharding"])
    assert options == ShardingOptions()
    assert loader_options(options, num_workers=cfg["data"]["num_workers"]) == {
        "options": ShardingOptions(),
        "num_workers": 0,
    }
    model = build_model(cfg["model"], 0)
    assert isinstance(model, ReferenceFoldModel) and model.config == ModelConfig()
    assert model.config.c_token == 32 and len(model.blocks) == 2
    predict = config("predict")
    assert predict["data"]["n_samples"] == 4 and predict["predict"]["checkpoint"] is None
    files = config("predict", ["data=files", "data.path=/samples"])["data"]
    assert files == {**config("train", ["data=files", "data.path=/samples"])["data"]}
    sgd = optimizer_settings(config("train", ["optimizer=sgd"])["optimizer"])
    assert (sgd.name, sgd.lr, sgd.momentum) == ("sgd", 1e-2, 0.9)


def test_the_model_group_builds_the_same_parameters_as_the_class():
    seeded = build_model(config("train")["model"], 3)
    torch.manual_seed(3)
    direct = ReferenceFoldModel(ModelConfig())
    assert seeded.state_dict().keys() == direct.state_dict().keys()
    assert all(torch.equal(v, direct.state_dict()[k]) for k, v in seeded.state_dict().items())
    wider = build_model(config("train", ["model.c_token=64"])["model"], 0)
    assert wider.config == ModelConfig(c_token=64)


def test_the_boltz2_trunk_group_composes_to_its_config():
    """model=boltz2_trunk: Boltz2TrunkConfig's defaults; building it needs boltz."""
    cfg = config("train", ["model=boltz2_trunk"])["model"]
    assert cfg["_target_"] == "physicsnemo_foldcp.models.boltz2_trunk.Boltz2Trunk"
    assert {k: v for k, v in cfg.items() if k != "_target_"} == Boltz2TrunkConfig().to_dict()
    with pytest.raises(ConfigCompositionException, match="model.token_zz"):
        config("train", ["model=boltz2_trunk", "model.token_zz=8"])
    pytest.importorskip("boltz")
    model = build_model(cfg, 0)
    assert model.config == Boltz2TrunkConfig()
    shallow = ["model=boltz2_trunk", "model.pairformer_args.num_blocks=1", "model.token_z=8"]
    model = build_model(config("train", shallow)["model"], 0)
    assert len(model.pairformer_module.layers) == 1 and model.config.token_z == 8


def test_every_default_is_written_once():
    """The composed defaults are those of the classes they configure; YAML only selects."""
    cfg = config("train")
    assert cfg["sharding"] == ShardingOptions().to_dict()
    assert {k: v for k, v in cfg["model"].items() if k != "_target_"} == ModelConfig().to_dict()
    defaults = dataclasses.asdict(TrainSettings())
    overridden = {k for k in defaults if cfg["train"][k] != defaults[k]}
    assert overridden == {"checkpoint_dir", "metrics_file", "summary_file"}  # under run_dir
    expected = dataclasses.asdict(OptimizerSettings())
    assert cfg["optimizer"] == {**expected, "betas": list(expected["betas"])}
    assert cfg["mesh"] == dataclasses.asdict(MeshConfig())
    assert cfg["mesh"]["work_budget_mib"] == DEFAULT_WORK_BUDGET_MIB
    assert init_mesh.__kwdefaults__ == {"timeout_s": None} and init_mesh.__defaults__ == (
        -1,
        (1, 1),
    )
    assert config("scatter")["sharding"] == ShardingOptions().to_dict()
    # Every value a YAML file sets, besides selecting configs; each one is commented there.
    allowed = {
        "train.yaml": {"train"},
        "data/synthetic_preview.yaml": {"n_samples"},
        "optimizer/sgd.yaml": {"name", "lr", "momentum"},
        "model/small.yaml": {"_target_"},
        "model/boltz2_trunk.yaml": {"_target_"},
        "model/boltz2.yaml": {"_target_"},
        "registry/boltz1.yaml": {"preset"},
        "registry/boltz2.yaml": {"preset"},
    }
    for path in sorted((ROOT / "conf").rglob("*.yaml")):
        name = str(path.relative_to(ROOT / "conf"))
        keys = set(yaml.safe_load(path.read_text())) - {"defaults", "hydra"}
        assert keys == allowed.get(name, set()), (name, keys)


def test_unknown_keys_and_bad_values_are_named():
    with pytest.raises(ConfigCompositionException, match="Could not override 'train.stepz'"):
        node("train", ["train.stepz=3"])
    with pytest.raises(ValueError, match=r"train.stepz: Key 'stepz' not in 'TrainSettings'"):
        typed(TrainAppConfig, node("train", ["+train.stepz=3"]), None)
    with pytest.raises(ValueError, match=r"data.batch_size: Key 'batch_size' not in"):
        build_dataset(config("predict", ["+data.batch_size=2"])["data"])
    with pytest.raises(ValueError, match=r"data.batch_size: Key 'batch_size' not in"):
        data_config(typed(PredictAppConfig, node("predict", ["+data.batch_size=2"]), None).data)
    with pytest.raises(ValueError, match=r"sharding.balance.weight: Key 'weight' not in"):
        sharding_options({"balance": {"mode": "balanced", "weight": 1.0}})
    with pytest.raises(ValueError, match=r"sharding.balance.mode must be one of"):
        sharding_options(config("train", ["sharding.balance.mode=odd"])["sharding"])
    with pytest.raises(ValueError, match=r"sample.n_tokenz: Key 'n_tokenz' not in"):
        typed(ScatterAppConfig, node("scatter", ["+sample.n_tokenz=3"]), None)
    with pytest.raises(ValueError, match=r"mesh.cp\[0\]: Value 'a' of type 'str'"):
        typed(TrainAppConfig, {**config("train"), "mesh": {"cp": ["a", 1]}}, None)
    with pytest.raises(ValueError, match="data.kind=files needs data.path"):
        build_dataset({"kind": "files"})
    with pytest.raises(ValueError, match="data.kind=files needs data.path"):
        build_dataset(config("train", ["data=files"])["data"])
    with pytest.raises(ValueError, match="data.kind must be one of"):
        build_dataset({"kind": "pdb"})
    with pytest.raises(ValueError, match="optimizer.name must be one of"):
        optimizer_settings(config("train", ["optimizer.name=adam"])["optimizer"])


def test_a_batch_of_two_is_refused_before_any_work():
    cfg = node("train", ["train.batch_size=2"])
    with pytest.raises(BatchSizeError, match=r"train.batch_size=2.*mesh.ddp"):
        typed(TrainAppConfig, cfg, None)
    with pytest.raises(BatchSizeError, match=r"train.batch_size=2.*mesh.ddp"):
        train_settings(cfg.train)


def test_balance_is_selected_in_the_sharding_config():
    even = loader_options(sharding_options(config("train")["sharding"]))["options"].balance
    assert (even.mode, even.pair_weight, even.atom_weight) == ("even", 0.0, 1.0)
    overrides = ["sharding.balance.mode=balanced", "sharding.balance.pair_weight=0.5"]
    chosen = loader_options(sharding_options(config("train", overrides)["sharding"]))
    assert (chosen["options"].balance.mode, chosen["options"].balance.pair_weight) == (
        "balanced",
        0.5,
    )
    for app in ("predict", "scatter"):
        more = [*overrides, "sharding.atom_multiple=32"]
        options = sharding_options(config(app, more)["sharding"])
        assert options.balance.mode == "balanced" and options.atom_multiple == 32


def test_the_reference_model_declares_its_units_regions_and_loss():
    model = ReferenceFoldModel(ModelConfig(c_atom=8, c_token=16, c_pair=8, n_blocks=1))
    assert module_types(model, "fsdp_units") == (TrunkBlock,)
    assert module_types(model, "compile_regions") == (Transition, DistogramHead)
    x = SyntheticComplexes(1, 9, 9, seed=2, msa_rows=2)[0]
    out = model(**x)
    assert torch.equal(model_loss(model)(out, x), reference_loss(out, x))


def test_a_new_model_plugs_in_with_its_own_config_file(tmp_path):
    """A model the loop has never heard of: one conf/model/*.yaml, its class, train.* paths."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tiny.yaml").write_text(
        "_target_: torch.nn.Linear\nin_features: 3\nout_features: 2\n"
    )
    overrides = [f"hydra.searchpath=[file://{tmp_path}]", "model=tiny"]
    overrides += ["train.fsdp_units=[torch.nn.Linear]", "train.loss=torch.nn.functional.l1_loss"]
    cfg = typed(TrainAppConfig, node("train", overrides), None)
    model = build_model(cfg.model, 0)
    assert isinstance(model, nn.Linear) and model.weight.shape == (2, 3)
    assert module_types(model, "fsdp_units", cfg.train.fsdp_units) == (nn.Linear,)
    assert module_types(model, "compile_regions", cfg.train.compile_regions) == ()
    assert model_loss(model, cfg.train.loss) is torch.nn.functional.l1_loss
    with pytest.raises(TypeError, match="Linear has no loss.*train.loss"):
        model_loss(model)
    with pytest.raises(ValueError, match="train.fsdp_units: cannot import 'torch.nn.Linearz'"):
        module_types(model, "fsdp_units", ["torch.nn.Linearz"])
    with pytest.raises(ValueError, match="train.compile_regions: .* is not an nn.Module class"):
        module_types(model, "compile_regions", ["torch.nn.functional.relu"])
    with pytest.raises(ValueError, match="model: needs _target_"):
        build_model({"c_token": 3}, 0)


def test_the_boltz2_group_composes_to_its_config():
    pytest.importorskip("boltz")
    from physicsnemo_foldcp.models.boltz2_config import Boltz2Config

    cfg = config("predict", ["model=boltz2", "model.predict_args.sampling_steps=4"])
    expected = Boltz2Config(predict_args={"sampling_steps": 4}).to_dict()
    model_cfg = {k: v for k, v in cfg["model"].items() if k != "_target_"}
    assert model_cfg == expected
    model = build_model(cfg["model"], 0)
    assert model.predicts_structures and model.config.predict_args["sampling_steps"] == 4
    with pytest.raises(ValueError, match="predict.output_format='cif'"):
        typed(PredictAppConfig, node("predict", ["predict.output_format=cif"]), None)
