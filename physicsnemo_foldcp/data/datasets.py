"""Serial datasets of batched Boltz samples for training and prediction runs.

The reference model reads Boltz's collated layout (a leading batch axis of 1 on every
tensor), which :func:`~physicsnemo_foldcp.scatter_features` keeps. Both datasets here
return one sample per index in that layout, plus a ``record_id`` string.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from physicsnemo_foldcp.data.files import FeatureFileDataset
from physicsnemo_foldcp.data.synthetic import make_complex


def batched(sample: Mapping[str, Any]) -> dict[str, Any]:
    """Add a leading batch axis of 1 to every tensor of an unbatched sample.

    Parameters
    ----------
    sample : Mapping[str, Any]
        Name -> unbatched tensor (non-tensor values are kept as they are).

    Returns
    -------
    dict[str, Any]
        Name -> ``[1, ...]`` tensor.
    """
    return {k: v.unsqueeze(0) if isinstance(v, torch.Tensor) else v for k, v in sample.items()}


class SyntheticComplexes(Dataset):
    """Deterministic synthetic Boltz complexes of varying size, batched (``[1, ...]``).

    Sample ``i`` is ``make_complex(sizes[i], seed=seed * 100003 + i, ...)``; the sizes are
    drawn uniformly from ``[min_tokens, max_tokens]`` with ``seed``. Samples are built on
    first access and kept (they are small), so later epochs cost nothing.

    Parameters
    ----------
    n_samples : int
        Length of the dataset.
    min_tokens, max_tokens : int
        Range of token counts (inclusive).
    seed : int, default 0
        Seed of the sizes and of every complex.
    preset : {"boltz2", "boltz1"}, default "boltz2"
        Feature set emitted.
    msa_rows : int, default 4
        MSA depth.
    n_conformers : int, default 1
        Conformers (and distogram conformers ``K`` for Boltz-2).
    atom_multiple : int, optional
        Pad each complex's atoms to a multiple of this, as Boltz's featurizer pads them to
        whole atom windows (a model's ``atom_multiple``).
    """

    def __init__(
        self,
        n_samples: int,
        min_tokens: int,
        max_tokens: int,
        *,
        seed: int = 0,
        preset: str = "boltz2",
        msa_rows: int = 4,
        n_conformers: int = 1,
        atom_multiple: int | None = None,
    ):
        if n_samples < 1:
            raise ValueError(f"n_samples must be >= 1, got {n_samples}")
        if not 2 <= min_tokens <= max_tokens:
            raise ValueError(
                f"need 2 <= min_tokens <= max_tokens, got min_tokens={min_tokens}, "
                f"max_tokens={max_tokens}"
            )
        g = torch.Generator().manual_seed(seed)
        self.sizes = torch.randint(min_tokens, max_tokens + 1, (n_samples,), generator=g).tolist()
        self.seed = seed
        self.preset = preset
        self.msa_rows = msa_rows
        self.n_conformers = n_conformers
        self.atom_multiple = atom_multiple
        self._cache: dict[int, dict[str, Any]] = {}

    def __len__(self) -> int:
        return len(self.sizes)

    def record_id(self, index: int) -> str:
        """The record id of sample ``index`` (without building it)."""
        return f"synthetic_{index:05d}"

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} samples")
        if index not in self._cache:
            sample = make_complex(
                self.sizes[index],
                seed=self.seed * 100003 + index,
                preset=self.preset,
                msa_rows=self.msa_rows,
                n_conformers=self.n_conformers,
                atom_multiple=self.atom_multiple,
            )
            out = batched(sample)
            out["record_id"] = self.record_id(index)
            self._cache[index] = out
        return dict(self._cache[index])

    def __repr__(self) -> str:
        return (
            f"SyntheticComplexes({len(self)} samples of {min(self.sizes)}-{max(self.sizes)} "
            f"tokens, preset={self.preset!r}, seed={self.seed})"
        )


class BatchedFiles(Dataset):
    """Feature files (``.pt`` / ``.npz``, see :mod:`physicsnemo_foldcp.data.files`), batched.

    A stored sample whose ``token_pad_mask`` is ``[N]`` gets a batch axis; one stored
    with ``[1, N]`` is returned as it is.

    Parameters
    ----------
    source : str or Path
        A directory of sample files, or one file.
    **options : Any
        Further :class:`~physicsnemo_foldcp.data.FeatureFileDataset` arguments.
    """

    def __init__(self, source: str | Path, **options: Any):
        self.files = FeatureFileDataset(source, **options)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample = self.files[index]
        mask = sample.get("token_pad_mask")
        out = sample if isinstance(mask, torch.Tensor) and mask.ndim == 2 else batched(sample)
        out.setdefault("record_id", self.files.record_id(index))
        return out


__all__ = ["BatchedFiles", "SyntheticComplexes", "batched"]
