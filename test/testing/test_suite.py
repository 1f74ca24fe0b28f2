"""The suite runner: bounded parts that kill their whole process tree, counts from JUnit."""

import os
import sys
import textwrap
import time

import psutil

from physicsnemo_foldcp.testing import suite
from physicsnemo_foldcp.testing.progress import PROGRESS_DIR_ENV, progress_file
from physicsnemo_foldcp.testing.suite import PartResult, run_part, summarize


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# A silent launcher: it starts a worker in a session of its own (as torchrun does), writes
# what rank 0 is doing to the progress file given, and both sleep without printing. It
# imports nothing heavy, so it is running long before the bound.
SILENT_LAUNCHER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    worker = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True
    )
    with open(sys.argv[1], "w") as f:
        f.write(f"{os.getpid()} {worker.pid}")
    with open(sys.argv[2], "w") as f:
        f.write("test_x.py::test_hangs (call)")
    time.sleep(600)
    """
)


def test_a_silent_part_is_killed_at_its_bound_with_its_detached_workers(tmp_path):
    pids_file = tmp_path / "pids"
    progress = tmp_path / "reports" / "progress"  # where run_part points the plugin
    start = time.monotonic()
    result = run_part(
        "silent",
        [sys.executable, "-c", SILENT_LAUNCHER, str(pids_file), str(progress_file(progress, 0))],
        ranks=[0, 1],
        report_dir=tmp_path / "reports",
        timeout_s=8,
        env=dict(os.environ),
    )
    elapsed = time.monotonic() - start
    launcher, worker = map(int, pids_file.read_text().split())
    assert result.timed_out and not result.ok
    assert 8 <= elapsed < 8 + 30, elapsed
    assert _gone(launcher) and _gone(worker)
    assert result.notes[1:3] == [
        "  rank 0: test_x.py::test_hangs (call)",
        "  rank 1: no progress written (pytest not started)",
    ]
    assert result.missing_reports == [0, 1]


# A launcher that ends on its own: rank 0 reports a failed test, rank 1 writes no report
# and was last seen in a test (its progress file says which).
HALF_REPORTED_LAUNCHER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    template = sys.argv[-1].removeprefix("--junitxml=")
    Path(template.replace("{rank}", "0")).write_text(
        '<testsuites><testsuite><testcase classname="t" name="a"/>'
        '<testcase classname="t" name="b"><failure message="broken group"/></testcase>'
        '</testsuite></testsuites>'
    )
    Path(sys.argv[1]).write_text("test_x.py::test_stuck (call)")
    sys.exit(1)
    """
)


def test_a_rank_without_report_is_named_with_its_last_test_and_the_first_failure(tmp_path):
    progress = tmp_path / "reports" / "progress"
    result = run_part(
        "half",
        [sys.executable, "-c", HALF_REPORTED_LAUNCHER, str(progress_file(progress, 1))],
        ranks=[0, 1],
        report_dir=tmp_path / "reports",
        timeout_s=60,
        env=dict(os.environ),
    )
    assert not result.timed_out and not result.ok and result.missing_reports == [1]
    assert result.notes == [
        "no readable JUnit report from rank(s) 1; last in:",
        "  rank 1: test_x.py::test_stuck (call)",
        "first failure: t.b on rank 0: broken group",
    ]


def test_closing_line_and_status_follow_the_parts(capsys):
    passed = PartResult("serial", 0, 1.0, {"passed": 5, "failed": 0, "skipped": 2})
    failed = PartResult("world 4", 1, 1.0, {"passed": 3, "failed": 2, "skipped": 0})
    timed_out = PartResult("world 6", -9, 9.0, {}, timed_out=True, missing_reports=[0])
    nothing_ran = PartResult("world 8", 5, 1.0, {"passed": 0, "failed": 0, "skipped": 1})
    assert summarize([passed]) == ("suite: 5 passed, 0 failed, 2 skipped", 0)
    assert summarize([passed, failed]) == ("suite: 8 passed, 2 failed, 2 skipped", 1)
    assert summarize([passed, timed_out]) == ("suite: 5 passed, 1 failed, 2 skipped", 1)
    assert summarize([nothing_ran]) == ("suite: 0 passed, 1 failed, 1 skipped", 1)
    assert summarize([]) == ("suite: 0 passed, 0 failed, 0 skipped", 1)
    assert "TIMED OUT" in capsys.readouterr().out


def test_serial_part_counts_come_from_its_junit_report(tmp_path, capsys, monkeypatch):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_mixed.py").write_text(
        "import pytest\n"
        "def test_passes():\n    pass\n"
        "def test_fails():\n    assert False\n"
        "def test_skips():\n    pytest.skip('not here')\n"
    )
    monkeypatch.chdir(tmp_path)
    status = suite.main(["--worlds", "--tests", "tests", "--log-dir", "logs"])
    out = capsys.readouterr().out
    assert status == 1
    assert out.rstrip().splitlines()[-1] == "suite: 1 passed, 1 failed, 1 skipped"
    assert "first failure: tests.test_mixed.test_fails on rank 0: assert False" in out, out
    assert (tmp_path / "logs" / "serial" / "junit" / "rank0.xml").is_file()


HANG_BOUND_S = 40
"""Bound of the hanging part, in seconds."""

HANGING_TEST = textwrap.dedent(
    """
    import os, time
    from pathlib import Path
    import pytest

    @pytest.mark.multigpu_static
    def test_hangs_silently():
        Path(os.environ["FOLDCP_TEST_PID_DIR"], os.environ["RANK"]).write_text(str(os.getpid()))
        time.sleep(600)
    """
)


def test_a_silent_distributed_hang_kills_launcher_and_workers_and_names_the_test(
    tmp_path, capsys, monkeypatch
):
    """Two ranks hang without output; the part stops at its bound with no worker left.

    The bound (40 s) leaves time for torchrun and both workers to start on a busy machine.
    """
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_hang.py").write_text(HANGING_TEST)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    monkeypatch.setenv("FOLDCP_TEST_PID_DIR", str(pid_dir))
    monkeypatch.delenv(PROGRESS_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    start = time.monotonic()
    status = suite.main(
        ["--no-serial", "--worlds", "2", "--tests", "tests", "--log-dir", "logs",
         "--part-timeout", str(HANG_BOUND_S)]
    )  # fmt: skip
    elapsed = time.monotonic() - start
    out = capsys.readouterr().out
    assert status == 1
    assert elapsed < HANG_BOUND_S + 40, elapsed
    for rank in (0, 1):
        assert f"rank {rank}: tests/test_hang.py::test_hangs_silently (call)" in out, out
        assert _gone(int((pid_dir / str(rank)).read_text()))
    assert out.rstrip().splitlines()[-1] == "suite: 0 passed, 1 failed, 0 skipped"
    children_after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert children_after <= children_before, "the torchrun launcher is still running"
