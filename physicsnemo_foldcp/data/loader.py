"""Sharded loaders: a serial dataset in, one ShardTensor sample per domain group per step out.

:class:`ShardedLoader` wraps a user's serial, map-style dataset (``dataset[i]`` returns one
sample's feature dict; it stays untouched and is the ground truth). At every step, each
domain group of the ``ddp x cp0 x cp1`` mesh takes one dataset index from its order
(:mod:`physicsnemo_foldcp.data.sampling`); the group's source rank fetches that sample and
:func:`~physicsnemo_foldcp.sharding.scatter.scatter_features` gives every rank of the group its
ShardTensor blocks.

Per step and domain group, every rank issues the same collectives:

* one :func:`scatter_features` per attempted sample (one object all-gather, then
  point-to-point sends of the blocks); a padding step (inference, uneven last round)
  issues nothing;
* plus, at the start of every pass, one object all-gather that checks every rank of the
  group iterates the same order from the same position.

Only the source rank calls ``dataset[i]``, optionally through a ``torch.utils.data``
``DataLoader`` with workers that prefetch the next samples while the main process scatters
the current one. The other ranks only call ``len(dataset)``. All collectives stay in the
main process.

Errors: an exception raised by ``dataset[i]`` (in the main process or in a worker), or by
the validation and layout of the sample before the scatter, is raised on every rank of the
domain group by that sample's scatter, with its type, message and traceback (the
traceback as ``__cause__``). With ``on_error="skip"`` every rank instead logs it (the
source rank only), records it in :attr:`ShardedLoader.skipped`, and moves on in lockstep;
more than ``max_skips`` skipped samples in one pass raise :class:`SkipLimitError`. Waits
are bounded by the mesh's collective timeout.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Sampler, get_worker_info

from physicsnemo_foldcp.data.sampling import (
    EpochSampler,
    InferenceOrder,
    Order,
    Step,
    TrainingOrder,
    reshard_training_state,
)
from physicsnemo_foldcp.distributed.errors import ErrorPayload, RemoteTraceback
from physicsnemo_foldcp.distributed.mesh import FoldMesh
from physicsnemo_foldcp.features.registry import FeatureRegistry
from physicsnemo_foldcp.sharding.options import ShardingOptions, options_or_defaults
from physicsnemo_foldcp.sharding.scatter import ShardedFeatures, scatter_features

logger = logging.getLogger("physicsnemo_foldcp.data")

MODES = ("train", "inference")
"""Loader modes: shuffled training epochs, or every sample once in order."""

ON_ERROR = ("raise", "skip")
"""What a loader does when a sample cannot be fetched or prepared."""

_RESERVED_DATALOADER_KWARGS = frozenset(
    {
        "dataset",
        "batch_size",
        "shuffle",
        "sampler",
        "batch_sampler",
        "num_workers",
        "collate_fn",
        "drop_last",
        "timeout",
        "prefetch_factor",
        "persistent_workers",
    }
)


def check_fetch_options(
    *,
    on_error: str,
    max_skips: int,
    num_workers: int,
    prefetch_factor: int | None,
    fetch_timeout_s: float | None,
    dataloader_kwargs: Mapping[str, Any] | None,
) -> None:
    """Check how a source rank fetches samples (see :class:`ShardedLoader`); raise if invalid.

    Raises
    ------
    ValueError
        Naming the option and the value at fault.
    """
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
    if isinstance(max_skips, bool) or not isinstance(max_skips, int) or max_skips < 0:
        raise ValueError(f"max_skips must be an integer >= 0, got {max_skips!r}")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"num_workers must be an integer >= 0, got {num_workers!r}")
    if num_workers == 0 and (prefetch_factor is not None or fetch_timeout_s is not None):
        raise ValueError(
            "prefetch_factor and fetch_timeout_s apply to DataLoader workers; set "
            "num_workers > 0 to use them"
        )
    if fetch_timeout_s is not None and fetch_timeout_s <= 0:
        raise ValueError(f"fetch_timeout_s must be > 0, got {fetch_timeout_s}")
    reserved = _RESERVED_DATALOADER_KWARGS & set(dataloader_kwargs or {})
    if reserved:
        raise ValueError(
            f"dataloader_kwargs may not set {sorted(reserved)}: the loader controls them "
            "(use num_workers / prefetch_factor / fetch_timeout_s for those)"
        )


def loader_sharding_options(
    options: ShardingOptions | None,
    token_bounds: Sequence[int] | None = None,
    *,
    caller: str = "ShardedLoader",
) -> tuple[ShardingOptions, tuple[int, ...] | None]:
    """The sharding options of a loader and its fixed row blocks, checked together.

    Parameters
    ----------
    options : ShardingOptions or None
        The options (the defaults when ``None``).
    token_bounds : sequence of int, optional
        Fixed ``cp0 + 1`` row-block token boundaries for every sample.
    caller : str
        Name for the messages.

    Returns
    -------
    tuple[ShardingOptions, tuple[int, ...] or None]
        The options every scatter of the loader uses, and the fixed ``token_bounds``.

    Raises
    ------
    TypeError
        When ``options`` is not a ``ShardingOptions`` (or ``None``).
    ValueError
        For fixed ``token_bounds`` with a balanced mode (which computes them per sample).
    """
    options = options_or_defaults(options, caller)
    if token_bounds is None:
        return options, None
    if options.balance.mode != "even":
        raise ValueError(
            f"{caller}: balance.mode={options.balance.mode!r} computes token_bounds per "
            "sample; do not also pass token_bounds"
        )
    return options, tuple(int(b) for b in token_bounds)


class SkipLimitError(RuntimeError):
    """More samples failed in one pass than ``max_skips`` allows (raised on every rank)."""


class SerialLoaderError(RuntimeError):
    """The source rank's serial DataLoader itself failed (e.g. a worker died or timed out).

    Raised on every rank of the domain group; never skipped, since the source's prefetch
    stream cannot continue.
    """


class LoaderConfigError(ValueError):
    """The ranks of one domain group iterate different orders or positions."""


@dataclass(frozen=True)
class SkippedSample:
    """A sample that the ``"skip"`` policy left out.

    Attributes
    ----------
    epoch, step : int
        Where it was due.
    index : int
        Its dataset index.
    error_type : str
        ``module.QualName`` of the exception.
    message : str
        The exception's message.
    """

    epoch: int
    step: int
    index: int
    error_type: str
    message: str


@dataclass
class ShardedSample:
    """What a :class:`ShardedLoader` yields for one domain group at one step.

    Attributes
    ----------
    features : ShardedFeatures or None
        Name -> ShardTensor at the registry's placements over ``mesh.domain_mesh`` (and the
        sample's non-tensor values); ``None`` for a padding step or a skipped inference
        sample.
    index : int or None
        Dataset index of the sample; ``None`` for a padding step.
    record_id : Any
        The sample's ``record_key`` value (e.g. a record id string), when it has one.
    epoch : int
        Epoch (pass) of the step.
    step : int
        Step number inside the epoch; the same on every rank of every domain group.
    skipped : tuple[int, ...]
        Indices that failed at this step under ``on_error="skip"`` (training: those
        replaced by ``index``; inference: ``(index,)`` when the sample itself failed).
    error : str or None
        Inference with ``on_error="skip"``: the message of this step's failed sample.
    """

    features: ShardedFeatures | None
    index: int | None
    record_id: Any
    epoch: int
    step: int
    skipped: tuple[int, ...] = ()
    error: str | None = None

    @property
    def is_padding(self) -> bool:
        """The group has no sample at this step (inference, uneven last round)."""
        return self.index is None

    @property
    def has_features(self) -> bool:
        """Whether :attr:`features` holds a sample (no padding, no skipped sample)."""
        return self.features is not None


@dataclass(frozen=True)
class _Fetched:
    """One serial fetch: the sample, or what went wrong."""

    index: int
    sample: Any
    error: BaseException | ErrorPayload | None


class _SerialFetch:
    """``dataset[i]`` that returns failures instead of raising them (picklable for workers)."""

    def __init__(self, dataset: Any, rank: int):
        self.dataset = dataset
        self.rank = rank

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> _Fetched:
        try:
            return _Fetched(index, self.dataset[index], None)
        except Exception as err:  # noqa: BLE001 - carried to every rank by the scatter
            where = get_worker_info()
            if where is None:
                _note(err, f"while fetching index {index} on rank {self.rank}")
                return _Fetched(index, None, err)
            _note(err, f"while fetching index {index} in DataLoader worker {where.id}")
            return _Fetched(index, None, ErrorPayload.capture(err, self.rank))


def _note(error: BaseException, text: str) -> None:
    if hasattr(error, "add_note"):
        error.add_note(text)


def _identity(item: Any) -> Any:
    return item


class _Indices(Sampler[int]):
    def __init__(self, indices: Sequence[int]):
        self.indices = list(indices)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class _SourceStream:
    """The source rank's fetches of one pass, in order, optionally prefetched by workers."""

    def __init__(
        self,
        fetch: _SerialFetch,
        indices: list[int],
        num_workers: int,
        prefetch_factor: int | None,
        timeout_s: float | None,
        dataloader_kwargs: Mapping[str, Any],
    ):
        self._iter: Iterator[_Fetched] | None = None
        self._broken: BaseException | None = None
        try:
            extra: dict[str, Any] = dict(dataloader_kwargs)
            # A DataLoader draws its workers' base seed from the global generator unless
            # it has its own; only the source rank builds one, so that draw would put the
            # source's stream one number ahead of its domain's (whose dropout masks must
            # agree) and a resumed run one number behind an uninterrupted one.
            extra.setdefault("generator", torch.Generator().manual_seed(0))
            if num_workers > 0:
                extra["num_workers"] = num_workers
                if prefetch_factor is not None:
                    extra["prefetch_factor"] = prefetch_factor
                if timeout_s is not None:
                    extra["timeout"] = timeout_s
            loader = DataLoader(
                fetch, batch_size=None, sampler=_Indices(indices), collate_fn=_identity, **extra
            )
            self._iter = iter(loader)
        except Exception as err:  # noqa: BLE001 - reported at the first step
            self._broken = err

    def next(self, expected: int, rank: int) -> tuple[Any, BaseException | None]:
        """The sample of index ``expected``, or ``(None, error)``."""
        if self._broken is not None or self._iter is None:
            return None, _loader_failure(self._broken, expected, rank)
        try:
            fetched = next(self._iter)
        except Exception as err:  # noqa: BLE001 - DataLoader machinery failed
            self._broken = err
            return None, _loader_failure(err, expected, rank)
        if fetched.index != expected:
            error = SerialLoaderError(
                f"the serial DataLoader on source rank {rank} returned index {fetched.index} "
                f"where index {expected} was due"
            )
            self._broken = error
            return None, error
        return fetched.sample, _as_exception(fetched)

    def close(self) -> None:
        self._iter = None


