"""No repeated work: a trunk training step's FLOPs over all ranks against the serial step's.

The trunk benchmark's training step (its main sizes, with the pair kernels keeping their
scores for backward as Boltz's modules do, ``mesh.kernel_recompute=false``) on 2x2 and
3x3 at a small N: the FLOPs of every rank's local blocks (torch's formulas,
:class:`~physicsnemo_foldcp.testing.flops.LocalFlops`), summed over the ranks, within 5 %
of the serial step's (Boltz's modules on the whole sample). A few percent fewer is
possible (Boltz builds the atom windows' keys and pair entries with dense index matrix
products that the plugin replaces by lookups); far fewer would mean work left out. The
atom windows of a row block are split over its ``cp1`` ranks here, so
the input embedder's FLOPs are not repeated ``cp1`` times either.
"""

import dataclasses
import sys
from pathlib import Path

import pytest

import physicsnemo_foldcp as fc
import physicsnemo_foldcp.boltz as fc_boltz
from physicsnemo_foldcp.testing import collective_assert
from physicsnemo_foldcp.testing.flops import summed_over_mesh

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

pytest.importorskip("boltz.model.modules.trunkv2")

from benchmarks.bench_trunk import BASE, build_trunk, step_flops  # noqa: E402
from physicsnemo_foldcp.data.synthetic import make_complex  # noqa: E402
from physicsnemo_foldcp.ops.atom_windows import AtomWindows  # noqa: E402
from physicsnemo_foldcp.training import batched  # noqa: E402

N = 96
"""Tokens of the sample (about 900 atoms: every row block has more windows than cp1)."""
BOUND = 1.05
"""The most FLOPs all ranks may do together, as a multiple of the serial step's."""
FLOOR = 0.95
"""The fewest: below, work the serial step does would be missing."""
SIZES = dataclasses.replace(BASE, kernel_recompute=False)


@pytest.mark.multigpu_static
@pytest.mark.parametrize("fold_mesh", [(1, 2, 2), (1, 3, 3)], indirect=True, ids=str)
def test_all_ranks_do_the_serial_steps_flops_within_5_percent(fold_mesh):
    fc_boltz.install()
    seed, dropout_seed = 0, 1
    sample = serial_flops = None
    if fold_mesh.is_domain_source:
        sample = batched(make_complex(N, seed=seed, msa_rows=SIZES.msa_rows, atom_multiple=32))
        serial = build_trunk(SIZES, seed, 0.05)
        serial_flops = sum(step_flops(serial, sample, dropout_seed).values())
        del serial
    features = fc.scatter_features(sample, fold_mesh)
    windows = AtomWindows.of(features["ref_pos"], 32, 128)
    model = build_trunk(SIZES, seed, 0.05).to(fold_mesh.device)
    with fc.recompute_in_backward(False):
        mine = step_flops(model, features, dropout_seed)
    domain = fold_mesh.domain_mesh
    total = summed_over_mesh(sum(mine.values()), domain)
    serial_total = summed_over_mesh(serial_flops or 0, domain)
    embedder = summed_over_mesh(mine.get("input_embedder", 0), domain)
    ratio = total / serial_total
    collective_assert(
        windows.split_over_columns and FLOOR <= ratio <= BOUND,
        f"FLOPs of all ranks {total} / serial {serial_total} = {ratio:.4f} (bound {BOUND}); "
        f"input embedder {embedder}; windows split over cp1: {windows.split_over_columns}",
    )
