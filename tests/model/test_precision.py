"""Precision the architecture fixes survives autocast (docs/precision.md has the table these tests pin).

CPU autocast lowers linear / matmul / bmm / einsum to bf16 exactly as CUDA autocast does, so each test runs the
model's own code under ``torch.autocast("cpu", torch.bfloat16)`` and compares with fp32 or fp64 computed outside
it. Without the fixes, the router's GEMM came back in bf16 (about a third of the tokens chose another expert set at
896 experts / top-16) and the AttnRes depth logits' GEMM too (log-sum-exp off by ~1e-2)."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from k3.config import get_preset
from k3.model.activation import situ, situ_glu
from k3.model.mla import MultiheadLatentAttention
from k3.model.moe import MoE
from k3.model.kda import KimiDeltaAttention
from k3.ops.attn_res import attn_res_phase1, attn_res_phase1_pieces, depth_weights
from k3.ops.kda.reference import chunk_kda, kda_gate, recurrent_kda
from k3.ops.linear import concatenated
from k3.ops.linear.reference import multi_linear
from k3.ops.mla.reference import segment_attention
from k3.train.newton_schulz import newton_schulz
from tests.helpers import rel

BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


def k3_width_moe(experts: int = 896, top_k: int = 16, d: int = 1024) -> MoE:
    """A MoE layer with K3's router shape (896 experts, top-16) at width d, tiny experts (the router is the point)."""
    cfg = get_preset("tiny")
    cfg = cfg.replace(
        hidden_size=d,
        moe=dataclasses.replace(
            cfg.moe, num_experts=experts, num_experts_per_token=top_k, moe_intermediate_size=8, latent_size=16
        ),
    )
    torch.manual_seed(0)
    moe = MoE(cfg, layer_idx=1)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, d**-0.5)
        moe.gate.e_score_correction_bias.normal_(0, 0.01)
    return moe


@pytest.mark.parametrize("grad", [False, True])
def test_router_is_fp32_under_autocast(grad):
    """Scores fp32 and equal to sigmoid of the fp32 GEMM of the layer's input (<= 1e-6), expert sets equal to the
    fp32 routing, with and without a gradient (a training step takes the stacked-weights form)."""
    moe = k3_width_moe()
    x = torch.randn(512, 1024)
    with torch.set_grad_enabled(grad), torch.autocast(**BF16):
        _, stats = moe(x)
    assert stats.scores.dtype == torch.float32 and stats.scores.requires_grad == grad
    truth = torch.sigmoid(x.double() @ moe.gate.weight.double().T)
    assert (stats.scores.double() - truth).abs().max().item() <= 1e-6
    with torch.no_grad():
        _, fp32_stats = moe(x)
    assert torch.equal(stats.topk_idx.sort(-1).values, fp32_stats.topk_idx.sort(-1).values)


def test_router_logits_of_every_multi_linear_form_are_fp32_under_autocast():
    """The router's GEMM rides the layer's multi_linear as its fp32 slot: the per-weight reference and the
    stacked-weights form a training step takes both keep it fp32, while the other maps follow autocast."""
    torch.manual_seed(1)
    x = torch.randn(64, 256, requires_grad=True)
    ws = [torch.randn(32, 256, requires_grad=True), torch.randn(48, 256, requires_grad=True), torch.randn(96, 256)]
    truth = x.detach().double() @ ws[-1].double().T
    for form in (multi_linear, concatenated):
        with torch.autocast(**BF16):
            *maps, logits = form(x, ws, fp32=1)
        assert all(m.dtype == torch.bfloat16 for m in maps), form
        assert logits.dtype == torch.float32 and rel(logits, truth) <= 1e-6, form


@pytest.mark.parametrize("pieces", [False, True], ids=["one_piece", "pieces"])
def test_attn_res_phase1_logsumexp_is_fp32_under_autocast(pieces):
    """The phase-1 log-sum-exp under autocast within 1e-5 of fp64 (it was ~1e-2 with the GEMM in bf16), also when
    the sources are scored two at a time."""
    torch.manual_seed(2)
    n, d, m = 256, 1024, 4
    sources = [torch.randn(n, d) * (1 + i) for i in range(5)]
    queries = torch.randn(m, d) * 0.1
    with torch.autocast(**BF16):
        if pieces:
            o, lse = attn_res_phase1_pieces(queries, sources, 1e-6, 2)
        else:
            o, lse = attn_res_phase1.reference(queries, sources, 1e-6)
    lse64 = torch.stack([torch.logsumexp(_logits64(sources, q), 0) for q in queries])  # [M, N]
    assert lse.dtype == torch.float32
    assert (lse.double() - lse64).abs().max().item() <= 1e-5
    o64 = torch.stack(
        [
            (
                depth_weights([s.double() for s in sources], q.double(), 1e-6).unsqueeze(-1)
                * torch.stack([s.double() for s in sources])
            ).sum(0)
            for q in queries
        ]
    )
    assert o.dtype == torch.float32 and rel(o, o64) <= 1e-6


