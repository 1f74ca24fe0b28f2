"""Importing the plugin changes nothing for ShardTensors it did not make.

Two 4-process jobs run the same 14 generic ops (Linear, matmul, einsum, bmm, slicing,
indexing, sum, mean, softmax, layer_norm, cat, reshape, casts, cdist) on even and uneven
ShardTensors made by PhysicsNeMo's ``scatter_tensor`` (``equivalence_probe.py``): one
without the plugin, one with it imported. Every result (value, or error) and every
collective count must be identical.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

PROBE = Path(__file__).with_name("equivalence_probe.py")


def run_probe(mode: str, out: Path) -> dict:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
        str(PROBE), mode, str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_generic_ops_on_plain_shard_tensors_are_unchanged_by_the_import(tmp_path):
    plain = run_probe("plain", tmp_path / "plain.json")
    plugin = run_probe("plugin", tmp_path / "plugin.json")
    assert plain.pop("mode") == "plain" and plugin.pop("mode") == "plugin"
    assert len(plain) == 28 and plain.keys() == plugin.keys()
    differ = [key for key in plain if plain[key] != plugin[key]]
    assert not differ, {key: (plain[key], plugin[key]) for key in differ[:3]}
    ran = [key for key, value in plain.items() if "value" in value]
    assert len(ran) >= 24, f"too few ops ran at all: {ran}"
