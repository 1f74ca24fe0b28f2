"""``FoldTensor``: the ShardTensors this plugin makes, with its handler registry and dispatch.

Every ShardTensor the plugin creates (the scatter's features, every op result computed
from one) is a :class:`FoldTensor`: a complete, truthful ShardTensor (same data, same
placements, same uneven sharding shapes) whose ``__torch_function__`` sends each call
through :func:`dispatch`. A ShardTensor the plugin did not make keeps PhysicsNeMo's
dispatch untouched; it joins the plugin's only when a FoldTensor is an operand of the same
call (torch picks the subclass's ``__torch_function__``).

The registry lives here, with the class, as PhysicsNeMo keeps its own on ``ShardTensor``:
the modules that handle ops import this one and register at import time (each rule next
to its handler), so nothing imports upward. :func:`dispatch`

1. defers to PhysicsNeMo's ``ShardTensor.__torch_function__`` *as it is at call time*
   while PhysicsNeMo converts tensors itself or ``torch.compile`` traces (a compiled
   region sees a FoldTensor exactly as a ShardTensor);
2. runs the plugin's own functions (``outer_sum``, ``tokens_to_atoms``, ...) through
   their handlers (:func:`register_own`);
3. runs the :class:`Rule` s registered for the function (:func:`register_rules`), in
   the order of their categories (:data:`CATEGORIES`), the first that applies wins;
4. for a function without rules, runs the handler registered for it with PhysicsNeMo's
   ``ShardTensor.register_function_handler`` (PhysicsNeMo's own, or a user's), if any;
5. otherwise runs the fallback (:func:`register_fallback`: every sharded operand
   gathered, the serial function on full tensors, reported).

Results of steps 3 (``local`` rules), 4 and 5 pass through the result hooks
(:func:`register_result_hook`), which keep what the plugin knows about a tensor's data.

A FoldTensor may carry a ``foldcp_tag`` saying more than placements can: a
:class:`~physicsnemo_foldcp.core.tags.MapTag` on a scattered atom<->token map, a
:class:`~physicsnemo_foldcp.core.tags.ViewTag` on a broadcast view of a single.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement

from physicsnemo_foldcp.core import compat
from physicsnemo_foldcp.core.blocks import ShardingLayoutError
from physicsnemo_foldcp.core.events import op_name
from physicsnemo_foldcp.core.leaves import tensor_leaves
from physicsnemo_foldcp.core.tags import MapTag, ViewTag

SHARDING_SHAPES = dict[int, list[tuple[int, ...]]]

Handler = Callable[[Callable, tuple, tuple, dict], Any]
"""``handler(func, types, args, kwargs)``: a ShardTensor function handler."""

RuleHandler = Callable[[Callable, tuple, dict], Any]
"""``handler(func, args, kwargs)``: a rule; ``NotImplemented`` when the call is not its form."""

ResultHook = Callable[[Callable, tuple, dict, Any], Any]
"""``hook(func, args, kwargs, result) -> result``."""

PLAIN = "plain"
BACKWARD = "backward"
UPSTREAM = "upstream"
REFUSE = "refuse"
KEEP_TAG = "keep tag"
DERIVE = "derive"
LOCAL = "local"
CATEGORIES = (PLAIN, BACKWARD, UPSTREAM, REFUSE, KEEP_TAG, DERIVE, LOCAL)
"""Rule categories, in the order rules are tried (and the table lists them)::

    plain      metadata of the wrapper (shape, dtype, device, ...): no dispatch at all
    backward   ``Tensor.backward``: torch's own backward with the plugin's dispatch left on
    upstream   autograd-identity and serialisation functions: PhysicsNeMo's dispatch
    refuse     in-place ops: a clear error, nothing is half-written
    keep tag   casts, detach, clone, contiguous of a map or view: same blocks, same tag
    derive     ops that give a new layout or tag (map transposes, broadcast views, ...)
    local      ops computed on local blocks, gathering only what they read along a
               sharded axis
"""


class FoldTensor(ShardTensor):
    """A ShardTensor made by this plugin; its torch functions go through :func:`dispatch`.

    Attributes
    ----------
    foldcp_tag : MapTag, ViewTag or None
        What the plugin knows about the tensor beyond its placements.
    """

    foldcp_tag: MapTag | ViewTag | None = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return dispatch(func, types, args, kwargs or {})

    @classmethod
    def upstream_torch_function(cls, func, types, args=(), kwargs=None):
        """PhysicsNeMo's ``ShardTensor.__torch_function__``, as it is at call time."""
        return super().__torch_function__(func, types, args, kwargs)


# -- making the plugin's tensors -------------------------------------------------------------


