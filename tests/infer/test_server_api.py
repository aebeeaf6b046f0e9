"""The OpenAI server with the clients its users run: many stop strings (lm-evaluation-harness adds its EOS to each
task's list), streamed n > 1 as vLLM streams it, vLLM's tokenizer endpoints, OpenAI options the server does not
honour (a 400 naming the field, unless at a no-op value; tool calling is test_tools'), and lm-evaluation-harness's
``local-completions`` pointed only at the server's URL. Served by test_server's tiny checkpoint, in a server of
this module's own.
"""

import json
import time

import httpx
import pytest
import torch

from k3.data.chat import render_chat
from k3.infer.sampling import MAX_STOP, MAX_STOP_CHARS
from tests.infer import test_server
from tests.infer.test_server import CHAT, CONTEXT, MODEL, OK, post

ckpt, served, client = test_server.ckpt, test_server.served, test_server.client  # (module-scoped fixtures)


def greedy(client, prompt, max_tokens=16) -> str:
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0).choices[0].text


def overlapping_stops(text: str) -> tuple[str, str]:
    """(long, short): two substrings of ``text`` at their first occurrences, ``long`` starting first and ``short``
    inside it, ending first; no U+FFFD (a piece of an unfinished character) in either."""
    for a in range(len(text) - 8):
        long, short = text[a : a + 8], text[a + 4 : a + 6]
        if text.find(long) == a and text.find(short) == a + 4 and "\ufffd" not in long:
            return long, short
    raise AssertionError(f"no usable stop strings in {text!r}")


def test_many_stop_strings_the_earliest_ending_wins(served, client):
    """More than OpenAI's 4 stop strings: the one that ends first cuts the text (not the first listed, nor the one
    that starts first), streamed or not; beyond MAX_STOP strings or MAX_STOP_CHARS characters is a 400."""
    prompt = "The json module"
    text = greedy(client, prompt)
    long, short = overlapping_stops(text)
    decoys = [f"\x01never{i}\x02" for i in range(4)]  # absent from the text
    kw = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=[long, *decoys, short])
    r = client.completions.create(**kw)
    assert r.choices[0].text == text[: text.find(short)] and r.choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw)) == r.choices[0].text
    alone = client.completions.create(**{**kw, "stop": [long, *decoys]})
    assert alone.choices[0].text == text[: text.find(long)]  # the long one cuts where it starts, once alone
    most = client.completions.create(**{**kw, "stop": [*decoys, *(f"\x03{i}" for i in range(MAX_STOP - 4))]})
    assert most.choices[0].text == text  # MAX_STOP strings are taken
    for stop in (["x"] * (MAX_STOP + 1), ["x" * (MAX_STOP_CHARS + 1)]):
        bad = post(served, "/v1/completions", {**OK, "stop": stop})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "stop", bad.text


def test_streamed_n_choices_equal_the_whole_response(served, client):
    """Streamed n=3 over two prompts: every chunk names its choice, the choices' chunks interleave (they decode
    together), each choice's text and finish reason equal the non-streamed response's (seeded: choice j is seed
    + j, so they differ), usage comes once at the end summed over the choices, [DONE] once."""
    kw = dict(model=MODEL, prompt=["Hello", "The json"], n=3, max_tokens=8, temperature=1.0, seed=5)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    body = [c for c in chunks if c.choices]
    order = [c.choices[0].index for c in body]
    assert set(order) == set(range(6)) and order != sorted(order)
    for c in whole.choices:
        mine = [ch.choices[0] for ch in body if ch.choices[0].index == c.index]
        assert "".join(x.text for x in mine) == c.text, c.index
        assert [x.finish_reason for x in mine if x.finish_reason] == [c.finish_reason]
    assert len({c.text for c in whole.choices[:3]}) > 1  # the seeds differ
    assert [c for c in chunks if c.usage] == [chunks[-1]] and chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    msgs = [{"role": "user", "content": "What is JSON?"}]
    kw = dict(model=MODEL, messages=msgs, n=3, max_tokens=8, temperature=1.0, seed=9)
    whole = client.chat.completions.create(**kw)
    raw = httpx.post(
        served.url + "/v1/chat/completions", json={**kw, "stream": True, "stream_options": {"include_usage": True}}
    )
    events = [e.removeprefix("data: ") for e in raw.text.split("\n\n") if e]
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    objs = [json.loads(e) for e in events[:-1]]
    assert [o["choices"][0]["delta"]["role"] for o in objs[:3]] == ["assistant"] * 3
    assert [o["choices"][0]["index"] for o in objs[:3]] == [0, 1, 2]
    for c in whole.choices:
        mine = [o["choices"][0] for o in objs if o["choices"] and o["choices"][0]["index"] == c.index]
        assert "".join(x["delta"].get("content") or "" for x in mine) == c.message.content, c.index
        assert [x["finish_reason"] for x in mine if x["finish_reason"]] == [c.finish_reason]
    assert len({c.message.content for c in whole.choices}) > 1
    assert [o for o in objs if o.get("usage")] == [objs[-1]] and objs[-1]["choices"] == []
    assert objs[-1]["usage"]["prompt_tokens"] == whole.usage.prompt_tokens
    assert objs[-1]["usage"]["completion_tokens"] == whole.usage.completion_tokens


