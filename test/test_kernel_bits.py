"""kernel_bits --compare says bit-identical only when every tensor of every rank is."""

import sys
from pathlib import Path

import torch

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.kernel_bits import compare  # noqa: E402


def saves(tmp_path: Path, last: float) -> tuple[Path, Path]:
    a, b = tmp_path / "a", tmp_path / "b"
    for out, value in ((a, 1.0), (b, last)):
        out.mkdir(parents=True)
        for rank in range(2):
            torch.save({"x": torch.zeros(3), "y": torch.full((2,), value)}, out / f"rank{rank}.pt")
    return a, b


def test_equal_saves_compare_equal_and_one_bit_fails(tmp_path, capsys):
    a, b = saves(tmp_path, 1.0)
    assert compare(a, b) == 0
    assert "4 of 4 tensors bit-identical over 2 ranks" in capsys.readouterr().out
    c, d = saves(tmp_path / "next", float(torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))))
    assert compare(c, d) == 1
    assert "rank0.pt y: differs" in capsys.readouterr().out


def test_missing_ranks_fail(tmp_path):
    a, b = saves(tmp_path, 1.0)
    (b / "rank1.pt").unlink()
    assert compare(a, b) == 1
