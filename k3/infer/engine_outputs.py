"""The output half of an engine step (k3.infer.engine.Engine inherits it): sample every row of a step's logits at
once, read the tokens back, and turn them into :class:`StepOutput` deltas (incremental text, stop tokens and
strings, log-probabilities, prompt scores), with a row that fails in sampling ending its sequence alone."""

from __future__ import annotations

import logging
import time

import torch
from torch import Tensor

from k3.infer.sampling import Sampled, SamplingRows, TokenLogprob, sample_batch, token_logprobs
from k3.infer.sequence import StepOutput, _Flight, _Sequence

log = logging.getLogger("k3.infer")
NOT_FINITE = "ValueError: the next-token probabilities are not finite (NaN or inf logits)"


class StepOutputs:
    """Sampling and outputs of :class:`k3.infer.engine.Engine` (its state: running sequences, slots, device
    tables; see there)."""

    @staticmethod
    def _score_prompt(seq: _Sequence, logits: Tensor, start: int, n: int) -> None:
        """The ``n`` positions fed from ``start`` predict the prompt's next tokens: their log-probabilities."""
        targets = seq.prompt[seq.fed + 1 : seq.fed + n + 1]
        if targets:
            seq.prompt_logprobs += token_logprobs(
                logits[start : start + len(targets)], targets, seq.params.prompt_logprobs
            )

    def _sample(self, seqs: list[_Sequence], raw: Tensor, scored: list[_Sequence]) -> _Flight:
        """Sample every row of ``raw`` (the model's logits [B, V], row i for seqs[i]) at once, record the tokens in
        the device table (and the penalty counts), and start their copy to the host. Rows with a grammar sample
        only the tokens it allows (one masked_fill for the step; none where no row is constrained)."""
        rows = raw if self.media_ids is None else raw.index_fill(-1, self.media_ids, float("-inf"))
        errors: dict[int, str] = {}
        if self.constrained and any(s.constraint is not None for s in seqs):
            from k3.infer.grammar import allowed_rows

            allowed, errors = allowed_rows([s.constraint for s in seqs], rows.shape[-1], self.device)
            rows = rows.masked_fill(~allowed, float("-inf"))
        params = [s.params for s in seqs]
        slots = self._on_device([s.slot for s in seqs])
        seen = counts = None
        if self.counts is not None and any(p.penalised for p in params):
            counts, seen = self.counts[slots], self.seen[slots] | (self.counts[slots] > 0)
        try:
            drawn = sample_batch(
                rows,
                SamplingRows.build(params, [s.seed for s in seqs], [s.launched for s in seqs], self.device),
                seen,
                counts,
            )
        except Exception:  # noqa: BLE001 - find the rows that fail alone; the others keep their draws
            drawn = self._sample_alone(seqs, rows, seen, counts, errors)
        for seq in seqs:
            seq.launched += 1
        self.last_tokens.index_copy_(0, slots, drawn.tokens)
        if self.counts is not None:
            self.counts.index_put_((slots, drawn.tokens), torch.ones_like(drawn.tokens, dtype=torch.int32), True)
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        chosen = top_values = top_ids = None
        if want:
            where = self._on_device(want) if len(want) < len(seqs) else None
            lp = (raw if where is None else raw.index_select(0, where)).float().log_softmax(-1)
            picked = drawn.tokens if where is None else drawn.tokens.index_select(0, where)
            chosen = lp.gather(1, picked[:, None])[:, 0]
            n = max(params[i].logprobs for i in want)
            if n:
                top = lp.topk(n, dim=-1)
                top_values, top_ids = top.values, top.indices
        host = [
            None if t is None else t.to("cpu", non_blocking=True)
            for t in (drawn.tokens, drawn.ok, chosen, top_values, top_ids)
        ]
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return _Flight(seqs, host[0], host[1], want, host[2], host[3], host[4], errors, scored, event)

    def _sample_alone(self, seqs, rows, seen, counts, errors: dict[int, str]) -> Sampled:
        """Each row sampled on its own, after the batched call raised: a row that raises alone is recorded in
        ``errors`` (its token is a placeholder) and the others keep their draws."""
        tokens, oks = [], []
        for i, seq in enumerate(seqs):
            try:
                one = sample_batch(
                    rows[i : i + 1],
                    SamplingRows.build([seq.params], [seq.seed], [seq.launched], self.device),
                    None if seen is None else seen[i : i + 1],
                    None if counts is None else counts[i : i + 1],
                )
            except Exception as e:  # noqa: BLE001 - this row's sampling failed: it ends alone
                errors[i] = f"{type(e).__name__}: {e}"
                one = Sampled(
                    torch.zeros(1, dtype=torch.int64, device=rows.device),
                    torch.zeros(1, dtype=torch.bool, device=rows.device),
                )
            tokens.append(one.tokens)
            oks.append(one.ok)
        return Sampled(torch.cat(tokens), torch.cat(oks))

    def _finish(self, flight: _Flight) -> list[StepOutput]:
        """Read a launched step's results: each sampled sequence's token becomes output (or ends it with an error)."""
        if flight.event is not None:
            flight.event.synchronize()
        outputs = [self._finish_scoring(seq) for seq in flight.scored if not seq.done]
        tokens, ok = flight.tokens.tolist(), flight.ok.tolist()
        lps: dict[int, TokenLogprob] = {}
        if flight.logprob_rows:
            chosen = flight.chosen.tolist()
            values = flight.top_values.tolist() if flight.top_values is not None else None
            ids = flight.top_ids.tolist() if flight.top_ids is not None else None
            for j, i in enumerate(flight.logprob_rows):
                n = flight.batch[i].params.logprobs
                top = [] if not n else list(zip(ids[j][:n], values[j][:n]))
                lps[i] = TokenLogprob(tokens[i], chosen[j], top)
        for i, seq in enumerate(flight.batch):
            if seq.done:
                continue
            error = flight.errors.get(i) or (None if ok[i] else NOT_FINITE)
            if error is not None:
                log.warning("request %s failed in sampling: %s", seq.request_id, error)
                outputs.append(self._fail(seq, error))
                continue
            complete = False
            if seq.constraint is not None:
                error = seq.constraint.consume(tokens[i])
                if error is not None:
                    outputs.append(self._fail(seq, error))
                    continue
                complete = seq.constraint.complete
            seq.output.append(tokens[i])
            if len(seq.output) == 1:
                self._first_token(seq)
            outputs.append(self._emit(seq, tokens[i], lps.get(i), complete))
        for seq in self.running:
            if seq.snapshot is not None and seq.snapshot[0] <= len(seq.tokens):
                self._store(seq, *seq.snapshot)
                seq.snapshot = None
        return outputs

    def _first_token(self, seq: _Sequence) -> None:
        """Count where a request's time to its first token went: waiting for a slot, then from the slot to the token
        (prefill passes, waiting for one, the step in flight)."""
        t = self.timing
        t["first_tokens"] += 1
        t["queue_s"] += seq.admitted_at - seq.added_at
        t["first_token_s"] += time.perf_counter() - seq.admitted_at

    def _fail(self, seq: _Sequence, error: str) -> StepOutput:
        """End one sequence whose step failed: its slot is freed, its output carries ``error``."""
        if seq in self.running:
            self._release(seq)
        return StepOutput(
            seq.request_id, [], "", True, "error", len(seq.prompt), len(seq.output), seq.cached_tokens, error=error
        )

    def _emit(self, seq: _Sequence, token: int, lp: TokenLogprob | None = None, complete: bool = False) -> StepOutput:
        """The output of a received token (:meth:`_Sequence.take`); a sequence that ends frees its slot."""
        out = seq.take(token, lp, self.max_context, complete)
        if out.finished:
            self._release(seq)
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
