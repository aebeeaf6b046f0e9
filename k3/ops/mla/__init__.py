"""MLA attention ops: ``attention`` over packed segments (prefill / training) and ``latent_attention``
over the latent cache (absorbed decode)."""

from k3.ops import backend
from k3.ops.mla.reference import attention as attention_reference
from k3.ops.mla.reference import latent_attention as latent_attention_reference

from k3.ops.mla import fast as _fast


def _cuda(device):
    return device.type == "cuda"


backend.register("mla_attention", "reference", attention_reference)
backend.register("mla_latent_attention", "reference", latent_attention_reference)
backend.register("mla_attention", "fast", _fast.attention, _cuda)
backend.register("mla_latent_attention", "fast", _fast.latent_attention, _cuda)


def attention(q, k, v, *, scale, cu_seqlens_q, cu_seqlens_k):
    """See :func:`k3.ops.mla.reference.attention` for shapes."""
    return backend.dispatch(
        "mla_attention", q.device, q, k, v, scale=scale, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k
    )


def latent_attention(q, kv, *, seq_ids, lengths, cu_seqlens_q, scale, v_dim, max_length=None):
    """See :func:`k3.ops.mla.reference.latent_attention` for shapes."""
    return backend.dispatch(
        "mla_latent_attention",
        q.device,
        q,
        kv,
        seq_ids=seq_ids,
        lengths=lengths,
        cu_seqlens_q=cu_seqlens_q,
        scale=scale,
        v_dim=v_dim,
        max_length=max_length,
    )
