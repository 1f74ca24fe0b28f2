"""Atomic outputs: a reader sees a run's file or directory whole, or not at all.

Every output of a run (checkpoint directories and their metadata, the metrics file, the
run manifest and summary, predictions) is written under a temporary name in its final
directory and moved into place with ``os.replace`` (a rename, atomic on one file system).
A crash leaves at most a ``.tmp`` name behind, never a truncated file under the real one.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

TMP_MARK = ".tmp"
"""Part of the name of every temporary file or directory written here."""


def temporary_sibling(path: str | os.PathLike, *, unique: bool = True) -> Path:
    """A temporary name next to ``path`` (same directory, so a rename is atomic).

    Parameters
    ----------
    path : path
        The final name.
    unique : bool, default True
        Add a random part, so concurrent writers never share a temporary name; ``False``
        gives a name every rank can compute (for a directory written collectively).
    """
    path = Path(path)
    tail = f".{uuid.uuid4().hex[:12]}" if unique else ""
    return path.with_name(f".{path.name}{TMP_MARK}{tail}")


def write_atomic(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Write ``path`` through ``write(temporary_path)``, then move it into place.

    Parameters
    ----------
    path : path
        The final file; its directory is created if missing.
    write : callable
        Writes the whole file to the path it is given.

    Returns
    -------
    Path
        ``path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` atomically (UTF-8)."""
    return write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def replace_directory(tmp: str | os.PathLike, final: str | os.PathLike) -> Path:
    """Move the finished directory ``tmp`` to ``final``, replacing a directory there.

    An existing ``final`` is first renamed aside and removed only once ``tmp`` is in its
    place, so ``final`` names a whole directory at every moment but one rename apart.

    Parameters
    ----------
    tmp : path
        A complete directory, in the same parent as ``final``.
    final : path
        Its name.

    Returns
    -------
    Path
        ``final``.
    """
    tmp, final = Path(tmp), Path(final)
    old = None
    if final.exists():
        old = temporary_sibling(final)
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


__all__ = [
    "TMP_MARK",
    "replace_directory",
    "temporary_sibling",
    "write_atomic",
    "write_text_atomic",
]
