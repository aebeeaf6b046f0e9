"""Attention Residuals: zero-init mixes are uniform; each mode equals a plain loop written from the equations."""

import pytest
import torch

from k3.config import get_preset
from k3.model.decoder import K3ForCausalLM
from k3.ops.attn_res.reference import depth_mix


def mix_eq(sources, norm, proj):
    """h = sum_i softmax_i(w . RMSNorm(v_i)) v_i, token by token, in fp64."""
    w = (norm.weight * proj.weight[0]).double()
    out = torch.empty_like(sources[0], dtype=torch.float64)
    for t in range(sources[0].shape[0]):
        vals = [v[t].double() for v in sources]
        logits = torch.stack([(v / v.pow(2).mean().add(norm.eps).sqrt() * w).sum() for v in vals])
        a = torch.exp(logits - logits.max())
        a = a / a.sum()
        out[t] = sum(ai * v for ai, v in zip(a, vals))
    return out


def plain_loop(model, tokens, cu):
    """The model's forward with the residual logic rewritten from docs/architecture.md#attnres for every mode."""
    cfg = model.config
    mode, bsize = cfg.attn_res.mode, cfg.attn_res.block_size
    emb = model.model.embed_tokens(tokens)
    outputs = []  # every sub-layer output in order

    def sources(layer, sub):
        i_sub = 2 * layer + (sub == "mlp")  # global sub-layer index
        if mode == "full":
            return [emb] + outputs
        if mode == "snapshot":
            r = emb + sum(outputs) if outputs else emb
            bank = [emb + sum(outputs[: 2 * b * bsize]) if b else emb for b in range(layer // bsize + 1)]
            return bank + [r]
        # block_sum: blocks of 2*bsize sub-layers; b_0 = embedding
        n = i_sub // (2 * bsize)
        blocks = [emb] + [sum(outputs[2 * bsize * j : 2 * bsize * (j + 1)]) for j in range(n)]
        partial = outputs[2 * bsize * n : i_sub]
        return blocks + ([sum(partial)] if partial else [])

    for i, layer in enumerate(model.model.layers):
        h = mix_eq(sources(i, "attn"), layer.self_attention_res_norm, layer.self_attention_res_proj)
        outputs.append(layer.self_attn(layer.input_layernorm(h), cu).double())
        h = layer.post_attention_layernorm(mix_eq(sources(i, "mlp"), layer.mlp_res_norm, layer.mlp_res_proj))
        outputs.append((layer.mlp(h) if hasattr(layer, "mlp") else layer.block_sparse_moe(h)[0]).double())
    if mode == "full":
        final = [emb] + outputs
    elif mode == "snapshot":
        final = sources(len(model.model.layers) - 1, "mlp")[:-1] + [emb + sum(outputs)]
    else:
        n_done = len(outputs) // (2 * bsize)
        final = [emb] + [sum(outputs[2 * bsize * j : 2 * bsize * (j + 1)]) for j in range(n_done)]
        if len(outputs) % (2 * bsize):
            final.append(sum(outputs[2 * bsize * n_done :]))
    h = mix_eq(final, model.model.output_attn_res_norm, model.model.output_attn_res_proj)
    return model.lm_head(model.model.norm(h))


@pytest.mark.parametrize("tokens", [9, 3000])
def test_compiled_phase1_scores_rowwise_or_by_gemm(tokens):
    """Traced by torch.compile, phase 1 scores few tokens (<= ROWWISE_TOKENS) by multiply-and-sum and more by
    GEMMs: both equal the reference mix with its gradients (fp64)."""
    torch.manual_seed(tokens)
    src = [(torch.randn(tokens, 16, dtype=torch.float64) * (i + 1) + 0.2 * i).requires_grad_() for i in range(4)]
    q = torch.randn(16, dtype=torch.float64, requires_grad=True)
    g = torch.randn(tokens, 16, dtype=torch.float64)
    out = two_phase(src[:3], src[3:], q, 1e-5, compiled=True)
    ours = torch.autograd.grad((out * g).sum(), [q, *src])
    ref = depth_mix(src, q, 1e-5)
    want = torch.autograd.grad((ref * g).sum(), [q, *src])
    assert ((out - ref).norm() / ref.norm()).item() <= 1e-12
    for a, b in zip(ours, want):
        assert ((a - b).norm() / b.norm()).item() <= 1e-10


def test_zero_init_gives_uniform_depth_weights():
    model = K3ForCausalLM(get_preset("tiny"))
    projs = [p for n, p in model.named_parameters() if n.endswith("_res_proj.weight")]
    assert len(projs) == 2 * 5 + 1 and all((p == 0).all() for p in projs)
    torch.manual_seed(0)
    src = torch.randn(5, 7, 64) * torch.rand(5, 1, 1) * 10
    out = depth_mix(list(src), torch.zeros(64), 1e-5)
    assert torch.allclose(out, src.mean(0), atol=1e-6)


def two_phase(fixed, live, q, eps, compiled=False):
    """phase 1 for q and two other queries (they must not disturb q's row), then the merge; ``compiled``: traced
    by torch.compile (aot_eager: no code generation), which takes phase 1's multiply-and-sum scoring."""
    from k3.ops.attn_res.two_phase import attn_res_merge, attn_res_phase1

    others = torch.randn(2, q.shape[0], dtype=q.dtype)
    phase1 = attn_res_phase1.reference
    if compiled:
        phase1 = torch.compile(phase1, backend="aot_eager", fullgraph=True, dynamic=False)
    o, lse = phase1(torch.stack([others[0], q, others[1]]), fixed, eps)
    return o[1] if not live else attn_res_merge.reference(o[1], lse[1], live, q, eps)


@pytest.mark.parametrize("n_fixed,n_live", [(1, 0), (1, 1), (3, 0), (3, 1), (2, 3)])
def test_two_phase_equals_reference_with_gradients(n_fixed, n_live):
    """Phase 1 over the fixed sources + online-softmax merge of the live ones == the reference mix of the whole
    list, values and gradients (fp64: equal to rounding); gradcheck of the two phases."""
    torch.manual_seed(n_fixed * 10 + n_live)
    src = [
        (torch.randn(9, 16, dtype=torch.float64) * (i + 1) + 0.2 * i).requires_grad_() for i in range(n_fixed + n_live)
    ]
    q = torch.randn(16, dtype=torch.float64, requires_grad=True)
    split = lambda s: (list(s[:n_fixed]), list(s[n_fixed:]))  # noqa: E731
    assert torch.autograd.gradcheck(lambda qq, *s: two_phase(*split(s), qq, 1e-5), [q, *src])
    g = torch.randn(9, 16, dtype=torch.float64)
    out = two_phase(*split(src), q, 1e-5)
    (out * g).sum().backward()
    ours = [t.grad.clone() for t in [q, *src]]
    for t in [q, *src]:
        t.grad = None
    ref = depth_mix(src, q, 1e-5)
    (ref * g).sum().backward()
    assert ((out - ref).norm() / ref.norm()).item() <= 1e-12
    for a, b in zip(ours, [t.grad for t in [q, *src]]):  # one source: the query's gradient is exactly zero
        assert ((a - b).norm() / (b.norm() if b.norm() > 0 else 1)).item() <= 1e-10


def fold_then_merge(fixed, chunks, q, eps):
    """Phase 1 over ``fixed``, then every live chunk but the last folded into (o, lse), then the last merged;
    -> (mix, the lse after folding every chunk)."""
    from k3.ops.attn_res.two_phase import attn_res_fold, attn_res_merge, attn_res_phase1

    o, lse = attn_res_phase1.reference(q[None], fixed, eps)
    o, lse = o[0], lse[0]
    for chunk in chunks[:-1]:
        o, lse = attn_res_fold.reference(o, lse, chunk, q, eps)
    out = attn_res_merge.reference(o, lse, chunks[-1], q, eps)
    return out, attn_res_fold.reference(o, lse, chunks[-1], q, eps)[1]


@pytest.mark.parametrize("n_fixed,sizes", [(1, (1, 2)), (3, (2, 1, 2)), (2, (1, 1, 1, 1))])
def test_fold_then_merge_equals_reference(n_fixed, sizes):
    """Live sources folded into phase 1's (o, lse) a few at a time, the rest merged == the reference mix of the
    whole list, values and gradients (fp64: equal to rounding; gradcheck); the folded lse is the log-sum-exp of
    every source's logit."""
    torch.manual_seed(n_fixed + len(sizes))
    n = n_fixed + sum(sizes)
    src = [(torch.randn(7, 16, dtype=torch.float64) * (i + 1) + 0.2 * i).requires_grad_() for i in range(n)]
    q = torch.randn(16, dtype=torch.float64, requires_grad=True)
    eps = 1e-5

    def split(s):
        live, chunks = list(s[n_fixed:]), []
        for k in sizes:
            chunks.append(live[:k])
            live = live[k:]
        return list(s[:n_fixed]), chunks

    assert torch.autograd.gradcheck(lambda qq, *s: fold_then_merge(*split(s), qq, eps)[0], [q, *src])
    out, lse = fold_then_merge(*split(src), q, eps)
    ref = depth_mix(src, q, eps)
    assert ((out - ref).norm() / ref.norm()).item() <= 1e-12
    logits = torch.stack([(v * q).sum(-1) / v.pow(2).mean(-1).add(eps).sqrt() for v in src])
    assert ((lse - torch.logsumexp(logits, 0)).abs().max()).item() <= 1e-12
    g = torch.randn(7, 16, dtype=torch.float64)
    ours = torch.autograd.grad((out * g).sum(), [q, *src])
    want = torch.autograd.grad((ref * g).sum(), [q, *src])
    for a, b in zip(ours, want):
        assert ((a - b).norm() / b.norm()).item() <= 1e-10


@pytest.mark.parametrize("n,piece", [(5, 2), (7, 3), (6, 6), (9, 1)])
def test_phase1_in_pieces_equals_phase1(n, piece):
    """Phase 1 over S sources scored ``piece`` at a time (logits per piece, one log-sum-exp, summed weighted sums)
    == phase 1 in one piece == the reference mix per query, values and gradients (fp64: rounding; gradcheck)."""
    from k3.ops.attn_res.two_phase import attn_res_phase1, attn_res_phase1_pieces

    torch.manual_seed(n + piece)
    src = [(torch.randn(5, 8, dtype=torch.float64) * (i + 1) + 0.2 * i).requires_grad_() for i in range(n)]
    q = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    eps = 1e-5

    def pieces(qq, *s):
        return attn_res_phase1_pieces(qq, list(s), eps, piece)

    assert torch.autograd.gradcheck(pieces, [q, *src])
    o, lse = pieces(q, *src)
    o1, lse1 = attn_res_phase1.reference(q, src, eps)
    assert ((o - o1).norm() / o1.norm()).item() <= 1e-13 and ((lse - lse1).abs().max()).item() <= 1e-12
    for m in range(3):
        ref = depth_mix(src, q[m], eps)
        assert ((o[m] - ref).norm() / ref.norm()).item() <= 1e-12
    g = torch.randn_like(o)
    ours = torch.autograd.grad((o * g).sum() + lse.sum(), [q, *src])
    want = torch.autograd.grad((o1 * g).sum() + lse1.sum(), [q, *src])
    for a, b in zip(ours, want):
        assert ((a - b).norm() / b.norm()).item() <= 1e-10


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 8e-3)])
def test_phase1_in_pieces_low_precision(dtype, tol):
    """fp32 / bf16 sources: the pieces' sums stay in fp32 and o is rounded to the sources' dtype once, as phase 1
    in one piece rounds it."""
    from k3.ops.attn_res.two_phase import attn_res_phase1_pieces

    torch.manual_seed(5)
    src = [(torch.randn(64, 128) * (i + 1) + 0.3).to(dtype) for i in range(7)]
    q = torch.randn(2, 128)
    o, lse = attn_res_phase1_pieces(q, src, 1e-6, 3)
    assert o.dtype == dtype and lse.dtype == torch.float32
    for m in range(2):
        ref = depth_mix([v.double() for v in src], q[m].double(), 1e-6)
        err = ((o[m].double() - ref).norm() / ref.norm()).item()
        assert err <= tol, err


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 8e-3)])
def test_two_phase_low_precision(dtype, tol):
    """fp32 / bf16 sources: both forms compute in fp32; the two-phase form rounds o to the sources' dtype once
    before the merge (2^-9 relative for bf16) and the output once, so bf16 differs by about 2^-8."""
    torch.manual_seed(3)
    src = [(torch.randn(64, 128) * (i + 1) + 0.3).to(dtype) for i in range(5)]
    q = torch.randn(128)
    ours, ref = two_phase(src[:4], src[4:], q, 1e-6), depth_mix(src, q, 1e-6)
    assert ours.dtype == ref.dtype == dtype
    err = ((ours.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err <= tol, err


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "two_phase"])
@pytest.mark.parametrize("mode", ["snapshot", "block_sum", "full"])
def test_mode_equals_plain_loop(mode, direct, perturb, monkeypatch):
    """Each mode's logits == a plain loop over the reference mixes (fp64), with the mixes computed in one pass
    (few tokens: DIRECT_TOKENS, or no gradient) or in two phases (a pass that builds a graph)."""
    import k3.model.attn_res as attn_res

    monkeypatch.setattr(attn_res, "DIRECT_TOKENS", 1 << 20 if direct else 0)
    cfg = get_preset("tiny").replace(**{"attn_res.mode": mode})
    torch.manual_seed(0)
    model = perturb(K3ForCausalLM(cfg).double().eval(), query_std=1.0, bias_std=0)
    tokens = torch.randint(0, 512, (9,))
    cu = torch.tensor([0, 9])
    with torch.set_grad_enabled(not direct):  # inference passes always mix in one pass
        ours = model(tokens[None]).logits[0].detach()
        ref = plain_loop(model, tokens, cu).detach()
    err = ((ours - ref).norm() / ref.norm()).item()
    assert err <= 1e-10, err


