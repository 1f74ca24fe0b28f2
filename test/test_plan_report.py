"""The plan report, library and CLI: ranges, bytes per group, padding, imbalance, the PNG."""

import math
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from physicsnemo_foldcp import ShardingOptions
from physicsnemo_foldcp.cli.plan_report import main
from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.features import FeatureRegistry
from physicsnemo_foldcp.sharding.balance import balanced_token_bounds
from physicsnemo_foldcp.sharding.plan_report import plan_report

GROUPS = ("token", "pair", "atom", "msa", "other")


def run_cli(capsys, *args):
    assert main([str(a) for a in args]) == 0
    return capsys.readouterr().out


def table_rows(text):
    """The per-rank rows of the printed table as lists of cells."""
    rows = []
    for line in text.splitlines():
        if re.match(r"^\| \d+ \|", line):
            rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def span(lo, hi):
    return f"[{lo},{hi})"


def group_of(axes):
    if list(axes).count("tokens") >= 2:
        return "pair"
    if "msa" in axes:
        return "msa"
    if "atoms" in axes or "rset" in axes:
        return "atom"
    if "tokens" in axes:
        return "token"
    return "other"


def local_piece(name, value, axes, rows, cols, msa_rows, atoms, rset_rows):
    """This rank's block of one serial feature, cut by hand (no padding)."""
    first = axes[0] if axes else None
    second = axes[1] if len(axes) > 1 else None
    if first == "tokens" and second == "tokens":
        return value[rows[0] : rows[1], cols[0] : cols[1]]
    if first == "msa":
        return value[msa_rows[0] : msa_rows[1], cols[0] : cols[1]]
    if first == "tokens":
        return value[rows[0] : rows[1]]
    if first == "atoms":
        return value[atoms[0] : atoms[1]]
    if first == "rset":
        return value[rset_rows]
    if first in ("ensemble", "templates") and second == "tokens":
        return value[:, rows[0] : rows[1]]
    if first in ("ensemble", "templates") and second == "atoms":
        return value[:, atoms[0] : atoms[1]]
    return value


def expected_report(x, cp0, cp1, bounds=None):
    """Per rank: token/column/atom ranges and bytes per group, computed from the tensors."""
    registry = FeatureRegistry.preset("boltz2")
    n = x["token_pad_mask"].shape[0]
    if bounds is None:
        sizes = [len(c) for c in torch.arange(n).tensor_split(cp0)]
        bounds = [0] + np.cumsum(sizes).tolist()
    col_bounds = [0] + np.cumsum([len(c) for c in torch.arange(n).tensor_split(cp1)]).tolist()
    if cp0 == cp1:
        col_bounds = list(bounds)
    atom_starts = [0] + x["atom_to_token"].sum(0).cumsum(0).tolist()
    s = x["msa"].shape[0]
    msa_bounds = [0] + np.cumsum([len(c) for c in torch.arange(s).tensor_split(cp0)]).tolist()
    rset_token = x["atom_to_token"].argmax(1)[x["r_set_to_rep_atom"].argmax(1)]
    out = []
    for i in range(cp0):
        for j in range(cp1):
            rows = (bounds[i], bounds[i + 1])
            cols = (col_bounds[j], col_bounds[j + 1])
            atoms = (atom_starts[rows[0]], atom_starts[rows[1]])
            rset_rows = ((rset_token >= rows[0]) & (rset_token < rows[1])).nonzero().flatten()
            group_bytes = dict.fromkeys(GROUPS, 0)
            for name, value in x.items():
                axes = registry[name].axes
                piece = local_piece(
                    name, value, axes, rows, cols, msa_bounds[i : i + 2], atoms, rset_rows
                )
                group_bytes[group_of(axes)] += piece.numel() * piece.element_size()
            out.append(
                {
                    "rank": i * cp1 + j,
                    "tokens": span(*rows),
                    "columns": span(*cols),
                    "atoms": span(*atoms),
                    "bytes": [group_bytes[g] for g in GROUPS],
                    "row_atoms": atoms[1] - atoms[0],
                }
            )
    return out


