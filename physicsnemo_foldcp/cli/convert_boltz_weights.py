r"""Command line of the weights conversion: Boltz-2's ``.ckpt`` to a checkpoint directory.

::

    python -m physicsnemo_foldcp.cli.convert_boltz_weights boltz2_conf.ckpt out/weights \
        [--max-bytes 16G] [--allow-nonfinite]

The file is read safely (:func:`~physicsnemo_foldcp.training.boltz_weights.read_boltz_weights`:
size bound, ``weights_only=True`` with a small allow-list), loaded into the
``Boltz2Model`` its hyperparameters describe, and written by
:func:`~physicsnemo_foldcp.training.boltz_weights.convert_boltz_weights` as a checkpoint
directory that ``load_checkpoint`` (and ``examples/predict.py predict.checkpoint=...``)
reads. Nothing in the file is ever unpickled without that allow-list.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from physicsnemo_foldcp.training.boltz_weights import MAX_WEIGHTS_BYTES, convert_boltz_weights
from physicsnemo_foldcp.training.checkpoint import CheckpointError

PROG = "python -m physicsnemo_foldcp.cli.convert_boltz_weights"
"""How the tool is run (its name in the usage line)."""

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def byte_size(text: str) -> int:
    """``"16G"`` -> ``17179869184``: a number of bytes, with an optional K/M/G/T (2^10...).

    Raises
    ------
    argparse.ArgumentTypeError
        For anything else.
    """
    match = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)i?B?\s*", text, flags=re.I)
    if not match:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: write bytes, or a number with K, M, G or T (16G)"
        )
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface of ``python -m physicsnemo_foldcp.cli.convert_boltz_weights``."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Read Boltz-2's Lightning checkpoint without running code from it, build "
        "the Boltz2Model its hyperparameters describe, and write it as this project's "
        "checkpoint directory.",
    )
    p.add_argument("checkpoint", type=Path, help="the .ckpt (e.g. ~/.boltz/boltz2_conf.ckpt)")
    p.add_argument("out", type=Path, help="the checkpoint directory to write (must not exist)")
    p.add_argument(
        "--max-bytes",
        type=byte_size,
        default=MAX_WEIGHTS_BYTES,
        help=f"refuse a larger file before reading it (default {MAX_WEIGHTS_BYTES // 2**30}G)",
    )
    p.add_argument("--allow-nonfinite", action="store_true", help="accept NaN or infinite weights")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the conversion; returns the exit status (1 when the file is refused)."""
    args = build_parser().parse_args(argv)
    try:
        out = convert_boltz_weights(
            args.checkpoint,
            args.out,
            max_bytes=args.max_bytes,
            allow_nonfinite=args.allow_nonfinite,
        )
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {out} from {args.checkpoint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["PROG", "build_parser", "byte_size", "main"]
