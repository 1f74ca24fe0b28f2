"""Benchmark 4: Boltz's PairformerModule under CP: peak memory, bytes per op, time per layer.

    torchrun --standalone --nproc-per-node 1 benchmarks/bench_pairformer.py --tokens 128 256 384
    torchrun --standalone --nproc-per-node 4 benchmarks/bench_pairformer.py --tokens 128 256 384
    torchrun --standalone --nproc-per-node 6 benchmarks/bench_pairformer.py --cp 2 3 \
        --tokens 128 256 384
    torchrun --standalone --nproc-per-node 9 benchmarks/bench_pairformer.py --tokens 128 256 384

One launch per mesh (``--cp``, by default the square mesh of the world size: 1x1, 2x2,
3x3). For each ``N``, Boltz's own ``PairformerModule`` (``boltz.model.layers.pairformer``,
unmodified, built after seeding torch and NumPy so every rank holds the same weights, with
``--init-noise`` added so that no sub-module's zero-initialised last projection hides it
from the loss, train mode so dropout is on) runs forward and
backward on random ``s [1, N, token_s]`` and ``z [1, N, N, token_z]`` (both requiring
grad, as a trunk layer's inputs do), with ``--padded`` masked tokens at the end; the inputs
are laid out as the scatter lays out features
(:class:`~physicsnemo_foldcp.testing.layouts.TokenLayout`: ``s`` row-sharded, ``z`` the
``(cp0, cp1)`` pair tile, uneven blocks as they fall) after
:func:`physicsnemo_foldcp.boltz.install`. The loss is
``masked_mean(z.pow(2).mean(-1), pair_mask) + masked_mean(s.pow(2).mean(-1), mask)``; the
dropout draws are seeded the same before every forward, so every step is the same step.

Measured per launch and ``N`` (every figure the same on every rank):

* **loss** of the first step beside the serial module's loss on the same inputs, weights
  and dropout draws (computed on the domain source rank, forward only;
  ``--no-serial-check`` skips it);
* **bytes moved per layer per op**: the collectives of the first step, recorded by a
  :class:`~benchmarks.bench_ops.CollectiveBytes` (``CommDebugMode`` with bytes: the larger
  of each collective's input and output), each attributed to the Pairformer layer and the
  op that issued it: ``tri_mul_out``, ``tri_mul_in``, ``tri_att_start``, ``tri_att_end``,
  ``attention`` (the single track's pair-biased attention), ``transitions``
  (``transition_z`` and ``transition_s``) and ``other`` (the rest of the layer: norms,
  dropout, residuals); collectives outside the layers (the loss) are listed apart. Forward:
  forward pre- and post-hooks of each layer's children switch the label. Backward
  (:class:`~benchmarks.op_scopes.OpScopes`): a pre-hook on the node that made a child's
  output (its backward starts) and a hook on the gradient of its input (its backward is
  done) switch it, following the autograd engine's order. Per op: bytes of the largest
  rank, averaged over the layers;
* **bytes copied per step per op**: in the same first step, the bytes written by ops that
  only move data (:class:`~physicsnemo_foldcp.testing.copies.CopyBytes`), per op as the
  collectives are, largest rank; beside one serial step's;
* **gathers the plugin reported** (:func:`physicsnemo_foldcp.core.events.observe`, kind
  ``fallback``: an op that could not stay on the local blocks), with their op names and the
  layer op they came from; ideally none;
* **time per layer**: median over ``--repeats`` steps of the largest wall time over the
  ranks of the forward and of the backward, each between a barrier and a device
  synchronisation (:func:`benchmarks.common.time_collective`), divided by the number of
  layers (after the counting step and the memory step, both untimed);
* **step time against serial Boltz**: on the domain source rank, before the distributed
  steps (the other ranks wait), the serial module on the whole plain tensors: one warm-up
  step, then ``--repeats`` forward + backward steps (:func:`serial_step_times`);
  **step: this / serial Boltz** is the median fwd + bwd time per layer of this mesh over
  the serial module's, both from this launch; on CPU the serial module gets every core
  the process may use (torchrun gives each of several ranks one thread: together they
  use the machine, and so does the serial run). Targets (N = 256, the issue's):
  <= 1.1 on 1x1, <= 1.0 on 2x2 (``--no-serial-time`` skips it);
* **work budget and pieces**: ``--work-budget`` MiB per kernel piece and rank
  (:mod:`physicsnemo_foldcp.kernels.budget`, default the package's), and the key
  sub-chunks and panels the kernels chose in the timed steps, every rank's;
* **time per layer per op**: one more step with the labels of the byte count switching
  on the same hooks (:class:`~benchmarks.op_scopes.OpScopes`); the wall time between two
  switches goes to the label that was on (on CUDA the device is synchronised at each
  switch), so waits for peers count where they happen. Per op: milliseconds of the
  slowest rank, averaged over the layers; the hooks themselves add a little time;
* **memory per rank**: *held* is the tensor bytes a rank keeps before the step (its blocks
  of ``s``, ``z`` and the masks, and the parameters; no gradients: they are set to
  ``None`` first; CUDA: ``torch.cuda.memory_allocated``), *step peak* the peak of tensor
  bytes allocated during one forward + backward above that
  (:class:`benchmarks.common.PeakMemory`), *peak* = held + step peak, the largest over the
  ranks; **peak: this / 1x1** divides it by the 1x1 row's of the same ``N`` and sizes.
  Targets at the largest ``N``: <= 0.30 on 2x2 and <= 0.15 on 3x3.

Boltz's triangle multiplications, triangle attentions and attention run the distributed
forwards :func:`physicsnemo_foldcp.boltz.install` registers; everything else runs op by op
on local blocks.

Each launch merges its rows into ``results/summary.json`` (section ``pairformer``, key
mesh and N) and rewrites ``results/pairformer.md`` and ``results/pairformer.png`` from
every mesh's rows there.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from physicsnemo.domain_parallel import ShardTensor
from torch import nn

try:
    from benchmarks import common
    from benchmarks.bench_ops import CollectiveBytes, group_labels
    from benchmarks.op_scopes import CATEGORIES, OUTSIDE, OpScopes, Scope, by_category
except ModuleNotFoundError:  # run as a script: the repository root is not on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import common
    from benchmarks.bench_ops import CollectiveBytes, group_labels
    from benchmarks.op_scopes import CATEGORIES, OUTSIDE, OpScopes, Scope, by_category

import physicsnemo_foldcp as fc
import physicsnemo_foldcp.boltz as fc_boltz
from physicsnemo_foldcp.core import compat, events
from physicsnemo_foldcp.distributed.mesh import FoldMesh
from physicsnemo_foldcp.features.spec import FeatureSpec
from physicsnemo_foldcp.kernels.budget import recorded_pieces, set_work_budget, work_budget_mib
from physicsnemo_foldcp.ops import masked_mean, wrap
from physicsnemo_foldcp.testing.copies import CopyBytes
from physicsnemo_foldcp.testing.layouts import TokenLayout
from physicsnemo_foldcp.training.loop import loss_value, set_precision

BENCHMARK = "pairformer"
"""Section of ``results/summary.json`` holding every mesh's rows."""

