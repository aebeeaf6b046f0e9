"""The model of ``k3 bench slice`` (k3.bench.slice): k3-slice built on the meta device with packed MXFP4 experts,
given storage and random values on the GPU, and its byte accounting (what a decode step must read)."""

from __future__ import annotations

import torch
from torch import nn

from k3.model.accounting import classify
from k3.bench.decode import step_bytes
from k3.config import K3Config, get_preset
from k3.model.decoder import K3ForCausalLM
from k3.model.moe import MoE, RoutedExperts, Router
from k3.model.norm import RMSNorm
from k3.quant.packed import PackedExperts, use_packed_experts

GB = 1e9
SCALES = (119, 122)  # E8M0 exponents drawn from [119, 122): 2^-8 .. 2^-6


def smoke_config() -> K3Config:
    """The tiny preset in k3-slice's layout: a dense first layer, 3 KDA-MoE + 1 MLA-MoE, all in one AttnRes block
    (widths multiples of 32, as packed experts need)."""
    return get_preset("tiny").replace(name="tiny-slice", mla_layers=[4], **{"attn_res.block_size": 8})


# ------------------------------------------------------------------ building
def build_meta_packed(config: K3Config) -> K3ForCausalLM:
    """``config``'s model on the meta device, bf16, routed experts as empty :class:`PackedExperts` (no memory)."""
    with torch.device("meta"):
        model = K3ForCausalLM(config)
        use_packed_experts(model)
    return model.cast(torch.bfloat16)


@torch.no_grad()
def fill_packed(experts: PackedExperts, scales: tuple[int, int] = SCALES) -> None:
    """Random E2M1 codes (every byte value: two codes) and E8M0 scales in [scales[0], scales[1]), in place."""
    for w in ("w1", "w2", "w3"):
        getattr(experts, f"{w}_packed").random_(0, 256)
        getattr(experts, f"{w}_scale").random_(*scales)


@torch.no_grad()
def materialise(model: K3ForCausalLM, device: torch.device | str, seed: int = 0) -> K3ForCausalLM:
    """Storage on ``device`` for a meta model and the values its constructor would give (``init_weights``, norms
    ones, AttnRes queries zeros), packed experts random (:func:`fill_packed`), router biases N(0, 0.01)."""
    model.to_empty(device=device)
    torch.manual_seed(seed)
    model.init_weights()
    for name, m in model.named_modules():
        if isinstance(m, RMSNorm):
            m.weight.fill_(1.0)
        elif isinstance(m, nn.Linear) and name.endswith("_res_proj"):
            m.weight.zero_()
        elif isinstance(m, Router):
            m.e_score_correction_bias.normal_(0.0, 0.01)
        elif isinstance(m, PackedExperts):
            fill_packed(m)
        elif isinstance(m, nn.Conv1d) and m.bias is not None:
            m.bias.zero_()
    return model.eval()


def build_packed(config: K3Config, device: torch.device | str, seed: int = 0) -> K3ForCausalLM:
    """``config``'s model with packed experts, built directly on ``device`` (never whole on the host)."""
    return materialise(build_meta_packed(config), device, seed)


def bf16_experts(n: int, d: int, i: int, device: torch.device | str) -> RoutedExperts:
    """A bf16 :class:`RoutedExperts` of ``n`` experts, width ``d``, GLU width ``i`` on ``device``, N(0, 0.02),
    built without an fp32 copy."""
    with torch.device("meta"):
        out = RoutedExperts(n, d, i).to(torch.bfloat16)
    out.to_empty(device=device)
    with torch.no_grad():
        for p in out.parameters():
            p.normal_(0.0, 0.02)
    return out


# ------------------------------------------------------------------ accounting
def expert_accounting(model: nn.Module) -> dict:
    """Routed-expert weights and bytes of every MoE layer: packed banks (codes + scales) or bf16 parameters.
    Works on the meta device. ``layers``: [{"layer", "packed", "weights", "bytes"}]; ``bytes_per_weight`` over all."""
    layers = []
    for moe in model.modules():
        if not isinstance(moe, MoE):
            continue
        tensors = list(moe.experts.parameters()) + [b for n, b in moe.experts.named_buffers() if n != "dtype_ref"]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        packed = getattr(moe.experts, "packed", False)
        weights = sum(2 * t.numel() for n, t in moe.experts.named_buffers() if n.endswith("_packed"))
        weights = weights if packed else sum(p.numel() for p in moe.experts.parameters())
        layers.append({"layer": moe.layer_idx, "packed": packed, "weights": weights, "bytes": nbytes})
    total_w, total_b = sum(r["weights"] for r in layers), sum(r["bytes"] for r in layers)
    return {"layers": layers, "weights": total_w, "bytes": total_b, "bytes_per_weight": total_b / max(total_w, 1)}


def model_bytes(model: nn.Module) -> dict:
    """Bytes held per accounting path (parameters and buffers), packed experts under ``routed_experts``."""
    out: dict[str, int] = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("dtype_ref") or name.endswith("e_score_correction_bias"):
            path = "router" if name.endswith("bias") else None
        else:
            path = classify(name, model.config)
        if path is not None:
            out[path] = out.get(path, 0) + t.numel() * t.element_size()
    return out


def expected_hit(config: K3Config, batch: int) -> float:
    """Expected distinct experts a batch of ``batch`` tokens selects in one MoE layer: E (1 - (1 - k/E)^B)."""
    e, k = config.moe.num_experts, config.moe.num_experts_per_token
    return e * (1 - (1 - k / e) ** batch)


def slice_step_bytes(model: K3ForCausalLM, batch: int, context: int, hits: list[float] | None = None) -> float:
    """Bytes one decode step must read: k3.bench.decode.step_bytes (dense weights, bf16 experts hit, embedding rows,
    KDA and conv states, MLA latents) + for each packed MoE layer its bytes per expert x the distinct experts hit
    (``hits`` per MoE layer, default the expected count)."""
    total = step_bytes(model, batch, context)
    acc = expert_accounting(model)
    e = model.config.moe.num_experts
    for i, layer in enumerate(acc["layers"]):
        if layer["packed"]:
            hit = hits[i] if hits is not None else expected_hit(model.config, batch)
            total += layer["bytes"] / e * hit
    return total
