"""Every private upstream name this package uses (PhysicsNeMo, torch.distributed, Lightning).

Each accessor below reads one private upstream name and states the upstream function and
the behaviour relied on; ``test/ops/test_compat.py`` has a test per name that fails when
upstream changes it. No other module of the package reads an underscore name of
``physicsnemo`` or ``torch.distributed`` (``test/test_private_names.py`` scans the source).
The versions these names were read from are pinned in :mod:`physicsnemo_foldcp.versions`.

Upstream names are looked up when called, never bound at import, so a wrapper someone
installs on them later (``validate_model`` does, for the length of one call) is seen.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed._functional_collectives as _funcol
from physicsnemo.domain_parallel import ShardTensor
from physicsnemo.domain_parallel import shard_tensor as _shard_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

# -- ShardTensor / DTensor internals --------------------------------------------------------


def local_tensor(x: ShardTensor | DTensor) -> torch.Tensor:
    """The local block, not differentiable and without dispatch.

    Upstream: ``ShardTensor._local_tensor`` / ``DTensor._local_tensor``, the attribute
    ``to_local()`` returns (through an autograd function). Relied on: it is this rank's
    block of the global tensor, of the local shape the spec records.
    """
    return x._local_tensor


def sharding_shapes(x: ShardTensor) -> dict[int, tuple[tuple[int, ...], ...]] | None:
    """``{mesh_dim: (local shape of rank r along mesh_dim, ...)}``, or ``None`` if unknown.

    Upstream: ``ShardTensorSpec._sharding_shapes``, the dict passed to
    ``ShardTensor.from_local(sharding_shapes=...)`` (``None`` until inferred). Relied on:
    it holds an entry per sharded mesh dim and is read without communication (the public
    ``spec.sharding_shapes()`` all-gathers when it is ``None``).
    """
    return x._spec._sharding_shapes


def global_shape(x: ShardTensor | DTensor) -> tuple[int, ...]:
    """Global shape, read from the spec without dispatch.

    Upstream: ``DTensorSpec.tensor_meta.shape`` behind ``x._spec``. Relied on: it is the
    global (padded-layout) shape; ``x.shape`` gives the same but goes through
    ``__torch_function__``.
    """
    return tuple(int(s) for s in x._spec.tensor_meta.shape)


def registered_function_handler(func: Callable) -> Callable | None:
    """The handler PhysicsNeMo has registered for ``func``, or ``None``.

    Upstream: ``ShardTensor._function_registry``, filled by
    ``ShardTensor.register_function_handler``. Relied on: it maps the exact callable to
    ``handler(func, types, args, kwargs)``; read at call time.
    """
    return ShardTensor._function_registry.get(func)


@contextlib.contextmanager
def function_handlers_removed(funcs: tuple[Callable, ...]) -> Iterator[None]:
    """Take the handlers of ``funcs`` out of PhysicsNeMo's registry for a while.

    Upstream: ``ShardTensor._function_registry`` (see :func:`registered_function_handler`).
    Relied on: a callable without an entry takes ShardTensor's generic path. The entries
    are put back on exit. Used to measure PhysicsNeMo without this package.
    """
    registry = ShardTensor._function_registry
    saved = {f: registry[f] for f in funcs if f in registry}
    try:
        for f in saved:
            del registry[f]
        yield
    finally:
        registry.update(saved)


def torch_function_fallback(func: Callable, args: tuple, kwargs: dict | None) -> Any:
    """Run ``func`` through PhysicsNeMo's generic DTensor fallback, as it is at call time.

    Upstream: ``physicsnemo.domain_parallel.shard_tensor._torch_function_fallback_via_dtensor``
    (what ``ShardTensor.__torch_function__`` calls for a function without a handler).
    Relied on: signature ``(func, args, kwargs)``; converts ShardTensors to DTensors, runs
    ``func``, converts results back.
    """
    return _shard_tensor._torch_function_fallback_via_dtensor(func, args, kwargs)


UPSTREAM_FALLBACKS = ("_torch_function_fallback_via_dtensor", "_dispatch_fallback_via_dtensor")
"""The two generic fallbacks of ``physicsnemo.domain_parallel.shard_tensor``
(``__torch_function__`` and ``__torch_dispatch__`` level), each ``(func, args, kwargs)``."""


@contextlib.contextmanager
def observed_upstream_fallbacks(
    wrap: Callable[[Callable, str], Callable],
) -> Iterator[None]:
    """Replace PhysicsNeMo's two generic fallbacks by ``wrap(original, name)`` for a while.

    Upstream: the module attributes named in :data:`UPSTREAM_FALLBACKS`, which
    ``ShardTensor.__torch_function__`` / ``__torch_dispatch__`` look up at call time.
    Relied on: both are module-level functions ``(func, args, kwargs)`` read through the
    module on every call. The originals are restored on exit.
    """
    originals = {name: getattr(_shard_tensor, name) for name in UPSTREAM_FALLBACKS}
    try:
        for name, original in originals.items():
            setattr(_shard_tensor, name, wrap(original, name))
        yield
    finally:
        for name, original in originals.items():
            setattr(_shard_tensor, name, original)


def conversion_active() -> bool:
    """Whether PhysicsNeMo is converting ShardTensors to or from DTensors right now.

    Upstream: ``shard_tensor._conversion_active``. Relied on: ``True`` inside the
    fallback's and the promotion's conversion scopes, where ``ShardTensor.__torch_function__``
    runs functions plainly; a subclass must then do the same.
    """
    return bool(_shard_tensor._conversion_active())


@contextlib.contextmanager
def conversion_scope() -> Iterator[None]:
    """PhysicsNeMo's conversion scope (functions on ShardTensors run plainly inside it).

    Upstream: ``shard_tensor._conversion_scope``, the re-entrant guard
    :func:`conversion_active` reads.
    """
    with _shard_tensor._conversion_scope():
        yield


def is_tracing(args: object, kwargs: object = None) -> bool:
    """Whether a fake tensor is among ``args`` / ``kwargs`` (a ``torch.compile`` trace).

    Upstream: ``shard_tensor._is_tracing(args, kwargs)`` (PhysicsNeMo 2.2.2); where it is
    missing, the same test through ``torch._subclasses.fake_tensor.is_fake``. Relied on:
    ``True`` exactly when an operand is a ``FakeTensor``.
    """
    upstream = getattr(_shard_tensor, "_is_tracing", None)
    if upstream is not None:
        return bool(upstream(args, kwargs))
    from torch._subclasses.fake_tensor import is_fake

    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    return any(isinstance(leaf, torch.Tensor) and is_fake(leaf) for leaf in leaves)


def plain_function_call(func: Callable, args: tuple, kwargs: dict) -> Any:
    """Call ``func`` with torch-function subclass dispatch disabled (subclasses run plainly).

    Upstream: ``torch._C.DisableTorchFunctionSubclass``, the guard ShardTensor itself uses.
    """
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


# -- functional collectives (counted by CommDebugMode) --------------------------------------

_all_gather = getattr(_funcol, "all_gather_single", None) or _funcol.all_gather_tensor
_reduce_scatter = getattr(_funcol, "reduce_scatter_single", None) or _funcol.reduce_scatter_tensor


def _waited(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, _funcol.AsyncCollectiveTensor):
        return t.wait()
    return t


def all_gather(t: torch.Tensor, dim: int, mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
    """Concatenate equal-shaped ``t`` of the ranks along ``mesh_dim`` on ``dim``, waited.

    Upstream: ``torch.distributed._functional_collectives.all_gather_tensor`` (or
    ``all_gather_single``) on the ``(mesh, mesh_dim)`` group. Relied on: CommDebugMode
    counts it; the result is a plain tensor after ``wait``.
    """
    return _waited(_all_gather(t.contiguous(), dim, (mesh, mesh_dim)))


def reduce_scatter(t: torch.Tensor, dim: int, mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
    """Sum ``t`` over the ranks along ``mesh_dim``; rank ``r`` keeps slice ``r`` of ``dim``.

    Upstream: ``_functional_collectives.reduce_scatter_tensor`` (``"sum"``), waited.
    """
    return _waited(_reduce_scatter(t.contiguous(), "sum", dim, (mesh, mesh_dim)))


def start_all_gather(t: torch.Tensor, mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
    """Start concatenating equal-shaped ``t`` of the ranks along ``mesh_dim`` on dim 0.

    Returns at once; the result ``[ranks * t.shape[0], ...]`` (coordinate order) is filled
    in the background and must go through :func:`wait` before it is read, so compute issued
    in between overlaps the transfer. Upstream: ``all_gather_single(t, 0, (mesh,
    mesh_dim))``. Relied on: for dim 0 it returns an ``AsyncCollectiveTensor`` without
    waiting and without a copy; CommDebugMode counts it.
    """
    return _all_gather(t.contiguous(), 0, (mesh, mesh_dim))


def start_reduce_scatter(t: torch.Tensor, mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
    """Start summing ``t`` over the ranks along ``mesh_dim``; rank ``r`` keeps slice ``r`` of dim 0.

    Returns at once (see :func:`start_all_gather`); ``t`` must not be written until the
    result has been waited. Upstream: ``reduce_scatter_single(t, "sum", 0, (mesh,
    mesh_dim))``, which for dim 0 neither copies nor waits.
    """
    return _reduce_scatter(t.contiguous(), "sum", 0, (mesh, mesh_dim))


def wait(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor of a started collective, once it has arrived (``t`` itself if plain).

    Upstream: ``AsyncCollectiveTensor.wait``.
    """
    return _waited(t)


