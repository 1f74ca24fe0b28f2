"""Plan report: what each rank of a ``cp0 x cp1`` mesh would hold of one sample, on one process.

Given a sample and a mesh shape, :func:`plan_report` validates and lays out the sample
exactly as the scatter's source rank does
(:func:`physicsnemo_foldcp.sharding.prepare.prepare_sample`, with the same
:class:`~physicsnemo_foldcp.sharding.options.ShardingOptions`) and reports, per rank: its
serial token and atom ranges, its token column block, the bytes of its blocks per feature
group, the elements it holds at pad positions (all asked of the plan), and the imbalance of
atoms, pair elements and bytes across ranks. :func:`draw_plan` draws the partition. No
process group is needed. The command line is
:mod:`physicsnemo_foldcp.cli.plan_report`.

Feature groups (by the ``group`` of the registry's axis meanings, first match wins):
``pair`` (two token axes), ``msa`` (an MSA axis), ``atom`` (an atoms or rset axis: atom
features, coordinates, atom<->token maps), ``token`` (a token axis), ``other`` (everything
else: replicated lists and passed-through tensors, held whole by every rank).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from physicsnemo_foldcp.features.axes import ATOMS, TOKENS, Axis, find_axis
from physicsnemo_foldcp.features.registry import FeatureRegistry
from physicsnemo_foldcp.sharding.balance import PlanCost, atoms_per_token, plan_cost
from physicsnemo_foldcp.sharding.options import ShardingOptions, options_or_defaults
from physicsnemo_foldcp.sharding.plan import Coordinate, ShardingPlan, even_token_bounds
from physicsnemo_foldcp.sharding.prepare import prepare_sample
from physicsnemo_foldcp.sharding.wire import FeatureMeta

GROUPS = ("token", "pair", "atom", "msa", "other")
"""Feature groups of the report, in print order."""


_GROUP_ORDER = ("msa", "atom", "token")
"""Axis groups in the order they claim a feature, after ``pair`` (two token-group axes)."""


def feature_group(axes: Sequence[str | Axis | None]) -> str:
    """Group of a feature from its registry axes (see the module docstring)."""
    groups = [axis.group for axis in map(find_axis, axes) if axis is not None]
    if groups.count("token") >= 2:
        return "pair"
    return next((g for g in _GROUP_ORDER if g in groups), "other")


@dataclass(frozen=True)
class RankLoad:
    """What one rank holds of the sample.

    Attributes
    ----------
    domain_rank : int
        Row-major rank in the domain group, ``i * cp1 + j``.
    coordinate : tuple[int, int]
        ``(i, j)`` in the ``(cp0, cp1)`` mesh.
    tokens, atoms : tuple[int, int]
        Serial ``[start, stop)`` of the row block's tokens and atoms.
    columns : tuple[int, int]
        ``[start, stop)`` of the token column block, in the padded layout.
    local_tokens, local_atoms : int
        Row-block lengths in the padded layout (per-shard pads included).
    group_bytes : dict[str, int]
        Bytes of this rank's blocks per feature group (:data:`GROUPS`).
    elements : int
        Elements of all its blocks.
    pad_elements : int
        Of those, elements at positions the plan inserted (per-shard padding).
    """

    domain_rank: int
    coordinate: tuple[int, int]
    tokens: tuple[int, int]
    atoms: tuple[int, int]
    columns: tuple[int, int]
    local_tokens: int
    local_atoms: int
    group_bytes: dict[str, int]
    elements: int
    pad_elements: int

    @property
    def nbytes(self) -> int:
        """Bytes of all this rank's blocks."""
        return sum(self.group_bytes.values())


