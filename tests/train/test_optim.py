"""K3Muon (per-head Muon + AdamW), parameter groups, schedule and QK-Clip.

Equality tests compare against torch.optim.Muon / torch.optim.AdamW with each head, expert or matrix as its
own parameter. torch.optim.Muon always runs Newton-Schulz in bf16; we compare (a) our bf16 path against it
unchanged and (b) our fp32 path against it with its bf16 cast turned into an fp32 cast (monkeypatched
``Tensor.bfloat16``), so both sides run the same algorithm in the same precision. Errors are measured on the
total parameter change over the steps, ||dW_ours - dW_ref|| / ||dW_ref||; the only difference between the two
sides is batched (baddbmm) vs per-matrix (addmm) GEMMs, i.e. fp32 summation order, ~1e-7, hence tol 1e-6.
"""

import copy
import io
import math

import pytest
import torch
from torch import nn

from k3.config import get_preset
from k3.model.decoder import K3ForCausalLM
from k3.model.mla import MultiheadLatentAttention
from k3.train.muon import K3Muon
from k3.train.newton_schulz import newton_schulz
from k3.train.param_groups import describe_groups, param_groups_for
from k3.train.qk_clip import mla_max_logits, qk_clip_
from k3.train.schedule import clip_grad_norm, cosine_schedule, make_scheduler
from tests.helpers import rel

LR, WD = 0.02, 0.1
TOL = 1e-6


@pytest.fixture(params=["bfloat16", "float32"])
def ns_dtype(request, monkeypatch):
    if request.param == "float32":  # make torch.optim.Muon's NS cast a float32 cast
        monkeypatch.setattr(torch.Tensor, "bfloat16", lambda self, *a, **k: self.float())
    return request.param


def run_pair(w0, ref_params, to_ref_grads, group_kw, steps=3, seed=0):
    """Step K3Muon on one parameter (init w0) and torch's optimiser on ref_params with the same grads."""
    p = nn.Parameter(w0.clone())
    opt = K3Muon([dict(params=[p], **group_kw)], lr=LR, weight_decay=WD)
    ref = torch.optim.Muon(
        ref_params, lr=LR, weight_decay=WD, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw"
    )
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        g = torch.randn(w0.shape, generator=gen) + 0.5  # never zero, non-centred so momentum matters
        p.grad = g.clone()
        for rp, rg in zip(ref_params, to_ref_grads(g)):
            rp.grad = rg.clone()
        opt.step()
        ref.step()
    return p.detach()


def test_per_head_muon_equals_torch_muon_per_head(ns_dtype):
    for heads, hd, d_in in [(4, 16, 48), (3, 32, 24)]:  # wide blocks, then tall blocks (NS on their transpose)
        w0 = torch.randn(heads * hd, d_in, generator=torch.Generator().manual_seed(1)) * 0.02
        ref_params = [nn.Parameter(w0[h * hd : (h + 1) * hd].clone()) for h in range(heads)]
        ours = run_pair(
            w0, ref_params, lambda g: g.split(hd, 0), dict(kind="muon_head", head_dim=hd, ns_dtype=ns_dtype)
        )
        theirs = torch.cat([rp.detach() for rp in ref_params])
        err = rel(ours - w0, theirs - w0)
        print(f"muon_head {heads}x[{hd},{d_in}] ns={ns_dtype}: rel err {err:.2e}")
        assert err < TOL


def test_whole_matrix_muon_equals_torch_muon(ns_dtype):
    for shape in [(64, 48), (40, 96)]:
        w0 = torch.randn(shape, generator=torch.Generator().manual_seed(2)) * 0.02
        ref_params = [nn.Parameter(w0.clone())]
        ours = run_pair(w0, ref_params, lambda g: [g], dict(kind="muon", ns_dtype=ns_dtype))
        err = rel(ours - w0, ref_params[0].detach() - w0)
        print(f"muon {shape} ns={ns_dtype}: rel err {err:.2e}")
        assert err < TOL


def test_expert_muon_equals_torch_muon_per_expert(ns_dtype):
    w0 = torch.randn(6, 32, 20, generator=torch.Generator().manual_seed(3)) * 0.02
    ref_params = [nn.Parameter(w0[e].clone()) for e in range(6)]
    ours = run_pair(w0, ref_params, lambda g: g.unbind(0), dict(kind="muon_expert", ns_dtype=ns_dtype))
    theirs = torch.stack([rp.detach() for rp in ref_params])
    err = rel(ours - w0, theirs - w0)
    print(f"muon_expert [6,32,20] ns={ns_dtype}: rel err {err:.2e}")
    assert err < TOL