def all_reduce(t: torch.Tensor, op: str, mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
    """Reduce ``t`` (``"sum"``, ``"max"``, ...) over the ranks along ``mesh_dim``, waited.

    Upstream: ``_functional_collectives.all_reduce``.
    """
    return _waited(_funcol.all_reduce(t.contiguous(), op, (mesh, mesh_dim)))


def all_to_all(
    t: torch.Tensor,
    output_split_sizes: list[int],
    input_split_sizes: list[int],
    mesh: DeviceMesh,
    mesh_dim: int,
) -> torch.Tensor:
    """Exchange pieces of ``t`` with the ranks along ``mesh_dim``, waited.

    Piece ``r`` of ``t`` (``input_split_sizes[r]`` entries along dim 0) goes to the rank at
    coordinate ``r``; the result holds, along dim 0 and in coordinate order, the pieces
    received (``output_split_sizes[r]`` entries from coordinate ``r``). Sizes may differ and
    may be zero.

    Upstream: ``_functional_collectives.all_to_all_single(t, output_split_sizes,
    input_split_sizes, (mesh, mesh_dim))``. Relied on: CommDebugMode counts it; the result
    is a plain tensor after ``wait``; gloo and NCCL accept uneven and empty pieces.
    """
    out = _funcol.all_to_all_single(
        t.contiguous(), list(output_split_sizes), list(input_split_sizes), (mesh, mesh_dim)
    )
    return _waited(out)


# -- autograd engine -------------------------------------------------------------------------


def at_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the backward pass now running has finished.

    Upstream: ``torch.autograd.Variable._execution_engine.queue_callback``, as DDP's
    reducer and FSDP2's root use it. Relied on: called from a hook while the engine runs
    a backward, the callback runs after every node of that backward, nested backwards
    included. A callback queued inside a reentrant checkpoint's nested backward runs when
    that nested backward ends, so callers queue from a hook of the outer graph.
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)


