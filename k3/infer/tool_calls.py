"""Tool calls in generated text: Kimi's tool-call section (k3.data.chat's format) turned back into OpenAI's
``tool_calls``, whole (:func:`parse_tool_calls`) or as the text streams in (:class:`ToolCallStream`).

A reply may hold one section, ``<|tool_calls_section_begin|>`` then one or more
``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>`` then
``<|tool_calls_section_end|>`` (whitespace between the markers is allowed; the ``functions.`` prefix may be
missing, as Kimi's parsers accept it). Its calls become ``{"id": "functions.NAME:IDX", "type": "function",
"function": {"name", "arguments"}}``; the text around the section is the content. A section that is not whole
(cut by max_tokens), holds no call, a call whose arguments are not a JSON object, or one naming a function the
request did not offer, stays in the content as plain text, as does any section after the first: nothing the
model wrote is lost.

Streamed, text goes out as soon as it cannot be the start of a section; from the section's first marker the
text is held until the section ends (or the reply does), then its calls go out (or, malformed, its text). So a
stream's content and calls are the whole reply's, piece by piece.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from k3.data.chat import ARGUMENT_BEGIN, CALL_BEGIN, CALL_END, SECTION_BEGIN, SECTION_END, call_id

NAME = r"[A-Za-z0-9_-]{1,64}"  # OpenAI's rule for function names (so a name holds no '.', ':' or '<')
_CALL = re.compile(
    rf"\s*{re.escape(CALL_BEGIN)}\s*(?:functions\.)?(?P<name>{NAME}):(?P<index>\d+)\s*"
    rf"{re.escape(ARGUMENT_BEGIN)}(?P<arguments>.*?){re.escape(CALL_END)}",
    re.S,
)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: its id (``functions.NAME:IDX``), the function's name and its arguments (JSON text)."""

    id: str
    name: str
    arguments: str

    def openai(self) -> dict:
        """OpenAI's ``tool_calls`` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_section(body: str, names) -> list[ToolCall] | None:
    """The calls of a section's ``body`` (the text between its begin and end markers); None where it holds no
    call, text outside a call, arguments that are not a JSON object, or a function not in ``names``."""
    calls, pos = [], 0
    while body[pos:].strip():
        m = _CALL.match(body, pos)
        if m is None or m["name"] not in names:
            return None
        arguments = m["arguments"].strip()
        try:
            value = json.loads(arguments)
        except ValueError:
            return None
        if not isinstance(value, dict):
            return None
        calls.append(ToolCall(call_id(m["name"], int(m["index"])), m["name"], arguments))
        pos = m.end()
    return calls or None


def _partial(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (and is shorter than it)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ToolCallStream:
    """Splits a reply, fed piece by piece, into content text and :class:`ToolCall` s (see the module docstring).

    ``names``: the functions the request offers; ``max_calls``: the most calls kept (``parallel_tool_calls:
    false`` keeps the first one only); None: all. After the last piece (``final``), :attr:`calls` holds the
    calls returned."""

    def __init__(self, names, max_calls: int | None = None):
        self.names, self.max_calls = frozenset(names), max_calls
        self.state = "text"  # "text": before any section, "section": inside one, "after": past it
        self.buf = ""
        self.calls: list[ToolCall] = []

    def feed(self, piece: str, final: bool = False) -> list[str | ToolCall]:
        """The content text (strings) and calls that ``piece`` releases, in order; ``final``: the reply has
        ended, so whatever is held is released."""
        out: list[str | ToolCall] = []
        self.buf += piece
        if self.state == "text":
            at = self.buf.find(SECTION_BEGIN)
            if at < 0:
                keep = 0 if final else _partial(self.buf, SECTION_BEGIN)
                text, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
                return [text] if text else []
            if at:
                out.append(self.buf[:at])
            self.buf, self.state = self.buf[at:], "section"
        if self.state == "section":
            end = self.buf.find(SECTION_END, len(SECTION_BEGIN))
            if end < 0:
                if final:
                    out.append(self.buf)
                    self.buf, self.state = "", "after"
                return out
            section, self.buf = self.buf[: end + len(SECTION_END)], self.buf[end + len(SECTION_END) :]
            self.state = "after"
            calls = parse_section(section[len(SECTION_BEGIN) : end], self.names)
            if calls is None:
                out.append(section)
            else:
                self.calls = calls[: self.max_calls]
                out.extend(self.calls)
        if self.buf:
            out.append(self.buf)
            self.buf = ""
        return out


def parse_tool_calls(text: str, names, max_calls: int | None = None) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole reply: the content is the text around the section (None where that is empty
    and there are calls), the calls those of a well-formed section (none: the content is ``text`` itself)."""
    stream = ToolCallStream(names, max_calls)
    events = stream.feed(text, final=True)
    content = "".join(e for e in events if isinstance(e, str))
    return (content or None) if stream.calls else content, stream.calls
