"""MX quantisers: bit-for-bit against a plain per-element scalar implementation of the OCP rules, and
against torchao's ``to_mx`` where it implements the same element type and scale mode."""

import functools
import math
import struct

import pytest
import torch

from k3.ops.mx import ELEMENTS, dequantize, fake_quantize, pack_fp4, quantize, unpack_fp4

# name: (exponent bits, mantissa bits, bias, max normal, emax) -- OCP MX v1.0 element types
SPEC = {"e2m1": (2, 1, 1, 6.0, 2), "e4m3": (4, 3, 7, 448.0, 8), "e5m2": (5, 2, 15, 57344.0, 15)}
NAN_CODE = {"e2m1": 0x0, "e4m3": 0x7F, "e5m2": 0x7F}  # our documented choice for NaN-scale blocks
INF, NAN = float("inf"), float("nan")


# ----------------------------------------------------------------------------------------- scalar reference
def f32(v: float) -> float:
    """Round a Python float to float32 (round-to-nearest-even)."""
    return struct.unpack("f", struct.pack("f", v))[0]


def element_value(code: int, elem: str) -> float:
    """The value of a non-negative element code, from the bit layout (no sign, no specials)."""
    ebits, mbits, bias, _, _ = SPEC[elem]
    exp, mant = code >> mbits, code & ((1 << mbits) - 1)
    if exp == 0:
        return mant * 2.0 ** (1 - bias - mbits)  # subnormal
    return (1 + mant / 2**mbits) * 2.0 ** (exp - bias)


@functools.lru_cache(maxsize=None)
def grid(elem: str) -> list[tuple[float, int]]:
    """Every finite non-negative (value, code) of the element type up to its max normal."""
    ebits, mbits, _, vmax, _ = SPEC[elem]
    return [(element_value(c, elem), c) for c in range(1 << (ebits + mbits)) if element_value(c, elem) <= vmax]


def scalar_element(v: float, elem: str) -> int:
    """v -> code: nearest grid value, ties to the even code, saturating at max; sign bit kept (also for 0)."""
    ebits, mbits, _, vmax, _ = SPEC[elem]
    a = abs(v)
    if a >= vmax:
        code = max(grid(elem))[1]
    else:
        code = min(grid(elem), key=lambda vc: (abs(a - vc[0]), vc[1] & 1))[1]
    return code | ((1 << (ebits + mbits)) if math.copysign(1.0, v) < 0 else 0)


def scalar_scale_exponent(amax: float, elem: str, mode: str) -> int:
    """Unbiased E8M0 exponent. floor(log2) / ceil(log2) are taken exactly with math.frexp."""
    _, _, _, vmax, emax = SPEC[elem]
    if mode == "floor":
        e = -127 if amax == 0 else math.frexp(amax)[1] - 1 - emax  # floor(log2 amax) - emax
    else:
        d = f32(amax / vmax)  # the float32 descale, as hardware / torchao compute it
        if d == 0:
            e = -127
        else:
            m, ex = math.frexp(d)
            e = ex - 1 if m == 0.5 else ex  # ceil(log2 d)
    return max(-127, min(127, e))


def scalar_quantize(row: list[float], elem: str, mode: str, block: int = 32) -> tuple[list[int], list[int]]:
    codes, scales = [], []
    for b in range(0, len(row), block):
        vals = row[b : b + block]
        if any(math.isnan(v) or math.isinf(v) for v in vals):
            scales.append(0xFF)
            codes += [NAN_CODE[elem]] * block
            continue
        e = scalar_scale_exponent(max(abs(v) for v in vals), elem, mode)
        scales.append(e + 127)
        codes += [scalar_element(v / 2.0**e, elem) for v in vals]
    return codes, scales


def scalar_dequantize(code: int, scale: int, elem: str) -> float:
    ebits, mbits, bias, _, _ = SPEC[elem]
    if scale == 0xFF:
        return NAN
    sign = -1.0 if code >> (ebits + mbits) & 1 else 1.0
    mag = code & ((1 << (ebits + mbits)) - 1)
    return sign * element_value(mag, elem) * 2.0 ** (scale - 127)


