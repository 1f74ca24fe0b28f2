"""Benchmark 5: one Boltz-2 trunk training step under CP: peak memory per rank and a memory model.

    torchrun --standalone --nproc-per-node 1 benchmarks/bench_trunk.py \
        --tokens 64 96 128 160 192 224 --repeats 1
    torchrun --standalone --nproc-per-node 4 benchmarks/bench_trunk.py \
        --tokens 64 96 128 160 192 224 --repeats 1
    torchrun --standalone --nproc-per-node 9 benchmarks/bench_trunk.py \
        --tokens 64 96 128 160 192 224 --repeats 1

One launch per mesh (``--cp``, by default the square mesh of the world size: 1x1, 2x2,
3x3). For each ``N`` a synthetic Boltz-2 sample
(``make_complex(N, seed, msa_rows=--msa-rows, atom_multiple=32)``, batched) is scattered
over the mesh (``scatter_features``, after :func:`physicsnemo_foldcp.boltz.install`) and
:class:`~physicsnemo_foldcp.models.boltz2_trunk.Boltz2Trunk` (Boltz's own modules: input
embedder, MSA module, Pairformer, distogram head; built after seeding torch and NumPy, with
seeded noise on every parameter so that no zero-initialised projection hides a module from
the loss; train mode, dropout on) runs ONE training step: forward with
``recycling_steps=0``, Boltz-2's distogram loss (``model.loss``), backward. The dropout
draws are seeded the same before every forward, so every step is the same step.

Measured per launch and ``N`` (every figure the same on every rank):

* **loss** of the step beside the serial trunk's loss on the whole sample with the same
  weights and dropout draws (computed on the domain source rank, forward only;
  ``--no-serial-check`` skips it); the relative difference must stay within 1e-4 (bf16:
  2e-3, :data:`LOSS_RTOL`);
* **step time**: median over ``--repeats`` steps of the largest wall time over the ranks
  (:func:`benchmarks.common.time_collective`; after the first step and the memory step);
* **step time against the serial trunk**: the same training step of the serial trunk on
  the whole plain sample (Boltz's own modules, no plugin tensor), timed on the domain
  source rank in the same launch, after a warm-up step, while the other ranks wait; on
  CPU with every core (torchrun gives each of several ranks one thread). **step: this /
  serial**; targets: <= 1.1 on 1x1, <= 1.0 on 2x2 (``--no-serial-time`` skips it);
* **time by part**: one more step, distributed and serial, with
  :class:`~benchmarks.op_scopes.OpScopes` as a clock: milliseconds per step in the input
  embedder, the MSA module, each Pairformer op (summed over the layers), the distogram
  head, the loss's forward and the rest of the trunk (:data:`PARTS`), the slowest rank's;
  waits for peers count in the part that waits;
* **memory per rank**: *held* is the tensor bytes a rank keeps before the step (its shard
  of the sample and the parameters; gradients are set to ``None`` first); *step peak* the
  peak of tensor bytes allocated during one forward + backward above that
  (:class:`benchmarks.common.PeakMemory`, which also counts the gradients the backward
  allocates); *peak* = held + step peak, the largest over the ranks; **peak: this / 1x1**
  divides it by the 1x1 row's of the same ``N`` and sizes. Targets at the largest ``N``:
  <= 0.30 on 2x2 and <= 0.15 on 3x3. On CPU the peak of a multi-rank step changes from one
  identical step to the next (by up to about 8 % on 2x2): gloo's threads allocate and free
  communication buffers while the step runs. So ``--memory-steps`` steps (default 3) are
  profiled; the table gives the median over them of the largest peak over the ranks, and
  the range. The tensors alive at every moment are the same in every step: the spread is
  the allocator's view of buffers in flight.

From every stored row the script then fits the per-rank memory model of
:mod:`benchmarks.memory_model` (non-negative least squares on the relative error), leaving
out the largest ``N`` of every mesh of the main sizes, and checks it on those held-out
points (every prediction within 15 %); it reports the largest ``N`` that fits
``--budget-mib`` per rank (measured, and from the model), and predicts per-rank memory and
the largest ``N`` for Boltz-2's own sizes on 1x1, 4x4 and 8x8 meshes of 80 GB GPUs.

Launches with other sizes (``--token-z``, ``--msa-blocks``, ``--pairformer-blocks``,
``--msa-rows``; 1x1 suffices) add calibration points: with one set of sizes, terms of the
model that grow alike in ``N`` (the pair track, the outer product mean, the pair features)
cannot be told apart.

Each launch merges its rows into ``results/summary.json`` (section ``trunk``, key mesh,
sizes and N) and rewrites ``results/trunk.md`` and ``results/trunk.png`` from every row
there.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import platform
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

try:
    from benchmarks import common, memory_model
    from benchmarks.bench_ops import CollectiveBytes, group_labels
    from benchmarks.op_scopes import CATEGORIES, OUTSIDE, OpScopes, by_category
except ModuleNotFoundError:  # run as a script: the repository root is not on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import common, memory_model
    from benchmarks.bench_ops import CollectiveBytes, group_labels
    from benchmarks.op_scopes import CATEGORIES, OUTSIDE, OpScopes, by_category

import physicsnemo_foldcp as fc
import physicsnemo_foldcp.boltz as fc_boltz
from physicsnemo_foldcp.core.grad_buckets import attach_gradient_buckets
from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.distributed.mesh import FoldMesh
from physicsnemo_foldcp.distributed.wrappers import unwrap
from physicsnemo_foldcp.models.boltz2_config import Boltz2TrunkConfig
from physicsnemo_foldcp.sharding.plan import even_token_bounds
from physicsnemo_foldcp.testing.collectives import count_p2p
from physicsnemo_foldcp.testing.flops import LocalFlops
from physicsnemo_foldcp.testing.host_syncs import count_host_syncs
from physicsnemo_foldcp.training import batched
from physicsnemo_foldcp.training.loop import autocast, loss_value, set_precision

BENCHMARK = "trunk"
"""Section of ``results/summary.json`` holding every mesh's rows."""

TARGETS = {"2x2": 0.30, "3x3": 0.15}
"""Largest ``peak: this / 1x1`` at the largest N, per mesh."""

LOSS_RTOL = {"fp32": 1e-4, "bf16": 2e-3}
"""Largest relative difference of the CP loss from the serial loss, per precision (bf16
keeps 8 bits of mantissa and the blocks sum in another order)."""

HOLDOUT_TOLERANCE = 0.15
"""Largest relative error of a held-out prediction."""

GIB = 2**30
MIB = 2**20


BOLTZ2_WIDTHS: dict[str, int] = {
    "token_s": 384,
    "token_z": 128,
    "atom_s": 128,
    "atom_z": 16,
    "msa_s": 64,
    "num_heads": 16,
    "pairwise_head_width": 32,
    "pairwise_num_heads": 4,
    "atom_encoder_depth": 3,
    "atom_encoder_heads": 4,
}
"""Widths and head counts of the released Boltz-2 trunk (``boltz.main``'s
``PairformerArgsV2`` and ``MSAModuleArgs``; atom encoder depth 3, heads 4)."""


