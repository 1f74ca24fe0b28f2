"""The upstream versions this package is tested with, checked when it is imported.

The plugin extends PhysicsNeMo's ShardTensor dispatch and reads a few of its private names
(all in :mod:`physicsnemo_foldcp.core.compat`). Those names change between releases, so
importing the package on a PhysicsNeMo or torch outside the tested range raises one
:class:`ImportError` that names the range, before anything else is imported. Setting the
environment variable ``FOLDCP_ALLOW_UNTESTED=1`` turns the error into a warning.

This module imports neither torch nor PhysicsNeMo: it reads the installed distributions'
metadata only, so the check runs before any upstream code.
"""

from __future__ import annotations

import os
import re
import warnings
from importlib import metadata

SUPPORTED: dict[str, tuple[str, str]] = {
    "nvidia-physicsnemo": ("2.2.2", "2.3"),
    "torch": ("2.10", "3"),
}
"""Distribution -> ``(lowest tested version, first version not supported)``."""

ALLOW_UNTESTED_ENV = "FOLDCP_ALLOW_UNTESTED"
"""Environment variable that turns the version error into a warning when set to ``1``."""


def _release(version: str) -> tuple[int, ...]:
    """The numeric release part of a version string (``"2.14.1+cu130"`` -> ``(2, 14, 1)``)."""
    match = re.match(r"\d+(\.\d+)*", version)
    if match is None:
        raise ValueError(f"cannot read the version {version!r}")
    return tuple(int(part) for part in match.group(0).split("."))


def _before(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    width = max(len(a), len(b))
    return a + (0,) * (width - len(a)) < b + (0,) * (width - len(b))


def in_range(version: str, low: str, high: str) -> bool:
    """Whether ``low <= version < high`` by release number (local tags ignored)."""
    release = _release(version)
    return not _before(release, _release(low)) and _before(release, _release(high))


def untested(installed: dict[str, str | None] | None = None) -> list[str]:
    """One line per distribution whose installed version is outside :data:`SUPPORTED`.

    Parameters
    ----------
    installed : dict[str, str or None], optional
        Distribution -> version (``None``: not installed); read from the environment by
        default.
    """
    if installed is None:
        installed = {}
        for name in SUPPORTED:
            try:
                installed[name] = metadata.version(name)
            except metadata.PackageNotFoundError:
                installed[name] = None
    problems = []
    for name, (low, high) in SUPPORTED.items():
        version = installed.get(name)
        if version is None:
            problems.append(f"{name} is not installed (tested: >={low},<{high})")
        elif not in_range(version, low, high):
            problems.append(f"{name} {version} is installed; tested: >={low},<{high}")
    return problems


def check(installed: dict[str, str | None] | None = None) -> None:
    """Raise :class:`ImportError` (or warn, with ``FOLDCP_ALLOW_UNTESTED=1``) if untested.

    Parameters
    ----------
    installed : dict[str, str or None], optional
        As for :func:`untested`.
    """
    problems = untested(installed)
    if not problems:
        return
    message = (
        "physicsnemo-foldcp is tested with "
        + ", ".join(f"{n}>={lo},<{hi}" for n, (lo, hi) in SUPPORTED.items())
        + ", but "
        + "; ".join(problems)
        + ". Install a tested version, or set "
        + f"{ALLOW_UNTESTED_ENV}=1 to try anyway (the plugin reads private names of "
        + "PhysicsNeMo's ShardTensor that change between releases)."
    )
    if os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        warnings.warn(message, stacklevel=2)
        return
    raise ImportError(message)


__all__ = ["ALLOW_UNTESTED_ENV", "SUPPORTED", "check", "in_range", "untested"]
