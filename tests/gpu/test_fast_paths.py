"""GPU fast paths against their references (run with ``pytest -m gpu`` on a CUDA machine).

Tolerances are relative errors ||a - b|| / ||b|| justified by dtype: bf16 keeps 8 bits of mantissa (rounding
~4e-3 per operation), so bf16 paths are held to 2e-2 on outputs and 5e-2 on gradients after long reductions;
fla's fp32 path uses TF32 dots (10-bit mantissa), held to 1e-2.
"""

import pytest
import torch
import torch.nn.functional as F

from k3.config import get_preset
from k3.model.activation import situ_glu
from k3.ops import backend
from k3.ops.kda import reference as kda_ref
from k3.ops.mla import fast as mla_fast
from k3.ops.mla import reference as mla_ref
from k3.ops.moe import reference as moe_ref
from tests.ops.kernel_switch import keep_kernel_plan
from tests.helpers import rel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = "cuda"


def kda_inputs(T=1000, H=8, K=128, strong=False, seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = F.normalize(torch.randn(1, T, H, K, device=DEV, generator=g), dim=-1)
    k = F.normalize(torch.randn(1, T, H, K, device=DEV, generator=g), dim=-1)
    v = torch.randn(1, T, H, K, device=DEV, generator=g)
    f = torch.randn(1, T, H, K, device=DEV, generator=g) * (4 if strong else 1)
    A_log = torch.zeros(H, device=DEV) if strong else torch.rand(H, device=DEV, generator=g).mul(2).log1p()
    dt_bias = torch.randn(H * K, device=DEV, generator=g) * (3 if strong else 1) - (0 if strong else 3)
    gate = kda_ref.kda_gate(f, A_log, dt_bias, lower_bound=-5.0)
    beta = torch.rand(1, T, H, device=DEV, generator=g)
    h0 = torch.randn(3, H, K, K, device=DEV, generator=g) * 0.1
    cu = torch.tensor([0, 300, 301, T], device=DEV)
    return [t.to(dtype) for t in (q, k, v)] + [gate, beta.to(dtype), h0, cu]


@pytest.mark.parametrize("strong", [False, True])
def test_fla_chunk_kda_forward_and_gradients(strong):
    from k3.ops.kda import fla

    q, k, v, g, beta, h0, cu = kda_inputs(strong=strong)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, g, beta, h0)]
    o, s = fla.chunk_kda(*leaves[:5], initial_state=leaves[5], output_final_state=True, cu_seqlens=cu)
    w_o, w_s = torch.randn_like(o, dtype=torch.float32), torch.randn_like(s)
    ((o.float() * w_o).sum() + (s * w_s).sum()).backward()
    fast_grads = [t.grad.clone() for t in leaves]
    ref_leaves = [t.detach().float().clone().requires_grad_() for t in leaves]
    o_r, s_r = kda_ref.chunk_kda(*ref_leaves[:5], initial_state=ref_leaves[5], output_final_state=True, cu_seqlens=cu)
    ((o_r * w_o).sum() + (s_r * w_s).sum()).backward()
    assert rel(o, o_r) <= 2e-2 and rel(s, s_r) <= 2e-2
    for name, a, b in zip("q k v g beta h0".split(), fast_grads, [t.grad for t in ref_leaves]):
        assert rel(a, b) <= 5e-2, (name, rel(a, b))


def test_fla_fused_recurrent_matches_reference():
    from k3.ops.kda import fla

    q, k, v, g, beta, h0, cu = kda_inputs(T=3)
    cu = torch.tensor([0, 1, 2, 3], device=DEV)
    o, s = fla.recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    o_r, s_r = kda_ref.recurrent_kda(
        q.float(), k.float(), v.float(), g, beta.float(), initial_state=h0, output_final_state=True, cu_seqlens=cu
    )
    assert rel(o, o_r) <= 2e-2 and rel(s, s_r) <= 2e-2