# -- CommDebugMode ---------------------------------------------------------------------------


@contextlib.contextmanager
def comm_counter() -> Iterator[Any]:
    """A ``CommDebugMode`` that counts collectives without hooking every module's backward.

    Upstream: ``CommDebugMode.advanced_module_tracker`` (a ``_CommModeModuleTracker``)
    registers, on enter, a global full backward pre-hook (``_bw_handle``) that only names
    the module a backward collective ran in. A full backward hook wraps each module's
    outputs in one autograd function, which hands a plain zero tensor as the gradient of
    an output the loss does not use; a ShardTensor output (Boltz-2's trunk returns a
    single ``s`` the distogram never reads) then fails in ``ShardTensor``'s backward.
    Relied on: removing that handle leaves the counts (``get_comm_counts``) as they are.
    The tracker then warns that its module hierarchy may be off; it is not read here.
    """
    import warnings

    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as mode, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The module hierarchy tracking")
        mode.advanced_module_tracker._bw_handle.remove()
        yield mode


# -- torch.distributed.checkpoint metadata ---------------------------------------------------


def checkpoint_metadata_globals() -> dict[tuple[str, str], Any]:
    """The globals a DCP ``.metadata`` file written by ``FileSystemWriter`` refers to.

    Upstream: ``FileSystemWriter.finish`` pickles a ``Metadata`` whose ``storage_data``
    values are ``torch.distributed.checkpoint.filesystem._StorageInfo``, and each tensor's
    ``TensorProperties`` pickles its layout through ``torch.serialization._get_layout`` and
    its memory format through ``TensorProperties``' ``_MEM_FORMAT_ENCODING`` enum (dtypes
    pickle as ``torch.<name>``, sizes as ``torch.Size``). Relied on: these are the only
    globals of such a file, and calling them builds plain records (no side effect), so an
    unpickler that resolves only them reads the metadata and refuses anything else.

    Returns
    -------
    dict[tuple[str, str], Any]
        ``(module, name)`` -> the object it names; dtypes are added by the reader.
    """
    from torch.distributed.checkpoint import filesystem, metadata
    from torch.serialization import _get_layout

    found: dict[tuple[str, str], Any] = {
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): _get_layout,
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): filesystem._StorageInfo,
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): (
            metadata._MEM_FORMAT_ENCODING
        ),
    }
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "ChunkStorageMetadata",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
    ):
        found[("torch.distributed.checkpoint.metadata", name)] = getattr(metadata, name)
    return found


