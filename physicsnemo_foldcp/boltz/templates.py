"""Boltz's template modules on scattered features: refused, with the reason.

``TemplateModule`` and ``TemplateV2Module`` (``boltz.model.modules.trunkv2``) embed up to
``T`` template structures into the pair track: per template, pair distances and unit
vectors from the template's frames, a pair stack (``PairformerNoSeqModule``) over a
``[B T, N, N, template_dim]`` pair, and a mean over templates. Run op by op on scattered
features, the frames and the template features (``template_restype``,
``template_frame_rot``, ``template_cb`` ...) have no layout in the feature registry, and
the ``B T`` axis folds the template axis into the batch axis of a sharded pair.

Rather than let that fall back to gathers or fail deep inside Boltz's code, these handlers
refuse a call on ShardTensors with an error that names the module and the way around it:
a trunk without templates (``Boltz2TrunkConfig.use_templates=False``, Boltz-2's default).
Called with plain tensors the modules run as Boltz wrote them.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from physicsnemo_foldcp.ops import ShardingLayoutError


def refuse_templates(module: nn.Module, *args: Any, **kwargs: Any) -> None:
    """Raise for a template module called on scattered features.

    Raises
    ------
    ShardingLayoutError
        Always: templates have no distributed forward.
    """
    raise ShardingLayoutError(
        f"{type(module).__name__}: Boltz's template module has no distributed forward under "
        "context parallelism (its template features have no layout in the feature "
        "registry); build the trunk without templates (use_templates=False) to run it on "
        "scattered features"
    )


def handlers() -> list[tuple[type[nn.Module], Any]]:
    """The Boltz template classes, each with the refusing handler."""
    from boltz.model.modules.trunkv2 import TemplateModule, TemplateV2Module

    return [(TemplateModule, refuse_templates), (TemplateV2Module, refuse_templates)]


__all__ = ["handlers", "refuse_templates"]
