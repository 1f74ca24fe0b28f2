"""Assembly: :func:`make_complex` draws one complex and emits every feature family.

The order of the stages is the order of the random stream (chains, token resolution,
coordinates, MSA, contact, B-factors, reference conformers); each stage lives in its own
module and returns its features, which this module merges and sorts by key.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from physicsnemo_foldcp.data.synthetic.atoms import (
    atom_features,
    atom_token_maps,
    build_atoms,
    draw_bfactor,
    reference_conformers,
)
from physicsnemo_foldcp.data.synthetic.chains import kind_counts, plan_chains
from physicsnemo_foldcp.data.synthetic.constraints import (
    chain_constraints,
    contact_features,
    pocket_feature,
    residue_constraints,
)
from physicsnemo_foldcp.data.synthetic.frames import frame_features
from physicsnemo_foldcp.data.synthetic.keys import PRESET_KEYS
from physicsnemo_foldcp.data.synthetic.msa import msa_features
from physicsnemo_foldcp.data.synthetic.pairs import bond_features, distogram_features
from physicsnemo_foldcp.data.synthetic.residues import residue_tables
from physicsnemo_foldcp.data.synthetic.structure import build_structure
from physicsnemo_foldcp.data.synthetic.templates import dummy_templates
from physicsnemo_foldcp.data.synthetic.tokens import build_tokens, token_features


def _check_arguments(
    n_tokens: int,
    preset: str,
    msa_rows: int,
    n_conformers: int,
    n_templates: int,
    atom_multiple: int | None,
    max_tokens: int | None,
) -> None:
    """Raise ``ValueError`` naming the first argument out of range."""
    if preset not in PRESET_KEYS:
        raise ValueError(f"unknown preset {preset!r}; use one of {sorted(PRESET_KEYS)}")
    if n_tokens < 1 or msa_rows < 1 or n_conformers < 1 or n_templates < 1:
        raise ValueError("n_tokens, msa_rows, n_conformers and n_templates must be >= 1")
    if atom_multiple is not None and atom_multiple < 1:
        raise ValueError("atom_multiple must be >= 1")
    if max_tokens is not None and max_tokens < n_tokens:
        raise ValueError(f"max_tokens={max_tokens} is smaller than n_tokens={n_tokens}")


def make_complex(
    n_tokens: int,
    *,
    seed: int = 0,
    preset: str = "boltz2",
    msa_rows: int = 8,
    n_conformers: int = 1,
    n_templates: int = 1,
    composition: Mapping[str, float] | None = None,
    atom_multiple: int | None = None,
    max_tokens: int | None = None,
) -> dict[str, Tensor]:
    """Build the Boltz feature dict of one random complex with ``n_tokens`` tokens.

    Parameters
    ----------
    n_tokens : int
        Number of real tokens ``N`` (residues plus ligand heavy atoms), ``>= 1``.
    seed : int, optional
        Seed of the local generator; equal arguments give identical tensors.
    preset : {"boltz2", "boltz1"}, optional
        Which featurizer's output to mimic; :data:`PRESET_KEYS` lists the keys of each.
    msa_rows : int, optional
        MSA depth ``S``; row 0 is the query sequence.
    n_conformers : int, optional
        Conformers ``E`` in ``coords``; for ``"boltz2"`` also ``K``, the distogram
        ensemble (``ensemble_ref_idxs = arange(E)``). Boltz-1 itself always has ``E = 1``;
        its frames and distogram use conformer 0.
    n_templates : int, optional
        Templates ``T`` (``"boltz2"`` only): all-zero dummy templates, as Boltz-2 emits at
        inference without template inputs.
    composition : Mapping[str, float], optional
        Relative token fractions of ``"protein"``, ``"dna"``, ``"rna"``, ``"ligand"``;
        default 0.7 / 0.1 / 0.1 / 0.1.
    atom_multiple : int, optional
        Pad the atom axis with pad atoms to a multiple of this (Boltz uses 32).
    max_tokens : int, optional
        Pad the token axis with pad tokens to this length (``>= n_tokens``).

    Returns
    -------
    dict[str, torch.Tensor]
        ``N`` is the (padded) token count, ``A`` the (padded) atom count, ``S`` the MSA
        depth, ``E`` / ``K`` the conformers, ``T`` the templates, ``R`` the resolved
        polymer tokens plus ``N - n_tokens``:

        * tokens ``[N]``: ``token_index``, ``residue_index``, ``asym_id``, ``entity_id``,
          ``sym_id`` (chain-level ids), ``mol_type`` (long); ``token_pad_mask``,
          ``token_resolved_mask``, ``token_disto_mask``, ``deletion_mean`` (float32);
          ``cyclic_period`` (int32 boltz1, float32 boltz2); boltz2 ``method_feature``,
          ``modified`` (long), ``affinity_token_mask`` (float32).
        * ``res_type`` ``[N, 33]`` long one-hot, ``profile`` ``[N, 33]`` float32,
          ``disto_center`` ``[N, 3]`` float32, boltz1 ``pocket_feature`` ``[N, 4]`` long.
        * pairs: ``token_bonds`` ``[N, N, 1]`` float32; ``disto_target`` ``[N, N, 64]``
          long (boltz1) or ``[N, N, K, 64]`` float32 (boltz2); boltz2 ``type_bonds``
          ``[N, N]`` long, ``contact_conditioning`` ``[N, N, 5]`` long,
          ``contact_threshold`` ``[N, N]`` float32.
        * atoms: ``ref_pos`` ``[A, 3]`` float32, ``ref_element`` ``[A, 128]`` long,
          ``ref_atom_name_chars`` ``[A, 4, 64]`` long, ``ref_charge`` ``[A]`` (int8 boltz1,
          float32 boltz2), ``ref_space_uid`` ``[A]`` long, ``atom_resolved_mask`` ``[A]``
          bool, ``atom_pad_mask`` ``[A]`` float32; boltz2 ``ref_chirality`` ``[A]`` long,
          ``atom_backbone_feat`` ``[A, 17]`` long, ``bfactor``, ``plddt`` ``[A]`` float32.
        * ``coords`` ``[E, A, 3]`` float32; one-hot long maps ``atom_to_token`` ``[A, N]``,
          ``token_to_rep_atom`` ``[N, A]``, ``r_set_to_rep_atom`` ``[R, A]``; boltz2
          ``token_to_center_atom`` ``[N, A]`` long, ``disto_coords_ensemble``
          ``[K, N, 3]`` float32, ``ensemble_ref_idxs`` ``[K]`` long (ensemble indices).
        * ``frames_idx`` long atom indices, ``[N, 3]`` (boltz1) or ``[E, N, 3]``
          (boltz2); ``frame_resolved_mask`` bool ``[N]`` or ``[E, N]``.
        * MSA ``[S, N]``: ``msa`` (boltz1 ``[S, N, 33]`` one-hot) and ``msa_mask`` long,
          ``msa_paired``, ``deletion_value`` float32, ``has_deletion`` bool.
        * boltz2 dummy templates: ``template_restype`` ``[T, N, 33]`` long one-hot,
          ``template_frame_rot`` ``[T, N, 3, 3]``, ``template_frame_t``, ``template_cb``,
          ``template_ca`` ``[T, N, 3]``, ``template_mask_cb``, ``template_mask_frame``,
          ``template_mask``, ``visibility_ids`` ``[T, N]`` float32, ``query_to_template``
          ``[T, N]`` long.
        * constraint lists, long ``[k, P]`` with ``P`` entries: ``rdkit_bounds_index``
          ``[2, P]``, ``chiral_atom_index`` ``[4, P]``, ``stereo_bond_index`` ``[4, P]``,
          ``planar_bond_index`` ``[6, P]``, ``planar_ring_5_index`` ``[5, P]``,
          ``planar_ring_6_index`` ``[6, P]``, ``connected_atom_index`` ``[2, P]`` and
          boltz2 ``contact_pair_index`` ``[2, P]`` hold atom indices;
          ``connected_chain_index`` and ``symmetric_chain_index`` ``[2, P]`` hold chain
          ids (``asym_id``). Per-entry values ``[P]``: ``rdkit_bounds_bond_mask``,
          ``rdkit_bounds_angle_mask``, ``chiral_reference_mask``,
          ``chiral_atom_orientations``, ``stereo_reference_mask``,
          ``stereo_bond_orientations``, ``contact_negation_mask`` (bool);
          ``rdkit_upper_bounds``, ``rdkit_lower_bounds``, ``contact_thresholds``
          (float32); ``contact_union_index`` (long).

    Raises
    ------
    ValueError
        On an unknown preset or composition kind, or out-of-range sizes.
    """
    _check_arguments(
        n_tokens, preset, msa_rows, n_conformers, n_templates, atom_multiple, max_tokens
    )
    v2 = preset == "boltz2"
    tables = residue_tables()
    g = torch.Generator().manual_seed(int(seed))
    chains = plan_chains(kind_counts(n_tokens, composition), g)
    tokens = build_tokens(chains, tables, n_tokens if max_tokens is None else max_tokens, g)
    atoms = build_atoms(tokens, tables, atom_multiple)
    structure = build_structure(tokens, atoms, tables, n_conformers, g)
    out: dict[str, Tensor] = {
        **token_features(tokens, v2),
        **bond_features(tokens, atoms, structure, v2),
        **distogram_features(tokens, atoms, structure, v2),
        **frame_features(tokens, atoms, tables, structure, v2),
        **atom_token_maps(tokens, atoms, v2),
        "coords": atoms.pad(structure.coords, 1),
        **msa_features(tokens, msa_rows, v2, g),
    }
    contact = contact_features(tokens, atoms, structure, g)
    if v2:
        out.update(contact)
        out["ensemble_ref_idxs"] = torch.arange(n_conformers)
        out.update(dummy_templates(n_templates, tokens.n_len))
    else:
        out["pocket_feature"] = pocket_feature(tokens, atoms, structure)
    out.update(residue_constraints(tokens, atoms, structure))
    out.update(chain_constraints(tokens, structure))
    bfactor = draw_bfactor(atoms, g)
    ref_pos, ref_space_uid = reference_conformers(tokens, atoms, tables, structure.ligands, v2, g)
    out.update(atom_features(atoms, ref_pos, ref_space_uid, bfactor, v2))
    return {k: out[k].contiguous() for k in sorted(out)}
