"""Do two checkouts compute the same bits? Boltz's Pairformer under CP, saved and compared.

    torchrun --standalone --nproc-per-node 4 benchmarks/kernel_bits.py --save OUT
    torchrun --standalone --nproc-per-node 6 benchmarks/kernel_bits.py --cp 2 3 --save OUT
    python benchmarks/kernel_bits.py --compare OUT_A OUT_B

``--save`` runs Boltz's own ``PairformerModule`` (the Pairformer benchmark's module, inputs,
loss and dropout draws: :mod:`benchmarks.bench_pairformer`) forward and backward on the
launched mesh, for every ``--tokens`` size and every ``--budgets`` work budget (the default
budget runs each pair kernel in one piece with its steps overlapped; a tiny one cuts them
into the most pieces, one key or one panel at a time), and writes each rank's output blocks
and the gradients of the inputs and of every parameter to ``OUT/rank<r>.pt``. Run it in
two checkouts (``git worktree add``) on the same mesh; ``--compare`` then says, tensor by
tensor, whether the two are bit-identical (``torch.equal``), and exits 1 when one is not.
A change that only moves data (fewer copies, collectives overlapped with compute) must
leave every bit as it was.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

try:
    from benchmarks import bench_pairformer as pairformer
    from benchmarks import common
except ModuleNotFoundError:  # run as a script: the repository root is not on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import bench_pairformer as pairformer
    from benchmarks import common

import physicsnemo_foldcp as fc
import physicsnemo_foldcp.boltz as fc_boltz
from physicsnemo_foldcp.core import compat
from physicsnemo_foldcp.kernels.budget import work_budget
from physicsnemo_foldcp.testing.layouts import TokenLayout
from physicsnemo_foldcp.training.loop import set_precision

TINY_BUDGET_MIB = 1e-6
"""A budget below one key's scores and one panel: every kernel takes its most pieces."""


def pairformer_results(
    mesh, n_tokens: int, budget_mib: float, sizes: pairformer.PairformerSizes, seed: int = 0
) -> dict[str, torch.Tensor]:
    """This rank's output blocks and gradients of one Pairformer step at ``budget_mib``."""
    module = pairformer.build_module(sizes, seed, init_noise=0.1).to(mesh.device)
    layout = TokenLayout(mesh, n_tokens)
    s, z, mask, pair_mask = pairformer.pair_inputs(n_tokens, sizes, seed, padded=3)
    s_leaf = layout.local(s, ("tokens", None)).requires_grad_(True)
    z_leaf = layout.local(z, pairformer.PAIR).requires_grad_(True)
    m_st, _ = layout.shard(mask, ("tokens",))
    p_st, _ = layout.shard(pair_mask, ("tokens", "tokens"))
    wrap_s = pairformer.rewrapper(layout, (1, n_tokens, sizes.token_s), ("tokens", None))
    wrap_z = pairformer.rewrapper(layout, (1, n_tokens, n_tokens, sizes.token_z), pairformer.PAIR)
    with work_budget(budget_mib):
        torch.manual_seed(seed + 1)
        s_out, z_out = module(wrap_s(s_leaf), wrap_z(z_leaf), m_st, p_st)
        pairformer.pair_loss(s_out, z_out, m_st, p_st).backward()
    tag = f"N{n_tokens}_budget{budget_mib:g}"
    out = {
        f"{tag}/s_out": compat.local_tensor(s_out).detach(),
        f"{tag}/z_out": compat.local_tensor(z_out).detach(),
        f"{tag}/grad_s": s_leaf.grad,
        f"{tag}/grad_z": z_leaf.grad,
    }
    out.update({f"{tag}/grad {name}": p.grad for name, p in module.named_parameters()})
    return out


def save(
    out: Path, tokens: Sequence[int], budgets: Sequence[float], cp: Sequence[int] | None
) -> None:
    """Run every size and budget on the launched mesh; each rank writes its tensors."""
    fc_boltz.install()
    set_precision("fp32")
    mesh = fc.init_mesh(ddp=1, cp=common.cp_shape(cp))
    try:
        results: dict[str, torch.Tensor] = {}
        for n in tokens:
            for budget in budgets:
                results.update(pairformer_results(mesh, n, budget, pairformer.PairformerSizes()))
        out.mkdir(parents=True, exist_ok=True)
        torch.save({k: v.cpu() for k, v in results.items()}, out / f"rank{mesh.rank}.pt")
        if mesh.rank == 0:
            print(f"saved {len(results)} tensors per rank to {out} ({mesh.describe()})")
    finally:
        with contextlib.suppress(Exception):
            fc.shutdown()


def compare(a: Path, b: Path) -> int:
    """Print the tensors that differ between two saves of the same mesh; 0 when none does."""
    files_a, files_b = sorted(a.glob("rank*.pt")), sorted(b.glob("rank*.pt"))
    if not files_a or [f.name for f in files_a] != [f.name for f in files_b]:
        print(f"{a} and {b} hold different ranks: {[f.name for f in files_a]}, "
              f"{[f.name for f in files_b]}")  # fmt: skip
        return 1
    total = differ = 0
    for fa, fb in zip(files_a, files_b):
        ta, tb = torch.load(fa), torch.load(fb)
        if ta.keys() != tb.keys():
            print(f"{fa.name}: different tensors saved ({sorted(set(ta) ^ set(tb))})")
            return 1
        for key in ta:
            total += 1
            if not torch.equal(ta[key], tb[key]):
                differ += 1
                gap = (ta[key] - tb[key]).abs().max().item()
                print(f"{fa.name} {key}: differs (max abs difference {gap:.3e})")
    print(f"{total - differ} of {total} tensors bit-identical over {len(files_a)} ranks")
    return 1 if differ else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``--save OUT`` under torchrun, or ``--compare A B``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--save", type=Path, metavar="OUT")
    mode.add_argument("--compare", type=Path, nargs=2, metavar=("A", "B"))
    parser.add_argument("--cp", type=int, nargs=2, metavar=("CP0", "CP1"))
    parser.add_argument("--tokens", type=int, nargs="+", default=[37, 61])
    parser.add_argument("--budgets", type=float, nargs="+", default=[64.0, TINY_BUDGET_MIB])
    args = parser.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    save(args.save, args.tokens, args.budgets, args.cp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
