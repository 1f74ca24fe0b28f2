"""Load-balanced row blocks: token boundaries that even out atoms (and pair work) per rank.

The default plan cuts the token axis into ``cp0`` row blocks of equal token counts. When
atoms per token vary (a nucleotide has ~20 atoms, a protein residue ~8, a ligand token 1),
equal token counts give very unequal atom counts per rank. :func:`balanced_token_bounds`
places the ``cp0 - 1`` boundaries to minimise the largest per-rank cost of a linear model::

    cost(i, j) = pair_weight * N_i * C_j + atom_weight * A_i

for the rank at domain coordinate ``(i, j)``, where ``N_i`` and ``A_i`` are the tokens
and atoms of row block ``i`` and ``C_j`` the tokens of column block ``j`` (the row blocks
themselves when ``cp0 == cp1``, an even split of the token axis otherwise: the plan's rule,
:func:`physicsnemo_foldcp.sharding.plan.column_block_sizes`). Blocks stay contiguous, so
atoms still follow their tokens. The minimum is exact (dynamic programming over prefix
sums); :func:`plan_cost` evaluates any set of boundaries with the same model.

The scatter applies it itself: with ``ShardingOptions(balance=BalanceOptions(mode="balanced"))``
the source rank computes the boundaries of every sample (:func:`token_bounds_for`)::

    options = ShardingOptions(balance=BalanceOptions(mode="balanced", pair_weight=0.5))
    sharded = scatter_features(sample, mesh, options=options)

Called directly, on the source rank of a domain group, where the sample is::

    bounds = balanced_token_bounds(atoms_per_token(sample), cp0, cp1=cp1)
    sharded = scatter_features(sample, mesh, token_bounds=bounds)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from physicsnemo_foldcp.sharding.options import (
    BALANCE_MODES,
    BalanceOptions,
    ShardingOptions,
    options_or_defaults,
)
from physicsnemo_foldcp.sharding.plan import (
    check_token_bounds,
    column_block_sizes,
    even_token_bounds,
    split_sizes,
)
from physicsnemo_foldcp.sharding.validation import FeatureValidationError, atom_tokens_from_map


def atoms_per_token(features: Mapping[str, Any], map_name: str = "atom_to_token") -> torch.Tensor:
    """Real atoms of every token, from a sample's atom -> token map.

    Parameters
    ----------
    features : Mapping[str, Any]
        One sample holding ``map_name``: the dense one-hot map ``[A, N]`` (or ``[1, A, N]``
        with a batch axis), or the compact int64 index vector ``[A]`` (token of each atom,
        -1 for none), whose token count is then the length of ``token_pad_mask`` when the
        sample has one, else the largest index + 1.
    map_name : str, default "atom_to_token"
        Key of the map.

    Returns
    -------
    torch.Tensor
        int64 ``[N]``: atoms per token. Trailing pad atoms, which belong to no token, are
        not counted.

    Raises
    ------
    FeatureValidationError
        If the map is missing, not one-hot, or has a batch axis larger than one.
    """
    if map_name not in features:
        raise FeatureValidationError(
            f"the sample has no {map_name!r}: atoms per token come from the atom -> token map"
        )
    value = features[map_name]
    if not isinstance(value, torch.Tensor):
        raise FeatureValidationError(f"{map_name!r} is a {type(value).__name__}, not a tensor")
    if value.ndim == 3:
        if value.shape[0] != 1:
            raise FeatureValidationError(
                f"{map_name!r} has shape {tuple(value.shape)}: one sample (batch 1) is expected"
            )
        value = value[0]
    if value.ndim == 2:
        tokens = atom_tokens_from_map(value)
        n_tokens = int(value.shape[1])
    elif value.ndim == 1:
        tokens = value.long()
        mask = features.get("token_pad_mask")
        if isinstance(mask, torch.Tensor):
            n_tokens = int(mask.shape[-1])
        else:
            n_tokens = int(tokens.max()) + 1 if tokens.numel() else 0
        if tokens.numel() and int(tokens.max()) >= n_tokens:
            raise FeatureValidationError(
                f"{map_name!r} points at token {int(tokens.max())}, but the sample has "
                f"{n_tokens} tokens"
            )
    else:
        raise FeatureValidationError(
            f"{map_name!r} has shape {tuple(value.shape)}; expected a dense [A, N] map or an "
            "[A] index vector"
        )
    return torch.bincount(tokens[tokens >= 0], minlength=n_tokens)


def _check_counts(atoms: torch.Tensor) -> torch.Tensor:
    if not isinstance(atoms, torch.Tensor) or atoms.ndim != 1:
        shape = tuple(atoms.shape) if isinstance(atoms, torch.Tensor) else type(atoms).__name__
        raise ValueError(f"atoms_per_token must be a 1-D tensor [N], got {shape}")
    if atoms.dtype.is_floating_point or atoms.dtype == torch.bool or atoms.is_complex():
        raise ValueError(f"atoms_per_token must hold integers, got {atoms.dtype}")
    if atoms.numel() and int(atoms.min()) < 0:
        t = int((atoms < 0).nonzero()[0])
        raise ValueError(f"atoms_per_token is negative at token {t}: {int(atoms[t])}")
    return atoms.detach().to("cpu", torch.int64)


def _check_weights(pair_weight: float, atom_weight: float) -> None:
    """The weights' checks are :class:`BalanceOptions`'s own."""
    BalanceOptions(mode="balanced", pair_weight=pair_weight, atom_weight=atom_weight)


def _min_max_partition(
    costs: np.ndarray, parts: int, max_len: int
) -> tuple[float, list[np.ndarray]]:
    """Exact minimum over contiguous partitions of the largest block cost.

    Parameters
    ----------
    costs : numpy.ndarray
        float64 ``[N]``, non-negative cost of every token.
    parts : int
        Number of blocks (empty blocks allowed).
    max_len : int
        Largest number of tokens a block may hold.

    Returns
    -------
    tuple[float, list[numpy.ndarray]]
        The optimum (``inf`` when ``parts * max_len < N``) and the table ``best[k]``
        (float64 ``[N + 1]``): the optimum for the first ``j`` tokens in ``k`` blocks.
    """
    n = costs.size
    prefix = np.concatenate(([0.0], np.cumsum(costs)))
    ends = np.arange(n + 1)
    low = np.maximum(ends - max_len, 0)
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    table = [best]
    for _ in range(parts):
        prev = table[-1]
        # Block (i, j] costs prefix[j] - prefix[i], falling in i; prev[i] rises in i. The
        # best i is where they cross: the first i with prev[i] + prefix[i] >= prefix[j].
        cross = np.searchsorted(prev + prefix, prefix, side="left")
        value = np.full(n + 1, np.inf)
        for candidate in (cross, cross - 1):
            i = np.minimum(np.maximum(candidate, low), ends)
            value = np.minimum(value, np.maximum(prev[i], prefix - prefix[i]))
        table.append(value)
    return float(table[-1][n]), table


def _reconstruct(
    costs: np.ndarray, table: list[np.ndarray], max_len: int, optimum: float
) -> tuple[int, ...]:
    """Boundaries of an optimal partition, built from the last block back.

    Each block takes, among the starts that keep the optimum, the one whose cost is
    closest to an even share of the cost left, then whose token count is closest to an
    even share of the tokens left.
    """
    n = costs.size
    prefix = np.concatenate(([0.0], np.cumsum(costs)))
    tolerance = 1e-9 * max(1.0, abs(optimum))
    bounds = [n]
    end = n
    for k in range(len(table) - 1, 0, -1):
        starts = np.arange(end + 1)
        block = prefix[end] - prefix[starts]
        ok = (
            (table[k - 1][starts] <= optimum + tolerance)
            & (block <= optimum + tolerance)
            & (end - starts <= max_len)
        )
        cost_miss = np.where(ok, np.abs(block - prefix[end] / k), np.inf)
        closest = cost_miss <= cost_miss.min() + tolerance
        token_miss = np.where(closest, np.abs((end - starts) - end / k), np.inf)
        end = int(np.argmin(token_miss))
        bounds.append(end)
    return tuple(reversed(bounds))


def balanced_token_bounds(
    atoms_per_token: torch.Tensor,
    cp0: int,
    *,
    cp1: int | None = None,
    pair_weight: float = 0.0,
    atom_weight: float = 1.0,
) -> tuple[int, ...]:
    """Contiguous row-block boundaries that minimise the largest per-rank cost.

    The cost of rank ``(i, j)`` is ``pair_weight * N_i * C_j + atom_weight * A_i`` (see
    the module docstring). With the defaults it is the atom count, so the result gives
    every row block as close to ``A / cp0`` atoms as whole tokens allow.

    Parameters
    ----------
    atoms_per_token : torch.Tensor
        int ``[N]``: atoms of each token (:func:`atoms_per_token`); zeros allowed.
    cp0 : int
        Row blocks (the ``cp0`` size of the domain mesh).
    cp1 : int, optional
        Column blocks; ``None`` means ``cp0`` (a square mesh, whose column blocks are the
        row blocks). Only matters when ``pair_weight > 0``.
    pair_weight : float, default 0.0
        Weight of one pair element (token row x token column) held by a rank.
    atom_weight : float, default 1.0
        Weight of one atom held by a rank.

    Returns
    -------
    tuple[int, ...]
        ``cp0 + 1`` non-decreasing boundaries from 0 to N, for
        ``scatter_features(..., token_bounds=...)`` or ``build_plan(..., token_bounds=...)``.
        Among optimal partitions, each block (from the last) takes the cost closest to an
        even share of the cost left, then the token count closest to an even share of the
        tokens left; for a square mesh with ``pair_weight > 0`` the smallest widest block
        is preferred.

    Raises
    ------
    ValueError
        On a non-1-D or negative ``atoms_per_token``, ``cp0 < 1`` or invalid weights.
    """
    atoms = _check_counts(atoms_per_token)
    _check_weights(pair_weight, atom_weight)
    if isinstance(cp0, bool) or int(cp0) != cp0 or cp0 < 1:
        raise ValueError(f"cp0 must be an integer >= 1, got {cp0!r}")
    cp1 = cp0 if cp1 is None else cp1
    if isinstance(cp1, bool) or int(cp1) != cp1 or cp1 < 1:
        raise ValueError(f"cp1 must be an integer >= 1, got {cp1!r}")
    n = atoms.numel()
    if cp0 == 1 or n == 0:
        return (0,) * cp0 + (n,)
    atom_cost = float(atom_weight) * atoms.numpy().astype(np.float64)
    pair_weight = float(pair_weight)
    if pair_weight == 0.0 or cp1 != cp0:
        # The widest column block does not depend on the rows: the cost is additive.
        widest = max(column_block_sizes(split_sizes(n, cp0), cp1)) if cp1 != cp0 else 0
        costs = atom_cost + pair_weight * widest
        optimum, table = _min_max_partition(costs, cp0, n)
        return _reconstruct(costs, table, n, optimum)
    # Square mesh: the columns are the rows, so a rank's pair work N_i * N_j depends on
    # the widest block M. For each cap M, solve with per-token cost pair_weight * M +
    # atom cost and blocks of at most M tokens; the best over M is the exact optimum.
    smallest = -(-n // cp0)
    chosen: tuple[float, int, np.ndarray, list[np.ndarray]] | None = None
    for cap in range(smallest, n + 1):
        if chosen is not None and pair_weight * cap * smallest > chosen[0]:
            break  # every block cap this wide costs more than the best found
        costs = atom_cost + pair_weight * cap
        optimum, table = _min_max_partition(costs, cp0, cap)
        if chosen is None or optimum < chosen[0] * (1 - 1e-12):
            chosen = (optimum, cap, costs, table)
    assert chosen is not None
    optimum, cap, costs, table = chosen
    return _reconstruct(costs, table, cap, optimum)


def _ratio(values: Sequence[float]) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


@dataclass(frozen=True)
class PlanCost:
    """Per-rank load of a set of row-block boundaries under the linear cost model.

    Ranks are listed row-major over ``(cp0, cp1)`` (domain rank ``i * cp1 + j``).

    Attributes
    ----------
    cp : tuple[int, int]
        ``(cp0, cp1)``.
    token_bounds : tuple[int, ...]
        ``cp0 + 1`` row-block boundaries.
    row_tokens, row_atoms : tuple[int, ...]
        ``N_i`` and ``A_i`` of each row block (real atoms of its tokens).
    column_tokens : tuple[int, ...]
        ``C_j`` of each column block.
    pair_weight, atom_weight : float
        Weights of the model.
    """

    cp: tuple[int, int]
    token_bounds: tuple[int, ...]
    row_tokens: tuple[int, ...]
    row_atoms: tuple[int, ...]
    column_tokens: tuple[int, ...]
    pair_weight: float
    atom_weight: float

    @property
    def rank_atoms(self) -> list[int]:
        """Atoms held by every rank (``A_i``, replicated over ``cp1``)."""
        return [a for a in self.row_atoms for _ in range(self.cp[1])]

    @property
    def rank_pair(self) -> list[int]:
        """Pair elements (token tile ``N_i x C_j``) held by every rank."""
        return [n * c for n in self.row_tokens for c in self.column_tokens]

    @property
    def rank_cost(self) -> list[float]:
        """``pair_weight * N_i * C_j + atom_weight * A_i`` of every rank."""
        return [
            self.pair_weight * p + self.atom_weight * a
            for p, a in zip(self.rank_pair, self.rank_atoms)
        ]

    @property
    def atom_imbalance(self) -> float:
        """Largest / mean atoms per rank (1.0 is perfect)."""
        return _ratio(self.rank_atoms)

    @property
    def pair_imbalance(self) -> float:
        """Largest / mean pair elements per rank."""
        return _ratio(self.rank_pair)

    @property
    def cost_imbalance(self) -> float:
        """Largest / mean cost per rank."""
        return _ratio(self.rank_cost)

    def format(self) -> str:
        """Per row block tokens and atoms, then the three imbalance figures, one line each."""
        lines = [
            f"row {i}: tokens [{self.token_bounds[i]}, {self.token_bounds[i + 1]}) "
            f"({self.row_tokens[i]}), {self.row_atoms[i]} atoms"
            for i in range(self.cp[0])
        ]
        lines.append(
            f"max/mean per rank: atoms {self.atom_imbalance:.3f}, pair "
            f"{self.pair_imbalance:.3f}, cost {self.cost_imbalance:.3f} "
            f"(pair_weight {self.pair_weight:g}, atom_weight {self.atom_weight:g})"
        )
        return "\n".join(lines)


def plan_cost(
    token_bounds: Sequence[int],
    atoms_per_token: torch.Tensor,
    cp: tuple[int, int],
    *,
    pair_weight: float = 0.0,
    atom_weight: float = 1.0,
) -> PlanCost:
    """Evaluate row-block boundaries: atoms, pair elements and cost per rank, and imbalance.

    Parameters
    ----------
    token_bounds : sequence of int
        ``cp0 + 1`` boundaries (:func:`even_token_bounds`, :func:`balanced_token_bounds`,
        or ``ShardingPlan.token_bounds``).
    atoms_per_token : torch.Tensor
        int ``[N]`` atoms of each token.
    cp : tuple[int, int]
        ``(cp0, cp1)``.
    pair_weight, atom_weight : float
        Weights of the cost model (see :func:`balanced_token_bounds`).

    Returns
    -------
    PlanCost

    Raises
    ------
    ValueError
        If the boundaries do not run from 0 to N in ``cp0`` non-decreasing steps.
    """
    atoms = _check_counts(atoms_per_token)
    _check_weights(pair_weight, atom_weight)
    cp = (int(cp[0]), int(cp[1]))
    n = atoms.numel()
    bounds = check_token_bounds(token_bounds, cp[0], n)
    prefix = [0] + torch.cumsum(atoms, 0).tolist()
    row_tokens = tuple(bounds[i + 1] - bounds[i] for i in range(cp[0]))
    row_atoms = tuple(int(prefix[bounds[i + 1]] - prefix[bounds[i]]) for i in range(cp[0]))
    return PlanCost(
        cp=cp,
        token_bounds=bounds,
        row_tokens=row_tokens,
        row_atoms=row_atoms,
        column_tokens=tuple(column_block_sizes(row_tokens, cp[1])),
        pair_weight=float(pair_weight),
        atom_weight=float(atom_weight),
    )


def token_bounds_for(
    atoms_per_token: torch.Tensor, cp: tuple[int, int], balance: BalanceOptions
) -> tuple[int, ...] | None:
    """Row-block boundaries of one sample under ``balance`` (what the scatter's source uses).

    Parameters
    ----------
    atoms_per_token : torch.Tensor
        int ``[N]`` atoms of each token (zeros for a sample without atoms: the pair term,
        or else the even split, decides).
    cp : tuple[int, int]
        ``(cp0, cp1)``.
    balance : BalanceOptions
        The strategy and the weights of its cost model.

    Returns
    -------
    tuple[int, ...] or None
        ``None`` for ``mode="even"`` (the plan's default split); otherwise
        :func:`balanced_token_bounds` with the options' weights.
    """
    if balance.mode == "even":
        return None
    return balanced_token_bounds(
        atoms_per_token,
        int(cp[0]),
        cp1=int(cp[1]),
        pair_weight=balance.pair_weight,
        atom_weight=balance.atom_weight,
    )


def plan_token_bounds(
    features: Mapping[str, Any],
    cp: tuple[int, int],
    *,
    options: ShardingOptions | None = None,
) -> tuple[int, ...] | None:
    """Row-block boundaries for one sample under ``options.balance`` (the config hook).

    Parameters
    ----------
    features : Mapping[str, Any]
        The serial sample (source rank), holding ``atom_to_token``.
    cp : tuple[int, int]
        ``(cp0, cp1)``.
    options : ShardingOptions, optional
        Its ``balance``: ``mode="even"`` gives ``None``, the plan's default split of equal
        token counts; ``"balanced"``: :func:`balanced_token_bounds` with its weights. The
        defaults (even) when omitted.

    Returns
    -------
    tuple[int, ...] or None
        ``token_bounds`` for :func:`physicsnemo_foldcp.scatter_features`.
    """
    balance = options_or_defaults(options, "plan_token_bounds").balance
    if balance.mode == "even":
        return None
    return token_bounds_for(atoms_per_token(features), cp, balance)


__all__ = [
    "BALANCE_MODES",
    "PlanCost",
    "atoms_per_token",
    "balanced_token_bounds",
    "even_token_bounds",
    "plan_cost",
    "plan_token_bounds",
    "token_bounds_for",
]
