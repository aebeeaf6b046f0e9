"""Low-rank adapters (LoRA) on a K3 model's linear maps, as weight parametrizations.

An adapted ``nn.Linear`` keeps its weight W frozen and reads ``weight`` as W + (alpha / rank) B A, with A [rank,
in] (Kaiming-uniform, as LoRA starts it) and B [out, rank] (zeros, so the adapted model starts as the base). The
adapters are ``torch.nn.utils.parametrize`` parametrizations of ``weight``, not wrappers of the module's forward:
K3 reads several weights directly (KDA's q/k/v in one fused GEMM, MLA's absorbed ``kv_b_proj`` at decode, the
multi-weight decode maps, the shared experts' fused inputs), and every such read goes through the
parametrization, so each path (training, prefill, decode) sees the adapted weight. The delta is computed in fp32
and added in W's dtype.

Targets (:func:`lora_targets`): every linear map of each layer's attention (KDA: q, k, v, the forget gate's two,
beta, the output gate's, o; MLA: q or q_a / q_b, kv_a, kv_b, the output gate, o), and with ``shared_experts`` the
gate / up / down maps of the shared experts and of the dense FFN layers. The routed experts, the router's weights,
embeddings, lm_head, norms, convolutions, A_log / dt_bias and AttnRes stay frozen; the router's bias is no weight
(no gradient: the balancer sets it) and is saved with the adapters. :func:`merge_lora` folds the adapters into
plain weights (in fp32, then W's dtype).
"""

from __future__ import annotations

import math
import re

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

ATTENTION = re.compile(r"^model\.layers\.\d+\.self_attn\.\w+$")
FFN = re.compile(r"^model\.layers\.\d+\.(block_sparse_moe\.shared_experts|mlp)\.\w+$")
A, B = "lora_A", "lora_B"
ROUTER_BIAS = "gate.e_score_correction_bias"


class LoRA(nn.Module):
    """The parametrization W -> W + (alpha / rank) B A of one linear weight [out, in]; A and B in fp32."""

    def __init__(self, out_features: int, in_features: int, rank: int, alpha: float, device=None):
        super().__init__()
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        self.lora_A = nn.Parameter(torch.empty(rank, in_features, dtype=torch.float32, device=device))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank, dtype=torch.float32, device=device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def delta(self) -> Tensor:
        """(alpha / rank) B A, [out, in] in fp32."""
        return (self.lora_B @ self.lora_A) * self.scale

    def forward(self, weight: Tensor) -> Tensor:
        return weight + self.delta().to(weight.dtype)

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha:g}"


def lora_targets(model: nn.Module, shared_experts: bool = False) -> list[str]:
    """The module names of the linear maps LoRA adapts, in module order (see the module docstring)."""
    return [
        name
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and (ATTENTION.match(name) or (shared_experts and FFN.match(name)))
    ]


def apply_lora(model: nn.Module, rank: int, alpha: float, targets: list[str]) -> nn.Module:
    """Freeze every parameter of ``model`` and adapt the linear maps named in ``targets`` (in place); the
    adapters (``lora_A`` / ``lora_B``) are the only parameters left trainable. Returns the model."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA rank={rank!r} must be a positive integer")
    if not alpha > 0 or not math.isfinite(alpha):
        raise ValueError(f"LoRA alpha={alpha!r} must be a positive number")
    modules = dict(model.named_modules())
    missing = [t for t in targets if not isinstance(modules.get(t), nn.Linear)]
    if missing or not targets:
        raise ValueError(f"LoRA targets that are not linear maps of this model: {missing[:4] or 'none given'}")
    for p in model.parameters():
        p.requires_grad_(False)
    for name in targets:
        w = modules[name].weight
        parametrize.register_parametrization(modules[name], "weight", LoRA(*w.shape, rank, alpha, device=w.device))
    return model


def adapters(model: nn.Module) -> dict[str, LoRA]:
    """{module name: its LoRA} for every adapted linear map of ``model``."""
    return {
        name: mod.parametrizations.weight[0]
        for name, mod in model.named_modules()
        if parametrize.is_parametrized(mod, "weight") and isinstance(mod.parametrizations.weight[0], LoRA)
    }


def lora_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """What an adapter checkpoint holds of ``model`` (detached, on their devices): each adapter's
    ``MODULE.lora_A`` / ``MODULE.lora_B``, and every MoE layer's router bias ``...gate.e_score_correction_bias``,
    which the balancer keeps updating while the adapters train (docs/decisions.md: expert balancing when
    fine-tuning), so that base + adapter checkpoint is the trained model."""
    out = {}
    for name, lora in adapters(model).items():
        out[f"{name}.{A}"], out[f"{name}.{B}"] = lora.lora_A.detach(), lora.lora_B.detach()
    for name, buf in model.named_buffers():
        if name.endswith(ROUTER_BIAS):
            out[name] = buf.detach()
    return out


@torch.no_grad()
def load_lora_state_dict(model: nn.Module, tensors: dict[str, Tensor]) -> None:
    """Copy saved adapters (and router biases) into ``model``'s (already applied, same targets and rank); one
    ValueError listing any missing, unexpected or misshapen tensor."""
    mine = lora_state_dict(model)
    missing, unexpected = sorted(set(mine) - set(tensors)), sorted(set(tensors) - set(mine))
    shapes = [
        f"{k} {tuple(tensors[k].shape)} vs {tuple(v.shape)}"
        for k, v in mine.items()
        if k in tensors and tensors[k].shape != v.shape
    ]
    if missing or unexpected or shapes:
        raise ValueError(
            f"the adapters do not fit the model: missing {missing[:4]}, unexpected {unexpected[:4]}, "
            f"shapes {shapes[:4]}"
        )
    for k, v in mine.items():
        v.copy_(tensors[k])


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its weight, W + (alpha / rank) B A computed in fp32 and stored in W's dtype, and
    remove the parametrizations (in place): a plain model with the adapted model's outputs. Returns the model."""
    for name, lora in adapters(model).items():
        mod = model.get_submodule(name)
        base = mod.parametrizations.weight.original
        merged = (base.float() + lora.delta()).to(base.dtype)
        parametrize.remove_parametrizations(mod, "weight", leave_parametrized=False)
        mod.weight.copy_(merged)
    return model
