"""Benchmark 2: the cross-axis ops, per op: collectives, bytes and time, against the fallback.

    torchrun --standalone --nproc-per-node 4 benchmarks/bench_ops.py --cp 2 2 --tokens 120 240
    torchrun --standalone --nproc-per-node 9 benchmarks/bench_ops.py --cp 3 3 --tokens 120 240

One synthetic Boltz-2 sample (``make_complex``) is scattered over the ``cp0 x cp1`` mesh
(``scatter_features``, maps tagged by ``tag_maps``); every op of
:mod:`physicsnemo_foldcp.ops` and the Boltz expressions it routes (``torch.bmm`` /
``torch.einsum`` with a tagged map, broadcast views of singles, ``torch.cdist``) runs on
inputs laid out like the sample's features (random singles ``(Shard(1), Replicate())`` with
the token or atom row blocks, pair tiles ``(Shard(1), Shard(2))``), two ways:

``foldcp``
    The call as a model writes it, with this package's handlers.
``fallback``
    The same call on plain ShardTensors (not the plugin's FoldTensors), with the handlers of
    the plugin's own functions taken out of PhysicsNeMo's registry: what PhysicsNeMo does
    without this package, i.e. its own handlers or its DTensor fallback. Where it raises,
    the row says ``fails: <error type>`` and the phase (the messages are listed under the
    table); where its forward runs, its output (``full_tensor()``) is compared with the
    ``foldcp`` one.

Measured per op and path, on every rank: the collectives of the forward and of the backward
(``out.backward(ones)``; none when the output does not require grad), counted by
``CommDebugMode`` and split by kind and mesh dim (``cp0``, ``cp1``, ``domain``); their
bytes (for each collective, the larger of its input and output tensors: an all-gather's
gathered result, a reduce-scatter's full input, an all-reduce's tensor; summed over the
collectives of the phase, largest over the ranks); whether the ``foldcp`` counts are the
documented ones (``physicsnemo_foldcp.ops``; a collective over a mesh dim of size 1 is
skipped); wall time of the forward and of the backward (median over ``--repeats`` runs of
the largest time over the ranks, each between a barrier and a device synchronisation,
after one untimed counting run).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import sys
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor.debug import CommDebugMode

try:
    from benchmarks import common
except ModuleNotFoundError:  # run as a script: the repository root is not on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import common

import physicsnemo_foldcp as fc
from physicsnemo_foldcp import ops
from physicsnemo_foldcp.core import compat
from physicsnemo_foldcp.core.tensor import own_functions
from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.distributed.mesh import FoldMesh

PATHS = ("foldcp", "fallback")
"""The two ways every op runs."""

Counts = dict[tuple[str, str], int]
"""``{(kind, mesh dim): number of collectives}``."""

_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")


# -- counting collectives and their bytes ----------------------------------------------------


def _nbytes(values: Any) -> int:
    return sum(t.numel() * t.element_size() for t in common.tensors_in(values))


def _kind(packet: object) -> str:
    name = str(packet).split(".")[-1]
    for short, long in (
        ("allgather", "all_gather"),
        ("allreduce", "all_reduce"),
        ("alltoall", "all_to_all"),
    ):
        name = name.replace(short, long)
    return next((k for k in _KINDS if k in name), name.strip("_"))


class CollectiveBytes(CommDebugMode):
    """``CommDebugMode`` that also records each collective's mesh dim and bytes.

    Parameters
    ----------
    groups : Mapping[str, str]
        Process-group name -> label (``"cp0"``, ``"cp1"``, ...).

    Attributes
    ----------
    records : list[tuple[str, str, int]]
        ``(kind, label, bytes)`` per collective, in order. ``bytes`` is the larger of the
        collective's input and output tensors (functional collectives), or the size of the
        tensors an in-place ``c10d`` collective writes.
    """

    def __init__(self, groups: Mapping[str, str]):
        super().__init__()
        self.groups = dict(groups)
        self.records: list[tuple[str, str, int]] = []
        # CommDebugMode's own module tracker puts a full backward pre-hook on every module,
        # which passes each module's outputs through an autograd Function that returns
        # them as they are; Boltz's in-place ``q /= ...`` on a view of such an output is
        # then refused by autograd, and a layer Boltz checkpoints (its forward under
        # ``no_grad``) fails the tracker's hook registration. Nothing here reads the
        # tracker's attribution, so it is entered and left once (its state is then what
        # CommDebugMode's counting reads: every collective in the "Global" module) and
        # CommDebugMode's own calls to enter and leave it do nothing.
        tracker = self.advanced_module_tracker
        type(tracker).__enter__(tracker)
        type(tracker).__exit__(tracker)
        tracker.__enter__ = lambda *args: tracker
        tracker.__exit__ = lambda *args: None

    def _label(self, args: Sequence[Any]) -> str:
        for a in args:
            if isinstance(a, torch.ScriptObject):  # an in-place c10d op's group, boxed
                with contextlib.suppress(RuntimeError):
                    a = dist.ProcessGroup.unbox(a)
            name = a if isinstance(a, str) else getattr(a, "group_name", None)
            if isinstance(name, str) and name in self.groups:
                return self.groups[name]
        return "other"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is NotImplemented:
            return out
        from torch.distributed.tensor.debug._comm_mode import c10d_collective_ops

        packet = getattr(func, "_overloadpacket", None)
        if packet is None:
            return out
        if packet in c10d_collective_ops:
            size = _nbytes(out)
        elif packet in self.comm_registry:
            size = max(_nbytes(args), _nbytes(out))
        else:
            return out
        flat = list(args) + list((kwargs or {}).values())
        self.records.append((_kind(packet), self._label(flat), size))
        return out

    def counts(self) -> Counts:
        """``{(kind, label): n}`` of the recorded collectives."""
        out: Counts = {}
        for kind, label, _ in self.records:
            out[(kind, label)] = out.get((kind, label), 0) + 1
        return out

    def total_bytes(self) -> int:
        """Bytes of all recorded collectives."""
        return sum(b for _, _, b in self.records)

    def debug_total(self) -> int:
        """``CommDebugMode``'s own total count (equals ``len(records)``)."""
        return int(sum(self.get_comm_counts().values()))


