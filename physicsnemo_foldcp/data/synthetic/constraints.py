"""Conditioning and constraints: pocket / contact conditioning and the constraint lists.

* Boltz-1 ``pocket_feature``: the first ligand's chain is the binder, polymer tokens
  within 8 A of it the pocket.
* Boltz-2 contact conditioning: the closest token pair between the first two chains,
  with its atom pairs as a contact constraint.
* Residue constraints (RDKit distance bounds, chirality, stereo bonds, planarity, rings)
  from the ligand graphs; chain constraints (the covalent link, symmetric chains).

List features are ``[k, P]`` long index lists (atom or chain indices) with per-entry
values ``[P]``; they are not padded.
"""

from __future__ import annotations

import torch
from torch import Tensor

from physicsnemo_foldcp.data.synthetic.atoms import AtomLayout
from physicsnemo_foldcp.data.synthetic.geometry import pairwise_to
from physicsnemo_foldcp.data.synthetic.ligands import Ligand
from physicsnemo_foldcp.data.synthetic.structure import Structure
from physicsnemo_foldcp.data.synthetic.tensors import index_list, one_hot
from physicsnemo_foldcp.data.synthetic.tokens import TokenLayout
from physicsnemo_foldcp.data.synthetic.vocab import (
    CONTACT_CONTACT,
    CONTACT_UNSELECTED,
    NUM_CONTACT_CLASSES,
    NUM_POCKET_CLASSES,
    POCKET_BINDER,
    POCKET_POCKET,
    POCKET_UNSELECTED,
)

CONTACT_DISTANCE = 8.0
"""Distance (Angstrom) of the pocket and of the contact threshold."""


def pocket_feature(tokens: TokenLayout, atoms: AtomLayout, structure: Structure) -> Tensor:
    """Boltz-1 ``pocket_feature`` ``[N, 4]`` long one-hot (all zero without a ligand)."""
    pocket = torch.zeros(tokens.n, dtype=torch.long)
    if structure.ligands and tokens.polymer.any():
        i, lig = structure.ligands[0]
        t0 = int(tokens.chain_starts[i])
        binder = tokens.asym == tokens.asym[t0]
        near = pairwise_to(structure.raw[0][atoms.center], lig.pos.float()).amin(1)
        pocket[:] = POCKET_UNSELECTED
        pocket[(near < CONTACT_DISTANCE) & tokens.polymer & tokens.resolved] = POCKET_POCKET
        pocket[binder] = POCKET_BINDER
    return one_hot(pocket, NUM_POCKET_CLASSES, (tokens.n_len,), torch.long)


def _sample_tokens(start: Tensor, stop: Tensor, g: torch.Generator, k: int = 64) -> Tensor:
    """Tokens ``start:stop``, or ``k`` of them drawn without replacement (sorted)."""
    s, e = int(start), int(stop)
    if e - s <= k:
        return torch.arange(s, e)
    return s + torch.randperm(e - s, generator=g)[:k].sort().values


