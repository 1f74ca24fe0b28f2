"""Boltz's PairformerLayer / PairformerModule / PairformerNoSeqModule, unmodified, under CP.

Serial vs distributed with the same weights and the same dropout draws: outputs, input
gradients and every parameter gradient (TF32 off), train mode (dropout on) and eval mode
(chunked triangle attention), on 1x2 to 3x3 meshes with uneven blocks and masked padded
tokens; no rank holds a full pair tensor or N^3 scores; validate_model finds no fallback.
"""

import copy

import pytest
import torch
from torch import nn

from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.ops import masked_mean
from physicsnemo_foldcp.testing import collective_assert
from physicsnemo_foldcp.testing.layouts import TokenLayout
from physicsnemo_foldcp.testing.memory import LocalSizeGuard
from physicsnemo_foldcp.testing.parity import close, randomize_parameters
from physicsnemo_foldcp.training import batched, validate_model

PAIR = ("tokens", "tokens", None)

pytestmark = pytest.mark.multigpu_static
MESHES = [(2, 1, 2), (2, 2, 1), (1, 2, 2), (1, 2, 3), (1, 3, 2), (1, 3, 3)]
mesh_id = lambda s: "x".join(map(str, s))  # noqa: E731
SIZES = {"token_s": 32, "token_z": 16, "num_heads": 4, "pairwise_head_width": 8,
         "pairwise_num_heads": 2}  # fmt: skip


def pair_inputs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(1, n, SIZES["token_s"], generator=g)
    z = torch.randn(1, n, n, SIZES["token_z"], generator=g)
    mask = torch.ones(1, n)
    mask[:, -3:] = 0
    return s, z, mask, mask[:, :, None] * mask[:, None, :]


def run_both(fold_mesh, module, n, training, seq=True, seed=0):
    """Serial and CP runs of ``module`` (copies), same weights and dropout draws."""
    module.train(training)
    serial = copy.deepcopy(module)
    s, z, mask, pair_mask = pair_inputs(n, seed)
    layout = TokenLayout(fold_mesh, n)
    s_st, s_leaf = layout.shard(s, ("tokens", None), requires_grad=True)
    z_st, z_leaf = layout.shard(z, PAIR, requires_grad=True)
    m_st, _ = layout.shard(mask, ("tokens",))
    p_st, _ = layout.shard(pair_mask, ("tokens", "tokens"))
    torch.manual_seed(11)
    out = module(s_st, z_st, m_st, p_st) if seq else (None, module(z_st, p_st))
    loss = sum((o * o).mean() for o in out if o is not None)
    loss.backward()
    s_ref, z_ref = s.clone().requires_grad_(True), z.clone().requires_grad_(True)
    torch.manual_seed(11)
    ref = serial(s_ref, z_ref, mask, pair_mask) if seq else (None, serial(z_ref, pair_mask))
    sum((o * o).mean() for o in ref if o is not None).backward()
    problems = []
    for k, (o, r) in enumerate(zip(out, ref)):
        if o is not None:
            close(o.full_tensor(), r.detach(), f"output {k}", problems)
    if seq:
        close(s_leaf.grad, layout.local(s_ref.grad, ("tokens", None)), "grad s", problems)
    close(z_leaf.grad, layout.local(z_ref.grad, PAIR), "grad z", problems)
    for (name, p), (_, q) in zip(module.named_parameters(), serial.named_parameters()):
        if (p.grad is None) != (q.grad is None):
            problems.append(f"{name}: gradient present in one run only")
        elif p.grad is not None:
            close(p.grad, q.grad, f"grad {name}", problems)
    return problems


@pytest.mark.parametrize("fold_mesh", MESHES, indirect=True, ids=mesh_id)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("n", [23, 37])
def test_pairformer_layer_matches_serial(fold_mesh, training, n):
    from boltz.model.layers.pairformer import PairformerLayer

    layer = randomize_parameters(PairformerLayer(**SIZES, dropout=0.25), 0)

    class Chunked(nn.Module):  # the eval-mode chunk size PairformerModule passes
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, s, z, mask, pair_mask):
            chunk = None if self.training else 4
            return self.layer(s, z, mask, pair_mask, chunk_size_tri_attn=chunk)

    problems = run_both(fold_mesh, Chunked(), n, training)
    collective_assert(not problems, "; ".join(problems))


