"""Boltz-2 prediction (Boltz2Model.predict_step) under CP against Boltz's own Boltz2.

Same weights and seed on every rank: the serial ``Boltz2.predict_step`` of the whole
sample is the ground truth; the distributed run gets the scattered sample. Uneven N,
ligand tokens, atom windows that straddle the row blocks; no fallback gather.
"""

import pytest
import torch

from physicsnemo_foldcp import scatter_features
from physicsnemo_foldcp.core import events
from physicsnemo_foldcp.data.datasets import batched
from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.testing import collective_assert

pytest.importorskip("boltz")

from physicsnemo_foldcp.models.boltz2_config import Boltz2Config  # noqa: E402
from physicsnemo_foldcp.testing.boltz2_models import model_pair  # noqa: E402

pytestmark = pytest.mark.multigpu_static
mesh_id = lambda s: "x".join(map(str, s))  # noqa: E731

SEED = 11
COORDS_ATOL = 1e-4


def _predict(config: Boltz2Config, sample: dict, fold_mesh) -> tuple[dict, dict, list]:
    torch.backends.cuda.matmul.allow_tf32 = False
    boltz2, ours = model_pair(config, seed=1)
    boltz2.predict_args = dict(config.predict_args)
    torch.manual_seed(SEED)
    with torch.no_grad():
        expected = boltz2.predict_step(dict(sample), 0)
    feats = scatter_features(sample, fold_mesh)
    fallbacks = []
    torch.manual_seed(SEED)
    with events.observe(lambda e: fallbacks.append(e) if e.kind == events.FALLBACK else None):
        got = ours.predict_step(feats)
    return expected, got, fallbacks


@pytest.mark.parametrize(
    "fold_mesh,n_tokens",
    [((2, 1, 2), 37), ((1, 2, 2), 37), ((1, 2, 3), 41), ((1, 3, 3), 37)],
    indirect=["fold_mesh"],
    ids=lambda v: mesh_id(v) if isinstance(v, tuple) else f"{v}",
)
def test_sampled_coordinates_equal_serial(fold_mesh, n_tokens):
    config = Boltz2Config(
        confidence_prediction=False,
        predict_args={"diffusion_samples": 2, "sampling_steps": 3, "max_parallel_samples": 2},
    )
    sample = batched(make_complex(n_tokens, seed=5, msa_rows=4, atom_multiple=32))
    expected, got, fallbacks = _predict(config, sample, fold_mesh)
    problems = [f"fallback gather in {e.op}: {e.reason}" for e in fallbacks[:3]]
    coords = got["coords"]
    if isinstance(coords, torch.Tensor) and coords.shape == expected["coords"].shape:
        err = (coords - expected["coords"]).abs().max().item()
        if not err <= COORDS_ATOL:
            problems.append(f"coords differ from serial by {err}")
    else:
        problems.append(f"coords {type(coords).__name__} {tuple(coords.shape)}")
    for key in ("chiral_centers_checked", "bonds_checked", "bonds_out_of_range"):
        if not torch.equal(got[key], expected[key]):
            problems.append(f"{key} {got[key].tolist()} != {expected[key].tolist()}")
    collective_assert(not problems, "; ".join(problems))
