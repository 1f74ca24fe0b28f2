"""validate_model: a correct model passes; a wrong handler and a fallback all-gather are found."""

import warnings

import pytest
import torch
from physicsnemo.domain_parallel import ShardTensor
from torch import nn
from torch.overrides import handle_torch_function, has_torch_function

from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.models import ModelConfig, ReferenceFoldModel
from physicsnemo_foldcp.models.reference import Transition
from physicsnemo_foldcp.testing import collective_assert
from physicsnemo_foldcp.training import batched, validate_model
from physicsnemo_foldcp.training import validate as validate_module

mesh_id = lambda s: "x".join(map(str, s))  # noqa: E731
CONFIG = ModelConfig(c_atom=8, c_token=16, c_pair=8, n_blocks=2, n_heads=2)


def scaled(x):
    """``2 x``, with a deliberately wrong ShardTensor handler (``3 x``) below."""
    if has_torch_function((x,)):
        return handle_torch_function(scaled, (x,), x)
    return 2 * x


def _wrong_handler(func, types, args, kwargs):
    (x,) = args
    shapes = dict(x._spec._sharding_shapes)
    return ShardTensor.from_local(
        3 * x.to_local(), x.device_mesh, x.placements, sharding_shapes=shapes
    )


ShardTensor.register_function_handler(scaled, _wrong_handler)


class ScaledTransition(Transition):
    def forward(self, x):
        return scaled(super().forward(x))


def model_with_bad_op():
    torch.manual_seed(0)
    model = ReferenceFoldModel(CONFIG)
    bad = ScaledTransition(CONFIG.c_token, CONFIG.transition_factor)
    bad.load_state_dict(model.blocks[1].single_transition.state_dict())
    model.blocks[1].single_transition = bad
    return model


class Cumulative(nn.Module):
    def forward(self, s):
        return torch.cumsum(s, dim=1)


class TokenCumsum(nn.Module):
    """A cumulative sum of a token feature over tokens (a sharded axis), then a Linear."""

    def __init__(self):
        super().__init__()
        self.cumulative = Cumulative()
        self.embed = nn.Linear(33, 4)

    def forward(self, **feats):
        return {"s": self.embed(self.cumulative(feats["res_type"].float()))}


def token_loss(outputs, feats):
    return outputs["s"].pow(2).mean()


def test_tf32_is_pinned_off_and_warned_once(monkeypatch):
    monkeypatch.setattr(validate_module, "_warned_tf32", False)
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        with pytest.warns(UserWarning, match="TF32 was enabled"):
            with validate_module.tf32_off() as was_on:
                assert was_on
                assert not torch.backends.cuda.matmul.allow_tf32
                assert torch.get_float32_matmul_precision() == "highest"
        assert torch.backends.cuda.matmul.allow_tf32
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with validate_module.tf32_off():
                pass
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.multigpu_static
@pytest.mark.parametrize(
    "fold_mesh", [(1, 2, 2), (2, 1, 2), (1, 2, 3), (1, 3, 3)], indirect=True, ids=mesh_id
)
def test_reference_model_validates(fold_mesh):
    cp0, cp1 = fold_mesh.cp
    sample = batched(make_complex(23, seed=4, msa_rows=2))
    torch.manual_seed(0)
    report = validate_model(ReferenceFoldModel(CONFIG), sample, fold_mesh)
    expected_gathers = (3 + 2 * CONFIG.n_blocks) if cp0 > 1 else 0
    gathers = report.forward_collectives.get("all_gather_into_tensor", 0)
    problems = []
    if not report.ok:
        problems.append(report.format())
    if gathers != expected_gathers:
        problems.append(f"{gathers} forward all-gathers, expected {expected_gathers}")
    if len(report.module_errors) < 40 or len(report.gradient_errors) != len(
        list(ReferenceFoldModel(CONFIG).parameters())
    ):
        problems.append(
            f"compared {len(report.module_errors)} modules, {len(report.gradient_errors)} grads"
        )
    collective_assert(not problems, "; ".join(problems))


