"""Carry an exception from one rank to its peers, so that every rank raises the same error."""

from __future__ import annotations

import pickle
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch.distributed as dist

T = TypeVar("T")


class RemoteTraceback(Exception):
    """The formatted traceback of an exception raised on another rank (set as ``__cause__``)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class ErrorPayload:
    """A picklable record of an exception raised on one rank.

    Attributes
    ----------
    rank : int
        Global rank that raised.
    type_name : str
        ``module.QualName`` of the exception type.
    message : str
        ``str(exception)``.
    traceback_text : str
        The formatted traceback, as printed on the raising rank.
    pickled : bytes or None
        The exception itself, when it can be pickled and unpickled.
    """

    rank: int
    type_name: str
    message: str
    traceback_text: str
    pickled: bytes | None

    @classmethod
    def capture(cls, error: BaseException, rank: int) -> ErrorPayload:
        """Record ``error`` (raised on ``rank``) for sending to other ranks."""
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        try:
            pickled = pickle.dumps(error)
            pickle.loads(pickled)
        except Exception:  # noqa: BLE001 - an unpicklable exception is sent as text
            pickled = None
        kind = type(error)
        return cls(rank, f"{kind.__module__}.{kind.__qualname__}", str(error), text, pickled)

    def to_exception(self, context: str = "") -> BaseException:
        """An exception of the original type (or ``RuntimeError``) to raise on a peer.

        Parameters
        ----------
        context : str
            Prefix for the message, e.g. which operation received the error.

        Returns
        -------
        BaseException
            The original exception when it could be pickled, its ``__cause__`` a
            :class:`RemoteTraceback` with the original traceback; otherwise a
            ``RuntimeError`` naming the original type.
        """
        remote = RemoteTraceback(
            f"\n--- traceback on rank {self.rank} ---\n{self.traceback_text.rstrip()}"
        )
        error: BaseException | None = None
        if self.pickled is not None:
            try:
                error = pickle.loads(self.pickled)
            except Exception:  # noqa: BLE001
                error = None
        if error is None:
            error = RuntimeError(f"{self.type_name}: {self.message}")
        if context and hasattr(error, "add_note"):
            error.add_note(f"{context} (raised on rank {self.rank})")
        error.__cause__ = remote
        return error


def on_rank_zero(work: Callable[[], T], context: str) -> T:
    """Run ``work()`` on global rank 0; its result, or its error, on every rank.

    Call on every rank. Whatever ``work`` raises on rank 0 is raised there as it is and on
    every other rank as :meth:`ErrorPayload.to_exception` (the same type when it pickles),
    so no rank is left waiting in a later collective.

    Communication: ONE ``broadcast_object_list`` over the world (none in a single process).

    Parameters
    ----------
    work : callable
        Run on rank 0 only (file-system work, a decision read from files).
    context : str
        Names the operation in the note of an error raised on the other ranks.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return work()
    box: list[object] = [None]
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            box[0] = ("result", work())
        except Exception as err:  # noqa: BLE001 - every error reaches every rank
            error = err
            box[0] = ("error", ErrorPayload.capture(err, 0))
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]  # type: ignore[misc]
    if kind == "error":
        if error is not None:
            raise error
        raise value.to_exception(context)
    return value


def on_every_rank(work: Callable[[], T], context: str) -> T:
    """Run ``work()`` on every rank; its result, or the first failing rank's error everywhere.

    Call on every rank. When ``work`` raises on any rank, every rank raises: a rank that
    failed raises its own error as it is, the others the error of the lowest failing rank as
    :meth:`ErrorPayload.to_exception` (the same type when it pickles). So a check that
    fails on one rank only (a file it cannot read, a value in its own shard) stops every
    rank at once instead of leaving the others in the next collective until the timeout.

    Communication: ONE ``all_gather_object`` over the world (none in a single process).

    Parameters
    ----------
    work : callable
        Run on every rank; it should not itself wait on other ranks after failing.
    context : str
        Names the operation in the note of an error raised on the other ranks.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return work()
    result: T | None = None
    error: BaseException | None = None
    mine: ErrorPayload | None = None
    try:
        result = work()
    except Exception as err:  # noqa: BLE001 - every error reaches every rank
        error = err
        mine = ErrorPayload.capture(err, dist.get_rank())
    gathered: list[ErrorPayload | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if error is not None:
        raise error
    failed = [payload for payload in gathered if payload is not None]
    if failed:
        raise failed[0].to_exception(context)
    return result  # type: ignore[return-value]
