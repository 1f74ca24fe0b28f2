"""Boltz-2's Lightning checkpoints are read without running code from them.

The checkpoints are written by Lightning itself (``Trainer.save_checkpoint``) from Boltz's
own ``Boltz2`` with random weights: once with plain-dict hyperparameters, once with the
Hydra (omegaconf) configs Boltz's training passes. Weights are compared with
``torch.equal``; every refusal is a ``CheckpointError`` that names the file.
"""

from __future__ import annotations

import os
import typing

import pytest
import torch

pytest.importorskip("boltz")
pytest.importorskip("pytorch_lightning")

from omegaconf import DictConfig, ListConfig, OmegaConf  # noqa: E402

import physicsnemo_foldcp as fc  # noqa: E402
from physicsnemo_foldcp.cli import convert_boltz_weights as cli  # noqa: E402
from physicsnemo_foldcp.models.boltz2 import Boltz2Model  # noqa: E402
from physicsnemo_foldcp.models.boltz2_config import (  # noqa: E402
    BOLTZ2_PREDICT_DIFFUSION_ARGS,
    DEFAULT_MSA_ARGS,
    DEFAULT_PAIRFORMER_ARGS,
    Boltz2Config,
)
from physicsnemo_foldcp.models.boltz2_hparams import (  # noqa: E402
    HyperparameterError,
    boltz2_config_from_hparams,
)
from physicsnemo_foldcp.testing.boltz2_models import (  # noqa: E402
    save_lightning_checkpoint,
    serial_boltz2,
)
from physicsnemo_foldcp.training import boltz_weights  # noqa: E402
from physicsnemo_foldcp.training.boltz_weights import (  # noqa: E402
    MAX_WEIGHTS_BYTES,
    WEIGHTS_GLOBALS,
    boltz2_config_from_checkpoint,
    boltz2_model,
    read_boltz_weights,
    strip_compile_prefix,
    weights_config,
)
from physicsnemo_foldcp.training.checkpoint import CheckpointError, load_checkpoint  # noqa: E402

TRAINING_DIFFUSION = {**BOLTZ2_PREDICT_DIFFUSION_ARGS, "step_scale": 2.0, "gamma_0": 0.5}
"""Training-time diffusion settings saved in the checkpoint (not Boltz's prediction ones)."""

CONFIG = Boltz2Config(
    token_s=24,
    token_z=8,
    atom_s=8,
    atom_z=4,
    msa_args={**DEFAULT_MSA_ARGS, "msa_s": 4, "subsample_msa": True, "num_subsampled_msa": 9},
    pairformer_args={**DEFAULT_PAIRFORMER_ARGS, "num_blocks": 1, "dropout": 0.1},
    diffusion_process_args=TRAINING_DIFFUSION,
    predict_args={"recycling_steps": 2, "sampling_steps": 7, "diffusion_samples": 3},
)
"""The checkpoint's model: widths other than ``Boltz2Config``'s defaults, training-time
settings other than the project's."""


def renamed(source, target, rename) -> None:
    """A copy of checkpoint ``source`` with its state dict's keys renamed."""
    checkpoint = torch.load(source, weights_only=True)  # written by this test: plain data
    checkpoint["state_dict"] = {rename(k): v for k, v in checkpoint["state_dict"].items()}
    torch.save(checkpoint, target)


@pytest.fixture(scope="module")
def boltz2():
    """Boltz's ``Boltz2`` with ``CONFIG``'s hyperparameters and random weights."""
    return serial_boltz2(CONFIG, seed=3)


