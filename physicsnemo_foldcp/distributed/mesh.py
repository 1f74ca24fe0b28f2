"""The ``ddp x cp0 x cp1`` mesh handle that every other module takes."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

MESH_DIM_NAMES: tuple[str, str, str] = ("ddp", "cp0", "cp1")
"""Names of the three mesh dimensions, outermost first."""


@dataclass(frozen=True)
class FoldMesh:
    """A 3-D ``("ddp", "cp0", "cp1")`` device mesh and the groups derived from it.

    The ``ddp`` dimension replicates the model (one sample per domain group per step);
    ``(cp0, cp1)`` is the 2-D context-parallel (domain) mesh over which one sample's
    features are sharded: token rows over ``cp0``, token columns over ``cp1``.

    Parameters
    ----------
    mesh : DeviceMesh
        The global 3-D mesh, built by ``DistributedManager().initialize_mesh``.
    domain_group : torch.distributed.ProcessGroup
        The flattened ``cp0 x cp1`` group this rank belongs to. Group rank ``r`` is the
        rank at domain coordinate ``(r // cp1, r % cp1)``.
    timeout : datetime.timedelta
        Bound on every collective wait of the process groups behind this mesh.
    object_group : torch.distributed.ProcessGroup
        Group for object collectives (metadata, errors) over the same ranks as
        ``domain_group``: a gloo mirror when the device backend is NCCL, so pickled
        objects never touch the GPU; ``domain_group`` itself on gloo.
    """

    mesh: DeviceMesh
    domain_group: dist.ProcessGroup
    timeout: timedelta
    object_group: dist.ProcessGroup

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(ddp, cp0, cp1)`` sizes."""
        return tuple(int(s) for s in self.mesh.shape)  # type: ignore[return-value]

    @property
    def ddp_size(self) -> int:
        """Number of domain groups (data-parallel replicas)."""
        return self.shape[0]

    @property
    def cp(self) -> tuple[int, int]:
        """``(cp0, cp1)``: the shape of the 2-D domain mesh."""
        return self.shape[1], self.shape[2]

    @property
    def domain_size(self) -> int:
        """Number of ranks in one domain group, ``cp0 * cp1``."""
        return self.shape[1] * self.shape[2]

    @cached_property
    def ddp_mesh(self) -> DeviceMesh:
        """1-D mesh over the ``ddp`` dimension through this rank (sliced once)."""
        return self.mesh["ddp"]

    @cached_property
    def domain_mesh(self) -> DeviceMesh:
        """2-D ``(cp0, cp1)`` mesh of this rank's domain group (sliced once, then reused)."""
        return self.mesh["cp0", "cp1"]

    @property
    def device(self) -> torch.device:
        """Device that this rank computes on (``cuda:<local_rank>`` or ``cpu``)."""
        if self.mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.mesh.device_type)

    @property
    def rank(self) -> int:
        """Global rank of this process."""
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        """Number of processes in the job."""
        return dist.get_world_size()

    @property
    def coordinate(self) -> tuple[int, int, int]:
        """This rank's ``(ddp, cp0, cp1)`` coordinate in the mesh."""
        coord = self.mesh.get_coordinate()
        assert coord is not None, "this rank is not part of the mesh"
        return tuple(int(c) for c in coord)  # type: ignore[return-value]

    @property
    def ddp_rank(self) -> int:
        """Index of this rank's domain group along ``ddp``."""
        return self.coordinate[0]

    @property
    def domain_coordinate(self) -> tuple[int, int]:
        """This rank's ``(cp0, cp1)`` coordinate inside its domain group."""
        return self.coordinate[1], self.coordinate[2]

    @property
    def domain_rank(self) -> int:
        """Rank inside the domain group, row-major over ``(cp0, cp1)``."""
        i, j = self.domain_coordinate
        return i * self.shape[2] + j

    @property
    def domain_source_rank(self) -> int:
        """GLOBAL rank of this domain group's source, the rank at ``(ddp_rank, 0, 0)``.

        The source rank is the only rank of the group that holds the serial sample; pass
        it as ``global_src`` to PhysicsNeMo's ``scatter_tensor``.
        """
        return int(self.mesh.mesh[self.ddp_rank, 0, 0])

    @property
    def is_domain_source(self) -> bool:
        """Whether this rank is its domain group's source."""
        return self.rank == self.domain_source_rank

    def domain_global_rank(self, i: int, j: int) -> int:
        """GLOBAL rank at domain coordinate ``(i, j)`` of this rank's domain group."""
        return int(self.mesh.mesh[self.ddp_rank, i, j])

    def describe(self) -> str:
        """Human-readable table of the mesh: global rank at every coordinate."""
        ddp, cp0, cp1 = self.shape
        lines = [
            f"mesh ddp x cp0 x cp1 = {ddp} x {cp0} x {cp1} "
            f"({self.world_size} ranks, backend {dist.get_backend()}, "
            f"device {self.mesh.device_type}, collective timeout {self.timeout})"
        ]
        for d in range(ddp):
            lines.append(f"  domain group {d} (source rank {int(self.mesh.mesh[d, 0, 0])}):")
            for i in range(cp0):
                row = " ".join(f"{int(self.mesh.mesh[d, i, j]):>4d}" for j in range(cp1))
                lines.append(f"    cp0={i}: {row}")
        return "\n".join(lines)
