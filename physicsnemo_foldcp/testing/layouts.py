"""Serial tensors laid out as the scatter lays out features, for tests of distributed code.

A test of a layer under context parallelism compares it with the serial layer on the same
tensors. :class:`TokenLayout` cuts serial tensors with token axes into this rank's blocks
(the plan's row blocks over ``cp0``, column blocks over ``cp1``, no padding) and wraps them
as the plugin's :class:`~physicsnemo_foldcp.ops.FoldTensor`, exactly as
:func:`~physicsnemo_foldcp.scatter_features` would place a feature with those axes; it
also cuts a serial result to this rank's block for element-wise comparison.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from physicsnemo_foldcp.distributed.mesh import FoldMesh
from physicsnemo_foldcp.features.spec import MSA, TOKENS, FeatureSpec
from physicsnemo_foldcp.ops import FoldTensor, wrap
from physicsnemo_foldcp.sharding.plan import ShardingPlan, build_plan


@dataclass
class TokenLayout:
    """This rank's blocks of ``[1, ...]`` tensors whose axes are tokens, MSA rows or unsharded.

    Parameters
    ----------
    mesh : FoldMesh
        The job's mesh (its domain mesh holds the blocks).
    n_tokens : int
        Token count N.
    token_bounds : sequence of int, optional
        Row-block boundaries (the even split by default).
    n_msa : int, optional
        MSA depth S, for tensors with an ``"msa"`` axis (rows over ``cp0``, tokens over
        ``cp1``).
    """

    mesh: FoldMesh
    n_tokens: int
    token_bounds: Sequence[int] | None = None
    n_msa: int | None = None

    @functools.cached_property
    def plan(self) -> ShardingPlan:
        """The plan of ``n_tokens`` tokens on the mesh's ``(cp0, cp1)``."""
        bounds = tuple(self.token_bounds) if self.token_bounds is not None else None
        lengths = {TOKENS: self.n_tokens}
        if self.n_msa is not None:
            lengths[MSA] = self.n_msa
        return build_plan(lengths, self.mesh.cp, token_bounds=bounds)

    def _feature_spec(self, axes: Sequence[str | None]) -> FeatureSpec:
        return FeatureSpec("layout", tuple(axes))

    def local(self, serial: torch.Tensor, axes: Sequence[str | None]) -> torch.Tensor:
        """This rank's block of ``serial`` ``[1, *shape]`` (a copy, on the mesh's device)."""
        spec = self._feature_spec(axes)
        block = self.plan.local_block(spec, serial[0], self.mesh.domain_coordinate)
        return block.unsqueeze(0).clone().to(self.mesh.device)

    def shard(
        self, serial: torch.Tensor, axes: Sequence[str | None], requires_grad: bool = False
    ) -> tuple[FoldTensor, torch.Tensor]:
        """``(FoldTensor, local leaf)`` of ``serial`` ``[1, *shape]`` with axis meanings ``axes``.

        Placements follow the registry's rules: a leading token axis is ``(Shard(1),
        Replicate())``, a token pair ``(Shard(1), Shard(2))``. The leaf is the local block;
        gradients of the FoldTensor land on it.
        """
        spec = self._feature_spec(axes)
        leaf = self.local(serial, axes).requires_grad_(requires_grad)
        shapes = self.plan.sharding_shapes(
            spec, tuple(serial.shape[1:]), self.mesh.domain_coordinate, batched=True
        )
        placements = spec.batched_placements(True)
        return wrap(leaf, self.mesh.domain_mesh, placements, shapes), leaf


__all__ = ["TokenLayout"]