def test_adamw_groups_equal_torch_adamw():
    gen = torch.Generator().manual_seed(4)
    w_dec, w_nodec = torch.randn(24, 16, generator=gen), torch.randn(24, generator=gen) + 1.0
    a, b = nn.Parameter(w_dec.clone()), nn.Parameter(w_nodec.clone())
    ra, rb = nn.Parameter(w_dec.clone()), nn.Parameter(w_nodec.clone())
    opt = K3Muon(
        [dict(params=[a], kind="adamw"), dict(params=[b], kind="adamw", weight_decay=0.0)], lr=1e-2, weight_decay=WD
    )
    ref = torch.optim.AdamW(
        [dict(params=[ra]), dict(params=[rb], weight_decay=0.0)],
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=WD,
        foreach=False,
    )
    for _ in range(4):
        for p, rp in ((a, ra), (b, rb)):
            g = torch.randn(p.shape, generator=gen) + 0.3
            p.grad, rp.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    for p, rp, w in ((a, ra, w_dec), (b, rb, w_nodec)):
        err = rel(p.detach() - w, rp.detach() - w)
        print(f"adamw {tuple(p.shape)}: rel err {err:.2e}")
        assert err < TOL


def test_lr_scale_and_missing_grads():
    w0 = torch.randn(32, 16) * 0.02
    p1, p2, idle = nn.Parameter(w0.clone()), nn.Parameter(w0.clone()), nn.Parameter(w0.clone())
    opt1 = K3Muon([dict(params=[p1, idle], kind="muon", lr_scale=0.5)], lr=LR)
    opt2 = K3Muon([dict(params=[p2], kind="muon")], lr=LR / 2)
    g = torch.randn(32, 16)
    p1.grad, p2.grad = g.clone(), g.clone()
    opt1.step(), opt2.step()
    assert torch.equal(p1, p2)
    assert torch.equal(idle, w0) and idle not in opt1.state


def test_newton_schulz_properties():
    gen = torch.Generator().manual_seed(5)
    g = torch.randn(64, 32, generator=gen)
    s = torch.linalg.svdvals(newton_schulz(g))
    assert s.min() > 0.5 and s.max() < 1.5, s
    # batched == one by one; tall == transposed wide; fp32 by default, the requested dtype otherwise
    batch = torch.randn(3, 2, 24, 40, generator=gen)
    out = newton_schulz(batch)
    assert out.dtype == torch.float32 and out.shape == batch.shape
    for i in range(3):
        for j in range(2):
            assert rel(out[i, j], newton_schulz(batch[i, j])) < 1e-6
    assert rel(newton_schulz(batch[0, 0].T), newton_schulz(batch[0, 0]).T) < 1e-6
    assert newton_schulz(g, dtype=torch.bfloat16).dtype == torch.bfloat16
    assert rel(newton_schulz(g), newton_schulz(g.double(), dtype=torch.float64)) < 1e-5


# ----------------------------------------------------------------------------------------------------------
# parameter groups
# ----------------------------------------------------------------------------------------------------------


def kinds_by_name(groups):
    return {n: (g["kind"], g.get("head_dim"), g["weight_decay"]) for g in groups for n in g["param_names"]}


