"""FP8 (e4m3) with row-wise power-of-two scales along the contraction dim, for the routed experts' training
matmuls (k3.quant.fp8 turns them on):

    scale s = 2^floor(log2(448 / amax)) per row,  q = clamp(x s, -448, 448) rounded to e4m3,  x ~ q / s

x [n, K] has one scale per row, an expert weight w [E, N, K] one per (expert, output channel). On a GPU the matmuls
are torchao's differentiable FP8 grouped GEMM (``torch._scaled_grouped_mm``, whose backward quantises the
gradient's matmul inputs the same way); :func:`fp8_rowwise` is the forward's rule in PyTorch (the reference).
"""

from __future__ import annotations

import torch
from torch import Tensor

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-12  # an all-zero row keeps a finite scale (its values stay 0)
ALIGN = 16  # FP8 grouped GEMMs need every group, K and N in multiples of 16


def rowwise_scale(x: Tensor, dim: int = -1) -> Tensor:
    """The power-of-two scale of each slice of ``x`` along ``dim`` (kept as a size-1 dim), in fp32. 448 / amax is
    taken in fp64, so a quotient just below a power of two is not rounded up to it (the scaled maximum would then
    saturate)."""
    amax = x.detach().abs().amax(dim, keepdim=True).double().clamp(min=AMAX_FLOOR)
    return torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax))).float()


def fp8_rowwise(x: Tensor, dim: int = -1) -> Tensor:
    """``x`` rounded to e4m3 with one power-of-two scale per slice along ``dim`` and scaled back (same dtype and
    shape): what an FP8 matmul with row-wise scales sees of ``x``."""
    s = rowwise_scale(x, dim)
    q = (x.float() * s).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return (q.float() / s).to(x.dtype)


class _Fp8STE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, dim: int) -> Tensor:
        return fp8_rowwise(x, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def fp8_rowwise_ste(x: Tensor, dim: int = -1) -> Tensor:
    """Forward: :func:`fp8_rowwise`; backward: identity."""
    return _Fp8STE.apply(x, dim)


def grouped_mm_fp8(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """x [R, K] bf16 (row-major), w [E, N, K] bf16, offs [E] int32 group ends, every group, K and N multiples of
    ALIGN -> [R, N] bf16: each group of rows times its expert's w^T in FP8 (torchao; CUDA, compute capability
    >= 8.9), differentiable."""
    from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm

    return _to_fp8_rowwise_then_scaled_grouped_mm(
        x.contiguous(), w.transpose(1, 2), offs, out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False
    )


def fp8_available(device: torch.device) -> str:
    """Why FP8 expert matmuls cannot run on ``device`` ('' when they can): the reference emulation runs anywhere;
    on CUDA they need compute capability >= 8.9 and torchao."""
    if device.type != "cuda":
        return ""
    if torch.cuda.get_device_capability(device) < (8, 9):
        return f"{torch.cuda.get_device_name(device)} has no FP8 tensor cores (compute capability < 8.9)"
    try:
        import torchao.prototype.moe_training.fp8_grouped_mm  # noqa: F401
    except ImportError as e:
        return f"torchao's FP8 grouped GEMM is not importable ({e}); pip install torchao"
    return ""
