"""``FoldCPStrategy``: Lightning's ``Trainer`` on the ``ddp x cp0 x cp1`` mesh.

Lightning's own strategies split the data over every rank and wrap the model for every
rank. Under context parallelism the ``cp0 x cp1`` ranks of a domain group share one
sample and one model replica; only the ``ddp`` axis holds replicas. This strategy:

* starts the job and its mesh with :func:`~physicsnemo_foldcp.init_mesh` (processes come
  from ``torchrun``, or one process without it: it launches none);
* syncs the model over each domain group and wraps it for ``ddp`` with
  :func:`~physicsnemo_foldcp.distributed.wrap_model` (no wrapper, DDP, or FSDP2 with the
  model's ``fsdp_units``; never FSDP1), and routes every ``*_step`` through the wrapper
  so DDP's and FSDP2's hooks run;
* sums parameter gradients over the domain in buckets, as the training loop does
  (:func:`~physicsnemo_foldcp.core.grad_buckets.attach_gradient_buckets`), and keeps the
  moving average of the weights when asked (``ema_decay``, as ``train.ema_decay``);
* leaves the data order to the :class:`~physicsnemo_foldcp.data.ShardedLoader` (a
  :class:`~physicsnemo_foldcp.data.FoldCPDataModule` gets its mesh from here); a plain
  ``DataLoader``, which Lightning would re-shard over every rank, is refused;
* logs a domain group's value, never a rank's local part: every tensor given to the
  LightningModule's ``log`` / ``log_dict`` is made whole first (a ``Partial`` or sharded
  ShardTensor by ``full_tensor()``, a replicated one by its local value), and
  ``sync_dist=True`` reduces it over the ``ddp`` axis only, since the ranks of a domain
  group hold the same value;
* writes checkpoints in the plugin's format (:mod:`~physicsnemo_foldcp.training.checkpoint`):
  a directory at Lightning's checkpoint path holding the model and optimizer as DCP
  shards, which load on another mesh and wrapper, plus Lightning's own state (loops,
  callbacks, the data module's loader positions) and every rank's random generators in
  a file read with ``weights_only=True``. Lightning state that is not plain data is
  refused when saving, with its name.

Usage (under ``torchrun --nproc-per-node 4``)::

    trainer = Trainer(strategy=FoldCPStrategy(cp=(2, 2)), accelerator="cpu", max_steps=3)
    trainer.fit(module, datamodule=FoldCPDataModule(train_dataset))
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from lightning_fabric.utilities.types import ReduceOp
from lightning_utilities.core.apply_func import apply_to_collection
from pytorch_lightning.strategies.parallel import ParallelStrategy
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.rank_zero import rank_zero_only
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader

from physicsnemo_foldcp.core import compat
from physicsnemo_foldcp.core.grad_buckets import (
    DEFAULT_BUCKET_MIB,
    GradientBuckets,
    attach_gradient_buckets,
    attached_buckets,
)
from physicsnemo_foldcp.distributed.bootstrap import init_mesh
from physicsnemo_foldcp.distributed.mesh import FoldMesh
from physicsnemo_foldcp.distributed.wrappers import WRAPPERS, sync_over_domain, wrap_model
from physicsnemo_foldcp.training.bounds import check_range
from physicsnemo_foldcp.training.checkpoint import (
    CheckpointError,
    load_checkpoint,
    write_checkpoint,
)
from physicsnemo_foldcp.training.ema import WeightAverage
from physicsnemo_foldcp.training.hooks import module_types
from physicsnemo_foldcp.training.loop import domain_value

LIGHTNING_STATE = "lightning"
"""Entry of the checkpoint's ``extra`` that holds Lightning's own state."""

_TENSOR_ENTRIES = ("state_dict", "optimizer_states")
"""Entries of Lightning's checkpoint dict that the DCP shards hold instead."""

