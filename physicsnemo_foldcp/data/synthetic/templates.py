"""Templates: the all-zero dummy templates Boltz-2 emits at inference without template inputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from physicsnemo_foldcp.data.synthetic.vocab import NUM_TOKENS


def dummy_templates(t: int, n: int) -> dict[str, Tensor]:
    """``t`` empty templates over ``n`` (padded) tokens.

    ``template_restype`` ``[T, N, 33]`` long one-hot of class 0, ``template_frame_rot``
    ``[T, N, 3, 3]``, ``template_frame_t``, ``template_cb``, ``template_ca`` ``[T, N, 3]``,
    ``template_mask_cb``, ``template_mask_frame``, ``template_mask``, ``visibility_ids``
    ``[T, N]`` float32 and ``query_to_template`` ``[T, N]`` long, all zero.
    """
    return {
        "template_restype": F.one_hot(torch.zeros(t, n, dtype=torch.long), NUM_TOKENS),
        "template_frame_rot": torch.zeros(t, n, 3, 3, dtype=torch.float32),
        "template_frame_t": torch.zeros(t, n, 3, dtype=torch.float32),
        "template_cb": torch.zeros(t, n, 3, dtype=torch.float32),
        "template_ca": torch.zeros(t, n, 3, dtype=torch.float32),
        "template_mask_cb": torch.zeros(t, n, dtype=torch.float32),
        "template_mask_frame": torch.zeros(t, n, dtype=torch.float32),
        "template_mask": torch.zeros(t, n, dtype=torch.float32),
        "query_to_template": torch.zeros(t, n, dtype=torch.long),
        "visibility_ids": torch.zeros(t, n, dtype=torch.float32),
    }
