"""Run the whole test suite: single-process tests, then distributed tests per world size.

Usage (from the repository root)::

    python -m physicsnemo_foldcp.testing.suite                # serial + worlds 4, 6, 8, 9
    python -m physicsnemo_foldcp.testing.suite --worlds 4     # serial + world 4
    python -m physicsnemo_foldcp.testing.suite --no-serial --worlds 9 -- -k scatter

Each distributed part is one ``torchrun --standalone`` session of pytest with
``--multigpu-static -m multigpu_static``; rank 0's output is shown, every rank's output is
kept under ``--log-dir``. Every part has a wall-clock bound. The last line sums the parts
as ``suite: N passed, N failed, N skipped``; the exit status is non-zero if any part
failed, timed out or ran no test.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)")
_SUMMARY = re.compile(r"^(=+ )?(\d+ \w+(, )?)+( in [\d.]+s| =+)|no tests ran")


@dataclass
class PartResult:
    """Outcome of one pytest session (serial, or one world size)."""

    name: str
    returncode: int
    seconds: float
    counts: dict[str, int] = field(default_factory=dict)
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        """Whether the part exited 0 and ran at least one test."""
        return self.returncode == 0 and self.counts.get("passed", 0) > 0 and not self.timed_out


def _parse_counts(line: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for number, word in _COUNT.findall(line):
        key = "errors" if word.startswith("error") else word
        counts[key] = counts.get(key, 0) + int(number)
    return counts


def _run(name: str, cmd: list[str], timeout_s: float, env: dict[str, str]) -> PartResult:
    print(f"\n### {name}: {' '.join(cmd)}", flush=True)
    start = time.monotonic()
    counts: dict[str, int] = {}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1
    )
    timed_out = False
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            if _SUMMARY.search(line.strip().split("]:", 1)[-1].strip()):
                counts = _parse_counts(line)
            if time.monotonic() - start > timeout_s:
                timed_out = True
                break
        remaining = max(1.0, timeout_s - (time.monotonic() - start))
        proc.wait(timeout=remaining)
    except subprocess.TimeoutExpired:
        timed_out = True
    if timed_out:
        proc.kill()
        proc.wait()
        print(f"### {name}: killed after {timeout_s:.0f} s", flush=True)
    sys.stdout.flush()
    return PartResult(name, proc.returncode, time.monotonic() - start, counts, timed_out)


def _show_failed_rank_logs(log_dir: Path, lines: int = 40) -> None:
    for log in sorted(log_dir.rglob("stderr.log")) + sorted(log_dir.rglob("stdout.log")):
        text = log.read_text(errors="replace").splitlines()
        if any("Error" in t or "FAILED" in t for t in text[-lines:]):
            print(f"--- tail of {log}")
            print("\n".join(text[-lines:]))


def main(argv: list[str] | None = None) -> int:
    """Run the suite; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="*", default=[4, 6, 8, 9])
    parser.add_argument("--no-serial", action="store_true", help="skip the serial part")
    parser.add_argument("--tests", default="test", help="test directory or files")
    parser.add_argument("--part-timeout", type=float, default=900.0, help="seconds per part")
    parser.add_argument("--test-timeout", type=float, default=600.0, help="seconds per test")
    parser.add_argument("--log-dir", default="test-logs")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)

    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    common = ["-q", "-p", "no:cacheprovider", f"--timeout={args.test_timeout:.0f}"]
    results: list[PartResult] = []
    if not args.no_serial:
        cmd = [sys.executable, "-m", "pytest", args.tests, "-m", "not multigpu_static"]
        results.append(_run("serial", cmd + common + args.pytest_args, args.part_timeout, env))
    for world in args.worlds:
        log_dir = Path(args.log_dir) / f"world{world}"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={world}", "--local-ranks-filter=0", "--tee=3",
            f"--log-dir={log_dir}", "-m", "pytest", args.tests,
            "--multigpu-static", "-m", "multigpu_static", "--timeout-method=thread",
        ]  # fmt: skip
        result = _run(f"world {world}", cmd + common + args.pytest_args, args.part_timeout, env)
        results.append(result)
        if not result.ok:
            _show_failed_rank_logs(log_dir)

    print("\n### summary")
    total = {"passed": 0, "failed": 0, "skipped": 0}
    for r in results:
        failed = r.counts.get("failed", 0) + r.counts.get("errors", 0)
        total["passed"] += r.counts.get("passed", 0)
        total["failed"] += failed + (0 if r.ok or failed else 1)
        total["skipped"] += r.counts.get("skipped", 0)
        state = "ok" if r.ok else ("TIMED OUT" if r.timed_out else f"FAILED (exit {r.returncode})")
        detail = ", ".join(f"{n} {k}" for k, n in r.counts.items()) or "no test summary"
        print(f"{r.name:>10}: {state:<18} {detail} in {r.seconds:.0f} s")
    print(f"suite: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped")
    return 0 if results and all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