def test_streamed_n_choices_are_all_aborted_on_disconnect(served, monkeypatch):
    aborted = []
    real_abort = served.engine.abort
    monkeypatch.setattr(served.engine, "abort", lambda rid: (aborted.append(rid), real_abort(rid)))
    body = {**OK, "max_tokens": 200, "n": 3, "temperature": 1.0, "stream": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
    rid = json.loads(first[6:])["id"]
    deadline = time.monotonic() + 10
    while not {f"{rid}-{j}" for j in range(3)} <= set(aborted):
        assert time.monotonic() < deadline, f"not every choice was aborted: {aborted}"
        time.sleep(0.02)


def test_tokenizer_endpoints(served, client):
    """vLLM's /tokenizer_info, /tokenize (a prompt, with special-token text read as the token, or chat messages as
    a chat request renders them) and /detokenize; ``model`` may be left out; bad input is one 400."""
    tok = served.tok
    info = httpx.get(served.url + "/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["eos_token_id"] == tok.eos_id and info["bos_token"] is None
    assert info["tokenizer_class"] and info["model_max_length"] == CONTEXT and info["chat_format"] == "k2"
    assert info["added_tokens_decoder"][str(tok.eos_id)] == {"content": tok.eos_token, "special": True}
    assert info["pad_token"] == tok.pad_token
    import jinja2  # the template renders the messages as the server does (as transformers' apply_chat_template)

    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is JSON?"}]
    rendered = (
        jinja2.Environment().from_string(info["chat_template"]).render(messages=turns, add_generation_prompt=True)
    )
    assert tok.hf.encode(rendered, add_special_tokens=False).ids == render_chat(turns, tok).token_ids
    text = "The json module exposes an API"
    r = post(served, "/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode(text) and r["count"] == len(r["tokens"]) and r["max_model_len"] == CONTEXT
    assert r["token_strs"] == [tok.hf.id_to_token(t) for t in r["tokens"]]
    eos = post(served, "/tokenize", {"model": MODEL, "prompt": f"a{tok.eos_token}"}).json()["tokens"]
    assert eos == tok.encode("a") + [tok.eos_id]
    long = post(served, "/tokenize", {"prompt": text * 40}).json()  # longer than the context: still tokenised
    assert long["count"] == len(tok.encode(text * 40)) > CONTEXT
    msgs = [{"role": "user", "content": "What is JSON?"}]
    chat = post(served, "/tokenize", {"messages": msgs}).json()
    assert chat["tokens"] == render_chat(msgs, tok).token_ids
    used = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, temperature=0)
    assert chat["count"] == used.usage.prompt_tokens
    bare = post(served, "/tokenize", {"messages": msgs, "add_generation_prompt": False}).json()
    assert bare["tokens"] == render_chat(msgs, tok, add_generation_prompt=False).token_ids != chat["tokens"]
    assert post(served, "/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": text}
    assert post(served, "/detokenize", {"tokens": eos}).json() == {"prompt": f"a{tok.eos_token}"}
    # a completion without "model" is the served model's
    assert post(served, "/v1/completions", {k: v for k, v in OK.items() if k != "model"}).status_code == 200


TOKENIZE_BAD = [  # (path, body, status, words the message must contain, param)
    ("/tokenize", {}, 400, "exactly one of prompt and messages", None),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "exactly one", None),
    ("/tokenize", {"prompt": 5}, 400, "prompt", "prompt"),
    ("/tokenize", {"prompt": "a", "model": "gpt-4"}, 404, "does not exist", "model"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "b"}]}, 400, "role", "messages"),
    ("/detokenize", {"tokens": [10**6]}, 400, "not in the vocabulary", "tokens"),
    ("/detokenize", {"tokens": [2**40]}, 400, "not in the vocabulary", "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, ">= 0", "tokens"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens", "tokens.0"),
    ("/detokenize", {}, 400, "tokens", "tokens"),
]


