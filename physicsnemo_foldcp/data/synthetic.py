"""Deterministic synthetic Boltz-1 / Boltz-2 feature dicts for one complex, unbatched.

:func:`make_complex` returns what a Boltz featurizer returns for one sample at inference
(``BoltzFeaturizer.process`` for ``"boltz1"``, ``Boltz2Featurizer.process`` for
``"boltz2"``, both with constraint features on), built from a random but chemically
plausible complex: protein chains (a homodimer when large enough), a DNA duplex, an RNA
chain and small ligands, one of them covalently bound to a protein residue.

Conventions (shared with Boltz):

* tokens are ordered chain by chain; a protein / nucleic residue is one token, a ligand
  heavy atom is one token; the atoms of a token are contiguous on the atom axis, in token
  order;
* ``token_to_center_atom`` / ``r_set_to_rep_atom`` pick the center atom (``CA``, ``C1'``,
  the ligand atom); ``token_to_rep_atom`` and ``disto_center`` use the distogram atom
  (``CB``, ``CA`` for glycine, ``C4`` for purines, ``C2`` for pyrimidines, the ligand
  atom);
* ``coords`` are centered on the resolved atoms of each conformer; ``disto_center`` and
  ``disto_coords_ensemble`` keep the raw frame (as Boltz does), so only their pairwise
  distances agree with ``coords``;
* padding value 0 everywhere, except ``msa`` whose pad is ``"-"`` (id 1): for Boltz-1,
  whose ``msa`` is one-hot, padded token columns are all ones, as Boltz pads the one-hot
  tensor itself with 1;
* ``r_set_to_rep_atom`` gets ``max_tokens - N`` zero rows appended when token padding is
  asked for (Boltz pads its first axis like a token axis).

Every value is a ``torch.Tensor``. All randomness comes from one local
:class:`torch.Generator` seeded with ``seed``; both presets draw the same complex for the
same arguments (same chains, coordinates, MSA), only the emitted features differ.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "ATOMS_PER_RESIDUE",
    "DISTO_BOUNDARIES",
    "MOL_TYPE_IDS",
    "PRESET_KEYS",
    "RESIDUE_ATOM_NAMES",
    "TOKEN_IDS",
    "chains_of",
    "make_complex",
]

# ------------------------------------------------------------------------------------------
# Vocabularies (Boltz ``const``)
# ------------------------------------------------------------------------------------------

_AMINO_ACIDS: tuple[str, ...] = (
    "ALA", "ARG", "ASN", "ASP", "CYS", "GLN", "GLU", "GLY", "HIS", "ILE",
    "LEU", "LYS", "MET", "PHE", "PRO", "SER", "THR", "TRP", "TYR", "VAL",
)  # fmt: skip
_RNA: tuple[str, ...] = ("A", "G", "C", "U")
_DNA: tuple[str, ...] = ("DA", "DG", "DC", "DT")

_TOKENS: tuple[str, ...] = (
    "<pad>", "-", *_AMINO_ACIDS, "UNK", *_RNA, "N", *_DNA, "DN",
)  # fmt: skip

TOKEN_IDS: dict[str, int] = {name: i for i, name in enumerate(_TOKENS)}
"""Boltz residue-token vocabulary (33 classes): ``res_type``, ``msa`` and ``profile`` ids."""

MOL_TYPE_IDS: dict[str, int] = {"protein": 0, "dna": 1, "rna": 2, "ligand": 3}
"""``mol_type`` ids per molecule kind (Boltz ``chain_type_ids``; ligand is NONPOLYMER)."""

_NUM_TOKENS = len(_TOKENS)
_NUM_ELEMENTS = 128
_NUM_NAME_CHARS = 64
_NUM_DISTO_BINS = 64
_NUM_POCKET_CLASSES = 4
_NUM_CONTACT_CLASSES = 5
_NUM_BACKBONE_CLASSES = 17
_METHOD_XRAY = 1
_GAP = TOKEN_IDS["-"]
_UNK = TOKEN_IDS["UNK"]

DISTO_BOUNDARIES: Tensor = torch.linspace(2.0, 22.0, _NUM_DISTO_BINS - 1)
"""The 63 inner boundaries (Angstrom) of the 64 distogram bins: bin = #(boundaries < d)."""

_POCKET_UNSELECTED, _POCKET_POCKET, _POCKET_BINDER = 1, 2, 3
_CONTACT_UNSELECTED, _CONTACT_CONTACT = 1, 4
_BOND_SINGLE, _BOND_DOUBLE, _BOND_AROMATIC, _BOND_COVALENT = 1, 2, 4, 5
_CHI_CW, _CHI_CCW = 1, 2

_BACKBONE_PROTEIN = ("N", "CA", "C", "O")
_BACKBONE_NUCLEIC = (
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
    **{aa: _BACKBONE_PROTEIN + _SIDE_CHAINS[aa] for aa in _AMINO_ACIDS},
    **{b: _RIBOSE + _BASES[b] for b in _RNA},
    **{d: _DEOXYRIBOSE + _BASES[d[1]] for d in _DNA},
}
"""Heavy atoms of each standard residue, in Boltz / PDB order (no hydrogens, no ``OXT``)."""

ATOMS_PER_RESIDUE: dict[str, int] = {name: len(atoms) for name, atoms in RESIDUE_ATOM_NAMES.items()}
"""Heavy-atom count per standard residue token (a ligand token always has one atom)."""

_AA_FREQUENCIES: tuple[float, ...] = (
    8.3, 5.5, 4.1, 5.5, 1.4, 3.9, 6.8, 7.1, 2.3, 5.9,
    9.9, 5.8, 2.4, 3.9, 4.7, 6.6, 5.3, 1.1, 2.9, 6.9,
)  # fmt: skip
_ATOMIC_NUMBER = {"C": 6, "N": 7, "O": 8, "F": 9, "P": 15, "S": 16, "CL": 17}
_PURINES = {"A", "G", "DA", "DG"}
_DEFAULT_COMPOSITION = {"protein": 0.7, "dna": 0.1, "rna": 0.1, "ligand": 0.1}
_KINDS = ("protein", "dna", "rna", "ligand")

# Residue-type table rows: the 28 standard residues, then one ligand-atom row.
_RES_TYPES: tuple[str, ...] = (*_AMINO_ACIDS, *_RNA, *_DNA, "LIG")
_RES_INDEX = {name: i for i, name in enumerate(_RES_TYPES)}
_LIG = _RES_INDEX["LIG"]
_AA_ROWS = torch.arange(len(_AMINO_ACIDS))
_RNA_ROWS = torch.tensor([_RES_INDEX[b] for b in _RNA])
_DNA_ROWS = torch.tensor([_RES_INDEX[d] for d in _DNA])