def group_labels(mesh: FoldMesh) -> dict[str, str]:
    """Process-group names of the mesh -> ``cp0``, ``cp1``, ``domain``, ``world``."""
    labels: dict[str, str] = {}
    dm = mesh.domain_mesh
    for k, label in enumerate(("cp0", "cp1")):
        labels[dm.get_group(k).group_name] = label
    with contextlib.suppress(Exception):
        labels.setdefault(mesh.domain_group.group_name, "domain")
    with contextlib.suppress(Exception):
        labels.setdefault(dist.group.WORLD.group_name, "world")
    return labels


def describe_counts(counts: Mapping[tuple[str, str], int]) -> str:
    """``"all_gather cp0 x1, all_reduce cp1 x2"``, or ``"none"``."""
    if not counts:
        return "none"
    return ", ".join(f"{k} {d} x{n}" for (k, d), n in sorted(counts.items()))


# -- PhysicsNeMo without this package ---------------------------------------------------------


@contextlib.contextmanager
def physicsnemo_default() -> Iterator[None]:
    """The plugin's own function handlers out of PhysicsNeMo's registry for the block.

    Together with plain ShardTensor inputs (:func:`untagged`), every call then takes
    PhysicsNeMo's dispatch exactly as it is without this package.
    """
    with compat.function_handlers_removed(tuple(own_functions())):
        yield


# -- inputs -----------------------------------------------------------------------------------


def _from_local(
    local: torch.Tensor,
    like: ShardTensor,
    shapes: dict[int, list[tuple[int, ...]]],
    plugin: bool = True,
) -> ShardTensor:
    if plugin:
        return ops.wrap(local, like.device_mesh, like.placements, shapes)
    return ShardTensor.from_local(local, like.device_mesh, like.placements, sharding_shapes=shapes)


def _shapes(x: ShardTensor) -> dict[int, list[tuple[int, ...]]]:
    return {k: list(v) for k, v in compat.sharding_shapes(x).items()}


def untagged(x: ShardTensor) -> ShardTensor:
    """A plain ShardTensor (not the plugin's) with the same local block and spec."""
    return _from_local(compat.local_tensor(x), x, _shapes(x), plugin=False)


