"""The OpenAI-compatible server, driven by the official ``openai`` client against a real uvicorn server.

One tiny random checkpoint (BPE vocab 400) per module; the server runs in a background thread. Greedy outputs of
32 concurrent streams must equal the same requests run one at a time; every malformed request gets a 4xx with
a message and the server keeps serving; ``k3 serve`` shuts down gracefully on SIGTERM.
"""

import argparse
import asyncio
import collections
import email
import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
import uvicorn

from k3.config import get_preset
from k3.infer.async_engine import AsyncEngine
from k3.infer.engine import Engine
from k3.infer.load import load_for_inference
from k3.infer.server import create_app
from k3.model.decoder import K3ForCausalLM
from k3.data.tokenizer import train_bpe
from k3.checkpoint.format import save_pretrained

MODEL, CONTEXT = "k3-test", 256
LIMIT = 256 << 10  # the served app's body limit
REPO = Path(__file__).resolve().parents[2]


def corpus() -> str:
    """Some English and code-ish text: standard-library module docstrings."""
    return "\n".join(m.__doc__ for m in (argparse, collections, email, inspect, json, textwrap))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    tok = train_bpe([corpus()], vocab_size=400)
    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset("tiny").replace(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id))
    path = tmp_path_factory.mktemp("ckpt")
    save_pretrained(model, path)
    tok.save(path)
    return path