@pytest.mark.parametrize("path,body,status,words,param", TOKENIZE_BAD, ids=[f"{b[0]}-{b[1]}" for b in TOKENIZE_BAD])
def test_bad_tokenizer_requests(served, path, body, status, words, param):
    r = post(served, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["param"] == param, err


UNSUPPORTED = [  # (path, field, a value the server does not honour, its no-op value or None)
    ("/v1/chat/completions", "response_format", {"type": "grammar", "grammar": "x"}, {"type": "text"}),
    ("/v1/completions", "response_format", {"type": "regex"}, None),
    ("/v1/chat/completions", "functions", [{"name": "f", "parameters": {}}], []),
    ("/v1/chat/completions", "function_call", "auto", "none"),
    ("/v1/chat/completions", "modalities", ["text", "audio"], ["text"]),
    ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "wav"}, None),
    ("/v1/chat/completions", "reasoning_effort", "high", None),
    ("/v1/chat/completions", "web_search_options", {}, None),
    ("/v1/chat/completions", "logit_bias", {"5": 10}, {}),
    ("/v1/completions", "logit_bias", {"5": 10}, {}),
    ("/v1/completions", "best_of", 2, 1),
    ("/v1/completions", "suffix", "end", ""),
]


@pytest.mark.parametrize("path,field,value,noop", UNSUPPORTED, ids=[f"{u[1]}={u[2]!s:.30}" for u in UNSUPPORTED])
def test_options_not_honoured_are_refused_naming_the_field(served, path, field, value, noop):
    body = {**(CHAT if "chat" in path else OK), "max_tokens": 1}
    r = post(served, path, {**body, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["code"] == "unsupported_parameter" and field in err["message"], err
    if noop is not None:
        assert post(served, path, {**body, field: noop}).status_code == 200


def test_harmless_option_values_are_accepted(served, client):
    """parallel_tool_calls means nothing without tools; min_p (a vLLM option) is honoured, not ignored."""
    msgs = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, parallel_tool_calls=True)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert post(served, "/v1/chat/completions", {**CHAT, "parallel_tool_calls": "yes"}).status_code == 400
    kw = dict(model=MODEL, prompt="Hello", max_tokens=8, temperature=1.5, seed=3)
    free = client.completions.create(**kw).choices[0].text
    top = client.completions.create(extra_body={"min_p": 1.0}, **kw).choices[0].text  # only the likeliest token
    assert top == greedy(client, "Hello", 8) != free
    assert post(served, "/v1/completions", {**OK, "min_p": 1.5}).json()["error"]["param"] == "min_p"


def test_lm_eval_local_completions_with_only_the_server_url(served, client):
    """lm-evaluation-harness's ``local-completions``, given only ``base_url``, finds the server's tokenizer
    (/tokenizer_info, /tokenize) and scores and generates through it: its log-likelihoods are the model's own
    (a full forward here; an empty context is conditioned on the EOS, looked up by its text), and generate_until
    with 5 stop strings (6 with the EOS it adds) ends at the first one met."""
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    lm = get_model("local-completions").create_from_arg_string(f"base_url={served.url}/v1/completions")
    assert lm.tokenizer_backend == "remote" and lm.eot_token_id == served.tok.eos_id
    tok, model = served.tok, served.engine.model

    def loglikelihood(context: list[int], continuation: list[int]) -> tuple[float, bool]:
        ids = torch.tensor(context + continuation)
        with torch.no_grad():
            lps = model(ids[None]).logits[0, :-1].double().log_softmax(-1)[len(context) - 1 :]
        target = ids[len(context) :]
        return lps.gather(1, target[:, None]).sum().item(), bool((lps.argmax(-1) == target).all())

    pairs = [("The json module", " exposes an API"), ("", "Return a string")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)], disable_tqdm=True)
    whole = tok.encode("".join(pairs[0]))
    context = tok.encode(pairs[0][0])
    want = [loglikelihood(context, whole[len(context) :]), loglikelihood([tok.eos_id], tok.encode(pairs[1][1]))]
    for (value, is_greedy), (ref, ref_greedy) in zip(got, want):
        assert abs(value - ref) <= 1e-3 and is_greedy == ref_greedy, (got, want)

    prompt = "Return a string"
    text = greedy(client, prompt, 12)
    stop = overlapping_stops(text)[1]
    until = [f"\x01never{i}\x02" for i in range(4)] + [stop]
    request = Instance("generate_until", {}, (prompt, {"until": until, "max_gen_toks": 12}), 0)
    assert lm.generate_until([request], disable_tqdm=True) == [text[: text.find(stop)]]