def checkpoint_storage_info_type() -> type:
    """The class of the values of a DCP ``Metadata.storage_data`` written to files.

    Upstream: ``torch.distributed.checkpoint.filesystem._StorageInfo``, a dataclass with
    ``relative_path`` (the shard file, relative to the checkpoint directory), ``offset`` and
    ``length`` (the bytes of one ``torch.save`` record in it) and ``transform_descriptors``
    (stream transforms, ``None`` or empty when none were used). Relied on:
    ``FileSystemReader.read_data`` reads exactly those bytes of that file for each entry.
    """
    from torch.distributed.checkpoint import filesystem

    return filesystem._StorageInfo


def replace_reader_file_system(reader: Any, file_system: Any) -> None:
    """Make a ``FileSystemReader`` open its shard files through ``file_system``.

    Upstream: ``FileSystemReader.fs``, a ``torch.distributed.checkpoint.filesystem.
    FileSystem``. Relied on: ``read_data`` opens every shard file as
    ``reader.fs.create_stream(reader.fs.concat_path(reader.path, relative_path), "rb")``
    (and ``read_metadata`` opens ``.metadata`` the same way), so a ``FileSystem`` subclass
    set here decides which files may be opened, and how.
    """
    reader.fs = file_system


__all__ = [
    "UPSTREAM_FALLBACKS",
    "at_end_of_backward",
    "checkpoint_metadata_globals",
    "checkpoint_storage_info_type",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "conversion_active",
    "conversion_scope",
    "function_handlers_removed",
    "global_shape",
    "is_tracing",
    "local_tensor",
    "observed_upstream_fallbacks",
    "plain_function_call",
    "profiled_cpu_allocations",
    "reduce_scatter",
    "registered_function_handler",
    "replace_reader_file_system",
    "sharding_shapes",
    "torch_function_fallback",
]


# -- torch.profiler -------------------------------------------------------------------------


def profiled_cpu_allocations(profiler: torch.profiler.profile) -> list[tuple[int, int, int]]:
    """``(time ns, bytes, address)`` of every CPU allocator event a finished profile holds.

    Upstream: ``profiler.profiler.kineto_results.experimental_event_tree()`` and the
    ``torch._C._profiler._EventType.Allocation`` nodes in it, whose ``extra_fields`` carry
    ``ptr``, ``alloc_size`` (negative for a free) and ``device``. Relied on: with
    ``profile_memory=True`` every allocation and free of the profiled thread is a node,
    with the address of the block. The public events (``kineto_results.events()``)
    have the sizes but not the addresses.
    """
    allocation = torch._C._profiler._EventType.Allocation
    found: list[tuple[int, int, int]] = []
    nodes = list(profiler.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        fields = node.extra_fields
        if node.tag == allocation and fields.device.type == "cpu":
            found.append((int(node.start_time_ns), int(fields.alloc_size), int(fields.ptr)))
        nodes.extend(node.children)
    return sorted(found)


# -- PyTorch Lightning -----------------------------------------------------------------------


def lightning_forward_redirection(strategy: Any) -> Callable[..., Any]:
    """The strategy's callable that runs a LightningModule method through a wrapper.

    Upstream: ``pytorch_lightning.strategies.Strategy._forward_redirection``, called as
    ``(wrapper_module, lightning_module, method_name, *args, **kwargs)``. Relied on: it
    patches the module's ``forward`` for one call of ``wrapper_module(...)``, so the
    wrapper's forward hooks (DDP's, FSDP2's) run around ``lightning_module.method_name``,
    and returns that method's result.
    """
    return strategy._forward_redirection
