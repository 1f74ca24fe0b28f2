"""The tensors inside a call's arguments: found by path, replaced by path.

Lists, tuples and mappings (a module's feature dict) are looked into, so a handler sees
every tensor a call holds, however the caller nested them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch


def _walk(obj: Any, path: tuple) -> Iterator[tuple[tuple, Any]]:
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            yield from _walk(item, (*path, i))
    elif isinstance(obj, Mapping):
        for key, item in obj.items():
            yield from _walk(item, (*path, key))


def tensor_leaves(args: tuple, kwargs: dict) -> Iterator[tuple[tuple, Any]]:
    """``(path, tensor)`` of every tensor in ``args`` and ``kwargs``.

    Lists, tuples and mappings (a module's feature dict) are looked into.
    """
    for i, a in enumerate(args):
        yield from _walk(a, ("args", i))
    for key, value in kwargs.items():
        yield from _walk(value, ("kwargs", key))


def _rebuild(obj: Any, path: tuple, new: dict[tuple, Any]) -> Any:
    if path in new:
        return new[path]
    if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Tensor):
        items = [_rebuild(item, (*path, i), new) for i, item in enumerate(obj)]
        return type(obj)(items) if isinstance(obj, list) else tuple(items)
    if isinstance(obj, Mapping) and any(len(p) > len(path) and p[: len(path)] == path for p in new):
        return {key: _rebuild(item, (*path, key), new) for key, item in obj.items()}
    return obj


def replace_leaves(args: tuple, kwargs: dict, new: dict[tuple, Any]) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with the tensor at each path of ``new`` replaced.

    A mapping that holds a replaced tensor comes back as a plain ``dict``. The recursion is
    a module-level function, not a closure: a recursive closure is a reference cycle, and
    the tensors of ``new`` would then live until the garbage collector runs.
    """
    out_args = tuple(_rebuild(a, ("args", i), new) for i, a in enumerate(args))
    out_kwargs = {k: _rebuild(v, ("kwargs", k), new) for k, v in kwargs.items()}
    return out_args, out_kwargs


__all__ = ["replace_leaves", "tensor_leaves"]