def _logits64(sources, query):
    """The depth logits of each source in fp64: (v . q) / rms(v), [S, N]."""
    v = torch.stack([s.double() for s in sources])
    return (v * query.double()).sum(-1) * torch.rsqrt(v.pow(2).mean(-1) + 1e-6)


@pytest.mark.parametrize("fn", [chunk_kda, recurrent_kda])
def test_kda_reference_state_is_fp32_under_autocast(fn):
    """The KDA references keep the state and its products in fp32 under autocast: equal (to fp32 rounding) to the
    same call without autocast, and the final state fp32."""
    torch.manual_seed(3)
    b, t, h, k, v = 1, 80, 2, 32, 32
    q = F.normalize(torch.randn(b, t, h, k), dim=-1)
    kk = F.normalize(torch.randn(b, t, h, k), dim=-1)
    vv = torch.randn(b, t, h, v)
    g = -torch.rand(b, t, h, k) * 0.5
    beta = torch.rand(b, t, h)
    plain = fn(q, kk, vv, g, beta, output_final_state=True)
    with torch.autocast(**BF16):
        o, state = fn(q, kk, vv, g, beta, output_final_state=True)
    assert state.dtype == torch.float32
    assert rel(o, plain[0]) <= 1e-6 and rel(state, plain[1]) <= 1e-6


def test_mla_reference_scores_are_fp32_under_autocast():
    torch.manual_seed(4)
    q, k, v = torch.randn(40, 4, 192), torch.randn(40, 1, 192), torch.randn(40, 1, 128)
    plain = segment_attention(q, k, v, 192**-0.5)
    with torch.autocast(**BF16):
        out = segment_attention(q, k, v, 192**-0.5)
    assert rel(out, plain) <= 1e-6


def test_situ_is_fp32_under_autocast():
    """SiTU and SiTU-GLU compute in fp32 whatever the input dtype, and autocast does not touch them."""
    torch.manual_seed(5)
    g, u = torch.randn(64, 128, dtype=torch.bfloat16) * 4, torch.randn(64, 128, dtype=torch.bfloat16) * 30
    g64, u64 = g.double(), u.double()
    truth = 4 * torch.tanh(g64 / 4) * torch.sigmoid(g64) * 25 * torch.tanh(u64 / 25)
    with torch.autocast(**BF16):
        y = situ_glu(g, u)
        s = situ(g)
    assert torch.equal(y, truth.to(torch.bfloat16))  # fp32 maths, one rounding to bf16
    assert torch.equal(s, (4 * torch.tanh(g64 / 4) * torch.sigmoid(g64)).to(torch.bfloat16))


def test_newton_schulz_keeps_its_dtype_under_autocast():
    torch.manual_seed(6)
    G = torch.randn(3, 64, 96)
    plain = newton_schulz(G, dtype=torch.float32)
    with torch.autocast(**BF16):
        out = newton_schulz(G, dtype=torch.float32)
    assert out.dtype == torch.float32 and torch.equal(out, plain)


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_kda_gate_and_beta_are_fp32_from_bf16_projections(lower_bound):
    """The forget gate (both forms) and beta come out fp32 from the bf16 projections autocast gives, equal to the
    fp64 formula to fp32 rounding; the layer's recurrence inputs say the same under autocast."""
    torch.manual_seed(7)
    f = (torch.randn(1, 16, 2, 8) * 3).to(torch.bfloat16)
    A_log, dt_bias = torch.rand(2).log1p(), torch.randn(16)
    g = kda_gate(f, A_log, dt_bias, lower_bound)
    z = f.double() + dt_bias.double().view(2, 8)
    truth = (
        lower_bound * torch.sigmoid(A_log.double().exp()[:, None] * z)
        if lower_bound is not None
        else -A_log.double().exp()[:, None] * F.softplus(z)
    )
    assert g.dtype == torch.float32 and rel(g, truth) <= 1e-6
    cfg = get_preset("tiny")
    layer = KimiDeltaAttention(cfg.replace(**{"kda.gate_lower_bound": lower_bound}))
    x = torch.randn(12, cfg.hidden_size)
    with torch.no_grad(), torch.autocast(**BF16):
        qkv = list(layer.project(x).split(layer.qkv_widths(), dim=-1))
        *_, g_layer, beta = layer.recurrence_inputs(x, qkv)
    assert g_layer.dtype == torch.float32 and beta.dtype == torch.float32


def test_mla_low_rank_norms_take_their_eps_from_the_config():
    """q_a / kv_a norms use ``mla.norm_eps`` (1e-6 in the presets, as transformers' Kimi-Linear; docs/decisions.md),
    not ``rms_norm_eps``; a config that sets it is obeyed."""
    cfg = get_preset("tiny")
    assert cfg.mla.norm_eps == 1e-6 and get_preset("k3").mla.norm_eps == 1e-6
    mla = MultiheadLatentAttention(cfg.replace(**{"mla.norm_eps": 3e-5}))
    assert mla.q_a_layernorm.eps == 3e-5 and mla.kv_a_layernorm.eps == 3e-5
