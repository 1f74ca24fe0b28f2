"""Coordinates: the 3-D structure of a complex and its conformer ensemble.

Polymer chains are random walks with ideal residue conformers at random orientations;
ligands are grown next to a polymer residue (the first one covalently bound to a protein
residue); further conformers are small perturbations of the first. Placing the ligands
also writes their chemistry (element, charge, chirality, atom names) into the atom layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from physicsnemo_foldcp.data.synthetic.atoms import AtomLayout
from physicsnemo_foldcp.data.synthetic.geometry import chain_trace, random_rotations, unit
from physicsnemo_foldcp.data.synthetic.ligands import Ligand, build_ligand
from physicsnemo_foldcp.data.synthetic.residues import ResidueTables, name_chars
from physicsnemo_foldcp.data.synthetic.tensors import randint
from physicsnemo_foldcp.data.synthetic.tokens import TokenLayout

PROTEIN_STEP = 3.8
"""CA-CA distance (Angstrom) of the protein walks."""
NUCLEIC_STEP = 5.9
"""C1'-C1' distance (Angstrom) of the nucleic-acid walks."""


@dataclass
class Structure:
    """The coordinates of a complex (real atoms only).

    Attributes
    ----------
    raw : torch.Tensor
        ``[E, A, 3]`` float32 conformers in the raw frame (``disto_center`` and
        ``disto_coords_ensemble`` read them, as Boltz does).
    coords : torch.Tensor
        ``raw`` with each conformer centered on its resolved atoms (``coords``).
    ligands : list[tuple[int, Ligand]]
        ``(chain index, ligand)`` per ligand chain, in chain order.
    covalent : tuple[int, int, int, int] or None
        ``(protein chain, ligand chain, protein atom, ligand atom)`` of the covalent link.
    """

    raw: Tensor
    coords: Tensor
    ligands: list[tuple[int, Ligand]]
    covalent: tuple[int, int, int, int] | None


def _polymer_positions(
    tokens: TokenLayout,
    atoms: AtomLayout,
    tables: ResidueTables,
    radius: float,
    g: torch.Generator,
) -> Tensor:
    """``[A, 3]`` float64 atom positions of the polymers (ligand atoms are placed later)."""
    trace = torch.zeros(tokens.n, 3, dtype=torch.float64)
    for i, c in enumerate(tokens.chains):
        if c.kind == "ligand":
            continue
        s, e = int(tokens.chain_starts[i]), int(tokens.chain_starts[i + 1])
        start = 0.5 * radius * unit(torch.randn(3, generator=g, dtype=torch.float64))
        step = PROTEIN_STEP if c.kind == "protein" else NUCLEIC_STEP
        trace[s:e] = chain_trace(e - s, step, start, radius, g)
    rot = random_rotations(tokens.n, g).double()
    local = tables.ideal[atoms.type, atoms.local].double()
    return trace[atoms.token] + torch.einsum("aij,aj->ai", rot[atoms.token], local)


def _write_ligand(atoms: AtomLayout, pos: Tensor, a0: int, lig: Ligand) -> None:
    """Write a ligand's positions and chemistry at atoms ``a0 : a0 + m`` (in place)."""
    m = len(lig.names)
    pos[a0 : a0 + m] = lig.pos
    atoms.element[a0 : a0 + m] = torch.tensor(lig.element)
    atoms.charge[a0 : a0 + m] = torch.tensor(lig.charge)
    atoms.chirality[a0 : a0 + m] = torch.tensor(lig.chirality)
    atoms.name_chars[a0 : a0 + m] = torch.tensor([name_chars(x) for x in lig.names])


def _place_ligands(
    tokens: TokenLayout, atoms: AtomLayout, pos: Tensor, radius: float, g: torch.Generator
) -> tuple[list[tuple[int, Ligand]], tuple[int, int, int, int] | None]:
    """Grow every ligand chain into ``pos`` ``[A, 3]``; returns the ligands and covalent link.

    The first ligand bonds covalently to the last atom of a random resolved protein residue
    (when there is one); the others sit 4.5 A from a random polymer residue's center atom.
    """
    ligands: list[tuple[int, Ligand]] = []
    covalent: tuple[int, int, int, int] | None = None
    protein_tokens = torch.nonzero(tokens.is_protein & tokens.resolved).flatten()
    polymer_tokens = torch.nonzero(tokens.polymer).flatten()
    for i, c in enumerate(tokens.chains):
        if c.kind != "ligand":
            continue
        s = int(tokens.chain_starts[i])
        direction = torch.randn(3, generator=g, dtype=torch.float64)
        if not ligands and len(protein_tokens) > 0:
            host = int(protein_tokens[randint(g, 0, len(protein_tokens) - 1)])
            host_atom = int(atoms.start[host] + atoms.counts[host] - 1)
            out = unit(pos[host_atom] - pos[atoms.center[host]] + 0.3 * unit(direction))
            start = pos[host_atom] + 1.8 * out
            lig = build_ligand(len(c.types), start, out, g)
            covalent = (int(tokens.asym[host]), i, host_atom, int(atoms.start[s]))
        elif len(polymer_tokens) > 0:
            host = int(polymer_tokens[randint(g, 0, len(polymer_tokens) - 1)])
            start = pos[atoms.center[host]] + 4.5 * unit(direction)
            lig = build_ligand(len(c.types), start, unit(direction), g)
        else:
            start = 0.5 * radius * unit(torch.randn(3, generator=g, dtype=torch.float64))
            lig = build_ligand(len(c.types), start, unit(direction), g)
        _write_ligand(atoms, pos, int(atoms.start[s]), lig)
        ligands.append((i, lig))
    return ligands, covalent


def _conformers(
    pos0: Tensor, tokens: TokenLayout, atoms: AtomLayout, n_conformers: int, g: torch.Generator
) -> tuple[Tensor, Tensor]:
    """``(raw, coords)`` ``[E, A, 3]`` float32: conformer 0 and perturbed copies, centered."""
    raw = pos0.unsqueeze(0).repeat(n_conformers, 1, 1)
    if n_conformers > 1:
        shift = 0.3 * torch.randn(n_conformers - 1, tokens.n, 3, generator=g, dtype=torch.float64)
        jitter = 0.1 * torch.randn(
            n_conformers - 1, atoms.n_atoms, 3, generator=g, dtype=torch.float64
        )
        raw[1:] += shift[:, atoms.token] + jitter
    raw = raw.float()
    weights = atoms.resolved.float()
    center = (raw * weights[None, :, None]).sum(1) / weights.sum().clamp(min=1)
    return raw, raw - center[:, None]


def build_structure(
    tokens: TokenLayout,
    atoms: AtomLayout,
    tables: ResidueTables,
    n_conformers: int,
    g: torch.Generator,
) -> Structure:
    """Draw the coordinates of the complex (and write the ligands' chemistry into ``atoms``)."""
    radius = max(10.0, 2.2 * float(tokens.n) ** 0.38)
    pos0 = _polymer_positions(tokens, atoms, tables, radius, g)
    ligands, covalent = _place_ligands(tokens, atoms, pos0, radius, g)
    raw, coords = _conformers(pos0, tokens, atoms, n_conformers, g)
    return Structure(raw=raw, coords=coords, ligands=ligands, covalent=covalent)
