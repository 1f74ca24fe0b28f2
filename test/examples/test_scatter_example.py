"""The Hydra scatter example runs end to end, and the registry config composes with Hydra."""

import re
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from physicsnemo_foldcp import FeatureRegistry
from physicsnemo_foldcp.training.config import register_configs

ROOT = Path(__file__).resolve().parents[2]


def test_scatter_example_single_process():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "scatter_sample.py"), "sample.n_tokens=48",
         "registry=boltz1", "sharding.atom_multiple=32", "sharding.map_layout=index",
         "sharding.balance.mode=balanced"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "audit: clean" in proc.stdout
    assert "gather_features(scatter_features(x)) == x on every rank" in proc.stdout
    assert "frames_idx" in proc.stdout  # the report lists the features
    # the sharding group reached the scatter: atoms padded to 32, index-layout maps
    assert "455 atoms (padded 480)" in proc.stdout
    assert re.search(r"atom_to_token\s+\(480,\)", proc.stdout)


def test_registry_extends_from_hydra_overrides():
    register_configs()  # the schemas conf/ selects (done on import; explicit here)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(
            config_name="scatter",
            overrides=[
                "registry=boltz2",
                "+registry.features.my_bias={axes: [tokens, tokens, null], pad_value: 0}",
                "registry.remove=[plddt]",
            ],
        )
    registry = FeatureRegistry.from_config(OmegaConf.to_container(cfg.registry))
    assert "my_bias" in registry and "plddt" not in registry
    assert registry["my_bias"].axes == ("tokens", "tokens", None)
