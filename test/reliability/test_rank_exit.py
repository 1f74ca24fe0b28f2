"""A rank that dies mid-epoch: its peers exit with an error within the timeout, not a hang.

Two processes are started by hand (no torchrun, whose agent would kill the survivors
itself), so what ends the survivor is the bounded wait of the project's collectives.
"""

import os
import re
import socket
import subprocess
import sys
import textwrap

TIMEOUT_S = 10

WORKER = textwrap.dedent(
    """
    import os, sys, time
    import physicsnemo_foldcp as fc
    from physicsnemo_foldcp.data.synthetic import make_complex
    mesh = fc.init_mesh(ddp=1, cp=(1, 2), timeout_s=float(os.environ["FAULT_TIMEOUT_S"]))
    for step in range(6):
        if mesh.rank == 1 and step == 3:
            print(f"rank 1 exits mid-epoch at {time.time():.3f}", flush=True)
            os._exit(3)
        x = make_complex(24, seed=step) if mesh.is_domain_source else None
        try:
            fc.scatter_features(x, mesh)
        except Exception:
            print(f"rank {mesh.rank} failed at {time.time():.3f}", flush=True)
            raise
        print(f"rank {mesh.rank} step {step} done", flush=True)
    print(f"rank {mesh.rank} finished all steps", flush=True)
    """
)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_survivor_exits_with_an_error_within_the_timeout():
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, FAULT_TIMEOUT_S=str(TIMEOUT_S))
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", WORKER],
                env=env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        )
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert procs[1].returncode == 3, outputs[1][-2000:]
    exit_at = float(re.search(r"exits mid-epoch at ([\d.]+)", outputs[1]).group(1))
    # The survivor completed the steps before the exit, then failed instead of hanging.
    assert "rank 0 step 2 done" in outputs[0], outputs[0][-3000:]
    assert "finished all steps" not in outputs[0]
    assert procs[0].returncode != 0, outputs[0][-3000:]
    assert "Traceback" in outputs[0]
    failed_at = float(re.search(r"rank 0 failed at ([\d.]+)", outputs[0]).group(1))
    assert failed_at - exit_at < TIMEOUT_S + 15, (
        f"survivor failed {failed_at - exit_at:.1f} s later"
    )
