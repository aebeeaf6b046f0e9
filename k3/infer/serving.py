"""The serving logic of the OpenAI server (k3.infer.server), behind its thin routes (k3.infer.routes): checks a
parsed request, builds the prompt and its :class:`SamplingParams`, submits every choice to the
:class:`AsyncEngine` and answers with the whole response or an SSE stream (every choice of every prompt in one
stream, as vLLM's); it also answers vLLM's tokenizer endpoints (``/tokenizer_info``, ``/tokenize``,
``/detokenize``), which evaluation harnesses use to tokenise with the server's own tokenizer. Any refusal is an
:class:`APIError` (one message, OpenAI's error body); engine failures are 500, a draining engine 503.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from tokenizers import Tokenizer as HFTokenizer

from k3.data.tokenizer import Tokenizer
from k3.infer.async_engine import AsyncEngine, EngineClosed, EngineError
from k3.data.chat import chat_format, chat_template, render_chat
from k3.infer.engine import Request as EngineRequest
from k3.infer.protocol import (
    APIError,
    BaseRequest,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    StrictRequest,
    TokenizeRequest,
    bad_text,
    message_content,
)
from k3.infer.responses import (
    ChatChoice,
    CompletionChoice,
    LogprobForms,
    stream_events,
    token_lps,
    usage,
)
from k3.infer.grammar import grammar_for
from k3.infer.sampling import SamplingError, SamplingParams
from k3.infer.tools import ToolChunks, ToolUse

# Echoed prompt log-probabilities: (prompt tokens x choices) x (logprobs + 1) entries at most. Each renders as a
# token text and a float (~25 bytes of JSON), so 2**18 keeps a response near 6 MB; scoring a whole 8192-token
# context with logprobs=20 (172k entries) fits.
MAX_PROMPT_LOGPROB_ENTRIES = 2**18
# The most tokens one request may make the engine process: the sum over its choices of prompt + max_tokens. A
# request of 64 prompts x 16 choices of 1K tokens each would otherwise keep the engine busy for everyone.
MAX_REQUEST_TOKENS = 2**18
# max_tokens left out: a completion stops after OpenAI's 16 tokens, a chat reply after DEFAULT_CHAT_MAX_TOKENS
# (k3 serve --default-max-tokens), either within the context, so a reply that never emits EOS ends in time
COMPLETION_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 1024


def private_copy(tokenizer: Tokenizer) -> Tokenizer:
    """The server encodes with its own copy, so the engine thread's decode never shares the Rust object."""
    return Tokenizer(HFTokenizer.from_str(tokenizer.hf.to_str()), tokenizer.eos_token, tokenizer.bos_token)


def max_token_chars(tokenizer: Tokenizer) -> int:
    """The most characters of text one token can stand for: its vocabulary entry's length (a byte-level token's
    entry has one character per byte, and a character is at least one byte). A text of more than
    ``context x this`` characters needs more than ``context`` tokens, so it is refused without tokenising."""
    return max(1, max(len(piece) for piece in tokenizer.hf.get_vocab(with_added_tokens=True)))


