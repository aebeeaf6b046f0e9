"""Several linear maps of one input: ``multi_linear(x [M, K], weights [N_i, K]) -> [[M, N_i]]``.

A decode step's KDA layer multiplies its input by six weights (q, k, v, the forget gate's and the output gate's
low-rank inputs, beta), a MoE layer by three (the latent down-projection, the shared experts' gate and up), an MLA
decode step by two or three (the first query map, kv_a_proj_with_mqa, the output gate): GEMV launches of a few
microseconds each on an H200, most of it launch and tail. The ``fast`` backend can run them as one Triton launch
(k3.ops.linear.triton_multi) for calls that need no gradient, with 2-D bf16 / fp16 inputs of at most MAX_ROWS rows
and at most MAX_WEIGHTS weights; the torch form otherwise. ``K3_MULTI_LINEAR=torch`` turns the kernel off
(:func:`k3.ops.backend.triton_or_torch`); it is the default since it was measured on an H200 in session 24
(benchmarks/results/decode-opt-in.md). Each choice is logged once, with the reason when it is torch.

``multi_linear_conv`` is a KDA decode step's maps followed by the short convs of the first three (q, k, v); opt-in
(``K3_MAPS_CONV=triton``, until run on a GPU), both in the maps' one launch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3.ops import backend
from k3.ops.conv import causal_conv1d_steps, steps_kernel
from k3.ops.linear.reference import multi_linear as multi_linear_reference
from k3.ops.moe import grouped as _grouped

MAX_WEIGHTS = 8  # the kernel's weight slots
MAX_ROWS = 256  # decode batches; bigger ones are GEMMs, where cuBLAS is the better choice
_logged: set[str] = set()


def multi_linear(x: Tensor, weights: list[Tensor]) -> list[Tensor]:
    """See :func:`k3.ops.linear.reference.multi_linear`."""
    return backend.dispatch("multi_linear", x.device, x, weights)


def _fast_supported(device: torch.device) -> bool:
    return device.type == "cuda"  # the kernel, where chosen, also needs Triton: checked when chosen


def kernel(x: Tensor, weights: list[Tensor]) -> str:
    """Which form the fast backend runs: 'triton' when Triton is usable, K3_MULTI_LINEAR is not torch, no gradient
    is needed, x is 2-D bf16 / fp16 with at most MAX_ROWS rows and 1..MAX_WEIGHTS weights of its dtype and width;
    else 'torch' (:func:`k3.ops.backend.triton_or_torch`: logged once each, with the reason)."""
    def why_not() -> str:
        if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)):
            return "a gradient is needed"
        if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16):
            return f"the kernel takes 2-D bf16 / fp16 inputs, not {x.dim()}-D {x.dtype}"
        if x.shape[0] > MAX_ROWS:  # a prefill's rows (the reason names no length: logged once, not once per length)
            return f"more than {MAX_ROWS} rows"
        if not 1 <= len(weights) <= MAX_WEIGHTS or any(w.dim() != 2 or w.dtype != x.dtype or w.shape[1] != x.shape[1]
                                                       for w in weights):
            return f"the kernel takes 1..{MAX_WEIGHTS} [N, K] weights of the input's dtype"
        return ""

    return backend.triton_or_torch("K3_MULTI_LINEAR", "multi_linear:", why_not,
                                   ("one Triton launch (k3.ops.linear.triton_multi)",
                                    "one torch linear per weight (k3.ops.linear.reference)"), _grouped._have_triton,
                                   _logged)


def _multi_linear_fast(x: Tensor, weights: list[Tensor]) -> list[Tensor]:
    if kernel(x, weights) == "triton":
        from k3.ops.linear.triton_multi import multi_linear as multi_linear_triton  # Triton: imported on use

        return multi_linear_triton(x, weights)
    return multi_linear_reference(x, weights)


_conv_logged: set[str] = set()


def conv_kernel(x: Tensor, weights: list[Tensor], conv_weights: list[Tensor], states: list[Tensor],
                activation: str | None) -> str:
    """Whether :func:`multi_linear_conv` runs as one launch (k3.ops.linear.triton_multi.multi_linear_conv): 'triton'
    when K3_MAPS_CONV=triton (opt-in: not yet run on a GPU), both parts' kernels would run (:func:`kernel` and
    k3.ops.conv.steps_kernel say triton: neither switched off, no gradient, supported shapes and dtypes), the
    activation is silu or None and the three convs have one width of at most 4; else 'torch' (logged once each,
    with the reason)."""
    def why_not() -> str:
        if len(weights) < 3 or len(conv_weights) != 3 or len(states) != 3:
            return "the kernel takes three convolved maps first"
        if kernel(x, weights) != "triton":
            return "multi_linear's own kernel does not run here (its log line says why)"
        # x stands for the three maps' outputs (their dtype, and a gradient iff x or a weight needs one)
        if steps_kernel([x] * 3, conv_weights, states, activation) != "triton":
            return "the short conv's own kernel does not run here (its log line says why)"
        if len({c.shape[-1] for c in conv_weights}) != 1 or conv_weights[0].shape[-1] > 4:
            return "the kernel takes three convs of one width, at most 4"
        return ""

    return backend.triton_or_torch("K3_MAPS_CONV", "multi_linear_conv:", why_not,
                                   ("one Triton launch (k3.ops.linear.triton_multi.multi_linear_conv)",
                                    "multi_linear, then causal_conv1d_steps"), _grouped._have_triton, _conv_logged,
                                   opt_in=True)


def multi_linear_conv(x: Tensor, weights: list[Tensor], conv_weights: list[Tensor], *, states: list[Tensor],
                      slots: Tensor, activation: str | None = "silu") -> list[Tensor]:
    """A KDA decode step's input maps and short convs: multi_linear(x, weights), then the first three outputs
    through k3.ops.conv.causal_conv1d_steps (conv weights [N_i, W], state pools [S, N_i, W-1] updated in place,
    ``slots`` [M]) -> [conv'd y_0..y_2, x @ W_3^T, ...]. Under the fast backend, where :func:`conv_kernel` chooses
    it, one Triton launch for both (opt-in: K3_MAPS_CONV=triton)."""
    if backend.resolve("multi_linear", x.device)[0] == "fast" and conv_kernel(
            x, weights, conv_weights, states, activation) == "triton":
        from k3.ops.linear.triton_multi import multi_linear_conv as fused  # Triton: imported on use

        return list(fused(x, weights, *conv_weights, *states, slots, activation == "silu")[:len(weights)])
    ys = multi_linear(x, weights)
    return causal_conv1d_steps(ys[:3], conv_weights, states=states, slots=slots, activation=activation) + ys[3:]


backend.register("multi_linear", "reference", multi_linear_reference, label="one torch linear per weight")
backend.register("multi_linear", "fast", _multi_linear_fast, _fast_supported,
                 label="one Triton launch where no gradient is needed (K3_MULTI_LINEAR=torch: never), else torch")
