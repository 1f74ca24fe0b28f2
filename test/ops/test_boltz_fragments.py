"""Boltz's own expressions, written out plainly, run on scattered features and match serial.

Nothing in the model code below calls a plugin op: the maps are used through ``torch.bmm``
/ ``@`` / ``torch.einsum``, pairs are built with ``f(s)[:, :, None] + g(s)[:, None, :]``,
distances with ``torch.cdist``. Only the test's loss uses ``masked_mean``.
"""

import copy

import pytest
import torch
from physicsnemo.domain_parallel import ShardTensor
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.debug import CommDebugMode

from physicsnemo_foldcp.ops import (
    ShardingLayoutError,
    atoms_to_tokens_mean,
    masked_mean,
    tokens_to_atoms,
)
from physicsnemo_foldcp.testing import collective_assert, collective_assert_close

pytestmark = pytest.mark.multigpu_static

MESHES = [(2, 1, 2), (1, 2, 2), (1, 2, 3), (1, 3, 3)]
mesh_id = "x".join
mesh_param = pytest.mark.parametrize(
    "fold_mesh", MESHES, indirect=True, ids=lambda s: mesh_id(map(str, s))
)
PAIR = ("tokens", "tokens")
AXES = {
    "atom_s": ("atoms", None),
    "token_q": ("tokens", None),
    "einsum_atom_s": ("atoms", None),
    "einsum_token_q": ("tokens", None),
    "matmul_atom_s": ("atoms", None),
    "rep": ("tokens", None),
    "distances": PAIR,
    "z": (*PAIR, None),
    "pair_mask": PAIR,
}


class BoltzFragments(nn.Module):
    """Serial Boltz-style code: the expressions of the issue, unchanged."""

    def __init__(self):
        super().__init__()
        self.s_to_c = nn.Linear(6, 4, bias=False)
        self.z_init_1 = nn.Linear(6, 5, bias=False)
        self.z_init_2 = nn.Linear(6, 5, bias=False)

    def forward(self, feats, s, q, x_atoms):
        a2t = feats["atom_to_token"].float()
        out = {}
        out["atom_s"] = torch.bmm(a2t, self.s_to_c(s))
        out["token_q"] = torch.bmm((a2t / (a2t.sum(1, keepdim=True) + 1e-6)).transpose(1, 2), q)
        out["einsum_atom_s"] = torch.einsum("bat,btc->bac", a2t, s)
        out["einsum_token_q"] = torch.einsum("bat,bac->btc", a2t, q)
        out["matmul_atom_s"] = a2t @ s
        rep = torch.bmm(feats["token_to_rep_atom"].float(), x_atoms)
        out["rep"] = rep
        out["distances"] = torch.cdist(rep, rep)
        out["z"] = self.z_init_1(s)[:, :, None] + self.z_init_2(s)[:, None, :]
        m = feats["token_pad_mask"]
        out["pair_mask"] = m[:, :, None] * m[:, None, :]
        return out


def loss_masks(case):
    """Serial masks of the loss terms (zero on the diagonal of the distances)."""
    n = case.n_tokens
    tokens = case.serial["token_pad_mask"]
    pair = tokens[:, :, None] * tokens[:, None, :]
    single = {"atoms": case.serial["atom_pad_mask"][..., None], "tokens": tokens[..., None]}
    masks = {name: single[axes[0]] for name, axes in AXES.items() if axes[1:] == (None,)}
    masks["distances"] = pair * (1 - torch.eye(n))
    masks["z"] = pair[..., None]
    axes = {name: (AXES[name][0], None) for name in masks}
    axes["distances"], axes["z"] = PAIR, (*PAIR, None)
    return masks, axes