_PROTEIN_STEP = 3.8
_NUCLEIC_STEP = 5.9
_LIGAND_BOND = 1.5
_MAX_LIGAND_ATOMS = 40
_UNRESOLVED_FRACTION = 0.02

# ------------------------------------------------------------------------------------------
# Keys per preset
# ------------------------------------------------------------------------------------------

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
"""Exactly the keys :func:`make_complex` returns per preset."""


# ------------------------------------------------------------------------------------------
# Residue tables
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Tables:
    """Per residue-type tables, padded on the atom axis to the largest residue."""

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


def _name_chars(name: str) -> list[int]:
    codes = [ord(c) - 32 for c in name.strip()][:4]
    return codes + [0] * (4 - len(codes))


def _unit(v: Tensor) -> Tensor:
    return v / v.norm(dim=-1, keepdim=True).clamp_min(1e-8)


def _in_plane(u: Tensor, p: Tensor, angle_deg: float) -> Tensor:
    """Return the unit vector at ``angle_deg`` from ``u`` in the plane of ``u`` and ``p``."""
    a = math.radians(angle_deg)
    return math.cos(a) * u + math.sin(a) * p


def _perpendicular(u: Tensor, g: torch.Generator) -> Tensor:
    r = torch.randn(3, generator=g, dtype=torch.float64)
    return _unit(r - (r @ u) * u)


def _ideal_offsets(name: str, g: torch.Generator) -> Tensor:
    """Return one fixed reference conformer of a residue, center atom at the origin."""
    atoms = RESIDUE_ATOM_NAMES[name]
    n = len(atoms)
    shell = _unit(torch.randn(n, 3, generator=g, dtype=torch.float64))
    radius = 1.3 + 0.7 * torch.rand(n, 1, generator=g, dtype=torch.float64)
    pos = shell * radius
    u = _unit(torch.randn(3, generator=g, dtype=torch.float64))
    p = _perpendicular(u, g)
    if name in _AMINO_ACIDS:
        pos[1] = 0.0
        pos[0] = 1.46 * u
        pos[2] = 1.52 * _in_plane(u, p, 111.0)
        if n > 4:
            normal = torch.linalg.cross(u, p)
            bisector = _unit(-(u + _in_plane(u, p, 111.0)))
            pos[4] = 1.53 * _unit(0.58 * bisector + 0.82 * normal)
    else:
        c1, c3, c4 = atoms.index("C1'"), atoms.index("C3'"), atoms.index("C4'")
        pos[c1] = 0.0
        pos[c3] = 2.35 * u
        pos[c4] = pos[c3] + 1.52 * _in_plane(-u, p, 72.0)
    return pos.float()


