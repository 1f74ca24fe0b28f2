"""Residue chemistry: heavy atoms of the standard residues and their per-type tables.

:func:`residue_tables` gives, per residue type (the 28 standard residues, then one
ligand-atom row), the atom count, token id, atom names, elements, charges, backbone and
chirality classes, one fixed reference conformer, and the local indices of the center,
distogram and frame atoms. It draws from its own fixed-seed generator, so the tables are
the same in every call and never consume the complex's random stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

from physicsnemo_foldcp.data.synthetic.geometry import in_plane, perpendicular, unit
from physicsnemo_foldcp.data.synthetic.vocab import (
    AMINO_ACIDS,
    CHI_CCW,
    CHI_CW,
    DNA,
    RNA,
    TOKEN_IDS,
    UNK,
)

BACKBONE_PROTEIN = ("N", "CA", "C", "O")
BACKBONE_NUCLEIC = (
    "P", "OP1", "OP2", "O5'", "C5'", "C4'", "O4'", "C3'", "O3'", "C2'", "O2'", "C1'",
)  # fmt: skip

_RIBOSE = ("P", "OP1", "OP2", "O5'", "C5'", "C4'", "O4'", "C3'", "O3'", "C2'", "O2'", "C1'")
_DEOXYRIBOSE = tuple(name for name in _RIBOSE if name != "O2'")
_BASES: dict[str, tuple[str, ...]] = {
    "A": ("N9", "C8", "N7", "C5", "C6", "N6", "N1", "C2", "N3", "C4"),
    "G": ("N9", "C8", "N7", "C5", "C6", "O6", "N1", "C2", "N2", "N3", "C4"),
    "C": ("N1", "C2", "O2", "N3", "C4", "N4", "C5", "C6"),
    "U": ("N1", "C2", "O2", "N3", "C4", "O4", "C5", "C6"),
    "T": ("N1", "C2", "O2", "N3", "C4", "O4", "C5", "C7", "C6"),
}
_SIDE_CHAINS: dict[str, tuple[str, ...]] = {
    "ALA": ("CB",),
    "ARG": ("CB", "CG", "CD", "NE", "CZ", "NH1", "NH2"),
    "ASN": ("CB", "CG", "OD1", "ND2"),
    "ASP": ("CB", "CG", "OD1", "OD2"),
    "CYS": ("CB", "SG"),
    "GLN": ("CB", "CG", "CD", "OE1", "NE2"),
    "GLU": ("CB", "CG", "CD", "OE1", "OE2"),
    "GLY": (),
    "HIS": ("CB", "CG", "ND1", "CD2", "CE1", "NE2"),
    "ILE": ("CB", "CG1", "CG2", "CD1"),
    "LEU": ("CB", "CG", "CD1", "CD2"),
    "LYS": ("CB", "CG", "CD", "CE", "NZ"),
    "MET": ("CB", "CG", "SD", "CE"),
    "PHE": ("CB", "CG", "CD1", "CD2", "CE1", "CE2", "CZ"),
    "PRO": ("CB", "CG", "CD"),
    "SER": ("CB", "OG"),
    "THR": ("CB", "OG1", "CG2"),
    "TRP": ("CB", "CG", "CD1", "CD2", "NE1", "CE2", "CE3", "CZ2", "CZ3", "CH2"),
    "TYR": ("CB", "CG", "CD1", "CD2", "CE1", "CE2", "CZ", "OH"),
    "VAL": ("CB", "CG1", "CG2"),
}

RESIDUE_ATOM_NAMES: dict[str, tuple[str, ...]] = {
    **{aa: BACKBONE_PROTEIN + _SIDE_CHAINS[aa] for aa in AMINO_ACIDS},
    **{b: _RIBOSE + _BASES[b] for b in RNA},
    **{d: _DEOXYRIBOSE + _BASES[d[1]] for d in DNA},
}
"""Heavy atoms of each standard residue, in Boltz / PDB order (no hydrogens, no ``OXT``)."""

ATOMS_PER_RESIDUE: dict[str, int] = {name: len(atoms) for name, atoms in RESIDUE_ATOM_NAMES.items()}
"""Heavy-atom count per standard residue token (a ligand token always has one atom)."""

AA_FREQUENCIES: tuple[float, ...] = (
    8.3, 5.5, 4.1, 5.5, 1.4, 3.9, 6.8, 7.1, 2.3, 5.9,
    9.9, 5.8, 2.4, 3.9, 4.7, 6.6, 5.3, 1.1, 2.9, 6.9,
)  # fmt: skip
"""Natural amino-acid frequencies (percent), in :data:`AMINO_ACIDS` order."""
ATOMIC_NUMBER = {"C": 6, "N": 7, "O": 8, "F": 9, "P": 15, "S": 16, "CL": 17}
"""Atomic numbers of the elements the generator places."""
_PURINES = {"A", "G", "DA", "DG"}

RES_TYPES: tuple[str, ...] = (*AMINO_ACIDS, *RNA, *DNA, "LIG")
"""Rows of the residue tables: the 28 standard residues, then one ligand-atom row."""
_RES_INDEX = {name: i for i, name in enumerate(RES_TYPES)}
LIG = _RES_INDEX["LIG"]
"""Table row of a ligand atom."""
AA_ROWS = torch.arange(len(AMINO_ACIDS))
"""Table rows of the amino acids."""
RNA_ROWS = torch.tensor([_RES_INDEX[b] for b in RNA])
"""Table rows of the RNA nucleotides."""
DNA_ROWS = torch.tensor([_RES_INDEX[d] for d in DNA])
"""Table rows of the DNA nucleotides."""


@dataclass(frozen=True)
class ResidueTables:
    """Per residue-type tables, padded on the atom axis to the largest residue (``M``).

    ``R`` is the number of table rows (:data:`RES_TYPES`).
    """

    n_atoms: Tensor  # [R] long
    token_id: Tensor  # [R] long
    name_chars: Tensor  # [R, M, 4] long
    element: Tensor  # [R, M] long
    charge: Tensor  # [R, M] long
    backbone: Tensor  # [R, M] long
    chirality: Tensor  # [R, M] long
    ideal: Tensor  # [R, M, 3] float32, center atom at the origin
    ideal_centroid: Tensor  # [R, 3] float32
    center_local: Tensor  # [R] long
    disto_local: Tensor  # [R] long
    frame_local: Tensor  # [R, 3] long


def name_chars(name: str) -> list[int]:
    """The 4 character codes of an atom name (``ord(c) - 32``, zero-padded)."""
    codes = [ord(c) - 32 for c in name.strip()][:4]
    return codes + [0] * (4 - len(codes))


def _ideal_offsets(name: str, g: torch.Generator) -> Tensor:
    """Return one fixed reference conformer of a residue, center atom at the origin."""
    atoms = RESIDUE_ATOM_NAMES[name]
    n = len(atoms)
    shell = unit(torch.randn(n, 3, generator=g, dtype=torch.float64))
    radius = 1.3 + 0.7 * torch.rand(n, 1, generator=g, dtype=torch.float64)
    pos = shell * radius
    u = unit(torch.randn(3, generator=g, dtype=torch.float64))
    p = perpendicular(u, g)
    if name in AMINO_ACIDS:
        pos[1] = 0.0
        pos[0] = 1.46 * u
        pos[2] = 1.52 * in_plane(u, p, 111.0)
        if n > 4:
            normal = torch.linalg.cross(u, p)
            bisector = unit(-(u + in_plane(u, p, 111.0)))
            pos[4] = 1.53 * unit(0.58 * bisector + 0.82 * normal)
    else:
        c1, c3, c4 = atoms.index("C1'"), atoms.index("C3'"), atoms.index("C4'")
        pos[c1] = 0.0
        pos[c3] = 2.35 * u
        pos[c4] = pos[c3] + 1.52 * in_plane(-u, p, 72.0)
    return pos.float()


def _atom_classes(name: str, atom: str) -> tuple[int, int, int]:
    """``(backbone, charge, chirality)`` classes of one atom of a standard residue."""
    protein = name in AMINO_ACIDS
    backbone = charge = chirality = 0
    if protein and atom in BACKBONE_PROTEIN:
        backbone = 1 + BACKBONE_PROTEIN.index(atom)
    elif not protein and atom in BACKBONE_NUCLEIC:
        backbone = 1 + len(BACKBONE_PROTEIN) + BACKBONE_NUCLEIC.index(atom)
    if (name, atom) in {("ARG", "NH2"), ("LYS", "NZ")}:
        charge = 1
    if (protein and atom == "CA" and name != "GLY") or (name, atom) in {
        ("ILE", "CB"),
        ("THR", "CB"),
    }:
        chirality = CHI_CW
    if not protein and atom in {"C1'", "C3'", "C4'"} | ({"C2'"} if name in RNA else set()):
        chirality = CHI_CCW
    return backbone, charge, chirality


def _special_atoms(name: str) -> tuple[int, int, tuple[int, int, int]]:
    """Local ``(center, distogram, frame)`` atom indices of a standard residue."""
    atoms = RESIDUE_ATOM_NAMES[name]
    if name in AMINO_ACIDS:
        center = atoms.index("CA")
        disto = atoms.index("CA" if name == "GLY" else "CB")
        frame = tuple(atoms.index(a) for a in ("N", "CA", "C"))
    else:
        center = atoms.index("C1'")
        disto = atoms.index("C4" if name in _PURINES else "C2")
        frame = tuple(atoms.index(a) for a in ("C1'", "C3'", "C4'"))
    return center, disto, frame  # type: ignore[return-value]


@lru_cache(maxsize=1)
def residue_tables() -> ResidueTables:
    """The residue tables (built once; the ligand row is one atom with zero features)."""
    width = max(ATOMS_PER_RESIDUE.values())
    n_types = len(RES_TYPES)
    g = torch.Generator().manual_seed(20_240_601)
    n_atoms = torch.ones(n_types, dtype=torch.long)
    token_id = torch.full((n_types,), UNK, dtype=torch.long)
    chars = torch.zeros(n_types, width, 4, dtype=torch.long)
    element = torch.zeros(n_types, width, dtype=torch.long)
    charge = torch.zeros(n_types, width, dtype=torch.long)
    backbone = torch.zeros(n_types, width, dtype=torch.long)
    chirality = torch.zeros(n_types, width, dtype=torch.long)
    ideal = torch.zeros(n_types, width, 3)
    centroid = torch.zeros(n_types, 3)
    center_local = torch.zeros(n_types, dtype=torch.long)
    disto_local = torch.zeros(n_types, dtype=torch.long)
    frame_local = torch.zeros(n_types, 3, dtype=torch.long)
    for row, name in enumerate(RES_TYPES[:-1]):
        atoms = RESIDUE_ATOM_NAMES[name]
        n = len(atoms)
        n_atoms[row] = n
        token_id[row] = TOKEN_IDS[name]
        chars[row, :n] = torch.tensor([name_chars(a) for a in atoms])
        element[row, :n] = torch.tensor([ATOMIC_NUMBER[a[0]] for a in atoms])
        for i, a in enumerate(atoms):
            backbone[row, i], charge[row, i], chirality[row, i] = _atom_classes(name, a)
        center, disto, frame = _special_atoms(name)
        center_local[row], disto_local[row] = center, disto
        frame_local[row] = torch.tensor(frame)
        offsets = _ideal_offsets(name, g)
        ideal[row, :n] = offsets
        centroid[row] = offsets.mean(0)
    return ResidueTables(
        n_atoms=n_atoms,
        token_id=token_id,
        name_chars=chars,
        element=element,
        charge=charge,
        backbone=backbone,
        chirality=chirality,
        ideal=ideal,
        ideal_centroid=centroid,
        center_local=center_local,
        disto_local=disto_local,
        frame_local=frame_local,
    )
