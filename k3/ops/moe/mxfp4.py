"""Routed experts kept as MXFP4 bytes (inference): only the experts a batch selects are dequantised
(docs/architecture.md#mx, docs/architecture.md#latentmoe).

``moe_experts_packed(x, topk_idx, topk_weight, experts, glu) -> [N, D]`` computes what
:func:`k3.ops.moe.reference.moe_experts` computes on the dequantised bank, reading the bank as packed codes and
scales: ``experts`` has uint8 ``w{1,3}_packed`` [E, I, D / 2], ``w2_packed`` [E, D, I / 2] (two E2M1 codes a
byte, low nibble = even column) and ``w{1,2,3}_scale`` [..., in / 32] (E8M0, 2^(s - 127), 0xFF = NaN), and
optionally ``dtype`` (what the weights are dequantised to, default x.dtype), as k3.quant.packed.PackedExperts.

- reference (any device): the unique experts of the batch are dequantised (:func:`dequantize_experts`, exactly
  k3.ops.mx's values, rounded once to the dtype) and the per-expert loop of k3.ops.moe.reference runs on them.
  Its output equals the loop on the whole dequantised bank bit for bit (same experts, same order).
- fast (CUDA): no-grad batches go to k3.ops.moe.triton_mxfp4 where the kernel plan chose kernel ``moe_mxfp4`` (codes
  and scales read in the matmul and dequantised in registers, no bf16 copy of any expert), decode and prefill alike:
  a grouped matmul over any number of rows per expert, which at decode sizes runs k3.ops.moe.cuda_mxfp4's kernel
  (kernel ``moe_mxfp4_rows``). Otherwise the selected experts are dequantised
  (to bf16 where ``moe_experts`` runs grouped_mm, else to the model's dtype) and the op ``moe_experts`` runs on
  them: without a host sync, a copy of its expert for each token-expert pair when there are fewer pairs than experts
  (duplicates included); else the batch's unique experts (one host sync) or, under CUDA-graph capture or
  compilation, the whole bank.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from k3.ops import backend
from k3.ops.moe import reference
from k3.ops.moe.grouped import kernel_device
from k3.ops.mx import MXFP4_GROUP, unpack_weight

WEIGHTS = ("w1", "w2", "w3")
GROUP = MXFP4_GROUP


def dequantize_experts(packed: Tensor, scale: Tensor, experts: Tensor, dtype: torch.dtype) -> Tensor:
    """packed uint8 [E, out, in / 2], scale uint8 [E, out, in / 32], experts int64 [U] -> the weights of those
    experts [U, out, in] in ``dtype``: E2M1 code x 2^(scale - 127), NaN for scale 0xFF (OCP MX; exactly
    k3.ops.mx.dequantize, then one rounding to ``dtype``). Only the U experts' bytes are read."""
    return unpack_weight(packed.index_select(0, experts), scale.index_select(0, experts), dtype)


