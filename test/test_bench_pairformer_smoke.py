"""The Pairformer benchmark at a tiny size: it measures what it claims, with the serial loss."""

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from physicsnemo_foldcp.kernels.budget import work_budget_mib
from physicsnemo_foldcp.testing import collective_assert

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

pytest.importorskip("boltz.model.layers.pairformer")

from benchmarks.bench_pairformer import (  # noqa: E402
    PairformerSizes,
    pair_inputs,
    run_pairformer_benchmark,
    with_ratios,
    write_results,
)
from benchmarks.op_scopes import CATEGORIES  # noqa: E402

N = 19  # uneven blocks on 2x2: 10 + 9
SEED = 5
NOISE = 0.1  # Boltz zero-initialises its last projections: without noise the layers add 0
SIZES = PairformerSizes(
    token_s=16, token_z=8, num_blocks=1, num_heads=2, pairwise_head_width=4, pairwise_num_heads=2
)
FINITE = [
    "held_MiB",
    "step_peak_MiB",
    "peak_MiB",
    "fwd_ms_layer",
    "bwd_ms_layer",
    "fwd_KiB_layer",
    "bwd_KiB_layer",
    "fwd_KiB_outside",
    "bwd_KiB_outside",
    "loss",
    "serial_loss",
    "serial_step_ms_layer",
    "step_over_serial",
    "copy_MiB_step",
    "serial_copy_MiB_step",
] + [f"{ph}_KiB_{c}" for ph in ("fwd", "bwd") for c in CATEGORIES]


def loss_of(s, z, mask, pair_mask) -> float:
    pair = (z.pow(2).mean(-1) * pair_mask).sum() / (pair_mask.sum() + 1e-6)
    single = (s.pow(2).mean(-1) * mask).sum() / (mask.sum() + 1e-6)
    return float(pair + single)


def serial_losses_of_boltz() -> tuple[float, float]:
    """Boltz's PairformerModule on the whole inputs, seeded as the benchmark seeds it, and
    the same loss of the inputs themselves (what a module adding nothing would give)."""
    from boltz.model.layers.pairformer import PairformerModule

    torch.manual_seed(SEED)
    np.random.seed(SEED)  # Boltz's LeCun / He initialisers draw from NumPy's generator
    module = PairformerModule(**SIZES.to_dict()).train()
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(NOISE * torch.randn(p.shape, generator=g))
    s, z, mask, pair_mask = pair_inputs(N, SIZES, SEED, padded=3)
    torch.manual_seed(SEED + 1)  # the dropout draws
    with torch.no_grad():
        s_out, z_out = module(s, z, mask, pair_mask)
    return loss_of(s_out, z_out, mask, pair_mask), loss_of(s, z, mask, pair_mask)


def test_ratios_and_targets_compare_with_the_1x1_row_of_the_same_size():
    rows = [
        {"mesh": "1x1", "ranks_n": 1, "N": 64, "model": "m", "device": "cpu", "peak_MiB": 20.0},
        {"mesh": "2x2", "ranks_n": 4, "N": 64, "model": "m", "device": "cpu", "peak_MiB": 5.0},
        {"mesh": "3x3", "ranks_n": 9, "N": 64, "model": "m", "device": "cpu", "peak_MiB": 4.0},
        {"mesh": "2x3", "ranks_n": 6, "N": 64, "model": "m", "device": "cpu", "peak_MiB": 4.0},
        {"mesh": "2x2", "ranks_n": 4, "N": 128, "model": "m", "device": "cpu", "peak_MiB": 9.0},
    ]
    out = {(r["mesh"], r["N"]): r for r in with_ratios(rows)}
    assert out[("2x2", 64)]["peak_this_over_1x1"] == 0.25
    assert out[("2x2", 64)]["target_met"] is True
    assert out[("3x3", 64)]["target_met"] is False  # 0.2 > 0.15
    assert out[("2x3", 64)]["target_met"] is None  # no target for 2x3
    assert out[("2x2", 128)]["peak_this_over_1x1"] is None  # no 1x1 row at N = 128


