"""Sampling parameters, next-token selection for a whole step at once, and the log-probabilities a request may ask
for.

:func:`sample_batch` samples every row of a step on the device in one pass (greedy, temperature, top-k, top-p,
min-p, repetition / presence / frequency penalties) with no host sync. Its randomness is counter-based: row ``i``'s
draw is a hash of (the request's seed, the index of the token it samples, the vocabulary id), turned into an
exponential race (``argmax p / E`` with ``E ~ Exp(1)`` picks index ``j`` with probability ``p_j``). A request's
tokens therefore depend on its seed and its own logits only, never on its batch mates or on the order rows come
in. :func:`sample_row` is the per-row reference the batched path is tested against."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from k3.ops.segments import to_device

MAX_LOGPROBS = 20  # the most alternatives a request may ask for per token (OpenAI's chat limit)
# Stop strings: a request may give MAX_STOP (evaluation harnesses add their end-of-text string to a task's list;
# OpenAI's 4 is too few), each at most MAX_STOP_CHARS long, so matching them costs a bounded time per token
# (k3.infer.detok.StopMatcher). The sampler takes one more: the stop string a chat format adds to the request's.
MAX_STOP = 64
MAX_STOP_CHARS = 256
# The smallest temperature and repetition penalty above 0: both divide fp32 logits, and a divisor of 1e-2 keeps
# |logit| / divisor <= 100 |logit|, finite for any logit a model produces (fp32 overflows at 3.4e38, so 1e-40, a
# denormal, turns logit 10 into inf and softmax into NaN). Below 0.01 sampling is greedy in all but name: a
# temperature in (0, 0.01), which OpenAI accepts, samples at 0.01 (as vLLM raises it), see :func:`divisor`.
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
    min_p: float = 0.0  # drop tokens whose probability is below min_p x the likeliest's (0: off)
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the prompt or output (HF rule)
    presence_penalty: float = 0.0  # subtracted from the logit of every token already generated (OpenAI's rule)
    frequency_penalty: float = 0.0  # subtracted once per time a token was generated
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings (not included in the output)
    stop_token_ids: list[int] = field(default_factory=list)  # besides the tokenizer's EOS
    ignore_eos: bool = False
    logprobs: int | None = None  # N: each generated token's log-probability and the N likeliest (TokenLogprob)
    prompt_logprobs: int | None = None  # N: the same for every prompt token but the first (scoring; no prefix cache)
    # structured output: an llguidance grammar (a JSON string, k3.infer.grammar.grammar_for) the output must match;
    # the engine masks the tokens it does not allow and ends the output where it is complete
    grammar: str | None = None

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
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= MAX_TEMPERATURE:
            bad("temperature", f"must be in [0, {MAX_TEMPERATURE:g}] (0: greedy)")
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
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
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
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in self.stop)
            or len(self.stop) > MAX_STOP + 1
        ):
            bad(
                "stop", f"must be a list of at most {MAX_STOP} non-empty strings of at most {MAX_STOP_CHARS} characters"
            )
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_LOGPROBS):
                bad(name, f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise SamplingError("grammar", "grammar must be None or a grammar string (k3.infer.grammar.grammar_for)")

    def draw_seed(self) -> int:
        """The request's seed as an unsigned 64-bit value: its own, or a fresh random one."""
        return self.seed % 2**64 if self.seed is not None else random.SystemRandom().getrandbits(64)

    @property
    def penalised(self) -> bool:
        """Whether any penalty needs the request's token counts."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0 or self.frequency_penalty != 0


# ---------------------------------------------------------------------- counter-based noise
_M32 = 0xFFFFFFFF


def divisor(temperature: float) -> float:
    """What a sampled row's logits are divided by: its temperature, raised to MIN_DIVISOR below it (0 is greedy
    and divides nothing)."""
    return max(float(temperature), MIN_DIVISOR) if temperature > 0 else 0.0


def _fmix32(h: Tensor) -> Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding values in [0, 2**32) (products wrap mod 2**64, the
    mask keeps their exact low 32 bits)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def uniform_noise(seeds: Tensor, positions: Tensor, vocab: int) -> Tensor:
    """[B, vocab] fp32 uniforms in (0, 1): a hash of (seeds[b] as 64 unsigned bits, positions[b], vocabulary id),
    so row b depends on its own seed and position only. seeds, positions: [B] int64."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    key_a = _fmix32(lo ^ _fmix32(positions & _M32))
    key_b = _fmix32(hi ^ _fmix32((positions >> 32) & _M32 ^ 0x5BD1E995))
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    h = _fmix32(_fmix32(ids[None, :] ^ key_a[:, None]) ^ key_b[:, None])
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def _signed(seed: int) -> int:
    """An unsigned 64-bit seed as the int64 holding the same bits."""
    return seed - 2**64 if seed >= 2**63 else seed


