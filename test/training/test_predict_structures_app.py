"""The prediction app as the README shows it: Boltz's YAML and a Boltz-2 weights file in,
Boltz's files out, on 2x2; the files equal those Boltz's writer makes from the serial
``Boltz2.predict_step`` with the same weights and seed.

The weights file is a Lightning ``.ckpt`` of a serial boltz-community ``Boltz2``, converted
to the project's checkpoint with the one-line conversion.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("boltz.main")
pytest.importorskip("pytorch_lightning")

from physicsnemo_foldcp.data.boltz_inputs import BoltzInputs  # noqa: E402
from physicsnemo_foldcp.models.boltz2_config import Boltz2Config  # noqa: E402
from physicsnemo_foldcp.testing.boltz2_models import (  # noqa: E402
    save_lightning_checkpoint,
    serial_boltz2,
)
from physicsnemo_foldcp.testing.boltz_library import write_library  # noqa: E402
from physicsnemo_foldcp.testing.boltz_outputs import compare_prediction_dirs  # noqa: E402
from physicsnemo_foldcp.training.structures import write_structures  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SEED = 5
YAML = """version: 1
sequences:
  - protein:
      id: A
      sequence: MKTAYIAKQRQISFVKSHFSRQ
      msa: empty
  - rna:
      id: B
      sequence: GCAUAGC
  - ligand:
      id: C
      smiles: 'CCO'
"""


LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)


def test_predict_app_writes_boltz_files_equal_to_serial_on_2x2(tmp_path):
    write_library(tmp_path / "cache")
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "cplx.yaml").write_text(YAML)
    config = Boltz2Config()  # what model=boltz2 builds
    boltz2 = serial_boltz2(config, seed=4)
    save_lightning_checkpoint(boltz2, tmp_path / "boltz2.ckpt")
    converted = _run(
        [sys.executable, "-m", "physicsnemo_foldcp.cli.convert_boltz_weights",
         str(tmp_path / "boltz2.ckpt"), str(tmp_path / "weights")]
    )  # fmt: skip
    assert converted.returncode == 0, converted.stderr[-2000:]
    app = _run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
         str(ROOT / "examples" / "predict.py"), "mesh.cp=[2,2]", "model=boltz2",
         "data=boltz_inputs", f"data.inputs={tmp_path / 'in'}",
         f"data.library_dir={tmp_path / 'cache'}", f"data.work_dir={tmp_path / 'work'}",
         f"predict.checkpoint={tmp_path / 'weights'}", f"predict.out_dir={tmp_path / 'out'}",
         f"predict.seed={SEED}"]
    )  # fmt: skip
    assert app.returncode == 0, app.stderr[-3000:]
    assert "Error in" not in app.stdout, app.stdout[-2000:]

    dataset = BoltzInputs(tmp_path / "in", tmp_path / "cache", tmp_path / "work")
    sample = dataset[0]
    boltz2.predict_args = dict(config.predict_args)
    torch.manual_seed(SEED)  # record 0
    with torch.no_grad():
        expected = boltz2.predict_step(dict(sample), 0)
    write_structures(expected, sample["record"][0], dataset.structures_dir, tmp_path / "serial")
    record = dataset.record_id(0)
    problems = compare_prediction_dirs(tmp_path / "out" / record, tmp_path / "serial" / record)
    assert not problems, "; ".join(problems[:8])
    assert sorted(p.suffix for p in (tmp_path / "out" / record).iterdir()).count(".cif") == 2


def test_outputs_boltz_could_not_write_or_would_replace_are_refused_first(tmp_path):
    from physicsnemo_foldcp.training.structures import (
        OutputDirError,
        OutputNameTooLong,
        check_structure_outputs,
    )

    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "mine.txt").write_text("a user's file")
    with pytest.raises(OutputDirError, match="kept already exists"):
        check_structure_outputs(["new", "kept"], tmp_path, 2, overwrite=False)
    check_structure_outputs(["new", "kept"], tmp_path, 2, overwrite=True)
    with pytest.raises(OutputNameTooLong, match="240 characters"):
        check_structure_outputs(["x" * 240], tmp_path, 2, overwrite=False)
    check_structure_outputs(["x" * 200], tmp_path, 2, overwrite=False)
    assert (tmp_path / "kept" / "mine.txt").read_text() == "a user's file"
