"""Axis meanings: one object per meaning, carrying every rule the layout derives from it.

A feature's registry entry names the meaning of each of its axes (``"tokens"``,
``"atoms"``, ...). Each meaning is one :class:`Axis`: its block rule (how the plan splits
its length over the ``(cp0, cp1)`` mesh), its per-shard pad multiple, the placement of a
feature that leads with it, whether index values may point into it, its group in the plan
report, and the size that sets its length in a random test sample. The placement rules, the
plan, the validation, the reports and the random samples ask the axis; none of them keeps a
table per axis name. A new meaning is one :func:`register_axis` call::

    register_axis(Axis("samples", leads=(STACK,), sample_size="samples"))

after which ``FeatureSpec("x", axes=("samples", "tokens", None))`` (or the same in a Hydra
YAML) is placed, planned, validated and scattered like an ensemble feature.

An :class:`Axis` compares equal to (and hashes and sorts like) its name, and prints as it,
so the strings users write keep working wherever an axis is looked up or compared.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import total_ordering
from types import MappingProxyType

from torch.distributed.tensor import Placement, Replicate, Shard

BOUNDS = "bounds"
"""Block rule: row blocks over ``cp0`` at the plan's serial boundaries of the axis (a layout
axis: the plan may pad each block, and lays the axis out in the padded layout)."""
EVEN = "even"
"""Block rule: ``cp0`` row blocks of its length that differ by at most one (never padded)."""
BLOCK_RULES = (BOUNDS, EVEN)

TILE = "tile"
"""Leading rule: followed by an axis with column blocks, a tile ``(Shard(0), Shard(1))``."""
LEAD_ROWS = "rows"
"""Leading rule: row blocks of the leading axis, ``(Shard(0), Replicate())``."""
STACK = "stack"
"""Leading rule: a stack of members whose next (stackable) axis is split, ``(Shard(1),
Replicate())``; the stack axis itself is never split."""
LEAD_RULES = (TILE, LEAD_ROWS, STACK)


@total_ordering
@dataclass(frozen=True, eq=False, repr=False)
class Axis:
    """One axis meaning and every rule the layout derives from it.

    Parameters
    ----------
    name : str
        What a :class:`~physicsnemo_foldcp.features.spec.FeatureSpec` (or a YAML registry)
        writes for it.
    doc : str
        One line on what the axis is.
    blocks : {"bounds", "even"} or None
        How the plan splits its length over ``cp0`` (:data:`BOUNDS`, :data:`EVEN`);
        ``None``: never split.
    bounds : str, optional
        For ``blocks="bounds"``: the :class:`~physicsnemo_foldcp.sharding.plan.ShardingPlan`
        field holding its ``cp0 + 1`` serial row-block boundaries.
    multiple : str, optional
        The sharding option (and plan field) holding its per-shard pad multiple; without
        one, its blocks are not padded.
    columns : bool
        It is split over ``cp1`` in column blocks when it follows a :data:`TILE` axis.
    leads : tuple of str
        Placement rules of a feature whose first axis has this meaning, tried in order
        (:data:`LEAD_RULES`); empty: it cannot lead a sharded feature.
    stackable : bool
        It may follow a :data:`STACK` axis (its row blocks are then split).
    follows : str, optional
        The axis whose row blocks its blocks follow (atoms follow their tokens).
    index_target : bool
        A feature's values may index it (``FeatureSpec.index_of``); indices into a layout
        axis are range-checked and remapped into its padded layout.
    group : str, optional
        Feature group of the plan report (``"token"``, ``"atom"``, ``"msa"``).
    sample_size : str, optional
        The size of a random test sample that sets its length
        (:meth:`physicsnemo_foldcp.testing.random_sample.RandomSampleSpec.length`).
    source : str
        What in a sample gives the plan this axis, for the message when it is missing.
    """

    name: str
    doc: str = ""
    blocks: str | None = None
    bounds: str | None = None
    multiple: str | None = None
    columns: bool = False
    leads: tuple[str, ...] = ()
    stackable: bool = False
    follows: str | None = None
    index_target: bool = False
    group: str | None = None
    sample_size: str | None = None
    source: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "leads", tuple(self.leads))
        where = f"axis {self.name!r}"
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"an axis name must be a non-empty string, got {self.name!r}")
        if self.blocks not in (None, *BLOCK_RULES):
            raise ValueError(f"{where}: blocks={self.blocks!r} is not one of {BLOCK_RULES}")
        if (self.blocks == BOUNDS) != (self.bounds is not None):
            raise ValueError(f"{where}: blocks='bounds' and a plan bounds field go together")
        if self.multiple is not None and self.blocks != BOUNDS:
            raise ValueError(f"{where}: only an axis with blocks='bounds' is padded per shard")
        bad = [r for r in self.leads if r not in LEAD_RULES]
        if bad:
            raise ValueError(f"{where}: unknown leading rule(s) {bad}; use {LEAD_RULES}")
        if (TILE in self.leads or LEAD_ROWS in self.leads) and self.blocks is None:
            raise ValueError(f"{where}: a tile or rows leading axis needs a block rule")
        if STACK in self.leads and self.blocks is not None:
            raise ValueError(f"{where}: a stack axis is never split (blocks=None)")
        if self.columns and self.blocks is None:
            raise ValueError(f"{where}: column blocks need a block rule")

    # -- an axis is its name, for lookups, comparisons and messages ------------------------

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Axis):
            return self.name == other.name
        if isinstance(other, str):
            return self.name == other
        return NotImplemented

    def __lt__(self, other: object) -> bool:
        if isinstance(other, (Axis, str)):
            return self.name < str(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.name)

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return repr(self.name)

    def __format__(self, spec: str) -> str:
        return format(self.name, spec)

    # -- rules -------------------------------------------------------------------------

    @property
    def split(self) -> bool:
        """Split over ``cp0``: every axis of this meaning in a sample has one length."""
        return self.blocks is not None

    @property
    def layout(self) -> bool:
        """The plan lays it out (row blocks at serial bounds, optional per-shard pads)."""
        return self.blocks == BOUNDS

    def missing(self) -> str:
        """Why the plan may lack this axis, for the message."""
        return self.source or f"no feature with a {self.name} axis"

    def lead_placements(self, second: Axis | None) -> tuple[Placement, Placement] | None:
        """Placements over ``(cp0, cp1)`` of a sharded feature that leads with this axis.

        Parameters
        ----------
        second : Axis or None
            The feature's second axis (``None``: a free axis or none).

        Returns
        -------
        tuple[Placement, Placement] or None
            The first of its :attr:`leads` rules that applies; ``None`` if none does.
        """
        for rule in self.leads:
            if rule == TILE and second is not None and second.columns:
                return (Shard(0), Shard(1))
            if rule == LEAD_ROWS:
                return (Shard(0), Replicate())
            if rule == STACK and second is not None and second.stackable:
                return (Shard(1), Replicate())
        return None


_AXES: dict[str, Axis] = {}

AXES: Mapping[str, Axis] = MappingProxyType(_AXES)
"""Every axis meaning a :class:`~physicsnemo_foldcp.features.spec.FeatureSpec` may use, by
name (``None`` marks a free axis). Read-only; :func:`register_axis` adds one."""


def register_axis(axis: Axis, *, replace: bool = False) -> Axis:
    """Add an axis meaning to :data:`AXES` (``replace=True`` overrides one of its name)."""
    if not isinstance(axis, Axis):
        raise TypeError(f"register_axis() takes an Axis, got {type(axis).__name__}")
    if axis.name in _AXES and not replace:
        raise ValueError(f"axis {axis.name!r} is already registered; pass replace=True")
    _AXES[axis.name] = axis
    return axis


def unregister_axis(name: str | Axis) -> None:
    """Remove an axis meaning from :data:`AXES` (specs that hold it keep working)."""
    del _AXES[str(name)]


def find_axis(meaning: str | Axis | None) -> Axis | None:
    """The :class:`Axis` of a name (an Axis is itself); ``None`` for ``None`` or no axis."""
    if meaning is None or isinstance(meaning, Axis):
        return meaning
    return _AXES.get(meaning)


def axis_of(meaning: str | Axis) -> Axis:
    """The :class:`Axis` of ``meaning``; raises ``ValueError`` for an unknown name."""
    axis = find_axis(meaning)
    if axis is None:
        raise ValueError(f"unknown axis meaning {meaning!r}; use one of {sorted(_AXES)}")
    return axis


def registered_axis(meaning: str | Axis) -> Axis | None:
    """The registered :class:`Axis` of a name (or of an Axis, by its name), else ``None``.

    Raises
    ------
    ValueError
        If ``meaning`` is an Axis whose name is registered with other rules.
    """
    if not isinstance(meaning, (str, Axis)):
        return None
    axis = _AXES.get(str(meaning))
    if axis is not None and isinstance(meaning, Axis) and vars(meaning) != vars(axis):
        raise ValueError(
            f"axis {meaning.name!r} is registered with other rules; register this Axis "
            "under its own name (register_axis)"
        )
    return axis


def is_layout(meaning: str | Axis | None) -> bool:
    """Whether ``meaning`` names a layout axis (:attr:`Axis.layout`)."""
    axis = find_axis(meaning)
    return axis is not None and axis.layout


TOKENS = register_axis(
    Axis(
        "tokens",
        doc="Token axis (length N): row blocks over cp0; a second token axis uses cp1 blocks.",
        blocks=BOUNDS,
        bounds="token_bounds",
        multiple="token_multiple",
        columns=True,
        leads=(TILE, LEAD_ROWS),
        stackable=True,
        index_target=True,
        group="token",
        sample_size="n_tokens",
    )
)
ATOMS = register_axis(
    Axis(
        "atoms",
        doc="Atom axis (length A): each rank holds exactly the atoms of its row-block tokens.",
        blocks=BOUNDS,
        bounds="atom_bounds",
        multiple="atom_multiple",
        leads=(LEAD_ROWS,),
        stackable=True,
        follows="tokens",
        index_target=True,
        group="atom",
        sample_size="n_atoms",
    )
)
MSA = register_axis(
    Axis(
        "msa",
        doc="MSA depth (length S): split over cp0 when followed by a token axis.",
        blocks=EVEN,
        leads=(TILE,),
        group="msa",
        sample_size="msa_rows",
        source="no MSA feature",
    )
)
ENSEMBLE = register_axis(
    Axis(
        "ensemble",
        doc="Conformer ensemble (E or K): never sharded.",
        leads=(STACK,),
        index_target=True,
        sample_size="conformers",
    )
)
TEMPLATES = register_axis(
    Axis(
        "templates",
        doc="Templates (T): never sharded.",
        leads=(STACK,),
        sample_size="templates",
    )
)
RSET = register_axis(
    Axis(
        "rset",
        doc="Rows that each belong to one token (r_set_to_rep_atom): they follow their tokens.",
        blocks=BOUNDS,
        bounds="rset_bounds",
        leads=(LEAD_ROWS,),
        follows="tokens",
        group="atom",
        sample_size="rset_rows",
        source="no r_set feature",
    )
)


__all__ = [
    "ATOMS",
    "AXES",
    "BLOCK_RULES",
    "BOUNDS",
    "ENSEMBLE",
    "EVEN",
    "LEAD_RULES",
    "MSA",
    "LEAD_ROWS",
    "RSET",
    "STACK",
    "TEMPLATES",
    "TILE",
    "TOKENS",
    "Axis",
    "axis_of",
    "find_axis",
    "is_layout",
    "register_axis",
    "registered_axis",
    "unregister_axis",
]
