"""Per-rank progress files: what each pytest process is doing right now.

The pytest plugin writes one small file per rank into the directory named by the
environment variable :data:`PROGRESS_DIR_ENV` (when it is set); a runner that has to stop
a hung run reads them with :func:`read_progress` to say which test each rank was in.
"""

from __future__ import annotations

import os
from pathlib import Path

PROGRESS_DIR_ENV = "FOLDCP_TEST_PROGRESS_DIR"
_PREFIX = "rank"
_SUFFIX = ".txt"


def progress_file(directory: str | os.PathLike[str], rank: int) -> Path:
    """Path of ``rank``'s progress file in ``directory``."""
    return Path(directory) / f"{_PREFIX}{rank}{_SUFFIX}"


def write_progress(directory: str | os.PathLike[str], rank: int, state: str) -> None:
    """Replace ``rank``'s progress with ``state`` (one line; written atomically).

    Parameters
    ----------
    directory : path
        Progress directory (created if missing).
    rank : int
        Global rank of the writing process (0 without ``torchrun``).
    state : str
        What the process is doing, e.g. ``"test/test_x.py::test_y (call)"``.
    """
    path = progress_file(directory, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(path.name + ".tmp")
    staging.write_text(state + "\n")
    os.replace(staging, path)


def read_progress(directory: str | os.PathLike[str]) -> dict[int, str]:
    """Read every rank's last progress state.

    Parameters
    ----------
    directory : path
        Progress directory; missing means no rank has written yet.

    Returns
    -------
    dict[int, str]
        Global rank -> state, sorted by rank.
    """
    states: dict[int, str] = {}
    for path in Path(directory).glob(f"{_PREFIX}*{_SUFFIX}"):
        number = path.name[len(_PREFIX) : -len(_SUFFIX)]
        if number.isdigit():
            states[int(number)] = path.read_text().strip()
    return dict(sorted(states.items()))
