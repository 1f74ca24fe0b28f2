"""Ops whose result crosses the row blocks: max / min along a split dim, reshapes around the
split dims, unique and boolean selection of a scattered single; each against serial.

Boltz's confidence heads use all four (pTM's max over frames, the interface mask's max
over a pair tile's columns, ``reshape(-1, N)`` of a frame mask, the chain ids of the
valid tokens); without their rules each one is a fallback gather.
"""

import pytest
import torch

from physicsnemo_foldcp import scatter_features
from physicsnemo_foldcp.core import events
from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.testing import collective_assert
from physicsnemo_foldcp.testing.asserts import gather_failures

pytestmark = pytest.mark.multigpu_static
MESHES = [(1, 2, 2), (1, 2, 3)]


def _steps():
    """(name, feature, fn): ops on scattered features, each run on the serial tensor too."""
    return [
        ("max over a tile's columns", "token_bonds", lambda t: torch.max(t.float(), dim=-1)),
        ("min over a tile's rows", "token_bonds", lambda t: torch.min(t.float(), dim=1)),
        ("max over tokens, keepdim", "asym_id", lambda t: t.max(dim=1, keepdim=True)),
        ("max with ties", "token_pad_mask", lambda t: torch.max(t.float(), dim=1)),
        ("reshape merging leading dims", "token_pad_mask", lambda t: t[:, None].reshape(-1, 13)),
        ("reshape splitting the batch", "ref_pos", lambda t: t.reshape(1, 1, -1, 3)),
        ("unique", "asym_id", lambda t: torch.unique(t)),
        ("boolean selection", "asym_id", lambda t: t[t > 0]),
    ]  # fmt: skip


def _equal(got, want) -> bool:
    if isinstance(want, tuple):
        return all(_equal(g, w) for g, w in zip(got, want)) and len(got) == len(want)
    got = got.full_tensor() if hasattr(got, "full_tensor") else got
    return got.shape == want.shape and torch.equal(got, want)


@pytest.mark.parametrize("fold_mesh", MESHES, indirect=True, ids=str)
def test_cross_block_ops_match_serial_without_fallbacks(fold_mesh):
    sample = {k: v.unsqueeze(0) for k, v in make_complex(13, seed=3, msa_rows=2).items()}
    sharded = scatter_features(sample if fold_mesh.is_domain_source else None, fold_mesh)
    problems = []
    for name, feature, fn in _steps():
        fallbacks, problem = [], None
        try:
            with events.observe(fallbacks.append):
                out = fn(sharded[feature])
            fallbacks = [e for e in fallbacks if e.kind == events.FALLBACK]
            if fallbacks:
                problem = f"{name}: fallback gather in {fallbacks[0].op}"
        except Exception as error:  # noqa: BLE001 - reported collectively
            problem = f"{name}: {type(error).__name__}: {error}"
        failures = gather_failures(problem)
        if failures:
            problems += [f"rank {r}: {m}" for r, m in failures.items()]
        elif not _equal(out, fn(sample[feature])):
            problems.append(f"{name}: differs from serial")
    collective_assert(not problems, "; ".join(problems))


@pytest.mark.parametrize("fold_mesh", [(1, 2, 2)], indirect=True, ids=str)
def test_max_values_carry_the_gradient_to_the_first_maximum(fold_mesh):
    sample = {k: v.unsqueeze(0) for k, v in make_complex(13, seed=3, msa_rows=2).items()}
    sharded = scatter_features(sample if fold_mesh.is_domain_source else None, fold_mesh)
    x = sharded["token_bonds"].float().detach().requires_grad_(True)
    torch.max(x + 0.0, dim=-1).values.sum().backward()
    serial = sample["token_bonds"].float().requires_grad_(True)
    torch.max(serial + 0.0, dim=-1).values.sum().backward()
    collective_assert(
        torch.equal(x.grad.full_tensor(), serial.grad), "max's gradient differs from serial"
    )
