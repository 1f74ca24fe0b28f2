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

from physicsnemo_foldcp.core.blocks import (
    ROWS,
    ShardingLayoutError,
    block,
    coordinate,
    gather_rows,
    local_of,
    mesh_sizes,
    row_shapes,
)
from physicsnemo_foldcp.core.tensor import FoldTensor, wrap


class _AtomRows(torch.autograd.Function):
    """Plain replicated ``[M, A, ...]`` -> this rank's rows ``[M, A_p, ...]`` (a slice).

    Backward: the local gradient rows gathered over ``cp0`` into the whole (every rank
    then holds the gradient of the replicated input).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh, sizes: tuple[int, ...]) -> torch.Tensor:
        """The forward pass (see the class docstring)."""
        ctx.mesh, ctx.sizes = mesh, sizes
        start, length = block(sizes, coordinate(mesh)[0])
        return x.narrow(1, start, length).clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """The adjoint of :meth:`forward`."""
        return gather_rows(grad.contiguous(), 1, ctx.sizes, ctx.mesh), None, None


class _WholeAtoms(torch.autograd.Function):
    """This rank's rows ``[M, A_p, ...]`` -> the whole ``[M, A, ...]`` on every rank.

    Forward: ONE all-gather over ``cp0``. Backward: this rank's rows of the gradient
    (every rank holds the whole gradient of the replicated output).
    """

    @staticmethod
    def forward(ctx, local: torch.Tensor, mesh, sizes: tuple[int, ...]) -> torch.Tensor:
        """The forward pass (see the class docstring)."""
        ctx.start, ctx.length = block(sizes, coordinate(mesh)[0])
        return gather_rows(local.contiguous(), 1, sizes, mesh)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """The adjoint of :meth:`forward`."""
        return grad.narrow(1, ctx.start, ctx.length).contiguous(), None, None


def scatter_atom_rows(x: torch.Tensor, like: ShardTensor) -> FoldTensor:
    """A plain replicated atom tensor ``[M, A, ...]`` as scattered atoms laid out like ``like``.

    Parameters
    ----------
    x : torch.Tensor
        The same on every rank of the domain, serial atom order.
    like : ShardTensor
        A scattered atom feature ``[B, A, ...]`` (``(Shard(1), Replicate())``).

    Returns
    -------
    FoldTensor
        ``[M, A, ...]``: this rank's atom rows, no communication.
    """
    sizes = tuple(mesh_sizes(like, ROWS, 1))
    if x.shape[1] != sum(sizes):
        raise ShardingLayoutError(
            f"diffusion: coordinates {tuple(x.shape)} have {x.shape[1]} atoms, the scattered "
            f"features {sum(sizes)}"
        )
    local = _AtomRows.apply(x, like.device_mesh, sizes)
    return wrap(local, like.device_mesh, like.placements, row_shapes(local.shape, 1, sizes))


def gather_atom_rows(x: ShardTensor) -> torch.Tensor:
    """Scattered atoms ``[M, A, ...]`` as one plain tensor on every rank (serial order).

    ONE all-gather over ``cp0`` (differentiable: backward keeps this rank's rows).
    """
    return _WholeAtoms.apply(local_of(x), x.device_mesh, tuple(mesh_sizes(x, ROWS, 1)))


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
    r = scatter_atom_rows(r_noisy, feats["ref_pos"]) if plain else r_noisy
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
    return gather_atom_rows(update) if plain else update


def handlers() -> list[tuple[type, Callable[..., Any]]]:
    """``[(DiffusionModule, score_model)]``."""
    from boltz.model.modules.diffusionv2 import DiffusionModule

    return [(DiffusionModule, score_model)]


__all__ = ["gather_atom_rows", "handlers", "scatter_atom_rows", "score_model"]
