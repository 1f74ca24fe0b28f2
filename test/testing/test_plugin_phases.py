"""The plugin shares setup and teardown outcomes across ranks, not only the call's.

A generated test file runs under ``torchrun --nproc-per-node 2``: fixtures fail (or skip)
on rank 1 only, in setup and in teardown, and the test after each must run normally on
both ranks. Every test body all-gathers its own name, so a rank that ran a different test
than its peer fails the check instead of waiting.
"""

import os
import subprocess
import sys
import textwrap

from physicsnemo_foldcp.testing.junit import read_cases
from physicsnemo_foldcp.testing.processes import kill_tree
from physicsnemo_foldcp.testing.progress import PROGRESS_DIR_ENV, read_progress

WORLD = 2
LAUNCH_TIMEOUT_S = 240

PHASES_FILE = textwrap.dedent(
    """
    import pytest
    import torch.distributed as dist

    pytestmark = pytest.mark.multigpu_static


    def same_test_on_every_rank(name):
        names = [None] * dist.get_world_size()
        dist.all_gather_object(names, name)
        assert names == [name] * len(names), f"ranks ran different tests: {names}"


    @pytest.fixture
    def fails_in_setup_on_rank_1(fold_world):
        if dist.get_rank() == 1:
            raise RuntimeError("setup failure on rank 1")


    @pytest.fixture
    def skips_in_setup_on_rank_1(fold_world):
        if dist.get_rank() == 1:
            pytest.skip("skip on rank 1")


    @pytest.fixture
    def fails_in_teardown_on_rank_1(fold_world):
        yield
        if dist.get_rank() == 1:
            raise RuntimeError("teardown failure on rank 1")


    def test_setup_fails(fails_in_setup_on_rank_1):
        same_test_on_every_rank("test_setup_fails")


    def test_after_setup_failure(fold_world):
        same_test_on_every_rank("test_after_setup_failure")


    def test_setup_skips(skips_in_setup_on_rank_1):
        same_test_on_every_rank("test_setup_skips")


    def test_after_setup_skip(fold_world):
        same_test_on_every_rank("test_after_setup_skip")


    def test_teardown_fails(fails_in_teardown_on_rank_1):
        same_test_on_every_rank("test_teardown_fails")


    def test_after_teardown_failure(fold_world):
        same_test_on_every_rank("test_after_teardown_failure")
    """
)

# Test -> outcomes pytest reports for it on every rank (a passed call followed by a failed
# teardown is one failed test case), and text its failure or skip message must contain.
EXPECTED = {
    "test_setup_fails": (["failed"], "setup failure on rank 1"),
    "test_after_setup_failure": (["passed"], ""),
    "test_setup_skips": (["skipped"], "skip on rank 1"),
    "test_after_setup_skip": (["passed"], ""),
    "test_teardown_fails": (["failed"], "teardown failure on rank 1"),
    "test_after_teardown_failure": (["passed"], ""),
}


def test_setup_and_teardown_failures_on_one_rank_fail_every_rank_and_keep_ranks_in_step(
    tmp_path,
):
    (tmp_path / "test_phases.py").write_text(PHASES_FILE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", PROGRESS_DIR_ENV: str(tmp_path / "progress")}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={WORLD}", "-m", "pytest", "test_phases.py",
        "-p", "physicsnemo_foldcp.testing.plugin", "-p", "no:cacheprovider",
        "--multigpu-static", "-m", "multigpu_static", "--foldcp-timeout=30",
        "--timeout=120", "--timeout-method=thread", "--junitxml=reports/rank{rank}.xml",
    ]  # fmt: skip
    log = tmp_path / "torchrun.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            proc.wait(timeout=LAUNCH_TIMEOUT_S)
        finally:
            kill_tree(proc.pid)
    output = log.read_text(errors="replace")
    assert proc.returncode == 1, f"exit {proc.returncode}, expected 1 (tests failed):\n{output}"
    assert read_progress(tmp_path / "progress") == {0: "finished", 1: "finished"}, output
    for rank in range(WORLD):
        cases = read_cases(tmp_path / "reports" / f"rank{rank}.xml")
        outcomes: dict[str, list[str]] = {}
        for case in cases:
            outcomes.setdefault(case.test.rsplit(".", 1)[-1], []).append(case.outcome)
        assert outcomes == {test: seen for test, (seen, _) in EXPECTED.items()}, (
            f"rank {rank}: {outcomes}\n{output}"
        )
        for test, (_, text) in EXPECTED.items():
            messages = [c.message for c in cases if c.test.endswith(f".{test}")]
            assert not text or any(text in m for m in messages), f"rank {rank} {test}: {messages}"
