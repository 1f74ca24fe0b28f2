"""A small offline molecule library in Boltz's cache layout, for tests.

Boltz-2 reads one RDKit molecule per CCD code from its cache (``~/.boltz/mols/<CODE>.pkl``):
``load_canonicals`` reads the 20 amino acids and ``UNK`` when processing starts, the parser
and the featurizer read every other residue they meet (DNA, RNA) by name. From each
molecule they read:

* each atom's ``"name"`` property (the PDB atom name), which must cover Boltz's reference
  atoms of the residue (``boltz.data.const.ref_atoms``: for a nucleotide ``P``, ``OP1``,
  ``OP2``, the sugar and the base);
* a conformer: the parser takes the one whose ``"name"`` property is ``"Computed"``, then
  ``"Ideal"``, then the first; the featurizer draws one of the molecule's conformers;
* each atom's element, formal charge and chiral tag;
* ``"leaving_atom"`` (0 or 1) per atom, where a residue is parsed as a CCD component with
  its leaving atoms dropped (a multi-residue CCD ligand, a modified residue).

:func:`write_library` builds those molecules with RDKit's ``Chem.MolFromSequence`` (the
nucleotides with a 5' phosphate, so that ``OP3``, ``P``, ``OP1``, ``OP2`` exist), adds
hydrogens, embeds one conformer with a fixed seed, and pickles each molecule with all its
properties, as Boltz does. The 20 amino acids, ``UNK``, ``DA``/``DC``/``DG``/``DT``/``DN``
and ``A``/``C``/``G``/``U``/``N`` take about a second. Nothing is downloaded; CCD ligands and
modified residues are not in it (a test uses SMILES ligands).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from pathlib import Path

PROTEIN_CODES: tuple[str, ...] = (
    "ALA",
    "ARG",
    "ASN",
    "ASP",
    "CYS",
    "GLN",
    "GLU",
    "GLY",
    "HIS",
    "ILE",
    "LEU",
    "LYS",
    "MET",
    "PHE",
    "PRO",
    "SER",
    "THR",
    "TRP",
    "TYR",
    "VAL",
    "UNK",
)
"""The residues ``load_canonicals`` reads: the 20 amino acids and ``UNK``."""

DNA_CODES: tuple[str, ...] = ("DA", "DC", "DG", "DT", "DN")
"""DNA residues (``DN``: a nucleotide of unknown base)."""

RNA_CODES: tuple[str, ...] = ("A", "C", "G", "U", "N")
"""RNA residues (``N``: a nucleotide of unknown base)."""

LIBRARY_CODES: tuple[str, ...] = PROTEIN_CODES + DNA_CODES + RNA_CODES
"""Every CCD code :func:`write_library` writes."""

_ONE_LETTER = {
    "ALA": "A",
    "ARG": "R",
    "ASN": "N",
    "ASP": "D",
    "CYS": "C",
    "GLN": "Q",
    "GLU": "E",
    "GLY": "G",
    "HIS": "H",
    "ILE": "I",
    "LEU": "L",
    "LYS": "K",
    "MET": "M",
    "PHE": "F",
    "PRO": "P",
    "SER": "S",
    "THR": "T",
    "TRP": "W",
    "TYR": "Y",
    "VAL": "V",
    "UNK": "A",  # no sequence letter: Boltz's UNK atoms are ALA's (N, CA, C, O, CB)
}

_PROTEIN, _RNA_5P, _DNA_5P = 0, 3, 7
"""``Chem.MolFromSequence`` flavours: L-amino acids; RNA and DNA with a 5' phosphate."""

_LEAVING = frozenset({"OXT", "OP3"})
"""Heavy atoms a linked residue loses (with the hydrogens bonded to them)."""


def _sequence_of(code: str) -> tuple[str, int]:
    """The one-letter sequence and ``MolFromSequence`` flavour that build ``code``."""
    if code in _ONE_LETTER:
        return _ONE_LETTER[code], _PROTEIN
    if code in DNA_CODES:
        return ("A" if code == "DN" else code[1]), _DNA_5P
    if code in RNA_CODES:
        return ("A" if code == "N" else code), _RNA_5P
    raise ValueError(f"no recipe for residue {code!r}; the library holds {list(LIBRARY_CODES)}")


