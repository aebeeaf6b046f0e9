"""The three short-conv decode steps in one Triton launch (k3.ops.conv.triton_step) against the reference's step on a
CUDA GPU (``pytest -m gpu``), at the decode benchmark's KDA shape: 64 tokens, q / k / v of 1024 channels, width 4,
bf16 inputs and state pools of 80 slots. Outputs within 4e-3 relative (both sum in fp32 and round once to bf16,
2^-8; the sums' orders differ), the shifted state rows exactly, the other slots untouched."""

import pytest
import torch

from k3.ops.conv.reference import causal_conv1d_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = "cuda"


@pytest.mark.parametrize("n", [1, 64])
def test_conv_steps_match_the_reference(n):
    from k3.ops.conv.triton_step import conv_steps

    g = torch.Generator(device=DEV).manual_seed(n)
    xs = [torch.randn(n, 1024, device=DEV, generator=g).bfloat16() for _ in range(3)]
    ws = [(torch.randn(1024, 4, device=DEV, generator=g) * 0.5).bfloat16() for _ in range(3)]
    pools = [torch.randn(80, 1024, 3, device=DEV, generator=g).bfloat16() for _ in range(3)]
    slots = torch.randperm(80, device=DEV, generator=g)[:n]
    mine = [p.clone() for p in pools]
    got = conv_steps(*xs, *ws, *mine, slots, True)
    for x, w, p, m, y in zip(xs, ws, pools, mine, got):
        want = causal_conv1d_step(x, w, state=p, slots=slots)
        assert ((y.float() - want.float()).norm() / want.float().norm()).item() <= 4e-3
        assert torch.equal(m, p)
