"""MXFP4 experts at inference (k3.ops.moe.mxfp4): the packed op equals the dequantise-then-compute reference,
E8M0 extremes and the NaN code behave as OCP MX says, dequantisation agrees with torchao, packed experts take
4.25 bits a weight, and only the experts a batch selects are dequantised."""

import pytest
import torch

import k3.ops.moe.mxfp4 as mxfp4
from k3.config import get_preset
from k3.model.activation import make_glu
from k3.model.decoder import K3ForCausalLM
from k3.model.moe import MoE
from k3.ops import backend
from k3.ops.moe import reference
from k3.ops.moe.layout import COUNT_PAIRS
from k3.quant.packed import PackedExperts, use_packed_experts
from tests.conftest import pack_model_experts

E, D, I, N, K = 8, 64, 96, 24, 3
NAN_EXPERT, BIG_EXPERT, TINY_EXPERT, UNUSED = 6, 5, 2, 7


def random_bank(seed=0) -> PackedExperts:
    """Random codes; scales in [118, 130] except: TINY_EXPERT's w1 and w2 rows 0-3 at scale 0 (2^-127),
    BIG_EXPERT's w1 first block at 254 (2^127, codes 0 but for one 0.5 a row: finite 2^126 weights) and one
    block of NAN_EXPERT's w3 at the NaN code 255."""
    g = torch.Generator().manual_seed(seed)
    bank = PackedExperts(E, D, I).to(torch.bfloat16)
    for name, buf in bank.named_buffers():
        if name.endswith("_packed"):
            buf.copy_(torch.randint(0, 256, buf.shape, generator=g, dtype=torch.uint8))
        elif name.endswith("_scale"):
            buf.copy_(torch.randint(118, 131, buf.shape, generator=g, dtype=torch.uint8))
    bank.w1_scale[TINY_EXPERT, :4] = 0
    bank.w2_scale[TINY_EXPERT, :4] = 0
    bank.w1_scale[BIG_EXPERT, :, 0] = 254
    bank.w1_packed[BIG_EXPERT, :, :16] = 0
    bank.w1_packed[BIG_EXPERT, :, 0] = 0x1  # column 0: E2M1 0.5
    bank.w3_scale[NAN_EXPERT, 5, 1] = 255
    return bank


def routing(seed=0):
    """N tokens, k distinct experts each among 0..6 (UNUSED never chosen); NAN_EXPERT chosen by tokens 0-3 only."""
    g = torch.Generator().manual_seed(seed)
    others = [e for e in range(E) if e not in (NAN_EXPERT, UNUSED)]
    rows = []
    for t in range(N):
        pool = torch.tensor(others)[torch.randperm(len(others), generator=g)[:K]]
        if t < 4:
            pool[0] = NAN_EXPERT
        rows.append(pool)
    idx = torch.stack(rows)
    weight = torch.rand(N, K, generator=g) + 0.1
    return idx, weight / weight.sum(-1, keepdim=True)


@pytest.fixture
def reference_backend():
    backend.set_backend("reference")
    yield
    backend.set_backend("auto")


def test_packed_op_equals_dequantised_reference(reference_backend):
    bank = random_bank()
    idx, weight = routing()
    x = torch.randn(N, D, generator=torch.Generator().manual_seed(3)).bfloat16()
    glu = make_glu("situ")
    out = mxfp4.moe_experts_packed(x, idx, weight, bank, glu)
    assert out.dtype == torch.bfloat16 and out.shape == (N, D)
    # the whole bank dequantised to bf16, then the per-expert loop: the same result bit for bit
    want = reference.moe_experts(x, idx, weight, bank.w1, bank.w2, bank.w3, glu)
    torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)
    # NaN code: exactly the tokens routed to that expert are NaN, every other output is finite
    nan_tokens = (idx == NAN_EXPERT).any(-1)
    assert nan_tokens.sum() == 4
    assert out[nan_tokens].isnan().all() and out[~nan_tokens].isfinite().all()
    # the extremes matter: 2^127 weights saturate the GLU, 2^-127 ones are (almost) zero
    assert bank.w1[BIG_EXPERT, :, 0].float().eq(2.0**126).all() and bank.w1[TINY_EXPERT, :4].abs().max() < 1e-37
    # within bf16 rounding of the same computation in fp32 (weights exact in fp32)
    bank32 = [w.float() for w in (bank.to(torch.float32).w1, bank.w2, bank.w3)]
    want32 = reference.moe_experts(x.float(), idx, weight, *bank32, glu)
    ok = ~nan_tokens
    err = (out[ok].float() - want32[ok]).norm(dim=-1) / want32[ok].norm(dim=-1)
    assert err.max() < 2e-2, err.max()