def _contact_pair(
    tokens: TokenLayout, atoms: AtomLayout, structure: Structure, g: torch.Generator
) -> tuple[int, int]:
    """The closest center-atom pair of tokens between chains 0 and 1 (sampled when long)."""
    starts = tokens.chain_starts
    ta = _sample_tokens(starts[0], starts[1], g)
    tb = _sample_tokens(starts[1], starts[2], g)
    centers = structure.raw[0][atoms.center[ta]], structure.raw[0][atoms.center[tb]]
    flat = int(pairwise_to(*centers).argmin())
    return int(ta[flat // len(tb)]), int(tb[flat % len(tb)])


def contact_features(
    tokens: TokenLayout, atoms: AtomLayout, structure: Structure, g: torch.Generator
) -> dict[str, Tensor]:
    """Boltz-2 contact conditioning and contact constraint, from one contact pair.

    Drawn for both presets (the draw keeps their random streams, hence their complexes,
    equal). ``contact_conditioning`` ``[N, N, 5]`` long one-hot, ``contact_threshold``
    ``[N, N]`` float32 (token-padded), ``contact_pair_index`` ``[2, P]`` atom pairs,
    ``contact_union_index`` ``[P]`` long, ``contact_negation_mask`` ``[P]`` bool,
    ``contact_thresholds`` ``[P]`` float32. Without a second chain: no contact.
    """
    n, n_len = tokens.n, tokens.n_len
    cond = torch.zeros(n, n, dtype=torch.long)
    threshold = torch.zeros(n, n, dtype=torch.float32)
    out: dict[str, Tensor] = {
        "contact_pair_index": torch.empty((2, 0), dtype=torch.long),
        "contact_union_index": torch.empty((0,), dtype=torch.long),
        "contact_negation_mask": torch.empty((0,), dtype=torch.bool),
        "contact_thresholds": torch.empty((0,), dtype=torch.float32),
    }
    if len(tokens.chains) >= 2:
        t1, t2 = _contact_pair(tokens, atoms, structure, g)
        cond[:] = CONTACT_UNSELECTED
        for x, y in ((t1, t2), (t2, t1)):
            cond[x, y] = CONTACT_CONTACT
            threshold[x, y] = CONTACT_DISTANCE
        first, count = atoms.start, atoms.counts
        atoms1 = torch.arange(int(first[t1]), int(first[t1] + count[t1]))
        atoms2 = torch.arange(int(first[t2]), int(first[t2] + count[t2]))
        pairs = torch.cartesian_prod(atoms1, atoms2).T
        p = pairs.shape[1]
        out = {
            "contact_pair_index": pairs,
            "contact_union_index": torch.zeros(p, dtype=torch.long),
            "contact_negation_mask": torch.ones(p, dtype=torch.bool),
            "contact_thresholds": torch.full((p,), CONTACT_DISTANCE, dtype=torch.float32),
        }
    out["contact_conditioning"] = one_hot(cond, NUM_CONTACT_CLASSES, (n_len, n_len), torch.long)
    out["contact_threshold"] = tokens.pad(tokens.pad(threshold), 1)
    return out


def _distance_bounds(lig: Ligand, a0: int, rows: dict[str, list]) -> None:
    """Append the ligand's bond (+-0.05 A) and angle (+-0.2 A) distance bounds to ``rows``."""
    nbrs: dict[int, list[int]] = {}
    for a, b, _ in lig.bonds:
        nbrs.setdefault(a, []).append(b)
        nbrs.setdefault(b, []).append(a)
        d = float((lig.pos[a] - lig.pos[b]).norm())
        rows["index"].append((a0 + a, a0 + b))
        rows["bond"].append(True)
        rows["angle"].append(False)
        rows["lo"].append(d - 0.05)
        rows["hi"].append(d + 0.05)
    for center in sorted(nbrs):
        around = sorted(nbrs[center])
        for x in range(len(around)):
            for y in range(x + 1, len(around)):
                a, b = around[x], around[y]
                d = float((lig.pos[a] - lig.pos[b]).norm())
                rows["index"].append((a0 + a, a0 + b))
                rows["bond"].append(False)
                rows["angle"].append(True)
                rows["lo"].append(d - 0.2)
                rows["hi"].append(d + 0.2)


def residue_constraints(
    tokens: TokenLayout, atoms: AtomLayout, structure: Structure
) -> dict[str, Tensor]:
    """The RDKit-style constraint lists of every ligand, in global atom indices.

    ``rdkit_bounds_index`` ``[2, P]`` with its bond / angle masks and bounds,
    ``chiral_atom_index`` ``[4, P]``, ``stereo_bond_index`` ``[4, P]`` (with reference
    masks and orientations), ``planar_bond_index`` ``[6, P]``, ``planar_ring_5_index``
    ``[5, P]``, ``planar_ring_6_index`` ``[6, P]``.
    """
    bounds: dict[str, list] = {"index": [], "bond": [], "angle": [], "lo": [], "hi": []}
    chiral_rows, chiral_r, stereo_rows, stereo_e = [], [], [], []
    planar_rows, ring5_rows, ring6_rows = [], [], []
    for i, lig in structure.ligands:
        a0 = int(atoms.start[int(tokens.chain_starts[i])])
        _distance_bounds(lig, a0, bounds)
        for n0, n1, n2, c, is_r in lig.chiral:
            chiral_rows.append((a0 + n0, a0 + n1, a0 + n2, a0 + c))
            chiral_r.append(is_r)
        for p0, p1, p2, p3, is_e in lig.stereo:
            stereo_rows.append((a0 + p0, a0 + p1, a0 + p2, a0 + p3))
            stereo_e.append(is_e)
        planar_rows += [tuple(a0 + x for x in row) for row in lig.planar]
        ring5_rows += [tuple(a0 + x for x in row) for row in lig.ring5]
        ring6_rows += [tuple(a0 + x for x in row) for row in lig.ring6]
    return {
        "rdkit_bounds_index": index_list(bounds["index"], 2),
        "rdkit_bounds_bond_mask": torch.tensor(bounds["bond"], dtype=torch.bool),
        "rdkit_bounds_angle_mask": torch.tensor(bounds["angle"], dtype=torch.bool),
        "rdkit_upper_bounds": torch.tensor(bounds["hi"], dtype=torch.float32),
        "rdkit_lower_bounds": torch.tensor(bounds["lo"], dtype=torch.float32),
        "chiral_atom_index": index_list(chiral_rows, 4),
        "chiral_reference_mask": torch.ones(len(chiral_rows), dtype=torch.bool),
        "chiral_atom_orientations": torch.tensor(chiral_r, dtype=torch.bool),
        "stereo_bond_index": index_list(stereo_rows, 4),
        "stereo_reference_mask": torch.ones(len(stereo_rows), dtype=torch.bool),
        "stereo_bond_orientations": torch.tensor(stereo_e, dtype=torch.bool),
        "planar_bond_index": index_list(planar_rows, 6),
        "planar_ring_5_index": index_list(ring5_rows, 5),
        "planar_ring_6_index": index_list(ring6_rows, 6),
    }


def chain_constraints(tokens: TokenLayout, structure: Structure) -> dict[str, Tensor]:
    """The chain constraint lists, ``[2, P]`` long each.

    ``connected_chain_index`` / ``connected_atom_index``: the covalent link's chains and
    atoms; ``symmetric_chain_index``: every pair of chains of one entity.
    """
    covalent = structure.covalent
    entity = [c.entity for c in tokens.chains]
    count = len(entity)
    symmetric = [
        (a, b) for a in range(count) for b in range(a + 1, count) if entity[a] == entity[b]
    ]
    return {
        "connected_chain_index": index_list([covalent[:2]] if covalent else [], 2),
        "connected_atom_index": index_list([covalent[2:]] if covalent else [], 2),
        "symmetric_chain_index": index_list(symmetric, 2),
    }
