"""The AttnRes depth mix with a hand-written backward that stores no per-source copies.

Autograd through the reference keeps the stacked (and upcast, normalised) sources of every mix, S x N x d
floats per sub-layer, which dominates training memory at long sequence length. The sources themselves are
alive anyway (they are the residual bank), so this form saves only them, the weights a [S, N] and the inverse
RMS r [S, N], and recomputes the rest. With k_i = v_i r_i, s_i = k_i . q, a = softmax(s), out = sum_i a_i v_i:
    da_i = g . v_i;   ds_i = a_i (da_i - sum_j a_j da_j)
    dv_i = a_i g + ds_i (r_i q - r_i^3 (q . v_i) v_i / d);   dq = sum_{i, tokens} ds_i r_i v_i
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from k3.ops.dtypes import upcast


class _DepthMix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query: Tensor, eps: float, *sources: Tensor) -> Tensor:
        q = upcast(query)
        rstd, logits = [], []
        for v in sources:
            v32 = upcast(v)
            r = torch.rsqrt(v32.pow(2).mean(-1) + eps)  # [N]
            rstd.append(r)
            logits.append((v32 @ q) * r)
        a = torch.stack(logits).softmax(0)  # [S, N]
        out = sum(a[i].unsqueeze(-1) * upcast(v) for i, v in enumerate(sources))
        r = torch.stack(rstd)
        ctx.eps = eps
        ctx.save_for_backward(query, a, r, *sources)
        return out.to(sources[0].dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        query, a, r, *sources = ctx.saved_tensors
        q, g = upcast(query), upcast(grad)
        d = q.shape[0]
        da = torch.stack([(g * upcast(v)).sum(-1) for v in sources])  # [S, N]
        ds = a * (da - (a * da).sum(0, keepdim=True))
        dq = torch.zeros_like(q)
        grads = []
        for i, v in enumerate(sources):
            v32 = upcast(v)
            qv = v32 @ q  # [N]
            dv = a[i].unsqueeze(-1) * g + ds[i].unsqueeze(-1) * (
                r[i].unsqueeze(-1) * q - (r[i].pow(3) * qv / d).unsqueeze(-1) * v32)
            dq = dq + ((ds[i] * r[i]).unsqueeze(-1) * v32).sum(0)
            grads.append(dv.to(v.dtype))
        return (dq.to(query.dtype), None, *grads)


def depth_mix(sources: Sequence[Tensor], query: Tensor, eps: float) -> Tensor:
    """Same contract as :func:`k3.ops.attn_res.reference.depth_mix`."""
    return _DepthMix.apply(query, eps, *sources)
