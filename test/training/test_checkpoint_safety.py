"""A checkpoint is untrusted input: it is read whole, confined to its directory, and checked
before anything in it reaches the model or the optimizer (one process).

Every refusal is a ``CheckpointError`` that names the file; after it the model's parameters
and the optimizer's state are what they were (compared with ``torch.equal``).
"""

import os
import pickle

import pytest
import torch
from torch import nn

import physicsnemo_foldcp as fc
from physicsnemo_foldcp.training.checkpoint import (
    STATE_NAME,
    CheckpointError,
    load_checkpoint,
    read_state,
    save_checkpoint,
)
from physicsnemo_foldcp.training.safe_dcp import METADATA_NAME

SHARD = "__0_0.distcp"
"""The one DCP shard file a one-process save writes."""


@pytest.fixture(scope="module")
def mesh():
    """A one-process gloo job (a save gathers every rank's random generators)."""
    mesh = fc.init_mesh()
    yield mesh
    fc.shutdown()


def trained(seed):
    """A two-layer model and its AdamW after one step (so the optimizer has state)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 3)).pow(2).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


@pytest.fixture
def saved(tmp_path, mesh):
    """A checkpoint of ``trained(0)`` at step 1."""
    model, optimizer = trained(0)
    return save_checkpoint(tmp_path / "checkpoints", 1, model, optimizer, mesh)


def snapshot(model, optimizer):
    tensors = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for index, state in optimizer.state_dict()["state"].items():
        for name, value in state.items():
            tensors[f"optimizer.{index}.{name}"] = value.clone()
    return tensors


def assert_unchanged(model, optimizer, before):
    after = snapshot(model, optimizer)
    assert after.keys() == before.keys()
    changed = [k for k in before if not torch.equal(after[k], before[k])]
    assert not changed, f"written before the refusal: {changed}"


def refused(path, names, match=None, mesh=None, **kwargs):
    """Load ``path`` into ``trained(1)``: a CheckpointError naming ``names``, nothing written."""
    model, optimizer = trained(1)
    before = snapshot(model, optimizer)
    with pytest.raises(CheckpointError, match=match) as info:
        load_checkpoint(path, model, optimizer, mesh=mesh, restore_rng=mesh is not None, **kwargs)
    message = str(info.value)
    for name in [names] if isinstance(names, (str, os.PathLike)) else names:
        assert str(name) in message, message
    assert_unchanged(model, optimizer, before)
    return message


def edit_metadata(path, edit):
    """Rewrite ``path``'s DCP metadata after ``edit(metadata)`` (plain pickle: test data)."""
    file = path / METADATA_NAME
    metadata = pickle.loads(file.read_bytes())
    edit(metadata)
    file.write_bytes(pickle.dumps(metadata))


def edit_state(path, edit):
    file = path / STATE_NAME
    state = torch.load(file, weights_only=True)
    edit(state)
    torch.save(state, file)


def storage_infos(metadata):
    return list(metadata.storage_data.values())


def test_a_checkpoint_loads_into_another_model_and_optimizer_exactly(saved):
    """The refusals below refuse what is wrong only: a sound checkpoint loads as saved."""
    model, optimizer = trained(1)
    state = load_checkpoint(saved, model, optimizer, restore_rng=False)
    expected = snapshot(*trained(0))
    got = snapshot(model, optimizer)
    assert state["step"] == 1
    assert all(torch.equal(got[k], expected[k]) for k in expected), "not loaded as saved"


class SharedProjection(nn.Module):
    """One Linear registered under two names, as Boltz's ``DiffusionTransformerLayer`` does."""

    def __init__(self):
        super().__init__()
        self.projection_linear = nn.Linear(3, 3)
        self.projection = nn.Sequential(self.projection_linear, nn.Sigmoid())
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        return self.head(self.projection(x))


