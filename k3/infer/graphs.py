"""CUDA-graph decode: one captured :meth:`K3ForCausalLM.decode_step` per padded batch size, replayed every step.

An eager decode step of the hybrid model is a few hundred small kernels, so at small batch the GPU mostly waits
for Python to launch them. ``decode_step`` reads nothing back to the host (slots and positions come as device
tensors; KDA / conv states update in place; MLA rows are written at each slot's position into a cache whose
capacity is reserved ahead), so the whole step can be recorded once and replayed with one launch.

A graph is bound to the addresses it was captured with: the cache tensors and this runner's input buffers.
When the MLA cache has to grow (a sequence outruns the capacity, here or in a prefill), every graph is dropped
and recaptured against the new tensors; the runner grows the capacity by ``headroom`` rows so this is rare (the
engine reserves the whole context up front where memory allows, and then it never happens).

Graphs are captured ahead for a few batch sizes (:func:`padded_sizes`: 1, 2, 4, 8, then steps of 8), largest
first so the smaller ones reuse its memory pool; a step of N sequences replays the smallest size >= N, its extra
rows decoding into free cache slots the caller names (their state is garbage, and a slot is reset when a
request takes it).
Capturing runs the step twice on a side stream first (Triton autotuning, lazy initialisation), the first time
eagerly (a compiled step then traces ops whose backends are resolved and logged already: a first resolution inside
the trace, with its log line, would cut the graph for good). Those runs write into the cache, so the KDA and conv
states of the slots involved are saved before and restored after (the MLA rows they write lie past each slot's
length and are overwritten by the real step).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from k3.ops.segments import to_device as _on
from k3.model.cache import K3Cache, KDAState
from k3.ops import pdl

log = logging.getLogger("k3.infer")
# Inductor options of a compiled decode step. combo_kernels fuses independent kernels side by side (on GPUs; the
# CPU backend ignores it): fewer kernels and a faster step (docs/decisions.md, "The compiled decode step uses
# inductor's `combo_kernels`").
COMPILE_OPTIONS = {"combo_kernels": True}


def padded_sizes(max_batch: int) -> list[int]:
    """The batch sizes graphs are captured for: 1, 2, 4, 8, then every multiple of 8, up to and with max_batch."""
    sizes = {n for n in (1, 2, 4, 8) if n <= max_batch} | set(range(16, max_batch + 1, 8)) | {max_batch}
    return sorted(sizes)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    input_ids: Tensor  # [N] static input buffers the graph reads
    slots: Tensor
    positions: Tensor
    logits: Tensor  # [N, V] the graph's output buffer


class GraphedDecoder:
    """``GraphedDecoder(model, cache)(input_ids [N] on the GPU, seq_ids list[int]) -> logits [N, V]``, equal to
    ``model.decode`` (the returned tensor is the graph's buffer: valid until the next call). ``compile=True``
    records a ``torch.compile``d decode_step (one compilation per batch size and cache capacity)."""

    def __init__(self, model, cache: K3Cache, headroom: int = 1024, compile: bool = False):
        device = next(model.parameters()).device
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need the model on a CUDA device, not {device}")
        self.model, self.cache, self.device, self.headroom = model, cache, device, headroom
        self.step = model.decode_step
        if compile:  # inductor fuses the step's pointwise chains; compiled in the warm-up, never under capture
            options = COMPILE_OPTIONS | pdl.inductor_options(device)
            self.step = torch.compile(model.decode_step, dynamic=False, options=options)
            log.info(
                "decode graphs: decode_step compiled by torch.compile (inductor, %s) before each capture",
                ", ".join(f"{k}={v}" for k, v in options.items()),
            )
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, _Captured] = {}
        self.sizes: list[int] = []  # captured ahead (capture); a step pads to the next one
        self.bound = self._tensors()

    def capture(self, sizes: list[int]) -> list[int]:
        """Capture the graphs of ``sizes`` now (largest first), replayed later for any batch up to each size."""
        self.sizes = sorted(set(sizes))
        if self.sizes[-1] > self.cache.batch_size:
            raise ValueError(f"batch sizes {self.sizes} exceed the cache's {self.cache.batch_size} slots")
        self._check_bound(max(self.cache.seq_lens[: self.sizes[-1]]) + 1)
        for n in reversed(self.sizes):
            if n not in self.graphs:
                self.graphs[n] = self._capture(n, *self._slot_tensors(list(range(n))))
        return self.sizes

    def replay_from(self, table: Tensor, seq_ids: list[int], pad_slots: list[int]) -> Tensor:
        """Logits [N, V] of one decode step for ``seq_ids``, each fed ``table[slot]`` (a device tensor of token ids
        per slot), padded to the next captured size with slots from ``pad_slots`` (free ones)."""
        n = len(seq_ids)
        size = next((s for s in self.sizes if s >= n), n)
        pads = [s for s in pad_slots if s not in set(seq_ids)][: size - n]
        slots = list(seq_ids) + (pads if len(pads) == size - n else [])
        ids = table.index_select(0, _on(torch.tensor(slots, dtype=torch.int64), self.device))
        return self._replay(ids, slots)[:n]

    def _tensors(self) -> list[int]:
        """Addresses of the cache tensors the graphs write (they change when the MLA capacity grows)."""
        out = []
        for layer in self.cache.layers:
            out += (
                [layer.recurrent.data_ptr()] + [c.data_ptr() for c in layer.conv]
                if isinstance(layer, KDAState)
                else [layer.kv.data_ptr()]
            )
        return out

    def __call__(self, input_ids: Tensor, seq_ids: list[int]) -> Tensor:
        """Logits [N, V] of one decode step: input_ids [N] on the GPU extend sequences ``seq_ids``."""
        return self._replay(input_ids, [int(i) for i in seq_ids])

    def _replay(self, input_ids: Tensor, ids: list[int]) -> Tensor:
        n = len(ids)
        if input_ids.shape != (n,) or not self.cache.distinct_slots(ids):
            raise ValueError(
                f"need input_ids [N] and N distinct seq_ids in [0, {self.cache.batch_size}); got "
                f"shape {tuple(input_ids.shape)} and seq_ids={ids}"
            )
        self._check_bound(max(self.cache.seq_lens[i] for i in ids) + 1)
        slots, positions = self._slot_tensors(ids)
        captured = self.graphs.get(n)
        if captured is None:
            captured = self.graphs[n] = self._capture(n, slots, positions)
        captured.input_ids.copy_(input_ids)
        captured.slots.copy_(slots)
        captured.positions.copy_(positions)
        captured.graph.replay()
        self.cache.advance_decode(ids)
        return captured.logits

    def _slot_tensors(self, ids: list[int]) -> tuple[Tensor, Tensor]:
        """(slots, positions) [N] on the device, copied from pinned memory in one transfer (no stream sync)."""
        both = torch.tensor([ids, [self.cache.seq_lens[i] for i in ids]], dtype=torch.int64)
        both = _on(both, self.device)
        return both[0], both[1]

    def _check_bound(self, need: int) -> None:
        """Grow the MLA capacity to ``need`` rows (with headroom) if short, and recapture every graph whose cache
        tensors were replaced (here or by a prefill)."""
        if need > self.cache.capacity:
            self.cache.reserve(need + self.headroom)
        if self._tensors() != self.bound:  # the cache grew: graphs point at old tensors
            had = sorted(self.graphs)
            if had:
                log.info(
                    "decode graphs: cache tensors replaced (MLA capacity %d rows); recapturing", self.cache.capacity
                )
            self.graphs.clear()  # frees their memory pool too: the captures need a new one
            self.pool = torch.cuda.graph_pool_handle()
            self.bound = self._tensors()
            for n in reversed(self.sizes):
                self.graphs[n] = self._capture(n, *self._slot_tensors(list(range(n))))

    @torch.no_grad()
    def _capture(self, n: int, slots: Tensor, positions: Tensor) -> _Captured:
        input_ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        slots, positions = slots.clone(), positions.clone()
        saved = self._save_states(slots)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # eager first: every op resolves its backend (and logs it) outside a trace
            for step in (self.model.decode_step, self.step):
                step(input_ids, self.cache, slots, positions)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.step(input_ids, self.cache, slots, positions)
        self._restore_states(slots, saved)
        log.debug("decode graphs: captured batch size %d (capacity %d rows)", n, self.cache.capacity)
        return _Captured(graph, input_ids, slots, positions, logits)

    def _save_states(self, slots: Tensor) -> list[list[Tensor]]:
        return [
            [layer.recurrent[slots]] + [c[slots] for c in layer.conv]
            for layer in self.cache.layers
            if isinstance(layer, KDAState)
        ]

    def _restore_states(self, slots: Tensor, saved: list[list[Tensor]]) -> None:
        kda = [layer for layer in self.cache.layers if isinstance(layer, KDAState)]
        for layer, tensors in zip(kda, saved, strict=True):
            for dst, src in zip([layer.recurrent] + layer.conv, tensors, strict=True):
                dst.index_copy_(0, slots, src)
