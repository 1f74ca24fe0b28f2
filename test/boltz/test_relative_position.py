"""Boltz-2's RelativePositionEncoder, unmodified, under CP.

Its pair features come from outer comparisons of token singles (chain, residue, entity,
symmetry ids) and ``torch.any(cyclic_period > 0)`` over all tokens; with a cyclic chain
in the sample, validate_model finds the serial loss and gradients and no fallback gather.
"""

import pytest
import torch
from torch import nn

from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.ops import masked_mean
from physicsnemo_foldcp.testing import collective_assert
from physicsnemo_foldcp.testing.parity import randomize_parameters
from physicsnemo_foldcp.training import batched, validate_model

encoders = pytest.importorskip("boltz.model.modules.encodersv2")

pytestmark = pytest.mark.multigpu_static
mesh_id = lambda s: "x".join(map(str, s))  # noqa: E731


class RelativePositions(nn.Module):
    """Boltz-2's encoder (symmetry check fixed, cyclic chains) on scattered features."""

    def __init__(self):
        super().__init__()
        self.encoder = encoders.RelativePositionEncoder(16, fix_sym_check=True, cyclic_pos_enc=True)

    def forward(self, **feats):
        return {"z": self.encoder(feats), "mask": feats["token_pad_mask"].float()}


def pair_loss(outputs, feats):
    mask = outputs["mask"]
    return masked_mean(outputs["z"].pow(2).mean(-1), mask[:, :, None] * mask[:, None, :])


@pytest.mark.parametrize("fold_mesh", [(1, 2, 2), (1, 2, 3), (1, 3, 3)], indirect=True, ids=mesh_id)
def test_relative_positions_with_a_cyclic_chain_match_serial_without_fallbacks(fold_mesh):
    sample = batched(make_complex(23, seed=3, msa_rows=2))
    first_chain = sample["asym_id"] == sample["asym_id"][0, 0]
    sample["cyclic_period"] = torch.where(
        first_chain, first_chain.sum().to(sample["cyclic_period"].dtype), 0
    )
    model = randomize_parameters(RelativePositions(), 1)
    report = validate_model(model, sample, fold_mesh, loss_fn=pair_loss)
    collective_assert(report.ok, report.format())