@lru_cache(maxsize=1)
def _tables() -> _Tables:
    width = max(ATOMS_PER_RESIDUE.values())
    n_types = len(_RES_TYPES)
    g = torch.Generator().manual_seed(20_240_601)
    n_atoms = torch.ones(n_types, dtype=torch.long)
    token_id = torch.full((n_types,), _UNK, dtype=torch.long)
    name_chars = torch.zeros(n_types, width, 4, dtype=torch.long)
    element = torch.zeros(n_types, width, dtype=torch.long)
    charge = torch.zeros(n_types, width, dtype=torch.long)
    backbone = torch.zeros(n_types, width, dtype=torch.long)
    chirality = torch.zeros(n_types, width, dtype=torch.long)
    ideal = torch.zeros(n_types, width, 3)
    centroid = torch.zeros(n_types, 3)
    center_local = torch.zeros(n_types, dtype=torch.long)
    disto_local = torch.zeros(n_types, dtype=torch.long)
    frame_local = torch.zeros(n_types, 3, dtype=torch.long)
    for row, name in enumerate(_RES_TYPES[:-1]):
        atoms = RESIDUE_ATOM_NAMES[name]
        n = len(atoms)
        protein = name in _AMINO_ACIDS
        n_atoms[row] = n
        token_id[row] = TOKEN_IDS[name]
        name_chars[row, :n] = torch.tensor([_name_chars(a) for a in atoms])
        element[row, :n] = torch.tensor([_ATOMIC_NUMBER[a[0]] for a in atoms])
        for i, a in enumerate(atoms):
            if protein and a in _BACKBONE_PROTEIN:
                backbone[row, i] = 1 + _BACKBONE_PROTEIN.index(a)
            elif not protein and a in _BACKBONE_NUCLEIC:
                backbone[row, i] = 1 + len(_BACKBONE_PROTEIN) + _BACKBONE_NUCLEIC.index(a)
            if (name, a) in {("ARG", "NH2"), ("LYS", "NZ")}:
                charge[row, i] = 1
            if (protein and a == "CA" and name != "GLY") or (name, a) in {
                ("ILE", "CB"),
                ("THR", "CB"),
            }:
                chirality[row, i] = _CHI_CW
            if not protein and a in {"C1'", "C3'", "C4'"} | ({"C2'"} if name in _RNA else set()):
                chirality[row, i] = _CHI_CCW
        if protein:
            center_local[row] = atoms.index("CA")
            disto_local[row] = atoms.index("CA" if name == "GLY" else "CB")
            frame_local[row] = torch.tensor([atoms.index(a) for a in ("N", "CA", "C")])
        else:
            center_local[row] = atoms.index("C1'")
            disto_local[row] = atoms.index("C4" if name in _PURINES else "C2")
            frame_local[row] = torch.tensor([atoms.index(a) for a in ("C1'", "C3'", "C4'")])
        offsets = _ideal_offsets(name, g)
        ideal[row, :n] = offsets
        centroid[row] = offsets.mean(0)
    return _Tables(
        n_atoms=n_atoms,
        token_id=token_id,
        name_chars=name_chars,
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


# ------------------------------------------------------------------------------------------
# Complex layout
# ------------------------------------------------------------------------------------------


@dataclass
class _Chain:
    kind: str
    types: Tensor  # [L] long rows of the residue tables
    entity: int = 0
    sym: int = 0


@dataclass
class _Ligand:
    """One ligand molecule: atom positions, chemistry and graph (local atom indices)."""

    pos: Tensor  # [m, 3] float64
    element: list[int]
    names: list[str]
    charge: list[int]
    chirality: list[int]
    bonds: list[tuple[int, int, int]]
    ring5: list[tuple[int, ...]] = field(default_factory=list)
    ring6: list[tuple[int, ...]] = field(default_factory=list)
    chiral: list[tuple[int, int, int, int, bool]] = field(default_factory=list)
    stereo: list[tuple[int, int, int, int, bool]] = field(default_factory=list)
    planar: list[tuple[int, ...]] = field(default_factory=list)


def _randint(g: torch.Generator, low: int, high: int) -> int:
    """Integer uniform in ``[low, high]``."""
    return int(torch.randint(low, high + 1, (1,), generator=g))


def _uniform(g: torch.Generator) -> float:
    return float(torch.rand((), generator=g))


def _kind_counts(n_tokens: int, composition: Mapping[str, float] | None) -> dict[str, int]:
    comp = dict(_DEFAULT_COMPOSITION if composition is None else composition)
    unknown = set(comp) - set(_KINDS)
    if unknown:
        raise ValueError(f"unknown composition kinds {sorted(unknown)}; use {_KINDS}")
    if any(v < 0 for v in comp.values()) or sum(comp.values()) <= 0:
        raise ValueError("composition fractions must be >= 0 with a positive sum")
    total = float(sum(comp.values()))
    share = {k: n_tokens * comp.get(k, 0.0) / total for k in _KINDS}
    counts = {k: int(math.floor(v)) for k, v in share.items()}
    by_remainder = sorted(_KINDS, key=lambda k: (-(share[k] - counts[k]), _KINDS.index(k)))
    for k in by_remainder[: n_tokens - sum(counts.values())]:
        counts[k] += 1
    return counts


def _split(total: int, parts: int, g: torch.Generator) -> list[int]:
    """Split ``total`` into ``parts`` positive sizes, roughly balanced."""
    weights = 0.6 + torch.rand(parts, generator=g, dtype=torch.float64)
    sizes = [max(1, int(total * float(w) / float(weights.sum()))) for w in weights]
    sizes[-1] = total - sum(sizes[:-1])
    return sizes


def _plan_chains(counts: dict[str, int], g: torch.Generator) -> list[_Chain]:
    chains: list[_Chain] = []
    freq = torch.tensor(_AA_FREQUENCIES, dtype=torch.float64)

    def protein(length: int) -> Tensor:
        return _AA_ROWS[torch.multinomial(freq, length, replacement=True, generator=g)]

    n_prot = counts["protein"]
    if n_prot >= 24:
        dimer = _randint(g, n_prot // 5, n_prot // 3)
        seq = protein(dimer)
        chains += [_Chain("protein", seq), _Chain("protein", seq.clone())]
        rest = n_prot - 2 * dimer
        if rest > 0:
            parts = 2 if rest >= 60 else 1
            chains += [_Chain("protein", protein(s)) for s in _split(rest, parts, g)]
    elif n_prot > 0:
        chains.append(_Chain("protein", protein(n_prot)))

    n_dna = counts["dna"]
    if n_dna >= 2:
        half = n_dna // 2
        strand = torch.randint(0, 4, (n_dna - half,), generator=g)
        complement = torch.tensor([3, 2, 1, 0])[strand[:half].flip(0)]  # DA<->DT, DG<->DC
        chains.append(_Chain("dna", _DNA_ROWS[strand]))
        chains.append(_Chain("dna", _DNA_ROWS[complement]))
    elif n_dna == 1:
        chains.append(_Chain("dna", _DNA_ROWS[torch.randint(0, 4, (1,), generator=g)]))

    if counts["rna"] > 0:
        chains.append(_Chain("rna", _RNA_ROWS[torch.randint(0, 4, (counts["rna"],), generator=g)]))

    left = counts["ligand"]
    while left > 0:
        size = min(left, _randint(g, 3, 30))
        chains.append(_Chain("ligand", torch.full((size,), _LIG, dtype=torch.long)))
        left -= size

    seen: dict[tuple[str, tuple[int, ...]], int] = {}
    copies: dict[int, int] = {}
    for index, chain in enumerate(chains):
        polymer = chain.kind != "ligand"
        key = (chain.kind, tuple(chain.types.tolist()) if polymer else (index,))
        chain.entity = seen.setdefault(key, len(seen))
        chain.sym = copies.get(chain.entity, 0)
        copies[chain.entity] = chain.sym + 1
    return chains


def _random_rotations(n: int, g: torch.Generator) -> Tensor:
    """``[n, 3, 3]`` uniformly random rotation matrices (float32)."""
    q = _unit(torch.randn(n, 4, generator=g, dtype=torch.float64))
    w, x, y, z = q.unbind(-1)
    rot = torch.stack(
        [
            1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w),
            2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w),
            2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y),
        ],
        dim=-1,
    )  # fmt: skip
    return rot.reshape(n, 3, 3).float()


def _chain_trace(
    length: int, step: float, start: Tensor, radius: float, g: torch.Generator
) -> Tensor:
    """Walk ``length`` points ``step`` apart, with persistence and a loose confinement."""
    noise = torch.randn(length, 3, generator=g, dtype=torch.float64).tolist()
    heading = _unit(torch.randn(3, generator=g, dtype=torch.float64)).tolist()
    x, y, z = start.tolist()
    out = [[x, y, z]]
    for i in range(1, length):
        pull = 0.35 * max(0.0, math.sqrt(x * x + y * y + z * z) / radius - 0.5)
        norm = max(math.sqrt(x * x + y * y + z * z), 1e-8)
        d = [1.2 * heading[k] + noise[i][k] - pull * (x, y, z)[k] / norm * 3.0 for k in range(3)]
        dn = max(math.sqrt(sum(c * c for c in d)), 1e-8)
        heading = [c / dn for c in d]
        x, y, z = x + step * heading[0], y + step * heading[1], z + step * heading[2]
        out.append([x, y, z])
    return torch.tensor(out, dtype=torch.float64)


def _ligand_elements(degree: list[int], ring: set[int], g: torch.Generator) -> list[str]:
    elements = []
    for i, deg in enumerate(degree):
        r = _uniform(g)
        if i in ring:
            elements.append("N" if r < 0.12 else "C")
        elif deg <= 1:
            elements.append("C" if r < 0.5 else "O" if r < 0.75 else "N" if r < 0.9 else "F")
        elif deg == 2:
            elements.append("C" if r < 0.7 else "N" if r < 0.85 else "O" if r < 0.97 else "S")
        else:
            elements.append("C" if r < 0.85 else "N")
    return elements


