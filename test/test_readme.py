"""The README's usage blocks work as written (see ``readme_probe.py``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

PROBE = Path(__file__).with_name("readme_probe.py")


def test_readme_usage_blocks_run_as_written_and_match_serial(tmp_path):
    out = tmp_path / "checked.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
        str(PROBE), str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FOLDCP_TIMEOUT_S": "300"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(out.read_text()) == {"checked": ["boltz", "script"]}
