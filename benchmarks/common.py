"""Measurement helpers shared by the benchmark scripts: timing, peak memory, tables, plots.

Timing
    :func:`time_collective` runs a callable on every rank between a barrier and a
    device synchronisation and returns the largest wall time over the ranks (the time the
    slowest rank needed), and the CPU time the ranks' processes spent in it, summed over
    the ranks and on the busiest rank: on a shared machine wall time depends on what else
    runs, CPU time much less; the busiest rank's CPU time is about the least wall time a
    run could take with a core per rank. Scripts take the median of several runs.

Peak memory (:class:`PeakMemory`)
    On CUDA: ``torch.cuda.max_memory_allocated()`` during the block minus
    ``torch.cuda.memory_allocated()`` at its start. On CPU there is no allocator counter,
    so the block runs under ``torch.profiler`` with ``profile_memory=True``: every
    allocation and free of a tensor on the CPU allocator in this thread is recorded with
    its size and address, and the peak is the largest running sum of those events. A
    buffer freed in another thread (a gloo collective's) has no free event; when its
    address is handed out again it counts as freed from then on. Both count tensor
    storage allocated during the block and still or transiently alive, including the
    tensors that object collectives (``all_gather_object``) pickle into; neither counts
    Python objects, interpreter or library memory (that is the fixed overhead).
    ``PeakMemory.mark(name)`` cuts the block into segments with a peak each (on CPU a
    profiler annotation at the cut, on CUDA a read and reset of the allocator's peak).

Resident memory (:class:`PeakRss`, CPU only, secondary)
    The Linux peak-RSS counter (``VmHWM``) is reset through ``/proc/self/clear_refs``
    before the block; the figure is ``VmHWM`` after it minus ``VmRSS`` before it. glibc
    is told (``mallopt``) to serve every allocation above 64 KiB by ``mmap`` so that
    freed tensors go back to the system and do not hide later ones.

Results
    :func:`write_markdown` writes one table; :func:`merge_summary` merges rows into
    ``results/summary.json`` (keyed rows per benchmark) and re-renders
    ``results/summary.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

RESULTS = Path(__file__).resolve().parent / "results"
"""Default folder of the tables and plots."""

_M_MMAP_THRESHOLD = -3


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Timing:
    """One timed collective run.

    Attributes
    ----------
    wall : float
        Largest wall time over the ranks, seconds.
    cpu_total : float
        CPU seconds (user + system, all threads) of the ranks' processes, summed.
    cpu_busiest : float
        CPU seconds of the rank that used the most.
    result : Any
        What the timed callable returned on this rank.
    """

    wall: float
    cpu_total: float
    cpu_busiest: float
    result: Any


def time_collective(
    fn: Callable[[], Any], device: torch.device, group: dist.ProcessGroup | None = None
) -> Timing:
    """Run ``fn`` on every rank of ``group`` and time it (the same figures on every rank).

    Parameters
    ----------
    fn : callable
        What to time; called once on every rank.
    device : torch.device
        This rank's device (synchronised before and after; the reductions run there).
    group : ProcessGroup, optional
        Ranks that take part; the world by default.

    Returns
    -------
    Timing
        Wall time (max over ranks), CPU time (sum and max over ranks), and the result.
    """
    synchronize(device)
    dist.barrier(group=group)
    start, cpu_start = time.perf_counter(), time.process_time()
    result = fn()
    synchronize(device)
    wall = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    cpu = time.process_time() - cpu_start
    total = torch.tensor([cpu], dtype=torch.float64, device=device)
    busiest = torch.tensor([cpu], dtype=torch.float64, device=device)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(busiest, op=dist.ReduceOp.MAX, group=group)
    return Timing(float(wall.item()), float(total.item()), float(busiest.item()), result)


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence."""
    return float(statistics.median(values))


