"""Helpers the tests share."""

import torch


def rel(a, b) -> float:
    """Relative error ||a - b|| / ||b||, computed in fp64 (||a - b|| itself where b is zero)."""
    a = torch.as_tensor(a).detach().double()
    b = torch.as_tensor(b).detach().double()
    nb = float(b.norm())
    diff = float((a - b).norm())
    return diff / nb if nb > 0 else diff


# a tiny K3 config changed to Kimi-Linear's architecture (what transformers' KimiLinearForCausalLM builds):
# softplus gate, low-rank output gate, no q LoRA, no MLA output gate, plain experts, SwiGLU, no AttnRes
KIMI_LINEAR_STYLE = {
    "kda.gate_lower_bound": None,
    "kda.full_rank_output_gate": False,
    "mla.q_lora_rank": None,
    "mla.output_gate": False,
    "moe.latent_size": None,
    "moe.latent_norm": False,
    "moe.routed_scaling_factor": 2.446,
    "hidden_act": "silu",
    "attn_res.mode": "none",
}