# ---------------------------------------------------------------------- one step's rows
@dataclass
class SamplingRows:
    """The per-row parameters of one step's sampling, as device tensors ([B] each), and which features any row
    uses (host flags, so a step of greedy rows runs none of the others' work)."""

    temperature: Tensor
    top_k: Tensor  # 0: off
    top_p: Tensor
    min_p: Tensor
    repetition: Tensor
    presence: Tensor
    frequency: Tensor
    seeds: Tensor  # int64 holding the unsigned 64-bit seeds
    positions: Tensor  # the index of the token each row samples in its request's output
    sampled: bool  # any row with temperature > 0
    top_k_on: bool
    top_p_on: bool
    min_p_on: bool
    repetition_on: bool
    counts_on: bool

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: list[int], positions: list[int], device) -> SamplingRows:
        """Rows for ``params`` (one per sampled sequence), their seeds (unsigned 64-bit) and output positions."""
        floats = torch.tensor(
            [
                [
                    divisor(p.temperature),
                    p.top_p,
                    p.min_p,
                    p.repetition_penalty,
                    p.presence_penalty,
                    p.frequency_penalty,
                ]
                for p in params
            ],
            dtype=torch.float32,
        )
        ints = torch.tensor([[p.top_k, _signed(s), n] for p, s, n in zip(params, seeds, positions)], dtype=torch.int64)
        floats, ints = to_device(floats, device), to_device(ints, device)
        return cls(
            temperature=floats[:, 0],
            top_p=floats[:, 1],
            min_p=floats[:, 2],
            repetition=floats[:, 3],
            presence=floats[:, 4],
            frequency=floats[:, 5],
            top_k=ints[:, 0],
            seeds=ints[:, 1],
            positions=ints[:, 2],
            sampled=any(p.temperature > 0 for p in params),
            top_k_on=any(p.top_k > 0 and p.temperature > 0 for p in params),
            top_p_on=any(p.top_p < 1 and p.temperature > 0 for p in params),
            min_p_on=any(p.min_p > 0 and p.temperature > 0 for p in params),
            repetition_on=any(p.repetition_penalty != 1.0 for p in params),
            counts_on=any(p.presence_penalty != 0 or p.frequency_penalty != 0 for p in params),
        )


class Sampled(NamedTuple):
    """A step's draws on the device: tokens [B] int64 and ok [B] bool (False: the row's logits were NaN or its
    probabilities not finite; its token is meaningless)."""

    tokens: Tensor
    ok: Tensor


def penalised_logits(
    logits: Tensor, rows: SamplingRows, seen: Tensor | None = None, counts: Tensor | None = None
) -> Tensor:
    """fp32 logits [B, V] after the repetition penalty (HF's rule over ``seen`` [B, V] bool: the prompt's and the
    output's tokens) and the presence / frequency penalties (OpenAI's rule over ``counts`` [B, V]: times each token
    was generated)."""
    x = logits.float()
    if rows.repetition_on:
        r = rows.repetition[:, None]
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    if rows.counts_on:
        c = counts.to(torch.float32)
        x = x - rows.frequency[:, None] * c - rows.presence[:, None] * (c > 0).to(torch.float32)
    return x


