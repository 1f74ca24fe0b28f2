"""The training loop: one complex per domain group per step, DDP / FSDP2 over ``ddp``.

:func:`train` takes a serial model and a serial dataset and runs them on the job's
``ddp x cp0 x cp1`` mesh: the model is synced over each domain group and wrapped for the
``ddp`` axis (:func:`~physicsnemo_foldcp.distributed.wrappers.wrap_model`), every step each
domain group scatters one sample (:class:`~physicsnemo_foldcp.data.ShardedLoader`), runs
the unchanged ``forward`` on the ShardTensors and steps the optimizer. Rank 0 alone shows a
progress bar and logs metrics; checkpoints are written every ``checkpoint_every`` steps and
a run resumes exactly (model, optimizer, data position, random generators).

The loss of a step is the mean over the domain groups of their samples' losses (what DDP
and FSDP2 optimise, since they average the gradients over ``ddp``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from physicsnemo.domain_parallel import ShardTensor
from torch import nn
from torch.distributed.tensor import DTensor

from physicsnemo_foldcp.core.grad_buckets import DEFAULT_BUCKET_MIB, attach_gradient_buckets
from physicsnemo_foldcp.data.loader import ShardedLoader
from physicsnemo_foldcp.distributed.mesh import FoldMesh
from physicsnemo_foldcp.distributed.wrappers import (
    param_groups,
    resolve_wrapper,
    unwrap,
    wrap_model,
)
from physicsnemo_foldcp.features.registry import FeatureRegistry
from physicsnemo_foldcp.training.atomic import write_text_atomic
from physicsnemo_foldcp.training.bounds import check_range, check_seed
from physicsnemo_foldcp.training.checkpoint import load_checkpoint, save_checkpoint
from physicsnemo_foldcp.training.compile import (
    COMPILE_MODES,
    compile_model,
    local_features,
    reduce_region_gradients,
    resolve_compile_mode,
)
from physicsnemo_foldcp.training.ema import WeightAverage
from physicsnemo_foldcp.training.hooks import LossFn, model_loss, module_types
from physicsnemo_foldcp.training.logs import MetricLogger
from physicsnemo_foldcp.training.rundir import (
    RESUME_MODES,
    RunPlan,
    decide,
    fingerprint,
    prepare_run,
)
from physicsnemo_foldcp.training.runlock import JobLock, lock_path

logger = logging.getLogger("physicsnemo_foldcp.training")

PRECISIONS = ("fp32", "tf32", "bf16")
"""``fp32``: TF32 off (exact comparisons); ``tf32``: TF32 matmuls on GPU; ``bf16``: autocast."""

OPTIMIZERS = ("adamw", "sgd")
"""Optimizers :func:`build_optimizer` knows."""


class BatchSizeError(ValueError):
    """More than one sample per domain group: grow the batch over ``ddp`` instead."""


@dataclass
class OptimizerSettings:
    """Optimizer of a run.

    Attributes
    ----------
    name : {"adamw", "sgd"}
        Optimizer class.
    lr : float
        Learning rate.
    weight_decay : float
        Decoupled (AdamW) or L2 (SGD) weight decay.
    betas : tuple[float, float]
        AdamW's betas.
    momentum : float
        SGD's momentum.

    Notes
    -----
    This is also the schema of the Hydra ``optimizer`` group
    (:mod:`physicsnemo_foldcp.training.config`): its defaults are the only ones. Ranges:
    ``lr > 0``, ``weight_decay >= 0``, each beta in ``[0, 1)``, ``momentum`` in ``[0, 1]``
    (:class:`~physicsnemo_foldcp.training.bounds.OptionRangeError` otherwise).
    """

    name: str = "adamw"
    lr: float = 3e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    momentum: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optimizer.name must be one of {OPTIMIZERS}, got {self.name!r}")
        if len(self.betas) != 2:
            raise ValueError(f"optimizer.betas must be two numbers, got {list(self.betas)}")
        for i, beta in enumerate(self.betas):
            check_range(f"optimizer.betas[{i}]", beta, low=0.0, high=1.0, high_open=True)
        self.betas = tuple(float(b) for b in self.betas)  # type: ignore[assignment]
        check_range("optimizer.lr", self.lr, low=0.0, low_open=True)
        check_range("optimizer.weight_decay", self.weight_decay, low=0.0)
        check_range("optimizer.momentum", self.momentum, low=0.0, high=1.0)


@dataclass
class TrainSettings:
    """Options of :func:`train`.

    Attributes
    ----------
    steps : int
        Total optimizer steps of the run (a resumed run continues up to it).
    wrapper : {"auto", "none", "ddp", "fsdp2"}
        Data-parallel wrapper over the ``ddp`` axis (see :func:`wrap_model`; with
        ``fsdp2`` every FSDP unit of the model is sharded on its own, then the root).
    precision : {"fp32", "tf32", "bf16"}
        Numerics of the forward pass.
    seed : int
        Seed of the data order (the model is initialised by the caller).
    log_every : int
        Log the loss on rank 0 every this many steps (0: never).
    checkpoint_every : int
        Write a checkpoint every this many steps (0: only at the end).
    checkpoint_dir : str or None
        Where checkpoints go (``step_<k>/`` directories and the run manifest ``run.json``);
        ``None`` writes none.
    resume : str or None
        ``"auto"``: continue this run from the newest checkpoint in ``checkpoint_dir``
        when the directory's manifest is this run's (a restarted job continues), start
        from scratch when there is none, refuse another run's checkpoints;
        ``"latest"``: the newest checkpoint in ``checkpoint_dir`` whatever run wrote it
        (from scratch if none); a checkpoint directory ``step_<k>/``; ``None``: from
        scratch, refusing a ``checkpoint_dir`` that holds checkpoints. See
        :mod:`~physicsnemo_foldcp.training.rundir` for how a run is identified.
    overwrite : bool
        Delete the checkpoints and metrics in the run's directories that ``resume``
        would not continue from, instead of refusing to start.
    compile : {"none", "auto", "whole", "regional"}
        See :mod:`~physicsnemo_foldcp.training.compile` (``regional`` needs ``ddp == 1``).
    compile_backend : str
        ``torch.compile`` backend (``"inductor"``; ``"aot_eager"`` traces without
        generating code).
    batch_size : int
        Samples per domain group per step; must be 1.
    progress : bool
        Show a progress bar on rank 0.
    metrics_file : str or None
        Rank 0 writes one JSON line per step (step, loss, seconds) to this file; a
        resumed run first drops the lines of steps after the resumed one, then appends.
        A file there that the project did not write is refused (see
        :mod:`~physicsnemo_foldcp.training.rundir`).
    summary_file : str or None
        Rank 0 writes the run's summary (:func:`write_summary`) here when the run ends;
        checked like ``metrics_file`` before the run starts.
    fsdp_units, compile_regions : list[str] or None
        Class paths (or classes) of the submodules FSDP2 shards one by one and regional
        compile compiles; ``None``: the model class's ``fsdp_units`` /
        ``compile_regions`` (see :mod:`~physicsnemo_foldcp.training.hooks`).
    loss : str or None
        Path of a ``loss(outputs, features)`` function; ``None``: the model's ``loss``
        method.
    ema_decay : float
        Decay of the exponential moving average of the weights kept beside them, as
        Boltz-2 trains with (``ema_decay`` 0.999 there,
        :class:`~physicsnemo_foldcp.training.ema.WeightAverage`): updated after every
        step, stored in the checkpoints, restored on resume, predicted with by
        ``examples/predict.py``; ``0``: none.
    grad_bucket_mib : float
        Size cap of the buckets in which parameter gradients are summed over the domain
        mesh, one all-reduce per bucket per step
        (:func:`~physicsnemo_foldcp.core.grad_buckets.attach_gradient_buckets`); ``0``:
        each module's backward sums its own (one all-reduce per call and mesh dim). Not
        with ``compile=regional``, whose regions sum their parameters' gradients after
        the backward.

    Notes
    -----
    This is also the schema of the Hydra ``train`` group
    (:mod:`physicsnemo_foldcp.training.config`): its defaults are the only ones. Invalid
    values raise when the settings are built (numbers out of range with
    :class:`~physicsnemo_foldcp.training.bounds.OptionRangeError`).
    """

    steps: int = 30
    wrapper: str = "auto"
    precision: str = "fp32"
    seed: int = 0
    log_every: int = 10
    checkpoint_every: int = 10
    checkpoint_dir: str | None = None
    resume: str | None = "auto"
    overwrite: bool = False
    compile: str = "none"
    compile_backend: str = "inductor"
    batch_size: int = 1
    progress: bool = True
    metrics_file: str | None = None
    summary_file: str | None = None
    fsdp_units: list[str] | None = None
    compile_regions: list[str] | None = None
    loss: str | None = None
    ema_decay: float = 0.0
    grad_bucket_mib: float = DEFAULT_BUCKET_MIB

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise a clear ``ValueError`` for an invalid setting (before any work)."""
        if self.batch_size != 1:
            raise BatchSizeError(
                f"per-domain-group batch size must be 1, got train.batch_size="
                f"{self.batch_size}: each domain group trains on one complex per step; grow "
                "the global batch over the ddp mesh axis (mesh.ddp) instead"
            )
        check_range("train.steps", self.steps, low=0, integer=True)
        check_seed("train.seed", self.seed)
        check_range("train.log_every", self.log_every, low=0, integer=True)
        check_range("train.checkpoint_every", self.checkpoint_every, low=0, integer=True)
        check_range("train.grad_bucket_mib", self.grad_bucket_mib, low=0)
        check_range("train.ema_decay", self.ema_decay, low=0, high=1)
        if self.precision not in PRECISIONS:
            raise ValueError(f"train.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"train.compile must be one of {COMPILE_MODES}, got {self.compile!r}")
        if self.resume == "latest" and not self.checkpoint_dir:
            raise ValueError("train.resume=latest needs train.checkpoint_dir")


@dataclass
class TrainResult:
    """What a run did.

    Attributes
    ----------
    losses : list[float]
        Loss of every step of this run (mean over domain groups), in order.
    start_step, end_step : int
        Steps done before this run (resume) and after it.
    seconds : float
        Wall time of the steps of this run.
    peak_memory : list[int]
        Peak memory of each global rank, in bytes (CPU: max RSS; GPU: max allocated).
    checkpoints : list[str]
        Checkpoint files written.
    model : nn.Module
        The wrapped model after training.
    optimizer : torch.optim.Optimizer
        Its optimizer.
    indices : list[int]
        Dataset index this rank's domain group trained on at each step.
    ema : WeightAverage or None
        The moving average of the weights (``train.ema_decay > 0``).
    """

    losses: list[float]
    start_step: int
    end_step: int
    seconds: float
    peak_memory: list[int]
    checkpoints: list[str] = field(default_factory=list)
    model: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    indices: list[int] = field(default_factory=list)
    ema: WeightAverage | None = None

    @property
    def steps_per_s(self) -> float:
        """Optimizer steps per second over this run."""
        steps = self.end_step - self.start_step
        return steps / self.seconds if self.seconds > 0 else float("nan")

    def summary(self) -> str:
        """A few lines for the end of a run."""
        steps = self.end_step - self.start_step
        lines = [
            f"trained steps {self.start_step + 1}..{self.end_step} ({steps} steps) in "
            f"{self.seconds:.1f} s: {self.steps_per_s:.2f} steps/s",
        ]
        if self.losses:
            lines.append(f"loss: first {self.losses[0]:.4f}, last {self.losses[-1]:.4f}")
        memory = ", ".join(f"r{r} {b / 2**20:.0f}" for r, b in enumerate(self.peak_memory))
        lines.append(f"peak memory per rank (MiB): {memory}")
        if self.checkpoints:
            lines.append(f"last checkpoint: {self.checkpoints[-1]}")
        return "\n".join(lines)


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory: ``max_memory_allocated`` on CUDA, max RSS otherwise."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def set_precision(precision: str) -> None:
    """Pin TF32 off (``fp32``, ``bf16``) or allow it (``tf32``) for matmuls and cuDNN."""
    allow = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = allow
    torch.backends.cudnn.allow_tf32 = allow
    torch.set_float32_matmul_precision("high" if allow else "highest")


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to bfloat16 for ``bf16``; a no-op otherwise."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def build_optimizer(model: nn.Module, settings: OptimizerSettings) -> torch.optim.Optimizer:
    """The optimizer of ``settings`` over ``model``'s parameters, grouped by device mesh."""
    if settings.name == "adamw":
        groups = param_groups(model)
        return torch.optim.AdamW(
            groups, lr=settings.lr, weight_decay=settings.weight_decay, betas=settings.betas
        )
    if settings.name == "sgd":
        groups = param_groups(model)
        return torch.optim.SGD(
            groups, lr=settings.lr, momentum=settings.momentum, weight_decay=settings.weight_decay
        )
    raise ValueError(f"optimizer name must be one of {OPTIMIZERS}, got {settings.name!r}")


def check_batch(features: Mapping[str, Any]) -> None:
    """Raise :class:`BatchSizeError` unless every tensor feature has a batch axis of 1.

    The scatter accepts unbatched samples too, but the model reads one batched sample
    (``[1, ...]``); this check is local (no communication). The scatter has already tagged
    the atom<->token maps, so nothing else needs preparing before ``forward``.

    Parameters
    ----------
    features : Mapping[str, Any]
        A sample as the model reads it (plain tensors or ShardTensors), batched.
    """
    for name in ("token_pad_mask", "res_type", "atom_pad_mask"):
        value = features.get(name)
        if isinstance(value, torch.Tensor):
            shape = tuple(value.shape)
            if len(shape) < 2 or shape[0] != 1:
                raise BatchSizeError(
                    f"feature {name!r} has shape {shape}: the model reads one batched sample "
                    "([1, ...]) per domain group; grow the batch over the ddp mesh axis"
                )


def domain_value(value: torch.Tensor) -> torch.Tensor:
    """The plain tensor a domain group's (Shard/DTensor) value stands for, detached.

    A replicated ShardTensor's local value is the global one (no communication); a
    ``Partial`` or sharded one is made whole with ``full_tensor()``, a collective over
    the domain mesh (call it on every rank of the domain). Plain tensors are returned
    detached.
    """
    if isinstance(value, (ShardTensor, DTensor)):
        if all(p.is_replicate() for p in value.placements):
            return value.to_local().detach()
        return value.full_tensor().detach()
    return value.detach()


def loss_value(loss: torch.Tensor) -> float:
    """The loss as a Python float (see :func:`domain_value`)."""
    return float(domain_value(loss))


def forward_backward(
    model: nn.Module,
    features: Mapping[str, Any],
    loss_fn: LossFn | None = None,
    *,
    precision: str = "fp32",
    device: torch.device | None = None,
) -> torch.Tensor:
    """One forward and backward pass; returns the (detached) loss of this domain group.

    Parameters
    ----------
    model : nn.Module
        The (wrapped) model.
    features : Mapping[str, Any]
        One batched sample: plain tensors (serial) or the ShardTensors of the scatter.
    loss_fn : callable, optional
        ``loss_fn(outputs, features)`` -> scalar loss; the model's ``loss`` method by
        default (of the model inside a DDP wrapper).
    precision : str
        See :data:`PRECISIONS`.
    device : torch.device, optional
        Device type for autocast; CPU by default.
    """
    loss_fn = loss_fn if loss_fn is not None else model_loss(unwrap(model))
    with autocast(precision, device or torch.device("cpu")):
        outputs = model(**features)
        loss = loss_fn(outputs, features)
    loss.backward()
    return loss.detach()


RESTART_FIELDS = (
    "steps",
    "wrapper",
    "log_every",
    "checkpoint_every",
    "checkpoint_dir",
    "resume",
    "overwrite",
    "compile",
    "compile_backend",
    "progress",
    "metrics_file",
    "summary_file",
    "fsdp_units",
    "compile_regions",
)
"""``TrainSettings`` fields a restarted run may change: not part of its fingerprint."""


def plain_values(value: Any) -> Any:
    """``value`` with every non-JSON leaf (a class, a path) replaced by its name."""

    def name(leaf: Any) -> str:
        if isinstance(leaf, type):
            return f"{leaf.__module__}.{leaf.__qualname__}"
        return str(leaf)

    return json.loads(json.dumps(value, default=name))


def run_identity(
    model: nn.Module,
    dataset: Any,
    settings: TrainSettings,
    optimizer: OptimizerSettings,
    run_config: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """What identifies a run (hashed into its fingerprint, see ``training.rundir``).

    Parameters
    ----------
    model : nn.Module
        The serial model (its class and parameter names and shapes).
    dataset : Any
        The dataset (its type and length).
    settings : TrainSettings
        All fields but :data:`RESTART_FIELDS`.
    optimizer : OptimizerSettings
        All fields.
    run_config : Mapping, optional
        Further configuration from the caller.
    """
    kind = type(model)
    return plain_values(
        {
            "train": {k: v for k, v in asdict(settings).items() if k not in RESTART_FIELDS},
            "optimizer": asdict(optimizer),
            "model": f"{kind.__module__}.{kind.__qualname__}",
            "parameters": {n: list(p.shape) for n, p in model.named_parameters()},
            "dataset": [
                type(dataset).__name__,
                len(dataset) if hasattr(dataset, "__len__") else None,
            ],
            "config": dict(run_config or {}),
        }
    )


def _mean_over_ddp(value: float, mesh: FoldMesh) -> float:
    if mesh.ddp_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=mesh.device)
    dist.all_reduce(t, group=mesh.ddp_mesh.get_group())
    return float(t.item()) / mesh.ddp_size


def _gather_peak_memory(mesh: FoldMesh) -> list[int]:
    mine = peak_memory_bytes(mesh.device)
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return [int(v) for v in out]


def _progress(total: int, initial: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)


def _batches(loader: ShardedLoader) -> Iterator[Any]:
    """Loader items across epochs, without end.

    A pass may be empty once: a loader resumed at the end of an epoch only finishes it.
    """
    empty = 0
    while True:
        yielded = False
        for item in loader:
            yielded = True
            yield item
        empty = 0 if yielded else empty + 1
        if empty > 1:
            raise RuntimeError("the training loader yields no steps (empty dataset?)")


@dataclass
class _RunSetup:
    """What :func:`train` decides before it touches the model (every check done).

    Attributes
    ----------
    loss_fn : LossFn
        ``loss_fn(outputs, features)`` -> scalar loss.
    fsdp_units, regions : tuple[type[nn.Module], ...]
        The FSDP2 units and the compile regions.
    compiled : str
        The compile mode that runs (``"auto"`` resolved).
    optimizer : OptimizerSettings
        The optimizer's settings.
    directory : RunPlan
        Where the run starts (``directory.resume``) and what its directories hold.
    """

    loss_fn: LossFn
    fsdp_units: tuple[type[nn.Module], ...]
    regions: tuple[type[nn.Module], ...]
    compiled: str
    optimizer: OptimizerSettings
    directory: RunPlan


@dataclass
class _Run:
    """The state of one call of :func:`train`, from its first step to its result.

    Attributes
    ----------
    settings : TrainSettings
        The run's settings.
    mesh : FoldMesh
        The job's mesh.
    model : nn.Module
        The wrapped (and compiled) model.
    optimizer : torch.optim.Optimizer
        Its optimizer.
    loader : ShardedLoader
        The training loader.
    setup : _RunSetup
        What was decided before the model was touched.
    extra : Mapping or None
        Stored in every checkpoint, with ``stored_settings``.
    metric_logger : MetricLogger or None
        Receives each step's metrics.
    start_step, step : int
        Steps done before this run (resume), and done so far.
    stored_settings : dict
        ``settings`` as plain data, for the checkpoints.
    metrics : file or None
        Rank 0's open ``settings.metrics_file``.
    bar : tqdm or None
        Rank 0's progress bar.
    start : float
        ``time.perf_counter()`` when the steps began.
    losses, indices, checkpoints : list
        Per step: the loss and the dataset index; the checkpoint files written.
    ema : WeightAverage or None
        The moving average of the weights, updated after every optimizer step.
    """

    settings: TrainSettings
    mesh: FoldMesh
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loader: ShardedLoader
    setup: _RunSetup
    extra: Mapping[str, Any] | None
    metric_logger: MetricLogger | None
    start_step: int = 0
    step: int = 0
    stored_settings: dict[str, Any] = field(default_factory=dict)
    metrics: Any = None
    bar: Any = None
    start: float = 0.0
    losses: list[float] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    ema: WeightAverage | None = None

    @property
    def rank0(self) -> bool:
        """Whether this is global rank 0 (which alone logs and writes the metrics)."""
        return self.mesh.rank == 0


def _decide_run(
    model: nn.Module,
    mesh: FoldMesh,
    dataset: Any,
    settings: TrainSettings,
    optimizer: OptimizerSettings | None,
    loss_fn: LossFn | None,
    run_config: Mapping[str, Any] | None,
) -> _RunSetup:
    """Resolve the model's hooks and the modes, then decide and prepare the run directory.

    Parameters
    ----------
    model : nn.Module
        The serial model (its hooks, parameter names and shapes).
    mesh : FoldMesh
        The job's mesh.
    dataset : Any
        The serial dataset (part of the run's identity).
    settings : TrainSettings
        The checked settings.
    optimizer : OptimizerSettings, optional
        AdamW with defaults when omitted.
    loss_fn : callable, optional
        ``settings.loss``, else the model's ``loss`` method, when omitted.
    run_config : Mapping, optional
        Further configuration that identifies the run.

    Returns
    -------
    _RunSetup
        The resolved hooks, compile mode, optimizer settings and run-directory plan.

    Raises
    ------
    ValueError
        For regional compilation with a data-parallel wrapper.
    RunDirectoryError
        When the run's directories hold another run's outputs (see
        :mod:`~physicsnemo_foldcp.training.rundir`).
    """
    loss_fn = model_loss(model, loss_fn if loss_fn is not None else settings.loss)
    fsdp_units = module_types(model, "fsdp_units", settings.fsdp_units)
    regions = module_types(model, "compile_regions", settings.compile_regions)
    wrapper = resolve_wrapper(settings.wrapper, mesh)
    compiled = resolve_compile_mode(settings.compile, mesh.cp)
    if compiled == "regional" and wrapper != "none":
        raise ValueError(
            f"train.compile=regional needs ddp=1 (wrapper none), got wrapper {wrapper!r} on "
            f"mesh {mesh.shape}: compiled regions return partial gradients that DDP/FSDP2 "
            "would reduce before they are summed over the domain group; use compile=none"
        )
    opt_settings = optimizer or OptimizerSettings()
    identity = run_identity(model, dataset, settings, opt_settings, run_config)
    run_id = fingerprint(identity)
    directory = decide(
        settings.checkpoint_dir,
        settings.metrics_file,
        run_id,
        settings.resume,
        settings.overwrite,
        settings.summary_file,
    )
    prepare_run(
        directory,
        settings.checkpoint_dir,
        settings.metrics_file,
        run_id,
        identity,
        settings.summary_file,
    )
    return _RunSetup(loss_fn, fsdp_units, regions, compiled, opt_settings, directory)


def _build_run(
    model: nn.Module,
    mesh: FoldMesh,
    dataset: Any,
    settings: TrainSettings,
    setup: _RunSetup,
    *,
    registry: FeatureRegistry | None,
    loader_options: Mapping[str, Any] | None,
    extra: Mapping[str, Any] | None,
    metric_logger: MetricLogger | None,
) -> _Run:
    """Pin the precision, wrap and compile the model, build its optimizer and the loader.

    Parameters
    ----------
    model : nn.Module
        The serial model; moved to ``mesh.device`` and wrapped per ``settings.wrapper``.
    mesh : FoldMesh
        The job's mesh.
    dataset : Any
        The serial dataset of the loader.
    settings : TrainSettings
        The run's settings.
    setup : _RunSetup
        From :func:`_decide_run`.
    registry : FeatureRegistry, optional
        Axis meanings of the features.
    loader_options : Mapping, optional
        Further :class:`~physicsnemo_foldcp.data.ShardedLoader` arguments.
    extra : Mapping, optional
        Stored in every checkpoint.
    metric_logger : MetricLogger, optional
        Receives each step's metrics.

    Returns
    -------
    _Run
        The run at step 0 (before any resume).
    """
    set_precision(settings.precision)
    model = model.to(mesh.device)
    wrapped = wrap_model(model, mesh, settings.wrapper, shard_modules=setup.fsdp_units)
    compile_model(
        unwrap(wrapped),
        mesh,
        settings.compile,
        regions=setup.regions,
        backend=settings.compile_backend,
    )
    if settings.grad_bucket_mib > 0 and setup.compiled != "regional":
        attach_gradient_buckets(wrapped, mesh, settings.grad_bucket_mib)
    if mesh.rank == 0:
        logger.info(
            "mesh %s (ddp x cp0 x cp1), model wrapped as %s over ddp",
            "x".join(map(str, mesh.shape)),
            type(wrapped).__name__,
        )
    opt = build_optimizer(wrapped, setup.optimizer)
    loader = ShardedLoader(
        dataset,
        mesh,
        mode="train",
        registry=registry,
        seed=settings.seed,
        **dict(loader_options or {}),
    )
    run = _Run(settings, mesh, wrapped, opt, loader, setup, extra, metric_logger)
    if settings.ema_decay > 0:
        run.ema = WeightAverage(wrapped, settings.ema_decay)
    return run


def _resume(run: _Run) -> None:
    """Load the checkpoint the run directory's plan names, if any; set ``run.start_step``.

    Restores the model, the optimizer and the loader's position (the random generators
    are restored by :func:`~physicsnemo_foldcp.training.checkpoint.load_checkpoint`).

    Parameters
    ----------
    run : _Run
        The run before its first step.

    Raises
    ------
    CheckpointError
        When the checkpoint is not one, is unsafe, or does not fit.
    """
    settings, resume = run.settings, run.setup.directory.resume
    if resume is None and run.rank0 and settings.resume in RESUME_MODES and settings.checkpoint_dir:
        logger.info("no checkpoint in %s: starting from scratch", settings.checkpoint_dir)
    if resume:
        state = load_checkpoint(resume, run.model, run.optimizer, mesh=run.mesh, ema=run.ema)
        run.start_step = int(state["step"])
        if state.get("loader") is not None:
            run.loader.load_state_dict(state["loader"])
        if run.rank0:
            logger.info("resumed from %s at step %d", resume, run.start_step)
    run.stored_settings = plain_values(asdict(settings))


def _open_outputs(run: _Run) -> None:
    """Open rank 0's metrics file (appending) and progress bar; start the clock.

    Parameters
    ----------
    run : _Run
        The run after :func:`_resume`; its model is put in training mode.
    """
    settings = run.settings
    if run.rank0 and settings.metrics_file:
        Path(settings.metrics_file).parent.mkdir(parents=True, exist_ok=True)
        run.metrics = open(settings.metrics_file, "a")  # noqa: SIM115 - trimmed by prepare_run
    run.bar = _progress(settings.steps, run.start_step, settings.progress and run.rank0)
    run.step = run.start_step
    run.model.train()
    run.start = time.perf_counter()


def _close_outputs(run: _Run) -> None:
    """Close the progress bar and the metrics file (also after an error)."""
    if run.bar is not None:
        run.bar.close()
    if run.metrics is not None:
        run.metrics.close()


def _train_step(run: _Run, item: Any) -> float:
    """One optimizer step on one loader item; returns the loss, averaged over ``ddp``.

    Parameters
    ----------
    run : _Run
        The run; ``run.step`` is advanced by one.
    item : ShardedSample
        This domain group's sample of the step.

    Returns
    -------
    float
        The step's loss, the mean over the domain groups.

    Raises
    ------
    BatchSizeError
        When the sample is not one batched complex.
    FloatingPointError
        When the loss is not finite.
    """
    features = item.features
    check_batch(features)
    compiled = run.setup.compiled
    inputs = local_features(features) if compiled == "whole" else features
    run.optimizer.zero_grad(set_to_none=True)
    loss = forward_backward(
        run.model,
        inputs,
        run.setup.loss_fn,
        precision=run.settings.precision,
        device=run.mesh.device,
    )
    if compiled == "regional":
        reduce_region_gradients(unwrap(run.model))
    run.optimizer.step()
    run.step += 1
    if run.ema is not None:
        run.ema.update(run.model, run.step)
    value = _mean_over_ddp(loss_value(loss), run.mesh)
    if not math.isfinite(value):
        raise FloatingPointError(f"loss is {value} at step {run.step}")
    run.losses.append(value)
    run.indices.append(int(item.index))
    return value


def _log_step(run: _Run, value: float) -> None:
    """Report the step's loss: metrics file, metric logger, progress bar, log line.

    Parameters
    ----------
    run : _Run
        The run after :func:`_train_step`.
    value : float
        The step's loss.
    """
    settings, step = run.settings, run.step
    elapsed = time.perf_counter() - run.start
    if run.metrics is not None:
        run.metrics.write(json.dumps({"step": step, "loss": value, "seconds": elapsed}) + "\n")
        run.metrics.flush()
    if run.metric_logger is not None:
        run.metric_logger.log({"loss": value, "seconds": elapsed}, step)
    if run.bar is not None:
        run.bar.update(1)
        run.bar.set_postfix(loss=f"{value:.4f}")
    if run.rank0 and settings.log_every and step % settings.log_every == 0:
        rate = (step - run.start_step) / (time.perf_counter() - run.start)
        message = f"step {step}/{settings.steps} loss {value:.4f} ({rate:.2f} steps/s)"
        if run.bar is not None:
            run.bar.write(message)
        else:
            logger.info("%s", message)


def _maybe_checkpoint(run: _Run) -> bool:
    """Write a checkpoint when one is due or the run is done; return whether it is done.

    Parameters
    ----------
    run : _Run
        The run after the step's :func:`_log_step`.

    Returns
    -------
    bool
        ``True`` once ``settings.steps`` steps are done.
    """
    settings, step = run.settings, run.step
    done = step >= settings.steps
    due = settings.checkpoint_every and step % settings.checkpoint_every == 0
    if settings.checkpoint_dir and (due or done):
        path = save_checkpoint(
            settings.checkpoint_dir,
            step,
            run.model,
            run.optimizer,
            run.mesh,
            loader_state=run.loader.state_dict(),
            extra={**dict(run.extra or {}), "settings": run.stored_settings},
            ema=run.ema,
        )
        run.checkpoints.append(str(path))
    return done


def _finish(run: _Run) -> TrainResult:
    """The run's result (peak memory gathered from every rank); rank 0 logs its summary.

    Parameters
    ----------
    run : _Run
        The run after its last step (call on every rank: one object all-gather).
    """
    seconds = time.perf_counter() - run.start
    result = TrainResult(
        losses=run.losses,
        start_step=run.start_step,
        end_step=run.step,
        seconds=seconds,
        peak_memory=_gather_peak_memory(run.mesh),
        checkpoints=run.checkpoints,
        model=run.model,
        optimizer=run.optimizer,
        indices=run.indices,
        ema=run.ema,
    )
    if run.rank0:
        logger.info("%s", result.summary())
    return result


def train(
    model: nn.Module,
    mesh: FoldMesh,
    dataset: Any,
    settings: TrainSettings | None = None,
    *,
    optimizer: OptimizerSettings | None = None,
    loss_fn: LossFn | None = None,
    registry: FeatureRegistry | None = None,
    loader_options: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    run_config: Mapping[str, Any] | None = None,
    metric_logger: MetricLogger | None = None,
) -> TrainResult:
    """Train ``model`` on ``dataset`` over the mesh (call on every rank).

    Parameters
    ----------
    model : nn.Module
        The serial model, initialised the same way on every rank (e.g. after
        ``torch.manual_seed``); it is moved to ``mesh.device``, synced over the domain
        group from its source, and wrapped per ``settings.wrapper``.
    mesh : FoldMesh
        From :func:`physicsnemo_foldcp.init_mesh`.
    dataset : map-style dataset
        Serial samples, batched (``[1, ...]``); only domain sources read it.
    settings : TrainSettings, optional
        Run options; defaults otherwise.
    optimizer : OptimizerSettings, optional
        Optimizer; AdamW with defaults otherwise.
    loss_fn : callable, optional
        ``loss_fn(outputs, features)`` -> scalar loss (replicated over the domain group);
        by default ``settings.loss``, else the model's ``loss`` method.
    registry : FeatureRegistry, optional
        Axis meanings of the features (Boltz-2 preset by default).
    loader_options : Mapping, optional
        Further :class:`~physicsnemo_foldcp.data.ShardedLoader` arguments
        (``options=ShardingOptions(...)``, ``num_workers``, ``token_bounds``, ...).
    extra : Mapping, optional
        Stored in every checkpoint (e.g. the run's configuration): plain data only.
    run_config : Mapping, optional
        Configuration that identifies the run besides ``settings``, ``optimizer``, the
        model's parameter shapes and the dataset (e.g. the data and model options); it is
        hashed into the run's fingerprint (:mod:`~physicsnemo_foldcp.training.rundir`).
    metric_logger : MetricLogger, optional
        Receives each step's ``loss`` and ``seconds`` (MLflow / W&B, from rank 0), besides
        ``settings.metrics_file``.

    Returns
    -------
    TrainResult
        Losses, timing, peak memory per rank, checkpoints, and the trained model.

    Raises
    ------
    BatchSizeError
        Before any work, when ``settings.batch_size != 1``.
    RunDirectoryError
        Before any work, when ``checkpoint_dir``, ``metrics_file`` or ``summary_file``
        hold another run's outputs and ``settings.overwrite`` is off, or a file the
        project did not write (whatever ``overwrite``).
    RunLockedError
        Before any work, when another run holds the run directory's lock
        (:mod:`~physicsnemo_foldcp.training.runlock`).
    CheckpointError
        When the checkpoint to resume from is not one, is unsafe, or does not fit.

    Notes
    -----
    The model's FSDP2 units, compile regions and loss come from its class, or from
    ``settings`` (see :mod:`~physicsnemo_foldcp.training.hooks`): nothing here knows the
    model.

    The steps, in this order (the order of the collectives and of the random draws, which
    an exact resume depends on): lock the run directory (held until the run returns),
    decide the run (hooks, modes, run directory), build it
    (precision, wrapper, compile, optimizer, loader), resume, open the outputs; then per
    step: train, log, checkpoint when due; finally gather the result and write the summary.
    """
    settings = settings or TrainSettings()
    settings.check()
    lock = JobLock(lock_path(settings.checkpoint_dir, settings.metrics_file, settings.summary_file))
    try:
        setup = _decide_run(model, mesh, dataset, settings, optimizer, loss_fn, run_config)
        run = _build_run(
            model,
            mesh,
            dataset,
            settings,
            setup,
            registry=registry,
            loader_options=loader_options,
            extra=extra,
            metric_logger=metric_logger,
        )
        _resume(run)
        try:
            _open_outputs(run)
            batches = _batches(run.loader) if run.step < settings.steps else iter(())
            for item in batches:
                value = _train_step(run, item)
                _log_step(run, value)
                if _maybe_checkpoint(run):
                    break
        finally:
            _close_outputs(run)
        result = _finish(run)
        if run.rank0 and settings.summary_file:
            write_summary(result, settings.summary_file)
        return result
    finally:
        lock.release()


def write_summary(result: TrainResult, path: str | os.PathLike) -> None:
    """Write the run's losses, timing and peak memory as JSON (call on rank 0)."""
    payload = {
        "start_step": result.start_step,
        "end_step": result.end_step,
        "losses": result.losses,
        "seconds": result.seconds,
        "steps_per_s": result.steps_per_s,
        "peak_memory_bytes": result.peak_memory,
        "checkpoints": result.checkpoints,
    }
    write_text_atomic(path, json.dumps(payload, indent=2))


__all__ = [
    "OPTIMIZERS",
    "PRECISIONS",
    "RESTART_FIELDS",
    "BatchSizeError",
    "OptimizerSettings",
    "TrainResult",
    "TrainSettings",
    "autocast",
    "build_optimizer",
    "check_batch",
    "domain_value",
    "forward_backward",
    "loss_value",
    "peak_memory_bytes",
    "plain_values",
    "run_identity",
    "set_precision",
    "train",
    "write_summary",
]
