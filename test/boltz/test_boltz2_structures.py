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

import pytest
import torch
import torch.distributed as dist

from physicsnemo_foldcp.features import FeatureRegistry
from physicsnemo_foldcp.testing import collective_assert
from physicsnemo_foldcp.testing.boltz_outputs import compare_prediction_dirs

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


@pytest.mark.parametrize(
    "fold_mesh,n_tokens",
    [((2, 1, 2), 37), ((1, 2, 2), 61), ((1, 2, 3), 37), ((1, 3, 3), 37)],
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
        problems += compare_prediction_dirs(
            shared_dir / "ours" / record, shared_dir / "serial" / record
        )
    printed = capsys.readouterr().out
    if "Error in" in printed:  # Boltz's confidence heads print and report 0 on an exception
        problems.append(f"Boltz caught an exception: {printed.strip()[:300]}")
    collective_assert(not problems, "; ".join(problems[:8]))
