"""OCP Microscaling (MX v1.0) codecs in vectorised PyTorch (docs/architecture.md#mx): quantise, dequantise, pack.

A block of ``block`` (32) consecutive elements along the last dim shares one E8M0 scale X = 2^(s - 127)
(s: uint8, 0xFF = NaN); each element is stored as a small float code P and is worth X * P.

Element types (``elem``), all with round-half-to-even and saturation to +-max (no infinities are produced):

  name   bits  bias  max     emax  min subnormal  special codes
  e2m1   1.2.1  1    6       2     0.5            none (E2M1 has no inf / NaN)
  e4m3   1.4.3  7    448     8     2^-9           S.1111.111 = NaN (no inf)
  e5m2   1.5.2  15   57344   15    2^-16          S.11111.00 = inf, S.11111.{01,10,11} = NaN

Codes are uint8 bit patterns (E2M1 in the low 4 bits: sign bit 3). Scale modes (``mode``), with amax the
block's largest magnitude:

- ``floor`` (the OCP rule): s - 127 = floor(log2 amax) - emax. V / X can reach almost 2^(emax + 1), above
  ``max``: those elements saturate.
- ``rceil`` (NVIDIA / cuBLAS, torchao RCEIL): X = the smallest power of two >= amax / max, where amax / max is
  first rounded to float32 (round-to-nearest-even), as the hardware and torchao compute it. Nothing saturates.

Choices and edge cases (all deterministic; the tests pin them):
- Arithmetic is float32: inputs are cast to float32 first (exact for bf16 / fp16 / fp32). Exponents come from
  ``torch.frexp`` and scales are built from their bit patterns, so every power of two, including 2^-127, is
  exact and the dequantised float32 value X * P is exact.
- Zero blocks (and blocks so small that the rule asks for an exponent below -127) get the smallest scale,
  s = 0 (2^-127), which is also what torchao writes for an all-zero block. Exponents are clamped to
  [-127, 127]; finite float32 inputs never reach the upper clamp.
- Elements below the element type's smallest subnormal round (half-to-even) to zero. The sign is kept:
  negative values that round to zero, and -0.0 itself, get the sign bit (codes 0x8 / 0x80).
- NaN anywhere in a block -> scale 0xFF (NaN), as the spec says. +-inf anywhere in a block -> also scale 0xFF:
  E8M0 has no infinity and log2(inf) is beyond every scale, so we propagate it as NaN rather than saturate
  (torchao instead writes a finite scale and saturates). The element codes of a NaN-scale block carry no
  value; we write the element NaN code 0x7F for e4m3 / e5m2 and 0 for e2m1 (no NaN code) in every position.
- A block's scale code 0 means exactly 2^-127 (a float32 subnormal): elements are divided by it exactly. torchao
  divides by 2^-126 (FLOOR) or by 1 (RCEIL) there instead, so its codes differ for such tiny blocks.

``fake_quantize`` (= ``dequantize(quantize(x))``, bit for bit) is computed directly, without host syncs, on
any device; it is the forward of quantisation-aware training (:mod:`k3.quant.qat`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

MODES = ("floor", "rceil")
SCALE_BIAS = 127
SCALE_NAN = 0xFF


@dataclass(frozen=True)
class Element:
    """A minifloat element type: sign, ``ebits`` exponent bits (bias ``bias``), ``mbits`` mantissa bits."""

    name: str
    ebits: int
    mbits: int
    bias: int
    max: float
    emax: int  # floor(log2(max))
    nan_code: int  # the code written in a NaN-scale block

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number (subnormals share it)."""
        return 1 - self.bias


ELEMENTS = {
    "e2m1": Element("e2m1", 2, 1, 1, 6.0, 2, 0x0),
    "e4m3": Element("e4m3", 4, 3, 7, 448.0, 8, 0x7F),
    "e5m2": Element("e5m2", 5, 2, 15, 57344.0, 15, 0x7F),
}


def element(elem: str) -> Element:
    if elem not in ELEMENTS:
        raise ValueError(f"elem={elem!r} must be one of {', '.join(ELEMENTS)}")
    return ELEMENTS[elem]


