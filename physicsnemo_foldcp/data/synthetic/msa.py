"""The multiple sequence alignment: rows of mutated query sequences and their statistics.

Row 0 is the query; the other rows mutate 20% of the protein positions, gap 5% (and every
non-protein position), and mark deletions at 5% of the protein positions; the first half
of them are paired. ``profile`` and ``deletion_mean`` are column statistics over all rows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from physicsnemo_foldcp.data.synthetic.tokens import TokenLayout
from physicsnemo_foldcp.data.synthetic.vocab import GAP, NUM_TOKENS, TOKEN_IDS


def _alignment(tokens: TokenLayout, rows: int, g: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """``(msa [S, N] long ids, deletions [S, N] counts, paired [S, N])``, unpadded."""
    n, is_protein = tokens.n, tokens.is_protein
    msa = tokens.token_id.expand(rows, n).clone()
    deletion = torch.zeros(rows, n)
    paired = torch.zeros(rows, n)
    paired[0] = 1.0
    if rows > 1:
        r = torch.rand(3, rows - 1, n, generator=g)
        mutant = torch.randint(TOKEN_IDS["ALA"], TOKEN_IDS["VAL"] + 1, (rows - 1, n), generator=g)
        others = msa[1:]
        others[r[0] < 0.2] = mutant[r[0] < 0.2]
        others[r[1] < 0.05] = GAP
        others[:, ~is_protein] = GAP
        counts = torch.randint(1, 10, (rows - 1, n), generator=g).float()
        deletion[1:] = torch.where((r[2] < 0.05) & is_protein, counts, 0.0)
        paired_rows = (torch.arange(1, rows) <= (rows - 1) // 2)[:, None]
        paired[1:] = (paired_rows & is_protein).float()
    return msa, deletion, paired


def msa_features(tokens: TokenLayout, rows: int, v2: bool, g: torch.Generator) -> dict[str, Tensor]:
    """The MSA features, token-padded (``msa`` with the gap id, the others with 0).

    ``msa`` ``[S, N]`` long (boltz1: ``[S, N, 33]`` one-hot), ``msa_mask`` ``[S, N]`` long,
    ``msa_paired``, ``deletion_value`` ``[S, N]`` float32, ``has_deletion`` ``[S, N]`` bool,
    ``profile`` ``[N, 33]`` and ``deletion_mean`` ``[N]`` float32.
    """
    toks = tokens.pad
    msa, deletion, paired = _alignment(tokens, rows, g)
    msa_onehot = F.one_hot(msa, NUM_TOKENS)
    deletion_value = (math.pi / 2) * torch.arctan(deletion / 3)
    return {
        "msa": toks(msa, 1, GAP) if v2 else toks(msa_onehot, 1, GAP),
        "msa_paired": toks(paired, 1),
        "deletion_value": toks(deletion_value, 1),
        "has_deletion": toks(deletion > 0, 1),
        "deletion_mean": toks(deletion_value.mean(0)),
        "profile": toks(msa_onehot.float().mean(0)),
        "msa_mask": toks(torch.ones(rows, tokens.n, dtype=torch.long), 1),
    }