def test_an_empty_prompt_starts_from_the_bos_token(served, monkeypatch):
    """``prompt: ""`` (OpenAI takes it) is the BOS token alone, counted in ``usage.prompt_tokens``: the completion
    of its id, in a list of prompts too; a tokenizer without a BOS answers one 400 saying so (test_server's BAD);
    an empty id list stays a 400; a chat whose contents are empty strings is served."""
    bos = served.tok.eos_id  # this vocabulary has no BOS: the EOS, which precedes every packed document, stands in
    monkeypatch.setattr(served.app.state.serving.tok, "bos_id", bos)
    empty = post(served, "/v1/completions", {**OK, "prompt": "", "max_tokens": 6})
    assert empty.status_code == 200, empty.text
    ids = post(served, "/v1/completions", {**OK, "prompt": [bos], "max_tokens": 6}).json()
    assert empty.json()["choices"][0]["text"] == ids["choices"][0]["text"]
    assert empty.json()["usage"]["prompt_tokens"] == 1
    both = post(served, "/v1/completions", {**OK, "prompt": ["", "Hello"], "max_tokens": 6}).json()
    assert both["choices"][0]["text"] == ids["choices"][0]["text"] and both["usage"]["prompt_tokens"] == 1 + len(
        served.tok.encode("Hello")
    )
    bad = post(served, "/v1/completions", {**OK, "prompt": [[bos], []]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt", bad.text
    chat = post(served, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": ""}] * 2})
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] > 0, chat.text


def test_max_tokens_left_out_has_a_default_cap(served, monkeypatch):
    """Without max_tokens a completion stops after OpenAI's 16 tokens and a chat reply after the server's
    default_max_tokens (k3 serve --default-max-tokens), or where the context ends if that comes first."""
    ask = {"model": MODEL, "temperature": 0, "ignore_eos": True}
    r = post(served, "/v1/completions", {**ask, "prompt": "Hello"}).json()
    assert r["usage"]["completion_tokens"] == 16 and r["choices"][0]["finish_reason"] == "length"
    monkeypatch.setattr(served.app.state.serving, "default_max_tokens", 5)
    r = post(served, "/v1/chat/completions", {**ask, "messages": [{"role": "user", "content": "hi"}]}).json()
    assert r["usage"]["completion_tokens"] == 5 and r["choices"][0]["finish_reason"] == "length", r
    n = next(
        n
        for n in range(1, CONTEXT)
        if len(render_chat([{"role": "user", "content": "hi " * n}], served.tok).token_ids) > CONTEXT - 4
    )
    r = post(served, "/v1/chat/completions", {**ask, "messages": [{"role": "user", "content": "hi " * n}]}).json()
    used = r["usage"]
    assert used["prompt_tokens"] + used["completion_tokens"] == CONTEXT and used["completion_tokens"] < 5, r
