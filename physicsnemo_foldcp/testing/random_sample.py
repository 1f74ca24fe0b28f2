"""Random feature dicts over every axis kind, for property-based tests of the scatter.

Unlike :func:`physicsnemo_foldcp.data.synthetic.make_complex`, which mimics real
chemistry, these samples stress the layout: any atom count per token (including tokens
with none), trailing pad atoms, any MSA depth and conformer count, any float dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from physicsnemo_foldcp.features.registry import FeatureRegistry
from physicsnemo_foldcp.features.spec import (
    ATOMS,
    ENSEMBLE,
    MSA,
    PASSTHROUGH,
    REPLICATE,
    RSET,
    TEMPLATES,
    TOKENS,
    FeatureSpec,
)


def random_registry() -> FeatureRegistry:
    """A small registry with one feature of every axis kind the plan handles."""
    return FeatureRegistry(
        [
            FeatureSpec("single", (TOKENS, None)),
            FeatureSpec("token_mask", (TOKENS,)),
            FeatureSpec("pair", (TOKENS, TOKENS, None)),
            FeatureSpec("atom_feat", (ATOMS, None)),
            FeatureSpec("atom_mask", (ATOMS,)),
            FeatureSpec("atom_to_token", (ATOMS, TOKENS), one_hot=True),
            FeatureSpec("token_to_rep_atom", (TOKENS, ATOMS), one_hot=True),
            FeatureSpec("r_set_to_rep_atom", (RSET, ATOMS), one_hot=True),
            FeatureSpec("msa", (MSA, TOKENS), pad_value=1),
            FeatureSpec("coords", (ENSEMBLE, ATOMS, None)),
            FeatureSpec("frames_idx", (ENSEMBLE, TOKENS, None), index_of=ATOMS),
            FeatureSpec("template_feat", (TEMPLATES, TOKENS)),
            FeatureSpec("atom_pairs", (None, None), index_of=ATOMS, mode=REPLICATE),
            FeatureSpec("global_scalar", (None,), mode=PASSTHROUGH),
        ],
        name="random",
    )


@dataclass(frozen=True)
class RandomSampleSpec:
    """Sizes of a random sample.

    Attributes
    ----------
    atoms_per_token : tuple[int, ...]
        Atom count of each token (0 allowed); N = its length.
    trailing_pad_atoms : int
        Atoms after the last token's, belonging to no token (pad mask 0).
    msa_rows, conformers, templates : int
        S, E, T.
    float_dtype : torch.dtype
        Dtype of the floating-point features.
    channels : int
        Size of the free axes.
    """

    atoms_per_token: tuple[int, ...]
    trailing_pad_atoms: int = 0
    msa_rows: int = 1
    conformers: int = 1
    templates: int = 1
    float_dtype: torch.dtype = torch.float32
    channels: int = 3


def random_sample(spec: RandomSampleSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """A sample of :func:`random_registry` features with the sizes of ``spec``.

    Parameters
    ----------
    spec : RandomSampleSpec
        Sizes and dtype.
    seed : int
        Seed of a local generator (the result is deterministic).

    Returns
    -------
    dict[str, torch.Tensor]
        Unbatched features: N tokens, A = sum(atoms_per_token) + trailing_pad_atoms atoms.

    Raises
    ------
    ValueError
        If the sample would have no atom at all (atom-index features need one).
    """
    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor(spec.atoms_per_token, dtype=torch.long)
    n = len(counts)
    real_atoms = int(counts.sum())
    a = real_atoms + spec.trailing_pad_atoms
    if a == 0:
        raise ValueError("a random sample needs at least one atom")
    c, fdt = spec.channels, spec.float_dtype
    owner = torch.repeat_interleave(torch.arange(n), counts)
    atom_to_token = torch.zeros(a, n, dtype=torch.long)
    atom_to_token[torch.arange(real_atoms), owner] = 1
    starts = torch.cumsum(counts, 0) - counts
    has_atoms = counts > 0
    rep = torch.zeros(n, a, dtype=torch.long)
    offset = (torch.rand(n, generator=g) * counts).long()
    picked = starts + torch.minimum(offset, (counts - 1).clamp(min=0))
    rep[has_atoms.nonzero().flatten(), picked[has_atoms]] = 1
    rset = rep[has_atoms]
    atom_mask = torch.cat([torch.ones(real_atoms), torch.zeros(spec.trailing_pad_atoms)])
    return {
        "single": torch.randn(n, c, generator=g).to(fdt),
        "token_mask": torch.ones(n, dtype=torch.bool),
        "pair": torch.randn(n, n, c, generator=g).to(fdt),
        "atom_feat": torch.randn(a, c, generator=g).to(fdt),
        "atom_mask": atom_mask.to(fdt),
        "atom_to_token": atom_to_token,
        "token_to_rep_atom": rep,
        "r_set_to_rep_atom": rset,
        "msa": torch.randint(0, 33, (spec.msa_rows, n), generator=g, dtype=torch.int8),
        "coords": torch.randn(spec.conformers, a, 3, generator=g).to(fdt),
        "frames_idx": torch.randint(0, a, (spec.conformers, n, 3), generator=g),
        "template_feat": torch.randn(spec.templates, n, generator=g).to(fdt),
        "atom_pairs": torch.randint(0, a, (2, 5), generator=g),
        "global_scalar": torch.tensor([float(seed)]),
    }
