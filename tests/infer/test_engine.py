"""Engine: continuous batching == full forward, prefix cache hit == miss, budgets, sampling."""

import pytest
import torch

import k3.infer.engine_outputs as engine_mod
from k3.config import get_preset
from k3.infer.engine import Engine
from k3.infer.prefix_cache import PrefixCache
from k3.infer.sampling import SamplingParams, sample_row
from k3.model.decoder import K3ForCausalLM


class IdTokenizer:
    """Decodes ids to space-separated numbers; EOS configurable."""

    def __init__(self, eos_id=None):
        self.eos_id = eos_id

    def decode(self, ids):
        return "".join(f" {i}" for i in ids)


@pytest.fixture(scope="module")
def model(perturb):
    torch.manual_seed(0)
    return perturb(K3ForCausalLM(get_preset("tiny")).eval())


def record_logits(monkeypatch):
    """The logits each sequence sampled from, per step, under its params' ``_tag``."""
    seen: dict[str, list[torch.Tensor]] = {}
    real = Engine._sample

    def spy(self, seqs, raw, scored):
        for seq, row in zip(seqs, raw):
            seen.setdefault(seq.params._tag, []).append(row.clone())
        return real(self, seqs, raw, scored)

    monkeypatch.setattr(Engine, "_sample", spy)
    return seen


def tagged(tag, **kw):
    p = SamplingParams(temperature=0, **kw)
    p._tag = tag
    return p


def full_forward_logits(model, prompt, generated):
    """Logits for every generated position from a full forward of the whole sequence (no cache)."""
    seq = torch.tensor(prompt + generated[:-1])[None]
    with torch.no_grad():
        return model(seq).logits[0, len(prompt) - 1 :]


@pytest.mark.parametrize("warm_up", [False, True])
def test_continuous_batching_equals_full_forward(model, monkeypatch, warm_up):
    """Different lengths, chunked prefill (chunk 16), sequences joining late (3 slots for 5 requests); after a
    warm-up too (it must leave nothing in the cache)."""
    seen = record_logits(monkeypatch)
    torch.manual_seed(1)
    lengths = [5, 37, 70, 1, 20]
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in lengths]
    eng = Engine(model, IdTokenizer(), max_batch=3, max_num_batched_tokens=16, max_context=256, warm_up=warm_up)
    results = eng.generate(prompts, [tagged(i, max_tokens=12) for i in range(5)])
    for i, (p, r) in enumerate(zip(prompts, results)):
        assert len(r["token_ids"]) == 12 and r["finish_reason"] == "length"
        got = torch.stack(seen[i])
        want = full_forward_logits(model, p, r["token_ids"])
        err = ((got - want).norm() / want.norm()).item()
        assert err <= 1e-4, (i, err)
        assert r["token_ids"] == want.argmax(-1).tolist()
    assert eng.reserved == 0 and sorted(eng.free_slots) == [0, 1, 2]


def test_warm_up_runs_the_ladder_and_empties_its_slots(model, monkeypatch):
    """Token counts 1, 2, 4, ... up to the budget, the budget, and each one less (odd sizes compile kernels of
    their own), in segments of half the context, longer where the slots need it; the largest pass whose segments
    can double runs once more, continuing its sequences; every slot ends empty."""
    eng = Engine(model, IdTokenizer(), max_batch=3, max_num_batched_tokens=40, max_context=24)
    passes = []
    real = type(model).forward

    def spy(self, ids, *args, cu_seqlens=None, seq_ids=None, cache=None, **kw):
        passes.append((ids.shape[1], cu_seqlens.diff().tolist(), list(seq_ids), [cache.seq_lens[i] for i in seq_ids]))
        return real(self, ids, *args, cu_seqlens=cu_seqlens, seq_ids=seq_ids, cache=cache, **kw)

    monkeypatch.setattr(type(model), "forward", spy)
    ladder = [1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 39, 40]
    assert eng.warm_up() == ladder
    assert [p[0] for p in passes] == [1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 32, 39, 40]
    assert passes[8][1:3] == ([12, 12, 7], [0, 1, 2])  # the odd pass ends in an odd segment
    assert passes[9][1:3] == ([12, 12, 8], [0, 1, 2])
    assert passes[10][3] == [12, 12, 8]  # the continuing pass starts where the last one ended
    assert passes[-1][1] == [14, 14, 12]  # 40 tokens fit 3 slots in segments of 14
    assert eng.cache.seq_lens == [0, 0, 0] and eng.free_slots == [0, 1, 2]
    for layer in eng.cache.layers:
        if hasattr(layer, "recurrent"):
            assert not layer.recurrent.any() and not any(c.any() for c in layer.conv)


