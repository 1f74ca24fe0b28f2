"""Boltz-2 prediction (Boltz2Model.predict_step) under CP against Boltz's own Boltz2.

Same weights and seed on every rank: the serial ``Boltz2.predict_step`` of the whole
sample is the ground truth; the distributed run gets the scattered sample. Uneven N,
ligand tokens, atom windows that straddle the row blocks; no fallback gather.
"""

import pytest
import torch
import torch.distributed as dist

from physicsnemo_foldcp import scatter_features
from physicsnemo_foldcp.core import events
from physicsnemo_foldcp.data.datasets import batched
from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.testing import collective_assert
from physicsnemo_foldcp.testing.memory import LocalSizeGuard

const = pytest.importorskip("boltz.data.const")

from physicsnemo_foldcp.models.boltz2 import Boltz2Model  # noqa: E402
from physicsnemo_foldcp.models.boltz2_config import Boltz2Config  # noqa: E402
from physicsnemo_foldcp.testing.boltz2_models import model_pair  # noqa: E402

pytestmark = pytest.mark.multigpu_static
mesh_id = lambda s: "x".join(map(str, s))  # noqa: E731

SEED = 11
COORDS_ATOL = 1e-4
VALUES_ATOL = 1e-5


def _predict(config: Boltz2Config, sample: dict, fold_mesh) -> tuple[dict, dict, list]:
    torch.backends.cuda.matmul.allow_tf32 = False
    boltz2, ours = model_pair(config, seed=1)
    boltz2.predict_args = dict(config.predict_args)
    expected = [None]
    if dist.get_rank() == 0:  # the serial run once; every rank compares with it
        torch.manual_seed(SEED)
        with torch.no_grad():
            expected[0] = boltz2.predict_step(dict(sample), 0)
    dist.broadcast_object_list(expected, src=0)
    expected = expected[0]
    feats = scatter_features(sample, fold_mesh)
    fallbacks = []
    torch.manual_seed(SEED)
    with events.observe(lambda e: fallbacks.append(e) if e.kind == events.FALLBACK else None):
        got = ours.predict_step(feats)
    return expected, got, fallbacks


def _differences(expected, got, path: str, out: list[str]) -> None:
    """Every value of ``got`` against ``expected`` (Boltz's predict_step output)."""
    if isinstance(expected, dict):
        if set(got) != set(expected):
            out.append(f"{path}: keys {sorted(got)} != {sorted(expected)}")
            return
        for key in expected:
            _differences(expected[key], got[key], f"{path}.{key}", out)
    elif isinstance(expected, torch.Tensor):
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
            out.append(f"{path}: {type(got).__name__} {getattr(got, 'shape', '')}")
            return
        if not expected.is_floating_point():
            if not torch.equal(got, expected):
                out.append(f"{path}: {got.tolist()} != {expected.tolist()}")
            return
        tol = COORDS_ATOL if path == ".coords" else VALUES_ATOL
        if not torch.equal(got.isnan(), expected.isnan()):
            out.append(f"{path}: NaN at other places")
            return
        err = (got - expected).nan_to_num().abs().max().item() if got.numel() else 0.0
        if not err <= tol:
            out.append(f"{path}: differs from serial by {err} (tolerance {tol})")
    elif got != expected:
        out.append(f"{path}: {got!r} != {expected!r}")


@pytest.mark.parametrize(
    "fold_mesh,n_tokens",
    [((1, 2, 3), 41)],
    indirect=["fold_mesh"],
    ids=lambda v: mesh_id(v) if isinstance(v, tuple) else f"{v}",
)
def test_prediction_equals_serial(fold_mesh, n_tokens, capsys):
    """Coordinates, structure checks, every confidence output: serial within tolerance.

    One non-square mesh here, on a synthetic complex with several ligand chains, for every
    output of ``predict_step`` and the absence of fallback gathers; the written files on
    1x2, 2x2, 2x3 and 3x3 are ``test_boltz2_structures``'s.
    """
    config = Boltz2Config(predict_args={"diffusion_samples": 2, "sampling_steps": 3})
    sample = batched(make_complex(n_tokens, seed=5, msa_rows=4, atom_multiple=32))
    ligand = const.chain_type_ids["NONPOLYMER"]
    chains = sample["asym_id"][sample["mol_type"] == ligand]
    collective_assert(
        bool(chains.numel()) and int(torch.bincount(chains).max()) >= 3,
        "the sample has no ligand chain of three or more atoms (the frame search path)",
    )
    expected, got, fallbacks = _predict(config, sample, fold_mesh)
    problems = [f"fallback gather in {e.op} {e.shape}: {e.reason}" for e in fallbacks[:3]]
    _differences(expected, got, "", problems)
    printed = capsys.readouterr().out
    if "Error in" in printed:  # Boltz's confidence heads print and report 0 on an exception
        problems.append(f"Boltz caught an exception: {printed.strip()[:300]}")
    collective_assert(not problems, "; ".join(problems[:8]))


GUARD_FACTOR = 4
"""Largest local tensor allowed during a prediction, in local ``z`` tiles."""


@pytest.mark.parametrize("fold_mesh", [(1, 3, 3)], indirect=True, ids=mesh_id)
def test_no_rank_holds_a_full_pair_in_a_prediction(fold_mesh):
    """Trunk, diffusion conditioning, sampling and confidence on 3x3, under a size guard.

    The pair width is large next to the atom widths and the bias heads, so that half a
    full ``N x N x token_z`` pair exceeds the bound while the windowed atom tensors (the
    window bias is repeated over the samples, as in Boltz: ``O(M A H / cp0)``) and the
    per-sample maps do not.
    """
    n, token_z = 56, 128
    config = Boltz2Config(
        token_z=token_z,
        atom_z=2,
        predict_args={"diffusion_samples": 2, "sampling_steps": 2},
    )
    torch.manual_seed(0)
    model = Boltz2Model(config).eval()
    sample = batched(make_complex(n, seed=7, msa_rows=5, atom_multiple=32))
    feats = scatter_features(sample, fold_mesh)
    rows, columns = feats["token_bonds"].to_local().shape[1:3]
    tile = rows * columns * token_z
    with LocalSizeGuard(GUARD_FACTOR * tile) as guard:
        model.predict_step(feats)
    problems = [f"{v}" for v in guard.violations[:5]]
    if 2 * guard.limit >= n * n * token_z:
        problems.append(f"the bound {guard.limit} does not exclude half a pair {n * n * token_z}")
    collective_assert(not problems, f"tile {tile}, largest {guard.largest}: " + "; ".join(problems))
