"""The decode step's other two Triton launches as custom ops (k3::kda_decode_launch, which updates the state pool in
place, and k3::mla_decode: the split-K kernel and the merge of its splits), in Triton's interpreter on a machine
with Triton but no GPU (in a subprocess: TRITON_INTERPRET is read when a kernel is defined): each against its
float32 reference, then torch.library.opcheck (schema and declared mutation, fake function, AOT dispatch). fp16
and fp32: the interpreter mishandles bf16 dot products; bf16 on the GPU: tests/gpu/test_fast_paths.py. The
small-groups expert matmul has its own: tests/ops/test_moe_small_groups.py."""

import textwrap

import pytest

KDA = textwrap.dedent("""
    import torch
    from k3.ops.kda import fla, reference

    torch.manual_seed(0)
    N, H, K, V, S = 3, 2, 32, 64, 5
    q, k, f = (torch.randn(N, H, K) for _ in range(3))
    v, b = torch.randn(N, H, V), torch.randn(N, H)
    A_log, dt_bias = torch.rand(H).log1p(), torch.randn(H * K)
    pool = torch.randn(S, H, K, V) * 0.1
    slots = torch.tensor([4, 0, 2])
    for lower_bound in (-5.0, None):
        got_pool, want_pool = pool.clone(), pool.clone()
        kw = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, slots=slots)
        got = fla.kda_decode_step(q, k, v, f, b, state=got_pool, **kw)
        want = reference.kda_decode_step(q, k, v, f, b, state=want_pool, **kw)
        err = ((got - want).norm() / want.norm()).item()
        assert err <= 1e-5 and torch.allclose(got_pool, want_pool, rtol=1e-5, atol=1e-6), (lower_bound, err)
        assert torch.equal(got_pool[[1, 3]], pool[[1, 3]])  # other slots untouched
    args = (q[:, None].half(), k[:, None].half(), v[:, None].half(), f[:, None], b[:, None], A_log, dt_bias,
            pool.clone(), slots.int(), True, -5.0, None)
    checks = torch.library.opcheck(torch.ops.k3.kda_decode_launch.default, args)
    assert all(r == "SUCCESS" for r in checks.values()), checks
    print("ok")
""")

MLA = textwrap.dedent("""
    import types
    import torch
    from k3.ops.mla import reference, triton_decode

    torch.cuda.get_device_properties = lambda device: types.SimpleNamespace(multi_processor_count=4)
    torch.manual_seed(0)
    B, H, R, DR, S, CAP = 3, 4, 32, 16, 4, 300
    q = torch.randn(B, H, R + DR).half()
    kv = torch.randn(S, CAP, R + DR).half()
    slots, lengths = torch.tensor([3, 0, 1]), torch.tensor([290, 5, 33])
    got = triton_decode.mla_decode(q, kv, slots, lengths, 0.1, R, block_n=16)  # several splits of 256 rows
    want = reference.latent_attention(q.float(), kv.float(), seq_ids=slots, lengths=lengths,
                                      cu_seqlens_q=torch.arange(B + 1), scale=0.1, v_dim=R)
    err = ((got.float() - want).norm() / want.norm()).item()
    assert err <= 2e-3, err  # fp16 output rounding (2^-11) and fp16 probabilities in the value product
    # 40 heads: two groups of 32 (the launch defaults for several groups), or one group of 64, heads masked
    q40 = torch.randn(B, 40, R + DR).half()
    want = reference.latent_attention(q40.float(), kv.float(), seq_ids=slots, lengths=lengths,
                                      cu_seqlens_q=torch.arange(B + 1), scale=0.1, v_dim=R)
    for block_h in (None, 64):
        got = triton_decode.mla_decode(q40, kv, slots, lengths, 0.1, R, block_h=block_h)
        err = ((got.float() - want).norm() / want.norm()).item()
        assert err <= 2e-3, (block_h, err)
    # 37 splits of 8 rows: the merge reads them in two blocks of 32 (the second mostly masked), rescaling the first
    # block's sums to the second's maximum where it is higher; a sequence with no rows gives zeros
    lengths = torch.tensor([290, 0, 33])
    kv[3, 256:290] *= 3  # sequence 0's highest scores in the second block
    args = (q, kv, slots.int(), lengths.int(), 0.1, 37, 8, 1, R, DR, 16, 16, 1, 4)
    got = torch.ops.k3.mla_decode(*args)
    keep = torch.tensor([0, 2])
    want = reference.latent_attention(q[keep].float(), kv.float(), seq_ids=slots[keep], lengths=lengths[keep],
                                      cu_seqlens_q=torch.arange(3), scale=0.1, v_dim=R)
    err = ((got[keep].float() - want).norm() / want.norm()).item()
    assert err <= 2e-3 and torch.equal(got[1], torch.zeros_like(got[1])), err
    # r = 256 over 20 splits: the merge's columns in two blocks of 128
    q2, kv2, lengths2 = torch.randn(2, 2, 256 + DR).half(), torch.randn(2, 40, 256 + DR).half(), torch.tensor([37, 9])
    got = torch.ops.k3.mla_decode(q2, kv2, torch.tensor([1, 0]).int(), lengths2.int(), 0.1, 20, 2, 1, 256, DR, 16,
                                  16, 1, 4)
    want = reference.latent_attention(q2.float(), kv2.float(), seq_ids=torch.tensor([1, 0]), lengths=lengths2,
                                      cu_seqlens_q=torch.arange(3), scale=0.1, v_dim=256)
    err = ((got.float() - want).norm() / want.norm()).item()
    assert err <= 2e-3, err
    checks = torch.library.opcheck(torch.ops.k3.mla_decode.default, args)
    assert all(r == "SUCCESS" for r in checks.values()), checks
    print("ok")
""")


@pytest.mark.parametrize("script", [KDA, MLA], ids=["kda_decode_launch", "mla_decode"])
def test_in_triton_interpreter(script, triton_interpreter):
    if script is KDA:
        pytest.importorskip("fla")
    triton_interpreter(script)