@pytest.mark.multigpu_static
@pytest.mark.parametrize("fold_mesh", [(1, 2, 2), (1, 2, 3)], indirect=True, ids=mesh_id)
def test_a_wrong_handler_is_located(fold_mesh):
    sample = batched(make_complex(21, seed=5, msa_rows=2))
    report = validate_model(model_with_bad_op, sample, fold_mesh)
    problems = []
    if report.ok or report.first_divergent_module != "blocks.1.single_transition":
        problems.append(f"first divergent module {report.first_divergent_module!r}")
    upstream = [k for k in report.module_errors if k.startswith(("atom_encoder", "blocks.0."))]
    if any(report.module_errors[k] > 1e-4 for k in upstream):
        problems.append("modules before the wrong op diverge too")
    if report.loss_ok or not report.bad_gradients:
        problems.append("loss and gradients should differ")
    collective_assert(not problems, "; ".join(problems) + "\n" + report.format())


@pytest.mark.multigpu_static
@pytest.mark.parametrize("fold_mesh", [(1, 2, 2), (1, 2, 3)], indirect=True, ids=mesh_id)
def test_a_fallback_all_gather_is_reported(fold_mesh):
    """cumsum over the sharded token axis: correct (even row blocks) but all-gathered."""
    sample = batched(make_complex(36, seed=6, msa_rows=2))  # 18 + 18 token rows
    torch.manual_seed(0)
    report = validate_model(TokenCumsum(), sample, fold_mesh, loss_fn=token_loss)
    found = report.unexpected_all_gathers
    problems = []
    if not report.loss_ok or report.bad_gradients:
        problems.append("the fallback result should be correct")
    if report.ok or not found:
        problems.append("no unexpected all-gather reported")
    elif not any(f.module == "cumulative" and "cumsum" in f.op for f in found):
        problems.append(f"reported {[(f.op, f.module) for f in found]}")
    collective_assert(not problems, "; ".join(problems) + "\n" + report.format())


class GenericFallbacks(nn.Module):
    """A matmul, an einsum and an indexing that read along the sharded token axis."""

    def __init__(self):
        super().__init__()
        self.rows = nn.Linear(33, 4)
        self.columns = nn.Linear(33, 4)
        self.values = nn.Linear(33, 3)

    def forward(self, **feats):
        x = feats["res_type"].float()
        pair = (self.rows(x)[:, :, None] * self.columns(x)[:, None, :]).sum(-1)  # the tile
        v = self.values(x)
        picked = torch.tensor([0, 3, 5, 8])
        return {
            "matmul": torch.matmul(pair, v),
            "einsum": torch.einsum("bij,bjc->bic", pair, v),
            "index": v[:, picked],
        }


def generic_loss(outputs, feats):
    return sum(out.pow(2).mean() for out in outputs.values())


@pytest.mark.multigpu_static
@pytest.mark.parametrize("fold_mesh", [(1, 2, 2), (1, 3, 3)], indirect=True, ids=mesh_id)
def test_matmul_einsum_and_index_fallbacks_are_reported_by_name(fold_mesh):
    sample = batched(make_complex(13, seed=7, msa_rows=2))
    torch.manual_seed(0)
    report = validate_model(GenericFallbacks(), sample, fold_mesh, loss_fn=generic_loss)
    ops = {f.op for f in report.unexpected_all_gathers}
    problems = []
    if not (report.loss_ok and report.outputs_ok) or report.bad_gradients:
        problems.append("the gathered results should equal serial")
    for name in ("Tensor.matmul", "torch.einsum", "Tensor.__getitem__"):
        if not any(op.endswith(name.split(".")[-1]) for op in ops):
            problems.append(f"{name} not reported (reported: {sorted(ops)})")
    if report.ok:
        problems.append("a model that gathers must not validate as ok")
    collective_assert(not problems, "; ".join(problems) + "\n" + report.format())


class _Predicts(nn.Module):
    """A module with a ``predict_step``, for the refusals of ``step="predict"``."""

    def predict_step(self, feats):
        """Nothing to predict."""
        return {}


def test_a_prediction_needs_a_predict_step_and_takes_no_loss():
    """Refused before any work: a model without predict_step, a loss, an unknown step."""
    with pytest.raises(TypeError, match="Linear has no predict_step"):
        validate_model(nn.Linear(2, 2), {}, None, step="predict")
    with pytest.raises(ValueError, match="loss_fn is for step='train'"):
        validate_model(_Predicts(), {}, None, step="predict", loss_fn=lambda out, feats: 0)
    with pytest.raises(ValueError, match="step must be 'train' or 'predict', got 'eval'"):
        validate_model(nn.Linear(2, 2), {}, None, step="eval")
