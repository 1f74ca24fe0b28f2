"""Generic ops on scattered features run on the plan's uneven blocks and match serial.

PhysicsNeMo's DTensor fallback infers a result's local shapes from ``torch.chunk`` of its
global shape, which disagrees with the plan's blocks (7 tokens on 3 rows are 3, 2, 2;
``torch.chunk`` gives 3, 3, 1); the plugin's rules keep the operand's blocks instead.
"""

import pytest
import torch
from torch.distributed.tensor.placement_types import Shard

from physicsnemo_foldcp import scatter_features
from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.testing import collective_assert
from physicsnemo_foldcp.testing.asserts import gather_failures

pytestmark = pytest.mark.multigpu_static


def shape_changing_steps():
    """(name, fn) pairs of model steps on ``[L, C]`` (``L`` sharded) that change ``C``'s
    length or split it, as a model's heads and concatenations do."""
    return [
        ("cat", lambda t: torch.cat([t, 2 * t], dim=-1)),
        ("unflatten", lambda t: t.unflatten(-1, (1, t.shape[-1]))),
        ("flatten", lambda t: t.unflatten(-1, (1, t.shape[-1])).flatten(-2)),
        ("sum", lambda t: t.sum(-1)),
        ("mean", lambda t: t.mean(-1, keepdim=True)),
        ("slice", lambda t: t[..., :1]),
    ]


@pytest.mark.parametrize("fold_mesh", [(1, 2, 2), (1, 3, 2), (1, 3, 3)], indirect=True, ids=str)
def test_shape_changing_ops_on_uneven_blocks_match_serial(fold_mesh):
    x = make_complex(7, seed=5, preset="boltz2", msa_rows=2)
    sharded = scatter_features(x if fold_mesh.is_domain_source else None, fold_mesh)
    problems = []
    for name in ("ref_pos", "coords", "profile"):
        st, serial = sharded[name].float(), x[name].float()
        sharded_dims = {p.dim for p in st.placements if isinstance(p, Shard)}
        for step, fn in shape_changing_steps():
            local_problem = None
            try:
                out = fn(st)
                lengths = [out.to_local().shape[d] for d in sharded_dims]
                if lengths != [st.to_local().shape[d] for d in sharded_dims]:
                    local_problem = f"{name}.{step}: local lengths {lengths} left the blocks"
            except Exception as error:  # noqa: BLE001 - reported collectively
                local_problem = f"{name}.{step}: {type(error).__name__}: {error}"
            failures = gather_failures(local_problem)  # full_tensor only if every rank can
            if failures:
                problems += [f"rank {r}: {m}" for r, m in failures.items()]
            elif not torch.equal(out.full_tensor(), fn(serial)):
                problems.append(f"{name}.{step}: values differ from serial")
    collective_assert(not problems, "; ".join(problems))


GENERIC_MESHES = [(1, 2, 2), (1, 2, 3), (1, 3, 3)]


def attention_like(x, q_proj, k_proj, v_proj):
    """Ordinary token attention written as a model would, on any ``[1, L, C]`` single."""
    q, k, v = q_proj(x), k_proj(x), v_proj(x)
    a = q @ k.mT
    return a.softmax(-1) @ v


