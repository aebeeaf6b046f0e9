"""FP8 matmuls for the routed experts in training (Hopper's e4m3 tensor cores), the master weights unchanged.

``enable_fp8_experts(model)`` sets ``MoE.fp8`` on every MoE layer: its three expert matmuls then take e4m3 inputs
with row-wise scales (k3.ops.fp8): torchao's FP8 grouped GEMM on a GPU; elsewhere (the reference path) the forward
is emulated and the gradient is straight-through. This is a speed lever, not K3's quantisation recipe (MXFP4
weights / MXFP8 activations: k3.quant.qat); the two are not combined.
"""

from __future__ import annotations

from torch import nn

from k3.model.moe import moe_layers


def enable_fp8_experts(model: nn.Module) -> None:
    """Run every MoE layer's routed-expert matmuls in FP8 (module docstring). ValueError when the model has no
    MoE layer, holds packed experts, or has quantisation-aware training on (k3.quant.qat): choose one."""
    layers = moe_layers(model)
    if not layers:
        raise ValueError("enable_fp8_experts: the model has no MoE layer")
    for moe in layers:
        if not isinstance(moe.experts.w1, nn.Parameter):
            raise ValueError("enable_fp8_experts: the experts are packed (inference only); load them to train")
        if moe.qat is not None:
            raise ValueError("enable_fp8_experts: QAT is on; FP8 matmuls and MX fake quantisation do not combine")
    for moe in layers:
        moe.fp8 = True


def disable_fp8_experts(model: nn.Module) -> None:
    """Back to bf16 expert matmuls on every MoE layer."""
    for moe in moe_layers(model):
        moe.fp8 = False
