"""Boltz's prediction files, compared: the project's against those of a serial run.

Both directories are written by Boltz's own writer (``<out_dir>/<record id>/``); the
structures (mmCIF) are compared atom record by atom record, with coordinates within a
tolerance (the files hold three decimals), the confidence JSON value by value and the
pLDDT / PAE / PDE arrays element by element.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

#: Coordinates (Angstrom) and confidence values: the parity tolerances of prediction.
COORDS_ATOL = 1e-4
VALUES_ATOL = 1e-5
ATOM_LINE = re.compile(r"^(ATOM|HETATM)\s")
DECIMAL = re.compile(r"-?\d+\.\d{3}")


def cif_atoms(path: Path) -> tuple[list[str], np.ndarray]:
    """The atom records of an mmCIF file without their coordinates, and ``[n, 3]`` coordinates."""
    labels, xyz = [], []
    for line in path.read_text().splitlines():
        if ATOM_LINE.match(line):
            fields = line.split()
            x = next(i for i, f in enumerate(fields) if DECIMAL.fullmatch(f))
            xyz.append([float(v) for v in fields[x : x + 3]])
            labels.append(" ".join(fields[:x] + fields[x + 3 : x + 4]))
    return labels, np.array(xyz)


def compare_values(a: Any, b: Any, path: str, atol: float = VALUES_ATOL) -> list[str]:
    """Differences of JSON values ``a`` against ``b`` (floats within ``atol``, NaN = NaN)."""
    if isinstance(b, dict):
        if not isinstance(a, dict) or set(a) != set(b):
            return [f"{path}: keys {sorted(a) if isinstance(a, dict) else a} != {sorted(b)}"]
        return [p for k in b for p in compare_values(a[k], b[k], f"{path}.{k}", atol)]
    if isinstance(b, float):
        same = isinstance(a, float) and ((np.isnan(a) and np.isnan(b)) or abs(a - b) <= atol)
        return [] if same else [f"{path}: {a} != {b}"]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def compare_prediction_dirs(
    ours: Path, theirs: Path, coords_atol: float = COORDS_ATOL, values_atol: float = VALUES_ATOL
) -> list[str]:
    """Every difference between two records' prediction directories (empty: the same).

    Parameters
    ----------
    ours, theirs : Path
        ``<out_dir>/<record id>`` of the run under test and of the serial run.
    coords_atol, values_atol : float
        Tolerances of the coordinates (plus the files' 0.001 rounding) and of every other
        value.

    Returns
    -------
    list[str]
        One line per difference, naming the file and the value.
    """
    names = sorted(p.name for p in theirs.iterdir())
    found = sorted(p.name for p in ours.iterdir()) if ours.is_dir() else []
    if found != names:
        return [f"files {found} != {names}"]
    problems: list[str] = []
    for name in names:
        a, b = ours / name, theirs / name
        if name.endswith(".cif"):
            (la, xa), (lb, xb) = cif_atoms(a), cif_atoms(b)
            if la != lb or not xb.size:
                problems.append(f"{name}: atom records differ")
            elif np.abs(xa - xb).max() > coords_atol + 1e-3:
                problems.append(f"{name}: coordinates differ by {np.abs(xa - xb).max()}")
        elif name.endswith(".json"):
            problems += compare_values(
                json.loads(a.read_text()), json.loads(b.read_text()), name, values_atol
            )
        elif name.endswith(".npz"):
            na, nb = np.load(a), np.load(b)
            for key in nb.files:
                same_shape = key in na.files and na[key].shape == nb[key].shape
                diff = np.nan_to_num(np.abs(na[key] - nb[key])).max() if same_shape else np.inf
                if not same_shape or (nb[key].size and diff > values_atol):
                    problems.append(f"{name}[{key}]: differs by {diff}")
    return problems


__all__ = ["COORDS_ATOL", "VALUES_ATOL", "cif_atoms", "compare_prediction_dirs", "compare_values"]
