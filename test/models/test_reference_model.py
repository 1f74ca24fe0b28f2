"""The reference model: serial behaviour, and the same numbers on scattered features."""

import pytest
import torch

from physicsnemo_foldcp import ShardingOptions, scatter_features
from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.models import ModelConfig, ReferenceFoldModel, reference_loss
from physicsnemo_foldcp.testing import collective_assert
from physicsnemo_foldcp.training import batched, forward_backward

CONFIG = ModelConfig(c_atom=8, c_token=16, c_pair=8, n_blocks=1, n_heads=2)
mesh_id = lambda s: "x".join(map(str, s))  # noqa: E731


def model(seed=0):
    torch.manual_seed(seed)
    return ReferenceFoldModel(CONFIG)


def index_maps(sample):
    """The compact layout of the atom -> token map: token of each atom, -1 for none."""
    a2t = sample["atom_to_token"]
    index = a2t.argmax(-1)
    return {**sample, "atom_to_token": torch.where(a2t.sum(-1) > 0, index, -1)}


def test_outputs_and_loss():
    x = batched(make_complex(17, seed=1, msa_rows=2))
    out = model()(**x)
    assert out["pdistogram"].shape == (1, 17, 17, 64)
    assert out["s"].shape == (1, 17, 16) and out["z"].shape == (1, 17, 17, 8)
    loss = reference_loss(out, x)
    assert loss.ndim == 0 and 3.0 < float(loss.detach()) < 6.0  # about log(64) at init


def test_compact_atom_map_gives_the_same_outputs():
    x = batched(make_complex(15, seed=2, msa_rows=2))
    m = model()
    dense, compact = m(**x)["pdistogram"], m(**index_maps(x))["pdistogram"]
    torch.testing.assert_close(compact, dense, rtol=1e-6, atol=1e-6)


def test_boltz1_features():
    x = batched(make_complex(13, seed=3, preset="boltz1", msa_rows=2))
    assert x["disto_target"].ndim == 4
    loss = reference_loss(model()(**x), x)
    assert torch.isfinite(loss)


def test_masked_tokens_do_not_change_the_loss_of_the_others():
    """Changing the features of a token masked everywhere leaves the loss as it was."""
    x = batched(make_complex(14, seed=4, msa_rows=2))
    for key in ("token_pad_mask", "token_disto_mask"):
        x[key] = x[key].clone()
        x[key][0, 5] = 0
    m = model()
    before = reference_loss(m(**x), x)
    y = dict(x)
    y["profile"] = x["profile"].clone()
    y["profile"][0, 5] += 3.0
    torch.testing.assert_close(reference_loss(m(**y), y), before, rtol=1e-6, atol=1e-6)


def test_missing_feature_and_bad_config_are_named():
    x = batched(make_complex(9, seed=5, msa_rows=2))
    del x["token_bonds"]
    with pytest.raises(KeyError, match="token_bonds"):
        model()(**x)
    with pytest.raises(ValueError, match="multiple of n_heads"):
        ModelConfig(c_token=10, n_heads=3)


@pytest.mark.multigpu_static
@pytest.mark.parametrize("fold_mesh", [(1, 2, 2), (1, 2, 3), (1, 3, 3)], indirect=True, ids=mesh_id)
@pytest.mark.parametrize(
    "options",
    [ShardingOptions(token_multiple=4, atom_multiple=8), ShardingOptions(map_layout="index")],
    ids=["padded", "compact-maps"],
)
def test_scattered_features_give_the_serial_loss_and_gradients(fold_mesh, options):
    """Per-shard padding and compact maps change the layout, not the loss or any gradient."""
    mesh = fold_mesh
    x = batched(make_complex(22, seed=6, msa_rows=2))
    serial = model()
    expected = forward_backward(serial, x)
    distributed = model().to(mesh.device)
    features = scatter_features(x if mesh.is_domain_source else None, mesh, options=options)
    loss = forward_backward(distributed, features)
    problems = []
    if not torch.allclose(loss.to_local().cpu(), expected, rtol=1e-5, atol=1e-6):
        problems.append(f"loss {float(loss.to_local())} != serial {float(expected)}")
    reference = dict(serial.named_parameters())
    for name, p in distributed.named_parameters():
        g, e = p.grad.cpu() if p.grad is not None else None, reference[name].grad
        scale = max(1.0, float(e.abs().max()))
        if g is None or not torch.allclose(g, e, rtol=1e-5, atol=1e-6 * scale):
            problems.append(f"gradient of {name} differs")
    collective_assert(not problems, "; ".join(problems[:5]))
