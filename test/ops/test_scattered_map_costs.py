"""Boltz's map products on the scatter's own output cost nothing: no collective, no host sync.

The maps come straight from ``scatter_features`` (the source validated them, so they are
tagged checked); nothing here tags a map by hand. Forward and backward of each of
Boltz's ``bmm`` / ``einsum`` forms issue no collective, no point-to-point call and no
tensor-to-host conversion, and match serial element by element.
"""

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode

from physicsnemo_foldcp import scatter_features
from physicsnemo_foldcp.core import compat
from physicsnemo_foldcp.data.synthetic import make_complex
from physicsnemo_foldcp.ops import map_tag, wrap
from physicsnemo_foldcp.testing import collective_assert, collective_assert_close
from physicsnemo_foldcp.testing.collectives import collective_counts
from physicsnemo_foldcp.testing.host_syncs import count_host_syncs

pytestmark = pytest.mark.multigpu_static

MESHES = [(1, 2, 2), (1, 2, 3)]


def boltz_forms(feats, s, q, x):
    """Boltz-2's uses of the atom<->token maps, as its modules write them."""
    a2t = feats["atom_to_token"].float()
    t2r = feats["token_to_rep_atom"].float()
    return {
        "bmm(a2t, s)": torch.bmm(a2t, s),
        "bmm(a2t normalised^T, q)": torch.bmm(
            (a2t / (a2t.sum(1, keepdim=True) + 1e-6)).transpose(1, 2), q
        ),
        "bmm(t2r, x)": torch.bmm(t2r, x),
        "einsum(bat,btc->bac)": torch.einsum("bat,btc->bac", a2t, s),
        "a2t @ s": a2t @ s,
    }


def _leaf_like(x, width, generator):
    """A float leaf with ``x``'s row layout and ``width`` channels, and its serial twin."""
    shapes = {m: [(*r[:-1], width) for r in rows] for m, rows in compat.sharding_shapes(x).items()}
    full_shape = (*compat.global_shape(x)[:-1], width)
    full = torch.randn(full_shape, generator=generator, dtype=torch.float32)
    rows = [r[1] for r in shapes[0]]
    i = x.device_mesh.get_local_rank(0)
    start = sum(rows[:i])
    local = full[:, start : start + rows[i]].clone().requires_grad_(True)
    full = full.clone().requires_grad_(True)
    return local, wrap(local, x.device_mesh, x.placements, shapes), full


@pytest.mark.parametrize("fold_mesh", MESHES, indirect=True, ids=lambda s: "x".join(map(str, s)))
def test_boltz_map_products_on_scattered_samples_cost_no_collective_and_no_sync(
    fold_mesh, p2p_counter
):
    serial = {k: v.unsqueeze(0) for k, v in make_complex(37, seed=4, preset="boltz2").items()}
    feats = scatter_features(serial if fold_mesh.is_domain_source else None, fold_mesh)
    for name in ("atom_to_token", "token_to_rep_atom"):
        tag = map_tag(feats[name])
        collective_assert(tag is not None and tag.checked, f"{name} left the scatter as {tag}")

    generator = torch.Generator().manual_seed(0)
    s_local, s, s_full = _leaf_like(feats["res_type"], 6, generator)
    q_local, q, q_full = _leaf_like(feats["ref_pos"], 5, generator)
    x_local, x, x_full = _leaf_like(feats["ref_pos"], 3, generator)

    with CommDebugMode() as forward, p2p_counter() as p2p_forward, count_host_syncs() as syncs:
        outs = boltz_forms(feats, s, q, x)
    grads = {
        k: wrap(torch.ones_like(compat.local_tensor(v)), v.device_mesh, v.placements,
                {m: list(r) for m, r in compat.sharding_shapes(v).items()})
        for k, v in outs.items()
    }  # fmt: skip
    with CommDebugMode() as backward, p2p_counter() as p2p_back, count_host_syncs() as back:
        torch.autograd.backward(list(outs.values()), list(grads.values()))

    counts = {
        "forward collectives": collective_counts(forward),
        "backward collectives": collective_counts(backward),
        "point-to-point": p2p_forward["calls"] + p2p_back["calls"],
        "host syncs": f"{syncs.format()}\n{back.format()}",
    }
    collective_assert(
        not counts["forward collectives"]
        and not counts["backward collectives"]
        and counts["point-to-point"] == 0
        and syncs.total == 0
        and back.total == 0,
        f"map products on the scatter's output communicated or synchronised: {counts}",
    )

    serial_feats = {k: serial[k] for k in ("atom_to_token", "token_to_rep_atom")}
    expected = boltz_forms(serial_feats, s_full, q_full, x_full)
    for name, out in outs.items():
        collective_assert(
            tuple(compat.global_shape(out)) == tuple(expected[name].shape),
            f"{name}: global shape {tuple(compat.global_shape(out))} != serial "
            f"{tuple(expected[name].shape)}",
        )
        collective_assert_close(out.full_tensor(), expected[name], name, atol=1e-6, rtol=1e-6)
    serial_outs = list(expected.values())
    torch.autograd.backward(serial_outs, [torch.ones_like(v) for v in serial_outs])
    _assert_grads_match(fold_mesh, feats, (s_local, q_local, x_local), (s_full, q_full, x_full))


def _assert_grads_match(mesh, feats, locals_, fulls):
    i = mesh.domain_mesh.get_local_rank(0)
    rows = {
        "tokens": [r[1] for r in compat.sharding_shapes(feats["res_type"])[0]],
        "atoms": [r[1] for r in compat.sharding_shapes(feats["ref_pos"])[0]],
    }
    for (local, full), axis in zip(zip(locals_, fulls), ("tokens", "atoms", "atoms")):
        start = sum(rows[axis][:i])
        block = full.grad[:, start : start + rows[axis][i]]
        collective_assert_close(local.grad, block, f"{axis} gradient", atol=1e-6, rtol=1e-6)