def wrap(
    x: torch.Tensor,
    mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    shapes: SHARDING_SHAPES | None = None,
    tag: MapTag | ViewTag | None = None,
) -> FoldTensor:
    """The plugin's tensor over a local block, or over a ShardTensor made elsewhere.

    Differentiable (the gradient of the result reaches the block); no communication.

    Parameters
    ----------
    x : torch.Tensor
        This rank's block (then ``mesh``, ``placements`` and ``shapes`` are required), or a
        ShardTensor (a FoldTensor is returned as it is, and a ``tag`` given is set on it
        in place: give one only for a tensor the caller made; another ShardTensor, built
        with explicit sharding shapes, gives a FoldTensor over the same block and layout,
        ``x`` itself unchanged).
    mesh : DeviceMesh, optional
        The 2-D ``(cp0, cp1)`` domain mesh.
    placements : sequence of Placement, optional
        One per mesh dim.
    shapes : dict[int, list[tuple[int, ...]]], optional
        ``{mesh_dim: [local shape of rank r along mesh_dim]}`` for every sharded mesh dim
        (empty when nothing is sharded).
    tag : MapTag or ViewTag, optional
        The result's ``foldcp_tag``.

    Raises
    ------
    ValueError
        If ``x`` is a ShardTensor without sharding shapes, or a plain tensor without a
        layout.
    """
    if isinstance(x, ShardTensor):
        if mesh is not None or placements is not None or shapes is not None:
            raise ValueError(
                "wrap: a ShardTensor carries its own layout; pass no mesh, "
                "placements or shapes with it"
            )
        out = x if isinstance(x, FoldTensor) else _over_same_block(x)
    else:
        if mesh is None or placements is None or shapes is None:
            raise ValueError("wrap: a local block needs its mesh, placements and shapes")
        out = ShardTensor.from_local(x, mesh, tuple(placements), sharding_shapes=shapes)
        _retype(out)
    if tag is not None:
        out.foldcp_tag = tag
    return out


def _over_same_block(x: ShardTensor) -> FoldTensor:
    shapes = compat.sharding_shapes(x)
    if shapes is None:
        raise ValueError(
            "wrap: the ShardTensor carries no sharding shapes; build it with "
            "ShardTensor.from_local(..., sharding_shapes={mesh_dim: [shape per rank]})"
        )
    local = x.to_local() if torch.is_grad_enabled() and x.requires_grad else compat.local_tensor(x)
    return wrap(local, x.device_mesh, x.placements, {m: list(s) for m, s in shapes.items()})


def _retype(x: ShardTensor) -> FoldTensor:
    """Make ``x``, a ShardTensor the plugin just created and nobody else holds, a FoldTensor.

    In place (its class changes, its tag stays); for results of PhysicsNeMo's own calls.
    """
    if type(x) is not FoldTensor:
        x.__class__ = FoldTensor
    return x


def tag_of(x: Any) -> MapTag | ViewTag | None:
    """The ``foldcp_tag`` of ``x``, or ``None``."""
    return x.foldcp_tag if isinstance(x, FoldTensor) else None


def map_tag(x: Any) -> MapTag | None:
    """The :class:`MapTag` of ``x``, or ``None``."""
    tag = tag_of(x)
    return tag if isinstance(tag, MapTag) else None


def view_tag(x: Any) -> ViewTag | None:
    """The :class:`ViewTag` of ``x``, or ``None``."""
    tag = tag_of(x)
    return tag if isinstance(tag, ViewTag) else None


# -- the registry ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """One row of the rule table.

    Attributes
    ----------
    category : str
        One of :data:`CATEGORIES`.
    funcs : tuple of callables
        The torch functions the row covers.
    handler : callable or None
        ``handler(func, args, kwargs)``; returns ``NotImplemented`` when the call is not
        of its form (then the next rule is tried). ``None`` for ``plain`` and
        ``upstream``.
    what : str
        What the rule does, for the printed table.
    """

    category: str
    funcs: tuple[Callable, ...]
    handler: RuleHandler | None
    what: str

    def __post_init__(self) -> None:
        if self.category not in CATEGORIES:
            raise ValueError(f"Rule category {self.category!r} is not one of {CATEGORIES}")

    def apply(self, func: Callable, types: tuple, args: tuple, kwargs: dict) -> Any:
        """Run the rule on one call."""
        if self.category == PLAIN:
            return compat.plain_function_call(func, args, kwargs)
        if self.category == UPSTREAM:
            return upstream(func, types, args, kwargs)
        out = self.handler(func, args, kwargs)
        if out is NotImplemented or self.category != LOCAL:
            return out
        return _after(func, args, kwargs, out)


_OWN: dict[Callable, Handler] = {}
_RULES: list[Rule] = []
_INDEX: dict[Callable, list[Rule]] = {}
_RESULT_HOOKS: list[ResultHook] = []
_FALLBACK: list[RuleHandler] = []


def register_own(func: Callable, handler: Handler) -> None:
    """Register the handler of one of this package's own functions (e.g. ``outer_sum``).

    The handler is registered with PhysicsNeMo's public
    ``ShardTensor.register_function_handler`` too, so the function also runs on
    ShardTensors made elsewhere; it changes nothing for any other function.

    Parameters
    ----------
    func : callable
        A function of this package that calls ``handle_torch_function``.
    handler : callable
        ``handler(func, types, args, kwargs)``.
    """
    _OWN[func] = handler
    ShardTensor.register_function_handler(func, handler)


def own_functions() -> dict[Callable, Handler]:
    """The plugin's own functions and their handlers (a copy)."""
    return dict(_OWN)