@pytest.mark.multigpu_static
@pytest.mark.parametrize("fold_mesh", [(1, 2, 2)], indirect=True, ids=str)
def test_pairformer_benchmark_measures_and_matches_the_serial_loss(fold_mesh, tmp_path):
    row = run_pairformer_benchmark(
        fold_mesh, N, sizes=SIZES, repeats=1, seed=SEED, padded=3, init_noise=NOISE
    )
    problems = []
    for key in FINITE:
        value = row.get(key)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            problems.append(f"{key} = {value!r}")
    if fold_mesh.rank == 0:
        expected, inputs_only = serial_losses_of_boltz()
        if abs(row["loss"] - expected) > 1e-5 * abs(expected):
            problems.append(f"CP loss {row['loss']} != serial {expected}")
        if abs(expected - inputs_only) < 1e-3:
            problems.append(f"the layers do not change the loss ({expected}, {inputs_only})")
    if not row["weights_agree"]:
        problems.append("the ranks built different weights")
    if not row["losses_agree"] or row["loss_diff"] is None or row["loss_diff"] > 1e-5:
        problems.append(f"loss {row['loss']} serial {row['serial_loss']}")
    if not isinstance(row["fallback_gathers"], int) or not isinstance(row["fallbacks"], list):
        problems.append(f"fallbacks {row['fallbacks']!r}")
    # A triangle multiplication and the pair-biased attention must communicate on 2x2,
    # whichever way they run; every collective is attributed to exactly one scope.
    for key in ("fwd_KiB_tri_mul_out", "fwd_KiB_tri_mul_in", "fwd_KiB_attention"):
        if not row[key] > 0:
            problems.append(f"{key} = {row[key]}")
    # Copies are counted per op, and the step's total is the largest rank's sum.
    if not (row["copy_MiB_tri_att_start"] > 0 and row["serial_copy_MiB_step"] > 0):
        problems.append(f"copies {row['copy_MiB_tri_att_start']}, {row['serial_copy_MiB_step']}")
    largest = max(sum(r["copies"].values()) for r in row["ranks"]) / 2**20
    if row["copy_MiB_step"] != largest:
        problems.append(f"copies per step {row['copy_MiB_step']} != {largest}")
    for r in row["ranks"]:
        for ph in ("fwd", "bwd"):
            if sum(r[ph].values()) != r[f"{ph}_total"]:
                problems.append(f"rank {r['rank']} {ph}: scopes {r[ph]} != {r[f'{ph}_total']}")
        if not (r["held"] > 0 and r["step_peak"] > 0 and r["peak"] == r["held"] + r["step_peak"]):
            problems.append(f"rank {r['rank']} memory: {r['held']}, {r['step_peak']}")
    # The time breakdown: every op of a layer takes time, forward and backward, and no
    # op's time is counted outside the layers.
    for ph in ("fwd", "bwd"):
        for op in ("tri_mul_out", "tri_mul_in", "tri_att_start", "tri_att_end", "attention",
                   "transitions"):  # fmt: skip
            for key in (f"{ph}_ms_{op}", f"serial_{ph}_ms_{op}"):  # this mesh, serial Boltz
                if not row[key] > 0:
                    problems.append(f"{key} = {row[key]}")
        in_layers = sum(r[f"{ph}_s"].get(op, 0.0) for r in row["ranks"][:1] for op in r[f"{ph}_s"]
                        if op != "outside")  # fmt: skip
        if not in_layers > row["ranks"][0][f"{ph}_s"].get("outside", 0.0):
            problems.append(f"{ph}: most of the step is outside the layers: {row['ranks'][0]}")
    if not (len(row["fwd_times"]) == 1 and len(row["bwd_times"]) == 1):
        problems.append(f"times {row['fwd_times']} {row['bwd_times']}")
    if not (len(row["serial_fwd_times"]) == 1 and len(row["serial_bwd_times"]) == 1):
        problems.append(f"serial times {row['serial_fwd_times']} {row['serial_bwd_times']}")
    # The kernels report their pieces: at this size each takes all of its work at once.
    if row["work_budget_MiB"] != work_budget_mib() or not (
        "triangle attention: key chunk 5 of 5" in row["pieces"]
        and "triangle multiplication: 1 panels" in row["pieces"]
    ):
        problems.append(f"budget {row['work_budget_MiB']} MiB, pieces {row['pieces']!r}")
    if fold_mesh.rank == 0:
        base = dict(row, mesh="1x1", ranks_n=1, peak_MiB=4 * row["peak_MiB"])
        write_results([base], "test 1x1", Path(tmp_path))
        md, png, _ = write_results([row], "test", Path(tmp_path))
        text = md.read_text()
        if "| 1x1 | 19 |" not in text or "| 2x2 | 19 |" not in text:
            problems.append("the shared table misses a mesh")
        if "| 0.250 | <= 0.30 | yes |" not in text:
            problems.append("the ratio to 1x1 or the target is missing")
        if "| 2x2 | 19 | backward |" not in text:
            problems.append("the bytes-per-op table misses a row")
        if "ms per layer by op" not in text or text.count("| 2x2 | 19 | backward |") != 2:
            problems.append("the time-per-op table misses a row")
        if "| serial Boltz (2x2 launch) | 19 | backward |" not in text:
            problems.append("the time-per-op table misses the serial module's row")
        speed = f"- 2x2 N=19: step {row['step_ms_layer']:.3f} ms / layer (1 thread(s) per process)"
        if speed not in text or f"ratio {row['step_over_serial']:.3f}" not in text:
            problems.append("the step time against serial Boltz is missing")
        if png.read_bytes()[:4] != b"\x89PNG":
            problems.append("the PNG is missing")
    collective_assert(not problems, "; ".join(problems))
