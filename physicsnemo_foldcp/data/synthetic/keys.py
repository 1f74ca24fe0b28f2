"""The feature keys each preset emits: Boltz-1's and Boltz-2's featurizer outputs.

The keys are grouped by feature family; :data:`PRESET_KEYS` is what
:func:`~physicsnemo_foldcp.data.synthetic.make_complex` returns per preset (its tests
compare the two).
"""

from __future__ import annotations

_TOKEN_KEYS_COMMON = (
    "token_index", "residue_index", "asym_id", "entity_id", "sym_id", "mol_type", "res_type",
    "disto_center", "token_bonds", "token_pad_mask", "token_resolved_mask", "token_disto_mask",
    "cyclic_period",
)  # fmt: skip
_ATOM_KEYS_COMMON = (
    "ref_pos", "atom_resolved_mask", "ref_element", "ref_charge", "ref_atom_name_chars",
    "ref_space_uid", "coords", "atom_pad_mask", "atom_to_token", "token_to_rep_atom",
    "r_set_to_rep_atom", "disto_target", "frames_idx", "frame_resolved_mask",
)  # fmt: skip
_MSA_KEYS = (
    "msa", "msa_paired", "deletion_value", "has_deletion", "deletion_mean", "profile",
    "msa_mask",
)  # fmt: skip
_RESIDUE_CONSTRAINT_KEYS = (
    "rdkit_bounds_index", "rdkit_bounds_bond_mask", "rdkit_bounds_angle_mask",
    "rdkit_upper_bounds", "rdkit_lower_bounds", "chiral_atom_index", "chiral_reference_mask",
    "chiral_atom_orientations", "stereo_bond_index", "stereo_reference_mask",
    "stereo_bond_orientations", "planar_bond_index", "planar_ring_5_index",
    "planar_ring_6_index",
)  # fmt: skip
_CHAIN_CONSTRAINT_KEYS = ("connected_chain_index", "connected_atom_index", "symmetric_chain_index")
_CONTACT_CONSTRAINT_KEYS = (
    "contact_pair_index", "contact_union_index", "contact_negation_mask", "contact_thresholds",
)  # fmt: skip
_TEMPLATE_KEYS = (
    "template_restype", "template_frame_rot", "template_frame_t", "template_cb", "template_ca",
    "template_mask_cb", "template_mask_frame", "template_mask", "query_to_template",
    "visibility_ids",
)  # fmt: skip
_BOLTZ2_ONLY_TOKEN_KEYS = (
    "type_bonds", "contact_conditioning", "contact_threshold", "method_feature", "modified",
    "affinity_token_mask",
)  # fmt: skip
_BOLTZ2_ONLY_ATOM_KEYS = (
    "ref_chirality", "atom_backbone_feat", "token_to_center_atom", "disto_coords_ensemble",
    "bfactor", "plddt",
)  # fmt: skip

PRESET_KEYS: dict[str, frozenset[str]] = {
    "boltz1": frozenset(
        (
            *_TOKEN_KEYS_COMMON,
            "pocket_feature",
            *_ATOM_KEYS_COMMON,
            *_MSA_KEYS,
            *_RESIDUE_CONSTRAINT_KEYS,
            *_CHAIN_CONSTRAINT_KEYS,
        )
    ),
    "boltz2": frozenset(
        (
            *_TOKEN_KEYS_COMMON,
            *_BOLTZ2_ONLY_TOKEN_KEYS,
            *_ATOM_KEYS_COMMON,
            *_BOLTZ2_ONLY_ATOM_KEYS,
            *_MSA_KEYS,
            *_TEMPLATE_KEYS,
            "ensemble_ref_idxs",
            *_RESIDUE_CONSTRAINT_KEYS,
            *_CHAIN_CONSTRAINT_KEYS,
            *_CONTACT_CONSTRAINT_KEYS,
        )
    ),
}
"""Exactly the keys :func:`~physicsnemo_foldcp.data.synthetic.make_complex` returns per preset."""