def machine_threads() -> int:
    """The cores this process may use (a serial CPU run's intra-op threads)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


@contextlib.contextmanager
def whole_machine(device: torch.device) -> Iterator[int | None]:
    """Run a serial reference with every core on CPU (torchrun gives each of several ranks
    one thread: together they use the machine, and so must the serial run it is compared
    with); yields the thread count (``None`` off CPU, where nothing changes)."""
    if device.type != "cpu":
        yield None
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(machine_threads())
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 (the profiler's start/stop lines come from C++)."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def segment_peaks(
    allocations: Sequence[tuple[int, int, int]],
    marks: Sequence[tuple[int, str]],
    first: str,
) -> tuple[int, dict[str, int]]:
    """Peak of the running sum of allocator events, overall and per segment.

    Parameters
    ----------
    allocations : Sequence[tuple[int, int, int]]
        ``(time ns, bytes, address)``: an allocation (bytes > 0) or a free (bytes < 0).
        A profiler sees the allocator's events of its own thread only: a buffer freed in
        another thread (a gloo collective's) has no free event, and its address comes
        back in a later allocation. A block handed out at an address still counted live
        was freed before, so its bytes are taken off at that allocation.
    marks : Sequence[tuple[int, str]]
        ``(time ns, name)``: from that time on, events belong to segment ``name``.
    first : str
        Name of the segment before the first mark.

    Returns
    -------
    peak : int
        The largest running sum.
    segments : dict[str, int]
        The largest running sum within each segment (a name marked twice keeps the
        larger), in order of first appearance.
    """
    timeline = [(t, 1, size, address, "") for t, size, address in allocations]
    timeline += [(t, 0, 0, 0, name) for t, name in marks]
    live_blocks: dict[int, int] = {}
    segment, live, peak = first, 0, 0
    segments = {segment: 0}
    # at one time: marks, then frees, then allocations
    for _, kind, size, address, name in sorted(timeline, key=lambda e: (e[0], e[1], e[2])):
        if kind == 0:
            segment = name
            segments.setdefault(segment, live)
            continue
        if size > 0:
            live -= live_blocks.get(address, 0)  # freed out of the profiler's sight
            live_blocks[address] = size
        else:
            live_blocks.pop(address, None)
        live += size
        peak = max(peak, live)
        segments[segment] = max(segments[segment], live)
    return peak, segments


class PeakMemory:
    """Peak bytes of tensors allocated inside a ``with`` block on this rank (see module doc).

    :meth:`mark` cuts the block into named segments, each with its own peak: the largest
    bytes alive (allocated since the block began) at any moment between its mark and the
    next.

    Parameters
    ----------
    device : torch.device
        Where the block computes.
    first : str, default "block"
        Name of the segment before the first :meth:`mark`.

    Attributes
    ----------
    peak : int
        Bytes, set on exit.
    segments : dict[str, int]
        Peak bytes of each segment, in order, set on exit (a name marked twice keeps the
        larger).
    source : str
        ``"cuda allocator"`` or ``"cpu allocator (profiler)"``.
    """

    _MARK = "peak-memory-segment:"

    def __init__(self, device: torch.device, first: str = "block"):
        self.device = device
        self.peak = 0
        self.segments: dict[str, int] = {}
        self.source = "cuda allocator" if device.type == "cuda" else "cpu allocator (profiler)"
        self._profiler: torch.profiler.profile | None = None
        self._start = 0
        self._first = first
        self._segment = first

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            self._profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
            )
            with _quiet_stderr():
                self._profiler.__enter__()
        return self

    def mark(self, name: str) -> None:
        """End the current segment and start one called ``name``."""
        if self.device.type == "cuda":
            self._close_cuda_segment()
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            with torch.profiler.record_function(self._MARK + name):
                pass
        self._segment = name

    def _close_cuda_segment(self) -> None:
        synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - self._start
        self.segments[self._segment] = max(self.segments.get(self._segment, 0), peak)

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            self._close_cuda_segment()
            self.peak = max(self.segments.values())
            return
        assert self._profiler is not None
        with _quiet_stderr():
            self._profiler.__exit__(*exc)
        from physicsnemo_foldcp.core import compat

        marks = [
            (e.start_ns(), e.name()[len(self._MARK) :])
            for e in self._profiler.profiler.kineto_results.events()
            if e.name().startswith(self._MARK)
        ]
        allocations = compat.profiled_cpu_allocations(self._profiler)
        self.peak, self.segments = segment_peaks(allocations, marks, self._first)
        # the recorded events hold every allocation of the block: let them go now, or
        # several profiled steps per rank add up to gigabytes of host memory per process
        self._profiler = None


def use_mmap_for_large_allocations(threshold: int = 1 << 16) -> bool:
    """Ask glibc to ``mmap`` (and so return on free) every allocation above ``threshold``.

    Returns
    -------
    bool
        Whether the setting was applied (False off glibc).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(threshold)))
    except (OSError, AttributeError):
        return False


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakRss:
    """Growth of the resident set during a ``with`` block (Linux; ``None`` elsewhere).

    Attributes
    ----------
    growth : int or None
        ``VmHWM`` after the block minus ``VmRSS`` before it, in bytes.
    """

    def __init__(self) -> None:
        self.growth: int | None = None
        self._before: int | None = None

    def __enter__(self) -> PeakRss:
        try:
            with open("/proc/self/clear_refs", "w") as refs:
                refs.write("5")
            self._before = _status_kib("VmRSS")
        except OSError:
            self._before = None
        return self

    def __exit__(self, *exc: object) -> None:
        after = _status_kib("VmHWM")
        if self._before is not None and after is not None:
            self.growth = max(0, after - self._before) * 1024