TARGETS = {"2x2": 0.30, "3x3": 0.15}
"""Largest ``peak: this / 1x1`` at the largest N, per mesh (the issue's targets)."""


PAIR = ("tokens", "tokens", None)


@dataclass(frozen=True)
class PairformerSizes:
    """``PairformerModule`` arguments (defaults small enough for a CPU)."""

    token_s: int = 64
    token_z: int = 32
    num_blocks: int = 2
    num_heads: int = 4
    pairwise_head_width: int = 16
    pairwise_num_heads: int = 4
    dropout: float = 0.25

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict (the ``PairformerModule`` keyword arguments)."""
        return dataclasses.asdict(self)


def build_module(sizes: PairformerSizes, seed: int, init_noise: float = 0.0) -> nn.Module:
    """Boltz's ``PairformerModule`` with parameters drawn from ``seed``, in train mode.

    Boltz's initialisers draw from torch's and from NumPy's global generators (SciPy's
    ``truncnorm`` for the LeCun and He initialisations), so both are seeded: the same
    weights on every rank and in the serial reference.
    Boltz initialises the last projection of every sub-module (triangle updates, triangle
    attentions, transitions, attention) to zero, so at its own initialisation the module
    returns its inputs and a loss comparison checks only the residual path.
    ``init_noise > 0`` adds ``init_noise * N(0, 1)`` (seeded) to every parameter, so
    every sub-module contributes to the outputs.
    """
    from boltz.model.layers.pairformer import PairformerModule

    torch.manual_seed(seed)
    np.random.seed(seed)
    module = PairformerModule(**sizes.to_dict())
    if init_noise > 0:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in module.parameters():
                p.add_(init_noise * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return module.train()


def pair_inputs(
    n_tokens: int, sizes: PairformerSizes, seed: int, padded: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Serial ``s [1, N, token_s]``, ``z [1, N, N, token_z]``, ``mask [1, N]``, ``pair_mask``.

    The last ``padded`` tokens are masked out (at least one token stays).
    """
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(1, n_tokens, sizes.token_s, generator=g)
    z = torch.randn(1, n_tokens, n_tokens, sizes.token_z, generator=g)
    mask = torch.ones(1, n_tokens)
    padded = min(max(padded, 0), n_tokens - 1)
    if padded:
        mask[:, n_tokens - padded :] = 0
    return s, z, mask, mask[:, :, None] * mask[:, None, :]


def pair_loss(
    s: torch.Tensor, z: torch.Tensor, mask: torch.Tensor, pair_mask: torch.Tensor
) -> torch.Tensor:
    """Masked mean squares of the outputs: the scalar that the backward starts from."""
    return masked_mean(z.pow(2).mean(-1), pair_mask) + masked_mean(s.pow(2).mean(-1), mask)


def serial_step_times(
    module: nn.Module,
    inputs: Sequence[torch.Tensor],
    dropout_seed: int,
    device: torch.device,
    repeats: int,
) -> tuple[list[float], list[float], dict[str, dict[str, float]]]:
    """Seconds of the serial module's forward and backward on the whole inputs, per step.

    Boltz's own module on plain tensors (no plugin tensor, so none of the plugin's
    handlers), the same loss and dropout draws as the distributed steps; one untimed
    warm-up step, then ``repeats`` steps, each phase between two device synchronisations.
    On CPU the serial module runs with every core (:func:`benchmarks.common.whole_machine`).
    One more step runs with :class:`~benchmarks.op_scopes.OpScopes` as a clock: the third result is
    ``{"fwd": {op: seconds}, "bwd": {...}}``, summed over the layers, as the distributed
    breakdown step gives it, and ``"copy_bytes"``: the bytes one more step's data-moving ops
    write (:class:`~physicsnemo_foldcp.testing.copies.CopyBytes`).
    """
    whole = [t.to(device) for t in inputs]
    fwd, bwd = [], []
    with common.whole_machine(device):
        _serial_step(module, whole, dropout_seed, device)  # warm-up
        for _ in range(repeats):
            forward, backward, _ = _serial_step(module, whole, dropout_seed, device)
            fwd.append(forward)
            bwd.append(backward)
        timer = OpScopes(module, device)
        with timer.attached():
            timer.take_seconds()
            *_, by_op = _serial_step(module, whole, dropout_seed, device, timer)
        with CopyBytes() as copies:
            _serial_step(module, whole, dropout_seed, device)
    module.zero_grad(set_to_none=True)
    by_op["copy_bytes"] = copies.total
    return fwd, bwd, by_op


