"""One run at a time per run directory: an exclusive lock that its holder's death releases.

A run takes the lock of its output directory (``<checkpoint_dir>/run.lock``, or next to its
metrics or summary file when it writes no checkpoints) on global rank 0 before it reads or
writes anything there, and keeps it until :func:`~physicsnemo_foldcp.training.train`
returns. The lock is an ``fcntl.flock`` on that file: the kernel releases it when the
holding process ends, however it ends, so a crashed run never leaves a lock that blocks
the next one. The file also records the holder (host, pid, start time) for the message a
refused run gives; a record left by a process of this host that no longer runs is reported
when the lock is taken over.

On a network file system the lock holds as far as that file system's ``flock`` does (NFS
v4 and Lustre with ``flock`` mounts do; elsewhere two hosts may not see each other's lock).
"""

from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import socket
from pathlib import Path

from physicsnemo_foldcp.distributed.errors import on_rank_zero

logger = logging.getLogger("physicsnemo_foldcp.training")

LOCK_NAME = "run.lock"
"""The lock file of a checkpoint directory."""


class RunLockedError(RuntimeError):
    """Another run holds the run directory's lock; this run changed nothing there."""


def lock_path(
    checkpoint_dir: str | os.PathLike | None,
    metrics_file: str | os.PathLike | None = None,
    summary_file: str | os.PathLike | None = None,
) -> Path | None:
    """The lock file of a run's outputs, or ``None`` for a run that writes no files.

    Parameters
    ----------
    checkpoint_dir : path or None
        The run's checkpoint directory: its lock is ``<checkpoint_dir>/run.lock``.
    metrics_file, summary_file : path or None
        Without a checkpoint directory, the lock is ``.<name>.lock`` next to the first
        of these that is set.
    """
    if checkpoint_dir:
        return Path(checkpoint_dir) / LOCK_NAME
    for path in (metrics_file, summary_file):
        if path:
            path = Path(path)
            return path.with_name(f".{path.name}.lock")
    return None


def _holder_record() -> dict[str, object]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "since": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def _read_record(fd: int) -> dict[str, object] | None:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data = os.read(fd, 4096)
        record = json.loads(data.decode("utf-8")) if data.strip() else None
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) else None


def _describe(record: dict[str, object] | None) -> str:
    if record is None:
        return "a run that left no holder record"
    return f"pid {record.get('pid')} on host {record.get('host')} (since {record.get('since')})"


def _is_dead_here(record: dict[str, object] | None) -> bool:
    """Whether ``record`` names a process of this host that no longer runs."""
    if record is None or record.get("host") != socket.gethostname():
        return False
    pid = record.get("pid")
    if type(pid) is not int or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class RunLock:
    """The exclusive lock of one run directory, held by this process (see module doc).

    Parameters
    ----------
    path : path
        The lock file; its directory is created if missing. A symlink there is refused.

    Raises
    ------
    RunLockedError
        When another process holds the lock; the message names the directory, the lock
        file and the holder.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as err:
            raise RunLockedError(
                f"cannot open the run lock {self.path} ({err.strerror}): it must be a regular "
                "file of the run directory (a symlink there is refused)"
            ) from err
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(_read_record(fd))
            os.close(fd)
            raise RunLockedError(
                f"run directory {self.path.parent} is in use by another run: {holder} holds "
                f"its lock {self.path}. Two runs in one directory would interleave their "
                "metrics and checkpoints; wait for that run to end, or give this run another "
                "directory (run_dir / train.checkpoint_dir)"
            ) from None
        except OSError as err:
            os.close(fd)
            raise RunLockedError(
                f"cannot lock the run directory {self.path.parent} ({self.path}: "
                f"{err.strerror}): the file system must support flock"
            ) from err
        previous = _read_record(fd)
        if _is_dead_here(previous):
            logger.info(
                "run directory %s: taking over the lock left by %s, which no longer runs",
                self.path.parent,
                _describe(previous),
            )
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps(_holder_record()).encode("utf-8"))
        os.fsync(fd)
        self._fd: int | None = fd

    @property
    def held(self) -> bool:
        """Whether this object still holds the lock."""
        return self._fd is not None

    def release(self) -> None:
        """Release the lock (idempotent); the file stays, its record is cleared."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class JobLock:
    """A run directory's lock taken by global rank 0 for the whole job (collective).

    Call the constructor and :meth:`release` on every rank: rank 0 takes or releases the
    lock, and a refusal there is raised on every rank (one object broadcast).

    Parameters
    ----------
    path : path or None
        The lock file (:func:`lock_path`); ``None`` takes no lock.
    """

    def __init__(self, path: str | os.PathLike | None) -> None:
        self._lock: RunLock | None = None

        def take() -> None:
            if path is not None:
                self._lock = RunLock(path)

        on_rank_zero(take, "locking the run directory")

    def release(self) -> None:
        """Release the lock on rank 0 (every rank may call it; no communication)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None


__all__ = ["LOCK_NAME", "JobLock", "RunLock", "RunLockedError", "lock_path"]