def _build_ligand(m: int, start: Tensor, direction: Tensor, g: torch.Generator) -> _Ligand:
    """Build a small ligand of ``m`` heavy atoms: rings, a branched tail, constraints."""
    pos = torch.zeros(m, 3, dtype=torch.float64)
    nbrs: list[list[int]] = [[] for _ in range(m)]
    bonds: list[tuple[int, int, int]] = []
    ring5: list[tuple[int, ...]] = []
    ring6: list[tuple[int, ...]] = []

    def bond(i: int, j: int, kind: int) -> None:
        bonds.append((i, j, kind))
        nbrs[i].append(j)
        nbrs[j].append(i)

    def ring(first: int, size: int, anchor: Tensor, d: Tensor) -> None:
        radius = _LIGAND_BOND / (2 * math.sin(math.pi / size))
        center = anchor + radius * d
        p = _perpendicular(d, g)
        for k in range(size):
            t = 2 * math.pi * k / size
            pos[first + k] = center + radius * (-math.cos(t) * d + math.sin(t) * p)
        for k in range(size):
            bond(first + k, first + (k + 1) % size, _BOND_AROMATIC)

    d0 = _unit(direction.double())
    placed = 0
    if m >= 6:
        ring(0, 6, start.double(), d0)
        ring6.append(tuple(range(6)))
        placed = 6
        if m >= 12:
            d1 = _unit(pos[5] - pos[:6].mean(0))
            ring(6, 5, pos[5] + _LIGAND_BOND * d1, d1)
            bond(5, 6, _BOND_SINGLE)
            ring5.append(tuple(range(6, 11)))
            placed = 11
    in_ring = set(range(placed))
    noise = torch.randn(m, 3, generator=g, dtype=torch.float64)
    for i in range(placed, m):
        if i == 0:
            pos[0] = start.double()
            continue
        open_atoms = [j for j in range(placed, i) if len(nbrs[j]) < 3]
        open_atoms = open_atoms or [j for j in range(i) if len(nbrs[j]) < 3]
        if len(nbrs[i - 1]) < 3 and _uniform(g) < 0.55:
            parent = i - 1
        elif open_atoms:
            parent = open_atoms[_randint(g, 0, len(open_atoms) - 1)]
        else:
            parent = i - 1
        if nbrs[parent]:
            out = _unit(pos[parent] - pos[nbrs[parent]].mean(0))
        else:
            out = d0
        pos[i] = pos[parent] + _LIGAND_BOND * _unit(out + 0.8 * noise[i])
        bond(parent, i, _BOND_SINGLE)

    degree = [len(n) for n in nbrs]
    symbols = _ligand_elements(degree, in_ring, g)
    numbering: dict[str, int] = {}
    names = []
    for s in symbols:
        numbering[s] = numbering.get(s, 0) + 1
        names.append(f"{s}{numbering[s]}")
    charge = [
        1 if s == "N" and degree[i] == 1 and i not in in_ring else 0 for i, s in enumerate(symbols)
    ]
    chirality = [0] * m

    lig = _Ligand(
        pos=pos,
        element=[_ATOMIC_NUMBER[s] for s in symbols],
        names=names,
        charge=charge,
        chirality=chirality,
        bonds=bonds,
        ring5=ring5,
        ring6=ring6,
    )
    double_atoms: set[int] = set()
    candidates = [
        (degree[i] + degree[j], -b)
        for b, (i, j, _) in enumerate(bonds)
        if i not in in_ring
        and j not in in_ring
        and min(degree[i], degree[j]) >= 2
        and symbols[i] == symbols[j] == "C"
    ]
    if candidates:
        b = -max(candidates)[1]
        i, j, _ = bonds[b]
        bonds[b] = (i, j, _BOND_DOUBLE)
        double_atoms = {i, j}
        ni = sorted(k for k in nbrs[i] if k != j)
        nj = sorted(k for k in nbrs[j] if k != i)
        lig.stereo.append((ni[0], i, j, nj[0], _uniform(g) < 0.5))
        if len(ni) == 2 and len(nj) == 2:
            lig.planar.append((i, ni[0], ni[1], j, nj[0], nj[1]))
    for c in range(m):
        if c in in_ring or c in double_atoms or degree[c] < 3 or symbols[c] != "C":
            continue
        is_r = _uniform(g) < 0.5
        n0, n1, n2 = sorted(nbrs[c], reverse=True)[:3]
        lig.chiral.append((n0, n1, n2, c, is_r))
        chirality[c] = _CHI_CW if is_r else _CHI_CCW
        if len(lig.chiral) == 2:
            break
    return lig


# ------------------------------------------------------------------------------------------
# Feature helpers
# ------------------------------------------------------------------------------------------


def _pairwise(x: Tensor) -> Tensor:
    return torch.cdist(x, x, compute_mode="donot_use_mm_for_euclid_dist")


def _distogram_bins(x: Tensor) -> Tensor:
    """``[N, N]`` long distogram bin of the pairwise distances of ``x`` ``[N, 3]``."""
    return torch.bucketize(_pairwise(x.float()), DISTO_BOUNDARIES)


def _not_collinear(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """Boltz frame validity: ``b-a`` and ``b-c`` long enough and not (anti)parallel."""
    v1, v2 = b - a, b - c
    n1, n2 = v1.norm(dim=-1), v2.norm(dim=-1)
    cos = (v1 / (n1[..., None] + 1e-6) * (v2 / (n2[..., None] + 1e-6))).sum(-1)
    return (cos.abs() < 0.9063) & (n1 > 1e-2) & (n2 > 1e-2)


def _pad(x: Tensor, dim: int, length: int, value: float = 0) -> Tensor:
    """Right-pad ``x`` along ``dim`` to ``length``."""
    missing = length - x.shape[dim]
    if missing <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x, torch.full(shape, value, dtype=x.dtype)], dim=dim)