def test_cli_prints_ranges_bytes_padding_imbalance_and_draws(capsys, tmp_path):
    png = tmp_path / "plan.png"
    text = run_cli(capsys, "--tokens", 40, "--cp", 2, 3, "--msa-rows", 5, "--png", png)
    x = make_complex(40, seed=0, preset="boltz2", msa_rows=5)
    expected = expected_report(x, 2, 3)
    rows = table_rows(text)
    assert len(rows) == 6
    for got, want in zip(rows, expected):
        rank, _, tokens, columns, atoms, _, _, *group_bytes, total, pads = got
        assert int(rank) == want["rank"]
        assert (tokens, columns, atoms) == (want["tokens"], want["columns"], want["atoms"])
        assert [int(b) for b in group_bytes] == want["bytes"]
        assert int(total) == sum(want["bytes"])
        assert int(pads) == 0
    assert "padding: 0 pad elements" in text
    row_atoms = [e["row_atoms"] for e in expected]
    atom_ratio = max(row_atoms) / (sum(row_atoms) / len(row_atoms))
    totals = [sum(e["bytes"]) for e in expected]
    byte_ratio = max(totals) / (sum(totals) / len(totals))
    assert f"imbalance (max/mean per rank): atoms {atom_ratio:.3f}" in text
    assert f"bytes {byte_ratio:.3f}" in text
    assert png.exists() and png.stat().st_size > 10_000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_balanced_with_padding(capsys):
    composition = {"protein": 0.4, "rna": 0.4, "ligand": 0.2}
    text = run_cli(
        capsys,
        *("--tokens", 48, "--cp", 2, 2, "--msa-rows", 3, "--balanced"),
        *("--composition", "protein=0.4,rna=0.4,ligand=0.2"),
        *("--token-multiple", 4, "--atom-multiple", 32),
    )
    x = make_complex(48, seed=0, msa_rows=3, composition=composition)
    per_token = x["atom_to_token"].sum(0)
    bounds = balanced_token_bounds(per_token, 2)
    assert f"token bounds {list(bounds)}" in text
    row_tokens = [bounds[i + 1] - bounds[i] for i in range(2)]
    row_atoms = [int(per_token[bounds[i] : bounds[i + 1]].sum()) for i in range(2)]
    padded_tokens = [math.ceil(t / 4) * 4 for t in row_tokens]
    padded_atoms = [math.ceil(a / 32) * 32 for a in row_atoms]
    for got in table_rows(text):
        i = int(got[0]) // 2
        assert got[2] == span(bounds[i], bounds[i + 1])
        assert (int(got[5]), int(got[6])) == (padded_tokens[i], padded_atoms[i])
    registry = FeatureRegistry.preset("boltz2")
    lengths = {"tokens": sum(padded_tokens), "atoms": sum(padded_atoms)}
    real = sum(v.numel() for v in x.values())
    padded = sum(
        math.prod(lengths.get(a, s) for a, s in zip(registry[k].axes, v.shape))
        for k, v in x.items()
    )
    assert f"padding: {padded - real} pad elements on {real} real elements" in text
    mean = sum(row_atoms) / 2
    even = [int(per_token[:24].sum()), int(per_token[24:].sum())]
    assert f"atoms per row block: {row_atoms[0]}, {row_atoms[1]}" in text
    assert f"(even split: {even[0]}, {even[1]})" in text
    assert f"even split for comparison: atoms {max(even) / mean:.3f}" in text


@pytest.mark.parametrize("suffix", [".pt", ".npz"])
def test_feature_files_give_the_same_report(capsys, tmp_path, suffix):
    x = make_complex(30, seed=4, msa_rows=4)
    path = tmp_path / f"sample{suffix}"
    if suffix == ".pt":
        torch.save(x, path)
    else:
        np.savez(path, **{k: v.numpy() for k, v in x.items()})
    from_file = run_cli(capsys, "--features", path, "--cp", 3, 3)
    synthetic = run_cli(capsys, "--tokens", 30, "--seed", 4, "--msa-rows", 4, "--cp", 3, 3)
    assert table_rows(from_file) == table_rows(synthetic)
    assert len(table_rows(from_file)) == 9


def test_index_map_layout_shrinks_the_atom_group():
    x = make_complex(30, seed=1, msa_rows=2)
    dense = plan_report(x, (2, 2))
    index = plan_report(x, (2, 2), options=ShardingOptions(map_layout="index"))
    n, a = 30, x["atom_to_token"].shape[0]
    rset_token = x["atom_to_token"].argmax(1)[x["r_set_to_rep_atom"].argmax(1)]
    for d, c in zip(dense.ranks, index.ranks):
        tokens = d.tokens[1] - d.tokens[0]
        atoms = d.atoms[1] - d.atoms[0]
        rset = int(((rset_token >= d.tokens[0]) & (rset_token < d.tokens[1])).sum())
        # Dense maps: atom_to_token [A_i, N], two [N_i, A] maps, r_set [R_i, A]; int64.
        dense_maps = 8 * (atoms * n + 2 * tokens * a + rset * a)
        index_maps = 8 * (atoms + 2 * tokens + rset)
        assert d.group_bytes["atom"] - c.group_bytes["atom"] == dense_maps - index_maps
        assert d.group_bytes["pair"] == c.group_bytes["pair"]


def test_cli_rejects_bad_arguments(capsys):
    assert main(["--tokens", "10", "--cp", "0", "2"]) == 2
    assert "both sizes must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--tokens", "10", "--features", "x.pt", "--cp", "1", "1"])


def test_the_cli_runs_as_a_module():
    command = [sys.executable, "-m", "physicsnemo_foldcp.cli.plan_report"]
    args = ["--tokens", "12", "--cp", "2", "1", "--msa-rows", "2"]
    proc = subprocess.run(command + args, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert len(table_rows(proc.stdout)) == 2
    assert "plan (even) on cp0 x cp1 = 2 x 1" in proc.stdout
