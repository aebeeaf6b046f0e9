"""An OpenAI-compatible HTTP server over :class:`AsyncEngine`: ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` (both with SSE streaming), vLLM's ``/tokenizer_info``, ``/tokenize`` and ``/detokenize``
(what lm-evaluation-harness's remote tokenizer calls) and ``/health``.

Every request body is validated by a pydantic model (strict types: ``"5"`` is not an integer); a bad field,
bad JSON, an unsupported option (``logit_bias``, ``best_of``, ``suffix``, ``tools``, ...:
every OpenAI option the server does not honour, at any but its no-op value) or a prompt that does not fit the
context answers 400 with OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``; an unknown
model answers 404; an engine failure answers 500 (or ends a stream with an error event) and the server keeps
serving. Sampling extensions beyond OpenAI's fields: ``top_k`` (0 = off), ``min_p`` and ``repetition_penalty``; OpenAI's
``presence_penalty`` / ``frequency_penalty`` count the generated tokens (k3.infer.sampling.apply_output_penalties).
``response_format`` ``json_object`` / ``json_schema`` constrains the output (k3.infer.grammar, with llguidance).

Log-probabilities (``logprobs`` N on completions; ``logprobs: true`` with ``top_logprobs`` N on chat; N <= 20, also
when streaming) are the model's: the log-softmax of its logits at each generated token, before temperature,
penalties and top-k / top-p (:class:`k3.infer.sampling.TokenLogprob`). Completions list the chosen token among the
alternatives (N + 1 entries where it is not among the N likeliest, as OpenAI's) and a stop token's entry; chat
leaves the stop token out (its text is not in the message). An entry goes out with its token's text: held while the
text is (it may begin a stop string), none for tokens a stop string cuts off (one across the cut keeps its). A
completions ``prompt`` may be a list of up to MAX_PROMPTS prompts, and ``n`` asks for up to MAX_N choices per prompt
(streamed too, every choice's chunks interleaved with their ``index``, usage once at the end): choices come
prompt by prompt, choice j seeded ``seed + j``. ``stop`` takes up to MAX_STOP strings. Each token is shown as its own
decoded text (a piece of a multi-byte character decodes to U+FFFD), ``text_offset`` counts those texts. Completions
with ``echo`` return the prompt before the completion and, with ``logprobs``, the prompt tokens' too (null for the
first); ``max_tokens: 0`` with ``echo`` only scores the prompt (how evaluation harnesses ask for log-likelihoods). A
scored prompt runs whole (the prefix cache is not used for it). ``temperature`` is in [0, 2] (0: greedy; below
0.01 it samples at 0.01; OpenAI's range, the sampler's own: :meth:`k3.infer.sampling.SamplingParams.validate`,
whose message a bad value gets).

Hostile or careless requests cost bounded work: a body over ``max_request_bytes`` answers 413 (checked from
Content-Length and counted as a chunked body arrives); a text prompt longer than the context could hold in
characters answers 400 before it is tokenised; tokenising runs off the event loop; echoed prompt log-probabilities
are capped (MAX_PROMPT_LOGPROB_ENTRIES); text with an unpaired UTF-16 surrogate answers 400; a non-streamed request
whose client disconnects is aborted; a failure in one request's sampling fails that request only; an unexpected
error answers 500 without closing the keep-alive connection. Once ``AsyncEngine.shutdown`` begins (``k3 serve``
starts it on SIGTERM), new requests answer 503 and requests still running at the drain deadline end with an error
(an SSE ``error`` event then ``[DONE]``, or a 503).

Connections cost bounded time and descriptors (uvicorn's options from :func:`http_options`, which ``k3 serve``
uses): a request's head must arrive within ``read_timeout`` seconds of the connection opening (or of its first
byte on a kept-alive connection) else the connection closes, and its body within as many more else 408; idle
keep-alive connections close after ``timeout_keep_alive``; beyond ``max_connections`` open ones (capped below the
descriptor limit by :func:`connection_limit`) requests answer 503. :func:`limit_log_rate` caps warnings and errors
at LOG_BURST a second per logger, so a flood (asyncio logs every accept that fails for want of descriptors) costs
a few lines. With ``api_key`` every path but /health (and the docs) needs ``Authorization: Bearer <key>``, else
OpenAI's 401; /docs, /redoc and /openapi.json are served only with ``docs``.

This module assembles the app (the request guard, the engine's start and drain); the request schema is in
k3.infer.protocol, the routes and error handlers in k3.infer.routes, the serving logic (checks, prompts, sampling
parameters, submitting and collecting) in k3.infer.serving and the response bodies and SSE streams in
k3.infer.responses.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import threading
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

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
from k3.infer.serving import DEFAULT_CHAT_MAX_TOKENS, MAX_REQUEST_TOKENS, Serving

log = logging.getLogger("k3.serve")
MAX_REQUEST_BYTES = 16 << 20  # default body limit: room for a ~10 MiB image as base64, far more than any prompt
READ_TIMEOUT = 30.0  # seconds a request's head may take to arrive, and then its body
KEEP_ALIVE_TIMEOUT = 5.0  # seconds an idle keep-alive connection stays open
MAX_CONNECTIONS = 512  # open connections served at once (more answer 503): well below a common 1024-descriptor limit
OVER_LIMIT_GRACE = 1.0  # seconds a connection over the limit gets to send the request its 503 answers
FD_MARGIN = 32  # descriptors kept free, beyond those open at start, when capping the connection limit
LOG_BURST = 20  # warnings and errors a second a logger may write before the rest are counted, not written
OPEN_PATHS = ("/health",)  # answered without the API key
DOCS_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")


class _Guard:
    """ASGI middleware around the app's routes. It answers 401 to a request outside ``open_paths`` without
    ``Authorization: Bearer <api_key>`` (when a key is set; compared in constant time, before any body is read),
    refuses a body over ``max_bytes`` with 413 (Content-Length is checked before reading, a chunked body is counted
    as it arrives, so at most ``max_bytes`` are ever buffered) and one not complete within ``read_timeout`` seconds
    with 408 (closing the connection: what is left of the body is not waited for), and turns an exception that
    escaped every handler into a 500 error body. It does not re-raise, as Starlette's own last-resort handler
    does, because uvicorn closes a keep-alive connection whose app raised."""

    def __init__(
        self,
        app,
        max_bytes: int,
        read_timeout: float | None = READ_TIMEOUT,
        api_key: str | None = None,
        open_paths: tuple[str, ...] = OPEN_PATHS,
    ):
        self.app, self.max_bytes, self.read_timeout = app, max_bytes, read_timeout
        self.api_key = None if api_key is None else api_key.encode()
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            refusal = self._refuse_unauthorized(scope)
            if refusal is not None:
                return await refusal(scope, receive, tracked)
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

    def _refuse_unauthorized(self, scope):
        """OpenAI's 401 for a request that needs the API key and lacks it (or has another); None if it may pass."""
        if self.api_key is None or scope["path"] in self.open_paths:
            return None
        scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").strip().partition(b" ")
        if scheme.lower() != b"bearer" or not token.strip():
            response = error_response(
                401,
                "You didn't provide an API key. You need to provide your API key in an Authorization header "
                "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
            )
        elif not hmac.compare_digest(token.strip(), self.api_key):
            response = error_response(401, "Incorrect API key provided.", code="invalid_api_key")
        else:
            return None
        response.headers["www-authenticate"] = "Bearer"
        return response

    async def _read_body(self, scope, receive, send):
        """The whole body within the limit and the time allowed, as a receive callable replaying it (then the
        client's own, which reports a disconnect); None once a 413 or 408 went out or the client left."""
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
        loop = asyncio.get_running_loop()
        deadline = None if self.read_timeout is None else loop.time() + self.read_timeout
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), None if deadline is None else deadline - loop.time())
            except TimeoutError:
                too_slow = error_response(
                    408,
                    f"the request body did not arrive within {self.read_timeout:g} s (k3 serve --timeout-request-read)",
                    code="request_timeout",
                )
                too_slow.headers["connection"] = "close"
                await too_slow(scope, receive, send)
                return None
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
    read_timeout: float | None = READ_TIMEOUT,
    api_key: str | None = None,
    docs: bool = False,
    max_request_tokens: int | None = None,
    default_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS,
) -> FastAPI:
    """The FastAPI app. Its lifespan starts ``async_engine`` (unless started) and shuts it down gracefully
    (requests in flight get up to ``drain_timeout`` seconds). Bodies over ``max_request_bytes`` answer 413, bodies
    slower than ``read_timeout`` seconds 408; with ``api_key`` every path but /health (and the docs) answers 401
    without it. ``docs`` serves /docs, /redoc and /openapi.json (off by default: they describe the whole API to
    anyone who asks). ``max_request_tokens``: the most prompt + max_tokens one request may ask for over all its
    prompts and choices (k3.infer.serving.MAX_REQUEST_TOKENS by default). ``default_max_tokens``: the ``max_tokens``
    of a chat request that gives none, within the context (a completions request's default is OpenAI's 16)."""
    serving = Serving(
        async_engine,
        tokenizer,
        model_name,
        max_context,
        max_request_tokens or MAX_REQUEST_TOKENS,
        default_max_tokens,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not async_engine.started:
            async_engine.start()
        yield
        await asyncio.to_thread(async_engine.shutdown, drain_timeout)
        serving.close()

    app = FastAPI(
        title="k3",
        lifespan=lifespan,
        **({} if docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}),
    )
    app.state.serving = serving
    open_paths = OPEN_PATHS + (DOCS_PATHS if docs else ())
    app.add_middleware(
        _Guard, max_bytes=max_request_bytes, read_timeout=read_timeout, api_key=api_key, open_paths=open_paths
    )
    routes.install(app)
    return app