def test_fast_path_form_on_cpu_equals_reference(reference_backend):
    """moe_experts_fast's torch form (the GPU path when the Triton kernel does not run) gives the reference's
    result within bf16 rounding, in both of its forms (a copy per pair; the unique experts)."""
    bank = random_bank(1)
    glu = make_glu("silu")
    for n in (2, N):  # 6 pairs < E: a copy per pair; 72 pairs: unique experts
        idx, weight = routing(n)
        idx, weight = idx[:n], weight[:n]
        x = torch.randn(n, D, generator=torch.Generator().manual_seed(n)).bfloat16()
        got = mxfp4.moe_experts_fast(x, idx, weight, bank, glu)
        want = mxfp4.moe_experts_reference(x, idx, weight, bank, glu)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_only_selected_experts_are_dequantised(monkeypatch, perturb):
    """A model with packed experts dequantises, per MoE layer and call, exactly the experts its batch selects;
    the whole-bank properties are never read on the forward."""
    torch.manual_seed(0)
    cfg = get_preset("tiny").replace(**{"moe.num_experts": 32, "moe.num_experts_per_token": 2})
    model = pack_model_experts(perturb(K3ForCausalLM(cfg)))
    calls, chosen = [], []
    real = mxfp4.dequantize_experts

    def spy(packed, scale, experts, dtype):
        calls.append(experts.numel())
        return real(packed, scale, experts, dtype)

    def whole_bank(self, w):
        raise AssertionError("the whole bank was dequantised on the forward")

    def record(moe, args, out):
        chosen.append(out[1].topk_idx.unique().numel())

    monkeypatch.setattr(mxfp4, "dequantize_experts", spy)
    monkeypatch.setattr(PackedExperts, "_weight", whole_bank)
    for m in model.modules():
        if isinstance(m, MoE):
            m.register_forward_hook(record)
    ids = torch.randint(0, 512, (1, 3), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    assert len(chosen) == 4 and calls == [c for c in chosen for _ in range(3)]  # w1, w2, w3 of each layer
    assert max(chosen) <= 3 * 2 < 32  # 3 tokens x top-2 of 32 experts
    assert logits.isfinite().all()


def test_dequantisation_matches_torchao():
    """dequantize_experts (k3.ops.mx's E2M1 x E8M0) equals torchao's MX dequantisation, NaN scale included,
    on random bytes with every scale code 0..255."""
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (4, 64, 48), generator=g, dtype=torch.uint8)  # [E, out, in / 2], in = 96
    scale = torch.randint(0, 256, (4, 64, 3), generator=g, dtype=torch.uint8)
    scale.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    for dtype in (torch.float32, torch.bfloat16):
        ours = mxfp4.dequantize_experts(packed, scale, torch.tensor([3, 0, 2]), dtype)
        sel = [3, 0, 2]
        theirs = mx.to_dtype(
            packed[sel].reshape(-1, 16),
            scale[sel].reshape(-1, 1).view(torch.float8_e8m0fnu),
            torch.float4_e2m1fn_x2,
            32,
            dtype,
        ).reshape(ours.shape)
        assert ours.dtype == theirs.dtype == dtype
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(ours.isnan(), (scale[sel] == 255).repeat_interleave(32, -1))


def test_packed_bytes_per_weight():
    """Codes + scales resident: 4.25 bits a routed-expert weight, for a CPU model and for k3-slice on meta."""

    def check(model, weights):
        use_packed_experts(model)
        bufs = [
            b
            for m in model.modules()
            if isinstance(m, PackedExperts)
            for n, b in m.named_buffers(recurse=False)
            if n.endswith(("_packed", "_scale"))
        ]
        assert all(b.dtype == torch.uint8 for b in bufs)
        assert not any(".experts." in n for n, _ in model.named_parameters())
        nbytes = sum(b.numel() * b.element_size() for b in bufs)
        assert abs(nbytes / weights / (4.25 / 8) - 1) < 0.01
        return nbytes

    cfg = get_preset("tiny")
    moe = cfg.num_hidden_layers - cfg.first_k_dense_replace
    check(K3ForCausalLM(cfg), moe * cfg.moe.num_experts * 3 * cfg.moe.moe_intermediate_size * cfg.moe.latent_size)
    cfg = get_preset("k3-slice")
    with torch.device("meta"):
        nbytes = check(K3ForCausalLM(cfg), 4 * 896 * 3 * 3072 * 3584)
    assert 62.8e9 < nbytes < 63.0e9


def test_kernel_switch(monkeypatch):
    """moe_mxfp4 follows the kernel plan like every Triton kernel, and runs no-grad batches of any size (decode
    and prefill) on a GPU (or in Triton's interpreter)."""
    from tests.ops.kernel_switch import check_kernel_switch

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, idx = torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(2, 2, dtype=torch.long)
    check_kernel_switch(monkeypatch, "moe_mxfp4", lambda: mxfp4.mxfp4_kernel(x, idx, False))
    assert mxfp4.mxfp4_kernel(x, idx, False) == "triton"
    assert mxfp4.mxfp4_kernel(x, idx, True) == "torch"
    assert mxfp4.mxfp4_kernel(x, torch.zeros(COUNT_PAIRS + 1, 1, dtype=torch.long), False) == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    assert mxfp4.mxfp4_kernel(x, idx, False) == "torch"