class LiveServer:
    """uvicorn in a background thread on a pre-bound 127.0.0.1 socket (no port race); ``options`` go to its
    Config."""

    def __init__(self, app, **options):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=10, **options))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def served(ckpt):
    model, tok, _ = load_for_inference(ckpt, "cpu", "float32")
    engine = Engine(model, tok, max_batch=16, max_context=CONTEXT)
    batches = []
    real_step = engine.step

    def step():  # record (sequences decoding, sequences prefilling) of each step, admissions included
        decoding = sum(s.fed >= len(s.prompt) for s in engine.running)
        batches.append((decoding, len(engine.running) - decoding + min(len(engine.waiting), len(engine.free_slots))))
        return real_step()

    engine.step = step
    async_engine = AsyncEngine(engine)
    app = create_app(async_engine, tok, MODEL, CONTEXT, max_request_bytes=LIMIT)
    live = LiveServer(app)
    yield argparse.Namespace(url=live.url, engine=engine, async_engine=async_engine, tok=tok, batches=batches, app=app)
    live.stop()
    # graceful shutdown: the lifespan stopped the engine thread
    assert not async_engine._thread.is_alive() and not async_engine.running


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_health_and_models(served, client):
    r = httpx.get(served.url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["max_context"] == CONTEXT
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_completion(served, client):
    r = client.completions.create(model=MODEL, prompt="The json module", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    c = r.choices[0]
    assert c.index == 0 and c.finish_reason in ("stop", "length") and isinstance(c.text, str)
    n_prompt = len(served.tok.encode("The json module"))
    assert r.usage.prompt_tokens == n_prompt and 1 <= r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == n_prompt + r.usage.completion_tokens
    # a prompt given as token ids is the same request
    same = client.completions.create(
        model=MODEL, prompt=served.tok.encode("The json module"), max_tokens=8, temperature=0
    )
    assert same.choices[0].text == c.text
    # seeded sampling repeats; extensions top_k / repetition_penalty are accepted
    kw = dict(
        model=MODEL,
        prompt="Hello",
        max_tokens=8,
        temperature=0.9,
        top_p=0.9,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        extra_body={"top_k": 20, "repetition_penalty": 1.2},
    )
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_health_counts_where_first_tokens_waited(served, client):
    """/health carries the engine's counters: after a completion, a first token with its wait for a slot and its
    time from the slot to the token."""
    client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0)
    h = httpx.get(served.url + "/health").json()
    assert h["first_tokens"] >= 1 and h["steps"] >= 2 and h["prefill_passes"] >= 1
    assert h["queue_s"] >= 0 and h["first_token_s"] > 0


def test_completion_stream_matches_non_stream(client):
    kw = dict(model=MODEL, prompt="Return a string", max_tokens=10, temperature=0)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full.choices[0].text
    reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert reasons[-1] == full.choices[0].finish_reason and not any(reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_and_chat_stream(served, client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is JSON?"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    m = r.choices[0].message
    assert m.role == "assistant" and isinstance(m.content, str) and r.choices[0].finish_reason in ("stop", "length")
    assert "<|im_end|>" not in m.content  # the template's stop token ends the reply and is not shown
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=msgs,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == m.content
    finish = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == r.choices[0].finish_reason
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    # without include_usage no chunk carries usage; the raw stream ends with [DONE]
    raw = httpx.post(
        served.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": msgs, "max_tokens": 3, "temperature": 0, "stream": True},
    )
    events = [e for e in raw.text.split("\n\n") if e]
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    assert all("usage" not in json.loads(e[6:]) or json.loads(e[6:])["usage"] is None for e in events[:-1])


def test_completion_logprobs_streamed_or_not(client):
    """Greedy: each token is the likeliest (its log-probability is the first alternative's); the tokens spell the
    text, text_offset counts them, and a stream carries the same entries as the whole response."""
    kw = dict(model=MODEL, prompt="The json module", max_tokens=8, temperature=0, logprobs=3)
    r = client.completions.create(**kw)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and value <= 0 and max(top.values()) == value and top[token] == value
    chunks = list(client.completions.create(stream=True, **kw))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices]
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert sum((getattr(s, field) for s in streamed), []) == getattr(lp, field), field
    assert client.completions.create(**{**kw, "logprobs": None}).choices[0].logprobs is None


def test_echo_scores_the_prompt(served, client):
    """echo + logprobs (+ max_tokens 0, how evaluation harnesses score text): the prompt's tokens come first, the
    first with no log-probability, the others the model's own log-softmax (a full forward, outside the server);
    with generation, the completion part equals the same request without echo; streamed the same."""
    text = "The json module exposes an API"
    ids = served.tok.encode(text)
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True, logprobs=2, temperature=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == text and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    assert lp.tokens == [served.tok.decode([t]) for t in ids] and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and all(1 <= len(t) <= 3 for t in lp.top_logprobs[1:])  # (equal texts merge)
    assert all(t[token] == v for token, v, t in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]))
    with torch.no_grad():
        full = served.engine.model(torch.tensor(ids)[None]).logits[0, :-1].double().log_softmax(-1)
    best = full.max(-1).values.tolist()  # (two alternatives with one text merge into the likelier one)
    assert max(abs(max(t.values()) - m) for t, m in zip(lp.top_logprobs[1:], best)) <= 1e-4
    want = full.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], want.tolist())) <= 1e-4
    kw = dict(model=MODEL, prompt=text, max_tokens=5, logprobs=1, temperature=0)
    plain, echoed = client.completions.create(**kw), client.completions.create(echo=True, **kw)
    assert echoed.choices[0].text == text + plain.choices[0].text
    e, p = echoed.choices[0].logprobs, plain.choices[0].logprobs
    assert e.tokens == lp.tokens + p.tokens and e.token_logprobs[: len(ids)] == lp.token_logprobs
    assert max(abs(a - b) for a, b in zip(e.token_logprobs[len(ids) :], p.token_logprobs)) <= 1e-4
    assert e.text_offset == [sum(len(t) for t in e.tokens[:i]) for i in range(len(e.tokens))]
    chunks = list(client.completions.create(echo=True, stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echoed.choices[0].text
    assert sum((c.choices[0].logprobs.tokens for c in chunks if c.choices), []) == e.tokens
    assert sum((c.choices[0].logprobs.token_logprobs for c in chunks if c.choices), []) == e.token_logprobs
    nulls = post(served, "/v1/completions", {**OK, "echo": None, "logprobs": None})  # OpenAI accepts null: off
    assert nulls.status_code == 200 and nulls.json()["choices"][0]["logprobs"] is None
    assert post(served, "/v1/chat/completions", {**CHAT, "logprobs": None}).status_code == 200
    bare = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True)  # no logprobs asked
    assert bare.choices[0].text == served.tok.decode(ids) and bare.choices[0].logprobs is None


def test_batched_prompts_as_an_evaluation_harness_sends_them(served, client):
    """A list of prompts (token ids, as lm-evaluation-harness sends with echo, logprobs=1, max_tokens=1) gives one
    choice per prompt, by index, each equal to the prompt sent alone; usage adds up."""
    texts = ["The json module exposes an API", "Return a string"]
    ids = [served.tok.encode(t) for t in texts]
    kw = dict(model=MODEL, max_tokens=1, echo=True, logprobs=1, temperature=0)
    both = client.completions.create(prompt=ids, **kw)
    alone = [client.completions.create(prompt=i, **kw) for i in ids]
    assert [c.index for c in both.choices] == [0, 1]
    for c, a in zip(both.choices, alone):
        assert c.text == a.choices[0].text and c.logprobs.tokens == a.choices[0].logprobs.tokens
        assert c.logprobs.token_logprobs[0] is None
        mine, theirs = c.logprobs.token_logprobs[1:], a.choices[0].logprobs.token_logprobs[1:]
        assert max(abs(x - y) for x, y in zip(mine, theirs)) <= 1e-5
    assert both.usage.prompt_tokens == sum(len(i) for i in ids) == sum(a.usage.prompt_tokens for a in alone)
    assert both.usage.completion_tokens == 2
    strings = client.completions.create(model=MODEL, prompt=texts, max_tokens=3, temperature=0)
    one = [client.completions.create(model=MODEL, prompt=t, max_tokens=3, temperature=0) for t in texts]
    assert [c.text for c in strings.choices] == [r.choices[0].text for r in one]


def test_n_choices(served, client):
    """n choices per prompt, prompt-major: choice j is the request seeded seed + j sent alone; greedy choices are
    equal; the prompt counts once in usage."""
    kw = dict(model=MODEL, max_tokens=6, temperature=1.0, seed=11)
    r = client.completions.create(prompt=["Hello", "The json"], n=3, **kw)
    assert [c.index for c in r.choices] == list(range(6))
    for i, c in enumerate(r.choices):
        alone = client.completions.create(prompt=["Hello", "The json"][i // 3], **{**kw, "seed": 11 + i % 3})
        assert c.text == alone.choices[0].text, i
    assert len({c.text for c in r.choices[:3]}) > 1  # different seeds sample differently
    assert r.usage.prompt_tokens == len(served.tok.encode("Hello")) + len(served.tok.encode("The json"))
    msgs = [{"role": "user", "content": "What is JSON?"}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0, n=2)
    assert [c.index for c in chat.choices] == [0, 1] and chat.choices[0].message == chat.choices[1].message
    one = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0)
    assert chat.usage.prompt_tokens == one.usage.prompt_tokens
    assert chat.usage.completion_tokens == 2 * one.usage.completion_tokens


def test_chat_logprobs_streamed_or_not(client):
    msgs = [{"role": "user", "content": "What is JSON?"}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2)
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert "".join(e.token for e in content) == r.choices[0].message.content  # the stop token has no entry
    raw = b"".join(bytes(e.bytes) for e in content)  # the raw token bytes: (this random model's text has broken
    assert raw.decode("utf-8", errors="replace") == r.choices[0].message.content  # characters, shown as U+FFFD)
    for e in content:
        assert bytes(e.bytes).decode("utf-8", errors="replace") == e.token and len(e.top_logprobs) == 2
        assert e.top_logprobs[0].logprob == e.logprob >= e.top_logprobs[1].logprob
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    plain = client.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None
    assert client.chat.completions.create(**{**kw, "top_logprobs": 0}).choices[0].logprobs.content[0].top_logprobs == []


def test_usage_reports_prefix_cache_hits(ckpt):
    """usage.prompt_tokens_details.cached_tokens: the prompt tokens a request read from the prefix cache (0 on a
    miss; whole blocks below the last prompt token on a repeat), streamed or not, completions and chat; and
    ignore_eos (a load test's fixed output length)."""
    model, tok, _ = load_for_inference(ckpt, "cpu", "float32")
    engine = Engine(
        model, tok, max_batch=4, max_context=CONTEXT, max_num_batched_tokens=32, block_size=16, prefix_cache_bytes=10**8
    )
    live = LiveServer(create_app(AsyncEngine(engine), tok, MODEL, CONTEXT))
    try:
        c = openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=60)
        prompt = list(range(3, 83))  # 80 token ids
        first = c.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        again = c.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert again.usage.prompt_tokens_details.cached_tokens == 64  # 4 blocks of 16 below token 79
        stream = c.completions.create(
            model=MODEL, prompt=prompt, max_tokens=2, temperature=0, stream=True, stream_options={"include_usage": True}
        )
        usage = [ch.usage for ch in stream if ch.usage is not None]
        assert len(usage) == 1 and usage[0].prompt_tokens_details.cached_tokens == 64
        msgs = [{"role": "user", "content": "the json module " * 12}]
        c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0)
        chat = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0)
        assert chat.usage.prompt_tokens_details.cached_tokens > 0
        long = c.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        assert long.usage.completion_tokens == 12 and long.choices[0].finish_reason == "length"
    finally:
        live.stop()


