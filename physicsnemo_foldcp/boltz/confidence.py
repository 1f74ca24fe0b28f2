"""Boltz's frame prediction for the confidence heads, on the plain O(N + A) data it reads.

``compute_frame_pred`` (``boltz.model.layers.confidence_utils``) picks each token's frame
atoms: the backbone atoms of a polymer token as the features give them, and for a
ligand of three or more atoms the two atoms nearest each atom in the predicted structure
(a sort of the chain's distance matrix). It loops over chains in Python, indexes atoms
by global index and writes the ligand frames in place: op by op on scattered tensors it
would read across the row blocks and is refused (Boltz's ``ConfidenceHeads`` then
catches the exception and reports ``ptm = iptm = 0``).

Everything it reads is O(N) or O(A) (coordinates, token and atom vectors, the frame
indices), so the distributed version runs Boltz's own function on plain copies, the same
on every rank of the domain: the coordinates ``[M, A, 3]`` and the token vectors are
gathered over ``cp0`` (small), and the ``atom_to_token`` map, which the function only
multiplies with ``asym_id``, is handed over as a sparse ``[B, A, N]`` tensor built from
each atom's token (O(A), never the dense ``A x N``). The frame mask it returns is cut back
to the token row blocks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from physicsnemo.domain_parallel import ShardTensor

from physicsnemo_foldcp.core.blocks import ROWS, gather_rows, local_of, mesh_sizes
from physicsnemo_foldcp.core.compat import global_shape
from physicsnemo_foldcp.core.whole import rows_of_whole, whole

#: The features ``compute_frame_pred`` reads besides the map (all O(N) or O(A)).
FRAME_FEATURES = ("asym_id", "token_pad_mask", "atom_pad_mask", "mol_type", "atom_resolved_mask")


def sparse_map_of(atom_to_token: ShardTensor) -> torch.Tensor:
    """The whole one-hot ``atom_to_token`` map ``[B, A, N]`` as a sparse COO tensor.

    Each rank finds its atoms' tokens in its local block; ONE all-gather over ``cp0`` of
    ``[B, A_p]`` token indices. Pad atoms (no token) have no entry, as in the dense map.
    """
    local = local_of(atom_to_token).detach()
    tokens = torch.where(local.amax(dim=-1) > 0, local.argmax(dim=-1), -1)
    sizes = mesh_sizes(atom_to_token, ROWS, 1)
    all_tokens = gather_rows(tokens, 1, sizes, atom_to_token.device_mesh)
    b, a, n = global_shape(atom_to_token)
    batch, atom = torch.nonzero(all_tokens >= 0, as_tuple=True)
    index = torch.stack([batch, atom, all_tokens[batch, atom]])
    values = torch.ones(index.shape[1], dtype=local.dtype, device=local.device)
    return torch.sparse_coo_tensor(index, values, (b, a, n), check_invariants=False).coalesce()


def frame_pred(original: Callable[..., Any]) -> Callable[..., Any]:
    """``compute_frame_pred`` that runs on plain copies when its inputs are scattered.

    Parameters
    ----------
    original : callable
        Boltz's ``compute_frame_pred``.

    Returns
    -------
    callable
        The same signature; with plain inputs, ``original`` itself. With scattered ones:
        ``(frames_idx_pred, frame_mask)``, the frame indices ``[B, M, N, 3]`` plain (the
        same on every rank) and the mask ``[B, M, N]`` in the token row blocks.
    """

    @functools.wraps(original)
    def compute_frame_pred(
        pred_atom_coords: torch.Tensor,
        frames_idx_true: torch.Tensor,
        feats: dict[str, Any],
        multiplicity: int,
        resolved_mask: torch.Tensor | None = None,
        inference: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        like = feats.get("token_pad_mask")
        if not isinstance(like, ShardTensor):
            return original(
                pred_atom_coords, frames_idx_true, feats, multiplicity, resolved_mask, inference
            )
        plain = {k: whole(feats[k]) for k in FRAME_FEATURES if k in feats}
        plain["atom_to_token"] = sparse_map_of(feats["atom_to_token"])
        if "pdb_id" in feats:
            plain["pdb_id"] = feats["pdb_id"]
        frames, mask = original(
            whole(pred_atom_coords),
            whole(frames_idx_true),
            plain,
            multiplicity,
            whole(resolved_mask),
            inference,
        )
        return frames, rows_of_whole(mask, like, dim=2)

    compute_frame_pred.foldcp_original = original
    return compute_frame_pred


#: ``(module, attribute)`` of every place Boltz's code looks ``compute_frame_pred`` up.
FRAME_PRED_SITES = (
    ("boltz.model.layers.confidence_utils", "compute_frame_pred"),
    ("boltz.model.modules.confidencev2", "compute_frame_pred"),
)


def function_handlers() -> list[tuple[str, str, Callable[[Callable], Callable]]]:
    """``(module, attribute, wrap)`` for each Boltz function this module distributes."""
    return [(module, attr, frame_pred) for module, attr in FRAME_PRED_SITES]


def handlers() -> list:
    """No module handlers here (see :func:`function_handlers`)."""
    return []


__all__ = ["FRAME_FEATURES", "frame_pred", "function_handlers", "handlers", "sparse_map_of"]
