"""Chat rendering: a list of OpenAI-style messages (and the tools they may call) -> prompt token ids plus what
ends the reply.

The format follows the tokenizer's special tokens:

* ``"k3"`` when the vocabulary has K3's four XTML tokens ``<|open|>``, ``<|close|>``, ``<|sep|>`` and
  ``<|end_of_msg|>``. K3's exact chat rendering is not public; this is **our reading**: one
  ``<|open|>{role}<|sep|>{content}<|end_of_msg|>`` per message, ``<|open|>assistant<|sep|>`` as the generation
  prompt, and the reply ends at ``<|end_of_msg|>``.
* ``"k2"`` when it has ``<|im_user|> <|im_assistant|> <|im_system|> <|im_middle|> <|im_end|>`` (Kimi K2's
  template without its default system prompt): ``<|im_{role}|>{role}<|im_middle|>{content}<|im_end|>`` per
  message (``<|im_system|>`` heads every role but user and assistant), ``<|im_assistant|>assistant<|im_middle|>``
  as the generation prompt, the reply ends at ``<|im_end|>``.
* ``"plain"`` otherwise: ``"System: ...\\n"``, ``"User: ...\\n"``, ``"Assistant: ...\\n"``, the generation prompt
  ``"Assistant:"``, and the reply ends at the stop string ``"\\nUser:"``.

Tool calling follows Kimi K2's public format (its tokenizer's chat template and tool-call guidance), in every
format; for K3 it is **our reading** (K3's tool-call format is not public either):

* the ``tools`` list is declared first, as a message of role ``tool_declare`` whose content is the tools as
  compact JSON (``<|im_system|>tool_declare<|im_middle|>[...]<|im_end|>`` in k2);
* an assistant turn with ``tool_calls`` (its content may be null) is its content, then
  ``<|tool_calls_section_begin|>``, per call ``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>``
  ``{json arguments}<|tool_call_end|>``, then ``<|tool_calls_section_end|>``. IDX counts the calls of the whole
  conversation from 0 (K2's template numbers them so, whatever ids the client gave);
* a ``tool`` message (with the ``tool_call_id`` of an earlier call) is ``## Return of functions.NAME:IDX\\n``
  and its content, under the ``tool`` role.

The five section markers are special tokens where the vocabulary has them (Kimi K2's does) and plain text
otherwise. A reply holding a section is parsed back into OpenAI tool calls by k3.infer.tool_calls.

Special tokens are spliced in by id while every message content is encoded as plain text, so a user who types
``<|im_end|>`` gets the characters, not the token. Where contents hold no special-token text the ids equal
``tokenizer.encode(text, allow_special=True)`` of the rendered text.

:func:`chat_template` is the same rendering as a Jinja template, the ``chat_template`` of the tokenizer_config.json
that ``Tokenizer.save`` writes, so transformers' ``apply_chat_template`` (``tools=`` included) renders as
:func:`render_chat` does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

ROLES = ("system", "user", "assistant", "tool")
K3_TOKENS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")
K2_TOKENS = ("<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "<|im_end|>")
PLAIN_STOP = "\nUser:"
TOOL_MARKERS = (
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)
SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END = TOOL_MARKERS
TOOL_DECLARE = "tool_declare"  # the role of the message declaring the tools
RETURN_OF = "## Return of "  # heads a tool message's content: "## Return of functions.NAME:IDX\n"


@dataclass
class RenderedChat:
    """A rendered conversation: ``text`` (special tokens as their text), its ``token_ids``, and what ends the
    assistant's reply: ``stop`` strings and ``stop_token_ids`` (both to pass to :class:`SamplingParams`);
    ``next_call``: the index the reply's first tool call takes (the calls rendered so far)."""

    text: str
    token_ids: list[int]
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    format: str = "plain"
    next_call: int = 0


def _token_id(tokenizer, token: str) -> int | None:
    return tokenizer.hf.token_to_id(token)


def chat_format(tokenizer) -> str:
    """``"k3"``, ``"k2"`` or ``"plain"``, from the special tokens the vocabulary holds."""
    if all(_token_id(tokenizer, t) is not None for t in K3_TOKENS):
        return "k3"
    if all(_token_id(tokenizer, t) is not None for t in K2_TOKENS):
        return "k2"
    return "plain"


def call_id(name: str, index: int) -> str:
    """Kimi's id of the ``index``-th tool call of a conversation: ``functions.NAME:IDX``."""
    return f"functions.{name}:{index}"


def tools_json(tools: list) -> str:
    """The tool_declare content: the tools as compact JSON (as the template's ``tojson(separators=(',', ':'))``)."""
    return json.dumps(tools, ensure_ascii=False, separators=(",", ":"))


