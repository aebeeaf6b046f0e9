"""The request schema of the server (k3.infer.server): the pydantic models of ``/v1/completions``,
``/v1/chat/completions``, ``/tokenize`` and ``/detokenize`` with their validation, the error OpenAI's clients
expect (:class:`APIError`, answered as ``{"error": {"message", "type", "param", "code"}}``), and chat message
content (text and ``data:`` image parts).

Models are strict (``"5"`` is not an integer) and ignore unknown fields; known OpenAI options this server does not
implement (the legacy functions, audio, ...) are accepted only at their no-op values, any other value
answering 400 naming the field (:meth:`StrictRequest.refuse_unsupported`). ``model`` may be left out (null): it
means the served model, as vLLM takes it. The sampling ranges
are the sampler's own (:meth:`k3.infer.sampling.SamplingParams.validate`, which the server runs on every request):
``temperature`` is only type-checked here so that an out-of-range value gets the sampler's one message and range
(OpenAI's [0, 2]; below 0.01 it samples at 0.01)."""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from k3.data.chat import IMAGE_SLOT
from k3.infer.sampling import MAX_LOGPROBS, MAX_STOP, MAX_STOP_CHARS

MAX_N = 16
MAX_PROMPTS = 64  # prompts in one completions request
MAX_IMAGE_BYTES = 32 << 20
MAX_DETOKENIZE = 1 << 20  # token ids in one /detokenize request


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None, kind: str = "invalid_request_error"
) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


def bad_text(value, path: str = "") -> str | None:
    """The path (``messages.0.content``) of the first string in a parsed JSON value that is not valid Unicode (an
    unpaired UTF-16 surrogate, which JSON's ``\\ud800`` escape can carry); None if every string is valid."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(item, (str, list, dict)):
            found = bad_text(item, f"{path}.{key}" if path else str(key))
            if found is not None:
                return found
    return None


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class StrictRequest(BaseModel):
    """A request body: strict types, unknown fields ignored, known unsupported options refused
    (:meth:`refuse_unsupported`); ``model`` None (left out) is the served model."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
    model: str | None = None

    def refuse_unsupported(self) -> None:
        """One 400 naming the first option set to a value this server does not implement."""
        for name, (noop, allowed) in _NOOP.items():
            if name in type(self).model_fields and not noop(getattr(self, name)):
                shown = json.dumps(getattr(self, name))
                shown = shown if len(shown) <= 80 else shown[:77] + "..."
                raise APIError(400, f"{name}={shown} is not supported (only {allowed})", name, "unsupported_parameter")


class BaseRequest(StrictRequest):
    """Fields both generating endpoints share."""

    max_tokens: int | None = Field(None, ge=1)
    temperature: float = 1.0  # range: SamplingParams.validate ([0, 2]), with its one message
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    n: int = Field(1, ge=1, le=MAX_N)  # choices per prompt; choice j is seeded seed + j
    ignore_eos: bool = False  # generate max_tokens whatever the model emits (as vLLM's; load tests use it)
    # structured output (k3.infer.grammar.grammar_for): text, json_object or json_schema; other types refused
    response_format: Any = None
    # accepted only at their no-op values
    logit_bias: dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP or not all(0 < len(s) <= MAX_STOP_CHARS for s in stops):
            raise ValueError(
                f"must be a non-empty string or a list of at most {MAX_STOP} non-empty strings, "
                f"each of at most {MAX_STOP_CHARS} characters"
            )
        return stops


_NOOP = {  # option -> (is it at a value we implement?, what we accept)
    "logit_bias": (lambda v: not v, "null or {}"),
    "best_of": (lambda v: v in (None, 1), "null or 1"),
    "suffix": (lambda v: not v, "null or an empty string"),
    "functions": (lambda v: not v, "null or []: send tools instead"),
    "function_call": (lambda v: v in (None, "none"), 'null or "none": send tool_choice instead'),
    "response_format": (
        lambda v: v is None or isinstance(v, dict) and v.get("type") in ("text", "json_object", "json_schema"),
        'null or a "type" of "text", "json_object" or "json_schema"',
    ),
    "modalities": (lambda v: v in (None, ["text"]), 'null or ["text"]'),
    "audio": (lambda v: v is None, "null"),
    "reasoning_effort": (lambda v: v is None, "null"),
    "web_search_options": (lambda v: v is None, "null"),
}


def _one_prompt(v) -> bool:
    """A string (an empty one starts from the BOS token, as the server encodes it) or a non-empty list of ids."""
    return isinstance(v, str) or (
        isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)
    )


class CompletionRequest(BaseRequest):
    prompt: Any
    max_tokens: int | None = Field(None, ge=0)  # 0: score the prompt only (with echo)
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        """-> a list of prompts, each a string or a list of token ids."""
        if _one_prompt(v):
            return [v]
        if isinstance(v, list) and 0 < len(v) <= MAX_PROMPTS and all(_one_prompt(p) for p in v):
            return v
        raise ValueError(f"must be a string, a non-empty list of token ids, or a list of up to {MAX_PROMPTS} of either")


class ChatRequest(BaseRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # tool calling (checked by k3.infer.tools.ToolUse)
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI options accepted only at their no-op values (_NOOP)
    functions: list | None = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None


class TokenizeRequest(StrictRequest):
    """``/tokenize`` (vLLM's): a ``prompt`` or chat ``messages``. ``add_special_tokens``: this server adds no
    special token to a prompt (no BOS), so both values give the same ids."""

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True  # messages: end with the assistant's header, as a chat request does
    tools: list | None = None  # messages: the tools a chat request declares (k3.infer.tools)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(StrictRequest):
    """``/detokenize`` (vLLM's): token ids -> their text."""

    tokens: list[int] = Field(max_length=MAX_DETOKENIZE)

    @field_validator("tokens")
    @classmethod
    def _ids(cls, v):
        if any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        return v


def image_part(i: int, part: dict) -> bytes:
    """The bytes of an OpenAI ``image_url`` content part; only ``data:`` URIs (base64), since the server fetches
    nothing from the network."""
    where = f"messages.{i}.content"
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str) or not url.startswith("data:"):
        raise APIError(
            400,
            f"messages[{i}]: image_url must be a data: URI (data:image/png;base64,...); "
            "the server fetches nothing from the network",
            where,
        )
    header, _, payload = url.partition(",")
    if not header.endswith(";base64") or not payload:
        raise APIError(400, f"messages[{i}]: image_url data URI must be base64-encoded", where)
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise APIError(400, f"messages[{i}]: image larger than {MAX_IMAGE_BYTES >> 20} MiB", where)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"messages[{i}]: image_url data URI is not valid base64", where) from None


def message_content(i: int, m: dict, images: list[bytes]) -> dict:
    """OpenAI messages -> {role, content} (with ``tool_calls`` / ``tool_call_id`` where given, for
    k3.data.chat to check): text parts are joined, each image part becomes an IMAGE_SLOT character (its bytes
    appended to ``images``), 'developer' is a system message."""
    content = m.get("content")
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
                parts.append(p["text"])
            elif isinstance(p, dict) and p.get("type") == "image_url":
                images.append(image_part(i, p))
                parts.append(IMAGE_SLOT)
            else:
                raise APIError(
                    400, f"messages[{i}].content: only text and image_url parts are supported", f"messages.{i}.content"
                )
        content = "".join(parts)
    role = "system" if m.get("role") == "developer" else m.get("role")
    out = {"role": role, "content": content}
    out.update({k: m[k] for k in ("tool_calls", "tool_call_id") if k in m})
    return out
