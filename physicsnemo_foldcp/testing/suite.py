"""Run the whole test suite: single-process tests, then distributed tests per world size.

Usage (from the repository root)::

    python -m physicsnemo_foldcp.testing.suite                # serial + worlds 4, 6, 8, 9
    python -m physicsnemo_foldcp.testing.suite --worlds 4     # serial + world 4
    python -m physicsnemo_foldcp.testing.suite --no-serial --worlds 9 -- -k scatter

Each distributed part is one ``torchrun --standalone`` session of pytest with
``--multigpu-static -m multigpu_static``; rank 0's output is shown, every rank's output is
kept under ``--log-dir``. Each part writes one JUnit XML report per rank
(``<log-dir>/<part>/junit/rank<r>.xml``), and the counts come from those reports. Every
part has a wall-clock bound that holds whether or not it prints: past it, the launcher,
its workers and everything they started are killed, and the test (and phase) each rank
was in is printed. The last line sums the parts as ``suite: N passed, N failed, N
skipped``; the exit status is non-zero if any part failed, timed out or ran no test.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from physicsnemo_foldcp.testing.junit import (
    OUTCOMES,
    RANK_PLACEHOLDER,
    count_outcomes,
    first_failure,
    merge_outcomes,
    read_reports,
)
from physicsnemo_foldcp.testing.processes import kill_group, kill_tree
from physicsnemo_foldcp.testing.progress import PROGRESS_DIR_ENV, read_progress

PLUGIN = "physicsnemo_foldcp.testing.plugin"
_OUTPUT_DRAIN_S = 10.0
_MESSAGE_CHARS = 300
"""Characters of the first failure's message shown in the summary."""


