"""Every option of how a sample is sharded, in one frozen object with one default each.

:class:`ShardingOptions` is what :func:`~physicsnemo_foldcp.sharding.scatter.scatter_features`,
:class:`~physicsnemo_foldcp.data.ShardedLoader`, :class:`~physicsnemo_foldcp.data.FoldCPDataModule`,
the plan report and the Hydra ``sharding`` config group take, as their one ``options=``
argument (``None`` for the defaults; the fields are not keywords of those functions). The
defaults written here are the only ones: the config group's YAML and every function read
them from this module.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

BALANCE_MODES = ("even", "balanced")
"""Row-block strategies: equal token counts, or boundaries that balance a cost model."""

MAP_LAYOUTS = ("dense", "index")
"""Layouts of the one-hot atom<->token maps: the serial dense map, or an index vector."""

METHODS = ("p2p", "scatter_tensor")
"""Transports of the scatter: the true scatter, or PhysicsNeMo's broadcast baseline."""


MAX_MULTIPLE = 4096
"""Largest ``token_multiple`` / ``atom_multiple``: a pad multiple beyond a large complex's
row block only pads, and one near 2**31 overflows the plan's index arithmetic."""


def bounded_multiple(name: str, value: Any) -> int:
    """``value`` if it is an integer in ``[1, MAX_MULTIPLE]``; else a ``ValueError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_MULTIPLE:
        raise ValueError(
            f"{name} must be an integer >= 1, got {value!r}: the range is [1, {MAX_MULTIPLE}]"
        )
    return value


def positive_int(name: str, value: Any) -> int:
    """``value`` if it is an integer >= 1 (not a bool); else a ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value


@dataclass(frozen=True)
class BalanceOptions:
    """How row-block boundaries are chosen for each sample.

    Attributes
    ----------
    mode : {"even", "balanced"}, default "even"
        ``"even"``: ``cp0`` blocks whose token counts differ by at most one.
        ``"balanced"``: boundaries that minimise the largest per-rank cost
        ``pair_weight * N_i * C_j + atom_weight * A_i``
        (:func:`physicsnemo_foldcp.sharding.balance.balanced_token_bounds`).
    pair_weight : float, default 0.0
        Weight of the pair tile ``N_i x C_j`` in the cost.
    atom_weight : float, default 1.0
        Weight of the row block's atoms ``A_i`` in the cost.
    """

    mode: str = "even"
    pair_weight: float = 0.0
    atom_weight: float = 1.0

    def __post_init__(self) -> None:
        _choice("balance.mode", self.mode, BALANCE_MODES)
        for name in ("pair_weight", "atom_weight"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value < 0
            ):
                raise ValueError(f"balance.{name} must be a finite number >= 0, got {value!r}")
        if self.pair_weight == 0 and self.atom_weight == 0:
            raise ValueError(
                "balance.pair_weight and balance.atom_weight are both 0: there is nothing to "
                "balance"
            )


@dataclass(frozen=True)
class ShardingOptions:
    """How one sample is laid out over the ``cp0 x cp1`` mesh and sent there.

    Attributes
    ----------
    token_multiple : int, default 1
        Pad each row block's tokens up to a multiple of this (pads hold the pad value, so
        masks are 0 there); at most :data:`MAX_MULTIPLE`.
    atom_multiple : int, default 1
        Pad each row block's atoms up to a multiple of this (e.g. 32, Boltz's atom
        window); at most :data:`MAX_MULTIPLE`.
    align_lengths : bool, default False
        Pad every axis of one meaning to the longest instead of raising when they differ.
    balance : BalanceOptions, default even
        How the row-block boundaries are chosen.
    map_layout : {"dense", "index"}, default "dense"
        Layout of the one-hot atom<->token maps: Boltz's dense maps, or an int64 vector of
        global positions per row (``-1`` for none).
    method : {"p2p", "scatter_tensor"}, default "p2p"
        ``"p2p"`` sends each rank only its own blocks; ``"scatter_tensor"`` uses
        PhysicsNeMo's broadcast-then-chunk per feature (a baseline; raises where its
        chunking disagrees with the plan).
    """

    token_multiple: int = 1
    atom_multiple: int = 1
    align_lengths: bool = False
    balance: BalanceOptions = field(default_factory=BalanceOptions)
    map_layout: str = "dense"
    method: str = "p2p"

    def __post_init__(self) -> None:
        bounded_multiple("token_multiple", self.token_multiple)
        bounded_multiple("atom_multiple", self.atom_multiple)
        if not isinstance(self.align_lengths, bool):
            raise ValueError(f"align_lengths must be a bool, got {self.align_lengths!r}")
        if isinstance(self.balance, Mapping):
            object.__setattr__(self, "balance", BalanceOptions(**self.balance))
        if not isinstance(self.balance, BalanceOptions):
            raise ValueError(f"balance must be BalanceOptions, got {self.balance!r}")
        _choice("map_layout", self.map_layout, MAP_LAYOUTS)
        _choice("method", self.method, METHODS)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None) -> ShardingOptions:
        """Options from a mapping (a Hydra ``sharding`` group); unknown keys are an error.

        Parameters
        ----------
        values : Mapping[str, Any] or None
            Any subset of the attributes; ``balance`` may be a mapping. ``None`` gives the
            defaults.
        """
        values = dict(values or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown sharding option(s) {unknown}; known: {sorted(known)}")
        return cls(**values)

    def replace(self, **changes: Any) -> ShardingOptions:
        """A copy with ``changes`` applied (validated like a new object)."""
        values = asdict(self)
        values.update(changes)
        return ShardingOptions.from_mapping(values)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict of the options (for configs and logs)."""
        return asdict(self)


def options_or_defaults(options: ShardingOptions | None, caller: str) -> ShardingOptions:
    """The options a call runs with: ``options``, or the defaults for ``None``.

    Parameters
    ----------
    options : ShardingOptions or None
        The ``options=`` argument of ``caller``.
    caller : str
        Name of the function, for the message.

    Raises
    ------
    TypeError
        For anything else (a mapping, a mode name, ...).
    """
    if options is None:
        return ShardingOptions()
    if not isinstance(options, ShardingOptions):
        raise TypeError(
            f"{caller}: options must be ShardingOptions or None, got {type(options).__name__}"
        )
    return options


__all__ = [
    "BALANCE_MODES",
    "MAP_LAYOUTS",
    "MAX_MULTIPLE",
    "METHODS",
    "BalanceOptions",
    "ShardingOptions",
    "bounded_multiple",
    "options_or_defaults",
    "positive_int",
]
