"""The depth mix for inference passes over few tokens (decode steps, short prefill chunks).

Within one forward pass most AttnRes sources never change once written (the snapshot bank, completed block sums,
every sub-layer output in ``full`` mode), yet every mix re-reads each of them, upcasts it, recomputes its RMS and
its logit: ~10 small kernels per source per mix, which dominates a decode step's AttnRes cost. Here those fixed
sources are kept stacked in fp32 with their inverse RMS (:class:`FixedSources`, filled once per source), and a
mix is one batched logit product over the stack, the live sources (the running residual, a block's partial sum),
one softmax and one weighted sum: a handful of kernels whatever the depth. Same maths as
:func:`k3.ops.attn_res.reference.depth_mix` (fp32 logits, softmax and mix); no autograd (inference only).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from k3.ops.dtypes import upcast


class FixedSources:
    """Sources [N, d] that stay fixed during a pass, stacked in fp32: ``v`` [S, N, d] and ``rstd`` [S, N], the
    inverse RMS under ``eps`` (of the last :meth:`sync`)."""

    def __init__(self):
        self.v: Tensor | None = None
        self.rstd: Tensor | None = None
        self.eps: float | None = None
        self.count = 0

    def sync(self, sources: Sequence[Tensor], eps: float) -> None:
        """Stack the sources appended since the last call (``sources`` is the whole, growing list)."""
        if eps != self.eps and self.v is not None:  # another norm eps: every inverse RMS again
            self.rstd = torch.rsqrt(self.v.pow(2).mean(-1) + eps)
        self.eps = eps
        if len(sources) == self.count:
            return
        v = upcast(torch.stack(list(sources[self.count:])))
        r = torch.rsqrt(v.pow(2).mean(-1) + eps)
        self.v = v if self.v is None else torch.cat([self.v, v])
        self.rstd = r if self.rstd is None else torch.cat([self.rstd, r])
        self.count = len(sources)


def depth_mix(fixed: FixedSources, live: Sequence[Tensor], query: Tensor, eps: float, dtype: torch.dtype) -> Tensor:
    """h = sum_i softmax_i(query . v_i / rms(v_i)) v_i over the fixed sources (stacked, synced with ``eps``)
    followed by the ``live`` ones [N, d]; returns [N, d] in ``dtype``."""
    q = upcast(query)
    logits = [(fixed.v @ q) * fixed.rstd]  # [S, N]
    live32 = [upcast(x) for x in live]
    for v in live32:
        logits.append(((v @ q) * torch.rsqrt(v.pow(2).mean(-1) + eps)).unsqueeze(0))
    a = torch.cat(logits).softmax(0)  # [S + L, N]
    out = torch.einsum("sn,snd->nd", a[:fixed.count], fixed.v)
    for i, v in enumerate(live32):
        out = out + a[fixed.count + i].unsqueeze(-1) * v
    return out.to(dtype)


def depth_mix_unstacked(fixed: FixedSources, live: Sequence[Tensor], query: Tensor, eps: float,
                        dtype: torch.dtype) -> Tensor:
    """The reference for :func:`depth_mix`: the sources unstacked through the reference depth mix."""
    from k3.ops.attn_res.reference import depth_mix as reference

    return reference(list(fixed.v.unbind(0)) + [upcast(x) for x in live], query, eps).to(dtype)
