"""Start ``torch.distributed`` through PhysicsNeMo and build the ``ddp x cp0 x cp1`` mesh.

One entry point, :func:`init_mesh`, works the same way under ``torchrun``, SLURM or
OpenMPI (whatever ``DistributedManager`` supports) and for a plain ``python script.py``
(world size 1, mesh ``1 x 1 x 1``).

Backend and device: ``DistributedManager`` picks NCCL and ``cuda:<LOCAL_RANK>`` when CUDA
and NCCL are available, gloo and ``cpu`` otherwise. Two upstream quirks of the CPU path
are handled here, at run time, without touching the installed package:

* ``DistributedManager.setup`` passes ``device_id=cpu`` to ``init_process_group``, which
  torch >= 2.13 rejects with a ``ValueError``; a CPU ``device_id`` is dropped.
* ``physicsnemo.domain_parallel`` registers its ShardTensor custom ops only when CUDA is
  available; they are registered here on CPU.

Under ``torchrun`` the elastic agent hosts the job's TCPStore and keeps it, with every key
written in it, across the restarts of ``--max-restarts``; the process group of a restarted
attempt would read the addresses its predecessors published there (gloo connects to the
dead workers' ports until its timeout). The default group is therefore created on a
namespace of the agent's store that is new for each attempt (:func:`_attempt_store`).

Every process group behind the mesh is created with the same bounded timeout, so a
collective that a peer never joins raises instead of hanging.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from physicsnemo.distributed import DistributedManager
from torch.distributed import distributed_c10d

from physicsnemo_foldcp.distributed.mesh import MESH_DIM_NAMES, FoldMesh
from physicsnemo_foldcp.distributed.rng import sync_rng_over_domain

logger = logging.getLogger("physicsnemo_foldcp")

DEFAULT_TIMEOUT_S = 600.0
"""Default bound, in seconds, on a collective wait (``FOLDCP_TIMEOUT_S`` overrides it)."""

_LAUNCHER_RANK_VARS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK")

_ATTEMPT_NAMESPACE = "physicsnemo_foldcp/attempt"
"""Keys of the per-attempt handshake in the elastic agent's store."""

_ATTEMPT_POLL_S = (0.01, 0.25)
"""First and longest pause, in seconds, between two looks of a rank at the handshake."""

_meshes: dict[tuple[tuple[int, int, int], float], FoldMesh] = {}
_job_timeout: timedelta | None = None
_custom_ops_registered = False


def default_timeout() -> timedelta:
    """Collective timeout from ``FOLDCP_TIMEOUT_S``, or :data:`DEFAULT_TIMEOUT_S`."""
    raw = os.environ.get("FOLDCP_TIMEOUT_S")
    try:
        seconds = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError as err:
        raise ValueError(f"FOLDCP_TIMEOUT_S must be a number of seconds, got {raw!r}") from err
    if seconds <= 0:
        raise ValueError(f"FOLDCP_TIMEOUT_S must be > 0, got {raw!r}")
    return timedelta(seconds=seconds)


def resolve_mesh_shape(ddp: int, cp: Sequence[int], world_size: int) -> tuple[int, int, int]:
    """Check a requested ``(ddp, cp0, cp1)`` against the world size and fill in one ``-1``.

    Parameters
    ----------
    ddp : int
        Number of domain groups, or ``-1`` to infer it.
    cp : Sequence[int]
        ``(cp0, cp1)``; one entry (of the three sizes overall) may be ``-1``.
    world_size : int
        Number of processes in the job.

    Returns
    -------
    tuple[int, int, int]
        ``(ddp, cp0, cp1)`` whose product is ``world_size``.

    Raises
    ------
    ValueError
        If an entry is not an integer, is 0 or below -1, if more than one entry is -1, or
        if the sizes do not multiply to ``world_size``.
    """
    if isinstance(cp, (str, bytes)) or not isinstance(cp, Sequence) or len(cp) != 2:
        raise ValueError(f"cp must be a pair (cp0, cp1), got {cp!r}")
    sizes = {"ddp": ddp, "cp0": cp[0], "cp1": cp[1]}
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int):
            raise ValueError(f"mesh size {name} must be an integer, got {size!r}")
        if size == 0 or size < -1:
            raise ValueError(
                f"mesh size {name}={size} is invalid: every mesh size must be >= 1 "
                "(or -1 for one size inferred from the world size)"
            )
    inferred = [name for name, size in sizes.items() if size == -1]
    if len(inferred) > 1:
        raise ValueError(f"only one mesh size may be -1, got -1 for {', '.join(inferred)}")
    if inferred:
        known = 1
        for size in sizes.values():
            if size != -1:
                known *= size
        if world_size % known:
            raise ValueError(
                f"cannot infer mesh size {inferred[0]}: world size {world_size} is not a "
                f"multiple of the other sizes' product {known} "
                f"(ddp={ddp}, cp0={cp[0]}, cp1={cp[1]})"
            )
        sizes[inferred[0]] = world_size // known
    shape = (sizes["ddp"], sizes["cp0"], sizes["cp1"])
    if shape[0] * shape[1] * shape[2] != world_size:
        raise ValueError(
            f"mesh ddp x cp0 x cp1 = {shape[0]} x {shape[1]} x {shape[2]} = "
            f"{shape[0] * shape[1] * shape[2]} ranks does not match the world size "
            f"{world_size}; launch {shape[0] * shape[1] * shape[2]} processes or change the mesh"
        )
    return shape


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_set_for_single_process: dict[str, str | None] = {}
"""Launcher variables :func:`_ensure_single_process_env` set, with their earlier values."""


