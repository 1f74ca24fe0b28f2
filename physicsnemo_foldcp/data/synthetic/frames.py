"""Frames: the three atoms that define each token's local frame, and whether it is valid.

Polymer tokens use their residue's frame atoms (``N, CA, C``; ``C1', C3', C4'``); a ligand
atom of a ligand with at least 3 atoms uses its two nearest ligand atoms, per conformer.
A frame is valid when its token is resolved and its atoms are not collinear.
"""

from __future__ import annotations

import torch
from torch import Tensor

from physicsnemo_foldcp.data.synthetic.atoms import AtomLayout
from physicsnemo_foldcp.data.synthetic.geometry import not_collinear, pairwise
from physicsnemo_foldcp.data.synthetic.residues import ResidueTables
from physicsnemo_foldcp.data.synthetic.structure import Structure
from physicsnemo_foldcp.data.synthetic.tokens import TokenLayout


def _frame(
    tokens: TokenLayout,
    atoms: AtomLayout,
    base: Tensor,
    valid: Tensor,
    structure: Structure,
    k: int,
) -> tuple[Tensor, Tensor]:
    """``(frames_idx [N, 3], frame_resolved_mask [N])`` of conformer ``k``."""
    raw = structure.raw[k]
    fr = base.clone()
    ok = valid.clone()
    for i, lig in structure.ligands:
        m = len(lig.names)
        if m < 3:
            continue
        t0 = int(tokens.chain_starts[i])
        a0 = int(atoms.start[t0])
        d = pairwise(raw[a0 : a0 + m])
        d.fill_diagonal_(-1.0)
        order = d.argsort(dim=1)
        fr[t0 : t0 + m] = torch.stack([order[:, 1], order[:, 0], order[:, 2]], 1) + a0
        ok[t0 : t0 + m] = True
    xyz = raw[fr]
    return fr, ok & not_collinear(xyz[:, 0], xyz[:, 1], xyz[:, 2])


def frame_features(
    tokens: TokenLayout,
    atoms: AtomLayout,
    tables: ResidueTables,
    structure: Structure,
    v2: bool,
) -> dict[str, Tensor]:
    """``frames_idx`` (long atom indices) and ``frame_resolved_mask`` (bool), token-padded.

    Boltz-1: ``[N, 3]`` and ``[N]`` of conformer 0; Boltz-2: ``[E, N, 3]`` and ``[E, N]``.
    """
    base = atoms.start[:, None] + tables.frame_local[tokens.types]  # [N, 3]
    base[~tokens.polymer] = atoms.start[~tokens.polymer, None]
    valid = tokens.polymer & tokens.resolved
    count = structure.raw.shape[0] if v2 else 1
    frames, masks = zip(*(_frame(tokens, atoms, base, valid, structure, k) for k in range(count)))
    if v2:
        return {
            "frames_idx": tokens.pad(torch.stack(frames), 1),
            "frame_resolved_mask": tokens.pad(torch.stack(masks), 1),
        }
    return {
        "frames_idx": tokens.pad(frames[0]),
        "frame_resolved_mask": tokens.pad(masks[0]),
    }