@dataclass
class Inputs:
    """Builds the inputs of the ops on this rank, laid out like the scattered sample.

    Attributes
    ----------
    features : Mapping[str, Any]
        The scattered, tagged sample.
    channels : int
        Channels of the random singles and tiles.
    heads : int
        Attention heads (``channels`` is split into ``heads x channels // heads``).
    tagged : bool
        Whether maps keep their tags (``foldcp``) or are plain ShardTensors (``fallback``).
    """

    features: Mapping[str, Any]
    channels: int = 32
    heads: int = 2
    tagged: bool = True

    def feature(self, name: str) -> ShardTensor:
        """A feature of the sample (untagged for the fallback)."""
        x = self.features[name]
        return x if self.tagged else untagged(x)

    def _values(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        return torch.randn(shape, generator=g)

    def rows(self, like: str, trailing: tuple[int, ...], name: str) -> ShardTensor:
        """Random ``[1, L, *trailing]`` leaf, ``(Shard(1), Replicate())``, rows of ``like``."""
        ref = self.features[like]
        shapes = _shapes(ref)
        sizes = [int(s[1]) for s in shapes[0]]
        i = ref.device_mesh.get_coordinate()[0]
        start = sum(sizes[:i])
        full = self._values(name, (1, sum(sizes), *trailing))
        local = full[:, start : start + sizes[i]].clone().to(ref.device)
        local.requires_grad_(True)
        new = {k: [(*s[:2], *trailing) for s in v] for k, v in shapes.items()}
        return _from_local(local, ref, new, self.tagged)

    def tile(self, trailing: tuple[int, ...], name: str) -> ShardTensor:
        """Random ``[1, N, N, *trailing]`` leaf, the pair tile of ``token_bonds``."""
        ref = self.features["token_bonds"]
        shapes = _shapes(ref)
        rows = [int(s[1]) for s in shapes[0]]
        cols = [int(s[2]) for s in shapes[1]]
        i, j = ref.device_mesh.get_coordinate()
        r0, c0 = sum(rows[:i]), sum(cols[:j])
        full = self._values(name, (1, sum(rows), sum(cols), *trailing))
        local = full[:, r0 : r0 + rows[i], c0 : c0 + cols[j]].clone()
        local = local.to(ref.device).requires_grad_(True)
        new = {k: [(*s[:3], *trailing) for s in v] for k, v in shapes.items()}
        return _from_local(local, ref, new, self.tagged)

    def mask_rows(self) -> ShardTensor:
        """``token_pad_mask`` as a float leaf that requires grad."""
        ref = self.features["token_pad_mask"]
        local = compat.local_tensor(ref).float().clone().requires_grad_(True)
        return _from_local(local, ref, _shapes(ref), self.tagged)


OpFn = Callable[[Inputs], Callable[[], torch.Tensor]]


def _tokens_to_atoms(x: Inputs):
    s, m = x.rows("res_type", (x.channels,), "s"), x.feature("atom_to_token")
    return lambda: ops.tokens_to_atoms(s, m)


def _atoms_to_tokens_mean(x: Inputs):
    q, m = x.rows("ref_pos", (x.channels,), "q"), x.feature("atom_to_token")
    return lambda: ops.atoms_to_tokens_mean(q, m)


def _representative_atoms(x: Inputs):
    c, m = x.rows("ref_pos", (3,), "coords"), x.feature("token_to_rep_atom")
    return lambda: ops.representative_atoms(c, m)


def _outer_sum(x: Inputs):
    a, b = x.rows("res_type", (x.channels,), "a"), x.rows("res_type", (x.channels,), "b")
    return lambda: ops.outer_sum(a, b)


def _relpos(x: Inputs):
    ids = [x.feature(k) for k in ("residue_index", "token_index", "asym_id", "entity_id", "sym_id")]
    return lambda: ops.relative_position_encoding(*ids)


def _pair_distances(x: Inputs):
    c = x.rows("res_type", (3,), "centers")
    return lambda: ops.pair_distances(c, c)


def _pair_mask(x: Inputs):
    m = x.mask_rows()
    return lambda: ops.pair_mask(m)


def _masked_mean(x: Inputs):
    z = x.tile((), "errors")
    mask = ops.pair_mask(x.features["token_pad_mask"])  # an input: built by the handler
    if not x.tagged:
        mask = untagged(mask.detach())
    return lambda: ops.masked_mean(z, mask)


def _attention(x: Inputs):
    h, d = x.heads, x.channels // x.heads
    q, k, v = (x.rows("res_type", (h, d), n) for n in ("q", "k", "v"))
    bias = x.tile((h,), "bias")
    mask = x.feature("token_pad_mask")
    return lambda: ops.pair_bias_attention(q, k, v, bias, mask)


def _bmm_a2t(x: Inputs):
    s, m = x.rows("res_type", (x.channels,), "s"), x.feature("atom_to_token")
    return lambda: torch.bmm(m.float(), s)


def _bmm_mean(x: Inputs):
    q, m = x.rows("ref_pos", (x.channels,), "q"), x.feature("atom_to_token")

    def call() -> torch.Tensor:
        w = m.float()
        w = w / (w.sum(1, keepdim=True) + 1e-6)
        return torch.bmm(w.transpose(1, 2), q)

    return call


def _einsum_rep(x: Inputs):
    c, m = x.rows("ref_pos", (3,), "coords"), x.feature("token_to_rep_atom")
    return lambda: torch.einsum("bta,bac->btc", m.float(), c)


def _view_outer_sum(x: Inputs):
    a, b = x.rows("res_type", (x.channels,), "a"), x.rows("res_type", (x.channels,), "b")
    return lambda: a[:, :, None] + b[:, None, :]


def _cdist(x: Inputs):
    c = x.rows("res_type", (3,), "centers")
    return lambda: torch.cdist(c, c)


_NONE: dict[str, int] = {}
_PAIR_FWD = {"all_gather cp0": 1}
_PAIR_BWD = {"reduce_scatter cp0": 1, "all_reduce cp1": 1}

OPS: dict[str, tuple[OpFn, dict[str, int], dict[str, int]]] = {
    "tokens_to_atoms": (_tokens_to_atoms, _NONE, _NONE),
    "atoms_to_tokens_mean": (_atoms_to_tokens_mean, _NONE, _NONE),
    "representative_atoms": (_representative_atoms, _NONE, _NONE),
    "outer_sum": (_outer_sum, _PAIR_FWD, _PAIR_BWD),
    "relative_position_encoding": (_relpos, _PAIR_FWD, _NONE),
    "pair_distances": (_pair_distances, _PAIR_FWD, _PAIR_BWD),
    "pair_mask": (_pair_mask, _PAIR_FWD, _PAIR_BWD),
    "masked_mean": (_masked_mean, {"all_reduce cp0": 1, "all_reduce cp1": 1}, _NONE),
    "pair_bias_attention": (
        _attention,
        {"all_gather cp0": 1, "all_reduce cp1": 2},
        _PAIR_BWD,
    ),
    "bmm(a2t.float(), s)": (_bmm_a2t, _NONE, _NONE),
    "bmm(mean(a2t).mT, q)": (_bmm_mean, _NONE, _NONE),
    "einsum(bta,bac->btc, t2r, x)": (_einsum_rep, _NONE, _NONE),
    "a[:, :, None] + b[:, None, :]": (_view_outer_sum, _PAIR_FWD, _PAIR_BWD),
    "torch.cdist(x, x)": (_cdist, _PAIR_FWD, _PAIR_BWD),
}
"""Op label -> (input builder, documented forward, documented backward collectives).

Documented counts are keyed ``"<kind> <mesh dim>"`` as :mod:`physicsnemo_foldcp.ops`
states them (the ``masked_mean`` case reduces a pair tile over every axis: one all-reduce
per mesh dim)."""


def documented(counts: Mapping[str, int], cp: tuple[int, int]) -> Counts:
    """The documented counts on a mesh: collectives over a mesh dim of size 1 are skipped."""
    sizes = {"cp0": cp[0], "cp1": cp[1]}
    out: Counts = {}
    for key, n in counts.items():
        kind, dim = key.split()
        if sizes[dim] > 1:
            out[(kind, dim)] = n
    return out


# -- running ----------------------------------------------------------------------------------


def _error(exc: BaseException) -> str:
    return type(exc).__name__


def _message(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:200]}"