# ----------------------------------------------------------------------------------------- inputs
def edge_rows(elem: str) -> torch.Tensor:
    """Rows of 64 (two blocks each) hitting every documented edge case."""
    _, _, _, vmax, _ = SPEC[elem]
    g = sorted(v for v, _ in grid(elem))
    mids = [(a + b) / 2 for a, b in zip(g, g[1:])]  # exact ties between neighbours
    mids = [mids[i * len(mids) // 31] for i in range(31)] + [vmax]
    gen = torch.Generator().manual_seed(1)
    r = torch.randn(32, generator=gen).tolist()
    above = math.nextafter(vmax, INF)
    blocks = [
        [0.0] * 32,  # zero block
        [-0.0, 0.0] * 16,  # signed zeros
        [1e-40, -(2.0**-149), 1e-38, -3e-39] * 8,  # float32 subnormals only
        [1.0, 2.0**-10, -3 * 2.0**-11, 2.0**-17, 2.0**-18, 5e-6, -1e-7, 0.3] * 4,  # element subnormals
        mids,  # round-half-to-even ties
        [-m * 2.0**-5 for m in mids],  # the same, negative and scaled
        [vmax, -vmax, vmax * 2.0**10, 1.0] * 8,  # element max (and a scaled max)
        [above, 7.9, -7.5, 1.0] * 8,  # above max: FLOOR saturates
        [1e6, -1e-6, 3.0, 1e-30] * 8,  # mixed magnitudes
        [3.4e38, -3e38, 1e38, 1.0] * 8,  # near float32 max
        [2.0**-120 * v for v in r],  # scale exponent near -127
        [2.0**-140 * v for v in r],  # below the smallest scale
        r[:5] + [INF] + r[6:],  # +inf
        r[:7] + [-INF] + r[8:],  # -inf
        r[:3] + [NAN] + r[4:],  # NaN
        [vmax * 2.0**k for k in range(-16, 16)],  # exact powers of the max
    ]
    if len(blocks) % 2:
        blocks.append(r)
    return torch.tensor(blocks, dtype=torch.float32).reshape(-1, 64)


def random_rows(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 128, generator=gen)
    mags = torch.tensor([1e-30, 1e-6, 1e-2, 1.0, 3.0, 1e3, 1e8, 1e30]).unsqueeze(1)
    heavy = torch.randn(8, 128, generator=gen).pow(3)  # heavy tails: mixed magnitudes in a block
    return torch.cat([x * mags, heavy * mags])


def all_inputs(elem: str) -> torch.Tensor:
    return torch.cat([random_rows().reshape(-1, 64), edge_rows(elem)])


# ----------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("mode", ["floor", "rceil"])
@pytest.mark.parametrize("elem", list(SPEC))
def test_matches_scalar_reference_bit_for_bit(elem, mode):
    x = all_inputs(elem)
    codes, scales = quantize(x, elem, 32, mode)
    assert codes.dtype == scales.dtype == torch.uint8
    assert codes.shape == x.shape and scales.shape == (x.shape[0], 2)
    for i, row in enumerate(x.tolist()):
        want_codes, want_scales = scalar_quantize(row, elem, mode)
        assert scales[i].tolist() == want_scales, (i, row)
        assert codes[i].tolist() == want_codes, (i, row)
    deq = dequantize(codes, scales, elem)
    want = torch.tensor(
        [
            [scalar_dequantize(c, s, elem) for c, s in zip(crow, [sr for sr in srow for _ in range(32)])]
            for crow, srow in zip(codes.tolist(), scales.tolist())
        ]
    )
    torch.testing.assert_close(deq, want, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(torch.signbit(deq), torch.signbit(want))  # signed zeros too


@pytest.mark.parametrize("mode", ["floor", "rceil"])
@pytest.mark.parametrize("elem", list(SPEC))
def test_fake_quantize_is_dequantize_of_quantize(elem, mode):
    x = all_inputs(elem)
    fq = fake_quantize(x, elem, 32, mode)
    dq = dequantize(*quantize(x, elem, 32, mode), elem)
    torch.testing.assert_close(fq, dq, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(torch.signbit(fq[~fq.isnan()]), torch.signbit(dq[~dq.isnan()]))
    nan_block = x.reshape(-1, 32).isnan().any(-1) | x.reshape(-1, 32).isinf().any(-1)
    assert fq.reshape(-1, 32)[nan_block].isnan().all() and not fq.reshape(-1, 32)[~nan_block].isnan().any()
    if mode == "floor":  # idempotent under the OCP rule: values already on the MX grid stay put
        keep = ~fq.isnan()
        assert torch.equal(fake_quantize(fq, elem, 32, mode)[keep], fq[keep])


@pytest.mark.parametrize("elem", list(SPEC))
def test_rceil_rounds_up_just_above_a_power_of_two(elem):
    """amax one float32 ulp above max * 2^k: fl32(amax / max) > 2^k, so X = 2^(k+1) (what cuBLAS' cvt.rp gives).
    torchao 0.18's eager RCEIL takes ceil(log2(.)) in float32, which rounds to 2^k for large |k|."""
    vmax = SPEC[elem][3]
    ks = list(range(-110, 111, 10))
    x = torch.zeros(len(ks), 32)
    x[:, 0] = torch.nextafter(torch.tensor([vmax * 2.0**k for k in ks]), torch.tensor(INF))
    x[:, 1] = -x[:, 0] / 3
    codes, scales = quantize(x, elem, 32, "rceil")
    assert scales[:, 0].tolist() == [k + 1 + 127 for k in ks]
    for i, row in enumerate(x.tolist()):
        assert (codes[i].tolist(), scales[i].tolist()) == scalar_quantize(row, elem, "rceil")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(dtype):
    x = (torch.randn(4, 64) * 3).to(dtype)
    for elem in SPEC:
        fq = fake_quantize(x, elem)
        assert fq.dtype == dtype
        assert torch.equal(fq, fake_quantize(x.float(), elem).to(dtype))
        assert all(torch.equal(a, b) for a, b in zip(quantize(x, elem), quantize(x.float(), elem)))


def test_known_values_e2m1():
    x = torch.tensor([[0.25, 0.75, 2.5, 3.5, 5.0, 7.0, -0.0, -1e-9] + [0.0] * 24])
    codes, scales = quantize(x, "e2m1", mode="floor")
    assert scales.tolist() == [[127]]  # floor(log2 7) - 2 = 0
    assert codes[0, :8].tolist() == [0, 2, 4, 6, 6, 7, 8, 8]  # 0, 1, 2, 4, 4, 6 (saturated), -0, -0
    codes, scales = quantize(x, "e2m1", mode="rceil")
    assert scales.tolist() == [[128]]  # ceil(log2(7 / 6)) = 1
    assert dequantize(codes, scales, "e2m1")[0, :6].tolist() == [0.0, 1.0, 2.0, 4.0, 4.0, 8.0]


def test_pack_unpack_round_trip_and_nibble_order():
    codes = torch.randint(0, 16, (3, 5, 64), dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.shape == (3, 5, 32) and torch.equal(unpack_fp4(packed), codes)
    assert pack_fp4(torch.tensor([1, 2, 15, 0], dtype=torch.uint8)).tolist() == [0x21, 0x0F]
    allbytes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(pack_fp4(unpack_fp4(allbytes)), allbytes)


def test_errors():
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="elem="):
        quantize(x, "e3m2")
    with pytest.raises(ValueError, match="mode="):
        quantize(x, "e2m1", mode="ceil")
    with pytest.raises(ValueError, match="multiple of block=32"):
        fake_quantize(torch.randn(2, 48), "e4m3")
    with pytest.raises(ValueError, match="block="):
        quantize(x, "e4m3", block=0)
    with pytest.raises(ValueError, match="floating-point"):
        quantize(torch.ones(2, 32, dtype=torch.int32), "e4m3")
    with pytest.raises(ValueError, match="do not match"):
        dequantize(torch.zeros(2, 64, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8), "e2m1")
    with pytest.raises(ValueError, match="must be < 16"):
        pack_fp4(torch.tensor([16, 0], dtype=torch.uint8))
    with pytest.raises(ValueError, match="even"):
        pack_fp4(torch.zeros(3, dtype=torch.uint8))


# ----------------------------------------------------------------------------------------- torchao
def _torchao():
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    cfg = pytest.importorskip("torchao.prototype.mx_formats.config")
    return mx, cfg.ScaleCalculationMode


TORCH_ELEM = {"e2m1": "float4_e2m1fn_x2", "e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["floor", "rceil"])
@pytest.mark.parametrize("elem", list(SPEC))
def test_matches_torchao(elem, mode, dtype):
    """Same scales everywhere except blocks holding inf (we: NaN scale; torchao: a finite one); same codes in
    blocks with a finite, non-minimal scale (torchao divides by 2^-126 or 1 where the scale code is 0 and
    writes arbitrary codes in NaN blocks). Dequantised values agree there too."""
    mx, Mode = _torchao()
    elem_dtype = getattr(torch, TORCH_ELEM[elem])
    x = all_inputs(elem).to(dtype).contiguous()
    ao_mode = Mode.FLOOR if mode == "floor" else Mode.RCEIL
    ao_scales, ao_data = mx.to_mx(x, elem_dtype, 32, ao_mode)
    ao_scales = ao_scales.view(torch.uint8)
    codes, scales = quantize(x, elem, 32, mode)
    has_inf = x.reshape(*scales.shape, 32).isinf().any(-1)
    assert torch.equal(scales[~has_inf], ao_scales[~has_inf])
    ok = ~has_inf & (scales != 0) & (scales != 0xFF)
    assert ok.float().mean() > 0.8  # most blocks are compared element by element
    if elem == "e2m1":
        ours, theirs = pack_fp4(codes).reshape(*scales.shape, 16), ao_data.view(torch.uint8).reshape(*scales.shape, 16)
    else:
        ours, theirs = codes.reshape(*scales.shape, 32), ao_data.view(torch.uint8).reshape(*scales.shape, 32)
    assert torch.equal(ours[ok], theirs[ok])
    ao_deq = mx.MXTensor.to_mx(x, elem_dtype, 32, scaling_mode=ao_mode).dequantize(torch.float32)
    ours_deq = fake_quantize(x, elem, 32, mode).float()
    blocks = ok.unsqueeze(-1).expand(*scales.shape, 32).reshape(x.shape)
    assert torch.equal(ours_deq[blocks], ao_deq[blocks])


def test_elements_table_matches_spec():
    for name, (ebits, mbits, bias, vmax, emax) in SPEC.items():
        e = ELEMENTS[name]
        assert (e.ebits, e.mbits, e.bias, e.max, e.emax) == (ebits, mbits, bias, vmax, emax)
        assert max(v for v, _ in grid(name)) == vmax and math.floor(math.log2(vmax)) == emax
    assert sorted({v for v, _ in grid("e2m1")}) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
