"""Chat data for ``k3 train --task sft``: conversations -> packed rows whose loss falls on the assistant's tokens.

Conversations
    One JSON object per line of a ``.jsonl`` file: ``{"messages": [...], "tools": [...]}`` (``tools`` optional), the
    messages in OpenAI's format (roles system / user / assistant / tool, assistant ``tool_calls``, tool
    ``tool_call_id``), each with at least one assistant message. Without ``--data`` the embedded set
    (k3.data.sft_default) is used. Every line is checked when the data is read: a bad one stops the run before it
    starts, with one error naming ``file:line``. Train / validation is decided per conversation by the hash of its
    name, as for documents (k3.data.documents.split_documents), with ``VALIDATION_FRACTION`` of them held out.

Rendering and labels
    A conversation is rendered by :func:`k3.data.chat.render_training_chat` in the tokenizer's chat format (the
    checkpoint's: k3, k2 or plain), the format ``k3 serve`` and ``k3 chat`` prompt the model with. The trained
    tokens are what the assistant says: its content, its tool-call section and its message end; and the EOS after
    the conversation when an assistant message ends it (so a plain-format model learns to stop). Headers, system,
    user and tool messages and the tool declaration are context only: their labels are ignored.

Packing
    As pretraining's documents (k3.data.packing.PackedDataset, with its ``trained`` flags): conversations joined with
    an EOS in a seeded order, cut into rows of ``seq_len``, each conversation its own segment of the document
    masks (``cu_seqlens``), so no attention or state crosses from one to the next. A conversation that runs past
    a row's end continues in the next row as a segment of its own, as a document does. Data positions resume
    exactly (the dataset's ``state_dict``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from k3.data.chat import ROLES, render_chat, render_training_chat, validate_messages
from k3.data.documents import Document, split_documents
from k3.data.packing import PackedDataset

# conversations held out for validation: more than documents' 2%, as a chat set holds fewer, shorter items
VALIDATION_FRACTION = 0.05
DEFAULT_NAME = "the embedded chat set (k3.data.sft_default)"


def parse_conversation(text: str, where: str) -> tuple[list[dict], list | None]:
    """(messages, tools) of one JSONL line; one ValueError naming ``where`` for anything that is not a conversation
    the chat renderer takes with an assistant message in it."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
        raise ValueError(f'{where}: expected a JSON object {{"messages": [...]}} (chat data for --task sft)')
    tools = record.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError(f"{where}: tools must be a list of tool objects")
    try:
        messages = validate_messages(record["messages"])
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: no assistant message, so nothing to train on (roles: {', '.join(ROLES)})")
    return record["messages"], tools


def read_chat_jsonl(path: Path) -> list[Document]:
    """The conversations of a ``.jsonl`` file, one document per non-blank line (named ``FILE:LINE``, the line's
    JSON as its text), every line checked by :func:`parse_conversation`."""
    docs = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError:
                raise ValueError(f"{where}: not UTF-8") from None
            if line:
                parse_conversation(line, where)
                docs.append(Document(f"{path.name}:{lineno}", line))
    return docs


def load_conversations(source: str | Path | None, split: str = "train") -> list[Document]:
    """The conversations of ``split`` ("train", "validation" or "all"): from a ``.jsonl`` file, or (``source``
    None) the embedded set."""
    if source is None:
        from k3.data.sft_default import conversations

        docs = [Document(f"k3-chat/{i:04d}", json.dumps(c)) for i, c in enumerate(conversations())]
    else:
        path = Path(source)
        if not path.is_file() or path.suffix != ".jsonl":
            raise FileNotFoundError(f"--task sft --data {source}: expected a .jsonl file of conversations")
        docs = read_chat_jsonl(path)
    if len(docs) < 2:
        raise ValueError(f"{source}: {len(docs)} conversation(s); a train/validation split needs at least 2")
    return split_documents(docs, split, VALIDATION_FRACTION)


def encode_conversations(tokenizer):
    """The ``encode`` of :class:`PackedDataset` for conversations: documents -> (ids, trained flags of the ids and
    the EOS after them, bytes of the trained text)."""
    eos = tokenizer.eos_id

    def encode(docs: Sequence[Document]) -> list[tuple[list[int], list[bool], int]]:
        out = []
        for doc in docs:
            messages, tools = parse_conversation(doc.text, doc.name)
            chat = render_training_chat(messages, tokenizer, tools)
            if eos in chat.token_ids:
                raise ValueError(
                    f"{doc.name}: the chat format's tokens include the tokenizer's EOS {tokenizer.eos_token!r}, "
                    "which separates packed conversations; give the tokenizer another EOS token"
                )
            out.append((chat.token_ids, chat.trained + [messages[-1]["role"] == "assistant"], chat.num_bytes))
        return out

    return encode


def chat_dataset(
    docs: Sequence[Document], tokenizer, seq_len: int, seed: int = 0, max_tokens: int | None = None
) -> PackedDataset:
    """Conversations packed into rows as documents are, labels only on the assistant's tokens (module docstring)."""
    return PackedDataset(
        docs, tokenizer, seq_len, seed=seed, max_tokens=max_tokens, encode=encode_conversations(tokenizer)
    )


def reply_prompts(docs: Sequence[Document], tokenizer, n: int) -> list[tuple[str, object]]:
    """For the first ``n`` conversations ending with an assistant message: (the message it answers, as
    ``role: content``; the rendered prompt for that reply, a :class:`k3.data.chat.RenderedChat`)."""
    out = []
    for doc in docs:
        if len(out) == n:
            break
        messages, tools = parse_conversation(doc.text, doc.name)
        if messages[-1]["role"] != "assistant" or len(messages) < 2:
            continue
        last = messages[-2]
        out.append((f"{last['role']}: {last.get('content') or ''}", render_chat(messages[:-1], tokenizer, tools=tools)))
    return out