def sample_batch(
    logits: Tensor, rows: SamplingRows, seen: Tensor | None = None, counts: Tensor | None = None
) -> Sampled:
    """One token for each row of logits [B, V] under its row's parameters (see :class:`SamplingRows`), all on the
    device. Greedy rows (temperature 0) take the argmax of the penalised logits; the others divide by their
    temperature, keep their top-k (ranks after a stable sort, so ties go to the lower id), the smallest prefix
    whose mass reaches top-p, and tokens of at least min-p x the likeliest's probability, then draw with
    :func:`uniform_noise`."""
    x = penalised_logits(logits, rows, seen, counts)
    greedy = x.argmax(-1)
    greedy_ok = ~torch.isnan(x).any(-1)
    if not rows.sampled:
        return Sampled(greedy, greedy_ok)
    v = x.shape[-1]
    is_sampled = rows.temperature > 0
    y = x / torch.where(is_sampled, rows.temperature, 1.0)[:, None]
    if rows.top_k_on or rows.top_p_on:
        sv, si = y.sort(dim=-1, descending=True, stable=True)
        drop = torch.zeros_like(sv, dtype=torch.bool)
        if rows.top_k_on:
            k = torch.where(rows.top_k > 0, rows.top_k, v)
            drop |= torch.arange(v, device=y.device)[None, :] >= k[:, None]
        if rows.top_p_on:
            p = sv.masked_fill(drop, float("-inf")).softmax(-1)
            drop |= p.cumsum(-1) - p > rows.top_p[:, None]
        y = y.masked_fill(torch.zeros_like(drop).scatter(-1, si, drop), float("-inf"))
    probs = y.softmax(-1)
    if rows.min_p_on:
        keep = probs >= rows.min_p[:, None] * probs.max(-1, keepdim=True).values
        probs = torch.where(keep, probs, 0.0)
    race = probs / -torch.log(uniform_noise(rows.seeds, rows.positions, v))
    drawn = race.argmax(-1)
    drawn_ok = torch.isfinite(probs).all(-1)
    return Sampled(torch.where(is_sampled, drawn, greedy), torch.where(is_sampled, drawn_ok, greedy_ok))


def sample_row(
    logits: Tensor,
    params: SamplingParams,
    seed: int,
    position: int,
    seen: list[int] | None = None,
    generated: list[int] | None = None,
) -> int:
    """Reference for one row of :func:`sample_batch`, written out step by step: logits [V]; seen: the prompt's and
    output's tokens (repetition penalty); generated: the output's tokens (presence / frequency penalties). Raises
    ValueError where the batched path reports a row not ok."""
    x = [float(v) for v in logits.float()]
    if params.repetition_penalty != 1.0:
        for t in set(seen or []):
            x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    counts: dict[int, int] = {}
    for t in generated or []:
        counts[t] = counts.get(t, 0) + 1
    for t, c in counts.items():
        x[t] -= params.frequency_penalty * c + params.presence_penalty
    if any(v != v for v in x):
        raise ValueError("the next-token probabilities are not finite (NaN or inf logits)")
    if params.temperature == 0:
        return max(range(len(x)), key=lambda i: (x[i], -i))
    y = [v / divisor(params.temperature) for v in x]
    order = sorted(range(len(y)), key=lambda i: (-y[i], i))
    keep = set(order[: params.top_k] if params.top_k > 0 else order)
    if params.top_p < 1:
        kept = [i for i in order if i in keep]
        z = torch.tensor([y[i] for i in kept], dtype=torch.float32).softmax(0).tolist()
        mass, prefix = 0.0, []
        for i, p in zip(kept, z):
            if mass > params.top_p:
                break
            prefix.append(i)
            mass += p
        keep = set(prefix)
    w = torch.tensor([y[i] if i in keep else float("-inf") for i in range(len(y))], dtype=torch.float32).softmax(0)
    if params.min_p > 0:
        w = torch.where(w >= params.min_p * w.max(), w, 0.0)
    if not torch.isfinite(w).all():
        raise ValueError("the next-token probabilities are not finite (NaN or inf logits)")
    noise = uniform_noise(torch.tensor([_signed(seed)]), torch.tensor([position]), len(y))[0]
    return int((w / -torch.log(noise)).argmax())
