"""Layouts of the one-hot atom<->token maps: dense ``[X, Y]`` maps and index vectors ``[X]``.

A one-hot map (``atom_to_token``, ``token_to_rep_atom``, ``r_set_to_rep_atom``) holds at
most one 1 per row, so its *index form*, the column of each row's 1 (``-1`` for none), says
the same in ``X`` integers instead of ``X * Y`` elements. The scatter uses the index form
twice: as the ``"index"`` map layout (:data:`MAP_LAYOUTS`), where the ShardTensor itself is
the index vector in padded-layout positions (:func:`padded_index_map`), and as the wire form
of a dense 0/1 map (:func:`exact_map_rows`, :func:`pad_map_index`), expanded back to dense
on arrival.
"""

from __future__ import annotations

import torch

from physicsnemo_foldcp.features.spec import PASSTHROUGH, FeatureSpec
from physicsnemo_foldcp.sharding.options import MAP_LAYOUTS
from physicsnemo_foldcp.sharding.plan import ShardingPlan
from physicsnemo_foldcp.sharding.validation import binary_rows


def dense_map_to_index(dense: torch.Tensor) -> torch.Tensor:
    """``[X, Y]`` one-hot map -> int64 ``[X]``: the column of each row's 1, or -1 for none."""
    rows = binary_rows(dense)
    if rows is not None:
        return torch.where(rows[0] > 0, rows[1], -1)
    nonzero = dense != 0
    return torch.where(nonzero.any(-1), nonzero.to(torch.int8).argmax(-1), -1)


def index_map_to_dense(index: torch.Tensor, columns: int, dtype: torch.dtype) -> torch.Tensor:
    """int64 ``[X]`` index vector (-1: no column) -> ``[X, columns]`` one-hot map."""
    dense = torch.zeros(*index.shape, columns, dtype=dtype, device=index.device)
    rows = (index >= 0).nonzero(as_tuple=True)
    dense[rows + (index[rows],)] = 1
    return dense


def exact_map_rows(t: torch.Tensor) -> torch.Tensor | None:
    """Index vector of a map of exact 0s and 1s with at most one 1 per row; else ``None``."""
    rows = binary_rows(t)
    if rows is None or bool((rows[0] > 1).any()):
        return None
    return torch.where(rows[0] > 0, rows[1], -1)


def pad_map_index(plan: ShardingPlan, spec: FeatureSpec, index: torch.Tensor) -> torch.Tensor:
    """Serial index vector of a one-hot map (pad value 0) -> that of its padded layout.

    Parameters
    ----------
    plan : ShardingPlan
        The sample's plan.
    spec : FeatureSpec
        The map's registry entry (axes ``(rows, columns)``).
    index : torch.Tensor
        int64 ``[X]``: serial column of each serial row's 1, -1 for none.

    Returns
    -------
    torch.Tensor
        int64 ``[X padded]``: padded-layout column of each padded row's 1, -1 for none
        (inserted rows hold -1).
    """
    rows_axis, columns_axis = spec.axes
    if plan.has_padding(columns_axis):
        positions = plan.positions(columns_axis).to(index.device)
        index = torch.where(index >= 0, positions[index.clamp(min=0)], -1)
    if plan.has_padding(rows_axis):
        index = plan.to_padded(index, (rows_axis,), -1)
    return index


def padded_index_map(
    plan: ShardingPlan, spec: FeatureSpec, dense: torch.Tensor, index: torch.Tensor | None
) -> torch.Tensor:
    """``dense_map_to_index`` of a one-hot map in the padded layout, from the serial map.

    Parameters
    ----------
    plan : ShardingPlan
        The sample's plan.
    spec : FeatureSpec
        The map's registry entry.
    dense : torch.Tensor
        ``[X, Y]`` map in the serial layout.
    index : torch.Tensor or None
        ``dense_map_to_index(dense)`` when validation already computed it.

    Returns
    -------
    torch.Tensor
        int64 ``[X padded]``: padded-layout column of each padded row's 1, -1 for none.
    """
    if spec.mode == PASSTHROUGH:
        return index if index is not None else dense_map_to_index(dense)
    if spec.pad_value != 0:
        return dense_map_to_index(plan.to_padded(dense, spec.axes, spec.pad_value))
    return pad_map_index(plan, spec, index if index is not None else dense_map_to_index(dense))


__all__ = [
    "MAP_LAYOUTS",
    "dense_map_to_index",
    "exact_map_rows",
    "index_map_to_dense",
    "pad_map_index",
    "padded_index_map",
]