def test_prefix_cache_hit_equals_miss(model, monkeypatch):
    seen = record_logits(monkeypatch)
    torch.manual_seed(2)
    shared = torch.randint(0, 512, (100,)).tolist()
    first, second = shared + [1, 2, 3], shared + [7, 8, 9, 10, 11]
    cached = Engine(
        model, IdTokenizer(), max_batch=2, max_num_batched_tokens=32, block_size=16, prefix_cache_bytes=10**8
    )
    cached.generate([first], tagged("first", max_tokens=4))
    hit = cached.generate([second], tagged("hit", max_tokens=6))[0]
    assert hit["cached_tokens"] == 96  # blocks of 16 up to the last chunk end inside the shared prefix
    plain = Engine(model, IdTokenizer(), max_batch=2, max_num_batched_tokens=32)
    miss = plain.generate([second], tagged("miss", max_tokens=6))[0]
    assert hit["token_ids"] == miss["token_ids"]
    a, b = torch.stack(seen["hit"]), torch.stack(seen["miss"])
    assert ((a - b).norm() / b.norm()).item() <= 1e-5
    assert cached.prefix.hits == 1


def test_prefix_cache_fills_from_a_prompt_shorter_than_the_chunk(model, monkeypatch):
    """A prompt that fits one prefill chunk is fed up to its last block boundary, then its tail: the cache gets the
    KDA state at the boundary, and the output equals a plain engine's."""
    seen = record_logits(monkeypatch)
    torch.manual_seed(5)
    shared = torch.randint(0, 512, (100,)).tolist()
    eng = Engine(model, IdTokenizer(), max_batch=2, max_num_batched_tokens=256, block_size=16, prefix_cache_bytes=10**8)
    first = eng.generate([shared + [1, 2]], tagged("first", max_tokens=3))[0]
    hit = eng.generate([shared + [7, 8, 9]], tagged("hit", max_tokens=5))[0]
    assert first["cached_tokens"] == 0 and hit["cached_tokens"] == 96
    plain = Engine(model, IdTokenizer(), max_batch=2, max_num_batched_tokens=256)
    miss = plain.generate([shared + [7, 8, 9]], tagged("miss", max_tokens=5))[0]
    assert hit["token_ids"] == miss["token_ids"]
    a, b = torch.stack(seen["hit"]), torch.stack(seen["miss"])
    assert ((a - b).norm() / b.norm()).item() <= 1e-5


def test_prefix_cache_resumes_after_generated_text(model):
    """Blocks completed during decode are cached too: a follow-up turn resumes past the first answer."""
    torch.manual_seed(3)
    prompt = torch.randint(0, 512, (40,)).tolist()
    eng = Engine(model, IdTokenizer(), max_batch=1, max_num_batched_tokens=16, block_size=16, prefix_cache_bytes=10**8)
    out = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=30))[0]
    follow = prompt + out["token_ids"] + [5, 6, 7]
    again = eng.generate([follow], SamplingParams(temperature=0, max_tokens=2))[0]
    assert again["cached_tokens"] == 64  # 70 tokens fed before; blocks end at 16, 32, 48 (prefill) and 64 (decode)


def test_eviction_holds_the_budget(model):
    torch.manual_seed(4)
    probe = PrefixCache(16, 10**9)
    eng = Engine(model, IdTokenizer(), max_batch=2, max_num_batched_tokens=16, block_size=16, prefix_cache_bytes=60_000)
    for _ in range(8):
        eng.generate([torch.randint(0, 512, (50,)).tolist()], SamplingParams(temperature=0, max_tokens=2))
        assert eng.prefix.nbytes <= 60_000
    assert eng.prefix.evictions > 0
    for key, entry in eng.prefix.entries.items():  # chains erode from the tip: every parent is still there
        assert entry.parent is None or entry.parent in eng.prefix.entries
    assert probe.keys([1] * 40) == probe.keys([1] * 47)  # only full blocks are keyed


def test_memory_budget_admits_or_queues(model):
    eng = Engine(model, IdTokenizer(), max_batch=8, max_num_batched_tokens=64, max_context=512)
    per_request = eng.context_bytes(10 + 8)
    eng.memory_budget = 2 * per_request
    for _ in range(4):
        eng.add(list(range(10)), SamplingParams(temperature=0, max_tokens=8))
    eng.step()
    assert len(eng.running) == 2 and len(eng.waiting) == 2 and eng.reserved <= eng.memory_budget
    while eng.has_work():
        eng.step()
        assert eng.reserved <= eng.memory_budget
    assert eng.reserved == 0
    with pytest.raises(ValueError, match="more than the whole budget"):
        eng.add(list(range(200)), SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="exceeds the context limit"):
        eng.add(list(range(500)), SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="temperature"):
        eng.add([1, 2], SamplingParams(temperature=-1))