def test_param_groups_tiny():
    model = K3ForCausalLM(get_preset("tiny"))
    groups = param_groups_for(model, lr=1e-3)
    names = [n for g in groups for n in g["param_names"]]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert len(names) == len(set(names))
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    k = kinds_by_name(groups)
    L = "model.layers."
    expect = {
        f"{L}0.self_attn.q_proj.weight": ("muon_head", 16, WD),
        f"{L}0.self_attn.v_proj.weight": ("muon_head", 16, WD),
        f"{L}0.self_attn.g_proj.weight": ("muon_head", 16, WD),
        f"{L}0.self_attn.o_proj.weight": ("muon", None, WD),
        f"{L}0.self_attn.f_b_proj.weight": ("muon", None, WD),
        f"{L}0.self_attn.b_proj.weight": ("muon", None, WD),
        f"{L}0.self_attn.A_log": ("adamw", None, 0.0),
        f"{L}0.self_attn.dt_bias": ("adamw", None, 0.0),
        f"{L}0.self_attn.q_conv1d.weight": ("adamw", None, 0.0),
        f"{L}0.self_attn.o_norm.weight": ("adamw", None, 0.0),
        f"{L}0.mlp.down_proj.weight": ("muon", None, WD),
        f"{L}0.self_attention_res_proj.weight": ("adamw", None, 0.0),
        f"{L}0.mlp_res_norm.weight": ("adamw", None, 0.0),
        f"{L}1.block_sparse_moe.gate.weight": ("muon", None, WD),
        f"{L}1.block_sparse_moe.experts.w2": ("muon_expert", None, WD),
        f"{L}1.block_sparse_moe.routed_expert_down_proj.weight": ("muon", None, WD),
        f"{L}1.block_sparse_moe.shared_experts.up_proj.weight": ("muon", None, WD),
        f"{L}3.self_attn.q_a_proj.weight": ("muon", None, WD),
        f"{L}3.self_attn.q_b_proj.weight": ("muon_head", 24, WD),
        f"{L}3.self_attn.kv_a_proj_with_mqa.weight": ("muon", None, WD),
        f"{L}3.self_attn.kv_b_proj.weight": ("muon_head", 32, WD),
        f"{L}3.self_attn.g_proj.weight": ("muon_head", 16, WD),
        f"{L}3.self_attn.kv_a_layernorm.weight": ("adamw", None, 0.0),
        "model.embed_tokens.weight": ("adamw", None, WD),
        "lm_head.weight": ("adamw", None, WD),
        "model.norm.weight": ("adamw", None, 0.0),
        "model.output_attn_res_proj.weight": ("adamw", None, 0.0),
    }
    for name, want in expect.items():
        assert k[name] == want, (name, k[name], want)
    print("\n" + describe_groups(groups))

    flat = kinds_by_name(param_groups_for(model, lr=1e-3, per_head=False))
    assert not any(v[0] == "muon_head" for v in flat.values())
    for name, (kind, _, _) in k.items():
        assert flat[name][0] == ("muon" if kind == "muon_head" else kind)
    routed = kinds_by_name(param_groups_for(model, lr=1e-3, router="adamw"))
    assert routed[f"{L}1.block_sparse_moe.gate.weight"] == ("adamw", None, WD)


def test_param_groups_no_q_lora_and_smoke_step():
    cfg = get_preset("tiny").replace(**{"mla.q_lora_rank": None, "kda.full_rank_output_gate": False})
    model = K3ForCausalLM(cfg)
    k = kinds_by_name(param_groups_for(model, lr=1e-3))
    assert k["model.layers.3.self_attn.q_proj.weight"] == ("muon_head", 24, WD)
    assert k["model.layers.0.self_attn.g_a_proj.weight"][0] == "muon"
    assert k["model.layers.0.self_attn.g_b_proj.weight"][0] == "muon"
    opt = K3Muon(param_groups_for(model, lr=1e-3))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(6))
    loss = nn.functional.cross_entropy(model(ids).logits[:, :-1].reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1))
    loss.backward()
    norm = clip_grad_norm(model, 1.0)
    assert torch.isfinite(norm)
    opt.step()
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert "model.layers.1.block_sparse_moe.experts.w1" in changed
    assert "model.layers.3.self_attn.q_proj.weight" in changed


def test_state_dict_round_trip_is_bitwise():
    torch.manual_seed(7)
    model_a = K3ForCausalLM(get_preset("tiny"))
    opt_a = K3Muon(param_groups_for(model_a, lr=1e-3))

    def set_grads(model, step):
        gen = torch.Generator().manual_seed(100 + step)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen) * 0.01 + 0.001

    for step in range(2):
        set_grads(model_a, step)
        opt_a.step()
    buf = io.BytesIO()
    torch.save(opt_a.state_dict(), buf)
    buf.seek(0)
    model_b = copy.deepcopy(model_a)
    opt_b = K3Muon(param_groups_for(model_b, lr=5.0, weight_decay=0.0))  # hyper-parameters come from the file
    opt_b.load_state_dict(torch.load(buf, weights_only=True))
    for step in range(2, 4):
        for m, o in ((model_a, opt_a), (model_b, opt_b)):
            set_grads(m, step)
            o.step()
    for (n, pa), (_, pb) in zip(model_a.named_parameters(), model_b.named_parameters()):
        assert torch.equal(pa, pb), n


