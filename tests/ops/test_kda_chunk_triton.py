"""The chunked KDA forward in Triton (k3.ops.kda.triton_chunk) in Triton's CPU interpreter, against the chunked
reference and the fp64 recurrence (fp32 arithmetic: 1e-5 relative; bf16 inputs: 1e-2, the output's rounding), on
random inputs: batches with a ragged last chunk, packed sequences of unequal lengths
with an initial state, K3's gate (g in (-5, 0)) and a slow one, unequal head dims, bf16 inputs. Gates that decay
faster than the kernel's bound are refused with one error, before any launch. Skipped without Triton (CI)."""

import pytest
import torch

from k3.ops.kda import reference

pytest.importorskip("triton")
from k3.ops.kda.triton_chunk import block_spread_ok, chunk_kda_fwd  # noqa: E402

INTERPRETED = """
import torch
from k3.ops.kda import reference
from k3.ops.kda.triton_chunk import chunk_kda_fwd
from tests.helpers import rel




def case(B, T, H, K, V, gate, cu=None, state=False, dtype=torch.float32, seed=0):
    g0 = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g0)  # noqa: E731
    q = reference.l2norm(rnd(B, T, H, K)).to(dtype)
    k = reference.l2norm(rnd(B, T, H, K)).to(dtype)
    v = rnd(B, T, H, V).to(dtype)
    g = (-5 * torch.sigmoid(rnd(B, T, H, K)) if gate == "k3" else -0.05 * torch.rand(B, T, H, K, generator=g0))
    beta = torch.sigmoid(rnd(B, T, H)).to(dtype)
    n = B if cu is None else len(cu) - 1
    s0 = rnd(n, H, K, V) if state else None
    cu = None if cu is None else torch.tensor(cu)
    kw = dict(initial_state=s0, output_final_state=True, cu_seqlens=cu)
    o, s = chunk_kda_fwd(q, k, v, g, beta, **kw)
    o_c, s_c = reference.chunk_kda(q, k, v, g, beta, **kw)
    wide = {**kw, "initial_state": None if s0 is None else s0.double()}
    o_r, s_r = reference.recurrent_kda(*(t.double() for t in (q, k, v, g, beta)), **wide)
    assert o.dtype == v.dtype and o.shape == v.shape and s.dtype == torch.float32 and s.shape == s_c.shape
    tol_c, tol_r = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 1e-2)  # bf16: the output's rounding
    assert rel(o, o_c) < tol_c and rel(s, s_c) < tol_c, (rel(o, o_c), rel(s, s_c))
    assert rel(o, o_r) < tol_r and rel(s, s_r) < tol_r, (rel(o, o_r), rel(s, s_r))


case(2, 100, 2, 32, 32, "k3")  # a full chunk and a ragged one per sequence
case(1, 37 + 130 + 64, 2, 32, 64, "k3", cu=[0, 37, 167, 231], state=True, seed=1)  # 1, 3 and 1 chunks
case(1, 64, 1, 16, 16, "slow", seed=2)
case(2, 70, 2, 32, 32, "k3", dtype=torch.bfloat16, seed=3)
print("ok")
"""


def test_forward_in_triton_interpreter(triton_interpreter):
    triton_interpreter(INTERPRETED)


def test_gate_bound():
    """K3's gate always fits the kernel's bound; a gate decaying 6 a position over a block does not, and the op
    refuses it before launching anything."""
    g = -5 * torch.sigmoid(torch.randn(2, 200, 2, 16) * 10)
    assert block_spread_ok(g)
    fast = torch.zeros(1, 40, 1, 16)
    fast[0, 10:25] = -6.0
    assert not block_spread_ok(fast)  # 15 x 6 = 90 > MAX_BLOCK_SPREAD
    fast[0, 10:25] = -5.0
    assert block_spread_ok(fast)
    q = reference.l2norm(torch.randn(1, 40, 1, 16))
    with pytest.raises(ValueError, match="decays some channel"):
        chunk_kda_fwd(q, q, torch.randn(1, 40, 1, 16), torch.full((1, 40, 1, 16), -6.0), torch.rand(1, 40, 1))
