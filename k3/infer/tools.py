"""Tool calling of the chat API (OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls``): the request's
options checked (one 400 naming the field), the tools declared in the prompt (k3.data.chat), the grammar that
forces a call, and the reply turned into OpenAI's message or stream chunks (k3.infer.tool_calls).

``tool_choice``:

* ``"none"``: the tools are not declared and the reply is not parsed: the request is answered as if it had no
  tools (the conversation's earlier calls and results are still rendered).
* ``"auto"`` (the default with tools): the tools are declared, the model decides, and a well-formed tool-call
  section in its reply becomes ``tool_calls`` with ``finish_reason: "tool_calls"``.
* ``"required"`` and a named function (``{"type": "function", "function": {"name": ...}}``): constrained
  decoding (llguidance, as ``response_format``; without it one 400 naming ``tool_choice``) makes the reply one
  section whose calls name the offered functions (the named one: one call of it) with arguments valid against
  each function's ``parameters`` JSON schema (compact JSON; no ``parameters``: an empty object), numbered on
  from the conversation's earlier calls. ``"required"`` allows up to MAX_CALLS calls.

``parallel_tool_calls: false`` allows one call: forced, the grammar holds one; under ``"auto"`` only the first
call of a section is returned. The legacy ``functions`` / ``function_call`` are refused (400 naming them): send
``tools`` and ``tool_choice``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from k3.data.chat import ARGUMENT_BEGIN, CALL_BEGIN, CALL_END, SECTION_BEGIN, SECTION_END, call_id
from k3.infer.grammar import json_rule, lark_grammar, schema_error
from k3.infer.protocol import APIError
from k3.infer.sampling import SamplingError
from k3.infer.tool_calls import NAME, ToolCallStream, parse_tool_calls

MAX_CALLS = 8  # the most calls a forced section ("required" with parallel calls) may hold
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param)


def check_tools(tools) -> dict[str, dict]:
    """{name: parameters schema} of OpenAI's ``tools`` list; one 400 naming the first bad field."""
    if tools is None:
        return {}
    schemas: dict[str, dict] = {}
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            raise _bad(f"tools.{i}.type", f'{where}.type must be "function" (the only tool type served)')
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"tools.{i}.function", f"{where}.function must be an object with a name")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(NAME, name):
            raise _bad(
                f"tools.{i}.function.name",
                f"{where}.function.name must be 1 to 64 letters, digits, underscores or dashes, got {name!r}",
            )
        if name in schemas:
            raise _bad(f"tools.{i}.function.name", f"{where}.function.name: {name!r} is offered twice")
        if not isinstance(fn.get("description", ""), (str, type(None))):
            raise _bad(f"tools.{i}.function.description", f"{where}.function.description must be a string")
        parameters = fn.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise _bad(f"tools.{i}.function.parameters", f"{where}.function.parameters must be a JSON schema object")
        if not isinstance(fn.get("strict", False), (bool, type(None))):
            raise _bad(f"tools.{i}.function.strict", f"{where}.function.strict must be a boolean")
        schemas[name] = parameters if parameters is not None else NO_PARAMETERS
    return schemas


