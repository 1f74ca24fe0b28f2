"""Serial semantics of the ops (plain tensors): Boltz's formulas, both map layouts, relpos."""

import pytest
import torch
from physicsnemo.domain_parallel import ShardTensor

from physicsnemo_foldcp.core.leaves import replace_leaves, tensor_leaves
from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.dispatch.rules import CONTRACTION_FUNCS
from physicsnemo_foldcp.ops import (
    atoms_to_tokens_mean,
    masked_mean,
    outer_sum,
    pair_distances,
    pair_mask,
    relative_position_encoding,
    relpos_width,
    representative_atoms,
    tokens_to_atoms,
)
from physicsnemo_foldcp.testing.memory import tensors_in_reference_cycles

RELPOS_KEYS = ("residue_index", "token_index", "asym_id", "entity_id", "sym_id")


@pytest.fixture(scope="module")
def feats():
    x = make_complex(29, seed=5, preset="boltz2", msa_rows=3, n_conformers=1)
    return {k: v.unsqueeze(0) for k, v in x.items()}


def index_map(dense):
    has = (dense != 0).any(-1)
    return torch.where(has, (dense != 0).to(torch.int8).argmax(-1), -1)


def test_dense_ops_are_exactly_boltz_expressions(feats):
    g = torch.Generator().manual_seed(0)
    a2t, t2r = feats["atom_to_token"], feats["token_to_rep_atom"]
    s = torch.randn(1, a2t.shape[2], 7, generator=g)
    q = torch.randn(1, a2t.shape[1], 7, generator=g)
    a2t_f = a2t.float()
    assert torch.equal(tokens_to_atoms(s, a2t), torch.bmm(a2t_f, s))
    boltz_mean = torch.bmm((a2t_f / (a2t_f.sum(1, keepdim=True) + 1e-6)).transpose(1, 2), q)
    assert torch.equal(atoms_to_tokens_mean(q, a2t), boltz_mean)
    assert torch.equal(representative_atoms(q, t2r), torch.bmm(t2r.float(), q))
    assert torch.equal(tokens_to_atoms(s[0], a2t[0]), torch.mm(a2t_f[0], s[0]))


def test_index_layout_gives_the_dense_result(feats):
    g = torch.Generator().manual_seed(1)
    a2t = feats["atom_to_token"].clone()
    a2t[0, -3:] = 0  # trailing atoms without a token
    n, a = a2t.shape[2], a2t.shape[1]
    s, q = torch.randn(1, n, 4, generator=g), torch.randn(1, a, 4, generator=g)
    idx = index_map(a2t)
    assert (idx[0, -3:] == -1).all()
    dense_atoms = tokens_to_atoms(s, a2t)
    assert torch.equal(tokens_to_atoms(s, idx), dense_atoms)
    assert torch.equal(dense_atoms[0, -3:], torch.zeros(3, 4))
    torch.testing.assert_close(
        atoms_to_tokens_mean(q, idx, n_tokens=n), atoms_to_tokens_mean(q, a2t), rtol=1e-6, atol=1e-6
    )
    for name in ("token_to_rep_atom", "token_to_center_atom", "r_set_to_rep_atom"):
        dense = feats[name]
        assert torch.equal(
            representative_atoms(q, index_map(dense)), representative_atoms(q, dense)
        )
    with pytest.raises(ValueError, match="index map needs n_tokens"):
        atoms_to_tokens_mean(q, idx)


def test_index_layout_gradients_are_the_dense_gradients(feats):
    a2t = feats["atom_to_token"].double()
    idx = index_map(a2t)
    n, a = a2t.shape[2], a2t.shape[1]
    s = torch.randn(1, n, 3, dtype=torch.double, requires_grad=True)
    q = torch.randn(1, a, 3, dtype=torch.double, requires_grad=True)
    torch.autograd.gradcheck(lambda t: tokens_to_atoms(t, idx), (s,))
    torch.autograd.gradcheck(lambda t: atoms_to_tokens_mean(t, idx, n_tokens=n), (q,))
    w = torch.randn(1, a, 3, dtype=torch.double)
    (g_index,) = torch.autograd.grad((tokens_to_atoms(s, idx) * w).sum(), s)
    (g_dense,) = torch.autograd.grad((tokens_to_atoms(s, a2t) * w).sum(), s)
    torch.testing.assert_close(g_index, g_dense)


def reference_relpos(feats, r_max, s_max, fix_sym_check):
    """Algorithm 3 of AF3 as Boltz implements it, one token pair at a time."""
    ids = {k: feats[k][0].tolist() for k in RELPOS_KEYS}
    n = len(ids["token_index"])
    width = 4 * (r_max + 1) + 2 * (s_max + 1) + 1
    out = torch.zeros(1, n, n, width)
    for i in range(n):
        for j in range(n):
            same_chain = ids["asym_id"][i] == ids["asym_id"][j]
            same_residue = ids["residue_index"][i] == ids["residue_index"][j]
            same_entity = ids["entity_id"][i] == ids["entity_id"][j]
            d_res = min(
                max(ids["residue_index"][i] - ids["residue_index"][j] + r_max, 0), 2 * r_max
            )
            d_res = d_res if same_chain else 2 * r_max + 1
            d_tok = min(max(ids["token_index"][i] - ids["token_index"][j] + r_max, 0), 2 * r_max)
            d_tok = d_tok if same_chain and same_residue else 2 * r_max + 1
            d_sym = min(max(ids["sym_id"][i] - ids["sym_id"][j] + s_max, 0), 2 * s_max)
            other = (not same_entity) if fix_sym_check else same_chain
            d_sym = 2 * s_max + 1 if other else d_sym
            out[0, i, j, d_res] = 1
            out[0, i, j, 2 * r_max + 2 + d_tok] = 1
            out[0, i, j, 4 * r_max + 4] = float(same_entity)
            out[0, i, j, 4 * r_max + 5 + d_sym] = 1
    return out


