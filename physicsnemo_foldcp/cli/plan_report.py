r"""Command line of the plan report: per-rank contents of one sample on a ``cp0 x cp1`` mesh.

::

    python -m physicsnemo_foldcp.cli.plan_report --tokens 512 --cp 2 3 [--preset boltz2] \
        [--balanced] [--features sample.pt|sample.npz] [--png plan.png]

The sample is a feature file (:func:`physicsnemo_foldcp.data.files.load_sample`) or a
synthetic complex of the given size; the options become one
:class:`~physicsnemo_foldcp.sharding.options.ShardingOptions`, and the report is
:func:`physicsnemo_foldcp.sharding.plan_report.plan_report` (the library function), printed,
and drawn with :func:`~physicsnemo_foldcp.sharding.plan_report.draw_plan`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from physicsnemo_foldcp.features.registry import FeatureRegistry
from physicsnemo_foldcp.sharding.options import MAP_LAYOUTS, BalanceOptions, ShardingOptions
from physicsnemo_foldcp.sharding.plan_report import draw_plan, plan_report

PROG = "python -m physicsnemo_foldcp.cli.plan_report"
"""How the tool is run (its name in the usage line)."""

_DEFAULTS = ShardingOptions()


def _parse_composition(text: str | None) -> dict[str, float] | None:
    """``"protein=0.4,rna=0.4"`` -> ``{"protein": 0.4, "rna": 0.4}``."""
    if not text:
        return None
    out = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        if not value:
            raise argparse.ArgumentTypeError(
                f"composition {text!r}: write kind=fraction pairs, e.g. protein=0.4,rna=0.4"
            )
        out[key.strip()] = float(value)
    return out


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface of ``python -m physicsnemo_foldcp.cli.plan_report``."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Per-rank token/atom ranges, bytes per feature group, padding and "
        "imbalance of one sample on a cp0 x cp1 mesh, and a PNG of the partition.",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--tokens", type=int, help="size of a synthetic complex (tokens)")
    source.add_argument("--features", type=Path, help="a sample saved as .pt or .npz")
    p.add_argument("--cp", type=int, nargs=2, required=True, metavar=("CP0", "CP1"))
    p.add_argument("--preset", choices=("boltz1", "boltz2"), default="boltz2")
    p.add_argument("--balanced", action="store_true", help="use the balanced row blocks")
    p.add_argument(
        "--pair-weight",
        type=float,
        default=_DEFAULTS.balance.pair_weight,
        help="balanced: pair weight",
    )
    p.add_argument(
        "--atom-weight",
        type=float,
        default=_DEFAULTS.balance.atom_weight,
        help="balanced: atom weight",
    )
    p.add_argument("--token-multiple", type=int, default=_DEFAULTS.token_multiple)
    p.add_argument("--atom-multiple", type=int, default=_DEFAULTS.atom_multiple)
    p.add_argument("--map-layout", choices=MAP_LAYOUTS, default=_DEFAULTS.map_layout)
    p.add_argument("--seed", type=int, default=0, help="synthetic complex seed")
    p.add_argument("--msa-rows", type=int, default=256, help="synthetic complex MSA depth")
    p.add_argument(
        "--composition",
        type=_parse_composition,
        default=None,
        help="synthetic token fractions, e.g. protein=0.4,rna=0.4,ligand=0.2",
    )
    p.add_argument("--png", type=Path, help="write the partition drawing here")
    return p


def options_from_args(args: argparse.Namespace) -> ShardingOptions:
    """The :class:`ShardingOptions` the parsed arguments ask for."""
    return ShardingOptions(
        token_multiple=args.token_multiple,
        atom_multiple=args.atom_multiple,
        map_layout=args.map_layout,
        balance=BalanceOptions(
            mode="balanced" if args.balanced else "even",
            pair_weight=args.pair_weight,
            atom_weight=args.atom_weight,
        ),
    )


def _sample(args: argparse.Namespace) -> dict[str, Any]:
    """The sample the arguments name: a feature file, or a synthetic complex."""
    if args.features is not None:
        from physicsnemo_foldcp.data.files import load_sample

        return load_sample(args.features)
    from physicsnemo_foldcp.data.synthetic import make_complex

    return make_complex(
        args.tokens,
        seed=args.seed,
        preset=args.preset,
        msa_rows=args.msa_rows,
        composition=args.composition,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the plan report; returns the exit status (2 for invalid arguments)."""
    args = build_parser().parse_args(argv)
    cp0, cp1 = args.cp
    if cp0 < 1 or cp1 < 1:
        print(f"error: --cp {cp0} {cp1}: both sizes must be >= 1", file=sys.stderr)
        return 2
    try:
        options = options_from_args(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    report = plan_report(
        _sample(args),
        (cp0, cp1),
        registry=FeatureRegistry.preset(args.preset),
        options=options,
        label="balanced" if args.balanced else "even",
    )
    print(report.format())
    if args.png is not None:
        print(f"partition drawn to {draw_plan(report, args.png)}")
    return 0


__all__ = ["PROG", "build_parser", "main", "options_from_args"]


if __name__ == "__main__":
    raise SystemExit(main())