@pytest.mark.parametrize("fold_mesh", MESHES, indirect=True, ids=mesh_id)
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_pairformer_module_matches_serial(fold_mesh, checkpointing):
    from boltz.model.layers.pairformer import PairformerModule

    module = PairformerModule(
        **SIZES, num_blocks=2, dropout=0.25, activation_checkpointing=checkpointing
    )
    randomize_parameters(module, 1)
    problems = run_both(fold_mesh, module, 37, training=True, seed=1)
    collective_assert(not problems, "; ".join(problems))


@pytest.mark.parametrize("fold_mesh", MESHES, indirect=True, ids=mesh_id)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_pairformer_no_seq_module_matches_serial(fold_mesh, training):
    """Eval mode: PairformerNoSeqModule picks the chunk size of the triangle attention."""
    from boltz.model.layers.pairformer import PairformerNoSeqModule

    module = PairformerNoSeqModule(
        SIZES["token_z"], num_blocks=2, dropout=0.25, pairwise_head_width=8,
        pairwise_num_heads=2,
    )  # fmt: skip
    randomize_parameters(module, 2)
    problems = run_both(fold_mesh, module, 23, training=training, seq=False, seed=2)
    collective_assert(not problems, "; ".join(problems))


GUARD_FACTOR = 4
"""Largest local tensor allowed during a Pairformer step, in local pair tiles."""


@pytest.mark.parametrize("fold_mesh", [(1, 3, 3)], indirect=True, ids=mesh_id)
def test_no_rank_holds_a_full_pair_or_cubic_scores(fold_mesh):
    from boltz.model.layers.pairformer import PairformerModule

    n = 37
    module = randomize_parameters(PairformerModule(**SIZES, num_blocks=1, dropout=0.25), 3)
    s, z, mask, pair_mask = pair_inputs(n, 3)
    layout = TokenLayout(fold_mesh, n)
    s_st, _ = layout.shard(s, ("tokens", None), requires_grad=True)
    z_st, z_leaf = layout.shard(z, PAIR, requires_grad=True)
    m_st, _ = layout.shard(mask, ("tokens",))
    p_st, _ = layout.shard(pair_mask, ("tokens", "tokens"))
    tile = z_leaf.numel()
    with LocalSizeGuard(GUARD_FACTOR * tile) as guard:
        s_out, z_out = module(s_st, z_st, m_st, p_st)
        ((s_out * s_out).mean() + (z_out * z_out).mean()).backward()
    full_pair = n * n * SIZES["token_z"]
    problems = [f"{v}" for v in guard.violations[:5]]
    if guard.limit >= full_pair:
        problems.append(f"the bound {guard.limit} does not exclude a full pair {full_pair}")
    collective_assert(not problems, f"tile {tile}: " + "; ".join(problems))


class PairformerOnFeatures(nn.Module):
    """A Boltz Pairformer fed from scattered features, for validate_model."""

    def __init__(self):
        super().__init__()
        from boltz.model.layers.pairformer import PairformerModule

        self.single = nn.Linear(33, SIZES["token_s"])
        self.rows = nn.Linear(33, SIZES["token_z"], bias=False)
        self.columns = nn.Linear(33, SIZES["token_z"], bias=False)
        self.pairformer = PairformerModule(**SIZES, num_blocks=1, dropout=0.0)

    def forward(self, **feats):
        x = feats["res_type"].float()
        mask = feats["token_pad_mask"].float()
        z = self.rows(x)[:, :, None] + self.columns(x)[:, None, :]
        s, z = self.pairformer(self.single(x), z, mask, mask[:, :, None] * mask[:, None, :])
        return {"s": s, "z": z, "mask": mask}


def pairformer_loss(outputs, feats):
    mask = outputs["mask"]
    pair = mask[:, :, None] * mask[:, None, :]
    return masked_mean(outputs["z"].pow(2).mean(-1), pair) + masked_mean(
        outputs["s"].pow(2).mean(-1), mask
    )


@pytest.mark.parametrize("fold_mesh", [(1, 2, 3), (1, 3, 3)], indirect=True, ids=mesh_id)
def test_validate_model_finds_no_fallback_in_the_pairformer(fold_mesh):
    sample = batched(make_complex(19, seed=8, msa_rows=2))
    model = randomize_parameters(PairformerOnFeatures(), 4)
    report = validate_model(model, sample, fold_mesh, loss_fn=pairformer_loss)
    collective_assert(report.ok, report.format())