# ----------------------------------------------------------------------------------------------------------
# schedule
# ----------------------------------------------------------------------------------------------------------


def test_cosine_schedule():
    total = 1000  # warmup = 10 steps
    f = [cosine_schedule(s, total) for s in range(total + 5)]
    assert f[0] == pytest.approx(0.1) and f[4] == pytest.approx(0.5) and f[9] == 1.0
    assert all(f[i] < f[i + 1] for i in range(9))
    assert all(f[i] >= f[i + 1] for i in range(9, total + 4))
    assert f[504] == pytest.approx(0.55)  # half way through the decay
    assert f[total - 1] == pytest.approx(0.1) and f[total + 4] == pytest.approx(0.1)
    assert cosine_schedule(0, 5) == 1.0 and cosine_schedule(4, 5) == pytest.approx(0.1)  # warmup of one step
    assert cosine_schedule(3, 100, warmup_frac=0.0, min_ratio=0.0) == pytest.approx(
        0.5 * (1 + math.cos(math.pi * 3 / 99))
    )

    p = nn.Parameter(torch.ones(2))
    opt = K3Muon([dict(params=[p], kind="adamw")], lr=3e-3)
    sched = make_scheduler(opt, total_steps=200, warmup_frac=0.05)
    for s in range(30):
        assert opt.param_groups[0]["lr"] == pytest.approx(3e-3 * cosine_schedule(s, 200, 0.05))
        opt.step()
        sched.step()


# ----------------------------------------------------------------------------------------------------------
# QK-Clip
# ----------------------------------------------------------------------------------------------------------


def make_mla(q_lora, rope):
    cfg = get_preset("tiny").replace(**{"mla.num_heads": 4, "mla.q_lora_rank": q_lora, "mla.rope_theta": rope})
    torch.manual_seed(8)
    m = MultiheadLatentAttention(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    return m


def logits_from_forward(m, x, cu):
    """Per-head max causal logit from q / kv captured out of the module's own forward (NoPE only)."""
    got = {}
    qmod = m.q_proj if hasattr(m, "q_proj") else m.q_b_proj
    hooks = [
        qmod.register_forward_hook(lambda mod, i, o: got.__setitem__("q", o)),
        m.kv_b_proj.register_forward_hook(lambda mod, i, o: got.__setitem__("kv", o)),
        m.kv_a_proj_with_mqa.register_forward_hook(lambda mod, i, o: got.__setitem__("a", o)),
    ]
    m(x, cu, absorb=False)
    for h in hooks:
        h.remove()
    n, h = x.shape[0], m.num_heads
    q = got["q"].view(n, h, -1)
    k = torch.cat([got["kv"].view(n, h, -1)[..., : m.dn], got["a"][:, None, m.r :].expand(-1, h, -1)], -1)
    best = torch.full((h,), -math.inf)
    b = cu.tolist()
    for s in range(len(b) - 1):
        sc = torch.einsum("ihd,jhd->hij", q[b[s] : b[s + 1]], k[b[s] : b[s + 1]]) * m.scale
        L = b[s + 1] - b[s]
        sc = sc.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), -math.inf)
        best = torch.maximum(best, sc.amax((1, 2)))
    return best