def test_compiled_decode_needs_cuda_graphs_and_its_whole_cache_in_the_budget(model):
    with pytest.raises(ValueError, match="compile_decode .* needs cuda_graphs"):
        Engine(model, IdTokenizer(), max_batch=2, cuda_graphs=False, compile_decode=True)
    per_sequence = Engine(model, IdTokenizer(), max_batch=2, max_context=256).context_bytes(256)
    with pytest.raises(ValueError, match="more than memory_budget"):  # checked before any CUDA graph
        Engine(
            model,
            IdTokenizer(),
            max_batch=2,
            max_context=256,
            memory_budget=per_sequence,
            cuda_graphs=True,
            compile_decode=True,
        )


def test_seeded_sampling_is_batch_independent(model):
    torch.manual_seed(5)
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (9, 30, 17)]
    params = [SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=s, max_tokens=10) for s in (1, 2, 3)]
    together = Engine(model, IdTokenizer(), max_batch=3).generate(prompts, params)
    alone = [Engine(model, IdTokenizer(), max_batch=1).generate([p], [sp])[0] for p, sp in zip(prompts, params)]
    assert [r["token_ids"] for r in together] == [r["token_ids"] for r in alone]


def test_stops_eos_and_abort(model):
    torch.manual_seed(6)
    prompt = torch.randint(0, 512, (12,)).tolist()
    greedy = Engine(model, IdTokenizer(), max_batch=2).generate([prompt], SamplingParams(temperature=0, max_tokens=8))[
        0
    ]
    third = greedy["token_ids"][2]
    eos = Engine(model, IdTokenizer(eos_id=third), max_batch=2)
    r = eos.generate([prompt], SamplingParams(temperature=0, max_tokens=8))[0]
    assert r["finish_reason"] == "stop" and r["token_ids"] == greedy["token_ids"][:3]
    assert r["text"] == "".join(f" {t}" for t in greedy["token_ids"][:2])  # the EOS itself is not text
    stop_text = f" {greedy['token_ids'][4]}"
    s = Engine(model, IdTokenizer(), max_batch=2).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=8, stop=[stop_text])
    )[0]
    assert s["finish_reason"] == "stop" and stop_text not in s["text"]
    eng = Engine(model, IdTokenizer(), max_batch=1)
    rid = eng.add(prompt, SamplingParams(temperature=0, max_tokens=50))
    eng.step()
    eng.abort(rid)
    assert not eng.has_work() and eng.free_slots == [0] and eng.reserved == 0


def test_logprobs_are_the_full_forward_log_softmax(model):
    """Each generated token's log-probability and its top-n alternatives equal the log-softmax of a full forward's
    logits at that position (batched, chunked, with temperature and top-k: they are the model's, not the
    sampler's); logprobs=0 gives no alternatives; a stop token has its entry too (flagged); the default has none."""
    torch.manual_seed(7)
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (6, 40)]
    params = [
        SamplingParams(temperature=0.8, top_k=40, seed=3, max_tokens=9, logprobs=5),
        SamplingParams(temperature=0, max_tokens=9, logprobs=0),
    ]
    results = Engine(model, IdTokenizer(), max_batch=2, max_num_batched_tokens=16).generate(prompts, params)
    for p, r, n in zip(prompts, results, (5, 0)):
        want = full_forward_logits(model, p, r["token_ids"]).double().log_softmax(-1)
        lps = r["logprobs"]
        assert [e.token_id for e in lps] == r["token_ids"] and len(lps) == 9
        got = torch.tensor([e.logprob for e in lps], dtype=torch.float64)
        chosen = want.gather(1, torch.tensor(r["token_ids"])[:, None])[:, 0]
        assert (got - chosen).abs().max() <= 1e-4, (got - chosen).abs().max()  # fp32 cache path vs full forward
        if n == 0:  # greedy: the likeliest token
            assert torch.equal(chosen, want.max(-1).values)
        for e, row in zip(lps, want):
            assert len(e.top) == n
            if n:
                ids, vals = zip(*e.top)
                top = row.topk(n)
                assert list(ids) == top.indices.tolist() and max(abs(a - b) for a, b in zip(vals, top.values)) <= 1e-4
    greedy = results[1]["token_ids"]
    eos = Engine(model, IdTokenizer(eos_id=greedy[2]), max_batch=1)
    eos.add(prompts[1], SamplingParams(temperature=0, max_tokens=9, logprobs=1))
    outs = [o for _ in range(12) for o in eos.step()]
    assert [o.token_ids[0] for o in outs] == greedy[:3] and [o.logprobs[0].token_id for o in outs] == greedy[:3]
    assert [o.stop_token for o in outs] == [False, False, True] and outs[-1].finish_reason == "stop"
    assert outs[-1].logprobs[0].logprob == results[1]["logprobs"][2].logprob
    plain = Engine(model, IdTokenizer(), max_batch=1).generate([prompts[0]], SamplingParams(max_tokens=2))[0]
    assert "logprobs" not in plain
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21).validate()


