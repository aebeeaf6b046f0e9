"""Structured output (``response_format``, k3.infer.grammar): JSON constrained by llguidance on the tiny random
checkpoint of test_server, through the openai client and through the engine (overlapped steps included)."""

import json
import sys

import openai
import pytest

from k3.infer.engine import Engine
from k3.infer.grammar import grammar_for
from k3.infer.load import load_for_inference
from k3.infer.sampling import SamplingParams
from tests.infer import test_server

pytest.importorskip("llguidance")
ckpt, served, client = test_server.ckpt, test_server.served, test_server.client  # (module-scoped fixtures)
MODEL = test_server.MODEL
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 4}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
MSGS = [{"role": "user", "content": "Who are you?"}]


def valid_person(text: str) -> bool:
    value = json.loads(text)
    return (
        set(value) == {"name", "age"}
        and isinstance(value["name"], str)
        and len(value["name"]) <= 4
        and type(value["age"]) is int
        and 0 <= value["age"] <= 99
    )


def test_json_schema_output_parses_and_matches_the_schema(served, client):
    for seed in range(4):
        r = client.chat.completions.create(
            model=MODEL, messages=MSGS, max_tokens=48, temperature=1.0, seed=seed, response_format=SCHEMA_FORMAT
        )
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice
        assert valid_person(choice.message.content), choice.message.content
    r = client.completions.create(
        model=MODEL, prompt="A person:", max_tokens=48, temperature=0, extra_body={"response_format": SCHEMA_FORMAT}
    )
    assert r.choices[0].finish_reason == "stop" and valid_person(r.choices[0].text), r.choices[0]


def test_json_object_output_parses(served, client):
    """A random model may write a long object (cut at max_tokens, the start of one); those that end parse."""
    r = client.chat.completions.create(
        model=MODEL,
        messages=MSGS,
        max_tokens=160,
        temperature=1.0,
        seed=0,
        n=6,
        response_format={"type": "json_object"},
    )
    ended = [c.message.content for c in r.choices if c.finish_reason == "stop"]
    assert ended and all(isinstance(json.loads(text), dict) for text in ended), ended
    assert all(c.message.content.startswith("{") for c in r.choices)


def test_max_tokens_before_the_grammar_completes_is_length(served, client):
    r = client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=3, temperature=0, response_format=SCHEMA_FORMAT
    )
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.content.startswith('{"')
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice.message.content)


@pytest.mark.parametrize(
    "fmt,words",
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}, "not valid"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "'schema'"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}, "'strict'"),
    ],
)
def test_bad_schema_is_a_400_naming_response_format(served, client, fmt, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, response_format=fmt)
    err = e.value.body
    assert err["param"] == "response_format" and words in err["message"], err


def test_without_llguidance_the_request_names_the_extra(served, client, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance now raises ImportError
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=MSGS, max_tokens=4, response_format={"type": "json_object"}
        )
    err = e.value.body
    assert err["param"] == "response_format" and "k3[structured]" in err["message"], err
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2, response_format={"type": "text"})
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("overlap", [False, True])
def test_constrained_rows_leave_their_batch_mates_alone(ckpt, overlap):
    """A greedy unconstrained request gives the same tokens alone and beside constrained ones; the constrained
    outputs are the same with overlapped steps (each mask waits for its previous token) as without."""
    model, tok, _ = load_for_inference(ckpt, "cpu", "float32")
    engine = Engine(model, tok, max_batch=4, max_context=test_server.CONTEXT, overlap=overlap)
    prompt = tok.encode("The json module")
    free = SamplingParams(max_tokens=24, temperature=0)
    alone = engine.generate([prompt], free)[0]
    grammar = grammar_for(SCHEMA_FORMAT)
    constrained = [SamplingParams(max_tokens=48, temperature=1.0, seed=s, grammar=grammar) for s in range(2)]
    out = engine.generate([prompt, prompt, tok.encode("A person:")], [free, *constrained])
    assert out[0]["token_ids"] == alone["token_ids"]
    for d in out[1:]:
        assert d["finish_reason"] == "stop" and valid_person(d["text"]), d
    reference = Engine(model, tok, max_batch=4, max_context=test_server.CONTEXT, overlap=False)
    assert [d["text"] for d in reference.generate([prompt, tok.encode("A person:")], constrained)] == [
        d["text"] for d in out[1:]
    ]
    assert engine.constrained == 0 and not engine.running
