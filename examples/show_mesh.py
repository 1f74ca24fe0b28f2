"""Build the ddp x cp0 x cp1 mesh and print its layout (rank 0) and each rank's place in it.

python examples/show_mesh.py                                    # 1 process, 1x1x1
torchrun --standalone --nproc-per-node 4 examples/show_mesh.py --cp 2 2
"""

import argparse

import torch.distributed as dist

import physicsnemo_foldcp as fc
from physicsnemo_foldcp.training.logs import setup_logging


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ddp", type=int, default=-1, help="domain groups (-1: infer)")
    parser.add_argument("--cp", type=int, nargs=2, default=(1, 1), metavar=("CP0", "CP1"))
    args = parser.parse_args()
    setup_logging("INFO")

    mesh = fc.init_mesh(ddp=args.ddp, cp=tuple(args.cp))
    line = (
        f"rank {mesh.rank}: coordinate (ddp, cp0, cp1) = {mesh.coordinate}, "
        f"domain source = rank {mesh.domain_source_rank}, device = {mesh.device}"
    )
    lines = [None] * mesh.world_size
    dist.all_gather_object(lines, line)
    if mesh.rank == 0:
        print("\n".join(lines))
    fc.shutdown()


if __name__ == "__main__":
    main()