def arguments_text(arguments) -> str:
    """A call's arguments as rendered: a string as given (OpenAI sends JSON text), an object as JSON."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _tool_calls(i: int, m: dict) -> list[tuple[str, str, str]]:
    """The (id, name, arguments text) of message i's ``tool_calls``; one ValueError naming the first bad one."""
    calls = m.get("tool_calls")
    if not calls:
        return []
    if m.get("role") != "assistant":
        raise ValueError(f"messages[{i}].tool_calls: only assistant messages carry tool calls")
    if not isinstance(calls, list):
        raise ValueError(f"messages[{i}].tool_calls must be a list of tool calls")
    out = []
    for j, c in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or c.get("type", "function") != "function":
            raise ValueError(f'{where} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}')
        if not isinstance(c.get("id"), str) or not c["id"]:
            raise ValueError(f"{where}.id must be a non-empty string")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"{where}.function.name must be a non-empty string")
        if not isinstance(fn.get("arguments"), (str, dict)):
            raise ValueError(f"{where}.function.arguments must be a JSON string (or an object)")
        out.append((c["id"], fn["name"], arguments_text(fn["arguments"])))
    return out


def validate_messages(messages) -> list[dict]:
    """One ValueError naming the first bad message; returns the messages as ``{"role", "content"}`` dicts, with
    ``tool_calls`` (a list of (id, name, arguments text)) on assistant turns that call tools and ``tool_call_id``
    (the call's ``functions.NAME:IDX``) on tool messages."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    out, ids, n = [], {}, 0  # ids: a call's id as the client gave it -> its functions.NAME:IDX (the latest such)
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object with role and content, got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role={role!r} must be one of {', '.join(ROLES)}")
        calls = _tool_calls(i, m)
        if content is None and calls:
            content = ""
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string, got {type(content).__name__}")
        msg = {"role": role, "content": content}
        if calls:
            msg["tool_calls"] = calls
            for given, name, _ in calls:
                ids[given], n = call_id(name, n), n + 1
        if role == "tool":
            given = m.get("tool_call_id")
            if not isinstance(given, str) or not given:
                raise ValueError(f"messages[{i}].tool_call_id must be a non-empty string: the id of the call answered")
            if given not in ids:
                raise ValueError(f"messages[{i}].tool_call_id={given!r} answers no earlier assistant tool call")
            msg["tool_call_id"] = ids[given]
        out.append(msg)
    return out


def _jinja_parts(fmt: str):
    """(header of a role given as a Jinja expression, message end, generation prompt) of ``fmt``'s template."""
    if fmt == "plain":
        return (lambda r: f"{{{{ {r} | capitalize }}}}{{{{ ': ' }}}}"), "{{ '\\n' }}", "Assistant:"
    if fmt == "k3":
        return (lambda r: f"<|open|>{{{{ {r} }}}}<|sep|>"), "<|end_of_msg|>", "<|open|>assistant<|sep|>"
    return (
        (
            lambda r: (
                f"{{%- if {r} == 'user' -%}}<|im_user|>{{%- elif {r} == 'assistant' -%}}<|im_assistant|>"
                f"{{%- else -%}}<|im_system|>{{%- endif -%}}{{{{ {r} }}}}<|im_middle|>"
            )
        ),
        "<|im_end|>",
        "<|im_assistant|>assistant<|im_middle|>",
    )


