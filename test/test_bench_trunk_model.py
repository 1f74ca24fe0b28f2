"""The trunk benchmark's memory model: the fit recovers known coefficients, refuses bad input."""

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.memory_model import (  # noqa: E402
    TERMS,
    StepShape,
    check,
    features,
    fit,
    largest_fitting,
    model_from_mapping,
)

TRUE = {
    "const": 3e6,
    "atoms": 12.0,
    "msa": 20.0,
    "msa_gather": 4.0,
    "pair": 28.0,
    "pair_work": 40.0,
    "strip": 6.0,
    "tri_att": 16.0,
    "pair_fixed": 900.0,
}


def design() -> list[StepShape]:
    """Points that tell every term apart: several N, meshes, widths, depths, MSA rows."""
    shapes = []
    for cp in ((1, 1), (2, 2), (3, 3)):
        for n in (48, 96, 160, 224):
            shapes.append(StepShape(n, 10 * n, 32, cp[0], cp[1], param_bytes=1e6 * (1 + cp[0])))
    for n in (64, 128):
        shapes.append(StepShape(n, 10 * n, 32, token_z=64, param_bytes=2e6))
        shapes.append(StepShape(n, 10 * n, 32, msa_blocks=2, param_bytes=2e6))
        shapes.append(StepShape(n, 10 * n, 128, param_bytes=2e6))
        shapes.append(StepShape(n, 10 * n, 32, atom_z=32, param_bytes=2e6))
        shapes.append(StepShape(n, 10 * n, 32, pairformer_blocks=4, param_bytes=2e6))
    return shapes


def exact(shapes: list[StepShape]) -> list[float]:
    vector = np.array([TRUE[t] for t in TERMS])
    return [float(features(s) @ vector) + s.param_bytes for s in shapes]


def test_fit_recovers_known_coefficients_and_predicts_unseen_points():
    shapes = design()
    model = fit(shapes, exact(shapes))
    for term in TERMS:
        assert model.coefficients[term] == pytest.approx(TRUE[term], rel=1e-6), term
    unseen = [StepShape(320, 3200, 48, 4, 4, token_z=128, msa_blocks=3, param_bytes=5e6)]
    (point,) = check(model, unseen, exact(unseen))
    assert abs(point["error"]) < 1e-9


def test_fit_is_non_negative_and_close_under_noise():
    shapes = design()
    rng = np.random.default_rng(0)
    noisy = [v * (1 + 0.01 * rng.standard_normal()) for v in exact(shapes)]
    model = fit(shapes, noisy)
    assert all(v >= 0 for v in model.coefficients.values())
    errors = [abs(c["error"]) for c in check(model, shapes, exact(shapes))]
    assert max(errors) < 0.05


def test_fit_refuses_too_few_points_and_bad_measurements():
    shapes = design()
    with pytest.raises(ValueError, match="cannot fit"):
        fit(shapes[: len(TERMS) - 1], exact(shapes)[: len(TERMS) - 1])
    with pytest.raises(ValueError, match="measurements"):
        fit(shapes, exact(shapes)[:-1])
    with pytest.raises(ValueError, match="exceed"):
        fit(shapes, [0.5 * s.param_bytes for s in shapes])


def test_sharded_terms_shrink_with_the_mesh():
    one = features(StepShape(240, 2400, 64))
    four = features(StepShape(240, 2400, 64, 2, 2))
    nine = features(StepShape(240, 2400, 64, 3, 3))
    pair = TERMS.index("pair")
    assert four[pair] == pytest.approx(one[pair] / 4)
    assert nine[pair] == pytest.approx(one[pair] / 9)
    assert four[TERMS.index("atoms")] == pytest.approx(one[TERMS.index("atoms")] / 2)
    assert four[TERMS.index("const")] == one[TERMS.index("const")] == 1.0


def test_largest_fitting_is_the_last_size_in_budget():
    model = model_from_mapping(TRUE)

    def predict(n: int) -> float:
        return model.predict(StepShape(n, 10 * n, 32, 2, 2))

    budget = predict(300) + 1.0
    assert largest_fitting(predict, budget, low=8, high=4096) == 300
    assert largest_fitting(predict, 0.0, low=8, high=4096) is None
    with pytest.raises(ValueError, match="missing"):
        model_from_mapping({"const": 1.0})