@dataclass(frozen=True)
class TrunkSizes:
    """Sizes of the benchmarked trunk (defaults: the pair and MSA terms dominate, CPU-quick).

    Attributes
    ----------
    token_s, token_z, atom_s, atom_z : int
        Channel widths (``Boltz2TrunkConfig``).
    msa_s, msa_blocks : int
        MSA module width and layers.
    pairformer_blocks : int
        Pairformer layers.
    num_heads : int
        Pairformer single-track attention heads.
    pairwise_head_width, pairwise_num_heads : int
        Triangle attention head width and heads (both stacks).
    atom_encoder_depth, atom_encoder_heads : int
        Atom transformer layers and heads.
    msa_rows : int
        MSA depth ``S`` of the sample.
    dropout : float
        Pairformer and MSA dropout (pair and MSA).
    checkpointing : bool
        Boltz's ``activation_checkpointing`` in the input embedder's atom transformer, the
        MSA module and the Pairformer.
    precision : {"fp32", "bf16"}
        ``bf16``: the step under ``torch.autocast`` to bfloat16 (parameters stay fp32).
    kernel_recompute : bool
        ``False``: the pair kernels keep their scores and outer products for backward
        instead of recomputing them (:func:`~physicsnemo_foldcp.set_kernel_recompute`).
    """

    token_s: int = 64
    token_z: int = 32
    atom_s: int = 32
    atom_z: int = 8
    msa_s: int = 16
    msa_blocks: int = 1
    pairformer_blocks: int = 2
    num_heads: int = 4
    pairwise_head_width: int = 16
    pairwise_num_heads: int = 4
    atom_encoder_depth: int = 1
    atom_encoder_heads: int = 2
    msa_rows: int = 32
    dropout: float = 0.15
    checkpointing: bool = False
    precision: str = "fp32"
    kernel_recompute: bool = True

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict."""
        return dataclasses.asdict(self)

    def label(self) -> str:
        """Short name of the sizes (a column of the tables)."""
        label = (
            f"z{self.token_z} s{self.token_s} msa{self.msa_s}x{self.msa_blocks} "
            f"S{self.msa_rows} pf{self.pairformer_blocks}"
        )
        if (self.token_s, self.token_z) == (BOLTZ2_WIDTHS["token_s"], BOLTZ2_WIDTHS["token_z"]):
            label += " boltz2-widths"
        label += " ckpt" * self.checkpointing + f" {self.precision}" * (self.precision != "fp32")
        return label + " kept" * (not self.kernel_recompute)

    @property
    def mode(self) -> str:
        """``"fp32"``, ``"fp32 ckpt"``, ``"bf16"`` or ``"bf16 ckpt"`` (:func:`mode_name`)."""
        return mode_name(self.checkpointing, self.precision)

    def plain(self) -> TrunkSizes:
        """The same sizes in fp32 without checkpointing (what the modes are compared to)."""
        return dataclasses.replace(self, checkpointing=False, precision="fp32")

    @property
    def measured_as_modelled(self) -> bool:
        """fp32, no checkpointing, kernels recomputing: the setting the memory model describes."""
        return self.precision == "fp32" and not self.checkpointing and self.kernel_recompute

    def config(self) -> Boltz2TrunkConfig:
        """The ``Boltz2Trunk`` configuration (``recycling_steps=0``)."""
        checkpointing = {"activation_checkpointing": True} if self.checkpointing else {}
        return Boltz2TrunkConfig(
            token_s=self.token_s,
            token_z=self.token_z,
            atom_s=self.atom_s,
            atom_z=self.atom_z,
            embedder_args={
                "atom_encoder_depth": self.atom_encoder_depth,
                "atom_encoder_heads": self.atom_encoder_heads,
                "add_method_conditioning": True,
                "add_modified_flag": True,
                "add_cyclic_flag": True,
                "add_mol_type_feat": True,
                **checkpointing,
            },
            msa_args={
                "msa_s": self.msa_s,
                "msa_blocks": self.msa_blocks,
                "msa_dropout": self.dropout,
                "z_dropout": self.dropout,
                "pairwise_head_width": self.pairwise_head_width,
                "pairwise_num_heads": self.pairwise_num_heads,
                **checkpointing,
            },
            pairformer_args={
                "num_blocks": self.pairformer_blocks,
                "num_heads": self.num_heads,
                "dropout": self.dropout,
                "pairwise_head_width": self.pairwise_head_width,
                "pairwise_num_heads": self.pairwise_num_heads,
                **checkpointing,
            },
            recycling_steps=0,
        )


BASE = TrunkSizes()
"""The main sizes: the meshes are compared, and the model checked, on these."""

BOLTZ2 = TrunkSizes(**BOLTZ2_WIDTHS, msa_blocks=4, pairformer_blocks=64, msa_rows=1024, dropout=0.0)
"""Boltz-2's trunk sizes: :data:`BOLTZ2_WIDTHS`, 64 Pairformer blocks
(``PairformerArgsV2``), 4 MSA blocks and ``num_subsampled_msa`` 1024 (``MSAModuleArgs``)."""

BOLTZ2_ATOMS_PER_TOKEN = 8
"""Atoms per token assumed for the predictions (proteins: about 7.8 heavy atoms)."""


SMOKE = TrunkSizes(
    token_s=16,
    token_z=8,
    atom_s=8,
    atom_z=4,
    msa_s=8,
    pairformer_blocks=1,
    num_heads=2,
    pairwise_head_width=4,
    pairwise_num_heads=2,
    msa_rows=6,
)
"""The smallest sizes: the benchmarks' smoke tests run at them."""

SMOKE_TOKENS = 29
"""Tokens of the smoke tests' sample: uneven token blocks on 2x2 (15 + 14)."""