def _serial_step(
    module: nn.Module,
    inputs: Sequence[torch.Tensor],
    dropout_seed: int,
    device: torch.device,
    timer: OpScopes | None = None,
) -> tuple[float, float, dict[str, dict[str, float]]]:
    """Seconds of one serial forward and of its backward, and by op (with ``timer``, its
    hooks attached: ``{"fwd": {op: seconds}, "bwd": {...}}``; empty without)."""
    s, z, mask, pair_mask = inputs
    module.zero_grad(set_to_none=True)
    s_leaf, z_leaf = s.clone().requires_grad_(True), z.clone().requires_grad_(True)
    by_op: dict[str, dict[str, float]] = {}
    common.synchronize(device)
    start = time.perf_counter()
    torch.manual_seed(dropout_seed)
    s_out, z_out = module(s_leaf, z_leaf, mask, pair_mask)
    loss = pair_loss(s_out, z_out, mask, pair_mask)
    if timer is not None:
        timer.current = (None, OUTSIDE)
        by_op["fwd"] = by_category(timer.take_seconds())
    common.synchronize(device)
    middle = time.perf_counter()
    loss.backward()
    common.synchronize(device)
    if timer is not None:
        timer.current = (None, OUTSIDE)
        by_op["bwd"] = by_category(timer.take_seconds())
    return middle - start, time.perf_counter() - middle, by_op


def serial_loss(
    module: nn.Module,
    inputs: Sequence[torch.Tensor],
    dropout_seed: int,
    device: torch.device,
) -> float:
    """The serial module's loss on the whole inputs (forward only, the same dropout draws)."""
    s, z, mask, pair_mask = (t.to(device) for t in inputs)
    torch.manual_seed(dropout_seed)
    with torch.no_grad():
        s_out, z_out = module(s, z, mask, pair_mask)
        return float(pair_loss(s_out, z_out, mask, pair_mask))


class ScopedCollectiveBytes(CollectiveBytes):
    """:class:`CollectiveBytes` that also records the scope each collective ran in.

    Attributes
    ----------
    scopes : list[Scope]
        ``(layer, category)`` of each entry of ``records``, in order.
    """

    def __init__(self, groups: Mapping[str, str], where: Callable[[], Scope]):
        super().__init__(groups)
        self.where = where
        self.scopes: list[Scope] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = len(self.records)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.scopes.extend([self.where()] * (len(self.records) - before))
        return out

    def by_scope(self) -> dict[str, int]:
        """``{"<layer>:<category>": bytes}``, ``"-:outside"`` for collectives outside layers."""
        out: dict[str, int] = {}
        for (layer, category), (_, _, size) in zip(self.scopes, self.records):
            key = f"{'-' if layer is None else layer}:{category}"
            out[key] = out.get(key, 0) + size
        return out


