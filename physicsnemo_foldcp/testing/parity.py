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


__all__ = ["close", "compare_parameter_grads"]
