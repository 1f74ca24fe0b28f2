"""Random feature dicts over every axis kind, for property-based tests of the scatter.

Unlike :func:`physicsnemo_foldcp.data.synthetic.make_complex`, which mimics real
chemistry, these samples stress the layout: any atom count per token (including tokens
with none), trailing pad atoms, any MSA depth and conformer count, any float dtype.

The length of each axis is the size its :class:`~physicsnemo_foldcp.features.axes.Axis`
names (``sample_size``, :meth:`RandomSampleSpec.length`), so a feature of a new axis
meaning is drawn by :func:`random_feature` (``random_sample(..., registry=...)``) with no
change here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from physicsnemo_foldcp.features.axes import Axis, axis_of
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
    sizes : tuple of (str, int)
        Further sizes by name, for axes whose ``sample_size`` names none of the above.
    """

    atoms_per_token: tuple[int, ...]
    trailing_pad_atoms: int = 0
    msa_rows: int = 1
    conformers: int = 1
    templates: int = 1
    float_dtype: torch.dtype = torch.float32
    channels: int = 3
    sizes: tuple[tuple[str, int], ...] = ()

    @property
    def n_tokens(self) -> int:
        """N: one token per entry of ``atoms_per_token``."""
        return len(self.atoms_per_token)

    @property
    def n_atoms(self) -> int:
        """A: every token's atoms, then the trailing pad atoms."""
        return sum(self.atoms_per_token) + self.trailing_pad_atoms

    @property
    def rset_rows(self) -> int:
        """R: one row per token that has an atom."""
        return sum(1 for c in self.atoms_per_token if c > 0)

    def length(self, axis: str | Axis) -> int:
        """Length of ``axis`` in the sample: the size its ``Axis.sample_size`` names.

        A field or property of this object, else an entry of :attr:`sizes`; 1 when the axis
        names no size or the size is not given.
        """
        key = axis_of(axis).sample_size
        if key is None:
            return 1
        return int(dict(self.sizes).get(key, getattr(self, key, 1)))


def random_feature(
    feature: FeatureSpec, spec: RandomSampleSpec, g: torch.Generator
) -> torch.Tensor:
    """A random tensor of one registry feature, each axis of its length in ``spec``.

    Free axes are ``spec.channels`` long. Index-valued features hold indices into their
    target axis; otherwise floats are normal, bools True, integers in ``[0, 8)``. One-hot
    maps relate the sample's own atoms and tokens and are not drawn here.

    Parameters
    ----------
    feature : FeatureSpec
        The feature (its axes, dtypes and ``index_of``).
    spec : RandomSampleSpec
        The sample's sizes and float dtype.
    g : torch.Generator
        The generator to draw from.
    """
    if feature.one_hot:
        raise ValueError(f"{feature.name}: a one-hot map is not drawn at random")
    shape = tuple(spec.channels if a is None else spec.length(a) for a in feature.axes)
    if feature.index_of is not None:
        dtype = feature.dtypes[0] if feature.dtypes else torch.int64
        high = max(spec.length(feature.index_of), 1)
        return torch.randint(0, high, shape, generator=g).to(dtype)
    dtype = feature.dtypes[0] if feature.dtypes else spec.float_dtype
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.ones(shape, dtype=torch.bool)
    return torch.randint(0, 8, shape, generator=g).to(dtype)


def random_sample(
    spec: RandomSampleSpec, seed: int = 0, registry: FeatureRegistry | None = None
) -> dict[str, torch.Tensor]:
    """A sample of :func:`random_registry` features with the sizes of ``spec``.

    Parameters
    ----------
    spec : RandomSampleSpec
        Sizes and dtype.
    seed : int
        Seed of a local generator (the result is deterministic).
    registry : FeatureRegistry, optional
        Also draw every feature of this registry that :func:`random_registry` lacks
        (:func:`random_feature`, in sorted order after the others, so that those stay the
        same), e.g. a feature of a new axis meaning.

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
    n = spec.length(TOKENS)
    real_atoms = int(counts.sum())
    a = spec.length(ATOMS)
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
    msa, conformers, templates = (spec.length(x) for x in (MSA, ENSEMBLE, TEMPLATES))
    sample = {
        "single": torch.randn(n, c, generator=g).to(fdt),
        "token_mask": torch.ones(n, dtype=torch.bool),
        "pair": torch.randn(n, n, c, generator=g).to(fdt),
        "atom_feat": torch.randn(a, c, generator=g).to(fdt),
        "atom_mask": atom_mask.to(fdt),
        "atom_to_token": atom_to_token,
        "token_to_rep_atom": rep,
        "r_set_to_rep_atom": rset,
        "msa": torch.randint(0, 33, (msa, n), generator=g, dtype=torch.int8),
        "coords": torch.randn(conformers, a, 3, generator=g).to(fdt),
        "frames_idx": torch.randint(0, a, (conformers, n, 3), generator=g),
        "template_feat": torch.randn(templates, n, generator=g).to(fdt),
        "atom_pairs": torch.randint(0, a, (2, 5), generator=g),
        "global_scalar": torch.tensor([float(seed)]),
    }
    for name in registry or ():
        if name not in sample:
            sample[name] = random_feature(registry[name], spec, g)
    return sample