def test_32_concurrent_streams_equal_sequential(served, client):
    prompts = [
        f"{w} " * (1 + i % 5) + f"item {i}:"
        for i, w in enumerate(["json", "The", "parse", "class", "def", "import", "return", "email"] * 4)
    ]

    lengths = [6 + i % 8 for i in range(len(prompts))]  # requests finish at different steps: waiting ones join
    sequential = []  # a batch that is mid-decode (prefill + decode mixed)
    served.batches.clear()  # (earlier tests may have batched: a list of prompts runs at once)
    for p, n in zip(prompts, lengths):
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0)
        sequential.append((r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens))
    assert max(d + p for d, p in served.batches) == 1
    served.batches.clear()

    async def one(aclient, p, n):
        text, reason, usage = [], None, None
        stream = await aclient.completions.create(
            model=MODEL, prompt=p, max_tokens=n, temperature=0, stream=True, stream_options={"include_usage": True}
        )
        async for ch in stream:
            if ch.choices:
                text.append(ch.choices[0].text)
                reason = ch.choices[0].finish_reason or reason
            if ch.usage:
                usage = ch.usage.completion_tokens
        return "".join(text), reason, usage

    async def all_at_once():
        async with openai.AsyncOpenAI(
            base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=120
        ) as aclient:
            return await asyncio.gather(*(one(aclient, p, n) for p, n in zip(prompts, lengths)), return_exceptions=True)

    concurrent = asyncio.run(all_at_once())
    errors = [c for c in concurrent if isinstance(c, BaseException)]
    assert not errors, errors[:3]
    assert concurrent == sequential
    assert max(d + p for d, p in served.batches) == 16, served.batches  # they really ran batched (max_batch)
    assert any(d and p for d, p in served.batches), served.batches  # prompts joined batches mid-decode
    assert len({t for t, _, _ in sequential}) > 8  # and the outputs differ between prompts


