"""The inference engine: continuous batching with chunked prefill over the hybrid cache, and prefix caching.

Every :meth:`Engine.step` packs one forward pass: each running sequence contributes either its next prefill
chunk or (once its prompt is in) its one newest token; segments are delimited by ``cu_seqlens`` and point at
their cache slot through ``seq_ids``, so sequences of any length join and leave between steps. The model
returns logits only at each segment's last token (at every position in a pass that scores a prompt for its
``prompt_logprobs``); a sequence whose prompt is fully in samples its next token from them. KDA runs its
chunked form while any prefill is in the pass and the recurrent form for pure decode steps; MLA runs absorbed
over the latent cache for decode steps. A pass where every sequence brings one token runs the model's sync-free
``decode_step``, replayed from a CUDA graph on GPUs (k3.infer.graphs).

Admission: a request needs a free slot and, under ``memory_budget``, the cache bytes of its whole context
(prompt + max_tokens, :func:`k3.model.cache.cache_bytes_per_sequence`); otherwise it waits in FIFO order. A
request that could never fit (too long for ``max_context`` or for the whole budget) is refused at ``add``.
With a ``prefix_cache_bytes`` budget, prompts resume from their longest cached prefix (see prefix_cache.py), but
for scored ones (``prompt_logprobs``), which run whole.

A sequence whose own part of a step fails (non-finite probabilities, any error while sampling its token) ends
alone with a :class:`StepOutput` carrying ``error``; the other sequences of the step go on. Only a failure of the
forward pass itself, shared by the whole batch, fails ``step()``.

Log-probabilities (``logprobs``, ``prompt_logprobs``) are the model's log-softmax, before the mask that keeps image
tokens from being sampled, the penalties, temperature and top-k / top-p.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from k3.infer.graphs import GraphedDecoder
from k3.infer.prefix_cache import PrefixCache
from k3.infer.sampling import SamplingParams, TokenLogprob, sample_next, token_logprobs
from k3.model.cache import K3Cache, MLAState, cache_bytes_per_sequence
from k3.ops.fused import raise_recompile_limit

log = logging.getLogger("k3.infer")


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
    generator: torch.Generator | None = None
    slot: int = -1
    fed: int = 0  # tokens already run through the model
    output: list[int] = field(default_factory=list)
    emitted: str = ""  # text already returned
    ends: list[int] = field(default_factory=list)  # len(decode(output[:i + 1])) for each output token i
    held: list[TokenLogprob] = field(default_factory=list)  # log-probabilities of output[-len(held):], not yet out
    cached_tokens: int = 0
    remembered: int = 0  # tokens already stored in the prefix cache
    image_features: torch.Tensor | None = None  # [M, d] encoded once at add(); M placeholders in the prompt
    features_used: int = 0  # rows already fed with the prefill
    prompt_logprobs: list[TokenLogprob | None] | None = None  # gathered during the prefill, handed out once

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


class _Pass(NamedTuple):
    """One forward pass's results: tokens fed per sequence, their ``cu_seqlens``, which sequences score their
    prompt, the logits ([T, V] at every position where a prompt is scored in a multi-token pass, else [S, V]), the
    model's logits at each sequence's last position (``raw``, for log-probabilities) and the rows sampled from."""

    lengths: list[int]
    cu: torch.Tensor
    scored: list[bool]
    logits: torch.Tensor
    raw: torch.Tensor
    rows: torch.Tensor


@dataclass
class Media:
    """A request's images after :meth:`Engine.prepare`: packed patches [N, 3*p*p] and patch grids [I, 2]."""

    patches: torch.Tensor
    grids: torch.Tensor


