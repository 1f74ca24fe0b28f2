"""The sharding report and the audit of a scattered sample."""

import pytest

from physicsnemo_foldcp import ShardingOptions, scatter_features
from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.sharding.report import audit_features, sharding_report
from physicsnemo_foldcp.testing import collective_assert

pytestmark = pytest.mark.multigpu_static


@pytest.mark.parametrize(
    "fold_mesh", [(2, 1, 2), (1, 2, 2), (1, 2, 3), (1, 3, 3)], indirect=True, ids=str
)
@pytest.mark.parametrize("padded", [False, True])
def test_report_describes_what_each_rank_holds(fold_mesh, padded):
    x = make_complex(29, seed=8, preset="boltz2", msa_rows=7)
    options = ShardingOptions(token_multiple=8, atom_multiple=32) if padded else None
    sharded = scatter_features(
        x if fold_mesh.is_domain_source else None, fold_mesh, options=options
    )
    report = sharding_report(sharded)
    problems = []
    if len(report.ranks) != fold_mesh.domain_size:
        problems.append(f"{len(report.ranks)} rank entries")
    # Row blocks tile the tokens and atoms of the sample exactly once per cp1 column.
    cp0, cp1 = fold_mesh.cp
    rows = sorted({r.tokens for r in report.ranks})
    atoms = sorted({r.atoms for r in report.ranks})
    if rows[0][0] != 0 or rows[-1][1] != 29 or any(a[1] != b[0] for a, b in zip(rows, rows[1:])):
        problems.append(f"token ranges {rows}")
    if atoms[-1][1] != x["ref_pos"].shape[0] or len(atoms) != cp0:
        problems.append(f"atom ranges {atoms}")
    mine = report.ranks[fold_mesh.domain_rank]
    for f in mine.features:
        value = sharded[f.name]
        if tuple(value.to_local().shape) != f.local_shape:
            problems.append(f"{f.name} local shape {f.local_shape}")
    pads = {f.name: f.pad_elements for f in mine.features}
    if not padded and any(pads.values()):
        problems.append(f"pad elements without padding: {pads}")
    if (
        padded
        and pads["res_type"] == 0
        and sharded.plan.row_sizes("tokens")[fold_mesh.domain_coordinate[0]]
        != sharded.plan.serial_range("tokens", fold_mesh.domain_coordinate[0])[1]
        - (sharded.plan.serial_range("tokens", fold_mesh.domain_coordinate[0])[0])
    ):
        problems.append("padded rows but no pad elements reported")
    if "rdkit_bounds_index" not in report.unsharded or "res_type" in report.unsharded:
        problems.append(f"unsharded list {report.unsharded}")
    text = report.format()
    if "token_bonds" not in text or f"rank {fold_mesh.rank}" not in text:
        problems.append("format() misses features or ranks")
    collective_assert(not problems, "; ".join(problems))


@pytest.mark.parametrize("fold_mesh", [(1, 2, 2), (1, 2, 3), (1, 3, 3)], indirect=True, ids=str)
@pytest.mark.parametrize("map_layout", ["dense", "index"])
def test_audit_is_clean_and_catches_an_unmasked_pad(fold_mesh, map_layout):
    x = make_complex(29, seed=9, preset="boltz2", msa_rows=7)
    sharded = scatter_features(
        x if fold_mesh.is_domain_source else None,
        fold_mesh,
        options=ShardingOptions(token_multiple=8, atom_multiple=32, map_layout=map_layout),
    )
    findings = audit_features(sharded)
    collective_assert(findings == [], f"clean sample: {findings}")
    # Corrupt one rank's local block: a pad token marked as real.
    if fold_mesh.domain_rank == 0:
        local = sharded["token_pad_mask"].to_local()
        local[-1] = 1.0
    findings = audit_features(sharded)
    collective_assert(
        len(findings) == 1
        and findings[0].startswith(f"rank {fold_mesh.domain_source_rank}:")
        and "token_pad_mask" in findings[0],
        f"findings {findings}",
    )
