"""Boltz-2 structure prediction from Boltz's YAML to Boltz's files, under CP against serial.

A protein + DNA + RNA + benzene (SMILES, six atoms: the ligand frame search) complex goes
through Boltz's own processing and featurizer (``BoltzInputs``); Boltz's ``Boltz2`` with
random weights predicts it serially and Boltz's writer writes the reference files; the
project predicts the scattered sample with the same weights and seed and writes its files
with the same writer from the domain source. Every file must match: the mmCIF structures
(coordinates within 1e-4 A), the confidence JSON and the pLDDT / PAE / PDE arrays within
1e-5.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from physicsnemo_foldcp.features import FeatureRegistry
from physicsnemo_foldcp.testing import collective_assert

pytest.importorskip("boltz.main")

from physicsnemo_foldcp.data.boltz_inputs import BoltzInputs  # noqa: E402
from physicsnemo_foldcp.models.boltz2_config import Boltz2Config  # noqa: E402
from physicsnemo_foldcp.testing.boltz2_models import model_pair  # noqa: E402
from physicsnemo_foldcp.training.structures import (  # noqa: E402
    predict_structures,
    write_structures,
)

pytestmark = pytest.mark.multigpu_static
mesh_id = lambda s: "x".join(map(str, s))  # noqa: E731

YAML = """version: 1
sequences:
  - protein:
      id: A
      sequence: {protein}
      msa: empty
  - dna:
      id: B
      sequence: ACGTA
  - rna:
      id: C
      sequence: GCAUAGC
  - ligand:
      id: D
      smiles: 'c1ccccc1'
"""
PROTEINS = {37: "MKTAYIAKQRQISFVKSHF", 61: "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQAPILSRVGDG"}
SEED = 3
COORDS_ATOL = 1e-4
VALUES_ATOL = 1e-5
ATOM_LINE = re.compile(r"^(ATOM|HETATM)\s")


def _cif_atoms(path: Path) -> tuple[list[str], np.ndarray]:
    """The atom records' text without coordinates, and the coordinates."""
    labels, xyz = [], []
    for line in path.read_text().splitlines():
        if ATOM_LINE.match(line):
            fields = line.split()
            numbers = [i for i, f in enumerate(fields) if re.fullmatch(r"-?\d+\.\d{3}", f)]
            x = numbers[0]
            xyz.append([float(v) for v in fields[x : x + 3]])
            labels.append(" ".join(fields[:x] + fields[x + 3 : x + 4]))
    return labels, np.array(xyz)


def _compare_files(ours: Path, theirs: Path) -> list[str]:
    problems = []
    names = sorted(p.name for p in theirs.iterdir())
    if sorted(p.name for p in ours.iterdir()) != names:
        return [f"files {sorted(p.name for p in ours.iterdir())} != {names}"]
    for name in names:
        a, b = ours / name, theirs / name
        if name.endswith(".cif"):
            (la, xa), (lb, xb) = _cif_atoms(a), _cif_atoms(b)
            if la != lb or not xb.size:
                problems.append(f"{name}: atom records differ")
            elif np.abs(xa - xb).max() > COORDS_ATOL + 1e-3:  # written with 3 decimals
                problems.append(f"{name}: coordinates differ by {np.abs(xa - xb).max()}")
        elif name.endswith(".json"):
            ja, jb = json.loads(a.read_text()), json.loads(b.read_text())
            problems += _compare_values(ja, jb, name)
        elif name.endswith(".npz"):
            na, nb = np.load(a), np.load(b)
            for key in nb.files:
                diff = np.nan_to_num(np.abs(na[key] - nb[key])).max() if nb[key].size else 0
                if na[key].shape != nb[key].shape or diff > VALUES_ATOL:
                    problems.append(f"{name}[{key}]: differs by {diff}")
    return problems


def _compare_values(a, b, path: str) -> list[str]:
    if isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(a)} != {sorted(b)}"]
        return [p for k in b for p in _compare_values(a[k], b[k], f"{path}.{k}")]
    if isinstance(b, float):
        same = (np.isnan(a) and np.isnan(b)) or abs(a - b) <= VALUES_ATOL
        return [] if same else [f"{path}: {a} != {b}"]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


@pytest.mark.parametrize(
    "fold_mesh,n_tokens",
    [((2, 1, 2), 37), ((1, 2, 2), 61), ((1, 2, 3), 37), ((1, 3, 3), 61)],
    indirect=["fold_mesh"],
    ids=lambda v: mesh_id(v) if isinstance(v, tuple) else f"{v}",
)
def test_boltz_yaml_to_files_equals_serial(fold_mesh, n_tokens, shared_dir, capsys):
    from physicsnemo_foldcp.testing.boltz_library import write_library

    torch.backends.cuda.matmul.allow_tf32 = False
    if dist.get_rank() == 0:
        write_library(shared_dir / "cache")
        (shared_dir / "in").mkdir()
        text = YAML.format(protein=PROTEINS[n_tokens])
        (shared_dir / "in" / f"cplx{n_tokens}.yaml").write_text(text)
    dist.barrier()
    dataset = BoltzInputs(shared_dir / "in", shared_dir / "cache", shared_dir / "work")
    config = Boltz2Config(predict_args={"diffusion_samples": 2, "sampling_steps": 3})
    boltz2, ours = model_pair(config, seed=1)
    boltz2.predict_args = dict(config.predict_args)
    problems = []
    if dist.get_rank() == 0:  # the serial reference, written by Boltz's writer
        sample = dataset[0]
        if int(sample["token_pad_mask"].sum()) != n_tokens:
            problems.append(f"{int(sample['token_pad_mask'].sum())} tokens, not {n_tokens}")
        torch.manual_seed(SEED)
        with torch.no_grad():
            expected = boltz2.predict_step(dict(sample), 0)
        write_structures(
            expected, sample["record"][0], dataset.structures_dir, shared_dir / "serial"
        )
    predict_structures(
        ours,
        fold_mesh,
        dataset,
        shared_dir / "ours",
        registry=FeatureRegistry.preset("boltz2"),
        seed=SEED,
    )
    dist.barrier()
    if dist.get_rank() == 0:
        record = dataset.record_id(0)
        problems += _compare_files(shared_dir / "ours" / record, shared_dir / "serial" / record)
    printed = capsys.readouterr().out
    if "Error in" in printed:  # Boltz's confidence heads print and report 0 on an exception
        problems.append(f"Boltz caught an exception: {printed.strip()[:300]}")
    collective_assert(not problems, "; ".join(problems[:8]))