class Engine:
    def __init__(
        self,
        model,
        tokenizer,
        *,
        max_batch: int = 16,
        max_context: int | None = None,
        prefill_chunk: int = 256,
        memory_budget: int | None = None,
        prefix_cache_bytes: int = 0,
        block_size: int = 64,
        state_dtype: torch.dtype = torch.float32,
        cuda_graphs: bool | None = None,
        compile_decode: bool = False,
    ):
        cfg = model.config
        if prefill_chunk < 1 or max_batch < 1:
            raise ValueError(f"prefill_chunk={prefill_chunk} and max_batch={max_batch} must be positive")
        if prefix_cache_bytes and prefill_chunk % block_size:
            raise ValueError(
                f"prefill_chunk={prefill_chunk} must be a multiple of block_size={block_size} when prefix caching is on"
            )
        self.model, self.tokenizer = model.eval(), tokenizer
        self.max_batch, self.prefill_chunk = max_batch, prefill_chunk
        self.max_context = max_context or min(cfg.max_position_embeddings, 8192)
        self.memory_budget = memory_budget
        self.device = next(model.parameters()).device
        self.cache = K3Cache(
            cfg, max_batch, device=self.device, dtype=next(model.parameters()).dtype, state_dtype=state_dtype
        )
        self.state_bytes = torch.empty((), dtype=state_dtype).element_size()
        self.kv_bytes = next(model.parameters()).element_size()
        self.prefix = PrefixCache(block_size, prefix_cache_bytes) if prefix_cache_bytes else None
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda"
        if compile_decode and not cuda_graphs:
            raise ValueError(
                "compile_decode compiles the decode step replayed from CUDA graphs: it needs "
                "cuda_graphs on a CUDA device"
            )
        if compile_decode:  # one compilation per batch size: the MLA capacity is reserved whole, so never grows
            whole = max_batch * self.context_bytes(self.max_context)
            if memory_budget is not None and whole > memory_budget:
                raise ValueError(
                    f"compile_decode reserves the cache of max_batch={max_batch} sequences of "
                    f"max_context={self.max_context} tokens up front ({whole / 2**30:.2f} GiB), more "
                    f"than memory_budget ({memory_budget / 2**30:.2f} GiB): lower either"
                )
            self.cache.reserve(self.max_context + 1)
            raise_recompile_limit(max_batch + 8, "k3.infer.engine: compiled decode, one version per batch size")
        self.graphs = GraphedDecoder(model, self.cache, compile=compile_decode) if cuda_graphs else None
        log.info(
            "engine: decode steps run %s",
            ("compiled, in CUDA graphs" if compile_decode else "in CUDA graphs") if cuda_graphs else "eagerly",
        )
        self.free_slots = list(range(max_batch))
        self.waiting: deque[_Sequence] = deque()
        self.running: list[_Sequence] = []
        self.reserved = 0
        self._ids = itertools.count()
        self.eos_id = getattr(tokenizer, "eos_id", None)
        self.vision = cfg.vision if hasattr(model, "vision_tower") else None  # VisionConfig: takes images
        v = self.vision
        media = (
            []
            if v is None
            else [
                i
                for i in (v.media_placeholder_token_id, v.media_begin_token_id, v.media_end_token_id)
                if i is not None and i < cfg.vocab_size
            ]
        )
        self.media_ids = torch.tensor(media, dtype=torch.int64, device=self.device) if media else None

    # ------------------------------------------------------------------ requests
    def context_bytes(self, tokens: int) -> int:
        return cache_bytes_per_sequence(self.model.config, tokens, self.state_bytes, self.kv_bytes)["total_bytes"]

    def add(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        images: list | None = None,
        media: Media | None = None,
    ) -> str:
        """Queue a request; one ValueError if it can never run (bad params, empty or too long, bad images).

        images (multimodal models): paths, bytes or PIL images, one per media placeholder token of the prompt
        (in order); each placeholder is expanded to the image's tokens (:meth:`prepare`) and the images are
        encoded once the request passes every other check. ``media``: the prompt was expanded by :meth:`prepare`
        already (the server does, to count the expanded prompt against its context)."""
        params.validate()
        if not prompt:
            raise ValueError("the prompt is empty")
        if media is None:
            prompt, media = self.prepare(prompt, images or [])
        elif images:
            raise ValueError("pass images or media (from Engine.prepare), not both")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(prompt) + params.max_tokens > self.max_context:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"context limit of {self.max_context} tokens"
            )
        need = self.context_bytes(len(prompt) + params.max_tokens)
        if self.memory_budget is not None and need > self.memory_budget:
            raise ValueError(f"the request needs {need} cache bytes, more than the whole budget {self.memory_budget}")
        rid = request_id or f"req-{next(self._ids)}"
        if any(s.request_id == rid for s in (*self.waiting, *self.running)):
            raise ValueError(f"request_id={rid!r} is already in use")
        features = None if media is None else self._encode(media)
        self.waiting.append(
            _Sequence(rid, list(prompt), params, need, params.generator(self.device), image_features=features)
        )
        return rid

    def prepare(self, prompt: list[int], images: list) -> tuple[list[int], Media | None]:
        """The prompt with its media placeholders expanded for ``images``, and the images processed on the host
        (decoded, resized, cut into patches; the tower runs later, in :meth:`add`): (expanded prompt, Media or
        None). One ValueError for images a model cannot take, bad images or placeholder / image count mismatch."""
        from k3.vision.media import expand_placeholders, merged_tokens
        from k3.vision.processor import ImageProcessor

        v = self.vision
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

    @torch.no_grad()
    def _encode(self, media: Media) -> torch.Tensor:
        """The vision tower on a request's images: [M, d] LM-width image tokens."""
        dtype = next(self.model.parameters()).dtype
        return self.model.encode_images(media.patches.to(self.device, dtype), media.grids)

    def abort(self, request_id: str) -> None:
        """Drop a waiting or running request (its slot is freed)."""
        self.waiting = deque(s for s in self.waiting if s.request_id != request_id)
        for seq in [s for s in self.running if s.request_id == request_id]:
            self._release(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> None:
        while self.waiting and self.free_slots:
            seq = self.waiting[0]
            if self.memory_budget is not None and self.reserved + seq.need_bytes > self.memory_budget:
                break
            self.waiting.popleft()
            seq.slot = self.free_slots.pop(0)
            self.reserved += seq.need_bytes
            self.cache.reset(seq.slot)
            if seq.params.prompt_logprobs is not None:  # run whole: a cached prefix would skip logits it needs
                seq.prompt_logprobs = [None]  # the first token has no context to be predicted from
            elif self.prefix is not None and seq.image_features is None:  # block hashes do not see pixels
                hit = self.prefix.lookup(seq.prompt, len(seq.prompt) - 1)
                if hit is not None:
                    self.cache.restore(seq.slot, hit.kda, hit.latents, hit.length)
                    seq.fed = seq.cached_tokens = seq.remembered = hit.length
            self.running.append(seq)

    def _release(self, seq: _Sequence) -> None:
        self.running.remove(seq)
        self.cache.reset(seq.slot)
        self.free_slots.append(seq.slot)
        self.reserved -= seq.need_bytes

    # ------------------------------------------------------------------ one step
    @torch.no_grad()
    def step(self) -> list[StepOutput]:
        """One forward pass over every running sequence: admit waiting requests, pick each sequence's piece of the
        pass, run the model, then advance each sequence on the pass's logits (its outputs, in batch order)."""
        self._admit()
        if not self.running:
            return []
        batch, pieces = self._schedule()
        fwd = self._forward(batch, pieces)
        return self._advance_all(batch, fwd)

    def _schedule(self) -> tuple[list[_Sequence], list[list[int]]]:
        """(sequences in this pass, the tokens each feeds): a prefill chunk (within the step's ``prefill_chunk``
        budget; one that stops short of its prompt's end ends on a prefix-cache block boundary, and with the prefix
        cache on a chunk that would end the prompt off a boundary stops at the last boundary first, so the cache
        gets the KDA state there: the tail follows in the next pass) or, once the prompt is in, the newest output
        token. A prefilling sequence left no budget sits this pass out."""
        pieces, batch, budget = [], [], self.prefill_chunk
        for seq in self.running:
            if seq.fed < len(seq.prompt):
                if budget <= 0:
                    continue
                take = min(len(seq.prompt) - seq.fed, budget)
                if self.prefix is not None:
                    end = seq.fed + take
                    aligned = end - end % self.prefix.block_size
                    if end < len(seq.prompt) or (aligned > seq.fed and seq.image_features is None):
                        take = aligned - seq.fed
                if take <= 0:
                    continue
                budget -= take
                pieces.append(seq.prompt[seq.fed : seq.fed + take])
            else:
                pieces.append([seq.output[-1]])
            batch.append(seq)
        return batch, pieces

    def _forward(self, batch: list[_Sequence], pieces: list[list[int]]) -> _Pass:
        """Run the model once over the packed pieces: the sync-free decode step where each brings one token, else
        the packed forward (logits at every position where a prompt is scored, else at each segment's last)."""
        lengths = [len(p) for p in pieces]
        ids = torch.tensor([t for p in pieces for t in p], device=self.device)[None]
        images = self._image_rows(batch, pieces)
        slots = [s.slot for s in batch]
        scored = [s.prompt_logprobs is not None and s.fed < len(s.prompt) for s in batch]  # need every position
        cu = torch.tensor([0] + lengths).cumsum(0)  # host offsets: the model reads them without a GPU sync
        full = any(scored) and max(lengths) > 1  # logits [T, V] at every position, else [S, V] at the last ones
        if max(lengths) == 1:  # every sequence decodes one token: the sync-free step (graph-replayed on CUDA)
            logits = self.graphs(ids[0], slots) if self.graphs else self.model.decode(ids[0], self.cache, slots)
        else:
            kwargs = {} if images is None else {"image_features": images}
            logits = self.model(
                ids, cu_seqlens=cu, cache=self.cache, seq_ids=slots, last_only=not full, **kwargs
            ).logits
            logits = logits[0] if full else logits
        raw = logits[cu[1:] - 1] if full else logits  # the model's, at each sequence's last position (logprobs)
        # sampled from: image tokens only ever come from images
        rows = raw if self.media_ids is None else raw.index_fill(-1, self.media_ids, float("-inf"))
        return _Pass(lengths, cu, scored, logits, raw, rows)

    def _advance_all(self, batch: list[_Sequence], fwd: _Pass) -> list[StepOutput]:
        """:meth:`_advance` each sequence of the pass; one whose own part fails ends alone (:meth:`_fail`)."""
        outputs = []
        for i, seq in enumerate(batch):
            try:
                out = self._advance(seq, i, fwd)
            except Exception as e:  # noqa: BLE001 - this sequence's sampling failed: end it alone, keep the rest
                log.warning("request %s failed in sampling: %s: %s", seq.request_id, type(e).__name__, e)
                out = self._fail(seq, f"{type(e).__name__}: {e}")
            if out is not None:
                outputs.append(out)
        return outputs

    def _advance(self, seq: _Sequence, i: int, fwd: _Pass) -> StepOutput | None:
        """Take the pass's results for batch entry ``i``: gather prompt log-probabilities, count the fed tokens
        (storing completed blocks in the prefix cache), then, once its prompt is in, sample its next token; its
        output or None."""
        n = fwd.lengths[i]
        if fwd.scored[i]:
            self._score_prompt(seq, fwd.logits, int(fwd.cu[i]), n)
        seq.fed += n
        if self.prefix is not None and seq.image_features is None:
            self._remember(seq)
        if seq.fed < len(seq.prompt):
            return None
        if seq.params.max_tokens == 0:  # scored only
            return self._finish_scoring(seq)
        token, lp = self._sample(seq, fwd.rows[i], fwd.raw[i : i + 1])
        return self._emit(seq, token, lp)

    @staticmethod
    def _score_prompt(seq: _Sequence, logits: torch.Tensor, start: int, n: int) -> None:
        """The ``n`` positions fed from ``start`` predict the prompt's next tokens: their log-probabilities."""
        targets = seq.prompt[seq.fed + 1 : seq.fed + n + 1]
        if targets:
            seq.prompt_logprobs += token_logprobs(
                logits[start : start + len(targets)], targets, seq.params.prompt_logprobs
            )

    def _sample(self, seq: _Sequence, row: torch.Tensor, raw: torch.Tensor) -> tuple[int, TokenLogprob | None]:
        """The next token from ``row`` (sampling logits [V]) under the request's penalties and generator, appended
        to its output, and its log-probability from ``raw`` (the model's logits [1, V]) if asked for."""
        p = seq.params
        seen = torch.tensor(seq.tokens, device=self.device) if p.repetition_penalty != 1.0 else None
        penalised = p.presence_penalty != 0 or p.frequency_penalty != 0
        generated = torch.tensor(seq.output, dtype=torch.int64, device=self.device) if penalised else None
        token = sample_next(row, p, seq.generator, seen, generated)
        seq.output.append(token)
        return token, None if p.logprobs is None else token_logprobs(raw, [token], p.logprobs)[0]

    def _fail(self, seq: _Sequence, error: str) -> StepOutput:
        """End one sequence whose step failed: its slot is freed, its output carries ``error``."""
        if seq in self.running:
            self._release(seq)
        return StepOutput(
            seq.request_id, [], "", True, "error", len(seq.prompt), len(seq.output), seq.cached_tokens, error=error
        )

    def _image_rows(self, batch: list[_Sequence], pieces: list[list[int]]) -> torch.Tensor | None:
        """The image-feature rows of this pass's prefill pieces, in packing order (None without images)."""
        if not any(s.image_features is not None for s in batch):
            return None
        pad = self.vision.media_placeholder_token_id
        rows = []
        for seq, piece in zip(batch, pieces):
            n = sum(1 for t in piece if t == pad) if seq.fed < len(seq.prompt) else 0
            if n:
                rows.append(seq.image_features[seq.features_used : seq.features_used + n])
                seq.features_used += n
        return torch.cat(rows) if rows else None  # None: no placeholder in this pass, nothing to splice

    def _remember(self, seq: _Sequence) -> None:
        """Store the blocks this pass completed; the block ending exactly here also gets the KDA state."""
        bs = self.prefix.block_size
        if seq.fed % bs or seq.fed <= seq.remembered:
            return
        keys = self.prefix.keys(seq.tokens[: seq.fed])
        mla_layers = [layer for layer in self.cache.layers if isinstance(layer, MLAState)]
        for i in range(seq.remembered // bs, len(keys)):
            lo, hi = i * bs, (i + 1) * bs
            # a model without KDA layers can resume at any block; with them, only where the pass stopped
            at_end = i == len(keys) - 1 or not any(m.mixer == "kda" for m in self.model.model.layers)
            state = self.cache.kda_snapshot(seq.slot) if at_end else None
            self.prefix.insert(keys[i], keys[i - 1] if i else None, [m.kv[seq.slot, lo:hi] for m in mla_layers], state)
        seq.remembered = seq.fed

    def _emit(self, seq: _Sequence, token: int, lp: TokenLogprob | None = None) -> StepOutput:
        p = seq.params
        reason = None
        stop_ids = set(p.stop_token_ids) | ({self.eos_id} if self.eos_id is not None and not p.ignore_eos else set())
        text = text_all = self.tokenizer.decode(seq.output)
        if token in stop_ids:
            reason = "stop"
            text = self.tokenizer.decode(seq.output[:-1])
        cut = min((text.find(s) for s in p.stop if s in text), default=-1)
        if cut >= 0:
            reason, text = "stop", text[:cut]
        if reason is None and (len(seq.output) >= p.max_tokens or len(seq.tokens) >= self.max_context):
            reason = "length"
        if reason is None:
            hold = max((len(s) - 1 for s in p.stop), default=0)
            safe = text[: len(text) - hold] if hold else text
            while safe.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its next byte
                safe = safe[:-1]
        else:
            safe = text
        delta = safe[len(seq.emitted) :] if safe.startswith(seq.emitted) else ""
        seq.emitted += delta
        out = StepOutput(
            seq.request_id,
            [token],
            delta,
            reason is not None,
            reason,
            len(seq.prompt),
            len(seq.output),
            seq.cached_tokens,
            logprobs=None
            if p.logprobs is None
            else self._release_logprobs(seq, lp, len(text_all), reason is not None, cut >= 0, token in stop_ids),
            prompt_logprobs=seq.prompt_logprobs,
            stop_token=token in stop_ids,
        )
        seq.prompt_logprobs = None  # handed out
        if reason is not None:
            self._release(seq)
        return out

    @staticmethod
    def _release_logprobs(
        seq: _Sequence, lp: TokenLogprob, end: int, finished: bool, cut: bool, stop: bool
    ) -> list[TokenLogprob]:
        """The newest token's entry (``end``: len(decode(output))) joins the held ones; out go those of the tokens
        whose text is out. While the request runs: the held tokens whose text is wholly returned. When it ends: all,
        except after a stop string's cut, where only the tokens whose text starts before the cut go (a token across
        it counts, those wholly after it are dropped); a stop token's (``stop``) always, last."""
        seq.ends.append(end)
        seq.held.append(lp)
        first = len(seq.output) - len(seq.held)  # the output index of held[0]
        if not finished:
            ready = 0
            while ready < len(seq.held) and seq.ends[first + ready] <= len(seq.emitted):
                ready += 1
            out, seq.held = seq.held[:ready], seq.held[ready:]
            return out
        text_tokens = seq.held[:-1] if stop else seq.held
        if cut:
            text_tokens = [
                e for i, e in enumerate(text_tokens, first) if (seq.ends[i - 1] if i else 0) < len(seq.emitted)
            ]
        out, seq.held = text_tokens + seq.held[len(seq.held) - stop :], []
        return out

    def _finish_scoring(self, seq: _Sequence) -> StepOutput:
        """A request with max_tokens=0 ends once its prompt is in: its prompt log-probabilities, no token."""
        out = StepOutput(
            seq.request_id,
            [],
            "",
            True,
            "length",
            len(seq.prompt),
            0,
            seq.cached_tokens,
            logprobs=None if seq.params.logprobs is None else [],
            prompt_logprobs=seq.prompt_logprobs,
        )
        self._release(seq)
        return out

    # ------------------------------------------------------------------ convenience
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[dict]:
        """Run requests to completion; returns per prompt {token_ids, text, finish_reason, cached_tokens} and, for
        requests with ``logprobs`` / ``prompt_logprobs``, their TokenLogprobs under those keys (``error`` for one
        that failed)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add(p, sp) for p, sp in zip(prompts, plist)]
        done: dict[str, dict] = {i: {"token_ids": [], "text": "", "finish_reason": None} for i in ids}
        while self.has_work():
            for out in self.step():
                d = done[out.request_id]
                d["token_ids"] += out.token_ids
                d["text"] += out.text
                if out.logprobs is not None:
                    d.setdefault("logprobs", []).extend(out.logprobs)
                if out.prompt_logprobs is not None:
                    d["prompt_logprobs"] = out.prompt_logprobs
                if out.finished:
                    d.update(finish_reason=out.finish_reason, cached_tokens=out.cached_tokens)
                if out.error is not None:
                    d["error"] = out.error
        return [done[i] for i in ids]

    def stats(self) -> dict:
        s = {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "reserved_bytes": self.reserved,
            "memory_budget": self.memory_budget,
            "slots": self.max_batch,
        }
        if self.prefix is not None:
            s["prefix_cache"] = self.prefix.stats()
        return s
