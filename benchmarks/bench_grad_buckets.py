"""Benchmark: collectives per trunk training step, per-call and bucketed gradient reductions.

    torchrun --standalone --nproc-per-node 4 benchmarks/bench_grad_buckets.py --cp 2 2
    torchrun --standalone --nproc-per-node 6 benchmarks/bench_grad_buckets.py --cp 2 3
    torchrun --standalone --nproc-per-node 9 benchmarks/bench_grad_buckets.py --cp 3 3
    torchrun --standalone --nproc-per-node 4 benchmarks/bench_grad_buckets.py --ddp 2 --cp 1 2 \
        --wrappers ddp fsdp2

One training step of the trunk of the main sizes (``benchmarks.bench_trunk.BASE``) on a
scattered synthetic sample, wrapped for ``ddp`` as given, twice on the same weights and
dropout draws: with every module reducing its parameters' gradients over the domain in its
own backward ("per call"), then with
:func:`~physicsnemo_foldcp.core.grad_buckets.attach_gradient_buckets` ("bucketed", the
training loop's default). Each is counted after one warm step: collectives by kind and
group, their bytes, point-to-point calls, the parameter reductions made per call, the
buckets' reductions, and the step's wall time (median of ``--repeats``). The largest
relative difference between the two runs' parameter gradients is checked against
:data:`GRAD_RTOL`.

Rank 0 merges its rows into ``results/summary.json`` (section ``gradient reductions``) and
writes ``results/grad_buckets.md`` from every launch's rows kept there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import physicsnemo_foldcp as fc
import physicsnemo_foldcp.boltz as fc_boltz
from physicsnemo_foldcp.core.grad_buckets import attach_gradient_buckets
from physicsnemo_foldcp.core.partial_grads import count_reduced_per_call
from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.distributed.mesh import FoldMesh
from physicsnemo_foldcp.distributed.wrappers import unwrap, wrap_model
from physicsnemo_foldcp.testing.collectives import count_p2p
from physicsnemo_foldcp.training import batched

try:
    from benchmarks import common
    from benchmarks.bench_ops import CollectiveBytes, group_labels
    from benchmarks.bench_trunk import BASE, TrunkSizes, build_trunk, step_loss
except ImportError:  # run as a script: benchmarks/ is not a package on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import common
    from benchmarks.bench_ops import CollectiveBytes, group_labels
    from benchmarks.bench_trunk import BASE, TrunkSizes, build_trunk, step_loss

SECTION = "gradient reductions"
"""Section of ``results/summary.json`` holding the rows."""

GRAD_RTOL = 1e-4
"""Largest relative difference (to the gradient's largest entry) between the bucketed and
the per-call gradients: the same sums, added in another order."""

SCALE_FLOOR = 1e-3
"""Smallest scale of a parameter's gradient difference, relative to the step's largest
gradient entry."""

STEPS = ("per call", "bucketed")
"""The two ways the parameter gradients are reduced, in the order they are measured."""

COLUMNS = (
    ("mesh", "mesh (ddp x cp0 x cp1)"),
    ("wrapper", "wrapper"),
    ("N", "N"),
    ("step", "gradient reductions"),
    ("collectives", "collectives / step"),
    ("all_reduces", "all-reduces / step"),
    ("by_group", "all-reduces by group"),
    ("collective_MiB", "collective MiB / step"),
    ("p2p", "point-to-point calls / step"),
    ("per_call_reductions", "per-call parameter reductions"),
    ("buckets", "buckets"),
    ("bucket_reductions", "bucket reductions"),
    ("time_s", "step s (median)"),
    ("grad_rel_diff", "max grad diff vs per call"),
    ("command", "command"),
)


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (FSDP2's sharded ones gathered)."""
    out = {}
    for name, p in unwrap(model).named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            out[name] = g.detach().clone()
    return out


def measure(
    model: torch.nn.Module,
    feats: Mapping[str, Any],
    mesh: FoldMesh,
    dropout_seed: int,
    repeats: int,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """One warm step, one counted step and ``repeats`` timed ones; counts and gradients."""

    def step() -> None:
        model.zero_grad(set_to_none=True)
        step_loss(model, feats, dropout_seed).backward()

    step()
    labels = group_labels(mesh)
    with contextlib.suppress(Exception):
        labels.setdefault(mesh.ddp_mesh.get_group().group_name, "ddp")
    with CollectiveBytes(labels) as comm, count_p2p() as p2p, count_reduced_per_call() as own:
        step()
    grads = gradients(model)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        step()
        common.synchronize(mesh.device)
        times.append(time.perf_counter() - start)
    reduces = Counter(label for kind, label, _ in comm.records if "all_reduce" in kind)
    counts = {
        "collectives": len(comm.records),
        "all_reduces": sum(reduces.values()),
        "by_group": ", ".join(f"{k} x{v}" for k, v in sorted(reduces.items())) or "none",
        "collective_MiB": comm.total_bytes() / 2**20,
        "p2p": p2p["calls"],
        "per_call_reductions": own["collectives"],
        "time_s": common.median(times) if times else None,
    }
    return counts, grads


def largest_relative_difference(
    got: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]
) -> float:
    """Largest ``max|got - expected| / scale`` over the parameters (inf if the parameters
    differ), ``scale`` the parameter's largest ``|expected|`` but at least
    :data:`SCALE_FLOOR` of the step's largest (gradients that cancel to rounding noise, such
    as a norm's bias in front of a softmax, are compared on the step's scale)."""
    if set(got) != set(expected):
        return float("inf")
    top = max((float(e.abs().max()) for e in expected.values()), default=0.0) or 1.0
    worst = 0.0
    for name, e in expected.items():
        scale = max(float(e.abs().max()), SCALE_FLOOR * top)
        worst = max(worst, float((got[name] - e).abs().max()) / scale)
    return worst


def run(
    mesh: FoldMesh,
    n_tokens: int,
    wrapper: str,
    seed: int,
    repeats: int,
    command: str,
    sizes: TrunkSizes = BASE,
) -> list[dict[str, Any]]:
    """Both steps of one wrapper at one size (every rank); the rows, the same on every rank."""
    fc_boltz.install()
    dropout_seed = seed + 1
    sample = None
    if mesh.is_domain_source:
        sample = batched(
            make_complex(n_tokens, seed=seed, msa_rows=sizes.msa_rows, atom_multiple=32)
        )
    feats = fc.scatter_features(sample, mesh)
    rows = []
    reference: dict[str, torch.Tensor] = {}
    for step_name in STEPS:
        model = wrap_model(build_trunk(sizes, seed, 0.05).to(mesh.device), mesh, wrapper)
        buckets = attach_gradient_buckets(model, mesh) if step_name == "bucketed" else None
        counts, grads = measure(model, feats, mesh, dropout_seed, repeats)
        diff = largest_relative_difference(grads, reference) if reference else 0.0
        reference = reference or grads
        mine = {**counts, "grad_rel_diff": diff}
        ranks = common.gather_rows(mine)
        row = {key: max(r[key] for r in ranks) for key in mine if key != "by_group"}
        row["by_group"] = ranks[0]["by_group"]
        row.update(
            mesh="x".join(map(str, mesh.shape)),
            wrapper=wrapper,
            N=n_tokens,
            step=step_name,
            device=mesh.device.type,
            buckets=len(buckets.buckets) if buckets else 0,
            bucket_reductions=buckets.reductions if buckets else 0,
            command=command,
        )
        rows.append(row)
        del model
    return rows


def write_results(rows: Sequence[Mapping[str, Any]], results: Path, command: str) -> list[Path]:
    """Merge ``rows`` into the summary section; ``results/grad_buckets.md`` shows every
    launch's rows kept there."""
    summary = common.merge_summary(
        SECTION, rows, ("mesh", "wrapper", "N", "step"), COLUMNS, results
    )
    kept = json.loads((results / "summary.json").read_text())[SECTION]["rows"]
    notes = [
        f"- {r['mesh']} {r['wrapper']} N={r['N']}: {r['collectives']} collectives / step "
        f"bucketed, gradients within {r['grad_rel_diff']:.1e} of the per-call step "
        f"(limit {GRAD_RTOL:.0e}): {'ok' if r['grad_rel_diff'] <= GRAD_RTOL else 'NOT ok'}"
        for r in kept
        if r["step"] == "bucketed"
    ]
    md = common.write_markdown(
        results / "grad_buckets.md",
        "Gradient reductions per trunk training step",
        [
            ("rows", common.markdown_table(COLUMNS, kept)),
            ("checks", "\n".join(notes)),
            ("environment (last launch)", common.environment(command, rows[0]["device"])),
        ],
    )
    return [md, summary]


def main(argv: Sequence[str] | None = None) -> int:
    """Measure every ``--wrappers`` at every ``--tokens`` on the launched mesh."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_sweep_arguments(p, tokens=(96,))
    p.set_defaults(repeats=2)
    p.add_argument("--ddp", type=int, default=1)
    p.add_argument("--wrappers", nargs="+", default=["auto"], choices=("auto", "ddp", "fsdp2"))
    common.add_output_arguments(p)
    args = p.parse_args(argv)
    cp = common.cp_shape(args.cp)
    mesh = fc.init_mesh(ddp=args.ddp, cp=cp, timeout_s=args.timeout)
    command = common.launch_command("bench_grad_buckets.py", mesh.world_size, argv)
    rows: list[dict[str, Any]] = []
    failed = False
    try:
        for wrapper in args.wrappers:
            for n in args.tokens:
                fresh = run(mesh, n, wrapper, args.seed, args.repeats, command)
                rows.extend(fresh)
                failed |= any(r["grad_rel_diff"] > GRAD_RTOL for r in fresh)
                if mesh.rank == 0:
                    for r in fresh:
                        print(
                            f"{r['mesh']} {wrapper} N={n} {r['step']}: {r['collectives']} "
                            f"collectives ({r['by_group']} all-reduces), step "
                            f"{r['time_s']:.2f} s, grad diff {r['grad_rel_diff']:.1e}",
                            flush=True,
                        )
        if mesh.rank == 0:
            for path in write_results(rows, args.results, command):
                print(f"wrote {path}")
    finally:
        with contextlib.suppress(Exception):
            fc.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