def _agree(error: str | None) -> str | None:
    """The first error over the ranks (the same answer on every rank), else ``None``."""
    errors = [e for e in common.gather_rows(error) if e]
    return errors[0] if errors else None


def _ones_like(out: ShardTensor) -> torch.Tensor:
    if not isinstance(out, ShardTensor):
        return torch.ones_like(out)
    shapes = compat.sharding_shapes(out)
    return ShardTensor.from_local(
        torch.ones_like(compat.local_tensor(out)),
        out.device_mesh,
        out.placements,
        sharding_shapes={k: list(v) for k, v in shapes.items()} if shapes else "infer",
    )


@contextlib.contextmanager
def _path(path: str) -> Iterator[None]:
    if path == "fallback":
        with physicsnemo_default():
            yield
    else:
        yield


def _not_run(status: str) -> dict[str, Any]:
    return {
        "status": status,
        "message": None,
        "fwd": None,
        "bwd": None,
        "fwd_bytes": None,
        "bwd_bytes": None,
        "out_bytes": None,
        "fwd_times": [],
        "bwd_times": [],
        "output": None,
        "placements": None,
    }


def run_op(
    name: str,
    path: str,
    features: Mapping[str, Any],
    mesh: FoldMesh,
    *,
    channels: int = 32,
    heads: int = 2,
    repeats: int = 3,
) -> dict[str, Any]:
    """Count, check and time one op on one path (call on every rank).

    When the backward fails, the forward alone is timed.

    Returns
    -------
    dict
        This rank's figures: ``status``, forward / backward counts and bytes, the local
        output (detached, for comparison), and the timed runs.
    """
    build = OPS[name][0]
    groups = group_labels(mesh)
    result: dict[str, Any] = {"status": "ok", "fwd": None, "bwd": None, "fwd_times": []}
    result.update(bwd_times=[], fwd_bytes=None, bwd_bytes=None, output=None, placements=None)
    result["out_bytes"] = None
    result["message"] = None

    def fresh() -> Callable[[], torch.Tensor]:
        return build(Inputs(features, channels, heads, tagged=path == "foldcp"))

    # Counting run.
    error, out = None, None
    with _path(path):
        try:
            call = fresh()
            with CollectiveBytes(groups) as fwd:
                out = call()
        except Exception as exc:  # noqa: BLE001 - the fallback's failure is a result
            error = f"fails (forward): {_error(exc)}"
            result["message"] = _message(exc)
    error = _agree(error)
    if error:
        result["status"] = error
        return result
    result["fwd"], result["fwd_bytes"] = fwd.counts(), fwd.total_bytes()
    result["fwd_debug_total"] = fwd.debug_total()
    result["placements"] = str(tuple(out.placements)) if isinstance(out, ShardTensor) else "-"
    result["output"] = out
    local = compat.local_tensor(out) if isinstance(out, ShardTensor) else out
    result["out_bytes"] = local.numel() * local.element_size()
    backward = out.requires_grad
    if backward:
        with _path(path):
            try:
                grad = _ones_like(out)
                with CollectiveBytes(groups) as bwd:
                    out.backward(grad)
            except Exception as exc:  # noqa: BLE001
                error = f"fails (backward): {_error(exc)}"
                result["message"] = _message(exc)
        error = _agree(error)
        if error:
            result["status"] = error
            backward = False
        else:
            result["bwd"], result["bwd_bytes"] = bwd.counts(), bwd.total_bytes()
            result["bwd_debug_total"] = bwd.debug_total()
    del out
    # Timed runs.
    for _ in range(repeats):
        with _path(path):
            call = fresh()
            t = common.time_collective(call, mesh.device)
            result["fwd_times"].append(t.wall)
            if backward:
                out = t.result
                grad = _ones_like(out)
                step = functools.partial(out.backward, grad)
                result["bwd_times"].append(common.time_collective(step, mesh.device).wall)
    return result


