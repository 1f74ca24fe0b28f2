"""What a scatter put where, and a consistency audit of it, on the ranks that hold it.

Both are collective over the domain group (one object all-gather each) and return the
same result on every rank. Every range and pad count is asked of the sample's
:class:`~physicsnemo_foldcp.sharding.plan.ShardingPlan`. (The plan report,
:mod:`physicsnemo_foldcp.sharding.plan_report`, says the same before any scatter, on one
process.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from physicsnemo.domain_parallel import ShardTensor

from physicsnemo_foldcp.features.spec import ATOMS, PASSTHROUGH, REPLICATE, TOKENS
from physicsnemo_foldcp.sharding.scatter import ShardedFeatures


@dataclass(frozen=True)
class FeatureShard:
    """One feature on one rank.

    Attributes
    ----------
    name : str
        Feature key.
    local_shape, global_shape : tuple[int, ...]
        Shape of this rank's block and of the whole (padded-layout) feature.
    placements : str
        Placements over ``(cp0, cp1)``, or ``"plain"`` for a passed-through tensor.
    nbytes : int
        Bytes of the local block.
    pad_elements : int
        Elements of the local block at positions the plan inserted (per-shard padding).
    """

    name: str
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    placements: str
    nbytes: int
    pad_elements: int


@dataclass(frozen=True)
class RankReport:
    """Everything one rank holds of the sample.

    Attributes
    ----------
    rank : int
        Global rank.
    coordinate : tuple[int, int]
        ``(cp0, cp1)`` coordinate in the domain mesh.
    tokens, atoms : tuple[int, int]
        Serial ``[start, stop)`` ranges of the row block's tokens and atoms.
    columns : tuple[int, int]
        ``[start, stop)`` of the token column block (padded layout).
    features : list[FeatureShard]
        Every tensor feature's local block.
    """

    rank: int
    coordinate: tuple[int, int]
    tokens: tuple[int, int]
    atoms: tuple[int, int]
    columns: tuple[int, int]
    features: list[FeatureShard] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes of all local blocks."""
        return sum(f.nbytes for f in self.features)


@dataclass(frozen=True)
class ShardingReport:
    """Per-rank contents of a scattered sample (see :func:`sharding_report`).

    Attributes
    ----------
    ranks : list[RankReport]
        One per rank of the domain group, in domain-rank order.
    unsharded : list[str]
        Features held whole on every rank (replicated or passed through).
    plan : str
        The plan's description.
    """

    ranks: list[RankReport]
    unsharded: list[str]
    plan: str

    def format(self) -> str:
        """A human-readable table: one block per rank, one line per feature."""
        lines = [self.plan]
        total = sum(r.nbytes for r in self.ranks)
        for r in self.ranks:
            lines.append(
                f"rank {r.rank} {r.coordinate}: tokens {list(r.tokens)}, atoms {list(r.atoms)}, "
                f"token columns {list(r.columns)}, {r.nbytes / 2**20:.2f} MiB "
                f"({100 * r.nbytes / max(total, 1):.1f}% of all ranks)"
            )
            for f in r.features:
                pad = f", {f.pad_elements} pad elements" if f.pad_elements else ""
                lines.append(
                    f"    {f.name:<26} {str(f.local_shape):<18} of {str(f.global_shape):<18} "
                    f"{f.placements:<24} {f.nbytes:>10} B{pad}"
                )
        if self.unsharded:
            lines.append(f"held whole on every rank: {', '.join(self.unsharded)}")
        return "\n".join(lines)


def _placement_text(value: Any) -> str:
    if not isinstance(value, ShardTensor):
        return "plain"
    return ", ".join(str(p) for p in value.placements)


def _gather(sharded: ShardedFeatures, item: Any) -> list[Any]:
    mesh = sharded.mesh
    out: list[Any] = [None] * mesh.domain_size
    dist.all_gather_object(out, item, group=mesh.object_group)
    return out


