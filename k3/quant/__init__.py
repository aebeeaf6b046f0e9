"""MX quantisation (docs/architecture.md#mx): OCP MX quantisers, QAT of the routed experts, packed MXFP4 checkpoints."""

from k3.ops.mx import ELEMENTS, MODES, dequantize, fake_quantize, pack_fp4, quantize, unpack_fp4
from k3.quant.packed import PackedExperts, pack_expert_tensors, quantization_config, unpack_expert_tensors
from k3.quant.qat import ExpertQAT, disable_qat, enable_qat, fake_quantize_ste, qat_settings

__all__ = [
    "ELEMENTS",
    "MODES",
    "quantize",
    "dequantize",
    "fake_quantize",
    "pack_fp4",
    "unpack_fp4",
    "fake_quantize_ste",
    "ExpertQAT",
    "enable_qat",
    "disable_qat",
    "qat_settings",
    "PackedExperts",
    "pack_expert_tensors",
    "unpack_expert_tensors",
    "quantization_config",
]
