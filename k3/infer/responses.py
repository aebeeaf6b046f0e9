"""Response bodies of the OpenAI server (k3.infer.server): usage, the completions and chat forms of
log-probabilities, the completion object of one choice, and the SSE stream of a request's choices.

Each token is shown as its own decoded text (a piece of a multi-byte character decodes to U+FFFD) and
``text_offset`` counts those texts. Chat leaves a stop token's log-probability out (its text is not in the
message); completions keep it.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from k3.data.tokenizer import Tokenizer
from k3.infer.async_engine import EngineClosed, EngineError


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: prompt tokens read from the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def token_lps(out, text_only: bool) -> list:
    """An output's TokenLogprobs; ``text_only``: without a stop token's, whose text is not returned (chat)."""
    lps = out.logprobs or []
    return lps[:-1] if text_only and out.stop_token else lps


# characters a line splitter may break on that json.dumps leaves raw (it escapes \r, \n and other controls below
# U+0020): written as their JSON escapes, the same value, so every event stays one ``data:`` line
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(obj) -> str:
    """One SSE event: ``data: `` and ``obj`` as JSON (UTF-8 text, not ASCII escapes) on one line. NEL, LINE
    SEPARATOR and PARAGRAPH SEPARATOR are escaped, since a client that splits lines on every Unicode line break
    (as Python's ``str.splitlines`` does) would otherwise cut the JSON in two."""
    return f"data: {json.dumps(obj, ensure_ascii=False).translate(_LINE_BREAKS)}\n\n"


async def stream_events(
    streams: list, first: list[dict], chunks: list, include_usage: bool, usage_of, text_only: bool = False
):
    """SSE of a request's choices: ``first`` chunks, then each choice's text deltas as its stream yields them
    (the choices interleaved, each chunk carrying its choice's index, as vLLM streams n > 1), one finish chunk per
    choice, an optional usage chunk once every choice has finished, then [DONE] once.

    ``chunks[i](text, finish_reason, token logprobs, prompt logprobs)`` builds choice i's chunk object, or a list
    of them (k3.infer.tools.ToolChunks), from ``streams[i]``; ``usage_of(last output of each choice)`` the usage
    object. The log-probabilities of tokens whose text is held back (it may begin a stop string) go out with the
    chunk that carries their text. An engine
    failure ends the stream with an ``error`` event, then [DONE]; closing the stream (the client went away) aborts
    every choice still running."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - raised where the events are written
            queue.put_nowait((i, e))
        else:
            queue.put_nowait((i, None))

    pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        for obj in first:
            yield sse(obj)
        pending, prompt = [[] for _ in streams], [None] * len(streams)
        lasts, running = [None] * len(streams), len(streams)
        while running:
            i, out = await queue.get()
            if out is None:
                running -= 1
                continue
            if isinstance(out, BaseException):
                raise out
            pending[i] += token_lps(out, text_only)
            prompt[i] = out.prompt_logprobs if out.prompt_logprobs is not None else prompt[i]
            if out.text or out.finished:
                built = chunks[i](out.text, out.finish_reason, pending[i], prompt[i])
                for obj in built if isinstance(built, list) else [built]:
                    yield sse(obj)
                pending[i], prompt[i] = [], None
            lasts[i] = out
        if include_usage:
            yield sse({**chunks[0](None, None, [], None), "choices": [], "usage": usage_of(lasts)})
    except (EngineError, EngineClosed) as e:
        yield sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
    finally:
        for p in pumps:
            p.cancel()
        for stream in streams:
            await stream.aclose()  # a client that went away aborts its requests
    yield "data: [DONE]\n\n"


class LogprobForms:
    """OpenAI's two shapes of log-probabilities, with each token shown as its own decoded text."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok

    def piece(self, token_id: int) -> str:
        return self.tok.decode([token_id])

    def top_dict(self, e) -> dict[str, float]:
        """The legacy form's {text: logprob} of a TokenLogprob's alternatives, most likely first, then the token
        itself where they miss it (N + 1 entries, as OpenAI's); where two decode to one text, the likelier's value."""
        out: dict[str, float] = {}
        for i, v in [*e.top, (e.token_id, e.logprob)]:
            out.setdefault(self.piece(i), v)
        return out

    def completion(self, lps: list, offset: int, prompt: list[int] | None = None) -> dict:
        """OpenAI's legacy completions form; ``offset``: the text_offset of the first token; ``prompt``: echoed
        prompt ids, whose entries in ``lps`` (None for the first) come first."""
        ids = (prompt or []) + [e.token_id for e in lps[len(prompt or []) :]]
        tokens = [self.piece(t) for t in ids]
        starts = [offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        return {
            "tokens": tokens,
            "token_logprobs": [None if e is None else e.logprob for e in lps],
            "top_logprobs": [None if e is None else self.top_dict(e) for e in lps],
            "text_offset": starts,
        }

    def chat(self, lps: list) -> dict:
        def entry(token_id: int, logprob: float) -> dict:
            return {"token": self.piece(token_id), "logprob": logprob, "bytes": list(self.tok.token_bytes(token_id))}

        return {
            "content": [{**entry(e.token_id, e.logprob), "top_logprobs": [entry(i, v) for i, v in e.top]} for e in lps]
        }


class CompletionChoice:
    """Builds the completion objects of choice ``index`` (called as ``chunk(text, reason, lps, prompt_lps)``): the
    first one with text carries the echoed prompt (``echo``), and ``text_offset`` runs on across a stream's chunks.
    ``logprobs``: the request's N (None: no log-probabilities)."""

    def __init__(
        self, forms: LogprobForms, base: dict, index: int, prompt: Any, ids: list[int], echo: bool, logprobs: int | None
    ):
        self.forms, self.base, self.index, self.ids, self.echo, self.logprobs = forms, base, index, ids, echo, logprobs
        self.offset = 0
        self.echo_text = (prompt if isinstance(prompt, str) else forms.tok.decode(ids)) if echo else ""

    def __call__(self, text: str | None, reason: str | None, lps: list, prompt_lps: list | None) -> dict:
        if text is not None and self.echo_text:
            text, self.echo_text = self.echo_text + text, ""
        logprobs = None
        if self.logprobs is not None:
            echoed = self.echo and prompt_lps is not None
            logprobs = self.forms.completion(
                (prompt_lps if echoed else []) + lps, self.offset, self.ids if echoed else None
            )
            self.offset += sum(len(t) for t in logprobs["tokens"])
        return {
            **self.base,
            "choices": [{"index": self.index, "text": text or "", "logprobs": logprobs, "finish_reason": reason}],
        }


class ChatChoice:
    """Builds the ``chat.completion.chunk`` objects of choice ``index`` (called as ``chunk(text, reason, lps,
    prompt_lps)``: the text delta, none in a finish chunk without text) and the log-probabilities of a message
    (``logprobs``: whether the request asked for them)."""

    def __init__(self, forms: LogprobForms, base: dict, logprobs: bool, index: int = 0):
        self.forms, self.base, self.want, self.index = forms, base, logprobs, index

    def logprobs(self, lps: list) -> dict | None:
        return self.forms.chat(lps) if self.want else None

    def first(self) -> dict:
        """The chunk opening a stream: the assistant's role."""
        return {
            **self.base,
            "object": "chat.completion.chunk",
            "choices": [
                {
                    "index": self.index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        }

    def __call__(self, text: str | None, reason: str | None, lps: list, prompt_lps: list | None = None) -> dict:
        delta = {} if text is None or reason is not None and not text else {"content": text}
        return {
            **self.base,
            "object": "chat.completion.chunk",
            "choices": [{"index": self.index, "delta": delta, "logprobs": self.logprobs(lps), "finish_reason": reason}],
        }