@dataclass(frozen=True)
class PlanReport:
    """Per-rank contents and balance of one sample on one plan (see :func:`plan_report`).

    Attributes
    ----------
    plan : ShardingPlan
        The plan.
    ranks : list[RankLoad]
        One per rank, row-major over ``(cp0, cp1)``.
    cost : PlanCost
        Atoms and pair elements per rank of this plan's row blocks (real atoms).
    even_cost : PlanCost
        The same for the default even split, for comparison.
    atoms_per_token : torch.Tensor
        int64 ``[N]`` real atoms of each token.
    features : list[FeatureMeta]
        The sample's features in the padded layout.
    label : str
        ``"even"`` or ``"balanced"``.
    """

    plan: ShardingPlan
    ranks: list[RankLoad]
    cost: PlanCost
    even_cost: PlanCost
    atoms_per_token: torch.Tensor
    features: list[FeatureMeta] = field(default_factory=list)
    label: str = "even"

    @property
    def real_elements(self) -> int:
        """Elements of the sample in the serial layout (all features, once)."""
        return sum(math.prod(f.serial_shape) for f in self.features)

    @property
    def padded_elements(self) -> int:
        """Elements of the sample in the padded layout (all features, once)."""
        return sum(math.prod(f.padded_shape) for f in self.features)

    @property
    def byte_imbalance(self) -> float:
        """Largest / mean bytes per rank."""
        values = [r.nbytes for r in self.ranks]
        mean = sum(values) / len(values)
        return max(values) / mean if mean else 1.0

    def format(self) -> str:
        """The report as text: one table row per rank, then padding and imbalance lines."""
        cp0, cp1 = self.plan.cp
        n, a = self.plan.n_tokens, self.plan.n_atoms
        lines = [
            f"plan ({self.label}) on cp0 x cp1 = {cp0} x {cp1}: {n} tokens "
            f"(padded {self.plan.padded_length(TOKENS)}), {a} atoms "
            f"(padded {self.plan.padded_length(ATOMS) if a else 0}), "
            f"{len(self.features)} features, token bounds {list(self.plan.token_bounds)}",
            "",
            "| rank | coord | tokens | columns | atoms | local tokens | local atoms | "
            + " | ".join(f"{g} B" for g in GROUPS)
            + " | total B | pad elements |",
            "|" + "---|" * (9 + len(GROUPS)),
        ]
        for r in self.ranks:
            lines.append(
                f"| {r.domain_rank} | ({r.coordinate[0]},{r.coordinate[1]}) | "
                f"[{r.tokens[0]},{r.tokens[1]}) | [{r.columns[0]},{r.columns[1]}) | "
                f"[{r.atoms[0]},{r.atoms[1]}) | {r.local_tokens} | {r.local_atoms} | "
                + " | ".join(str(r.group_bytes[g]) for g in GROUPS)
                + f" | {r.nbytes} | {r.pad_elements} |"
            )
        pad = self.padded_elements - self.real_elements
        lines += [
            "",
            f"padding: {pad} pad elements on {self.real_elements} real elements "
            f"({100 * pad / max(self.real_elements, 1):.3f}%); held by ranks: "
            f"{sum(r.pad_elements for r in self.ranks)} pad of "
            f"{sum(r.elements for r in self.ranks)} elements",
            f"imbalance (max/mean per rank): atoms {self.cost.atom_imbalance:.3f}, "
            f"pair elements {self.cost.pair_imbalance:.3f}, bytes {self.byte_imbalance:.3f}",
            f"even split for comparison: atoms {self.even_cost.atom_imbalance:.3f}, "
            f"pair elements {self.even_cost.pair_imbalance:.3f}",
            "atoms per row block: "
            + ", ".join(str(x) for x in self.cost.row_atoms)
            + " (even split: "
            + ", ".join(str(x) for x in self.even_cost.row_atoms)
            + ")",
        ]
        return "\n".join(lines)


def _rank_load(
    metas: Sequence[FeatureMeta],
    registry: FeatureRegistry,
    plan: ShardingPlan,
    coord: Coordinate,
) -> tuple[dict[str, int], int, int]:
    """Bytes per feature group, elements and pad elements of the rank at ``coord``."""
    group_bytes = dict.fromkeys(GROUPS, 0)
    elements = pad_elements = 0
    for meta in metas:
        spec = registry[meta.name]
        numel = math.prod(plan.local_shape(spec, meta.padded_shape, coord))
        size = torch.empty((), dtype=meta.dtype).element_size()
        group_bytes[feature_group(spec.axes)] += numel * size
        elements += numel
        pad_elements += plan.pad_elements(spec, meta.padded_shape, coord)
    return group_bytes, elements, pad_elements


