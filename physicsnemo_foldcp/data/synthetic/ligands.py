"""Small-molecule ligands: heavy-atom graph, 3-D positions, chemistry and stereo constraints.

:func:`build_ligand` grows one ligand of ``m`` heavy atoms (a benzene-like ring, a fused
five-ring when large enough, then a branched tail), picks elements by degree, and records
what Boltz's constraint features read: rings, one stereo double bond, up to two chiral
centers and planar double bonds. Indices are local to the ligand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from physicsnemo_foldcp.data.synthetic.geometry import perpendicular, unit
from physicsnemo_foldcp.data.synthetic.residues import ATOMIC_NUMBER
from physicsnemo_foldcp.data.synthetic.tensors import randint, uniform
from physicsnemo_foldcp.data.synthetic.vocab import (
    BOND_AROMATIC,
    BOND_DOUBLE,
    BOND_SINGLE,
    CHI_CCW,
    CHI_CW,
)

LIGAND_BOND = 1.5
"""Bond length (Angstrom) inside a ligand."""


@dataclass
class Ligand:
    """One ligand molecule: atom positions ``[m, 3]`` (float64), chemistry and graph.

    Bonds are ``(i, j, bond type)``; rings, chiral ``(n0, n1, n2, center, is_r)``, stereo
    ``(a, i, j, b, is_e)`` and planar entries hold local atom indices.
    """

    pos: Tensor
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


@dataclass
class _Graph:
    """A ligand's atom positions and bond graph while it is grown."""

    pos: Tensor  # [m, 3] float64
    nbrs: list[list[int]]
    bonds: list[tuple[int, int, int]] = field(default_factory=list)
    ring5: list[tuple[int, ...]] = field(default_factory=list)
    ring6: list[tuple[int, ...]] = field(default_factory=list)

    def bond(self, i: int, j: int, kind: int) -> None:
        self.bonds.append((i, j, kind))
        self.nbrs[i].append(j)
        self.nbrs[j].append(i)

    def ring(self, first: int, size: int, anchor: Tensor, d: Tensor, g: torch.Generator) -> None:
        """Place an aromatic ring of ``size`` atoms from ``first``, ``d`` off ``anchor``."""
        radius = LIGAND_BOND / (2 * math.sin(math.pi / size))
        center = anchor + radius * d
        p = perpendicular(d, g)
        for k in range(size):
            t = 2 * math.pi * k / size
            self.pos[first + k] = center + radius * (-math.cos(t) * d + math.sin(t) * p)
        for k in range(size):
            self.bond(first + k, first + (k + 1) % size, BOND_AROMATIC)


def _rings(graph: _Graph, m: int, start: Tensor, d0: Tensor, g: torch.Generator) -> int:
    """A six-ring when ``m >= 6`` and a five-ring bonded to it when ``m >= 12``; atoms placed."""
    if m < 6:
        return 0
    graph.ring(0, 6, start.double(), d0, g)
    graph.ring6.append(tuple(range(6)))
    if m < 12:
        return 6
    pos = graph.pos
    d1 = unit(pos[5] - pos[:6].mean(0))
    graph.ring(6, 5, pos[5] + LIGAND_BOND * d1, d1, g)
    graph.bond(5, 6, BOND_SINGLE)
    graph.ring5.append(tuple(range(6, 11)))
    return 11


def _tail(graph: _Graph, placed: int, start: Tensor, d0: Tensor, g: torch.Generator) -> None:
    """Grow the remaining atoms as a branched tail (at most 3 neighbours per atom)."""
    pos, nbrs = graph.pos, graph.nbrs
    m = len(nbrs)
    noise = torch.randn(m, 3, generator=g, dtype=torch.float64)
    for i in range(placed, m):
        if i == 0:
            pos[0] = start.double()
            continue
        open_atoms = [j for j in range(placed, i) if len(nbrs[j]) < 3]
        open_atoms = open_atoms or [j for j in range(i) if len(nbrs[j]) < 3]
        if len(nbrs[i - 1]) < 3 and uniform(g) < 0.55:
            parent = i - 1
        elif open_atoms:
            parent = open_atoms[randint(g, 0, len(open_atoms) - 1)]
        else:
            parent = i - 1
        if nbrs[parent]:
            out = unit(pos[parent] - pos[nbrs[parent]].mean(0))
        else:
            out = d0
        pos[i] = pos[parent] + LIGAND_BOND * unit(out + 0.8 * noise[i])
        graph.bond(parent, i, BOND_SINGLE)


