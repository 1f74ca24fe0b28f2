"""The trunk benchmark at a tiny size: the loss is the serial trunk's, the peaks add up."""

import dataclasses
import math
import statistics
import sys
from pathlib import Path

import pytest

from physicsnemo_foldcp.testing import collective_assert

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

pytest.importorskip("boltz.model.modules.trunkv2")

from benchmarks.bench_trunk import (  # noqa: E402
    PARTS,
    SMOKE,
    SMOKE_TOKENS,
    run_trunk_benchmark,
    write_results,
)

N = SMOKE_TOKENS
SIZES = SMOKE
MEMORY_STEPS = 2


@pytest.mark.multigpu_static
@pytest.mark.parametrize("fold_mesh", [(1, 2, 2)], indirect=True, ids=str)
def test_trunk_benchmark_matches_the_serial_loss_and_keeps_the_median_peak(fold_mesh, tmp_path):
    row = run_trunk_benchmark(fold_mesh, N, sizes=SIZES, repeats=1, memory_steps=MEMORY_STEPS)
    problems = []
    for key in ("held_MiB", "step_peak_MiB", "peak_MiB", "time_s", "loss", "serial_loss",
                "serial_time_s", "time_over_serial"):  # fmt: skip
        value = row.get(key)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            problems.append(f"{key} = {value!r}")
    if len(row["serial_times"]) != 1 or row["time_over_serial"] != (
        row["time_s"] / row["serial_time_s"]
    ):
        problems.append(f"serial times {row['serial_times']}, ratio {row['time_over_serial']}")
    for prefix in ("", "serial_"):  # every stage and Pairformer op ran in the forward
        idle = [p for p in PARTS if not row[f"{prefix}fwd_s_{p}"] > 0]
        if idle or not row[f"{prefix}bwd_s_tri_att_start"] > 0:
            problems.append(f"{prefix}breakdown: no forward time in {idle}")
    ratio = row["flop_ratio"]
    if not (isinstance(ratio, float) and 0.999 <= ratio < 2 and row["serial_flops_tri_mul_in"]):
        problems.append(f"FLOPs of all ranks over serial {ratio}")
    traffic = {k: row[k] for k in ("collectives", "collective_bytes", "p2p", "p2p_bytes")}
    if not all(isinstance(v, int) and v > 0 for v in traffic.values()):
        problems.append(f"a 2x2 trunk step communicates: counted {traffic}")
    if not 0 <= row["host_syncs"] <= row["serial_host_syncs"]:
        problems.append(f"host syncs {row['host_syncs']}, serial {row['serial_host_syncs']}")
    if not row["losses_agree"] or not row["loss_ok"]:
        problems.append(f"loss {row['loss']} vs serial {row['serial_loss']}")
    peaks = row["peaks_MiB"]
    if len(peaks) != MEMORY_STEPS or row["peak_MiB"] != statistics.median(peaks):
        problems.append(f"peak {row['peak_MiB']} is not the median of {peaks}")
    for r in row["ranks"]:
        if len(r["step_peaks"]) != MEMORY_STEPS or min(r["step_peaks"]) <= 0 or r["held"] <= 0:
            problems.append(f"rank {r['rank']}: held {r['held']}, step peaks {r['step_peaks']}")
    largest = [
        max(r["held"] + r["step_peaks"][i] for r in row["ranks"]) for i in range(MEMORY_STEPS)
    ]
    if [v / 2**20 for v in largest] != peaks:
        problems.append(f"per-step peaks {peaks} are not the largest over the ranks {largest}")
    # The same step checkpointed in bf16: the loss within the bf16 tolerance of serial bf16.
    mode = dataclasses.replace(SIZES, checkpointing=True, precision="bf16")
    other = run_trunk_benchmark(
        fold_mesh, N, sizes=mode, repeats=1, memory_steps=1, serial_time=False, flops=False
    )
    if not other["loss_ok"] or other["loss"] == row["loss"]:
        problems.append(f"bf16 checkpointed loss {other['loss']}, fp32 {row['loss']}")
    if fold_mesh.rank == 0:
        md, png, summary = write_results([row, other], "test", Path(tmp_path))
        text = md.read_text()
        headline = summary.read_text().split("\n## ")[1]
        if not headline.startswith("trunk step per mesh") or "| 2x2 | 29 |" not in headline:
            problems.append(f"the summary does not open with the per-mesh line: {headline[:200]}")
        if "| 2x2 |" not in text or "range over steps" not in text:
            problems.append("the table misses the 2x2 row or the range of the peaks")
        if "| serial trunk (2x2 launch) |" not in text or "pairformer tri_mul_out" not in text:
            problems.append("the breakdown by part misses the serial trunk's rows")
        if "| 2x2 | z8 s16 msa8x1 S6 pf1 | 29 |" not in text.split("bf16 ckpt / fp32")[-1]:
            problems.append("the checkpointing and bf16 table misses the 2x2 row")
        if "| all ranks / serial |" not in text:
            problems.append("the FLOP table is missing")
        if f"ratio {row['time_over_serial']:.3f}, target <= 1.0: " not in text:
            problems.append("the step time against the serial trunk is missing")
        if png.read_bytes()[:4] != b"\x89PNG":
            problems.append("the PNG is missing")
    collective_assert(not problems, "; ".join(problems))