_REDUCE_OPS = {
    "mean": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def _op_name(reduce_op: ReduceOp | str | None) -> str:
    if reduce_op is None:
        return "mean"
    if isinstance(reduce_op, str):
        name = reduce_op.lower()
    else:
        name = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min"}.get(
            reduce_op, ""
        )
    if name not in _REDUCE_OPS:
        raise ValueError(
            f"FoldCPStrategy.reduce: unsupported reduce_op {reduce_op!r}; use one of "
            f"{sorted(_REDUCE_OPS)}"
        )
    return name


class FoldCPStrategy(ParallelStrategy):
    """Lightning strategy for context parallelism over a ``ddp x cp0 x cp1`` mesh.

    Parameters
    ----------
    cp : Sequence[int], default (1, 1)
        ``(cp0, cp1)``: the domain mesh of each sample (one size may be -1).
    ddp : int, default -1
        Number of domain groups; -1 infers it from the world size.
    wrapper : {"auto", "none", "ddp", "fsdp2"}, default "auto"
        Data-parallel wrapper over ``ddp`` (see :func:`~physicsnemo_foldcp.distributed.wrap_model`).
    fsdp_units : Sequence[str or type], optional
        Submodule types FSDP2 shards one by one; ``None``: the LightningModule's
        ``fsdp_units`` attribute (e.g. :class:`~physicsnemo_foldcp.lightning.FoldModule`
        takes its model's), else none.
    timeout_s : float, optional
        Bound on every collective wait (see :func:`~physicsnemo_foldcp.init_mesh`).
    grad_bucket_mib : float, default 25
        Size cap of the buckets in which ``fit`` sums parameter gradients over the domain
        (:func:`~physicsnemo_foldcp.core.grad_buckets.attach_gradient_buckets`); ``0``:
        each module's backward sums its own.
    ema_decay : float, default 0
        Decay of the moving average of the weights ``fit`` keeps
        (:class:`~physicsnemo_foldcp.training.ema.WeightAverage`, updated after every
        optimizer step, stored in and restored from the checkpoints); ``0``: none.
        Prediction from a checkpoint that has one predicts with it.
    mesh : FoldMesh, optional
        A mesh already built with :func:`~physicsnemo_foldcp.init_mesh`; then ``cp``,
        ``ddp`` and ``timeout_s`` are not used.
    accelerator, checkpoint_io, precision_plugin
        As for Lightning's other strategies.

    Notes
    -----
    Processes are started by ``torchrun`` (``Trainer(devices=...)`` does not start any);
    every rank computes on ``mesh.device`` (``cuda:<LOCAL_RANK>`` or CPU). The LightningModule
    builds its optimizer in ``configure_optimizers`` after wrapping, as FSDP2 requires, and
    one optimizer is supported. Prediction and validation run the model unwrapped on
    each domain group after syncing it from the group's source; a module already sharded
    by FSDP2 over ``ddp > 1`` is refused for them, since a group with no sample in an
    uneven last round would skip the forward its peers' parameter all-gathers wait for
    (the same holds for a validation loop inside ``fit``: keep its size a multiple of
    ``ddp`` there).
    """

    strategy_name = "foldcp"

    def __init__(
        self,
        cp: Sequence[int] = (1, 1),
        ddp: int = -1,
        *,
        wrapper: str = "auto",
        fsdp_units: Sequence[str | type] | None = None,
        timeout_s: float | None = None,
        grad_bucket_mib: float = DEFAULT_BUCKET_MIB,
        ema_decay: float = 0.0,
        mesh: FoldMesh | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin
        )
        if wrapper not in WRAPPERS:
            raise ValueError(f"FoldCPStrategy: wrapper must be one of {WRAPPERS}, got {wrapper!r}")
        self._cp = tuple(cp)
        self._ddp = ddp
        self._wrapper = wrapper
        self._fsdp_units = fsdp_units
        self._timeout_s = timeout_s
        check_range("grad_bucket_mib", grad_bucket_mib, low=0)
        self._grad_bucket_mib = grad_bucket_mib
        self._buckets: GradientBuckets | None = None
        check_range("ema_decay", ema_decay, low=0, high=1)
        self._ema_decay = ema_decay
        self.ema: WeightAverage | None = None
        self._mesh = mesh

    # -- the mesh and this process -----------------------------------------------------------

    @property
    def mesh(self) -> FoldMesh:
        """The job's ``ddp x cp0 x cp1`` mesh (built by :meth:`setup_environment`)."""
        if self._mesh is None:
            raise RuntimeError(
                "FoldCPStrategy.mesh is built when the Trainer starts (setup_environment); "
                "pass mesh=init_mesh(...) to have it before"
            )
        return self._mesh

    @property
    def root_device(self) -> torch.device:
        """The device this rank computes on."""
        if self._mesh is not None:
            return self._mesh.device
        if torch.cuda.is_available() and not isinstance(
            self.accelerator, pl.accelerators.CPUAccelerator
        ):
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    @property
    def global_rank(self) -> int:
        """Rank of this process in the job."""
        return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))

    @property
    def local_rank(self) -> int:
        """Rank of this process on its node (``LOCAL_RANK``)."""
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def node_rank(self) -> int:
        """Index of this process's node (``GROUP_RANK`` under torchrun)."""
        return int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", 0)))

    @property
    def world_size(self) -> int:
        """Number of processes in the job."""
        if dist.is_initialized():
            return dist.get_world_size()
        return int(os.environ.get("WORLD_SIZE", 1))

    @property
    def is_distributed(self) -> bool:
        """Whether several processes take part (Lightning asks custom strategies)."""
        return self.world_size > 1

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The ``ddp`` split (for reference only: plain DataLoaders are refused)."""
        return {"num_replicas": self.mesh.ddp_size, "rank": self.mesh.ddp_rank}

    def setup_environment(self) -> None:
        """Start the job (once) and build the mesh; called by the Trainer before setup."""
        if self._mesh is None:
            devices = len(self.parallel_devices or [])
            if "WORLD_SIZE" not in os.environ and devices > 1:
                raise RuntimeError(
                    f"FoldCPStrategy starts no processes, but Trainer(devices={devices}) asks "
                    f"for {devices}: launch with torchrun --nproc-per-node {devices} (Trainer "
                    "devices=1 or 'auto')"
                )
            self._mesh = init_mesh(ddp=self._ddp, cp=self._cp, timeout_s=self._timeout_s)
        rank_zero_only.rank = self.global_rank
        super().setup_environment()

    # -- the model ---------------------------------------------------------------------------

    def connect(self, model: pl.LightningModule) -> None:
        """Take the LightningModule; its ``log`` reports domain-group values (see module doc)."""
        super().connect(model)
        _log_whole_values(model)

    def model_to_device(self) -> None:
        """Move the model to this rank's device."""
        assert self.model is not None
        self.model.to(self.root_device)

    def setup(self, trainer: pl.Trainer) -> None:
        """Sync the model over its domain, wrap it for ``ddp`` (fit), build the optimizer."""
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        sharded = isinstance(self.model, FSDPModule)  # by an earlier fit: stays so
        if sharded and trainer.state.fn != TrainerFn.FITTING and self.mesh.ddp_size > 1:
            raise RuntimeError(
                f"FoldCPStrategy: {trainer.state.fn.value} with a model sharded by FSDP2 over "
                f"ddp={self.mesh.ddp_size} would hang: a domain group with no sample in the "
                "last round skips the forward that FSDP2's parameter all-gather needs. Run "
                "it on a fresh module from the checkpoint (ckpt_path=...), which runs unwrapped"
            )
        if trainer.state.fn == TrainerFn.FITTING and not sharded:
            units = self._fsdp_units
            if units is None:
                units = getattr(self.lightning_module, "fsdp_units", None) or ()
            shard = module_types(self.lightning_module, "fsdp_units", units)
            self.model = wrap_model(self.model, self.mesh, self._wrapper, shard_modules=shard)
        elif not sharded:
            sync_over_domain(self.model, self.mesh)
        if trainer.state.fn == TrainerFn.FITTING:
            self._attach_buckets()
            self.ema = WeightAverage(self.model, self._ema_decay) if self._ema_decay else None
            self.setup_optimizers(trainer)
            if len(self.optimizers) != 1:
                raise ValueError(
                    f"FoldCPStrategy supports one optimizer, configure_optimizers gave "
                    f"{len(self.optimizers)}"
                )
        self.setup_precision_plugin()

    def _attach_buckets(self) -> None:
        """Gradient buckets on the wrapped model (again, on a later ``fit``)."""
        earlier = attached_buckets(self.model)
        if earlier is not None:
            earlier.detach()
        self._buckets = None
        if self._grad_bucket_mib > 0:
            self._buckets = attach_gradient_buckets(self.model, self.mesh, self._grad_bucket_mib)

    def _step(self, name: str, context: Any, *args: Any, **kwargs: Any) -> Any:
        assert self.lightning_module is not None and self.model is not None
        with context():
            if self.model is not self.lightning_module or isinstance(self.model, FSDPModule):
                # Through the wrapper's forward, so DDP's and FSDP2's hooks run (FSDP2
                # shards the LightningModule in place: wrapper and module are one object).
                redirect = compat.lightning_forward_redirection(self)
                return redirect(self.model, self.lightning_module, name, *args, **kwargs)
            return getattr(self.lightning_module, name)(*args, **kwargs)

    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Any,
        model: Any = None,
        **kwargs: Any,
    ) -> Any:
        """The optimizer's step, then the moving average's (when kept)."""
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.ema is not None:
            self.ema.update(self.model, (self.ema.step or 0) + 1)
        return output

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The LightningModule's ``training_step``, through the ``ddp`` wrapper."""
        context = self.precision_plugin.train_step_context
        output = self._step("training_step", context, *args, **kwargs)
        if self._buckets is not None:
            self._buckets.watch(output)  # training_step is not forward: the hook missed it
        return output

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """The LightningModule's ``validation_step``, through the ``ddp`` wrapper."""
        context = self.precision_plugin.val_step_context
        return self._step("validation_step", context, *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """The LightningModule's ``test_step``, through the ``ddp`` wrapper."""
        context = self.precision_plugin.test_step_context
        return self._step("test_step", context, *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The LightningModule's ``predict_step``, through the ``ddp`` wrapper."""
        context = self.precision_plugin.predict_step_context
        return self._step("predict_step", context, *args, **kwargs)

    def teardown(self) -> None:
        """End of a stage: the model and optimizer stay where they are.

        Lightning's default moves the module to the CPU, which replaces FSDP2's DTensor
        parameters with new objects: the optimizer's state would no longer be found
        under them, and a checkpoint saved afterwards would miss it.
        """
        self.precision_plugin.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()

    # -- data --------------------------------------------------------------------------------

    def process_dataloader(self, dataloader: object) -> object:
        """Refuse a plain ``DataLoader``: Lightning would split it over every rank."""
        if isinstance(dataloader, DataLoader):
            raise TypeError(
                "FoldCPStrategy: got a torch DataLoader; the ranks of a domain group must "
                "share each sample, so use FoldCPDataModule or ShardedLoader (they split the "
                "data over the ddp axis and scatter each sample over the domain)"
            )
        return dataloader

    def batch_to_device(
        self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0
    ) -> Any:
        """The batch as it is: a ShardedLoader's features are already on ``mesh.device``."""
        return batch

    # -- collectives -------------------------------------------------------------------------

    def barrier(self, name: str | None = None) -> None:
        """Wait for every rank of the job."""
        if dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` of global rank ``src`` on every rank."""
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(
        self,
        tensor: torch.Tensor | Any,
        group: Any | None = None,
        reduce_op: ReduceOp | str | None = "mean",
    ) -> torch.Tensor | Any:
        """Reduce a domain group's value over the ``ddp`` axis (or over ``group``).

        Parameters
        ----------
        tensor : torch.Tensor
            A value of this rank's domain group: a plain tensor (the same on every rank of
            the domain) or a ShardTensor, made whole first (a collective over the domain).
        group : ProcessGroup, optional
            Reduce over this group instead of ``ddp``.
        reduce_op : {"mean", "sum", "max", "min"}, default "mean"
            The reduction.
        """
        if not isinstance(tensor, torch.Tensor):
            return tensor
        name = _op_name(reduce_op)
        value = domain_value(tensor).clone()
        if group is None:
            if self.mesh.ddp_size == 1:
                return value
            group = self.mesh.ddp_mesh.get_group()
        size = dist.get_world_size(group)
        work = value.to(torch.float64) if name in ("mean", "avg") else value
        dist.all_reduce(work, op=_REDUCE_OPS[name], group=group)
        if name in ("mean", "avg"):
            return (work / size).to(value.dtype)
        return work

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """``all`` (or ``any``) of ``decision`` over every rank of the job."""
        if not dist.is_initialized():
            return decision
        flag = torch.tensor([int(decision)], device=self.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN if all else dist.ReduceOp.MAX)
        return bool(flag.item())

    # -- checkpoints -------------------------------------------------------------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints load into the wrapped model and its optimizer."""
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        """The optimizer is loaded with the model, from its DCP shards."""
        return False

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Empty: :meth:`save_checkpoint` writes the model's shards itself."""
        return {}

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Empty: :meth:`save_checkpoint` writes the optimizer's shards itself."""
        return {}

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing: :meth:`load_checkpoint` has loaded the model."""

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing: :meth:`load_checkpoint` has loaded the optimizer."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | os.PathLike, storage_options: Any = None
    ) -> None:
        """Write ``checkpoint`` as a checkpoint directory at ``filepath`` (every rank).

        Raises
        ------
        TypeError
            For ``storage_options`` (no ``CheckpointIO`` is used).
        CheckpointError
            When Lightning's state holds anything but plain data and tensors (named).
        """
        if storage_options is not None:
            raise TypeError("FoldCPStrategy.save_checkpoint takes no storage_options")
        path = Path(self.broadcast(str(filepath)))
        state = {k: v for k, v in checkpoint.items() if k not in _TENSOR_ENTRIES}
        optimizer = self.optimizers[0] if self.optimizers else None
        write_checkpoint(
            path,
            int(checkpoint.get("global_step", 0)),
            self.model,
            optimizer,
            self.mesh,
            extra={LIGHTNING_STATE: state},
            ema=self.ema if optimizer is not None else None,
        )

    def load_checkpoint(
        self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load the model (and optimizer and random generators when fitting); Lightning's state.

        Raises
        ------
        CheckpointError
            When ``checkpoint_path`` is not a checkpoint directory written by this strategy
            (or is unsafe, or does not fit the model).
        """
        path = Path(self.broadcast(str(checkpoint_path)))
        trainer = self.lightning_module.trainer
        fitting = bool(self.optimizers) and trainer.state.fn == TrainerFn.FITTING
        optimizer = self.optimizers[0] if fitting else None
        state = load_checkpoint(
            path,
            self.model,
            optimizer,
            mesh=self.mesh,
            restore_rng=fitting,
            ema=self.ema if fitting else None,
            weights="model" if fitting else "auto",
        )
        lightning = (state.get("extra") or {}).get(LIGHTNING_STATE)
        if lightning is None:
            raise CheckpointError(
                f"{path} holds no Lightning state: it was not written by FoldCPStrategy "
                "(a training-loop checkpoint loads with physicsnemo_foldcp.training."
                "load_checkpoint)"
            )
        return dict(lightning)

    def remove_checkpoint(self, filepath: str | os.PathLike) -> None:
        """Delete a checkpoint directory (rank 0)."""
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)


def _log_whole_values(module: pl.LightningModule) -> None:
    """Make ``module.log`` turn ShardTensor values into their domain group's value."""
    if getattr(module.log, "_foldcp_whole_values", False):
        return
    log = module.log

    def log_whole(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        return log(name, apply_to_collection(value, torch.Tensor, domain_value), *args, **kwargs)

    log_whole._foldcp_whole_values = True  # type: ignore[attr-defined]
    log_whole.__doc__ = log.__doc__
    module.log = log_whole  # type: ignore[method-assign]


__all__ = ["LIGHTNING_STATE", "FoldCPStrategy"]
