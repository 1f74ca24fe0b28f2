"""Boltz-2's whole trunk (Boltz2Trunk: Boltz's own modules) under CP against serial.

``validate_model`` runs the serial trunk and the trunk on the scattered sample with the
same weights: the distogram loss, every module's output that can be compared, and every
parameter gradient (TF32 off), on complexes with ligands (one-atom tokens), uneven N and
atom windows that straddle the row blocks; no fallback gather.
"""

import pytest
import torch

from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.testing import collective_assert
from physicsnemo_foldcp.testing.parity import randomize_parameters
from physicsnemo_foldcp.training import batched, validate_model

pytest.importorskip("boltz")

from physicsnemo_foldcp.models.boltz2_trunk import Boltz2Trunk  # noqa: E402

pytestmark = pytest.mark.multigpu_static
mesh_id = lambda s: "x".join(map(str, s))  # noqa: E731


def trunk() -> Boltz2Trunk:
    torch.manual_seed(0)
    return randomize_parameters(Boltz2Trunk(recycling_steps=1), 3)


@pytest.mark.parametrize(
    "fold_mesh,n_tokens",
    [((2, 1, 2), 23), ((1, 2, 2), 37), ((1, 2, 3), 23), ((1, 3, 3), 37)],
    indirect=["fold_mesh"],
    ids=lambda v: mesh_id(v) if isinstance(v, tuple) else f"N{v}",
)
def test_trunk_matches_serial_without_fallbacks(fold_mesh, n_tokens):
    sample = batched(make_complex(n_tokens, seed=7, msa_rows=5, atom_multiple=32))
    report = validate_model(trunk(), sample, fold_mesh)
    collective_assert(report.ok, report.format())
