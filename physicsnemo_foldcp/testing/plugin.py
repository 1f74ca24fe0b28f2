"""Pytest plugin for distributed tests, following PhysicsNeMo's ``multigpu_static`` convention.

Enable it from a ``conftest.py`` with ``pytest_plugins = ["physicsnemo_foldcp.testing.plugin"]``.

* ``--multigpu-static``: the whole pytest session runs on every rank under ``torchrun``;
  tests marked ``multigpu_static`` run, unmarked ones should be deselected with
  ``-m multigpu_static``. Without the option, marked tests are skipped.
* Fixtures: ``fold_world`` (the started job), ``fold_mesh_factory`` (``(ddp, cp0, cp1)``
  -> cached :class:`~physicsnemo_foldcp.FoldMesh`) and ``fold_mesh``, parametrized
  indirectly with a mesh shape. Parametrizations whose shape does not fit the world size
  are deselected at collection; a direct request for such a mesh skips. ``shared_dir``:
  a temporary directory with one path on every rank.
* The outcome of every phase (setup, call, teardown) of a ``multigpu_static`` test is
  shared: when it fails on one rank it fails on all, with the failing rank's message, so
  every rank runs the same sequence of collectives and no rank waits for a peer that gave
  up. A skip in setup on one rank skips the test on all (a skip in the call does not
  spread). Phases that end without a process group (the first setup, before
  ``fold_world`` started the job; the last teardown, after it ended) are not shared.
* ``--junitxml`` paths containing ``{rank}`` get the global rank, one report per rank.
* With ``FOLDCP_TEST_PROGRESS_DIR`` set, each rank keeps the test and phase it is in
  in a file there (:mod:`physicsnemo_foldcp.testing.progress`), for a runner that has to
  report a hang.
* Every collective wait is bounded by ``--foldcp-timeout`` seconds; TF32 is off.
* ``--foldcp-exit-at-end``: once the session's reports are written, the process ends
  with pytest's exit status through ``os._exit``, without tearing the interpreter down
  (with torch, Boltz and Lightning loaded that takes seconds per process, times the
  ranks on a few cores). The suite runner passes it; a pytest run inside a test
  (``pytester``) does not get it.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from physicsnemo_foldcp.testing.asserts import CollectiveAssertionError, gather_failures
from physicsnemo_foldcp.testing.junit import RANK_PLACEHOLDER, report_path
from physicsnemo_foldcp.testing.progress import PROGRESS_DIR_ENV, write_progress

MARKER = "multigpu_static"


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add ``--multigpu-static``, ``--foldcp-timeout`` and ``--foldcp-exit-at-end``."""
    group = parser.getgroup("foldcp")
    group.addoption(
        "--multigpu-static",
        action="store_true",
        default=False,
        help="run multigpu_static tests; launch pytest on every rank with torchrun",
    )
    group.addoption(
        "--foldcp-timeout",
        type=float,
        default=float(os.environ.get("FOLDCP_TEST_TIMEOUT_S", 180)),
        help="bound in seconds on every collective wait in distributed tests",
    )
    group.addoption(
        "--foldcp-exit-at-end",
        action="store_true",
        default=False,
        help="end the process with os._exit(status) once the reports are written",
    )


