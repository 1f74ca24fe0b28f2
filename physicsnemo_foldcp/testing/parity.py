"""Element-wise parity of a distributed run with the serial one, as a list of problems.

Distributed tests gather every difference they find into a list and assert it empty with
:func:`~physicsnemo_foldcp.testing.collective_assert`, so a failure on one rank fails every
rank with all the messages.
"""

from __future__ import annotations

import torch
from torch import nn


def close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    label: str,
    problems: list[str],
    rtol: float = 1e-5,
    atol: float = 1e-5,
) -> None:
    """Append to ``problems`` unless ``actual`` equals ``expected`` at fp32 tolerance.

    ``atol`` is scaled by ``max(1, max |expected|)``; shapes must match.
    """
    scale = max(1.0, float(expected.abs().max())) if expected.numel() else 1.0
    same_shape = actual.shape == expected.shape
    if not same_shape or not torch.allclose(actual, expected, rtol=rtol, atol=atol * scale):
        diff = (
            (actual - expected).abs().max()
            if same_shape
            else f"shapes {actual.shape} {expected.shape}"
        )
        problems.append(f"{label}: differs by {diff}")


def compare_parameter_grads(distributed: nn.Module, serial: nn.Module, problems: list[str]) -> None:
    """Every parameter gradient of two copies of a module, pairwise (see :func:`close`)."""
    pairs = zip(distributed.named_parameters(), serial.named_parameters())
    for (name, p), (_, q) in pairs:
        if (p.grad is None) != (q.grad is None):
            problems.append(f"{name}: gradient present in one run only")
        elif p.grad is not None:
            close(p.grad, q.grad, f"grad {name}", problems)


def randomize_parameters(module: nn.Module, seed: int, scale: float = 0.5) -> nn.Module:
    """Give every parameter random values from a torch generator, the same on every rank.

    Modules that initialise weights with another random source (Boltz draws some from
    NumPy's global generator) or with zeros (Boltz's final layers, whose gradients are then
    zero for a zero upstream) get non-zero weights that agree across ranks: a parity test
    then compares real gradients. Norm weights get ``1 +`` noise.

    Parameters
    ----------
    module : nn.Module
        Changed in place; returned.
    seed : int
        Seed of the generator.
    scale : float, default 0.5
        Standard deviation, divided by ``sqrt(fan_in)`` for matrices.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=generator, dtype=torch.float32)
            if p.ndim >= 2:
                noise = noise / p.shape[-1] ** 0.5
            offset = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            p.copy_(offset + scale * noise)
    return module


__all__ = ["close", "compare_parameter_grads", "randomize_parameters"]
