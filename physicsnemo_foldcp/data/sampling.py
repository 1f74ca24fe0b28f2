"""Which dataset index each domain group takes at each step, for training and inference.

The ``ddp`` axis of the mesh holds ``D`` domain groups; each takes one sample per step.
The orders here are pure functions of their arguments: every rank computes them on its own
and all ranks agree without communicating.

* :class:`TrainingOrder`: a permutation of the dataset per epoch, drawn from
  ``(seed, epoch)``; at step ``s`` domain group ``d`` takes position ``s * D + d`` of the
  permutation. The ``len % D`` positions left over in the last round are either dropped
  (``remainder="drop"``) or filled by wrapping to the start of the permutation
  (``remainder="wrap"``, the default), so every group runs the same number of steps.
* :class:`InferenceOrder`: every index exactly once, in order: group ``d`` takes
  ``d, d + D, d + 2D, ...``; in an uneven last round the groups without an index get a
  padding step (``index is None``) so that they stay in lockstep.

:class:`EpochSampler` adds the mutable part: the current epoch and the position (steps
already consumed) in it, with ``state_dict`` / ``load_state_dict`` for resuming.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

REMAINDERS = ("wrap", "drop")
"""How :class:`TrainingOrder` evens out the last round of an epoch."""


def _mixed_seed(*parts: int) -> int:
    """A 63-bit seed from integers, identical on every platform and process."""
    text = ":".join(str(int(p)) for p in parts)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def _check_sizes(length: int, ddp_size: int, ddp_rank: int) -> None:
    for name, value in (("length", length), ("ddp_size", ddp_size), ("ddp_rank", ddp_rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an integer, got {value!r}")
    if length < 1:
        raise ValueError(f"the dataset is empty (length {length}); nothing to iterate")
    if ddp_size < 1:
        raise ValueError(f"ddp_size must be >= 1, got {ddp_size}")
    if not 0 <= ddp_rank < ddp_size:
        raise ValueError(f"ddp_rank must be in [0, {ddp_size}), got {ddp_rank}")


def reshard_training_state(
    state: dict[str, Any], ddp_size: int
) -> tuple[dict[str, Any], str | None]:
    """A training sampler state taken with another ``ddp`` size, mapped to ``ddp_size``.

    An epoch's order is one permutation of the dataset whatever the ``ddp`` size; step
    ``s`` of group ``g`` takes its entry ``s * ddp + g``. ``position`` steps on ``D``
    groups consumed its first ``position * D`` entries, which is position
    ``position * D // ddp_size`` here (at most the end of the epoch): exact when divisible,
    otherwise the last few samples are seen again (said in the returned note).

    Parameters
    ----------
    state : dict
        :meth:`EpochSampler.state_dict` (or a loader's, which adds ``mode``).
    ddp_size : int
        This run's ``ddp`` size.

    Returns
    -------
    tuple[dict, str or None]
        The state to load, and what changed (``None`` when nothing did: an inference
        state, or the same ``ddp`` size).
    """
    state = dict(state)
    signature = list(state.get("signature", ()))
    if len(signature) != 6 or signature[0] != "train" or signature[2] == ddp_size:
        return state, None
    _, length, old, seed, shuffle, remainder = signature
    order = TrainingOrder(int(length), ddp_size, seed=seed, shuffle=shuffle, remainder=remainder)
    consumed = int(state["position"]) * int(old)
    state["position"] = min(consumed // ddp_size, order.steps_per_epoch)
    state["signature"] = list(order.signature())
    note = (
        f"the loader state was taken with ddp={old} (epoch {state['epoch']}, {consumed} "
        f"samples consumed); with ddp={ddp_size} the epoch continues at step "
        f"{state['position']}"
    )
    if consumed % ddp_size and state["position"] < order.steps_per_epoch:
        note += f", so {consumed % ddp_size} sample(s) of this epoch are seen again"
    return state, note


@dataclass(frozen=True)
class Step:
    """One step of one domain group.

    Attributes
    ----------
    epoch : int
        Epoch (pass over the dataset) the step belongs to.
    step : int
        Step number inside the epoch, from 0.
    index : int or None
        Dataset index the group fetches; ``None`` for a padding step (inference only: the
        group has no sample in this round and only keeps in step with the others).
    """

    epoch: int
    step: int
    index: int | None

    @property
    def is_padding(self) -> bool:
        """Whether the group has no sample at this step."""
        return self.index is None


class TrainingOrder:
    """Shuffled per-epoch order for training; each domain group gets different samples.

    Parameters
    ----------
    length : int
        Number of samples in the dataset, ``L >= 1``.
    ddp_size : int
        Number of domain groups ``D`` (the ``ddp`` mesh size).
    ddp_rank : int, default 0
        This rank's domain group ``d``.
    seed : int, default 0
        Base seed; the permutation of epoch ``e`` depends only on ``(seed, e, L)``. Every
        rank of the job must use the same seed.
    shuffle : bool, default True
        Permute per epoch; ``False`` keeps the dataset order (still split over groups).
    remainder : {"wrap", "drop"}, default "wrap"
        ``"wrap"``: ``ceil(L / D)`` steps per epoch, the last round filled with the first
        positions of the permutation (a few samples are seen twice in that epoch).
        ``"drop"``: ``L // D`` steps, the last ``L % D`` positions of the permutation are
        not used in that epoch (a different subset each epoch when shuffling).

    Raises
    ------
    ValueError
        For an empty dataset, a bad ``ddp_rank`` / ``remainder``, or ``remainder="drop"``
        with fewer samples than domain groups.
    """

    def __init__(
        self,
        length: int,
        ddp_size: int,
        ddp_rank: int = 0,
        *,
        seed: int = 0,
        shuffle: bool = True,
        remainder: str = "wrap",
    ):
        _check_sizes(length, ddp_size, ddp_rank)
        if remainder not in REMAINDERS:
            raise ValueError(f"remainder must be one of {REMAINDERS}, got {remainder!r}")
        if remainder == "drop" and length < ddp_size:
            raise ValueError(
                f"remainder='drop' with {length} samples and {ddp_size} domain groups leaves "
                "no step per epoch; use remainder='wrap' or fewer domain groups"
            )
        self.length, self.ddp_size, self.ddp_rank = length, ddp_size, ddp_rank
        self.seed, self.shuffle, self.remainder = int(seed), bool(shuffle), remainder

    @property
    def steps_per_epoch(self) -> int:
        """Steps every domain group runs per epoch."""
        if self.remainder == "drop":
            return self.length // self.ddp_size
        return math.ceil(self.length / self.ddp_size)

    def permutation(self, epoch: int) -> torch.Tensor:
        """The dataset order of ``epoch``: ``[L]`` int64, a permutation of ``range(L)``."""
        if not self.shuffle:
            return torch.arange(self.length)
        generator = torch.Generator().manual_seed(_mixed_seed(self.seed, epoch, self.length))
        return torch.randperm(self.length, generator=generator)

    def group_indices(self, epoch: int, group: int | None = None) -> list[int]:
        """Dataset indices of one domain group in ``epoch``, one per step.

        Parameters
        ----------
        epoch : int
            The epoch.
        group : int, optional
            Domain group; this order's ``ddp_rank`` by default.

        Returns
        -------
        list[int]
            ``steps_per_epoch`` indices: permutation positions ``group, group + D, ...``
            (wrapped around the permutation for ``remainder="wrap"``).
        """
        group = self.ddp_rank if group is None else group
        if not 0 <= group < self.ddp_size:
            raise ValueError(f"group must be in [0, {self.ddp_size}), got {group}")
        perm = self.permutation(epoch).tolist()
        return [
            perm[(s * self.ddp_size + group) % self.length] for s in range(self.steps_per_epoch)
        ]

    def replacement(self, epoch: int, step: int, attempt: int, exclude: set[int]) -> int:
        """A substitute index for a sample that failed, the same on every rank of the group.

        Parameters
        ----------
        epoch, step : int
            Where the failed sample was.
        attempt : int
            1 for the first substitute of this step, 2 for the next, ...
        exclude : set[int]
            Indices that already failed at this step; avoided unless nothing else is left.

        Returns
        -------
        int
            A dataset index drawn from ``(seed, epoch, ddp_rank, step, attempt)``.
        """
        generator = torch.Generator().manual_seed(
            _mixed_seed(self.seed, epoch, self.ddp_rank, step, attempt, self.length)
        )
        candidates = torch.randperm(self.length, generator=generator).tolist()
        for index in candidates:
            if index not in exclude:
                return index
        return candidates[0]

    def signature(self) -> tuple[Any, ...]:
        """Everything that determines the order (compared across ranks and checkpoints)."""
        return ("train", self.length, self.ddp_size, self.seed, self.shuffle, self.remainder)

    def __repr__(self) -> str:
        return (
            f"TrainingOrder(length={self.length}, ddp_size={self.ddp_size}, "
            f"ddp_rank={self.ddp_rank}, seed={self.seed}, shuffle={self.shuffle}, "
            f"remainder={self.remainder!r})"
        )


class InferenceOrder:
    """Every index exactly once over the domain groups, in order, padding steps flagged.

    Parameters
    ----------
    length : int
        Number of samples ``L >= 1``.
    ddp_size : int
        Number of domain groups ``D``.
    ddp_rank : int, default 0
        This rank's domain group ``d``.

    Notes
    -----
    Step ``s`` of group ``d`` is index ``s * D + d`` when it is ``< L``, and a padding
    step (``None``) otherwise; there are ``ceil(L / D)`` steps, and only the last can be a
    padding step (for the groups ``d >= L % D`` when ``L % D != 0``).
    """

    def __init__(self, length: int, ddp_size: int, ddp_rank: int = 0):
        _check_sizes(length, ddp_size, ddp_rank)
        self.length, self.ddp_size, self.ddp_rank = length, ddp_size, ddp_rank

    @property
    def steps_per_epoch(self) -> int:
        """Steps every domain group runs per pass, ``ceil(L / D)``."""
        return math.ceil(self.length / self.ddp_size)

    @property
    def padding_steps(self) -> int:
        """Padding steps of this rank's group per pass (0 or 1)."""
        return self.group_indices(0).count(None)

    def group_indices(self, epoch: int = 0, group: int | None = None) -> list[int | None]:
        """Dataset index per step of one domain group; ``None`` marks a padding step.

        Parameters
        ----------
        epoch : int
            Ignored (the order is the same in every pass); kept for symmetry with
            :meth:`TrainingOrder.group_indices`.
        group : int, optional
            Domain group; this order's ``ddp_rank`` by default.
        """
        group = self.ddp_rank if group is None else group
        if not 0 <= group < self.ddp_size:
            raise ValueError(f"group must be in [0, {self.ddp_size}), got {group}")
        out: list[int | None] = []
        for s in range(self.steps_per_epoch):
            index = s * self.ddp_size + group
            out.append(index if index < self.length else None)
        return out

    def signature(self) -> tuple[Any, ...]:
        """Everything that determines the order (compared across ranks and checkpoints)."""
        return ("inference", self.length, self.ddp_size)

    def __repr__(self) -> str:
        return (
            f"InferenceOrder(length={self.length}, ddp_size={self.ddp_size}, "
            f"ddp_rank={self.ddp_rank})"
        )


Order = TrainingOrder | InferenceOrder


class EpochSampler:
    """The current epoch and position of a domain group in an order; resumable.

    Parameters
    ----------
    order : TrainingOrder or InferenceOrder
        Which index each step takes.

    Attributes
    ----------
    epoch : int
        The current epoch (starts at 0).
    position : int
        Steps of the current epoch already consumed; a new pass starts here.
    """

    def __init__(self, order: Order):
        self.order = order
        self.epoch = 0
        self.position = 0

    def __len__(self) -> int:
        return self.order.steps_per_epoch

    def set_epoch(self, epoch: int) -> None:
        """Go to the start of ``epoch``; a no-op when it is already the current epoch.

        Keeping the position for the current epoch lets a run resumed from
        :meth:`state_dict` call ``set_epoch`` (as Lightning does) without losing its place.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def pending(self) -> list[Step]:
        """The steps of the current epoch not yet consumed, in order."""
        indices = self.order.group_indices(self.epoch)
        return [Step(self.epoch, s, indices[s]) for s in range(self.position, len(indices))]

    def consumed(self, step: Step) -> None:
        """Record that ``step`` was handed out (the next pass starts after it)."""
        self.position = step.step + 1

    def finish_epoch(self) -> None:
        """Move to the start of the next epoch."""
        self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        """``epoch``, ``position`` and the order's ``signature``, all plain Python values."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "signature": list(self.order.signature()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the epoch and position of :meth:`state_dict`.

        Raises
        ------
        ValueError
            When the state was taken with another order (dataset length, ddp size, seed,
            shuffle or remainder), which would hand out other samples, or when the position
            is past the end of the epoch.
        """
        missing = {"epoch", "position", "signature"} - set(state)
        if missing:
            raise ValueError(f"sampler state lacks {sorted(missing)}; got keys {sorted(state)}")
        theirs, mine = tuple(state["signature"]), self.order.signature()
        if theirs != mine:
            names = (
                ("mode", "length", "ddp_size", "seed", "shuffle", "remainder")
                if mine[0] == "train"
                else ("mode", "length", "ddp_size")
            )
            diffs = [
                f"{name}={a!r} in the state but {b!r} here"
                for name, a, b in zip(names, theirs, mine)
                if a != b
            ] or [f"signature {theirs} in the state but {mine} here"]
            raise ValueError(
                "cannot resume: the sampler state was saved for another order ("
                + "; ".join(diffs)
                + ")"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.order.steps_per_epoch:
            raise ValueError(
                f"cannot resume at epoch {epoch}, position {position}: positions run from 0 "
                f"to {self.order.steps_per_epoch}"
            )
        self.epoch, self.position = epoch, position

    def steps(self) -> Iterator[Step]:
        """Iterate the pending steps, marking each consumed, then finish the epoch."""
        for step in self.pending():
            self.consumed(step)
            yield step
        self.finish_epoch()


__all__ = [
    "REMAINDERS",
    "EpochSampler",
    "InferenceOrder",
    "Order",
    "Step",
    "TrainingOrder",
    "reshard_training_state",
]
