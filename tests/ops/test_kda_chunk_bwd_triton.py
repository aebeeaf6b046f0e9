"""The chunked KDA gradient in Triton (k3.ops.kda.triton_chunk_bwd.chunk_kda) in Triton's CPU interpreter,
against autograd through the fp64 recurrence: every input's gradient (q, k, v, g, beta, the initial state) through
both outputs, by relative error (fp32 kernels: 1e-5; bf16 inputs: 1e-2, the gradients' rounding), on random
inputs: a batch with a ragged last chunk, packed sequences of unequal lengths with an initial state, a slow gate,
unequal head dims, the final state unused. Skipped without Triton (CI)."""

import pytest

pytest.importorskip("triton")

INTERPRETED = """
import torch
from k3.ops.kda import reference
from k3.ops.kda.triton_chunk_bwd import chunk_kda




def case(B, T, H, K, V, gate, cu=None, state=False, dtype=torch.float32, final=True, seed=0):
    g0 = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g0)  # noqa: E731
    q = reference.l2norm(rnd(B, T, H, K)).to(dtype)
    k = reference.l2norm(rnd(B, T, H, K)).to(dtype)
    v = rnd(B, T, H, V).to(dtype)
    g = -5 * torch.sigmoid(rnd(B, T, H, K)) if gate == "k3" else -0.05 * torch.rand(B, T, H, K, generator=g0)
    beta = torch.sigmoid(rnd(B, T, H)).to(dtype)
    n = B if cu is None else len(cu) - 1
    s0 = rnd(n, H, K, V) if state else None
    cu = None if cu is None else torch.tensor(cu)
    do = rnd(B, T, H, V)
    dsn = rnd(n, H, K, V)
    grads = []
    for fn, wide in ((chunk_kda, lambda t: t), (reference.recurrent_kda, lambda t: t.double())):
        ins = [wide(t).detach().requires_grad_() for t in (q, k, v, g, beta)]
        st = None if s0 is None else wide(s0).detach().requires_grad_()
        o, s = fn(*ins, initial_state=st, output_final_state=True, cu_seqlens=cu)
        loss = (o.double() * do.double()).sum() + ((s.double() * dsn.double()).sum() if final else 0)
        loss.backward()
        grads.append([(t.grad, t.dtype) for t in ins + ([] if st is None else [st])])
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for name, (a, a_dtype), (b, _) in zip(("q", "k", "v", "g", "beta", "initial state"), *grads):
        assert a.dtype == a_dtype and a.shape == b.shape, name
        assert rel(a, b) < tol, (name, rel(a, b))


case(2, 100, 2, 32, 32, "k3")  # a full chunk and a ragged one per sequence
case(1, 37 + 130 + 64, 2, 32, 64, "k3", cu=[0, 37, 167, 231], state=True, seed=1)  # 1, 3 and 1 chunks
case(1, 64, 1, 16, 16, "slow", final=False, seed=2)
case(2, 70, 2, 32, 16, "k3", dtype=torch.bfloat16, state=True, seed=3)
print("ok")
"""


def test_gradients_in_triton_interpreter(triton_interpreter):
    triton_interpreter(INTERPRETED)


RAW = """
import torch
from k3.ops.kda import reference
from k3.ops.kda.triton_chunk_bwd import chunk_kda_raw
from tests.helpers import rel

g0 = torch.Generator().manual_seed(4)
B, T, H, K = 1, 150, 2, 32
rnd = lambda *s: torch.randn(*s, generator=g0)  # noqa: E731
raw = [rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H), rnd(H), rnd(H * K)]
do = rnd(B, T, H, K)
grads = []
for fn, wide in ((chunk_kda_raw, lambda t: t), (reference.chunk_kda_raw, lambda t: t.double())):
    q, k, v, f, b, a_log, dt_bias = ins = [wide(t).detach().requires_grad_() for t in raw]
    o, _ = fn(q, k, v, f, b, A_log=a_log, dt_bias=dt_bias, lower_bound=-5.0, cu_seqlens=torch.tensor([0, 70, T]))
    (o.double() * do.double()).sum().backward()
    grads.append([t.grad for t in ins])
for name, a, b in zip(("q", "k", "v", "f", "b", "A_log", "dt_bias"), *grads):
    err = float((a.double() - b).norm() / b.norm())
    assert err < (1e-4 if name in ("A_log", "dt_bias") else 1e-5), (name, err)  # the two: fp32 sums over positions
try:
    chunk_kda_raw(*raw[:5], A_log=raw[5], dt_bias=raw[6], lower_bound=None)
    raise SystemExit("an unbounded gate was taken")
except ValueError as e:
    assert "gate lower bound" in str(e)
print("ok")
"""


def test_from_raw_projections_in_triton_interpreter(triton_interpreter):
    """chunk_kda_raw by our kernels: the gradients of all seven tensors (A_log and dt_bias included) match autograd
    through the fp64 reference; a gate without K3's lower bound is refused."""
    triton_interpreter(RAW)


def test_gate_bound_matches_the_kernel():
    from k3.ops.kda import CHUNK_GATE_BOUND
    from k3.ops.kda.triton_chunk import BLOCK, MAX_BLOCK_SPREAD

    assert CHUNK_GATE_BOUND == -MAX_BLOCK_SPREAD / (BLOCK - 1)
