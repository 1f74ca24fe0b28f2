"""Benchmark 7: one Boltz-2 prediction under CP (trunk, sampling, confidence): peak memory per rank.

    torchrun --standalone --nproc-per-node 1 benchmarks/bench_predict.py --tokens 64 128 192
    torchrun --standalone --nproc-per-node 4 benchmarks/bench_predict.py --tokens 64 128 192
    torchrun --standalone --nproc-per-node 9 benchmarks/bench_predict.py --tokens 64 128 192

One launch per mesh (``--cp``, by default the square mesh of the world size). For each
``N`` a synthetic Boltz-2 sample (``make_complex(N, seed, msa_rows=--msa-rows,
atom_multiple=32)``, batched) is scattered over the mesh and
:class:`~physicsnemo_foldcp.models.boltz2.Boltz2Model` (Boltz's own modules, seeded
weights; ``--token-z``, two diffusion samples, ``--sampling-steps``, the confidence module
on) runs ONE ``predict_step``.

Measured per launch and ``N`` (the largest over the ranks): *held*, the tensor bytes a
rank keeps before the prediction (its shard of the sample and the parameters); *step
peak*, the peak of tensor bytes allocated during ``predict_step`` above that
(:class:`benchmarks.common.PeakMemory`); *peak* = held + step peak, and **peak: this /
1x1**, divided by the 1x1 row's of the same ``N`` and sizes; and the step peak of each
phase (*trunk*, *conditioning* (``diffusion_conditioning``), *sampling* (the sampler and
the structure checks), *confidence*), each the largest bytes alive in that phase.
Targets at the largest ``N``: <= 0.30 on 2x2 and <= 0.15 on 3x3. The prediction's wall
time is reported beside it.

Each launch merges its rows into ``results/summary.json`` (section ``predict``, key mesh,
sizes and N) and rewrites ``results/predict.md`` from every row there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

import physicsnemo_foldcp as fc

try:
    from benchmarks import common
except ImportError:  # run as a script: benchmarks/ is not a package on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import common
from physicsnemo_foldcp.data.datasets import batched
from physicsnemo_foldcp.data.synthetic import make_complex

COLUMNS = (
    ("mesh", "mesh"),
    ("config", "sizes"),
    ("N", "N"),
    ("A", "A"),
    ("held_MiB", "held MiB"),
    ("step_peak_MiB", "step peak MiB"),
    ("peak_MiB", "peak MiB / rank"),
    ("ratio", "peak: this / 1x1"),
    ("phases_MiB", "step peak MiB by phase: trunk / conditioning / sampling / confidence"),
    ("time_s", "seconds"),
)
KEY = ("mesh", "config", "N")
TARGETS = {"2x2": 0.30, "3x3": 0.15}
#: Segments of one ``predict_step`` (:func:`phase_marks`), in order.
PHASES = ("trunk", "conditioning", "sampling", "confidence")


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_sweep_arguments(parser, tokens=(64, 128))
    common.add_output_arguments(parser)
    parser.add_argument("--token-z", type=int, default=64)
    parser.add_argument("--msa-rows", type=int, default=8)
    parser.add_argument("--sampling-steps", type=int, default=2)
    return parser


def run_prediction(mesh, n: int, *, token_z: int, msa_rows: int, steps: int, seed: int) -> dict:
    """Peak memory and time of one ``predict_step`` on ``mesh`` at ``N = n`` (every rank)."""
    from physicsnemo_foldcp.models.boltz2 import Boltz2Model
    from physicsnemo_foldcp.models.boltz2_config import Boltz2Config

    config = Boltz2Config(
        token_z=token_z, predict_args={"diffusion_samples": 2, "sampling_steps": steps}
    )
    torch.manual_seed(seed)
    model = Boltz2Model(config).to(mesh.device).eval()
    sample = None
    if mesh.is_domain_source:
        sample = batched(make_complex(n, seed=seed, msa_rows=msa_rows, atom_multiple=32))
    feats = fc.scatter_features(sample, mesh)
    held = common.tensor_bytes(list(feats.values())) + common.tensor_bytes(model.parameters())
    torch.manual_seed(seed + 1)
    start = time.perf_counter()
    with common.PeakMemory(mesh.device, first=PHASES[0]) as peak, phase_marks(model, peak):
        model.predict_step(feats)
    seconds = time.perf_counter() - start
    phases = [peak.segments.get(name, 0) for name in PHASES]
    per_rank = common.gather_rows((held, peak.peak, seconds, phases))
    held_max = max(h for h, _, _, _ in per_rank)
    peak_max = max(h + p for h, p, _, _ in per_rank)
    mib = 2**20
    phase_max = [max(r[3][k] for r in per_rank) / mib for k in range(len(PHASES))]
    return {
        "mesh": f"{mesh.cp[0]}x{mesh.cp[1]}",
        "config": f"token_z={token_z} msa={msa_rows} steps={steps}",
        "N": n,
        "A": int(feats["atom_pad_mask"].shape[1]),
        "held_MiB": held_max / mib,
        "step_peak_MiB": max(p for _, p, _, _ in per_rank) / mib,
        "peak_MiB": peak_max / mib,
        "phases_MiB": " / ".join(f"{value:.1f}" for value in phase_max),
        "time_s": max(s for _, _, s, _ in per_rank),
    }


@contextlib.contextmanager
def phase_marks(model: torch.nn.Module, peak: common.PeakMemory) -> Iterator[None]:
    """Mark ``peak``'s segments at the phases of ``model.predict_step`` (module hooks)."""
    hooks = [
        model.diffusion_conditioning.register_forward_pre_hook(
            lambda *_: peak.mark("conditioning")
        ),
        model.diffusion_conditioning.register_forward_hook(lambda *_: peak.mark("sampling")),
    ]
    if hasattr(model, "confidence_module"):
        hooks.append(
            model.confidence_module.register_forward_pre_hook(lambda *_: peak.mark("confidence"))
        )
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def with_ratios(rows: list[dict]) -> list[dict]:
    """Every row with ``ratio``: its peak over the 1x1 peak of the same sizes and N."""
    serial = {(r["config"], r["N"]): r["peak_MiB"] for r in rows if r["mesh"] == "1x1"}
    out = []
    for row in rows:
        base = serial.get((row["config"], row["N"]))
        out.append({**row, "ratio": row["peak_MiB"] / base if base else None})
    return out