def _ensure_single_process_env() -> None:
    """Give a process started without a launcher the environment of a 1-rank job.

    What it sets is put back by :func:`shutdown`, so that a later job of this process (or
    a process it starts) picks its own free port instead of inheriting this job's.
    """
    if any(var in os.environ for var in _LAUNCHER_RANK_VARS):
        return
    single = {
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "RANK": "0",
    }
    for var, value in single.items():
        if var == "RANK" or var not in os.environ:
            _set_for_single_process.setdefault(var, os.environ.get(var))
            os.environ[var] = value


def _restore_single_process_env() -> None:
    """Put back the launcher variables :func:`_ensure_single_process_env` set."""
    while _set_for_single_process:
        var, earlier = _set_for_single_process.popitem()
        if earlier is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = earlier


def _agent_store_address() -> tuple[str, int] | None:
    """The elastic agent's store, ``(MASTER_ADDR, MASTER_PORT)``, when the workers share it.

    ``torchrun`` exports ``TORCHELASTIC_USE_AGENT_STORE=True`` when its agent hosts the
    store at ``MASTER_ADDR:MASTER_PORT`` for the workers (its default).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    return addr, int(port)


def _attempt_token(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> str:
    """Agree on a token that names this attempt of the job, new for each attempt.

    Rank 0 draws the token and publishes it under ``<namespace>/token``. A store kept
    across attempts may still hold the token of an earlier attempt, so every other rank
    has it confirmed: it posts a nonce of its own under ``<token>/join/<rank>`` and takes
    the token once rank 0 has answered with ``<token>/welcome/<nonce>``; a token that
    nobody answers is an earlier attempt's and is replaced when rank 0 publishes its own.
    ``TORCHELASTIC_RESTART_COUNT`` cannot name the attempt: each agent counts only the
    failures of its own workers, so the nodes of one attempt may disagree on it.

    Parameters
    ----------
    store : torch.distributed.Store
        A client of the agent's store.
    rank, world_size : int
        This rank and the number of ranks of the attempt.
    timeout : timedelta
        Bound on the handshake.

    Returns
    -------
    str
        The token, the same on every rank of the attempt.

    Raises
    ------
    RuntimeError
        If the ranks do not meet within ``timeout``.
    """
    ns = _ATTEMPT_NAMESPACE
    if rank == 0:
        token = uuid.uuid4().hex
        store.set(f"{ns}/token", token)
        joins = [f"{ns}/{token}/join/{r}" for r in range(1, world_size)]
        if joins:
            try:
                store.wait(joins, timeout)
            except dist.DistStoreError as err:
                missing = [r for r, key in enumerate(joins, 1) if not store.check([key])]
                raise RuntimeError(
                    f"rank(s) {missing} did not join the job within {timeout.total_seconds():g} "
                    "s (the agent store's handshake before the process group is created)"
                ) from err
            nonces = [nonce.decode() for nonce in store.multi_get(joins)]
            store.multi_set([f"{ns}/{token}/welcome/{n}" for n in nonces], ["1"] * len(nonces))
        return token

    nonce = uuid.uuid4().hex
    deadline = time.monotonic() + timeout.total_seconds()
    joined = None
    pause = _ATTEMPT_POLL_S[0]
    while True:
        if store.check([f"{ns}/token"]):
            token = store.get(f"{ns}/token").decode()
            if token != joined:
                store.set(f"{ns}/{token}/join/{rank}", nonce)
                joined = token
            if store.check([f"{ns}/{token}/welcome/{nonce}"]):
                return token
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"rank {rank} got no answer from rank 0 within {timeout.total_seconds():g} s "
                "(the agent store's handshake before the process group is created)"
            )
        time.sleep(pause)
        pause = min(2 * pause, _ATTEMPT_POLL_S[1])


def _attempt_store(
    rank: int, world_size: int, timeout: timedelta
) -> tuple[dist.Store, int, int] | None:
    """The store, rank and world size for the default process group under ``torchrun``.

    Parameters
    ----------
    rank, world_size : int
        As given to ``init_process_group``; -1 reads ``RANK`` / ``WORLD_SIZE``.
    timeout : timedelta
        Bound on connecting to the store and on the handshake.

    Returns
    -------
    tuple[torch.distributed.Store, int, int] or None
        A client of the agent's store whose keys live under a prefix that names this
        attempt (:func:`_attempt_token`), so a group created after a ``--max-restarts``
        restart does not read the keys an earlier attempt left there; ``None`` when the
        workers do not share the agent's store (no ``torchrun``, or
        ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``): the store ``env://`` creates is new.
    """
    address = _agent_store_address()
    if address is None:
        return None
    rank = int(os.environ["RANK"]) if rank == -1 else rank
    world_size = int(os.environ["WORLD_SIZE"]) if world_size == -1 else world_size
    store = dist.TCPStore(
        host_name=address[0],
        port=address[1],
        world_size=world_size,
        is_master=False,
        timeout=timeout,
    )
    token = _attempt_token(store, rank, world_size, timeout)
    return dist.PrefixStore(f"{_ATTEMPT_NAMESPACE}/{token}/default_pg", store), rank, world_size


@contextlib.contextmanager
def _bounded_group_creation(timeout: timedelta) -> Iterator[None]:
    """Create process groups with ``timeout`` and without a CPU ``device_id``.

    ``init_process_group`` gets ``timeout`` and loses a ``device_id`` of type cpu; groups
    made by ``new_group`` without an explicit timeout (as ``init_device_mesh`` makes them)
    get ``timeout`` as their default. Under ``torchrun``, an ``init_process_group`` given
    neither ``init_method`` nor ``store`` gets this attempt's namespace of the agent's
    store (:func:`_attempt_store`). Everything is restored on exit.
    """
    original_init = dist.init_process_group
    saved_defaults = (distributed_c10d.default_pg_timeout, distributed_c10d.default_pg_nccl_timeout)

    def init_process_group(*args, **kwargs):
        device_id = kwargs.get("device_id")
        if device_id is not None and torch.device(device_id).type == "cpu":
            del kwargs["device_id"]
        kwargs.setdefault("timeout", timeout)
        if len(args) < 2 and kwargs.get("init_method") is None and kwargs.get("store") is None:
            rank, world_size = kwargs.get("rank", -1), kwargs.get("world_size", -1)
            attempt = _attempt_store(rank, world_size, kwargs["timeout"])
            if attempt is not None:
                kwargs.pop("init_method", None)
                kwargs.update(zip(("store", "rank", "world_size"), attempt, strict=True))
        return original_init(*args, **kwargs)

    dist.init_process_group = init_process_group
    distributed_c10d.default_pg_timeout = timeout
    if saved_defaults[1] is not None:
        distributed_c10d.default_pg_nccl_timeout = timeout
    try:
        yield
    finally:
        dist.init_process_group = original_init
        distributed_c10d.default_pg_timeout, distributed_c10d.default_pg_nccl_timeout = (
            saved_defaults
        )


def register_shard_tensor_ops() -> None:
    """Register PhysicsNeMo's ShardTensor custom ops (upstream does so only with CUDA)."""
    global _custom_ops_registered
    if _custom_ops_registered:
        return
    from physicsnemo.domain_parallel import register_custom_ops

    if not torch.cuda.is_available():
        register_custom_ops()
    _custom_ops_registered = True


