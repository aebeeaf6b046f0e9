"""The inference engine: continuous batching with chunked prefill over the hybrid cache, and prefix caching.

Every :meth:`Engine.step` runs one pass: each running sequence contributes either its next prefill chunk or (once
its prompt is in) its one newest token. The decoding sequences run the model's sync-free ``decode_step``, replayed
from a CUDA graph on GPUs (k3.infer.graphs: graphs are captured at start for padded batch sizes, a step pads to
the next one with free cache slots), also while other sequences prefill: their chunks run through the packed
forward in the same step, segments delimited by ``cu_seqlens`` and pointing at their cache slot through
``seq_ids``. KDA runs its chunked form for prefill chunks and the recurrent form for decode tokens; MLA runs
absorbed over the latent cache for decode tokens. A step feeds at most ``max_num_batched_tokens`` tokens (decode
tokens first, then prefill chunks); a prefill waits up to ``prefill_wait_steps`` decode steps to gather a fuller
pass (a packed forward costs about as much host time for one prompt as for several), and never while no sequence
decodes or once it has begun.

On a GPU the engine first runs :meth:`Engine.warm_up` (prefill passes of 1, 2, 4, ... tokens) and then captures
the graphs: the kernels' autotuners and torch.compile's versions run at start, not as stalls of seconds in the
first requests of each size.

Sampling runs once per step for every row on the device (k3.infer.sampling.sample_batch, called from
k3.infer.engine_outputs, the output half of a step); the step's tokens (and the log-probabilities asked for) come
back in one device-to-host copy. With ``overlap`` (the default on CUDA) the
engine launches step N+1 before it reads step N's tokens: decode inputs are read from a device table of each
slot's newest token, so the host turns step N's tokens into text while the GPU runs step N+1. A sequence that
stopped at step N (a stop token or string) has one step computed for nothing. Text is decoded incrementally
(k3.infer.detok): the cost per token does not grow with the output.

Admission: a request needs a free slot and, under ``memory_budget``, the cache bytes of its whole context
(prompt + max_tokens, :func:`k3.model.cache.cache_bytes_per_sequence`). Requests are admitted fairly across
groups (one HTTP request's prompts and choices form a group): a free slot goes to the waiting group with the
fewest running sequences (the earliest on a tie), so one request with many choices cannot starve the others. A
request that could never fit (too long for ``max_context`` or for the whole budget) is refused at ``add``. With a
``prefix_cache_bytes`` budget, prompts resume from their longest cached prefix (see prefix_cache.py), but for
scored ones (``prompt_logprobs``), which run whole.

A sequence whose own part of a step fails (non-finite probabilities, an error while sampling its row) ends alone
with a :class:`StepOutput` carrying ``error``; the other sequences of the step go on. Only a failure of the
forward pass itself, shared by the whole batch, fails ``step()``.

Structured output (``SamplingParams.grammar``, k3.infer.grammar): each constrained sequence has an llguidance
matcher; its row's logits are masked to the tokens the grammar allows before sampling, the matcher consumes the
token once it reaches the host, and the output ends ("stop") where the grammar is complete. Such a mask needs the
previous token, so while a constrained sequence runs the steps do not overlap; other steps pay nothing.

Log-probabilities (``logprobs``, ``prompt_logprobs``) are the model's log-softmax, before the masks that keep image
tokens (and a grammar's refused tokens) from being sampled, the penalties, temperature and top-k / top-p / min-p.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque

import torch
from torch import Tensor

from k3.infer.engine_outputs import StepOutputs
from k3.infer.detok import IncrementalDecoder, StopMatcher
from k3.infer.sequence import Media, Request, StepOutput, _Flight, _Sequence, prepare_media
from k3.infer.graphs import GraphedDecoder, padded_sizes
from k3.infer.prefix_cache import PrefixCache
from k3.infer.sampling import SamplingParams
from k3.model.cache import K3Cache, MLAState, cache_bytes_per_sequence
from k3.ops.fused import raise_recompile_limit
from k3.ops.segments import to_device

log = logging.getLogger("k3.infer")


class Engine(StepOutputs):
    def __init__(
        self,
        model,
        tokenizer,
        *,
        max_batch: int = 16,
        max_context: int | None = None,
        max_num_batched_tokens: int | None = None,
        prefill_wait_steps: int | None = None,
        memory_budget: int | None = None,
        prefix_cache_bytes: int = 0,
        block_size: int = 64,
        state_dtype: torch.dtype = torch.float32,
        cuda_graphs: bool | None = None,
        compile_decode: bool = False,
        overlap: bool | None = None,
        warm_up: bool | None = None,
    ):
        """``max_num_batched_tokens`` (default 16384 on CUDA: a packed pass's host cost hardly grows with its
        tokens, so a larger budget prefills more prompts for it; 512 on a CPU) and ``prefill_wait_steps`` (default 8
        on CUDA, 0 on a CPU: the packed forward's host cost is what waiting amortises) shape each step; ``overlap``
        (default: on CUDA) launches a step before reading the previous one's tokens; ``warm_up`` (default: on
        CUDA) runs :meth:`warm_up` before the decode graphs are captured."""
        cfg = model.config
        self.device = next(model.parameters()).device
        gpu = self.device.type == "cuda"
        budget = max_num_batched_tokens if max_num_batched_tokens is not None else (16384 if gpu else 512)
        self.min_chunk = block_size if prefix_cache_bytes else 1  # prefills always get this much of a step
        if max_batch < 1 or budget < self.min_chunk:
            raise ValueError(
                f"max_batch={max_batch} must be positive and max_num_batched_tokens={budget} at least "
                f"{self.min_chunk}{' (the prefix cache block)' if prefix_cache_bytes else ''}"
            )
        self.model, self.tokenizer = model.eval(), tokenizer
        self.max_batch, self.max_num_batched_tokens = max_batch, budget
        self.prefill_wait_steps = prefill_wait_steps if prefill_wait_steps is not None else (8 if gpu else 0)
        if self.prefill_wait_steps < 0:
            raise ValueError(f"prefill_wait_steps={self.prefill_wait_steps} must be >= 0")
        self.overlap = gpu if overlap is None else overlap
        self.max_context = max_context or min(cfg.max_position_embeddings, 8192)
        self.memory_budget = memory_budget
        dtype = next(model.parameters()).dtype
        self.cache = K3Cache(cfg, max_batch, device=self.device, dtype=dtype, state_dtype=state_dtype)
        self.state_bytes = torch.empty((), dtype=state_dtype).element_size()
        self.kv_bytes = next(model.parameters()).element_size()
        self.prefix = PrefixCache(block_size, prefix_cache_bytes) if prefix_cache_bytes else None
        if cuda_graphs is None:
            cuda_graphs = gpu
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
            raise_recompile_limit(max_batch + 8, "k3.infer.engine: compiled decode, one version per batch size")
        if cuda_graphs and (compile_decode or self._whole_cache_fits()):
            self.cache.reserve(self.max_context + 1)  # graphs are never recaptured for a grown cache
        self.last_tokens = torch.zeros(max_batch, dtype=torch.int64, device=self.device)  # each slot's newest
        self.counts: Tensor | None = None  # [max_batch, V] int32 tokens generated, once a request is penalised
        self.seen: Tensor | None = None  # [max_batch, V] bool tokens of the prompt, likewise
        self.free_slots = list(range(max_batch))
        self.waiting: deque[_Sequence] = deque()
        self.running: list[_Sequence] = []
        self.group_running: dict[str, int] = {}
        self.reserved = 0
        self._ids = itertools.count()
        self._inflight: _Flight | None = None
        self._prefill_waited = 0
        self._ll_tokenizer = None  # llguidance's view of the tokenizer, built for the first constrained request
        self.constrained = 0  # running sequences with a grammar (their steps do not overlap)
        # counters since start; busy_s: seconds inside step() (host time, and device time where a step waits on it);
        # first_tokens requests got their first token, after queue_s waiting for a slot and first_token_s from the
        # slot to that token on the host (summed: a reader takes means between two reads)
        self.timing = {
            "steps": 0,
            "decode_rows": 0,
            "prefill_passes": 0,
            "prefill_tokens": 0,
            "busy_s": 0.0,
            "first_tokens": 0,
            "queue_s": 0.0,
            "first_token_s": 0.0,
        }
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
        self.graphs = None
        if gpu if warm_up is None else warm_up:
            t0 = time.perf_counter()
            counts = self.warm_up()
            log.info(
                "engine: prefill warmed up for %d..%d tokens a pass in %.1f s",
                counts[0],
                counts[-1],
                time.perf_counter() - t0,
            )
        if cuda_graphs:
            self.graphs = GraphedDecoder(model, self.cache, compile=compile_decode)
            t0 = time.perf_counter()
            sizes = self.graphs.capture(padded_sizes(max_batch))
            log.info(
                "engine: decode graphs%s captured for batch sizes %s in %.1f s",
                " (compiled)" if compile_decode else "",
                ",".join(map(str, sizes)),
                time.perf_counter() - t0,
            )
        log.info(
            "engine: decode steps %s; %d tokens a step, prefills wait up to %d decode steps; overlap %s",
            "in CUDA graphs" if cuda_graphs else "eager",
            self.max_num_batched_tokens,
            self.prefill_wait_steps,
            "on" if self.overlap else "off",
        )

    @torch.no_grad()
    def warm_up(self, segment: int = 1024) -> list[int]:
        """Run the packed prefill forward once for each token count of the ladder 1, 2, 4, ... up to the most a
        pass can hold (``max_num_batched_tokens``, or what the free slots hold at ``max_context``), that most, and
        each count one less (in segments of ``segment`` tokens or half the context, longer where the slots need
        it: the odd counts end in an odd segment); the largest pass whose segments can double runs once more,
        continuing its sequences; then the slots are emptied. The first pass of a new size class otherwise stalls
        live traffic for seconds: the kernels' autotuners run for each new key (the MoE kernels' rows per group,
        fla's chunked kernels), torch.compile'd ops compile a static first shape, then a dynamic one, and Triton
        compiles each kernel again for sizes that are not multiples of 16 (it specialises integer arguments on
        that). Returns the token counts run. Must run while no request does (at start)."""
        if self.running or self._inflight is not None:
            raise RuntimeError("warm_up runs before any request")
        vocab = self.model.config.vocab_size
        media = set() if self.media_ids is None else set(self.media_ids.tolist())
        plain = next(i for i in range(vocab) if i not in media)
        gen = torch.Generator().manual_seed(0)
        seg = max(1, min(segment, self.max_context // 2))  # the continuing pass doubles a slot's length
        free = len(self.free_slots)
        top = min(self.max_num_batched_tokens, self.max_context * free)  # the most tokens a pass can hold

        def split(total: int) -> list[int]:  # segments of seg tokens, longer where the slots need them to be
            n = min(self.max_context, max(seg, -(-total // free)))
            return [n] * (total // n) + ([total % n] if total % n else [])

        counts, t = [], 1
        while t <= top:
            counts.append(t)
            t *= 2
        counts = sorted(set(counts) | {top} | {t - 1 for t in counts + [top] if t > 2})
        again = max((c for c in counts if 2 * max(split(c)) <= self.max_context), default=None)
        slots: list[int] = []
        for total in counts:
            self.cache.reset(slots)  # a fresh pass on empty slots; the continuing one follows its pass
            lengths = split(total)
            slots = self.free_slots[: len(lengths)]
            for _ in range(2 if total == again else 1):
                ids = torch.randint(vocab, (total,), generator=gen)
                if media:
                    ids[torch.isin(ids, torch.tensor(sorted(media)))] = plain
                cu = torch.tensor([0] + lengths).cumsum(0)
                self.model(
                    to_device(ids, self.device)[None], cu_seqlens=cu, cache=self.cache, seq_ids=slots, last_only=True
                )
        self.cache.reset(slots)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return counts

    def _whole_cache_fits(self) -> bool:
        """Whether the MLA cache of every slot at max_context takes under a quarter of the free device memory
        (then it is reserved at start and the graphs never see it grow)."""
        rows = sum(layer.kv.shape[0] * layer.kv.shape[2] for layer in self.cache.layers if isinstance(layer, MLAState))
        need = rows * (self.max_context + 1) * self.kv_bytes
        free, _ = torch.cuda.mem_get_info(self.device)
        return need <= free // 4 and (self.memory_budget is None or need <= self.memory_budget)

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
        return self.add_many([Request(prompt, params, request_id, images, media)])[0]

    def add_many(self, requests: list[Request], group: str | None = None) -> list[str]:
        """Queue several sequences at once, all or none: each is checked as :meth:`add` checks one, and one
        ValueError (naming the sequence's index when there are several) leaves nothing queued. They form one
        admission group (default: their first id)."""
        seqs, taken = [], {s.request_id for s in (*self.waiting, *self.running)}
        for i, r in enumerate(requests):
            try:
                seq, media = self._check(r, taken)
            except ValueError as e:
                if len(requests) > 1:
                    e.args = (f"choice {i}: {e}",)
                raise
            taken.add(seq.request_id)
            seqs.append((seq, media))
        group = group or (seqs[0][0].request_id if seqs else "")
        now = time.perf_counter()
        for seq, media in seqs:
            seq.group, seq.added_at = group, now
            if media is not None:
                seq.image_features = self._encode(media)
        self.waiting.extend(seq for seq, _ in seqs)
        return [seq.request_id for seq, _ in seqs]

    def _check(self, r: Request, taken: set[str]) -> tuple[_Sequence, Media | None]:
        """The sequence of one request (not queued) and its prepared media, or one ValueError."""
        params, prompt, media = r.params, r.prompt, r.media
        params.validate()
        if not prompt:
            raise ValueError("the prompt is empty")
        if media is None:
            prompt, media = self.prepare(prompt, r.images or [])
        elif r.images:
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
        rid = r.request_id or f"req-{next(self._ids)}"
        if rid in taken:
            raise ValueError(f"request_id={rid!r} is already in use")
        stop_ids = set(params.stop_token_ids)
        if self.eos_id is not None and (not params.ignore_eos or params.grammar is not None):
            stop_ids.add(self.eos_id)  # a grammar allows EOS only where the output may end
        constraint = None
        if params.grammar is not None:
            from k3.infer.grammar import Constraint, ll_tokenizer

            if self._ll_tokenizer is None:
                self._ll_tokenizer = ll_tokenizer(self.tokenizer, self.model.config.vocab_size)
            constraint = Constraint(self._ll_tokenizer, params.grammar)
        seq = _Sequence(
            rid,
            list(prompt),
            params,
            need,
            params.draw_seed(),
            rid,
            frozenset(stop_ids),
            IncrementalDecoder(self.tokenizer),
            StopMatcher(params.stop),
            constraint=constraint,
        )
        return seq, media

    def prepare(self, prompt: list[int], images: list) -> tuple[list[int], Media | None]:
        """See :func:`k3.infer.sequence.prepare_media` (this engine's vision config)."""
        return prepare_media(self.vision, prompt, images)

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
        """Whether a step would do anything: requests waiting or running, or results in flight for a live one."""
        f = self._inflight
        return bool(self.waiting or self.running) or (f is not None and any(not s.done for s in (*f.batch, *f.scored)))

    def _next_waiting(self) -> _Sequence:
        """The head of the waiting group with the fewest running sequences (the earliest group on a tie)."""
        best, best_running, seen = None, None, set()
        for seq in self.waiting:
            if seq.group in seen:
                continue
            seen.add(seq.group)
            n = self.group_running.get(seq.group, 0)
            if best is None or n < best_running:
                best, best_running = seq, n
                if n == 0:
                    break
        return best

    def _admit(self) -> None:
        admitted = []
        while self.waiting and self.free_slots:
            seq = self._next_waiting()
            if self.memory_budget is not None and self.reserved + seq.need_bytes > self.memory_budget:
                break
            self.waiting.remove(seq)
            seq.slot, seq.admitted_at = self.free_slots.pop(0), time.perf_counter()
            self.reserved += seq.need_bytes
            self.group_running[seq.group] = self.group_running.get(seq.group, 0) + 1
            admitted.append(seq)
        self.cache.reset([seq.slot for seq in admitted])  # one fill per state tensor for the whole batch
        for seq in admitted:
            if seq.params.penalised:
                self._track_penalties(seq)
            if seq.constraint is not None:
                self.constrained += 1
            if seq.params.prompt_logprobs is not None:  # run whole: a cached prefix would skip logits it needs
                seq.prompt_logprobs = [None]  # the first token has no context to be predicted from
            elif self.prefix is not None and seq.image_features is None:  # block hashes do not see pixels
                hit = self.prefix.lookup(seq.prompt, len(seq.prompt) - 1)
                if hit is not None:
                    self.cache.restore(seq.slot, hit.kda, hit.latents, hit.length)
                    seq.fed = seq.cached_tokens = seq.remembered = hit.length
            self.running.append(seq)

    def _track_penalties(self, seq: _Sequence) -> None:
        """Zero the slot's generated-token counts and mark its prompt's tokens (device tables, made at first use)."""
        if self.counts is None:
            v = self.model.config.vocab_size
            self.counts = torch.zeros(self.max_batch, v, dtype=torch.int32, device=self.device)
            self.seen = torch.zeros(self.max_batch, v, dtype=torch.bool, device=self.device)
        self.counts[seq.slot].zero_()
        self.seen[seq.slot].zero_()
        self.seen[seq.slot, to_device(torch.tensor(seq.prompt, dtype=torch.int64), self.device)] = True

    def _release(self, seq: _Sequence) -> None:
        seq.done = True
        self.running.remove(seq)
        self.cache.release(seq.slot)  # its states are zeroed when the slot is admitted again
        self.free_slots.append(seq.slot)
        self.reserved -= seq.need_bytes
        if seq.constraint is not None:
            self.constrained -= 1
        left = self.group_running[seq.group] - 1
        if left:
            self.group_running[seq.group] = left
        else:
            del self.group_running[seq.group]

    # ------------------------------------------------------------------ one step
    @torch.no_grad()
    def step(self) -> list[StepOutput]:
        """Admit waiting requests, launch one pass over the running sequences and sample their next tokens, then
        read a step's results: this one's, or with ``overlap`` the one launched before (read while this one runs).
        Returns the outputs read, in row order. While a constrained sequence runs, the step in flight is read
        first: its tokens advance the grammars the next step's masks come from."""
        t0 = time.perf_counter()
        outputs = []
        if self.constrained and self._inflight is not None:
            done, self._inflight = self._inflight, None
            outputs = self._finish(done)
        launched = self._launch()
        done, self._inflight = self._inflight, launched
        outputs += [] if done is None else self._finish(done)
        if not self.overlap and self._inflight is not None:
            done, self._inflight = self._inflight, None
            outputs += self._finish(done)
        self.timing["busy_s"] += time.perf_counter() - t0
        return outputs

    def _launch(self) -> _Flight | None:
        self._admit()
        decoders, prefills, pieces = self._schedule()
        if not decoders and not prefills:
            return None
        rows, sampled, scored = [], list(decoders), []
        if decoders:
            rows.append(self._decode(decoders))
            for seq in decoders:
                seq.fed += 1
        if prefills:
            last = self._prefill(prefills, pieces)
            ready = [i for i, s in enumerate(prefills) if s.fed == len(s.prompt)]
            sampled += [prefills[i] for i in ready if prefills[i].params.max_tokens > 0]
            scored = [prefills[i] for i in ready if prefills[i].params.max_tokens == 0]
            picked = [i for i in ready if prefills[i].params.max_tokens > 0]
            if picked:
                rows.append(last if len(picked) == len(prefills) else last.index_select(0, self._on_device(picked)))
        if self.prefix is not None:
            for seq in decoders + prefills:
                self._remember(seq)
        self.timing["steps"] += 1
        self.timing["decode_rows"] += len(decoders)
        if not sampled:
            return _Flight(
                [], torch.empty(0, dtype=torch.int64), torch.empty(0), [], None, None, None, {}, scored, None
            )
        return self._sample(sampled, rows[0] if len(rows) == 1 else torch.cat(rows), scored)

    def _schedule(self) -> tuple[list[_Sequence], list[_Sequence], list[list[int]]]:
        """(decoding sequences, prefilling ones, the prompt tokens each of those feeds). A sequence decodes once its
        prompt is in and until it has launched max_tokens tokens. Prefill chunks fill what the decode tokens leave
        of the step's budget; a chunk that stops short of its prompt's end ends on a prefix-cache block boundary,
        and with the prefix cache on a chunk that would end the prompt off a boundary stops at the last boundary
        first, so the cache gets the KDA state there (the tail follows in the next pass). Prefills wait (at most
        ``prefill_wait_steps`` decode steps) while sequences decode, none has begun and they would not fill the
        step. Prefills get at least one token (one block with the prefix cache) even when decode tokens fill the
        budget, so they always progress."""
        decoders, pending = [], []
        for seq in self.running:
            if seq.fed < len(seq.prompt):
                pending.append(seq)
            elif 0 < seq.launched < seq.params.max_tokens:
                decoders.append(seq)
        budget = max(self.max_num_batched_tokens - len(decoders), self.min_chunk)
        if not pending:
            return decoders, [], []
        go = (
            not decoders
            or self._prefill_waited >= self.prefill_wait_steps
            or any(s.fed > s.cached_tokens for s in pending)
            or sum(len(s.prompt) - s.fed for s in pending) >= budget
        )
        if not go:
            self._prefill_waited += 1
            return decoders, [], []
        self._prefill_waited = 0
        prefills, pieces = [], []
        for seq in pending:
            if budget <= 0:
                break
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
            prefills.append(seq)
        return decoders, prefills, pieces

    def _on_device(self, values: list[int]) -> Tensor:
        """An int64 index tensor on the engine's device, copied without waiting for the device (a list or a host
        tensor used as a CUDA index is copied from pageable memory: a sync)."""
        return to_device(torch.tensor(values, dtype=torch.int64), self.device)

    def _decode(self, seqs: list[_Sequence]) -> Tensor:
        """Logits [N, V] of one decode token per sequence, each its slot's newest token (the device table)."""
        slots = [s.slot for s in seqs]
        if self.graphs is not None:
            return self.graphs.replay_from(self.last_tokens, slots, self.free_slots)
        ids = self.last_tokens[self._on_device(slots)]
        return self.model.decode(ids, self.cache, slots)

    def _prefill(self, seqs: list[_Sequence], pieces: list[list[int]]) -> Tensor:
        """Run the packed forward over the prefill chunks; logits [S, V] at each chunk's last position (gathering
        prompt log-probabilities for scored sequences from the logits at every position)."""
        lengths = [len(p) for p in pieces]
        ids = to_device(torch.tensor([t for p in pieces for t in p], dtype=torch.int64), self.device)[None]
        images = self._image_rows(seqs, pieces)
        cu = torch.tensor([0] + lengths).cumsum(0)  # host offsets: the model reads them without a GPU sync
        full = any(s.prompt_logprobs is not None for s in seqs)  # logits [T, V] at every position, else [S, V]
        kwargs = {} if images is None else {"image_features": images}
        logits = self.model(
            ids, cu_seqlens=cu, cache=self.cache, seq_ids=[s.slot for s in seqs], last_only=not full, **kwargs
        ).logits
        if full:
            logits = logits[0]
            for i, seq in enumerate(seqs):
                if seq.prompt_logprobs is not None:
                    self._score_prompt(seq, logits, int(cu[i]), lengths[i])
            logits = logits[cu[1:] - 1]
        for seq, n in zip(seqs, lengths):
            seq.fed += n
        self.timing["prefill_passes"] += 1
        self.timing["prefill_tokens"] += sum(lengths)
        return logits

    def _image_rows(self, batch: list[_Sequence], pieces: list[list[int]]) -> Tensor | None:
        """The image-feature rows of this pass's prefill pieces, in packing order (None without images)."""
        if not any(s.image_features is not None for s in batch):
            return None
        pad = self.vision.media_placeholder_token_id
        rows = []
        for seq, piece in zip(batch, pieces):
            n = sum(1 for t in piece if t == pad)
            if n:
                rows.append(seq.image_features[seq.features_used : seq.features_used + n])
                seq.features_used += n
        return torch.cat(rows) if rows else None  # None: no placeholder in this pass, nothing to splice

    def _remember(self, seq: _Sequence) -> None:
        """At a block end, store the blocks this pass completed; the block ending exactly here also gets the KDA
        state, snapshotted now (the next pass changes it). Where the block's last token is not received yet (it
        was sampled by the step in flight), the blocks are stored once it is (:meth:`_finish`)."""
        if seq.fed % self.prefix.block_size or seq.fed <= seq.remembered or seq.image_features is not None:
            return
        state = self.cache.kda_snapshot(seq.slot)
        if seq.fed <= len(seq.tokens):
            self._store(seq, seq.fed, state)
        else:
            seq.snapshot = (seq.fed, state)

    def _store(self, seq: _Sequence, fed: int, state) -> None:
        bs = self.prefix.block_size
        keys = self.prefix.keys(seq.tokens[:fed])
        mla_layers = [layer for layer in self.cache.layers if isinstance(layer, MLAState)]
        # a model without KDA layers can resume at any block; with them, only where a pass stopped
        every = not any(m.mixer == "kda" for m in self.model.model.layers)
        for i in range(seq.remembered // bs, len(keys)):
            lo, hi = i * bs, (i + 1) * bs
            at_end = i == len(keys) - 1 or every
            latents = [m.kv[seq.slot, lo:hi] for m in mla_layers]
            self.prefix.insert(keys[i], keys[i - 1] if i else None, latents, state if at_end else None)
        seq.remembered = fed

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
            **self.timing,
        }
        if self.prefix is not None:
            s["prefix_cache"] = self.prefix.stats()
        return s