def _distributed(config: pytest.Config) -> bool:
    return bool(config.getoption("--multigpu-static"))


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _note_progress(state: str) -> None:
    directory = os.environ.get(PROGRESS_DIR_ENV)
    if directory:
        write_progress(directory, _rank(), state)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Register the marker, give each rank its JUnit report, turn TF32 off.

    Runs before pytest's own JUnit plugin opens ``--junitxml``, so that a path with
    ``{rank}`` is this rank's file.
    """
    xmlpath = getattr(config.option, "xmlpath", None)
    if xmlpath and RANK_PLACEHOLDER in xmlpath:
        config.option.xmlpath = report_path(xmlpath, _rank())
    _note_progress("starting")
    config.addinivalue_line(
        "markers", f"{MARKER}: distributed test, run on every rank under torchrun"
    )
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def _mesh_param(item: pytest.Item) -> tuple[int, int, int] | None:
    callspec = getattr(item, "callspec", None)
    if callspec is None or "fold_mesh" not in callspec.params:
        return None
    return tuple(callspec.params["fold_mesh"])  # type: ignore[return-value]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip marked tests without the option; deselect meshes that do not fit the world."""
    if not _distributed(config):
        skip = pytest.mark.skip(reason=f"{MARKER} tests need --multigpu-static under torchrun")
        for item in items:
            if item.get_closest_marker(MARKER):
                item.add_marker(skip)
        return
    world = _world_size()
    keep, drop = [], []
    for item in items:
        shape = _mesh_param(item)
        fits = shape is None or shape[0] * shape[1] * shape[2] == world
        (keep if fits else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def sync_outcome(error: BaseException | None, phase: str = "call") -> None:
    """Share one test phase's outcome across the world; raise on every rank if one failed.

    Every rank must call it once per phase, in the same order: it is one all-gather.

    Parameters
    ----------
    error : BaseException or None
        What this rank's phase raised (``None`` on success).
    phase : {"setup", "call", "teardown"}
        The phase. A skip counts as success for the other ranks, except in ``"setup"``,
        where it skips the test on every rank (a rank that skipped setup runs no call, so
        the others must not either).

    Raises
    ------
    BaseException
        This rank's own ``error`` if it failed; otherwise a
        :class:`CollectiveAssertionError` naming the ranks that failed and their messages
        (also on a rank that skipped); otherwise this rank's own skip, or (setup only) a
        skip naming the ranks that skipped.
    """
    if error is None:
        outcome = None
    elif isinstance(error, pytest.skip.Exception):
        outcome = ("skipped", str(error.msg))
    else:
        outcome = ("failed", f"{type(error).__name__}: {error}")
    outcomes = gather_failures(outcome)
    if error is not None and outcome[0] == "failed":
        raise error
    failures = {rank: message for rank, (kind, message) in outcomes.items() if kind == "failed"}
    if failures:
        raise CollectiveAssertionError(failures)
    if error is not None:
        raise error
    skips = {rank: message for rank, (kind, message) in outcomes.items() if kind == "skipped"}
    if skips and phase == "setup":
        ranks = ", ".join(str(rank) for rank in skips)
        pytest.skip(f"skipped in setup on rank(s) {ranks}: {next(iter(skips.values()))}")


def _shared_phase(item: pytest.Item, phase: str):
    """Body of the phase wrappers: note progress, run the phase, share its outcome.

    The outcome is shared when the process group exists after the phase, which is the
    same on every rank: ``fold_world`` starts the job in the first test's setup and ends
    it in the last test's teardown, on all ranks together.
    """
    _note_progress(f"{item.nodeid} ({phase})")
    if not (_distributed(item.config) and item.get_closest_marker(MARKER)):
        return (yield)
    try:
        result = yield
    except (KeyboardInterrupt, pytest.exit.Exception):
        raise
    except BaseException as error:  # noqa: BLE001 - every outcome is shared
        if dist.is_initialized():
            sync_outcome(error, phase)
        raise
    if dist.is_initialized():
        sync_outcome(None, phase)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    """Set up a test's fixtures; fail (or skip) setup on every rank if it did on one."""
    return (yield from _shared_phase(item, "setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """Run a ``multigpu_static`` test and fail it on every rank if it failed on one."""
    return (yield from _shared_phase(item, "call"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """Tear down a test's fixtures; fail teardown on every rank if it failed on one."""
    return (yield from _shared_phase(item, "teardown"))


def pytest_collection(session: pytest.Session) -> None:
    """Note that this rank is collecting tests."""
    _note_progress("collecting")


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Note that this rank ran its last test; keep the session for the exit status."""
    _note_progress("finished")
    session.config.stash[_SESSION] = session


_SESSION = pytest.StashKey[pytest.Session]()


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """With ``--foldcp-exit-at-end``, end the process now with pytest's exit status.

    This is the last hook pytest calls: the JUnit report and the terminal summary are
    written (``pytest_sessionfinish``) and every other plugin is unconfigured.
    """
    session = config.stash.get(_SESSION, None)
    if not config.getoption("--foldcp-exit-at-end") or session is None:
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(int(session.exitstatus))


@pytest.fixture(scope="session")
def fold_world(request: pytest.FixtureRequest):
    """Start the distributed job once per session (gloo on CPU, NCCL on GPU).

    Yields
    ------
    int
        The world size.
    """
    if not _distributed(request.config):
        pytest.skip(f"{MARKER} tests need --multigpu-static under torchrun")
    from physicsnemo_foldcp.distributed import bootstrap

    bootstrap.init_mesh(ddp=-1, cp=(1, 1), timeout_s=request.config.getoption("--foldcp-timeout"))
    yield dist.get_world_size()
    bootstrap.shutdown()


@pytest.fixture(scope="session")
def fold_mesh_factory(fold_world: int):
    """Return ``make(ddp, cp0, cp1) -> FoldMesh``; it skips when the shape does not fit."""
    from physicsnemo_foldcp.distributed import bootstrap

    def make(ddp: int, cp0: int, cp1: int):
        if ddp * cp0 * cp1 != fold_world:
            pytest.skip(f"mesh {ddp}x{cp0}x{cp1} needs {ddp * cp0 * cp1} ranks, have {fold_world}")
        return bootstrap.init_mesh(ddp=ddp, cp=(cp0, cp1))

    return make


@pytest.fixture
def fold_mesh(request: pytest.FixtureRequest, fold_mesh_factory):
    """The mesh named by an indirect parametrization ``(ddp, cp0, cp1)``."""
    return fold_mesh_factory(*request.param)


@pytest.fixture
def shared_dir(fold_world: int):
    """A temporary directory with the same path on every rank (removed afterwards)."""
    name = [tempfile.mkdtemp(prefix="foldcp-test-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    yield Path(name[0])
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(name[0], ignore_errors=True)


__all__ = ["MARKER", "CollectiveAssertionError", "sync_outcome"]
