"""MoE routing after the router GEMM: ``route(logits [N, E], bias [E], top_k, renormalize, scaling) -> (scores
[N, E], topk_idx [N, k] int64, topk_weight [N, k])``; the contract: :func:`k3.ops.router.reference.route`.

Backends: ``reference`` is the torch form; ``fast`` (CUDA) runs the one Triton kernel of k3.ops.router.triton_topk
(it needs Triton) for calls that need no gradient (decode, evaluation) with fp32 inputs and at most MAX_EXPERTS
experts, and the torch form otherwise. ``K3_ROUTER_TOPK=torch`` turns the kernel off
(:func:`k3.ops.backend.triton_or_torch`); it is the default since it was measured on an H200 in session 24
(benchmarks/results/decode-opt-in.md). Each choice is logged once, with the reason when it is torch.
The order of a token's k choices differs between the two (the kernel's is descending by score + bias, torch's is
unspecified); consumers treat them as a set.

``route_input(x, weight, bias, ...)`` is the router from its input (what k3.model.moe.Router calls): F.linear in fp32,
then ``route``; opt-in (``K3_ROUTER_GEMM=triton``, until measured on a GPU), the GEMM and the routing in one Triton
launch (k3.ops.router.triton_gemm_topk) where :func:`gemm_topk_kernel` allows it.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

from k3.ops import backend
from k3.ops.dtypes import upcast
from k3.ops.moe import grouped as _grouped
from k3.ops.router.reference import route as route_reference

MAX_EXPERTS = 4096  # the kernel holds a row's E scores in one block of lanes
_logged: set[str] = set()


def route(logits: Tensor, bias: Tensor, top_k: int, renormalize: bool, scaling: float
          ) -> tuple[Tensor, Tensor, Tensor]:
    """See :func:`k3.ops.router.reference.route` for shapes."""
    return backend.dispatch("router", logits.device, logits, bias, top_k, renormalize, scaling)


def _fast_supported(device: torch.device) -> bool:
    return device.type == "cuda"  # the kernel, where chosen, also needs Triton: checked when chosen


def topk_kernel(logits: Tensor, bias: Tensor) -> str:
    """Which form the fast backend runs: 'triton' when Triton is usable, K3_ROUTER_TOPK is not torch, no gradient
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

    return backend.triton_or_torch("K3_ROUTER_TOPK", "router: top-k by", why_not,
                                   ("the Triton kernel (k3.ops.router.triton_topk)", "torch (k3.ops.router.reference)"),
                                   _grouped._have_triton, _logged)


MAX_LOGITS = 8192  # the one-launch router's limit on N * E (its last program reads every logit's partials)
_gemm_logged: set[str] = set()


def gemm_topk_kernel(x: Tensor, weight: Tensor, bias: Tensor) -> str:
    """Whether :func:`route_input` runs its GEMM and routing in one launch (k3.ops.router.triton_gemm_topk):
    'triton' when K3_ROUTER_GEMM=triton (opt-in: not yet measured on a GPU), Triton is usable, the inputs are on a
    GPU (or in Triton's interpreter), no gradient is needed, autocast is off, K3_ROUTER_TOPK is not torch, x and the
    weight are bf16, fp16 or fp32, the bias fp32, E <= MAX_EXPERTS and N * E <= MAX_LOGITS; else 'torch' (logged
    once each, with the reason). The kernel's GEMM is always IEEE fp32 (also where TF32 is allowed)."""
    def why_not() -> str:
        if not _grouped._kernel_device(x.device):
            return "the router's input is not on a GPU"
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            return "a gradient is needed"
        if torch.is_autocast_enabled(x.device.type):
            return "autocast is on (F.linear then runs in autocast's dtype; the kernel always in fp32)"
        if os.environ.get("K3_ROUTER_TOPK") == "torch":
            return "K3_ROUTER_TOPK=torch (the launch includes the top-k)"
        floats = (torch.bfloat16, torch.float16, torch.float32)
        if x.dtype not in floats or weight.dtype not in floats or bias.dtype != torch.float32:
            return f"the kernel takes bf16 / fp16 / fp32 x and weight and an fp32 bias, not {x.dtype}, " \
                   f"{weight.dtype} and {bias.dtype}"
        if weight.shape[0] > MAX_EXPERTS:
            return f"{weight.shape[0]} experts, more than the kernel's {MAX_EXPERTS}"
        if x.shape[0] * weight.shape[0] > MAX_LOGITS:
            return f"{x.shape[0]} rows x {weight.shape[0]} experts, more than the kernel's {MAX_LOGITS} logits"
        return ""

    return backend.triton_or_torch("K3_ROUTER_GEMM", "router: GEMM and top-k by", why_not,
                                   ("one Triton launch (k3.ops.router.triton_gemm_topk)",
                                    "F.linear in fp32, then route()"), _grouped._have_triton, _gemm_logged,
                                   opt_in=True)


def route_input(x: Tensor, weight: Tensor, bias: Tensor, top_k: int, renormalize: bool, scaling: float
                ) -> tuple[Tensor, Tensor, Tensor]:
    """The router from its input: x [N, d], weight [E, d], bias [E] -> route(x W^T in fp32, bias, ...). Under the
    fast backend, where :func:`gemm_topk_kernel` chooses it, the GEMM and the routing in one Triton launch (equal
    up to the GEMM's fp32 summation order); otherwise F.linear on upcast inputs, then :func:`route`."""
    if backend.resolve("router", x.device)[0] == "fast" and gemm_topk_kernel(x, weight, bias) == "triton":
        from k3.ops.router.triton_gemm_topk import router_gemm_topk  # Triton: imported on use

        return router_gemm_topk(x, weight, bias, top_k, renormalize, scaling)
    return route(F.linear(upcast(x), upcast(weight)), bias, top_k, renormalize, scaling)


def _route_fast(logits: Tensor, bias: Tensor, top_k: int, renormalize: bool, scaling: float
                ) -> tuple[Tensor, Tensor, Tensor]:
    if topk_kernel(logits, bias) == "triton":
        from k3.ops.router.triton_topk import router_topk  # Triton: imported on use (GPUs only)

        return router_topk(logits, bias, top_k, renormalize, scaling)
    return route_reference(logits, bias, top_k, renormalize, scaling)


backend.register("router", "reference", route_reference, label="torch; the fast path needs CUDA")
backend.register("router", "fast", _route_fast, _fast_supported,
                 label="the Triton top-k kernel where no gradient is needed (K3_ROUTER_TOPK=torch: never), else torch")
