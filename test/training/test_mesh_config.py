"""The mesh group starts the mesh and sets the kernels' work budget and recompute choice,
all from one config."""

import pytest

from physicsnemo_foldcp.kernels.budget import (
    DEFAULT_WORK_BUDGET_MIB,
    kernel_recompute,
    recompute_in_backward,
    set_kernel_recompute,
    work_budget,
    work_budget_mib,
)
from physicsnemo_foldcp.training import config
from physicsnemo_foldcp.training.config import MeshConfig, build_mesh


def test_build_mesh_sets_the_kernels_and_passes_the_mesh_options(monkeypatch):
    assert MeshConfig().work_budget_mib == DEFAULT_WORK_BUDGET_MIB
    assert MeshConfig().kernel_recompute is True
    seen = {}

    def init_mesh(**options):
        seen.update(options, budget=work_budget_mib(), recompute=kernel_recompute())
        return "the mesh"

    monkeypatch.setattr(config, "init_mesh", init_mesh)
    # both restored after the test
    with work_budget(DEFAULT_WORK_BUDGET_MIB), recompute_in_backward(True):
        options = {"timeout_s": 30.0, "work_budget_mib": 7.5, "kernel_recompute": False}
        mesh = build_mesh(MeshConfig(ddp=1, cp=[2, 3], **options))
        assert (work_budget_mib(), kernel_recompute()) == (7.5, False)
    assert kernel_recompute() is True
    assert mesh == "the mesh"
    assert seen == {"ddp": 1, "cp": (2, 3), "timeout_s": 30.0, "budget": 7.5, "recompute": False}


def test_the_recompute_choice_is_a_bool():
    with pytest.raises(TypeError, match="kernel_recompute must be a bool"):
        set_kernel_recompute("no")
    assert kernel_recompute() is True
