"""The kernels' backward under the autocast state of their forward.

A kernel is a ``torch.autograd.Function`` whose forward runs inside the caller's
``torch.autocast`` (its matmuls in bf16 when the model runs in bf16) and whose backward
autograd runs outside it. Its saved inputs may then be fp32 while the incoming gradient
is bf16, and a matmul of the two fails ("expected m1 and m2 to have the same dtype").
``torch.amp.custom_fwd`` / ``custom_bwd`` fix that for one device type named in advance;
:func:`backward_in_forward_autocast` does it for the device the forward's tensors are on,
so the same kernel serves CPU (gloo) and CUDA (NCCL).
"""

from __future__ import annotations

import functools

import torch


def backward_in_forward_autocast(function: type[torch.autograd.Function]):
    """Class decorator: run ``function.backward`` under the autocast state of its forward.

    The forward records the device type of its first tensor argument, whether autocast is
    on there and its dtype; the backward enters the same ``torch.autocast``. Without
    autocast in the forward, nothing changes.

    Parameters
    ----------
    function : type[torch.autograd.Function]
        A Function with static ``forward(ctx, ...)`` and ``backward(ctx, ...)``.

    Returns
    -------
    type[torch.autograd.Function]
        The same class, its two methods wrapped.
    """
    forward, backward = function.forward, function.backward

    @functools.wraps(forward)
    def recording_forward(ctx, *args, **kwargs):
        device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
        ctx.forward_autocast = (
            device,
            torch.is_autocast_enabled(device),
            torch.get_autocast_dtype(device),
        )
        return forward(ctx, *args, **kwargs)

    @functools.wraps(backward)
    def autocast_backward(ctx, *grads):
        device, enabled, dtype = ctx.forward_autocast
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            return backward(ctx, *grads)

    function.forward = staticmethod(recording_forward)
    function.backward = staticmethod(autocast_backward)
    return function


__all__ = ["backward_in_forward_autocast"]