@pytest.mark.parametrize("d,i", [(256, 384), (250, 85)])  # aligned; both widths padded to multiples of 8
def test_grouped_mm_moe_matches_the_loop(d, i):
    from k3.ops.moe import grouped

    torch.manual_seed(0)
    n, e, topk = 1000, 32, 4
    x = torch.randn(n, d, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w1, w3 = (torch.randn(e, i, d, device=DEV) * d**-0.5 for _ in range(2))
    w2 = torch.randn(e, d, i, device=DEV) * i**-0.5
    ws = [w.requires_grad_() for w in (w1, w2, w3)]
    idx = torch.stack([torch.randperm(e, device=DEV)[:topk] for _ in range(n)])
    idx[:50] = 3  # a hot expert and (likely) some cold ones: ragged, unaligned groups
    wt = torch.rand(n, topk, device=DEV)
    y = grouped.moe_experts(x, idx, wt, ws[0], ws[1], ws[2], situ_glu)
    gy = torch.randn_like(y, dtype=torch.float32)
    (y.float() * gy).sum().backward()
    grads = [x.grad.clone()] + [w.grad.clone() for w in ws]
    xr = x.detach().float().requires_grad_()
    wr = [w.detach().clone().requires_grad_() for w in ws]
    yr = moe_ref.moe_experts(xr, idx, wt, wr[0], wr[1], wr[2], situ_glu)
    (yr * gy).sum().backward()
    assert rel(y, yr) <= 2e-2
    for name, a, b in zip(("x", "w1", "w2", "w3"), grads, [xr.grad] + [w.grad for w in wr]):
        assert rel(a, b) <= 5e-2, (name, rel(a, b))


def _decode_experts(n: int, seed: int, gain: float = 1.0, i: int = 512):
    """x [n, 1024] bf16, top-8 of 64 experts (every token also on expert 7: a group of n rows, at 64 several passes
    of BLOCK_M rows), weights [n, 8], fp32 expert weights w1 / w3 [64, i, 1024] (scaled by gain) and w2: the
    decode benchmark's expert shapes (its autotuning cache) at i=512."""
    torch.manual_seed(seed)
    e, topk, d = 64, 8, 1024
    x = torch.randn(n, d, device=DEV, dtype=torch.bfloat16)
    w1, w3 = (torch.randn(e, i, d, device=DEV) * gain * d**-0.5 for _ in range(2))
    w2 = torch.randn(e, d, i, device=DEV) * i**-0.5
    idx = torch.rand(n, e, device=DEV).topk(topk).indices
    idx[:, 0] = 7
    return x, idx, torch.rand(n, topk, device=DEV), w1, w2, w3


@pytest.mark.parametrize("n", [5, 64])
def test_small_groups_moe_matches_the_loop_and_grouped_mm(n, monkeypatch):
    """At decode (no grad) the Triton small-groups kernel (the default) against the per-expert loop
    (fp32; bf16 weights and activations: 2e-2) and against torch._grouped_mm (same bf16 inputs: 1e-2, fp32
    accumulation in both). A hot expert holds more rows than one pass of the kernel, most others few or none."""
    from k3.ops.moe import grouped

    x, idx, wt, w1, w2, w3 = _decode_experts(n, seed=n)
    with torch.no_grad():
        keep_kernel_plan(monkeypatch)
        backend.set_kernels(None)
        assert grouped._experts_matmul(idx.numel(), needs_grad=False) == "triton"  # the default on a GPU
        y = grouped.moe_experts(x, idx, wt, w1, w2, w3, situ_glu)
        backend.set_kernels("moe_small_groups=grouped_mm")
        y_mm = grouped.moe_experts(x, idx, wt, w1, w2, w3, situ_glu)
        yr = moe_ref.moe_experts(x.float(), idx, wt, w1, w2, w3, situ_glu)
    assert rel(y, yr) <= 2e-2 and rel(y, y_mm) <= 1e-2, (rel(y, yr), rel(y, y_mm))


@pytest.mark.parametrize("kind,i", [("situ", 512), ("silu", 512), ("situ", 85)])
def test_fused_up_glu_matches_the_unfused_kernels(kind, i, monkeypatch):
    """Kernel moe_up_glu (the rows' gather, w1, w3 and the GLU in one launch) against the same small-groups path
    with them apart, on the same bf16 inputs (1e-2: the products are rounded to bf16 alike, the fp32 tanh and
    sigmoid differ in their last bits before the bf16 GLU output, the kernels' own BLOCK_K may differ), and against
    the per-expert loop (2e-2); at i=85 the expert width is zero-padded to 88 as for grouped_mm."""
    from k3.model.activation import make_glu
    from k3.ops.moe import grouped

    x, idx, wt, w1, w2, w3 = _decode_experts(64, seed=2, gain=3.0, i=i)  # |g|, |u| up to ~10: the tanh bend
    glu = make_glu(kind, 3.0, 20.0)
    keep_kernel_plan(monkeypatch)
    with torch.no_grad():
        backend.set_kernels("moe_small_groups=triton,moe_up_glu=torch")
        apart = grouped.moe_experts(x, idx, wt, w1, w2, w3, glu)
        backend.set_kernels("moe_small_groups=triton,moe_up_glu=triton")
        assert grouped.up_glu_kernel(glu, x.device) == "triton"  # so the comparison is not with itself
        fused = grouped.moe_experts(x, idx, wt, w1, w2, w3, glu)
        loop = moe_ref.moe_experts(x.float(), idx, wt, w1, w2, w3, glu)
    assert rel(fused, apart) <= 1e-2 and rel(fused, loop) <= 2e-2, (rel(fused, apart), rel(fused, loop))


@pytest.mark.parametrize("h", [16, 96])  # one head group; K3's three groups of 32 (their own launch defaults)
def test_triton_mla_decode_matches_reference(h):
    torch.manual_seed(1)
    slots, cap, r, dr = 6, 3000, 512, 64
    kv = torch.randn(slots, cap, r + dr, device=DEV, dtype=torch.bfloat16)
    seq_ids = torch.tensor([4, 0, 2], device=DEV)
    lengths = torch.tensor([2999, 17, 1000], device=DEV)
    q = torch.randn(3, h, r + dr, device=DEV, dtype=torch.bfloat16)
    cu = torch.arange(4, device=DEV)
    scale = (128 + 64) ** -0.5
    got = mla_fast.latent_attention(q, kv, seq_ids=seq_ids, lengths=lengths, cu_seqlens_q=cu, scale=scale, v_dim=r)
    want = mla_ref.latent_attention(
        q.float(), kv.float(), seq_ids=seq_ids, lengths=lengths, cu_seqlens_q=cu, scale=scale, v_dim=r
    )
    assert rel(got, want) <= 2e-2


def test_sdpa_attention_matches_reference():
    torch.manual_seed(2)
    q = torch.randn(300, 8, 192, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(340, 8, 192, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(340, 8, 128, device=DEV, dtype=torch.bfloat16)
    cq = torch.tensor([0, 100, 300], device=DEV)
    ck = torch.tensor([0, 140, 340], device=DEV)  # cached prefixes: queries are the last positions
    got = mla_fast.attention(q, k, v, scale=0.07, cu_seqlens_q=cq, cu_seqlens_k=ck)
    want = mla_ref.attention(q.float(), k.float(), v.float(), scale=0.07, cu_seqlens_q=cq, cu_seqlens_k=ck)
    assert rel(got, want) <= 2e-2


@pytest.mark.parametrize("autocast", [False, True])
def test_flat_short_conv_matches_reference_on_gpu(autocast):
    """The flat conv (the GPU path) vs the packed reference on the GPU, fp32 compute (also under autocast),
    packed documents, gradients."""
    from k3.ops.conv.flat import causal_conv1d as flat
    from k3.ops.conv.reference import causal_conv1d as packed

    torch.manual_seed(6)
    cu = torch.tensor([0, 1, 3, 700, 701, 2048], device=DEV)
    x = torch.randn(1, 2048, 384, device=DEV, requires_grad=True)
    w = torch.randn(384, 4, device=DEV, requires_grad=True)
    gy = torch.randn(1, 2048, 384, device=DEV)
    outs = []
    for fn in (flat, packed):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            y, _ = fn(x, w, cu_seqlens=cu)
        outs.append((y, *torch.autograd.grad((y * gy).sum(), (x, w))))
    for name, a, b in zip(("y", "dx", "dw"), *outs):
        assert rel(a, b) <= 1e-5, (name, rel(a, b))


def test_fla_short_conv_matches_reference():
    """fla's conv kernel (bf16 activations, fp32 weight, as under autocast) vs the reference in fp32: packed
    documents of 1..1345 tokens, the initial state (fla's extra history column) and final state, gradients for
    x, the weight and the initial state. bf16 output rounding: 1e-2."""
    from k3.ops.conv import fla as conv_fla
    from k3.ops.conv.reference import causal_conv1d as packed

    torch.manual_seed(6)
    cu = torch.tensor([0, 1, 3, 700, 701, 2048], device=DEV)
    x = torch.randn(1, 2048, 384, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(384, 4, device=DEV, requires_grad=True)
    h0 = torch.randn(5, 384, 3, device=DEV, requires_grad=True)
    gy, gs = torch.randn(1, 2048, 384, device=DEV), torch.randn(5, 384, 3, device=DEV)
    outs = []
    for fn, xx in ((conv_fla.causal_conv1d, x), (packed, x.float())):
        y, state = fn(xx, w, initial_state=h0, output_final_state=True, cu_seqlens=cu)
        assert state.shape == (5, 384, 3)
        outs.append((y, state, *torch.autograd.grad((y.float() * gy).sum() + (state.float() * gs).sum(), (x, w, h0))))
    for name, a, b in zip(("y", "state", "dx", "dw", "dh0"), *outs):
        assert rel(a, b) <= 1e-2, (name, rel(a, b))


@pytest.mark.parametrize("lower_bound,eps", [(-5.0, 1e-6), (-5.0, 1e-5), (None, 1e-6), (-8.0, 1e-6)])
def test_fla_chunk_kda_raw_forward_and_gradients(lower_bound, eps):
    """fla's fused-input chunk KDA (in-kernel L2 norms, gate, sigmoid; safe_gate with K3's bound; V-first
    state; a bound below -5 without safe_gate) vs the reference from the same raw projections: outputs, final
    states and the gradients of every input, A_log and dt_bias included. bf16: 2e-2 / 5e-2 as above."""
    from k3.ops.kda import fla

    g = torch.Generator(device=DEV).manual_seed(3)
    T, H, K = 1000, 8, 128  # the benchmark's heads: fla's autotuning (minutes per new shape) is shared
    q, k, v, f = (torch.randn(1, T, H, K, device=DEV, generator=g) for _ in range(4))
    b = torch.randn(1, T, H, device=DEV, generator=g)
    A_log = torch.rand(H, device=DEV, generator=g).log1p()
    dt_bias = torch.randn(H * K, device=DEV, generator=g) - (0 if lower_bound else 3)
    h0 = torch.randn(3, H, K, K, device=DEV, generator=g) * 0.1
    cu = torch.tensor([0, 300, 301, T], device=DEV)
    runs = []
    for fn, dtype in ((fla.chunk_kda_raw, torch.bfloat16), (kda_ref.chunk_kda_raw, torch.float32)):
        leaves = [
            t.detach().clone().to(dtype if t.dim() > 2 else torch.float32).requires_grad_() for t in (q, k, v, f, b)
        ] + [t.detach().clone().requires_grad_() for t in (A_log, dt_bias, h0)]
        o, s = fn(
            *leaves[:5],
            A_log=leaves[5],
            dt_bias=leaves[6],
            lower_bound=lower_bound,
            l2norm_eps=eps,
            initial_state=leaves[7],
            output_final_state=True,
            cu_seqlens=cu,
        )
        gen = torch.Generator(device=DEV).manual_seed(9)  # the same output weights for both runs
        w_o, w_s = torch.randn(o.shape, device=DEV, generator=gen), torch.randn(s.shape, device=DEV, generator=gen)
        ((o.float() * w_o).sum() + (s.float() * w_s).sum()).backward()
        runs.append((o, s, *[t.grad for t in leaves]))
    for name, a, r in zip("o state q k v f b A_log dt_bias h0".split(), *runs):
        tol = 2e-2 if name in ("o", "state") else 5e-2
        assert rel(a, r) <= tol, (name, rel(a, r))


@pytest.mark.parametrize("autocast", [False, True])
def test_varlen_flash_prefill_matches_reference(autocast):
    """Packed documents without a cache (training): one flash varlen call, forward and gradients."""
    if mla_fast._varlen_flash() is None:
        pytest.skip("this torch has no torch.nn.attention.varlen.varlen_attn with a scale")
    torch.manual_seed(5)
    cu = torch.tensor([0, 1, 300, 301, 1200, 2048], device=DEV)
    dtype = torch.float32 if autocast else torch.bfloat16
    q, k = (torch.randn(2048, 8, 192, device=DEV, dtype=dtype, requires_grad=True) for _ in range(2))
    v = torch.randn(2048, 8, 128, device=DEV, dtype=dtype, requires_grad=True)
    gy = torch.randn(2048, 8, 128, device=DEV)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        got = mla_fast.attention(q, k, v, scale=0.07, cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert got.dtype == dtype
    grads = torch.autograd.grad((got.float() * gy).sum(), (q, k, v))
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    want = mla_ref.attention(*ref_in, scale=0.07, cu_seqlens_q=cu, cu_seqlens_k=cu)
    want_grads = torch.autograd.grad((want * gy).sum(), ref_in)
    assert rel(got, want) <= 2e-2
    for name, a, b in zip("qkv", grads, want_grads):
        assert rel(a, b) <= 5e-2, (name, rel(a, b))


def test_whole_model_fast_equals_reference_and_decode_is_consistent():
    from k3.model.decoder import K3ForCausalLM
    from k3.ops import backend

    torch.manual_seed(3)
    cfg = get_preset("tiny").replace(
        **{
            "kda.num_heads": 8,
            "kda.head_dim": 128,
            "kda.v_head_dim": 128,
            "kda.chunk_size": 64,
            "mla.num_heads": 16,
            "mla.kv_lora_rank": 64,
            "mla.qk_rope_head_dim": 16,
        }
    )
    model = K3ForCausalLM(cfg).to(DEV).eval()
    ids = torch.randint(0, 512, (2, 200), device=DEV)
    try:
        backend.set_backend("reference")
        with torch.no_grad():
            want = model(ids).logits.float()
        backend.set_backend("fast")
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            got = model(ids).logits.float()
            cache = model.new_cache(2, dtype=torch.bfloat16)
            steps = [model(ids[:, :150], cache=cache).logits.float()]
            for t in range(150, 200):
                steps.append(model(ids[:, t : t + 1], cache=cache).logits.float())
        decoded = torch.cat(steps, 1)
    finally:
        backend.set_backend("auto")
    assert rel(got, want) <= 3e-2
    assert rel(decoded, want) <= 3e-2


def test_grouped_mm_qat_path_matches_reference():
    from k3.ops.moe import grouped
    from k3.ops.mx import fake_quantize

    torch.manual_seed(4)
    n, d, i, e = 256, 128, 256, 16
    x = torch.randn(n, d, device=DEV)
    ws = [torch.randn(shape, device=DEV) * 0.1 for shape in ((e, i, d), (e, d, i), (e, i, d))]
    wq = [fake_quantize(w, "e2m1") for w in ws]
    aq = lambda t: fake_quantize(t, "e4m3")  # noqa: E731
    idx = torch.stack([torch.randperm(e, device=DEV)[:2] for _ in range(n)])
    wt = torch.rand(n, 2, device=DEV)
    glu_q = lambda g, u: aq(situ_glu(g, u))  # noqa: E731  (what k3.ops.moe.moe_experts composes under QAT)
    got = grouped.moe_experts(aq(x), idx, wt, *wq, glu_q)
    want = moe_ref.moe_experts(aq(x), idx, wt, *wq, glu_q)
    assert rel(got, want) <= 2e-2


@pytest.mark.parametrize("lower_bound,eps", [(-5.0, 1e-6), (None, 1e-6), (-5.0, 1e-5)])
def test_fla_decode_step_matches_reference(lower_bound, eps):
    """fla's in-place continuous-batching kernel (gate, beta sigmoid and q/k norm fused) vs the reference step."""
    from k3.ops.kda import fla

    g = torch.Generator(device=DEV).manual_seed(5)
    S, N, H, K = 9, 4, 8, 128
    q, k, v, f = (torch.randn(N, H, K, device=DEV, generator=g).to(torch.bfloat16) for _ in range(4))
    b = torch.randn(N, H, device=DEV, generator=g).to(torch.bfloat16)
    A_log = torch.rand(H, device=DEV, generator=g).log1p()
    dt_bias = torch.randn(H * K, device=DEV, generator=g)
    pool = torch.randn(S, H, K, K, device=DEV, generator=g) * 0.1
    slots = torch.tensor([7, 2, 0, 5], device=DEV)
    ref_pool = pool.clone()
    kw = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, slots=slots, l2norm_eps=eps)
    got = fla.kda_decode_step(q, k, v, f, b, state=pool, **kw)
    want = kda_ref.kda_decode_step(q.float(), k.float(), v.float(), f.float(), b.float(), state=ref_pool, **kw)
    assert rel(got, want) <= 2e-2 and rel(pool, ref_pool) <= 1e-2
    others = torch.tensor([1, 3, 4, 6, 8], device=DEV)
    assert torch.equal(pool[others], ref_pool[others])


def _decode_model(seed: int):
    """A tiny bf16 model whose decode step runs every Triton kernel: the KDA decode core (8 heads x 128; fla's KDA
    step with K3_KERNELS=kda_decode_core=torch), the MLA decode (r=64, dr=16) and the small-groups experts."""
    from k3.model.decoder import K3ForCausalLM

    torch.manual_seed(seed)
    cfg = get_preset("tiny").replace(
        **{
            "kda.num_heads": 8,
            "kda.head_dim": 128,
            "kda.v_head_dim": 128,
            "mla.num_heads": 16,
            "mla.kv_lora_rank": 64,
            "mla.qk_rope_head_dim": 16,
        }
    )
    return K3ForCausalLM(cfg).to(DEV).cast(torch.bfloat16).eval()


@pytest.mark.parametrize("compile", [False, True])
def test_cuda_graph_decode_equals_eager_and_survives_cache_growth(compile):
    """GraphedDecoder replays == eager decode (bf16, fast backend) over 40 steps with changing batches and an MLA
    cache that grows (so graphs are recaptured); both stay close to the full forward. compile=True records a
    torch.compile'd step (inductor keeps fp32 between fused ops where eager rounds to bf16: 2e-2)."""
    from k3.infer.graphs import GraphedDecoder
    from k3.ops import backend

    model = _decode_model(seed=6)
    ids = torch.randint(0, 512, (3, 80), device=DEV)
    backend.set_backend("fast")
    try:
        with torch.no_grad():
            full = model(ids).logits.float()
            eager, graphed = model.new_cache(3, capacity=48), model.new_cache(3, capacity=48)
            for c in (eager, graphed):
                model(ids[:, :40], cache=c)
            runner = GraphedDecoder(model, graphed, headroom=16, compile=compile)
            errs, full_errs = [], []
            for t in range(40, 80):
                seqs = [0, 1, 2] if t % 3 else [2, 0]  # batch sizes 3 and 2, slots out of order
                if t >= 70:
                    seqs = [1]
                tok = ids[seqs, t]
                want = model.decode(tok, eager, seqs).float()
                got = runner(tok, seqs).float()
                errs.append(rel(got, want))
                full_errs.append(rel(got, full[seqs, t]))
                if t >= 70 or not t % 3:  # keep the others in step eagerly (this also grows the cache behind
                    # the runner's back, which it must notice)
                    rest = [s for s in (0, 1, 2) if s not in seqs]
                    for c in (eager, graphed):
                        model.decode(ids[rest, t], c, rest)
    finally:
        backend.set_backend("auto")
    assert len(runner.graphs) >= 2 and graphed.capacity > 48  # grew past 48 rows: recaptured
    assert max(errs) <= (2e-2 if compile else 1e-2), errs
    assert max(full_errs) <= 5e-2, full_errs


def test_cuda_graph_decode_back_to_back_equals_eager():
    """Back-to-back GraphedDecoder calls with no sync of the test's own between them (each step's tokens come from
    the last step's logits on the GPU; the runner copies slots and positions from the host, which the driver may
    synchronise): 24 greedy steps with the slot order flipped every step, the logits kept on the GPU, == the same
    steps decoded eagerly after."""
    from k3.infer.graphs import GraphedDecoder
    from k3.ops import backend

    model = _decode_model(seed=9)
    prompt = torch.randint(0, 512, (4, 30), device=DEV)
    backend.set_backend("fast")
    try:
        with torch.no_grad():
            eager, graphed = model.new_cache(4, capacity=128), model.new_cache(4, capacity=128)
            for c in (eager, graphed):
                model(prompt, cache=c)
            runner = GraphedDecoder(model, graphed, headroom=16)
            orders = [[0, 1, 2, 3], [3, 1, 0, 2]]
            index = [torch.tensor(o, device=DEV) for o in orders]  # device indices: no host copy in the loop
            tok, got, fed = prompt[:, -1].clone(), [], []
            for t in range(24):
                fed.append(tok[index[t % 2]])
                logits = runner(fed[-1], orders[t % 2])
                got.append(logits.clone())
                tok = torch.empty_like(tok).index_copy_(0, index[t % 2], logits.argmax(-1))
            for t in range(24):
                want = model.decode(fed[t], eager, orders[t % 2]).float()
                assert rel(got[t].float(), want) <= 1e-2, t
    finally:
        backend.set_backend("auto")


@pytest.mark.parametrize("kernels", [True, False], ids=["default", "torch_forms"])
def test_compiled_decode_step_is_one_graph(kernels, monkeypatch):
    """The decode step's Triton launches (the split-K MLA decode, the small-groups expert matmul and, unless turned
    off, the router's top-k, the KDA layer's six input maps in one launch, the MoE routing program, the experts'
    fused up-projection and GLU, the three short-conv steps in one launch and the KDA core in one launch, else
    fla's KDA step) are custom ops, so
    torch.compile traces the whole step as one graph with all of them inside (a torch.compiler.disable'd launch
    cut it at every KDA, MLA and MoE layer). Checked the way an engine compiles it: GraphedDecoder(compile=True)
    from cold backend caches (its eager warm-up resolves every op first; a first resolution inside the trace logs,
    which cuts the graph for good), then the ops named in the traced graph."""
    from torch._dynamo.utils import counters

    from k3.infer.graphs import GraphedDecoder
    from k3.ops import conv, kda, linear, router
    from k3.ops.moe import grouped

    keep_kernel_plan(monkeypatch)
    decode_kernels = ("router_topk", "multi_linear", "moe_route", "moe_up_glu", "conv_step", "kda_decode_core")
    backend.set_kernels(None if kernels else {k: "torch" for k in decode_kernels})  # default: every kernel on

    model = _decode_model(seed=9)
    ids = torch.randint(0, 512, (3, 24), device=DEV)
    backend.set_backend("fast")
    try:
        with torch.no_grad():
            cache = model.new_cache(3, capacity=64)
            model(ids[:, :20], cache=cache)
            for op in backend._OPS.values():  # cold: as in a fresh process
                op.fast_ok.clear()
                op.logged.clear()
            monkeypatch.setattr(router, "_logged", set())
            monkeypatch.setattr(linear, "_logged", set())
            monkeypatch.setattr(conv, "_steps_logged", set())
            monkeypatch.setattr(kda, "_core_logged", set())
            monkeypatch.setattr(grouped, "_route_logged", set())
            monkeypatch.setattr(grouped, "_glu_logged", set())
            torch._dynamo.reset()
            counters.clear()
            GraphedDecoder(model, cache, headroom=16, compile=True)(ids[:, 20], [0, 1, 2])
            breaks = dict(counters["graph_break"])
            slots, positions = torch.arange(3, device=DEV), torch.full((3,), 21, device=DEV)
            explained = torch._dynamo.explain(model.decode_step)(ids[:, 21], cache, slots, positions)
    finally:
        backend.set_backend("auto")
    assert not breaks, [reason[:200] for reason in breaks]
    assert explained.graph_break_count == 0, [b.reason[:200] for b in explained.break_reasons]
    code = "\n".join(g.code for g in explained.graphs)
    ops = ("k3.mla_decode", "k3.small_groups_mm") + (
        (
            "k3.router_topk",
            "k3.multi_linear",
            "k3.moe_route",
            "k3.small_groups_glu",
            "k3.conv_steps",
            "k3.kda_decode_core",
        )
        if kernels
        else ("k3.kda_decode_launch",)
    )
    for op in ops:
        assert op in code, op


@pytest.mark.parametrize("compile_decode", [False, True])
def test_engine_with_cuda_graphs_equals_eager_engine(compile_decode):
    """Continuous batching with graph-replayed decode steps (compiled or not) gives the eager engine's greedy
    tokens."""
    from k3.infer.engine import Engine
    from k3.infer.sampling import SamplingParams
    from k3.model.decoder import K3ForCausalLM

    class Ids:
        eos_id = None

        def decode(self, ids):
            return "".join(f" {i}" for i in ids)

    torch.manual_seed(8)
    model = K3ForCausalLM(get_preset("tiny")).to(DEV).eval()  # MLA dr=8: the masked dense decode fallback
    for layer in model.model.layers:
        if layer.mixer == "kda":
            layer.self_attn.mode = "recurrent"  # prefill without fla's chunk autotuning for every new length
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (5, 17, 9, 30)]
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in (12, 20, 7, 15)]
    outs = []
    for graphs in (True, False):
        engine = Engine(
            model,
            Ids(),
            max_batch=3,
            max_num_batched_tokens=16,
            cuda_graphs=graphs,
            compile_decode=compile_decode and graphs,
        )
        outs.append([r["token_ids"] for r in engine.generate(prompts, params)])
    assert outs[0] == outs[1]


def _fused_cases(n):
    """(op, positional args, kwargs) for every pointwise op fused by torch.compile, random inputs of n rows."""
    from k3.model.activation import swiglu
    from k3.model.norm import gated_rms_norm, rms_norm
    from k3.ops.kda import kda_gate, l2norm

    r = lambda *s: torch.randn(*s, device=DEV)  # noqa: E731
    return [
        (situ_glu, (r(n, 768) * 4, r(n, 768) * 30), dict(beta=4.0, linear_beta=25.0)),
        (swiglu, (r(n, 768) * 3, r(n, 768)), {}),
        (rms_norm, (r(n, 1024) * 5, 1 + r(1024) * 0.1, 1e-5), {}),
        (gated_rms_norm, (r(n, 8, 128), r(n, 8, 128) * 2, 1 + r(128) * 0.1, 1e-5), {}),
        (kda_gate, (r(1, n, 8, 128) * 2, r(8) * 0.5, r(1024), -5.0), {}),
        (kda_gate, (r(1, n, 8, 128) * 2, r(8) * 0.5, r(1024) - 3, None), {}),
        (l2norm, (r(1, n, 8, 128) * 3, 1e-6), {}),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_pointwise_ops_match_reference(dtype):
    """Each op's compiled fast path (k3.ops.fused) against its eager reference on fp64 copies of the same inputs:
    outputs and input gradients, two row counts (the second compiles with a dynamic row dimension). fp32 held to
    1e-5 (only reduction order differs); bf16 outputs and gradients are rounded once more: 1e-2."""
    from k3.ops import backend

    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for n in (1000, 777):
        for op, args, kwargs in _fused_cases(n):
            name, fast = backend.resolve(op.__name__, torch.device(DEV))
            assert name == "fast"
            leaves = [a.to(dtype).requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
            ref_leaves = [a.detach().double().requires_grad_() if isinstance(a, torch.Tensor) else a for a in leaves]
            out, ref = fast(*leaves, **kwargs), op.reference(*ref_leaves, **kwargs)
            w = torch.randn_like(ref)
            (out.double() * w).sum().backward()
            (ref * w).sum().backward()
            assert rel(out, ref) <= tol, (op.__name__, n, rel(out, ref))
            for i, (a, b) in enumerate(zip(leaves, ref_leaves)):
                if isinstance(a, torch.Tensor):
                    assert rel(a.grad, b.grad) <= tol, (op.__name__, n, i, rel(a.grad, b.grad))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_two_phase_attn_res_matches_reference(dtype):
    """AttnRes phase 1 (four queries) + merge, compiled, against the reference depth mix of the whole source list
    on fp64 copies: outputs and gradients of sources and query, for three fixed / live splits, the last with the
    fixed sources scored two at a time. fp32 1e-5 (reduction order); bf16 rounds o and h once more: 1e-2."""
    from k3.ops import backend
    from k3.ops.attn_res import attn_res_merge, attn_res_phase1_pieces, depth_mix

    for op in ("attn_res_phase1", "attn_res_logits", "attn_res_weighted_sum", "attn_res_merge"):
        assert backend.resolve(op, torch.device(DEV))[0] == "fast", op
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    g = torch.Generator(device=DEV).manual_seed(9)
    for n in (1000, 4096):  # phase 1 scores by multiply-and-sum up to 2048 tokens, by GEMMs above
        for n_fixed, n_live, piece in ((3, 1, 24), (2, 3, 24), (5, 1, 2)):
            src = [
                (torch.randn(n, 256, device=DEV, generator=g) * (i + 1) + 0.3).to(dtype).requires_grad_()
                for i in range(n_fixed + n_live)
            ]
            queries = torch.randn(4, 256, device=DEV, generator=g).requires_grad_()
            ref_src = [s.detach().double().requires_grad_() for s in src]
            ref_q = queries.detach().double().requires_grad_()
            o, lse = attn_res_phase1_pieces(queries, src[:n_fixed], 1e-6, piece)
            out = attn_res_merge(o[2], lse[2], src[n_fixed:], queries[2], 1e-6) if n_live else o[2]
            ref = depth_mix(ref_src, ref_q[2], 1e-6)
            w = torch.randn_like(ref)
            (out.double() * w).sum().backward()
            (ref * w).sum().backward()
            assert rel(out, ref) <= tol, (n, n_fixed, n_live, rel(out, ref))
            for i, (a, b) in enumerate(zip(src + [queries], ref_src + [ref_q])):
                gb = b.grad[2] if b is ref_q else b.grad
                ga = a.grad[2] if a is queries else a.grad
                assert rel(ga, gb) <= tol, (n, n_fixed, n_live, i, rel(ga, gb))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_merge_with_pre_norm_matches_reference(dtype):
    """The merge fused with the sub-layer's RMSNorm (k3.model.attn_res.attn_res_merge_norm), compiled, against
    rms_norm(reference depth mix) on fp64 copies: output and gradients of sources, query and norm weight.
    Tolerances as the two-phase test's."""
    from k3.model.attn_res import attn_res_merge_norm
    from k3.model.norm import rms_norm
    from k3.ops import backend
    from k3.ops.attn_res import attn_res_phase1, depth_mix

    assert backend.resolve("attn_res_merge_norm", torch.device(DEV))[0] == "fast"
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    g = torch.Generator(device=DEV).manual_seed(10)
    src = [
        (torch.randn(1000, 256, device=DEV, generator=g) * (i + 1) + 0.3).to(dtype).requires_grad_() for i in range(3)
    ]
    queries = torch.randn(2, 256, device=DEV, generator=g).requires_grad_()
    weight = (1 + 0.1 * torch.randn(256, device=DEV, generator=g)).requires_grad_()
    leaves = src + [queries, weight]
    refs = [t.detach().double().requires_grad_() for t in leaves]
    o, lse = attn_res_phase1(queries, src[:2], 1e-6)
    out = attn_res_merge_norm(o[1], lse[1], src[2:], queries[1], 1e-6, weight, 1e-5)
    ref = rms_norm.reference(depth_mix(refs[:3], refs[3][1], 1e-6), refs[4], 1e-5)
    w = torch.randn_like(ref)
    (out.double() * w).sum().backward()
    (ref * w).sum().backward()
    assert rel(out, ref) <= tol, rel(out, ref)
    for i, (a, b) in enumerate(zip(leaves, refs)):
        assert rel(a.grad, b.grad) <= tol, (i, rel(a.grad, b.grad))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_one_pass_mix_with_pre_norm_matches_reference(dtype):
    """The one-pass mix of short passes (k3.model.attn_res.attn_res_mix_norm: decode steps), compiled, against
    rms_norm(reference depth mix) on fp64 copies, 16 tokens (a decode batch), four sources, no gradients (decode).
    Tolerances as the two-phase test's."""
    from k3.model.attn_res import attn_res_mix_norm
    from k3.model.norm import rms_norm
    from k3.ops import backend
    from k3.ops.attn_res import depth_mix

    assert backend.resolve("attn_res_mix_norm", torch.device(DEV))[0] == "fast"
    g = torch.Generator(device=DEV).manual_seed(11)
    src = [(torch.randn(16, 1024, device=DEV, generator=g) * (i + 1) + 0.3).to(dtype) for i in range(4)]
    query = torch.randn(1024, device=DEV, generator=g)
    weight = 1 + 0.1 * torch.randn(1024, device=DEV, generator=g)
    with torch.no_grad():
        out = attn_res_mix_norm(query, src, 1e-6, weight, 1e-5)
        ref = rms_norm.reference(depth_mix([s.double() for s in src], query.double(), 1e-6), weight.double(), 1e-5)
    assert rel(out, ref) <= (1e-5 if dtype == torch.float32 else 1e-2), rel(out, ref)


def test_activation_checkpointing_with_fast_paths_keeps_loss_and_gradients():
    """Recomputing every mixer and FFN (fla chunk_kda, varlen flash MLA, grouped-GEMM experts, compiled ops) in
    the backward pass under bf16 autocast gives the loss and gradients of the plain step: the recomputation runs
    the same kernels on the same inputs, only atomic-add order (expert scatter) differs: 1e-2."""
    import copy

    from k3.model.decoder import K3ForCausalLM
    from k3.ops import backend
    from k3.train.activation_checkpoint import apply_activation_checkpointing

    torch.manual_seed(5)
    cfg = get_preset("tiny").replace(
        **{
            "kda.num_heads": 8,
            "kda.head_dim": 128,
            "kda.v_head_dim": 128,
            "kda.chunk_size": 64,
            "mla.num_heads": 16,
            "mla.kv_lora_rank": 64,
            "mla.qk_rope_head_dim": 16,
        }
    )
    plain = K3ForCausalLM(cfg).to(DEV)
    ckpt = copy.deepcopy(plain)
    assert apply_activation_checkpointing(ckpt) == 2 * cfg.num_hidden_layers
    ids = torch.randint(0, 512, (2, 256), device=DEV)
    cu = torch.tensor([0, 100, 256, 512], device=DEV)
    results = []
    backend.set_backend("fast")
    try:
        for model in (plain, ckpt):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(ids, cu_seqlens=cu).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1)[:-1], ids.flatten()[1:])
            loss.backward()
            results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    finally:
        backend.set_backend("auto")
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert rel(loss_b, loss_a) <= 1e-3 and grads_a.keys() == grads_b.keys()
    flat_a = torch.cat([g.flatten().double() for g in grads_a.values()])
    flat_b = torch.cat([grads_b[n].flatten().double() for n in grads_a])
    assert rel(flat_b, flat_a) <= 1e-2, rel(flat_b, flat_a)


def test_slice_kernel_times_name_the_kernels_of_a_decode_step():
    """k3 bench slice's kernels phase: one eager decode step's device time by kernel, the MLA decode among them."""
    from k3.bench.slice import kernel_times

    busy, kernels = kernel_times(_decode_model(5), 4, 64)
    assert busy > 0 and kernels and all(t >= 0 and count > 0 for _, t, count in kernels)
    assert any("mla_decode" in name for name, _, _ in kernels), [name for name, _, _ in kernels]
    assert sum(t for _, t, _ in kernels) >= 0.9 * busy  # one stream: the kernels add up to the busy time
