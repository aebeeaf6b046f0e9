"""A KDA layer's decode core in one Triton launch (k3.ops.kda.triton_decode) on a CUDA GPU (``pytest -m gpu``),
against the same equations composed of the reference ops in float64, at the decode benchmark's shape (64 tokens,
16 heads of 64, low-rank gates of rank 64, Kimi Linear's softplus gate) and a K3-like one (heads of 128, the
bounded gate, the full-rank output gate). bf16 inputs (exact in float64); the output within 8e-3 relative (its bf16
rounding, 2^-8, summed over a row), the fp32 state within 1e-5 (fp32 sums in other orders; the GPU's fast exp)."""

import pytest
import torch

from tests.ops.kda_core_reference import core_float64

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = "cuda"


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize(
    "H,K,V,RF,RG,bound,warps",
    [
        (16, 64, 64, 64, 64, None, None),
        (16, 64, 64, 64, 64, None, 4),
        (8, 128, 128, 128, 0, -5.0, None),
        (96, 128, 128, 128, 128, -5.0, None),
    ],
    ids=["kimi-linear", "kimi-linear-four-warps", "k3-like", "k3-heads"],
)
def test_kda_decode_core_matches_the_float64_composition(H, K, V, RF, RG, bound, warps, monkeypatch):
    """``warps``: the launch rule's choice (for the kimi-linear shape's 1024 programs one warp on GPUs of at most
    256 SMs, an H200's 132 among them; heads of 128 go in 32-column chunks with four), or four warps forced (the
    rule's choice at fewer programs)."""
    from k3.ops.kda import triton_decode
    from k3.ops.kda.triton_decode import kda_decode_core

    if warps is not None:
        monkeypatch.setattr(triton_decode, "_warps", lambda *a: warps)

    g = torch.Generator(device=DEV).manual_seed(H)
    N, S = 64, 80

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=DEV, generator=g) * scale).bfloat16()

    q, k, v, b = rand(N, H * K), rand(N, H * K), rand(N, H * V), rand(N, H)
    f_a, w_fb = rand(N, RF), rand(H * K, RF, scale=RF**-0.5)
    gate_in = rand(N, RG or H * V)
    w_gb = rand(H * V, RG, scale=RG**-0.5) if RG else None
    A_log = torch.rand(H, device=DEV, generator=g).log1p()
    dt_bias = torch.randn(H * K, device=DEV, generator=g) * 0.5
    norm_w = torch.rand(V, device=DEV, generator=g) + 0.5
    pool = torch.randn(S, H, K, V, device=DEV, generator=g) * 0.3
    slots = torch.randperm(S, device=DEV, generator=g)[:N]
    mine = pool.clone()
    y = kda_decode_core(
        q, k, v, f_a, w_fb, b, gate_in, w_gb, A_log, dt_bias, norm_w, mine, slots, bound, 1e-6, 1e-5, torch.bfloat16
    )
    want, want_pool = core_float64(q, k, v, f_a, w_fb, b, gate_in, w_gb, A_log, dt_bias, norm_w, pool, slots, bound)
    assert y.dtype == torch.bfloat16 and _rel(y, want) <= 8e-3
    assert _rel(mine[slots], want_pool[slots]) <= 1e-5
    rest = torch.ones(S, dtype=torch.bool, device=DEV)
    rest[slots] = False
    assert torch.equal(mine[rest], pool[rest])