def compare_outputs(out: Any, reference: Any) -> str:
    """``"equal"`` / ``"differs"``: the whole outputs (``full_tensor()``), on every rank.

    ``"not compared: <error>"`` when an output cannot be assembled. Collective.
    """
    error, verdict = None, None
    try:
        b = reference.full_tensor() if isinstance(reference, ShardTensor) else reference
        a = out.full_tensor() if isinstance(out, ShardTensor) else out
        same = a.shape == b.shape and torch.allclose(
            a.detach().float(), b.detach().float(), rtol=1e-5, atol=1e-5
        )
        verdict = "equal" if same else "differs"
    except Exception as exc:  # noqa: BLE001
        error = f"not compared: {_error(exc)}"
    error = _agree(error)
    if error:
        return error
    verdicts = common.gather_rows(verdict)
    return "equal" if all(v == "equal" for v in verdicts) else "differs"


def chunk_mismatch(features: Mapping[str, Any]) -> str | None:
    """Why the token blocks of the sample are not the ``torch.chunk`` blocks DTensor assumes.

    Returns ``None`` when the token row blocks (over ``cp0``) and the pair tile's column
    blocks (over ``cp1``) are ``torch.chunk``'s. Otherwise DTensor's redistribution of a
    token-sharded tensor all-gathers blocks of unequal sizes, which gloo does not detect
    (the ranks' next collectives hang).
    """
    rows = [int(s[1]) for s in compat.sharding_shapes(features["res_type"])[0]]
    cols = [int(s[2]) for s in compat.sharding_shapes(features["token_bonds"])[1]]
    n = sum(rows)
    for name, sizes in (("token row blocks", rows), ("pair column blocks", cols)):
        chunks = [len(c) for c in torch.arange(n).chunk(len(sizes))]
        if sizes != chunks:
            return f"{name} {sizes} are not torch.chunk's {chunks}"
    return None