@pytest.mark.parametrize("fold_mesh", GENERIC_MESHES, indirect=True, ids=str)
@pytest.mark.parametrize("feature", ["res_type", "ref_element"])
def test_attention_like_chain_on_uneven_blocks_gives_the_serial_result(fold_mesh, feature):
    """``q @ k.mT; softmax; @ v`` on tokens (13 on the mesh) and on atoms (blocks that
    follow their tokens, not torch.chunk's): output and every weight gradient equal serial."""
    x = {k: v.unsqueeze(0) for k, v in make_complex(13, seed=3, msa_rows=2).items()}
    sharded = scatter_features(x if fold_mesh.is_domain_source else None, fold_mesh)
    width = x[feature].shape[-1]
    torch.manual_seed(0)
    projections = [torch.nn.Linear(width, 8) for _ in range(3)]
    out = attention_like(sharded[feature].float(), *projections)
    loss = (out * out).mean()
    loss.backward()
    grads = [p.weight.grad.clone() for p in projections]
    for p in projections:
        p.weight.grad = None
    serial = attention_like(x[feature].float(), *projections)
    (serial * serial).mean().backward()
    problems = []
    if not torch.allclose(out.full_tensor(), serial, rtol=1e-5, atol=1e-6):
        problems.append("output differs from serial")
    if not torch.allclose(loss.full_tensor(), (serial * serial).mean(), rtol=1e-5):
        problems.append("loss differs from serial")
    for k, (g, p) in enumerate(zip(grads, projections)):
        if not torch.allclose(g, p.weight.grad, rtol=1e-5, atol=1e-6):
            problems.append(f"projection {k}: gradient off by {(g - p.weight.grad).abs().max()}")
    if out.placements[0] != Shard(1):
        problems.append(f"output placements {out.placements}")
    collective_assert(not problems, "; ".join(problems))


@pytest.mark.parametrize("fold_mesh", GENERIC_MESHES, indirect=True, ids=str)
def test_softmax_of_a_pair_tile_stays_a_tile(fold_mesh):
    x = {k: v.unsqueeze(0) for k, v in make_complex(11, seed=2, msa_rows=2).items()}
    sharded = scatter_features(x if fold_mesh.is_domain_source else None, fold_mesh)
    out = sharded["token_bonds"].float().squeeze(-1).softmax(-1)
    serial = x["token_bonds"].float().squeeze(-1).softmax(-1)
    good = tuple(out.placements) == (Shard(1), Shard(2))
    collective_assert(good and torch.allclose(out.full_tensor(), serial), f"{out.placements}")


def single_and_pair(fold_mesh, seed: int, n: int = 11):
    """A serial single ``[1, n, 4]``, a pair ``[1, n, n, 4]`` and their token layout."""
    from physicsnemo_foldcp.testing.layouts import TokenLayout

    g = torch.Generator().manual_seed(seed)
    s_serial, z_serial = torch.randn(1, n, 4, generator=g), torch.randn(1, n, n, 4, generator=g)
    return s_serial, z_serial, TokenLayout(fold_mesh, n)


ZOO = {
    "sum over tokens": lambda s, z: s.sum(1),
    "mean over all": lambda s, z: z.mean(),
    "gram over tokens": lambda s, z: s.mT @ s,
    "einsum pair x single": lambda s, z: torch.einsum("bijc,bjc->bic", z, s),
    "cat channels": lambda s, z: torch.cat([s, s * 2], dim=-1),
    "slice tokens": lambda s, z: s[:, 2:9],
    "slice pair columns": lambda s, z: z[:, :, 0:1, :1],
    "stack": lambda s, z: torch.stack([s, s + 1], dim=1),
    "chunk": lambda s, z: torch.chunk(s, 2, dim=-1)[1],
    "expand": lambda s, z: s[:, :, None, :].expand(-1, -1, 3, -1),
    "softmax over pair rows": lambda s, z: z.softmax(dim=1),
    "amax over columns": lambda s, z: z.amax(dim=2),
    "layer_norm": lambda s, z: torch.nn.functional.layer_norm(z, (4,)),
    "cumsum tokens": lambda s, z: s.cumsum(1),
    "transpose pair": lambda s, z: z.transpose(1, 2) * z,
    "pair over a single on its columns": lambda s, z: z / (s.abs() + 1),
    "single first, times a pair": lambda s, z: (s + 2) * z,
}


