"""Serial tests of the loader's and the data module's configuration and state handling.

Building a loader reads only ``mesh.ddp_size`` and ``mesh.ddp_rank``; a stand-in mesh
with those two attributes is enough here (iteration is tested under ``multigpu_static``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from physicsnemo_foldcp.data import FoldCPDataModule, ShardedLoader
from physicsnemo_foldcp.data.sampling import InferenceOrder, TrainingOrder
from physicsnemo_foldcp.sharding.options import BalanceOptions, ShardingOptions

MESH = SimpleNamespace(ddp_size=2, ddp_rank=1)


class Unloaded:
    """A dataset whose samples must not be fetched by these tests."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index):
        raise AssertionError(f"sample {index} was fetched")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(mode="eval"), ValueError, "mode must be one of"),
        (dict(on_error="ignore"), ValueError, "on_error must be one of"),
        (dict(max_skips=-1), ValueError, "max_skips must be an integer >= 0"),
        (dict(num_workers=-2), ValueError, "num_workers must be an integer >= 0"),
        (dict(prefetch_factor=2), ValueError, "set num_workers > 0"),
        (dict(fetch_timeout_s=5.0), ValueError, "set num_workers > 0"),
        (dict(num_workers=1, fetch_timeout_s=0), ValueError, "fetch_timeout_s must be > 0"),
        (dict(dataloader_kwargs={"batch_size": 4}), ValueError, r"may not set \['batch_size'\]"),
        (dict(options={"atom_multiple": 32}), TypeError, "options must be ShardingOptions"),
        (dict(remainder="pad"), ValueError, "remainder must be one of"),
    ],
)
def test_loader_rejects_bad_options(kwargs, error, match):
    with pytest.raises(error, match=match):
        ShardedLoader(Unloaded(5), MESH, **kwargs)


def test_loader_needs_a_map_style_dataset():
    with pytest.raises(TypeError, match="map-style dataset with __len__"):
        ShardedLoader(iter(range(3)), MESH)


def test_loader_orders_length_and_state():
    train = ShardedLoader(Unloaded(7), MESH, seed=4, remainder="drop")
    assert isinstance(train.order, TrainingOrder) and len(train) == 3
    assert train.order.group_indices(0) == TrainingOrder(
        7, 2, 1, seed=4, remainder="drop"
    ).group_indices(0)
    infer = ShardedLoader(Unloaded(7), MESH, mode="inference")
    assert isinstance(infer.order, InferenceOrder) and len(infer) == 4
    train.set_epoch(3)
    state = train.state_dict()
    assert state["mode"] == "train" and (state["epoch"], state["position"]) == (3, 0)
    again = ShardedLoader(Unloaded(7), MESH, seed=4, remainder="drop")
    again.load_state_dict(state)
    assert (again.epoch, again.position) == (3, 0)
    with pytest.raises(ValueError, match="cannot resume a 'inference' loader"):
        infer.load_state_dict(state)
    with pytest.raises(ValueError, match="seed=4 in the state but 5 here"):
        ShardedLoader(Unloaded(7), MESH, seed=5, remainder="drop").load_state_dict(state)


def test_datamodule_builds_the_loaders_each_stage_needs():
    with pytest.raises(TypeError, match="has no mesh: pass mesh=init_mesh"):
        FoldCPDataModule(Unloaded(3)).train_dataloader()
    dm = FoldCPDataModule(Unloaded(5), Unloaded(3), None, MESH, seed=9, max_skips=2)
    with pytest.raises(ValueError, match="stage must be one of"):
        dm.setup("train")
    dm.setup("fit")
    train, val = dm.train_dataloader(), dm.val_dataloader()
    assert train is dm.train_dataloader() and val is dm.val_dataloader()
    assert train.mode == "train" and train.order.seed == 9 and train.max_skips == 2
    assert val.mode == "inference" and len(val) == 2
    with pytest.raises(ValueError, match="no predict dataset: pass predict_dataset="):
        dm.setup("predict")
    with pytest.raises(ValueError, match="no test dataset"):
        dm.test_dataloader()
    everything = FoldCPDataModule(Unloaded(5), None, Unloaded(4), MESH, test_dataset=Unloaded(2))
    everything.setup()
    assert everything.predict_dataloader().mode == "inference"
    assert len(everything.test_dataloader()) == 1


