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


def test_scenarios_scale_and_checkpoint_the_fitted_terms():
    import math

    from benchmarks.bench_trunk import BASE, Prediction, scenario_bytes

    model = model_from_mapping(TRUE)
    shape = StepShape(96, 960, 32, 2, 2, pairformer_blocks=1, msa_blocks=1, param_bytes=3e6)
    plain = scenario_bytes(model, shape, BASE, Prediction("fp32"))
    assert plain == pytest.approx(model.predict(shape))
    half = scenario_bytes(model, shape, BASE, Prediction("bf16", scale=0.5))
    assert half == pytest.approx(3e6 + 0.5 * (plain - 3e6))
    # One block of each stack: checkpointing only adds the two blocks' saved inputs.
    checked = scenario_bytes(model, shape, BASE, Prediction("ckpt", checkpoint=True))
    saved = 48 * 48 * BASE.token_z * 2 + math.ceil(32 / 2) * 48 * BASE.msa_s
    assert checked - plain == pytest.approx(4.0 * saved)
    # More blocks: the unchecked step grows by whole blocks, the checkpointed one by inputs.
    deep = shape.with_(pairformer_blocks=8)
    grown = scenario_bytes(model, deep, BASE, Prediction("fp32")) - plain
    grown_checked = scenario_bytes(model, deep, BASE, Prediction("c", checkpoint=True)) - checked
    assert grown_checked == pytest.approx(4.0 * 48 * 48 * BASE.token_z * 7)
    assert grown > grown_checked


def test_modes_are_compared_side_by_side_and_named_in_the_basis():
    import dataclasses
    import json

    from benchmarks.bench_trunk import BASE, SCENARIOS, basis_of, precision_rows

    def row(mesh, n, peak, **mode):
        sizes = dataclasses.replace(BASE, **mode)
        return {"mesh": mesh, "ranks_n": int(mesh[0]) ** 2, "N": n, "peak_MiB": peak,
                "sizes": json.dumps(sizes.to_dict()), "peak_this_over_1x1": peak / 100}  # fmt: skip

    rows = [row("1x1", 64, 100.0), row("1x1", 64, 40.0, checkpointing=True),
            row("1x1", 64, 70.0, precision="bf16"), row("2x2", 64, 30.0)]  # fmt: skip
    (table,) = precision_rows(rows)  # 2x2 has one mode only: no row
    assert (table["mesh"], table["N"], table["config"]) == ("1x1", 64, BASE.label())
    assert table["fp32 ckpt / fp32"] == pytest.approx(0.4)
    assert table["bf16 / fp32"] == pytest.approx(0.7)
    assert table["bf16 ckpt peak"] is None
    checks = [{"mode": "fp32 ckpt", "N": 64, "mesh": "1x1", "error": 0.12},
              {"mode": "fp32 ckpt", "N": 128, "mesh": "2x2", "error": -0.03}]  # fmt: skip
    checkpointed = next(s for s in SCENARIOS if s.checkpoint and s.scale == 1.0)
    assert "fp32 ckpt measured at 2 points (N <= 128, 1x1, 2x2)" in basis_of(checkpointed, checks)
    assert "-3 to +12 %" in basis_of(checkpointed, checks)
    assert basis_of(SCENARIOS[-1], checks) == "extrapolated; bf16 ckpt not measured"
