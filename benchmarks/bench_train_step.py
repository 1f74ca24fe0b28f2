"""Benchmark 3: one training step of the reference model, time and memory per rank, per mesh.

    torchrun --standalone --nproc-per-node 1 benchmarks/bench_train_step.py --tokens 64 128 256
    torchrun --standalone --nproc-per-node 4 benchmarks/bench_train_step.py --tokens 64 128 256
    torchrun --standalone --nproc-per-node 9 benchmarks/bench_train_step.py --tokens 64 128 256

One launch per mesh (``--cp``, by default the square mesh of the world size: 1x1, 2x2,
3x3). For each ``N`` a synthetic Boltz-2 sample (``make_complex``, batched) is scattered
over the mesh (``scatter_features``, which tags the atom<->token maps) and its batch axis
checked as the training loop does (``check_batch``); the reference model
(``ReferenceFoldModel``, seeded the same on every rank) is moved to the device and wrapped
by ``wrap_model`` (synced over the domain group), its optimizer built by
``build_optimizer``; a step is what :func:`physicsnemo_foldcp.training.train` does per
sample: ``zero_grad(set_to_none=True)``, ``forward_backward`` (forward, the reference
distogram loss, backward), ``optimizer.step()``, ``loss_value``.

Measured per launch and ``N``:

* **loss** of the first step (the initial parameters), and the serial model's loss on the
  same sample with the same initial parameters (computed on the source rank, forward only;
  ``--no-serial-check`` skips it);
* **step time**: median over ``--repeats`` steps of the largest wall time over the ranks,
  each step between a barrier and a device synchronisation (after the first step and the
  memory step, both untimed); CPU time (``time.process_time``) summed over the ranks and
  of the busiest rank beside it (on a shared machine the wall time follows the load, the
  CPU time much less);
* **memory per rank**: *held* is the tensor bytes a rank keeps between steps: its shard
  of the sample, the parameters, their gradients and the optimizer state (CPU: summed
  over those tensors; CUDA: ``torch.cuda.memory_allocated`` at the start of the step,
  every live tensor of the process); *step peak* is the peak of tensor bytes allocated
  during one step above what was live at its start
  (:class:`benchmarks.common.PeakMemory`: the CUDA allocator's peak on GPUs, the CPU
  allocator's events recorded by ``torch.profiler`` on CPU); *peak* = held + step peak,
  the largest over the ranks. Max RSS (``getrusage``, the whole process: interpreter,
  libraries) is listed as a secondary figure.

Each launch merges its rows into ``results/summary.json`` (section ``train_step``) and
rewrites ``results/train_step.md`` and ``results/train_step.png`` from every mesh's rows
there, so the 1x1 / 2x2 / 3x3 comparison is one table and one plot; the ratio columns
compare each row with the 1x1 row of the same ``N`` and model when it is present.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

try:
    from benchmarks import common
except ModuleNotFoundError:  # run as a script: the repository root is not on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import common

import physicsnemo_foldcp as fc
from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.distributed.mesh import FoldMesh
from physicsnemo_foldcp.distributed.wrappers import wrap_model
from physicsnemo_foldcp.models import ModelConfig, ReferenceFoldModel
from physicsnemo_foldcp.training.loop import (
    OptimizerSettings,
    build_optimizer,
    check_batch,
    forward_backward,
    loss_value,
    set_precision,
)

BENCHMARK = "train_step"
"""Section of ``results/summary.json`` holding every mesh's rows."""


