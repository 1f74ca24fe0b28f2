"""Scatter one sample's features from its domain group's source rank as ShardTensors, and back.

Protocol of :func:`scatter_features` (per sample, per domain group):

1. The source rank validates the sample and plans its layout (:class:`ShardingPlan`,
   :func:`physicsnemo_foldcp.sharding.prepare.prepare_sample`), computing balanced row
   blocks there when the options ask for them; the other ranks do nothing.
2. ONE object all-gather over the domain group: the source contributes the metadata (plan,
   per-feature dtype and shapes, non-tensor values) or the error it hit; every rank
   contributes its registry fingerprint (and the error of its own options, if any). Every
   rank then decides the same thing: go on, or raise the source's error / a rank's
   options error / a registry mismatch.
3. The source packs each rank's blocks of all features into one byte buffer, copied
   straight from the serial tensors (:func:`physicsnemo_foldcp.sharding.wire.pack_rank`), and
   sends it point-to-point; on the CPU each buffer leaves as soon as it is packed, while
   the next one is packed. Each rank receives only its own buffer, whose size it knows
   from the metadata. Features are iterated in sorted key order everywhere. A dense map
   of exact 0s and 1s travels as the column of each local row's 1 (8 bytes per row
   instead of a row of the map) and is expanded on arrival.
4. Every rank wraps its blocks as the plugin's ShardTensors
   (:class:`~physicsnemo_foldcp.ops.FoldTensor`, ``ShardTensor.from_local`` with explicit
   sharding shapes; no further communication) and tags the atom<->token maps.

``ShardingOptions(method="scatter_tensor")`` replaces step 3 by PhysicsNeMo's
``scatter_tensor`` per feature (broadcast of the whole tensor, then a local
``torch.chunk``), where its chunking agrees with the plan; it is the baseline the
benchmarks compare against.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from physicsnemo.distributed.utils import compute_split_shapes
from physicsnemo.domain_parallel import ShardTensor, scatter_tensor

from physicsnemo_foldcp.core.tensor import wrap
from physicsnemo_foldcp.distributed.errors import ErrorPayload
from physicsnemo_foldcp.distributed.mesh import FoldMesh
from physicsnemo_foldcp.features.registry import FeatureRegistry
from physicsnemo_foldcp.features.spec import PASSTHROUGH
from physicsnemo_foldcp.sharding.map_tags import tag_maps
from physicsnemo_foldcp.sharding.maps import index_map_to_dense
from physicsnemo_foldcp.sharding.options import METHODS, ShardingOptions, options_or_defaults
from physicsnemo_foldcp.sharding.packing import packed_size, unpack
from physicsnemo_foldcp.sharding.plan import ShardingPlan, sharding_shapes
from physicsnemo_foldcp.sharding.prepare import prepare_sample
from physicsnemo_foldcp.sharding.validation import FeatureValidationError
from physicsnemo_foldcp.sharding.wire import (
    FeatureMeta,
    PreparedSample,
    WireLayout,
    expand_wire_blocks,
    pack_rank,
    wire_layout,
)


class RegistryMismatchError(RuntimeError):
    """The ranks of one domain group hold different feature registries."""


@dataclass(frozen=True)
class ScatterMeta:
    """Everything a rank needs, besides its bytes, to rebuild its features.

    Attributes
    ----------
    plan : ShardingPlan
        Blocks per rank.
    features : tuple[FeatureMeta, ...]
        Tensor features, sorted by name.
    values : dict[str, Any]
        Non-tensor entries of the sample, passed through.
    batched : bool
        Whether the sample's tensors had a leading batch axis of 1 (kept in the output).
    fingerprint : str
        Fingerprint of the source rank's registry.
    """

    plan: ShardingPlan
    features: tuple[FeatureMeta, ...]
    values: dict[str, Any]
    batched: bool
    fingerprint: str


@dataclass
class ScatterStats:
    """What one scatter moved and how long it took, on this rank.

    Attributes
    ----------
    bytes_received : int
        Tensor bytes that arrived at this rank (0 on the source for ``p2p``).
    bytes_sent : int
        Tensor bytes this rank sent.
    local_bytes : int
        Bytes of this rank's own local blocks (what it must hold at least).
    messages_received : int
        Tensor messages that arrived at this rank.
    seconds : float
        Wall time of the scatter on this rank.
    """

    bytes_received: int = 0
    bytes_sent: int = 0
    local_bytes: int = 0
    messages_received: int = 0
    seconds: float = 0.0


class ShardedFeatures(dict):
    """A sample's features on this rank: name -> ShardTensor (or passed-through value).

    A plain ``dict`` (so ``model(**features)`` works) with the scatter's context attached.

    Attributes
    ----------
    plan : ShardingPlan
        Blocks per rank.
    meta : ScatterMeta
        Metadata received from the source.
    registry : FeatureRegistry
        The registry used.
    mesh : FoldMesh
        The mesh the features live on.
    stats : ScatterStats
        Bytes and time of the scatter on this rank.
    """

    plan: ShardingPlan
    meta: ScatterMeta
    registry: FeatureRegistry
    mesh: FoldMesh
    stats: ScatterStats


def _exchange_metadata(
    mesh: FoldMesh, payload: ScatterMeta | ErrorPayload | None, registry: FeatureRegistry
) -> ScatterMeta:
    """Step 2 of the protocol: one all-gather; raise the same error on every rank if needed."""
    mine = (payload, registry.fingerprint, registry.name)
    gathered: list[Any] = [None] * mesh.domain_size
    dist.all_gather_object(gathered, mine, group=mesh.object_group)
    source_payload = gathered[0][0]
    if isinstance(source_payload, ErrorPayload):
        raise source_payload.to_exception(
            f"scatter_features failed on the source rank {mesh.domain_source_rank} of domain "
            f"group {mesh.ddp_rank}"
        )
    for r, (peer_payload, _, _) in enumerate(gathered[1:], start=1):
        if isinstance(peer_payload, ErrorPayload):
            rank = mesh.domain_global_rank(r // mesh.cp[1], r % mesh.cp[1])
            raise peer_payload.to_exception(
                f"scatter_features failed on rank {rank} of domain group {mesh.ddp_rank}"
            )
    prints = {(fp, name) for _, fp, name in gathered}
    if len(prints) > 1:
        listing = ", ".join(
            f"rank {mesh.domain_global_rank(r // mesh.cp[1], r % mesh.cp[1])}: {name} {fp}"
            for r, (_, fp, name) in enumerate(gathered)
        )
        raise RegistryMismatchError(
            "the ranks of domain group "
            f"{mesh.ddp_rank} use different feature registries ({listing}); every rank must "
            "build the same registry (same preset and the same extra features)"
        )
    assert isinstance(source_payload, ScatterMeta)
    return source_payload


def _local_layout(
    meta: ScatterMeta, registry: FeatureRegistry, coord: tuple[int, int]
) -> WireLayout:
    return wire_layout(meta.features, registry, meta.plan, coord)


def _local_blocks(
    buffer: torch.Tensor, meta: ScatterMeta, registry: FeatureRegistry, coord: tuple[int, int]
) -> list[torch.Tensor]:
    views = unpack(buffer, _local_layout(meta, registry, coord))
    return expand_wire_blocks(views, meta.features, registry, meta.plan, coord)


def _wait_every_send(sends: list[tuple[Any, int, torch.Tensor]]) -> None:
    """Wait for every send, even after one fails, then raise naming the ranks not reached.

    A peer that fails before it receives must not cost the others their blocks: each
    send is waited on (each wait bounded by the group's timeout) before the first error
    is raised again.

    Parameters
    ----------
    sends : list of (work, peer, buffer)
        The source's pending sends: the backend's work handle, the receiving global rank
        and the buffer (kept alive until its send is done).
    """
    failed: list[tuple[int, RuntimeError]] = []
    for work, peer, _ in sends:
        try:
            work.wait()
        except RuntimeError as err:
            failed.append((peer, err))
    if failed:
        ranks = ", ".join(str(peer) for peer, _ in failed)
        raise RuntimeError(
            f"scatter: the send of the features to global rank(s) {ranks} did not complete "
            f"({failed[0][1]})"
        ) from failed[0][1]


def _p2p_transfer(
    mesh: FoldMesh,
    prepared: PreparedSample | None,
    meta: ScatterMeta,
    registry: FeatureRegistry,
    stats: ScatterStats,
) -> list[torch.Tensor]:
    """Step 3: the source sends each rank its packed blocks; returns this rank's blocks."""
    cp0, cp1 = mesh.cp
    me = mesh.domain_coordinate
    device = mesh.device
    if mesh.is_domain_source:
        assert prepared is not None
        # On the CPU (gloo) every buffer is sent as soon as it is packed, so the peers
        # receive while the next buffer is packed; on accelerators the sends go out as
        # one batch, as the backend's point-to-point batching expects.
        eager = device.type == "cpu"
        sends: list[tuple[Any, int, torch.Tensor]] = []
        ops: list[dist.P2POp] = []
        for i in range(cp0):
            for j in range(cp1):
                if (i, j) == me:
                    continue
                buffer = pack_rank(prepared, (i, j), device)
                if not buffer.numel():
                    continue
                peer = mesh.domain_global_rank(i, j)
                stats.bytes_sent += buffer.numel()
                if eager:
                    work = dist.isend(buffer, peer, group=mesh.domain_group)
                    sends.append((work, peer, buffer))
                else:
                    ops.append(dist.P2POp(dist.isend, buffer, peer, mesh.domain_group))
        own = pack_rank(prepared, me, device)
        for work in dist.batch_isend_irecv(ops) if ops else ():
            work.wait()
        _wait_every_send(sends)
        return _local_blocks(own, meta, registry, me)
    layout = _local_layout(meta, registry, me)
    buffer = torch.empty(packed_size(layout), dtype=torch.uint8, device=device)
    if buffer.numel():
        op = dist.P2POp(dist.irecv, buffer, mesh.domain_source_rank, mesh.domain_group)
        for work in dist.batch_isend_irecv([op]):
            work.wait()
        stats.bytes_received += buffer.numel()
        stats.messages_received += 1
    return _local_blocks(buffer, meta, registry, me)


def _check_chunking_agrees(meta: ScatterMeta, registry: FeatureRegistry) -> None:
    """Raise unless ``scatter_tensor``'s chunking gives the plan's blocks for every feature."""
    for f in meta.features:
        spec = registry[f.name]
        for mesh_dim, dim in spec.sharded_axes.items():
            n, parts = f.padded_shape[dim], meta.plan.cp[mesh_dim]
            planned = meta.plan.sizes(spec.axes[dim], mesh_dim)
            chunked = [len(c) for c in torch.arange(n).chunk(parts)]
            chunked += [0] * (parts - len(chunked))
            specced = list(compute_split_shapes(n, parts))
            if not (planned == chunked == specced):
                raise ValueError(
                    f"method='scatter_tensor' cannot place feature {f.name!r}: its "
                    f"{spec.axes[dim]} axis (dim {dim}, length {n}) over mesh dim "
                    f"{('cp0', 'cp1')[mesh_dim]}={parts} is cut {chunked} by torch.chunk and "
                    f"{specced} by PhysicsNeMo's spec, but the plan needs {planned}; use the "
                    "default method='p2p'"
                )


def _scatter_tensor_transfer(
    mesh: FoldMesh,
    prepared: PreparedSample | None,
    meta: ScatterMeta,
    registry: FeatureRegistry,
    stats: ScatterStats,
) -> dict[str, Any]:
    """Step 3 through PhysicsNeMo's ``scatter_tensor`` (broadcast, then chunk locally)."""
    _check_chunking_agrees(meta, registry)
    out: dict[str, Any] = {}
    prefix = (1,) if meta.batched else ()
    for f in meta.features:
        spec = registry[f.name]
        tensor = None
        if mesh.is_domain_source:
            assert prepared is not None
            tensor = prepared.padded[f.name].reshape(prefix + f.padded_shape).to(mesh.device)
        placements = spec.batched_placements(meta.batched)
        st = scatter_tensor(
            tensor,
            mesh.domain_source_rank,
            mesh.domain_mesh,
            placements,
            global_shape=torch.Size(prefix + f.padded_shape),
            dtype=f.dtype,
        )
        if not mesh.is_domain_source:
            stats.bytes_received += _nbytes(prefix + f.padded_shape, f.dtype)
            stats.messages_received += 1
        out[f.name] = st.to_local() if spec.mode == PASSTHROUGH else wrap(st)
    return out


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()


def _source_payload(
    features: Mapping[str, Any] | None,
    mesh: FoldMesh,
    registry: FeatureRegistry,
    options: ShardingOptions | None,
    token_bounds: tuple[int, ...] | None,
    error: BaseException | None,
) -> tuple[PreparedSample | None, ScatterMeta | ErrorPayload | None]:
    """Step 1: this rank's contribution to the metadata exchange (and the source's sample).

    The source validates and plans the sample, or reports ``error`` (the caller's, or
    that of its options); another rank contributes nothing, or its options' error.
    """
    if not mesh.is_domain_source:
        return None, ErrorPayload.capture(error, mesh.rank) if options is None else None
    if error is not None:
        return None, ErrorPayload.capture(error, mesh.rank)
    try:
        prepared = prepare_sample(
            features, registry, mesh.cp, options=options, token_bounds=token_bounds
        )
        payload = ScatterMeta(
            prepared.plan,
            tuple(prepared.metas),
            prepared.values,
            prepared.batched,
            registry.fingerprint,
        )
    except Exception as failure:  # noqa: BLE001 - sent to every rank, then raised
        return None, ErrorPayload.capture(failure, mesh.rank)
    return prepared, payload


def scatter_features(
    features: Mapping[str, Any] | None,
    mesh: FoldMesh,
    *,
    registry: FeatureRegistry | None = None,
    options: ShardingOptions | None = None,
    token_bounds: tuple[int, ...] | None = None,
    error: BaseException | None = None,
) -> ShardedFeatures:
    """Shard one sample over this rank's domain group; every rank gets ShardTensors.

    Call on EVERY rank of the domain group; only the source rank
    (``mesh.is_domain_source``) needs the sample, the others pass ``None`` (what they pass
    is ignored).

    Parameters
    ----------
    features : Mapping[str, Any] or None
        The serial sample on the source rank: name -> tensor, unbatched or with a leading
        batch axis of 1 (Boltz's collate output), plus any non-tensor values (passed
        through to every rank unchanged).
    mesh : FoldMesh
        From :func:`physicsnemo_foldcp.init_mesh`.
    registry : FeatureRegistry, optional
        Axis meanings of the features; the Boltz-2 preset by default. Every rank must
        hold an equal registry (checked by fingerprint).
    options : ShardingOptions, optional
        How the sample is laid out and sent (the defaults when omitted; every field is
        described in :class:`~physicsnemo_foldcp.sharding.options.ShardingOptions`):
        per-shard padding multiples, ``align_lengths``, ``balance`` (with
        ``mode="balanced"`` the source rank computes this sample's balanced row blocks,
        :func:`~physicsnemo_foldcp.sharding.balance.balanced_token_bounds`), ``map_layout``
        (``"dense"``: Boltz's maps, a rank holds ``A_i x N`` elements of ``atom_to_token``;
        ``"index"``: an int64 vector of global padded-layout positions under the same key,
        ``A_i`` elements; ``gather_features`` returns dense maps either way) and
        ``method`` (``"p2p"``: each rank receives only its own blocks, in one message;
        ``"scatter_tensor"``: PhysicsNeMo's broadcast-then-chunk, where its chunking
        agrees with the plan).
    token_bounds : tuple[int, ...], optional
        Explicit ``cp0 + 1`` row-block token boundaries (source rank); they win over
        ``options.balance``. The default splits evenly.
    error : BaseException, optional
        On the source rank: an exception hit before the scatter (e.g. in the serial fetch).
        Instead of scattering, it is raised on every rank of the domain group, with its
        type, message and traceback; ignored on the other ranks.

    Returns
    -------
    ShardedFeatures
        Name -> ``ShardTensor`` at the registry's placements over ``mesh.domain_mesh``
        (the one-hot maps tagged, see :func:`physicsnemo_foldcp.ops.tag_maps`)
        (``passthrough`` features as plain tensors, non-tensor values as given), with the
        plan, metadata and transfer statistics attached. Dtypes are preserved; a leading
        batch axis of 1 is kept.

    Raises
    ------
    FeatureValidationError, UnknownFeatureError
        On every rank of the domain group, when the source's sample is invalid.
    TypeError
        On every rank, when a rank's ``options`` is not a ``ShardingOptions`` (or
        ``None``); an unknown keyword (the option fields are not keywords) is Python's
        own ``TypeError``, raised where the call is made.
    RegistryMismatchError
        On every rank, when the ranks' registries differ.
    """
    registry = registry if registry is not None else FeatureRegistry.preset("boltz2")
    stats = ScatterStats()
    start = time.perf_counter()
    options_error: BaseException | None = None
    try:
        options = options_or_defaults(options, "scatter_features")
    except TypeError as err:
        options, options_error = None, err
    if options_error is not None and not (mesh.is_domain_source and error is not None):
        error = options_error
    prepared, payload = _source_payload(features, mesh, registry, options, token_bounds, error)
    meta = _exchange_metadata(mesh, payload, registry)
    assert options is not None  # a rank's options error was raised on every rank

    out = ShardedFeatures()
    coord = mesh.domain_coordinate
    prefix = (1,) if meta.batched else ()
    if options.method == "scatter_tensor":
        out.update(_scatter_tensor_transfer(mesh, prepared, meta, registry, stats))
    else:
        blocks = _p2p_transfer(mesh, prepared, meta, registry, stats)
        for f, block in zip(meta.features, blocks):
            spec = registry[f.name]
            block = block.reshape(prefix + tuple(block.shape))
            if spec.mode == PASSTHROUGH:
                out[f.name] = block
                continue
            out[f.name] = wrap(
                block,
                mesh.domain_mesh,
                spec.batched_placements(meta.batched),
                sharding_shapes(spec, f.padded_shape, meta.plan, coord, meta.batched),
            )
    for f in meta.features:
        value = out[f.name]
        local = value.to_local() if isinstance(value, ShardTensor) else value
        stats.local_bytes += local.numel() * local.element_size()
    out.update(meta.values)
    out.plan, out.meta, out.registry, out.mesh = meta.plan, meta, registry, mesh
    # Tag the atom<->token maps so Boltz's bmm forms on them run on local blocks; the
    # source validated the maps, so they are tagged checked without another look.
    tag_maps(out, validated=True)
    stats.seconds = time.perf_counter() - start
    out.stats = stats
    return out


def gather_features(sharded: ShardedFeatures) -> dict[str, Any]:
    """Reassemble the serial sample on every rank (undo padding, map indices back).

    Collective over the domain group (one all-gather per sharded feature, through
    ``full_tensor()``).

    Parameters
    ----------
    sharded : ShardedFeatures
        The output of :func:`scatter_features`.

    Returns
    -------
    dict[str, Any]
        Plain tensors in the serial layout (with the batch axis if the input had one),
        and the non-tensor values, equal to what the source rank passed in.
    """
    if not isinstance(sharded, ShardedFeatures):
        raise TypeError(
            f"gather_features takes the ShardedFeatures of scatter_features, got "
            f"{type(sharded).__name__}"
        )
    meta, plan, registry = sharded.meta, sharded.plan, sharded.registry
    out: dict[str, Any] = {}
    for f in meta.features:
        spec = registry[f.name]
        value = sharded[f.name]
        full = value.full_tensor() if isinstance(value, ShardTensor) else value
        full = full[0] if meta.batched else full
        if f.compact_of is not None:
            full = index_map_to_dense(full, plan.padded_length(spec.axes[1]), f.compact_of)
        if spec.mode != PASSTHROUGH:
            full = plan.from_padded(full, spec.axes)
        if spec.index_axis is not None:
            full = plan.unmap_index_values(full, spec.index_axis)
        for dim, length in enumerate(f.serial_shape):
            if full.shape[dim] != length:
                full = full.narrow(dim, 0, length)
        out[f.name] = full.unsqueeze(0) if meta.batched else full
    out.update(meta.values)
    return out


__all__ = [
    "METHODS",
    "FeatureValidationError",
    "RegistryMismatchError",
    "ScatterMeta",
    "ScatterStats",
    "ShardedFeatures",
    "gather_features",
    "scatter_features",
]
