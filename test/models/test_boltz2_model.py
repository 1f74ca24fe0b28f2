"""Boltz2Model against Boltz's own Boltz2: same state dict, same predict_step, serially."""

import pytest
import torch

pytest.importorskip("boltz")

from physicsnemo_foldcp.data.datasets import batched  # noqa: E402
from physicsnemo_foldcp.data.synthetic import make_complex  # noqa: E402
from physicsnemo_foldcp.models.boltz2 import (  # noqa: E402
    Boltz2Model,
    UnsupportedBoltz2Option,
)
from physicsnemo_foldcp.models.boltz2_config import Boltz2Config  # noqa: E402
from physicsnemo_foldcp.models.boltz2_trunk import TRUNK_PREFIXES  # noqa: E402
from physicsnemo_foldcp.testing.boltz2_models import model_pair, serial_boltz2  # noqa: E402

PAST_TRUNK = {"diffusion_conditioning", "structure_module", "confidence_module", "bfactor_module"}


def _assert_same(expected, got, path="") -> None:
    if isinstance(expected, dict):
        assert set(got) == set(expected), path
        for key in expected:
            _assert_same(expected[key], got[key], f"{path}.{key}")
    elif isinstance(expected, torch.Tensor):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True, msg=path)
    else:
        assert got == expected, path


def test_state_dict_is_boltz2s() -> None:
    boltz2 = serial_boltz2()
    ours = Boltz2Model()
    theirs = {k: tuple(v.shape) for k, v in boltz2.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == theirs
    assert {k.split(".", 1)[0] for k in theirs} == set(TRUNK_PREFIXES) - {
        "template_module"
    } | PAST_TRUNK
    ours.load_state_dict(boltz2.state_dict(), strict=True)


@pytest.mark.parametrize("parallel", [None, 1])
def test_predict_step_equals_boltz2(parallel) -> None:
    config = Boltz2Config(
        predict_args={"diffusion_samples": 2, "sampling_steps": 3, "max_parallel_samples": parallel}
    )
    boltz2, ours = model_pair(config, seed=1)
    feats = batched(make_complex(20, seed=3, msa_rows=4, atom_multiple=32))
    boltz2.predict_args = dict(config.predict_args)
    torch.manual_seed(5)
    with torch.no_grad():
        expected = boltz2.predict_step(dict(feats), 0)
    torch.manual_seed(5)
    got = ours.predict_step(feats)
    assert expected["exception"] is False
    _assert_same(expected, got)
    assert got["coords"].shape == (2, feats["atom_pad_mask"].shape[1], 3)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"affinity_prediction": True}, "affinity_prediction"),
        ({"use_kernels": True}, "use_kernels"),
        ({"steering_args": {"fk_steering": True}}, "fk_steering"),
        ({"steering_args": {"contact_guidance_update": True}}, "contact_guidance_update"),
    ],
)
def test_undistributed_options_are_refused_by_name(overrides, named) -> None:
    with pytest.raises(UnsupportedBoltz2Option, match=named):
        Boltz2Model(**overrides)


@pytest.mark.parametrize(
    "predict_args",
    [{"sampling_steps": 0}, {"diffusion_samples": 0}, {"recycling_steps": -1}],
)
def test_predict_args_are_bounded(predict_args) -> None:
    (key,) = predict_args
    with pytest.raises(ValueError, match=f"predict_args.{key}"):
        Boltz2Config(predict_args=predict_args)


@pytest.mark.parametrize(("field", "value"), [("token_z", 0), ("atom_s", -2), ("num_bins", 1.5)])
def test_sizes_are_bounded_by_name(field, value) -> None:
    with pytest.raises(ValueError, match=rf"model.{field}={value!r} is out of range"):
        Boltz2Config(**{field: value})
    with pytest.raises(ValueError, match="conditioning_cutoff_min"):
        Boltz2Config(conditioning_cutoff_min=30.0)
