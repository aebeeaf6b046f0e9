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
scored prompt runs whole (the prefix cache is not used for it). ``temperature`` is 0 (greedy) or in [0.01, 2]
(OpenAI's range, the sampler's own: :meth:`k3.infer.sampling.SamplingParams.validate`, whose message a bad value gets).

Hostile or careless requests cost bounded work: a body over ``max_request_bytes`` answers 413 (checked from
Content-Length and counted as a chunked body arrives); a text prompt longer than the context could hold in
characters answers 400 before it is tokenised; tokenising runs off the event loop; echoed prompt log-probabilities
are capped (MAX_PROMPT_LOGPROB_ENTRIES); text with an unpaired UTF-16 surrogate answers 400; a non-streamed request
whose client disconnects is aborted; a failure in one request's sampling fails that request only; an unexpected
error answers 500 without closing the keep-alive connection. Once ``AsyncEngine.shutdown`` begins (``k3 serve``
starts it on SIGTERM), new requests answer 503 and requests still running at the drain deadline end with an error
(an SSE ``error`` event then ``[DONE]``, or a 503).

This module assembles the app (the body guard, the engine's start and drain); the request schema is in
k3.infer.protocol, the routes and error handlers in k3.infer.routes, the serving logic (checks, prompts, sampling
parameters, submitting and collecting) in k3.infer.serving and the response bodies and SSE streams in
k3.infer.responses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI

from k3.data.tokenizer import Tokenizer
from k3.infer import routes
from k3.infer.async_engine import AsyncEngine
from k3.infer.protocol import (  # noqa: F401 - the request schema stays importable from here
    MAX_IMAGE_BYTES,
    MAX_N,
    MAX_PROMPTS,
    MAX_STOP,
    APIError,
    ChatRequest,
    CompletionRequest,
    StreamOptions,
    error_response,
)
from k3.infer.serving import Serving

log = logging.getLogger("k3.serve")
MAX_REQUEST_BYTES = 16 << 20  # default body limit: room for a ~10 MiB image as base64, far more than any prompt


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
        too_large = error_response(
            413,
            f"the request body is larger than this server's limit of {self.max_bytes} "
            "bytes (k3 serve --max-request-mb)",
            code="request_too_large",
        )
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


def create_app(
    async_engine: AsyncEngine,
    tokenizer: Tokenizer,
    model_name: str,
    max_context: int,
    drain_timeout: float = 30.0,
    max_request_bytes: int = MAX_REQUEST_BYTES,
) -> FastAPI:
    """The FastAPI app. Its lifespan starts ``async_engine`` (unless started) and shuts it down gracefully
    (requests in flight get up to ``drain_timeout`` seconds). Bodies over ``max_request_bytes`` answer 413."""
    serving = Serving(async_engine, tokenizer, model_name, max_context)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not async_engine.started:
            async_engine.start()
        yield
        await asyncio.to_thread(async_engine.shutdown, drain_timeout)
        serving.close()

    app = FastAPI(title="k3", lifespan=lifespan)
    app.state.serving = serving
    app.add_middleware(_Guard, max_bytes=max_request_bytes)
    routes.install(app)
    return app
