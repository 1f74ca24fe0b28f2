"""Hypothesis strategies for random samples, used by the property tests (test extra)."""

import torch
from hypothesis import strategies as st

from physicsnemo_foldcp.testing.random_sample import RandomSampleSpec

FLOAT_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


@st.composite
def sample_specs(draw, max_tokens=200, max_atoms_per_token=30):
    """1..max_tokens tokens, 0..30 atoms each (tokens with none allowed), MSA 1..40, E 1..3."""
    n = draw(st.integers(1, max_tokens))
    counts = draw(st.lists(st.integers(0, max_atoms_per_token), min_size=n, max_size=n))
    pads = draw(st.integers(0, 40))
    if sum(counts) + pads == 0:
        counts[0] = 1
    return RandomSampleSpec(
        atoms_per_token=tuple(counts),
        trailing_pad_atoms=pads,
        msa_rows=draw(st.integers(1, 40)),
        conformers=draw(st.integers(1, 3)),
        templates=draw(st.integers(1, 2)),
        float_dtype=draw(st.sampled_from(FLOAT_DTYPES)),
        channels=draw(st.integers(1, 4)),
    )


paddings = st.fixed_dictionaries(
    {
        "token_multiple": st.sampled_from([1, 1, 2, 8]),
        "atom_multiple": st.sampled_from([1, 1, 4, 32]),
    }
)
