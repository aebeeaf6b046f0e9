"""The short causal conv on the GPU through fla-core's Triton kernel (``pip install k3[gpu]``): one fused kernel
for the convolution and the SiLU, forward and backward, over the packed segments (``cu_seqlens``), computing in
fp32 and storing in x's dtype, like the reference (bf16 / fp16 / fp32 inputs; the flat form takes fp64).

fla keeps W columns of history per sequence ([N, C, W], the newest last) where the reference keeps W-1; the
kernel never reads the oldest column (the outputs need W-1 past inputs), so the reference's initial state
enters with a zero column in front and the final state leaves without its first column. States travel in x's
dtype here (the reference returns the final state in promote(x.dtype, fp32)): they hold past inputs, which are
exact in x's dtype, so only an initial state's gradient is rounded.
"""

from __future__ import annotations

import importlib.util

import torch

from k3.ops.conv.reference import check_arguments
from k3.ops.segments import Segments, as_segments

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def available(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("fla") is not None


@torch.compiler.disable  # fla's launch wrappers (autotuners, caches) stay out of traced graphs
def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Segments | torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """See :func:`k3.ops.conv.reference.causal_conv1d` (x [B, T, C], weight [C, W] -> y [B, T, C], state)."""
    from fla.modules.causal_conv1d import causal_conv1d as fla_causal_conv1d

    cu_seqlens = as_segments(cu_seqlens, x.device)
    check_arguments(x, weight, initial_state, cu_seqlens, activation)
    if x.dtype not in DTYPES:
        raise ValueError(f"fla's conv kernel takes {DTYPES}, got {x.dtype} (the flat form takes it)")
    state = None
    if initial_state is not None:
        state = torch.nn.functional.pad(initial_state.to(x.dtype), (1, 0)).contiguous()  # [N, C, W]
    y, final = fla_causal_conv1d(
        x.contiguous(),
        weight,
        initial_state=state,
        output_final_state=output_final_state,
        activation=activation,
        backend="triton",
        cu_seqlens=None if cu_seqlens is None else cu_seqlens.offsets,
        cu_seqlens_cpu=None if cu_seqlens is None else cu_seqlens.cpu,
    )
    return y, None if final is None else final[..., 1:]
