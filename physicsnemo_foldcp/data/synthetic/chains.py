"""Composition of a complex: how many tokens of each kind, and which chains carry them.

:func:`plan_chains` turns token counts per molecule kind into chains (a protein homodimer
when large enough, a DNA duplex, an RNA chain, ligands of 3-30 atoms) with their entity
and symmetry ids; :func:`chains_of` reads the chains back from a feature dict.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from physicsnemo_foldcp.data.synthetic.residues import (
    AA_FREQUENCIES,
    AA_ROWS,
    DNA_ROWS,
    LIG,
    RNA_ROWS,
)
from physicsnemo_foldcp.data.synthetic.tensors import randint
from physicsnemo_foldcp.data.synthetic.vocab import KINDS

DEFAULT_COMPOSITION = {"protein": 0.7, "dna": 0.1, "rna": 0.1, "ligand": 0.1}
"""Token fractions per molecule kind when none is given."""


@dataclass
class Chain:
    """One chain: its kind, its residue-table rows ``[L]`` (long), entity and copy number."""

    kind: str
    types: Tensor
    entity: int = 0
    sym: int = 0


def kind_counts(n_tokens: int, composition: Mapping[str, float] | None) -> dict[str, int]:
    """Tokens per molecule kind: ``n_tokens`` split by the composition's fractions.

    Raises
    ------
    ValueError
        For an unknown kind, a negative fraction or fractions that sum to 0.
    """
    comp = dict(DEFAULT_COMPOSITION if composition is None else composition)
    unknown = set(comp) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown composition kinds {sorted(unknown)}; use {KINDS}")
    if any(v < 0 for v in comp.values()) or sum(comp.values()) <= 0:
        raise ValueError("composition fractions must be >= 0 with a positive sum")
    total = float(sum(comp.values()))
    share = {k: n_tokens * comp.get(k, 0.0) / total for k in KINDS}
    counts = {k: int(math.floor(v)) for k, v in share.items()}
    by_remainder = sorted(KINDS, key=lambda k: (-(share[k] - counts[k]), KINDS.index(k)))
    for k in by_remainder[: n_tokens - sum(counts.values())]:
        counts[k] += 1
    return counts


def _split(total: int, parts: int, g: torch.Generator) -> list[int]:
    """Split ``total`` into ``parts`` positive sizes, roughly balanced."""
    weights = 0.6 + torch.rand(parts, generator=g, dtype=torch.float64)
    sizes = [max(1, int(total * float(w) / float(weights.sum()))) for w in weights]
    sizes[-1] = total - sum(sizes[:-1])
    return sizes


def _protein_chains(n_prot: int, g: torch.Generator) -> list[Chain]:
    """A homodimer plus one or two other chains when ``n_prot >= 24``, else one chain."""
    freq = torch.tensor(AA_FREQUENCIES, dtype=torch.float64)

    def protein(length: int) -> Tensor:
        return AA_ROWS[torch.multinomial(freq, length, replacement=True, generator=g)]

    chains: list[Chain] = []
    if n_prot >= 24:
        dimer = randint(g, n_prot // 5, n_prot // 3)
        seq = protein(dimer)
        chains += [Chain("protein", seq), Chain("protein", seq.clone())]
        rest = n_prot - 2 * dimer
        if rest > 0:
            parts = 2 if rest >= 60 else 1
            chains += [Chain("protein", protein(s)) for s in _split(rest, parts, g)]
    elif n_prot > 0:
        chains.append(Chain("protein", protein(n_prot)))
    return chains


def _nucleic_chains(n_dna: int, n_rna: int, g: torch.Generator) -> list[Chain]:
    """A DNA duplex (or one DNA token) and an RNA chain."""
    chains: list[Chain] = []
    if n_dna >= 2:
        half = n_dna // 2
        strand = torch.randint(0, 4, (n_dna - half,), generator=g)
        complement = torch.tensor([3, 2, 1, 0])[strand[:half].flip(0)]  # DA<->DT, DG<->DC
        chains.append(Chain("dna", DNA_ROWS[strand]))
        chains.append(Chain("dna", DNA_ROWS[complement]))
    elif n_dna == 1:
        chains.append(Chain("dna", DNA_ROWS[torch.randint(0, 4, (1,), generator=g)]))
    if n_rna > 0:
        chains.append(Chain("rna", RNA_ROWS[torch.randint(0, 4, (n_rna,), generator=g)]))
    return chains


def _ligand_chains(n_ligand: int, g: torch.Generator) -> list[Chain]:
    """Ligands of 3-30 heavy atoms (the last one takes what is left)."""
    chains: list[Chain] = []
    left = n_ligand
    while left > 0:
        size = min(left, randint(g, 3, 30))
        chains.append(Chain("ligand", torch.full((size,), LIG, dtype=torch.long)))
        left -= size
    return chains


def plan_chains(counts: dict[str, int], g: torch.Generator) -> list[Chain]:
    """Chains of a complex with ``counts`` tokens per kind, in token order.

    Identical polymer sequences share an entity (``sym`` numbers the copies); every ligand
    is its own entity.
    """
    chains = _protein_chains(counts["protein"], g)
    chains += _nucleic_chains(counts["dna"], counts["rna"], g)
    chains += _ligand_chains(counts["ligand"], g)
    seen: dict[tuple[str, tuple[int, ...]], int] = {}
    copies: dict[int, int] = {}
    for index, chain in enumerate(chains):
        polymer = chain.kind != "ligand"
        key = (chain.kind, tuple(chain.types.tolist()) if polymer else (index,))
        chain.entity = seen.setdefault(key, len(seen))
        chain.sym = copies.get(chain.entity, 0)
        copies[chain.entity] = chain.sym + 1
    return chains


def chains_of(features: Mapping[str, Tensor]) -> list[tuple[int, int, int]]:
    """List the chains of a feature dict as contiguous token ranges.

    Parameters
    ----------
    features : Mapping[str, torch.Tensor]
        A dict from :func:`~physicsnemo_foldcp.data.synthetic.make_complex` (either
        preset); reads ``asym_id`` ``[N]`` and ``token_pad_mask`` ``[N]``.

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
