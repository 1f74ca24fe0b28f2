"""A refused feature file stops every rank of the job within seconds, naming the file."""

import time

import pytest
import torch.distributed as dist

from physicsnemo_foldcp.data import ShardedLoader
from physicsnemo_foldcp.data.files import FeatureFileDataset, save_sample
from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.testing import collective_assert

pytestmark = pytest.mark.multigpu_static

ERROR_BOUND_S = 30.0
"""Longest wait, from the start of the loop, for the refusal on any rank."""


@pytest.mark.parametrize("fold_mesh", [(1, 2, 2), (2, 1, 2)], indirect=True, ids=str)
def test_a_feature_file_with_nan_is_refused_on_every_rank(fold_mesh, shared_dir):
    """Sample 1 holds a NaN position: every rank raises the source's error naming it."""
    bad = shared_dir / "1.npz"
    if dist.get_rank() == 0:
        for index in range(4):
            sample = make_complex(7 + index, seed=index, msa_rows=2)
            if index == 1:
                sample["ref_pos"].view(-1)[0] = float("nan")
            save_sample(sample, shared_dir / f"{index}.npz")
    dist.barrier()
    loader = ShardedLoader(FeatureFileDataset(shared_dir), fold_mesh, mode="inference")
    start = time.monotonic()
    error = None
    try:
        for _ in loader:
            pass
    except Exception as err:  # noqa: BLE001 - examined below, on every rank
        error = err
    seconds = time.monotonic() - start
    reaches = fold_mesh.ddp_rank == 1 % fold_mesh.ddp_size  # the group that loads sample 1
    problems = []
    if reaches:
        text = str(error)
        if error is None or str(bad) not in text or "'ref_pos'" not in text or "NaN" not in text:
            problems.append(f"expected the refusal of {bad} (ref_pos NaN), got {error!r}")
        if seconds > ERROR_BOUND_S:
            problems.append(f"the refusal took {seconds:.1f} s")
    elif error is not None:
        problems.append(f"group {fold_mesh.ddp_rank} raised {error!r}")
    collective_assert(not problems, f"rank {dist.get_rank()}: " + "; ".join(problems))
