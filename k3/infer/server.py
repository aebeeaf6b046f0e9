"""An OpenAI-compatible HTTP server over :class:`AsyncEngine`: ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` (both with SSE streaming) and ``/health``.

Every request body is validated by a pydantic model (strict types: ``"5"`` is not an integer); a bad field,
bad JSON, an unsupported option (``logit_bias``, ``best_of``, ``suffix``, ...) or a prompt that does not fit the
context answers 400 with OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``; an unknown
model answers 404; an engine failure answers 500 (or ends a stream with an error event) and the server keeps
serving. Sampling extensions beyond OpenAI's fields: ``top_k`` (0 = off) and ``repetition_penalty``; OpenAI's
``presence_penalty`` / ``frequency_penalty`` count the generated tokens (k3.infer.sampling.apply_output_penalties).

Log-probabilities (``logprobs`` N on completions; ``logprobs: true`` with ``top_logprobs`` N on chat; N <= 20, also
when streaming) are the model's: the log-softmax of its logits at each generated token, before temperature,
penalties and top-k / top-p (:class:`k3.infer.sampling.TokenLogprob`). Completions list the chosen token among the
alternatives (N + 1 entries where it is not among the N likeliest, as OpenAI's) and a stop token's entry; chat
leaves the stop token out (its text is not in the message). An entry goes out with its token's text: held while the
text is (it may begin a stop string), none for tokens a stop string cuts off (one across the cut keeps its). A
completions ``prompt`` may be a list of up to MAX_PROMPTS prompts, and ``n`` asks for up to MAX_N choices per prompt
(neither streamed): choices come prompt by prompt, choice j seeded ``seed + j``. Each token is shown as its own
decoded text (a piece of a multi-byte character decodes to U+FFFD), ``text_offset`` counts those texts. Completions
with ``echo`` return the prompt before the completion and, with ``logprobs``, the prompt tokens' too (null for the
first); ``max_tokens: 0`` with ``echo`` only scores the prompt (how evaluation harnesses ask for log-likelihoods). A
scored prompt runs whole (the prefix cache is not used for it).

Hostile or careless requests cost bounded work: a body over ``max_request_bytes`` answers 413 (checked from
Content-Length and counted as a chunked body arrives); a text prompt longer than the context could hold in
characters answers 400 before it is tokenised; tokenising runs off the event loop; echoed prompt log-probabilities
are capped (MAX_PROMPT_LOGPROB_ENTRIES); text with an unpaired UTF-16 surrogate answers 400; a non-streamed request
whose client disconnects is aborted; a failure in one request's sampling fails that request only; an unexpected
error answers 500 without closing the keep-alive connection. Once ``AsyncEngine.shutdown`` begins (``k3 serve``
starts it on SIGTERM), new requests answer 503 and requests still running at the drain deadline end with an error
(an SSE ``error`` event then ``[DONE]``, or a 503).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException
from tokenizers import Tokenizer as HFTokenizer

from k3.infer.async_engine import AsyncEngine, EngineClosed, EngineError
from k3.infer.chat import IMAGE_SLOT, render_chat
from k3.infer.sampling import MAX_LOGPROBS, SamplingError, SamplingParams
from k3.data.tokenizer import Tokenizer

log = logging.getLogger("k3.serve")
MAX_STOP = 4
MAX_N = 16
MAX_REQUEST_BYTES = 16 << 20  # default body limit: room for a ~10 MiB image as base64, far more than any prompt
# Echoed prompt log-probabilities: (prompt tokens x choices) x (logprobs + 1) entries at most. Each renders as a
# token text and a float (~25 bytes of JSON), so 2**18 keeps a response near 6 MB; scoring a whole 8192-token
# context with logprobs=20 (172k entries) fits.
MAX_PROMPT_LOGPROB_ENTRIES = 2**18


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


class _Guard:
    """ASGI middleware around the app's routes: refuses a body over ``max_bytes`` with 413 (Content-Length is
    checked before reading, a chunked body is counted as it arrives, so at most ``max_bytes`` are ever buffered),
    and turns an exception that escaped every handler into a 500 error body. It does not re-raise, as Starlette's
    own last-resort handler does, because uvicorn closes a keep-alive connection whose app raised."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            replay = await self._read_body(scope, receive, tracked)
            if replay is not None:
                await self.app(scope, replay, tracked)
        except Exception as exc:  # noqa: BLE001 - any bug: a 500 with a message; the server keeps serving
            log.error("internal error on %s %s: %r", scope.get("method"), scope.get("path"), exc)
            if not started:  # (backslashreplace: an exception's text may hold a lone surrogate JSON cannot encode)
                message = f"internal error: {type(exc).__name__}: {exc}".encode("utf-8", "backslashreplace").decode()
                await error_response(500, message, kind="server_error")(scope, receive, send)
            else:  # a streamed response failed midway: end its body so the connection stays usable
                with contextlib.suppress(Exception):
                    await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _read_body(self, scope, receive, send):
        """The whole body within the limit, as a receive callable replaying it (then the client's own, which
        reports a disconnect); None once a 413 went out or the client left."""
        too_large = error_response(413, f"the request body is larger than this server's limit of {self.max_bytes} "
                                        "bytes (k3 serve --max-request-mb)", code="request_too_large")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await too_large(scope, receive, send)
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await too_large(scope, receive, send)
                return None
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return replay