def sample_features(
    mesh: FoldMesh, n_tokens: int, *, seed: int = 0, msa_rows: int = 4
) -> Mapping[str, Any]:
    """One synthetic Boltz-2 sample, scattered over the domain group and tagged."""
    sample = None
    if mesh.is_domain_source:
        serial = make_complex(n_tokens, seed=seed, preset="boltz2", msa_rows=msa_rows)
        sample = {k: v.unsqueeze(0) for k, v in serial.items()}
    features = fc.scatter_features(sample, mesh)
    return ops.tag_maps(features)


def run_ops_benchmark(
    mesh: FoldMesh,
    n_tokens: int,
    *,
    names: Sequence[str] | None = None,
    paths: Sequence[str] = PATHS,
    channels: int = 32,
    heads: int = 2,
    repeats: int = 3,
    seed: int = 0,
    msa_rows: int = 4,
    force_fallback: bool = False,
) -> list[dict[str, Any]]:
    """Every op on both paths at one size; one row per (op, path), the same on every rank.

    Parameters
    ----------
    mesh : FoldMesh
        The mesh (``ddp == 1``).
    n_tokens : int
        Tokens of the synthetic sample.
    names : sequence of str, optional
        Keys of :data:`OPS` to run (all by default).
    paths : sequence of str
        ``"foldcp"`` and / or ``"fallback"``.
    channels, heads : int
        Channels of the random singles and tiles; attention heads.
    repeats : int
        Timed runs per op and path.
    seed, msa_rows : int
        Of the synthetic sample.
    force_fallback : bool
        Run the fallback even when the token blocks are not ``torch.chunk``'s (see
        :func:`chunk_mismatch`; it can hang the job); otherwise its rows say ``not run``.

    Returns
    -------
    list[dict]
        Rows with ``op``, ``path``, ``status``, forward / backward collectives (counts,
        text, bytes), ``documented`` (foldcp: the counts are the documented ones), and
        median forward / backward times in ms.
    """
    features = sample_features(mesh, n_tokens, seed=seed, msa_rows=msa_rows)
    atoms = int(features["atom_to_token"].shape[1])
    uneven = chunk_mismatch(features)
    names = list(names or OPS)
    cp0, cp1 = mesh.cp
    rows = []
    for name in names:
        mine: dict[str, dict[str, Any]] = {}
        for path in paths:
            if path == "fallback" and uneven and not force_fallback:
                mine[path] = _not_run(f"not run: {uneven}")
                continue
            mine[path] = run_op(
                name, path, features, mesh, channels=channels, heads=heads, repeats=repeats
            )
        compared = None
        if "foldcp" in mine and "fallback" in mine:
            fb, ref = mine["fallback"]["output"], mine["foldcp"]["output"]
            if fb is not None and ref is not None:
                compared = compare_outputs(fb, ref)
        everyone = common.gather_rows(
            {p: {k: v for k, v in r.items() if k != "output"} for p, r in mine.items()}
        )
        for path in paths:
            ranks = [e[path] for e in everyone]
            r0 = ranks[0]
            status = r0["status"]
            output = compared if path == "fallback" else None
            fwd_doc, bwd_doc = OPS[name][1], OPS[name][2]
            row = {
                "mesh": f"{cp0}x{cp1}",
                "N": n_tokens,
                "A": atoms,
                "op": name,
                "path": path,
                "status": status,
                "message": next((r["message"] for r in ranks if r["message"]), None),
                "output": output,
                "fwd_counts": r0["fwd"],
                "bwd_counts": r0["bwd"],
                "fwd": describe_counts(r0["fwd"]) if r0["fwd"] is not None else None,
                "bwd": describe_counts(r0["bwd"]) if r0["bwd"] is not None else None,
                "fwd_KiB": _max_kib(ranks, "fwd_bytes"),
                "out_KiB": _max_kib(ranks, "out_bytes"),
                "bwd_KiB": _max_kib(ranks, "bwd_bytes"),
                "fwd_ms": 1e3 * common.median(r0["fwd_times"]) if r0["fwd_times"] else None,
                "bwd_ms": 1e3 * common.median(r0["bwd_times"]) if r0["bwd_times"] else None,
                "fwd_times": r0["fwd_times"],
                "bwd_times": r0["bwd_times"],
                "placements": r0["placements"],
                "same_counts_on_ranks": all(
                    (r["fwd"], r["bwd"]) == (r0["fwd"], r0["bwd"]) for r in ranks
                ),
                "debug_totals_agree": all(
                    r.get("fwd_debug_total", 0) == sum((r["fwd"] or {}).values())
                    and r.get("bwd_debug_total", 0) == sum((r["bwd"] or {}).values())
                    for r in ranks
                ),
            }
            if path == "foldcp" and r0["fwd"] is not None:
                want_bwd = documented(bwd_doc, mesh.cp) if r0["bwd"] is not None else None
                row["documented"] = r0["fwd"] == documented(fwd_doc, mesh.cp) and (
                    r0["bwd"] == want_bwd
                )
            rows.append(row)
    base = {r["op"]: r for r in rows if r["path"] == "foldcp"}
    for r in rows:
        ref = base.get(r["op"])
        r["fwd_time_over_foldcp"] = (
            r["fwd_ms"] / ref["fwd_ms"] if ref and ref["fwd_ms"] and r["fwd_ms"] else None
        )
        r["fwd_KiB_over_foldcp"] = (
            r["fwd_KiB"] / ref["fwd_KiB"]
            if ref and ref["fwd_KiB"] and r["fwd_KiB"] is not None
            else None
        )
        r["out_KiB_over_foldcp"] = (
            r["out_KiB"] / ref["out_KiB"] if ref and ref["out_KiB"] and r["out_KiB"] else None
        )
        r["total_ms"] = (r["fwd_ms"] or 0) + (r["bwd_ms"] or 0) if r["fwd_ms"] else None
    return rows