def test_none_mode_is_the_plain_residual():
    cfg = get_preset("tiny").replace(**{"attn_res.mode": "none"})
    model = K3ForCausalLM(cfg).double().eval()
    assert not any("_res_" in n for n, _ in model.named_parameters())
    tokens = torch.randint(0, 512, (6,))
    cu = torch.tensor([0, 6])
    with torch.no_grad():
        r = model.model.embed_tokens(tokens)
        for layer in model.model.layers:
            r = r + layer.self_attn(layer.input_layernorm(r), cu)
            h = layer.post_attention_layernorm(r)
            r = r + (layer.mlp(h) if hasattr(layer, "mlp") else layer.block_sparse_moe(h)[0])
        ref = model.lm_head(model.model.norm(r))
        ours = model(tokens[None]).logits[0]
    assert ((ours - ref).norm() / ref.norm()).item() <= 1e-12


@pytest.mark.parametrize("direct", [False, True], ids=["two_phase", "direct"])
@pytest.mark.parametrize(
    "mode,merge_sources,phase1_sources",
    [("snapshot", 4, 24), ("block_sum", 4, 24), ("full", 4, 24), ("full", 1, 24), ("full", 4, 2)],
    ids=["snapshot", "block_sum", "full", "full-fold", "full-pieces"],
)
def test_two_phase_model_equals_reference_mixes_with_gradients(
    mode, merge_sources, phase1_sources, direct, perturb, monkeypatch
):
    """The model's two-phase mixes (phase 1 batched per block, then one mix per phase 1 with a zero budget, then
    three) give the logits and every gradient of the reference mixes (the recording path), fp64; one mix with its
    own norm eps cuts a batch. Also the one-pass mixes of short passes (DIRECT_TOKENS), mode full's merges
    of one live source at a time, the block's earlier outputs folded in first (MERGE_SOURCES = 1), and its phase 1
    over the earlier blocks' outputs two at a time (PHASE1_SOURCES = 2)."""
    import k3.model.attn_res as attn_res

    monkeypatch.setattr(attn_res, "DIRECT_TOKENS", 1 << 20 if direct else 0)
    monkeypatch.setattr(attn_res, "MERGE_SOURCES", merge_sources)
    monkeypatch.setattr(attn_res, "PHASE1_SOURCES", phase1_sources)

    cfg = get_preset("tiny").replace(**{"attn_res.mode": mode})
    torch.manual_seed(0)
    model = perturb(K3ForCausalLM(cfg).double(), query_std=1.0, bias_std=0)
    model.model.layers[0].mlp_res_norm.eps = 1e-3
    tokens = torch.randint(0, 512, (2, 12))
    g = torch.randn(2, 12, cfg.vocab_size, dtype=torch.float64)

    def run(record):
        model.zero_grad()
        logits = model(tokens, record_attn_res=record).logits
        (logits * g).sum().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref_logits, ref_grads = run(True)
    for budget in (attn_res.TWO_PHASE_BYTES, 0, 3 * 24 * cfg.hidden_size * 8):
        monkeypatch.setattr(attn_res, "TWO_PHASE_BYTES", budget)
        logits, grads = run(False)
        assert ((logits - ref_logits).norm() / ref_logits.norm()).item() <= 1e-12
        assert grads.keys() == ref_grads.keys() and any("_res_proj" in n for n in grads)
        for n, b in ref_grads.items():
            assert ((grads[n] - b).norm() / b.norm().clamp_min(1e-30)).item() <= 1e-9, n