def test_logprobs_follow_the_returned_text(model):
    """With stop strings, a token's log-probability goes out with its text: while text is held back (it may start a
    stop string) its tokens' entries are held too; at a stop string's cut, the tokens whose text starts before the
    cut keep theirs (one across the cut included) and those after it get none. Streamed step by step, the entries
    out before the end never cover more text than was returned."""
    torch.manual_seed(6)
    prompt = torch.randint(0, 512, (12,)).tolist()
    free = Engine(model, IdTokenizer(), max_batch=1).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, logprobs=2)
    )[0]
    tokens, pieces = free["token_ids"], [f" {t}" for t in free["token_ids"]]
    full, stop = "".join(pieces), pieces[6][1:] + pieces[7]  # starts inside token 6's text, ends with token 7's
    assert full.index(stop) == len("".join(pieces[:6])) + 1
    engine = Engine(model, IdTokenizer(), max_batch=1)
    engine.add(prompt, SamplingParams(temperature=0, max_tokens=12, logprobs=2, stop=[stop]))
    text, released = "", []
    while engine.has_work():
        for out in engine.step():
            text += out.text
            released += out.logprobs
            if not out.finished:
                assert text.startswith("".join(f" {e.token_id}" for e in released))  # never ahead of the text
    assert out.finish_reason == "stop" and out.completion_tokens == 8 and text == "".join(pieces[:6]) + " "
    assert [e.token_id for e in released] == tokens[:7]  # 0..5 whole, 6 across the cut; 7 (after it) has none
    assert [e.logprob for e in released] == [e.logprob for e in free["logprobs"][:7]]


def test_prompt_logprobs_score_the_prompt(model):
    """prompt_logprobs: None for the first token, then each prompt token's log-probability (and top-n) equal to the
    full forward's log-softmax, over several prefill chunks, beside a decoding request, with the prefix cache on
    (a scored prompt bypasses it: its cached blocks would skip logits); max_tokens=0 only scores."""
    torch.manual_seed(8)
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (40, 40, 23, 1)]
    eng = Engine(model, IdTokenizer(), max_batch=4, max_num_batched_tokens=16, prefix_cache_bytes=1 << 24, block_size=8)
    eng.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=2))  # caches blocks of prompt 0
    params = [
        SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=2),
        SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0, logprobs=1),
        SamplingParams(temperature=0, max_tokens=12),
        SamplingParams(max_tokens=0, prompt_logprobs=3),
    ]
    results = eng.generate(prompts, params)
    for p, r, sp in zip(prompts, results, params):
        if sp.prompt_logprobs is None:
            assert "prompt_logprobs" not in r
            continue
        plp = r["prompt_logprobs"]
        assert plp[0] is None and [e.token_id for e in plp[1:]] == p[1:]
        assert r["cached_tokens"] == 0 and len(r["token_ids"]) == sp.max_tokens
        if len(p) > 1:
            with torch.no_grad():
                want = model(torch.tensor(p)[None]).logits[0, :-1].double().log_softmax(-1)
            got = torch.tensor([e.logprob for e in plp[1:]], dtype=torch.float64)
            assert (got - want.gather(1, torch.tensor(p[1:])[:, None])[:, 0]).abs().max() <= 1e-4
            n = sp.prompt_logprobs
            assert all([i for i, _ in e.top] == row.topk(n).indices.tolist() for e, row in zip(plp[1:], want))
    assert results[0]["finish_reason"] == "length" and results[0]["text"] == "" and "logprobs" not in results[0]
    solo = Engine(model, IdTokenizer(), max_batch=1).generate([prompts[1], prompts[2]], params[1:3])
    assert [r["token_ids"] for r in solo] == [r["token_ids"] for r in results[1:3]]  # beside scored passes
    want = full_forward_logits(model, prompts[1], results[1]["token_ids"]).double().log_softmax(-1)
    got = torch.tensor([e.logprob for e in results[1]["logprobs"]], dtype=torch.float64)
    assert (got - want.max(-1).values).abs().max() <= 1e-4  # greedy: the likeliest, after a scored prompt
    eng.add(prompts[0], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1))
    handed = [o.prompt_logprobs is not None for _ in range(8) for o in eng.step()]
    assert handed == [True, False, False]  # once, with the first output
    assert eng.reserved == 0 and not eng.has_work()
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0).validate()
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1).validate()


