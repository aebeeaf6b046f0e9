"""MoE: router semantics, the per-expert op vs a dense all-experts computation, the latent dataflow."""

import torch
import torch.nn.functional as F

from k3.config import get_preset
from k3.model.activation import situ_glu, swiglu
from k3.model.moe import MoE
from k3.ops.moe.reference import moe_experts
from tests.helpers import rel


def test_experts_op_equals_dense_computation():
    torch.manual_seed(0)
    n, d, i, e, k = 50, 12, 20, 6, 3
    x = torch.randn(n, d)
    w1, w3, w2 = torch.randn(e, i, d), torch.randn(e, i, d), torch.randn(e, d, i)
    idx = torch.stack([torch.randperm(e)[:k] for _ in range(n)])
    w = torch.rand(n, k)
    # every expert on every token, then a dense gate matrix with zeros for unselected experts
    all_out = torch.stack([situ_glu(x @ w1[j].T, x @ w3[j].T) @ w2[j].T for j in range(e)], 1)  # [n, e, d]
    gate = torch.zeros(n, e).scatter(1, idx, w)
    ref = (gate.unsqueeze(-1) * all_out).sum(1)
    assert rel(moe_experts(x, idx, w, w1, w2, w3, situ_glu), ref) <= 1e-6


def make_moe(**over):
    cfg = get_preset("tiny").replace(**over)
    torch.manual_seed(0)
    moe = MoE(cfg, layer_idx=1)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
        moe.gate.e_score_correction_bias.normal_(0, 0.2)
    return cfg, moe


def test_latent_moe_dataflow_and_router_semantics():
    cfg, moe = make_moe()
    x = torch.randn(30, cfg.hidden_size)
    out, stats = moe(x)
    s = torch.sigmoid(x @ moe.gate.weight.T)
    chosen = torch.topk(s + moe.gate.e_score_correction_bias, cfg.moe.num_experts_per_token).indices
    assert torch.equal(stats.topk_idx.sort(-1).values, chosen.sort(-1).values)
    p = s.gather(1, chosen)
    p = p / p.sum(-1, keepdim=True) * cfg.moe.routed_scaling_factor  # the bias never enters the weights
    z = moe.routed_expert_down_proj(x)
    y = torch.zeros_like(z)
    for t in range(30):
        for j, e in enumerate(chosen[t].tolist()):
            h = situ_glu(z[t] @ moe.experts.w1[e].T, z[t] @ moe.experts.w3[e].T) @ moe.experts.w2[e].T
            y[t] += p[t, j] * h
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * moe.routed_expert_norm.weight
    sh = moe.shared_experts
    ref = moe.routed_expert_up_proj(y) + sh.down_proj(situ_glu(sh.gate_proj(x), sh.up_proj(x)))
    assert rel(out, ref) <= 1e-5
    assert stats.scores.dtype == torch.float32 and stats.layer == 1
    assert torch.equal(stats.bias, moe.gate.e_score_correction_bias)


def test_plain_moe_kimi_linear_style():
    cfg, moe = make_moe(
        **{
            "moe.latent_size": None,
            "moe.routed_scaling_factor": 2.446,
            "moe.num_shared_experts": 0,
            "hidden_act": "silu",
        }
    )
    assert not hasattr(moe, "routed_expert_down_proj") and not hasattr(moe, "shared_experts")
    x = torch.randn(20, cfg.hidden_size)
    out, stats = moe(x)
    s = torch.sigmoid(x @ moe.gate.weight.T)
    w = s.gather(1, stats.topk_idx)
    w = w / w.sum(-1, keepdim=True) * 2.446
    ref = moe_experts(x, stats.topk_idx, w, moe.experts.w1, moe.experts.w2, moe.experts.w3, swiglu)
    assert rel(out, ref) <= 1e-6


def test_router_gradient_flows_through_scores_not_bias():
    cfg, moe = make_moe()
    x = torch.randn(16, cfg.hidden_size)
    out, stats = moe(x)
    out.pow(2).mean().backward()
    assert moe.gate.weight.grad is not None and moe.gate.weight.grad.abs().sum() > 0
    assert not moe.gate.e_score_correction_bias.requires_grad
    assert stats.scores.requires_grad


def test_swiglu_and_situ_reference_values():
    g, u = torch.randn(1000) * 3, torch.randn(1000) * 3
    assert rel(swiglu(g, u), F.silu(g) * u) <= 1e-7
