"""Hyperparameters of Boltz-2's trunk and of the whole Boltz-2 model.

:class:`Boltz2TrunkConfig` configures
:class:`~physicsnemo_foldcp.models.boltz2_trunk.Boltz2Trunk`; :class:`Boltz2Config` adds
what :class:`~physicsnemo_foldcp.models.boltz2.Boltz2Model` holds past the trunk
(diffusion conditioning, the structure module, the confidence and B-factor heads) and
Boltz's prediction-time settings. Kept apart from the models so that the Hydra schemas
(``model/boltz2_trunk_schema``, ``model/boltz2_schema``) are registered without importing
``boltz``, an optional extra.
"""

from __future__ import annotations

import dataclasses
import math
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


#: Integer widths and counts of :class:`Boltz2TrunkConfig` (each must be >= 1).
SIZE_FIELDS = (
    "atom_s",
    "atom_z",
    "token_s",
    "token_z",
    "num_bins",
    "atoms_per_window_queries",
    "atoms_per_window_keys",
)


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
        for name in SIZE_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"model.{name}={value!r} is out of range: it must be an integer >= 1"
                )
        low, high = self.conditioning_cutoff_min, self.conditioning_cutoff_max
        if not (math.isfinite(low) and math.isfinite(high) and 0 <= low < high):
            raise ValueError(
                f"model.conditioning_cutoff_min={low}, conditioning_cutoff_max={high}: they "
                "must be finite with 0 <= min < max"
            )
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


#: Small defaults of ``score_model_args`` (Boltz's ``DiffusionModule`` and
#: ``DiffusionConditioning`` depths and heads).
DEFAULT_SCORE_MODEL_ARGS: dict[str, Any] = {
    "atom_encoder_depth": 1,
    "atom_encoder_heads": 2,
    "token_transformer_depth": 2,
    "token_transformer_heads": 2,
    "atom_decoder_depth": 1,
    "atom_decoder_heads": 2,
    "conditioning_transition_layers": 1,
    "dim_fourier": 32,
}
#: ``diffusion_process_args`` as ``boltz predict`` sets them for Boltz-2
#: (``boltz.main.Boltz2DiffusionParams``).
BOLTZ2_PREDICT_DIFFUSION_ARGS: dict[str, Any] = {
    "gamma_0": 0.8,
    "gamma_min": 1.0,
    "noise_scale": 1.003,
    "rho": 7,
    "step_scale": 1.5,
    "sigma_min": 0.0001,
    "sigma_max": 160.0,
    "sigma_data": 16.0,
    "P_mean": -1.2,
    "P_std": 1.5,
    "coordinate_augmentation": True,
    "alignment_reverse_diff": True,
    "synchronize_sigmas": True,
}
#: Small defaults of ``confidence_model_args`` (Boltz's ``ConfidenceModule``), with
#: Boltz-2's flags on.
DEFAULT_CONFIDENCE_MODEL_ARGS: dict[str, Any] = {
    "pairformer_args": {
        "num_blocks": 1,
        "num_heads": 2,
        "dropout": 0.0,
        "pairwise_head_width": 8,
        "pairwise_num_heads": 2,
    },
    "num_dist_bins": 64,
    "max_dist": 22,
    "add_s_to_z_prod": True,
    "add_s_input_to_s": True,
    "add_z_input_to_z": True,
    "confidence_args": {"num_plddt_bins": 50, "num_pde_bins": 64, "num_pae_bins": 64},
}
#: ``predict_args`` (Boltz's names): a quick CPU prediction of two samples.
DEFAULT_PREDICT_ARGS: dict[str, Any] = {
    "recycling_steps": 0,
    "sampling_steps": 3,
    "diffusion_samples": 2,
    "max_parallel_samples": None,
    "write_confidence_summary": True,
    "write_full_pae": True,
    "write_full_pde": True,
}
#: ``steering_args`` with every potential off (steering is not distributed).
NO_STEERING_ARGS: dict[str, Any] = {
    "fk_steering": False,
    "num_particles": 1,
    "fk_lambda": 0.0,
    "fk_resampling_interval": 1,
    "physical_guidance_update": False,
    "contact_guidance_update": False,
    "num_gd_steps": 1,
}