def chat_template(tokenizer) -> str:
    """The Jinja chat template (transformers' ``apply_chat_template``, with or without ``tools``) of
    ``tokenizer``'s chat format: the text of :func:`render_chat`, with and without the generation prompt; a bad
    role, a non-string content, a tool message answering no earlier call or no messages raise, as render_chat
    does. (Rendered by transformers, special-token text typed inside a content becomes the special token: only
    render_chat keeps it plain text.) Text holding whitespace is written as Jinja expressions, which whitespace
    control leaves alone."""
    head, end, prompt = _jinja_parts(chat_format(tokenizer))
    roles = ", ".join(f"'{r}'" for r in ROLES)
    args = "call['function']['arguments']"
    call = (
        f"{CALL_BEGIN}{{{{ 'functions.' ~ call['function']['name'] ~ ':' ~ ns.calls }}}}{ARGUMENT_BEGIN}"
        f"{{%- if {args} is string -%}}{{{{ {args} }}}}{{%- else -%}}{{{{ {args} | tojson }}}}{{%- endif -%}}"
        f"{CALL_END}{{%- set ns.calls = ns.calls + 1 -%}}"
    )
    return (
        "{%- if not messages -%}{{ raise_exception('messages must be a non-empty list') }}{%- endif -%}"
        "{%- set ns = namespace(calls=0) -%}"
        f"{{%- if tools -%}}{head(repr(TOOL_DECLARE))}{{{{ tools | tojson(separators=(',', ':')) }}}}{end}"
        "{%- endif -%}"
        "{%- for message in messages -%}"
        f"{{%- if message['role'] not in [{roles}] -%}}"
        f"{{{{ raise_exception('message role must be one of {', '.join(ROLES)}') }}}}{{%- endif -%}}"
        "{%- set calls = message.get('tool_calls') or [] -%}"
        "{%- if calls and message['role'] != 'assistant' -%}"
        "{{ raise_exception('only assistant messages carry tool_calls') }}{%- endif -%}"
        "{%- if not (calls and message.get('content') is none) and message.get('content') is not string -%}"
        "{{ raise_exception('message content must be a string') }}{%- endif -%}"
        "{%- if message['role'] == 'tool' -%}"
        "{%- if message.get('tool_call_id') is not string -%}"
        "{{ raise_exception('a tool message needs the tool_call_id of the call it answers') }}{%- endif -%}"
        "{%- set found = namespace(id=none, n=0) -%}"
        "{%- for prev in messages[:loop.index0] -%}{%- for c in (prev.get('tool_calls') or []) -%}"
        "{%- if c['id'] == message['tool_call_id'] -%}"
        "{%- set found.id = 'functions.' ~ c['function']['name'] ~ ':' ~ found.n -%}{%- endif -%}"
        "{%- set found.n = found.n + 1 -%}{%- endfor -%}{%- endfor -%}"
        "{%- if found.id is none -%}"
        "{{ raise_exception('tool_call_id answers no earlier assistant tool call') }}{%- endif -%}"
        f"{head('message.role')}{{{{ {RETURN_OF!r} ~ found.id ~ '\\n' ~ message['content'] }}}}{end}"
        "{%- else -%}"
        f"{head('message.role')}{{{{ message.get('content') or '' }}}}"
        f"{{%- if calls -%}}{SECTION_BEGIN}{{%- for call in calls -%}}{call}{{%- endfor -%}}{SECTION_END}"
        f"{{%- endif -%}}{end}"
        "{%- endif -%}"
        "{%- endfor -%}"
        f"{{%- if add_generation_prompt -%}}{prompt}{{%- endif -%}}"
    )


IMAGE_SLOT = "\ufffc"  # stands for an image inside a message content (rendered as image_token_id)


def _encode(tokenizer, text: str, image_token_id: int | None) -> list[int]:
    """Plain-text ids of ``text``, with each IMAGE_SLOT character replaced by ``image_token_id`` when given."""
    if image_token_id is None:
        return tokenizer.encode(text)
    ids: list[int] = []
    for i, part in enumerate(text.split(IMAGE_SLOT)):
        if i:
            ids.append(image_token_id)
        if part:
            ids.extend(tokenizer.encode(part))
    return ids


def _pieces(messages: list[dict], tokenizer, fmt: str, add_generation_prompt: bool, tools) -> tuple[list, int]:
    """The rendering of validated ``messages`` as ``(text, is_special, is_trained)`` pieces, and the number of tool
    calls rendered. Trained pieces are what the assistant says: its content, its tool-call section and its message
    end (the plain format's reply begins with the space after ``Assistant:``, where its generation prompt ends)."""
    pieces: list[tuple[str, bool, bool]] = []

    def header(role: str) -> None:
        if fmt == "plain":  # the space after the colon starts the reply: the generation prompt stops before it
            pieces.extend([(f"{role.capitalize()}:", False, False), (" ", False, role == "assistant")])
        elif fmt == "k3":
            pieces.extend([("<|open|>", True, False), (role, False, False), ("<|sep|>", True, False)])
        else:
            token = f"<|im_{role}|>" if role in ("user", "assistant") else "<|im_system|>"
            pieces.extend([(token, True, False), (role, False, False), ("<|im_middle|>", True, False)])

    end = {"plain": "\n", "k3": "<|end_of_msg|>", "k2": "<|im_end|>"}[fmt]
    if tools:
        header(TOOL_DECLARE)
        pieces.extend([(tools_json(tools), False, False), (end, fmt != "plain", False)])
    calls = 0
    for m in messages:
        header(m["role"])
        said = m["role"] == "assistant"
        if m["role"] == "tool":
            pieces.append((f"{RETURN_OF}{m['tool_call_id']}\n{m['content']}", False, False))
        else:
            pieces.append((m["content"], False, said))
        if m.get("tool_calls"):

            def marker(text: str) -> None:
                pieces.append((text, _token_id(tokenizer, text) is not None, True))

            marker(SECTION_BEGIN)
            for _, name, arguments in m["tool_calls"]:
                marker(CALL_BEGIN)
                pieces.append((call_id(name, calls), False, True))
                marker(ARGUMENT_BEGIN)
                pieces.append((arguments, False, True))
                marker(CALL_END)
                calls += 1
            marker(SECTION_END)
        pieces.append((end, fmt != "plain", said))
    if add_generation_prompt:
        if fmt == "plain":
            pieces.append(("Assistant:", False, False))
        else:
            header("assistant")
    return pieces, calls