def _one_hot(index: Tensor, classes: int, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """Return zeros of ``(*shape, classes)``, one-hot of ``index`` in the leading corner."""
    out = torch.zeros(*shape, classes, dtype=dtype)
    corner = out[tuple(slice(0, size) for size in index.shape)]
    corner.scatter_(-1, index.unsqueeze(-1), 1)
    return out


def _index_list(rows: list[tuple[int, ...]], width: int) -> Tensor:
    if not rows:
        return torch.empty((width, 0), dtype=torch.long)
    return torch.tensor(rows, dtype=torch.long).T.contiguous()


# ------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------


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
    if preset not in PRESET_KEYS:
        raise ValueError(f"unknown preset {preset!r}; use one of {sorted(PRESET_KEYS)}")
    if n_tokens < 1 or msa_rows < 1 or n_conformers < 1 or n_templates < 1:
        raise ValueError("n_tokens, msa_rows, n_conformers and n_templates must be >= 1")
    if atom_multiple is not None and atom_multiple < 1:
        raise ValueError("atom_multiple must be >= 1")
    if max_tokens is not None and max_tokens < n_tokens:
        raise ValueError(f"max_tokens={max_tokens} is smaller than n_tokens={n_tokens}")
    v2 = preset == "boltz2"
    tab = _tables()
    g = torch.Generator().manual_seed(int(seed))
    chains = _plan_chains(_kind_counts(n_tokens, composition), g)

    # Tokens ---------------------------------------------------------------------------
    n = n_tokens
    tok_type = torch.cat([c.types for c in chains])
    tok_asym = torch.cat([torch.full((len(c.types),), i) for i, c in enumerate(chains)])
    tok_entity = torch.cat([torch.full((len(c.types),), c.entity) for c in chains])
    tok_sym = torch.cat([torch.full((len(c.types),), c.sym) for c in chains])
    tok_kind = torch.cat([torch.full((len(c.types),), MOL_TYPE_IDS[c.kind]) for c in chains]).long()
    tok_resid = torch.cat(
        [
            torch.zeros(len(c.types), dtype=torch.long)
            if c.kind == "ligand"
            else torch.arange(len(c.types))
            for c in chains
        ]
    )
    chain_starts = torch.tensor([0, *itertools.accumulate(len(c.types) for c in chains)])
    polymer = tok_kind != MOL_TYPE_IDS["ligand"]
    is_protein = tok_kind == MOL_TYPE_IDS["protein"]
    tok_token_id = tab.token_id[tok_type]
    tok_resolved = ~(polymer & (torch.rand(n, generator=g) < _UNRESOLVED_FRACTION))

    # Atoms ----------------------------------------------------------------------------
    counts = tab.n_atoms[tok_type]
    tok_atom_start = counts.cumsum(0) - counts
    n_atoms = int(counts.sum())
    atom_tok = torch.repeat_interleave(torch.arange(n), counts)
    atom_type = tok_type[atom_tok]
    atom_local = torch.arange(n_atoms) - tok_atom_start[atom_tok]
    name_chars = tab.name_chars[atom_type, atom_local]
    element = tab.element[atom_type, atom_local]
    charge = tab.charge[atom_type, atom_local]
    backbone = tab.backbone[atom_type, atom_local]
    chirality = tab.chirality[atom_type, atom_local]
    atom_resolved = tok_resolved[atom_tok]
    a_len = n_atoms if atom_multiple is None else -(-n_atoms // atom_multiple) * atom_multiple
    n_len = n if max_tokens is None else max_tokens
    center_atom = tok_atom_start + tab.center_local[tok_type]
    disto_atom = tok_atom_start + tab.disto_local[tok_type]

    # Coordinates (conformer 0) ---------------------------------------------------------
    radius = max(10.0, 2.2 * float(n) ** 0.38)
    trace = torch.zeros(n, 3, dtype=torch.float64)
    for i, c in enumerate(chains):
        if c.kind == "ligand":
            continue
        s, e = int(chain_starts[i]), int(chain_starts[i + 1])
        start = 0.5 * radius * _unit(torch.randn(3, generator=g, dtype=torch.float64))
        step = _PROTEIN_STEP if c.kind == "protein" else _NUCLEIC_STEP
        trace[s:e] = _chain_trace(e - s, step, start, radius, g)
    rot = _random_rotations(n, g).double()
    local = tab.ideal[atom_type, atom_local].double()
    pos0 = trace[atom_tok] + torch.einsum("aij,aj->ai", rot[atom_tok], local)

    ligands: list[tuple[int, _Ligand]] = []
    covalent: tuple[int, int, int, int] | None = None
    protein_tokens = torch.nonzero(is_protein & tok_resolved).flatten()
    polymer_tokens = torch.nonzero(polymer).flatten()
    for i, c in enumerate(chains):
        if c.kind != "ligand":
            continue
        s = int(chain_starts[i])
        direction = torch.randn(3, generator=g, dtype=torch.float64)
        if not ligands and len(protein_tokens) > 0:
            host = int(protein_tokens[_randint(g, 0, len(protein_tokens) - 1)])
            host_atom = int(tok_atom_start[host] + counts[host] - 1)
            out = _unit(pos0[host_atom] - pos0[center_atom[host]] + 0.3 * _unit(direction))
            start = pos0[host_atom] + 1.8 * out
            lig = _build_ligand(len(c.types), start, out, g)
            covalent = (int(tok_asym[host]), i, host_atom, int(tok_atom_start[s]))
        elif len(polymer_tokens) > 0:
            host = int(polymer_tokens[_randint(g, 0, len(polymer_tokens) - 1)])
            start = pos0[center_atom[host]] + 4.5 * _unit(direction)
            lig = _build_ligand(len(c.types), start, _unit(direction), g)
        else:
            start = 0.5 * radius * _unit(torch.randn(3, generator=g, dtype=torch.float64))
            lig = _build_ligand(len(c.types), start, _unit(direction), g)
        a0 = int(tok_atom_start[s])
        m = len(c.types)
        pos0[a0 : a0 + m] = lig.pos
        element[a0 : a0 + m] = torch.tensor(lig.element)
        charge[a0 : a0 + m] = torch.tensor(lig.charge)
        chirality[a0 : a0 + m] = torch.tensor(lig.chirality)
        name_chars[a0 : a0 + m] = torch.tensor([_name_chars(x) for x in lig.names])
        ligands.append((i, lig))

    # Conformers: small perturbations of conformer 0.
    e_count = n_conformers
    raw = pos0.unsqueeze(0).repeat(e_count, 1, 1)
    if e_count > 1:
        shift = 0.3 * torch.randn(e_count - 1, n, 3, generator=g, dtype=torch.float64)
        jitter = 0.1 * torch.randn(e_count - 1, n_atoms, 3, generator=g, dtype=torch.float64)
        raw[1:] += shift[:, atom_tok] + jitter
    raw = raw.float()
    weights = atom_resolved.float()
    center = (raw * weights[None, :, None]).sum(1) / weights.sum().clamp(min=1)
    coords = raw - center[:, None]

    # Bonds between tokens (ligand graph, covalent link) ------------------------------------
    bond_rows: list[tuple[int, int, int]] = []
    for i, lig in ligands:
        t0 = int(chain_starts[i])
        bond_rows += [(t0 + a, t0 + b, kind) for a, b, kind in lig.bonds]
    if covalent is not None:
        host_atom, lig_atom = covalent[2], covalent[3]
        bond_rows.append((int(atom_tok[host_atom]), int(atom_tok[lig_atom]), _BOND_COVALENT))
    token_bonds = torch.zeros(n_len, n_len, dtype=torch.float32)
    type_bonds = torch.zeros(n_len, n_len, dtype=torch.long)
    if bond_rows:
        b = torch.tensor(bond_rows, dtype=torch.long)
        for u, w in ((b[:, 0], b[:, 1]), (b[:, 1], b[:, 0])):
            token_bonds[u, w] = 1.0
            type_bonds[u, w] = b[:, 2] + 1

    # Distogram -------------------------------------------------------------------------------
    disto_ens = raw[:, disto_atom]  # [K, N, 3]
    disto_center = disto_ens[0].clone()
    if v2:
        bins = torch.stack([_distogram_bins(disto_ens[k]) for k in range(e_count)], dim=-1)
        disto_target = _one_hot(bins, _NUM_DISTO_BINS, (n_len, n_len, e_count), torch.float32)
    else:
        bins = _distogram_bins(disto_center)
        disto_target = _one_hot(bins, _NUM_DISTO_BINS, (n_len, n_len), torch.long)

    # Frames ----------------------------------------------------------------------------------
    frame_base = tok_atom_start[:, None] + tab.frame_local[tok_type]  # [N, 3]
    frame_base[~polymer] = tok_atom_start[~polymer, None]
    frame_ok = polymer & tok_resolved
    frames, frame_mask = [], []
    for k in range(e_count if v2 else 1):
        fr = frame_base.clone()
        for i, lig in ligands:
            m = len(lig.names)
            if m < 3:
                continue
            t0 = int(chain_starts[i])
            a0 = int(tok_atom_start[t0])
            d = _pairwise(raw[k, a0 : a0 + m])
            d.fill_diagonal_(-1.0)
            order = d.argsort(dim=1)
            fr[t0 : t0 + m] = torch.stack([order[:, 1], order[:, 0], order[:, 2]], 1) + a0
        ok = frame_ok.clone()
        for i, lig in ligands:
            if len(lig.names) >= 3:
                t0 = int(chain_starts[i])
                ok[t0 : t0 + len(lig.names)] = True
        xyz = raw[k][fr]
        frames.append(fr)
        frame_mask.append(ok & _not_collinear(xyz[:, 0], xyz[:, 1], xyz[:, 2]))
    frames_idx = torch.stack(frames) if v2 else frames[0]
    frame_resolved_mask = torch.stack(frame_mask) if v2 else frame_mask[0]

    # Atom <-> token maps -------------------------------------------------------------------
    r_set = center_atom[polymer & tok_resolved]
    atom_to_token = _one_hot(atom_tok, n_len, (a_len,), torch.long)
    token_to_rep_atom = _one_hot(disto_atom, a_len, (n_len,), torch.long)
    r_set_to_rep_atom = _one_hot(r_set, a_len, (len(r_set) + n_len - n,), torch.long)

    # MSA -------------------------------------------------------------------------------------
    s_rows = msa_rows
    msa = tok_token_id.expand(s_rows, n).clone()
    deletion = torch.zeros(s_rows, n)
    paired = torch.zeros(s_rows, n)
    paired[0] = 1.0
    if s_rows > 1:
        r = torch.rand(3, s_rows - 1, n, generator=g)
        mutant = torch.randint(TOKEN_IDS["ALA"], TOKEN_IDS["VAL"] + 1, (s_rows - 1, n), generator=g)
        rows = msa[1:]
        rows[r[0] < 0.2] = mutant[r[0] < 0.2]
        rows[r[1] < 0.05] = _GAP
        rows[:, ~is_protein] = _GAP
        counts_del = torch.randint(1, 10, (s_rows - 1, n), generator=g).float()
        deletion[1:] = torch.where((r[2] < 0.05) & is_protein, counts_del, 0.0)
        paired_rows = (torch.arange(1, s_rows) <= (s_rows - 1) // 2)[:, None]
        paired[1:] = (paired_rows & is_protein).float()
    msa_onehot = F.one_hot(msa, _NUM_TOKENS)
    profile = msa_onehot.float().mean(0)
    has_deletion = deletion > 0
    deletion_value = (math.pi / 2) * torch.arctan(deletion / 3)
    deletion_mean = deletion_value.mean(0)
    msa_mask = torch.ones(s_rows, n, dtype=torch.long)

    # Conditioning: pocket (boltz1) / contact (boltz2) -------------------------------------
    pocket = torch.zeros(n, dtype=torch.long)
    if ligands and polymer.any():
        i, lig = ligands[0]
        t0 = int(chain_starts[i])
        binder = tok_asym == tok_asym[t0]
        near = _pairwise_to(raw[0][center_atom], lig.pos.float()).amin(1) < 8.0
        pocket[:] = _POCKET_UNSELECTED
        pocket[near & polymer & tok_resolved] = _POCKET_POCKET
        pocket[binder] = _POCKET_BINDER

    contact_cond = torch.zeros(n, n, dtype=torch.long)
    contact_threshold = torch.zeros(n, n, dtype=torch.float32)
    contact_rows: list[Tensor] = []
    if len(chains) >= 2:
        ta = _sample_tokens(chain_starts[0], chain_starts[1], g)
        tb = _sample_tokens(chain_starts[1], chain_starts[2], g)
        dist = _pairwise_to(raw[0][center_atom[ta]], raw[0][center_atom[tb]])
        flat = int(dist.argmin())
        t1, t2 = int(ta[flat // len(tb)]), int(tb[flat % len(tb)])
        contact_cond[:] = _CONTACT_UNSELECTED
        for x, y in ((t1, t2), (t2, t1)):
            contact_cond[x, y] = _CONTACT_CONTACT
            contact_threshold[x, y] = 8.0
        atoms1 = torch.arange(int(tok_atom_start[t1]), int(tok_atom_start[t1] + counts[t1]))
        atoms2 = torch.arange(int(tok_atom_start[t2]), int(tok_atom_start[t2] + counts[t2]))
        contact_rows.append(torch.cartesian_prod(atoms1, atoms2).T)
    contact_conditioning = _one_hot(contact_cond, _NUM_CONTACT_CLASSES, (n_len, n_len), torch.long)
    if contact_rows:
        contact_pair_index = torch.cat(contact_rows, dim=1)
        n_contact = contact_pair_index.shape[1]
        contact_union_index = torch.zeros(n_contact, dtype=torch.long)
        contact_negation_mask = torch.ones(n_contact, dtype=torch.bool)
        contact_thresholds = torch.full((n_contact,), 8.0, dtype=torch.float32)
    else:
        contact_pair_index = torch.empty((2, 0), dtype=torch.long)
        contact_union_index = torch.empty((0,), dtype=torch.long)
        contact_negation_mask = torch.empty((0,), dtype=torch.bool)
        contact_thresholds = torch.empty((0,), dtype=torch.float32)

    # Residue and chain constraints ----------------------------------------------------------
    rdkit_rows: list[tuple[int, int]] = []
    rdkit_bond: list[bool] = []
    rdkit_angle: list[bool] = []
    rdkit_lo: list[float] = []
    rdkit_hi: list[float] = []
    chiral_rows, chiral_ref, chiral_r = [], [], []
    stereo_rows, stereo_ref, stereo_e = [], [], []
    planar_rows, ring5_rows, ring6_rows = [], [], []
    for i, lig in ligands:
        a0 = int(tok_atom_start[int(chain_starts[i])])
        nbrs: dict[int, list[int]] = {}
        for a, b, _ in lig.bonds:
            nbrs.setdefault(a, []).append(b)
            nbrs.setdefault(b, []).append(a)
            d = float((lig.pos[a] - lig.pos[b]).norm())
            rdkit_rows.append((a0 + a, a0 + b))
            rdkit_bond.append(True)
            rdkit_angle.append(False)
            rdkit_lo.append(d - 0.05)
            rdkit_hi.append(d + 0.05)
        for center_idx in sorted(nbrs):
            around = sorted(nbrs[center_idx])
            for x in range(len(around)):
                for y in range(x + 1, len(around)):
                    a, b = around[x], around[y]
                    d = float((lig.pos[a] - lig.pos[b]).norm())
                    rdkit_rows.append((a0 + a, a0 + b))
                    rdkit_bond.append(False)
                    rdkit_angle.append(True)
                    rdkit_lo.append(d - 0.2)
                    rdkit_hi.append(d + 0.2)
        for n0, n1, n2, c, is_r in lig.chiral:
            chiral_rows.append((a0 + n0, a0 + n1, a0 + n2, a0 + c))
            chiral_ref.append(True)
            chiral_r.append(is_r)
        for p0, p1, p2, p3, is_e in lig.stereo:
            stereo_rows.append((a0 + p0, a0 + p1, a0 + p2, a0 + p3))
            stereo_ref.append(True)
            stereo_e.append(is_e)
        planar_rows += [tuple(a0 + x for x in row) for row in lig.planar]
        ring5_rows += [tuple(a0 + x for x in row) for row in lig.ring5]
        ring6_rows += [tuple(a0 + x for x in row) for row in lig.ring6]

    residue_constraints = {
        "rdkit_bounds_index": _index_list(rdkit_rows, 2),
        "rdkit_bounds_bond_mask": torch.tensor(rdkit_bond, dtype=torch.bool),
        "rdkit_bounds_angle_mask": torch.tensor(rdkit_angle, dtype=torch.bool),
        "rdkit_upper_bounds": torch.tensor(rdkit_hi, dtype=torch.float32),
        "rdkit_lower_bounds": torch.tensor(rdkit_lo, dtype=torch.float32),
        "chiral_atom_index": _index_list(chiral_rows, 4),
        "chiral_reference_mask": torch.tensor(chiral_ref, dtype=torch.bool),
        "chiral_atom_orientations": torch.tensor(chiral_r, dtype=torch.bool),
        "stereo_bond_index": _index_list(stereo_rows, 4),
        "stereo_reference_mask": torch.tensor(stereo_ref, dtype=torch.bool),
        "stereo_bond_orientations": torch.tensor(stereo_e, dtype=torch.bool),
        "planar_bond_index": _index_list(planar_rows, 6),
        "planar_ring_5_index": _index_list(ring5_rows, 5),
        "planar_ring_6_index": _index_list(ring6_rows, 6),
    }
    chain_entity = [c.entity for c in chains]
    symmetric = [
        (a, b)
        for a in range(len(chains))
        for b in range(a + 1, len(chains))
        if chain_entity[a] == chain_entity[b]
    ]
    chain_constraints = {
        "connected_chain_index": _index_list([covalent[:2]] if covalent else [], 2),
        "connected_atom_index": _index_list([covalent[2:]] if covalent else [], 2),
        "symmetric_chain_index": _index_list(symmetric, 2),
    }

    # Per-atom extras (boltz2) ------------------------------------------------------------------
    bfactor = torch.where(
        atom_resolved, 15.0 + 45.0 * torch.rand(n_atoms, generator=g), torch.zeros(())
    )
    plddt = torch.ones(n_atoms, dtype=torch.float32)

    # Reference conformers -----------------------------------------------------------------
    new_res = torch.ones(n, dtype=torch.bool)
    new_res[1:] = (tok_asym[1:] != tok_asym[:-1]) | (tok_resid[1:] != tok_resid[:-1])
    tok_uid = new_res.long().cumsum(0) - 1
    atom_uid = tok_uid[atom_tok]
    n_uid = int(tok_uid[-1]) + 1
    ref_local = (tab.ideal[atom_type, atom_local] - tab.ideal_centroid[atom_type]).double()
    for i, lig in ligands:
        a0 = int(tok_atom_start[int(chain_starts[i])])
        ref_local[a0 : a0 + len(lig.names)] = lig.pos - lig.pos.mean(0)
    if v2:
        uid_rot = _random_rotations(n_uid, g).double()
        uid_shift = torch.randn(n_uid, 3, generator=g, dtype=torch.float64)
        ref_pos = torch.einsum("aij,aj->ai", uid_rot[atom_uid], ref_local) + uid_shift[atom_uid]
    else:
        glob_rot = _random_rotations(1, g)[0].double()
        glob_shift = torch.randn(3, generator=g, dtype=torch.float64)
        ref_pos = ref_local @ glob_rot.T + glob_shift
    ref_pos = ref_pos.float()

    # Padding ------------------------------------------------------------------------------------
    def atoms(x: Tensor, dim: int = 0) -> Tensor:
        return _pad(x, dim, a_len)

    def toks(x: Tensor, dim: int = 0, value: float = 0) -> Tensor:
        return _pad(x, dim, n_len, value)

    out: dict[str, Tensor] = {
        "token_index": toks(torch.arange(n)),
        "residue_index": toks(tok_resid),
        "asym_id": toks(tok_asym.long()),
        "entity_id": toks(tok_entity.long()),
        "sym_id": toks(tok_sym.long()),
        "mol_type": toks(tok_kind),
        "res_type": _one_hot(tok_token_id, _NUM_TOKENS, (n_len,), torch.long),
        "disto_center": toks(disto_center),
        "token_bonds": token_bonds.unsqueeze(-1),
        "token_pad_mask": toks(torch.ones(n, dtype=torch.float32)),
        "token_resolved_mask": toks(tok_resolved.float()),
        "token_disto_mask": toks(tok_resolved.float()),
        "ref_pos": atoms(ref_pos),
        "atom_resolved_mask": atoms(atom_resolved),
        "ref_element": _one_hot(element, _NUM_ELEMENTS, (a_len,), torch.long),
        "ref_atom_name_chars": _one_hot(
            name_chars % _NUM_NAME_CHARS, _NUM_NAME_CHARS, (a_len, 4), torch.long
        ),
        "ref_space_uid": atoms(atom_uid),
        "coords": atoms(coords, 1),
        "atom_pad_mask": atoms(torch.ones(n_atoms, dtype=torch.float32)),
        "atom_to_token": atom_to_token,
        "token_to_rep_atom": token_to_rep_atom,
        "r_set_to_rep_atom": r_set_to_rep_atom,
        "disto_target": disto_target,
        "msa_paired": toks(paired, 1),
        "deletion_value": toks(deletion_value, 1),
        "has_deletion": toks(has_deletion, 1),
        "deletion_mean": toks(deletion_mean),
        "profile": toks(profile),
        "msa_mask": toks(msa_mask, 1),
        **residue_constraints,
        **chain_constraints,
    }
    if v2:
        out.update(
            {
                "type_bonds": type_bonds,
                "contact_conditioning": contact_conditioning,
                "contact_threshold": toks(toks(contact_threshold), 1),
                "method_feature": toks(torch.full((n,), _METHOD_XRAY, dtype=torch.long)),
                "modified": toks(torch.zeros(n, dtype=torch.long)),
                "cyclic_period": toks(torch.zeros(n, dtype=torch.float32)),
                "affinity_token_mask": toks(torch.zeros(n, dtype=torch.float32)),
                "ref_charge": atoms(charge.float()),
                "ref_chirality": atoms(chirality),
                "atom_backbone_feat": _one_hot(
                    backbone, _NUM_BACKBONE_CLASSES, (a_len,), torch.long
                ),
                "token_to_center_atom": _one_hot(center_atom, a_len, (n_len,), torch.long),
                "disto_coords_ensemble": toks(disto_ens, 1),
                "bfactor": atoms(bfactor),
                "plddt": atoms(plddt),
                "frames_idx": toks(frames_idx, 1),
                "frame_resolved_mask": toks(frame_resolved_mask, 1),
                "msa": toks(msa, 1, _GAP),
                "ensemble_ref_idxs": torch.arange(e_count),
                "contact_pair_index": contact_pair_index,
                "contact_union_index": contact_union_index,
                "contact_negation_mask": contact_negation_mask,
                "contact_thresholds": contact_thresholds,
                **_dummy_templates(n_templates, n_len),
            }
        )
    else:
        out.update(
            {
                "pocket_feature": _one_hot(pocket, _NUM_POCKET_CLASSES, (n_len,), torch.long),
                "cyclic_period": toks(torch.zeros(n, dtype=torch.int32)),
                "ref_charge": atoms(charge.to(torch.int8)),
                "frames_idx": toks(frames_idx),
                "frame_resolved_mask": toks(frame_resolved_mask),
                "msa": toks(msa_onehot, 1, _GAP),
            }
        )
    return {k: out[k].contiguous() for k in sorted(out)}


def _pairwise_to(x: Tensor, y: Tensor) -> Tensor:
    return torch.cdist(x.float(), y.float(), compute_mode="donot_use_mm_for_euclid_dist")


def _sample_tokens(start: Tensor, stop: Tensor, g: torch.Generator, k: int = 64) -> Tensor:
    s, e = int(start), int(stop)
    if e - s <= k:
        return torch.arange(s, e)
    return s + torch.randperm(e - s, generator=g)[:k].sort().values


def _dummy_templates(t: int, n: int) -> dict[str, Tensor]:
    return {
        "template_restype": F.one_hot(torch.zeros(t, n, dtype=torch.long), _NUM_TOKENS),
        "template_frame_rot": torch.zeros(t, n, 3, 3, dtype=torch.float32),
        "template_frame_t": torch.zeros(t, n, 3, dtype=torch.float32),
        "template_cb": torch.zeros(t, n, 3, dtype=torch.float32),
        "template_ca": torch.zeros(t, n, 3, dtype=torch.float32),
        "template_mask_cb": torch.zeros(t, n, dtype=torch.float32),
        "template_mask_frame": torch.zeros(t, n, dtype=torch.float32),
        "template_mask": torch.zeros(t, n, dtype=torch.float32),
        "query_to_template": torch.zeros(t, n, dtype=torch.long),
        "visibility_ids": torch.zeros(t, n, dtype=torch.float32),
    }


def chains_of(features: Mapping[str, Tensor]) -> list[tuple[int, int, int]]:
    """List the chains of a feature dict as contiguous token ranges.

    Parameters
    ----------
    features : Mapping[str, torch.Tensor]
        A dict from :func:`make_complex` (either preset); reads ``asym_id`` ``[N]`` and
        ``token_pad_mask`` ``[N]``.

    Returns
    -------
    list[tuple[int, int, int]]
        ``(asym_id, start, stop)`` per chain, in token order, over real tokens only;
        tokens ``start:stop`` belong to the chain.
    """
    asym = features["asym_id"][features["token_pad_mask"] > 0].tolist()
    out: list[tuple[int, int, int]] = []
    for i, a in enumerate(asym):
        if out and out[-1][0] == a:
            out[-1] = (a, out[-1][1], i + 1)
        else:
            out.append((a, i, i + 1))
    return out
