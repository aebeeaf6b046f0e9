"""Packed MXFP4 experts on a CUDA GPU (run with ``pytest -m gpu``): the kernels (k3.ops.moe.triton_mxfp4 and, at
decode, k3.ops.moe.cuda_mxfp4) against the reference (k3.ops.moe.mxfp4.moe_experts_reference, bf16) on random codes
and scales, the E8M0 extremes and the NaN code included; the decode kernel's matmul against the dequantised bf16
matmul element by element; then the op's dispatch."""

import pytest
import torch

from k3.model.activation import make_glu
from k3.ops import backend
from k3.ops.moe import cuda_mxfp4, grouped, mxfp4
from k3.ops.mx import unpack_weight
from k3.quant.packed import PackedExperts
from tests.ops.kernel_switch import keep_kernel_plan

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = "cuda"


def bank(e: int, d: int, i: int, seed: int, extremes: bool, big: bool = True) -> PackedExperts:
    """Random codes; scales 2^-7..2^-3; with ``extremes`` some rows at scale 0 (2^-127), one block of expert 2's w3
    at the NaN code and, with ``big``, one block a row of expert 1's w1 at 254 (codes 0 but one 0.5: 2^126
    weights, which SiTU-GLU saturates)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    b = PackedExperts(e, d, i).to(DEV, torch.bfloat16)
    for name, t in b.named_buffers():
        if name.endswith("_packed"):
            t.copy_(torch.randint(0, 256, t.shape, device=DEV, generator=g, dtype=torch.uint8))
        elif name.endswith("_scale"):
            t.copy_(torch.randint(120, 125, t.shape, device=DEV, generator=g, dtype=torch.uint8))
    if extremes:
        b.w1_scale[0, :8] = 0
        b.w2_scale[0, :8] = 0
        b.w3_scale[2, 3, 1] = 255
    if extremes and big:
        b.w1_scale[1, :, 0] = 254
        b.w1_packed[1, :, :16] = 0
        b.w1_packed[1, :, 0] = 1
    return b


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Same non-finite positions; finite rows equal within bf16 rounding (relative to each row's norm)."""
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    ok = want.isfinite().all(-1)
    if not ok.any():  # e.g. one token routed to the NaN block
        return
    err = (got[ok].float() - want[ok].float()).norm(dim=-1) / want[ok].float().norm(dim=-1).clamp(min=1e-30)
    assert err.max() < 1e-2, err.max()


@pytest.mark.parametrize(
    "n,k,e,d,i",
    [(1, 16, 896, 512, 384), (8, 16, 896, 512, 384), (64, 8, 64, 256, 128), (5, 2, 4, 96, 160), (600, 8, 16, 256, 128)],
)
@pytest.mark.parametrize("extremes", [False, True])
@pytest.mark.parametrize("act", ["situ", "silu"])
@pytest.mark.parametrize("rows_kernel", ["cuda", "triton"])
def test_kernel_matches_reference(n, k, e, d, i, extremes, act, rows_kernel, monkeypatch):
    from k3.ops.moe.triton_mxfp4 import moe_mxfp4

    keep_kernel_plan(monkeypatch)
    if rows_kernel == "cuda" and cuda_mxfp4.why_not(torch.device(DEV)):
        pytest.skip(cuda_mxfp4.why_not(torch.device(DEV)))
    backend.set_kernels({"moe_mxfp4_rows": rows_kernel})

    b = bank(e, d, i, n * e, extremes, big=act == "situ")  # SwiGLU would pass 2^126 on and overflow
    g = torch.Generator(device=DEV).manual_seed(n)
    x = torch.randn(n, d, device=DEV, generator=g, dtype=torch.bfloat16)
    idx = torch.rand(n, e, device=DEV, generator=g).topk(k).indices
    if extremes:
        idx[0, 0], idx[-1, -1] = 1, 2  # route to the 2^127 expert and to the NaN one
        idx[0] = torch.where(idx[0] == 2, 3, idx[0]) if n > 1 else idx[0]
    weight = torch.rand(n, k, device=DEV, generator=g)
    glu = make_glu(act)
    with torch.no_grad():
        want = mxfp4.moe_experts_reference(x, idx, weight, b, glu)
        got = moe_mxfp4(x, idx, weight, mxfp4._bank(b), glu)
    assert got.dtype == x.dtype and got.shape == (n, d)
    close(got, want)
    if extremes:
        nan_tokens = (idx == 2).any(-1)
        assert got[nan_tokens].isnan().all() and got[~nan_tokens].isfinite().all()


def test_dispatch_runs_the_kernel_for_no_grad_decode(monkeypatch):
    keep_kernel_plan(monkeypatch)
    backend.set_kernels(None)
    b = bank(64, 256, 128, 0, True)
    x = torch.randn(4, 256, device=DEV, dtype=torch.bfloat16)
    idx = torch.rand(4, 64, device=DEV).topk(8).indices
    weight = torch.rand(4, 8, device=DEV)
    with torch.no_grad():
        assert mxfp4.mxfp4_kernel(x, idx, needs_grad=False) == "triton"
        got = mxfp4.moe_experts_packed(x, idx, weight, b, make_glu("situ"))
        backend.set_kernels("moe_mxfp4=torch")  # the selected experts dequantised to bf16, then moe_experts
        torch_form = mxfp4.moe_experts_packed(x, idx, weight, b, make_glu("situ"))
        want = mxfp4.moe_experts_reference(x, idx, weight, b, make_glu("situ"))
    close(got, want)
    close(torch_form, want)


