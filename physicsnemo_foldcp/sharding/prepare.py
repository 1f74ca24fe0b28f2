"""The source rank's half of the scatter: validate one sample, plan it, and get it ready to send.

:func:`prepare_sample` runs the checks of :mod:`~physicsnemo_foldcp.sharding.validation`,
picks the row blocks (even, explicit, or balanced by the options' cost model,
:mod:`~physicsnemo_foldcp.sharding.balance`), builds the
:class:`~physicsnemo_foldcp.sharding.plan.ShardingPlan`, and returns a
:class:`~physicsnemo_foldcp.sharding.wire.PreparedSample` that writes any rank's blocks
straight from the serial tensors. Pure tensor code: no communication; the plan report runs
it on one process to show what a scatter would do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from physicsnemo_foldcp.features.registry import FeatureRegistry
from physicsnemo_foldcp.features.spec import (
    ATOMS,
    ENSEMBLE,
    PASSTHROUGH,
    RSET,
    TOKENS,
    FeatureSpec,
)
from physicsnemo_foldcp.sharding.balance import token_bounds_for
from physicsnemo_foldcp.sharding.maps import exact_map_rows, padded_index_map
from physicsnemo_foldcp.sharding.options import ShardingOptions, options_or_defaults
from physicsnemo_foldcp.sharding.plan import ShardingPlan, build_plan
from physicsnemo_foldcp.sharding.validation import (
    FeatureValidationError,
    align_to_lengths,
    atom_tokens_from_map,
    axis_lengths,
    check_dtype,
    check_index_range,
    check_map_within_tokens,
    check_nonnegative_indices,
    detect_batch,
    find_map,
    rset_row_tokens,
    split_sample,
)
from physicsnemo_foldcp.sharding.wire import FeatureMeta, PreparedSample


def _atom_tokens(
    tensors: Mapping[str, torch.Tensor], registry: FeatureRegistry, lengths: Mapping[str, int]
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """Token of every atom (from the sample's ``(atoms, tokens)`` map) and that map's index.

    Returns
    -------
    tuple[torch.Tensor or None, dict[str, torch.Tensor]]
        int64 ``[A]`` (``-1``: trailing pad atom), or ``None`` for a sample without atoms;
        and ``{map name: the same vector}`` (the map's index form).
    """
    if ATOMS not in lengths:
        return None, {}
    map_name = find_map(registry, tensors, (ATOMS, TOKENS))
    if map_name is None:
        raise FeatureValidationError(
            "the sample has atom features but no one-hot (atoms, tokens) map such as "
            "atom_to_token to place its atoms with their tokens"
        )
    try:
        atom_tokens = atom_tokens_from_map(tensors[map_name], tensors.get("atom_pad_mask"))
    except FeatureValidationError as err:
        raise FeatureValidationError(str(err).replace("atom_to_token", map_name)) from None
    return atom_tokens, {map_name: atom_tokens}


def _first_with(
    tensors: Mapping[str, torch.Tensor], registry: FeatureRegistry, axis: str
) -> str | None:
    """The first feature (sorted) with an axis of meaning ``axis``."""
    return next((n for n in sorted(tensors) if registry[n].axes_of(axis)), None)


def _plan(
    tensors: Mapping[str, torch.Tensor],
    registry: FeatureRegistry,
    cp: tuple[int, int],
    lengths: Mapping[str, int],
    options: ShardingOptions,
    token_bounds: tuple[int, ...] | None,
) -> tuple[ShardingPlan, dict[str, torch.Tensor]]:
    """The sample's plan, and the index form of every validated one-hot map."""
    atom_tokens, map_index = _atom_tokens(tensors, registry, lengths)
    if token_bounds is None and options.balance.mode != "even":
        n_tokens = int(lengths[TOKENS])
        if atom_tokens is None:
            counts = torch.zeros(n_tokens, dtype=torch.int64)
        else:
            counts = torch.bincount(atom_tokens[atom_tokens >= 0], minlength=n_tokens)
        token_bounds = token_bounds_for(counts, cp, options.balance)
    rset_name = find_map(registry, tensors, (RSET, ATOMS))
    rset_rows = None
    if rset_name is not None and atom_tokens is not None:
        rset_rows = (rset_name, rset_row_tokens(rset_name, tensors[rset_name], atom_tokens))
    plan = build_plan(
        lengths,
        cp,
        atom_tokens=atom_tokens,
        rset_rows=rset_rows,
        token_multiple=options.token_multiple,
        atom_multiple=options.atom_multiple,
        token_bounds=token_bounds,
    )
    if atom_tokens is not None:
        for name in sorted(tensors):
            spec = registry[name]
            if spec.one_hot and spec.axes == (TOKENS, ATOMS):
                map_index[name] = check_map_within_tokens(name, tensors[name], atom_tokens)
    return plan, map_index


def _wire_rows(spec: FeatureSpec, t: torch.Tensor, index: torch.Tensor | None):
    """Index form of a dense map that may travel as one int64 per row, else ``None``."""
    if (
        spec.one_hot
        and spec.mode != PASSTHROUGH
        and spec.pad_value == 0
        and not (t.dtype.is_floating_point or t.dtype.is_complex)
        and t.numel()
    ):
        # Validated maps are exact 0/1 with one 1 per row at most: reuse their index.
        return index if index is not None else exact_map_rows(t)
    return None


def _lay_out(
    name: str,
    spec: FeatureSpec,
    t: torch.Tensor,
    plan: ShardingPlan,
    lengths: Mapping[str, int],
    map_layout: str,
    index: torch.Tensor | None,
) -> tuple[torch.Tensor, tuple[int, ...], torch.dtype | None, torch.Tensor | None]:
    """One feature's source tensor, padded shape, compact dtype and wire row vector.

    Index values are checked and remapped into the padded layout; an ``"index"``-layout
    map is converted (and is then already in the padded layout).
    """
    target = spec.index_axis  # indices into a layout axis: checked, then remapped
    if target is not None:
        if target not in lengths:
            raise FeatureValidationError(
                f"feature {name!r} holds {target} indices but the sample has no {target} axis"
            )
        check_index_range(name, t, target, lengths[target])
        t = plan.remap_index_values(t, target)
    if spec.one_hot and map_layout == "index":
        compact = padded_index_map(plan, spec, t, index)
        return compact, tuple(int(n) for n in compact.shape), t.dtype, None
    return t, plan.padded_shape(spec, t.shape), None, _wire_rows(spec, t, index)


def prepare_sample(
    features: Mapping[str, Any] | None,
    registry: FeatureRegistry,
    cp: tuple[int, int],
    *,
    options: ShardingOptions | None = None,
    token_bounds: tuple[int, ...] | None = None,
) -> PreparedSample:
    """Validate a serial sample and plan the layout of every feature.

    Each dense map is scanned once for validation (a few reductions, no copies of it);
    no feature is copied into the padded layout here: the blocks are written from the
    serial tensors when packed (:meth:`PreparedSample.write_block`).

    Parameters
    ----------
    features : Mapping[str, Any]
        One sample: tensors unbatched or with a leading batch axis of 1, plus any
        non-tensor values (passed through).
    registry : FeatureRegistry
        Axis meanings of every tensor feature.
    cp : tuple[int, int]
        ``(cp0, cp1)``.
    options : ShardingOptions, optional
        Padding multiples, ``align_lengths``, map layout and balance (the defaults when
        omitted). With ``balance.mode == "balanced"`` and no ``token_bounds``, the row
        blocks balance the options' cost model over the sample's atoms per token.
    token_bounds : tuple[int, ...], optional
        Explicit row-block token boundaries (see
        :func:`~physicsnemo_foldcp.sharding.plan.build_plan`); they win over the balance.

    Returns
    -------
    PreparedSample
        The plan, metadata and sources; ``padded`` builds the padded layout on access.

    Raises
    ------
    FeatureValidationError
        With a message naming the feature, axis, shape or value at fault.
    UnknownFeatureError
        For tensor keys the registry lacks.
    """
    options = options_or_defaults(options, "prepare_sample")
    tensors, values = split_sample(features)
    registry.check_keys(tensors)
    batched = detect_batch(tensors, registry)
    if batched:
        tensors = {k: v[0] for k, v in tensors.items()}
    for name, t in tensors.items():
        check_dtype(registry[name], t)
    lengths = axis_lengths(tensors, registry, options.align_lengths)
    serial_shapes = {k: tuple(int(s) for s in v.shape) for k, v in tensors.items()}
    if options.align_lengths:
        tensors = {k: align_to_lengths(v, registry[k], lengths) for k, v in tensors.items()}
    if TOKENS not in lengths:
        raise FeatureValidationError(
            "the sample has no sharded feature with a token axis; nothing to plan from"
        )
    if lengths[TOKENS] == 0:
        raise FeatureValidationError(
            f"the sample is an empty complex: its token axes have length 0 (e.g. "
            f"{_first_with(tensors, registry, TOKENS)!r}); a complex needs at least one token"
        )
    for name, t in tensors.items():
        if registry[name].index_of == ENSEMBLE:
            check_nonnegative_indices(name, t, ENSEMBLE)
    plan, map_index = _plan(tensors, registry, cp, lengths, options, token_bounds)

    sources: dict[str, torch.Tensor] = {}
    laid_out: set[str] = set()
    map_rows: dict[str, torch.Tensor] = {}
    metas: list[FeatureMeta] = []
    for name in sorted(tensors):
        spec = registry[name]
        t, padded_shape, compact_of, rows = _lay_out(
            name, spec, tensors[name], plan, lengths, options.map_layout, map_index.get(name)
        )
        if compact_of is not None:
            laid_out.add(name)
        if rows is not None:
            map_rows[name] = rows
        sources[name] = t
        metas.append(
            FeatureMeta(
                name, t.dtype, serial_shapes[name], padded_shape, compact_of, rows is not None
            )
        )
    specs = {name: registry[name] for name in sources}
    return PreparedSample(
        plan, metas, sources, specs, values, batched, frozenset(laid_out), map_rows
    )


__all__ = ["prepare_sample"]