def test_a_ddp_model_with_a_module_under_two_names_saves_and_loads_exactly(tmp_path, mesh):
    """DDP's ``module.`` prefix is not put back on a second name: the strict load fits."""
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = nn.parallel.DistributedDataParallel(SharedProjection())
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.randn(5, 3)).pow(2).sum().backward()
        optimizer.step()
        models.append((model, optimizer))
    (source, source_optimizer), (target, target_optimizer) = models
    path = save_checkpoint(tmp_path / "checkpoints", 1, source, source_optimizer, mesh)
    load_checkpoint(path, target, target_optimizer, mesh=mesh)
    expected = snapshot(source.module, source_optimizer)
    got = snapshot(target.module, target_optimizer)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected), "not loaded as saved"


# -- where the files are --------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("where", ["relative", "absolute", "symlink", "fifo"])
def test_a_shard_outside_the_directory_or_not_a_regular_file_is_refused(
    saved, tmp_path, mesh, where
):
    """A shard path out of the directory, a link out of it or a FIFO is refused, not read.

    The outside file holds another checkpoint's valid shard, so a reader that followed the
    path would load its weights without complaint; a FIFO would block ``open()``.
    """
    other, other_optimizer = trained(2)
    elsewhere = save_checkpoint(tmp_path / "other", 1, other, other_optimizer, mesh)
    outside = tmp_path / "outside.distcp"
    outside.write_bytes((elsewhere / SHARD).read_bytes())
    shard = saved / SHARD
    if where in ("relative", "absolute"):
        name = "../../outside.distcp" if where == "relative" else str(outside)

        def point_outside(metadata):
            for info in storage_infos(metadata):
                info.relative_path = name

        edit_metadata(saved, point_outside)
        message = refused(saved, [saved / METADATA_NAME, name])
    else:
        shard.unlink()
        if where == "symlink":
            shard.symlink_to(outside)
        else:
            os.mkfifo(shard)
        message = refused(saved, shard)
    assert "symbolic link" in message or "FIFO" in message or "inside" in message, message


@pytest.mark.parametrize("name", [STATE_NAME, METADATA_NAME])
def test_a_state_or_metadata_file_that_is_a_link_is_refused(saved, tmp_path, name):
    """``state.pt`` and ``.metadata`` are read only as regular files of the directory."""
    moved = tmp_path / f"moved{name}"
    (saved / name).rename(moved)
    (saved / name).symlink_to(moved)
    refused(saved, saved / name, match="symbolic link")


# -- bounded metadata --------------------------------------------------------------------------


def test_metadata_larger_than_the_limit_is_refused_before_it_is_read(saved):
    from physicsnemo_foldcp.training.safe_dcp import MAX_METADATA_BYTES

    os.truncate(saved / METADATA_NAME, MAX_METADATA_BYTES + 1)  # sparse: nothing is written
    refused(saved, saved / METADATA_NAME, match="MAX_METADATA_BYTES")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("repeats", ["thousands", "beyond the limit"])
def test_repeated_chunk_lists_are_refused_at_once(saved, repeats):
    """Chunk lists repeated by reference (a small file) are refused before DCP plans them."""
    from physicsnemo_foldcp.training.safe_dcp import MAX_CHUNKS

    def repeat(metadata):
        entries = list(metadata.state_dict_metadata.values())
        if repeats == "thousands":
            for entry in entries:
                entry.chunks = entry.chunks * 4000
        else:
            entries[0].chunks = entries[0].chunks * (MAX_CHUNKS + 1)

    edit_metadata(saved, repeat)
    assert (saved / METADATA_NAME).stat().st_size < 16 * 2**20
    refused(saved, saved / METADATA_NAME, match="overlap|MAX_CHUNKS")


