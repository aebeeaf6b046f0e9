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
    """The model's forward with the residual logic rewritten from spec §5 for every mode."""
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
            bank = [emb + sum(outputs[:2 * b * bsize]) if b else emb for b in range(layer // bsize + 1)]
            return bank + [r]
        # block_sum: blocks of 2*bsize sub-layers; b_0 = embedding
        n = i_sub // (2 * bsize)
        blocks = [emb] + [sum(outputs[2 * bsize * j:2 * bsize * (j + 1)]) for j in range(n)]
        partial = outputs[2 * bsize * n:i_sub]
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
        final = [emb] + [sum(outputs[2 * bsize * j:2 * bsize * (j + 1)]) for j in range(n_done)]
        if len(outputs) % (2 * bsize):
            final.append(sum(outputs[2 * bsize * n_done:]))
    h = mix_eq(final, model.model.output_attn_res_norm, model.model.output_attn_res_proj)
    return model.lm_head(model.model.norm(h))


def test_zero_init_gives_uniform_depth_weights():
    model = K3ForCausalLM(get_preset("tiny"))
    projs = [p for n, p in model.named_parameters() if n.endswith("_res_proj.weight")]
    assert len(projs) == 2 * 5 + 1 and all((p == 0).all() for p in projs)
    torch.manual_seed(0)
    src = torch.randn(5, 7, 64) * torch.rand(5, 1, 1) * 10
    out = depth_mix(list(src), torch.zeros(64), 1e-5)
    assert torch.allclose(out, src.mean(0), atol=1e-6)


def test_lean_depth_mix_equals_reference_with_gradients():
    from k3.ops.attn_res.lean import depth_mix as lean

    torch.manual_seed(1)
    src = [(torch.randn(9, 16, dtype=torch.float64) * (i + 1)).requires_grad_() for i in range(4)]
    q = torch.randn(16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda qq, *s: lean(list(s), qq, 1e-5), [q, *src])
    g = torch.randn(9, 16, dtype=torch.float64)
    (lean(src, q, 1e-5) * g).sum().backward()
    ours = [t.grad.clone() for t in [q, *src]]
    for t in [q, *src]:
        t.grad = None
    (depth_mix(src, q, 1e-5) * g).sum().backward()
    for a, b in zip(ours, [t.grad for t in [q, *src]]):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", ["snapshot", "block_sum", "full"])
def test_mode_equals_plain_loop(mode, perturb):
    cfg = get_preset("tiny").replace(**{"attn_res.mode": mode})
    torch.manual_seed(0)
    model = perturb(K3ForCausalLM(cfg).double().eval(), query_std=1.0, bias_std=0)
    tokens = torch.randint(0, 512, (9,))
    cu = torch.tensor([0, 9])
    with torch.no_grad():
        ours = model(tokens[None]).logits[0]
        ref = plain_loop(model, tokens, cu)
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


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6), (torch.bfloat16, 8e-3)])
def test_stacked_depth_mix_equals_reference(dtype, tol):
    """Fixed sources stacked once (growing between mixes, eps changing once) + live ones == the reference mix of the
    whole list. bf16: both paths compute in fp32 from the same bf16 sources; only the final rounding to bf16
    (2^-8 relative) and summation order differ."""
    from k3.ops.attn_res.stacked import FixedSources
    from k3.ops.attn_res.stacked import depth_mix as stacked

    torch.manual_seed(2)
    fixed = FixedSources()
    sources = []
    for step, eps in enumerate([1e-5, 1e-5, 1e-6]):
        sources += [(torch.randn(6, 32) * (step + 1) + 0.3).to(dtype) for _ in range(2)]
        live = [(torch.randn(6, 32) * 3).to(dtype)]
        q = torch.randn(32, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
        fixed.sync(sources, eps)
        ours = stacked(fixed, live, q, eps, dtype)
        ref = depth_mix(sources + live, q, eps)
        assert ours.dtype == ref.dtype == dtype and fixed.count == len(sources)
        err = ((ours.double() - ref.double()).norm() / ref.double().norm()).item()
        assert err <= tol, (step, err)


@pytest.mark.parametrize("mode", ["snapshot", "block_sum", "full"])
def test_stacked_inference_path_equals_the_source_list_path(mode, perturb, monkeypatch):
    """No-grad passes stack their fixed sources; the logits equal those of the plain source-list path (budget 0)
    and of a pass that outgrows the budget half-way, in fp32; a pass with autograd never stacks."""
    import k3.model.attn_res as attn_res

    cfg = get_preset("tiny").replace(**{"attn_res.mode": mode})
    torch.manual_seed(0)
    model = perturb(K3ForCausalLM(cfg).eval(), query_std=1.0, bias_std=0)
    tokens = torch.randint(0, 512, (2, 12))
    with torch.no_grad():
        stacked = model(tokens).logits
        monkeypatch.setattr(attn_res, "STACK_BYTES", 0)
        plain = model(tokens).logits
        monkeypatch.setattr(attn_res, "STACK_BYTES", 2 * 24 * cfg.hidden_size * 4)  # two sources of 24 tokens
        switched = model(tokens).logits
    for other in (plain, switched):
        err = ((stacked - other).norm() / other.norm()).item()
        assert err <= 1e-6, err
    emb = torch.randn(4, cfg.hidden_size)
    assert attn_res.ResidualStream(mode, 2, emb).fixed is None  # autograd on: the source-list path
    with torch.no_grad():
        assert attn_res.ResidualStream(mode, 2, emb).fixed is not None