@dataclass
class PartResult:
    """Outcome of one pytest session (serial, or one world size).

    Attributes
    ----------
    name : str
        ``"serial"`` or ``"world <n>"``.
    returncode : int
        Exit status of the pytest (or ``torchrun``) process; negative if it was killed.
    seconds : float
        Wall-clock time of the part.
    counts : dict[str, int]
        ``{"passed": n, "failed": n, "skipped": n}`` from the JUnit reports, each test
        counted once over all ranks (:mod:`physicsnemo_foldcp.testing.junit`).
    timed_out : bool
        Whether the part ran past its bound and was killed.
    notes : list[str]
        What went wrong beyond the counts: the test each rank was in when the part was
        killed, ranks that wrote no report.
    missing_reports : list[int]
        Ranks whose JUnit report is missing or unreadable.
    """

    name: str
    returncode: int
    seconds: float
    counts: dict[str, int] = field(default_factory=dict)
    timed_out: bool = False
    notes: list[str] = field(default_factory=list)
    missing_reports: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether the part exited 0, ran at least one test and every rank reported."""
        return (
            self.returncode == 0
            and not self.timed_out
            and not self.missing_reports
            and self.counts.get("passed", 0) > 0
            and self.counts.get("failed", 0) == 0
        )


def _copy_output(stream: IO[str]) -> None:
    for line in stream:
        sys.stdout.write(line)
    sys.stdout.flush()


def _describe_progress(progress_dir: Path, ranks: Sequence[int]) -> list[str]:
    states = read_progress(progress_dir)
    unknown = "no progress written (pytest not started)"
    return [f"rank {rank}: {states.get(rank, unknown)}" for rank in ranks]


def run_part(
    name: str,
    cmd: Sequence[str],
    *,
    ranks: Sequence[int],
    report_dir: Path,
    timeout_s: float,
    env: dict[str, str],
) -> PartResult:
    """Run one pytest session in its own process group, bounded by ``timeout_s``.

    Parameters
    ----------
    name : str
        Name of the part, for the output.
    cmd : Sequence[str]
        The pytest (or ``torchrun ... -m pytest``) command; ``--junitxml`` is appended.
    ranks : Sequence[int]
        Global ranks the command runs (``[0]`` for a single process).
    report_dir : Path
        Directory for this part's JUnit reports (``junit/rank<r>.xml``) and progress
        files (``progress/``); both are emptied first.
    timeout_s : float
        Wall-clock bound in seconds, whether or not the part prints anything.
    env : dict[str, str]
        Environment of the command; the progress directory is added to it.

    Returns
    -------
    PartResult
        Exit status, time, counts from the JUnit reports and what went wrong.
    """
    junit_dir, progress_dir = report_dir / "junit", report_dir / "progress"
    for directory in (junit_dir, progress_dir):
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
    template = str(junit_dir / f"rank{RANK_PLACEHOLDER}.xml")
    cmd = [*cmd, f"--junitxml={template}"]
    print(f"\n### {name}: {' '.join(cmd)}", flush=True)
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**env, PROGRESS_DIR_ENV: str(progress_dir)},
        start_new_session=True,
    )
    assert proc.stdout is not None
    reader = threading.Thread(target=_copy_output, args=(proc.stdout,), daemon=True)
    reader.start()
    notes: list[str] = []
    try:
        proc.wait(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
        running = _describe_progress(progress_dir, ranks)
        survivors = kill_tree(proc.pid)
        proc.wait(timeout=_OUTPUT_DRAIN_S)
        notes.append(f"timed out after {timeout_s:.0f} s; killed the process tree, in:")
        notes.extend(f"  {line}" for line in running)
        if survivors:
            notes.append(f"  still alive after SIGKILL: pids {survivors}")
    # Processes the part left behind in its group would keep the output pipe open.
    kill_group(proc.pid)
    reader.join(timeout=_OUTPUT_DRAIN_S)
    reports, missing = read_reports(template, ranks)
    counts = count_outcomes(merge_outcomes(reports))
    if missing and not timed_out:
        listed = ", ".join(map(str, missing))
        notes.append(f"no readable JUnit report from rank(s) {listed}; last in:")
        notes.extend(f"  {line}" for line in _describe_progress(progress_dir, missing))
    first = first_failure(reports)
    if first is not None:
        rank, case = first
        message = " ".join(case.message.split())[:_MESSAGE_CHARS]
        notes.append(f"first failure: {case.test} on rank {rank}: {message}")
    for note in notes:
        print(f"### {name}: {note}", flush=True)
    return PartResult(
        name, proc.returncode, time.monotonic() - start, counts, timed_out, notes, missing
    )


def _show_failed_rank_logs(log_dir: Path, lines: int = 40) -> None:
    for log in sorted(log_dir.rglob("stderr.log")) + sorted(log_dir.rglob("stdout.log")):
        text = log.read_text(errors="replace").splitlines()
        if any("Error" in t or "FAILED" in t for t in text[-lines:]):
            print(f"--- tail of {log}")
            print("\n".join(text[-lines:]))


def summarize(results: Sequence[PartResult]) -> tuple[str, int]:
    """Print one line per part and return the closing line and the exit status.

    Parameters
    ----------
    results : Sequence[PartResult]
        Every part that ran.

    Returns
    -------
    closing : str
        ``suite: N passed, N failed, N skipped``; a part that failed without a failed
        test (a crash, a timeout, no test run) counts as one failure.
    status : int
        0 if every part is :attr:`PartResult.ok` (and at least one ran), else 1.
    """
    total = dict.fromkeys(OUTCOMES, 0)
    for r in results:
        failed = r.counts.get("failed", 0)
        total["passed"] += r.counts.get("passed", 0)
        total["failed"] += failed + (0 if r.ok or failed else 1)
        total["skipped"] += r.counts.get("skipped", 0)
        state = "ok" if r.ok else ("TIMED OUT" if r.timed_out else f"FAILED (exit {r.returncode})")
        detail = ", ".join(f"{n} {k}" for k, n in r.counts.items() if n) or "no test reported"
        print(f"{r.name:>10}: {state:<18} {detail} in {r.seconds:.0f} s")
        for note in r.notes:
            print(f"{'':>12}{note}")
    closing = (
        f"suite: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped"
    )
    return closing, 0 if results and all(r.ok for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    """Run the suite; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="*", default=[4, 6, 8, 9])
    parser.add_argument("--no-serial", action="store_true", help="skip the serial part")
    parser.add_argument("--tests", default="test", help="test directory or files")
    parser.add_argument("--part-timeout", type=float, default=1500.0, help="seconds per part")
    parser.add_argument("--test-timeout", type=float, default=600.0, help="seconds per test")
    parser.add_argument("--log-dir", default="test-logs")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)

    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    common = ["-q", "-p", "no:cacheprovider", "-p", PLUGIN, "--foldcp-exit-at-end"]
    common += [f"--timeout={args.test_timeout:.0f}"]
    log_root = Path(args.log_dir)
    results: list[PartResult] = []
    if not args.no_serial:
        cmd = [sys.executable, "-m", "pytest", args.tests, "-m", "not multigpu_static"]
        part = run_part(
            "serial",
            cmd + common + args.pytest_args,
            ranks=[0],
            report_dir=log_root / "serial",
            timeout_s=args.part_timeout,
            env=env,
        )
        results.append(part)
    for world in args.worlds:
        log_dir = log_root / f"world{world}"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={world}", "--local-ranks-filter=0", "--tee=3",
            f"--log-dir={log_dir}", "-m", "pytest", args.tests,
            "--multigpu-static", "-m", "multigpu_static", "--timeout-method=thread",
        ]  # fmt: skip
        result = run_part(
            f"world {world}",
            cmd + common + args.pytest_args,
            ranks=range(world),
            report_dir=log_dir,
            timeout_s=args.part_timeout,
            env=env,
        )
        results.append(result)
        if not result.ok:
            _show_failed_rank_logs(log_dir)

    print("\n### summary")
    closing, status = summarize(results)
    print(closing, flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