@pytest.mark.parametrize("broken", ["entries", "chunks", "storage", "offset", "path type"])
def test_malformed_metadata_records_are_refused_naming_the_file(saved, broken):
    """Records of the allowed classes with wrong contents: a CheckpointError, no crash."""

    def spoil(metadata):
        first = next(iter(metadata.state_dict_metadata.values()))
        if broken == "entries":
            metadata.state_dict_metadata = None
        elif broken == "chunks":
            first.chunks = None
        elif broken == "storage":
            metadata.storage_data = {}
        elif broken == "offset":
            storage_infos(metadata)[0].offset = -5
        else:
            storage_infos(metadata)[0].relative_path = 3

    edit_metadata(saved, spoil)
    refused(saved, saved / METADATA_NAME)


# -- shards that do not hold what the metadata says ----------------------------------------------


def test_a_truncated_shard_is_refused_and_nothing_is_written(saved):
    shard = saved / SHARD
    os.truncate(shard, shard.stat().st_size - 100)
    refused(saved, shard, match="bytes")


def test_a_shard_that_holds_another_shape_is_refused_and_nothing_is_written(saved):
    """The last entry read points at another entry's bytes: found while reading, after the
    entries before it were read (into fresh tensors, not the model)."""

    def misdirect(metadata):
        entries = metadata.state_dict_metadata
        last = list(entries)[-1]
        other = next(k for k, v in entries.items() if v.size != entries[last].size)
        key = next(k for k in metadata.storage_data if k.fqn == last)
        source = next(k for k in metadata.storage_data if k.fqn == other)
        metadata.storage_data[key] = metadata.storage_data[source]

    edit_metadata(saved, misdirect)
    refused(saved, saved / SHARD)


def test_a_checkpoint_of_another_shape_is_refused_naming_the_entry(saved):
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 3))
    optimizer = torch.optim.AdamW(model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"model\.1\.weight") as info:
        load_checkpoint(saved, model, optimizer, restore_rng=False)
    assert str(saved / METADATA_NAME) in str(info.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


# -- state.pt -------------------------------------------------------------------------------


def test_an_empty_state_file_is_refused_naming_it(saved):
    (saved / STATE_NAME).write_bytes(b"")
    refused(saved, saved / STATE_NAME)


@pytest.mark.parametrize(
    "key, value",
    [
        ("rng", None),
        ("model_plain", None),
        ("optimizer_plain", [1]),
        ("mesh", None),
        ("step", "one"),
        ("rng", {"states": []}),
    ],
    ids=["no rng", "no model_plain", "optimizer_plain list", "no mesh", "step str", "rng empty"],
)
def test_an_incomplete_state_file_is_refused_naming_the_key(saved, mesh, key, value):
    def spoil(state):
        if value is None:
            del state[key]
        else:
            state[key] = value

    edit_state(saved, spoil)
    refused(saved, [saved / STATE_NAME, key], mesh=mesh)


def test_a_state_file_of_another_step_than_its_directory_is_refused(saved):
    edit_state(saved, lambda state: state.update(step=7))
    message = refused(saved, [saved / STATE_NAME, "step_00000001"])
    assert "7" in message
    with pytest.raises(CheckpointError, match="step_00000001"):
        read_state(saved)


# -- values ---------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["model", "optimizer"])
def test_nonfinite_values_are_refused_unless_asked_for(tmp_path, mesh, where):
    model, optimizer = trained(0)
    with torch.no_grad():
        if where == "model":
            model[0].weight[1, 2] = float("nan")
            model[1].bias[0] = float("inf")
        else:
            optimizer.state[model[0].weight]["exp_avg"][0, 0] = float("nan")
    path = save_checkpoint(tmp_path, 1, model, optimizer, mesh)
    entry = "model.0.weight" if where == "model" else "exp_avg"
    refused(path, [path / SHARD, entry, "allow_nonfinite"])
    target, target_optimizer = trained(1)
    load_checkpoint(path, target, target_optimizer, restore_rng=False, allow_nonfinite=True)
    if where == "model":
        assert torch.isnan(target[0].weight[1, 2]) and torch.isinf(target[1].bias[0])
    else:
        assert torch.isnan(target_optimizer.state[target[0].weight]["exp_avg"][0, 0])