def build_trunk(sizes: TrunkSizes, seed: int, init_noise: float) -> torch.nn.Module:
    """``Boltz2Trunk`` with parameters drawn from ``seed`` (+ seeded noise), in train mode.

    Boltz's initialisers draw from torch's and NumPy's global generators, so both are
    seeded (the same weights on every rank and in the serial reference). Boltz zeroes the
    last projection of most sub-modules; ``init_noise * N(0, 1)`` is added to every
    parameter so that every sub-module contributes to the loss.
    """
    from physicsnemo_foldcp.models.boltz2_trunk import Boltz2Trunk

    torch.manual_seed(seed)
    np.random.seed(seed)
    model = Boltz2Trunk(sizes.config())
    if init_noise > 0:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(init_noise * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model.train()


def parameter_count(sizes: TrunkSizes) -> int:
    """Parameters of the trunk of ``sizes``, from trunks of 1 and 2 blocks per stack.

    The count is linear in the Pairformer and MSA layers, so three small trunks give it
    for any depth without building the deep one.
    """

    def count(pf: int, msa: int) -> int:
        small = dataclasses.replace(sizes, pairformer_blocks=pf, msa_blocks=msa)
        torch.manual_seed(0)
        np.random.seed(0)
        from physicsnemo_foldcp.models.boltz2_trunk import Boltz2Trunk

        return sum(p.numel() for p in Boltz2Trunk(small.config()).parameters())

    one = count(1, 1)
    per_pf = count(2, 1) - one
    per_msa = count(1, 2) - one
    return one + per_pf * (sizes.pairformer_blocks - 1) + per_msa * (sizes.msa_blocks - 1)


def step_loss(model: torch.nn.Module, feats: Mapping[str, Any], dropout_seed: int) -> torch.Tensor:
    """Forward (no recycling) and Boltz-2's distogram loss, dropout drawn from ``dropout_seed``."""
    torch.manual_seed(dropout_seed)
    return unwrap(model).loss(model(recycling_steps=0, **feats), feats)


STAGES = ("input_embedder", "msa_module", "distogram_module")
"""Trunk modules timed as a whole in the breakdown step (attribute names of the trunk)."""

PARTS = ("input_embedder", "msa_module", *CATEGORIES, "distogram_module", "loss", OUTSIDE)
"""Columns of the breakdown: the stages, the Pairformer's ops summed over its layers, the
loss (forward only; its backward counts in ``outside``) and ``outside`` (the rest of the
trunk: relative positions, bonds, contact conditioning, norms and recycling projections)."""


def step_by_part(
    model: torch.nn.Module,
    feats: Mapping[str, Any],
    dropout_seed: int,
    device: torch.device,
    collective: bool,
) -> dict[str, dict[str, float]]:
    """One training step with :class:`~benchmarks.op_scopes.OpScopes` as a clock.

    Parameters
    ----------
    model : nn.Module
        The trunk (a ``Boltz2Trunk``).
    feats : Mapping[str, Any]
        Its features (plugin tensors under CP, plain tensors for the serial trunk).
    dropout_seed : int
        As :func:`step_loss`.
    device : torch.device
        Synchronised at every switch (on CUDA).
    collective : bool
        Start after a barrier (every rank of the launch calls it).

    Returns
    -------
    dict[str, dict[str, float]]
        ``{"fwd": {part: seconds}, "bwd": {...}}`` over :data:`PARTS`, the Pairformer's ops
        summed over its layers.
    """
    stages = {name: getattr(model, name) for name in STAGES}
    timer = OpScopes(model.pairformer_module, device, stages)
    model.zero_grad(set_to_none=True)
    with timer.attached():
        common.synchronize(device)
        if collective:
            torch.distributed.barrier()
        timer.take_seconds()
        torch.manual_seed(dropout_seed)
        out = model(recycling_steps=0, **feats)
        timer.current = (None, "loss")
        loss = model.loss(out, feats)
        timer.current = (None, OUTSIDE)
        fwd = by_category(timer.take_seconds())
        loss.backward()
        timer.current = (None, OUTSIDE)
        bwd = by_category(timer.take_seconds())
    model.zero_grad(set_to_none=True)
    return {"fwd": fwd, "bwd": bwd}


def step_flops(
    model: torch.nn.Module, feats: Mapping[str, Any], dropout_seed: int
) -> dict[str, int]:
    """FLOPs of one training step on this rank's local blocks, by part (:data:`PARTS`;
    forward and backward together), counted by
    :class:`~physicsnemo_foldcp.testing.flops.LocalFlops`."""
    stages = {name: getattr(model, name) for name in STAGES}
    scopes = OpScopes(model.pairformer_module, None, stages)
    counter = LocalFlops(where=lambda: scopes.current[1])
    model.zero_grad(set_to_none=True)
    with scopes.attached(), counter:
        torch.manual_seed(dropout_seed)
        out = model(recycling_steps=0, **feats)
        scopes.current = (None, "loss")
        loss = model.loss(out, feats)
        scopes.current = (None, OUTSIDE)
        loss.backward()
    model.zero_grad(set_to_none=True)
    return dict(counter.by_part)


TRAFFIC = ("collectives", "collective_bytes", "p2p", "p2p_bytes", "host_syncs")
"""What :func:`step_traffic` counts; a row keeps the largest rank's count of each."""


def step_traffic(
    model: torch.nn.Module,
    feats: Mapping[str, Any],
    dropout_seed: int,
    groups: Mapping[str, str],
) -> dict[str, int]:
    """What one training step asks of the network and the host, on this rank.

    Parameters
    ----------
    model, feats, dropout_seed
        As :func:`step_loss`.
    groups : Mapping[str, str]
        Process-group labels (:func:`benchmarks.bench_ops.group_labels`; empty for the
        serial trunk, which makes no collective).

    Returns
    -------
    dict[str, int]
        ``collectives`` (calls), ``collective_bytes`` (each call's larger of input and
        output), ``p2p`` (point-to-point sends and receives), ``p2p_bytes`` (sent plus
        received), ``host_syncs`` (tensor-to-host conversions and data-dependent shapes,
        :func:`~physicsnemo_foldcp.testing.host_syncs.count_host_syncs`).
    """
    model.zero_grad(set_to_none=True)
    with CollectiveBytes(groups) as comm, count_p2p() as p2p, count_host_syncs() as syncs:
        step_loss(model, feats, dropout_seed).backward()
    model.zero_grad(set_to_none=True)
    return {
        "collectives": len(comm.records),
        "collective_bytes": comm.total_bytes(),
        "p2p": p2p["calls"],
        "p2p_bytes": p2p["sent"] + p2p["received"],
        "host_syncs": syncs.total,
    }


def serial_step_times(
    model: torch.nn.Module,
    sample: Mapping[str, Any],
    dropout_seed: int,
    device: torch.device,
    repeats: int,
) -> tuple[list[float], dict[str, dict[str, float]]]:
    """Seconds of ``repeats`` serial training steps (forward, loss, backward), after a
    warm-up step, with every core on CPU; then one more step by part
    (:func:`step_by_part`)."""
    times = []
    with common.whole_machine(device):
        for step in range(repeats + 1):
            model.zero_grad(set_to_none=True)
            common.synchronize(device)
            start = time.perf_counter()
            step_loss(model, sample, dropout_seed).backward()
            common.synchronize(device)
            if step:  # the first is the warm-up
                times.append(time.perf_counter() - start)
        by_part = step_by_part(model, sample, dropout_seed, device, collective=False)
    return times, by_part


def run_trunk_benchmark(mesh: FoldMesh, n_tokens: int, **kwargs: Any) -> dict[str, Any]:
    """Measure one trunk training step at one size (every rank; see :func:`measure_step`),
    under ``torch.autocast`` when the sizes say ``precision="bf16"``, with the kernels
    recomputing or keeping as the sizes say."""
    sizes = kwargs.get("sizes", BASE)
    with autocast(sizes.precision, mesh.device), fc.recompute_in_backward(sizes.kernel_recompute):
        return measure_step(mesh, n_tokens, **kwargs)


def measure_step(
    mesh: FoldMesh,
    n_tokens: int,
    *,
    sizes: TrunkSizes = BASE,
    repeats: int = 2,
    seed: int = 0,
    init_noise: float = 0.05,
    serial_check: bool = True,
    serial_time: bool = True,
    flops: bool = True,
    memory: bool = True,
    memory_steps: int = 3,
) -> dict[str, Any]:
    """Measure one trunk training step at one size (every rank).

    Parameters
    ----------
    mesh : FoldMesh
        The mesh (``ddp == 1``).
    n_tokens : int
        Tokens ``N`` of the synthetic sample.
    sizes : TrunkSizes
        Trunk sizes and MSA depth.
    repeats : int
        Timed steps.
    seed : int
        Seed of the sample and the parameters; ``seed + 1`` seeds the dropout draws.
    init_noise : float
        Noise added to the initial parameters (:func:`build_trunk`).
    serial_check : bool
        Compute the serial trunk's loss on the domain source rank.
    serial_time : bool
        Time ``repeats`` training steps of the serial trunk (Boltz's modules on the whole
        plain sample, no plugin tensor) on the domain source rank, after one warm-up step,
        with every core on CPU (:func:`benchmarks.common.whole_machine`), while the other
        ranks wait.
    flops : bool
        Count the FLOPs of one more step on every rank (:func:`step_flops`), and of the
        serial step on the domain source rank.
    memory : bool
        Run the memory steps (profiled on CPU).
    memory_steps : int
        Profiled steps; the row's peak is the median over them.

    Returns
    -------
    dict
        One row, the same on every rank: ``mesh``, ``N``, ``A``, ``S``, ``config``,
        ``loss``, ``serial_loss``, ``loss_rel_diff``, ``time_s`` (median) and ``times``,
        ``held_MiB`` / ``step_peak_MiB`` / ``peak_MiB`` (max over ranks), ``param_bytes``,
        ``serial_time_s`` (median) and ``serial_times``, ``time_over_serial``,
        ``threads`` / ``serial_threads``, ``flops_<part>`` (summed over the ranks) and
        ``serial_flops_<part>``, ``flop_ratio`` (their totals' ratio), the counts of
        :data:`TRAFFIC` in one more step (largest rank) and ``serial_host_syncs`` (the
        serial step's), ``ranks`` (per-rank figures).
    """
    fc_boltz.install()
    cp0, cp1 = mesh.cp
    set_precision(sizes.precision)
    dropout_seed = seed + 1
    sample = reference = None
    serial_times: list[float] = []
    serial_by_part: dict[str, dict[str, float]] = {}
    serial_flops: dict[str, int] = {}
    serial_traffic: dict[str, int] = {}
    if mesh.is_domain_source:
        serial_sample = make_complex(n_tokens, seed=seed, msa_rows=sizes.msa_rows, atom_multiple=32)
        sample = batched(serial_sample)
        if serial_check or serial_time or flops:
            serial = build_trunk(sizes, seed, init_noise).to(mesh.device)
            whole = {k: v.to(mesh.device) if torch.is_tensor(v) else v for k, v in sample.items()}
            if serial_check:
                with torch.no_grad():
                    reference = float(step_loss(serial, whole, dropout_seed))
            if serial_time:
                serial_times, serial_by_part = serial_step_times(
                    serial, whole, dropout_seed, mesh.device, repeats
                )
            if flops:
                serial_flops = step_flops(serial, whole, dropout_seed)
            if not (serial_time or flops):  # warm-up: count a steady-state step
                step_loss(serial, whole, dropout_seed).backward()
            serial_traffic = step_traffic(serial, whole, dropout_seed, {})
            del serial, whole
    features = fc.scatter_features(sample, mesh)
    del sample
    atoms = int(features["atom_to_token"].shape[1])
    depth = int(features["msa"].shape[1])
    model = build_trunk(sizes, seed, init_noise).to(mesh.device)
    attach_gradient_buckets(model, mesh)  # as train() does
    params = list(model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)

    def step() -> float:
        model.zero_grad(set_to_none=True)
        loss = step_loss(model, features, dropout_seed)
        loss.backward()
        return loss_value(loss.detach())

    first = common.time_collective(step, mesh.device)
    loss = float(first.result)
    held = None
    step_peaks: list[int] = []
    if memory:
        model.zero_grad(set_to_none=True)
        if mesh.device.type == "cuda":
            common.synchronize(mesh.device)
            held = int(torch.cuda.memory_allocated(mesh.device))
        else:
            held = common.tensor_bytes([*features.values(), *params])
        for _ in range(max(1, memory_steps)):
            model.zero_grad(set_to_none=True)
            with common.PeakMemory(mesh.device) as peak:
                step()
            step_peaks.append(peak.peak)
    timings = [common.time_collective(step, mesh.device) for _ in range(repeats)]
    by_part = step_by_part(model, features, dropout_seed, mesh.device, collective=True)
    flops_by_part = step_flops(model, features, dropout_seed) if flops else {}
    traffic = step_traffic(model, features, dropout_seed, group_labels(mesh))
    mine = {
        "rank": mesh.rank,
        "coord": mesh.domain_coordinate,
        "held": held,
        "step_peaks": step_peaks,
        "shard": common.tensor_bytes(features.values()),
        "serial_loss": reference,
        "serial_times": serial_times,
        "serial_by_part": serial_by_part,
        "by_part": by_part,
        "serial_flops": serial_flops,
        "flops": flops_by_part,
        "traffic": traffic,
        "serial_traffic": serial_traffic,
        "loss": loss,
    }
    ranks = common.gather_rows(mine)
    reference = next((r["serial_loss"] for r in ranks if r["serial_loss"] is not None), None)

    def largest(key: str) -> float | None:
        values = [r[key] for r in ranks if r[key] is not None]
        return max(values) / MIB if values else None

    # per profiled step, the largest over the ranks; the row keeps the median step
    step_maxima = [max(r["step_peaks"][i] for r in ranks) for i in range(len(step_peaks))]
    peak_maxima = [
        max(r["held"] + r["step_peaks"][i] for r in ranks) for i in range(len(step_peaks))
    ]

    rel = abs(loss - reference) / max(abs(reference), 1e-30) if reference is not None else None
    times = [t.wall for t in timings]
    serial_times = next((r["serial_times"] for r in ranks if r["serial_times"]), [])
    serial_s = common.median(serial_times) if serial_times else None
    serial_by_part = next((r["serial_by_part"] for r in ranks if r["serial_by_part"]), {})
    parts: dict[str, float | None] = {}
    for ph in ("fwd", "bwd"):
        for part in PARTS:
            parts[f"{ph}_s_{part}"] = max(r["by_part"][ph].get(part, 0.0) for r in ranks)
            parts[f"serial_{ph}_s_{part}"] = (
                serial_by_part[ph].get(part, 0.0) if serial_by_part else None
            )
    serial_flops = next((r["serial_flops"] for r in ranks if r["serial_flops"]), {})
    for part in PARTS if flops else ():
        parts[f"flops_{part}"] = sum(r["flops"].get(part, 0) for r in ranks)
        parts[f"serial_flops_{part}"] = serial_flops.get(part, 0) if serial_flops else None
    total_flops = sum(parts.get(f"flops_{part}") or 0 for part in PARTS)
    parts["flop_ratio"] = total_flops / sum(serial_flops.values()) if serial_flops else None
    for key in TRAFFIC:
        parts[key] = max(r["traffic"][key] for r in ranks)
    serial_traffic = next((r["serial_traffic"] for r in ranks if r["serial_traffic"]), {})
    parts["serial_host_syncs"] = serial_traffic.get("host_syncs")
    return {
        "mesh": f"{cp0}x{cp1}",
        "cp0": cp0,
        "cp1": cp1,
        "ranks_n": cp0 * cp1,
        "N": n_tokens,
        "A": atoms,
        "S": depth,
        "config": sizes.label(),
        "seed": seed,
        "sizes": json.dumps(sizes.to_dict(), sort_keys=True),
        "init_noise": init_noise,
        "device": mesh.device.type,
        "memory_source": common.PeakMemory(mesh.device).source,
        "loss": loss,
        "serial_loss": reference,
        "loss_rel_diff": rel,
        "loss_rel_diff_text": f"{rel:.1e}" if rel is not None else None,
        "loss_ok": rel <= LOSS_RTOL[sizes.precision] if rel is not None else None,
        "losses_agree": len({r["loss"] for r in ranks}) == 1,
        "first_step_s": first.wall,
        "time_s": common.median(times) if times else None,
        "times": times,
        "serial_time_s": serial_s,
        "serial_times": serial_times,
        "time_over_serial": common.median(times) / serial_s if serial_s and times else None,
        "threads": torch.get_num_threads(),
        "serial_threads": common.machine_threads() if mesh.device.type == "cpu" else None,
        "param_bytes": param_bytes,
        "held_MiB": largest("held"),
        "step_peak_MiB": common.median(step_maxima) / MIB if memory else None,
        "peak_MiB": common.median(peak_maxima) / MIB if memory else None,
        "peak_range_text": (
            f"{min(peak_maxima) / MIB:.1f}-{max(peak_maxima) / MIB:.1f}" if memory else None
        ),
        "peaks_MiB": [v / MIB for v in peak_maxima],
        "shard_MiB": largest("shard"),
        **parts,
        "ranks": [{k: r[k] for k in ("rank", "coord", "held", "step_peaks")} for r in ranks],
    }


# -- tables, model, plot ------------------------------------------------------------------------

COLUMNS = [
    ("mesh", "mesh"),
    ("config", "sizes"),
    ("N", "N"),
    ("A", "atoms A"),
    ("S", "MSA rows S"),
    ("held_MiB", "held MiB / rank"),
    ("step_peak_MiB", "step peak MiB / rank"),
    ("peak_MiB", "peak MiB / rank (max; median step)"),
    ("peak_range_text", "range over steps"),
    ("peak_this_over_1x1", "peak: this / 1x1"),
    ("target_text", "target"),
    ("target_met", "met"),
    ("time_s", "step s (median)"),
    ("serial_time_s", "serial trunk step s (median)"),
    ("time_over_serial", "step: this / serial"),
    ("flop_ratio", "FLOPs: all ranks / serial"),
    ("loss", "loss"),
    ("loss_rel_diff_text", "rel. diff. to serial loss"),
    ("loss_ok", "loss within tolerance"),
]
SUMMARY_KEY = ("mesh", "config", "N")
_STORED = [k for k, _ in COLUMNS] + [
    "cp0",
    "cp1",
    "seed",
    "ranks_n",
    "sizes",
    "init_noise",
    "device",
    "memory_source",
    "serial_loss",
    "loss_rel_diff",
    "losses_agree",
    "first_step_s",
    "times",
    "serial_times",
    "threads",
    "serial_threads",
    "param_bytes",
    "boltz2_params",
    "shard_MiB",
    "peaks_MiB",
    "ranks",
    "command",
    *[f"{pre}{ph}_s_{part}" for pre in ("", "serial_") for ph in ("fwd", "bwd") for part in PARTS],
    *[f"{pre}flops_{part}" for pre in ("", "serial_") for part in PARTS],
    *TRAFFIC,
    "serial_host_syncs",
]


def part_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per (mesh, sizes, N, phase) with a breakdown: ms per step by part
    (:data:`PARTS`, the slowest rank's), and the serial trunk's row of the same launch."""
    out = []
    for r in rows:
        for prefix, label in (("", r["mesh"]), ("serial_", f"serial trunk ({r['mesh']} launch)")):
            for ph, name in (("fwd", "forward"), ("bwd", "backward")):
                if r.get(f"{prefix}{ph}_s_{PARTS[0]}") is None:
                    continue
                item = {"mesh": label, "config": r["config"], "N": r["N"], "phase": name}
                for part in PARTS:
                    item[part] = 1e3 * r[f"{prefix}{ph}_s_{part}"]
                item["total"] = sum(item[part] for part in PARTS)
                out.append(item)
    return out


def flop_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per (mesh, sizes, N) with FLOP counts: the serial step's GFLOP per part
    (:data:`PARTS`) and the FLOPs of all ranks over the serial step's, per part and in
    total (1.0: no work repeated)."""
    out = []
    for r in rows:
        if not r.get("flop_ratio"):
            continue
        item = {"mesh": r["mesh"], "config": r["config"], "N": r["N"], "ratio": r["flop_ratio"]}
        for part in PARTS:
            serial = r[f"serial_flops_{part}"]
            item[f"{part}_gflop"] = serial / 1e9
            item[part] = r[f"flops_{part}"] / serial if serial else None
        item["serial_gflop"] = sum(r[f"serial_flops_{part}"] for part in PARTS) / 1e9
        out.append(item)
    return out


FLOP_COLUMNS = [
    ("mesh", "mesh"),
    ("config", "sizes"),
    ("N", "N"),
    ("serial_gflop", "serial GFLOP / step"),
    ("ratio", "all ranks / serial"),
    *[(p, f"{p}: ratio") for p in PARTS],
]


PART_COLUMNS = [
    ("mesh", "mesh"),
    ("config", "sizes"),
    ("N", "N"),
    ("phase", "phase"),
    *[(p, f"pairformer {p}" if p in CATEGORIES else p) for p in PARTS],
    ("total", "step phase total"),
]


def mode_name(checkpointing: bool, precision: str) -> str:
    """``"fp32"``, ``"fp32 ckpt"``, ``"bf16"``, ``"bf16 ckpt"``."""
    return precision + " ckpt" * checkpointing


MODES = tuple(mode_name(c, p) for p in ("fp32", "bf16") for c in (False, True))
"""The modes the precision table compares, fp32 first."""


def precision_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Peaks of the same step with and without checkpointing and bf16, side by side.

    One row per (mesh, sizes without the mode, N) measured in more than one mode:
    the peak per rank of each of :data:`MODES`, its ratio to the fp32 step's, and its
    ratio to the 1x1 peak of the same mode.
    """
    groups: dict[tuple, dict[str, Mapping[str, Any]]] = {}
    for r in rows:
        if not r.get("peak_MiB") or not sizes_of(r).kernel_recompute:
            continue
        sizes = sizes_of(r)
        plain = sizes.plain().label()
        key = (r["ranks_n"], r["mesh"], plain, r["N"])
        groups.setdefault(key, {})[sizes.mode] = r
    out = []
    for (_, mesh, plain, n), found in sorted(groups.items()):
        if len(found) < 2:
            continue
        item: dict[str, Any] = {"mesh": mesh, "config": plain, "N": n}
        fp32 = found.get("fp32")
        for mode in MODES:
            r = found.get(mode)
            item[f"{mode} peak"] = r["peak_MiB"] if r else None
            item[f"{mode} / fp32"] = r["peak_MiB"] / fp32["peak_MiB"] if r and fp32 else None
            item[f"{mode} this / 1x1"] = r.get("peak_this_over_1x1") if r else None
        out.append(item)
    return out


PRECISION_COLUMNS = [
    ("mesh", "mesh"),
    ("config", "sizes"),
    ("N", "N"),
    *[(f"{m} peak", f"{m}: peak MiB / rank") for m in MODES],
    *[(f"{m} / fp32", f"{m} / fp32") for m in MODES[1:]],
    *[(f"{m} this / 1x1", f"{m}: this / 1x1") for m in MODES],
]


def per_mesh_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per mesh at the largest N that every mesh ran with the same sizes: peak
    ratio to 1x1, step time over the serial trunk's, collectives, point-to-point calls and
    bytes per step, host syncs (with the serial step's), FLOP ratio and the launch's command;
    and the FLOP ratio with the kernels keeping their scores for backward, with its command,
    where a launch measured it at the same sizes and N.

    Parameters
    ----------
    rows : Sequence[Mapping]
        Stored rows with their ratios (:func:`with_ratios`).

    Returns
    -------
    list[dict]
        Columns :data:`PER_MESH_COLUMNS`, ordered by the number of ranks; empty when no
        N was run on every mesh.
    """
    meshes = {r["mesh"] for r in rows}
    ran: dict[tuple[str, int], set[str]] = {}
    for r in rows:
        ran.setdefault((r["config"], r["N"]), set()).add(r["mesh"])
    everywhere = [key for key, where in ran.items() if where == meshes]
    if not everywhere:
        return []
    config, n = max(everywhere, key=lambda key: (key[1], key[0] == BASE.label()))
    chosen = [r for r in rows if (r["config"], r["N"]) == (config, n)]
    kept = {r["mesh"]: r for r in rows if (r["config"], r["N"]) == (f"{config} kept", n)}
    out = []
    for r in sorted(chosen, key=lambda r: (r["ranks_n"], r["mesh"])):
        item = dict(r)
        other = kept.get(r["mesh"], {})
        item["kept_flop_ratio"] = other.get("flop_ratio")
        item["kept_command"] = other.get("command")
        for key in ("collective_bytes", "p2p_bytes"):
            value = r.get(key)
            item[key.replace("bytes", "MiB")] = value / MIB if value is not None else None
        out.append(item)
    return out


PER_MESH_COLUMNS = [
    ("mesh", "mesh"),
    ("N", "N"),
    ("A", "atoms A"),
    ("peak_MiB", "peak MiB / rank"),
    ("peak_this_over_1x1", "peak: this / 1x1"),
    ("time_over_serial", "step: this / serial trunk"),
    ("collectives", "collectives / step"),
    ("collective_MiB", "collective MiB / step"),
    ("p2p", "point-to-point calls / step"),
    ("p2p_MiB", "point-to-point MiB / step"),
    ("host_syncs", "host syncs / step"),
    ("serial_host_syncs", "serial host syncs / step"),
    ("flop_ratio", "FLOPs: all ranks / serial"),
    ("command", "command"),
    ("kept_flop_ratio", "FLOPs: all ranks / serial, scores kept (kernel_recompute=false)"),
    ("kept_command", "command (scores kept)"),
]
"""Columns of the summary's headline (every count: the largest rank's, one step)."""

PER_MESH = "trunk step per mesh"
"""Section of ``results/summary.json`` holding :func:`per_mesh_rows` (rendered first)."""


def with_ratios(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Rows with ``peak: this / 1x1`` (1x1 row of the same N and sizes) and the target."""
    base = {(r["N"], r.get("config"), r.get("device")): r for r in rows if r["mesh"] == "1x1"}
    out = []
    for r in rows:
        r = dict(r)
        ref = base.get((r["N"], r.get("config"), r.get("device")))
        ok = ref is not None and ref.get("peak_MiB") and r.get("peak_MiB")
        r["peak_this_over_1x1"] = r["peak_MiB"] / ref["peak_MiB"] if ok else None
        target = TARGETS.get(r["mesh"])
        r["target_text"] = f"<= {target:.2f}" if target is not None else None
        r["target_met"] = (
            r["peak_this_over_1x1"] <= target
            if target is not None and r["peak_this_over_1x1"] is not None
            else None
        )
        out.append(r)
    return sorted(
        out, key=lambda r: (r["config"] != BASE.label(), r["config"], r["ranks_n"], r["N"])
    )


def sizes_of(row: Mapping[str, Any]) -> TrunkSizes:
    """The :class:`TrunkSizes` a stored row was measured with."""
    return TrunkSizes(**json.loads(row["sizes"]))


@functools.cache
def largest_row_atoms(n_tokens: int, msa_rows: int, seed: int, cp0: int) -> int:
    """Real atoms of the fullest row block of the even token split of the benchmark's sample.

    Atoms follow their tokens: ``make_complex`` puts the nucleic acids (about 20 atoms per
    token) after the proteins, so on an even token split the last row block holds more
    atoms than ``A / cp0``; the memory model reads this count.
    """
    sample = make_complex(n_tokens, seed=seed, msa_rows=msa_rows, atom_multiple=32)
    token = sample["atom_to_token"].float().argmax(-1)[sample["atom_pad_mask"] > 0]
    bounds = even_token_bounds(n_tokens, cp0)
    return max(int(((token >= lo) & (token < hi)).sum()) for lo, hi in zip(bounds[:-1], bounds[1:]))


def step_shape(row: Mapping[str, Any]) -> memory_model.StepShape:
    """The :class:`~benchmarks.memory_model.StepShape` of a stored row."""
    shape = shape_for(
        sizes_of(row), row["N"], row["A"], row["S"], row["cp0"], row["cp1"], row["param_bytes"]
    )
    atoms = largest_row_atoms(row["N"], row["S"], row.get("seed") or 0, row["cp0"])
    return shape.with_(atoms_rank=float(atoms))


def shape_for(
    sizes: TrunkSizes, n: int, atoms: int, depth: int, cp0: int, cp1: int, param_bytes: float
) -> memory_model.StepShape:
    """The model's view of a step: sizes, ``N``, ``A``, ``S``, mesh; parameters + gradients."""
    return memory_model.StepShape(
        n_tokens=n,
        n_atoms=atoms,
        msa_depth=depth,
        cp0=cp0,
        cp1=cp1,
        token_s=sizes.token_s,
        token_z=sizes.token_z,
        msa_s=sizes.msa_s,
        atom_s=sizes.atom_s,
        atom_z=sizes.atom_z,
        pairformer_blocks=sizes.pairformer_blocks,
        msa_blocks=sizes.msa_blocks,
        pair_heads=sizes.pairwise_num_heads,
        atom_depth=sizes.atom_encoder_depth,
        param_bytes=2.0 * param_bytes,  # parameters and their gradients
    )


def scaled_shape(ref: Mapping[str, Any], n: int, cp0: int, cp1: int) -> memory_model.StepShape:
    """The step of a measured row's sizes at another ``N`` and mesh (main sizes).

    Atoms, and the atoms of the fullest row block, scale with ``N`` as in ``ref``.
    """
    shape = step_shape(ref)
    per_token = ref["A"] / ref["N"]
    fullest = shape.atoms_rank * ref["cp0"] / cp0 / ref["N"]  # atoms per token, fullest row
    return shape_for(BASE, n, int(per_token * n), ref["S"], cp0, cp1, ref["param_bytes"]).with_(
        atoms_rank=fullest * n
    )


def split_points(
    rows: Sequence[Mapping[str, Any]],
) -> tuple[list[Mapping[str, Any]], list[Mapping[str, Any]]]:
    """``(fit, held out)`` of the fp32 points without checkpointing (what the model
    describes): held out is the largest N of every mesh of the main sizes."""
    usable = [r for r in rows if r.get("peak_MiB") and sizes_of(r).measured_as_modelled]
    top: dict[str, int] = {}
    for r in usable:
        if r["config"] == BASE.label():
            top[r["mesh"]] = max(top.get(r["mesh"], 0), r["N"])
    held = [r for r in usable if r["config"] == BASE.label() and r["N"] == top[r["mesh"]]]
    fitted = [r for r in usable if r not in held]
    return fitted, held


@dataclass
class Prediction:
    """One scenario of the Boltz-2 predictions.

    Attributes
    ----------
    name : str
        What the scenario assumes.
    scale : float
        Factor on the fitted activation terms (0.5: bf16 activations).
    checkpoint : bool
        Per-block activation checkpointing: block terms counted for one block, plus the
        fp32/bf16 pair (and MSA) input that each block keeps.
    """

    name: str
    scale: float = 1.0
    checkpoint: bool = False


SCENARIOS = (
    Prediction("fp32, no checkpointing (the measured setting)"),
    Prediction("fp32, checkpoint per block", checkpoint=True),
    Prediction("bf16 activations, checkpoint per block", scale=0.5, checkpoint=True),
)

PREDICTION_MESHES = ((1, 1), (4, 4), (8, 8))
GPU_BYTES = 80e9
RESERVE_BYTES = 8e9
"""Per-GPU budget of the predictions: 80 GB minus 8 GB (CUDA context, allocator slack,
communication buffers)."""


def predict_boltz2(
    model: memory_model.MemoryModel,
    n: int,
    cp: tuple[int, int],
    scenario: Prediction,
    param_count: int,
) -> float:
    """Predicted per-rank peak bytes of a Boltz-2 trunk step (see :class:`Prediction`).

    Adam's two moments (``8 x param_count`` bytes) are added: a training step holds them.
    """
    sizes = BOLTZ2
    atoms = BOLTZ2_ATOMS_PER_TOKEN * n
    shape = shape_for(sizes, n, atoms, sizes.msa_rows, cp[0], cp[1], 4.0 * param_count)
    return scenario_bytes(model, shape, sizes, scenario) + 8.0 * param_count


def scenario_bytes(
    model: memory_model.MemoryModel,
    shape: memory_model.StepShape,
    sizes: TrunkSizes,
    scenario: Prediction,
) -> float:
    """Per-rank peak bytes of the step ``shape`` under a scenario (no optimizer state).

    The fitted terms, scaled by ``scenario.scale``; with ``scenario.checkpoint``, the block
    terms of one block of each stack (in a checkpointed backward one block is live at a
    time: counting one of each is conservative) plus every block's saved input (the pair
    tile, and the MSA rows of the MSA blocks).
    """
    blocks = shape.pairformer_blocks + shape.msa_blocks
    if scenario.checkpoint:
        shape = shape.with_(pairformer_blocks=1, msa_blocks=1)
    terms = model.terms(shape)
    activations = sum(v for k, v in terms.items() if k != "params")
    total = terms["params"] + scenario.scale * activations
    if scenario.checkpoint:
        n0, n1 = math.ceil(shape.n_tokens / shape.cp0), math.ceil(shape.n_tokens / shape.cp1)
        msa_rows = math.ceil(shape.msa_depth / shape.cp0)
        kept = n0 * n1 * sizes.token_z * blocks + msa_rows * n1 * sizes.msa_s * sizes.msa_blocks
        total += 4.0 * scenario.scale * kept
    return float(total)


def scenario_of(sizes: TrunkSizes) -> Prediction:
    """The scenario that describes a measured mode (bf16: activations at half the bytes)."""
    return Prediction(
        sizes.mode,
        scale=0.5 if sizes.precision == "bf16" else 1.0,
        checkpoint=sizes.checkpointing,
    )


def scenario_checks(
    model: memory_model.MemoryModel, rows: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """The scenarios' predictions against the measured peaks of every checkpointed or bf16
    row (and the fp32 rows measured beside them), one row each; not of the steps whose
    kernels keep their scores for backward, which no scenario describes."""
    plain = {
        (r["mesh"], sizes_of(r).plain(), r["N"])
        for r in rows
        if not sizes_of(r).measured_as_modelled
    }
    out = []
    for r in rows:
        sizes = sizes_of(r)
        key = (r["mesh"], sizes.plain(), r["N"])
        if key not in plain or not r.get("peak_MiB") or not sizes.kernel_recompute:
            continue
        predicted = scenario_bytes(model, step_shape(r), sizes, scenario_of(sizes)) / MIB
        out.append(
            {
                "mesh": r["mesh"],
                "config": key[1].label(),
                "N": r["N"],
                "mode": sizes.mode,
                "measured": r["peak_MiB"],
                "predicted": predicted,
                "error": predicted / r["peak_MiB"] - 1,
            }
        )
    return sorted(out, key=lambda c: (c["config"], c["mesh"], c["N"], c["mode"]))


CHECK_COLUMNS = [
    ("mesh", "mesh"),
    ("config", "sizes"),
    ("N", "N"),
    ("mode", "mode"),
    ("measured", "measured MiB / rank"),
    ("predicted", "scenario's prediction MiB"),
    ("error_text", "error"),
]


def largest_measured(rows: Sequence[Mapping[str, Any]], budget_mib: float) -> dict[str, Any]:
    """Per mesh (main sizes): the largest measured N whose peak fits, and the next one tried."""
    out: dict[str, Any] = {}
    for r in rows:
        if r["config"] != BASE.label() or not r.get("peak_MiB"):
            continue
        item = out.setdefault(r["mesh"], {"fits": None, "over": None})
        if r["peak_MiB"] <= budget_mib:
            item["fits"] = max(item["fits"] or 0, r["N"])
        else:
            item["over"] = min(item["over"] or 1 << 30, r["N"])
    return out


def draw(
    rows: Sequence[Mapping[str, Any]],
    model: memory_model.MemoryModel | None,
    held: Sequence[Mapping[str, Any]],
    path: Path,
) -> Path:
    """Peak MiB per rank vs N per mesh (main sizes): measured points and model curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    base = [r for r in rows if r["config"] == BASE.label() and r.get("peak_MiB")]
    meshes = sorted({(r["ranks_n"], r["mesh"], r["cp0"], r["cp1"]) for r in base})
    held_ids = {(r["mesh"], r["N"]) for r in held}
    for _, mesh, cp0, cp1 in meshes:
        pts = sorted((r["N"], r["peak_MiB"], r) for r in base if r["mesh"] == mesh)
        xs = [p[0] for p in pts]
        (line,) = axes[0].plot(xs, [p[1] for p in pts], "o", label=f"{mesh} measured")
        out = [(p[0], p[1]) for p in pts if (mesh, p[0]) in held_ids]
        if out:
            axes[0].plot(*zip(*out), "s", mfc="none", ms=11, color=line.get_color())
        if model is not None:
            ref = pts[-1][2]
            grid = np.linspace(min(xs) * 0.8, max(xs) * 1.3, 60)
            curve = [model.predict(scaled_shape(ref, int(n), cp0, cp1)) / MIB for n in grid]
            axes[0].plot(grid, curve, "-", color=line.get_color(), alpha=0.7, label=f"{mesh} model")
        ratio = [(r["N"], r["peak_this_over_1x1"]) for r in rows_with(base, mesh)]
        if ratio and mesh != "1x1":
            axes[1].plot(*zip(*ratio), "o-", color=line.get_color(), label=mesh)
    for mesh, target in TARGETS.items():
        axes[1].axhline(target, linestyle="--", color="gray")
        axes[1].text(axes[1].get_xlim()[0], target, f" {mesh} target", fontsize=8, va="bottom")
    axes[0].set_xlabel("tokens N")
    axes[0].set_ylabel("peak tensor MiB per rank (max over ranks)")
    axes[0].set_yscale("log")
    axes[0].set_title("measured (squares: held out of the fit) and model")
    axes[1].set_xlabel("tokens N")
    axes[1].set_ylabel("peak per rank: this mesh / 1x1")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"Boltz-2 trunk training step (fwd + bwd, distogram loss), sizes {BASE.label()}")
    return common.save_figure(fig, path, dpi=100)


def rows_with(rows: Sequence[Mapping[str, Any]], mesh: str) -> list[Mapping[str, Any]]:
    """Rows of ``mesh`` with a ratio, by N."""
    return sorted(
        (r for r in rows if r["mesh"] == mesh and r.get("peak_this_over_1x1")),
        key=lambda r: r["N"],
    )


def stored_rows(results: Path) -> list[dict[str, Any]]:
    """The ``trunk`` rows already in ``results/summary.json``."""
    path = results / "summary.json"
    if not path.exists():
        return []
    return [dict(r) for r in json.loads(path.read_text()).get(BENCHMARK, {}).get("rows", [])]


def model_sections(
    merged: Sequence[Mapping[str, Any]], budget_mib: float, param_count: int | None
) -> tuple[list[tuple[str, str]], memory_model.MemoryModel | None, list[Mapping[str, Any]]]:
    """Markdown sections of the fit, the held-out check, the budget and the predictions."""
    fitted, held = split_points(merged)
    if len(fitted) < len(memory_model.TERMS):
        text = (
            f"{len(fitted)} points to fit {len(memory_model.TERMS)} terms: "
            "run more sizes or meshes first."
        )
        return [("Memory model", text)], None, held
    model = memory_model.fit([step_shape(r) for r in fitted], [r["peak_MiB"] * MIB for r in fitted])
    checks = memory_model.check(
        model, [step_shape(r) for r in held], [r["peak_MiB"] * MIB for r in held]
    )
    check_rows = [
        {
            "mesh": r["mesh"],
            "N": r["N"],
            "measured": c["measured"] / MIB,
            "predicted": c["predicted"] / MIB,
            "error": f"{100 * c['error']:+.1f} %",
            "ok": abs(c["error"]) <= HOLDOUT_TOLERANCE,
        }
        for r, c in zip(held, checks)
    ]
    fit_checks = memory_model.check(
        model, [step_shape(r) for r in fitted], [r["peak_MiB"] * MIB for r in fitted]
    )
    worst_fit = max(abs(c["error"]) for c in fit_checks)
    coef_rows = [
        {"term": t, "bytes_per_element": v, "fp32_copies": v / 4}
        for t, v in model.coefficients.items()
    ]
    sections = [
        (
            "Memory model: fitted coefficients",
            "Terms (benchmarks/memory_model.py): per-rank element counts, largest rank; "
            "parameters + gradients are known bytes, not fitted. Non-negative least squares "
            f"on the relative error over {len(fitted)} points (every size and mesh measured, "
            "less the held-out points below); largest relative error on the fitted points "
            f"{100 * worst_fit:.1f} %.\n\n"
            + common.markdown_table(
                [
                    ("term", "term"),
                    ("bytes_per_element", "bytes / element"),
                    ("fp32_copies", "fp32 copies"),
                ],
                coef_rows,
            ),
        ),
        (
            "Memory model: held-out check (largest N of every mesh, main sizes)",
            f"Each within {100 * HOLDOUT_TOLERANCE:.0f} %: "
            + common.fmt(all(r["ok"] for r in check_rows))
            + "\n\n"
            + common.markdown_table(
                [
                    ("mesh", "mesh"),
                    ("N", "N"),
                    ("measured", "measured MiB"),
                    ("predicted", "predicted MiB"),
                    ("error", "error"),
                    ("ok", f"within {100 * HOLDOUT_TOLERANCE:.0f} %"),
                ],
                check_rows,
            ),
        ),
    ]
    # Budget on this machine, main sizes: measured, and from the model.
    measured = largest_measured(merged, budget_mib)
    base = [r for r in merged if r["config"] == BASE.label() and r.get("peak_MiB")]
    budget_rows = []
    for mesh in sorted({(r["ranks_n"], r["mesh"], r["cp0"], r["cp1"]) for r in base}):
        _, name, cp0, cp1 = mesh
        ref = max((r for r in base if r["mesh"] == name), key=lambda r: r["N"])
        n_model = memory_model.largest_fitting(
            lambda n, cp0=cp0, cp1=cp1, ref=ref: model.predict(scaled_shape(ref, n, cp0, cp1)),
            budget_mib * MIB,
            low=8,
            high=1 << 16,
        )
        m = measured.get(name, {})
        budget_rows.append(
            {
                "mesh": name,
                "measured_fits": m.get("fits"),
                "measured_over": m.get("over"),
                "model": n_model,
            }
        )
    sections.append(
        (
            f"Largest N within {budget_mib:.0f} MiB per rank (main sizes, this CPU)",
            "measured: the largest N run whose peak fit (and the smallest that did not, if "
            "one was run); model: the fitted model's largest N (extrapolated past the "
            "measured range where it exceeds it).\n\n"
            + common.markdown_table(
                [
                    ("mesh", "mesh"),
                    ("measured_fits", "largest measured N that fits"),
                    ("measured_over", "smallest measured N over"),
                    ("model", "largest N, model"),
                ],
                budget_rows,
            ),
        )
    )
    checks = scenario_checks(model, merged)
    if checks:
        for c in checks:
            c["error_text"] = f"{100 * c['error']:+.1f} %"
        sections.append(
            (
                "The predictions' scenarios against measured checkpointed and bf16 steps",
                "Each measured mode predicted as the table below predicts Boltz-2 "
                "(:func:`scenario_bytes`: the fitted fp32 terms; checkpointing counts one "
                "block of each stack plus every block's saved input; bf16 halves the "
                "activation terms), at the measured step's sizes, N and mesh.\n\n"
                + common.markdown_table(CHECK_COLUMNS, checks),
            )
        )
    if param_count:
        sections.append(
            (
                "Predictions for Boltz-2's trunk on 80 GB GPUs",
                boltz2_table(model, param_count, checks),
            )
        )
    return sections, model, held


def basis_of(scenario: Prediction, checks: Sequence[Mapping[str, Any]]) -> str:
    """What stands behind a scenario's predictions: always an extrapolation (no GPU step
    was measured), and how the scenario predicted the steps measured in its mode."""
    mode = mode_name(scenario.checkpoint, "bf16" if scenario.scale < 1 else "fp32")
    mine = [c for c in checks if c["mode"] == mode]
    if not mine:
        return f"extrapolated; {mode} not measured"
    errors = [100 * c["error"] for c in mine]
    largest = max(c["N"] for c in mine)
    return (
        f"extrapolated; {mode} measured at {len(mine)} points (N <= {largest}, "
        f"{', '.join(sorted({c['mesh'] for c in mine}))}): prediction error "
        f"{min(errors):+.0f} to {max(errors):+.0f} %"
    )


def boltz2_table(
    model: memory_model.MemoryModel,
    param_count: int,
    checks: Sequence[Mapping[str, Any]] = (),
) -> str:
    """Markdown: Boltz-2 per-rank memory at a few N and the largest N, per scenario and mesh,
    each entry with its basis (:func:`basis_of` over the scenario checks)."""
    budget = GPU_BYTES - RESERVE_BYTES
    rows = []
    for scenario in SCENARIOS:
        for cp in PREDICTION_MESHES:
            row: dict[str, Any] = {
                "scenario": scenario.name,
                "mesh": f"{cp[0]}x{cp[1]}",
                "basis": basis_of(scenario, checks),
            }
            for n in (512, 1024, 2048, 5120):
                row[f"n{n}"] = predict_boltz2(model, n, cp, scenario, param_count) / 1e9
            row["largest"] = memory_model.largest_fitting(
                lambda n, cp=cp, s=scenario: predict_boltz2(model, n, cp, s, param_count),
                budget,
                low=16,
                high=1 << 17,
            )
            rows.append(row)
    cols = [
        ("scenario", "assumption"),
        ("mesh", "mesh"),
        ("n512", "GB/rank N=512"),
        ("n1024", "N=1024"),
        ("n2048", "N=2048"),
        ("n5120", "N=5120"),
        ("largest", f"largest N in {budget / 1e9:.0f} GB"),
        ("basis", "basis"),
    ]
    s = BOLTZ2
    return (
        f"Boltz-2 sizes: token_s {s.token_s}, token_z {s.token_z}, atom_s {s.atom_s}, atom_z "
        f"{s.atom_z}, msa_s {s.msa_s}, {s.msa_blocks} MSA blocks, {s.pairformer_blocks} "
        f"Pairformer blocks (boltz.main PairformerArgsV2), triangle attention "
        f"{s.pairwise_num_heads} heads x {s.pairwise_head_width}, atom encoder depth "
        f"{s.atom_encoder_depth}, MSA depth {s.msa_rows} (subsampled), "
        f"{BOLTZ2_ATOMS_PER_TOKEN} atoms per token, {param_count / 1e6:.1f} M trunk parameters "
        "(counted from Boltz's modules). Per-rank bytes: parameters + gradients (fp32) + "
        "Adam moments (fp32) + the fitted activation terms at these sizes; budget "
        f"{GPU_BYTES / 1e9:.0f} GB - {RESERVE_BYTES / 1e9:.0f} GB reserve. Every entry is "
        "an extrapolation of the model fitted to the fp32 steps without checkpointing "
        "measured here (this project's distributed forwards: flash-style triangle "
        "attention, chunked outer product mean). The other scenarios change the fitted "
        "terms: per-block checkpointing counts the block terms of one Pairformer and one "
        "MSA block (one block is live at a time in a checkpointed backward: conservative) "
        "plus every block's saved input (pair track, and the MSA track of the MSA blocks); "
        "bf16 halves the activation terms (parameters, gradients and Adam stay fp32). The "
        "basis column says how each scenario predicted the steps measured in its mode "
        "(section above).\n\n"
        + common.markdown_table(cols, rows)
        + "\n\nPublished anchors: AF3 folds about 5,120 tokens on one 80 GB GPU (inference, "
        "bf16, chunked, no gradients); Fold-CP reports over 30,000 residues on 64 GPUs."
    )


def write_results(
    rows: Sequence[Mapping[str, Any]],
    command: str,
    results: Path,
    budget_mib: float = 512.0,
    param_count: int | None = None,
) -> list[Path]:
    """Merge this launch's rows with the stored ones; rewrite ``trunk.md``, ``.png``, summary.

    ``param_count`` (Boltz-2's trunk parameters, for the predictions) is stored with the
    rows; a launch without it (``--no-predictions``) uses the stored one.
    """
    fresh = {(r["mesh"], r["config"], r["N"]) for r in rows}
    kept = [r for r in stored_rows(results) if (r["mesh"], r["config"], r["N"]) not in fresh]
    new = [{k: r.get(k) for k in _STORED} for r in rows]
    for r in new:
        r["command"] = command
        r["boltz2_params"] = param_count
    merged = with_ratios(kept + new)
    param_count = param_count or max((r.get("boltz2_params") or 0 for r in merged), default=0)
    summary = common.merge_summary(BENCHMARK, merged, SUMMARY_KEY, COLUMNS, results)
    common.merge_summary(
        PER_MESH,
        per_mesh_rows(merged),
        ("mesh",),
        PER_MESH_COLUMNS,
        results,
        replace=True,
        first=True,
    )
    commands = "\n".join(
        f"- {m} {c}: `{cmd}`"
        for m, c, cmd in sorted({(r["mesh"], r["config"], r.get("command") or "?") for r in merged})
    )
    sources = sorted({f"{r.get('device')}: {r.get('memory_source')}" for r in merged})
    environment = (
        f"launches (one per mesh and sizes):\n\n{commands}\n\n"
        f"torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} CPU cores; load "
        f"average at the end of the last launch {common.load_average()}\n\n"
        f"peak memory from: {'; '.join(sources)}\n\n"
        f"main sizes `{BASE.label()}`: `{json.dumps(BASE.to_dict(), sort_keys=True)}`; "
        "Boltz2Trunk, recycling_steps=0, train mode, fp32, init noise "
        f"{merged[0].get('init_noise') if merged else '-'}\n\n"
        "every rank found the same loss: "
        + common.fmt(all(r.get("losses_agree") for r in merged))
        + "; every loss within tolerance of the serial loss (relative; fp32 1e-4, bf16 2e-3): "
        + common.fmt(all(r.get("loss_ok") for r in merged))
    )
    targets = []
    for mesh, target in TARGETS.items():
        pts = rows_with([r for r in merged if r["config"] == BASE.label()], mesh)
        if not pts:
            targets.append(f"- {mesh}: not measured")
            continue
        top = pts[-1]
        ratio = top["peak_this_over_1x1"]
        targets.append(
            f"- {mesh}: peak per rank / 1x1 <= {target:.2f} at the largest N: N = {top['N']}, "
            f"{ratio:.3f}, {'met' if ratio <= target else 'NOT met'}"
        )
    sections, model, held = model_sections(merged, budget_mib, param_count)
    timings = "\n".join(
        f"- {r['mesh']} {r['config']} N={r['N']}: "
        + ", ".join(f"{t:.2f}" for t in r.get("times") or [])
        for r in merged
    )
    md = common.write_markdown(
        results / f"{BENCHMARK}.md",
        "Trunk benchmark: one Boltz-2 trunk training step per mesh, and a per-rank memory model",
        [
            ("Runs", environment),
            ("Memory, time and loss per rank", common.markdown_table(COLUMNS, merged)),
            ("Targets", "\n".join(targets)),
            (
                "Per mesh at the largest N every mesh ran (one step; counts: the largest rank's)",
                common.markdown_table(PER_MESH_COLUMNS, per_mesh_rows(merged)),
            ),
            (
                "Step time against the serial trunk (Boltz's modules on the whole sample, "
                "timed in the same launch)",
                common.step_time_lines(
                    merged,
                    lambda r: f"{r['mesh']} {r['config']} N={r['N']}",
                    "s",
                    "time_s",
                    "serial_time_s",
                    "time_over_serial",
                ),
            ),
            (
                "ms per step by part (slowest rank; one step with hooks; the Pairformer's ops "
                "summed over its layers)",
                common.markdown_table(PART_COLUMNS, part_rows(merged)),
            ),
            (
                "FLOPs per step: all ranks together against the serial step (by part; torch's "
                "FLOP formulas on each rank's local blocks)",
                common.markdown_table(FLOP_COLUMNS, flop_rows(merged)),
            ),
            (
                "Activation checkpointing and bf16, measured (peak per rank of the same step "
                "in each mode)",
                common.markdown_table(PRECISION_COLUMNS, precision_rows(merged)),
            ),
            *sections,
            ("Every timed step (s, max over ranks)", timings),
        ],
    )
    png = draw(merged, model, held, results / f"{BENCHMARK}.png")
    return [md, png, summary]


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    d = BASE
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_sweep_arguments(p, tokens=(64, 128, 192, 256))
    p.set_defaults(repeats=2)
    p.add_argument("--msa-rows", type=int, default=d.msa_rows, help="MSA depth S")
    p.add_argument("--token-s", type=int, default=d.token_s)
    p.add_argument("--token-z", type=int, default=d.token_z)
    p.add_argument("--msa-s", type=int, default=d.msa_s)
    p.add_argument("--msa-blocks", type=int, default=d.msa_blocks)
    p.add_argument("--pairformer-blocks", type=int, default=d.pairformer_blocks)
    p.add_argument(
        "--widths",
        choices=("small", "boltz2"),
        default="small",
        help="small: the main sizes' widths; boltz2: Boltz-2's widths and head counts",
    )
    p.add_argument(
        "--checkpointing", action="store_true", help="Boltz's activation_checkpointing on"
    )
    p.add_argument("--precision", choices=tuple(LOSS_RTOL), default="fp32")
    p.add_argument(
        "--keep-for-backward",
        action="store_true",
        help="the pair kernels keep their scores for backward (mesh.kernel_recompute=false)",
    )
    p.add_argument("--init-noise", type=float, default=0.05)
    p.add_argument("--budget-mib", type=float, default=512.0, help="per-rank budget of the table")
    p.add_argument(
        "--no-predictions", action="store_true", help="skip Boltz-2's parameter count and table"
    )
    p.add_argument(
        "--memory-steps", type=int, default=3, help="profiled steps (the median peak is kept)"
    )
    common.add_step_arguments(p)
    p.add_argument("--no-flops", action="store_true", help="skip counting the FLOPs")
    common.add_output_arguments(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run every ``--tokens`` size on the launched mesh; rank 0 writes the results."""
    args = build_parser().parse_args(argv)
    cp = common.cp_shape(args.cp)
    sizes = dataclasses.replace(
        BASE,
        msa_rows=args.msa_rows,
        token_s=args.token_s,
        token_z=args.token_z,
        msa_s=args.msa_s,
        msa_blocks=args.msa_blocks,
        pairformer_blocks=args.pairformer_blocks,
        checkpointing=args.checkpointing,
        precision=args.precision,
        kernel_recompute=not args.keep_for_backward,
    )
    if args.widths == "boltz2":
        sizes = dataclasses.replace(sizes, **BOLTZ2_WIDTHS)
    mesh = fc.init_mesh(ddp=1, cp=cp, timeout_s=args.timeout)
    command = common.launch_command("bench_trunk.py", mesh.world_size, argv)
    param_count = None
    if mesh.rank == 0 and not args.no_predictions:
        param_count = parameter_count(BOLTZ2)
    rows = []
    try:
        for n in args.tokens:
            row = run_trunk_benchmark(
                mesh,
                n,
                sizes=sizes,
                repeats=args.repeats,
                seed=args.seed,
                init_noise=args.init_noise,
                serial_check=not args.no_serial_check,
                serial_time=not args.no_serial_time,
                flops=not args.no_flops,
                memory=not args.no_memory,
                memory_steps=args.memory_steps,
            )
            rows.append(row)
            if mesh.rank == 0:
                print(
                    f"{row['mesh']} {row['config']} N={row['N']} A={row['A']} "
                    f"peak {row['peak_MiB'] or 0:.1f} MiB/rank (held {row['held_MiB'] or 0:.1f}, "
                    f"step {row['step_peak_MiB'] or 0:.1f}) step {row['time_s'] or 0:.2f} s "
                    f"loss {row['loss']:.6f} serial {row['serial_loss']} "
                    f"step / serial {common.fmt(row['time_over_serial'])} "
                    f"FLOPs / serial {common.fmt(row['flop_ratio'])}",
                    flush=True,
                )
                paths = write_results(rows, command, args.results, args.budget_mib, param_count)
                for path in paths:
                    print(f"wrote {path}")
    finally:
        with contextlib.suppress(Exception):
            fc.shutdown()
    return 0


__all__ = [
    "BASE",
    "BOLTZ2",
    "COLUMNS",
    "TrunkSizes",
    "build_trunk",
    "parameter_count",
    "predict_boltz2",
    "run_trunk_benchmark",
    "split_points",
    "with_ratios",
    "write_results",
]

if __name__ == "__main__":
    raise SystemExit(main())
