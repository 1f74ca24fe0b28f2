"""Boltz-2's whole trunk (Boltz2Trunk: Boltz's own modules) under CP against serial.

``validate_model`` runs the serial trunk and the trunk on the scattered sample with the
same weights: the distogram loss, every module's output that can be compared, and every
parameter gradient (TF32 off), on complexes with ligands (one-atom tokens), uneven N and
atom windows that straddle the row blocks; no fallback gather.
"""

import pytest
import torch

from physicsnemo_foldcp import scatter_features
from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.ops import ShardingLayoutError
from physicsnemo_foldcp.testing import collective_assert
from physicsnemo_foldcp.testing.memory import LocalSizeGuard
from physicsnemo_foldcp.testing.parity import randomize_parameters
from physicsnemo_foldcp.training import batched, validate_model

const = pytest.importorskip("boltz.data.const")

from physicsnemo_foldcp.models.boltz2_trunk import Boltz2Trunk  # noqa: E402

pytestmark = pytest.mark.multigpu_static
mesh_id = lambda s: "x".join(map(str, s))  # noqa: E731


def trunk(recycling_steps: int) -> Boltz2Trunk:
    torch.manual_seed(0)
    return randomize_parameters(Boltz2Trunk(recycling_steps=recycling_steps), 3)


@pytest.mark.parametrize(
    "fold_mesh,n_tokens,recycling_steps",
    [((2, 1, 2), 23, 0), ((1, 2, 2), 37, 1), ((1, 2, 3), 23, 0), ((1, 3, 3), 37, 0)],
    indirect=["fold_mesh"],
    ids=lambda v: mesh_id(v) if isinstance(v, tuple) else f"{v}",
)
def test_trunk_matches_serial_without_fallbacks(fold_mesh, n_tokens, recycling_steps):
    sample = batched(make_complex(n_tokens, seed=7, msa_rows=5, atom_multiple=32))
    ligand = const.chain_type_ids["NONPOLYMER"]
    collective_assert(bool((sample["mol_type"] == ligand).any()), "no ligand (one-atom) token")
    report = validate_model(trunk(recycling_steps), sample, fold_mesh)
    collective_assert(report.ok, report.format())


@pytest.mark.parametrize("fold_mesh", [(1, 2, 2)], indirect=True, ids=mesh_id)
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_trunk_with_templates_is_refused_by_name(fold_mesh, version):
    torch.manual_seed(0)
    template_args = {"template_dim": 8, "template_blocks": 1, "pairwise_num_heads": 2}
    model = Boltz2Trunk(
        use_templates=True, use_templates_v2=version == "v2", template_args=template_args
    )
    name = "TemplateV2Module" if version == "v2" else "TemplateModule"
    feats = scatter_features(
        batched(make_complex(23, seed=7, msa_rows=5, atom_multiple=32)), fold_mesh
    )
    with pytest.raises(ShardingLayoutError, match=f"^{name}: .*use_templates=False"):
        model(**feats)


GUARD_FACTOR = 4
"""Largest local tensor allowed during a trunk training step, in local ``z`` tiles."""


@pytest.mark.parametrize("fold_mesh", [(1, 3, 3)], indirect=True, ids=mesh_id)
def test_no_rank_holds_a_full_pair_in_a_trunk_training_step(fold_mesh):
    """Forward, distogram loss and backward of the whole trunk on 3x3.

    The pair width is large next to the atom widths, so that half a full
    ``N x N x token_z`` pair exceeds the bound while the windowed atom tensors
    (``O(A W H / cp0)``) do not.
    """
    n, token_z = 56, 96
    torch.manual_seed(0)
    model = Boltz2Trunk(token_z=token_z, atom_z=2)
    sample = batched(make_complex(n, seed=7, msa_rows=5, atom_multiple=32))
    feats = scatter_features(sample, fold_mesh)
    rows, columns = feats["token_bonds"].to_local().shape[1:3]
    tile = rows * columns * token_z
    with LocalSizeGuard(GUARD_FACTOR * tile) as guard:
        model.loss(model(**feats), feats).backward()
    problems = [f"{v}" for v in guard.violations[:5]]
    if 2 * guard.limit >= n * n * token_z:
        problems.append(f"the bound {guard.limit} does not exclude half a pair {n * n * token_z}")
    collective_assert(not problems, f"tile {tile}, largest {guard.largest}: " + "; ".join(problems))
