"""Scheduling: a request's sequences enter together, groups are admitted fairly, overlapped steps and mixed
prefill / decode passes give every request what it gets alone."""

import pytest
import torch

from k3.config import get_preset
from k3.infer.engine import Engine, Request
from k3.infer.sampling import SamplingParams
from k3.model.decoder import K3ForCausalLM


class IdTokenizer:
    eos_id = None

    def decode(self, ids):
        return "".join(f" {i}" for i in ids)


@pytest.fixture(scope="module")
def model(perturb):
    torch.manual_seed(0)
    return perturb(K3ForCausalLM(get_preset("tiny")).eval())


def test_many_sequences_enter_in_one_message_all_or_none(model):
    eng = Engine(model, IdTokenizer(), max_batch=4)
    good = SamplingParams(temperature=0, max_tokens=2)
    with pytest.raises(ValueError, match="choice 2: .*temperature"):
        eng.add_many([Request([1, 2], good), Request([3], good), Request([4], SamplingParams(temperature=-1))])
    assert not eng.waiting  # nothing of the refused request was queued
    ids = eng.add_many([Request([1, 2, i % 500], good) for i in range(64 * 16)], group="big")
    assert len(ids) == 1024 and len(eng.waiting) == 1024
    eng.step()
    assert len(eng.running) == 4  # admitted as slots allow, from the one message


def test_a_small_request_is_not_starved_by_a_large_one(model):
    """A 1024-sequence request holds every slot; a single request that arrives later is admitted at the next free
    slot (its group has none running), long before the large one drains."""
    eng = Engine(model, IdTokenizer(), max_batch=4)
    p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    eng.add_many([Request([5, 6, 7], p) for _ in range(1024)], group="big")
    eng.step()
    (small,) = eng.add_many([Request([9, 9], p, "small")], group="small")
    for steps in range(1, 20):
        if any(o.request_id == small and o.finished for o in eng.step()):
            break
    assert steps <= 8, steps
    assert len(eng.waiting) > 900


@pytest.mark.parametrize("overlap", [False, True])
def test_mixed_passes_and_overlap_equal_each_request_alone(model, overlap):
    """Requests joining while others decode (prefills waiting and batched, decode rows on the decode path, the
    step's tokens read one step late with overlap): greedy and seeded outputs equal each request run alone."""
    torch.manual_seed(3)
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (7, 33, 2, 20, 50, 12)]
    params = [
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=1.0, top_k=20, min_p=0.05, seed=5, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, frequency_penalty=0.5),
        SamplingParams(temperature=0.7, seed=2, max_tokens=10, ignore_eos=True, logprobs=2),
    ]
    alone = [
        Engine(model, IdTokenizer(), max_batch=1, overlap=False).generate([p], [sp])[0]
        for p, sp in zip(prompts, params)
    ]
    eng = Engine(model, IdTokenizer(), max_batch=3, max_num_batched_tokens=24, prefill_wait_steps=2, overlap=overlap)
    done: dict[str, dict] = {}
    ids = [eng.add(prompts[0], params[0])]
    queue = list(zip(prompts[1:], params[1:]))
    while eng.has_work() or queue:
        if queue and eng.timing["steps"] % 2 == 1:  # arrivals while others are mid-flight
            ids.append(eng.add(*queue.pop(0)))
        for out in eng.step():
            d = done.setdefault(out.request_id, {"token_ids": [], "text": "", "logprobs": []})
            d["token_ids"] += out.token_ids
            d["text"] += out.text
            d["logprobs"] += out.logprobs or []
    for rid, want in zip(ids, alone):
        assert done[rid]["token_ids"] == want["token_ids"], rid
        assert done[rid]["text"] == want["text"]
    got_lp = [e.logprob for e in done[ids[5]]["logprobs"]]
    want_lp = [e.logprob for e in alone[5]["logprobs"]]
    assert got_lp == pytest.approx(want_lp, abs=1e-4)
    assert eng.timing["prefill_passes"] < len(prompts) + 4  # prefills were gathered, not one pass per chunk
    assert eng.reserved == 0 and sorted(eng.free_slots) == [0, 1, 2]


def test_time_to_first_token_is_split_into_queue_and_prefill(model, monkeypatch):
    """Each request's first token adds its wait for a slot and its time from the slot to that token (a clock that
    ticks once a read): alone a request waits a tick or two for its slot; with one slot for two, the second waits
    out the first's three steps."""

    def run(n: int) -> dict:
        clock = iter(range(10_000))
        for module in ("engine", "engine_outputs"):
            monkeypatch.setattr(f"k3.infer.{module}.time.perf_counter", lambda: float(next(clock)))
        eng = Engine(model, IdTokenizer(), max_batch=1, overlap=False)
        eng.add_many([Request([1, 2, 3], SamplingParams(temperature=0, max_tokens=3)) for _ in range(n)])
        while eng.has_work():
            eng.step()
        return eng.timing

    alone, two = run(1), run(2)
    assert alone["first_tokens"] == 1 and two["first_tokens"] == 2
    assert 0 < alone["queue_s"] <= 2 and alone["first_token_s"] > 0
    assert two["queue_s"] - alone["queue_s"] >= 6  # three steps, each reading the clock at least twice
