"""Run the README's usage blocks as written on a 2x2 mesh and compare them with serial.

Launched by ``test_readme.py`` as ``torchrun --nproc-per-node 4 readme_probe.py OUT``. Two
Python blocks of the README run unchanged, with only the names they leave to the reader
defined first:

- "Boltz models": ``s``, ``z``, ``mask``, ``pair_mask`` laid out as the scatter lays
  them out (13 tokens, the last 3 padded and masked), and seeded noise on the module's
  weights before its call. The module is in training mode and no rank is seeded: its
  outputs' ``full_tensor()`` must equal the same module run serially on the whole
  tensors from the same generator state (the same dropout masks).
- "Use it in your script": ``featurizer``, ``record`` and ``model`` (a synthetic complex
  with Boltz's batch axis of 1, and the reference model). ``gather_features`` must
  return the sample exactly, and the model's outputs must equal its serial outputs. The
  block's last line (``fc.shutdown()``) runs after the checks.

Every check is a collective assert; rank 0 writes the names of the blocks checked to OUT.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"
N_TOKENS, PADDED = 13, 3


def python_block(marker: str) -> list[str]:
    """Lines of the one README Python block that contains ``marker``."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    found = [b for b in blocks if marker in b]
    if len(found) != 1:
        raise SystemExit(f"README: {len(found)} python blocks contain {marker!r}, expected 1")
    return found[0].rstrip("\n").split("\n")


def run_boltz_block(problems: list[str]) -> None:
    """The "Boltz models" block on scattered inputs, against the serial module."""
    import physicsnemo_foldcp as fc
    from physicsnemo_foldcp.testing.layouts import TokenLayout
    from physicsnemo_foldcp.testing.parity import close

    lines = python_block("physicsnemo_foldcp.boltz.install()")
    *head, call = lines
    if not call.startswith("s, z = pairformer("):
        raise SystemExit(f"README: the Boltz block ends with {call!r}")
    mesh = fc.init_mesh(cp=(2, 2))
    generator = torch.Generator().manual_seed(0)
    s_full = torch.randn(1, N_TOKENS, 384, generator=generator)
    z_full = torch.randn(1, N_TOKENS, N_TOKENS, 128, generator=generator)
    mask = torch.ones(1, N_TOKENS)
    mask[:, -PADDED:] = 0
    pair_mask = mask[:, :, None] * mask[:, None, :]
    layout = TokenLayout(mesh, N_TOKENS)
    names = {
        "s": layout.shard(s_full, ("tokens", None))[0],
        "z": layout.shard(z_full, ("tokens", "tokens", None))[0],
        "mask": layout.shard(mask, ("tokens",))[0],
        "pair_mask": layout.shard(pair_mask, ("tokens", "tokens"))[0],
    }
    exec("\n".join(head), names)
    if names["mesh"] is not mesh:
        problems.append("the Boltz block's init_mesh(cp=(2, 2)) built a second mesh")
    # Boltz zero-initialises each sub-module's last projection (the module would return its
    # inputs): the same seeded noise added on every rank makes every sub-module count and
    # keeps whatever differs between the ranks' weights.
    noise = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in names["pairformer"].parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=noise))
    rng = torch.get_rng_state()
    exec(call, names)
    torch.set_rng_state(rng)
    s_serial, z_serial = names["pairformer"](s_full, z_full, mask, pair_mask)
    close(names["s"].full_tensor(), s_serial.detach(), "Boltz block: s", problems, rtol=1e-4)
    close(names["z"].full_tensor(), z_serial.detach(), "Boltz block: z", problems, rtol=1e-4)


def run_script_block(problems: list[str]) -> None:
    """The "Use it in your script" block, against the sample and the serial model."""
    from physicsnemo_foldcp.data.synthetic import make_complex
    from physicsnemo_foldcp.models import ModelConfig, ReferenceFoldModel
    from physicsnemo_foldcp.testing import collective_assert
    from physicsnemo_foldcp.testing.parity import close
    from physicsnemo_foldcp.training import batched

    *body, last = python_block("fc.scatter_features(sample, mesh)")
    if last.strip() != "fc.shutdown()":
        raise SystemExit(f"README: the script block ends with {last!r}")
    torch.manual_seed(0)
    model = ReferenceFoldModel(ModelConfig(c_atom=8, c_token=16, c_pair=8, n_blocks=1))
    names = {
        "featurizer": lambda n_tokens: batched(make_complex(n_tokens, seed=5, msa_rows=2)),
        "record": 22,
        "model": model,
    }
    exec("\n".join(body), names)
    sample = batched(make_complex(22, seed=5, msa_rows=2))
    gathered = names["serial"]
    if gathered.keys() != sample.keys():
        problems.append(f"gather_features keys differ: {sorted(gathered.keys() ^ sample.keys())}")
    for key in sample.keys() & gathered.keys():
        if not torch.equal(gathered[key], sample[key]):
            problems.append(f"gather_features changed {key!r}")
    with torch.no_grad():
        expected = model(**sample)
    for key, value in names["out"].items():
        close(value.full_tensor().detach(), expected[key], f"script block: {key}", problems)
    collective_assert(not problems, "; ".join(problems[:5]))
    exec(last, names)


def main(out: str) -> None:
    """Run both blocks (the Boltz one first: the script block shuts the job down)."""
    import physicsnemo_foldcp as fc
    from physicsnemo_foldcp.testing import collective_assert

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    problems: list[str] = []
    run_boltz_block(problems)
    collective_assert(not problems, "; ".join(problems[:5]))
    rank = fc.init_mesh(cp=(2, 2)).rank
    run_script_block(problems)
    if rank == 0:
        Path(out).write_text(json.dumps({"checked": ["boltz", "script"]}))


if __name__ == "__main__":
    main(sys.argv[1])
