"""Tags on the scatter's atom<->token maps, so Boltz's ``torch.bmm`` forms run locally.

A scattered one-hot map (``atom_to_token``, ``token_to_rep_atom``, ``token_to_center_atom``,
``r_set_to_rep_atom``) is, by its placements alone, any ``(Shard, Replicate)`` tensor.
:func:`tag_maps` gives it a :class:`~physicsnemo_foldcp.core.tags.MapTag` from the plan:
its axes, layout and the column blocks its entries lie in. The scatter tags its maps
``checked=True``: the source validated them (every atom in its token's row block), so the
map products of :mod:`physicsnemo_foldcp.ops.maps` run with no collective and no host
sync. A map the plugin did not validate is checked here once, when it is tagged, never per
call.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor.placement_types import Replicate, Shard

from physicsnemo_foldcp.core.blocks import ROWS, MapLayoutError, coordinate, mesh_sizes
from physicsnemo_foldcp.core.compat import global_shape, local_tensor
from physicsnemo_foldcp.core.tags import MapTag
from physicsnemo_foldcp.core.tensor import wrap
from physicsnemo_foldcp.features.axes import is_layout


def dense_block_problem(
    local: torch.Tensor, block_dim: int, start: int, length: int, what: str
) -> str | None:
    """Why a dense map block has entries outside columns ``[start, start + length)``."""
    total = local.shape[block_dim]
    for lo, hi in ((0, start), (start + length, total)):
        if hi <= lo:
            continue
        outside = local.narrow(block_dim, lo, hi - lo)
        if bool((outside != 0).any()):
            where = (outside != 0).nonzero()[0].tolist()
            where[block_dim] += lo
            return (
                f"{what} has a nonzero entry at local index {tuple(where)}, in column "
                f"{where[block_dim]} outside this rank's column block [{start}, "
                f"{start + length}): a row's atoms and tokens must live on the same rank "
                "(scatter the sample, or build the map from the plan)"
            )
    return None


def index_block_problem(local: torch.Tensor, start: int, length: int, what: str) -> str | None:
    """Why an index map block points outside ``[start, start + length)`` (``-1`` is none)."""
    bad = (local >= 0) & ((local < start) | (local >= start + length))
    if bool(bad.any()):
        where = tuple(bad.nonzero()[0].tolist())
        return (
            f"{what} holds position {int(local[where])} at local index {where}, outside "
            f"this rank's block [{start}, {start + length}): a row's atoms and tokens must "
            "live on the same rank"
        )
    return None


def row_pads(plan: Any, axis: Any) -> tuple[int, ...]:
    """Positions the plan inserted at the end of each ``cp0`` block of ``axis``."""
    blocks = (plan.block(axis, 0, i) for i in range(plan.cp[0]))
    return tuple(stop - start - plan.real_count(axis, start, stop) for start, stop in blocks)


def tag_maps(features: Any, *, validated: bool = False) -> Any:
    """Tag the one-hot maps of a scattered sample so Boltz's ``torch.bmm`` forms run locally.

    Call on every rank of the domain group, right after
    :func:`physicsnemo_foldcp.scatter_features` (it modifies the dict in place and returns
    it). Every feature whose registry spec is ``one_hot`` gets a checked
    :class:`~physicsnemo_foldcp.core.tags.MapTag` (same data, same placements), so the map
    products that read it do no check of their own; the tag also carries the pads the
    plan inserted in each row block (``row_pads``), so the atom windows check the padding
    of the atom axis without reading a mask.

    Parameters
    ----------
    features : ShardedFeatures
        The scatter's output (needs ``.plan``, ``.registry``, ``.meta`` and ``.mesh``).
    validated : bool, default False
        The source validated the maps before it sent them (the scatter's own call): tag
        them without looking again. Otherwise every local map block is checked to have its
        entries inside this rank's blocks and shapes that agree with the plan, once, here;
        the outcome is shared over the domain group (one object all-gather), so every rank
        raises the same error.

    Returns
    -------
    ShardedFeatures
        ``features``, with its maps tagged.

    Raises
    ------
    MapLayoutError
        On every rank of the domain group, when a map has an entry outside the rank's
        block or a shape that disagrees with the plan (message names the feature, the
        rank and the index).
    """
    plan, registry, mesh = features.plan, features.registry, features.mesh
    batch = 1 if features.meta.batched else 0
    problems: list[str] = []
    for name in sorted(features):
        if name not in registry:
            continue
        spec = registry[name]
        value = features[name]
        if not spec.one_hot or not isinstance(value, ShardTensor):
            continue
        rows_axis, columns_axis = spec.axes
        if not (is_layout(rows_axis) and is_layout(columns_axis)):
            continue
        shape = global_shape(value)
        layout = "dense" if len(shape) == batch + 2 else "index"
        tag = MapTag(
            name=name,
            axes=(str(rows_axis), str(columns_axis)),
            layout=layout,
            sharded_dim=batch,
            block_dim=batch + 1 if layout == "dense" else None,
            block_sizes=tuple(plan.row_sizes(columns_axis)),
            checked=True,
            row_pads=row_pads(plan, rows_axis),
        )
        if not validated:
            problem = _check_tag(value, tag, plan)
            if problem:
                problems.append(problem)
        features[name] = wrap(value, tag=tag)
    if not validated:
        _raise_collectively(problems, mesh)
    return features


def _check_tag(value: ShardTensor, tag: MapTag, plan: Any) -> str | None:
    shape = global_shape(value)
    rows = plan.padded_length(tag.axes[0])
    columns = plan.padded_length(tag.axes[1])
    if shape[tag.sharded_dim] != rows or (
        tag.layout == "dense" and shape[tag.block_dim] != columns
    ):
        return (
            f"{tag.name}: global shape {tuple(shape)} disagrees with the plan: "
            f"{rows} {tag.axes[0]} x {columns} {tag.axes[1]} (padded layout)"
        )
    placements = tuple(value.placements)
    if placements != (Shard(tag.sharded_dim), Replicate()):
        return (
            f"{tag.name}: placements {placements}, expected (Shard({tag.sharded_dim}), Replicate())"
        )
    sizes, planned = mesh_sizes(value, ROWS, tag.sharded_dim), list(plan.row_sizes(tag.axes[0]))
    if sizes != planned:
        return f"{tag.name}: cp0 row blocks {sizes} disagree with the plan's {planned}"
    i, _ = coordinate(value.device_mesh)
    start, length = tag.column_block(i)
    local = local_tensor(value)
    if tag.layout == "dense":
        return dense_block_problem(local, tag.block_dim, start, length, tag.name)
    return index_block_problem(local, start, length, tag.name)


def _raise_collectively(problems: list[str], mesh: Any) -> None:
    mine = "; ".join(problems) if problems else None
    if not dist.is_initialized() or mesh.domain_size == 1:
        gathered = [mine]
    else:
        gathered = [None] * mesh.domain_size
        dist.all_gather_object(gathered, mine, group=mesh.object_group)
    failures = {r: msg for r, msg in enumerate(gathered) if msg}
    if failures:
        cp1 = mesh.cp[1]
        listing = "; ".join(
            f"rank {mesh.domain_global_rank(r // cp1, r % cp1)} (cp0, cp1) = "
            f"({r // cp1}, {r % cp1}): {msg}"
            for r, msg in failures.items()
        )
        raise MapLayoutError(f"tag_maps: scattered map(s) do not follow their tokens: {listing}")


__all__ = ["dense_block_problem", "index_block_problem", "row_pads", "tag_maps"]
