"""The scatter benchmark at a tiny size: it runs every method and measures what it claims."""

import math
import sys
from pathlib import Path

import pytest

from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.features import FeatureRegistry
from physicsnemo_foldcp.testing import collective_assert

pytestmark = pytest.mark.multigpu_static

N = 32
MSA_ROWS = 8
FEATURES = [  # one or more of every placement kind, index remapping and replication
    "atom_pad_mask",
    "atom_to_token",
    "coords",
    "disto_target",
    "frames_idx",
    "msa",
    "r_set_to_rep_atom",
    "rdkit_bounds_index",
    "ref_pos",
    "res_type",
    "token_bonds",
    "token_pad_mask",
    "token_to_rep_atom",
]


def boltz_cp_padding(x, cp0):
    """(padded, real) elements of boltz-cp's layout: tokens to cp0 * ceil(N / cp0), each row
    block of ceil(N / cp0) tokens padded to the largest block's atoms."""
    registry = FeatureRegistry.preset("boltz2")
    n = x["atom_to_token"].shape[1]
    block = math.ceil(n / cp0)
    per_token = x["atom_to_token"].sum(0)
    largest = max(int(per_token[i * block : (i + 1) * block].sum()) for i in range(cp0))
    lengths = {"tokens": cp0 * block, "atoms": cp0 * largest}
    padded = sum(
        math.prod(lengths.get(a, s) for a, s in zip(registry[k].axes, v.shape))
        for k, v in x.items()
    )
    return padded, sum(v.numel() for v in x.values())


# 2x2 and 2x3 (a square and a rectangular mesh); the 3x3 launch is benchmarks/README.md's.
@pytest.mark.parametrize("fold_mesh", [(1, 2, 2), (1, 2, 3)], indirect=True, ids=str)
def test_scatter_benchmark_runs_and_measures_what_it_claims(fold_mesh, tmp_path):
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    from benchmarks.bench_scatter import (
        METHODS,
        evaluate_targets,
        peak_within_target,
        run_scatter_benchmark,
        write_results,
    )

    rows = run_scatter_benchmark(fold_mesh, N, repeats=1, msa_rows=MSA_ROWS, features=FEATURES)
    by = {(r["complex"], r["method"]): r for r in rows}
    x = make_complex(N, seed=0, preset="boltz2", msa_rows=MSA_ROWS)
    x = {k: v for k, v in x.items() if k in FEATURES}
    sample_bytes = sum(v.numel() * v.element_size() for v in x.values())
    n_features = len(x)
    problems = []
    if [r["method"] for r in rows] != list(METHODS):
        problems.append(f"methods {[r['method'] for r in rows]}")
    for r in rows:
        if not all(t > 0 and math.isfinite(t) for t in r["times"]) or len(r["times"]) != 1:
            problems.append(f"{r['method']}: times {r['times']}")
    # The broadcast baseline receives the whole sample on every non-source rank.
    for rank in by[("default", "scatter_tensor")]["ranks"]:
        if not rank["source"] and rank["received"] != sample_bytes:
            problems.append(f"scatter_tensor received {rank['received']} != {sample_bytes}")
    # The true scatter receives at most its own blocks (plus at most 15 alignment bytes per
    # feature): exactly them with index maps, less with dense 0/1 maps (one int64 per row on
    # the wire); its peak memory holds what it received.
    for method in ("foldcp", "foldcp-index", "foldcp-balanced", "dtensor-layout"):
        for rank in by[("default", method)]["ranks"]:
            if rank["source"]:
                if rank["received"] != 0:
                    problems.append(f"{method}: the source received {rank['received']}")
                continue
            low = rank["shard"] if method == "foldcp-index" else 0.2 * rank["shard"]
            if not low <= rank["received"] <= rank["shard"] + 15 * n_features:
                problems.append(f"{method}: received {rank['received']}, shard {rank['shard']}")
            if not rank["received"] <= rank["peak"]:
                problems.append(f"{method}: peak {rank['peak']} < received {rank['received']}")
    if not peak_within_target(by[("default", "foldcp")]):
        problems.append("foldcp peak memory above 1.5 x shard + overhead")
    if by[("default", "foldcp")]["pad_over_real"] != 0:
        problems.append("foldcp pads without per-shard padding")
    padded, real = boltz_cp_padding(x, fold_mesh.cp[0])
    dtensor = by[("default", "dtensor-layout")]["pad_over_real"]
    if abs(dtensor - (padded / real - 1)) > 1e-12:
        problems.append(f"dtensor-layout padding {dtensor} != boltz-cp formula {padded / real - 1}")
    even = by[("default", "foldcp")]["atoms_max_over_mean"]
    balanced = by[("default", "foldcp-balanced")]["atoms_max_over_mean"]
    if not balanced <= even:
        problems.append(f"balanced atoms max/mean {balanced} > even split {even}")
    held = sum(r["real_atoms"] for r in by[("default", "foldcp")]["ranks"] if r["domain"] == 0)
    if held != int(x["atom_pad_mask"].sum()) * fold_mesh.cp[1]:
        problems.append(f"ranks hold {held} real atoms in all")
    if fold_mesh.rank == 0:
        paths = write_results(rows, fold_mesh.cp, "test", Path(tmp_path))
        md = paths[0].read_text()
        mesh = f"{fold_mesh.cp[0]}x{fold_mesh.cp[1]}"
        if f"| {mesh} | {N} |" not in md or "## Targets" not in md:
            problems.append("the markdown table is missing rows or targets")
        if paths[1].read_bytes()[:4] != b"\x89PNG" or paths[1].stat().st_size < 10_000:
            problems.append("the PNG is missing")
        names = [t["target"] for t in evaluate_targets(rows)]
        if len(names) < 3:
            problems.append(f"targets evaluated: {names}")
    collective_assert(not problems, "; ".join(problems))
