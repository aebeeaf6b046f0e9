"""Whole-model tests on the ``tiny`` preset: branches, packing, cache consistency, meta builds."""

import time

import pytest
import torch

from k3.config import PRESETS, get_preset
from k3.model.decoder import K3ForCausalLM
from k3.model.kda import KimiDeltaAttention
from k3.model.mla import MultiheadLatentAttention
from tests.helpers import KIMI_LINEAR_STYLE, rel


@pytest.fixture(scope="module")
def tiny_model(perturb):
    torch.manual_seed(0)
    return perturb(K3ForCausalLM(get_preset("tiny")).eval())


def test_tiny_hits_every_branch(tiny_model):
    cfg = tiny_model.config
    kinds = {(cfg.mixer(i), cfg.ffn(i)) for i in range(cfg.num_hidden_layers)}
    assert kinds == {("kda", "dense"), ("kda", "moe"), ("mla", "moe")}
    assert cfg.mixer(cfg.num_hidden_layers - 1) == "mla"
    assert cfg.num_hidden_layers % cfg.attn_res.block_size != 0  # a partial last AttnRes block
    assert cfg.moe.latent_size is not None and cfg.kda.gate_lower_bound is not None and cfg.mla.output_gate
    layers = tiny_model.model.layers
    assert isinstance(layers[0].self_attn, KimiDeltaAttention) and hasattr(layers[0], "mlp")
    assert isinstance(layers[4].self_attn, MultiheadLatentAttention) and hasattr(layers[4], "block_sparse_moe")


def test_tiny_forward_shapes_and_router_stats(tiny_model):
    x = torch.randint(0, 512, (2, 64))
    with torch.no_grad():
        out = tiny_model(x)
    assert out.logits.shape == (2, 64, 512) and torch.isfinite(out.logits).all()
    assert len(out.router_stats) == 4 and [s.layer for s in out.router_stats] == [1, 2, 3, 4]


def test_packed_equals_separate_documents(tiny_model):
    torch.manual_seed(1)
    lengths = [23, 1, 40, 16]
    docs = [torch.randint(0, 512, (1, n)) for n in lengths]
    cu = torch.tensor([0] + lengths).cumsum(0)
    with torch.no_grad():
        packed = tiny_model(torch.cat(docs, 1), cu_seqlens=cu).logits[0]
        separate = torch.cat([tiny_model(d).logits[0] for d in docs])
    assert rel(packed, separate) <= 1e-5


def test_rows_with_documents_match_flat_packing(tiny_model):
    torch.manual_seed(2)
    x = torch.randint(0, 512, (2, 24))
    cu = torch.tensor([0, 10, 24, 30, 48])
    with torch.no_grad():
        two_rows = tiny_model(x, cu_seqlens=cu).logits.reshape(48, -1)
        one_row = tiny_model(x.reshape(1, 48), cu_seqlens=cu).logits[0]
    assert rel(two_rows, one_row) <= 1e-6


