"""Boltz-1 and Boltz-2 presets: every feature their featurizers emit, with its axes.

Shapes are those of one unbatched sample: N tokens, A atoms, S MSA rows, E conformers, K
distogram conformers, R resolved polymer tokens, T templates, P list entries. Pad values
are 0 except the MSA, whose pad is the gap id 1 (``"-"``).
"""

from __future__ import annotations

import torch

from physicsnemo_foldcp.features.spec import (
    ATOMS,
    ENSEMBLE,
    MSA,
    REPLICATE,
    RSET,
    TEMPLATES,
    TOKENS,
    FeatureSpec,
)

MSA_GAP_ID = 1
"""Boltz's token id of the MSA gap ``"-"``, used to pad the MSA."""

_INDEX_DTYPES = (torch.int64, torch.int32)

ID_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
"""Dtypes of id and one-hot features (``res_type``, ``asym_id``, ``msa``, ...): Boltz's
featurizers emit int64; a floating id or one-hot map is refused."""

COORDINATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Dtypes of coordinate features (``ref_pos``, ``coords``, ...): Boltz's featurizers emit
float32; integer coordinates, and float64 (which the float32 model cannot take), are
refused."""

Dtypes = tuple[torch.dtype, ...] | None


def _token(name: str, extra: int = 0, description: str = "", dtypes: Dtypes = None) -> FeatureSpec:
    return FeatureSpec(name, (TOKENS,) + (None,) * extra, description=description, dtypes=dtypes)


def _atom(name: str, extra: int = 0, description: str = "", dtypes: Dtypes = None) -> FeatureSpec:
    return FeatureSpec(name, (ATOMS,) + (None,) * extra, description=description, dtypes=dtypes)


def _pair(name: str, extra: int = 0, description: str = "", dtypes: Dtypes = None) -> FeatureSpec:
    return FeatureSpec(
        name, (TOKENS, TOKENS) + (None,) * extra, description=description, dtypes=dtypes
    )


def _msa(
    name: str, extra: int = 0, pad: int = 0, description: str = "", dtypes: Dtypes = None
) -> FeatureSpec:
    return FeatureSpec(
        name,
        (MSA, TOKENS) + (None,) * extra,
        pad_value=pad,
        description=description,
        dtypes=dtypes,
    )


def _template(name: str, extra: int = 0, dtypes: Dtypes = None) -> FeatureSpec:
    return FeatureSpec(
        name, (TEMPLATES, TOKENS) + (None,) * extra, description="template", dtypes=dtypes
    )


def _atom_list(name: str, rows: int | None) -> FeatureSpec:
    return FeatureSpec(
        name,
        (None, None) if rows else (None,),
        index_of=ATOMS,
        dtypes=_INDEX_DTYPES,
        mode=REPLICATE,
        description=f"[{rows}, P] atom indices" if rows else "atom indices",
    )


def _list(name: str, ndim: int = 1, description: str = "") -> FeatureSpec:
    return FeatureSpec(name, (None,) * ndim, mode=REPLICATE, description=description)


def _common_token_specs() -> list[FeatureSpec]:
    return [
        _token(
            "token_index",
            description="token position 0..N-1 (relative-position input)",
            dtypes=ID_DTYPES,
        ),
        _token("residue_index", description="residue number within its chain", dtypes=ID_DTYPES),
        _token("asym_id", description="chain id", dtypes=ID_DTYPES),
        _token("entity_id", description="entity id", dtypes=ID_DTYPES),
        _token("sym_id", description="copy id among chains of one entity", dtypes=ID_DTYPES),
        _token("mol_type", description="0 protein, 1 DNA, 2 RNA, 3 non-polymer", dtypes=ID_DTYPES),
        _token("res_type", 1, "one-hot residue type [N, 33]", ID_DTYPES),
        _token("disto_center", 1, "distogram center coordinates [N, 3]", COORDINATE_DTYPES),
        _token("token_pad_mask", description="1 real token, 0 pad"),
        _token("token_resolved_mask", description="1 where the token is resolved"),
        _token("token_disto_mask", description="1 where the distogram target is valid"),
        _token("cyclic_period", description="cyclic chain period, 0 when not cyclic"),
        _token("deletion_mean", description="mean MSA deletion per column"),
        _token("profile", 1, "MSA residue profile [N, 33]"),
        _pair("token_bonds", 1, "token bond flags [N, N, 1]"),
        _pair("token_pair_pad_mask", description="outer product of the token pad mask"),
    ]


def _common_atom_specs() -> list[FeatureSpec]:
    return [
        _atom("ref_pos", 1, "reference conformer coordinates [A, 3]", COORDINATE_DTYPES),
        _atom("ref_element", 1, "one-hot element [A, 128]", ID_DTYPES),
        _atom("ref_charge", description="formal charge"),
        _atom("ref_atom_name_chars", 2, "one-hot atom-name characters [A, 4, 64]", ID_DTYPES),
        _atom("ref_space_uid", description="id of the reference conformer space", dtypes=ID_DTYPES),
        _atom("atom_resolved_mask", description="1 where the atom is resolved"),
        _atom("atom_pad_mask", description="1 real atom, 0 pad"),
        FeatureSpec(
            "coords",
            (ENSEMBLE, ATOMS, None),
            description="coordinates [E, A, 3]",
            dtypes=COORDINATE_DTYPES,
        ),
        FeatureSpec(
            "atom_to_token",
            (ATOMS, TOKENS),
            one_hot=True,
            description="one-hot atom -> token map [A, N]",
        ),
        FeatureSpec(
            "token_to_rep_atom",
            (TOKENS, ATOMS),
            one_hot=True,
            description="one-hot token -> representative atom map [N, A]",
        ),
        FeatureSpec(
            "r_set_to_rep_atom",
            (RSET, ATOMS),
            one_hot=True,
            description="one-hot resolved polymer token -> representative atom [R, A]",
        ),
    ]


def _constraint_specs() -> list[FeatureSpec]:
    return [
        _atom_list("rdkit_bounds_index", 2),
        _list("rdkit_bounds_bond_mask", description="[P] bond-length bounds flag"),
        _list("rdkit_bounds_angle_mask", description="[P] bond-angle bounds flag"),
        _list("rdkit_upper_bounds", description="[P] upper distance bounds"),
        _list("rdkit_lower_bounds", description="[P] lower distance bounds"),
        _atom_list("chiral_atom_index", 4),
        _list("chiral_reference_mask", description="[C]"),
        _list("chiral_atom_orientations", description="[C]"),
        _atom_list("stereo_bond_index", 4),
        _list("stereo_reference_mask", description="[Sb]"),
        _list("stereo_bond_orientations", description="[Sb]"),
        _atom_list("planar_bond_index", 6),
        _atom_list("planar_ring_5_index", 5),
        _atom_list("planar_ring_6_index", 6),
        FeatureSpec(
            "connected_chain_index",
            (None, None),
            index_of="chains",
            mode=REPLICATE,
            dtypes=_INDEX_DTYPES,
            description="[2, P] chain ids of covalent links",
        ),
        _atom_list("connected_atom_index", 2),
        FeatureSpec(
            "symmetric_chain_index",
            (None, None),
            index_of="chains",
            mode=REPLICATE,
            dtypes=_INDEX_DTYPES,
            description="[2, P] chain ids of symmetric chains",
        ),
    ]


def boltz1_specs() -> list[FeatureSpec]:
    """Every feature of the Boltz-1 featurizer."""
    return [
        *_common_token_specs(),
        _token("pocket_feature", 1, "one-hot pocket conditioning [N, 4]", ID_DTYPES),
        *_common_atom_specs(),
        _pair("disto_target", 1, "one-hot distogram target [N, N, 64]"),
        FeatureSpec(
            "frames_idx",
            (TOKENS, None),
            index_of=ATOMS,
            dtypes=_INDEX_DTYPES,
            description="frame atoms [N, 3] (atom indices)",
        ),
        _token("frame_resolved_mask", description="1 where the frame is resolved"),
        _msa("msa", 1, pad=MSA_GAP_ID, description="one-hot MSA [S, N, 33]", dtypes=ID_DTYPES),
        _msa("msa_paired"),
        _msa("deletion_value"),
        _msa("has_deletion"),
        _msa("msa_mask"),
        *_constraint_specs(),
    ]


def boltz2_specs() -> list[FeatureSpec]:
    """Every feature of the Boltz-2 featurizer (training and inference)."""
    return [
        *_common_token_specs(),
        _token("method_feature", description="experimental method id", dtypes=ID_DTYPES),
        _token("modified", description="1 for a modified residue"),
        _token("affinity_token_mask", description="1 for tokens of the affinity ligand"),
        _pair("type_bonds", description="bond type ids [N, N]", dtypes=ID_DTYPES),
        _pair("contact_conditioning", 1, "one-hot contact conditioning [N, N, 5]", ID_DTYPES),
        _pair("contact_threshold", description="contact distance thresholds [N, N]"),
        _pair("disto_target", 2, "one-hot distogram target [N, N, K, 64]"),
        *_common_atom_specs(),
        _atom("ref_chirality", description="chirality id", dtypes=ID_DTYPES),
        _atom("atom_backbone_feat", 1, "one-hot backbone atom type [A, 17]", ID_DTYPES),
        _atom("bfactor", description="B-factor", dtypes=COORDINATE_DTYPES),
        _atom("plddt", description="pLDDT", dtypes=COORDINATE_DTYPES),
        FeatureSpec(
            "token_to_center_atom",
            (TOKENS, ATOMS),
            one_hot=True,
            description="one-hot token -> center atom map [N, A]",
        ),
        FeatureSpec(
            "disto_coords_ensemble",
            (ENSEMBLE, TOKENS, None),
            description="distogram centers per conformer [K, N, 3]",
            dtypes=COORDINATE_DTYPES,
        ),
        FeatureSpec(
            "frames_idx",
            (ENSEMBLE, TOKENS, None),
            index_of=ATOMS,
            dtypes=_INDEX_DTYPES,
            description="frame atoms [E, N, 3] (atom indices)",
        ),
        FeatureSpec(
            "frame_resolved_mask",
            (ENSEMBLE, TOKENS),
            description="1 where the frame is resolved [E, N]",
        ),
        FeatureSpec(
            "ensemble_ref_idxs",
            (None,),
            index_of=ENSEMBLE,
            mode=REPLICATE,
            dtypes=_INDEX_DTYPES,
            description="[K] conformers used for the distogram (their ids, >= 0)",
        ),
        _msa("msa", pad=MSA_GAP_ID, description="MSA residue ids [S, N]", dtypes=ID_DTYPES),
        _msa("msa_paired"),
        _msa("deletion_value"),
        _msa("has_deletion"),
        _msa("msa_mask"),
        _template("template_restype", 1, ID_DTYPES),
        _template("template_frame_rot", 2, COORDINATE_DTYPES),
        _template("template_frame_t", 1, COORDINATE_DTYPES),
        _template("template_cb", 1, COORDINATE_DTYPES),
        _template("template_ca", 1, COORDINATE_DTYPES),
        _template("template_mask_cb"),
        _template("template_mask_frame"),
        _template("template_mask"),
        _template("query_to_template"),
        _template("visibility_ids"),
        *_constraint_specs(),
        _atom_list("contact_pair_index", 2),
        _list("contact_union_index", description="[P] id of the contact union"),
        _list("contact_negation_mask", description="[P]"),
        _list("contact_thresholds", description="[P]"),
    ]
