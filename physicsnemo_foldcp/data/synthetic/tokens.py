"""Tokens: the per-token layout of a complex and the token features Boltz emits.

A protein or nucleic residue is one token, a ligand heavy atom is one token; tokens are
ordered chain by chain. :func:`build_tokens` lays the chains out on the token axis (and
draws which polymer tokens are unresolved); :func:`token_features` emits the ``[N]`` and
``[N, 33]`` token features, padded to ``max_tokens``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

from physicsnemo_foldcp.data.synthetic.chains import Chain
from physicsnemo_foldcp.data.synthetic.residues import ResidueTables
from physicsnemo_foldcp.data.synthetic.tensors import one_hot, pad
from physicsnemo_foldcp.data.synthetic.vocab import METHOD_XRAY, MOL_TYPE_IDS, NUM_TOKENS

UNRESOLVED_FRACTION = 0.02
"""Share of polymer tokens drawn as unresolved (no coordinates)."""


@dataclass
class TokenLayout:
    """The token axis of a complex: ``n`` real tokens, padded to ``n_len``.

    Every tensor is ``[n]`` (real tokens only) unless stated.

    Attributes
    ----------
    chains : list[Chain]
        The chains, in token order; ``chain_starts`` ``[C + 1]`` bounds their tokens.
    types : torch.Tensor
        Residue-table row of each token.
    asym, entity, sym, kind, resid : torch.Tensor
        Chain index, entity, copy number, ``mol_type`` id, residue index (0 for ligands).
    polymer, is_protein, resolved : torch.Tensor
        Bool masks.
    token_id : torch.Tensor
        Boltz token id (``res_type`` class).
    """

    chains: list[Chain]
    n: int
    n_len: int
    types: Tensor
    asym: Tensor
    entity: Tensor
    sym: Tensor
    kind: Tensor
    resid: Tensor
    chain_starts: Tensor
    polymer: Tensor
    is_protein: Tensor
    token_id: Tensor
    resolved: Tensor

    def pad(self, x: Tensor, dim: int = 0, value: float = 0) -> Tensor:
        """Right-pad ``x``'s token axis ``dim`` from ``n`` to ``n_len``."""
        return pad(x, dim, self.n_len, value)


def build_tokens(
    chains: list[Chain],
    tables: ResidueTables,
    n_len: int,
    g: torch.Generator,
) -> TokenLayout:
    """Lay ``chains`` out on the token axis; draw unresolved polymer tokens with ``g``."""
    n = sum(len(c.types) for c in chains)
    kind = torch.cat([torch.full((len(c.types),), MOL_TYPE_IDS[c.kind]) for c in chains]).long()
    resid = torch.cat(
        [
            torch.zeros(len(c.types), dtype=torch.long)
            if c.kind == "ligand"
            else torch.arange(len(c.types))
            for c in chains
        ]
    )
    types = torch.cat([c.types for c in chains])
    polymer = kind != MOL_TYPE_IDS["ligand"]
    resolved = ~(polymer & (torch.rand(n, generator=g) < UNRESOLVED_FRACTION))
    return TokenLayout(
        chains=chains,
        n=n,
        n_len=n_len,
        types=types,
        asym=torch.cat([torch.full((len(c.types),), i) for i, c in enumerate(chains)]),
        entity=torch.cat([torch.full((len(c.types),), c.entity) for c in chains]),
        sym=torch.cat([torch.full((len(c.types),), c.sym) for c in chains]),
        kind=kind,
        resid=resid,
        chain_starts=torch.tensor([0, *itertools.accumulate(len(c.types) for c in chains)]),
        polymer=polymer,
        is_protein=kind == MOL_TYPE_IDS["protein"],
        token_id=tables.token_id[types],
        resolved=resolved,
    )


def token_features(tokens: TokenLayout, v2: bool) -> dict[str, Tensor]:
    """The per-token features, ``[N]`` (``res_type`` ``[N, 33]``), padded with 0.

    ``token_index``, ``residue_index``, ``asym_id``, ``entity_id``, ``sym_id``,
    ``mol_type``, ``res_type``, ``token_pad_mask``, ``token_resolved_mask``,
    ``token_disto_mask``, ``cyclic_period`` (int32 boltz1, float32 boltz2); boltz2 also
    ``method_feature``, ``modified`` and ``affinity_token_mask``.
    """
    n, toks = tokens.n, tokens.pad
    out = {
        "token_index": toks(torch.arange(n)),
        "residue_index": toks(tokens.resid),
        "asym_id": toks(tokens.asym.long()),
        "entity_id": toks(tokens.entity.long()),
        "sym_id": toks(tokens.sym.long()),
        "mol_type": toks(tokens.kind),
        "res_type": one_hot(tokens.token_id, NUM_TOKENS, (tokens.n_len,), torch.long),
        "token_pad_mask": toks(torch.ones(n, dtype=torch.float32)),
        "token_resolved_mask": toks(tokens.resolved.float()),
        "token_disto_mask": toks(tokens.resolved.float()),
    }
    if not v2:
        out["cyclic_period"] = toks(torch.zeros(n, dtype=torch.int32))
        return out
    out.update(
        {
            "method_feature": toks(torch.full((n,), METHOD_XRAY, dtype=torch.long)),
            "modified": toks(torch.zeros(n, dtype=torch.long)),
            "cyclic_period": toks(torch.zeros(n, dtype=torch.float32)),
            "affinity_token_mask": toks(torch.zeros(n, dtype=torch.float32)),
        }
    )
    return out