VARIANTS = {
    "k3": {},
    "kimi_linear": KIMI_LINEAR_STYLE,
    "block_sum": {"attn_res.mode": "block_sum"},
    "full_rope": {"attn_res.mode": "full", "mla.rope_theta": 10000.0},
    "narrow_values": {"kda.v_head_dim": 8},
}  # q|k|v of unequal widths (one stacked conv, its states split)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chunked_prefill_and_decode_reproduce_full_logits(tiny_model, variant):
    """Sequences of different lengths: prefill in chunks of 7 (sequences join and drop out), then decode."""
    if variant != "k3":
        torch.manual_seed(0)
        tiny_model = K3ForCausalLM(get_preset("tiny").replace(**VARIANTS[variant])).eval()
    torch.manual_seed(3)
    total = [37, 20, 45]
    prompt = [25, 9, 33]
    seqs = [torch.randint(0, 512, (n,)) for n in total]
    with torch.no_grad():
        full = [tiny_model(s[None]).logits[0] for s in seqs]
        cache = tiny_model.new_cache(3)
        got = [[] for _ in seqs]
        pos = [0, 0, 0]

        def step(ids, take):
            pieces = [seqs[i][pos[i] : pos[i] + n] for i, n in zip(ids, take)]
            cu = torch.tensor([0] + take).cumsum(0)
            logits = tiny_model(torch.cat(pieces)[None], cu_seqlens=cu, cache=cache, seq_ids=ids).logits[0]
            for i, a, b in zip(ids, cu[:-1].tolist(), cu[1:].tolist()):
                got[i].append(logits[a:b])
                pos[i] += b - a

        while any(p < q for p, q in zip(pos, prompt)):  # chunked prefill
            ids = [i for i in range(3) if pos[i] < prompt[i]]
            step(ids, [min(7, prompt[i] - pos[i]) for i in ids])
        while any(p < n for p, n in zip(pos, total)):  # token-by-token decode
            ids = [i for i in range(3) if pos[i] < total[i]]
            step(ids, [1] * len(ids))
    assert cache.seq_lens == total
    for i in range(3):
        err = rel(torch.cat(got[i]), full[i])
        assert err <= 1e-4, f"sequence {i}: relative error {err:.2e}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_decode_step_reproduces_full_logits(tiny_model, variant):
    """The sync-free decode step (what CUDA graphs capture): prefill two of three sequences, then decode subsets
    in scrambled slot order while the third joins; the MLA cache starts small so it has to grow."""
    if variant != "k3":
        torch.manual_seed(0)
        tiny_model = K3ForCausalLM(get_preset("tiny").replace(**VARIANTS[variant])).eval()
    torch.manual_seed(4)
    total, prompt = [30, 22, 26], [12, 5, 9]
    seqs = [torch.randint(0, 512, (n,)) for n in total]
    with torch.no_grad():
        full = [tiny_model(s[None]).logits[0] for s in seqs]
        cache = tiny_model.new_cache(3, capacity=8)
        got = [[] for _ in seqs]
        for i in (0, 2):
            got[i].append(tiny_model(seqs[i][None, : prompt[i]], cache=cache, seq_ids=[i]).logits[0])
        pos = [prompt[0], 0, prompt[2]]
        while any(p < n for p, n in zip(pos, total)):
            if pos[1] == 0 and pos[0] >= 16:  # sequence 1 joins mid-way
                got[1].append(tiny_model(seqs[1][None, : prompt[1]], cache=cache, seq_ids=[1]).logits[0])
                pos[1] = prompt[1]
            ids = [i for i in (2, 0, 1) if 0 < pos[i] < total[i]]
            logits = tiny_model.decode(torch.stack([seqs[i][pos[i]] for i in ids]), cache, ids)
            for i, row in zip(ids, logits):
                got[i].append(row[None])
                pos[i] += 1
    assert cache.seq_lens == total and cache.capacity >= max(total)
    for i in range(3):
        err = rel(torch.cat(got[i]), full[i])
        assert err <= 1e-4, f"sequence {i}: relative error {err:.2e}"


@pytest.mark.slow
def test_compiled_decode_step_equals_eager(tiny_model):
    """decode_step under torch.compile with GraphedDecoder's options (what GraphedDecoder(compile=True) records) ==
    eager: logits, and the cache's in-place updates (KDA and conv states, MLA rows) reach the real cache tensors;
    three steps of 3 sequences in scrambled slot order. fp32, inductor on the CPU (~1 minute: the reference experts
    recompile per routing). The CPU backend accepts but ignores combo_kernels (it groups GPU kernels only): that
    option is covered by tests/gpu's compiled graph-decode test."""
    torch.manual_seed(5)
    prompt = torch.randint(0, 512, (3, 6))
    ids = torch.randint(0, 512, (3, 3))
    caches, logits = [], []
    from k3.infer.graphs import COMPILE_OPTIONS

    for step in (tiny_model.decode_step, torch.compile(tiny_model.decode_step, dynamic=False, options=COMPILE_OPTIONS)):
        with torch.no_grad():
            cache = tiny_model.new_cache(3, capacity=16)
            tiny_model(prompt, cache=cache)
            out = []
            for t in range(3):
                order = [2, 0, 1]
                slots, pos = torch.tensor(order), torch.tensor([cache.seq_lens[i] for i in order])
                out.append(step(ids[order, t], cache, slots, pos).clone())
                cache.advance_decode(order)
        caches.append(cache)
        logits.append(torch.stack(out))
    assert rel(logits[1], logits[0]) <= 1e-5
    for a, b in zip(caches[1].layers, caches[0].layers):
        for x, y in (
            ([(a.recurrent, b.recurrent)] + list(zip(a.conv, b.conv))) if hasattr(a, "recurrent") else [(a.kv, b.kv)]
        ):
            assert rel(x, y) <= 1e-5


