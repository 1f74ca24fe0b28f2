"""Distributed tests of the mesh: shape, names, coordinates, source ranks, ShardTensor smoke."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from physicsnemo.domain_parallel import ShardTensor, scatter_tensor
from torch.distributed.tensor import Replicate, Shard

import physicsnemo_foldcp as fc
from physicsnemo_foldcp.testing import collective_assert, collective_assert_equal

pytestmark = pytest.mark.multigpu_static

MESHES = [
    (1, 2, 2),
    (2, 1, 2),
    (2, 2, 1),
    (4, 1, 1),
    (1, 1, 4),
    (1, 2, 3),
    (1, 3, 2),
    (3, 1, 2),
    (2, 1, 3),
    (1, 3, 3),
    (3, 1, 3),
    (3, 3, 1),
]


@pytest.mark.parametrize("fold_mesh", MESHES, indirect=True, ids=lambda s: "x".join(map(str, s)))
def test_mesh_shape_names_and_coordinates(fold_mesh):
    ddp, cp0, cp1 = fold_mesh.shape
    rank = dist.get_rank()
    # Row-major placement of global ranks over (ddp, cp0, cp1), computed independently.
    expected = (rank // (cp0 * cp1), (rank // cp1) % cp0, rank % cp1)
    collective_assert(fold_mesh.mesh.mesh_dim_names == ("ddp", "cp0", "cp1"), "mesh dim names")
    collective_assert(tuple(fold_mesh.mesh.shape) == (ddp, cp0, cp1), "mesh shape")
    collective_assert(
        fold_mesh.coordinate == expected, f"coordinate {fold_mesh.coordinate} != {expected}"
    )
    collective_assert(fold_mesh.domain_mesh.shape == (cp0, cp1), "domain mesh shape")
    collective_assert(fold_mesh.ddp_mesh.size() == ddp, "ddp mesh size")
    collective_assert(
        fold_mesh.domain_group.size() == cp0 * cp1
        and dist.get_rank(fold_mesh.domain_group) == expected[1] * cp1 + expected[2],
        "domain group size / rank order",
    )


@pytest.mark.parametrize("fold_mesh", MESHES, indirect=True, ids=lambda s: "x".join(map(str, s)))
def test_domain_source_rank_is_the_groups_first_rank(fold_mesh):
    ddp, cp0, cp1 = fold_mesh.shape
    rank = dist.get_rank()
    expected_source = (rank // (cp0 * cp1)) * cp0 * cp1
    collective_assert(
        fold_mesh.domain_source_rank == expected_source,
        f"source {fold_mesh.domain_source_rank} != {expected_source}",
    )
    collective_assert(fold_mesh.is_domain_source == (rank == expected_source), "is_domain_source")
    # The source is reachable as src of the domain group: every rank receives its source's rank.
    token = torch.tensor([rank if fold_mesh.is_domain_source else -1])
    dist.broadcast(token, src=fold_mesh.domain_source_rank, group=fold_mesh.domain_group)
    collective_assert(int(token) == expected_source, f"broadcast from source gave {int(token)}")


@pytest.mark.parametrize("fold_mesh", MESHES, indirect=True, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("placements", [(Shard(0), Shard(1)), (Shard(0), Replicate())])
def test_shard_tensor_scatter_and_full_tensor_round_trip(fold_mesh, placements):
    gen = torch.Generator().manual_seed(fold_mesh.ddp_rank)
    # 12 x 18 divides every mesh here evenly, so scatter_tensor's chunking is exact.
    x = torch.randn(12, 18, 4, generator=gen)
    st = scatter_tensor(
        x,
        fold_mesh.domain_source_rank,
        fold_mesh.domain_mesh,
        placements,
        global_shape=x.shape,
        dtype=x.dtype,
    )
    collective_assert(isinstance(st, ShardTensor), f"got {type(st).__name__}")
    collective_assert_equal(st.full_tensor(), x, "full_tensor after scatter_tensor")


@pytest.mark.parametrize("fold_mesh", MESHES, indirect=True, ids=lambda s: "x".join(map(str, s)))
def test_uneven_from_local_round_trip(fold_mesh):
    """from_local with explicit, uneven sharding shapes needs no communication to build."""
    cp0, cp1 = fold_mesh.cp
    i, j = fold_mesh.domain_coordinate
    x = torch.arange(7 * 5 * 2, dtype=torch.float32).reshape(7, 5, 2)
    rows = [len(r) for r in torch.arange(7).tensor_split(cp0)]
    cols = [len(c) for c in torch.arange(5).tensor_split(cp1)]
    local = x.tensor_split(cp0, 0)[i].tensor_split(cp1, 1)[j].contiguous()
    shapes = {
        0: [torch.Size((r, cols[j], 2)) for r in rows],
        1: [torch.Size((rows[i], c, 2)) for c in cols],
    }
    st = ShardTensor.from_local(
        local, fold_mesh.domain_mesh, (Shard(0), Shard(1)), sharding_shapes=shapes
    )
    collective_assert(tuple(st.shape) == (7, 5, 2), f"global shape {tuple(st.shape)}")
    collective_assert_equal(st.full_tensor(), x, "full_tensor of uneven ShardTensor")


def test_mesh_that_does_not_match_the_world_is_refused_on_every_rank(fold_world):
    world = fold_world
    with pytest.raises(ValueError) as info:
        fc.init_mesh(ddp=world + 1, cp=(1, 1))
    collective_assert(
        f"= {world + 1} ranks does not match the world size {world}" in str(info.value),
        str(info.value),
    )
    with pytest.raises(ValueError, match="mesh size cp0=0 is invalid"):
        fc.init_mesh(ddp=1, cp=(0, world))


def test_mesh_groups_have_the_bounded_timeout(fold_world, request):
    mesh = fc.init_mesh(ddp=-1, cp=(1, 1))
    expected = timedelta(seconds=request.config.getoption("--foldcp-timeout"))
    collective_assert(mesh.timeout == expected, f"{mesh.timeout} != {expected}")


@pytest.mark.parametrize("fold_mesh", MESHES, indirect=True, ids=lambda s: "x".join(map(str, s)))
def test_building_a_mesh_gives_each_domain_its_sources_random_stream(fold_mesh, request):
    ddp, cp0, cp1 = fold_mesh.shape
    rank = dist.get_rank()
    torch.manual_seed(1000 + rank)  # every process starts from its own seed
    # Another timeout makes init_mesh build a new mesh of this shape rather than reuse one.
    timeout = request.config.getoption("--foldcp-timeout") + 1 + sum(fold_mesh.shape) / 100
    fresh = fc.init_mesh(ddp=ddp, cp=(cp0, cp1), timeout_s=timeout)
    draws = torch.rand(4)
    everyone = [torch.empty(4) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, draws)
    source = fresh.domain_source_rank
    expected = torch.rand(4, generator=torch.Generator().manual_seed(1000 + source))
    collective_assert(
        torch.equal(draws, expected), f"rank {rank} does not draw domain source {source}'s numbers"
    )
    others = {r // (cp0 * cp1) for r in range(len(everyone)) if not torch.equal(everyone[r], draws)}
    collective_assert(
        others == set(range(ddp)) - {rank // (cp0 * cp1)},
        f"rank {rank}: ranks of domains {sorted(others)} draw other numbers than its own domain",
    )
