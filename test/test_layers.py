"""The package's layers point down: no import points up, and no modules import in a cycle."""

import textwrap
from pathlib import Path

import pytest

from physicsnemo_foldcp.testing import layers

PACKAGE = Path(__file__).resolve().parents[1] / "physicsnemo_foldcp"


@pytest.fixture(scope="module")
def edges():
    return layers.import_edges(layers.module_files(PACKAGE))


def test_every_subpackage_has_a_layer():
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert "core" in packages and "versions" in modules
    for name in sorted(packages | modules):
        layers.layer_of(name)


def test_no_import_points_up(edges):
    assert edges, "the reader found no import at all"
    problems = layers.layer_violations(edges)
    assert not problems, "\n".join(problems)


def test_no_modules_import_in_a_cycle(edges):
    cycles = layers.module_cycles(edges)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def _write(root, files):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_the_checks_find_a_back_edge_and_a_cycle(tmp_path):
    """A copy of the package with one upward import added fails both checks."""
    root = tmp_path / "physicsnemo_foldcp"
    _write(root, {
        "__init__.py": "",
        "core/__init__.py": "",
        "core/tensor.py": "def f():\n    from physicsnemo_foldcp.ops import maps\n",
        "ops/__init__.py": "",
        "ops/maps.py": "from physicsnemo_foldcp.core.tensor import f\n",
    })  # fmt: skip
    edges = layers.import_edges(layers.module_files(root))
    assert [(e.source, e.target, e.in_function) for e in edges] == [
        ("physicsnemo_foldcp.core.tensor", "physicsnemo_foldcp.ops.maps", True),
        ("physicsnemo_foldcp.ops.maps", "physicsnemo_foldcp.core.tensor", False),
    ]
    problems = layers.layer_violations(edges)
    assert len(problems) == 1 and "core.tensor:2 imports physicsnemo_foldcp.ops.maps" in problems[0]
    assert layers.module_cycles(edges) == [
        ["physicsnemo_foldcp.core.tensor", "physicsnemo_foldcp.ops.maps"]
    ]


def test_the_real_package_with_a_back_edge_added_fails(edges):
    extra = layers.Edge(
        "physicsnemo_foldcp.sharding.scatter", "physicsnemo_foldcp.ops.maps", 1, True
    )
    problems = layers.layer_violations([*edges, extra])
    assert any("sharding.scatter:1 imports physicsnemo_foldcp.ops.maps" in p for p in problems)


def test_peers_may_not_import_each_other():
    edge = layers.Edge(
        "physicsnemo_foldcp.data.loader", "physicsnemo_foldcp.testing.asserts", 3, False
    )
    assert layers.layer_violations([edge])


def test_a_subpackage_without_a_layer_is_named():
    with pytest.raises(KeyError, match="'newpkg' is in no layer"):
        layers.layer_of("newpkg")