# ---------------------------------------------------------------------- connections and logging (uvicorn)
class _Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request head, which uvicorn has none of: a connection must
    deliver a complete head within ``read_timeout`` seconds of opening, and a keep-alive connection within that
    time of the first byte of its next request (its idle wait before that byte is uvicorn's keep-alive timeout),
    else it is closed. A connection opened over the connection limit gets OVER_LIMIT_GRACE seconds: its request
    only earns a 503, and holding it longer would hold a descriptor a served client may need. The body's deadline
    is the app's (:class:`_Guard`)."""

    read_timeout = READ_TIMEOUT

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.head_timer = None
        over = self.limit_concurrency is not None and len(self.connections) >= self.limit_concurrency
        self._arm_head_timer(min(self.read_timeout, OVER_LIMIT_GRACE) if over else self.read_timeout)

    def data_received(self, data: bytes) -> None:
        if self.head_timer is None and self._awaiting_head():
            self._arm_head_timer(self.read_timeout)
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if not self._awaiting_head():
            self._cancel_head_timer()

    def connection_lost(self, exc) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _awaiting_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm_head_timer(self, seconds: float) -> None:
        self.head_timer = self.loop.call_later(seconds, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_timed_out(self) -> None:
        self.head_timer = None
        if self._awaiting_head() and not self.transport.is_closing():
            self.transport.close()


def connection_limit(requested: int) -> int:
    """``requested`` connections, or fewer where the process's descriptor limit (RLIMIT_NOFILE) would run out
    first: each connection holds a descriptor, and a server out of them cannot accept even the connection a 503
    would answer (asyncio then logs every failed accept). Those open now and FD_MARGIN more stay free."""
    try:
        import resource
    except ImportError:  # not a Unix: no such limit to read
        return requested
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return requested
    try:
        in_use = len(os.listdir("/dev/fd"))
    except OSError:
        in_use = 64
    room = max(1, soft - in_use - FD_MARGIN)
    if requested > room:
        log.warning(
            "--max-connections %d capped at %d: the descriptor limit is %d (ulimit -n), %d are in use",
            requested,
            room,
            soft,
            in_use,
        )
        return room
    return requested


def http_options(
    timeout_keep_alive: float = KEEP_ALIVE_TIMEOUT,
    read_timeout: float = READ_TIMEOUT,
    max_connections: int | None = MAX_CONNECTIONS,
) -> dict:
    """uvicorn.Config keyword arguments for this server's connection handling: idle keep-alive connections close
    after ``timeout_keep_alive`` seconds, request heads have ``read_timeout`` seconds (:class:`_Protocol`; pass the
    same to create_app for the body), and a request on a connection beyond the first ``max_connections`` open
    answers 503 (uvicorn's ``limit_concurrency`` counts the asking connection, hence the + 1). WebSocket upgrades
    are off: the API has none."""
    protocol = type("K3H11Protocol", (_Protocol,), {"read_timeout": read_timeout})
    limit = None if max_connections is None else max_connections + 1
    return {"http": protocol, "ws": "none", "timeout_keep_alive": timeout_keep_alive, "limit_concurrency": limit}


class LogRateLimit(logging.Filter):
    """A handler's filter letting at most ``per_second`` warnings and errors a second from each logger through;
    the rest are counted, and the next one let through is preceded by one "suppressed N messages" line. A flood
    (asyncio logs every failed accept once descriptors run out, a client can provoke a warning per request)
    then costs a few lines a second instead of filling the disk. Records below WARNING (access lines) pass."""

    def __init__(self, handler: logging.Handler, per_second: int = LOG_BURST, clock=time.monotonic):
        super().__init__()
        self.handler, self.per_second, self.clock = handler, per_second, clock
        self.windows: dict[str, list] = {}  # logger name -> [window start, records in it, records suppressed]
        self.lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or getattr(record, "k3_suppressed", False):
            return True
        now = self.clock()
        with self.lock:
            window = self.windows.setdefault(record.name, [now, 0, 0])
            suppressed = 0
            if now - window[0] >= 1.0:
                suppressed, window[:] = window[2], [now, 0, 0]
            window[1] += 1
            passes = window[1] <= self.per_second
            window[2] += not passes
        if suppressed:
            note = logging.LogRecord(
                record.name,
                logging.WARNING,
                __file__,
                0,
                "suppressed %d messages (more than %d a second from this logger)",
                (suppressed, self.per_second),
                None,
            )
            note.k3_suppressed = True
            self.handler.handle(note)
        return passes


def limit_log_rate(per_second: int = LOG_BURST, loggers=("", "uvicorn", "uvicorn.access")) -> list[LogRateLimit]:
    """A :class:`LogRateLimit` on every handler of ``loggers`` (the root and uvicorn's own, which do not
    propagate) that has none yet; returns those added."""
    added = []
    for name in loggers:
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, LogRateLimit) for f in handler.filters):
                added.append(LogRateLimit(handler, per_second))
                handler.addFilter(added[-1])
    return added
