"""Boltz's own AttentionPairBias, Transition and dropout masks on scattered layouts.

Each test builds a small Boltz module with a fixed seed (the same weights on every rank),
runs it unchanged on FoldTensors laid out as the scatter lays out features, and compares
output, input gradients and every parameter gradient with the serial module (TF32 off).
"""

import copy

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.placement_types import Replicate, Shard

from physicsnemo_foldcp.core.events import FALLBACK
from physicsnemo_foldcp.ops import observe
from physicsnemo_foldcp.testing import collective_assert
from physicsnemo_foldcp.testing.collectives import collective_counts
from physicsnemo_foldcp.testing.layouts import TokenLayout
from physicsnemo_foldcp.testing.parity import (
    close,
    compare_parameter_grads,
    randomize_parameters,
)

PAIR = ("tokens", "tokens", None)
SINGLE = ("tokens", None)

pytestmark = pytest.mark.multigpu_static
MESHES = [(2, 1, 2), (2, 2, 1), (1, 2, 2), (1, 2, 3), (1, 3, 2), (1, 3, 3)]
mesh_param = pytest.mark.parametrize(
    "fold_mesh", MESHES, indirect=True, ids=lambda s: "x".join(map(str, s))
)
TOKENS = pytest.mark.parametrize("n", [23, 37])


def inputs(n, c_s, c_z, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(1, n, c_s, generator=g)
    z = torch.randn(1, n, n, c_z, generator=g)
    mask = torch.ones(1, n)
    mask[:, -3:] = 0
    return s, z, mask


@mesh_param
@TOKENS
def test_attention_pair_bias_matches_serial_without_fallbacks(fold_mesh, n):
    """Output, gradients and the stated forward collectives: one all-gather over cp0 (keys,
    values, mask) and two all-reduces over cp1 (row maxima, sums), none on a size-1 dim."""
    from boltz.model.layers.attentionv2 import AttentionPairBias

    module = randomize_parameters(AttentionPairBias(32, 16, num_heads=4), 0)
    serial_module = copy.deepcopy(module)
    s, z, mask = inputs(n, 32, 16)
    layout = TokenLayout(fold_mesh, n)
    s_st, s_leaf = layout.shard(s, SINGLE, requires_grad=True)
    z_st, z_leaf = layout.shard(z, PAIR, requires_grad=True)
    m_st, _ = layout.shard(mask, ("tokens",))
    fallbacks = []
    with observe(lambda e: fallbacks.append(e) if e.kind == FALLBACK else None):
        with CommDebugMode() as forward:
            out = module(s=s_st, z=z_st, mask=m_st, k_in=s_st)
        (out * out).sum().backward()
    cp0, cp1 = fold_mesh.cp
    stated = {"all_gather": 1} if cp0 > 1 else {}
    stated.update({"all_reduce": 2} if cp1 > 1 else {})
    s_ref, z_ref = s.clone().requires_grad_(True), z.clone().requires_grad_(True)
    ref = serial_module(s=s_ref, z=z_ref, mask=mask, k_in=s_ref)
    (ref * ref).sum().backward()
    problems = [f"fallback gathers: {[(e.op, e.mesh_dims) for e in fallbacks]}"][: len(fallbacks)]
    if collective_counts(forward) != stated:
        problems.append(f"forward collectives {collective_counts(forward)}, stated {stated}")
    if tuple(out.placements) != (Shard(1), Replicate()):
        problems.append(f"output placements {out.placements}")
    close(out.full_tensor(), ref.detach(), "output", problems)
    close(s_leaf.grad, layout.local(s_ref.grad, SINGLE), "grad s", problems)
    close(z_leaf.grad, layout.local(z_ref.grad, PAIR), "grad z", problems)
    compare_parameter_grads(module, serial_module, problems)
    collective_assert(not problems, "; ".join(problems))


@mesh_param
@TOKENS
def test_transition_on_a_pair_tile_is_local(fold_mesh, n):
    from boltz.model.layers.transition import Transition

    module = randomize_parameters(Transition(16, 64), 1)
    serial_module = copy.deepcopy(module)
    _, z, _ = inputs(n, 32, 16, seed=1)
    layout = TokenLayout(fold_mesh, n)
    z_st, z_leaf = layout.shard(z, PAIR, requires_grad=True)
    with CommDebugMode() as forward:
        out = module(z_st)
    (out * out).sum().backward()
    z_ref = z.clone().requires_grad_(True)
    ref = serial_module(z_ref)
    (ref * ref).sum().backward()
    problems = []
    if sum(forward.get_comm_counts().values()):
        problems.append(f"forward communicated: {forward.get_comm_counts()}")
    close(out.full_tensor(), ref.detach(), "output", problems)
    close(z_leaf.grad, layout.local(z_ref.grad, PAIR), "grad z", problems)
    compare_parameter_grads(module, serial_module, problems)
    collective_assert(not problems, "; ".join(problems))


@mesh_param
@pytest.mark.parametrize("columnwise", [False, True], ids=["rowwise", "columnwise"])
def test_dropout_masks_equal_serial_for_a_seed(fold_mesh, columnwise):
    """Boltz's get_dropout_mask draws from the global shape: every rank the same mask."""
    from boltz.model.layers.dropout import get_dropout_mask

    n = 23
    _, z, _ = inputs(n, 32, 16, seed=2)
    layout = TokenLayout(fold_mesh, n)
    z_st, _ = layout.shard(z, PAIR)
    torch.manual_seed(7)
    with CommDebugMode() as mode:
        mask = get_dropout_mask(0.25, z_st, True, columnwise=columnwise)
        dropped = mask * z_st
    torch.manual_seed(7)
    serial = get_dropout_mask(0.25, z, True, columnwise=columnwise) * z
    problems = []
    if sum(mode.get_comm_counts().values()):
        problems.append(f"the mask communicated: {mode.get_comm_counts()}")
    if not torch.equal(dropped.full_tensor(), serial):
        problems.append("masked pair differs from serial")
    collective_assert(not problems, "; ".join(problems))