@pytest.fixture(scope="module")
def files(tmp_path_factory, boltz2):
    """Lightning checkpoints of ``boltz2``: plain, Hydra hyperparameters, compiled keys."""
    root = tmp_path_factory.mktemp("boltz_weights")
    paths = {name: root / f"{name}.ckpt" for name in ("plain", "hydra", "compiled", "submodule")}
    save_lightning_checkpoint(boltz2, paths["plain"])
    saved = dict(boltz2.hparams)
    hydra = {k: OmegaConf.create(v) for k, v in saved.items() if isinstance(v, dict)}
    hydra["training_args"] = OmegaConf.create({"max_lr": 1e-3, "milestones": [10, 20]})
    try:
        boltz2.hparams.update(hydra)
        save_lightning_checkpoint(boltz2, paths["hydra"])
    finally:
        boltz2.hparams.update(saved)
    renamed(paths["plain"], paths["compiled"], lambda k: f"_orig_mod.{k}")
    renamed(
        paths["plain"],
        paths["submodule"],
        lambda k: k.replace("pairformer_module.", "pairformer_module._orig_mod.", 1),
    )
    return paths


@pytest.fixture(scope="module")
def mesh():
    """A one-process gloo job (a save gathers every rank's random generators)."""
    mesh = fc.init_mesh()
    yield mesh
    fc.shutdown()


def assert_same_tensors(got, expected):
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


# (a) the state dict, tensor by tensor, and a strict load ------------------------------------


@pytest.mark.parametrize("name", ["plain", "hydra"])
def test_state_dict_equals_the_model_and_loads_strictly(files, boltz2, name):
    weights = read_boltz_weights(files[name])
    assert_same_tensors(weights.state_dict, boltz2.state_dict())
    assert weights.compiled_keys == 0
    ours = Boltz2Model(weights_config(weights))
    ours.load_state_dict(weights.state_dict, strict=True)
    assert_same_tensors(ours.state_dict(), boltz2.state_dict())


def test_hydra_hyperparameters_are_unpickled_as_omegaconf(files):
    weights = read_boltz_weights(files["hydra"])
    assert isinstance(weights.hyper_parameters["msa_args"], DictConfig)
    assert isinstance(weights.hyper_parameters["training_args"]["milestones"], ListConfig)


def test_every_allowed_global_is_needed(files, monkeypatch):
    """Plain hyperparameters need no allowed global; Hydra ones need each of them."""
    monkeypatch.setattr(boltz_weights, "WEIGHTS_GLOBALS", ())
    read_boltz_weights(files["plain"])
    preset = torch.serialization.get_safe_globals()
    names = {typing.Any: "typing.Any"}
    for entry in WEIGHTS_GLOBALS:
        if entry in preset:
            continue  # allowed by the host already: cannot be taken away here
        monkeypatch.setattr(
            boltz_weights, "WEIGHTS_GLOBALS", tuple(g for g in WEIGHTS_GLOBALS if g is not entry)
        )
        name = names.get(entry) or f"{entry.__module__}.{entry.__qualname__}"
        with pytest.raises(CheckpointError, match="hydra.ckpt: refers to") as refused:
            read_boltz_weights(files["hydra"])
        assert name in str(refused.value), (name, str(refused.value))


# (b) compiled models' names --------------------------------------------------------------


@pytest.mark.parametrize("name", ["compiled", "submodule"])
def test_compiled_names_load_the_same(files, boltz2, name):
    weights = read_boltz_weights(files[name])
    assert weights.compiled_keys > 0
    assert_same_tensors(weights.state_dict, boltz2.state_dict())
    assert_same_tensors(boltz2_model(weights).state_dict(), boltz2.state_dict())


def test_names_that_clash_without_the_compile_part_are_refused():
    t = torch.zeros(1)
    with pytest.raises(CheckpointError, match=r"w.ckpt: state_dict keys 'a.b' and '_orig_mod.a.b'"):
        strip_compile_prefix({"a.b": t, "_orig_mod.a.b": t}, "w.ckpt")


# (c) a malicious pickle ------------------------------------------------------------------


