"""Hyperparameters of :class:`~physicsnemo_foldcp.models.boltz2_trunk.Boltz2Trunk`.

Kept apart from the model so that the Hydra schema (``model/boltz2_trunk_schema``) is
registered without importing ``boltz``, an optional extra.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

#: Small defaults (CPU-sized) of ``embedder_args``, with Boltz-2's feature flags on.
DEFAULT_EMBEDDER_ARGS: dict[str, Any] = {
    "atom_encoder_depth": 1,
    "atom_encoder_heads": 2,
    "add_method_conditioning": True,
    "add_modified_flag": True,
    "add_cyclic_flag": True,
    "add_mol_type_feat": True,
}
#: Small defaults of ``msa_args`` (Boltz's ``MSAModule`` arguments).
DEFAULT_MSA_ARGS: dict[str, Any] = {
    "msa_s": 8,
    "msa_blocks": 1,
    "msa_dropout": 0.15,
    "z_dropout": 0.25,
    "pairwise_head_width": 8,
    "pairwise_num_heads": 2,
}
#: Small defaults of ``pairformer_args`` (Boltz's ``PairformerModule`` arguments).
DEFAULT_PAIRFORMER_ARGS: dict[str, Any] = {
    "num_blocks": 2,
    "num_heads": 2,
    "dropout": 0.25,
    "pairwise_head_width": 8,
    "pairwise_num_heads": 2,
}


@dataclass(frozen=True)
class Boltz2TrunkConfig:
    """``Boltz2.__init__``'s trunk arguments (same names and meaning), small by default.

    Attributes
    ----------
    atom_s, atom_z : int
        Atom single and pair widths (the input embedder's atom encoder).
    token_s, token_z : int
        Token single ``s`` and pair ``z`` widths.
    num_bins : int
        Distogram bins (Boltz-2: 64, the width of ``disto_target``).
    embedder_args : dict
        Further ``InputEmbedder`` arguments (``atom_encoder_depth``,
        ``atom_encoder_heads``, the ``add_*`` flags).
    msa_args : dict
        ``MSAModule`` arguments (``msa_s``, ``msa_blocks``, dropouts, head sizes...).
    pairformer_args : dict
        ``PairformerModule`` arguments (``num_blocks``, ``num_heads``, ``dropout``...).
    atom_feature_dim : int or None
        Width of the per-atom features; None derives it from the three atom flags.
    template_args : dict or None
        ``TemplateV2Module`` / ``TemplateModule`` arguments (``template_dim``,
        ``template_blocks``...); required with ``use_templates``.
    atoms_per_window_queries, atoms_per_window_keys : int
        Atom attention windows (the atom axis must be padded to a multiple of the first).
    fix_sym_check, cyclic_pos_enc : bool
        ``RelativePositionEncoder`` options.
    aggregate_distogram : bool
        The loss averages the target over the ``K`` conformers (Boltz-2's default).
    bond_type_feature : bool
        Add the bond-type embedding ``token_bonds_type`` (reads ``type_bonds``).
    use_no_atom_char, use_atom_backbone_feat, use_residue_feats_atoms : bool
        Atom-feature flags of the input embedder.
    conditioning_cutoff_min, conditioning_cutoff_max : float
        ``ContactConditioning`` distance range.
    use_templates, use_templates_v2 : bool
        Add the template module (``TemplateV2Module`` with ``use_templates_v2``, else
        ``TemplateModule``) to the pair stack, as ``Boltz2`` does.
    use_kernels, use_flash_attn : bool
        Passed to the template, MSA and Pairformer modules on every call (cuequivariance
        kernels, SDPA attention); off by default (and needed off on a CPU).
    recycling_steps : int
        Default recycling steps of the forward (``recycling_steps + 1`` passes).
    """

    atom_s: int = 16
    atom_z: int = 8
    token_s: int = 32
    token_z: int = 16
    num_bins: int = 64
    embedder_args: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_EMBEDDER_ARGS))
    msa_args: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_MSA_ARGS))
    pairformer_args: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_PAIRFORMER_ARGS))
    atom_feature_dim: int | None = None
    template_args: dict[str, Any] | None = None
    atoms_per_window_queries: int = 32
    atoms_per_window_keys: int = 128
    fix_sym_check: bool = True
    cyclic_pos_enc: bool = True
    aggregate_distogram: bool = True
    bond_type_feature: bool = True
    use_no_atom_char: bool = False
    use_atom_backbone_feat: bool = False
    use_residue_feats_atoms: bool = False
    conditioning_cutoff_min: float = 4.0
    conditioning_cutoff_max: float = 20.0
    use_templates: bool = False
    use_templates_v2: bool = True
    use_kernels: bool = False
    use_flash_attn: bool = False
    recycling_steps: int = 0

    def __post_init__(self) -> None:
        if self.recycling_steps < 0:
            raise ValueError(f"recycling_steps must be >= 0, got {self.recycling_steps}")
        if self.use_templates and self.template_args is None:
            raise ValueError(
                "use_templates=True needs template_args (TemplateV2Module / "
                "TemplateModule arguments: template_dim, template_blocks, ...)"
            )
        for name in ("embedder_args", "msa_args", "pairformer_args", "template_args"):
            value = getattr(self, name)
            if value is not None:  # Hydra passes DictConfig: keep plain dicts
                object.__setattr__(self, name, {str(k): v for k, v in value.items()})

    def to_dict(self) -> dict[str, Any]:
        """The fields as keyword arguments."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


__all__ = [
    "DEFAULT_EMBEDDER_ARGS",
    "DEFAULT_MSA_ARGS",
    "DEFAULT_PAIRFORMER_ARGS",
    "Boltz2TrunkConfig",
]
