"""Fixtures of the ops tests: one scattered synthetic complex per mesh, and its serial twin.

Every rank builds the serial sample of its domain group itself (``make_complex`` is
deterministic), so a test compares each rank's local blocks with the serial ground truth
laid out on the plan, element by element.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from physicsnemo_foldcp import ShardingOptions, scatter_features
from physicsnemo_foldcp.core import compat
from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.features import FeatureSpec
from physicsnemo_foldcp.ops import tag_maps, wrap
from physicsnemo_foldcp.sharding.plan import local_block, sharding_shapes
from physicsnemo_foldcp.sharding.scatter import ShardedFeatures
from physicsnemo_foldcp.testing.collectives import collective_counts, count_p2p

PADDINGS = {"no-pad": {}, "pad-4-32": {"token_multiple": 4, "atom_multiple": 32}}
MAPS = {
    "atom_to_token": ("atoms", "tokens"),
    "token_to_rep_atom": ("tokens", "atoms"),
    "token_to_center_atom": ("tokens", "atoms"),
    "r_set_to_rep_atom": ("rset", "atoms"),
}


@dataclass
class Case:
    """A scattered sample on this rank and the serial sample it came from (batched)."""

    mesh: object
    serial: dict
    sharded: ShardedFeatures
    index: ShardedFeatures
    batched: bool = True
    generator: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(0))

    @property
    def device(self) -> torch.device:
        return self.mesh.device

    @property
    def plan(self):
        return self.sharded.plan

    @property
    def n_tokens(self) -> int:
        return self.serial["atom_to_token"].shape[-1]

    @property
    def n_atoms(self) -> int:
        return self.serial["atom_to_token"].shape[-2]

    def _unbatch(self, t: torch.Tensor) -> torch.Tensor:
        return t[0] if self.batched else t

    def _batch(self, t: torch.Tensor) -> torch.Tensor:
        return t.unsqueeze(0) if self.batched else t

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(tuple(shape), generator=self.generator)

    def padded(self, t: torch.Tensor, axes) -> torch.Tensor:
        """A serial tensor in the padded layout (pads = 0)."""
        return self._batch(self.plan.to_padded(self._unbatch(t), axes, 0))

    def expected_local(self, t: torch.Tensor, axes) -> torch.Tensor:
        """This rank's block of a serial tensor (padded layout, pads = 0), on the CPU."""
        spec = FeatureSpec("expected", axes)
        padded = self.plan.to_padded(self._unbatch(t.detach()), axes, 0)
        return self._batch(local_block(spec, padded, self.plan, self.mesh.domain_coordinate))

    def shard(self, t: torch.Tensor, axes, requires_grad: bool = False):
        """``(ShardTensor, local leaf)`` of a serial tensor at the registry placements."""
        spec = FeatureSpec("input", axes)
        padded = self.plan.to_padded(self._unbatch(t.detach()), axes, 0)
        coord = self.mesh.domain_coordinate
        leaf = self._batch(local_block(spec, padded, self.plan, coord).clone())
        leaf = leaf.to(self.device).requires_grad_(requires_grad)
        shapes = sharding_shapes(spec, tuple(padded.shape), self.plan, coord, self.batched)
        st = wrap(leaf, self.mesh.domain_mesh, spec.batched_placements(self.batched), shapes)
        return st, leaf

    def unpadded(self, st, axes) -> torch.Tensor:
        """``full_tensor()`` back in the serial layout, on the CPU (collective)."""
        full = st.full_tensor().detach().cpu()
        return self._batch(self.plan.from_padded(self._unbatch(full), axes))

    def pads(self, axes) -> torch.Tensor:
        """Bool, padded layout, batched: True where any axis of ``axes`` is a pad position."""
        shape = [self.plan.padded_length(a) if a else 1 for a in axes]
        out = torch.zeros(shape, dtype=torch.bool)
        for dim, axis in enumerate(axes):
            if axis:
                view = [1] * len(axes)
                view[dim] = -1
                out = out | self.plan.is_pad(axis).view(view)
        return out.unsqueeze(0)


def serial_index_maps(serial: dict) -> dict:
    """Index layout of the serial one-hot maps: ``[1, R]`` column per row, ``-1`` for none."""
    out = {}
    for name in MAPS:
        dense = serial[name]
        has = (dense != 0).any(-1)
        out[name] = torch.where(has, (dense != 0).to(torch.int8).argmax(-1), -1)
    return out


def _index_features(sharded: ShardedFeatures) -> ShardedFeatures:
    """The scattered sample with each map in the index layout (what map_layout='index' gives)."""
    out = ShardedFeatures(sharded)
    for attr in ("plan", "meta", "registry", "mesh", "stats"):
        setattr(out, attr, getattr(sharded, attr))
    for name in MAPS:
        dense = sharded[name]
        local = compat.local_tensor(dense)
        has = (local != 0).any(-1)
        index = torch.where(has, (local != 0).to(torch.int8).argmax(-1), -1).to(torch.int64)
        shapes = {0: [tuple(s[:-1]) for s in compat.sharding_shapes(dense)[0]]}
        out[name] = wrap(index, dense.device_mesh, dense.placements, shapes)
    return tag_maps(out)


_CASES: dict = {}


@pytest.fixture
def ops_case():
    """``make(mesh, padding="no-pad", n_tokens=37) -> Case`` (cached per mesh and padding)."""

    def make(mesh, padding: str = "no-pad", n_tokens: int = 37, batched: bool = True) -> Case:
        key = (mesh.shape, padding, n_tokens, batched)
        if key not in _CASES:
            serial = make_complex(
                n_tokens, seed=mesh.ddp_rank, preset="boltz2", msa_rows=5, n_conformers=1
            )
            if batched:
                serial = {k: v.unsqueeze(0) for k, v in serial.items()}
            sharded = scatter_features(
                serial if mesh.is_domain_source else None,
                mesh,
                options=ShardingOptions(**PADDINGS[padding]),
            )
            sharded = tag_maps(sharded)
            index = _index_features(sharded) if batched else None
            _CASES[key] = (serial, sharded, index)
        serial, sharded, index = _CASES[key]
        return Case(mesh, serial, sharded, index, batched)

    return make


@pytest.fixture
def p2p_counter():
    """The :func:`count_p2p` context manager."""
    return count_p2p


@pytest.fixture
def collectives():
    """``collectives(CommDebugMode) -> {"all_gather": n, "all_reduce": n, ...}``."""
    return collective_counts