def _encode_pieces(pieces: list, tokenizer, image_token_id: int | None, split_trained: bool):
    """(token ids, per id whether its piece is trained): special pieces by id, each run of text between them
    encoded as one (as a tokenizer reads the text); ``split_trained`` also ends a run where trained text begins or
    ends, so that a reply's ids are the ids it is generated as after its prompt."""
    ids: list[int] = []
    trained: list[bool] = []
    run: list[str] = []  # text since the last special token (or trained / untrained change)
    run_trained = False

    def flush() -> None:
        text = "".join(run)
        if text:
            new = _encode(tokenizer, text, image_token_id)
            ids.extend(new)
            trained.extend([run_trained] * len(new))
        run.clear()

    for piece, special, is_trained in [*pieces, ("", True, False)]:
        if special:
            flush()
            if piece:
                ids.append(_token_id(tokenizer, piece))
                trained.append(is_trained)
        elif piece:
            if split_trained and run and is_trained != run_trained:
                flush()
            if not run:
                run_trained = is_trained
            run.append(piece)
    return ids, trained


def render_chat(
    messages,
    tokenizer,
    add_generation_prompt: bool = True,
    image_token_id: int | None = None,
    tools: list | None = None,
) -> RenderedChat:
    """Render ``messages`` (roles system/user/assistant/tool, string contents; assistant ``tool_calls``, tool
    ``tool_call_id``) and the ``tools`` they may call (OpenAI's tool objects, declared as given) for
    ``tokenizer``'s chat format.

    Returns a :class:`RenderedChat` with the text, the token ids (built piecewise: special-token ids spliced
    in, each run of text between them encoded as plain text), the stop strings / stop token ids, the format name
    and the index of the next tool call. Raises one ValueError for a bad message or an empty list. With
    ``image_token_id`` (multimodal models) each IMAGE_SLOT character of a content becomes that media placeholder
    token.
    """
    messages = validate_messages(messages)
    fmt = chat_format(tokenizer)
    pieces, calls = _pieces(messages, tokenizer, fmt, add_generation_prompt, tools)
    ids, _ = _encode_pieces(pieces, tokenizer, image_token_id, split_trained=False)
    text = "".join(p for p, _, _ in pieces)
    if fmt == "plain":
        return RenderedChat(text, ids, [PLAIN_STOP], [], fmt, calls)
    end = "<|end_of_msg|>" if fmt == "k3" else "<|im_end|>"
    return RenderedChat(text, ids, [], [_token_id(tokenizer, end)], fmt, calls)


@dataclass
class TrainingChat:
    """A conversation rendered for supervised fine-tuning: ``token_ids``, ``trained`` (per id: a target of the
    loss, i.e. said by the assistant: its content, tool calls and message end) and ``num_bytes`` (UTF-8 bytes of
    the trained text, special tokens not counted: the denominator of bits per byte)."""

    token_ids: list[int]
    trained: list[bool]
    num_bytes: int


def render_training_chat(messages, tokenizer, tools: list | None = None) -> TrainingChat:
    """``messages`` rendered as :func:`render_chat` renders them (no generation prompt), with the assistant's
    tokens marked. Each reply is encoded apart from the text before it, so its ids are those the model generates
    after :func:`render_chat`'s prompt for it (in the k3 and k2 formats special tokens bound every message, so the
    ids equal render_chat's; in the plain format a run of text may otherwise merge across a reply's edge)."""
    messages = validate_messages(messages)
    pieces, _ = _pieces(messages, tokenizer, chat_format(tokenizer), False, tools)
    ids, trained = _encode_pieces(pieces, tokenizer, None, split_trained=True)
    num_bytes = sum(len(p.encode("utf-8")) for p, special, is_trained in pieces if is_trained and not special)
    return TrainingChat(ids, trained, num_bytes)