def _domain_group(global_mesh) -> dist.ProcessGroup:
    """A new group over this rank's ``cp0 x cp1`` ranks, row-major.

    Created afresh for every mesh (``DistributedManager.get_mesh_group`` caches by mesh
    hash, which would hand a mesh with another timeout the groups of an earlier one).
    """
    ranks = [int(r) for r in global_mesh["cp0", "cp1"].mesh.flatten().tolist()]
    return dist.new_group(ranks, use_local_synchronization=True)


def _object_group(global_mesh, domain_group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A gloo mirror of this rank's domain group when the backend is not gloo.

    Every rank creates the mirror of every domain group (``new_group`` is collective over
    the world), in ddp order, and keeps its own.
    """
    if dist.get_backend() == "gloo":
        return domain_group
    mine = None
    rank = dist.get_rank()
    for d in range(global_mesh.shape[0]):
        ranks = [int(r) for r in global_mesh.mesh[d].flatten().tolist()]
        group = dist.new_group(ranks, backend="gloo")
        if rank in ranks:
            mine = group
    assert mine is not None
    return mine


def init_mesh(
    ddp: int = -1,
    cp: Sequence[int] = (1, 1),
    *,
    timeout_s: float | None = None,
) -> FoldMesh:
    """Initialize the distributed job (once) and return the ``ddp x cp0 x cp1`` mesh.

    Works under ``torchrun`` (and SLURM / OpenMPI as ``DistributedManager`` supports) and
    in a single process started without a launcher (world size 1, mesh ``1 x 1 x 1``).
    NCCL on ``cuda:<LOCAL_RANK>`` is used when CUDA is available, gloo on CPU otherwise.
    Calling it again with another shape builds (and caches) another mesh over the same
    process group. Building a mesh gives every rank of a domain group the torch generator
    states of the group's source (``distributed.rng.sync_rng_over_domain``), so random
    draws from global shapes, such as dropout masks, agree over the domain; reseed with
    the same seed on every rank of a domain.

    Parameters
    ----------
    ddp : int, default -1
        Number of domain groups (data-parallel replicas); -1 infers it.
    cp : Sequence[int], default (1, 1)
        ``(cp0, cp1)``: the 2-D context-parallel mesh of each domain group. One of the
        three sizes may be -1.
    timeout_s : float, optional
        Bound, in seconds, on every collective wait of the groups created for this mesh.
        The first call, which starts the job, also sets it for the default group and as
        the job's timeout, used by later calls without ``timeout_s``. Defaults to
        ``FOLDCP_TIMEOUT_S`` or :data:`DEFAULT_TIMEOUT_S`. A mesh of the same shape with
        another timeout is a separate mesh with its own groups.

    Returns
    -------
    FoldMesh
        The mesh, its ddp and domain sub-meshes, this rank's coordinate and the global
        rank of its domain group's source.

    Raises
    ------
    ValueError
        If a size is 0 or below -1, or the sizes do not multiply to the world size (the
        message gives both numbers).
    RuntimeError
        If the process group or the mesh cannot be created.
    """
    global _job_timeout
    if timeout_s is not None:
        timeout = timedelta(seconds=timeout_s)
    else:
        timeout = _job_timeout if _job_timeout is not None else default_timeout()
    if timeout.total_seconds() <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    cp = tuple(cp) if not isinstance(cp, (str, bytes)) and hasattr(cp, "__iter__") else cp

    if not DistributedManager.is_initialized():
        _ensure_single_process_env()
        with _bounded_group_creation(timeout):
            DistributedManager.initialize()
        _job_timeout = timeout
    manager = DistributedManager()
    if not manager.distributed or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed could not be initialized: no launcher environment "
            "(RANK/WORLD_SIZE, SLURM or OpenMPI) was usable and the single-process "
            "fallback failed"
        )
    register_shard_tensor_ops()

    shape = resolve_mesh_shape(ddp, cp, manager.world_size)
    key = (shape, timeout.total_seconds())
    if key in _meshes:
        return _meshes[key]
    try:
        with _bounded_group_creation(timeout):
            global_mesh = manager.initialize_mesh(shape, MESH_DIM_NAMES)
            domain_group = _domain_group(global_mesh)
            object_group = _object_group(global_mesh, domain_group)
    except Exception as err:
        raise RuntimeError(
            f"could not build the ddp x cp0 x cp1 = {shape[0]} x {shape[1]} x {shape[2]} "
            f"mesh on {manager.world_size} ranks (backend {dist.get_backend()}): {err}"
        ) from err
    fold_mesh = FoldMesh(global_mesh, domain_group, timeout, object_group)
    sync_rng_over_domain(fold_mesh)
    _meshes[key] = fold_mesh
    if fold_mesh.rank == 0:
        logger.info("%s", fold_mesh.describe())
    return fold_mesh


def shutdown() -> None:
    """Destroy every process group and reset ``DistributedManager``.

    Safe to call more than once, and when nothing was initialized.
    """
    global _job_timeout
    _meshes.clear()
    _job_timeout = None
    try:
        DistributedManager.cleanup()
    finally:
        _restore_single_process_env()