def _plain(value: Any) -> Any:
    """Nested plain dicts (and lists) of a Hydra ``DictConfig`` / ``ListConfig``."""
    if hasattr(value, "items"):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig":
        return [_plain(v) for v in value]
    return value


@dataclass(frozen=True)
class Boltz2Config(Boltz2TrunkConfig):
    """``Boltz2.__init__``'s arguments for prediction (same names), small by default.

    The trunk's fields are :class:`Boltz2TrunkConfig`'s; these are the rest.

    Attributes
    ----------
    score_model_args : dict
        Depths and heads of the diffusion module and its conditioning
        (``atom_encoder_depth``, ``token_transformer_depth``, ``dim_fourier``...).
    diffusion_process_args : dict
        ``AtomDiffusion`` arguments (noise schedule, step scale, augmentation); the
        defaults are those ``boltz predict`` uses for Boltz-2.
    confidence_prediction : bool
        Build and run the confidence module (pLDDT, PDE, PAE, resolved; ptm / iptm).
    confidence_model_args : dict
        ``ConfidenceModule`` arguments (its Pairformer, bins, ``add_*`` flags).
    token_level_confidence : bool
        Per-token (not per-atom) pLDDT and resolved heads, as Boltz-2.
    alpha_pae : float
        Above 0, the PAE head's outputs (``pae``, complex and chain PAE) are predicted.
    predict_bfactor : bool
        Build the B-factor head ``bfactor_module``.
    predict_args : dict
        Boltz's prediction settings: ``recycling_steps``, ``sampling_steps``,
        ``diffusion_samples``, ``max_parallel_samples``, ``write_full_pae``,
        ``write_full_pde``, ``write_confidence_summary``.
    steering_args : dict
        Boltz's steering settings; every potential must stay off (steering is not
        distributed).
    affinity_prediction : bool
        Must stay False: the affinity module is not distributed.
    """

    score_model_args: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_SCORE_MODEL_ARGS))
    diffusion_process_args: dict[str, Any] = field(
        default_factory=lambda: dict(BOLTZ2_PREDICT_DIFFUSION_ARGS)
    )
    confidence_prediction: bool = True
    confidence_model_args: dict[str, Any] = field(
        default_factory=lambda: _plain(DEFAULT_CONFIDENCE_MODEL_ARGS)
    )
    token_level_confidence: bool = True
    alpha_pae: float = 1.0
    predict_bfactor: bool = True
    predict_args: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_PREDICT_ARGS))
    steering_args: dict[str, Any] = field(default_factory=lambda: dict(NO_STEERING_ARGS))
    affinity_prediction: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in (
            "score_model_args",
            "diffusion_process_args",
            "confidence_model_args",
            "predict_args",
            "steering_args",
        ):
            object.__setattr__(self, name, _plain(getattr(self, name)))
        predict = {**DEFAULT_PREDICT_ARGS, **self.predict_args}
        object.__setattr__(self, "predict_args", predict)
        for key in ("sampling_steps", "diffusion_samples"):
            if int(predict[key]) < 1:
                raise ValueError(f"predict_args.{key} must be >= 1, got {predict[key]}")
        if int(predict["recycling_steps"]) < 0:
            raise ValueError(
                f"predict_args.recycling_steps must be >= 0, got {predict['recycling_steps']}"
            )
        parallel = predict["max_parallel_samples"]
        if parallel is not None and int(parallel) < 1:
            raise ValueError(f"predict_args.max_parallel_samples must be >= 1, got {parallel}")


__all__ = [
    "BOLTZ2_PREDICT_DIFFUSION_ARGS",
    "DEFAULT_CONFIDENCE_MODEL_ARGS",
    "DEFAULT_EMBEDDER_ARGS",
    "DEFAULT_MSA_ARGS",
    "DEFAULT_PAIRFORMER_ARGS",
    "DEFAULT_PREDICT_ARGS",
    "DEFAULT_SCORE_MODEL_ARGS",
    "NO_STEERING_ARGS",
    "Boltz2Config",
    "Boltz2TrunkConfig",
]
