"""Boltz's Pairformer layers: their own forward, on inputs that are the plugin's tensors.

A ``PairformerLayer`` (or ``PairformerNoSeqLayer``) needs no distributed forward of its
own: its triangle updates, triangle attentions and attention have theirs, and the rest
(transitions, dropout masks, residual sums) runs op by op on local blocks. With
``activation_checkpointing``, though, Boltz runs each layer through the reentrant
``torch.utils.checkpoint``, which saves the layer's inputs and recomputes the layer in
backward on ShardTensors that have lost the plugin's class; registered with
:data:`~physicsnemo_foldcp.ops.modules.OWN_FORWARD`, the layer gets them back first.
Communication: none of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from physicsnemo_foldcp.ops.modules import OWN_FORWARD


def handlers() -> list[tuple[type, Callable[..., Any] | None]]:
    """``[(PairformerLayer, OWN_FORWARD), (PairformerNoSeqLayer, OWN_FORWARD)]``."""
    from boltz.model.layers.pairformer import PairformerLayer, PairformerNoSeqLayer

    return [(PairformerLayer, OWN_FORWARD), (PairformerNoSeqLayer, OWN_FORWARD)]


__all__ = ["handlers"]