def _backbone_only(mol):
    """``mol`` (a nucleotide) without its base: the phosphate and the sugar (``N``, ``DN``)."""
    from rdkit import Chem

    keep = {"OP3", "P", "OP1", "OP2"}
    editable = Chem.RWMol(mol)
    base = [
        atom.GetIdx()
        for atom in mol.GetAtoms()
        if not ((name := atom.GetPDBResidueInfo().GetName().strip()) in keep or name.endswith("'"))
    ]
    for index in sorted(base, reverse=True):
        editable.RemoveAtom(index)
    out = editable.GetMol()
    Chem.SanitizeMol(out)
    return out


def residue_molecule(code: str, *, seed: int = 0):
    """One residue as Boltz's cache holds it: named atoms, hydrogens, one conformer.

    Parameters
    ----------
    code : str
        A CCD code of :data:`LIBRARY_CODES`.
    seed : int, default 0
        Seed of the conformer embedding (the same seed gives the same coordinates).

    Returns
    -------
    rdkit.Chem.Mol
        ``A_r`` atoms, hydrogens included. Atom properties: ``"name"`` (the PDB atom name;
        hydrogens ``H1``, ``H2``, ... as RDKit numbers them) and ``"leaving_atom"`` (1 for
        ``OXT`` / ``OP3`` and their hydrogens). One conformer, named ``"Computed"``.

    Raises
    ------
    ValueError
        For a code the library has no recipe for, or when no conformer can be embedded.
    """
    from rdkit import Chem
    from rdkit.Chem import AllChem

    letters, flavour = _sequence_of(code)
    mol = Chem.MolFromSequence(letters, flavor=flavour)
    if code in ("N", "DN"):
        mol = _backbone_only(mol)
    mol = Chem.AddHs(mol, addResidueInfo=True)
    for atom in mol.GetAtoms():
        atom.SetProp("name", atom.GetPDBResidueInfo().GetName().strip())
    for atom in mol.GetAtoms():
        heavy = atom if atom.GetAtomicNum() > 1 else atom.GetNeighbors()[0]
        atom.SetIntProp("leaving_atom", int(heavy.GetProp("name") in _LEAVING))
    params = AllChem.ETKDGv3()
    params.randomSeed = seed
    conf_id = AllChem.EmbedMolecule(mol, params)
    if conf_id < 0:
        raise ValueError(f"RDKit embedded no conformer for residue {code!r} (seed {seed})")
    mol.GetConformer(conf_id).SetProp("name", "Computed")
    mol.SetProp("name", code)
    return mol


def write_library(
    directory: str | Path, codes: Iterable[str] = LIBRARY_CODES, *, seed: int = 0
) -> Path:
    """Write ``<directory>/mols/<CODE>.pkl`` for each code, as Boltz's cache lays them out.

    Parameters
    ----------
    directory : str or Path
        The cache directory (made when missing); the molecules go to its ``mols/``.
    codes : iterable of str, default LIBRARY_CODES
        CCD codes to write (a test may leave one out to see the error).
    seed : int, default 0
        Seed of every conformer embedding.

    Returns
    -------
    Path
        The molecule directory ``<directory>/mols`` (Boltz's ``mol_dir``).
    """
    from rdkit import Chem

    mols = Path(directory) / "mols"
    mols.mkdir(parents=True, exist_ok=True)
    # Without this, pickling drops the atom and conformer properties (the names).
    Chem.SetDefaultPickleProperties(Chem.PropertyPickleOptions.AllProps)
    for code in codes:
        molecule = residue_molecule(code, seed=seed)
        with (mols / f"{code}.pkl").open("wb") as handle:
            pickle.dump(molecule, handle)
    return mols


__all__ = [
    "DNA_CODES",
    "LIBRARY_CODES",
    "PROTEIN_CODES",
    "RNA_CODES",
    "residue_molecule",
    "write_library",
]
