"""A per-rank memory model of one trunk training step (forward + backward), fitted to points.

The peak tensor bytes a rank holds during one step of a Boltz-2 trunk under context
parallelism on a ``cp0 x cp1`` mesh (``P = cp0 * cp1``) is modelled as a non-negative
combination of element counts (:data:`TERMS`), each the size of one family of activations
on the largest rank, plus the bytes that are known exactly and not fitted (the parameters
and their gradients, replicated on every rank):

=================  ===========================================================================
term               elements on the largest rank
=================  ===========================================================================
``const``          1 (fixed bytes: small buffers, the loss, metadata)
``atoms``          ``A_rank * W_k * atom_z * atom_depth`` (windowed atom pair features:
                   each atom query attends ``W_k`` keys; ``A_rank`` the atoms of the
                   largest row block, ``A / cp0`` when balanced)
``msa``            ``ceil(S / cp0) * n1 * msa_s * msa_blocks`` (the local MSA track;
                   ``n0 = ceil(N / cp0)``, ``n1 = ceil(N / cp1)``)
``msa_gather``     ``S * (n0 + n1) * c_opm * msa_blocks`` (MSA operands gathered over the
                   mesh: the outer product mean keeps ``S (n + m) c`` for its backward,
                   ``c_opm = 32`` in Boltz)
``pair``           ``n0 * n1 * token_z * L`` (the pair track saved by every pair-updating
                   block, ``L = pairformer_blocks + msa_blocks``)
``pair_work``      ``n0 * n1 * token_z`` (one block's transient working set: recomputed
                   chunks, gradients in flight; not multiplied by the blocks)
``strip``          ``N * (n0 + n1) * token_z * L`` (pair strips a rank gathers along a
                   row or column of the mesh and keeps for the backward: the triangle
                   multiplications' operands; equal in form to ``pair`` on 1x1, so only
                   meshes tell the two apart)
``tri_att``        ``n0 * n1 * N * pair_heads * L`` (triangle attention scores, if kept:
                   Boltz's own PyTorch path keeps them; a flash-style one does not)
``pair_fixed``     ``n0 * n1`` (pair terms without a width that varies here: the sample's pair
                   features, the distogram logits and target over ``num_bins = 64``)
=================  ===========================================================================

Each coefficient is then bytes per element (about ``4 x`` the number of fp32 copies kept
or live at the peak). The coefficients are found by non-negative least squares on the
relative error (every equation divided by its measurement, so small and large points count
alike): :func:`fit`. :func:`check` compares predictions with held-out measurements;
:func:`largest_fitting` finds the largest ``N`` whose prediction fits a budget.

Pure NumPy / SciPy: no torch, no distributed state.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.optimize import nnls

TERMS = (
    "const",
    "atoms",
    "msa",
    "msa_gather",
    "pair",
    "pair_work",
    "strip",
    "tri_att",
    "pair_fixed",
)
"""Names of the fitted terms, in the order of :func:`features` and of the coefficients."""

OPM_HIDDEN = 32
"""Boltz's ``OuterProductMean`` hidden width (``c_hidden``, fixed in ``MSALayer``)."""

WINDOW_KEYS = 128
"""Keys per atom query window (Boltz's ``atoms_per_window_keys``)."""


@dataclass(frozen=True)
class StepShape:
    """Sizes that fix the memory of one trunk step on one mesh.

    Attributes
    ----------
    n_tokens : int
        Tokens ``N``.
    n_atoms : int
        Atoms ``A`` (padded).
    msa_depth : int
        MSA rows ``S`` the MSA module reads.
    cp0, cp1 : int
        Mesh shape.
    token_s, token_z, msa_s, atom_s, atom_z : int
        Channel widths.
    pairformer_blocks, msa_blocks : int
        Pairformer layers and MSA module layers.
    pair_heads : int
        Triangle attention heads (``pairwise_num_heads``, the same in both stacks here).
    atom_depth : int
        Atom encoder (atom transformer) layers.
    param_bytes : float
        Bytes of the parameters and their gradients on a rank (known, not fitted).
    atoms_rank : float or None
        Atoms of the largest row block, when known (atoms follow their tokens, so an even
        token split can give a row block more than ``A / cp0``); None: ``A / cp0``.
    """

    n_tokens: int
    n_atoms: int
    msa_depth: int
    cp0: int = 1
    cp1: int = 1
    token_s: int = 64
    token_z: int = 32
    msa_s: int = 16
    atom_s: int = 32
    atom_z: int = 8
    pairformer_blocks: int = 2
    msa_blocks: int = 1
    pair_heads: int = 4
    atom_depth: int = 1
    param_bytes: float = 0.0
    atoms_rank: float | None = None

    @property
    def ranks(self) -> int:
        """``P = cp0 * cp1``."""
        return self.cp0 * self.cp1

    def with_(self, **changes: Any) -> StepShape:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)


def features(shape: StepShape) -> np.ndarray:
    """Element counts of every term of :data:`TERMS` on the largest rank.

    Parameters
    ----------
    shape : StepShape
        One step's sizes and mesh.

    Returns
    -------
    np.ndarray
        ``[len(TERMS)]`` float64.
    """
    n = shape.n_tokens
    n0 = math.ceil(n / shape.cp0)
    n1 = math.ceil(n / shape.cp1)
    tile = float(n0 * n1)
    pair_blocks = shape.pairformer_blocks + shape.msa_blocks
    atoms = shape.n_atoms / shape.cp0 if shape.atoms_rank is None else shape.atoms_rank
    return np.array(
        [
            1.0,
            atoms * WINDOW_KEYS * shape.atom_z * shape.atom_depth,
            math.ceil(shape.msa_depth / shape.cp0) * n1 * shape.msa_s * shape.msa_blocks,
            float(shape.msa_depth * (n0 + n1)) * OPM_HIDDEN * shape.msa_blocks,
            tile * shape.token_z * pair_blocks,
            tile * shape.token_z,
            float(n * (n0 + n1)) * shape.token_z * pair_blocks,
            tile * n * shape.pair_heads * pair_blocks,
            tile,
        ],
        dtype=np.float64,
    )


