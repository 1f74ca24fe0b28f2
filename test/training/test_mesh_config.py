"""The mesh group starts the mesh and sets the kernels' work budget, both from one config."""

from physicsnemo_foldcp.kernels.budget import DEFAULT_WORK_BUDGET_MIB, work_budget, work_budget_mib
from physicsnemo_foldcp.training import config
from physicsnemo_foldcp.training.config import MeshConfig, build_mesh


def test_build_mesh_sets_the_work_budget_and_passes_the_mesh_options(monkeypatch):
    assert MeshConfig().work_budget_mib == DEFAULT_WORK_BUDGET_MIB
    seen = {}

    def init_mesh(**options):
        seen.update(options, budget=work_budget_mib())
        return "the mesh"

    monkeypatch.setattr(config, "init_mesh", init_mesh)
    with work_budget(DEFAULT_WORK_BUDGET_MIB):  # restored after the test
        mesh = build_mesh(MeshConfig(ddp=1, cp=[2, 3], timeout_s=30.0, work_budget_mib=7.5))
        assert work_budget_mib() == 7.5
    assert mesh == "the mesh"
    assert seen == {"ddp": 1, "cp": (2, 3), "timeout_s": 30.0, "budget": 7.5}