def _bank(experts) -> tuple[Tensor, ...]:
    """(w1_packed, w1_scale, w2_packed, w2_scale, w3_packed, w3_scale) of a PackedExperts-like object, checked."""
    out = tuple(getattr(experts, f"{w}_{part}") for w in WEIGHTS for part in ("packed", "scale"))
    e = out[0].shape[0]
    for w, (p, s) in zip(WEIGHTS, zip(out[0::2], out[1::2])):
        if (
            p.dtype != torch.uint8
            or s.dtype != torch.uint8
            or p.dim() != 3
            or p.shape[0] != e
            or tuple(s.shape) != (e, p.shape[1], 2 * p.shape[2] // GROUP)
            or (2 * p.shape[2]) % GROUP
        ):
            raise ValueError(
                f"moe_experts_packed: {w}_packed {tuple(p.shape)} {p.dtype} and {w}_scale "
                f"{tuple(s.shape)} {s.dtype} are not an MXFP4 bank (uint8 [E, out, in / 2] and "
                f"[E, out, in / {GROUP}])"
            )
    return out


def _dtype(experts, x: Tensor) -> torch.dtype:
    return getattr(experts, "dtype", None) or x.dtype


def _selected(bank: tuple[Tensor, ...], chosen: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """w1, w2, w3 of the experts ``chosen`` [U], dequantised (looked up at call time: tests count the experts)."""
    return tuple(dequantize_experts(bank[2 * i], bank[2 * i + 1], chosen, dtype) for i in range(3))


def moe_experts_reference(
    x: Tensor, topk_idx: Tensor, topk_weight: Tensor, experts, glu: Callable[[Tensor, Tensor], Tensor]
) -> Tensor:
    """x [N, D], topk_idx [N, k] int64, topk_weight [N, k] fp32, packed experts -> [N, D] in x.dtype: the batch's
    unique experts dequantised (one host sync), then the per-expert loop of k3.ops.moe.reference."""
    bank = _bank(experts)
    if x.shape[0] == 0:
        return x.new_zeros(0, bank[2].shape[1])
    chosen, local = torch.unique(topk_idx, sorted=True, return_inverse=True)
    w1, w2, w3 = _selected(bank, chosen, _dtype(experts, x))
    return reference.moe_experts(x, local.reshape(topk_idx.shape), topk_weight, w1, w2, w3, glu)


def available(device: torch.device) -> bool:
    return device.type == "cuda"


_logged: set[str] = set()


def mxfp4_kernel(x: Tensor, topk_idx: Tensor, needs_grad: bool) -> str:
    """'triton' (k3.ops.moe.triton_mxfp4) where the kernel plan chose moe_mxfp4, no gradient is needed, the batch
    is on a GPU; else 'torch' (selected experts dequantised to bf16). Chosen and
    logged once each by :func:`k3.ops.backend.triton_or_torch`."""

    def why_not() -> str:
        if not kernel_device(x.device):
            return "the batch is not on a GPU"
        if needs_grad:
            return "a gradient is needed"
        return ""

    return backend.triton_or_torch(
        "moe_mxfp4",
        "moe_experts_packed: MXFP4 experts by",
        why_not,
        (
            "one Triton matmul per weight reading codes and scales (k3.ops.moe.triton_mxfp4)",
            "the selected experts dequantised to bf16, then moe_experts",
        ),
        _logged,
    )


def moe_experts_fast(
    x: Tensor, topk_idx: Tensor, topk_weight: Tensor, experts, glu: Callable[[Tensor, Tensor], Tensor]
) -> Tensor:
    """Same contract as :func:`moe_experts_reference`; see the module docstring for what runs."""
    bank = _bank(experts)
    n, k = topk_idx.shape
    if x.shape[0] == 0:
        return x.new_zeros(0, bank[2].shape[1])
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or topk_weight.requires_grad)
    if mxfp4_kernel(x, topk_idx, needs_grad) == "triton":
        from k3.ops.moe.triton_mxfp4 import moe_mxfp4  # Triton: imported on use (GPUs only)

        return moe_mxfp4(x, topk_idx, topk_weight, bank, glu)
    num_experts, pairs = bank[0].shape[0], topk_idx.numel()
    if pairs < num_experts:  # a copy of its expert for each pair: static shapes, no host sync
        chosen, local = topk_idx.reshape(-1), torch.arange(pairs, device=x.device).view(n, k)
    elif torch.compiler.is_compiling() or (x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        chosen, local = torch.arange(num_experts, device=x.device), topk_idx
    else:
        chosen, local = torch.unique(topk_idx, sorted=True, return_inverse=True)
    name, run = backend.resolve("moe_experts", x.device)  # grouped_mm computes in bf16; the loop in the model's dtype
    w1, w2, w3 = _selected(bank, chosen, torch.bfloat16 if name == "fast" else _dtype(experts, x))
    return run(x, local.reshape(n, k), topk_weight, w1, w2, w3, glu)


backend.register("moe_experts_packed", "reference", moe_experts_reference)
backend.register("moe_experts_packed", "fast", moe_experts_fast, available)


def moe_experts_packed(
    x: Tensor, topk_idx: Tensor, topk_weight: Tensor, experts, glu: Callable[[Tensor, Tensor], Tensor]
) -> Tensor:
    """y_t = sum_j p_tj E_j(x_t) with the routed experts kept packed (see the module docstring).

    x [N, D]; topk_idx [N, k] int64; topk_weight [N, k] fp32; experts: PackedExperts-like (uint8 codes and E8M0
    scales, [E, out, in / 2] and [E, out, in / 32]). Returns [N, D] in x.dtype."""
    return backend.dispatch("moe_experts_packed", x.device, x, topk_idx, topk_weight, experts, glu)
