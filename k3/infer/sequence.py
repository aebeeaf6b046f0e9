"""What the engine keeps per request and per step: a sequence's state (:class:`_Sequence`), a launched step's
results on their way to the host (:class:`_Flight`), what a step returns per request (:class:`StepOutput`) and
what a caller adds (:class:`Request`, with images prepared as :class:`Media`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from k3.infer.detok import IncrementalDecoder, StopMatcher
from k3.infer.sampling import SamplingParams, TokenLogprob


@dataclass
class StepOutput:
    """What one step produced for one request (deltas; ``finished`` once)."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # with params.logprobs: those of the tokens whose text is now out (text held back for a possible stop string
    # holds its tokens' entries too; tokens cut off by a stop string get none); a stop token's, last, when it ends
    logprobs: list[TokenLogprob] | None = None
    stop_token: bool = False  # token_ids ends with a stop token (EOS / stop_token_ids), whose text is not returned
    # with params.prompt_logprobs, in a request's first output: None for the first prompt token, then one each
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None  # this request failed alone (finish_reason "error"); the others in the step go on


@dataclass
class _Sequence:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    need_bytes: int
    seed: int  # unsigned 64-bit: the request's or a random one (k3.infer.sampling.uniform_noise)
    group: str
    stop_ids: frozenset[int]
    decoder: IncrementalDecoder
    stopper: StopMatcher
    slot: int = -1
    fed: int = 0  # tokens already run through the model (launched)
    launched: int = 0  # tokens sampled, those of a step still in flight included
    output: list[int] = field(default_factory=list)  # tokens received
    decoded: int = 0  # characters of text decoded from the output so far
    emitted: int = 0  # characters of text returned
    ends: list[int] = field(default_factory=list)  # len(decode(output[:i + 1])) for each output token i
    held: list[TokenLogprob] = field(default_factory=list)  # log-probabilities of output[-len(held):], not yet out
    cached_tokens: int = 0
    remembered: int = 0  # tokens already stored in the prefix cache
    snapshot: tuple | None = None  # (fed, KDA state) taken at a block end whose last token is not received yet
    image_features: Tensor | None = None  # [M, d] encoded once at add(); M placeholders in the prompt
    features_used: int = 0  # rows already fed with the prefill
    prompt_logprobs: list[TokenLogprob | None] | None = None  # gathered during the prefill, handed out once
    done: bool = False  # finished, failed or aborted: results of a step in flight are dropped
    constraint: object | None = None  # k3.infer.grammar.Constraint of a structured-output request
    added_at: float = 0.0  # time.perf_counter() when the engine queued it
    admitted_at: float = 0.0  # ... and when it took a slot

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def take(self, token: int, lp: TokenLogprob | None, max_context: int, complete: bool = False) -> StepOutput:
        """The output of a received token (already appended to ``output``): its text (decoded incrementally; held
        while it may begin a stop string or ends inside a character), whether it ends the request, and the
        log-probabilities now out. ``complete``: the request's grammar ended with this token (a "stop")."""
        p = self.params
        stop_token = token in self.stop_ids
        piece = "" if stop_token else self.decoder.push(token)
        complete = complete and not stop_token
        at_length = not stop_token and (
            len(self.output) >= p.max_tokens or len(self.prompt) + len(self.output) >= max_context
        )
        if stop_token or at_length or complete:
            piece += self.decoder.flush()
        self.decoded += len(piece)
        end = self.decoded + (1 if self.decoder.holding else 0)  # an unfinished character decodes to one U+FFFD
        text, cut = self.stopper.feed(piece, final=stop_token or at_length or complete)
        reason = "stop" if stop_token or cut or complete else "length" if at_length else None
        self.emitted += len(text)
        out = StepOutput(
            self.request_id,
            [token],
            text,
            reason is not None,
            reason,
            len(self.prompt),
            len(self.output),
            self.cached_tokens,
            logprobs=None
            if p.logprobs is None
            else self._release_logprobs(lp, end, reason is not None, cut, stop_token),
            prompt_logprobs=self.prompt_logprobs,
            stop_token=stop_token,
        )
        self.prompt_logprobs = None  # handed out
        return out

    def _release_logprobs(
        self, lp: TokenLogprob, end: int, finished: bool, cut: bool, stop: bool
    ) -> list[TokenLogprob]:
        """The newest token's entry (``end``: len(decode(output))) joins the held ones; out go those of the tokens
        whose text is out. While the request runs: the held tokens whose text is wholly returned. When it ends: all,
        except after a stop string's cut, where only the tokens whose text starts before the cut go (a token across
        it counts, those wholly after it are dropped); a stop token's (``stop``) always, last."""
        self.ends.append(end)
        self.held.append(lp)
        first = len(self.output) - len(self.held)  # the output index of held[0]
        if not finished:
            ready = 0
            while ready < len(self.held) and self.ends[first + ready] <= self.emitted:
                ready += 1
            out, self.held = self.held[:ready], self.held[ready:]
            return out
        text_tokens = self.held[:-1] if stop else self.held
        if cut:
            text_tokens = [e for i, e in enumerate(text_tokens, first) if (self.ends[i - 1] if i else 0) < self.emitted]
        out, self.held = text_tokens + self.held[len(self.held) - stop :], []
        return out


@dataclass
class _Flight:
    """One launched step whose results are not read yet: the sampled sequences (row order), their tokens and
    ok flags and the asked log-probabilities (host copies, complete once ``event`` has passed), rows whose
    sampling raised, and the scored-only sequences whose prompt is in."""

    batch: list[_Sequence]
    tokens: Tensor
    ok: Tensor
    logprob_rows: list[int]
    chosen: Tensor | None
    top_values: Tensor | None
    top_ids: Tensor | None
    errors: dict[int, str]
    scored: list[_Sequence]
    event: torch.cuda.Event | None


@dataclass
class Media:
    """A request's images after :meth:`Engine.prepare`: packed patches [N, 3*p*p] and patch grids [I, 2]."""

    patches: Tensor
    grids: Tensor


@dataclass
class Request:
    """One sequence to add (:meth:`Engine.add_many`): a prompt, its params, an id; images or prepared media."""

    prompt: list[int]
    params: SamplingParams
    request_id: str | None = None
    images: list | None = None
    media: Media | None = None


def prepare_media(vision, prompt: list[int], images: list) -> tuple[list[int], Media | None]:
    """The prompt with its media placeholders expanded for ``images``, and the images processed on the host
    (decoded, resized, cut into patches; the tower runs later, in Engine.add): (expanded prompt, Media or None).
    ``vision``: the model's vision config (None: no tower). One ValueError for images a model cannot take, bad
    images or placeholder / image count mismatch. Host work only, so the API process runs it."""
    from k3.vision.media import expand_placeholders, merged_tokens
    from k3.vision.processor import ImageProcessor

    v = vision
    if v is None:
        if images:
            raise ValueError("this model has no vision tower: it cannot take images")
        return list(prompt), None
    if not images:
        found = prompt.count(v.media_placeholder_token_id)
        if found:
            raise ValueError(
                f"the prompt has {found} media placeholder token(s) (id "
                f"{v.media_placeholder_token_id}) but 0 image(s) were given"
            )
        return list(prompt), None
    patches, grids = ImageProcessor.from_config(v).process(images)
    counts = [merged_tokens(g, v.merge_size) for g in grids.tolist()]
    prompt, _ = expand_placeholders(
        prompt, counts, v.media_placeholder_token_id, v.media_begin_token_id, v.media_end_token_id
    )
    return prompt, Media(patches, grids)