@pytest.mark.parametrize("mode", ["snapshot", "block_sum"])
def test_inference_mix_of_a_token_does_not_depend_on_its_pass(mode, perturb):
    """Without a gradient a token's mixes are the same whatever else its pass holds: rows 100..106 of a 600-token
    pass (above DIRECT_TOKENS) equal a 7-token pass of the same rows, bitwise in bf16, at every sub-layer and the
    output. (Phase 1 stores o in the sources' dtype and the one-pass mix does not: a pass that switched between
    them by its length made packed prefill differ from a prompt alone.)"""
    from k3.model.attn_res import DIRECT_TOKENS, ResidualStream

    cfg = get_preset("tiny").replace(**{"attn_res.mode": mode})
    torch.manual_seed(0)
    model = perturb(K3ForCausalLM(cfg), query_std=1.0, bias_std=0).cast(torch.bfloat16)
    n, d, layers = 600, cfg.hidden_size, model.model.layers
    assert n > DIRECT_TOKENS
    emb = torch.randn(n, d).bfloat16()
    outs = [torch.randn(n, d).bfloat16() * (i + 1) for i in range(2 * len(layers))]

    def inputs(rows):
        stream = ResidualStream(mode, cfg.attn_res.block_size, emb[rows], model.model.mixers())
        got = []
        for i, layer in enumerate(layers):
            for j, (sub, norm) in enumerate((("attn", layer.input_layernorm), ("mlp", layer.post_attention_layernorm))):
                got.append(stream.input(i, sub, norm))
                stream.add(outs[2 * i + j][rows])
        return got + [stream.output(model.model.norm)]

    with torch.no_grad():
        packed, alone = inputs(slice(0, n)), inputs(slice(100, 107))
    for k, (a, b) in enumerate(zip(packed, alone)):
        assert torch.equal(a[100:107], b), k
