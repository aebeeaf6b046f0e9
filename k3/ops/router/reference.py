"""The MoE router after its GEMM, in PyTorch: the reference the Triton kernel (triton_topk.py) is tested against,
and the path every differentiable call (training) takes."""

from __future__ import annotations

import torch
from torch import Tensor


def route(logits: Tensor, bias: Tensor, top_k: int, renormalize: bool, scaling: float) -> tuple[Tensor, Tensor, Tensor]:
    """logits [N, E] (fp32, or fp64 for gradchecks), bias [E] (the e_score_correction_bias, same dtype) ->
    scores [N, E] = sigmoid(logits); topk_idx [N, k] int64: the k experts of largest score + bias (the bias
    selects only: no gradient flows through the selection), in no particular order; topk_weight [N, k]: their
    unbiased scores, divided by their sum (+ 1e-20) if ``renormalize``, times ``scaling``. Gradients reach the
    logits through the scores and the weights."""
    scores = torch.sigmoid(logits)
    topk_idx = torch.topk(scores.detach() + bias, top_k, dim=-1, sorted=False).indices  # any order: no sort
    weight = scores.gather(1, topk_idx)
    if renormalize:
        weight = weight / (weight.sum(-1, keepdim=True) + 1e-20)
    return scores, topk_idx, weight * scaling