@dataclass(frozen=True)
class MemoryModel:
    """Fitted coefficients (bytes per element of each term of :data:`TERMS`).

    Attributes
    ----------
    coefficients : dict[str, float]
        ``{term: bytes per element}``, every value ``>= 0``.
    points : int
        Measurements it was fitted on.
    """

    coefficients: dict[str, float]
    points: int

    def vector(self) -> np.ndarray:
        """Coefficients in the order of :data:`TERMS`, ``[len(TERMS)]``."""
        return np.array([self.coefficients[t] for t in TERMS], dtype=np.float64)

    def terms(self, shape: StepShape) -> dict[str, float]:
        """Predicted bytes of every term, and ``params`` (the known bytes), for ``shape``."""
        out = dict(zip(TERMS, (features(shape) * self.vector()).tolist()))
        out["params"] = float(shape.param_bytes)
        return out

    def predict(self, shape: StepShape) -> float:
        """Predicted peak bytes on the largest rank (fitted terms + known parameter bytes)."""
        return float(features(shape) @ self.vector()) + float(shape.param_bytes)


def fit(shapes: Sequence[StepShape], measured: Sequence[float]) -> MemoryModel:
    """Fit the coefficients to measured peaks (non-negative least squares, relative error).

    Parameters
    ----------
    shapes : Sequence[StepShape]
        ``M`` measured steps.
    measured : Sequence[float]
        ``[M]`` peak bytes on the largest rank, each ``> shape.param_bytes``.

    Returns
    -------
    MemoryModel
        The coefficients.

    Raises
    ------
    ValueError
        Fewer points than terms, lengths that differ, or a measurement not above the
        known parameter bytes.
    """
    if len(shapes) != len(measured):
        raise ValueError(f"{len(shapes)} shapes but {len(measured)} measurements")
    if len(shapes) < len(TERMS):
        raise ValueError(f"{len(shapes)} points cannot fit {len(TERMS)} terms ({', '.join(TERMS)})")
    y = np.asarray(measured, dtype=np.float64) - np.array([s.param_bytes for s in shapes])
    if np.any(y <= 0):
        raise ValueError("every measurement must exceed its known parameter bytes")
    x = np.stack([features(s) for s in shapes])
    # Columns scaled to unit size for conditioning; rows divided by the measurement.
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    weights = 1.0 / np.asarray(measured, dtype=np.float64)
    solution, _ = nnls((x / scale) * weights[:, None], y * weights, maxiter=50 * len(TERMS))
    coefficients = solution / scale
    return MemoryModel(dict(zip(TERMS, coefficients.tolist())), points=len(shapes))


def check(
    model: MemoryModel, shapes: Sequence[StepShape], measured: Sequence[float]
) -> list[dict[str, float]]:
    """Predictions beside measurements: ``predicted``, ``measured``, relative ``error``.

    Parameters
    ----------
    model : MemoryModel
        Fitted model.
    shapes : Sequence[StepShape]
        ``M`` steps (typically held out of the fit).
    measured : Sequence[float]
        ``[M]`` peak bytes.

    Returns
    -------
    list[dict[str, float]]
        Per point: ``predicted`` and ``measured`` bytes, ``error = predicted / measured - 1``.
    """
    out = []
    for shape, value in zip(shapes, measured):
        predicted = model.predict(shape)
        out.append(
            {"predicted": predicted, "measured": float(value), "error": predicted / value - 1}
        )
    return out


def largest_fitting(
    predict: Callable[[int], float], budget: float, low: int = 1, high: int = 1 << 20
) -> int | None:
    """Largest ``N`` in ``[low, high]`` with ``predict(N) <= budget`` (``predict`` increasing).

    Parameters
    ----------
    predict : callable
        ``N -> bytes``, non-decreasing in ``N``.
    budget : float
        Bytes.
    low, high : int
        Search range.

    Returns
    -------
    int or None
        The largest such ``N``; None when even ``low`` does not fit.
    """
    if predict(low) > budget:
        return None
    if predict(high) <= budget:
        return high
    while high - low > 1:
        mid = (low + high) // 2
        if predict(mid) <= budget:
            low = mid
        else:
            high = mid
    return low


def coefficient_table(model: MemoryModel) -> list[dict[str, Any]]:
    """Rows ``{"term", "bytes_per_element"}`` of the fitted coefficients."""
    return [{"term": t, "bytes_per_element": v} for t, v in model.coefficients.items()]


def model_from_mapping(values: Mapping[str, float], points: int = 0) -> MemoryModel:
    """A :class:`MemoryModel` from ``{term: coefficient}`` (every term of :data:`TERMS`)."""
    missing = [t for t in TERMS if t not in values]
    if missing:
        raise ValueError(f"missing coefficients: {', '.join(missing)}")
    return MemoryModel({t: float(values[t]) for t in TERMS}, points=points)


__all__ = [
    "OPM_HIDDEN",
    "TERMS",
    "WINDOW_KEYS",
    "MemoryModel",
    "StepShape",
    "check",
    "coefficient_table",
    "features",
    "fit",
    "largest_fitting",
    "model_from_mapping",
]