def held_bytes(
    features: Mapping[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> int:
    """Tensor bytes of the sample shard, parameters, gradients and optimizer state."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = [v for s in optimizer.state.values() for v in s.values()]
    return common.tensor_bytes(list(features.values()) + params + grads + state)


def serial_loss(sample: Mapping[str, torch.Tensor], config: ModelConfig, seed: int) -> float:
    """The serial model's loss on the whole sample, initial parameters (forward only)."""
    torch.manual_seed(seed)
    model = ReferenceFoldModel(config)
    with torch.no_grad():
        return float(model.loss(model(**sample), sample))


def _max_rss() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def run_train_step_benchmark(
    mesh: FoldMesh,
    n_tokens: int,
    *,
    config: ModelConfig | None = None,
    repeats: int = 3,
    seed: int = 0,
    msa_rows: int = 4,
    optimizer: OptimizerSettings | None = None,
    serial_check: bool = True,
    memory: bool = True,
) -> dict[str, Any]:
    """Time and measure training steps of the reference model at one size (every rank).

    Parameters
    ----------
    mesh : FoldMesh
        The mesh (``ddp == 1``).
    n_tokens : int
        Tokens of the synthetic sample.
    config : ModelConfig, optional
        Model sizes (the defaults otherwise).
    repeats : int
        Timed steps.
    seed : int
        Seed of the sample and of the model's initial parameters.
    msa_rows : int
        MSA depth of the sample (the model does not read it).
    optimizer : OptimizerSettings, optional
        AdamW with defaults otherwise.
    serial_check : bool
        Compute the serial model's first-step loss on the source rank.
    memory : bool
        Run the memory step (profiled on CPU).

    Returns
    -------
    dict
        One row, the same on every rank: ``mesh``, ``N``, ``A``, ``loss``,
        ``serial_loss``, ``loss_diff``, ``time_s`` (median), ``times``, ``cpu_s``,
        ``busiest_cpu_s``, ``held_MiB`` / ``step_peak_MiB`` / ``peak_MiB`` (max over ranks),
        ``peak_MiB_mean``, ``rss_MiB`` (max), ``ranks`` (per-rank figures).
    """
    config = config or ModelConfig()
    cp0, cp1 = mesh.cp
    set_precision("fp32")
    sample = None
    reference = None
    if mesh.is_domain_source:
        serial = make_complex(n_tokens, seed=seed, preset="boltz2", msa_rows=msa_rows)
        sample = {k: v.unsqueeze(0) for k, v in serial.items()}
        if serial_check:
            reference = serial_loss(sample, config, seed)
    features = fc.scatter_features(sample, mesh)
    check_batch(features)
    del sample
    atoms = int(features["atom_to_token"].shape[1])

    torch.manual_seed(seed)
    model = ReferenceFoldModel(config).to(mesh.device)
    wrapped = wrap_model(model, mesh, "auto", shard_modules=model.fsdp_units)
    opt = build_optimizer(wrapped, optimizer or OptimizerSettings())
    wrapped.train()

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = forward_backward(wrapped, features, device=mesh.device)  # the model's loss
        opt.step()
        return loss_value(loss)

    first = common.time_collective(step, mesh.device)
    loss = float(first.result)
    held = step_peak = None
    if memory:
        if mesh.device.type == "cuda":
            common.synchronize(mesh.device)
            held = int(torch.cuda.memory_allocated(mesh.device))
        else:
            held = held_bytes(features, wrapped, opt)
        with common.PeakMemory(mesh.device) as peak:
            step()
        step_peak = peak.peak
    timings = [common.time_collective(step, mesh.device) for _ in range(repeats)]
    mine = {
        "rank": mesh.rank,
        "coord": mesh.domain_coordinate,
        "held": held,
        "step_peak": step_peak,
        "peak": held + step_peak if memory else None,
        "rss": _max_rss(),
        "shard": common.tensor_bytes(features.values()),
        "serial_loss": reference,
        "loss": loss,
    }
    ranks = common.gather_rows(mine)
    reference = next((r["serial_loss"] for r in ranks if r["serial_loss"] is not None), None)
    mib = 2**20

    def largest(key: str) -> float | None:
        values = [r[key] for r in ranks if r[key] is not None]
        return max(values) / mib if values else None

    peaks = [r["peak"] for r in ranks if r["peak"] is not None]
    times = [t.wall for t in timings]
    return {
        "mesh": f"{cp0}x{cp1}",
        "ranks_n": cp0 * cp1,
        "N": n_tokens,
        "A": atoms,
        "model": json.dumps(config.to_dict(), sort_keys=True),
        "device": mesh.device.type,
        "memory_source": common.PeakMemory(mesh.device).source,
        "loss": loss,
        "serial_loss": reference,
        "loss_diff": abs(loss - reference) if reference is not None else None,
        "loss_diff_text": f"{abs(loss - reference):.1e}" if reference is not None else None,
        "losses_agree": len({r["loss"] for r in ranks}) == 1,
        "first_step_s": first.wall,
        "time_s": common.median(times) if times else None,
        "times": times,
        "cpu_s": common.median([t.cpu_total for t in timings]) if timings else None,
        "busiest_cpu_s": common.median([t.cpu_busiest for t in timings]) if timings else None,
        "held_MiB": largest("held"),
        "step_peak_MiB": largest("step_peak"),
        "peak_MiB": largest("peak"),
        "peak_MiB_mean": sum(peaks) / len(peaks) / mib if peaks else None,
        "shard_MiB": largest("shard"),
        "rss_MiB": largest("rss"),
        "ranks": ranks,
    }


# -- the shared table ---------------------------------------------------------------------------

COLUMNS = [
    ("mesh", "mesh"),
    ("N", "N"),
    ("A", "A"),
    ("time_s", "step s (median)"),
    ("cpu_s", "CPU s, sum"),
    ("busiest_cpu_s", "CPU s, busiest rank"),
    ("held_MiB", "held MiB / rank"),
    ("step_peak_MiB", "step peak MiB / rank"),
    ("peak_MiB", "peak MiB / rank (max)"),
    ("peak_MiB_mean", "peak MiB / rank (mean)"),
    ("peak_1x1_over_this", "peak: 1x1 / this"),
    ("time_this_over_1x1", "wall: this / 1x1"),
    ("cpu_this_over_1x1", "busiest CPU: this / 1x1"),
    ("rss_MiB", "max RSS MiB (whole process)"),
    ("loss", "loss"),
    ("loss_diff_text", "abs(loss - serial)"),
]
SUMMARY_KEY = ("mesh", "N")
_STORED = [k for k, _ in COLUMNS] + ["model", "device", "memory_source", "times", "ranks_n"]


def with_ratios(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Rows with the ratio columns against the 1x1 row of the same ``N`` and model."""
    base = {(r["N"], r.get("model")): r for r in rows if r["mesh"] == "1x1"}
    out = []
    for r in rows:
        r = dict(r)
        ref = base.get((r["N"], r.get("model")))
        ok = ref is not None and ref.get("device") == r.get("device")
        r["peak_1x1_over_this"] = (
            ref["peak_MiB"] / r["peak_MiB"] if ok and ref["peak_MiB"] and r["peak_MiB"] else None
        )
        r["time_this_over_1x1"] = (
            r["time_s"] / ref["time_s"] if ok and ref["time_s"] and r["time_s"] else None
        )
        r["cpu_this_over_1x1"] = (
            r["busiest_cpu_s"] / ref["busiest_cpu_s"]
            if ok and ref.get("busiest_cpu_s") and r.get("busiest_cpu_s")
            else None
        )
        out.append(r)
    return sorted(out, key=lambda r: (r["ranks_n"], r["N"]))


def stored_rows(results: Path) -> list[dict[str, Any]]:
    """The ``train_step`` rows already in ``results/summary.json``."""
    path = results / "summary.json"
    if not path.exists():
        return []
    store = json.loads(path.read_text())
    return [dict(r) for r in store.get(BENCHMARK, {}).get("rows", [])]


def draw(rows: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """Peak memory per rank, step wall and CPU time against N, one line per mesh."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(22, 5))
    meshes = sorted({(r["ranks_n"], r["mesh"]) for r in rows})
    panels = (
        (axes[0], "peak_MiB", "peak tensor MiB per rank (held + step peak, max over ranks)"),
        (axes[1], "step_peak_MiB", "step peak MiB per rank (above held)"),
        (axes[2], "time_s", "step wall time s (median, max over ranks)"),
        (axes[3], "busiest_cpu_s", "step CPU s of the busiest rank (median)"),
    )
    for ax, key, label in panels:
        for _, mesh in meshes:
            pts = sorted((r["N"], r[key]) for r in rows if r["mesh"] == mesh and r.get(key))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=mesh)
        ax.set_xlabel("tokens N")
        ax.set_ylabel(label, fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(title="mesh", fontsize=8)
    fig.suptitle("training step of the reference model (forward + backward + AdamW step)")
    return common.save_figure(fig, path, dpi=100)


def write_results(rows: Sequence[Mapping[str, Any]], command: str, results: Path) -> list[Path]:
    """Merge this launch's rows with the stored ones; rewrite the table, plot and summary."""
    fresh = {(r["mesh"], r["N"]) for r in rows}
    kept = [r for r in stored_rows(results) if (r["mesh"], r["N"]) not in fresh]
    new = [{k: r.get(k) for k in _STORED} for r in rows]
    for r in new:
        r["command"] = command
    merged = with_ratios(kept + new)
    summary = common.merge_summary(BENCHMARK, merged, SUMMARY_KEY, COLUMNS, results)
    commands = "\n".join(
        f"- {m}: `{c}`" for m, c in sorted({(r["mesh"], r.get("command") or "?") for r in merged})
    )
    sources = sorted({f"{r.get('device')}: {r.get('memory_source')}" for r in merged})
    environment = (
        f"launches (one per mesh):\n\n{commands}\n\n"
        f"torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} CPU cores; load "
        f"average at the end of the last launch {common.load_average()}\n\n"
        f"step peak memory from: {'; '.join(sources)}\n\n"
        f"model: `{merged[0].get('model') if merged else '-'}`"
    )
    timings = "\n".join(
        f"- {r['mesh']} N={r['N']}: " + ", ".join(f"{t:.3f}" for t in r.get("times") or [])
        for r in merged
    )
    md = common.write_markdown(
        results / f"{BENCHMARK}.md",
        "Training step benchmark: reference model, per mesh",
        [
            ("Runs", environment),
            ("Results", common.markdown_table(COLUMNS, merged)),
            ("Every timed step (s, max over ranks)", timings),
        ],
    )
    png = draw(merged, results / f"{BENCHMARK}.png")
    return [md, png, summary]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_sweep_arguments(p, tokens=(64, 128, 256))
    p.add_argument("--msa-rows", type=int, default=4)
    p.add_argument("--c-atom", type=int, default=ModelConfig.c_atom)
    p.add_argument("--c-token", type=int, default=ModelConfig.c_token)
    p.add_argument("--c-pair", type=int, default=ModelConfig.c_pair)
    p.add_argument("--n-blocks", type=int, default=ModelConfig.n_blocks)
    p.add_argument("--n-heads", type=int, default=ModelConfig.n_heads)
    common.add_step_arguments(p)
    common.add_output_arguments(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cp = common.cp_shape(args.cp)
    config = ModelConfig(
        c_atom=args.c_atom,
        c_token=args.c_token,
        c_pair=args.c_pair,
        n_blocks=args.n_blocks,
        n_heads=args.n_heads,
    )
    mesh = fc.init_mesh(ddp=1, cp=cp, timeout_s=args.timeout)
    rows = []
    try:
        for n in args.tokens:
            row = run_train_step_benchmark(
                mesh,
                n,
                config=config,
                repeats=args.repeats,
                seed=args.seed,
                msa_rows=args.msa_rows,
                serial_check=not args.no_serial_check,
                memory=not args.no_memory,
            )
            rows.append(row)
            if mesh.rank == 0:
                print(
                    f"{row['mesh']} N={row['N']} A={row['A']} step {row['time_s']:.3f}s "
                    f"held {row['held_MiB'] or 0:.1f} MiB step peak "
                    f"{row['step_peak_MiB'] or 0:.1f} MiB peak {row['peak_MiB'] or 0:.1f} MiB "
                    f"loss {row['loss']:.6f} serial {row['serial_loss']}",
                    flush=True,
                )
        if mesh.rank == 0:
            command = common.launch_command("bench_train_step.py", mesh.world_size, argv)
            for path in write_results(rows, command, args.results):
                print(f"wrote {path}")
    finally:
        with contextlib.suppress(Exception):
            fc.shutdown()
    return 0


__all__ = [
    "COLUMNS",
    "held_bytes",
    "run_train_step_benchmark",
    "serial_loss",
    "with_ratios",
    "write_results",
]

if __name__ == "__main__":
    raise SystemExit(main())