@pytest.mark.parametrize("q_lora,rope", [(32, None), (None, 10000.0)])
def test_qk_clip(q_lora, rope):
    m = make_mla(q_lora, rope)
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(9))
    cu = torch.tensor([0, 7, 20])
    with torch.no_grad():  # make head 1 exceed tau = 100 and head 2 sit just under it
        s0 = mla_max_logits(m, x, cu)
        wq = (m.q_proj if hasattr(m, "q_proj") else m.q_b_proj).weight.view(4, m.dn + m.dr, -1)
        wq[1].mul_(150.0 / s0[1].abs())
        wq[2].mul_(90.0 / s0[2].abs())
    s = mla_max_logits(m, x, cu)
    if rope is None:
        assert rel(s, logits_from_forward(m, x, cu)) < 1e-5
    assert s[1] > 100 and s[2] < 100, s

    captured = []
    hook = m.o_proj.register_forward_pre_hook(lambda mod, args: captured.append(args[0].detach().clone()))
    m(x, cu)
    kv_a, w_v = m.kv_a_proj_with_mqa.weight.clone(), m.kv_b_proj.weight.view(4, m.dn + m.dv, -1)[:, m.dn :].clone()
    gamma = qk_clip_(m, s)
    m(x, cu)
    hook.remove()
    s_after = mla_max_logits(m, x, cu)

    clipped = s > 100
    assert torch.equal(clipped, gamma < 1)
    assert (s_after[clipped] <= 100 * (1 + 1e-4)).all() and (s_after[clipped] >= 100 * (1 - 1e-4)).all()
    assert torch.allclose(s_after[~clipped], s[~clipped], rtol=1e-6, atol=0)
    before, after = (o.view(20, 4, m.dv) for o in captured)
    keep = (~clipped).nonzero().flatten()
    assert torch.allclose(after[:, keep], before[:, keep], rtol=1e-6, atol=1e-7)
    assert not torch.allclose(after[:, 1], before[:, 1])
    assert torch.equal(m.kv_a_proj_with_mqa.weight, kv_a)  # shared k_pe untouched
    assert torch.equal(m.kv_b_proj.weight.view(4, m.dn + m.dv, -1)[:, m.dn :], w_v)  # v rows untouched


def test_batched_newton_schulz_equals_one_matrix_at_a_time(monkeypatch):
    """A step on the tiny model with Newton-Schulz batched over same-shape blocks (the default) equals the step
    with every parameter orthogonalised alone (a budget of one byte forces that)."""
    import k3.train.muon as muon

    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset("tiny"))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    twin, before = copy.deepcopy(model), copy.deepcopy(model)
    for p, q in zip(model.parameters(), twin.parameters()):
        q.grad = p.grad.clone()
    K3Muon(param_groups_for(model, 1e-2), lr=1e-2).step()
    monkeypatch.setattr(muon, "NS_BATCH_BYTES", 1)
    K3Muon(param_groups_for(twin, 1e-2), lr=1e-2).step()
    worst = max(rel(p.detach(), q.detach()) for p, q in zip(model.parameters(), twin.parameters()))
    assert worst <= 1e-6, worst  # fp32; batched and single GEMMs may block their sums differently
    moved = [rel(p.detach(), b.detach()) for p, b in zip(model.parameters(), before.parameters())]
    assert max(moved) > 1e-3  # the step did move the weights


def test_ns_batches_fill_each_shape_up_to_the_budget_in_order():
    """Items of one key share a Newton-Schulz call while their elements fit the budget; a new call starts when the
    next would not fit; an item larger than the budget is a call of its own; keys never mix."""
    from k3.train.newton_schulz import block_shape, ns_batches

    items = [("a", 4, 1), ("a", 4, 2), ("b", 9, 3), ("a", 3, 4), ("a", 20, 5), ("a", 1, 6), ("b", 1, 7)]
    assert ns_batches(items, 10) == {"a": [[1, 2], [4], [5], [6]], "b": [[3, 7]]}
    assert block_shape({"kind": "muon_head", "head_dim": 16}, (64, 48)) == (16, 48)
    assert block_shape({"kind": "muon_expert"}, (8, 32, 48)) == (32, 48)
    assert block_shape({"kind": "muon"}, (32, 48)) == (32, 48)


@pytest.mark.parametrize("kind", ["muon", "adamw"])
def test_weight_decay_of_bf16_parameters_multiplies_in_fp32(kind):
    """With zero gradients a step is the decay alone (Muon: NS(0) = 0; AdamW: 0 / (0 + eps) = 0): every bf16
    parameter must equal the eager ``p.mul_(1 - lr * wd)``, which multiplies in fp32 (foreach would round the
    factor 0.998 to bf16's 0.99609 first on CPU)."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(16, 24, dtype=torch.bfloat16) + 3) for _ in range(3)]
    params.append(nn.Parameter(torch.randn(16, 24) + 3))  # an fp32 one in the same group
    want = [p.detach().clone().mul_(1 - LR * WD) for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    K3Muon([dict(params=params, kind=kind)], lr=LR, weight_decay=WD).step()
    for p, w in zip(params, want):
        assert torch.equal(p.detach(), w), (p.dtype, (p.detach().float() - w.float()).abs().max().item())
