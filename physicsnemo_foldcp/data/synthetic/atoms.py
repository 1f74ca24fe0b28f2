"""Atoms: the per-atom layout of a complex, its reference conformers and atom features.

The atoms of a token are contiguous on the atom axis, in token order (what lets the
sharding keep atoms with their tokens). :func:`build_atoms` reads the residue tables;
:func:`atom_token_maps` builds Boltz's one-hot atom<->token maps; :func:`reference_conformers`
draws the RDKit-like reference positions; :func:`atom_features` emits the ``[A, ...]``
features, padded to a multiple of ``atom_multiple``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from physicsnemo_foldcp.data.synthetic.geometry import random_rotations
from physicsnemo_foldcp.data.synthetic.ligands import Ligand
from physicsnemo_foldcp.data.synthetic.residues import ResidueTables
from physicsnemo_foldcp.data.synthetic.tensors import one_hot, pad
from physicsnemo_foldcp.data.synthetic.tokens import TokenLayout
from physicsnemo_foldcp.data.synthetic.vocab import (
    NUM_BACKBONE_CLASSES,
    NUM_ELEMENTS,
    NUM_NAME_CHARS,
)


@dataclass
class AtomLayout:
    """The atom axis of a complex: ``n_atoms`` real atoms, padded to ``a_len``.

    Attributes
    ----------
    counts, start : torch.Tensor
        ``[N]`` atoms per token and the token's first atom.
    token, type, local : torch.Tensor
        ``[A]`` token of each atom, its residue-table row and its index inside the residue.
    name_chars : torch.Tensor
        ``[A, 4]`` atom-name character codes.
    element, charge, backbone, chirality : torch.Tensor
        ``[A]`` long classes (the ligand atoms' are set when ligands are placed).
    resolved : torch.Tensor
        ``[A]`` bool: the atom's token is resolved.
    center, disto : torch.Tensor
        ``[N]`` global index of each token's center and distogram atom.
    """

    n_atoms: int
    a_len: int
    counts: Tensor
    start: Tensor
    token: Tensor
    type: Tensor
    local: Tensor
    name_chars: Tensor
    element: Tensor
    charge: Tensor
    backbone: Tensor
    chirality: Tensor
    resolved: Tensor
    center: Tensor
    disto: Tensor

    def pad(self, x: Tensor, dim: int = 0) -> Tensor:
        """Right-pad ``x``'s atom axis ``dim`` from ``n_atoms`` to ``a_len`` with 0."""
        return pad(x, dim, self.a_len)


def build_atoms(
    tokens: TokenLayout, tables: ResidueTables, atom_multiple: int | None
) -> AtomLayout:
    """Expand the tokens into their atoms (no random draws)."""
    types = tokens.types
    counts = tables.n_atoms[types]
    start = counts.cumsum(0) - counts
    n_atoms = int(counts.sum())
    token = torch.repeat_interleave(torch.arange(tokens.n), counts)
    kind = types[token]
    local = torch.arange(n_atoms) - start[token]
    a_len = n_atoms if atom_multiple is None else -(-n_atoms // atom_multiple) * atom_multiple
    return AtomLayout(
        n_atoms=n_atoms,
        a_len=a_len,
        counts=counts,
        start=start,
        token=token,
        type=kind,
        local=local,
        name_chars=tables.name_chars[kind, local],
        element=tables.element[kind, local],
        charge=tables.charge[kind, local],
        backbone=tables.backbone[kind, local],
        chirality=tables.chirality[kind, local],
        resolved=tokens.resolved[token],
        center=start + tables.center_local[types],
        disto=start + tables.disto_local[types],
    )


def atom_token_maps(tokens: TokenLayout, atoms: AtomLayout, v2: bool) -> dict[str, Tensor]:
    """Boltz's one-hot long maps, padded.

    ``atom_to_token`` ``[A, N]``, ``token_to_rep_atom`` ``[N, A]`` (the distogram atom),
    ``r_set_to_rep_atom`` ``[R, A]`` (center atoms of resolved polymer tokens, plus
    ``N_len - N`` zero rows as Boltz pads it like a token axis) and, boltz2,
    ``token_to_center_atom`` ``[N, A]``.
    """
    n_len, a_len = tokens.n_len, atoms.a_len
    r_set = atoms.center[tokens.polymer & tokens.resolved]
    out = {
        "atom_to_token": one_hot(atoms.token, n_len, (a_len,), torch.long),
        "token_to_rep_atom": one_hot(atoms.disto, a_len, (n_len,), torch.long),
        "r_set_to_rep_atom": one_hot(r_set, a_len, (len(r_set) + n_len - tokens.n,), torch.long),
    }
    if v2:
        out["token_to_center_atom"] = one_hot(atoms.center, a_len, (n_len,), torch.long)
    return out


def reference_conformers(
    tokens: TokenLayout,
    atoms: AtomLayout,
    tables: ResidueTables,
    ligands: list[tuple[int, Ligand]],
    v2: bool,
    g: torch.Generator,
) -> tuple[Tensor, Tensor]:
    """Reference positions ``[A, 3]`` float32 and ``ref_space_uid`` ``[A]`` (unpadded).

    Each residue's ideal conformer (each ligand's own positions), centered; boltz2 moves
    every residue by its own random rotation and shift, boltz1 the whole complex by one.
    """
    n = tokens.n
    asym, resid = tokens.asym, tokens.resid
    new_res = torch.ones(n, dtype=torch.bool)
    new_res[1:] = (asym[1:] != asym[:-1]) | (resid[1:] != resid[:-1])
    tok_uid = new_res.long().cumsum(0) - 1
    atom_uid = tok_uid[atoms.token]
    n_uid = int(tok_uid[-1]) + 1
    ref_local = (tables.ideal[atoms.type, atoms.local] - tables.ideal_centroid[atoms.type]).double()
    for i, lig in ligands:
        a0 = int(atoms.start[int(tokens.chain_starts[i])])
        ref_local[a0 : a0 + len(lig.names)] = lig.pos - lig.pos.mean(0)
    if v2:
        uid_rot = random_rotations(n_uid, g).double()
        uid_shift = torch.randn(n_uid, 3, generator=g, dtype=torch.float64)
        ref_pos = torch.einsum("aij,aj->ai", uid_rot[atom_uid], ref_local) + uid_shift[atom_uid]
    else:
        glob_rot = random_rotations(1, g)[0].double()
        glob_shift = torch.randn(3, generator=g, dtype=torch.float64)
        ref_pos = ref_local @ glob_rot.T + glob_shift
    return ref_pos.float(), atom_uid


def draw_bfactor(atoms: AtomLayout, g: torch.Generator) -> Tensor:
    """``[A]`` float32 B-factors: uniform in ``[15, 60)`` on resolved atoms, 0 elsewhere."""
    return torch.where(
        atoms.resolved, 15.0 + 45.0 * torch.rand(atoms.n_atoms, generator=g), torch.zeros(())
    )


def atom_features(
    atoms: AtomLayout, ref_pos: Tensor, ref_space_uid: Tensor, bfactor: Tensor, v2: bool
) -> dict[str, Tensor]:
    """The per-atom features, padded with 0 to ``a_len``.

    ``ref_pos`` ``[A, 3]``, ``atom_resolved_mask`` ``[A]`` bool, ``ref_element`` ``[A, 128]``,
    ``ref_atom_name_chars`` ``[A, 4, 64]``, ``ref_space_uid``, ``atom_pad_mask``,
    ``ref_charge`` (int8 boltz1, float32 boltz2); boltz2 also ``ref_chirality``,
    ``atom_backbone_feat`` ``[A, 17]``, ``bfactor`` and ``plddt``.
    """
    a_len, pad_atoms = atoms.a_len, atoms.pad
    out = {
        "ref_pos": pad_atoms(ref_pos),
        "atom_resolved_mask": pad_atoms(atoms.resolved),
        "ref_element": one_hot(atoms.element, NUM_ELEMENTS, (a_len,), torch.long),
        "ref_atom_name_chars": one_hot(
            atoms.name_chars % NUM_NAME_CHARS, NUM_NAME_CHARS, (a_len, 4), torch.long
        ),
        "ref_space_uid": pad_atoms(ref_space_uid),
        "atom_pad_mask": pad_atoms(torch.ones(atoms.n_atoms, dtype=torch.float32)),
    }
    if not v2:
        out["ref_charge"] = pad_atoms(atoms.charge.to(torch.int8))
        return out
    out.update(
        {
            "ref_charge": pad_atoms(atoms.charge.float()),
            "ref_chirality": pad_atoms(atoms.chirality),
            "atom_backbone_feat": one_hot(
                atoms.backbone, NUM_BACKBONE_CLASSES, (a_len,), torch.long
            ),
            "bfactor": pad_atoms(bfactor),
            "plddt": pad_atoms(torch.ones(atoms.n_atoms, dtype=torch.float32)),
        }
    )
    return out