def _max_kib(ranks: Sequence[Mapping[str, Any]], key: str) -> float | None:
    values = [r[key] for r in ranks if r.get(key) is not None]
    return max(values) / 1024 if values else None


# -- tables, plots ----------------------------------------------------------------------------

COLUMNS = [
    ("mesh", "mesh"),
    ("N", "N"),
    ("A", "A"),
    ("op", "op"),
    ("path", "path"),
    ("status", "status"),
    ("output", "output vs foldcp"),
    ("placements", "output placements"),
    ("fwd", "forward collectives"),
    ("fwd_KiB", "fwd KiB"),
    ("bwd", "backward collectives"),
    ("bwd_KiB", "bwd KiB"),
    ("documented", "as documented"),
    ("fwd_ms", "fwd ms"),
    ("bwd_ms", "bwd ms"),
    ("out_KiB", "output KiB / rank"),
    ("fwd_time_over_foldcp", "fwd time / foldcp"),
    ("fwd_KiB_over_foldcp", "fwd bytes / foldcp"),
    ("out_KiB_over_foldcp", "output / foldcp"),
]
SUMMARY_KEY = ("mesh", "N", "op", "path")


def draw(rows: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """Per op: forward time and forward bytes, foldcp beside the fallback, one row per N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["N"] for r in rows})
    names = list(dict.fromkeys(r["op"] for r in rows))
    fig, axes = plt.subplots(len(sizes), 2, figsize=(16, 4.5 * len(sizes)), squeeze=False)
    for row_axes, n in zip(axes, sizes):
        at = {(r["op"], r["path"]): r for r in rows if r["N"] == n}
        for ax, key, label in (
            (row_axes[0], "fwd_ms", "forward ms (median, max over ranks)"),
            (row_axes[1], "fwd_KiB", "forward collective KiB (max over ranks)"),
        ):
            for k, p in enumerate(PATHS):
                values = []
                for name in names:
                    r = at.get((name, p))
                    if r is None or r.get("fwd_ms") is None:
                        values.append(0.0)
                    else:
                        values.append(r[key] or 0.0)
                xs = [i + 0.4 * k - 0.2 for i in range(len(names))]
                ax.bar(xs, values, width=0.4, label=p)
                for x, name, v in zip(xs, names, values):
                    r = at.get((name, p))
                    if r is None:
                        continue
                    if str(r["status"]).startswith("fails (forward)"):
                        note = "fails"
                    elif key == "fwd_KiB" and not v:
                        note = "0 B"
                    else:
                        continue
                    ax.text(
                        x,
                        0.02,
                        note,
                        rotation=90,
                        ha="center",
                        va="bottom",
                        fontsize=7,
                        transform=ax.get_xaxis_transform(),
                    )
            ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=7)
            ax.set_ylabel(label, fontsize=8)
            if key == "fwd_ms":
                ax.set_yscale("log")
            else:
                ax.set_yscale("symlog", linthresh=1.0)
            ax.set_title(f"N = {n}", fontsize=9)
            ax.legend(fontsize=8)
            ax.grid(True, axis="y", alpha=0.3)
    mesh = rows[0]["mesh"] if rows else "?"
    fig.suptitle(f"ops on a {mesh} mesh: foldcp handlers vs PhysicsNeMo's DTensor fallback")
    return common.save_figure(fig, path, dpi=100)


def write_results(
    rows: Sequence[Mapping[str, Any]], cp: tuple[int, int], command: str, results: Path
) -> list[Path]:
    """Write ``ops_<cp0>x<cp1>.md`` / ``.png`` and merge the rows into the summary."""
    name = f"ops_{cp[0]}x{cp[1]}"
    device = rows[0].get("device", "cpu") if rows else "cpu"
    environment = common.environment(command, device)
    timings = "\n".join(
        f"- {r['mesh']} N={r['N']} {r['op']} {r['path']}: forward "
        + ", ".join(f"{1e3 * t:.2f}" for t in r["fwd_times"])
        + "; backward "
        + (", ".join(f"{1e3 * t:.2f}" for t in r["bwd_times"]) or "-")
        for r in rows
    )
    errors = "\n".join(
        f"- N={r['N']} {r['op']} ({r['path']}): {r['status']}: `{r['message']}`"
        for r in rows
        if r.get("message")
    )
    consistent = all(r["same_counts_on_ranks"] and r["debug_totals_agree"] for r in rows)
    environment += (
        "\n\nEvery rank counted the same collectives, and CommDebugMode's totals equal the "
        f"recorded collectives on every rank: {common.fmt(consistent)}"
    )
    md = common.write_markdown(
        results / f"{name}.md",
        f"Ops benchmark, {cp[0]}x{cp[1]} mesh",
        [
            ("Run", environment),
            ("Results", common.markdown_table(COLUMNS, rows)),
            ("Errors", errors or "none"),
            ("Every timed run (ms, max over ranks)", timings),
        ],
    )
    png = draw(rows, results / f"{name}.png")
    summary_rows = [{k: r.get(k) for k, _ in COLUMNS} for r in rows]
    summary = common.merge_summary("ops", summary_rows, SUMMARY_KEY, COLUMNS, results)
    return [md, png, summary]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cp", type=int, nargs=2, required=True, metavar=("CP0", "CP1"))
    p.add_argument("--tokens", type=int, nargs="+", default=[120, 240])
    p.add_argument("--ops", nargs="+", default=None, choices=list(OPS), metavar="OP")
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    p.add_argument("--channels", type=int, default=32)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--msa-rows", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--force-fallback",
        action="store_true",
        help="run the fallback even when the token blocks are not torch.chunk's (may hang)",
    )
    common.add_output_arguments(p, timeout_s=300.0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    mesh = fc.init_mesh(ddp=1, cp=tuple(args.cp), timeout_s=args.timeout)
    rows: list[dict[str, Any]] = []
    try:
        for n in args.tokens:
            part = run_ops_benchmark(
                mesh,
                n,
                names=args.ops,
                paths=args.paths,
                channels=args.channels,
                heads=args.heads,
                repeats=args.repeats,
                seed=args.seed,
                msa_rows=args.msa_rows,
                force_fallback=args.force_fallback,
            )
            for row in part:
                row["device"] = str(mesh.device.type)
            rows += part
            if mesh.rank == 0:
                for r in part:
                    print(
                        f"{r['mesh']} N={r['N']} {r['op']:<30} {r['path']:<9} {r['status']:<28} "
                        f"fwd [{r['fwd']}] {r['fwd_KiB'] or 0:.1f} KiB "
                        f"bwd [{r['bwd']}] {r['bwd_KiB'] or 0:.1f} KiB "
                        f"{r['fwd_ms'] or math.nan:.2f}/{r['bwd_ms'] or math.nan:.2f} ms",
                        flush=True,
                    )
        if mesh.rank == 0:
            command = common.launch_command("bench_ops.py", mesh.world_size, argv)
            for path in write_results(rows, mesh.cp, command, args.results):
                print(f"wrote {path}")
    finally:
        fc.shutdown()
    return 0


__all__ = [
    "OPS",
    "PATHS",
    "CollectiveBytes",
    "describe_counts",
    "documented",
    "physicsnemo_default",
    "run_ops_benchmark",
    "write_results",
]

if __name__ == "__main__":
    raise SystemExit(main())