def gather_rows(item: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """All-gather one picklable object per rank (in rank order)."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, item, group=group)
    return out


def fmt(value: Any, digits: int = 3) -> str:
    """Table cell: floats to ``digits`` decimals (in ``1.2e-07`` form where that would show
    a non-zero value as zero), ``None`` to ``-``."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if value and abs(value) < 0.5 * 10**-digits:
            return f"{value:.1e}"
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(columns: Sequence[tuple[str, str]], rows: Iterable[Mapping[str, Any]]) -> str:
    """A markdown table; ``columns`` are ``(key, header)`` pairs."""
    lines = [
        "| " + " | ".join(h for _, h in columns) + " |",
        "|" + "---|" * len(columns),
    ]
    for row in rows:
        lines.append("| " + " | ".join(fmt(row.get(k)) for k, _ in columns) + " |")
    return "\n".join(lines)


def write_markdown(path: Path, title: str, sections: Sequence[tuple[str, str]]) -> Path:
    """Write ``# title`` then each ``(heading, body)`` section; returns the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    parts = [f"# {title}", ""]
    for heading, body in sections:
        parts += [f"## {heading}", "", body, ""]
    path.write_text("\n".join(parts))
    return path


def _sort_key(value: Any) -> tuple[int, Any]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (0, value)
    return (1, str(value))


def merge_summary(
    benchmark: str,
    rows: Sequence[Mapping[str, Any]],
    key: Sequence[str],
    columns: Sequence[tuple[str, str]],
    results: Path = RESULTS,
    *,
    replace: bool = False,
    first: bool = False,
) -> Path:
    """Merge ``rows`` into ``results/summary.json`` and re-render ``results/summary.md``.

    Rows of ``benchmark`` with the same values of ``key`` are replaced (with ``replace``,
    all of its rows); other rows and other benchmarks' sections are kept. A section stored
    with ``first`` comes before the others in the markdown (the others by name).

    Returns
    -------
    Path
        The markdown summary.
    """
    results.mkdir(parents=True, exist_ok=True)
    store_path = results / "summary.json"
    store: dict[str, Any] = json.loads(store_path.read_text()) if store_path.exists() else {}
    section = store.setdefault(benchmark, {"columns": [], "rows": []})
    section["columns"] = [list(c) for c in columns]
    section["key"] = list(key)
    section["first"] = first
    fresh = {tuple(r.get(k) for k in key) for r in rows}
    kept = [r for r in section["rows"] if not replace and tuple(r.get(k) for k in key) not in fresh]
    merged = kept + [dict(r) for r in rows]
    section["rows"] = sorted(merged, key=lambda r: tuple(_sort_key(r.get(k)) for k in key))
    store_path.write_text(json.dumps(store, indent=1, sort_keys=True))
    body = []
    for name in sorted(store, key=lambda name: (not store[name].get("first"), name)):
        sec = store[name]
        cols = [tuple(c) for c in sec["columns"]]
        body.append((name, markdown_table(cols, sec["rows"])))
    return write_markdown(results / "summary.md", "Benchmark summary", body)


def load_average() -> str:
    """The 1, 5 and 15 minute load averages as ``"a, b, c"`` (``"n/a"`` where unknown)."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return ", ".join(f"{x:.1f}" for x in load) if load else "n/a"


def environment(command: str, device: str) -> str:
    """Markdown paragraph naming the launch command, torch, machine, device and load."""
    return (
        f"command: `{command}`\n\n"
        f"torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} CPU cores, "
        f"device {device}, load average at the end {load_average()}"
    )


def save_figure(fig: Any, path: Path, dpi: int = 100) -> Path:
    """Lay out ``fig``, write it to ``path`` (creating its folder) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


# -- command lines ---------------------------------------------------------------------------


def add_output_arguments(parser: argparse.ArgumentParser, timeout_s: float = 900.0) -> None:
    """Add ``--results`` (folder of tables and plots) and ``--timeout`` (collectives, s)."""
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--timeout", type=float, default=timeout_s, help="collective timeout, s")


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--no-serial-check``, ``--no-serial-time`` and ``--no-memory`` of the
    training-step benchmarks."""
    parser.add_argument("--no-serial-check", action="store_true", help="skip the serial loss")
    parser.add_argument(
        "--no-serial-time", action="store_true", help="skip timing the serial module"
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the memory step")


STEP_TIME_TARGETS = {"1x1": 1.1, "2x2": 1.0}
"""Largest step time over the serial Boltz module's (one launch, medians) per mesh."""


def step_time_lines(
    rows: Iterable[Mapping[str, Any]],
    label: Callable[[Mapping[str, Any]], str],
    unit: str,
    this: str,
    serial: str,
    ratio: str,
) -> str:
    """One line per row with a serial timing: this mesh's step, the serial module's, their
    ratio and the verdict against :data:`STEP_TIME_TARGETS` (rows of other meshes: no
    verdict)."""
    lines = []
    for r in rows:
        if not r.get(serial):
            continue
        target = STEP_TIME_TARGETS.get(r["mesh"])
        verdict = (
            f", target <= {target:.1f}: {'met' if r[ratio] <= target else 'NOT met'}"
            if target is not None and r.get(ratio) is not None
            else ""
        )
        lines.append(
            f"- {label(r)}: step {fmt(r.get(this))} {unit} ({r.get('threads')} thread(s) per "
            f"process), serial Boltz {fmt(r.get(serial))} {unit} "
            f"({r.get('serial_threads') or '-'} thread(s)), ratio {fmt(r.get(ratio))}{verdict}"
        )
    return "\n".join(lines) or "no row with a serial timing"


def add_sweep_arguments(parser: argparse.ArgumentParser, tokens: Sequence[int]) -> None:
    """Add ``--cp`` (default: the square mesh), ``--tokens``, ``--repeats`` and ``--seed``."""
    parser.add_argument("--cp", type=int, nargs=2, default=None, metavar=("CP0", "CP1"))
    parser.add_argument("--tokens", type=int, nargs="+", default=list(tokens))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)


def cp_shape(cp: Sequence[int] | None) -> tuple[int, int]:
    """``--cp`` when given, else the square ``s x s`` mesh of ``WORLD_SIZE = s^2`` ranks."""
    if cp:
        return int(cp[0]), int(cp[1])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    side = math.isqrt(world)
    if side * side != world:
        raise SystemExit(f"world size {world} is not a square: pass --cp CP0 CP1")
    return side, side


def launch_command(script: str, world_size: int, argv: Sequence[str] | None) -> str:
    """The ``torchrun`` command that reproduces this run of ``benchmarks/<script>``."""
    args = " ".join(sys.argv[1:] if argv is None else argv)
    return f"torchrun --standalone --nproc-per-node {world_size} benchmarks/{script} {args}"


def tensor_bytes(tensors: Iterable[Any]) -> int:
    """Bytes this rank holds of ``tensors`` (a ShardTensor's local block; each storage once).

    Parameters
    ----------
    tensors : Iterable
        Tensors (plain or ShardTensor); other items are skipped.

    Returns
    -------
    int
        Sum of ``numel * element_size`` of the distinct local tensors.
    """
    from physicsnemo.domain_parallel import ShardTensor

    from physicsnemo_foldcp.core import compat

    seen: set[int] = set()
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        local = compat.local_tensor(t) if isinstance(t, ShardTensor) else t
        if id(local) in seen:
            continue
        seen.add(id(local))
        total += local.numel() * local.element_size()
    return total


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value`` and its nested lists, tuples and mappings, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in tensors_in(v)]
    return []
