"""Boltz-2 prediction (Boltz2Model.predict_step) under CP: serial parity and local sizes.

``validate_model(step="predict")`` runs the same weights and seed serially on the whole
sample (the ground truth; ``Boltz2Model.predict_step`` equals Boltz's own
``Boltz2.predict_step``, ``test/models/test_boltz2_model.py``) and distributed on the
scattered sample, and compares every module and output. Uneven N, ligand tokens, atom
windows that straddle the row blocks; no fallback gather.
"""

import pytest
import torch
from physicsnemo.domain_parallel import ShardTensor

from physicsnemo_foldcp import scatter_features
from physicsnemo_foldcp.data.datasets import batched
from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.testing import collective_assert
from physicsnemo_foldcp.testing.memory import LocalSizeGuard
from physicsnemo_foldcp.training.validate import validate_model

const = pytest.importorskip("boltz.data.const")

from physicsnemo_foldcp.models.boltz2 import Boltz2Model  # noqa: E402
from physicsnemo_foldcp.models.boltz2_config import Boltz2Config  # noqa: E402

pytestmark = pytest.mark.multigpu_static
mesh_id = lambda s: "x".join(map(str, s))  # noqa: E731

SEED = 11
COORDS_ATOL = 1e-4
VALUES_ATOL = 1e-5
CONFIG = Boltz2Config(predict_args={"diffusion_samples": 2, "sampling_steps": 3})


class ShiftedWhenSharded(Boltz2Model):
    """A Boltz2Model whose distributed prediction moves every atom by 1 (coordinates a few
    sampling steps from the noise are hundreds of units large)."""

    def predict_step(self, feats):
        """The prediction, its coordinates shifted when ``feats`` are scattered."""
        out = super().predict_step(feats)
        if any(isinstance(v, ShardTensor) for v in feats.values()):
            out["coords"] = out["coords"] + 1.0
        return out


def _validate(model: Boltz2Model, sample: dict, fold_mesh):
    torch.manual_seed(SEED)
    return validate_model(
        model.eval(), sample, fold_mesh, step="predict", rtol=COORDS_ATOL, atol=VALUES_ATOL
    )


@pytest.mark.parametrize("fold_mesh", [(1, 2, 2)], indirect=True, ids=mesh_id)
def test_validate_model_finds_no_fallback_in_a_prediction(fold_mesh, capsys):
    """Trunk, conditioning, sampling, structure checks and confidence, module by module.

    A synthetic complex with several ligand chains (the frame search path): every module
    output and every output of ``predict_step`` as serial, and no fallback gather. The
    written files on 1x2, 2x2, 2x3 and 3x3 are ``test_boltz2_structures``'s.
    """
    sample = batched(make_complex(41, seed=5, msa_rows=4, atom_multiple=32))
    ligand = const.chain_type_ids["NONPOLYMER"]
    chains = sample["asym_id"][sample["mol_type"] == ligand]
    collective_assert(
        bool(chains.numel()) and int(torch.bincount(chains).max()) >= 3,
        "the sample has no ligand chain of three or more atoms (the frame search path)",
    )
    torch.manual_seed(0)
    report = _validate(Boltz2Model(CONFIG), sample, fold_mesh)
    problems = [] if report.ok else [report.format()]
    if report.fallback_collectives:
        problems.append(f"fallbacks: {report.fallback_collectives[:3]}")
    # The atom encoder's window blocks are each rank's own (not compared); the rest is.
    if len(report.module_errors) < 400:
        problems.append(f"{len(report.module_errors)} modules compared, {report.not_compared}")
    if report.loss_serial is not None or report.gradient_errors:
        problems.append("a prediction has no loss and no gradient")
    printed = capsys.readouterr().out
    if "Error in" in printed:  # Boltz's confidence heads print and report 0 on an exception
        problems.append(f"Boltz caught an exception: {printed.strip()[:300]}")
    collective_assert(not problems, "; ".join(problems))


@pytest.mark.parametrize("fold_mesh", [(1, 2, 2)], indirect=True, ids=mesh_id)
def test_a_prediction_that_differs_from_serial_fails_validation(fold_mesh):
    """Coordinates 1 off in the distributed run only: the outputs fail, no module does."""
    sample = batched(make_complex(17, seed=2, msa_rows=2, atom_multiple=32))
    torch.manual_seed(0)
    report = _validate(ShiftedWhenSharded(CONFIG), sample, fold_mesh)
    problems = []
    if report.ok or report.outputs_ok:
        problems.append(f"the shifted coordinates passed:\n{report.format()}")
    if report.first_divergent_module is not None:
        problems.append(f"a module diverged: {report.first_divergent_module}")
    collective_assert(not problems, "; ".join(problems))


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