@mesh_param
@pytest.mark.parametrize("padding", ["no-pad", "pad-4-32"])
def test_boltz_expressions_match_serial_with_gradients(fold_mesh, padding, ops_case, collectives):
    case = ops_case(fold_mesh, padding)
    torch.manual_seed(3)
    serial_model = BoltzFragments()
    distributed_model = copy.deepcopy(serial_model).to(case.device)
    n, a = case.n_tokens, case.n_atoms
    inputs = {"s": case.randn(1, n, 6), "q": case.randn(1, a, 6), "x": 10 * case.randn(1, a, 3)}
    input_axes = {"s": ("tokens", None), "q": ("atoms", None), "x": ("atoms", None)}
    params = {k: nn.Parameter(v.clone()) for k, v in inputs.items()}
    shards = {k: case.shard(v, input_axes[k], requires_grad=True) for k, v in inputs.items()}

    out_s = serial_model(case.serial, params["s"], params["q"], params["x"])
    out_d = distributed_model(case.sharded, shards["s"][0], shards["q"][0], shards["x"][0])

    masks, mask_axes = loss_masks(case)
    loss_s, loss_d = 0, 0
    for name in masks:
        weight = case.randn(*out_s[name].shape)
        loss_s = loss_s + masked_mean(out_s[name] * weight, masks[name])
        w_d, _ = case.shard(weight, AXES[name])
        m_d, _ = case.shard(masks[name], mask_axes[name])
        loss_d = loss_d + masked_mean(out_d[name] * w_d, m_d)
    loss_s.backward()
    loss_d.backward()

    for name, value in out_s.items():
        collective_assert_close(
            case.unpadded(out_d[name], AXES[name]), value.detach(), name, atol=1e-5
        )
    collective_assert_close(loss_d.to_local().detach().cpu(), loss_s.detach(), "loss")
    for k in inputs:
        collective_assert_close(
            shards[k][1].grad.cpu(), case.expected_local(params[k].grad, input_axes[k]), f"grad {k}"
        )
    for (label, p_d), p_s in zip(distributed_model.named_parameters(), serial_model.parameters()):
        collective_assert_close(p_d.grad.cpu(), p_s.grad, f"grad of {label}", atol=1e-6)


@mesh_param
def test_map_products_communicate_nothing(fold_mesh, ops_case, p2p_counter, collectives):
    case = ops_case(fold_mesh, "pad-4-32")
    n, a = case.n_tokens, case.n_atoms
    a2t = case.sharded["atom_to_token"].float()
    t2r = case.sharded["token_to_rep_atom"].float()
    forms = {
        "bmm(a2t, s)": (lambda s, q: torch.bmm(a2t, s), "atoms"),
        "mean": (
            lambda s, q: torch.bmm((a2t / (a2t.sum(1, keepdim=True) + 1e-6)).transpose(1, 2), q),
            "tokens",
        ),
        "einsum": (lambda s, q: torch.einsum("bat,btc->bac", a2t, s), "atoms"),
        "einsum transposed": (lambda s, q: torch.einsum("bta,btc->bac", a2t.mT, s), "atoms"),
        "a2t @ s": (lambda s, q: a2t @ s, "atoms"),
        "Tensor.bmm": (lambda s, q: a2t.mT.bmm(q), "tokens"),
        "bmm(t2r, x)": (lambda s, q: torch.bmm(t2r, q), "tokens"),
    }
    problems = []
    for label, (form, out_axis) in forms.items():
        s, s_leaf = case.shard(case.randn(1, n, 3), ("tokens", None), requires_grad=True)
        q, q_leaf = case.shard(case.randn(1, a, 3), ("atoms", None), requires_grad=True)
        with CommDebugMode() as forward, p2p_counter() as p2p:
            out = form(s, q)
        length = n if out_axis == "tokens" else a
        grad, _ = case.shard(case.randn(1, length, 3), (out_axis, None))
        with CommDebugMode() as backward, p2p_counter() as p2p_backward:
            out.backward(grad)
        seen = (collectives(forward), collectives(backward), p2p["calls"] + p2p_backward["calls"])
        if seen != ({}, {}, 0) or (s_leaf.grad is None and q_leaf.grad is None):
            problems.append(f"{label}: {seen}")
    collective_assert(not problems, "; ".join(problems))


