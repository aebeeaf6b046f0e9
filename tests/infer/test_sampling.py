"""Batched sampling == the per-row reference; rows never depend on their batch mates; the noise is uniform."""

import random

import pytest
import torch

from k3.infer.sampling import SamplingParams, SamplingRows, sample_batch, sample_row, uniform_noise


def random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0, 0.5, 1.0, 1.7]),
        top_k=rng.choice([0, 1, 5, 40]),
        top_p=rng.choice([1.0, 0.9, 0.5]),
        min_p=rng.choice([0.0, 0.05, 0.3]),
        repetition_penalty=rng.choice([1.0, 1.3, 0.8]),
        presence_penalty=rng.choice([0.0, 0.5]),
        frequency_penalty=rng.choice([0.0, 0.7]),
    )


def batch_of(logits, params, seeds, positions, histories, prompts):
    v = logits.shape[1]
    counts = torch.zeros(len(params), v, dtype=torch.int32)
    seen = torch.zeros(len(params), v, dtype=torch.bool)
    for i, (h, p) in enumerate(zip(histories, prompts)):
        for t in h:
            counts[i, t] += 1
        seen[i, p] = True
    seen |= counts > 0
    rows = SamplingRows.build(params, seeds, positions, "cpu")
    return sample_batch(logits, rows, seen, counts)


def test_batched_sampling_equals_the_reference_per_row():
    rng = random.Random(0)
    torch.manual_seed(0)
    b, v = 48, 64
    logits = torch.randn(b, v) * 3
    params = [random_params(rng) for _ in range(b)]
    seeds = [rng.getrandbits(64) for _ in range(b)]
    positions = [rng.randrange(1000) for _ in range(b)]
    histories = [[rng.randrange(v) for _ in range(rng.randrange(6))] for _ in range(b)]
    prompts = [[rng.randrange(v) for _ in range(3)] for _ in range(b)]
    got = batch_of(logits, params, seeds, positions, histories, prompts)
    assert got.ok.all()
    want = [
        sample_row(logits[i], params[i], seeds[i], positions[i], prompts[i] + histories[i], histories[i])
        for i in range(b)
    ]
    assert got.tokens.tolist() == want


def test_a_row_does_not_depend_on_its_batch_mates_or_their_order():
    rng = random.Random(1)
    torch.manual_seed(1)
    b, v = 16, 300
    logits = torch.randn(b, v)
    params = [random_params(rng) for _ in range(b)]
    seeds = [rng.getrandbits(64) for _ in range(b)]
    positions = list(range(b))
    hist, prompts = [[] for _ in range(b)], [[0] for _ in range(b)]
    together = batch_of(logits, params, seeds, positions, hist, prompts).tokens.tolist()
    order = list(range(b))
    rng.shuffle(order)
    shuffled = batch_of(
        logits[order],
        [params[i] for i in order],
        [seeds[i] for i in order],
        [positions[i] for i in order],
        hist,
        prompts,
    ).tokens.tolist()
    alone = [
        batch_of(logits[i : i + 1], params[i : i + 1], seeds[i : i + 1], [i], [[]], [[0]]).tokens.item()
        for i in range(b)
    ]
    assert together == alone
    assert [together[i] for i in order] == shuffled


def test_draws_follow_the_distribution_and_the_seed():
    """Over 4000 positions of one seed, a 4-token softmax is drawn at its probabilities (within 4 sigma); the
    same (seed, position) draws the same token, another seed another sequence."""
    logits = torch.tensor([[1.0, 0.0, -1.0, 2.0]]).repeat(4000, 1)
    p = SamplingParams(temperature=1.0)
    rows = SamplingRows.build([p] * 4000, [12345] * 4000, list(range(4000)), "cpu")
    tokens = sample_batch(logits, rows).tokens
    freq = torch.bincount(tokens, minlength=4).double() / 4000
    probs = logits[0].double().softmax(-1)
    assert ((freq - probs).abs() <= 4 * (probs * (1 - probs) / 4000).sqrt()).all(), (freq, probs)
    again = sample_batch(logits, rows).tokens
    assert torch.equal(tokens, again)
    other = sample_batch(logits, SamplingRows.build([p] * 4000, [999] * 4000, list(range(4000)), "cpu")).tokens
    assert not torch.equal(tokens, other)
    u = uniform_noise(torch.tensor([1, 2**62]), torch.tensor([0, 5]), 100000)
    assert 0 < u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.005


def test_nan_rows_fail_alone_and_sampling_stays_fp32_under_autocast():
    logits = torch.randn(3, 10, dtype=torch.bfloat16)
    logits[1] = float("nan")
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(temperature=0)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = sample_batch(logits, SamplingRows.build(params, [1, 2, 3], [0, 0, 0], "cpu"))
    assert out.ok.tolist() == [True, False, True]
    assert out.tokens[0] == logits[0].float().argmax() and out.tokens[2] == logits[2].float().argmax()
    with pytest.raises(ValueError, match="not finite"):
        sample_row(logits[1], params[1], 2, 0)
