"""MLA: absorbed == naive, and both == attention written out head by head from the equations."""

import pytest
import torch

from k3.config import get_preset
from k3.model.cache import MLAState
from k3.model.mla import MultiheadLatentAttention
from k3.model.rope import rotate_half_rope
from tests.helpers import rel


def make(q_lora=32, gate=True, rope=None):
    cfg = get_preset("tiny").replace(**{"mla.q_lora_rank": q_lora, "mla.output_gate": gate, "mla.rope_theta": rope})
    torch.manual_seed(0)
    m = MultiheadLatentAttention(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m


def manual(m, x):
    """One sequence, per head, straight from the equations (fp64)."""
    m = m.double()
    x = x.double()
    n, h = x.shape[0], m.num_heads
    q = m.q_proj(x) if hasattr(m, "q_proj") else m.q_b_proj(m.q_a_layernorm(m.q_a_proj(x)))
    q = q.view(n, h, -1)
    c_kv, k_pe = m.kv_a_proj_with_mqa(x).split([m.r, m.dr], -1)
    if m.rope_theta is not None:
        q = torch.cat([q[..., : m.dn], rotate_half_rope(q[..., m.dn :], torch.arange(n), m.rope_theta)], -1)
        k_pe = rotate_half_rope(k_pe, torch.arange(n), m.rope_theta)
    kv = m.kv_b_proj(m.kv_a_layernorm(c_kv)).view(n, h, -1)
    outs = []
    for head in range(h):
        k = torch.cat([kv[:, head, : m.dn], k_pe], -1)
        v = kv[:, head, m.dn :]
        s = q[:, head] @ k.T * (m.dn + m.dr) ** -0.5
        s = s.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
        outs.append(s.softmax(-1) @ v)
    o = torch.cat(outs, -1)
    if hasattr(m, "g_proj"):
        o = o * torch.sigmoid(m.g_proj(x))
    return m.o_proj(o)


@pytest.mark.parametrize("q_lora,gate,rope", [(32, True, None), (None, False, None), (32, False, 10000.0)])
def test_naive_and_absorbed_match_the_equations(q_lora, gate, rope):
    m = make(q_lora, gate, rope)
    torch.manual_seed(1)
    x = torch.randn(19, 64)
    cu = torch.tensor([0, 19])
    truth = manual(m, x)
    m = m.float()
    naive = m(x, cu, absorb=False)
    absorbed = m(x, cu, absorb=True)
    assert rel(naive, truth) <= 1e-5
    assert rel(absorbed, naive) <= 1e-5


def test_absorbed_decode_with_latent_cache_equals_naive_prefill():
    m = make()
    torch.manual_seed(2)
    lengths = [11, 5]
    x = torch.randn(sum(lengths), 64)
    cu = torch.tensor([0, 11, 16])
    full = m(x, cu, absorb=False)
    state = MLAState(torch.zeros(2, 4, m.r + m.dr), [0, 0])  # capacity 4: appends must grow it
    ids = torch.tensor([0, 1])
    # prefill 3 + 2 tokens, then decode one token at a time (absorbed by default)
    pre = m(torch.cat([x[0:3], x[11:13]]), torch.tensor([0, 3, 5]), state, ids)
    outs = {0: [pre[:3]], 1: [pre[3:]]}
    pos, start = [3, 2], [0, 11]
    while pos[0] < 11:
        ids_now = [i for i in (0, 1) if pos[i] < lengths[i]]
        rows = [x[start[i] + pos[i]] for i in ids_now]
        o = m(torch.stack(rows), torch.arange(len(rows) + 1), state, torch.tensor(ids_now))
        for j, i in enumerate(ids_now):
            outs[i].append(o[j : j + 1])
            pos[i] += 1
    assert state.lengths == [11, 5] and state.rows(0).shape == (11, m.r + m.dr)
    assert rel(torch.cat(outs[0]), full[:11]) <= 1e-5
    assert rel(torch.cat(outs[1]), full[11:]) <= 1e-5


def test_masked_decode_equals_reference_latent_attention():
    """The graph-safe dense fallback of the fast MLA decode (shapes the Triton kernel does not take) equals the
    reference latent attention, one query token per sequence, slots out of order."""
    from k3.ops.mla.fast import masked_decode
    from k3.ops.mla.reference import latent_attention
    from k3.ops.segments import Segments

    g = torch.Generator().manual_seed(9)
    kv = torch.randn(4, 20, 24, generator=g)
    q = torch.randn(3, 5, 24, generator=g)
    slots, lengths = torch.tensor([2, 0, 3]), torch.tensor([7, 20, 1])
    cu = Segments.from_host(range(4))
    want = latent_attention(q, kv, seq_ids=slots, lengths=lengths, cu_seqlens_q=cu, scale=0.3, v_dim=16)
    got = masked_decode(q, kv, slots, lengths, 0.3, 16)
    assert ((got - want).norm() / want.norm()).item() <= 1e-6


def test_mla_decode_kernel_off_runs_the_masked_fallback(monkeypatch):
    """With kernel ``mla_decode`` off (``K3_KERNELS=mla_decode=torch``) the fast latent attention of one-token
    segments is the masked dense form, equal to the reference; no Triton import is needed for it."""
    from k3.ops import backend
    from k3.ops.mla import fast
    from k3.ops.mla.reference import latent_attention
    from k3.ops.segments import Segments
    from tests.ops.kernel_switch import keep_kernel_plan

    keep_kernel_plan(monkeypatch)
    backend.set_kernels("mla_decode=torch", triton=True)
    assert backend.kernel_choice("mla_decode") == "torch"
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(3, 12, 24, generator=g)
    q = torch.randn(2, 4, 24, generator=g)
    slots, lengths = torch.tensor([1, 2]), torch.tensor([12, 5])
    cu = Segments.from_host(range(3))
    want = latent_attention(q, kv, seq_ids=slots, lengths=lengths, cu_seqlens_q=cu, scale=0.5, v_dim=16)
    got = fast.latent_attention(q, kv, seq_ids=slots, lengths=lengths, cu_seqlens_q=cu, scale=0.5, v_dim=16)
    assert ((got - want).norm() / want.norm()).item() <= 1e-6