def dequantised_groups_mm(x, src_pair, pairs_per_token, packed, scale, offs):
    """The contract of k3::mxfp4_groups_mm on the dequantised bf16 weights: fp32 products of bf16 operands, the
    output rounded once to bf16."""
    rows = src_pair.shape[0] if src_pair is not None else x.shape[0]
    y = torch.zeros(rows, packed.shape[1], device=DEV)
    start = 0
    for ex, end in enumerate(offs.tolist()):
        if end > start:
            w = unpack_weight(packed[ex], scale[ex], torch.bfloat16).float()
            if src_pair is not None:
                src = src_pair[start:end]
                xr = torch.where((src >= 0)[:, None], x[src.clamp(min=0) // pairs_per_token].float(), 0.0)
            else:
                xr = x[start:end].float()
            y[start:end] = xr @ w.T
        start = end
    return y.to(torch.bfloat16)


@pytest.mark.parametrize(
    "e,n,k,b,top,gather",
    [
        (16, 256, 512, 4, 4, True),
        (16, 256, 512, 40, 4, False),  # experts with more than 8 rows: the weights stream once per 8
        (4, 160, 96, 5, 2, True),  # K not a multiple of a step's 128 columns
        (4, 100, 96, 5, 2, False),  # N not a multiple of 8: the last warp's lanes past N
        (64, 128, 256, 64, 8, True),
        (896, 3072, 3584, 64, 16, True),  # K3's w1 / w3 at B=64
        (896, 3584, 3072, 8, 16, False),  # K3's w2 at B=8
    ],
)
def test_decode_kernel_equals_the_dequantised_matmul(e, n, k, b, top, gather):
    """Element by element within one bf16 rounding of the output (plus fp32 reordering): random codes, scales
    2^-9..2^-2 with rows at E8M0 0 (2^-127), a block at 254 and one at 200 (beyond bf16 for some codes: inf, as
    the dequantised weights), a row at 129 (the kernel's second multiply) and a NaN block."""
    why = cuda_mxfp4.why_not(torch.device(DEV))
    if why:
        pytest.skip(why)
    g = torch.Generator(device=DEV).manual_seed(e + n + b)
    packed = torch.randint(0, 256, (e, n, k // 2), device=DEV, generator=g, dtype=torch.uint8)
    scale = torch.randint(118, 126, (e, n, k // 32), device=DEV, generator=g, dtype=torch.uint8)
    scale[0, :5] = 0
    scale[1, :3, 0] = 254
    scale[1, 3, 1] = 200
    scale[2, 4, 0] = 255
    scale[3, 7] = 129
    idx = torch.rand(b, e, device=DEV, generator=g).topk(top).indices
    idx[0, 0], idx[-1, -1] = 1, 2  # the experts with extreme scales
    route = grouped._route(idx, e, 1)
    rows = route.src_pair.shape[0]
    x = torch.randn(b if gather else rows, k, device=DEV, generator=g, dtype=torch.bfloat16)
    src, per = (route.src_pair, top) if gather else (None, 1)
    got = cuda_mxfp4.mxfp4_rows_mm(x, src, per, packed, scale, route.offs, b * top)
    want = dequantised_groups_mm(x, src, per, packed, scale, route.offs)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape == (rows, n)
    got, want = got[: route.offs[-1]], want[: route.offs[-1]]  # the buffer's rows past the last group are unused
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    assert want.isnan().any()
    fin = want.isfinite()
    rms = want.float().where(fin, 0.0).pow(2).mean(-1, keepdim=True).sqrt().expand_as(want)
    err = (got.float() - want.float()).abs()[fin]
    assert (err <= 2**-7 * want.float().abs()[fin] + 1e-3 * rms[fin]).all(), err.max()


def test_groups_mm_runs_the_decode_kernel_at_few_rows_an_expert(monkeypatch):
    """k3::mxfp4_groups_mm: the CUDA kernel up to ROWS_PER_EXPERT rows an expert on average where the plan chose
    it, Triton's beyond or where ``K3_KERNELS=moe_mxfp4_rows=triton``."""
    from k3.ops.moe import triton_mxfp4

    why = cuda_mxfp4.why_not(torch.device(DEV))
    if why:
        pytest.skip(why)
    keep_kernel_plan(monkeypatch)
    backend.set_kernels(None)
    calls = []
    real = cuda_mxfp4.mxfp4_rows_mm
    monkeypatch.setattr(cuda_mxfp4, "mxfp4_rows_mm", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    packed = torch.randint(0, 256, (8, 64, 32), device=DEV, dtype=torch.uint8)
    scale = torch.full((8, 64, 2), 120, device=DEV, dtype=torch.uint8)
    most = 8 * cuda_mxfp4.ROWS_PER_EXPERT
    for rows in (most, most + 1):
        offs = torch.arange(1, 9, device=DEV, dtype=torch.int32) * rows // 8
        x = torch.randn(rows, 64, device=DEV, dtype=torch.bfloat16)
        got = triton_mxfp4.mxfp4_groups_mm(x, None, 1, packed, scale, offs)
        close(got, dequantised_groups_mm(x, None, 1, packed, scale, offs))
    assert calls == [most]
    backend.set_kernels("moe_mxfp4_rows=triton")
    triton_mxfp4.mxfp4_groups_mm(x[:4], None, 1, packed, scale, offs.clamp(max=4))
    assert calls == [most]