def plan_report(
    features: Mapping[str, Any],
    cp: tuple[int, int],
    *,
    registry: FeatureRegistry | None = None,
    options: ShardingOptions | None = None,
    token_bounds: Sequence[int] | None = None,
    label: str | None = None,
) -> PlanReport:
    """Lay out one sample on its plan (one process) and report every rank's share.

    Parameters
    ----------
    features : Mapping[str, Any]
        The serial sample (unbatched or with a leading batch axis of 1).
    cp : tuple[int, int]
        ``(cp0, cp1)``.
    registry : FeatureRegistry, optional
        Axis meanings; the Boltz-2 preset by default.
    options : ShardingOptions, optional
        As for :func:`physicsnemo_foldcp.scatter_features`: padding multiples, map layout,
        and the balance (``mode="balanced"`` computes the balanced row blocks, as the
        scatter's source does); the defaults when omitted.
    token_bounds : sequence of int, optional
        Explicit row-block boundaries; they win over ``options.balance``.
    label : str, optional
        Name of the plan in the printout; by default ``"balanced"`` for a balanced option
        or bounds other than the even split, else ``"even"``.

    Returns
    -------
    PlanReport
        Exactly what :func:`physicsnemo_foldcp.scatter_features` would put on each rank
        (same validation and layout code), without any communication.
    """
    options = options_or_defaults(options, "plan_report")
    registry = registry if registry is not None else FeatureRegistry.preset("boltz2")
    cp = (int(cp[0]), int(cp[1]))
    bounds = tuple(int(b) for b in token_bounds) if token_bounds is not None else None
    prepared = prepare_sample(features, registry, cp, options=options, token_bounds=bounds)
    plan = prepared.plan
    counts = atoms_per_token(features) if "atom_to_token" in features else None
    if counts is None or counts.numel() != plan.n_tokens:
        counts = torch.zeros(plan.n_tokens, dtype=torch.int64)
    has_atoms = plan.n_atoms > 0
    ranks = []
    for i, j in plan.coordinates:
        group_bytes, elements, pads = _rank_load(prepared.metas, registry, plan, (i, j))
        ranks.append(
            RankLoad(
                domain_rank=i * cp[1] + j,
                coordinate=(i, j),
                tokens=plan.serial_range(TOKENS, i),
                atoms=plan.serial_range(ATOMS, i) if has_atoms else (0, 0),
                columns=plan.block(TOKENS, 1, j),
                local_tokens=plan.row_sizes(TOKENS)[i],
                local_atoms=plan.row_sizes(ATOMS)[i] if has_atoms else 0,
                group_bytes=group_bytes,
                elements=elements,
                pad_elements=pads,
            )
        )
    even = even_token_bounds(plan.n_tokens, cp[0])
    weights = {
        "pair_weight": options.balance.pair_weight,
        "atom_weight": options.balance.atom_weight,
    }
    balanced = plan.token_bounds != even or (bounds is None and options.balance.mode == "balanced")
    return PlanReport(
        plan=plan,
        ranks=ranks,
        cost=plan_cost(plan.token_bounds, counts, cp, **weights),
        even_cost=plan_cost(even, counts, cp, **weights),
        atoms_per_token=counts,
        features=list(prepared.metas),
        label=label or ("balanced" if balanced else "even"),
    )