def copies(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The params of n choices: choice j seeded seed + j, so a seeded request stays reproducible."""
    return [
        params if j == 0 or params.seed is None else dataclasses.replace(params, seed=(params.seed + j) % 2**64)
        for j in range(n)
    ]


async def until_disconnected(request: Request) -> None:
    """Returns once the client has gone (after the body, the ASGI receive channel only reports that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def watched(request: Request, work):
    """Await ``work`` (a request's tokenising, checks and submission: a tuple whose last item is its streams)
    unless the client disconnects first; then it is cancelled, whatever it submitted is aborted, and the request
    ends with a 400."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        if not task.cancelled() and task.exception() is None:  # submitted just before the cancel arrived
            for stream in task.result()[-1]:
                await stream.aclose()
        raise APIError(400, "the client disconnected before the response", code="client_disconnected")
    finally:
        gone.cancel()


class Serving:
    """One served model: its engine, a private tokenizer (encoding runs in one thread of its own: off the event
    loop, and calls never overlap, since Tokenizer.encode sets a flag on the shared HF tokenizer before each), its
    context and the ``max_tokens`` of a chat request that gives none (``default_max_tokens``)."""

    def __init__(
        self,
        async_engine: AsyncEngine,
        tokenizer: Tokenizer,
        model_name: str,
        max_context: int,
        max_request_tokens: int = MAX_REQUEST_TOKENS,
        default_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS,
    ):
        self.async_engine, self.engine = async_engine, async_engine.engine
        self.model_name, self.max_context = model_name, max_context
        self.max_request_tokens, self.default_max_tokens = max_request_tokens, default_max_tokens
        self.tok = private_copy(tokenizer)
        self.forms = LogprobForms(self.tok)
        self.max_chars = max_context * max_token_chars(self.tok)
        self.tok_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="k3-tokenize")
        self.created = int(time.time())
        self.info: dict | None = None  # /tokenizer_info's answer, built on first use
        vision = self.engine.vision
        self.image_token_id = None if vision is None else vision.media_placeholder_token_id

    def close(self) -> None:
        self.tok_pool.shutdown(wait=False)

    async def off_loop(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) in the tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(self.tok_pool, lambda: fn(*args, **kwargs))

    # ------------------------------------------------------------------ models and health
    def model_card(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "k3",
            "max_model_len": self.max_context,
        }

    def model(self, name: str | None) -> dict:
        """The model card of ``name`` (None: the served model); 404 for another model."""
        if name is not None and name != self.model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                "model",
                "model_not_found",
                "not_found_error",
            )
        return self.model_card()

    def health(self):
        stats = self.async_engine.stats()
        if not self.async_engine.running:
            return JSONResponse({"status": "unavailable", **stats}, 503)
        return {"status": "ok", "model": self.model_name, "max_context": self.max_context, **stats}

    # ------------------------------------------------------------------ checks and sampling parameters
    def check(self, req: StrictRequest) -> None:
        """Valid Unicode everywhere, this server's model (or none named), no unsupported option."""
        bad = bad_text({name: getattr(req, name) for name in type(req).model_fields})
        if bad is not None:
            raise APIError(
                400,
                f"{bad}: the text is not valid Unicode (it holds an unpaired UTF-16 surrogate such as \\ud800)",
                bad,
                "invalid_text",
            )
        self.model(req.model)
        req.refuse_unsupported()

    def check_chars(self, chars: int, param: str) -> None:
        """A text of ``chars`` characters cannot fit the context: 400 without tokenising it (max_token_chars)."""
        if chars > self.max_chars:
            raise APIError(
                400,
                f"the {param} is {chars} characters, more than this model's context of "
                f"{self.max_context} tokens can hold",
                param,
                "context_length_exceeded",
            )

    def sampling(
        self,
        req: BaseRequest,
        prompt_len: int,
        max_tokens: int | None,
        default_max: int,
        stop: list[str],
        stop_ids: list[int],
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        grammar: str | None = None,
    ) -> SamplingParams:
        """The SamplingParams of a prompt of ``prompt_len`` tokens, checked against the context and the sampler's
        ranges (SamplingParams.validate: its message, as `k3 generate` prints it); ``grammar``: the output's
        (a forced tool call's), else ``response_format``'s."""
        max_context = self.max_context
        if prompt_len > max_context or prompt_len == max_context and max_tokens != 0:  # 0: scored, fits whole
            raise APIError(
                400,
                f"the prompt is {prompt_len} tokens; this model's context is {max_context} tokens",
                "prompt",
                "context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = min(default_max, max_context - prompt_len)
        elif prompt_len + max_tokens > max_context:
            raise APIError(
                400,
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds this model's "
                f"context of {max_context} tokens",
                "max_tokens",
                "context_length_exceeded",
            )
        try:
            grammar = grammar if grammar is not None else grammar_for(req.response_format)
        except SamplingError as e:
            raise APIError(400, str(e), e.param) from None
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_k=req.top_k,
            top_p=req.top_p,
            min_p=req.min_p,
            repetition_penalty=req.repetition_penalty,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            seed=req.seed,
            stop=list(req.stop or []) + stop,
            stop_token_ids=stop_ids,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            ignore_eos=req.ignore_eos,
            grammar=grammar,
        )
        try:
            params.validate()
        except SamplingError as e:
            raise APIError(400, str(e), e.param) from None
        return params

    # ------------------------------------------------------------------ running requests
    async def start_all(self, requests: list[tuple[list[int], SamplingParams, Any]], rid: str) -> list:
        """Submit every (prompt, params, media) in one engine message (added together or not at all, admitted
        fairly against other requests' sequences), within the request's token budget."""
        total = sum(len(ids) + params.max_tokens for ids, params, _ in requests)
        if total > self.max_request_tokens:
            raise APIError(
                400,
                f"this request asks for {total} tokens (prompt + max_tokens, summed over its {len(requests)} "
                f"prompts x choices); the limit is {self.max_request_tokens} (k3 serve --max-request-tokens): "
                "send fewer prompts, a smaller n or a smaller max_tokens",
                "max_tokens",
                "request_too_large",
            )
        seqs = [
            EngineRequest(ids, params, rid if len(requests) == 1 else f"{rid}-{i}", media=media)
            for i, (ids, params, media) in enumerate(requests)
        ]
        try:
            return await self.async_engine.submit_many(seqs, rid)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except EngineClosed as e:
            raise APIError(503, str(e), kind="server_error") from None
        except EngineError as e:
            raise APIError(500, str(e), kind="server_error") from None

    @staticmethod
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

    async def collect_all(self, request: Request, streams: list, text_only: bool = False) -> list:
        """collect() of every stream; if the client disconnects first, the requests are aborted (their slots
        freed at once) rather than run to the end for nobody."""
        work = asyncio.gather(*(self.collect(s, text_only) for s in streams))
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

    # ------------------------------------------------------------------ endpoints
    async def completion_jobs(self, req: CompletionRequest, scored: bool) -> tuple[list[tuple], int]:
        """((prompt as given, its ids, params) per choice, prompt tokens counted once per prompt): every prompt is
        checked before any is submitted. ``scored``: the prompts' log-probabilities are echoed, within
        MAX_PROMPT_LOGPROB_ENTRIES."""
        jobs, prompt_tokens = [], 0
        for p in req.prompt:
            if isinstance(p, str):
                self.check_chars(len(p), "prompt")
        for p in req.prompt:
            try:  # an empty text starts from the BOS token (Tokenizer.prompt_ids), counted in prompt_tokens
                ids = p if isinstance(p, list) else await self.off_loop(self.tok.prompt_ids, p)
            except ValueError as e:
                raise APIError(400, str(e), "prompt") from None
            params = self.sampling(
                req,
                len(ids),
                req.max_tokens,
                COMPLETION_MAX_TOKENS,
                [],
                [],
                req.logprobs,
                (req.logprobs or 0) if scored else None,
            )
            jobs += [(p, ids, params_j) for params_j in copies(params, req.n)]
            prompt_tokens += len(ids)  # once per prompt, whatever n
        entries = sum(len(ids) for _, ids, _ in jobs) * ((req.logprobs or 0) + 1) if scored else 0
        if entries > MAX_PROMPT_LOGPROB_ENTRIES:
            raise APIError(
                400,
                f"echo with logprobs={req.logprobs or 0} over these prompts would return {entries} "
                f"prompt log-probability entries (prompt tokens x choices x (logprobs + 1)); the limit "
                f"is {MAX_PROMPT_LOGPROB_ENTRIES}: send fewer or shorter prompts or a smaller logprobs",
                "logprobs",
                "response_too_large",
            )
        return jobs, prompt_tokens

    @staticmethod
    def completion_usage(prompt_tokens: int, lasts: list, n: int) -> dict:
        """The usage of a completions request from each choice's last output: every choice's tokens; each prompt
        (its n choices in a row) counts once, as in ``prompt_tokens``, with the most cached tokens of its choices."""
        cached = sum(max(last.cached_tokens for last in lasts[i : i + n]) for i in range(0, len(lasts), n))
        return usage(prompt_tokens, sum(last.completion_tokens for last in lasts), cached)

    @staticmethod
    def chat_usage(prompt_tokens: int, lasts: list) -> dict:
        """The usage of a chat request (one prompt, n choices) from each choice's last output."""
        completion_tokens = sum(last.completion_tokens for last in lasts)
        return usage(prompt_tokens, completion_tokens, max(last.cached_tokens for last in lasts))

    async def completions(self, req: CompletionRequest, request: Request):
        self.check(req)
        if req.max_tokens == 0 and not req.echo:
            raise APIError(400, "max_tokens=0 needs echo=true (it scores the prompt)", "max_tokens")
        scored = bool(req.echo) and (req.logprobs is not None or req.max_tokens == 0)
        rid = f"cmpl-{uuid.uuid4().hex}"

        async def admit():
            jobs, prompt_tokens = await self.completion_jobs(req, scored)
            return jobs, prompt_tokens, await self.start_all([(ids, params, None) for _, ids, params in jobs], rid)

        jobs, prompt_tokens, streams = await watched(request, admit())
        base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_name}
        echo = bool(req.echo)
        builders = [
            CompletionChoice(self.forms, base, i, p, ids, echo, req.logprobs) for i, (p, ids, _) in enumerate(jobs)
        ]
        if req.stream:
            include = bool(req.stream_options and req.stream_options.include_usage)
            events = stream_events(
                streams, [], builders, include, lambda lasts: self.completion_usage(prompt_tokens, lasts, req.n)
            )
            return StreamingResponse(events, media_type="text/event-stream")
        results = await self.collect_all(request, streams)
        choices = [
            chunk(text, last.finish_reason, lps, prompt_lps)["choices"][0]
            for chunk, (text, last, lps, prompt_lps) in zip(builders, results)
        ]
        lasts = [last for _, last, _, _ in results]
        return {**base, "choices": choices, "usage": self.completion_usage(prompt_tokens, lasts, req.n)}

    async def chat_prompt(
        self, req, add_generation_prompt: bool = True, tools: list | None = None
    ) -> tuple[list[int], Any, Any]:
        """(prompt ids with image tokens expanded, the images' media, the rendered chat) of ``req.messages`` and
        the ``tools`` they declare."""
        images: list[bytes] = []
        messages = [message_content(i, m, images) for i, m in enumerate(req.messages)]
        if images and self.image_token_id is None:
            raise APIError(400, f"model {self.model_name!r} takes no images (no vision tower)", "messages")
        self.check_chars(sum(len(m["content"]) for m in messages if isinstance(m["content"], str)), "messages")
        try:
            rendered = await self.off_loop(
                render_chat,
                messages,
                self.tok,
                add_generation_prompt,
                image_token_id=self.image_token_id if images else None,
                tools=tools,
            )
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        try:  # expand the image placeholders first: the context check counts every image token
            prompt, media = await asyncio.to_thread(self.engine.prepare, rendered.token_ids, images)
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        return prompt, media, rendered

    async def chat_completions(self, req: ChatRequest, request: Request):
        self.check(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        tools = ToolUse.of(req)
        rid = f"chatcmpl-{uuid.uuid4().hex}"

        async def admit():
            prompt, media, rendered = await self.chat_prompt(req, tools=tools.declared)
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            params = self.sampling(
                req,
                len(prompt),
                max_tokens,
                self.default_max_tokens,
                rendered.stop,
                rendered.stop_token_ids,
                (req.top_logprobs or 0) if req.logprobs else None,
                grammar=tools.grammar(self.tok, rendered.next_call),
            )
            return prompt, await self.start_all([(prompt, p, media) for p in copies(params, req.n)], rid)

        prompt, streams = await watched(request, admit())
        base = {"id": rid, "created": int(time.time()), "model": self.model_name}
        builders = [ChatChoice(self.forms, base, bool(req.logprobs), j) for j in range(req.n)]
        if req.stream and tools.parsing:
            builders = [ToolChunks(b, tools.stream()) for b in builders]
        if req.stream:
            include = bool(req.stream_options and req.stream_options.include_usage)
            events = stream_events(
                streams,
                [chunk.first() for chunk in builders],
                builders,
                include,
                lambda lasts: self.chat_usage(len(prompt), lasts),
                text_only=True,
            )
            return StreamingResponse(events, media_type="text/event-stream")
        results = await self.collect_all(request, streams, text_only=True)
        choices = []
        for j, (text, last, lps, _) in enumerate(results):
            message, reason = tools.message(text, last.finish_reason)
            choices.append(
                {"index": j, "message": message, "logprobs": builders[j].logprobs(lps), "finish_reason": reason}
            )
        return {
            **base,
            "object": "chat.completion",
            "choices": choices,
            "usage": self.chat_usage(len(prompt), [last for _, last, _, _ in results]),
        }

    # ------------------------------------------------------------------ tokenizer endpoints (vLLM's)
    def tokenizer_info(self) -> dict:
        """The tokenizer's configuration, as vLLM's ``/tokenizer_info`` gives it (tokenizer_config.json's fields:
        what lm-evaluation-harness's remote tokenizer reads, ``eos_token`` first), with the ids, the vocabulary
        size, the context, the chat format and its Jinja template (k3.data.chat) besides; built once."""
        if self.info is None:
            self.info = self._tokenizer_info()
        return self.info

    def _tokenizer_info(self) -> dict:
        tok = self.tok
        added = tok.hf.get_added_tokens_decoder()
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",  # a tokenizers tokenizer.json, as transformers loads it
            "eos_token": tok.eos_token,
            "bos_token": tok.bos_token,
            "pad_token": tok.pad_token,
            "eos_token_id": tok.eos_id,
            "bos_token_id": tok.bos_id,
            "vocab_size": tok.vocab_size,
            "model_max_length": self.max_context,
            "add_bos_token": False,
            "add_eos_token": False,
            "chat_format": chat_format(tok),
            "chat_template": chat_template(tok),  # the checkpoint's tokenizer_config.json carries the same
            "added_tokens_decoder": {
                str(i): {"content": t.content, "special": t.special} for i, t in sorted(added.items())
            },
        }

    async def tokenize(self, req: TokenizeRequest) -> dict:
        """A prompt's ids (special-token text such as ``<|endoftext|>`` read as that token, as an HF tokenizer
        reads it, so a client can look a special token's id up) or a chat's ids as a chat request renders them;
        any length (the body limit bounds it): harnesses tokenise whole documents, longer than the context."""
        self.check(req)
        if req.messages is not None:
            ids, _, _ = await self.chat_prompt(req, req.add_generation_prompt, ToolUse.of(req).declared)
        else:
            ids = await self.off_loop(self.tok.encode, req.prompt, True)
        out = {"count": len(ids), "max_model_len": self.max_context, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = await self.off_loop(lambda: [self.tok.hf.id_to_token(t) for t in ids])
        return out

    async def detokenize(self, req: DetokenizeRequest) -> dict:
        """The text of token ids (special tokens kept as their text); an id outside the vocabulary is a 400."""
        self.check(req)

        def decode(ids: list[int]) -> str:
            vocab = self.tok.vocab_size
            bad = next((t for t in ids if t >= vocab or self.tok.hf.id_to_token(t) is None), None)
            if bad is not None:
                raise APIError(400, f"token id {bad} is not in the vocabulary", "tokens", "invalid_token")
            return self.tok.decode(ids)

        return {"prompt": await self.off_loop(decode, req.tokens)}
