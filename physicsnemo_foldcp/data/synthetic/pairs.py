"""Token-pair features: bonds between tokens and the distogram target.

``token_bonds`` / ``type_bonds`` come from the ligand graphs and the covalent link;
``disto_target`` bins the pairwise distances of each token's distogram atom
(:data:`~physicsnemo_foldcp.data.synthetic.vocab.DISTO_BOUNDARIES`), per conformer for
Boltz-2.
"""

from __future__ import annotations

import torch
from torch import Tensor

from physicsnemo_foldcp.data.synthetic.atoms import AtomLayout
from physicsnemo_foldcp.data.synthetic.geometry import pairwise
from physicsnemo_foldcp.data.synthetic.structure import Structure
from physicsnemo_foldcp.data.synthetic.tensors import one_hot
from physicsnemo_foldcp.data.synthetic.tokens import TokenLayout
from physicsnemo_foldcp.data.synthetic.vocab import (
    BOND_COVALENT,
    DISTO_BOUNDARIES,
    NUM_DISTO_BINS,
)


def distogram_bins(x: Tensor) -> Tensor:
    """``[N, N]`` long distogram bin of the pairwise distances of ``x`` ``[N, 3]``."""
    return torch.bucketize(pairwise(x.float()), DISTO_BOUNDARIES)


def bond_features(
    tokens: TokenLayout, atoms: AtomLayout, structure: Structure, v2: bool
) -> dict[str, Tensor]:
    """``token_bonds`` ``[N, N, 1]`` float32 and, boltz2, ``type_bonds`` ``[N, N]`` long.

    Symmetric; ``type_bonds`` holds the bond type plus one (0: no bond).
    """
    rows: list[tuple[int, int, int]] = []
    for i, lig in structure.ligands:
        t0 = int(tokens.chain_starts[i])
        rows += [(t0 + a, t0 + b, kind) for a, b, kind in lig.bonds]
    if structure.covalent is not None:
        host_atom, lig_atom = structure.covalent[2], structure.covalent[3]
        rows.append((int(atoms.token[host_atom]), int(atoms.token[lig_atom]), BOND_COVALENT))
    n_len = tokens.n_len
    token_bonds = torch.zeros(n_len, n_len, dtype=torch.float32)
    type_bonds = torch.zeros(n_len, n_len, dtype=torch.long)
    if rows:
        b = torch.tensor(rows, dtype=torch.long)
        for u, w in ((b[:, 0], b[:, 1]), (b[:, 1], b[:, 0])):
            token_bonds[u, w] = 1.0
            type_bonds[u, w] = b[:, 2] + 1
    out = {"token_bonds": token_bonds.unsqueeze(-1)}
    if v2:
        out["type_bonds"] = type_bonds
    return out


def distogram_features(
    tokens: TokenLayout, atoms: AtomLayout, structure: Structure, v2: bool
) -> dict[str, Tensor]:
    """The distogram target and the positions it was binned from.

    ``disto_center`` ``[N, 3]`` (conformer 0), ``disto_target`` one-hot ``[N, N, 64]`` long
    (boltz1, conformer 0) or ``[N, N, K, 64]`` float32 (boltz2, every conformer) and, boltz2,
    ``disto_coords_ensemble`` ``[K, N, 3]``.
    """
    n_len = tokens.n_len
    ensemble = structure.raw[:, atoms.disto]  # [K, N, 3]
    center = ensemble[0].clone()
    out = {"disto_center": tokens.pad(center)}
    if v2:
        k = ensemble.shape[0]
        bins = torch.stack([distogram_bins(ensemble[i]) for i in range(k)], dim=-1)
        out["disto_target"] = one_hot(bins, NUM_DISTO_BINS, (n_len, n_len, k), torch.float32)
        out["disto_coords_ensemble"] = tokens.pad(ensemble, 1)
    else:
        bins = distogram_bins(center)
        out["disto_target"] = one_hot(bins, NUM_DISTO_BINS, (n_len, n_len), torch.long)
    return out
