"""Property tests of the cross-axis ops on random samples and every mesh: loss and weight
gradients of a chain through every op equal the serial ones."""

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from physicsnemo.domain_parallel import ShardTensor

from physicsnemo_foldcp import ShardingOptions, scatter_features
from physicsnemo_foldcp.ops import (
    atoms_to_tokens_mean,
    masked_mean,
    outer_sum,
    pair_mask,
    representative_atoms,
    tag_maps,
    tokens_to_atoms,
)
from physicsnemo_foldcp.testing import collective_assert
from physicsnemo_foldcp.testing.random_sample import (
    RandomSampleSpec,
    random_registry,
    random_sample,
)
from physicsnemo_foldcp.testing.strategies import paddings, sample_specs

pytestmark = pytest.mark.multigpu_static

MESHES = [(2, 1, 2), (2, 2, 1), (1, 2, 2), (1, 2, 3), (3, 1, 2), (1, 3, 3)]
REGISTRY = random_registry()
RUNS = settings(
    max_examples=6, derandomize=True, database=None, deadline=None,
    suppress_health_check=list(HealthCheck),
)  # fmt: skip


class Chain(torch.nn.Module):
    """Every cross-axis op between two small linear layers, down to a scalar."""

    def __init__(self, channels: int):
        super().__init__()
        self.token_in = torch.nn.Linear(channels, 4)
        self.atom_in = torch.nn.Linear(channels, 4)

    def forward(self, f):
        s = self.token_in(f["single"].float())
        q = tokens_to_atoms(s, f["atom_to_token"]) + self.atom_in(f["atom_feat"].float())
        t = atoms_to_tokens_mean(q, f["atom_to_token"])
        r = representative_atoms(q, f["token_to_rep_atom"])
        mask = f["token_mask"].float()
        z = outer_sum(t, r)
        return masked_mean((z * z).sum(-1), pair_mask(mask)) + masked_mean((t * r).sum(-1), mask)


def _value(t):
    return t.full_tensor() if isinstance(t, ShardTensor) else t


@pytest.mark.parametrize("fold_mesh", MESHES, indirect=True, ids=str)
@RUNS
@given(spec=sample_specs(max_tokens=48, max_atoms_per_token=12), padding=paddings)
@example(spec=RandomSampleSpec(atoms_per_token=(0, 3, 0, 0, 1, 0), trailing_pad_atoms=2),
         padding={"token_multiple": 2, "atom_multiple": 4})  # fmt: skip
@example(  # one token: size-1 pair axes that are not broadcasts
    spec=RandomSampleSpec(atoms_per_token=(1,), channels=1),
    padding={"token_multiple": 1, "atom_multiple": 1},
)
def test_ops_chain_matches_serial_forward_and_backward(fold_mesh, spec, padding):
    x = random_sample(spec, seed=7 + fold_mesh.ddp_rank)
    x = {k: v.unsqueeze(0) for k, v in x.items()}
    torch.manual_seed(0)
    serial_model = Chain(spec.channels)
    model = Chain(spec.channels)
    model.load_state_dict(serial_model.state_dict())
    serial_loss = serial_model(x)
    serial_loss.backward()
    sharded = tag_maps(
        scatter_features(
            x if fold_mesh.is_domain_source else None,
            fold_mesh,
            registry=REGISTRY,
            options=ShardingOptions(**padding),
        )
    )
    loss = model(sharded)
    loss.backward()
    problems = []
    if not torch.allclose(_value(loss).detach(), serial_loss.detach(), rtol=1e-4, atol=1e-5):
        problems.append(f"loss {float(_value(loss))} != {float(serial_loss)}")
    for (name, p), q in zip(model.named_parameters(), serial_model.parameters()):
        grad = _value(p.grad)
        if grad is None or not torch.allclose(grad, q.grad, rtol=1e-4, atol=1e-5):
            problems.append(f"grad of {name}")
    collective_assert(not problems, f"{spec} {padding}: {problems}")
