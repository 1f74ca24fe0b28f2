"""Boltz-2's diffusion module (the score model) between plain coordinates and scattered atoms.

Boltz's sampler (``AtomDiffusion.sample``) keeps the coordinates of the ``M`` samples
``[M, A, 3]`` (O(A)): it draws their noise, centres them, applies random rotations, aligns
and steps them. Here they stay plain tensors, replicated over the domain, in the serial
atom order (the scatter keeps it when atoms are not padded per shard), so the sampler runs
unchanged and every rank of a domain draws the serial noise from the one random stream
they share. Only the score model (``DiffusionModule``) computes on the scattered features.

Its distributed forward here takes the noised coordinates as they come (plain, the serial
layout), keeps this rank's atom rows as a FoldTensor laid out like ``ref_pos``
(``(Shard(1), Replicate())``), runs Boltz's own ``DiffusionModule.forward`` (its atom
encoder, token transformer and atom decoder go to their own handlers), and returns the
coordinate update plain and whole again: ONE all-gather over ``cp0`` of ``[M, A_p, 3]``
per call. Backward (training) reverses both moves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from physicsnemo.domain_parallel import ShardTensor

from physicsnemo_foldcp.core.blocks import ShardingLayoutError
from physicsnemo_foldcp.core.whole import rows_of_whole, whole_of_rows


def score_model(
    module: torch.nn.Module,
    s_inputs: torch.Tensor,
    s_trunk: torch.Tensor,
    r_noisy: torch.Tensor,
    times: torch.Tensor,
    feats: dict[str, Any],
    diffusion_conditioning: dict[str, Any],
    multiplicity: int = 1,
    _inference_cache: Any = None,
) -> torch.Tensor:
    """``DiffusionModule.forward`` with plain coordinates and scattered features.

    Parameters
    ----------
    module : boltz.model.modules.diffusionv2.DiffusionModule
        The score model.
    s_inputs, s_trunk : FoldTensor
        ``[B, N, token_s]``, row-sharded.
    r_noisy : torch.Tensor
        ``[B M, A, 3]`` scaled noised coordinates, plain (the same on every rank), serial
        atom order; a scattered FoldTensor is taken as it is.
    times : torch.Tensor
        ``[B M]`` noise levels, plain.
    feats : dict[str, torch.Tensor]
        The scattered features.
    diffusion_conditioning : dict[str, FoldTensor]
        ``DiffusionConditioning``'s outputs (``q``, ``c``, ``to_keys``, the biases).
    multiplicity : int, default 1
        Samples ``M`` per complex.
    _inference_cache : None
        Boltz's denoiser cache; must be None (it is off unless ``BOLTZ_DENOISER_CACHE``).

    Returns
    -------
    torch.Tensor
        ``[B M, A, 3]`` coordinate update, plain when ``r_noisy`` was.
    """
    if _inference_cache is not None:
        raise ShardingLayoutError(
            "DiffusionModule under CP: Boltz's denoiser cache (BOLTZ_DENOISER_CACHE=on) is "
            "not distributed; unset it"
        )
    plain = not isinstance(r_noisy, ShardTensor)
    r = rows_of_whole(r_noisy, feats["ref_pos"]) if plain else r_noisy
    original = type(module).forward.foldcp_original
    update = original(
        module,
        s_inputs=s_inputs,
        s_trunk=s_trunk,
        r_noisy=r,
        times=times,
        feats=feats,
        diffusion_conditioning=diffusion_conditioning,
        multiplicity=multiplicity,
    )
    return whole_of_rows(update) if plain else update


def handlers() -> list[tuple[type, Callable[..., Any]]]:
    """``[(DiffusionModule, score_model)]``."""
    from boltz.model.modules.diffusionv2 import DiffusionModule

    return [(DiffusionModule, score_model)]


__all__ = ["handlers", "score_model"]
