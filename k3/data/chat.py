"""Chat rendering: a list of ``{"role", "content"}`` messages -> prompt token ids plus what ends the reply.

The format follows the tokenizer's special tokens:

* ``"k3"`` when the vocabulary has K3's four XTML tokens ``<|open|>``, ``<|close|>``, ``<|sep|>`` and
  ``<|end_of_msg|>``. K3's exact chat rendering is not public; this is **our reading**: one
  ``<|open|>{role}<|sep|>{content}<|end_of_msg|>`` per message, ``<|open|>assistant<|sep|>`` as the generation
  prompt, and the reply ends at ``<|end_of_msg|>``.
* ``"k2"`` when it has ``<|im_user|> <|im_assistant|> <|im_system|> <|im_middle|> <|im_end|>`` (Kimi K2's
  template without its default system prompt): ``<|im_{role}|>{role}<|im_middle|>{content}<|im_end|>`` per
  message, ``<|im_assistant|>assistant<|im_middle|>`` as the generation prompt, the reply ends at ``<|im_end|>``.
* ``"plain"`` otherwise: ``"System: ...\\n"``, ``"User: ...\\n"``, ``"Assistant: ...\\n"``, the generation prompt
  ``"Assistant:"``, and the reply ends at the stop string ``"\\nUser:"``.

Special tokens are spliced in by id while every message content is encoded as plain text, so a user who types
``<|im_end|>`` gets the characters, not the token. Where contents hold no special-token text the ids equal
``tokenizer.encode(text, allow_special=True)`` of the rendered text.

:func:`chat_template` is the same rendering as a Jinja template, the ``chat_template`` of the tokenizer_config.json
that ``Tokenizer.save`` writes, so transformers' ``apply_chat_template`` renders as :func:`render_chat` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROLES = ("system", "user", "assistant")
K3_TOKENS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")
K2_TOKENS = ("<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "<|im_end|>")
PLAIN_STOP = "\nUser:"


@dataclass
class RenderedChat:
    """A rendered conversation: ``text`` (special tokens as their text), its ``token_ids``, and what ends the
    assistant's reply: ``stop`` strings and ``stop_token_ids`` (both to pass to :class:`SamplingParams`)."""

    text: str
    token_ids: list[int]
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    format: str = "plain"


def _token_id(tokenizer, token: str) -> int | None:
    return tokenizer.hf.token_to_id(token)


def chat_format(tokenizer) -> str:
    """``"k3"``, ``"k2"`` or ``"plain"``, from the special tokens the vocabulary holds."""
    if all(_token_id(tokenizer, t) is not None for t in K3_TOKENS):
        return "k3"
    if all(_token_id(tokenizer, t) is not None for t in K2_TOKENS):
        return "k2"
    return "plain"


def validate_messages(messages) -> list[dict]:
    """One ValueError naming the first bad message; returns the messages as ``{"role", "content"}`` dicts."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object with role and content, got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role={role!r} must be one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string, got {type(content).__name__}")
        out.append({"role": role, "content": content})
    return out


def chat_template(tokenizer) -> str:
    """The Jinja chat template (transformers' ``apply_chat_template``) of ``tokenizer``'s chat format: the text of
    :func:`render_chat`, with and without the generation prompt; a bad role, a non-string content or no
    messages raise, as render_chat does. (Rendered by transformers, special-token text typed inside a content
    becomes the special token: only render_chat keeps it plain text.)"""
    fmt = chat_format(tokenizer)
    if fmt == "plain":
        body, prompt = "{{ message['role'] | capitalize }}: {{ message['content'] }}{{ '\\n' }}", "Assistant:"
    elif fmt == "k3":
        body = "<|open|>{{ message['role'] }}<|sep|>{{ message['content'] }}<|end_of_msg|>"
        prompt = "<|open|>assistant<|sep|>"
    else:
        body = "<|im_{{ message['role'] }}|>{{ message['role'] }}<|im_middle|>{{ message['content'] }}<|im_end|>"
        prompt = "<|im_assistant|>assistant<|im_middle|>"
    roles = ", ".join(f"'{r}'" for r in ROLES)
    return (
        "{%- if not messages -%}{{ raise_exception('messages must be a non-empty list') }}{%- endif -%}"
        "{%- for message in messages -%}"
        f"{{%- if message['role'] not in [{roles}] -%}}"
        f"{{{{ raise_exception('message role must be one of {', '.join(ROLES)}') }}}}{{%- endif -%}}"
        "{%- if message['content'] is not string -%}"
        "{{ raise_exception('message content must be a string') }}{%- endif -%}"
        f"{body}{{%- endfor -%}}"
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


def render_chat(
    messages, tokenizer, add_generation_prompt: bool = True, image_token_id: int | None = None
) -> RenderedChat:
    """Render ``messages`` (roles system/user/assistant, string contents) for ``tokenizer``'s chat format.

    Returns a :class:`RenderedChat` with the text, the token ids (built piecewise: special-token ids spliced
    in, contents and role names encoded as plain text), the stop strings / stop token ids and the format name.
    Raises one ValueError for a bad role, a non-string content or an empty list. With ``image_token_id``
    (multimodal models) each IMAGE_SLOT character of a content becomes that media placeholder token.
    """
    messages = validate_messages(messages)
    fmt = chat_format(tokenizer)
    if fmt == "plain":
        text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "Assistant:"
        return RenderedChat(text, _encode(tokenizer, text, image_token_id), [PLAIN_STOP], [], fmt)

    pieces: list[tuple[str, bool]] = []  # (text, is_special)

    def header(role: str) -> None:
        if fmt == "k3":
            pieces.extend([("<|open|>", True), (role, False), ("<|sep|>", True)])
        else:
            pieces.extend([(f"<|im_{role}|>", True), (role, False), ("<|im_middle|>", True)])

    end = "<|end_of_msg|>" if fmt == "k3" else "<|im_end|>"
    for m in messages:
        header(m["role"])
        pieces.extend([(m["content"], False), (end, True)])
    if add_generation_prompt:
        header("assistant")

    ids: list[int] = []
    for piece, special in pieces:
        if special:
            ids.append(_token_id(tokenizer, piece))
        elif piece:
            ids.extend(_encode(tokenizer, piece, image_token_id))
    text = "".join(p for p, _ in pieces)
    return RenderedChat(text, ids, [], [_token_id(tokenizer, end)], fmt)
