"""Dtype casts keep a ShardTensor's uneven blocks (PhysicsNeMo's fallback re-chunks them)."""

import pytest
import torch

from physicsnemo_foldcp import scatter_features
from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.testing import collective_assert

pytestmark = pytest.mark.multigpu_static


@pytest.mark.parametrize(
    "fold_mesh", [(2, 2, 1), (1, 2, 2), (1, 3, 2), (1, 2, 3), (1, 3, 3)], indirect=True, ids=str
)
def test_casts_of_uneven_features_match_serial(fold_mesh):
    x = make_complex(7, seed=3, preset="boltz2", msa_rows=2)  # 7 tokens: [3, 2, 2] rows on 3
    sharded = scatter_features(x if fold_mesh.is_domain_source else None, fold_mesh)
    problems = []
    for name in ("token_pad_mask", "atom_pad_mask", "res_type", "ref_pos", "token_bonds"):
        st = sharded[name]
        for cast, expected in (
            (st.float(), x[name].float()),
            (st.to(torch.float64), x[name].to(torch.float64)),
            (st.bool(), x[name].bool()),
            (st.type_as(torch.zeros((), dtype=torch.int32)), x[name].to(torch.int32)),
        ):
            if cast.placements != st.placements or cast.to_local().shape != st.to_local().shape:
                problems.append(f"{name}: blocks changed")
            elif not torch.equal(cast.full_tensor(), expected):
                problems.append(f"{name}: values differ after cast to {cast.dtype}")
    collective_assert(not problems, "; ".join(problems))
