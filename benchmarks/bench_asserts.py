"""Benchmark 8: the cost of one collective assert when every rank passes.

    torchrun --standalone --nproc-per-node 9 benchmarks/bench_asserts.py --calls 200

The distributed tests call :func:`physicsnemo_foldcp.testing.asserts.gather_failures` four
to six times per test (each ``collective_assert`` and the plugin's shared setup, call and
teardown outcome). When every rank passes it sums a one-element flag; an object all-gather
of the ranks' ``None`` (what it did before) is timed beside it, in alternating rounds.
Rank 0 prints the milliseconds per call and writes ``results/asserts.md``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch.distributed as dist

import physicsnemo_foldcp as fc
from physicsnemo_foldcp.testing.asserts import gather_failures

try:
    from benchmarks import common
except ImportError:  # run as a script: benchmarks/ is not a package on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import common

COLUMNS = (("method", "method"), ("ranks", "ranks"), ("ms", "ms per call (median round)"))


def _object_gather() -> None:
    gathered: list[None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, None)


METHODS: dict[str, Callable[[], object]] = {
    "gather_failures (flag)": lambda: gather_failures(None),
    "all_gather_object of None": _object_gather,
}
"""What is timed: the assert as it is, and the object all-gather it replaces."""


def time_calls(fn: Callable[[], object], calls: int) -> float:
    """Seconds per call of ``fn`` over ``calls`` calls, started together after a barrier."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def main(argv: Sequence[str] | None = None) -> int:
    """Time every method in ``--rounds`` alternating rounds; rank 0 writes the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--results", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    mesh = fc.init_mesh(ddp=-1, cp=(1, 1))
    command = common.launch_command("bench_asserts.py", mesh.world_size, argv)
    rounds: dict[str, list[float]] = {name: [] for name in METHODS}
    try:
        for _ in range(args.rounds):
            for name, fn in METHODS.items():
                rounds[name].append(time_calls(fn, args.calls))
        if mesh.rank == 0:
            rows = [
                {"method": name, "ranks": mesh.world_size, "ms": 1e3 * common.median(times)}
                for name, times in rounds.items()
            ]
            for row in rows:
                print(f"{row['method']}: {row['ms']:.2f} ms per call on {row['ranks']} ranks")
            path = common.write_markdown(
                args.results / "asserts.md",
                "Collective asserts: cost of a passing check",
                [
                    ("Table", common.markdown_table(COLUMNS, rows)),
                    ("Last launch", common.environment(command, "cpu")),
                ],
            )
            print(f"wrote {path}")
    finally:
        fc.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