def test_datamodule_state_survives_teardown_and_restores_before_setup():
    dm = FoldCPDataModule(Unloaded(9), None, None, MESH, seed=1)
    dm.setup("fit")
    dm.train_dataloader().load_state_dict({**dm.train_dataloader().state_dict(), "epoch": 4})
    dm.train_dataloader().sampler.position = 2
    state = dm.state_dict()
    assert (state["train"]["epoch"], state["train"]["position"]) == (4, 2)
    dm.teardown("fit")
    assert dm.state_dict() == state
    dm.setup("fit")
    assert (dm.train_dataloader().epoch, dm.train_dataloader().position) == (4, 2)

    fresh = FoldCPDataModule(Unloaded(9), None, None, MESH, seed=1)
    fresh.load_state_dict(state)
    fresh.setup("fit")
    assert (fresh.train_dataloader().epoch, fresh.train_dataloader().position) == (4, 2)
    with pytest.raises(ValueError, match=r"unknown split\(s\) \['training'\]"):
        fresh.load_state_dict({"training": {}})
    other_seed = FoldCPDataModule(Unloaded(9), None, None, MESH, seed=2)
    other_seed.load_state_dict(state)
    with pytest.raises(ValueError, match="seed=1 in the state but 2 here"):
        other_seed.train_dataloader()


OLD_KEYWORDS = [
    dict(token_multiple=4),
    dict(atom_multiple=32),
    dict(align_lengths=True),
    dict(map_layout="index"),
    dict(method="scatter_tensor"),
    dict(balance="balanced"),
    dict(pair_weight=0.5),
    dict(atom_weight=2.0),
    dict(scatter_options={"map_layout": "index"}),
]


@pytest.mark.parametrize("kwargs", OLD_KEYWORDS, ids=lambda kw: next(iter(kw)))
def test_loader_and_datamodule_take_the_options_only_as_options(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{name}'"):
        ShardedLoader(Unloaded(5), MESH, **kwargs)
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{name}'"):
        FoldCPDataModule(Unloaded(5), None, None, MESH, **kwargs)


def test_loader_keeps_the_options_it_is_given():
    assert ShardedLoader(Unloaded(5), MESH).options == ShardingOptions()
    given = ShardingOptions(atom_multiple=32)
    assert ShardedLoader(Unloaded(5), MESH, options=given).options is given


def test_datamodule_checks_options_when_built_and_gives_them_to_every_loader():
    with pytest.raises(ValueError, match="max_skips must be an integer >= 0"):
        FoldCPDataModule(Unloaded(3), None, None, MESH, max_skips=-1)
    with pytest.raises(TypeError, match="FoldCPDataModule: options must be ShardingOptions"):
        FoldCPDataModule(Unloaded(3), None, None, MESH, options="balanced")  # type: ignore[arg-type]
    balanced = ShardingOptions(balance=BalanceOptions(mode="balanced"))
    with pytest.raises(ValueError, match="FoldCPDataModule: balance.mode='balanced' computes"):
        FoldCPDataModule(Unloaded(3), None, None, MESH, options=balanced, token_bounds=(0, 1, 3))
    options = ShardingOptions(atom_multiple=32, balance=BalanceOptions(mode="balanced"))
    dm = FoldCPDataModule(Unloaded(5), Unloaded(3), None, MESH, options=options, max_skips=2)
    dm.setup("fit")
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        assert loader.options == options and loader.max_skips == 2
    fixed = FoldCPDataModule(Unloaded(5), Unloaded(3), None, MESH, token_bounds=[0, 2, 5])
    for loader in (fixed.train_dataloader(), fixed.val_dataloader()):
        assert loader.options == ShardingOptions() and loader._token_bounds == (0, 2, 5)