def sharding_report(sharded: ShardedFeatures) -> ShardingReport:
    """Per rank: token/atom ranges, every feature's local shape, bytes, placement and padding.

    Collective over the domain group (one object all-gather).

    Parameters
    ----------
    sharded : ShardedFeatures
        The output of :func:`physicsnemo_foldcp.scatter_features`.

    Returns
    -------
    ShardingReport
        The same on every rank; ``report.format()`` gives a table.
    """
    plan, registry, mesh = sharded.plan, sharded.registry, sharded.mesh
    coord = mesh.domain_coordinate
    shards = []
    for meta in sharded.meta.features:
        value = sharded[meta.name]
        local = value.to_local() if isinstance(value, ShardTensor) else value
        shards.append(
            FeatureShard(
                meta.name,
                tuple(local.shape),
                tuple(value.shape),
                _placement_text(value),
                local.numel() * local.element_size(),
                plan.pad_elements(registry[meta.name], meta.padded_shape, coord),
            )
        )
    mine = RankReport(
        rank=mesh.rank,
        coordinate=coord,
        tokens=plan.serial_range(TOKENS, coord[0]),
        atoms=plan.serial_range(ATOMS, coord[0]),
        columns=plan.block(TOKENS, 1, coord[1]),
        features=shards,
    )
    unsharded = [
        m.name for m in sharded.meta.features if registry[m.name].mode in (REPLICATE, PASSTHROUGH)
    ]
    return ShardingReport(_gather(sharded, mine), unsharded, plan.describe())


def _local_findings(sharded: ShardedFeatures) -> list[str]:
    plan, registry, mesh = sharded.plan, sharded.registry, sharded.mesh
    coord = mesh.domain_coordinate
    findings: list[str] = []
    batched = sharded.meta.batched

    def local(name: str) -> torch.Tensor:
        value = sharded[name]
        t = value.to_local() if isinstance(value, ShardTensor) else value
        return t[0] if batched else t

    atom_pads = plan.is_pad(ATOMS) if ATOMS in _used_axes(sharded) else None
    for meta in sharded.meta.features:
        spec = registry[meta.name]
        t = local(meta.name)
        # Pad positions hold the pad value, so that masks are 0 there.
        if spec.mode != PASSTHROUGH:
            for dim, axis in enumerate(spec.axes):
                if plan.has_padding(axis) and spec.sharded_axes.get(0) == dim:
                    _, pad_runs = plan.layout_runs(axis, *plan.block(axis, 0, coord[0]))
                    pad_value = -1 if meta.compact_of is not None else spec.pad_value
                    if not all(
                        bool((t.narrow(dim, offset, length) == pad_value).all())
                        for offset, length in pad_runs
                    ):
                        findings.append(
                            f"{meta.name}: pad positions of its {axis} axis do not hold the "
                            f"pad value {pad_value}"
                        )
        # Atom indices are GLOBAL positions in the padded atom layout, never at a pad.
        if spec.index_of == ATOMS and atom_pads is not None and t.numel():
            if int(t.min()) < 0 or int(t.max()) >= atom_pads.numel():
                findings.append(f"{meta.name}: atom index outside [0, {atom_pads.numel()})")
            elif bool(atom_pads[t.long()].any()):
                findings.append(f"{meta.name}: an atom index points at a pad atom")
    # Mask polarity: 1 marks real tokens/atoms; some real position must be 1.
    for name in ("token_pad_mask", "atom_pad_mask"):
        if name in sharded:
            m = sharded[name]
            full_max = float(m.to_local().float().max()) if m.to_local().numel() else 0.0
            if full_max not in (0.0, 1.0):
                findings.append(f"{name}: values are not 0/1")
    # Atoms follow their tokens: every local atom's token is in this rank's row block.
    a2t = next((m for m in sharded.meta.features if registry[m.name].axes == (ATOMS, TOKENS)), None)
    if a2t is not None:
        held = local(a2t.name)
        cols = held[held >= 0] if a2t.compact_of is not None else held.nonzero(as_tuple=True)[1]
        start, stop = plan.block(TOKENS, 0, coord[0])
        if bool(((cols < start) | (cols >= stop)).any()):
            findings.append(f"{a2t.name}: a local atom belongs to a token outside this rank's rows")
    return [f"rank {mesh.rank}: {f}" for f in findings]


def _used_axes(sharded: ShardedFeatures) -> set[str]:
    return {a for m in sharded.meta.features for a in sharded.registry[m.name].axes if a}


def audit_features(sharded: ShardedFeatures) -> list[str]:
    """Check a scattered sample: pads masked, mask polarity, atom indices, atom ownership.

    Collective over the domain group (one object all-gather). Atom-index features hold
    GLOBAL positions in the padded atom layout; token/atom maps keep the global token
    axis; the audit checks exactly these conventions.

    Parameters
    ----------
    sharded : ShardedFeatures
        The output of :func:`physicsnemo_foldcp.scatter_features` (or a batch a user built
        to the same conventions).

    Returns
    -------
    list[str]
        Findings from every rank, each prefixed with the rank; empty when all is well.
    """
    return [
        f for rank_findings in _gather(sharded, _local_findings(sharded)) for f in rank_findings
    ]
