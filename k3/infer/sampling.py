"""Sampling parameters and next-token selection (greedy, temperature, top-k, top-p, repetition penalty, seed), and
the log-probabilities a request may ask for."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

MAX_LOGPROBS = 20  # the most alternatives a request may ask for per token (OpenAI's chat limit)
# The smallest temperature and repetition penalty above 0: both divide fp32 logits, and a divisor of 1e-2 keeps
# |logit| / divisor <= 100 |logit|, finite for any logit a model produces (fp32 overflows at 3.4e38, so 1e-40, a
# denormal, turns logit 10 into inf and softmax into NaN). Below 0.01 sampling is greedy in all but name (vLLM
# raises smaller temperatures to the same 0.01 for the same reason).
MIN_DIVISOR = 1e-2
MAX_TEMPERATURE = 2.0  # OpenAI's documented upper bound; the server and `k3 generate` both check this one range


class SamplingError(ValueError):
    """An out-of-range sampling parameter; ``param`` names it (the server's error body carries it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class TokenLogprob(NamedTuple):
    """A token's log-probability under the model and the ``n`` likeliest tokens' [(id, logprob)], most likely
    first: the log-softmax of the model's logits at that position, before the request's temperature, penalties
    and top-k / top-p (what the model predicts, not what the sampler drew from)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(logits: Tensor, tokens: list[int], n: int) -> list[TokenLogprob]:
    """logits [m, V] (row i predicts tokens[i]) -> m TokenLogprobs with the n likeliest alternatives each (fp32
    log-softmax)."""
    lp = logits.float().log_softmax(-1)
    ids = torch.tensor(tokens, device=lp.device)
    chosen = lp.gather(1, ids[:, None])[:, 0].tolist()
    if not n:
        return [TokenLogprob(t, v, []) for t, v in zip(tokens, chosen)]
    top = lp.topk(n, dim=-1)
    return [
        TokenLogprob(t, v, list(zip(i, x)))
        for t, v, i, x in zip(tokens, chosen, top.indices.tolist(), top.values.tolist())
    ]


@dataclass
class SamplingParams:
    """What one request asks for. ``temperature == 0`` is greedy decoding."""

    max_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the prompt or output (HF rule)
    presence_penalty: float = 0.0  # subtracted from the logit of every token already generated (OpenAI's rule)
    frequency_penalty: float = 0.0  # subtracted once per time a token was generated
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings (not included in the output)
    stop_token_ids: list[int] = field(default_factory=list)  # besides the tokenizer's EOS
    ignore_eos: bool = False
    logprobs: int | None = None  # N: each generated token's log-probability and the N likeliest (TokenLogprob)
    prompt_logprobs: int | None = None  # N: the same for every prompt token but the first (scoring; no prefix cache)

    def validate(self) -> None:
        """One ValueError naming the field for any out-of-range value."""

        def bad(name: str, why: str) -> None:
            raise SamplingError(name, f"{name}={getattr(self, name)!r} {why}")

        if (
            isinstance(self.max_tokens, bool)
            or not isinstance(self.max_tokens, int)
            or self.max_tokens < (0 if self.prompt_logprobs is not None else 1)
        ):
            bad("max_tokens", "must be an integer >= 1 (0 only to score a prompt, with prompt_logprobs)")
        t = self.temperature
        if (
            isinstance(t, bool)
            or not isinstance(t, (int, float))
            or not (t == 0 or MIN_DIVISOR <= t <= MAX_TEMPERATURE)
        ):
            bad("temperature", f"must be 0 (greedy) or in [{MIN_DIVISOR}, {MAX_TEMPERATURE:g}]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "must be an integer >= 0")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if (
            isinstance(self.repetition_penalty, bool)
            or not isinstance(self.repetition_penalty, (int, float))
            or not MIN_DIVISOR <= self.repetition_penalty <= 10
        ):
            bad("repetition_penalty", f"must be in [{MIN_DIVISOR}, 10]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2 <= v <= 2:
                bad(name, "must be in [-2, 2]")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64
        ):
            bad("seed", "must be None or an integer in [-2**63, 2**64)")
        if (
            not isinstance(self.stop, list)
            or not all(isinstance(s, str) and s for s in self.stop)
            or len(self.stop) > 16
        ):
            bad("stop", "must be a list of at most 16 non-empty strings")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_LOGPROBS):
                bad(name, f"must be None or an integer in [0, {MAX_LOGPROBS}]")

    def generator(self, device: torch.device) -> torch.Generator | None:
        """A generator of its own per request, so a seeded request samples the same tokens in any batch."""
        if self.temperature == 0:
            return None
        g = torch.Generator(device=device)
        g.manual_seed(self.seed if self.seed is not None else torch.seed())
        return g


def apply_repetition_penalty(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """HF's rule: for every token id in ``seen``, positive logits / penalty, negative logits * penalty."""
    if penalty == 1.0 or seen.numel() == 0:
        return logits
    ids = seen.unique()
    picked = logits[ids]
    logits = logits.clone()
    logits[ids] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def apply_output_penalties(logits: Tensor, generated: Tensor, presence: float, frequency: float) -> Tensor:
    """OpenAI's rule: logits[t] - frequency * count(t) - presence * (count(t) > 0), counted over ``generated``
    (the tokens generated so far, not the prompt's)."""
    if generated.numel() == 0 or presence == frequency == 0:
        return logits
    counts = torch.bincount(generated, minlength=logits.numel()).to(logits.dtype)
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def sample_next(
    logits: Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    seen: Tensor | None = None,
    generated: Tensor | None = None,
) -> int:
    """Pick the next token from logits [V] (fp32). seen: the prompt and output tokens (repetition penalty);
    generated: the output tokens (presence / frequency penalties)."""
    logits = logits.float()
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if generated is not None:
        logits = apply_output_penalties(logits, generated, params.presence_penalty, params.frequency_penalty)
    if params.temperature == 0:
        return int(logits.argmax())
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > params.top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    # NaN logits would make multinomial fail (a device assert on a GPU): it draws from uniform weights instead, and
    # the finiteness flag comes back with the token in one transfer, so sampling costs no extra host sync
    finite = torch.isfinite(probs).all()
    token = torch.multinomial(torch.where(finite, probs, torch.ones_like(probs)), 1, generator=generator)
    ok, token = torch.stack([finite.to(token.dtype), token[0]]).tolist()
    if not ok:
        raise ValueError("the next-token probabilities are not finite (NaN or inf logits)")
    return token
