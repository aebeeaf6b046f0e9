"""Tool calling through the openai client against a live server (k3.infer.tools): tools -> tool_calls (forced by
tool_choice "required" or a named function: a tiny random model calls a tool only when constrained) -> the tool's
result -> an answer, whole and streamed; "auto" and "none"; one 400 per bad tools entry, tool_choice or tool
message. The checkpoint's vocabulary holds the section markers as special tokens; test_chat_engine_text_markers
drives a vocabulary without them (the markers are text) through the engine."""

import json
import sys

import openai
import pytest
import torch

from k3.config import get_preset
from k3.checkpoint.format import save_pretrained
from k3.data.chat import TOOL_MARKERS, render_chat
from k3.data.tokenizer import DEFAULT_SPECIAL_TOKENS, train_bpe
from k3.infer.async_engine import AsyncEngine
from k3.infer.engine import Engine
from k3.infer.load import load_for_inference
from k3.infer.sampling import SamplingParams
from k3.infer.server import create_app
from k3.infer.tool_calls import parse_tool_calls
from k3.infer.tools import ToolUse
from k3.model.decoder import K3ForCausalLM
from tests.infer import test_server
from tests.infer.test_server import LiveServer, corpus

pytest.importorskip("llguidance")
MODEL, CONTEXT = "k3-tools", 1024
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now", "description": "The time"}},  # no parameters
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def valid_weather(arguments: str) -> bool:
    v = json.loads(arguments)
    return (
        set(v) == {"city", "unit", "days"}
        and isinstance(v["city"], str)
        and len(v["city"]) <= 8
        and v["unit"] in ("c", "f")
        and type(v["days"]) is int
        and 1 <= v["days"] <= 7
    )


def valid_call(call) -> bool:
    """A call of one of TOOLS whose arguments match its parameters."""
    if call.function.name == "now":
        return json.loads(call.function.arguments) == {}
    return call.function.name == "get_weather" and valid_weather(call.function.arguments)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tok = train_bpe([corpus()], vocab_size=400, special_tokens=DEFAULT_SPECIAL_TOKENS + TOOL_MARKERS)
    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset("tiny").replace(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id))
    path = tmp_path_factory.mktemp("ckpt")
    save_pretrained(model, path)
    tok.save(path)
    model, tok, _ = load_for_inference(path, "cpu", "float32")
    async_engine = AsyncEngine(Engine(model, tok, max_batch=8, max_context=CONTEXT))
    live = LiveServer(create_app(async_engine, tok, MODEL, CONTEXT))
    live.tok = tok
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=60)


def chat(client, **kw):
    return client.chat.completions.create(model=MODEL, **{"max_tokens": 120, "temperature": 1.0, **kw})


def test_forced_call_round_trip(served, client):
    """A named call: one call of get_weather, id functions.get_weather:0, schema-valid JSON arguments; sent back
    with the tool's result, the next forced call is numbered 1 and a free turn answers in text."""
    r = chat(client, messages=ASK, tools=TOOLS, tool_choice=NAMED, seed=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id == "functions.get_weather:0" and valid_weather(call.function.arguments)
    history = ASK + [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"weather": "sunny"}'},
    ]
    again = chat(client, messages=history, tools=TOOLS, tool_choice=NAMED, seed=1).choices[0]
    assert again.message.tool_calls[0].id == "functions.get_weather:1", again
    answer = chat(client, messages=history, tools=TOOLS, tool_choice="none", max_tokens=8, seed=2).choices[0]
    assert answer.finish_reason in ("stop", "length") and isinstance(answer.message.content, str)
    assert answer.message.tool_calls is None
    # the prompt is the chat template's rendering, tools declared
    rendered = render_chat(history, served.tok, tools=TOOLS)
    assert chat(client, messages=history, tools=TOOLS, max_tokens=1).usage.prompt_tokens == len(rendered.token_ids)


def test_required_calls_are_valid_and_parallel_false_holds_one(client):
    counts = set()
    for seed in range(4):
        r = chat(client, messages=ASK, tools=TOOLS, tool_choice="required", seed=seed, max_tokens=300)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        calls = choice.message.tool_calls
        assert all(valid_call(c) for c in calls) and [c.id.rsplit(":", 1)[1] for c in calls] == [
            str(i) for i in range(len(calls))
        ]
        counts.add(len(calls))
        one = chat(client, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=seed)
        assert len(one.choices[0].message.tool_calls) == 1 and valid_call(one.choices[0].message.tool_calls[0])
    assert max(counts) > 1, counts  # without parallel_tool_calls: false a random model writes several calls


