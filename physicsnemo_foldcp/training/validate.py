"""Validate your own model under context parallelism: one call, serial vs distributed.

:func:`validate_model` runs a model on a sample twice on every rank of a domain group:
serially on plain tensors (the ground truth) and distributed on the scattered ShardTensors.
It compares the loss, every named module's output (in call order), the model's outputs and
every parameter gradient, and lists the collectives of the distributed forward and
backward. With ``step="predict"`` it runs the model's ``predict_step`` instead, without
gradients (a Boltz-2 prediction: trunk, sampling, confidence), and compares the module
outputs and the prediction. Every op that fell back to gathering a sharded operand is
reported with the op and the module that called it, whichever path it took: the plugin's
dispatch (an op that reads along a sharded axis, or one without a rule) or PhysicsNeMo's
generic DTensor fallback (a ShardTensor the plugin did not make). Such an all-gather is
*unexpected*: correct, but it is the memory CP exists to save. TF32 is pinned off during
the comparison.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from physicsnemo.domain_parallel import ShardTensor
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from physicsnemo_foldcp.core import compat, events
from physicsnemo_foldcp.distributed.mesh import FoldMesh
from physicsnemo_foldcp.distributed.rng import sync_rng_over_domain
from physicsnemo_foldcp.distributed.wrappers import sync_over_domain
from physicsnemo_foldcp.features.registry import FeatureRegistry
from physicsnemo_foldcp.sharding.options import ShardingOptions
from physicsnemo_foldcp.sharding.scatter import scatter_features
from physicsnemo_foldcp.training.hooks import LossFn, model_loss

_warned_tf32 = False


@dataclass(frozen=True)
class FallbackCollective:
    """Collectives issued inside PhysicsNeMo's generic fallback for one op call.

    Attributes
    ----------
    op : str
        The op (``torch`` function or ``aten`` overload).
    module : str
        Innermost named module running at the time (``"<backward>"`` in backward,
        ``"<model>"`` for the root module).
    phase : str
        ``"forward"`` or ``"backward"``.
    collectives : dict[str, int]
        Collective name -> count.
    """

    op: str
    module: str
    phase: str
    collectives: dict[str, int]

    @property
    def all_gathers(self) -> int:
        """How many all-gathers the call issued."""
        return sum(c for name, c in self.collectives.items() if "all_gather" in name)


@dataclass
class ValidationReport:
    """Outcome of :func:`validate_model` (the same on every rank of the domain group).

    Attributes
    ----------
    loss_serial, loss_distributed : float or None
        The two losses (``None`` for ``step="predict"``).
    loss_ok : bool
        Whether they agree within tolerance (``True`` when there is no loss).
    module_errors : dict[str, float]
        Named module (``name`` or ``name#k`` for its k-th call) -> max abs difference of
        its output, in call order; modules whose outputs cannot be compared are absent.
    first_divergent_module : str or None
        The first module, in call order, whose output differs beyond tolerance.
    not_compared : dict[str, str]
        Modules whose outputs were not compared, with the reason.
    outputs_ok : bool
        Whether the model's own outputs agree.
    gradient_errors : dict[str, float]
        Parameter -> max abs difference of its gradient.
    bad_gradients : list[str]
        Parameters whose gradients differ beyond tolerance.
    missing_gradients : list[str]
        Parameters with a serial gradient but none distributed (or the reverse).
    forward_collectives, backward_collectives : dict[str, int]
        Collectives of the distributed forward (loss included) and backward.
    fallback_collectives : list[FallbackCollective]
        Every op call that communicated inside the generic fallback.
    tf32_was_on : bool
        Whether TF32 was enabled when the call started.
    rtol, atol : float
        Tolerances used.
    """

    loss_serial: float | None
    loss_distributed: float | None
    loss_ok: bool
    module_errors: dict[str, float] = field(default_factory=dict)
    first_divergent_module: str | None = None
    not_compared: dict[str, str] = field(default_factory=dict)
    outputs_ok: bool = True
    gradient_errors: dict[str, float] = field(default_factory=dict)
    bad_gradients: list[str] = field(default_factory=list)
    missing_gradients: list[str] = field(default_factory=list)
    forward_collectives: dict[str, int] = field(default_factory=dict)
    backward_collectives: dict[str, int] = field(default_factory=dict)
    fallback_collectives: list[FallbackCollective] = field(default_factory=list)
    tf32_was_on: bool = False
    rtol: float = 1e-5
    atol: float = 1e-6

    @property
    def unexpected_all_gathers(self) -> list[FallbackCollective]:
        """Fallback calls that all-gathered a sharded operand."""
        return [f for f in self.fallback_collectives if f.all_gathers]

    @property
    def ok(self) -> bool:
        """Loss, outputs and gradients agree, and no op fell back to an all-gather."""
        return (
            self.loss_ok
            and self.outputs_ok
            and self.first_divergent_module is None
            and not self.bad_gradients
            and not self.missing_gradients
            and not self.unexpected_all_gathers
        )

    def format(self) -> str:
        """A readable summary."""
        verdict = "OK" if self.ok else "FAILED"
        if self.loss_serial is None or self.loss_distributed is None:
            loss = "  loss: none (a prediction)"
        else:
            loss = (
                f"  loss serial {self.loss_serial:.8g}, distributed {self.loss_distributed:.8g}"
                f" -> {'equal' if self.loss_ok else 'DIFFERENT'}"
            )
        lines = [
            f"validate_model: {verdict} (rtol={self.rtol:g}, atol={self.atol:g}, TF32 off)",
            loss,
            f"  modules compared: {len(self.module_errors)}; first divergent: "
            f"{self.first_divergent_module or 'none'}",
            f"  gradients compared: {len(self.gradient_errors)}; differing: "
            f"{self.bad_gradients or 'none'}; missing: {self.missing_gradients or 'none'}",
            f"  forward collectives: {self.forward_collectives}",
            f"  backward collectives: {self.backward_collectives}",
        ]
        unexpected = self.unexpected_all_gathers
        lines.append(f"  unexpected all-gathers (ops that fell back): {len(unexpected)}")
        for f in unexpected:
            lines.append(f"    {f.op} in {f.module} ({f.phase}): {f.collectives}")
        if self.tf32_was_on:
            lines.append("  note: TF32 was on; it was pinned off for the comparison")
        return "\n".join(lines)


def _rng_states(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The CPU generator state and ``device``'s (CUDA only)."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_states(states: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    """Put back what :func:`_rng_states` read."""
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1], device)


def _comm_name(op: object) -> str:
    return str(op).split(".")[-1]


def _counts(mode: CommDebugMode) -> dict[str, int]:
    return {_comm_name(k): int(v) for k, v in mode.get_comm_counts().items()}


@contextlib.contextmanager
def tf32_off() -> Iterator[bool]:
    """Pin TF32 off (matmul, cuDNN, float32 matmul precision); yields whether it was on.

    Warns once per process when TF32 was on.
    """
    global _warned_tf32
    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
    )
    was_on = bool(saved[0]) or saved[2] != "highest"
    if was_on and not _warned_tf32:
        warnings.warn(
            "TF32 was enabled: validate_model pins it off for the comparison (TF32 matmuls "
            "differ from fp32 by ~1e-3, far above the fp32 tolerances used here)",
            stacklevel=3,
        )
        _warned_tf32 = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield was_on
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved[0]
        torch.backends.cudnn.allow_tf32 = saved[1]
        torch.set_float32_matmul_precision(saved[2])


class _Recorder:
    """Forward hooks on every named module: call order, outputs, and the module stack."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.outputs: dict[str, Any] = {}
        self.order: list[str] = []
        self.stack: list[str] = []
        self.calls: dict[str, int] = {}
        self.handles: list[Any] = []
        self.recording = False

    def __enter__(self) -> _Recorder:
        for name, module in self.model.named_modules():
            label = name or "<model>"
            self.handles.append(module.register_forward_pre_hook(self._pre(label)))
            self.handles.append(module.register_forward_hook(self._post(label)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _pre(self, label: str):
        def hook(module, args):
            self.stack.append(label)

        return hook

    def _post(self, label: str):
        def hook(module, args, output):
            if self.stack and self.stack[-1] == label:
                self.stack.pop()
            if not self.recording or label == "<model>":
                return
            k = self.calls.get(label, 0)
            self.calls[label] = k + 1
            key = label if k == 0 else f"{label}#{k}"
            self.order.append(key)
            self.outputs[key] = _detach(output)

        return hook

    def reset(self) -> None:
        self.outputs, self.order, self.calls, self.stack = {}, [], {}, []


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, Mapping):
        return {k: _detach(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return (
            type(value)(_detach(v) for v in value)
            if isinstance(value, list)
            else tuple(_detach(v) for v in value)
        )
    return value


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        return [t for k in sorted(value) for t in _tensors(value[k])]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _plain_leaves(value: Any) -> Any:
    """``value`` with every tensor dropped: the keys and the non-tensor values it holds."""
    if isinstance(value, Mapping):
        return {k: _plain_leaves(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_leaves(v) for v in value]
    return None if isinstance(value, torch.Tensor) else value


def _full(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, (ShardTensor, DTensor)):
        return t.full_tensor()
    return t


@contextlib.contextmanager
def _fallback_tracing(
    comm: dict[str, CommDebugMode | None], recorder: _Recorder, found: list[FallbackCollective]
) -> Iterator[None]:
    """Record every op that fell back to gathering, whichever path reached it.

    The plugin's own dispatch reports its gathers (:mod:`physicsnemo_foldcp.core.events`);
    PhysicsNeMo's generic DTensor fallbacks (reached by ShardTensors the plugin did not
    make) are wrapped for the length of the call and their collectives counted.
    """
    depth = [0]

    def where() -> tuple[str, str]:
        phase = comm["phase"] or "forward"
        return (recorder.stack[-1] if recorder.stack else "<backward>"), phase

    def on_gather(event: events.GatherEvent) -> None:
        if comm["active"] is None or event.kind != events.FALLBACK:
            return
        module, phase = where()
        found.append(FallbackCollective(event.op, module, phase, {"all_gather": 1}))

    def traced(original, name):
        def run(func, args, kwargs=None):
            mode = comm["active"]
            # Tensor.backward on a ShardTensor takes the fallback too: it is the whole
            # backward pass, not an op.
            if mode is None or depth[0] or func is torch.Tensor.backward:
                return original(func, args, kwargs)
            before = _counts(mode)
            depth[0] += 1
            try:
                return original(func, args, kwargs)
            finally:
                depth[0] -= 1
                after = _counts(mode)
                diff = {k: v - before.get(k, 0) for k, v in after.items() if v > before.get(k, 0)}
                if diff:
                    module, phase = where()
                    found.append(FallbackCollective(events.op_name(func), module, phase, diff))

        return run

    with compat.observed_upstream_fallbacks(traced), events.observe(on_gather):
        yield


def _max_diff(
    actual: torch.Tensor, expected: torch.Tensor, equal_nan: bool = False
) -> float | None:
    """Max abs difference, or ``None`` when the shapes differ."""
    if actual.shape != expected.shape:
        return None
    a, e = actual.double(), expected.double()
    diff = (a - e).abs()
    if equal_nan:
        diff = diff.masked_fill(a.isnan() & e.isnan(), 0.0)
    return float(diff.max()) if a.numel() else 0.0


def _within(
    actual: torch.Tensor,
    expected: torch.Tensor,
    rtol: float,
    atol: float,
    equal_nan: bool = False,
) -> bool:
    scale = max(1.0, float(expected.abs().nan_to_num().max())) if expected.numel() else 1.0
    return bool(
        torch.allclose(
            actual.double(), expected.double(), rtol=rtol, atol=atol * scale, equal_nan=equal_nan
        )
    )


def validate_model(
    model: nn.Module | Callable[[], nn.Module],
    sample: Mapping[str, Any],
    mesh: FoldMesh,
    *,
    loss_fn: LossFn | None = None,
    registry: FeatureRegistry | None = None,
    options: ShardingOptions | None = None,
    token_bounds: Sequence[int] | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    step: str = "train",
) -> ValidationReport:
    """Run ``model`` serially and distributed on ``sample``; compare outputs and gradients.

    Call on every rank of the job (every domain group validates the same sample). Both
    runs start from the same generator state (the domain source's), so their random draws
    (dropout masks, MSA subsampling) are the same.

    Parameters
    ----------
    model : nn.Module or callable
        The serial model, or a function that builds it (called once). It is moved to
        ``mesh.device`` and its parameters are broadcast over the domain group first.
    sample : Mapping[str, Any]
        The full serial sample in the layout the model reads (e.g. batched ``[1, ...]``),
        on EVERY rank: each rank runs the serial reference itself.
    mesh : FoldMesh
        From :func:`physicsnemo_foldcp.init_mesh`.
    loss_fn : callable, optional
        ``loss_fn(outputs, features)`` -> scalar loss; the model's ``loss`` method by
        default (``step="train"`` only).
    registry : FeatureRegistry, optional
        Axis meanings of the features (Boltz-2 preset by default).
    options : ShardingOptions, optional
        How the sample is sharded (the defaults otherwise). With per-shard padding,
        module outputs along padded axes cannot be compared element by element and are
        listed in ``not_compared``.
    token_bounds : sequence of int, optional
        Explicit row-block token boundaries for the scatter (see
        :func:`~physicsnemo_foldcp.scatter_features`).
    rtol, atol : float
        Tolerances; ``atol`` is scaled by ``max(1, max |serial value|)`` per tensor. With
        ``step="predict"`` NaN agrees with NaN at the same place.
    step : {"train", "predict"}, default "train"
        ``"train"``: ``model(**features)``, the loss and its backward; gradients are
        compared. ``"predict"``: ``model.predict_step(features)`` under ``torch.no_grad``
        (e.g. :class:`~physicsnemo_foldcp.models.Boltz2Model`); there is no loss and no
        gradient, the prediction's keys and tensors are compared.

    Returns
    -------
    ValidationReport
        See its attributes; ``report.ok`` and ``report.format()``.
    """
    if step not in ("train", "predict"):
        raise ValueError(f"step must be 'train' or 'predict', got {step!r}")
    if not isinstance(model, nn.Module):
        model = model()
    if step == "predict":
        if loss_fn is not None:
            raise ValueError("loss_fn is for step='train'; a prediction has no loss")
        if not callable(getattr(model, "predict_step", None)):
            raise TypeError(
                f"{type(model).__name__} has no predict_step(features): step='predict' "
                "runs that method"
            )
    else:
        loss_fn = model_loss(model, loss_fn)
    predicting = step == "predict"

    def run(features: Mapping[str, Any]) -> tuple[Any, torch.Tensor | None]:
        if predicting:
            with torch.no_grad():
                return model.predict_step(features), None
        outputs = model(**features)
        return outputs, loss_fn(outputs, features)

    model = model.to(mesh.device)
    sync_over_domain(model, mesh)
    device_sample = {
        k: v.to(mesh.device) if isinstance(v, torch.Tensor) else v for k, v in sample.items()
    }
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    fallbacks: list[FallbackCollective] = []
    comm: dict[str, Any] = {"active": None, "phase": None}
    sync_rng_over_domain(mesh)
    rng = _rng_states(mesh.device)
    with tf32_off() as was_on, _Recorder(model) as recorder:
        model.zero_grad(set_to_none=True)
        recorder.recording = True
        serial_out, serial_loss = run(device_sample)
        recorder.recording = False
        if serial_loss is not None:
            serial_loss.backward()
        serial_outputs, serial_order = recorder.outputs, recorder.order
        serial_grads = {
            n: p.grad.detach().clone() if p.grad is not None else None for n, p in params.items()
        }
        model.zero_grad(set_to_none=True)
        recorder.reset()

        _set_rng_states(rng, mesh.device)
        features = scatter_features(
            device_sample if mesh.is_domain_source else None,
            mesh,
            registry=registry,
            options=options,
            token_bounds=None if token_bounds is None else tuple(int(b) for b in token_bounds),
        )
        with _fallback_tracing(comm, recorder, fallbacks):
            with compat.comm_counter() as forward_mode:
                comm.update(active=forward_mode, phase="forward")
                recorder.recording = True
                dist_out, dist_loss = run(features)
                recorder.recording = False
            with compat.comm_counter() as backward_mode:
                comm.update(active=backward_mode, phase="backward")
                if dist_loss is not None:
                    dist_loss.backward()
            comm.update(active=None, phase=None)

        report = ValidationReport(
            loss_serial=None if serial_loss is None else float(serial_loss.detach()),
            loss_distributed=None if dist_loss is None else float(_full(dist_loss.detach())),
            loss_ok=serial_loss is None,
            tf32_was_on=was_on,
            rtol=rtol,
            atol=atol,
            forward_collectives=_counts(forward_mode),
            backward_collectives=_counts(backward_mode),
            fallback_collectives=fallbacks,
        )
        if report.loss_serial is not None and report.loss_distributed is not None:
            report.loss_ok = _within(
                torch.tensor(report.loss_distributed), torch.tensor(report.loss_serial), rtol, atol
            )
        # A prediction may hold NaN by design (Boltz's masked confidence values): NaN at
        # the same place agrees there; a training step's NaN is never "equal".
        _compare_modules(
            report, serial_order, serial_outputs, recorder, rtol, atol, equal_nan=predicting
        )
        _compare_outputs(report, serial_out, dist_out, rtol, atol, equal_nan=predicting)
        _compare_gradients(report, params, serial_grads, rtol, atol)
    return report


def _compare_modules(
    report: ValidationReport,
    serial_order: list[str],
    serial_outputs: Mapping[str, Any],
    recorder: _Recorder,
    rtol: float,
    atol: float,
    equal_nan: bool = False,
) -> None:
    for key in serial_order:
        if key not in recorder.outputs:
            report.not_compared[key] = "not called in the distributed run"
            continue
        expected = _tensors(serial_outputs[key])
        actual = _tensors(recorder.outputs[key])
        if len(expected) != len(actual):
            report.not_compared[key] = "different number of output tensors"
            continue
        worst, good, comparable = 0.0, True, True
        for e, a in zip(expected, actual):
            full = _full(a)
            diff = _max_diff(full, e, equal_nan)
            if diff is None:
                comparable = False
                report.not_compared[key] = (
                    f"output shape {tuple(full.shape)} vs serial {tuple(e.shape)} (padding)"
                )
                break
            worst = max(worst, diff)
            good = good and _within(full, e, rtol, atol, equal_nan)
        if not comparable:
            continue
        report.module_errors[key] = worst
        if not good and report.first_divergent_module is None:
            report.first_divergent_module = key


def _compare_outputs(
    report, serial_out, dist_out, rtol: float, atol: float, equal_nan: bool = False
) -> None:
    expected, actual = _tensors(serial_out), _tensors(dist_out)
    ok = len(expected) == len(actual) and _plain_leaves(serial_out) == _plain_leaves(dist_out)
    for e, a in zip(expected, actual):
        full = _full(a.detach())
        ok = ok and full.shape == e.shape and _within(full, e.detach(), rtol, atol, equal_nan)
    report.outputs_ok = ok


def _compare_gradients(report, params, serial_grads, rtol: float, atol: float) -> None:
    for name, p in params.items():
        expected = serial_grads[name]
        actual = p.grad
        if (expected is None) != (actual is None):
            report.missing_gradients.append(name)
            continue
        if expected is None:
            continue
        full = _full(actual)
        diff = _max_diff(full, expected)
        report.gradient_errors[name] = float("inf") if diff is None else diff
        if diff is None or not _within(full, expected, rtol, atol):
            report.bad_gradients.append(name)


__all__ = [
    "FallbackCollective",
    "ValidationReport",
    "tf32_off",
    "validate_model",
]
