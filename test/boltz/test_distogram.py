"""Boltz's DistogramModule and distogram loss, unmodified, under CP.

The head symmetrises the pair (``z + z.transpose(1, 2)``: a pair tile meets its mirror
tile) and the loss builds the pair mask from a row-sharded mask, removes the diagonal with
a full ``torch.eye(N)`` and sums over both token axes. Serial vs distributed with the same
weights: the loss, the per-example loss, the pair's gradient and every parameter
gradient (TF32 off), on 1x2 to 3x3 meshes with uneven blocks and masked tokens;
``validate_model`` finds no fallback gather.
"""

import copy

import pytest
import torch
from torch import nn

from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.testing import collective_assert
from physicsnemo_foldcp.testing.layouts import TokenLayout
from physicsnemo_foldcp.testing.parity import close, randomize_parameters
from physicsnemo_foldcp.training import batched, validate_model

distogram = pytest.importorskip("boltz.model.modules.trunkv2")
distogram_loss = pytest.importorskip("boltz.model.loss.distogramv2").distogram_loss

pytestmark = pytest.mark.multigpu_static
MESHES = [(2, 1, 2), (2, 2, 1), (1, 2, 2), (1, 2, 3), (1, 3, 2), (1, 3, 3)]
mesh_id = lambda s: "x".join(map(str, s))  # noqa: E731
TOKEN_Z, BINS, CONFORMERS = 16, 16, 2


def inputs(n: int, seed: int = 0):
    """``z [1, N, N, c]``, a one-hot target ``[1, N, N, K, bins]`` and a token mask."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(1, n, n, TOKEN_Z, generator=g)
    bins = torch.randint(0, BINS, (1, n, n, CONFORMERS), generator=g)
    target = torch.nn.functional.one_hot(bins, BINS).float()
    mask = torch.ones(1, n)
    mask[:, -3:] = 0  # padded tokens
    mask[:, n // 2] = 0  # a token without a distance target
    return z, target, mask


@pytest.mark.parametrize("fold_mesh", MESHES, indirect=True, ids=mesh_id)
@pytest.mark.parametrize("n", [23, 37])
def test_distogram_head_and_loss_match_serial(fold_mesh, n):
    torch.manual_seed(0)
    module = randomize_parameters(distogram.DistogramModule(TOKEN_Z, BINS), 3)
    serial = copy.deepcopy(module)
    z, target, mask = inputs(n)
    layout = TokenLayout(fold_mesh, n)
    z_st, z_leaf = layout.shard(z, ("tokens", "tokens", None), requires_grad=True)
    feats = {
        "disto_target": layout.shard(target, ("tokens", "tokens", None, None))[0],
        "token_disto_mask": layout.shard(mask, ("tokens",))[0],
    }
    loss, per_example = distogram_loss({"pdistogram": module(z_st)}, feats)
    loss.backward()

    z_ref = z.clone().requires_grad_(True)
    serial_feats = {"disto_target": target, "token_disto_mask": mask}
    ref_loss, ref_per_example = distogram_loss({"pdistogram": serial(z_ref)}, serial_feats)
    ref_loss.backward()

    problems: list[str] = []
    close(loss.full_tensor().detach(), ref_loss.detach(), "loss", problems)
    close(per_example.full_tensor().detach(), ref_per_example.detach(), "per example", problems)
    close(z_leaf.grad, layout.local(z_ref.grad, ("tokens", "tokens", None)), "grad z", problems)
    for (name, p), (_, q) in zip(module.named_parameters(), serial.named_parameters()):
        close(p.grad, q.grad, f"grad {name}", problems)
    collective_assert(not problems, "; ".join(problems))


class DistogramOnFeatures(nn.Module):
    """A pair from ``res_type`` and Boltz's distogram head, for validate_model."""

    def __init__(self):
        super().__init__()
        self.rows = nn.Linear(33, TOKEN_Z, bias=False)
        self.columns = nn.Linear(33, TOKEN_Z, bias=False)
        self.head = distogram.DistogramModule(TOKEN_Z, 64)

    def forward(self, **feats):
        x = feats["res_type"].float()
        z = self.rows(x)[:, :, None] + self.columns(x)[:, None, :]
        return {"pdistogram": self.head(z)}


@pytest.mark.parametrize("fold_mesh", [(1, 2, 3), (1, 3, 3)], indirect=True, ids=mesh_id)
def test_validate_model_finds_no_fallback_in_the_distogram_head(fold_mesh):
    sample = batched(make_complex(19, seed=8, msa_rows=2))
    model = randomize_parameters(DistogramOnFeatures(), 4)
    report = validate_model(
        model, sample, fold_mesh, loss_fn=lambda out, feats: distogram_loss(out, feats)[0]
    )
    collective_assert(report.ok, report.format())
