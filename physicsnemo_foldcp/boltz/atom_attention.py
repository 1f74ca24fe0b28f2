"""Boltz-2's atom encoder and windowed atom transformer on atoms scattered with their tokens.

``AtomEncoder`` (encodersv2) embeds the atoms and builds the atom pair features of every
window of ``W`` query atoms and ``H`` key atoms; ``AtomTransformer`` (transformersv2) runs
a ``DiffusionTransformer`` on those windows. Run op by op, both ``view`` the atom axis into
windows and build the keys with an ``einsum`` over the sharded atom axis
(:mod:`physicsnemo_foldcp.ops.atom_windows` says why that fails on scattered atoms).

The distributed forwards here cut this rank's atoms at window boundaries
(:class:`~physicsnemo_foldcp.ops.atom_windows.AtomWindows`): the windows that start in a
``cp0`` row block's atoms are split among the block's ``cp1`` ranks, and each rank runs
the module's own submodules (``torch.func.functional_call``) on the windows it owns, with
keys that include the halo atoms of the neighbouring runs: every window, key and pair
feature is the serial one, and each is computed once. The parameters used on the windows
get each rank's part of their gradients, summed over ``cp0`` and ``cp1``; those used on
the atoms of a row block (the encoder's ``embed_atom_features`` and ``s_to_c_trans``,
computed alike by its ``cp1`` ranks) are summed over ``cp0`` only.

Layouts (over ``(cp0, cp1)``): atom tensors ``[B, A, ...]`` are ``(Shard(1), Replicate())``,
atoms with their tokens; the atom pair features ``p`` / the bias ``[B, K, W, H, c]`` are
``(Shard(1), Replicate())`` in window-aligned blocks of ``K_p`` windows; the returned
``to_keys`` is a :class:`WindowKeys`.

Communication per call: point to point among the ranks of one ``cp0`` column, fewer than
``W`` atoms per block boundary to cut the windows (and back for the transformer's
output); point to point between neighbouring runs, ``(H - W) / 2`` halo atoms per side
and per key set (the encoder's positions, mask, ids and embeddings; each transformer
layer's normalised activations and mask); the same in backward. Over ``cp1``: the
encoder's ``p`` and the transformer's output joined from the runs (ONE all-gather each),
and in backward ONE all-gather per input with a gradient (the encoder's ``c`` and
``z``'s window entries; the transformer's ``q``, ``c`` and bias). The parameter
gradients: one all-reduce per mesh dim for each of the two groups. The encoder's
padding check reads the plan (the pads in the ``atom_to_token`` map's tag): no
communication, no host sync (for a sample that did not come from the scatter, one small
all-gather over ``cp0`` of the mask's flags).

Both encoders run here: the trunk's, and the diffusion conditioning's
(``structure_prediction=True``), whose ``z_to_p`` reads the pair entry of each (query,
key) token pair of a window (:func:`pair_of_windows`: one all-reduce over ``cp1``). The
transformer takes ``multiplicity > 1`` (the window bias repeated over the samples, as
Boltz does); Boltz's denoiser conditioning cache is refused with a clear error. The
windows of a ``cp0`` row block run on each of its ``cp1`` ranks: that work is repeated
``cp1`` times (the trunk benchmark's FLOP table shows it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn.functional import one_hot

from physicsnemo_foldcp.core.blocks import (
    COLUMNS,
    ROWS,
    SumToReplicate,
    block,
    coordinate,
    local_of,
    mesh_sizes,
    row_shapes,
)
from physicsnemo_foldcp.core.tensor import FoldTensor, wrap
from physicsnemo_foldcp.ops import ShardingLayoutError
from physicsnemo_foldcp.ops.atom_windows import (
    ATOM_DIM,
    AtomWindows,
    gather_windows,
    own_windows,
)
from physicsnemo_foldcp.ops.modules import submodule_caller, tile_parameters

ROW_BLOCK_SUBMODULES = ("embed_atom_features", "s_to_c_trans")
"""``AtomEncoder`` submodules applied to a row block's atoms or tokens, which its ``cp1``
ranks compute alike (their gradients are summed over ``cp0`` only)."""


class WindowKeys:
    """``to_keys`` of scattered atoms: ``[B, A, D]`` -> keys ``[B, K, H, D]`` of every window.

    The keys come in window-aligned blocks, ``(Shard(1), Replicate())``; equal to Boltz's
    ``single_to_keys`` of the whole tensor.
    """

    def __init__(self, windows: AtomWindows) -> None:
        self.windows = windows

    def __call__(self, x: FoldTensor) -> FoldTensor:
        """Keys of every window of ``x`` (scattered atoms like the encoder's)."""
        local = self.windows.window_keys(self.windows.to_windows(x))
        return self.windows.wrap_windows(local, x)


def _no_autocast(device: torch.device) -> torch.autocast:
    """Boltz runs both modules in full precision."""
    return torch.autocast(device.type, enabled=False)


def _atom_features(module: torch.nn.Module, feats: dict[str, Any]) -> torch.Tensor:
    """The concatenated atom features of ``AtomEncoder.forward`` (op by op, no parameters)."""
    b, n = feats["ref_pos"].shape[:2]
    atom_feats = [
        feats["ref_pos"],
        feats["ref_charge"].unsqueeze(-1),
        feats["ref_element"],
    ]
    if not module.use_no_atom_char:
        atom_feats.append(feats["ref_atom_name_chars"].reshape(b, n, 4 * 64))
    if module.use_atom_backbone_feat:
        atom_feats.append(feats["atom_backbone_feat"])
    if module.use_residue_feats_atoms:
        res_feats = torch.cat(
            [
                feats["res_type"],
                feats["modified"].unsqueeze(-1),
                one_hot(feats["mol_type"], num_classes=4).float(),
            ],
            dim=-1,
        )
        atom_feats.append(torch.bmm(feats["atom_to_token"].float(), res_feats))
    return torch.cat(atom_feats, dim=-1)


def atom_encoder(
    module: torch.nn.Module,
    feats: dict[str, Any],
    s_trunk: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
) -> tuple[FoldTensor, FoldTensor, FoldTensor, WindowKeys]:
    """``AtomEncoder.forward`` on scattered atom features (see the module docstring).

    Parameters
    ----------
    module : boltz.model.modules.encodersv2.AtomEncoder
        The trunk's (``structure_prediction=False``) or the diffusion conditioning's
        (``structure_prediction=True``).
    feats : dict[str, torch.Tensor]
        Boltz-2's atom features ``[B, A, ...]``, scattered (``ref_pos``,
        ``atom_pad_mask``, ``ref_space_uid``, ``ref_charge``, ``ref_element``,
        ``atom_to_token``, ...).
    s_trunk : torch.Tensor, optional
        ``[B, N, token_s]`` row-sharded; with ``structure_prediction`` only.
    z : torch.Tensor, optional
        ``[B, N, N, token_z]`` pair tile; with ``structure_prediction`` only.

    Returns
    -------
    q : FoldTensor
        ``[B, A, atom_s]`` atom embeddings, laid out like ``ref_pos``.
    c : FoldTensor
        ``q`` plus, with ``structure_prediction``, the trunk's single of each atom's token.
    p : FoldTensor
        ``[B, K, W, H, atom_z]`` atom pair features, window-aligned blocks; with
        ``structure_prediction`` including the pair ``z`` of each (query, key) token pair
        (:func:`pair_of_windows`).
    to_keys : WindowKeys
        The keys of scattered atoms.

    Raises
    ------
    ShardingLayoutError
        When ``s_trunk`` / ``z`` do not match ``structure_prediction``, atoms are not a
        multiple of ``W``, or pad atoms lie inside the atom axis (per-shard atom padding).
    """
    conditioned = s_trunk is not None and z is not None
    if module.structure_prediction != conditioned:
        raise ShardingLayoutError(
            f"AtomEncoder(structure_prediction={module.structure_prediction}) needs "
            f"{'both' if module.structure_prediction else 'neither of'} s_trunk and z"
        )
    ref_pos = feats["ref_pos"]
    mesh = ref_pos.device_mesh
    windows = AtomWindows.of(
        ref_pos, module.atoms_per_window_queries, module.atoms_per_window_keys, "ref_pos"
    )
    windows.check_padding(feats["atom_pad_mask"], feats.get("atom_to_token"))
    with _no_autocast(ref_pos.device):
        # the windows' submodules run on each rank's owned windows, z_to_p_trans on its
        # pair tile (summed over both dims); those on the row block's atoms over cp0 only
        row_part = dict.fromkeys(ROW_BLOCK_SUBMODULES, (ROWS,))
        row_part["z_to_p_trans"] = (ROWS, COLUMNS)
        params = tile_parameters(module, mesh, windows.window_mesh_dims, submodule_dims=row_part)
        call = submodule_caller(module, params)
        c_local = call("embed_atom_features", local_of(_atom_features(module, feats)))
        atom_shapes = row_shapes(c_local.shape, ATOM_DIM, windows.atom_sizes)
        q = wrap(c_local, mesh, ref_pos.placements, atom_shapes)

        def queries_and_keys(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """``x`` per owned window: queries ``[B, K, W, 1, ...]``, keys ``[B, K, 1, H, ...]``."""
            owned = own_windows(windows.to_windows(x), windows, windows.queries)
            return (
                windows.windows_of(owned, windows.owned_count).unsqueeze(3),
                windows.owned_keys(owned).unsqueeze(2),
            )

        pos_q, pos_k = queries_and_keys(local_of(ref_pos))
        d = pos_k - pos_q
        d_norm = 1 / (1 + torch.sum(d * d, dim=-1, keepdim=True))
        mask_q, mask_k = queries_and_keys(local_of(feats["atom_pad_mask"]).float())
        uid_q, uid_k = queries_and_keys(local_of(feats["ref_space_uid"]))
        v = (mask_q.bool() & mask_k.bool() & (uid_q == uid_k)).float().unsqueeze(-1)

        p = call("embed_atompair_ref_pos", d) * v
        p = p + call("embed_atompair_ref_dist", d_norm) * v
        p = p + call("embed_atompair_mask", v) * v
        if conditioned:
            atom_to_token = feats["atom_to_token"].float()
            s_to_c = call("s_to_c_trans", local_of(s_trunk).float())
            s_to_c = wrap(
                s_to_c,
                mesh,
                s_trunk.placements,
                row_shapes(s_to_c.shape, 1, mesh_sizes(s_trunk, ROWS, 1)),
            )
            c_local = c_local + local_of(torch.bmm(atom_to_token, s_to_c))
            z_to_p = call("z_to_p_trans", local_of(z).float())
            p = p + pair_of_windows(z_to_p, z, atom_to_token, windows)
        c = wrap(c_local, mesh, ref_pos.placements, atom_shapes) if conditioned else q
        c_q, c_k = queries_and_keys(c_local)
        p = p + call("c_to_p_trans_q", c_q)
        p = p + call("c_to_p_trans_k", c_k)
        p = p + call("p_mlp", p)
        p = gather_windows(p, windows)
    return q, c, windows.wrap_windows(p, ref_pos), WindowKeys(windows)


def atom_tokens(atom_to_token: FoldTensor) -> torch.Tensor:
    """Global token index of each of this rank's atoms, ``-1`` for pad atoms.

    Parameters
    ----------
    atom_to_token : FoldTensor
        The scattered one-hot map ``[B, A, N]`` (rows split over ``cp0``, full columns).

    Returns
    -------
    torch.Tensor
        ``[B, A_p]`` int64, local (read on the device, no host sync).
    """
    local = local_of(atom_to_token)
    return torch.where(local.amax(dim=-1) > 0, local.argmax(dim=-1), -1)


def pair_of_windows(
    z_local: torch.Tensor, z: FoldTensor, atom_to_token: FoldTensor, windows: AtomWindows
) -> torch.Tensor:
    """``z[token(query), token(key)]`` for every (query, key) atom pair of this rank's windows.

    Boltz's ``einsum("bijd,bwki,bwlj->bwkld", z, queries' map, keys' map)`` without the
    dense maps: each rank looks up, for its own atoms, the entries of its pair tile at
    (the atom's token, each key atom's token) and leaves zeros for keys whose token
    column another ``cp1`` rank holds; the sum over ``cp1`` completes every row, and the
    rows move to the window-aligned layout like any atom tensor. A pad atom or a key
    outside ``[0, A)`` has no token, and gets zeros, as in Boltz.

    Parameters
    ----------
    z_local : torch.Tensor
        This rank's tile ``[B, N_i, M_j, d]`` of a pair tensor laid out like ``z``.
    z : FoldTensor
        The pair tile ``(Shard(1), Shard(2))`` it was computed from (its blocks).
    atom_to_token : FoldTensor
        The scattered ``atom_to_token`` map ``[B, A, N]``.
    windows : AtomWindows
        The atom windows.

    Returns
    -------
    torch.Tensor
        ``[B, K_pl, W, H, d]``, the windows this rank owns.

    Notes
    -----
    Communication: the window moves of an ``[B, A_p, H]`` index and an ``[B, A_p, H, d]``
    tensor (point to point in a ``cp0`` column, fewer than ``W`` rows per block boundary,
    plus the key halos of the index), and ONE all-reduce over ``cp1`` of
    ``[B, A_p, H, d]``; backward: ONE all-gather over ``cp1`` of the owned windows'
    gradients, the identity over ``cp1`` (every ``cp1`` rank's rows get the whole gradient,
    and each tile entry is read on one rank only), the moves back, and the lookup's
    scatter-add into the tile.
    """
    mesh = z.device_mesh
    p, q = coordinate(mesh)
    row_start, _ = block(mesh_sizes(z, ROWS, 1), p)
    col_start, col_len = block(mesh_sizes(z, COLUMNS, 2), q)
    b, rows, cols, width = z_local.shape
    tokens = atom_tokens(atom_to_token)  # [B, A_p]
    # Token + 1 of every key atom of this rank's windows (0: no token), back at the atoms.
    shifted = windows.to_windows((tokens + 1).to(z_local.dtype).unsqueeze(-1))
    keys = windows.window_keys(shifted).squeeze(-1)  # [B, K_p, H]
    count, w = keys.shape[1], windows.queries
    per_atom = keys[:, :, None, :].expand(b, count, w, windows.keys).reshape(b, count * w, -1)
    key_tokens = local_of(windows.to_atoms(per_atom, atom_to_token)).round().long() - 1
    key_cols = key_tokens - col_start
    held = (tokens >= 0)[..., None] & (key_tokens >= 0) & (key_cols >= 0) & (key_cols < col_len)
    index = (tokens - row_start).clamp(0, max(rows - 1, 0))[..., None] * cols + key_cols.clamp(
        0, max(cols - 1, 0)
    )
    atoms = index.shape[1]
    flat = z_local.reshape(b, rows * cols, width)
    if flat.shape[1] == 0:
        looked_up = z_local.new_zeros(b, atoms * windows.keys, width)
    else:
        looked_up = flat.gather(1, index.reshape(b, -1, 1).expand(-1, -1, width))
    looked_up = looked_up.view(b, atoms, windows.keys, width) * held[..., None].to(z_local.dtype)
    complete = SumToReplicate.apply(looked_up, mesh, (COLUMNS,))
    return windows.windows_of(own_windows(windows.to_windows(complete), windows, windows.queries),
                              windows.owned_count)  # fmt: skip


def atom_transformer(
    module: torch.nn.Module,
    q: torch.Tensor,
    c: torch.Tensor,
    bias: torch.Tensor,
    to_keys: Callable | None,
    mask: torch.Tensor,
    multiplicity: int = 1,
    conditioning_cache: Any = None,
) -> FoldTensor:
    """``AtomTransformer.forward`` on scattered atoms (see the module docstring).

    Parameters
    ----------
    module : boltz.model.modules.transformersv2.AtomTransformer
        The Boltz module (its ``diffusion_transformer`` runs on this rank's windows).
    q, c : FoldTensor
        ``[B, A, atom_s]`` atom activations and conditioning, scattered atoms.
    bias : FoldTensor
        ``[B / M, K, W, H, depth * heads]`` window-aligned blocks (the encoder's ``p``
        projected).
    to_keys : callable or None
        The encoder's :class:`WindowKeys` (unused: the keys are built here).
    mask : FoldTensor
        ``[B, A]`` atom mask, scattered atoms.
    multiplicity : int, default 1
        Samples per batch element of ``bias``: ``q``, ``c`` and ``mask`` have batch
        ``B M``, ``bias`` has ``B`` (repeated here, as Boltz does, window by window).
    conditioning_cache : None
        Must be None (Boltz's denoiser cache is off by default).

    Returns
    -------
    FoldTensor
        ``[B, A, atom_s]``, laid out like ``q``.
    """
    if conditioning_cache is not None:
        raise ShardingLayoutError(
            "AtomTransformer under CP: Boltz's denoiser conditioning cache "
            "(BOLTZ_DENOISER_CACHE) is not distributed; leave it off"
        )
    windows = AtomWindows.of(q, module.attn_window_queries, module.attn_window_keys, "q")
    b, dim = q.shape[0], q.shape[-1]
    count, w, h = windows.owned_count, windows.queries, windows.keys
    bias_local = local_of(bias)
    if bias_local.shape[0] * multiplicity != b:
        raise ShardingLayoutError(
            f"AtomTransformer: bias batch {bias_local.shape[0]} x multiplicity {multiplicity} "
            f"is not the batch {b} of q"
        )
    row_windows = windows.window_counts[windows.p]
    if tuple(bias.shape[1:4]) != (sum(windows.window_counts), w, h) or (
        bias_local.shape[1] != row_windows
    ):
        raise ShardingLayoutError(
            f"AtomTransformer: bias {tuple(bias.shape)} (local {tuple(bias_local.shape)}) is "
            f"not the encoder's window-aligned [B, {sum(windows.window_counts)}, {w}, {h}, c] "
            f"with {row_windows} windows here"
        )
    # Boltz repeats the window bias over the samples (O(A H), not a pair tensor).
    bias_local = own_windows(bias_local, windows).repeat_interleave(multiplicity, 0)

    def window_keys(x: torch.Tensor) -> torch.Tensor:
        """Boltz's ``to_keys`` on this rank's windows ``[B K, W, d]`` -> ``[B K, H, d]``."""
        keys = windows.owned_keys(x.reshape(b, count * w, x.shape[-1]))
        return keys.reshape(b * count, h, x.shape[-1])

    transformer = module.diffusion_transformer

    def run(a: torch.Tensor, s: torch.Tensor, window_bias: torch.Tensor, window_mask: torch.Tensor):
        """The transformer on this rank's windows, its parameters' gradients reduced."""
        params = tile_parameters(module, q.device_mesh, windows.window_mesh_dims)
        if not count:
            return _no_windows(a, s, window_bias, params)
        call = submodule_caller(module, params)
        checkpointing = transformer.activation_checkpointing
        transformer.activation_checkpointing = False  # checkpointed around ``run`` instead
        try:
            return call("diffusion_transformer", a=a, s=s, bias=window_bias, mask=window_mask,
                        multiplicity=1, to_keys=window_keys, conditioning_cache=None)  # fmt: skip
        finally:
            transformer.activation_checkpointing = checkpointing

    def owned(x: torch.Tensor) -> torch.Tensor:
        """This rank's windows of scattered atoms ``x``, ``[B K, W, ...]``."""
        run_of = own_windows(windows.to_windows(x), windows, w)
        return run_of.reshape(b * count, w, *run_of.shape[2:])

    inputs = (
        owned(q),
        owned(c),
        bias_local.reshape(b * count, w, h, bias_local.shape[-1]),
        owned(local_of(mask).float()),
    )
    if transformer.activation_checkpointing and transformer.training:
        # Boltz's reentrant checkpoint would recompute each layer with the module's own
        # parameters, past the reduction of their gradients over the mesh; the
        # non-reentrant one recomputes only the saved tensors, and the gradients take the
        # forward's path.
        out = torch.utils.checkpoint.checkpoint(run, *inputs, use_reentrant=False)
    else:
        out = run(*inputs)
    out = gather_windows(out.reshape(b, count * w, dim), windows, w)
    return windows.to_atoms(out, q)


def _no_windows(
    a: torch.Tensor, s: torch.Tensor, bias: torch.Tensor, params: dict[str, torch.Tensor]
) -> torch.Tensor:
    """The empty output ``[0, W, d]`` of a rank without windows, which Boltz's attention refuses.

    A row block of fewer atoms than a window may start no window. Zero gradients still
    reach the inputs and the parameters, so that this rank takes part in the backward's
    moves and parameter reductions like the others.
    """
    anchor = s.sum() + bias.sum() + sum(p.sum() for p in params.values() if p.requires_grad)
    return a * 0 + anchor * 0


def handlers() -> list[tuple[type, Callable]]:
    """``(Boltz class, handler)`` pairs of this module."""
    from boltz.model.modules.encodersv2 import AtomEncoder
    from boltz.model.modules.transformersv2 import AtomTransformer

    return [(AtomEncoder, atom_encoder), (AtomTransformer, atom_transformer)]


__all__ = [
    "WindowKeys",
    "atom_encoder",
    "atom_tokens",
    "atom_transformer",
    "handlers",
    "pair_of_windows",
]
