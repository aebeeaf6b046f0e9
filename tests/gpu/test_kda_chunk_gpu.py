"""Our chunked KDA (k3.ops.kda.triton_chunk_bwd.chunk_kda) on a GPU, compiled for it: the output, the final state
and every input's gradient against the fp64 chunked reference (equal to the fp64 recurrence:
tests/ops/test_kda_chunk_triton.py) with autograd, on packed sequences of unequal lengths with an initial state,
K = V = 128. Tolerances: fp32 inputs with tf32x3 matmuls (about fp32's accuracy) 1e-4; bf16 inputs 1e-2 (the
results' rounding)."""

import pytest
import torch

from k3.ops.kda import reference
from tests.helpers import rel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_kda_gradients_on_cuda(dtype):
    from k3.ops.kda.triton_chunk_bwd import chunk_kda

    gen = torch.Generator(device="cuda").manual_seed(0)
    T, H, D = 1000 + 1300 + 64, 4, 128
    cu = torch.tensor([0, 1000, 2300, T], device="cuda")

    def rnd(*s):
        return torch.randn(*s, device="cuda", generator=gen)

    q, k = (reference.l2norm(rnd(1, T, H, D)).to(dtype) for _ in range(2))
    v, g, beta = rnd(1, T, H, D).to(dtype), -5 * torch.sigmoid(rnd(1, T, H, D)), torch.sigmoid(rnd(1, T, H))
    s0, do, dsn = rnd(3, H, D, D), rnd(1, T, H, D), rnd(3, H, D, D)
    results = []
    for fn, wide in ((chunk_kda, lambda t: t), (reference.chunk_kda, lambda t: t.double())):
        ins = [wide(t).detach().requires_grad_() for t in (q, k, v, g, beta, s0)]
        o, s = fn(*ins[:5], initial_state=ins[5], output_final_state=True, cu_seqlens=cu)
        ((o.double() * do).sum() + (s.double() * dsn).sum()).backward()
        results.append([o, s] + [t.grad for t in ins])
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    for name, a, b in zip(("o", "final state", "q", "k", "v", "g", "beta", "initial state"), *results):
        assert rel(a, b) < tol, (name, rel(a, b))
