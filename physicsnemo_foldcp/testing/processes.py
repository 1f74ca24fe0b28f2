"""End a process and everything it started, including children that left its session.

``torchrun`` starts each worker in a session (and process group) of its own, so killing
the launcher's process group alone leaves the workers running. :func:`kill_tree` walks the
process tree of a running process first, then kills every process in it and every process
group they lead; :func:`kill_group` ends what is left of a finished child's group.
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
        Root of the tree: a running child of this process (not yet reaped, so its pid
        cannot have been reused), e.g. a ``torchrun`` launcher started with
        ``start_new_session=True``. It is not waited for here: its parent reaps it
        (``Popen.wait``) and so keeps its exit status.
    wait_s : float
        Bound in seconds on waiting for the killed descendants to exit.

    Returns
    -------
    list[int]
        Descendants still running after ``wait_s`` seconds (normally empty).
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
    _, alive = psutil.wait_procs(members[1:], timeout=wait_s)
    return [p.pid for p in alive if _running(p)]


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_group(pgid: int) -> None:
    """Kill whatever is left in process group ``pgid``; nothing if it is empty.

    Parameters
    ----------
    pgid : int
        The group of a finished child started with ``start_new_session=True`` (its pid):
        processes it left behind, which could keep its output pipe open.

    Raises
    ------
    ValueError
        If ``pgid`` is this process's own group.
    """
    if pgid == os.getpgid(0):
        raise ValueError(f"refusing to kill this process's own process group {pgid}")
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
