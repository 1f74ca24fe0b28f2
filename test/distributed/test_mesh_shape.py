"""Single-process tests of mesh-shape validation and the launcher-free entry point."""

import os
import subprocess
import sys
import textwrap

import pytest

from physicsnemo_foldcp.distributed import resolve_mesh_shape


@pytest.mark.parametrize(
    "ddp, cp, world, expected",
    [
        (1, (2, 2), 4, (1, 2, 2)),
        (-1, (2, 2), 8, (2, 2, 2)),
        (2, (-1, 3), 12, (2, 2, 3)),
        (3, (3, -1), 9, (3, 3, 1)),
        (-1, (1, 1), 1, (1, 1, 1)),
        (1, [2, 3], 6, (1, 2, 3)),
    ],
)
def test_resolves_valid_shapes(ddp, cp, world, expected):
    assert resolve_mesh_shape(ddp, cp, world) == expected


def test_product_mismatch_names_both_numbers():
    with pytest.raises(ValueError, match=r"2 x 2 x 2 = 8 ranks does not match the world size 4"):
        resolve_mesh_shape(2, (2, 2), 4)


@pytest.mark.parametrize(
    "ddp, cp, bad", [(1, (0, 2), "cp0=0"), (1, (2, 0), "cp1=0"), (0, (1, 1), "ddp=0")]
)
def test_zero_size_is_rejected(ddp, cp, bad):
    with pytest.raises(ValueError, match=rf"mesh size {bad} is invalid"):
        resolve_mesh_shape(ddp, cp, 4)


@pytest.mark.parametrize("ddp, cp, bad", [(1, (-2, 2), "cp0=-2"), (-3, (1, 1), "ddp=-3")])
def test_negative_size_is_rejected(ddp, cp, bad):
    with pytest.raises(ValueError, match=rf"mesh size {bad} is invalid"):
        resolve_mesh_shape(ddp, cp, 4)


def test_two_inferred_sizes_are_rejected():
    with pytest.raises(ValueError, match="only one mesh size may be -1, got -1 for ddp, cp1"):
        resolve_mesh_shape(-1, (2, -1), 4)


def test_inference_that_does_not_divide_is_rejected():
    with pytest.raises(
        ValueError, match="cannot infer mesh size ddp: world size 6 is not a multiple"
    ):
        resolve_mesh_shape(-1, (2, 2), 6)


@pytest.mark.parametrize("cp", [(2,), (1, 2, 3), "22", 4])
def test_cp_must_be_a_pair(cp):
    with pytest.raises(ValueError, match="cp must be a pair"):
        resolve_mesh_shape(1, cp, 4)


@pytest.mark.parametrize("cp", [(1.0, 2), (True, 1)])
def test_sizes_must_be_integers(cp):
    with pytest.raises(ValueError, match="must be an integer"):
        resolve_mesh_shape(1, cp, 2)


def test_single_process_without_launcher():
    """`python script.py` gets a 1x1x1 mesh over a real 1-rank gloo group and exits cleanly."""
    script = textwrap.dedent(
        """
        import torch, torch.distributed as dist
        import physicsnemo_foldcp as fc
        from physicsnemo.domain_parallel import scatter_tensor
        from torch.distributed.tensor import Shard, Replicate
        mesh = fc.init_mesh()
        assert mesh.shape == (1, 1, 1), mesh.shape
        assert mesh.mesh.mesh_dim_names == ("ddp", "cp0", "cp1")
        assert mesh.coordinate == (0, 0, 0) and mesh.domain_source_rank == 0
        assert mesh.is_domain_source and dist.get_backend() == "gloo"
        x = torch.randn(5, 3)
        st = scatter_tensor(x, 0, mesh.domain_mesh, (Shard(0), Replicate()),
                            global_shape=x.shape, dtype=x.dtype)
        assert torch.equal(st.full_tensor(), x)
        fc.shutdown()
        import os
        launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        left = [var for var in launcher if var in os.environ]
        assert not left, f"shutdown left {left} behind"
        fc.init_mesh()  # a second job of the process: a fresh port
        fc.shutdown()
        print("single-process ok")
        """
    )
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "single-process ok" in proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
