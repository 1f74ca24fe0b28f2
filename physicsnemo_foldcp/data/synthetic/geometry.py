"""Vector geometry of the synthetic complex: unit vectors, rotations, chain walks, distances.

Every random draw takes the complex's local :class:`torch.Generator`; nothing here touches
torch's global generator.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def unit(v: Tensor) -> Tensor:
    """``v / |v|`` along the last axis (``[..., 3]``), safe at zero."""
    return v / v.norm(dim=-1, keepdim=True).clamp_min(1e-8)


def in_plane(u: Tensor, p: Tensor, angle_deg: float) -> Tensor:
    """Return the unit vector at ``angle_deg`` from ``u`` in the plane of ``u`` and ``p``."""
    a = math.radians(angle_deg)
    return math.cos(a) * u + math.sin(a) * p


def perpendicular(u: Tensor, g: torch.Generator) -> Tensor:
    """A random unit vector perpendicular to the unit vector ``u`` ``[3]`` (float64)."""
    r = torch.randn(3, generator=g, dtype=torch.float64)
    return unit(r - (r @ u) * u)


def random_rotations(n: int, g: torch.Generator) -> Tensor:
    """``[n, 3, 3]`` uniformly random rotation matrices (float32)."""
    q = unit(torch.randn(n, 4, generator=g, dtype=torch.float64))
    w, x, y, z = q.unbind(-1)
    rot = torch.stack(
        [
            1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w),
            2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w),
            2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y),
        ],
        dim=-1,
    )  # fmt: skip
    return rot.reshape(n, 3, 3).float()


def chain_trace(
    length: int, step: float, start: Tensor, radius: float, g: torch.Generator
) -> Tensor:
    """Walk ``length`` points ``step`` apart, with persistence and a loose confinement.

    Returns
    -------
    torch.Tensor
        ``[length, 3]`` float64 positions, the first at ``start``.
    """
    noise = torch.randn(length, 3, generator=g, dtype=torch.float64).tolist()
    heading = unit(torch.randn(3, generator=g, dtype=torch.float64)).tolist()
    x, y, z = start.tolist()
    out = [[x, y, z]]
    for i in range(1, length):
        pull = 0.35 * max(0.0, math.sqrt(x * x + y * y + z * z) / radius - 0.5)
        norm = max(math.sqrt(x * x + y * y + z * z), 1e-8)
        d = [1.2 * heading[k] + noise[i][k] - pull * (x, y, z)[k] / norm * 3.0 for k in range(3)]
        dn = max(math.sqrt(sum(c * c for c in d)), 1e-8)
        heading = [c / dn for c in d]
        x, y, z = x + step * heading[0], y + step * heading[1], z + step * heading[2]
        out.append([x, y, z])
    return torch.tensor(out, dtype=torch.float64)


def pairwise(x: Tensor) -> Tensor:
    """``[N, N]`` Euclidean distances of the points ``x`` ``[N, 3]`` (exact, no matmul)."""
    return torch.cdist(x, x, compute_mode="donot_use_mm_for_euclid_dist")


def pairwise_to(x: Tensor, y: Tensor) -> Tensor:
    """``[N, M]`` float32 distances from ``x`` ``[N, 3]`` to ``y`` ``[M, 3]``."""
    return torch.cdist(x.float(), y.float(), compute_mode="donot_use_mm_for_euclid_dist")


def not_collinear(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """Boltz frame validity: ``b-a`` and ``b-c`` long enough and not (anti)parallel."""
    v1, v2 = b - a, b - c
    n1, n2 = v1.norm(dim=-1), v2.norm(dim=-1)
    cos = (v1 / (n1[..., None] + 1e-6) * (v2 / (n2[..., None] + 1e-6))).sum(-1)
    return (cos.abs() < 0.9063) & (n1 > 1e-2) & (n2 > 1e-2)
