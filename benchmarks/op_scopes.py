"""Which part of a model is running, forward and backward: labels for bytes, a clock for time.

The Pairformer benchmark attributes each collective and each millisecond to the
Pairformer layer and op that was running (``tri_mul_out``, ..., ``other``); the trunk
benchmark adds the trunk's stages around the Pairformer (input embedder, MSA module,
distogram head). Both use one :class:`OpScopes`: module hooks switch the running scope in
the forward, and hooks on autograd nodes and gradients switch it in the backward, in the
autograd engine's order. The profiler is not used: its per-kernel events on CPU would not
say which Boltz module asked for them, and waits for peers inside an op are what a
breakdown of a distributed step must show.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from benchmarks import common

CATEGORIES = (
    "tri_mul_out",
    "tri_mul_in",
    "tri_att_start",
    "tri_att_end",
    "attention",
    "transitions",
    "other",
)
"""The ops of a Pairformer layer that bytes and time are attributed to."""

CHILD_CATEGORY = {
    "tri_mul_out": "tri_mul_out",
    "tri_mul_in": "tri_mul_in",
    "tri_att_start": "tri_att_start",
    "tri_att_end": "tri_att_end",
    "attention": "attention",
    "transition_z": "transitions",
    "transition_s": "transitions",
}
"""``PairformerLayer`` child name -> category (other children: ``other``)."""

OUTSIDE = "outside"
"""Label of what runs outside every layer and stage (the loss, the rest of the model)."""

Scope = tuple[int | None, str]
"""``(layer index, op category)`` in a Pairformer layer, ``(None, stage name)`` in a stage,
``(None, OUTSIDE)`` elsewhere."""


class OpScopes:
    """Which Pairformer layer and op, or which model stage, is running.

    Forward: pre- and post-hooks on every ``PairformerLayer`` and its children, and on each
    stage module, set :attr:`current`, and the wall time between two changes goes to the
    scope that was on (:attr:`seconds`; with ``device`` a CUDA device, it is synchronised
    first). Backward, following the autograd engine's order: a module's backward starts
    when the node that made its output runs (a pre-hook on that node, registered in the
    forward post-hook, sets the module's label) and ends when the gradient of its input is
    complete (a hook on the input tensor, registered in the forward pre-hook, sets the
    enclosing label back). Where one tensor is both a module's input and another's output,
    both fire at once, and the node's pre-hook, which the engine runs after the tensor's
    hooks, wins: the producer's backward comes next.

    Parameters
    ----------
    module : nn.Module
        A ``PairformerModule`` (its ``layers`` are hooked, layer ``i``'s ops as
        ``(i, category)``).
    device : torch.device, optional
        The device the module computes on.
    stages : Mapping[str, nn.Module], optional
        Other modules to time as a whole, as ``(None, name)``; none may contain or be
        ``module`` (their hooks would take over its last layer's backward).
    """

    def __init__(
        self,
        module: nn.Module,
        device: torch.device | None = None,
        stages: Mapping[str, nn.Module] | None = None,
    ):
        self.module = module
        self.device = device
        self.stages = dict(stages or {})
        inner = set(map(id, module.modules()))
        for name, stage in self.stages.items():
            if any(id(m) in inner for m in stage.modules()):
                raise ValueError(f"stage {name!r} contains the Pairformer module's layers")
        self.seconds: dict[Scope, float] = {}
        self._scope: Scope = (None, OUTSIDE)
        self._since = time.perf_counter()
        self._handles: list[Any] = []

    @property
    def current(self) -> Scope:
        """The running scope; setting it ends the time of the one before."""
        return self._scope

    @current.setter
    def current(self, scope: Scope) -> None:
        if self.device is not None:
            common.synchronize(self.device)
        now = time.perf_counter()
        self.seconds[self._scope] = self.seconds.get(self._scope, 0.0) + now - self._since
        self._scope, self._since = scope, now

    def take_seconds(self) -> dict[Scope, float]:
        """Seconds spent in each scope since the last call (the running one's so far)."""
        self.current = self._scope
        taken, self.seconds = self.seconds, {}
        return taken

    def _set(self, scope: Scope) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            self.current = scope

        return hook

    def _on_start(self, tensors: Sequence[torch.Tensor], scope: Scope) -> None:
        for t in tensors:
            if not t.requires_grad:
                continue
            node = t.grad_fn
            if node is not None:
                node.register_prehook(self._set(scope))
            else:
                t.register_hook(self._set(scope))

    def _on_end(self, tensors: Sequence[torch.Tensor], scope: Scope) -> None:
        for t in tensors:
            if t.requires_grad:
                t.register_hook(self._set(scope))

    def _hooks(self, target: nn.Module, inside: Scope, outside: Scope) -> None:
        def pre(_: nn.Module, args: tuple) -> None:
            self.current = inside
            self._on_end(common.tensors_in(args), outside)

        def post(_: nn.Module, args: tuple, output: Any) -> None:
            self.current = outside
            self._on_start(common.tensors_in(output), inside)

        self._handles.append(target.register_forward_pre_hook(pre))
        self._handles.append(target.register_forward_hook(post))

    @contextlib.contextmanager
    def attached(self) -> Iterator[OpScopes]:
        """Hooks in place for the length of the ``with`` block."""
        for name, stage in self.stages.items():
            self._hooks(stage, (None, name), (None, OUTSIDE))
        for i, layer in enumerate(self.module.layers):
            self._hooks(layer, (i, "other"), (None, OUTSIDE))
            for name, child in layer.named_children():
                self._hooks(child, (i, CHILD_CATEGORY.get(name, "other")), (i, "other"))
        self.current = (None, OUTSIDE)
        try:
            yield self
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            self.current = (None, OUTSIDE)


def by_category(seconds: Mapping[Scope, float]) -> dict[str, float]:
    """Seconds per category or stage, summed over the layers (``OUTSIDE``: the rest)."""
    out: dict[str, float] = {}
    for (_, category), value in seconds.items():
        out[category] = out.get(category, 0.0) + value
    return out


__all__ = ["CATEGORIES", "CHILD_CATEGORY", "OUTSIDE", "OpScopes", "Scope", "by_category"]
