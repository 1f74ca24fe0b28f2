"""Boltz's vocabularies and class counts: token ids, molecule kinds, feature class widths.

The ids and widths here are those of Boltz's ``const`` module; every feature family of the
synthetic generator reads them from this module and nowhere else.
"""

from __future__ import annotations

import torch
from torch import Tensor

AMINO_ACIDS: tuple[str, ...] = (
    "ALA", "ARG", "ASN", "ASP", "CYS", "GLN", "GLU", "GLY", "HIS", "ILE",
    "LEU", "LYS", "MET", "PHE", "PRO", "SER", "THR", "TRP", "TYR", "VAL",
)  # fmt: skip
"""The 20 standard amino acids, in Boltz's order."""
RNA: tuple[str, ...] = ("A", "G", "C", "U")
"""RNA nucleotides."""
DNA: tuple[str, ...] = ("DA", "DG", "DC", "DT")
"""DNA nucleotides."""

_TOKENS: tuple[str, ...] = (
    "<pad>", "-", *AMINO_ACIDS, "UNK", *RNA, "N", *DNA, "DN",
)  # fmt: skip

TOKEN_IDS: dict[str, int] = {name: i for i, name in enumerate(_TOKENS)}
"""Boltz residue-token vocabulary (33 classes): ``res_type``, ``msa`` and ``profile`` ids."""

MOL_TYPE_IDS: dict[str, int] = {"protein": 0, "dna": 1, "rna": 2, "ligand": 3}
"""``mol_type`` ids per molecule kind (Boltz ``chain_type_ids``; ligand is NONPOLYMER)."""

KINDS: tuple[str, ...] = ("protein", "dna", "rna", "ligand")
"""Molecule kinds of a complex (keys of a composition)."""

NUM_TOKENS = len(_TOKENS)
"""Classes of ``res_type``, ``msa``, ``profile`` and ``template_restype``."""
NUM_ELEMENTS = 128
"""Classes of ``ref_element`` (atomic numbers)."""
NUM_NAME_CHARS = 64
"""Classes of each of the 4 characters of ``ref_atom_name_chars``."""
NUM_DISTO_BINS = 64
"""Distogram bins of ``disto_target``."""
NUM_POCKET_CLASSES = 4
"""Classes of Boltz-1's ``pocket_feature``."""
NUM_CONTACT_CLASSES = 5
"""Classes of Boltz-2's ``contact_conditioning``."""
NUM_BACKBONE_CLASSES = 17
"""Classes of Boltz-2's ``atom_backbone_feat``."""
METHOD_XRAY = 1
"""``method_feature`` id of X-ray diffraction."""
GAP = TOKEN_IDS["-"]
"""Token id of an MSA gap (also the pad value of ``msa``)."""
UNK = TOKEN_IDS["UNK"]
"""Token id of an unknown protein residue (a ligand atom's token)."""

DISTO_BOUNDARIES: Tensor = torch.linspace(2.0, 22.0, NUM_DISTO_BINS - 1)
"""The 63 inner boundaries (Angstrom) of the 64 distogram bins: bin = #(boundaries < d)."""

POCKET_UNSELECTED, POCKET_POCKET, POCKET_BINDER = 1, 2, 3
"""``pocket_feature`` classes."""
CONTACT_UNSELECTED, CONTACT_CONTACT = 1, 4
"""``contact_conditioning`` classes."""
BOND_SINGLE, BOND_DOUBLE, BOND_AROMATIC, BOND_COVALENT = 1, 2, 4, 5
"""Bond types (``type_bonds`` holds them plus one)."""
CHI_CW, CHI_CCW = 1, 2
"""``ref_chirality`` classes."""