def test_decode_step_in_bf16_matches_forward(tiny_model):
    """bf16 weights and cache, no autocast: the step path and the packed forward agree to bf16 rounding."""
    torch.manual_seed(5)
    model = K3ForCausalLM(tiny_model.config)
    model.load_state_dict(tiny_model.state_dict())
    model.cast(torch.bfloat16).eval()
    ids = torch.randint(0, 512, (2, 10))
    with torch.no_grad():
        a, b = model.new_cache(2), model.new_cache(2)
        model(ids[:, :9], cache=a)
        model(ids[:, :9], cache=b)
        ref = model(ids[:, 9:], cache=a, last_only=True).logits
        got = model.decode(ids[:, 9], b, [0, 1])
    assert got.dtype == torch.bfloat16 and rel(got, ref) <= 2e-2  # a few bf16 roundings (2^-8) apart
    for x, y in zip(a.layers, b.layers):
        for u, v in (
            [(x.recurrent, y.recurrent)] + list(zip(x.conv, y.conv))
            if hasattr(x, "recurrent")
            else [(x.rows(0), y.rows(0)), (x.rows(1), y.rows(1))]
        ):
            assert rel(v, u) <= 2e-2


def test_decode_rejects_bad_slots(tiny_model):
    cache = tiny_model.new_cache(2)
    with pytest.raises(ValueError, match="distinct seq_ids"):
        tiny_model.decode(torch.tensor([1, 2]), cache, [0, 0])
    with pytest.raises(ValueError, match="distinct seq_ids"):
        tiny_model.decode(torch.tensor([1]), cache, [2])


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_builds_on_meta(name):
    cfg = get_preset(name)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    assert time.perf_counter() - t0 < 30
    assert all(p.is_meta for p in model.parameters())
    assert len(model.model.layers) == cfg.num_hidden_layers


def test_bad_inputs_raise_clear_errors(tiny_model):
    x = torch.randint(0, 512, (2, 8))
    with pytest.raises(ValueError, match="row boundary"):
        tiny_model(x, cu_seqlens=torch.tensor([0, 3, 16]))
    with pytest.raises(ValueError, match="strictly increasing"):
        tiny_model(x, cu_seqlens=torch.tensor([0, 8, 8, 16]))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        tiny_model(x[0])
    with pytest.raises(ValueError, match="cache holds"):
        tiny_model(x, cache=tiny_model.new_cache(3))
    with pytest.raises(ValueError, match="distinct cached sequences"):
        tiny_model(x, cache=tiny_model.new_cache(3), seq_ids=[0, 0])


def test_cast_keeps_router_and_gate_params_fp32():
    model = K3ForCausalLM(get_preset("tiny")).cast(torch.bfloat16)
    dtypes = {n: t.dtype for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    assert dtypes["model.layers.1.block_sparse_moe.gate.e_score_correction_bias"] == torch.float32
    assert dtypes["model.layers.1.block_sparse_moe.gate.weight"] == torch.float32
    assert dtypes["model.layers.0.self_attn.A_log"] == torch.float32
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == torch.bfloat16
    out = model(torch.randint(0, 512, (1, 12)))
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.logits.float()).all()


def test_backward_reaches_every_trainable_parameter(perturb):
    model = perturb(K3ForCausalLM(get_preset("tiny")), bias_std=0)
    x = torch.randint(0, 512, (2, 20))
    out = model(x)
    loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), x.flatten())
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    # with 8 experts, top-2 and 40 tokens per layer some experts may get no tokens: allow only expert stacks
    assert all(".experts." in n for n in missing), missing