@pytest.mark.parametrize("fold_mesh", GENERIC_MESHES, indirect=True, ids=str)
def test_generic_op_zoo_matches_serial_with_gradients(fold_mesh):
    """Each op on a row-sharded single and a pair tile: output and input gradients."""
    from physicsnemo_foldcp.testing.parity import close

    s_serial, z_serial, layout = single_and_pair(fold_mesh, seed=9)
    problems = []
    for name, op in ZOO.items():
        s, s_leaf = layout.shard(s_serial, ("tokens", None), requires_grad=True)
        z, z_leaf = layout.shard(z_serial, ("tokens", "tokens", None), requires_grad=True)
        out = op(s, z)
        (out * out).sum().backward()
        s_ref = s_serial.clone().requires_grad_(True)
        z_ref = z_serial.clone().requires_grad_(True)
        ref = op(s_ref, z_ref)
        (ref * ref).sum().backward()
        close(out.full_tensor(), ref.detach(), f"{name}: output", problems)
        for label, leaf, serial, axes in (
            ("s", s_leaf, s_ref, ("tokens", None)),
            ("z", z_leaf, z_ref, ("tokens", "tokens", None)),
        ):
            if serial.grad is None:
                continue
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            close(grad, layout.local(serial.grad, axes), f"{name}: grad {label}", problems)
    collective_assert(not problems, "; ".join(problems))


FLAGS = {
    "any over all": lambda s, z: torch.any(z > 2.0),
    "all over all": lambda s, z: (s > -2.5).all(),
    "any over pair columns": lambda s, z: torch.any(z > 1.5, dim=2),
    "all over pair rows": lambda s, z: (z > -1.5).all(dim=1),
    "any over tokens, keepdim": lambda s, z: torch.any(s > 1.0, dim=1, keepdim=True),
}


@pytest.mark.parametrize("fold_mesh", GENERIC_MESHES, indirect=True, ids=str)
def test_any_and_all_over_sharded_dims_reduce_without_gathering(fold_mesh):
    """``any`` / ``all`` over sharded dims: local, then a max / min all-reduce."""
    from physicsnemo_foldcp.core import events

    s_serial, z_serial, layout = single_and_pair(fold_mesh, seed=4)
    s, _ = layout.shard(s_serial, ("tokens", None))
    z, _ = layout.shard(z_serial, ("tokens", "tokens", None))
    problems = []
    for name, op in FLAGS.items():
        gathers: list = []
        with events.observe(gathers.append):
            out = op(s, z)
        ref = op(s_serial, z_serial)
        value = out.full_tensor() if hasattr(out, "full_tensor") else out
        if value.dtype != torch.bool or not torch.equal(value, ref):
            problems.append(f"{name}: {value.tolist()} != serial {ref.tolist()}")
        if gathers:
            problems.append(f"{name}: gathered {[e.reason for e in gathers]}")
    # The serial flags take both values, so a constant answer would fail.
    values = torch.cat([op(s_serial, z_serial).flatten() for op in FLAGS.values()])
    collective_assert(bool(values.any()) and not bool(values.all()), "flags are all equal")
    collective_assert(not problems, "; ".join(problems))


@pytest.mark.parametrize("fold_mesh", GENERIC_MESHES, indirect=True, ids=str)
def test_an_embedding_of_a_pair_tile_of_indices_stays_a_tile(fold_mesh):
    """``nn.Embedding`` of bond types on a pair tile (Boltz-2's ``token_bonds_type``):
    the serial output and table gradient, no gather."""
    from physicsnemo_foldcp.core import events
    from physicsnemo_foldcp.testing.parity import close

    _, z_serial, layout = single_and_pair(fold_mesh, seed=5)
    types = (z_serial[..., 0].abs() * 3).long().clamp(max=6)  # [1, N, N], values 0..6
    torch.manual_seed(0)
    table = torch.nn.Embedding(7, 4)
    reference = torch.nn.Embedding(7, 4)
    reference.load_state_dict(table.state_dict())
    indices, _ = layout.shard(types, ("tokens", "tokens"))
    gathers: list = []
    with events.observe(gathers.append):
        out = table(indices)
    (out * out).sum().backward()
    ref = reference(types)
    (ref * ref).sum().backward()
    problems = [f"gathered {[e.reason for e in gathers]}"] if gathers else []
    close(out.full_tensor(), ref.detach(), "output", problems)
    close(table.weight.grad, reference.weight.grad, "table gradient", problems)
    collective_assert(len(set(types.flatten().tolist())) > 3, "too few bond types drawn")
    collective_assert(not problems, "; ".join(problems))