class Payload:
    """Unpickled without restriction, creates ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def test_a_malicious_pickle_is_refused_and_not_run(tmp_path, boltz2, monkeypatch):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.ckpt"
    state = {"state_dict": boltz2.state_dict(), "hyper_parameters": {"x": Payload(marker)}}
    torch.save(state, path)
    with pytest.raises(CheckpointError) as refused:
        read_boltz_weights(path)
    message = str(refused.value)
    assert message.startswith(f"{path}: refers to builtins.exec")
    assert "nothing in it was run" in message and "re-save it" in message
    assert not marker.exists()

    # as boltz predict leaves torch.load in its process: weights_only forced off
    original = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: original(*a, **{**k, "weights_only": False}))
    with pytest.raises(CheckpointError, match="refers to builtins.exec"):
        read_boltz_weights(path)
    assert not marker.exists()

    # the payload is live: what its reduction names, called, runs (no file is unpickled)
    control = tmp_path / "control"
    function, arguments = Payload(control).__reduce__()
    function(*arguments)
    assert control.exists()


def test_a_refused_file_converts_nothing(tmp_path, boltz2, mesh, capsys):
    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"x": Payload(tmp_path / "ran")}}, path)
    assert cli.main([str(path), str(tmp_path / "out")]) == 1
    assert "refers to builtins.exec" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "ran").exists()


# (d) size and kind of file, before reading ------------------------------------------------


def test_an_oversized_file_is_refused_before_reading(tmp_path, monkeypatch):
    path = tmp_path / "huge.ckpt"
    with open(path, "wb") as f:
        f.truncate(MAX_WEIGHTS_BYTES + 1)  # sparse: nothing to read in it

    def never(*args, **kwargs):
        raise AssertionError("the file was read")

    monkeypatch.setattr(torch.serialization, "load", never)
    monkeypatch.setattr(boltz_weights.zipfile, "is_zipfile", never)
    with pytest.raises(CheckpointError, match=rf"huge.ckpt: {MAX_WEIGHTS_BYTES + 1} bytes, more"):
        read_boltz_weights(path)


def test_the_size_bound_is_configurable(files):
    size = files["plain"].stat().st_size
    with pytest.raises(CheckpointError, match="more than max_bytes"):
        read_boltz_weights(files["plain"], max_bytes=size - 1)
    assert read_boltz_weights(files["plain"], max_bytes=size).size == size
    assert cli.build_parser().parse_args(["a", "b", "--max-bytes", "3G"]).max_bytes == 3 * 2**30


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_links_and_fifos_are_refused(tmp_path, files, kind):
    path = tmp_path / "weights.ckpt"
    if kind == "symlink":
        path.symlink_to(files["plain"])
    else:
        os.mkfifo(path)
    with pytest.raises(CheckpointError, match="weights.ckpt: is a (symbolic link|FIFO)"):
        read_boltz_weights(path)


def test_a_compressed_archive_is_refused(tmp_path, files):
    import zipfile

    path = tmp_path / "packed.ckpt"
    with zipfile.ZipFile(files["plain"]) as src, zipfile.ZipFile(path, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info), compress_type=zipfile.ZIP_DEFLATED)
    with pytest.raises(CheckpointError, match="packed.ckpt: records .* are compressed"):
        read_boltz_weights(path)


def test_nonfinite_weights_are_refused(tmp_path, files):
    path = tmp_path / "nan.ckpt"
    checkpoint = torch.load(files["plain"], weights_only=True)
    key = next(iter(checkpoint["state_dict"]))
    checkpoint["state_dict"][key] = torch.full_like(checkpoint["state_dict"][key], float("nan"))
    torch.save(checkpoint, path)
    with pytest.raises(CheckpointError, match=f"nan.ckpt: state_dict entries with NaN .*{key}"):
        read_boltz_weights(path)
    assert read_boltz_weights(path, allow_nonfinite=True).state_dict[key].isnan().all()


# (e) the conversion to the project's checkpoint -------------------------------------------


def test_the_conversion_writes_a_checkpoint_load_checkpoint_reads(tmp_path, files, boltz2, mesh):
    out = tmp_path / "weights"
    assert cli.main([str(files["hydra"]), str(out)]) == 0
    config = boltz2_config_from_checkpoint(out)
    assert config == weights_config(read_boltz_weights(files["plain"]))
    model = Boltz2Model(config)
    load_checkpoint(out, model, restore_rng=False)  # as examples/predict.py loads it
    assert_same_tensors(model.state_dict(), boltz2.state_dict())
    assert cli.main([str(files["plain"]), str(out)]) == 1  # never replaces a directory


# (f) the config built from the checkpoint ------------------------------------------------


def test_the_config_from_the_hyperparameters_fits_the_weights(files):
    weights = read_boltz_weights(files["hydra"])
    config = boltz2_config_from_hparams(weights.hyper_parameters)
    shapes = {k: v.shape for k, v in weights.state_dict.items()}
    with torch.device("meta"):
        model = Boltz2Model(config)
    assert {k: v.shape for k, v in model.state_dict().items()} == shapes
    for name in ("token_s", "token_z", "atom_s", "atom_z"):
        assert getattr(config, name) == getattr(CONFIG, name) != getattr(Boltz2Config(), name)
    assert config.msa_args["msa_s"] == 4 and config.pairformer_args["num_blocks"] == 1


def test_prediction_settings_are_the_projects_not_the_checkpoints(files):
    hparams = read_boltz_weights(files["plain"]).hyper_parameters
    assert hparams["diffusion_process_args"]["step_scale"] == 2.0  # saved at training
    project = Boltz2Config()
    config = boltz2_config_from_hparams(hparams)
    for name in ("diffusion_process_args", "predict_args", "steering_args", "recycling_steps"):
        assert getattr(config, name) == getattr(project, name), name
    assert config.diffusion_process_args == BOLTZ2_PREDICT_DIFFUSION_ARGS
    assert "subsample_msa" not in config.msa_args  # the training value is dropped
    assert config.msa_args["msa_dropout"] == project.msa_args["msa_dropout"]
    assert config.pairformer_args["dropout"] == project.pairformer_args["dropout"]
    boltz_predict = Boltz2Config(
        msa_args={**DEFAULT_MSA_ARGS, "subsample_msa": True, "num_subsampled_msa": 1024},
        predict_args={"recycling_steps": 3, "sampling_steps": 200, "diffusion_samples": 1},
    )
    config = boltz2_config_from_hparams(hparams, boltz_predict)
    assert config.msa_args["num_subsampled_msa"] == 1024 and config.msa_args["msa_s"] == 4
    assert config.predict_args["sampling_steps"] == 200


def test_a_missing_field_takes_boltz2s_default(files):
    hparams = dict(read_boltz_weights(files["plain"]).hyper_parameters)
    assert hparams.pop("fix_sym_check") is True
    assert boltz2_config_from_hparams(hparams).fix_sym_check is False  # Boltz2.__init__'s
    del hparams["token_s"]
    with pytest.raises(HyperparameterError, match="lacks 'token_s'"):
        boltz2_config_from_hparams(hparams)


def test_hyperparameters_that_are_not_plain_data_are_refused(files):
    hparams = dict(read_boltz_weights(files["plain"]).hyper_parameters)
    bad = {**hparams, "msa_args": OmegaConf.create({"msa_s": "${oc.env:HOME}"})}
    with pytest.raises(HyperparameterError, match=r"hyper_parameters.msa_args.msa_s is .*interp"):
        boltz2_config_from_hparams(bad)
    with pytest.raises(HyperparameterError, match=r"hyper_parameters.token_s is a .*Tensor"):
        boltz2_config_from_hparams({**hparams, "token_s": torch.tensor(3)})


def test_weights_that_do_not_fit_their_hyperparameters_are_refused(tmp_path, files):
    path = tmp_path / "other.ckpt"
    checkpoint = torch.load(files["plain"], weights_only=True)
    checkpoint["hyper_parameters"]["token_z"] = 12
    torch.save(checkpoint, path)
    with pytest.raises(CheckpointError, match="other.ckpt: does not fit .* other shapes"):
        boltz2_model(read_boltz_weights(path))