@pytest.mark.parametrize("r_max, s_max, fix", [(32, 2, False), (4, 1, True)])
def test_relative_position_encoding_is_algorithm_3(feats, r_max, s_max, fix):
    got = relative_position_encoding(*(feats[k] for k in RELPOS_KEYS), r_max, s_max, fix)
    assert got.shape[-1] == relpos_width(r_max, s_max)
    assert torch.equal(got, reference_relpos(feats, r_max, s_max, fix))


def test_pair_ops_follow_their_definitions():
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(1, 6, 3, generator=g), torch.randn(1, 5, 3, generator=g)
    pair = outer_sum(a, b)
    assert pair.shape == (1, 6, 5, 3)
    assert torch.equal(pair[0, 4, 2], a[0, 4] + b[0, 2])
    m = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    assert torch.equal(pair_mask(m)[0], torch.outer(m[0], m[0]))
    d = pair_distances(a, b)
    assert torch.allclose(d[0, 4, 2], (a[0, 4] - b[0, 2]).norm())


def test_masked_mean_is_sum_over_count(feats):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 5, 5, 2, generator=g)
    mask = (torch.rand(1, 5, 5, 1, generator=g) > 0.4).float()
    full = masked_mean(x, mask, eps=0.0)
    assert torch.allclose(full, x[mask.expand_as(x).bool()].mean())
    per_row = masked_mean(x, mask, dim=(2, 3), eps=0.0)
    for i in range(5):
        keep = mask[0, i, :, 0].bool()
        expected = x[0, i][keep].mean() if keep.any() else torch.tensor(0.0)
        assert torch.allclose(per_row[0, i], expected)
    assert masked_mean(x, mask, dim=-1, keepdim=True).shape == (1, 5, 5, 1)
    assert torch.allclose(masked_mean(x, torch.zeros_like(mask)), torch.tensor(0.0))
    with pytest.raises(ValueError, match="repeats an axis"):
        masked_mean(x, mask, dim=(1, -3))


def test_only_the_plugins_own_functions_are_registered_with_physicsnemo():
    from physicsnemo_foldcp.core.tensor import own_functions

    OWN = own_functions()

    registry = ShardTensor._function_registry
    for op in (tokens_to_atoms, atoms_to_tokens_mean, representative_atoms, outer_sum, masked_mean):
        assert registry[op] is OWN[op]
    for func in (*CONTRACTION_FUNCS, torch.Tensor.unsqueeze, torch.Tensor.__getitem__, torch.cdist):
        handler = registry.get(func)
        assert handler is None or handler.__module__.startswith("physicsnemo."), (func, handler)


class TwiceRegistered(torch.nn.Module):
    """One Linear under two names (as Boltz's ``output_projection_linear``) and a weight
    shared with another Linear (tied weights)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)
        self.gated = torch.nn.Sequential(self.linear, torch.nn.Sigmoid())
        self.tied = torch.nn.Linear(3, 3, bias=False)
        self.tied.weight = self.linear.weight

    def forward(self, x):
        return self.gated(x) + self.tied(x)


def test_submodules_called_with_other_tensors_get_their_own_parameters_back():
    from physicsnemo_foldcp.ops.modules import parameter_slots, submodule_caller

    holder = torch.nn.ModuleDict({"m": TwiceRegistered()})
    before = dict(holder.named_parameters(remove_duplicate=False))
    slots = parameter_slots(holder)
    assert sorted(slots) == ["m.linear.bias", "m.linear.weight", "m.tied.weight"]
    views = {id(p): p * 2 for p in before.values()}
    swapped = {name: views[id(p)] for name, p in slots.items()}
    x = torch.randn(4, 3)
    out = submodule_caller(holder, swapped)("m", x)
    m = holder["m"]
    w, b = m.linear.weight * 2, m.linear.bias * 2
    expected = torch.sigmoid(x @ w.T + b) + x @ w.T
    assert torch.allclose(out, expected, rtol=1e-6, atol=1e-6)
    after = dict(holder.named_parameters(remove_duplicate=False))
    assert all(after[name] is p for name, p in before.items())


def test_replacing_tensor_leaves_leaves_no_tensor_in_a_reference_cycle():
    """A recursive closure over the replacements kept them alive until the next collection."""
    replacement = torch.full((3,), 2.0)

    def run():
        args = ({"a": torch.ones(3), "b": [torch.zeros(2)]},)
        paths = [path for path, _ in tensor_leaves(args, {"c": torch.ones(1)})]
        assert paths == [("args", 0, "a"), ("args", 0, "b", 0), ("kwargs", "c")]
        out_args, _ = replace_leaves(args, {}, {("args", 0, "a"): replacement.clone()})
        assert torch.equal(out_args[0]["a"], replacement)
        assert out_args[0]["b"][0] is args[0]["b"][0]

    left = tensors_in_reference_cycles(run)
    assert not left, f"tensors left in reference cycles: {[tuple(t.shape) for t in left]}"