def _elements(degree: list[int], ring: set[int], g: torch.Generator) -> list[str]:
    """Element symbol per atom, drawn by its degree (ring atoms: C or N)."""
    elements = []
    for i, deg in enumerate(degree):
        r = uniform(g)
        if i in ring:
            elements.append("N" if r < 0.12 else "C")
        elif deg <= 1:
            elements.append("C" if r < 0.5 else "O" if r < 0.75 else "N" if r < 0.9 else "F")
        elif deg == 2:
            elements.append("C" if r < 0.7 else "N" if r < 0.85 else "O" if r < 0.97 else "S")
        else:
            elements.append("C" if r < 0.85 else "N")
    return elements


def _stereo(
    lig: Ligand, nbrs: list[list[int]], symbols: list[str], in_ring: set[int], g: torch.Generator
) -> None:
    """One C=C double bond off the rings (stereo, planar), then up to two chiral carbons."""
    degree = [len(n) for n in nbrs]
    bonds = lig.bonds
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
        bonds[b] = (i, j, BOND_DOUBLE)
        double_atoms = {i, j}
        ni = sorted(k for k in nbrs[i] if k != j)
        nj = sorted(k for k in nbrs[j] if k != i)
        lig.stereo.append((ni[0], i, j, nj[0], uniform(g) < 0.5))
        if len(ni) == 2 and len(nj) == 2:
            lig.planar.append((i, ni[0], ni[1], j, nj[0], nj[1]))
    for c in range(len(nbrs)):
        if c in in_ring or c in double_atoms or degree[c] < 3 or symbols[c] != "C":
            continue
        is_r = uniform(g) < 0.5
        n0, n1, n2 = sorted(nbrs[c], reverse=True)[:3]
        lig.chiral.append((n0, n1, n2, c, is_r))
        lig.chirality[c] = CHI_CW if is_r else CHI_CCW
        if len(lig.chiral) == 2:
            break


def build_ligand(m: int, start: Tensor, direction: Tensor, g: torch.Generator) -> Ligand:
    """Build a small ligand of ``m`` heavy atoms: rings, a branched tail, constraints.

    Parameters
    ----------
    m : int
        Heavy atoms.
    start : torch.Tensor
        ``[3]`` position of the first atom (the ring's anchor).
    direction : torch.Tensor
        ``[3]`` direction the ligand grows in.
    g : torch.Generator
        The complex's generator.
    """
    graph = _Graph(pos=torch.zeros(m, 3, dtype=torch.float64), nbrs=[[] for _ in range(m)])
    d0 = unit(direction.double())
    placed = _rings(graph, m, start, d0, g)
    in_ring = set(range(placed))
    _tail(graph, placed, start, d0, g)

    degree = [len(n) for n in graph.nbrs]
    symbols = _elements(degree, in_ring, g)
    numbering: dict[str, int] = {}
    names = []
    for s in symbols:
        numbering[s] = numbering.get(s, 0) + 1
        names.append(f"{s}{numbering[s]}")
    charge = [
        1 if s == "N" and degree[i] == 1 and i not in in_ring else 0 for i, s in enumerate(symbols)
    ]
    lig = Ligand(
        pos=graph.pos,
        element=[ATOMIC_NUMBER[s] for s in symbols],
        names=names,
        charge=charge,
        chirality=[0] * m,
        bonds=graph.bonds,
        ring5=graph.ring5,
        ring6=graph.ring6,
    )
    _stereo(lig, graph.nbrs, symbols, in_ring, g)
    return lig
