"""Quantisation-aware training of the routed experts (docs/architecture.md#mx): MXFP4 weights, MXFP8 activations, STE.

``enable_qat(model)`` sets ``MoE.qat`` on every MoE layer. Its forward then runs the routed-expert matmuls on

    w1, w3 [E, I, D], w2 [E, D, I]  -> fake_quantize(w, "e2m1")   blocks of 32 along each weight's input dim
    z [N, D] (expert input)         -> fake_quantize(z, "e4m3")   blocks of 32 along the feature dim
    h [n, I] (GLU output, w2 input) -> fake_quantize(h, "e4m3")

The master weights stay as they are (fp32 / bf16 parameters): the optimiser updates them, and checkpoints hold
them. Nothing else is touched: attention, shared experts, latent projections, router, norms, embeddings and
lm_head run in high precision. ``disable_qat(model)`` restores the exact high-precision forward.

Gradients use the straight-through estimator: the backward of a fake quantisation is the identity, so the
gradient reaching a master weight equals the gradient with respect to its fake-quantised copy. Saturated
(clamped) elements pass their gradient too (no clip mask): with the FLOOR rule only the block maxima can clamp,
and masking them would freeze exactly the weights that set each block's scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from k3.model.moe import moe_layers
from k3.ops.mx import MODES, fake_quantize

FORMATS = {"mxfp4": "e2m1", "mxfp8_e4m3": "e4m3", "mxfp8_e5m2": "e5m2"}
BLOCK = 32
# ``k3 train --qat NAME``: (weights, activations)
RECIPES = {
    "mxfp4": ("mxfp4", "mxfp8_e4m3"),  # K3: MXFP4 weights, MXFP8 activations
    "mxfp4-weights": ("mxfp4", None),
}  # weight-only (W4A16, as K2-Thinking's INT4 QAT)


class _FakeQuantizeSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, elem: str, block: int, mode: str) -> Tensor:
        return fake_quantize(x, elem, block, mode)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None, None, None


def fake_quantize_ste(x: Tensor, elem: str, block: int = BLOCK, mode: str = "floor") -> Tensor:
    """Forward: :func:`k3.ops.mx.fake_quantize`; backward: identity (straight-through, clamped values too)."""
    return _FakeQuantizeSTE.apply(x, elem, block, mode)


@dataclass(frozen=True)
class ExpertQAT:
    """What one MoE layer fake-quantises: ``weights`` / ``activations`` are FORMATS keys or None (off)."""

    weights: str | None = "mxfp4"
    activations: str | None = "mxfp8_e4m3"
    mode: str = "floor"
    block: int = BLOCK

    def __post_init__(self):
        for what in ("weights", "activations"):
            v = getattr(self, what)
            if v is not None and v not in FORMATS:
                raise ValueError(f"{what}={v!r} must be one of {', '.join(FORMATS)} or None")
        if self.weights is None and self.activations is None:
            raise ValueError("QAT with weights=None and activations=None quantises nothing; use disable_qat")
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} must be one of {', '.join(MODES)}")

    def weight(self, w: Tensor) -> Tensor:
        """A routed-expert weight [E, out, in], fake-quantised along ``in`` (identity when weights is None)."""
        return w if self.weights is None else fake_quantize_ste(w, FORMATS[self.weights], self.block, self.mode)

    def act(self, x: Tensor) -> Tensor:
        """An expert-matmul input [n, features], fake-quantised along ``features``."""
        return x if self.activations is None else fake_quantize_ste(x, FORMATS[self.activations], self.block, self.mode)

    @property
    def act_quant(self):
        """The ``act_quant`` callable for :func:`k3.ops.moe.moe_experts` (None when activations stay precise)."""
        return None if self.activations is None else self.act


def enable_qat(
    model: nn.Module, weights: str | None = "mxfp4", activations: str | None = "mxfp8_e4m3", mode: str = "floor"
) -> ExpertQAT:
    """Fake-quantise every MoE layer's routed experts (see the module docstring); returns the settings.

    Raises ValueError when the model has no MoE layer, holds packed experts (inference only), or an expert
    width (D or I) is not a multiple of 32."""
    qat = ExpertQAT(weights, activations, mode)
    layers = moe_layers(model)
    if not layers:
        raise ValueError("enable_qat: the model has no MoE layer")
    for moe in layers:
        if getattr(moe, "fp8", False):
            raise ValueError("enable_qat: FP8 expert matmuls are on (k3.quant.fp8); they do not combine with QAT")
        w1, w2 = moe.experts.w1, moe.experts.w2
        if not isinstance(w1, nn.Parameter):
            raise ValueError(
                "enable_qat: the experts are packed (loaded with packed='keep', inference only); "
                "load with packed='dequantize' to train"
            )
        for name, width in (("expert input width D", w1.shape[-1]), ("moe_intermediate_size", w2.shape[-1])):
            if width % qat.block:
                raise ValueError(
                    f"enable_qat: {name}={width} (layer {moe.layer_idx}) is not a multiple of "
                    f"the MX block size {qat.block}"
                )
    for moe in layers:
        moe.qat = qat
    return qat


def disable_qat(model: nn.Module) -> None:
    """Back to the high-precision forward on every MoE layer (the master weights were never changed)."""
    for moe in moe_layers(model):
        moe.qat = None


def qat_settings(model: nn.Module) -> ExpertQAT | None:
    """The QAT settings of the model's MoE layers (None when off); ValueError if the layers disagree."""
    found = {moe.qat for moe in moe_layers(model)}
    if len(found) > 1:
        raise ValueError(f"MoE layers have different QAT settings: {found}")
    return next(iter(found), None)
