"""Build the ddp x cp0 x cp1 mesh and print its layout (rank 0) and each rank's place in it.

python examples/show_mesh.py                                    # 1 process, 1x1x1
torchrun --standalone --nproc-per-node 4 examples/show_mesh.py --cp 2 2

The mesh is built from the processes the launcher started: a mesh of more than one rank
needs torchrun (or SLURM / OpenMPI) with that many processes; on a mismatch the error says
which command to run.
"""

import argparse

import torch.distributed as dist

import physicsnemo_foldcp as fc
from physicsnemo_foldcp.training.logs import setup_logging


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ddp", type=int, default=-1, help="domain groups (-1: infer)")
    parser.add_argument("--cp", type=int, nargs=2, default=(1, 1), metavar=("CP0", "CP1"))
    return parser


def launch_command(ddp: int, cp: tuple[int, int]) -> str:
    """The command that starts as many processes as the mesh ``(ddp, *cp)`` has ranks."""
    ranks = max(ddp, 1) * cp[0] * cp[1]
    flags = (f"--ddp {ddp} " if ddp != -1 else "") + f"--cp {cp[0]} {cp[1]}"
    return f"torchrun --standalone --nproc-per-node {ranks} examples/show_mesh.py {flags}"


def main() -> None:
    args = build_parser().parse_args()
    setup_logging("INFO")

    cp = (args.cp[0], args.cp[1])
    try:
        mesh = fc.init_mesh(ddp=args.ddp, cp=cp)
    except ValueError as err:
        if "world size" not in str(err):
            raise
        raise SystemExit(
            f"{err}\nThis mesh needs one process per rank; run:\n  {launch_command(args.ddp, cp)}"
        ) from err
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
