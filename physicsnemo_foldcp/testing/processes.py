"""End a process and everything it started, including children that left its session.

``torchrun`` starts each worker in a session (and process group) of its own, so killing
the launcher's process group alone leaves the workers running. :func:`kill_tree` walks the
process tree first, then kills every process in it and every process group they lead.
"""

from __future__ import annotations

import os
import signal

import psutil


def kill_tree(pid: int, wait_s: float = 10.0) -> list[int]:
    """Kill process ``pid``, all its descendants and their process groups with ``SIGKILL``.

    Parameters
    ----------
    pid : int
        Root of the tree, e.g. a ``torchrun`` launcher started with
        ``start_new_session=True`` (so its process group is its own).
    wait_s : float
        Bound in seconds on waiting for the killed processes to exit.

    Returns
    -------
    list[int]
        Process ids that were still alive after ``wait_s`` seconds (normally empty).
    """
    try:
        root = psutil.Process(pid)
        members = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        members = []
    groups = {pid}
    for member in members:
        try:
            groups.add(os.getpgid(member.pid))
        except ProcessLookupError:
            pass
    own_group = os.getpgid(0)
    for group in groups - {own_group}:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for member in members:
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(members, timeout=wait_s)
    return [p.pid for p in alive]
