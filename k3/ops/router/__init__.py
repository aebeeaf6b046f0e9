"""MoE routing after the router GEMM: ``route(logits [N, E], bias [E], top_k, renormalize, scaling) -> (scores
[N, E], topk_idx [N, k] int64, topk_weight [N, k])``; the contract: :func:`k3.ops.router.reference.route`.

Backends: ``reference`` is the torch form; ``fast`` (CUDA) runs the one Triton kernel of k3.ops.router.triton_topk (it
needs Triton) for calls that need no gradient (decode, evaluation) with fp32 inputs and at most MAX_EXPERTS experts, and
the torch form otherwise. ``K3_KERNELS=router_topk=torch`` turns the kernel off
(:func:`k3.ops.backend.triton_or_torch`); it is the default because it was faster in the decode step (docs/decisions.md,
"A kernel written without a GPU is opt-in until one has run it; then, if faster, the default"). Each choice is logged
once, with the reason when it is torch. The order of a token's k choices differs between the two (the kernel's is
descending by score + bias, torch's is unspecified); consumers treat them as a set.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3.ops import backend
from k3.ops.router.reference import route as route_reference

MAX_EXPERTS = 4096  # the kernel holds a row's E scores in one block of lanes
_logged: set[str] = set()


def route(logits: Tensor, bias: Tensor, top_k: int, renormalize: bool, scaling: float) -> tuple[Tensor, Tensor, Tensor]:
    """See :func:`k3.ops.router.reference.route` for shapes."""
    return backend.dispatch("router", logits.device, logits, bias, top_k, renormalize, scaling)


def _fast_supported(device: torch.device) -> bool:
    return device.type == "cuda"  # the kernel, where chosen, also needs Triton: checked when chosen


def topk_kernel(logits: Tensor, bias: Tensor) -> str:
    """Which form the fast backend runs: 'triton' where the kernel plan chose router_topk, no gradient
    is needed, logits and bias are fp32 and E <= MAX_EXPERTS, else 'torch' (:func:`k3.ops.backend.triton_or_torch`:
    logged once each, with the reason)."""

    def why_not() -> str:
        if torch.is_grad_enabled() and logits.requires_grad:
            return "a gradient is needed"
        if logits.dtype != torch.float32 or bias.dtype != torch.float32:
            return f"the kernel takes fp32 logits and bias, not {logits.dtype} and {bias.dtype}"
        if logits.shape[-1] > MAX_EXPERTS:
            return f"{logits.shape[-1]} experts, more than the kernel's {MAX_EXPERTS}"
        return ""

    return backend.triton_or_torch(
        "router_topk",
        "router: top-k by",
        why_not,
        ("the Triton kernel (k3.ops.router.triton_topk)", "torch (k3.ops.router.reference)"),
        _logged,
    )


def _route_fast(
    logits: Tensor, bias: Tensor, top_k: int, renormalize: bool, scaling: float
) -> tuple[Tensor, Tensor, Tensor]:
    if topk_kernel(logits, bias) == "triton":
        from k3.ops.router.triton_topk import router_topk  # Triton: imported on use (GPUs only)

        return router_topk(logits, bias, top_k, renormalize, scaling)
    return route_reference(logits, bias, top_k, renormalize, scaling)


backend.register("router", "reference", route_reference, label="torch")
backend.register(
    "router", "fast", _route_fast, _fast_supported, label="kernel router_topk where no gradient is needed, else torch"
)
