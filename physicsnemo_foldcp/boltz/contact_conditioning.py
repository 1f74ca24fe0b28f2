"""Boltz-2's ``ContactConditioning`` (trunkv2) on pair tiles.

The module embeds the pair features ``contact_conditioning [B, N, N, 5]`` and
``contact_threshold [B, N, N]`` entry by entry: a Fourier embedding of the normalised
threshold, a concatenation, a Linear and a masked mix with two learned encodings.

Why the generic path fails
--------------------------
Boltz feeds the Fourier embedding ``contact_threshold_normalized.flatten()`` and reshapes
the result back to ``[B, N, N, -1]``: flattening a pair tile into one axis has no tile
layout, so the op-by-op run all-gathers the whole ``N x N`` threshold on every rank.

What happens instead
--------------------
Every output entry depends on the same entry of the inputs only, so the module's own
forward runs on this rank's tiles (``torch.func.functional_call`` with the module's
parameters; the flatten is then of the local tile) and the result is the output tile,
laid out like ``contact_conditioning``. Each rank's parameter gradients are the part of
its tile, summed over both mesh dims in backward (one all-reduce per mesh dim). No other
communication.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from physicsnemo_foldcp.core import compat
from physicsnemo_foldcp.core.blocks import describe, local_of
from physicsnemo_foldcp.core.tensor import FoldTensor, wrap
from physicsnemo_foldcp.ops import ShardingLayoutError
from physicsnemo_foldcp.ops.modules import submodule_caller, tile_parameters

FEATURES = ("contact_conditioning", "contact_threshold")
"""The features the module reads, both pair tiles."""


def contact_conditioning(module: torch.nn.Module, feats: dict[str, Any]) -> FoldTensor:
    """``ContactConditioning.forward`` on scattered pair features (see the module docstring).

    Parameters
    ----------
    module : boltz.model.modules.trunkv2.ContactConditioning
        The Boltz module (its parameters are used as they are).
    feats : dict[str, torch.Tensor]
        ``contact_conditioning [B, N, N, 5]`` and ``contact_threshold [B, N, N]``, pair
        tiles ``(Shard(1), Shard(2))``.

    Returns
    -------
    FoldTensor
        ``[B, N, N, token_z]``, the pair tile layout of ``contact_conditioning``.
    """
    pair = feats["contact_conditioning"]
    tiles = [feats[name] for name in FEATURES]
    if any(not isinstance(t, FoldTensor) or t.placements != pair.placements for t in tiles):
        raise ShardingLayoutError(
            "ContactConditioning: contact_conditioning and contact_threshold must be pair "
            f"tiles laid out alike, got {[describe(t) for t in tiles]}"
        )
    local = {name: local_of(feats[name]) for name in FEATURES}
    out = submodule_caller(module, tile_parameters(module, pair.device_mesh))("", local)
    shapes = {
        mesh_dim: [(*shape[:-1], out.shape[-1]) for shape in per_rank]
        for mesh_dim, per_rank in compat.sharding_shapes(pair).items()
    }
    return wrap(out, pair.device_mesh, pair.placements, shapes)


def handlers() -> list[tuple[type, Callable]]:
    """``(Boltz class, handler)`` pairs of this module."""
    from boltz.model.modules.trunkv2 import ContactConditioning

    return [(ContactConditioning, contact_conditioning)]


__all__ = ["FEATURES", "contact_conditioning", "handlers"]
