"""Only ``core/compat.py`` reads private names of PhysicsNeMo or torch.distributed.

The private names are collected from the installed upstream code itself (module-level
names and class attributes starting with one underscore), so a name upstream adds later is
caught too. The scanner is checked on code that does use such names.
"""

import ast
import dataclasses
import importlib
import inspect
import pkgutil
from pathlib import Path

import physicsnemo.domain_parallel
import torch.distributed
import torch.distributed.tensor
from physicsnemo.domain_parallel import ShardTensor, ShardTensorSpec
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import physicsnemo_foldcp

PACKAGE = Path(physicsnemo_foldcp.__file__).parent
COMPAT = PACKAGE / "core" / "compat.py"
UPSTREAM_PACKAGES = ("physicsnemo", "torch.distributed")


def _upstream(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in UPSTREAM_PACKAGES)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def upstream_private_names() -> set[str]:
    """Underscore names of upstream's domain-parallel and distributed modules and classes."""
    names: set[str] = set()
    modules = [physicsnemo.domain_parallel, torch.distributed, torch.distributed.tensor]
    modules += [importlib.import_module(f"torch.distributed.checkpoint.{name}")
                for name in ("filesystem", "metadata", "default_planner", "planner")]  # fmt: skip
    for package in (physicsnemo.domain_parallel,):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            try:
                modules.append(importlib.import_module(info.name))
            except Exception:  # noqa: BLE001 - optional backends (CUDA-only) may not import
                continue
    for module in modules:
        names |= {n for n in vars(module) if _private(n)}
    for cls in (ShardTensor, ShardTensorSpec, DTensor, DeviceMesh, torch.distributed.ProcessGroup):
        for klass in inspect.getmro(cls):
            if klass.__module__.startswith(("physicsnemo", "torch")):
                attributes = set(vars(klass)) | set(getattr(klass, "__annotations__", {}))
                attributes |= set(getattr(klass, "__slots__", ()))
                if dataclasses.is_dataclass(klass):
                    attributes |= {f.name for f in dataclasses.fields(klass)}
                names |= {n for n in attributes if _private(n)}
    return names


def violations(source: str, private: set[str]) -> list[str]:
    """Lines of ``source`` that import or read an upstream private name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            upstream = _upstream(node.module)
            if upstream and any(_private(part) for part in node.module.split(".")):
                found.append(f"line {node.lineno}: from {node.module} import ...")
            for alias in node.names:
                if upstream and _private(alias.name):
                    found.append(f"line {node.lineno}: from {node.module} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if _upstream(alias.name) and any(map(_private, parts)):
                    found.append(f"line {node.lineno}: import {alias.name}")
        elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr in private:
            found.append(f"line {node.lineno}: .{node.attr}")
    return found


def test_upstream_private_names_are_found():
    private = upstream_private_names()
    for name in ("_local_tensor", "_spec", "_function_registry", "_sharding_shapes"):
        assert name in private


def test_the_scanner_finds_private_uses():
    private = upstream_private_names()
    code = (
        "from physicsnemo.domain_parallel.shard_tensor import _is_tracing\n"
        "import torch.distributed._functional_collectives as funcol\n"
        "from physicsnemo.domain_parallel._shard_tensor_spec import ShardTensorSpec\n"
        "shapes = x._spec._sharding_shapes\n"
        "local = x._local_tensor\n"
        "mine = self._cache\n"
    )
    found = violations(code, private)
    assert len(found) == 6, found  # _cache is not upstream's: not flagged
    assert not any("_cache" in f for f in found)


def test_only_the_compat_module_uses_private_upstream_names():
    private = upstream_private_names()
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == COMPAT:
            continue
        found = violations(path.read_text(), private)
        if found:
            offenders[str(path.relative_to(PACKAGE))] = found
    assert not offenders, f"private upstream names outside core/compat.py: {offenders}"


def test_the_compat_module_does_use_them():
    assert violations(COMPAT.read_text(), upstream_private_names())