def draw_plan(report: PlanReport, path: str | Path) -> Path:
    """Draw the partition as a PNG: row blocks over atoms per token, pair tiles, per-rank load.

    Parameters
    ----------
    report : PlanReport
        From :func:`plan_report`.
    path : str or Path
        Output file (``.png``); parent folders are created.

    Returns
    -------
    Path
        The file written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    plan, cp0, cp1 = report.plan, report.plan.cp[0], report.plan.cp[1]
    n = plan.n_tokens
    colors = plt.get_cmap("tab10" if cp0 * cp1 <= 10 else "tab20")
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    title = (
        f"{report.label} plan, cp0 x cp1 = {cp0} x {cp1}, N = {n}, A = {plan.n_atoms}: "
        f"atoms max/mean {report.cost.atom_imbalance:.3f} "
        f"(even {report.even_cost.atom_imbalance:.3f})"
    )
    fig.suptitle(title)

    ax = axes[0, 0]
    counts = report.atoms_per_token.numpy()
    for i in range(cp0):
        t0, t1 = plan.serial_range(TOKENS, i)
        ax.axvspan(t0, t1, color=colors(i * cp1 % colors.N), alpha=0.18)
        ax.bar(range(t0, t1), counts[t0:t1], width=1.0, color=colors(i * cp1 % colors.N))
        ax.text(
            (t0 + t1) / 2,
            max(counts.max(initial=1), 1) * 1.02,
            f"row {i}\n{t1 - t0} tok\n{report.cost.row_atoms[i]} at",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xlim(0, max(n, 1))
    ax.set_ylim(0, max(counts.max(initial=1), 1) * 1.35)
    ax.set_xlabel("token (serial order)")
    ax.set_ylabel("atoms per token")
    ax.set_title("row blocks over cp0: tokens and their atoms")

    ax = axes[0, 1]
    total = plan.padded_length(TOKENS)
    for r in report.ranks:
        i, j = r.coordinate
        y0, y1 = plan.block(TOKENS, 0, i)
        x0, x1 = r.columns
        ax.add_patch(
            Rectangle(
                (x0, y0), x1 - x0, y1 - y0, facecolor=colors(r.domain_rank % colors.N), alpha=0.6
            )
        )
        ax.add_patch(Rectangle((x0, y0), x1 - x0, y1 - y0, fill=False, edgecolor="black"))
        ax.text(
            (x0 + x1) / 2,
            (y0 + y1) / 2,
            f"rank {r.domain_rank}\n{y1 - y0} x {x1 - x0}",
            ha="center",
            va="center",
            fontsize=8,
        )
    ax.set_xlim(0, max(total, 1))
    ax.set_ylim(max(total, 1), 0)
    ax.set_aspect("equal")
    ax.set_xlabel("token column (cp1 blocks)")
    ax.set_ylabel("token row (cp0 blocks)")
    ax.set_title("pair tiles (padded layout)")

    ax = axes[1, 0]
    labels = [f"{r.domain_rank}\n({r.coordinate[0]},{r.coordinate[1]})" for r in report.ranks]
    atoms = report.cost.rank_atoms
    even_atoms = report.even_cost.rank_atoms
    x = torch.arange(len(report.ranks)).numpy()
    ax.bar(x - 0.2, even_atoms, width=0.4, color="lightgray", label="even split")
    ax.bar(x + 0.2, atoms, width=0.4, color="tab:blue", label=f"this plan ({report.label})")
    ax.axhline(sum(atoms) / max(len(atoms), 1), color="black", lw=1, ls="--", label="mean")
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("atoms per rank")
    ax.set_title("atoms per rank")
    ax.legend(fontsize=8)

    ax = axes[1, 1]
    bottom = [0.0] * len(report.ranks)
    for k, group in enumerate(GROUPS):
        values = [r.group_bytes[group] / 2**20 for r in report.ranks]
        ax.bar(x, values, bottom=bottom, color=plt.get_cmap("Set2")(k), label=group)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("MiB per rank")
    ax.set_title(f"bytes per rank by feature group (max/mean {report.byte_imbalance:.3f})")
    ax.legend(fontsize=8)

    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


__all__ = [
    "GROUPS",
    "PlanReport",
    "RankLoad",
    "draw_plan",
    "feature_group",
    "plan_report",
]
