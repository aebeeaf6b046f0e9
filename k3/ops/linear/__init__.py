"""Several linear maps of one input: ``multi_linear(x [M, K], weights [N_i, K]) -> [[M, N_i]]``.

A decode step's KDA layer multiplies its input by six weights (q, k, v, the forget gate's and the output gate's low-rank
inputs, beta), a MoE layer by three (the latent down-projection, the shared experts' gate and up), an MLA decode step by
two or three (the first query map, kv_a_proj_with_mqa, the output gate): GEMV launches whose time is mostly launch and
tail (benchmarks/results/multi_linear_configs.md). A MoE layer's router goes with its maps as the last one, computed in
fp32 (``fp32=1``: x and the weight upcast, as the router's own GEMM); in the kernel that is the input's products
accumulated in fp32, with the weight in fp32 or in the input's dtype, where cuBLAS took two launches of its own, an fp32
GEMM and a split-K reduction (docs/decisions.md, "The router's fp32 GEMM on the tensor cores"). One-weight calls (a KDA
decode step's o_proj, the shared experts' down-projection) take the launch too: cuBLAS's kernels do not use programmatic
dependent launch (k3.ops.pdl), ours do. The ``fast`` backend can run them as one Triton launch
(k3.ops.linear.triton_multi) for calls that need no gradient, with 2-D bf16 / fp16 inputs of at most MAX_ROWS rows and
at most MAX_WEIGHTS weights; the torch form otherwise: where a gradient is needed (a training step) one linear over the
stacked weights (:func:`concatenated`: one matrix product forward and two backward instead of one and two per weight),
else one linear per weight (a prefill's GEMMs gain nothing from stacking, a decode step's GEMVs would pay for its copy
of the weights: they read each weight once). ``K3_KERNELS=multi_linear=torch`` turns the kernel off
(:func:`k3.ops.backend.triton_or_torch`); it is the default because it was faster in the decode step (docs/decisions.md,
"A kernel written without a GPU is opt-in until one has run it; then, if faster, the default"). Each choice is logged
once, with the reason when it is torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from k3.ops import backend
from k3.ops.linear.reference import multi_linear as multi_linear_reference

MAX_WEIGHTS = 8  # the kernel's weight slots
MAX_ROWS = 256  # decode batches; bigger ones are GEMMs, where cuBLAS is the better choice
_logged: set[str] = set()
TORCH_FORM = (
    "torch: one linear over the stacked weights where a gradient is needed (k3.ops.linear.concatenated), "
    "else one linear per weight (k3.ops.linear.reference)"
)


def multi_linear(x: Tensor, weights: list[Tensor], fp32: int = 0) -> list[Tensor]:
    """See :func:`k3.ops.linear.reference.multi_linear` (every form ends in its check of ``fp32``)."""
    return backend.dispatch("multi_linear", x.device, x, weights, fp32)


def _needs_grad(x: Tensor, weights: list[Tensor]) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights))


def _fast_supported(device: torch.device) -> bool:
    return device.type == "cuda"  # the kernel, where chosen, also needs Triton: checked when chosen


def kernel(x: Tensor, weights: list[Tensor], fp32: int = 0) -> str:
    """Which form the fast backend runs: 'triton' where the kernel plan chose multi_linear, no gradient
    is needed, x is 2-D bf16 / fp16 with at most MAX_ROWS rows and 1..MAX_WEIGHTS weights of its width and dtype
    (the last ``fp32`` ones: its dtype or fp32); else 'torch' (:func:`k3.ops.backend.triton_or_torch`: logged once
    each, with the reason)."""

    def why_not() -> str:
        if _needs_grad(x, weights):
            return "a gradient is needed"
        if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16):
            return f"the kernel takes 2-D bf16 / fp16 inputs, not {x.dim()}-D {x.dtype}"
        if x.shape[0] > MAX_ROWS:  # a prefill's rows (the reason names no length: logged once, not once per length)
            return f"more than {MAX_ROWS} rows"
        if not 1 <= len(weights) <= MAX_WEIGHTS or not weights_fit(x, weights, fp32):
            return f"the kernel takes 1..{MAX_WEIGHTS} [N, K] weights of the input's dtype (fp32 ones: also fp32)"
        return ""

    return backend.triton_or_torch(
        "multi_linear",
        "multi_linear:",
        why_not,
        ("one Triton launch (k3.ops.linear.triton_multi)", TORCH_FORM),
        _logged,
    )


def weights_fit(x: Tensor, weights: list[Tensor], fp32: int) -> bool:
    """Whether the kernel takes these weights: [N_i, K] with x's K, in x's dtype; the last ``fp32`` also in fp32."""
    n = len(weights) - fp32
    return 0 <= fp32 <= len(weights) and all(
        w.dim() == 2 and w.shape[1] == x.shape[1] and (w.dtype == x.dtype or (i >= n and w.dtype == torch.float32))
        for i, w in enumerate(weights)
    )


def concatenated(x: Tensor, weights: list[Tensor], fp32: int = 0) -> list[Tensor]:
    """The maps as one matrix product with the weights stacked ([sum N_i, K]), its output split into column views
    [M, N_i] (strided: row stride sum N_i): one GEMM and, in backward, one for x's gradient and one for the stacked
    weights' instead of a few per weight. Weights of one dtype (else one linear each, the reference). The stacking
    copies the weights once per call: small beside a training step's products over its rows. The last ``fp32``
    maps are the reference's (each its own fp32 product)."""
    n = len(weights) - fp32
    stacked, rest = weights[:n], multi_linear_reference(x, weights[n:], fp32) if fp32 else []
    if len(stacked) < 2 or any(w.dtype != stacked[0].dtype for w in stacked):
        return multi_linear_reference(x, stacked) + rest
    return list(F.linear(x, torch.cat(stacked)).split([w.shape[0] for w in stacked], dim=-1)) + rest


def _multi_linear_fast(x: Tensor, weights: list[Tensor], fp32: int = 0) -> list[Tensor]:
    if kernel(x, weights, fp32) == "triton":
        from k3.ops.linear.triton_multi import multi_linear as multi_linear_triton  # Triton: imported on use

        return multi_linear_triton(x, weights, fp32)
    if _needs_grad(x, weights):
        return concatenated(x, weights, fp32)
    return multi_linear_reference(x, weights, fp32)


backend.register("multi_linear", "reference", multi_linear_reference, label="one torch linear per weight")
backend.register(
    "multi_linear",
    "fast",
    _multi_linear_fast,
    _fast_supported,
    label="kernel multi_linear where no gradient is needed, else torch (stacked where one is)",
)