def register_rules(*rules: Rule) -> None:
    """Add rows to the rule table; for each function, rules run by category, then in order.

    Registering a rule again (the same object) changes nothing.
    """
    for rule in rules:
        if rule in _RULES:
            continue
        _RULES.append(rule)
        for func in rule.funcs:
            _INDEX.setdefault(func, []).append(rule)
    for func_rules in _INDEX.values():
        func_rules.sort(key=lambda r: CATEGORIES.index(r.category))


def registered_rules() -> tuple[Rule, ...]:
    """Every row of the rule table, by category, in registration order within one."""
    return tuple(sorted(_RULES, key=lambda r: CATEGORIES.index(r.category)))


def register_result_hook(hook: ResultHook) -> None:
    """Pass every result of a ``local`` rule, a PhysicsNeMo handler or the fallback to ``hook``."""
    if hook not in _RESULT_HOOKS:
        _RESULT_HOOKS.append(hook)


def register_fallback(handler: RuleHandler) -> None:
    """The handler of calls that no rule handles (one; a second registration replaces it)."""
    _FALLBACK[:] = [handler]


def rules_for(func: Callable, kwargs: dict) -> list[Rule]:
    """The rules that may handle a call of ``func``, in order (``out=`` is refused first)."""
    if kwargs.get("out") is not None:
        return [_OUT_RULE]
    return _INDEX.get(func, [])


def _refuse_out(func: Callable, args: tuple, kwargs: dict) -> Any:
    raise ShardingLayoutError(
        f"{op_name(func)}(..., out=...) on sharded features is not supported under context "
        "parallelism: drop out= and use the result"
    )


_OUT_RULE = Rule(REFUSE, (), _refuse_out, "out= arguments: error naming the op")


def _after(func: Callable, args: tuple, kwargs: dict, result: Any) -> Any:
    for hook in _RESULT_HOOKS:
        result = hook(func, args, kwargs, result)
    return result


# -- the dispatch ----------------------------------------------------------------------------


def upstream(func: Callable, types: tuple, args: tuple, kwargs: dict) -> Any:
    """PhysicsNeMo's dispatch of the call, with ShardTensor results made FoldTensors."""
    result = FoldTensor.upstream_torch_function(func, types, args, kwargs)
    inputs = {id(t) for _, t in tensor_leaves(args, kwargs)}

    def made_here(r: Any) -> Any:
        if isinstance(r, ShardTensor) and not isinstance(r, FoldTensor) and id(r) not in inputs:
            _retype(r)
        return r

    if isinstance(result, (tuple, list)):
        for r in result:
            made_here(r)
        return result
    return made_here(result)


def dispatch(func: Callable, types: tuple, args: tuple, kwargs: dict) -> Any:
    """Run one torch function call that has a FoldTensor among its operands.

    Parameters
    ----------
    func : callable
        The torch function (``torch.matmul``, ``torch.Tensor.softmax``, ...).
    types : tuple
        As ``__torch_function__`` received them.
    args, kwargs
        The call's arguments.

    Returns
    -------
    Any
        The result; every ShardTensor in it is a FoldTensor.

    Raises
    ------
    ShardingLayoutError
        When a rule refuses the call (in-place ops, ``out=``, unsupported uses of a
        scattered map), with the op and the layout named.
    """
    if (
        compat.conversion_active()
        or torch.compiler.is_compiling()
        or compat.is_tracing(args, kwargs)
    ):
        return FoldTensor.upstream_torch_function(func, types, args, kwargs)
    own = _OWN.get(func)
    if own is not None:
        return own(func, types, args, kwargs)
    func_rules = rules_for(func, kwargs)
    for rule in func_rules:
        out = rule.apply(func, types, args, kwargs)
        if out is not NotImplemented:
            return out
    if not func_rules and compat.registered_function_handler(func) is not None:
        return _after(func, args, kwargs, upstream(func, types, args, kwargs))
    if not _FALLBACK:
        raise RuntimeError(
            f"{op_name(func)} on a FoldTensor: no fallback is registered; import "
            "physicsnemo_foldcp (its dispatch.rules registers the generic rows)"
        )
    return _after(func, args, kwargs, _FALLBACK[0](func, args, kwargs))


__all__ = [
    "CATEGORIES",
    "FoldTensor",
    "Rule",
    "dispatch",
    "map_tag",
    "own_functions",
    "register_fallback",
    "register_own",
    "register_result_hook",
    "register_rules",
    "registered_rules",
    "rules_for",
    "tag_of",
    "upstream",
    "view_tag",
    "wrap",
]
