"""The gradient-reduction benchmark at a tiny size: fewer collectives, the same gradients."""

import sys
from pathlib import Path

import pytest

from physicsnemo_foldcp.testing import collective_assert

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

pytest.importorskip("boltz.model.modules.trunkv2")

from benchmarks.bench_grad_buckets import GRAD_RTOL, run, write_results  # noqa: E402
from benchmarks.bench_trunk import SMOKE, SMOKE_TOKENS  # noqa: E402

N = SMOKE_TOKENS
SIZES = SMOKE


@pytest.mark.multigpu_static
@pytest.mark.parametrize("fold_mesh", [(1, 2, 2)], indirect=True, ids=str)
def test_buckets_cut_the_collectives_and_keep_the_gradients(fold_mesh, tmp_path):
    per_call, bucketed = run(fold_mesh, N, "auto", 3, 1, "smoke", sizes=SIZES)
    problems = []
    if not per_call["per_call_reductions"] > 0 or bucketed["per_call_reductions"] != 0:
        problems.append(
            f"per-call reductions {per_call['per_call_reductions']} -> "
            f"{bucketed['per_call_reductions']}"
        )
    if not bucketed["collectives"] < per_call["collectives"]:
        problems.append(f"collectives {per_call['collectives']} -> {bucketed['collectives']}")
    if not 0 < bucketed["bucket_reductions"] <= bucketed["buckets"]:
        problems.append(f"{bucketed['bucket_reductions']} reductions of {bucketed['buckets']}")
    if not bucketed["grad_rel_diff"] <= GRAD_RTOL:
        problems.append(f"gradients differ by {bucketed['grad_rel_diff']:.1e}")
    if fold_mesh.rank == 0:
        written = write_results([per_call, bucketed], tmp_path, "smoke")
        missing = [str(p) for p in written if not p.is_file()]
        if missing or "| bucketed |" not in (tmp_path / "grad_buckets.md").read_text():
            problems.append(f"results not written: {missing}")
    collective_assert(not problems, "; ".join(problems))