def _loader_failure(err: BaseException | None, index: int, rank: int) -> SerialLoaderError:
    if isinstance(err, SerialLoaderError):
        return err
    detail = f"{type(err).__name__}: {err}" if err is not None else "no iterator"
    failure = SerialLoaderError(
        f"the serial DataLoader on source rank {rank} failed while fetching index {index}: {detail}"
    )
    failure.__cause__ = err
    return failure


def _as_exception(fetched: _Fetched) -> BaseException | None:
    if isinstance(fetched.error, ErrorPayload):
        return fetched.error.to_exception()
    return fetched.error


def _skippable(error: BaseException) -> bool:
    """Whether ``error`` is a source-side sample failure that every rank received alike."""
    return isinstance(error.__cause__, RemoteTraceback) and not isinstance(
        error, (SerialLoaderError, SkipLimitError)
    )


def _type_name(error: BaseException) -> str:
    kind = type(error)
    return f"{kind.__module__}.{kind.__qualname__}"


class ShardedLoader:
    """Iterate a serial dataset as ShardTensor samples, one per domain group per step.

    Parameters
    ----------
    dataset : map-style dataset
        ``dataset[i]`` returns one sample's feature dict (name -> tensor, unbatched or with
        a leading batch axis of 1, plus non-tensor values such as a record id). Only the
        source rank of each domain group calls ``dataset[i]``; every rank calls
        ``len(dataset)``.
    mesh : FoldMesh
        From :func:`physicsnemo_foldcp.init_mesh`.
    mode : {"train", "inference"}, default "train"
        ``"train"``: a :class:`~physicsnemo_foldcp.data.sampling.TrainingOrder` (shuffled
        per epoch, different samples per domain group); ``"inference"``: an
        :class:`~physicsnemo_foldcp.data.sampling.InferenceOrder` (every index once, in
        order, padding steps flagged).
    registry : FeatureRegistry, optional
        Axis meanings of the features; the Boltz-2 preset by default.
    options : ShardingOptions, optional
        How every sample is sharded (:func:`scatter_features`); the defaults when omitted.
        With ``balance.mode == "balanced"`` the source rank computes each sample's row
        blocks in the scatter (an error there reaches every rank like a failed fetch).
    seed : int, default 0
        Seed of the training order; must be the same on every rank of the job.
    shuffle : bool, default True
        Training only: permute the dataset every epoch.
    remainder : {"wrap", "drop"}, default "wrap"
        Training only: how the last round of an epoch is evened out over the domain groups
        (see :class:`~physicsnemo_foldcp.data.sampling.TrainingOrder`).
    num_workers : int, default 0
        DataLoader worker processes on the source rank; with ``> 0`` they prefetch the
        next samples while the main process scatters the current one.
    prefetch_factor : int, optional
        Samples prefetched per worker (``num_workers > 0`` only).
    fetch_timeout_s : float, optional
        Bound on waiting for one sample from the workers (``num_workers > 0`` only); a
        timeout is raised on every rank as :class:`SerialLoaderError`.
    dataloader_kwargs : Mapping[str, Any], optional
        Further ``DataLoader`` arguments for the source rank (``pin_memory``,
        ``multiprocessing_context``, ``worker_init_fn``, ...).
    on_error : {"raise", "skip"}, default "raise"
        ``"raise"``: a failed sample raises its error on every rank of the domain group.
        ``"skip"``: every rank logs and records it and goes on in lockstep; in training the
        step is retried with a substitute index drawn from the order (so every domain
        group still runs the same number of steps); in inference the step yields a
        :class:`ShardedSample` with no features, ``index`` of the failed sample and its
        ``error`` message.
    max_skips : int, default 10
        With ``on_error="skip"``: the number of failed samples tolerated per pass; one more
        raises :class:`SkipLimitError` on every rank of the domain group.
    record_key : str or None, default "record_id"
        Non-tensor sample entry reported as :attr:`ShardedSample.record_id`.
    token_bounds : sequence of int, optional
        Fixed ``cp0 + 1`` row-block token boundaries for every sample (even balance only;
        see :func:`scatter_features`).

    Attributes
    ----------
    options : ShardingOptions
        The options of every scatter.
    sampler : EpochSampler
        Current epoch and position; ``sampler.set_epoch`` is what Lightning calls.
    skipped : list[SkippedSample]
        Every sample left out by the ``"skip"`` policy, in order.

    Notes
    -----
    Iterating the loader runs the rest of the current epoch (from ``position``) and then
    moves to the next epoch, so ``for epoch in range(E): for item in loader: ...`` sees
    epochs 0..E-1. :meth:`state_dict` / :meth:`load_state_dict` save and restore the
    epoch and the position (steps already yielded), so a resumed run yields the same
    samples as an uninterrupted one. Every rank of a domain group must iterate the loader
    the same number of steps; all domain groups run the same number of steps per epoch.
    """

    batch_sampler = None
    """No batch sampler (one sample per step): how Lightning learns to read ``sampler``,
    whose ``set_epoch`` it calls at every epoch (a no-op for the current epoch)."""

    def __init__(
        self,
        dataset: Any,
        mesh: FoldMesh,
        *,
        mode: str = "train",
        registry: FeatureRegistry | None = None,
        options: ShardingOptions | None = None,
        seed: int = 0,
        shuffle: bool = True,
        remainder: str = "wrap",
        num_workers: int = 0,
        prefetch_factor: int | None = None,
        fetch_timeout_s: float | None = None,
        dataloader_kwargs: Mapping[str, Any] | None = None,
        on_error: str = "raise",
        max_skips: int = 10,
        record_key: str | None = "record_id",
        token_bounds: Sequence[int] | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        check_fetch_options(
            on_error=on_error,
            max_skips=max_skips,
            num_workers=num_workers,
            prefetch_factor=prefetch_factor,
            fetch_timeout_s=fetch_timeout_s,
            dataloader_kwargs=dataloader_kwargs,
        )
        self.options, self._token_bounds = loader_sharding_options(options, token_bounds)
        try:
            length = len(dataset)
        except TypeError as err:
            raise TypeError(
                f"the dataset must be a map-style dataset with __len__ and __getitem__, got "
                f"{type(dataset).__name__}"
            ) from err
        order: Order
        if mode == "train":
            order = TrainingOrder(
                length,
                mesh.ddp_size,
                mesh.ddp_rank,
                seed=seed,
                shuffle=shuffle,
                remainder=remainder,
            )
        else:
            order = InferenceOrder(length, mesh.ddp_size, mesh.ddp_rank)
        self.dataset = dataset
        self.mesh = mesh
        self.mode = mode
        self.registry = registry if registry is not None else FeatureRegistry.preset("boltz2")
        self.sampler = EpochSampler(order)
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.fetch_timeout_s = fetch_timeout_s
        self.dataloader_kwargs = dict(dataloader_kwargs or {})
        self.on_error = on_error
        self.max_skips = max_skips
        self.record_key = record_key
        self.skipped: list[SkippedSample] = []

    # -- position ---------------------------------------------------------------------------

    @property
    def order(self) -> Order:
        """The order of dataset indices (pure; the same on every rank)."""
        return self.sampler.order

    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self.sampler.epoch

    @property
    def position(self) -> int:
        """Steps of the current epoch already yielded."""
        return self.sampler.position

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        """Go to the start of ``epoch`` (kept position if it is the current one)."""
        self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Epoch, position and order signature: enough to resume with the same samples."""
        return {"mode": self.mode, **self.sampler.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`; raises ``ValueError`` for another order or mode.

        A training state taken with another ``ddp`` size continues the same epoch
        (:func:`~physicsnemo_foldcp.data.sampling.reshard_training_state`; rank 0 warns
        when samples are seen again or the step moves).
        """
        if state.get("mode", self.mode) != self.mode:
            raise ValueError(
                f"cannot resume a {self.mode!r} loader from the state of a {state['mode']!r} one"
            )
        state, note = reshard_training_state(dict(state), self.order.ddp_size)
        if note and self.mesh.rank == 0:
            logger.warning("resuming the training loader: %s", note)
        self.sampler.load_state_dict(state)

    def __repr__(self) -> str:
        return (
            f"ShardedLoader({self.order!r}, epoch={self.epoch}, position={self.position}, "
            f"on_error={self.on_error!r}, num_workers={self.num_workers})"
        )

    # -- iteration --------------------------------------------------------------------------

    def __iter__(self) -> Iterator[ShardedSample]:
        return self._iterate()

    def _check_in_step(self) -> None:
        """One object all-gather: every rank must start the same pass of the same order."""
        mesh = self.mesh
        mine = (
            self.mode,
            tuple(self.order.signature()),
            self.epoch,
            self.position,
            self.on_error,
            self.max_skips,
        )
        gathered: list[Any] = [None] * mesh.domain_size
        dist.all_gather_object(gathered, mine, group=mesh.object_group)
        names = ("mode", "order", "epoch", "position", "on_error", "max_skips")
        problems = []
        for r, theirs in enumerate(gathered[1:], start=1):
            rank = mesh.domain_global_rank(r // mesh.cp[1], r % mesh.cp[1])
            for name, a, b in zip(names, gathered[0], theirs):
                if a != b:
                    problems.append(f"rank {rank} has {name}={b!r}, the source has {a!r}")
        if problems:
            raise LoaderConfigError(
                f"the ranks of domain group {mesh.ddp_rank} would iterate different samples: "
                + "; ".join(problems[:6])
                + ". Build the loader with the same arguments on every rank, and resume every "
                "rank from the same state_dict"
            )

    def _iterate(self) -> Iterator[ShardedSample]:
        mesh = self.mesh
        self._check_in_step()
        steps = self.sampler.pending()
        stream = None
        if mesh.is_domain_source:
            stream = _SourceStream(
                _SerialFetch(self.dataset, mesh.rank),
                [s.index for s in steps if s.index is not None],
                self.num_workers,
                self.prefetch_factor,
                self.fetch_timeout_s,
                self.dataloader_kwargs,
            )
        skips = [0]
        try:
            for step in steps:
                item = self._run_step(step, stream, skips)
                self.sampler.consumed(step)
                yield item
            self.sampler.finish_epoch()
        finally:
            if stream is not None:
                stream.close()

    def _fetch_now(self, index: int) -> tuple[Any, BaseException | None]:
        fetched = _SerialFetch(self.dataset, self.mesh.rank)[index]
        return fetched.sample, _as_exception(fetched)

    def _run_step(
        self, step: Step, stream: _SourceStream | None, skips: list[int]
    ) -> ShardedSample:
        mesh = self.mesh
        if step.index is None:
            return ShardedSample(None, None, None, step.epoch, step.step)
        index, failed = step.index, []
        while True:
            sample, error = None, None
            if mesh.is_domain_source:
                if not failed:
                    assert stream is not None
                    sample, error = stream.next(index, mesh.rank)
                else:
                    sample, error = self._fetch_now(index)
            try:
                features = scatter_features(
                    sample,
                    mesh,
                    registry=self.registry,
                    options=self.options,
                    token_bounds=self._token_bounds,
                    error=error,
                )
            except Exception as err:
                if self.on_error == "raise" or not _skippable(err):
                    raise
                failed.append(index)
                skips[0] += 1
                self._record_skip(step, index, err, skips[0])
                if skips[0] > self.max_skips:
                    listing = ", ".join(str(s.index) for s in self.skipped if s.epoch == step.epoch)
                    raise SkipLimitError(
                        f"domain group {mesh.ddp_rank}: {skips[0]} samples failed in epoch "
                        f"{step.epoch}, more than max_skips={self.max_skips} (indices "
                        f"{listing}); last error {_type_name(err)}: {err}"
                    ) from err
                if self.mode == "inference":
                    return ShardedSample(
                        None,
                        index,
                        None,
                        step.epoch,
                        step.step,
                        skipped=(index,),
                        error=f"{_type_name(err)}: {err}",
                    )
                assert isinstance(self.order, TrainingOrder)
                index = self.order.replacement(step.epoch, step.step, len(failed), set(failed))
                continue
            record_id = None
            if self.record_key is not None:
                value = features.get(self.record_key)
                record_id = None if isinstance(value, torch.Tensor) else value
            return ShardedSample(
                features, index, record_id, step.epoch, step.step, skipped=tuple(failed)
            )

    def _record_skip(self, step: Step, index: int, error: BaseException, count: int) -> None:
        entry = SkippedSample(step.epoch, step.step, index, _type_name(error), str(error))
        self.skipped.append(entry)
        if self.mesh.is_domain_source:
            logger.warning(
                "domain group %d: skipping dataset index %d (epoch %d, step %d) after %s: %s "
                "[%d of at most %d skips this epoch]",
                self.mesh.ddp_rank,
                index,
                step.epoch,
                step.step,
                entry.error_type,
                entry.message,
                count,
                self.max_skips,
            )


__all__ = [
    "MODES",
    "ON_ERROR",
    "LoaderConfigError",
    "check_fetch_options",
    "loader_sharding_options",
    "SerialLoaderError",
    "ShardedLoader",
    "ShardedSample",
    "SkipLimitError",
    "SkippedSample",
]