def _bad_text(value, path: str = "") -> str | None:
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
            found = _bad_text(item, f"{path}.{key}" if path else str(key))
            if found is not None:
                return found
    return None


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _Request(BaseModel):
    """Fields both endpoints share. Unknown fields are ignored; known unsupported ones are refused."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    n: int = Field(1, ge=1, le=MAX_N)  # choices per prompt (not streamed); choice j is seeded seed + j
    # accepted only at their no-op values
    logit_bias: dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP or not all(stops):
            raise ValueError(f"must be a non-empty string or a list of at most {MAX_STOP} non-empty strings")
        return stops

    def refuse_unsupported(self) -> None:
        """One 400 naming the first option set to a value this server does not implement."""
        for name, (noop, allowed) in _NOOP.items():
            if name in type(self).model_fields and not noop(getattr(self, name)):
                raise APIError(400, f"{name}={json.dumps(getattr(self, name))} is not supported (only {allowed})",
                               name, "unsupported_parameter")


_NOOP = {  # option -> (is it at a value we implement?, what we accept)
    "logit_bias": (lambda v: not v, "null or {}"),
    "best_of": (lambda v: v in (None, 1), "null or 1"),
    "suffix": (lambda v: not v, "null or an empty string"),
    "tools": (lambda v: not v, "null or []"),
}


MAX_PROMPTS = 64  # prompts in one completions request


def _one_prompt(v) -> bool:
    return (isinstance(v, str) and bool(v)) or (isinstance(v, list) and bool(v) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in v))


class CompletionRequest(_Request):
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
        raise ValueError("must be a non-empty string, a non-empty list of token ids, or a list of up to "
                         f"{MAX_PROMPTS} of either")


class ChatRequest(_Request):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list | None = None


MAX_IMAGE_BYTES = 32 << 20


def _image_part(i: int, part: dict) -> bytes:
    """The bytes of an OpenAI ``image_url`` content part; only ``data:`` URIs (base64), since the server fetches
    nothing from the network."""
    where = f"messages.{i}.content"
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str) or not url.startswith("data:"):
        raise APIError(400, f"messages[{i}]: image_url must be a data: URI (data:image/png;base64,...); "
                            "the server fetches nothing from the network", where)
    header, _, payload = url.partition(",")
    if not header.endswith(";base64") or not payload:
        raise APIError(400, f"messages[{i}]: image_url data URI must be base64-encoded", where)
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise APIError(400, f"messages[{i}]: image larger than {MAX_IMAGE_BYTES >> 20} MiB", where)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"messages[{i}]: image_url data URI is not valid base64", where) from None


def _message_content(i: int, m: dict, images: list[bytes]) -> dict:
    """OpenAI messages -> {role, content}: text parts are joined, each image part becomes an IMAGE_SLOT character
    (its bytes appended to ``images``), 'developer' is a system message."""
    content = m.get("content")
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
                parts.append(p["text"])
            elif isinstance(p, dict) and p.get("type") == "image_url":
                images.append(_image_part(i, p))
                parts.append(IMAGE_SLOT)
            else:
                raise APIError(400, f"messages[{i}].content: only text and image_url parts are supported",
                               f"messages.{i}.content")
        content = "".join(parts)
    role = "system" if m.get("role") == "developer" else m.get("role")
    return {"role": role, "content": content}


def _private_copy(tokenizer: Tokenizer) -> Tokenizer:
    """The server encodes with its own copy, so the engine thread's decode never shares the Rust object."""
    return Tokenizer(HFTokenizer.from_str(tokenizer.hf.to_str()), tokenizer.eos_token, tokenizer.bos_token)