def check_choice(tool_choice, schemas: dict) -> str:
    """``"none"``, ``"auto"``, ``"required"`` or the named function's name, from OpenAI's ``tool_choice`` (None:
    ``"auto"`` with tools, else ``"none"``); one 400 naming tool_choice."""
    if tool_choice is None:
        return "auto" if schemas else "none"
    if tool_choice in ("none", "auto"):
        return tool_choice
    name = None
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if tool_choice.get("type") == "function" and isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise _bad(
                "tool_choice",
                'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            )
    elif tool_choice != "required":
        raise _bad("tool_choice", f'tool_choice={tool_choice!r} must be "none", "auto", "required" or a function')
    if not schemas:
        raise _bad("tool_choice", f"tool_choice={json.dumps(tool_choice)} needs tools")
    if name is not None and name not in schemas:
        raise _bad("tool_choice", f"tool_choice names the function {name!r}, which tools does not offer")
    return name or "required"


@dataclass
class ToolUse:
    """A chat request's tool options, checked: the tools as given, their parameter schemas, the choice
    (``"none"``, ``"auto"``, ``"required"`` or a function's name) and whether calls may be parallel."""

    tools: list
    schemas: dict[str, dict]
    choice: str
    parallel: bool = True

    @classmethod
    def of(cls, req) -> ToolUse:
        """The tool options of a parsed request (one without the fields: no tools)."""
        tools = getattr(req, "tools", None)
        schemas = check_tools(tools)
        choice = check_choice(getattr(req, "tool_choice", None), schemas)
        parallel = getattr(req, "parallel_tool_calls", None) is not False
        if choice not in ("none", "auto"):
            fmt = getattr(req, "response_format", None)
            if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
                raise _bad("tool_choice", "a forced tool call (tool_choice) cannot be combined with response_format")
        return cls(tools or [], schemas, choice, parallel)

    @property
    def declared(self) -> list | None:
        """The tools the prompt declares (None: none)."""
        return self.tools if self.tools and self.choice != "none" else None

    @property
    def forced(self) -> bool:
        """Whether constrained decoding forces a call ("required" or a named function)."""
        return self.choice not in ("none", "auto")

    def grammar(self, tokenizer, first_call: int) -> str | None:
        """The llguidance grammar forcing the reply's tool-call section (None unless forced): calls numbered
        from ``first_call``, markers as the vocabulary's tokens where it has them (else their text), arguments
        compact JSON valid against each function's schema. One 400 naming tool_choice where llguidance is
        missing, or naming the function's parameters where it cannot compile them."""
        if not self.forced:
            return None
        what = f"tool_choice={json.dumps(self.choice if self.choice == 'required' else {'function': self.choice})}"
        names = list(self.schemas) if self.choice == "required" else [self.choice]
        index = {name: i for i, name in enumerate(self.schemas)}
        try:
            for name in names:
                error = schema_error(self.schemas[name], "tool_choice", what)
                if error:
                    i = index[name]
                    raise _bad(
                        f"tools.{i}.function.parameters",
                        f"tools[{i}].function.parameters is not a JSON schema constrained decoding can follow: {error}",
                    )

            def mark(text: str) -> str:
                token = tokenizer.hf.token_to_id(text)
                return json.dumps(text) if token is None else f"<[{token}]>"

            count = MAX_CALLS if self.choice == "required" and self.parallel else 1
            lines = [f"start: {mark(SECTION_BEGIN)} call_0 {mark(SECTION_END)}"]
            for k in range(count):
                alts = " | ".join(
                    f"{json.dumps(call_id(name, first_call + k))} {mark(ARGUMENT_BEGIN)} args_{j}"
                    for j, name in enumerate(names)
                )
                more = f" call_{k + 1}?" if k + 1 < count else ""
                lines.append(f"call_{k}: {mark(CALL_BEGIN)} ({alts}) {mark(CALL_END)}{more}")
            lines += [f"args_{j}: {json_rule(self.schemas[name])}" for j, name in enumerate(names)]
            return lark_grammar("\n".join(lines), "tool_choice", what)
        except SamplingError as e:
            raise APIError(400, str(e), e.param) from None

    @property
    def parsing(self) -> bool:
        """Whether the reply is parsed for tool calls."""
        return self.choice != "none" and bool(self.schemas)

    def stream(self) -> ToolCallStream:
        """A parser of one streamed choice's reply."""
        return ToolCallStream(self.schemas, None if self.parallel else 1)

    def message(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        """(the assistant message, the finish reason) of a whole reply: with a well-formed section, its calls
        and ``"tool_calls"``."""
        if not self.parsing:
            return {"role": "assistant", "content": text}, reason
        content, calls = parse_tool_calls(text, self.schemas, None if self.parallel else 1)
        if not calls:
            return {"role": "assistant", "content": text}, reason
        return {"role": "assistant", "content": content, "tool_calls": [c.openai() for c in calls]}, "tool_calls"


class ToolChunks:
    """A streamed choice's chunks (k3.infer.responses.ChatChoice ``choice``) with its tool calls parsed: content
    deltas as the parser releases them, each call as two ``delta.tool_calls`` chunks (index, id, type and name
    with empty arguments, then the arguments), and the finish chunk (``"tool_calls"`` where calls went out).
    Log-probabilities of held text go out with the next chunk. Called as stream_events calls a chunk builder;
    returns a list of chunks (``(None, None, ...)``: the bare chunk, the usage chunk's base)."""

    def __init__(self, choice, parser: ToolCallStream):
        self.choice, self.parser = choice, parser
        self.held: list = []
        self.sent = 0

    def first(self) -> dict:
        return self.choice.first()

    def _take(self) -> list:
        lps, self.held = self.held, []
        return lps

    def _delta(self, delta: dict) -> dict:
        chunk = self.choice(None, None, self._take())
        chunk["choices"][0]["delta"] = delta
        return chunk

    def __call__(self, text: str | None, reason: str | None, lps: list, prompt_lps: list | None = None):
        if text is None and reason is None:
            return self.choice(None, None, lps)
        self.held += lps
        out = []
        for event in self.parser.feed(text or "", final=reason is not None):
            if isinstance(event, str):
                out.append(self.choice(event, None, self._take()))
                continue
            i, self.sent = self.sent, self.sent + 1
            head = {"index": i, "id": event.id, "type": "function", "function": {"name": event.name, "arguments": ""}}
            out.append(self._delta({"tool_calls": [head]}))
            out.append(self._delta({"tool_calls": [{"index": i, "function": {"arguments": event.arguments}}]}))
        if reason is not None:
            out.append(self.choice(None, "tool_calls" if self.parser.calls else reason, self._take()))
        return out