@mesh_param
def test_forms_that_cannot_run_locally_raise_instead_of_gathering(fold_mesh, ops_case):
    case = ops_case(fold_mesh, "pad-4-32")
    n, a = case.n_tokens, case.n_atoms
    a2t = case.sharded["atom_to_token"].float()
    s, _ = case.shard(case.randn(1, n, 4), ("tokens", None))
    q, _ = case.shard(case.randn(1, a, 4), ("atoms", None))
    z, _ = case.shard(case.randn(1, n, n, 4), (*PAIR, None))
    b, k, w = 1, a2t.shape[1] // 32, 32
    queries = a2t.view(b, k, w, a2t.shape[-1])
    with pytest.raises(ShardingLayoutError, match="not supported on the scattered map 'atom_to_t"):
        torch.einsum("bijd,bwki,bwlj->bwkld", z, queries, queries)
    with pytest.raises(ShardingLayoutError, match="derived from it by .*view"):
        torch.matmul(queries.view(b, a2t.shape[1], a2t.shape[-1]), s)
    with pytest.raises(ShardingLayoutError, match="derived from it by .*add"):
        torch.bmm(a2t + 0, s)
    with pytest.raises(ShardingLayoutError, match="map as the right operand"):
        torch.bmm(q, a2t)
    with pytest.raises(ShardingLayoutError, match=r"einsum\('bat,btc->bca'\)"):
        torch.einsum("bat,btc->bca", a2t, s)
    with pytest.raises(ShardingLayoutError, match="shapes disagree: map"):
        torch.bmm(a2t, q)


@mesh_param
def test_products_and_ops_without_a_product_keep_the_default_path(fold_mesh, ops_case):
    """bmm / einsum of ShardTensors that are not maps, and other ops on maps, run as before."""
    case = ops_case(fold_mesh)
    x, y = case.randn(1, 3, 4), case.randn(1, 4, 2)
    xs, ys = (
        ShardTensor.from_local(t, fold_mesh.domain_mesh, (Replicate(), Replicate()), {})
        for t in (x, y)
    )
    collective_assert_close(torch.bmm(xs, ys).full_tensor().cpu(), torch.bmm(x, y), "bmm")
    collective_assert_close(
        torch.einsum("bij,bjk->bik", xs, ys).full_tensor().cpu(), torch.einsum("bij,bjk->bik", x, y)
    )
    count = case.sharded["atom_to_token"].sum().full_tensor()
    collective_assert_close(count.float().cpu(), case.serial["atom_to_token"].sum().float(), "sum")


@mesh_param
def test_unbatched_maps_work_in_mm_einsum_and_the_ops(fold_mesh, ops_case):
    case = ops_case(fold_mesh, "pad-4-32", batched=False)
    n, a = case.n_tokens, case.n_atoms
    a2t_serial = case.serial["atom_to_token"].float()
    s, q = case.randn(n, 4), case.randn(a, 4)
    ss, _ = case.shard(s, ("tokens", None))
    qs, _ = case.shard(q, ("atoms", None))
    a2t_map = case.sharded["atom_to_token"]
    a2t = a2t_map.float()
    checks = {
        "torch.mm": (torch.mm(a2t, ss), a2t_serial @ s, "atoms"),
        "a2t @ s": (a2t @ ss, a2t_serial @ s, "atoms"),
        "einsum": (
            torch.einsum("at,ac->tc", a2t, qs),
            torch.einsum("at,ac->tc", a2t_serial, q),
            "tokens",
        ),
        "tokens_to_atoms": (tokens_to_atoms(ss, a2t_map), a2t_serial @ s, "atoms"),
        "atoms_to_tokens_mean": (
            atoms_to_tokens_mean(qs, a2t_map),
            atoms_to_tokens_mean(q, a2t_serial),
            "tokens",
        ),
    }
    for label, (distributed, serial, axis) in checks.items():
        collective_assert_close(case.unpadded(distributed, (axis, None)), serial, label)
