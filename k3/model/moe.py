"""Sigmoid-routed MoE with shared experts; Stable LatentMoE when ``moe.latent_size`` is set
(docs/architecture.md#latentmoe).

  s       = sigmoid(W_r x)  in fp32 on the full-width x                       [N, E]
  chosen  = top-k of (s + b), b = e_score_correction_bias (selection only, no gradient)
  p_j     = s_j / sum_chosen s  (if renormalize)  * routed_scaling_factor
  latent:  z = W_down x;  y = RMSNorm(sum_j p_j E_j(z));  routed = W_up y      experts live in width l
  plain:   routed = sum_j p_j E_j(x)                                            experts live in width d
  out     = routed + shared_experts(x)                                          shared experts full width
E_j(z) = w2_j act(w1_j z, w3_j z) with act = SiTU-GLU (K3) or SwiGLU.
With ``qat`` set (k3.quant.qat.enable_qat) the routed experts see MXFP4 weights and MXFP8 inputs (fake-quantised);
with ``fp8`` (k3.quant.fp8.enable_fp8_experts) their matmuls run in FP8 with row-wise scales.
With ``expert_dispatch`` set (k3.distributed.expert_parallel) the routed experts run wherever that callable sends
the latent rows (expert parallelism); this module itself never communicates.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from k3.config import K3Config
from k3.model.activation import GatedFFN, make_glu
from k3.model.norm import RMSNorm
from k3.model.router_stats import RouterStats
from k3.ops.linear.reference import fp32_linear
from k3.ops.moe import moe_experts, moe_inputs
from k3.ops.moe.mxfp4 import moe_experts_packed
from k3.ops.router import route
from k3.ops.dtypes import upcast


class Router(nn.Module):
    """Checkpoint name ``gate``: weight [E, d] and the fp32 buffer ``e_score_correction_bias`` [E]."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool, scaling: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
        self.top_k, self.renormalize, self.scaling = top_k, renormalize, scaling

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [N, d] -> scores [N, E] fp32, topk_idx [N, k] int64 (a token's k experts in no particular order),
        topk_weight [N, k] fp32. The GEMM is here; the rest (sigmoid, biased top-k, gather, renormalise, scale)
        is k3.ops.router.route: torch, or one Triton kernel where no gradient is needed on a GPU (decode)."""
        return self.route(fp32_linear(x, self.weight))  # fp32 also under autocast

    def route(self, logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """What :meth:`forward` does after its GEMM: logits [N, E] (fp32) -> scores, topk_idx, topk_weight."""
        return route(logits, upcast(self.e_score_correction_bias), self.top_k, self.renormalize, self.scaling)


class RoutedExperts(nn.Module):
    """Stacked expert weights: w1 (gate) and w3 (up) [E, I, D], w2 (down) [E, D, I]."""

    def __init__(self, num_experts: int, dim: int, intermediate: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, intermediate, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, intermediate))
        self.w3 = nn.Parameter(torch.empty(num_experts, intermediate, dim))


class MoE(nn.Module):
    def __init__(self, config: K3Config, layer_idx: int):
        super().__init__()
        c = config.moe
        d = config.hidden_size
        self.layer_idx = layer_idx
        self.glu = make_glu(config.hidden_act, config.situ_beta, config.situ_linear_beta)
        self.gate = Router(d, c.num_experts, c.num_experts_per_token, c.renormalize, c.routed_scaling_factor)
        width = c.latent_size if c.latent_size is not None else d
        self.experts = RoutedExperts(c.num_experts, width, c.moe_intermediate_size)
        if c.latent_size is not None:
            self.routed_expert_down_proj = nn.Linear(d, c.latent_size, bias=False)
            if c.latent_norm:
                self.routed_expert_norm = RMSNorm(c.latent_size, eps=config.rms_norm_eps)
            self.routed_expert_up_proj = nn.Linear(c.latent_size, d, bias=False)
        if c.num_shared_experts > 0:
            self.shared_experts = GatedFFN(d, c.shared_width, self.glu)
        self.qat = None  # k3.quant.qat.ExpertQAT while quantisation-aware training is on (enable_qat)
        self.fp8 = False  # the routed experts' matmuls in FP8 (k3.quant.fp8.enable_fp8_experts)
        # expert_dispatch(moe, z, topk_idx, topk_weight) -> y [N, D], replacing the local moe_experts call (QAT is
        # then the dispatcher's job); set by k3.distributed.expert_parallel.apply_expert_parallel, None = local
        self.expert_dispatch = None

    def forward(self, x: Tensor) -> tuple[Tensor, RouterStats]:
        """x [N, d] -> (out [N, d], router statistics of this layer)."""
        latent = hasattr(self, "routed_expert_down_proj")
        shared = getattr(self, "shared_experts", None)
        logits, z, shared_in = moe_inputs(
            x,
            self.gate.weight,
            self.routed_expert_down_proj.weight if latent else None,
            () if shared is None else (shared.gate_proj.weight, shared.up_proj.weight),
        )
        scores, topk_idx, topk_weight = self.gate.route(logits)
        z = x if z is None else z
        e = self.experts
        if self.expert_dispatch is not None:
            if self.fp8:
                raise ValueError("FP8 expert matmuls do not run under expert parallelism; disable_fp8_experts")
            y = self.expert_dispatch(self, z, topk_idx, topk_weight)
        elif getattr(e, "packed", False):  # MXFP4 bytes: only the experts this batch selects are dequantised
            y = moe_experts_packed(z, topk_idx, topk_weight, e, self.glu)
        elif self.qat is None:
            y = moe_experts(z, topk_idx, topk_weight, e.w1, e.w2, e.w3, self.glu, fp8=self.fp8)
        else:  # fake-quantised expert weights and matmul inputs, straight-through gradients
            q = self.qat.weight
            y = moe_experts(z, topk_idx, topk_weight, q(e.w1), q(e.w2), q(e.w3), self.glu, act_quant=self.qat.act_quant)
        if latent:
            if hasattr(self, "routed_expert_norm"):
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        if shared is not None:
            y = y + shared.finish(*shared_in)
        stats = RouterStats(
            scores=scores,
            topk_idx=topk_idx,
            bias=self.gate.e_score_correction_bias.detach().clone(),
            layer=self.layer_idx,
        )
        return y, stats


def moe_layers(model: nn.Module) -> list[MoE]:
    """Every MoE block of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def keep_experts(moe: MoE, ids) -> None:
    """Keep only the routed experts ``ids`` (global indices, in this order) of ``moe``'s bank, plain or packed:
    every [E, ...] tensor of it becomes [len(ids), ...] (copied; on the meta device only reshaped, for a loader to
    fill), and ``moe.experts.expert_ids`` records ``ids``. The router still scores all E experts, so the layer then
    needs an ``expert_dispatch`` that maps them to this bank (k3.distributed.serve)."""
    ids = tuple(int(i) for i in ids)
    e = moe.gate.weight.shape[0]
    if getattr(moe.experts, "expert_ids", None) is not None:
        raise ValueError(f"MoE layer {moe.layer_idx} keeps part of its experts already")
    if len(set(ids)) != len(ids) or any(not 0 <= i < e for i in ids):
        raise ValueError(f"MoE layer {moe.layer_idx}: experts {list(ids)} must be distinct, in 0..{e - 1}")
    for kind in ("_parameters", "_buffers"):
        table = getattr(moe.experts, kind)
        for key, t in list(table.items()):
            if t is None or t.dim() == 0 or t.shape[0] != e:
                continue
            if t.is_meta:
                new = torch.empty((len(ids), *t.shape[1:]), dtype=t.dtype, device="meta")
            else:
                new = t.detach().index_select(0, torch.tensor(ids, dtype=torch.long, device=t.device))
            table[key] = nn.Parameter(new, requires_grad=t.requires_grad) if kind == "_parameters" else new
    moe.experts.expert_ids = ids