def write_results(rows: list[dict], command: str, results: Path) -> list[Path]:
    """Merge ``rows`` into the summary and rewrite ``predict.md`` from every stored row."""
    common.merge_summary("predict", rows, KEY, COLUMNS, results)
    stored = json.loads((results / "summary.json").read_text())["predict"]["rows"]
    table = with_ratios(stored)
    largest = {}
    for row in table:
        if row["mesh"] in TARGETS and row["ratio"] is not None:
            if row["N"] >= largest.get(row["mesh"], {"N": -1})["N"]:
                largest[row["mesh"]] = row
    verdicts = "\n".join(
        f"- {mesh}: {row['ratio']:.3f} at N = {row['N']} (target <= {TARGETS[mesh]}): "
        f"{'met' if row['ratio'] <= TARGETS[mesh] else 'NOT met'}"
        for mesh, row in sorted(largest.items())
    )
    path = common.write_markdown(
        results / "predict.md",
        "Boltz-2 prediction: peak memory per rank",
        [
            ("Table", common.markdown_table(COLUMNS, table)),
            ("Targets at the largest N", verdicts or "- no 2x2 / 3x3 row with a 1x1 row yet"),
            ("Last launch", common.environment(command, "cpu")),
        ],
    )
    return [path, results / "summary.md"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run every ``--tokens`` size on the launched mesh; rank 0 writes the results."""
    args = build_parser().parse_args(argv)
    cp = common.cp_shape(args.cp)
    mesh = fc.init_mesh(ddp=1, cp=cp, timeout_s=args.timeout)
    command = common.launch_command("bench_predict.py", mesh.world_size, argv)
    import physicsnemo_foldcp.boltz as fc_boltz

    fc_boltz.install()
    rows = []
    try:
        for n in args.tokens:
            row = run_prediction(
                mesh,
                n,
                token_z=args.token_z,
                msa_rows=args.msa_rows,
                steps=args.sampling_steps,
                seed=args.seed,
            )
            rows.append(row)
            if mesh.rank == 0:
                print(
                    f"{row['mesh']} N={row['N']} A={row['A']} peak {row['peak_MiB']:.1f} MiB/rank "
                    f"(held {row['held_MiB']:.1f}) {row['time_s']:.1f} s",
                    flush=True,
                )
        if mesh.rank == 0:
            for path in write_results(rows, command, args.results):
                print(f"wrote {path}")
    finally:
        with contextlib.suppress(Exception):
            fc.shutdown()
    return 0


__all__ = ["COLUMNS", "PHASES", "phase_marks", "run_prediction", "with_ratios", "write_results"]

if __name__ == "__main__":
    raise SystemExit(main())