def post(served, path, body=None, raw=None):
    if raw is not None:
        return httpx.post(served.url + path, content=raw, headers={"content-type": "application/json"})
    return httpx.post(served.url + path, json=body)


OK = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BAD = [  # (path, body or raw bytes, status, words the message must contain)
    ("/v1/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, "valid dictionary"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "model": 5}, 400, "model"),
    ("/v1/completions", {**OK, "model": "gpt-4"}, 404, "does not exist"),
    ("/v1/completions", {**OK, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {**OK, "max_tokens": 10**9}, 400, "context"),
    ("/v1/completions", {**OK, "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {**OK, "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {**OK, "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {**OK, "top_k": -1}, 400, "top_k"),
    ("/v1/completions", {**OK, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {**OK, "repetition_penalty": 1e-40}, 400, "repetition_penalty=1e-40 must be in [0.01"),
    ("/v1/completions", {**OK, "temperature": -1e-40}, 400, "temperature=-1e-40 must be in [0, 2]"),
    ("/v1/chat/completions", {**CHAT, "temperature": 2.01}, 400, "temperature"),
    ("/v1/completions", {**OK, "prompt": "x" * 100_000}, 400, "characters"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x" * 100_000}]}, 400, "characters"),
    ("/v1/completions", b'{"model": "k3-test", "prompt": "ab\\ud800cd", "max_tokens": 2}', 400, "surrogate"),
    (
        "/v1/chat/completions",
        b'{"model": "k3-test", "messages": [{"role": "user", "content": "\\udfff"}]}',
        400,
        "messages.0.content",
    ),
    ("/v1/completions", {**OK, "n": 17}, 400, "n"),
    ("/v1/completions", {**OK, "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/completions", {**OK, "frequency_penalty": "high"}, 400, "frequency_penalty"),
    ("/v1/completions", {**OK, "echo": "yes"}, 400, "echo"),
    ("/v1/completions", {**OK, "max_tokens": 0}, 400, "max_tokens=0 needs echo"),
    ("/v1/completions", {**OK, "max_tokens": -1, "echo": True}, 400, "max_tokens"),
    ("/v1/completions", {**OK, "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {**OK, "logprobs": True}, 400, "logprobs"),
    ("/v1/completions", {**OK, "prompt": "word " * 400}, 400, "context"),
    ("/v1/completions", {**OK, "prompt": [5] * 300}, 400, "context"),
    ("/v1/completions", {**OK, "prompt": [10**6]}, 400, "token ids"),
    ("/v1/completions", {**OK, "prompt": ""}, 400, "no BOS token"),  # (test_server_api: with a BOS token)
    ("/v1/completions", {**OK, "prompt": []}, 400, "non-empty list of token ids"),
    ("/v1/completions", {**OK, "prompt": 5}, 400, "prompt"),
    ("/v1/completions", {**OK, "prompt": [[1], []]}, 400, "prompt"),
    ("/v1/completions", {**OK, "prompt": ["a"] * 65}, 400, "up to 64"),
    ("/v1/completions", {**OK, "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {**OK, "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {**OK, "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {**OK, "stop": 5}, 400, "stop"),
    ("/v1/completions", {**OK, "stop": ["a"] * 65}, 400, "at most 64"),
    ("/v1/completions", {**OK, "stop": ["a" * 257]}, 400, "at most 256 characters"),
    ("/v1/completions", {**OK, "seed": 2**70}, 400, "seed"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 123}]}, 400, "content"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi " * 400}]}, 400, "context"),
    ("/v1/chat/completions", {**CHAT, "temperature": 2.5}, 400, "temperature"),
    ("/v1/chat/completions", {**CHAT, "model": "nope"}, 404, "does not exist"),
    ("/v1/chat/completions", {**CHAT, "n": 0}, 400, "n"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs needs logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
]


@pytest.mark.parametrize("path,body,status,words", BAD, ids=[f"{i}-{b[1]!s:.40}" for i, b in enumerate(BAD)])
def test_bad_request_gets_4xx_then_server_still_serves(served, path, body, status, words):
    r = post(served, path, raw=body) if isinstance(body, bytes) else post(served, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words.lower() in err["message"].lower(), err
    assert set(err) == {"message", "type", "param", "code"}
    assert post(served, "/v1/completions", OK).status_code == 200


def test_openai_client_raises_on_4xx(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])


def test_internal_error_is_500_and_server_recovers(served, client):
    real = served.engine.step

    def broken():
        served.engine.step = real
        raise RuntimeError("simulated failure")

    served.engine.step = broken
    r = post(served, "/v1/completions", OK)
    assert r.status_code == 500 and "simulated failure" in r.json()["error"]["message"]
    assert client.completions.create(**OK).choices[0].finish_reason in ("stop", "length")
    assert httpx.get(served.url + "/health").json()["running"] == 0


def test_client_disconnect_aborts_the_request(served):
    aborted = []
    real_abort = served.engine.abort
    served.engine.abort = lambda rid: (aborted.append(rid), real_abort(rid))
    try:
        body = {**OK, "max_tokens": 200, "stream": True}
        with httpx.stream("POST", served.url + "/v1/completions", json=body) as r:
            first = next(line for line in r.iter_lines() if line.startswith("data: "))
        rid = json.loads(first[6:])["id"]
        deadline = time.monotonic() + 10
        while rid not in aborted:
            assert time.monotonic() < deadline, "the request was not aborted"
            time.sleep(0.02)
    finally:
        served.engine.abort = real_abort


def test_a_64x16_request_enters_in_one_step_and_is_aborted_on_disconnect(served):
    """64 prompts x n=16 (1024 sequences) reach the engine in one message; the client leaving mid-response aborts
    every one of them, and a request over the token budget answers 400 before anything runs."""
    added = []
    real_add = served.engine.add_many
    served.engine.add_many = lambda reqs, group=None: (added.append(len(reqs)), real_add(reqs, group))[1]
    serving, limit = served.app.state.serving, served.app.state.serving.max_request_tokens
    try:
        body = {**OK, "prompt": [f"p{i}" for i in range(64)], "n": 16, "max_tokens": 40}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(served.url + "/v1/completions", json=body, timeout=1.0)
        assert added == [1024]
        deadline = time.monotonic() + 10
        while served.engine.has_work():
            assert time.monotonic() < deadline, "the abandoned request kept the engine busy"
            time.sleep(0.05)
        serving.max_request_tokens = 64 * 16 * 40  # below what this request asks for (prompt + max_tokens each)
        r = post(served, "/v1/completions", body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "request_too_large"
        assert added == [1024]  # refused before it reached the engine
    finally:
        served.engine.add_many = real_add
        serving.max_request_tokens = limit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(ckpt, *flags: str) -> tuple[subprocess.Popen, str]:
    """A live ``k3 serve`` on a free loopback port (CPU), once /health answers 200: (process, base URL)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "k3", "serve", "--ckpt", str(ckpt), "--port", str(port), "--device", "cpu", *flags],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(proc.stdout.read())
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.1)


@pytest.mark.parametrize("engine", ["thread", "process"])
def test_k3_serve_cli_graceful_sigterm(ckpt, engine):
    """SIGTERM mid-stream: the request completes, the server (and its engine process) exits 0."""
    proc, url = start_serve(ckpt, "--max-context", "512", "--engine", engine)
    try:
        events = []
        with httpx.stream(
            "POST",
            url + "/v1/completions",
            json={
                "model": "k3",
                "prompt": "Hello",
                "max_tokens": 40,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    if not events:
                        proc.send_signal(signal.SIGTERM)  # mid-stream: the request still completes
                    events.append(line[6:])
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        finishes = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-2]]
        assert finishes[-1] in ("stop", "length") and last["usage"]["completion_tokens"] >= 1
        assert proc.wait(30) == 0
        out = proc.stdout.read()
        assert "stopped" in out and "Traceback" not in out and f"engine in a {engine}" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------- AsyncEngine with a fake engine
class FakeEngine:
    """One token per running request per step (its step count), finishing at max_tokens; counts calls."""

    def __init__(self, delay=0.0):
        self.running, self.delay, self.has_work_calls, self.aborted = {}, delay, 0, []

    def add(self, prompt, params, request_id, images=None, media=None):
        params.validate()
        if not prompt:
            raise ValueError("the prompt is empty")
        self.running[request_id] = [params.max_tokens, 0]
        return request_id

    def add_many(self, requests, group=None):
        return [self.add(r.prompt, r.params, r.request_id, r.images, r.media) for r in requests]

    def abort(self, rid):
        self.aborted.append(rid)
        self.running.pop(rid, None)

    def has_work(self):
        self.has_work_calls += 1
        return bool(self.running)

    def step(self):
        from k3.infer.engine import StepOutput

        time.sleep(self.delay)
        outs = []
        for rid, st in list(self.running.items()):
            st[1] += 1
            done = st[1] >= st[0]
            outs.append(StepOutput(rid, [st[1]], f"{st[1]} ", done, "length" if done else None, 1, st[1]))
            if done:
                del self.running[rid]
        return outs

    def stats(self):
        return {"running": len(self.running), "waiting": 0}


def test_async_engine_generate_errors_idle_and_shutdown():
    from k3.infer.async_engine import EngineClosed
    from k3.infer.sampling import SamplingParams

    fake = FakeEngine(delay=0.01)
    ae = AsyncEngine(fake).start()

    async def collect(n):
        return "".join([o.text async for o in ae.generate([1], SamplingParams(max_tokens=n))])

    async def scenario():
        assert await asyncio.gather(collect(3), collect(5)) == ["1 2 3 ", "1 2 3 4 5 "]
        with pytest.raises(ValueError, match="max_tokens"):
            await ae.submit([1], SamplingParams(max_tokens=0))
        with pytest.raises(ValueError, match="empty"):
            await ae.submit([], SamplingParams())
        # leaving the iteration early aborts the request in the engine
        gen = ae.generate([1], SamplingParams(max_tokens=1000), request_id="early")
        await gen.__anext__()
        await gen.aclose()
        # a cancelled consumer aborts too
        task = asyncio.ensure_future(collect(1000))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if not fake.running:
                break
            await asyncio.sleep(0.01)
        assert "early" in fake.aborted and not fake.running

    asyncio.run(scenario())
    calls = fake.has_work_calls
    time.sleep(0.3)  # idle: the thread sleeps on its condition variable
    assert fake.has_work_calls - calls <= 2

    async def shutdown_with_one_in_flight():
        stream = await ae.submit([1], SamplingParams(max_tokens=10**6))
        await asyncio.to_thread(ae.shutdown, 0.1)  # drain 0.1 s, then abort what is left
        with pytest.raises(EngineClosed):
            async for _ in stream:
                pass
        with pytest.raises(EngineClosed):
            await ae.submit([1], SamplingParams())

    asyncio.run(shutdown_with_one_in_flight())
    assert not ae._thread.is_alive() and not ae.running
    ae.shutdown()  # idempotent


@pytest.mark.parametrize("stopped", [False, True])
def test_a_failed_step_fails_the_requests_in_flight(stopped, caplog):
    """Any exception in step() fails the requests in flight with EngineError; one the engine reported itself
    (EngineStopped: an expert-parallel group that lost a rank) is not logged again, so no traceback."""
    from k3.infer.async_engine import EngineError, EngineStopped
    from k3.infer.sampling import SamplingParams

    class Failing(FakeEngine):
        def step(self):
            raise (EngineStopped if stopped else RuntimeError)("lost rank 2")

    ae = AsyncEngine(Failing()).start()

    async def one():
        return [o async for o in ae.generate([1], SamplingParams(max_tokens=3))]

    with caplog.at_level("ERROR", logger="k3.infer"):
        with pytest.raises(EngineError, match="lost rank 2"):
            asyncio.run(one())
    ae.shutdown()
    logged = [r for r in caplog.records if r.name == "k3.infer"]
    assert (logged == []) if stopped else (len(logged) == 1 and logged[0].exc_info is not None)


# ---------------------------------------------------------------------- faults a hostile client can cause
def test_sampling_ranges_are_the_samplers_with_its_message(served):
    from k3.infer.sampling import SamplingParams

    for name, value in (("temperature", -1e-40), ("repetition_penalty", 1e-40)):
        with pytest.raises(ValueError) as alone:
            SamplingParams(**{name: value}).validate()
        r = post(served, "/v1/completions", {**OK, name: value})
        assert r.status_code == 400 and r.json()["error"]["message"] == str(alone.value), r.text
        assert r.json()["error"]["param"] == name
    assert post(served, "/v1/completions", {**OK, "temperature": 0.01, "repetition_penalty": 0.01}).status_code == 200


def test_temperature_has_one_range_with_one_message(served):
    """OpenAI's [0, 2] is the sampler's range too: the server and `k3 generate` refuse the same values, in the
    sampler's words, whichever way the value is out of range."""
    from k3.infer.sampling import MAX_TEMPERATURE, SamplingParams

    assert MAX_TEMPERATURE == 2
    for path, body in (("/v1/completions", OK), ("/v1/chat/completions", CHAT)):
        for t in (-1.0, -1e-3, 2.5, 100.0):  # floats: the schema parses a JSON number into one
            with pytest.raises(ValueError) as alone:
                SamplingParams(temperature=t).validate()
            r = post(served, path, {**body, "temperature": t})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["message"] == str(alone.value) and "[0, 2]" in err["message"], err
            assert err["param"] == "temperature" and err["type"] == "invalid_request_error"
        for t in (0, 1e-40, 1e-3, 0.01, 2):
            SamplingParams(temperature=t).validate()
            assert post(served, path, {**body, "temperature": t}).status_code == 200
    # below 0.01 a row samples at 0.01 (OpenAI accepts it; its logits / 1e-40 would overflow to NaN)
    seeded = {**OK, "max_tokens": 6, "seed": 11}
    texts = [
        post(served, "/v1/completions", {**seeded, "temperature": t}).json()["choices"][0]["text"]
        for t in (1e-40, 0.01)
    ]
    assert texts[0] == texts[1]


def test_a_request_failing_in_sampling_fails_alone(served, client, monkeypatch):
    import k3.infer.engine_outputs as engine_mod

    real = engine_mod.sample_batch

    def sampler(logits, rows, *tables):  # seed 4242 marks the victim: its row's logits turn NaN
        victim = rows.seeds == 4242
        if bool(victim.any()):
            logits = logits.masked_fill(victim[:, None], float("nan"))
        return real(logits, rows, *tables)

    monkeypatch.setattr(engine_mod, "sample_batch", sampler)
    prompts = [f"item {i}: json" for i in range(6)]
    alone = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0).choices[0].text for p in prompts
    ]

    async def scenario():
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as ac:

            async def good(p, stream):
                body = {**OK, "prompt": p, "max_tokens": 6, "stream": stream}
                if not stream:
                    return (await ac.post("/v1/completions", json=body)).json()["choices"][0]["text"]
                async with ac.stream("POST", "/v1/completions", json=body) as r:
                    events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
                assert events[-1] == "[DONE]"
                return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])

            async def victim(stream):
                body = {**OK, "prompt": "victim", "max_tokens": 6, "seed": 4242, "stream": stream}
                if not stream:
                    return await ac.post("/v1/completions", json=body)
                async with ac.stream("POST", "/v1/completions", json=body) as r:
                    return [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]

            return await asyncio.gather(
                victim(False), victim(True), *(good(p, i % 2 == 0) for i, p in enumerate(prompts))
            )

    failed, failed_stream, *others = asyncio.run(scenario())
    assert others == alone
    assert failed.status_code == 500 and "not finite" in failed.json()["error"]["message"]
    assert failed_stream[-1] == "[DONE]" and "not finite" in json.loads(failed_stream[-2])["error"]["message"]
    assert httpx.get(served.url + "/health").json()["running"] == 0


def test_body_over_the_limit_is_413_declared_or_chunked(served):
    big = json.dumps({**OK, "prompt": "x" * (LIMIT + 1)}).encode()
    for content in (big, iter([big[i : i + 8192] for i in range(0, len(big), 8192)])):  # Content-Length, chunked
        r = httpx.post(served.url + "/v1/completions", content=content, headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert (
            "larger than" in err["message"]
            and err["code"] == "request_too_large"
            and set(err) == {"message", "type", "param", "code"}
        )
    assert post(served, "/v1/completions", OK).status_code == 200


def test_tokenising_runs_off_the_event_loop(served, monkeypatch):
    from k3.data.tokenizer import Tokenizer

    threads, real = [], Tokenizer.encode
    monkeypatch.setattr(
        Tokenizer,
        "encode",
        lambda self, *a, **k: (threads.append(threading.current_thread().name), real(self, *a, **k))[1],
    )
    assert post(served, "/v1/completions", OK).status_code == 200
    assert post(served, "/v1/chat/completions", CHAT).status_code == 200
    assert threads and all(t.startswith("k3-tokenize") for t in threads), threads


def test_echoed_logprobs_are_capped(served, monkeypatch):
    import k3.infer.serving as serving_mod

    monkeypatch.setattr(serving_mod, "MAX_PROMPT_LOGPROB_ENTRIES", 1000)
    body = {**OK, "prompt": [5] * 100, "echo": True, "logprobs": 20, "max_tokens": 1}
    r = post(served, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "response_too_large", r.text
    assert "2100" in r.json()["error"]["message"]
    assert post(served, "/v1/completions", {**body, "logprobs": 5}).status_code == 200  # 600 entries


def test_abandoned_non_streamed_request_is_aborted(served):
    aborted = []
    real_abort = served.engine.abort
    served.engine.abort = lambda rid: (aborted.append(rid), real_abort(rid))
    try:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up; ~15 ms a step: 240 tokens take seconds
            httpx.post(served.url + "/v1/completions", json={**OK, "max_tokens": 240, "n": 2}, timeout=0.5)
        deadline = time.monotonic() + 2
        while len(aborted) < 2 or served.engine.has_work():
            assert time.monotonic() < deadline, f"still running after the client left (aborted {aborted})"
            time.sleep(0.02)
        assert all(rid.startswith("cmpl-") for rid in aborted)
    finally:
        served.engine.abort = real_abort


def raw_exchange(url: str, requests: list[tuple[str, bytes]]) -> list[tuple[int, dict, bytes]]:
    """POST each (path, JSON body) in turn on ONE connection: (status, headers, body) each. A server that closed
    the connection fails the next request here (no reconnect, unlike httpx's pool)."""
    host, port = url.removeprefix("http://").split(":")
    out = []
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        f = sock.makefile("rb")
        for path, body in requests:
            sock.sendall(
                f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            status = f.readline()
            assert status, "the server closed the connection"
            headers = {}
            for line in iter(f.readline, b"\r\n"):
                k, _, v = line.decode().partition(":")
                headers[k.strip().lower()] = v.strip()
            out.append((int(status.split()[1]), headers, f.read(int(headers["content-length"]))))
    return out


def test_bad_text_and_internal_errors_keep_the_connection(served, monkeypatch):
    import k3.infer.serving as serving_mod

    good = json.dumps(OK).encode()
    bad_text = b'{"model": "k3-test", "prompt": "ab\\ud800cd", "max_tokens": 2}'
    chat = json.dumps(CHAT).encode()

    def bug(*args, **kwargs):
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(serving_mod, "render_chat", bug)  # an unexpected exception inside a handler
    replies = raw_exchange(
        served.url,
        [
            ("/v1/completions", bad_text),
            ("/v1/completions", good),
            ("/v1/chat/completions", chat),
            ("/v1/completions", good),
        ],
    )
    assert [status for status, _, _ in replies] == [400, 200, 500, 200]
    assert "surrogate" in json.loads(replies[0][2])["error"]["message"]
    assert json.loads(replies[2][2])["error"] == {
        "message": "internal error: RuntimeError: simulated bug",
        "type": "server_error",
        "param": None,
        "code": None,
    }
    assert all(h.get("connection") != "close" for _, h, _ in replies)


def test_drain_ends_open_requests_with_errors_and_refuses_new_ones(ckpt):
    model, tok, _ = load_for_inference(ckpt, "cpu", "float32")
    async_engine = AsyncEngine(Engine(model, tok, max_batch=4, max_context=CONTEXT))
    live = LiveServer(create_app(async_engine, tok, MODEL, CONTEXT))
    try:
        long = {**OK, "max_tokens": 240}
        results = {}

        def stream():
            with httpx.stream("POST", live.url + "/v1/completions", json={**long, "stream": True}, timeout=30) as r:
                results["stream"] = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]

        def whole():
            results["whole"] = httpx.post(live.url + "/v1/completions", json=long, timeout=30)

        threads = [threading.Thread(target=stream), threading.Thread(target=whole)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while async_engine.stats()["running"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        drain = threading.Thread(target=async_engine.shutdown, args=(0.3,))
        drain.start()
        r = post(argparse.Namespace(url=live.url), "/v1/completions", OK)  # a new request while draining
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error", r.text
        for t in (*threads, drain):
            t.join(30)
        events = results["stream"]
        assert events[-1] == "[DONE]" and "shut down" in json.loads(events[-2])["error"]["message"]
        assert results["whole"].status_code == 503 and "shut down" in results["whole"].json()["error"]["message"]
    finally:
        live.stop()


def test_k3_serve_sigterm_past_the_drain_ends_requests_with_errors(ckpt):
    proc, url = start_serve(ckpt, "--max-context", "2048", "--drain-timeout", "0.5")
    try:
        body = {"model": "k3", "prompt": "Hello", "max_tokens": 2000, "temperature": 0}  # far past the drain
        whole = {}
        t = threading.Thread(target=lambda: whole.update(r=httpx.post(url + "/v1/completions", json=body, timeout=60)))
        t.start()
        deadline = time.monotonic() + 30
        while httpx.get(url + "/health").json()["running"] < 1:  # the non-streamed one is in before the SIGTERM
            assert time.monotonic() < deadline and t.is_alive()
            time.sleep(0.05)
        events = []
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    if not events:
                        proc.send_signal(signal.SIGTERM)
                    events.append(line[6:])
        t.join(60)
        assert events[-1] == "[DONE]" and "shut down" in json.loads(events[-2])["error"]["message"]
        assert whole["r"].status_code == 503 and whole["r"].json()["error"]["type"] == "server_error"
        assert proc.wait(30) == 0
        out = proc.stdout.read()
        assert "Traceback" not in out and "Cancel" not in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_k3_serve_request_limit_flag(ckpt, monkeypatch, capsys):
    import k3.cli.serve as serve_mod
    from k3.cli.main import main

    assert main(["serve", "--ckpt", str(ckpt), "--max-request-mb", "0"]) == 2
    assert capsys.readouterr().err == "k3 serve: error: --max-request-mb=0.0 must be in (0, 4096]\n"
    seen = {}
    monkeypatch.setattr(
        serve_mod,
        "_server",
        lambda config, engine, drain: seen.update(config=config, drain=drain) or argparse.Namespace(run=lambda: None),
    )
    assert main(["serve", "--ckpt", str(ckpt), "--device", "cpu", "--max-request-mb", "2", "--drain-timeout", "3"]) == 0
    guard = next(m for m in seen["config"].app.user_middleware if m.cls.__name__ == "_Guard")
    assert guard.kwargs["max_bytes"] == 2 << 20 and seen["drain"] == 3
    assert seen["config"].timeout_graceful_shutdown > 3  # uvicorn waits past the drain for the error responses
