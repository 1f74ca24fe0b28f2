"""The ops and training-step benchmarks at a tiny size: they measure what they claim."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed._functional_collectives as funcol

from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.models import ModelConfig, ReferenceFoldModel, reference_loss
from physicsnemo_foldcp.testing import collective_assert

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.bench_ops import (  # noqa: E402
    CollectiveBytes,
    chunk_mismatch,
    describe_counts,
    documented,
    group_labels,
    run_ops_benchmark,
)
from benchmarks.bench_ops import write_results as write_ops_results  # noqa: E402
from benchmarks.bench_train_step import (  # noqa: E402
    run_train_step_benchmark,
    with_ratios,
)
from benchmarks.bench_train_step import write_results as write_step_results  # noqa: E402

MESHES = [(1, 2, 2), (1, 3, 3)]
N = 24
CHANNELS = 8
OPS = ["tokens_to_atoms", "outer_sum", "masked_mean", "bmm(a2t.float(), s)"]
CONFIG = ModelConfig(c_atom=8, c_token=16, c_pair=8, n_blocks=1, n_heads=2)


def test_documented_counts_skip_mesh_dims_of_size_one():
    counts = {"all_gather cp0": 1, "all_reduce cp1": 2}
    assert documented(counts, (2, 2)) == {("all_gather", "cp0"): 1, ("all_reduce", "cp1"): 2}
    assert documented(counts, (1, 3)) == {("all_reduce", "cp1"): 2}
    assert describe_counts({}) == "none"
    assert describe_counts({("all_gather", "cp0"): 1}) == "all_gather cp0 x1"


def _fake(shapes):
    return SimpleNamespace(_spec=SimpleNamespace(_sharding_shapes=shapes))


def test_the_fallback_is_skipped_for_token_blocks_other_than_torch_chunk():
    def sample(rows, cols):
        return {
            "res_type": _fake({0: [(1, n, 33) for n in rows]}),
            "token_bonds": _fake({1: [(1, rows[0], m, 1) for m in cols]}),
        }

    assert chunk_mismatch(sample([86, 86, 84], [86, 86, 84])) is None
    assert "[86, 85, 85] are not torch.chunk's [86, 86, 84]" in chunk_mismatch(
        sample([86, 85, 85], [86, 85, 85])
    )
    assert "pair column blocks" in chunk_mismatch(sample([128, 128], [86, 85, 85]))


def test_ratios_compare_with_the_1x1_row_of_the_same_size_and_model():
    rows = [
        {"mesh": "2x2", "ranks_n": 4, "N": 64, "model": "m", "peak_MiB": 5.0, "time_s": 3.0},
        {"mesh": "1x1", "ranks_n": 1, "N": 64, "model": "m", "peak_MiB": 20.0, "time_s": 1.5},
        {"mesh": "2x2", "ranks_n": 4, "N": 128, "model": "m", "peak_MiB": 9.0, "time_s": 1.0},
        {"mesh": "3x3", "ranks_n": 9, "N": 64, "model": "other", "peak_MiB": 2.0, "time_s": 1.0},
    ]
    out = {(r["mesh"], r["N"]): r for r in with_ratios(rows)}
    assert out[("2x2", 64)]["peak_1x1_over_this"] == 4.0
    assert out[("2x2", 64)]["time_this_over_1x1"] == 2.0
    assert out[("1x1", 64)]["peak_1x1_over_this"] == 1.0
    assert out[("2x2", 128)]["peak_1x1_over_this"] is None  # no 1x1 row at N = 128
    assert out[("3x3", 64)]["peak_1x1_over_this"] is None  # another model


@pytest.mark.multigpu_static
@pytest.mark.parametrize("fold_mesh", MESHES, indirect=True, ids=str)
def test_ops_benchmark_counts_collectives_and_bytes(fold_mesh, tmp_path):
    cp0, cp1 = fold_mesh.cp
    problems = []
    # The byte count of a collective of known size, over a known mesh dim.
    probe = torch.ones(3, 5, device=fold_mesh.device)
    with CollectiveBytes(group_labels(fold_mesh)) as mode:
        gathered = funcol.all_gather_tensor(probe, 0, (fold_mesh.domain_mesh, 0))
        if isinstance(gathered, funcol.AsyncCollectiveTensor):
            gathered = gathered.wait()
    if mode.records != [("all_gather", "cp0", cp0 * probe.numel() * 4)]:
        problems.append(f"probe all_gather recorded as {mode.records}")

    rows = run_ops_benchmark(fold_mesh, N, names=OPS, repeats=1, channels=CHANNELS)
    by = {(r["op"], r["path"]): r for r in rows}
    if sorted(by) != sorted((op, p) for op in OPS for p in ("foldcp", "fallback")):
        problems.append(f"rows {sorted(by)}")
    outer = by[("outer_sum", "foldcp")]
    if outer["fwd_counts"] != {("all_gather", "cp0"): 1}:
        problems.append(f"outer_sum forward: {outer['fwd']}")
    if outer["bwd_counts"] != {("reduce_scatter", "cp0"): 1, ("all_reduce", "cp1"): 1}:
        problems.append(f"outer_sum backward: {outer['bwd']}")
    # The all-gather returns the whole column single [1, N, C] in float32 (N divides by cp0
    # here, so no padding).
    if N % cp0 == 0 and outer["fwd_KiB"] * 1024 != N * CHANNELS * 4:
        problems.append(f"outer_sum forward bytes {outer['fwd_KiB'] * 1024}")
    for op in ("tokens_to_atoms", "bmm(a2t.float(), s)"):
        r = by[(op, "foldcp")]
        if r["fwd_counts"] != {} or r["bwd_counts"] != {} or r["fwd_KiB"] or r["bwd_KiB"]:
            problems.append(f"{op}: {r['fwd']} / {r['bwd']}")
    mean = by[("masked_mean", "foldcp")]
    if mean["fwd_counts"] != {("all_reduce", "cp0"): 1, ("all_reduce", "cp1"): 1}:
        problems.append(f"masked_mean forward: {mean['fwd']}")
    for r in rows:
        if r["path"] == "foldcp":
            if r["status"] != "ok" or r["documented"] is not True:
                problems.append(f"{r['op']}: {r['status']}, documented {r.get('documented')}")
            if not (r["fwd_ms"] > 0 and len(r["fwd_times"]) == 1):
                problems.append(f"{r['op']}: times {r['fwd_times']}")
        elif r["status"] == "ok" or r["status"].startswith("fails (backward)"):
            if r["output"] not in ("equal", "differs"):
                problems.append(f"{r['op']} fallback output {r['output']}")
        elif not r["status"].startswith("fails (forward)") or not r["message"]:
            problems.append(f"{r['op']} fallback status {r['status']!r}, {r['message']!r}")
        if not (r["same_counts_on_ranks"] and r["debug_totals_agree"]):
            problems.append(f"{r['op']} {r['path']}: counts differ over ranks or CommDebugMode")
    if fold_mesh.rank == 0:
        md, png, _ = write_ops_results(rows, fold_mesh.cp, "test", Path(tmp_path))
        text = md.read_text()
        if f"| {cp0}x{cp1} | {N} |" not in text or "| outer_sum | foldcp |" not in text:
            problems.append("the markdown table is missing rows")
        if png.read_bytes()[:4] != b"\x89PNG":
            problems.append("the PNG is missing")
    collective_assert(not problems, "; ".join(problems))


@pytest.mark.multigpu_static
@pytest.mark.parametrize("fold_mesh", MESHES, indirect=True, ids=str)
def test_train_step_benchmark_loss_is_the_serial_loss(fold_mesh, tmp_path):
    row = run_train_step_benchmark(fold_mesh, N, config=CONFIG, repeats=1, seed=3)
    sample = {k: v.unsqueeze(0) for k, v in make_complex(N, seed=3, msa_rows=4).items()}
    torch.manual_seed(3)
    with torch.no_grad():
        expected = float(reference_loss(ReferenceFoldModel(CONFIG)(**sample), sample))
    sample_bytes = sum(v.numel() * v.element_size() for v in sample.values())
    problems = []
    if abs(row["loss"] - expected) > 1e-5 * abs(expected):
        problems.append(f"loss {row['loss']} != serial {expected}")
    if row["serial_loss"] != pytest.approx(expected, rel=1e-6) or not row["losses_agree"]:
        problems.append(f"serial loss {row['serial_loss']}, agree {row['losses_agree']}")
    for r in row["ranks"]:
        if not (0 < r["shard"] < sample_bytes and r["held"] > r["shard"] and r["step_peak"] > 0):
            problems.append(f"rank {r['rank']}: {r}")
        if r["peak"] != r["held"] + r["step_peak"]:
            problems.append(f"rank {r['rank']}: peak is not held + step peak")
    if not (row["time_s"] > 0 and len(row["times"]) == 1):
        problems.append(f"times {row['times']}")
    if fold_mesh.rank == 0:
        base = dict(row, mesh="1x1", ranks_n=1, peak_MiB=4 * row["peak_MiB"])
        write_step_results([base], "test 1x1", Path(tmp_path))
        md, png, _ = write_step_results([row], "test", Path(tmp_path))
        text = md.read_text()
        mesh = f"{fold_mesh.cp[0]}x{fold_mesh.cp[1]}"
        if f"| 1x1 | {N} |" not in text or f"| {mesh} | {N} |" not in text:
            problems.append("the shared table misses a mesh")
        if f"| {4.0:.3f} |" not in text:
            problems.append("the 1x1 ratio is missing")
        if png.read_bytes()[:4] != b"\x89PNG":
            problems.append("the PNG is missing")
    collective_assert(not problems, "; ".join(problems))
