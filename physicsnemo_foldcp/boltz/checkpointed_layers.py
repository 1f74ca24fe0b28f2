"""Boltz's layers that Boltz runs through ``torch.utils.checkpoint``: their own forward.

``PairformerLayer``, ``PairformerNoSeqLayer``, ``MSALayer`` and
``DiffusionTransformerLayer`` need no distributed forward of their own: their triangle
updates, attentions and outer products have theirs, and the rest (transitions, dropout
masks, residual sums) runs op by op on local blocks. With ``activation_checkpointing``,
though, Boltz runs each of these layers through the reentrant ``torch.utils.checkpoint``,
which saves the layer's inputs and recomputes the layer in backward on ShardTensors that
have lost the plugin's class (the recomputation then takes PhysicsNeMo's generic path, and
its outputs no longer match the saved gradients). Registered with
:data:`~physicsnemo_foldcp.ops.modules.OWN_FORWARD`, each layer gets them back first.
Communication: none of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from physicsnemo_foldcp.ops.modules import OWN_FORWARD


def handlers() -> list[tuple[type, Callable[..., Any] | None]]:
    """``(layer class, OWN_FORWARD)`` for each layer Boltz may checkpoint."""
    from boltz.model.layers.pairformer import PairformerLayer, PairformerNoSeqLayer
    from boltz.model.modules.transformersv2 import DiffusionTransformerLayer
    from boltz.model.modules.trunkv2 import MSALayer

    return [
        (cls, OWN_FORWARD)
        for cls in (PairformerLayer, PairformerNoSeqLayer, MSALayer, DiffusionTransformerLayer)
    ]


__all__ = ["handlers"]