def _check(x: Tensor, elem: str, block: int, mode: str | None) -> Element:
    e = element(elem)
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block={block!r} must be a positive integer")
    if mode is not None and mode not in MODES:
        raise ValueError(f"mode={mode!r} must be one of {', '.join(MODES)}")
    if not x.is_floating_point():
        raise ValueError(f"expected a floating-point tensor, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % block:
        raise ValueError(f"the last dim of shape {tuple(x.shape)} must be a multiple of block={block}")
    return e


def pow2(k: Tensor) -> Tensor:
    """Exact float32 2^k for an integer tensor k in [-149, 127] (subnormal powers included), built from bits."""
    k = k.to(torch.int32)
    normal = torch.bitwise_left_shift((k + 127).clamp(min=1), 23)
    subnormal = torch.bitwise_left_shift(torch.ones_like(k), (k + 149).clamp(0, 22))
    return torch.where(k >= -126, normal, subnormal).view(torch.float32)


def _floor_log2(a: Tensor) -> Tensor:
    """floor(log2(a)) for finite a > 0 (float32, subnormals included), as int32; garbage where a == 0."""
    return torch.frexp(a)[1] - 1


def _blocks(x: Tensor, block: int) -> Tensor:
    """[..., n] -> float32 [..., n / block, block]."""
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _scale_exponent(xb: Tensor, e: Element, mode: str) -> tuple[Tensor, Tensor]:
    """Blocks [..., nb, block] -> (unbiased scale exponent int32 [..., nb, 1] in [-127, 127], bad [..., nb, 1])
    where ``bad`` marks blocks holding a NaN or an infinity."""
    amax = xb.abs().amax(-1, keepdim=True)  # NaN if the block holds a NaN
    bad = ~torch.isfinite(amax)
    if mode == "floor":
        exp = _floor_log2(amax) - e.emax
        zero = amax == 0
    else:
        descale = amax / e.max  # float32, round-to-nearest-even
        mant, ex = torch.frexp(descale)
        exp = torch.where(mant == 0.5, ex - 1, ex)  # ceil(log2(descale)), exact
        zero = descale == 0
    exp = torch.where(zero | bad, -SCALE_BIAS, exp).clamp(-SCALE_BIAS, SCALE_BIAS)
    return exp, bad


def _round_magnitude(y: Tensor, e: Element) -> Tensor:
    """|y| rounded half-to-even onto the element grid and saturated to e.max (float32, exact)."""
    a = y.abs()
    exp = _floor_log2(a).clamp(min=e.emin)  # a == 0 -> frexp exponent 0 -> -1 -> emin (emin <= 0)
    quantum = pow2(exp - e.mbits)
    return (torch.round(a / quantum) * quantum).clamp(max=e.max)


def quantize(x: Tensor, elem: str, block: int = 32, mode: str = "floor") -> tuple[Tensor, Tensor]:
    """x [..., n] float -> (codes uint8 [..., n], scales uint8 [..., n / block]) in MX format ``elem``."""
    e = _check(x, elem, block, mode)
    xb = _blocks(x, block)
    exp, bad = _scale_exponent(xb, e, mode)
    y = torch.where(bad, 0.0, xb) * pow2(-exp)  # exact: V / X
    r = _round_magnitude(y, e)
    fe = _floor_log2(r).clamp(min=e.emin)
    mant_full = (r * pow2(e.mbits - fe)).to(torch.int32)  # r / 2^(fe - mbits): an integer < 2^(mbits + 1)
    normal = mant_full >= (1 << e.mbits)
    exp_field = torch.where(normal, fe + e.bias, 0)
    mant = mant_full - normal.to(torch.int32) * (1 << e.mbits)
    sign = torch.signbit(y).to(torch.int32)
    codes = (sign << (e.ebits + e.mbits)) | (exp_field << e.mbits) | mant
    codes = torch.where(bad, e.nan_code, codes).to(torch.uint8).reshape(x.shape)
    scales = torch.where(bad, SCALE_NAN, exp + SCALE_BIAS).to(torch.uint8).squeeze(-1)
    return codes, scales


def decode(codes: Tensor, elem: str) -> Tensor:
    """Element codes uint8 -> float32 values (without the block scale). E2M1 reads the low 4 bits only."""
    e = element(elem)
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    c = codes.to(torch.int32)
    sign = (c >> (e.ebits + e.mbits)) & 1
    exp_field = (c >> e.mbits) & ((1 << e.ebits) - 1)
    mant = c & ((1 << e.mbits) - 1)
    normal = exp_field > 0
    mant_full = mant + normal.to(torch.int32) * (1 << e.mbits)
    value = mant_full.float() * pow2(torch.where(normal, exp_field - e.bias, e.emin) - e.mbits)
    top = (1 << e.ebits) - 1
    if e.name == "e4m3":
        value = torch.where((exp_field == top) & (mant == (1 << e.mbits) - 1), float("nan"), value)
    elif e.name == "e5m2":
        value = torch.where(exp_field == top, torch.where(mant == 0, float("inf"), float("nan")), value)
    return torch.where(sign.bool(), -value, value)


def scale_values(scales: Tensor) -> Tensor:
    """E8M0 codes uint8 -> float32 2^(s - 127), NaN for 0xFF (exact, 2^-127 included)."""
    if scales.dtype != torch.uint8:
        raise ValueError(f"scales must be uint8, got {scales.dtype}")
    s = scales.to(torch.int32)
    return torch.where(s == SCALE_NAN, float("nan"), pow2(s.clamp(max=254) - SCALE_BIAS))


def dequantize(codes: Tensor, scales: Tensor, elem: str, block: int = 32, dtype: torch.dtype = torch.float32) -> Tensor:
    """codes uint8 [..., n], scales uint8 [..., n / block] -> values [..., n] in ``dtype``
    (exact in float32; rounded once to ``dtype`` otherwise)."""
    element(elem)
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block={block!r} must be a positive integer")
    if codes.dim() == 0 or codes.shape[-1] % block or scales.shape != (*codes.shape[:-1], codes.shape[-1] // block):
        raise ValueError(
            f"codes {tuple(codes.shape)} and scales {tuple(scales.shape)} do not match block={block}: "
            f"scales must be codes.shape[:-1] + (n / {block},)"
        )
    values = decode(codes, elem).reshape(*scales.shape, block) * scale_values(scales).unsqueeze(-1)
    return values.reshape(codes.shape).to(dtype)


def fake_quantize(x: Tensor, elem: str, block: int = 32, mode: str = "floor") -> Tensor:
    """``dequantize(quantize(x, elem, block, mode), ...)`` in x.dtype, computed directly (no host syncs)."""
    e = _check(x, elem, block, mode)
    xb = _blocks(x, block)
    exp, bad = _scale_exponent(xb, e, mode)
    scale = pow2(exp)
    y = torch.where(bad, 0.0, xb) * pow2(-exp)
    out = torch.copysign(_round_magnitude(y, e) * scale, y)
    out = torch.where(bad, float("nan"), out)
    return out.reshape(x.shape).to(x.dtype)


def pack_fp4(codes: Tensor) -> Tensor:
    """E2M1 codes uint8 [..., n] (values 0..15) -> uint8 [..., n / 2]: low nibble = even column, high = odd.

    Checks that every code fits in 4 bits (one host sync: packing is a checkpoint-time operation)."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise ValueError(f"the last dim of shape {tuple(codes.shape)} must be even to pack two codes per byte")
    if codes.numel() and int(codes.max()) > 0xF:
        raise ValueError(f"E2M1 codes must be < 16, found {int(codes.max())}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: Tensor) -> Tensor:
    """uint8 [..., m] -> E2M1 codes uint8 [..., 2m] (inverse of :func:`pack_fp4`)."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed must be uint8, got {packed.dtype}")
    if packed.dim() == 0:
        raise ValueError("packed must have at least one dimension")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


MXFP4_ELEM, MXFP4_GROUP = "e2m1", 32  # MXFP4: E2M1 elements, one E8M0 scale per 32
MXFP4_BYTES_PER_WEIGHT = (4 + 8 / MXFP4_GROUP) / 8  # a 4-bit code + its share of the block's scale byte: 4.25 bits


def unpack_weight(packed: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """An MXFP4 weight as checkpoints store it (weight_packed [..., out, in / 2] uint8, two E2M1 codes a byte;
    weight_scale [..., out, in / 32] E8M0) -> W [..., out, in] in ``dtype``."""
    if scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        scale = scale.view(torch.uint8)
    return dequantize(unpack_fp4(packed), scale, MXFP4_ELEM, MXFP4_GROUP, dtype)