def assemble(chunks) -> tuple[str | None, list[dict], list]:
    """(content, calls, finish reasons) of a stream's chunks, as an OpenAI client accumulates them."""
    content, calls, reasons = None, {}, []
    for ch in chunks:
        if not ch.choices:
            continue
        c = ch.choices[0]
        if c.delta.content:
            content = (content or "") + c.delta.content
        for d in c.delta.tool_calls or []:
            if d.id is not None:
                assert d.index not in calls and d.function.arguments == ""
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            else:
                calls[d.index]["arguments"] += d.function.arguments
        if c.finish_reason:
            reasons.append(c.finish_reason)
    return content, [calls[i] for i in sorted(calls)], reasons


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_streamed_calls_equal_the_whole_response(client, tool_choice):
    kw = dict(messages=ASK, tools=TOOLS, tool_choice=tool_choice, seed=3, max_tokens=300)
    whole = chat(client, **kw).choices[0]
    content, calls, reasons = assemble(chat(client, stream=True, stream_options={"include_usage": True}, **kw))
    assert reasons == ["tool_calls"] and content is None
    assert calls == [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls
    ]


def test_auto_leaves_text_as_content(client):
    """Unconstrained, the random model writes no section: its text is the content, streamed or not."""
    kw = dict(messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=16, temperature=0)
    whole = client.chat.completions.create(model=MODEL, **kw).choices[0]
    assert whole.message.tool_calls is None and whole.finish_reason in ("stop", "length")
    content, calls, reasons = assemble(client.chat.completions.create(model=MODEL, stream=True, **kw))
    assert (content or "") == whole.message.content and calls == [] and reasons == [whole.finish_reason]


def test_without_llguidance_a_forced_call_names_the_extra(client, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, messages=ASK, tools=TOOLS, tool_choice="required")
    assert e.value.body["param"] == "tool_choice" and "k3[structured]" in e.value.body["message"], e.value.body
    assert chat(client, messages=ASK, tools=TOOLS, max_tokens=2).choices[0].finish_reason in ("stop", "length")


CALLED = {
    "role": "assistant",
    "content": None,
    "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}],
}
BAD = [  # (request fields, param, words of the message)
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type", '"function"'),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools.0.function.name", "1 to 64"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name", "1 to 64"),
    ({"tools": [{"type": "function"}]}, "tools.0.function", "object"),
    (
        {"tools": [TOOLS[1], {"type": "function", "function": {"name": "f", "parameters": []}}]},
        "tools.1.function.parameters",
        "JSON schema object",
    ),
    ({"tools": [TOOLS[1], TOOLS[1]]}, "tools.1.function.name", "twice"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "must be"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
        "response_format",
    ),
    (
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
            "tool_choice": "required",
        },
        "tools.0.function.parameters",
        "JSON schema",
    ),
    ({"functions": [{"name": "f"}]}, "functions", "tools"),
    ({"function_call": "auto"}, "function_call", "tool_choice"),
    ({"messages": ASK + [CALLED, {"role": "tool", "content": "12:00"}]}, "messages", "tool_call_id"),
    (
        {"messages": ASK + [CALLED, {"role": "tool", "tool_call_id": "call_9", "content": "x"}]},
        "messages",
        "answers no earlier",
    ),
    ({"messages": ASK + [{"role": "assistant", "content": None}]}, "messages", "content must be a string"),
]


@pytest.mark.parametrize("fields,param,words", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_tool_requests_are_one_400(served, fields, param, words):
    r = test_server.post(served, "/v1/chat/completions", {"model": MODEL, "messages": ASK, "max_tokens": 2, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_tool_history_with_null_content_is_served(client):
    """An assistant turn with tool_calls and content null, then the tool's result, then a plain answer."""
    history = ASK + [CALLED, {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    r = chat(client, messages=history, tools=TOOLS, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_chat_engine_text_markers(tmp_path):
    """A vocabulary without the markers as tokens: the forced grammar spells them as text, and the output
    parses into schema-valid calls."""
    tok = train_bpe([corpus()], vocab_size=400)
    assert tok.hf.token_to_id(TOOL_MARKERS[0]) is None
    torch.manual_seed(0)
    model = K3ForCausalLM(get_preset("tiny").replace(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id)).eval()
    engine = Engine(model, tok, max_batch=2, max_context=CONTEXT)
    use = ToolUse(TOOLS, {"get_weather": WEATHER, "now": {"type": "object", "properties": {}}}, "get_weather")
    rendered = render_chat(ASK, tok, tools=TOOLS)
    params = [SamplingParams(max_tokens=200, temperature=1.0, seed=s, grammar=use.grammar(tok, 3)) for s in (0, 1)]
    for out in engine.generate([rendered.token_ids] * 2, params):
        content, calls = parse_tool_calls(out["text"], use.schemas)
        assert out["finish_reason"] == "stop" and content is None, out["text"]
        assert [c.id for c in calls] == ["functions.get_weather:3"] and valid_weather(calls[0].arguments)