def rewrapper(
    layout: TokenLayout, shape: Sequence[int], axes: Sequence[str | None]
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``leaf -> FoldTensor``: a local block of serial ``shape``, placed as ``layout.shard`` does.

    ``TokenLayout.shard`` cuts and wraps in one go; a benchmark that runs several steps on
    the same leaves wraps them again for every step.
    """
    spec = FeatureSpec("input", tuple(axes))
    coordinate = layout.mesh.domain_coordinate
    shapes = layout.plan.sharding_shapes(spec, tuple(shape[1:]), coordinate, batched=True)
    placements = spec.batched_placements(True)
    return lambda leaf: wrap(leaf, layout.mesh.domain_mesh, placements, shapes)


def _local(t: torch.Tensor) -> torch.Tensor:
    return compat.local_tensor(t) if isinstance(t, ShardTensor) else t


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def _per_layer(
    ranks: Sequence[Mapping[str, Any]], key: str, num_blocks: int
) -> tuple[dict[str, float], float, dict[str, dict[str, int]]]:
    """Per category KiB per layer (max over ranks, mean over layers), outside KiB, by layer."""
    largest: dict[str, int] = {}
    for r in ranks:
        for scope, size in r[key].items():
            largest[scope] = max(largest.get(scope, 0), size)
    by_layer: dict[str, dict[str, int]] = {}
    for scope, size in largest.items():
        layer, category = scope.split(":")
        by_layer.setdefault(layer, {})[category] = size
    per_op = {
        c: sum(by_layer.get(str(i), {}).get(c, 0) for i in range(num_blocks))
        / max(num_blocks, 1)
        / 1024
        for c in CATEGORIES
    }
    outside = by_layer.get("-", {}).get(OUTSIDE, 0) / 1024
    return per_op, outside, by_layer


def describe_fallbacks(fallbacks: Sequence[Mapping[str, Any]]) -> str:
    """``"Tensor.softmax in tri_att_start over cp1 x4, ..."``, or ``"none"``."""
    if not fallbacks:
        return "none"
    return ", ".join(
        f"{f['op']} in {f['where']} over {f['mesh_dims']} x{f['count']}" for f in fallbacks
    )


def run_pairformer_benchmark(
    mesh: FoldMesh,
    n_tokens: int,
    *,
    sizes: PairformerSizes | None = None,
    repeats: int = 3,
    seed: int = 0,
    padded: int = 3,
    serial_check: bool = True,
    serial_time: bool = True,
    memory: bool = True,
    init_noise: float = 0.1,
) -> dict[str, Any]:
    """Measure Boltz's ``PairformerModule`` forward + backward at one size (every rank).

    Parameters
    ----------
    mesh : FoldMesh
        The mesh (``ddp == 1``).
    n_tokens : int
        Token count N.
    sizes : PairformerSizes, optional
        Module sizes (:class:`PairformerSizes` defaults otherwise).
    repeats : int
        Timed steps (forward and backward each timed).
    seed : int
        Seed of the parameters and inputs; ``seed + 1`` seeds the dropout draws.
    padded : int
        Masked tokens at the end of the sequence.
    serial_check : bool
        Compute the serial module's loss on the domain source rank.
    serial_time : bool
        Time ``repeats`` forward + backward steps of the serial module on the domain source
        rank (:func:`serial_step_times`) while the other ranks wait, in this launch.
    memory : bool
        Run the memory step (profiled on CPU).
    init_noise : float
        Noise added to Boltz's initial parameters (:func:`build_module`); 0 keeps Boltz's
        initialisation, whose zero last projections make the loss comparison vacuous.

    Returns
    -------
    dict
        One row, the same on every rank: ``mesh``, ``N``, ``loss``, ``serial_loss``,
        ``loss_diff``; ``fwd_KiB_<op>`` / ``bwd_KiB_<op>`` per category of
        :data:`CATEGORIES` (per layer), ``fwd_KiB_layer`` / ``bwd_KiB_layer`` (their sums),
        ``fwd_KiB_outside`` / ``bwd_KiB_outside``, ``bytes_by_layer``; ``fallbacks`` (the
        reported gathers) and ``fallback_gathers`` (their count); ``fwd_ms_layer`` /
        ``bwd_ms_layer`` (median) and the timed runs; ``fwd_ms_<op>`` / ``bwd_ms_<op>``
        (the breakdown step, slowest rank, per layer; ``_outside`` per step);
        ``held_MiB`` / ``step_peak_MiB`` / ``peak_MiB`` (max over ranks),
        ``peak_MiB_mean``; ``serial_fwd_ms_layer`` / ``serial_bwd_ms_layer`` /
        ``serial_step_ms_layer`` (the serial module, medians) and ``step_over_serial``;
        ``threads`` (torch's intra-op threads per rank), ``work_budget_MiB`` and
        ``pieces`` (what the kernels chose, every rank's); ``ranks`` (per-rank figures).
    """
    fc_boltz.install()
    sizes = sizes or PairformerSizes()
    cp0, cp1 = mesh.cp
    set_precision("fp32")
    dropout_seed = seed + 1
    module = build_module(sizes, seed, init_noise)
    values = [p.detach().double() for p in module.parameters()]
    weights = float(sum(v.sum() + v.pow(2).sum() for v in values))
    wanted = (serial_check or serial_time) and mesh.is_domain_source
    serial = copy.deepcopy(module) if wanted else None
    module = module.to(mesh.device)
    inputs = pair_inputs(n_tokens, sizes, seed, padded)
    reference = None
    serial_fwd: list[float] = []
    serial_bwd: list[float] = []
    serial_by_op: dict[str, dict[str, float]] = {}
    if serial is not None:
        serial = serial.to(mesh.device)
        if serial_check:
            reference = serial_loss(serial, inputs, dropout_seed, mesh.device)
        if serial_time:
            serial_fwd, serial_bwd, serial_by_op = serial_step_times(
                serial, inputs, dropout_seed, mesh.device, repeats
            )
        del serial
    torch.distributed.barrier()  # the other ranks wait for the serial runs

    layout = TokenLayout(mesh, n_tokens)
    s, z, mask, pair_mask = inputs
    s_leaf = layout.local(s, ("tokens", None)).requires_grad_(True)
    z_leaf = layout.local(z, PAIR).requires_grad_(True)
    m_st, _ = layout.shard(mask, ("tokens",))
    p_st, _ = layout.shard(pair_mask, ("tokens", "tokens"))
    del inputs, s, z, mask, pair_mask

    def fresh() -> None:
        module.zero_grad(set_to_none=True)
        s_leaf.grad = z_leaf.grad = None

    wrap_s = rewrapper(layout, (1, n_tokens, sizes.token_s), ("tokens", None))
    wrap_z = rewrapper(layout, (1, n_tokens, n_tokens, sizes.token_z), PAIR)

    def forward() -> torch.Tensor:
        # The leaves are wrapped again each step: the wrap is a node of the step's graph.
        torch.manual_seed(dropout_seed)
        s_out, z_out = module(wrap_s(s_leaf), wrap_z(z_leaf), m_st, p_st)
        return pair_loss(s_out, z_out, m_st, p_st)

    # Counting step: collectives by scope, reported gathers, the loss.
    scopes = OpScopes(module)
    groups = group_labels(mesh)
    found: dict[tuple[str, str, str, str], int] = {}

    def on_gather(event: events.GatherEvent) -> None:
        if event.kind != events.FALLBACK:
            return
        layer, category = scopes.current
        where = category if layer is None else f"layer {layer} {category}"
        dims = "+".join(f"cp{d}" for d in event.mesh_dims) or "-"
        key = (event.op, where, dims, phase[0])
        found[key] = found.get(key, 0) + 1

    phase = ["forward"]
    fresh()
    with scopes.attached(), events.observe(on_gather):
        try:
            with CopyBytes(where=lambda: scopes.current[1]) as copies:
                with ScopedCollectiveBytes(groups, lambda: scopes.current) as fwd:
                    loss = forward()
                scopes.current = (None, OUTSIDE)
                phase[0] = "backward"
                with ScopedCollectiveBytes(groups, lambda: scopes.current) as bwd:
                    loss.backward()
        except Exception as exc:
            layer, category = scopes.current
            where = category if layer is None else f"layer {layer} {category}"
            raise RuntimeError(
                f"PairformerModule on {cp0}x{cp1}, N = {n_tokens}: the {phase[0]} failed in "
                f"{where} (rank {mesh.rank}): {type(exc).__name__}: {exc}"
            ) from exc
    loss_cp = loss_value(loss.detach())
    del loss

    held = step_peak = None
    if memory:
        fresh()
        if mesh.device.type == "cuda":
            common.synchronize(mesh.device)
            held = int(torch.cuda.memory_allocated(mesh.device))
        else:
            held = _nbytes([s_leaf, z_leaf, m_st, p_st, *module.parameters()])
        with common.PeakMemory(mesh.device) as peak:
            forward().backward()
        step_peak = peak.peak

    fwd_times, bwd_times = [], []
    with recorded_pieces() as pieces:
        for _ in range(repeats):
            fresh()
            timed = common.time_collective(forward, mesh.device)
            fwd_times.append(timed.wall)
            loss = timed.result
            bwd_times.append(common.time_collective(loss.backward, mesh.device).wall)
            del loss, timed

    # Breakdown step: the same hooks, now as a clock per scope.
    fresh()
    timer = OpScopes(module, mesh.device)
    with timer.attached():
        common.synchronize(mesh.device)
        torch.distributed.barrier()
        timer.take_seconds()
        loss = forward()
        timer.current = (None, OUTSIDE)
        fwd_seconds = timer.take_seconds()
        loss.backward()
        timer.current = (None, OUTSIDE)
        bwd_seconds = timer.take_seconds()
    del loss

    mine = {
        "rank": mesh.rank,
        "coord": mesh.domain_coordinate,
        "held": held,
        "step_peak": step_peak,
        "peak": held + step_peak if memory else None,
        "fwd": fwd.by_scope(),
        "bwd": bwd.by_scope(),
        "fwd_s": by_category(fwd_seconds),
        "bwd_s": by_category(bwd_seconds),
        "copies": dict(copies.by_part),
        "fwd_total": fwd.total_bytes(),
        "bwd_total": bwd.total_bytes(),
        "fallbacks": found,
        "serial_loss": reference,
        "serial_fwd": serial_fwd,
        "serial_bwd": serial_bwd,
        "serial_by_op": serial_by_op,
        "pieces": {kernel: sorted(choices) for kernel, choices in pieces.items()},
        "loss": loss_cp,
        "weights": weights,
    }
    ranks = common.gather_rows(mine)
    reference = next((r["serial_loss"] for r in ranks if r["serial_loss"] is not None), None)
    mib = 2**20
    blocks = sizes.num_blocks

    def largest(key: str) -> float | None:
        values = [r[key] for r in ranks if r[key] is not None]
        return max(values) / mib if values else None

    counts: dict[tuple[str, str, str, str], int] = {}
    for r in ranks:
        for key, n in r["fallbacks"].items():
            counts[key] = max(counts.get(key, 0), n)
    fallbacks = [
        {"op": op, "where": where, "mesh_dims": dims, "phase": ph, "count": n}
        for (op, where, dims, ph), n in sorted(counts.items())
    ]
    row: dict[str, Any] = {
        "mesh": f"{cp0}x{cp1}",
        "ranks_n": cp0 * cp1,
        "N": n_tokens,
        "padded": min(max(padded, 0), n_tokens - 1),
        "model": json.dumps(dict(sizes.to_dict(), init_noise=init_noise), sort_keys=True),
        "device": mesh.device.type,
        "memory_source": common.PeakMemory(mesh.device).source,
        "handlers": fc_boltz.install(),
        "loss": loss_cp,
        "serial_loss": reference,
        "loss_diff": abs(loss_cp - reference) if reference is not None else None,
        "loss_diff_text": f"{abs(loss_cp - reference):.1e}" if reference is not None else None,
        "losses_agree": len({r["loss"] for r in ranks}) == 1,
        "weights_agree": len({r["weights"] for r in ranks}) == 1,
        "fallbacks": fallbacks,
        "fallback_gathers": sum(f["count"] for f in fallbacks),
        "fallbacks_text": describe_fallbacks(fallbacks),
        "fwd_ms_layer": 1e3 * common.median(fwd_times) / blocks if fwd_times else None,
        "bwd_ms_layer": 1e3 * common.median(bwd_times) / blocks if bwd_times else None,
        "fwd_times": fwd_times,
        "bwd_times": bwd_times,
        "held_MiB": largest("held"),
        "step_peak_MiB": largest("step_peak"),
        "peak_MiB": largest("peak"),
        "peak_MiB_mean": (sum(r["peak"] for r in ranks) / len(ranks) / mib if memory else None),
        "ranks": ranks,
    }
    row["step_ms_layer"] = row["fwd_ms_layer"] + row["bwd_ms_layer"] if fwd_times else None
    source = next((r for r in ranks if r["serial_fwd"]), None)
    for ph in ("fwd", "bwd"):
        times = source[f"serial_{ph}"] if source else []
        row[f"serial_{ph}_times"] = times
        row[f"serial_{ph}_ms_layer"] = 1e3 * common.median(times) / blocks if times else None
        for c in (*CATEGORIES, OUTSIDE):
            seconds = source["serial_by_op"][ph].get(c, 0.0) if source else None
            row[f"serial_{ph}_ms_{c}"] = (
                None if seconds is None else 1e3 * seconds / (1 if c == OUTSIDE else blocks)
            )
    serial_step = row["serial_fwd_ms_layer"] + row["serial_bwd_ms_layer"] if source else None
    row["serial_step_ms_layer"] = serial_step
    row["step_over_serial"] = (
        row["step_ms_layer"] / serial_step if serial_step and row["step_ms_layer"] else None
    )
    row["threads"] = torch.get_num_threads()
    row["serial_threads"] = common.machine_threads() if mesh.device.type == "cpu" else None
    row["work_budget_MiB"] = work_budget_mib()
    chosen: dict[str, set[str]] = {}
    for r in ranks:
        for kernel, choices in r["pieces"].items():
            chosen.setdefault(kernel, set()).update(choices)
    row["pieces"] = "; ".join(
        f"{kernel}: {', '.join(sorted(choices))}" for kernel, choices in sorted(chosen.items())
    )
    by_layer = {}
    for ph in ("fwd", "bwd"):
        per_op, outside, by_layer[ph] = _per_layer(ranks, ph, blocks)
        for c, kib in per_op.items():
            row[f"{ph}_KiB_{c}"] = kib
        row[f"{ph}_KiB_layer"] = sum(per_op.values())
        row[f"{ph}_KiB_outside"] = outside
        row[f"{ph}_KiB_total"] = max(r[f"{ph}_total"] for r in ranks) / 1024
    row["bytes_by_layer"] = by_layer
    for c in (*CATEGORIES, OUTSIDE):
        row[f"copy_MiB_{c}"] = max(r["copies"].get(c, 0) for r in ranks) / mib
    row["copy_MiB_step"] = max(sum(r["copies"].values()) for r in ranks) / mib
    row["serial_copy_MiB_step"] = source["serial_by_op"]["copy_bytes"] / mib if source else None
    for ph in ("fwd", "bwd"):
        for c in (*CATEGORIES, OUTSIDE):
            per_step = max(r[f"{ph}_s"].get(c, 0.0) for r in ranks)
            row[f"{ph}_ms_{c}"] = 1e3 * per_step / (1 if c == OUTSIDE else blocks)
    return row


# -- the shared tables --------------------------------------------------------------------------

COLUMNS = [
    ("mesh", "mesh"),
    ("N", "N"),
    ("held_MiB", "held MiB / rank"),
    ("step_peak_MiB", "step peak MiB / rank"),
    ("peak_MiB", "peak MiB / rank (max)"),
    ("peak_this_over_1x1", "peak: this / 1x1"),
    ("target_text", "target"),
    ("target_met", "met"),
    ("fwd_ms_layer", "fwd ms / layer"),
    ("bwd_ms_layer", "bwd ms / layer"),
    ("serial_step_ms_layer", "serial Boltz fwd + bwd ms / layer"),
    ("step_over_serial", "step: this / serial Boltz"),
    ("copy_MiB_step", "MiB copied / step (max rank)"),
    ("serial_copy_MiB_step", "serial Boltz MiB copied / step"),
    ("fwd_KiB_layer", "fwd KiB moved / layer"),
    ("bwd_KiB_layer", "bwd KiB moved / layer"),
    ("fallback_gathers", "fallback gathers"),
    ("loss_diff_text", "abs(loss - serial)"),
]
COPY_COLUMNS = [
    ("mesh", "mesh"),
    ("N", "N"),
    *[(f"copy_MiB_{c}", c) for c in (*CATEGORIES, OUTSIDE)],
    ("copy_MiB_step", "step (max rank)"),
    ("serial_copy_MiB_step", "serial Boltz step"),
]
SUMMARY_KEY = ("mesh", "N")
_STORED = (
    [k for k, _ in COLUMNS]
    + [
        "ranks_n",
        "padded",
        "model",
        "device",
        "memory_source",
        "handlers",
        "loss",
        "serial_loss",
        "loss_diff",
        "losses_agree",
        "weights_agree",
        "fallbacks",
        "fallbacks_text",
        "fwd_times",
        "bwd_times",
        "step_ms_layer",
        "serial_fwd_ms_layer",
        "serial_bwd_ms_layer",
        "serial_fwd_times",
        "serial_bwd_times",
        "threads",
        "serial_threads",
        "work_budget_MiB",
        "pieces",
        "peak_MiB_mean",
        "bytes_by_layer",
    ]
    + [f"copy_MiB_{c}" for c in (*CATEGORIES, OUTSIDE)]
    + [f"{ph}_KiB_{c}" for ph in ("fwd", "bwd") for c in (*CATEGORIES, "outside", "total")]
    + [f"{ph}_ms_{c}" for ph in ("fwd", "bwd") for c in (*CATEGORIES, OUTSIDE)]
    + [f"serial_{ph}_ms_{c}" for ph in ("fwd", "bwd") for c in (*CATEGORIES, OUTSIDE)]
)


def with_ratios(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Rows with ``peak: this / 1x1`` (the 1x1 row of the same N, sizes and device) and the
    target verdict (2x2 and 3x3 rows; the one that counts is at the largest N)."""
    base = {(r["N"], r.get("model"), r.get("device")): r for r in rows if r["mesh"] == "1x1"}
    out = []
    for r in rows:
        r = dict(r)
        ref = base.get((r["N"], r.get("model"), r.get("device")))
        ok = ref is not None and ref.get("peak_MiB") and r.get("peak_MiB")
        r["peak_this_over_1x1"] = r["peak_MiB"] / ref["peak_MiB"] if ok else None
        target = TARGETS.get(r["mesh"])
        r["target"] = target
        r["target_text"] = f"<= {target:.2f}" if target is not None else None
        r["target_met"] = (
            r["peak_this_over_1x1"] <= target
            if target is not None and r["peak_this_over_1x1"] is not None
            else None
        )
        out.append(r)
    return sorted(out, key=lambda r: (r.get("ranks_n", 0), r["mesh"], r["N"]))


def evaluate_targets(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per mesh with a target: its largest N with a 1x1 row, the ratio and the verdict."""
    out = []
    for mesh, target in TARGETS.items():
        measured = [r for r in rows if r["mesh"] == mesh and r.get("peak_this_over_1x1")]
        if not measured:
            out.append({"mesh": mesh, "target": target, "N": None, "ratio": None, "met": None})
            continue
        top = max(measured, key=lambda r: r["N"])
        ratio = top["peak_this_over_1x1"]
        out.append(
            {"mesh": mesh, "target": target, "N": top["N"], "ratio": ratio, "met": ratio <= target}
        )
    return out


def op_rows(rows: Sequence[Mapping[str, Any]], unit: str = "KiB") -> list[dict[str, Any]]:
    """One row per (mesh, N, phase): KiB moved (``unit="KiB"``) or ms (``"ms"``) per layer
    by op, and for ms also the serial module's row of each launch; rows without the
    figures are left out."""
    out = []
    for r in rows:
        for prefix, label in (("", r["mesh"]), ("serial_", f"serial Boltz ({r['mesh']} launch)")):
            if prefix and unit != "ms":
                continue
            for ph, name in (("fwd", "forward"), ("bwd", "backward")):
                if r.get(f"{prefix}{ph}_{unit}_{CATEGORIES[0]}") is None:
                    continue
                item = {"mesh": label, "N": r["N"], "phase": name}
                for c in (*CATEGORIES, "outside"):
                    item[c] = r.get(f"{prefix}{ph}_{unit}_{c}")
                layer = r.get(f"{ph}_KiB_layer") if unit == "KiB" else None
                item["layer"] = layer if layer is not None else sum(item[c] for c in CATEGORIES)
                out.append(item)
    return out


OP_COLUMNS = [
    ("mesh", "mesh"),
    ("N", "N"),
    ("phase", "phase"),
    *[(c, c) for c in CATEGORIES],
    ("layer", "layer total"),
    ("outside", "outside layers (loss), per step"),
]


def stored_rows(results: Path) -> list[dict[str, Any]]:
    """The ``pairformer`` rows already in ``results/summary.json``."""
    path = results / "summary.json"
    if not path.exists():
        return []
    store = json.loads(path.read_text())
    return [dict(r) for r in store.get(BENCHMARK, {}).get("rows", [])]


def draw(rows: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """Peak memory per rank, its ratio to 1x1 (with the targets) and time per layer vs N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    meshes = sorted({(r.get("ranks_n", 0), r["mesh"]) for r in rows})
    panels = (
        (axes[0], "peak_MiB", "peak tensor MiB per rank (held + step peak, max over ranks)"),
        (axes[1], "peak_this_over_1x1", "peak per rank: this mesh / 1x1"),
        (axes[2], "step_ms_layer", "fwd + bwd ms per layer (median, max over ranks)"),
    )
    colors: dict[str, Any] = {}
    for ax, key, label in panels:
        for _, mesh in meshes:
            pts = sorted((r["N"], r[key]) for r in rows if r["mesh"] == mesh and r.get(key))
            if pts:
                (line,) = ax.plot(*zip(*pts), marker="o", label=mesh, color=colors.get(mesh))
                colors[mesh] = line.get_color()
        ax.set_xlabel("tokens N")
        ax.set_ylabel(label, fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    for mesh, target in TARGETS.items():
        axes[1].axhline(
            target, linestyle="--", color=colors.get(mesh, "gray"), label=f"{mesh} target"
        )
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(title="mesh", fontsize=8)
    fig.suptitle("Boltz PairformerModule, forward + backward, per mesh")
    return common.save_figure(fig, path, dpi=100)


def write_results(rows: Sequence[Mapping[str, Any]], command: str, results: Path) -> list[Path]:
    """Merge this launch's rows with the stored ones; rewrite the tables, plot and summary."""
    fresh = {(r["mesh"], r["N"]) for r in rows}
    kept = [r for r in stored_rows(results) if (r["mesh"], r["N"]) not in fresh]
    new = [{k: r.get(k) for k in _STORED} for r in rows]
    for r in new:
        r["command"] = command
    merged = with_ratios(kept + new)
    summary = common.merge_summary(BENCHMARK, merged, SUMMARY_KEY, COLUMNS, results)
    commands = "\n".join(
        f"- {m}: `{c}`" for m, c in sorted({(r["mesh"], r.get("command") or "?") for r in merged})
    )
    sources = sorted({f"{r.get('device')}: {r.get('memory_source')}" for r in merged})
    handlers = sorted({h for r in merged for h in r.get("handlers") or []})
    environment = (
        f"launches (one per mesh):\n\n{commands}\n\n"
        f"torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} CPU cores; load "
        f"average at the end of the last launch {common.load_average()}\n\n"
        f"step peak memory from: {'; '.join(sources)}\n\n"
        "every rank built the same weights and found the same loss: "
        + common.fmt(all(r.get("weights_agree") and r.get("losses_agree") for r in merged))
        + "\n\n"
        f"PairformerModule: `{merged[0].get('model') if merged else '-'}`, "
        f"{merged[0].get('padded') if merged else '-'} padded tokens, train mode\n\n"
        f"Boltz modules with a distributed forward: "
        + (", ".join(f"`{h}`" for h in handlers) or "none")
    )
    speed = common.step_time_lines(
        merged,
        lambda r: f"{r['mesh']} N={r['N']}",
        "ms / layer",
        "step_ms_layer",
        "serial_step_ms_layer",
        "step_over_serial",
    )
    pieces = "\n".join(
        f"- {r['mesh']} N={r['N']}: work budget {common.fmt(r.get('work_budget_MiB'))} MiB; "
        + (r.get("pieces") or "not recorded")
        for r in merged
    )
    targets = "\n".join(
        f"- {t['mesh']}: peak per rank / 1x1 <= {t['target']:.2f} at the largest N: "
        + (
            f"N = {t['N']}, {t['ratio']:.3f}, {'met' if t['met'] else 'NOT met'}"
            if t["N"] is not None
            else "not measured (no row with a 1x1 row of the same N)"
        )
        for t in evaluate_targets(merged)
    )
    fallbacks = "\n".join(
        f"- {r['mesh']} N={r['N']}: "
        + (
            "; ".join(
                f"{f['phase']} `{f['op']}` in {f['where']} over {f['mesh_dims']} x{f['count']}"
                for f in r.get("fallbacks") or []
            )
            or "none"
        )
        for r in merged
    )
    timings = "\n".join(
        f"- {r['mesh']} N={r['N']}: forward "
        + ", ".join(f"{1e3 * t:.1f}" for t in r.get("fwd_times") or [])
        + "; backward "
        + ", ".join(f"{1e3 * t:.1f}" for t in r.get("bwd_times") or [])
        for r in merged
    )
    md = common.write_markdown(
        results / f"{BENCHMARK}.md",
        "Pairformer benchmark: Boltz PairformerModule, per mesh",
        [
            ("Runs", environment),
            ("Memory, time and bytes per rank", common.markdown_table(COLUMNS, merged)),
            ("Targets", targets),
            (
                "Step time against serial Boltz (the serial module timed in the same launch)",
                speed,
            ),
            ("Work budget and the pieces the kernels chose (every rank's)", pieces),
            (
                "KiB moved per layer by op (largest rank, mean over layers)",
                common.markdown_table(OP_COLUMNS, op_rows(merged)),
            ),
            (
                "MiB copied per step by op (forward + backward, largest rank per op; "
                "cat, clone, copy_, casts, pads, index_select / index_copy)",
                common.markdown_table(COPY_COLUMNS, merged),
            ),
            (
                "ms per layer by op (slowest rank, mean over layers; one step with hooks)",
                common.markdown_table(OP_COLUMNS, op_rows(merged, "ms")),
            ),
            ("Gathers the plugin reported (fallback)", fallbacks),
            ("Every timed run (ms for all layers, max over ranks)", timings),
        ],
    )
    png = draw(merged, results / f"{BENCHMARK}.png")
    return [md, png, summary]


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    defaults = PairformerSizes()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_sweep_arguments(p, tokens=(128, 256, 384))
    p.add_argument("--padded", type=int, default=3, help="masked tokens at the end")
    p.add_argument("--token-s", type=int, default=defaults.token_s)
    p.add_argument("--token-z", type=int, default=defaults.token_z)
    p.add_argument("--num-blocks", type=int, default=defaults.num_blocks)
    p.add_argument("--num-heads", type=int, default=defaults.num_heads)
    p.add_argument("--pairwise-head-width", type=int, default=defaults.pairwise_head_width)
    p.add_argument("--pairwise-num-heads", type=int, default=defaults.pairwise_num_heads)
    p.add_argument("--dropout", type=float, default=defaults.dropout)
    p.add_argument(
        "--init-noise",
        type=float,
        default=0.1,
        help="noise added to Boltz's initial parameters (0: Boltz's own, zero last projections)",
    )
    p.add_argument(
        "--work-budget",
        type=float,
        default=work_budget_mib(),
        help="MiB per kernel piece and rank (physicsnemo_foldcp.kernels.budget)",
    )
    common.add_step_arguments(p)
    common.add_output_arguments(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run every ``--tokens`` size on the launched mesh; rank 0 writes the results."""
    args = build_parser().parse_args(argv)
    cp = common.cp_shape(args.cp)
    sizes = PairformerSizes(
        token_s=args.token_s,
        token_z=args.token_z,
        num_blocks=args.num_blocks,
        num_heads=args.num_heads,
        pairwise_head_width=args.pairwise_head_width,
        pairwise_num_heads=args.pairwise_num_heads,
        dropout=args.dropout,
    )
    set_work_budget(args.work_budget)
    mesh = fc.init_mesh(ddp=1, cp=cp, timeout_s=args.timeout)
    command = common.launch_command("bench_pairformer.py", mesh.world_size, argv)
    rows = []
    try:
        for n in args.tokens:
            row = run_pairformer_benchmark(
                mesh,
                n,
                sizes=sizes,
                repeats=args.repeats,
                seed=args.seed,
                padded=args.padded,
                serial_check=not args.no_serial_check,
                serial_time=not args.no_serial_time,
                memory=not args.no_memory,
                init_noise=args.init_noise,
            )
            rows.append(row)
            if mesh.rank == 0:
                print(
                    f"{row['mesh']} N={row['N']} peak {row['peak_MiB'] or 0:.1f} MiB/rank "
                    f"(held {row['held_MiB'] or 0:.1f}, step {row['step_peak_MiB'] or 0:.1f}) "
                    f"fwd {row['fwd_ms_layer'] or 0:.1f} ms/layer "
                    f"bwd {row['bwd_ms_layer'] or 0:.1f} ms/layer "
                    f"moved fwd {row['fwd_KiB_layer']:.1f} KiB/layer "
                    f"bwd {row['bwd_KiB_layer']:.1f} KiB/layer "
                    f"fallback gathers {row['fallback_gathers']} "
                    f"loss {row['loss']:.6f} serial {row['serial_loss']} "
                    f"step / serial Boltz {common.fmt(row['step_over_serial'])} "
                    f"({row['pieces']})",
                    flush=True,
                )
            if mesh.rank == 0:  # after every N, so a later failure keeps the earlier rows
                for path in write_results(rows, command, args.results):
                    print(f"wrote {path}")
    finally:
        with contextlib.suppress(Exception):
            fc.shutdown()
    return 0


__all__ = [
    "COLUMNS",
    "PairformerSizes",
    "ScopedCollectiveBytes",
    "build_module",
    "evaluate_targets",
    "pair_inputs",
    "pair_loss",
    "run_pairformer_benchmark",
    "serial_loss",
    "serial_step_times",
    "with_ratios",
    "write_results",
]

if __name__ == "__main__":
    raise SystemExit(main())