def _max_token_chars(tokenizer: Tokenizer) -> int:
    """The most characters of text one token can stand for: its vocabulary entry's length (a byte-level token's
    entry has one character per byte, and a character is at least one byte). A text of more than
    ``context x this`` characters needs more than ``context`` tokens, so it is refused without tokenising."""
    return max(1, max(len(piece) for piece in tokenizer.hf.get_vocab(with_added_tokens=True)))


def create_app(async_engine: AsyncEngine, tokenizer: Tokenizer, model_name: str, max_context: int,
               drain_timeout: float = 30.0, max_request_bytes: int = MAX_REQUEST_BYTES) -> FastAPI:
    """The FastAPI app. Its lifespan starts ``async_engine`` (unless started) and shuts it down gracefully
    (requests in flight get up to ``drain_timeout`` seconds). Bodies over ``max_request_bytes`` answer 413."""
    tok = _private_copy(tokenizer)
    max_chars = max_context * _max_token_chars(tok)
    # one thread: tokenising stays off the event loop, and calls never overlap (Tokenizer.encode sets a flag on
    # the shared HF tokenizer before each call)
    tok_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="k3-tokenize")
    created = int(time.time())
    engine = async_engine.engine
    image_token_id = None if engine.vision is None else engine.vision.media_placeholder_token_id

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not async_engine.started:
            async_engine.start()
        yield
        await asyncio.to_thread(async_engine.shutdown, drain_timeout)
        tok_pool.shutdown(wait=False)

    app = FastAPI(title="k3", lifespan=lifespan)
    app.add_middleware(_Guard, max_bytes=max_request_bytes)

    async def off_loop(fn, *args, **kwargs):
        """fn(*args, **kwargs) in the tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(tok_pool, lambda: fn(*args, **kwargs))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        if err.get("type") == "json_invalid":
            return error_response(400, f"the request body is not valid JSON: {err.get('msg')}")
        msg = err.get("msg", "invalid value").removeprefix("Value error, ")
        return error_response(400, f"{param}: {msg}" if param else msg, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), kind="not_found_error" if exc.status_code == 404
                              else "invalid_request_error")

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.kind)

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "k3",
                "max_model_len": max_context}

    @app.get("/health")
    async def health():
        stats = async_engine.stats()
        if not async_engine.running:
            return JSONResponse({"status": "unavailable", **stats}, 503)
        return {"status": "ok", "model": model_name, "max_context": max_context, **stats}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}", "model",
                           "model_not_found", "not_found_error")
        return model_card()

    def check(req: _Request) -> None:
        bad = _bad_text({name: getattr(req, name) for name in type(req).model_fields})
        if bad is not None:
            raise APIError(400, f"{bad}: the text is not valid Unicode (it holds an unpaired UTF-16 surrogate such "
                                "as \\ud800)", bad, "invalid_text")
        if req.model != model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {model_name!r}",
                           "model", "model_not_found", "not_found_error")
        req.refuse_unsupported()

    def check_chars(chars: int, param: str) -> None:
        """A text of ``chars`` characters cannot fit the context: 400 without tokenising it (_max_token_chars)."""
        if chars > max_chars:
            raise APIError(400, f"the {param} is {chars} characters, more than this model's context of {max_context} "
                                "tokens can hold", param, "context_length_exceeded")

    def sampling(req: _Request, prompt_len: int, max_tokens: int | None, default_max: int, stop: list[str],
                 stop_ids: list[int], logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
        if prompt_len > max_context or prompt_len == max_context and max_tokens != 0:  # 0: scored, fits whole
            raise APIError(400, f"the prompt is {prompt_len} tokens; this model's context is {max_context} tokens",
                           "prompt", "context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(default_max, max_context - prompt_len)
        elif prompt_len + max_tokens > max_context:
            raise APIError(400, f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds this model's "
                           f"context of {max_context} tokens", "max_tokens", "context_length_exceeded")
        params = SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_k=req.top_k,
                                top_p=req.top_p, repetition_penalty=req.repetition_penalty,
                                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                                seed=req.seed, stop=list(req.stop or []) + stop, stop_token_ids=stop_ids,
                                logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        try:  # the sampler's own ranges (what it can compute), with its message: `k3 generate` prints the same
            params.validate()
        except SamplingError as e:
            raise APIError(400, str(e), e.param) from None
        return params

    def copies(params: SamplingParams, n: int) -> list[SamplingParams]:
        """The params of n choices: choice j seeded seed + j, so a seeded request stays reproducible."""
        return [params if j == 0 or params.seed is None else dataclasses.replace(params, seed=(params.seed + j) % 2**64)
                for j in range(n)]

    async def start_all(requests: list[tuple[list[int], SamplingParams, Any]], rid: str) -> list:
        """Submit every (prompt, params, media); if one is refused, abort those already submitted."""
        streams = []
        try:
            for i, (ids, params, media) in enumerate(requests):
                streams.append(await start(ids, params, rid if len(requests) == 1 else f"{rid}-{i}", media))
        except APIError:
            for s in streams:
                await s.aclose()
            raise
        return streams

    async def start(prompt: list[int], params: SamplingParams, rid: str, media=None):
        try:
            return await async_engine.submit(prompt, params, rid, media=media)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except EngineClosed as e:
            raise APIError(503, str(e), kind="server_error") from None
        except EngineError as e:
            raise APIError(500, str(e), kind="server_error") from None

    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def token_lps(out, text_only: bool) -> list:
        """An output's TokenLogprobs; ``text_only``: without a stop token's, whose text is not returned (chat)."""
        lps = out.logprobs or []
        return lps[:-1] if text_only and out.stop_token else lps

    async def collect(stream, text_only: bool = False) -> tuple[str, Any, list, list | None]:
        """(text, last output, every TokenLogprob, the prompt's) of a whole request."""
        text, last, lps, prompt_lps = [], None, [], None
        try:
            async for out in stream:
                text.append(out.text)
                lps += token_lps(out, text_only)
                prompt_lps = out.prompt_logprobs if out.prompt_logprobs is not None else prompt_lps
                last = out
        except EngineClosed as e:
            raise APIError(503, str(e), kind="server_error") from None
        except EngineError as e:
            raise APIError(500, str(e), kind="server_error") from None
        return "".join(text), last, lps, prompt_lps

    async def until_disconnected(request: Request) -> None:
        """Returns once the client has gone (after the body, the ASGI receive channel only reports that)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def collect_all(request: Request, streams: list, text_only: bool = False) -> list:
        """collect() of every stream; if the client disconnects first, the requests are aborted (their slots
        freed at once) rather than run to the end for nobody."""
        work = asyncio.gather(*(collect(s, text_only) for s in streams))
        # a gather cancelled below ends with an exception nobody awaits: mark it seen (asyncio would log it)
        work.add_done_callback(lambda f: f.cancelled() or f.exception())
        gone = asyncio.ensure_future(until_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if work.done():
                return work.result()
            raise APIError(400, "the client disconnected before the response", code="client_disconnected")
        finally:
            gone.cancel()
            work.cancel()
            for s in streams:
                await s.aclose()

    def piece(token_id: int) -> str:
        return tok.decode([token_id])

    def top_dict(e) -> dict[str, float]:
        """The legacy form's {text: logprob} of a TokenLogprob's alternatives, most likely first, then the token
        itself where they miss it (N + 1 entries, as OpenAI's); where two decode to one text, the likelier's value."""
        out: dict[str, float] = {}
        for i, v in [*e.top, (e.token_id, e.logprob)]:
            out.setdefault(piece(i), v)
        return out

    def completion_logprobs(lps: list, offset: int, prompt: list[int] | None = None) -> dict:
        """OpenAI's legacy completions form; ``offset``: the text_offset of the first token; ``prompt``: echoed
        prompt ids, whose entries in ``lps`` (None for the first) come first."""
        ids = (prompt or []) + [e.token_id for e in lps[len(prompt or []):]]
        tokens = [piece(t) for t in ids]
        starts = [offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        return {"tokens": tokens, "token_logprobs": [None if e is None else e.logprob for e in lps],
                "top_logprobs": [None if e is None else top_dict(e) for e in lps],
                "text_offset": starts}

    def chat_logprobs(lps: list) -> dict:
        def entry(token_id: int, logprob: float) -> dict:
            return {"token": piece(token_id), "logprob": logprob, "bytes": list(tok.token_bytes(token_id))}

        return {"content": [{**entry(e.token_id, e.logprob), "top_logprobs": [entry(i, v) for i, v in e.top]}
                            for e in lps]}

    def sse(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def stream_events(stream, first: list[dict], chunk, include_usage: bool, text_only: bool = False):
        """SSE: ``first`` chunks, one chunk per text delta, a finish chunk, optional usage chunk, [DONE]."""
        try:
            for obj in first:
                yield sse(obj)
            pending, prompt = [], None  # log-probabilities of tokens whose text is held back (a stop string?)
            async for out in stream:
                pending += token_lps(out, text_only)
                prompt = out.prompt_logprobs if out.prompt_logprobs is not None else prompt
                if out.text or out.finished:
                    yield sse(chunk(out.text, out.finish_reason, pending, prompt))
                    pending, prompt = [], None
                if out.finished and include_usage:
                    yield sse({**chunk(None, None, [], None), "choices": [],
                               "usage": usage(out.prompt_tokens, out.completion_tokens)})
        except (EngineError, EngineClosed) as e:
            yield sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
        finally:
            await stream.aclose()  # a client that went away aborts its request
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check(req)
        if req.max_tokens == 0 and not req.echo:
            raise APIError(400, "max_tokens=0 needs echo=true (it scores the prompt)", "max_tokens")
        if req.stream and len(req.prompt) * req.n > 1:
            raise APIError(400, "a streamed completion takes one prompt and n=1", "prompt" if req.n == 1 else "n")
        scored = bool(req.echo) and (req.logprobs is not None or req.max_tokens == 0)
        jobs, prompt_tokens = [], 0  # (prompt as given, its ids, params) per choice, checked before any is submitted
        for p in req.prompt:
            if isinstance(p, str):
                check_chars(len(p), "prompt")
        for p in req.prompt:
            ids = p if isinstance(p, list) else await off_loop(tok.encode, p)
            params = sampling(req, len(ids), req.max_tokens, 16, [], [], req.logprobs,
                              (req.logprobs or 0) if scored else None)
            jobs += [(p, ids, params_j) for params_j in copies(params, req.n)]
            prompt_tokens += len(ids)  # once per prompt, whatever n
        entries = sum(len(ids) for _, ids, _ in jobs) * ((req.logprobs or 0) + 1) if scored else 0
        if entries > MAX_PROMPT_LOGPROB_ENTRIES:
            raise APIError(400, f"echo with logprobs={req.logprobs or 0} over these prompts would return {entries} "
                                f"prompt log-probability entries (prompt tokens x choices x (logprobs + 1)); the limit "
                                f"is {MAX_PROMPT_LOGPROB_ENTRIES}: send fewer or shorter prompts or a smaller logprobs",
                           "logprobs", "response_too_large")
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = await start_all([(ids, params, None) for _, ids, params in jobs], rid)
        base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name}

        def chunker(index: int, prompt, ids: list[int]):
            """chunk(text, reason, lps, prompt_lps) -> the completion object of choice ``index``; the first chunk
            with text carries the echoed prompt, text_offset runs on across a stream's chunks."""
            offset, echo_text = 0, (prompt if isinstance(prompt, str) else tok.decode(ids)) if req.echo else ""

            def chunk(text, reason, lps, prompt_lps):
                nonlocal offset, echo_text
                if text is not None and echo_text:
                    text, echo_text = echo_text + text, ""
                logprobs = None
                if req.logprobs is not None:
                    echoed = bool(req.echo) and prompt_lps is not None
                    logprobs = completion_logprobs((prompt_lps if echoed else []) + lps, offset,
                                                   ids if echoed else None)
                    offset += sum(len(t) for t in logprobs["tokens"])
                return {**base, "choices": [{"index": index, "text": text or "", "logprobs": logprobs,
                                             "finish_reason": reason}]}

            return chunk

        if req.stream:
            include = bool(req.stream_options and req.stream_options.include_usage)
            chunk = chunker(0, *jobs[0][:2])
            return StreamingResponse(stream_events(streams[0], [], chunk, include), media_type="text/event-stream")
        results = await collect_all(request, streams)
        choices = [chunker(i, p, ids)(text, last.finish_reason, lps, prompt_lps)["choices"][0]
                   for i, ((p, ids, _), (text, last, lps, prompt_lps)) in enumerate(zip(jobs, results))]
        completion_tokens = sum(last.completion_tokens for _, last, _, _ in results)
        return {**base, "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        check(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        images: list[bytes] = []
        messages = [_message_content(i, m, images) for i, m in enumerate(req.messages)]
        if images and image_token_id is None:
            raise APIError(400, f"model {model_name!r} takes no images (no vision tower)", "messages")
        check_chars(sum(len(m["content"]) for m in messages if isinstance(m["content"], str)), "messages")
        try:
            rendered = await off_loop(render_chat, messages, tok, image_token_id=image_token_id if images else None)
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        try:  # expand the image placeholders first: the context check counts every image token
            prompt, media = await asyncio.to_thread(engine.prepare, rendered.token_ids, images)
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = sampling(req, len(prompt), max_tokens, max_context, rendered.stop, rendered.stop_token_ids,
                          (req.top_logprobs or 0) if req.logprobs else None)
        if req.stream and req.n > 1:
            raise APIError(400, "a streamed chat completion takes n=1", "n")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await start_all([(prompt, p, media) for p in copies(params, req.n)], rid)
        base = {"id": rid, "created": int(time.time()), "model": model_name}

        def chunk(text, reason, lps, prompt_lps=None):
            delta = {} if text is None or reason is not None and not text else {"content": text}
            return {**base, "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": delta, "logprobs": chat_logprobs(lps) if req.logprobs else None,
                                 "finish_reason": reason}]}

        if req.stream:
            include = bool(req.stream_options and req.stream_options.include_usage)
            first = {**base, "object": "chat.completion.chunk",
                     "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}]}
            return StreamingResponse(stream_events(streams[0], [first], chunk, include, text_only=True),
                                     media_type="text/event-stream")
        results = await collect_all(request, streams, text_only=True)
        completion_tokens = sum(last.completion_tokens for _, last, _, _ in results)
        return {**base, "object": "chat.completion",
                "choices": [{"index": j, "message": {"role": "assistant", "content": text},
                             "logprobs": chat_logprobs(lps) if req.logprobs else None,
                             "finish_reason": last.finish_reason} for j, (text, last, lps, _) in enumerate(results)],
                "usage": usage(len(prompt), completion_tokens)}

    return app
