"""Boltz2Trunk against Boltz's own ``Boltz2``: same weights layout, same distogram."""

import re
from typing import Any

import pytest
import torch

pytest.importorskip("boltz")

from boltz.model.models.boltz2 import Boltz2  # noqa: E402

from physicsnemo_foldcp.data.datasets import batched  # noqa: E402
from physicsnemo_foldcp.data.synthetic import make_complex  # noqa: E402
from physicsnemo_foldcp.models.boltz2_config import (  # noqa: E402
    DEFAULT_EMBEDDER_ARGS,
    DEFAULT_MSA_ARGS,
    DEFAULT_PAIRFORMER_ARGS,
)
from physicsnemo_foldcp.models.boltz2_trunk import (  # noqa: E402
    TRUNK_PREFIXES,
    Boltz2Trunk,
    atom_feature_width,
    trunk_state_dict,
)

#: Hyperparameters shared by both models (the trunk's small defaults, spelled out).
TRUNK_ARGS: dict[str, Any] = {
    "atom_s": 16,
    "atom_z": 8,
    "token_s": 32,
    "token_z": 16,
    "num_bins": 64,
    "embedder_args": DEFAULT_EMBEDDER_ARGS,
    "msa_args": DEFAULT_MSA_ARGS,
    "pairformer_args": DEFAULT_PAIRFORMER_ARGS,
    "atom_feature_dim": atom_feature_width(),
    "bond_type_feature": True,
    "fix_sym_check": True,
    "cyclic_pos_enc": True,
}
#: What Boltz2 needs beyond the trunk: a tiny structure module, no confidence head, no
#: validators, and no diffusion sampling in its forward.
BOLTZ2_ONLY: dict[str, Any] = {
    "training_args": {},
    "validation_args": {},
    "score_model_args": {
        "atom_encoder_depth": 1,
        "atom_encoder_heads": 2,
        "token_transformer_depth": 1,
        "token_transformer_heads": 2,
        "atom_decoder_depth": 1,
        "atom_decoder_heads": 2,
        "conditioning_transition_layers": 1,
    },
    "diffusion_process_args": {},
    "diffusion_loss_args": {},
    "confidence_prediction": False,
    "validate_structure": False,
    "skip_run_structure": True,
}
#: Boltz2 submodules outside the trunk (the structure module and its conditioning).
NOT_TRUNK = {"diffusion_conditioning", "structure_module"}
#: Parameters on the single (``s``) path only, which the distogram does not depend on.
SINGLE_PATH = re.compile(
    r"^(s_init|s_norm|s_recycle)\.|^pairformer_module\.layers\.\d+\."
    r"(attention|pre_norm_s|transition_s)\."
)


@pytest.fixture(scope="module")
def boltz2() -> Boltz2:
    torch.manual_seed(0)
    return Boltz2(**TRUNK_ARGS, **BOLTZ2_ONLY).eval()


@pytest.fixture(scope="module")
def feats() -> dict[str, Any]:
    return batched(make_complex(12, seed=3, msa_rows=4, atom_multiple=32))


def test_state_dict_matches_boltz2(boltz2: Boltz2) -> None:
    trunk = Boltz2Trunk(**TRUNK_ARGS)
    ours = {k: tuple(v.shape) for k, v in trunk.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in trunk_state_dict(boltz2.state_dict()).items()}
    assert ours == theirs
    boltz2_prefixes = {k.split(".", 1)[0] for k in boltz2.state_dict()}
    trunk_prefixes = {k.split(".", 1)[0] for k in ours}
    assert boltz2_prefixes - trunk_prefixes == NOT_TRUNK
    assert trunk_prefixes <= set(TRUNK_PREFIXES)


def test_default_arguments_are_the_shared_ones() -> None:
    a = Boltz2Trunk().state_dict()
    b = Boltz2Trunk(**TRUNK_ARGS).state_dict()
    assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}


@pytest.mark.parametrize("recycling_steps", [0, 1])
def test_distogram_equals_boltz2_forward(
    boltz2: Boltz2, feats: dict[str, Any], recycling_steps: int
) -> None:
    trunk = Boltz2Trunk(**TRUNK_ARGS).eval()
    trunk.load_state_dict(trunk_state_dict(boltz2.state_dict()), strict=True)
    with torch.no_grad():
        expected = boltz2(dict(feats), recycling_steps=recycling_steps)
        got = trunk(recycling_steps=recycling_steps, **feats)
    assert set(expected) == {"pdistogram", "s", "z"}
    for key in ("pdistogram", "s", "z"):
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0)
    assert got["pdistogram"].shape == (1, 12, 12, 1, TRUNK_ARGS["num_bins"])


def test_from_boltz2_loads_strictly(boltz2: Boltz2, feats: dict[str, Any]) -> None:
    trunk = Boltz2Trunk.from_boltz2(boltz2, recycling_steps=1).eval()
    for key, value in trunk.state_dict().items():
        torch.testing.assert_close(value, boltz2.state_dict()[key], rtol=0, atol=0)
    with torch.no_grad():
        expected = boltz2(dict(feats), recycling_steps=1)["pdistogram"]
        torch.testing.assert_close(trunk(**feats)["pdistogram"], expected, rtol=0, atol=0)


def test_train_step_on_synthetic_boltz2_complex(feats: dict[str, Any]) -> None:
    torch.manual_seed(1)
    trunk = Boltz2Trunk(recycling_steps=1).train()
    out = trunk(**feats)
    loss = trunk.loss(out, feats)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    grads = {n: p.grad for n, p in trunk.named_parameters() if p.requires_grad}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    # The distogram reads z only; Boltz's Pairformer never updates z from s, so the
    # single path (s_init, the s recycling, the Pairformer's s updates) gets a zero
    # gradient from this loss (in Boltz2 the structure module reads s); the loss adds
    # 0 * s.sum() so that it gets one at all.
    single = [n for n in grads if SINGLE_PATH.match(n)]
    assert "s_init.weight" in single and not any(grads[n].any() for n in single)
    assert grads["distogram_module.distogram.weight"].any()


def test_templates_need_arguments() -> None:
    with pytest.raises(ValueError, match="template_args"):
        Boltz2Trunk(use_templates=True)


def test_importing_the_package_does_not_import_boltz() -> None:
    import subprocess
    import sys

    code = (
        "import sys, physicsnemo_foldcp, physicsnemo_foldcp.models; print('boltz' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_templates_v2_match_boltz2(feats: dict[str, Any]) -> None:
    template = {
        "use_templates": True,
        "use_templates_v2": True,
        "template_args": {
            "template_dim": 8,
            "template_blocks": 1,
            "pairwise_head_width": 8,
            "pairwise_num_heads": 2,
        },
    }
    torch.manual_seed(2)
    boltz2 = Boltz2(**TRUNK_ARGS, **template, **BOLTZ2_ONLY).eval()
    trunk = Boltz2Trunk.from_boltz2(boltz2).eval()
    assert type(trunk.template_module).__name__ == "TemplateV2Module"
    with torch.no_grad():
        expected = boltz2(dict(feats))["pdistogram"]
        torch.testing.assert_close(trunk(**feats)["pdistogram"], expected, rtol=0, atol=0)