def test_presence_and_frequency_penalties_follow_openais_rule(model):
    """Greedy with penalties: each token is the argmax of the full forward's logits minus frequency * (times
    generated so far) minus presence * (generated at all); the prompt's tokens are not penalised."""
    torch.manual_seed(9)
    prompt = torch.randint(0, 512, (10,)).tolist()
    params = SamplingParams(temperature=0, max_tokens=16, presence_penalty=1.5, frequency_penalty=0.7)
    out = Engine(model, IdTokenizer(), max_batch=1).generate([prompt], params)[0]["token_ids"]
    logits = full_forward_logits(model, prompt, out)
    for j, row in enumerate(logits):
        counts = torch.bincount(torch.tensor(out[:j], dtype=torch.long), minlength=row.numel()).float()
        assert out[j] == int((row - 0.7 * counts - 1.5 * (counts > 0).float()).argmax()), j
    plain = Engine(model, IdTokenizer(), max_batch=1).generate([prompt], SamplingParams(temperature=0, max_tokens=16))[
        0
    ]
    assert plain["token_ids"] != out  # the penalties changed the greedy path (it repeats tokens unpenalised)
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(presence_penalty=True)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad).validate()


def test_sampling_rules():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    rep = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sample_row(logits, rep, 0, 0, seen=[3]) == 0  # 3.0 / 2 < 2.0
    assert sample_row(torch.tensor([-2.0, -1.5]), rep, 0, 0, seen=[1]) == 0  # -1.5 * 2 < -2.0
    assert sample_row(logits, SamplingParams(temperature=1.0, top_k=1), 0, 0) == 3
    assert sample_row(logits, SamplingParams(temperature=1.0, top_p=0.01), 0, 0) == 3
    draws = {sample_row(logits, SamplingParams(temperature=1.0, top_k=2), 7, n) for n in range(50)}
    assert draws == {0, 3}
    for bad in (
        dict(max_tokens=0),
        dict(top_p=0.0),
        dict(top_k=-1),
        dict(stop=[""]),
        dict(repetition_penalty=0),
        dict(seed=2**64),
        dict(temperature=True),
        dict(min_p=1.5),
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad).validate()


def test_sampler_refuses_what_it_cannot_compute():
    for params in (
        SamplingParams(temperature=-1e-40),
        SamplingParams(repetition_penalty=1e-40),
        SamplingParams(temperature=float("nan")),
    ):
        with pytest.raises(ValueError, match="temperature|repetition_penalty"):
            params.validate()
    SamplingParams(temperature=0.01, repetition_penalty=0.01).validate()
    SamplingParams(temperature=1e-40).validate()  # OpenAI takes it: it samples at 0.01, finite
    logits = torch.tensor([10.0, 9.0, -3.0])
    assert sample_row(logits, SamplingParams(temperature=1e-40), 5, 0) == 0
    with pytest.raises(ValueError, match="not finite"):
        sample_row(torch.full((10,), float("nan")), SamplingParams(temperature=1.0), 0, 0)


def test_a_sequence_that_fails_in_sampling_ends_alone(model, monkeypatch):
    """Its output carries the error and frees its slot; the others of the step produce what they would alone."""
    real = engine_mod.sample_batch

    def sampler(logits, rows, *tables):  # any batch holding the victim's row (seed 4242) raises
        if bool((rows.seeds == 4242).any()):
            raise RuntimeError("simulated sampler failure")
        return real(logits, rows, *tables)

    monkeypatch.setattr(engine_mod, "sample_batch", sampler)
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    alone = [Engine(model, IdTokenizer(), max_batch=4).generate([p], greedy)[0]["token_ids"] for p in prompts]
    engine = Engine(model, IdTokenizer(), max_batch=4)
    victim = SamplingParams(max_tokens=5, temperature=0, seed=4242)
    out = engine.generate(prompts[:1] + [[1, 2]] + prompts[1:], [greedy, victim, greedy, greedy])
    assert [o["token_ids"] for i, o in enumerate(out) if i != 1] == alone
    assert out[1]["finish_reason"] == "error" and "simulated sampler failure" in out[1]["error"]
    assert not engine.has_work() and len(engine.free_slots) == 4
