"""Causal attention over packed segments (MLA's core). ``attention(q, k, v, scale=, cu_seqlens_q=, cu_seqlens_k=)``."""

from k3.ops import backend
from k3.ops.mla.reference import attention as attention_reference

backend.register("mla_attention", "reference", attention_reference)


def attention(q, k, v, *, scale, cu_seqlens_q, cu_seqlens_k):
    """See :func:`k3.ops.mla.reference.attention` for shapes."""
    return backend.dispatch("mla_attention", q.device, q, k, v, scale=scale, cu_seqlens_q=cu_seqlens_q,
                            cu_seqlens_k=cu_seqlens_k)
