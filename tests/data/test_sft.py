"""Chat data for ``--task sft``: the rendering's trained tokens, packing with document masks, the embedded set."""

import json

import pytest
import torch

from k3.data.batch import IGNORE_INDEX
from k3.data.chat import render_chat, render_training_chat
from k3.data.documents import Document
from k3.data.sft import chat_dataset, load_conversations, parse_conversation, read_chat_jsonl
from k3.data.tokenizer import train_bpe
from tests.train.finetune_sources import tokenizer as k2_tokenizer

CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 4}'},
    {"role": "assistant", "content": "4 degrees."},
]


def test_trained_tokens_are_exactly_the_assistants_k2():
    """Built by hand in Kimi K2's format (the tool-call markers are text in this vocabulary): context (tool
    declaration, system, user, tool result, the assistant headers) untrained; the call section, the reply and the
    assistant's message ends trained."""
    tok = k2_tokenizer()
    s = tok.hf.token_to_id
    enc = tok.encode

    def message(head: str, role: str, content: str) -> list[int]:
        return [s(head)] + enc(role) + [s("<|im_middle|>")] + enc(content) + [s("<|im_end|>")]

    def assistant_head() -> list[int]:
        return [s("<|im_assistant|>")] + enc("assistant") + [s("<|im_middle|>")]

    declared = json.dumps(TOOLS, separators=(",", ":"))
    section = (
        '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": '
        '"Oslo"}<|tool_call_end|><|tool_calls_section_end|>'
    )
    parts = [
        (message("<|im_system|>", "tool_declare", declared), False),
        (message("<|im_system|>", "system", "Be brief."), False),
        (message("<|im_user|>", "user", "Weather in Oslo?"), False),
        (assistant_head(), False),
        (enc(section) + [s("<|im_end|>")], True),
        (message("<|im_system|>", "tool", '## Return of functions.get_weather:0\n{"temp": 4}'), False),
        (assistant_head(), False),
        (enc("4 degrees.") + [s("<|im_end|>")], True),
    ]
    want_ids = [i for ids, _ in parts for i in ids]
    want_trained = [t for ids, t in parts for _ in ids]
    got = render_training_chat(MESSAGES, tok, TOOLS)
    assert got.token_ids == want_ids and got.trained == want_trained
    assert got.token_ids == render_chat(MESSAGES, tok, add_generation_prompt=False, tools=TOOLS).token_ids
    assert got.num_bytes == len(section.encode()) + len(b"4 degrees.")


def test_plain_format_reply_is_encoded_after_its_prompt():
    """Without chat tokens (plain format) the reply, " hello\\n", is encoded apart from "User: hi\\nAssistant:", the
    generation prompt it follows at inference, so the trained ids are those the model generates there."""
    tok = train_bpe(["User: hi\nAssistant: hello\n" * 50], vocab_size=280, special_tokens=("<|endoftext|>",))
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    got = render_training_chat(chat, tok)
    prompt = render_chat(chat[:1], tok).token_ids
    assert prompt == tok.encode("User: hi\nAssistant:")
    assert got.token_ids == prompt + tok.encode(" hello\n")
    assert got.trained == [False] * len(prompt) + [True] * len(tok.encode(" hello\n"))
    assert render_chat(chat, tok, add_generation_prompt=False).text == "User: hi\nAssistant: hello\n"


def test_packed_rows_keep_labels_on_trained_tokens_and_one_segment_per_conversation():
    tok = k2_tokenizer()
    chats = [MESSAGES, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]] * 3
    docs = [Document(f"c{i}", json.dumps({"messages": m, "tools": TOOLS})) for i, m in enumerate(chats)]
    data = chat_dataset(docs, tok, seq_len=64)
    stream, trained = data.tokens.long(), data.trained
    assert trained.shape == stream.shape and data.num_labels == int(trained.sum())
    for row in range(data.num_rows):
        b = data.rows_batch([row])
        at = torch.arange(row * 64 + 1, row * 64 + 65)
        want = torch.where(trained[at] & (stream[at - 1] != tok.eos_id), stream[at], IGNORE_INDEX)
        assert torch.equal(b.labels[0], want)
        eos_after = (b.input_ids[0] == tok.eos_id).nonzero().reshape(-1) + 1
        assert set(b.cu_seqlens.tolist()) == {0, 64} | set(eos_after.tolist())
    # every conversation ends with an assistant message: its EOS is trained, and nothing untrained is
    eos = (stream == tok.eos_id).nonzero().reshape(-1)
    assert len(eos) == len(docs) and bool(trained[eos].all())
    rendered = {len(render_training_chat(m, tok, TOOLS).token_ids) for m in chats}
    assert data.tokens.numel() == sum(len(render_training_chat(m, tok, TOOLS).token_ids) + 1 for m in chats)
    assert len(rendered) == 2


def test_bad_conversations_fail_with_their_line(tmp_path):
    path = tmp_path / "chat.jsonl"
    good = json.dumps({"messages": MESSAGES[1:3] + [MESSAGES[3], MESSAGES[4]]})
    cases = [
        ("not json", "invalid JSON"),
        (json.dumps({"text": "hi"}), 'expected a JSON object {"messages": [...]}'),
        (json.dumps({"messages": [{"role": "robot", "content": "x"}]}), "messages[0].role='robot'"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}]}), "no assistant message"),
        (json.dumps({"messages": MESSAGES, "tools": "x"}), "tools must be a list"),
    ]
    for line, why in cases:
        path.write_text(good + "\n\n" + line + "\n")
        with pytest.raises(ValueError, match="chat.jsonl:3: ") as e:
            read_chat_jsonl(path)
        assert why in str(e.value) and "\n" not in str(e.value)
    path.write_text(good + "\n" + good + "\n")
    assert [d.name for d in read_chat_jsonl(path)] == ["chat.jsonl:1", "chat.jsonl:2"]
    with pytest.raises(FileNotFoundError, match="expected a .jsonl file"):
        load_conversations(tmp_path / "missing.jsonl")


def test_embedded_set_renders_and_splits():
    tok = k2_tokenizer()
    train, val = load_conversations(None, "train"), load_conversations(None, "validation")
    assert len(val) >= 20 and len(train) > 10 * len(val)
    assert not {d.text for d in train} & {d.text for d in val}  # distinct conversations
    records = [parse_conversation(d.text, d.name) for d in train + val]
    assert any(tools for _, tools in records) and any(m[0]["role"] == "system" for m, _ in records)
    assert load_conversations(None, "train") == train  # the same set every time
    data = chat_dataset(val, tok, seq_len=128)
    assert 0.2 < data.num_labels / data.tokens.numel() < 0.8
