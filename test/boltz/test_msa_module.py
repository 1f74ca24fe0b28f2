"""Boltz-2's MSAModule with MSA subsampling, unmodified, on scattered features.

Serial vs distributed with the same weights and the same random draws (the subsampling
``randperm`` and the dropout masks): the output pair (``full_tensor``), the gradients of
``z`` and of the single ``emb``, and every parameter gradient (TF32 off), on 2x2, 2x3 and
3x2 meshes with an MSA depth and a subsampled depth that do not divide evenly, masked
padded tokens and masked MSA entries; train mode with dropout off and on, and eval mode
(Boltz subsamples in both). The features are laid out as the registry says (``msa``,
``has_deletion``, ``deletion_value``, ``msa_paired``, ``msa_mask``: MSA rows over ``cp0``,
tokens over ``cp1``; ``token_pad_mask`` a token single).

The subsampling ``m[:, idx]`` / ``msa_mask[:, idx]`` moves rows point to point
(:mod:`physicsnemo_foldcp.ops.msa_rows`); the only gather of the forward is the expected
one of ``m + s_proj(emb).unsqueeze(1)``: the token single ``s_proj(emb)`` meets the MSA on
its token (column) dim, so it is all-gathered over ``cp0`` and cut to this rank's column
block (an ``O(N x msa_s)`` single, not the MSA).
"""

import copy

import pytest
import torch

from physicsnemo_foldcp.core import events
from physicsnemo_foldcp.testing import collective_assert
from physicsnemo_foldcp.testing.layouts import TokenLayout
from physicsnemo_foldcp.testing.parity import close, compare_parameter_grads, randomize_parameters

trunkv2 = pytest.importorskip("boltz.model.modules.trunkv2")
const = pytest.importorskip("boltz.data.const")

pytestmark = pytest.mark.multigpu_static
mesh_id = lambda s: "x".join(map(str, s))  # noqa: E731
N, MSA_ROWS, SUBSAMPLED = 23, 13, 5
SIZES = {"msa_s": 8, "token_z": 16, "token_s": 12, "msa_blocks": 2,
         "pairwise_head_width": 8, "pairwise_num_heads": 2}  # fmt: skip
PAIR = ("tokens", "tokens", None)
SINGLE = ("tokens", None)
MSA_FEATURES = ("msa", "has_deletion", "deletion_value", "msa_paired", "msa_mask")


def inputs(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``z``, ``emb`` and the features MSAModule reads, serial, as Boltz-2's featurizer types
    them (``msa`` and ``msa_mask`` int64, ``has_deletion`` bool)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(1, N, N, SIZES["token_z"], generator=g)
    emb = torch.randn(1, N, SIZES["token_s"], generator=g)
    tokens = torch.ones(1, N)
    tokens[:, -3:] = 0
    deleted = torch.rand(1, MSA_ROWS, N, generator=g) > 0.7
    deletions = torch.rand(1, MSA_ROWS, N, generator=g) * deleted
    mask = (torch.rand(1, MSA_ROWS, N, generator=g) > 0.2).long() * tokens.long()[:, None]
    mask[:, 0] = tokens.long()
    feats = {
        "msa": torch.randint(0, const.num_tokens, (1, MSA_ROWS, N), generator=g),
        "has_deletion": deletions > 0,
        "deletion_value": deletions,
        "msa_paired": (torch.rand(1, MSA_ROWS, N, generator=g) > 0.5).float(),
        "msa_mask": mask,
        "token_pad_mask": tokens,
    }
    return z, emb, feats


def make_module(dropout: float, training: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    module = trunkv2.MSAModule(
        **SIZES,
        msa_dropout=dropout,
        z_dropout=dropout,
        subsample_msa=True,
        num_subsampled_msa=SUBSAMPLED,
    )
    return randomize_parameters(module, 5).train(training)


def expected_gather(event: events.GatherEvent) -> bool:
    """The all-gather over cp0 of the token single in ``m + s_proj(emb).unsqueeze(1)``."""
    single = (1, 1, N, SIZES["msa_s"])
    return (event.op, event.kind, event.mesh_dims, event.shape) == (
        "Tensor.add",
        events.TILE,
        (0,),
        single,
    )


# Every mode on 2x2; the non-square meshes once each (train with dropout, eval).
CASES = [
    ((1, 2, 2), 0.0, True),
    ((1, 2, 2), 0.25, True),
    ((1, 2, 2), 0.25, False),
    ((1, 2, 3), 0.25, True),
    ((1, 3, 2), 0.25, False),
]


def case_id(value):
    if isinstance(value, tuple):
        return mesh_id(value)
    if isinstance(value, bool):
        return "train" if value else "eval"
    return f"dropout{value}"


@pytest.mark.parametrize("fold_mesh,dropout,training", CASES, indirect=["fold_mesh"], ids=case_id)
def test_msa_module_subsampling_matches_serial(fold_mesh, dropout, training):
    module = make_module(dropout, training)
    serial = copy.deepcopy(module)
    z, emb, feats = inputs()
    layout = TokenLayout(fold_mesh, N, n_msa=MSA_ROWS)
    z_st, z_leaf = layout.shard(z, PAIR, requires_grad=True)
    emb_st, emb_leaf = layout.shard(emb, SINGLE, requires_grad=True)
    feats_st = {name: layout.shard(feats[name], ("msa", "tokens"))[0] for name in MSA_FEATURES}
    feats_st["token_pad_mask"] = layout.shard(feats["token_pad_mask"], ("tokens",))[0]

    gathers: list = []
    torch.manual_seed(11)
    with events.observe(gathers.append):
        out = module(z_st, emb_st, feats_st)
    out.pow(2).mean().backward()

    z_ref, emb_ref = z.clone().requires_grad_(True), emb.clone().requires_grad_(True)
    torch.manual_seed(11)
    ref = serial(z_ref, emb_ref, feats)
    ref.pow(2).mean().backward()

    problems: list[str] = []
    close(out.full_tensor().detach(), ref.detach(), "output", problems)
    close(z_leaf.grad, layout.local(z_ref.grad, PAIR), "grad z", problems)
    close(emb_leaf.grad, layout.local(emb_ref.grad, SINGLE), "grad emb", problems)
    compare_parameter_grads(module, serial, problems)
    unexpected = [e for e in gathers if not expected_gather(e)]
    if unexpected or len(gathers) != 1:
        problems.append(f"gathers: {[(e.op, e.mesh_dims, e.shape, e.reason) for e in gathers]}")
    collective_assert(not problems, "; ".join(problems))
