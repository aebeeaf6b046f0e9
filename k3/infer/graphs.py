"""CUDA-graph decode: one captured :meth:`K3ForCausalLM.decode_step` per batch size, replayed every step.

An eager decode step of the hybrid model is a few hundred small kernels, so at small batch the GPU mostly waits
for Python to launch them. ``decode_step`` reads nothing back to the host (slots and positions come as device
tensors; KDA / conv states update in place; MLA rows are written at each slot's position into a cache whose
capacity is reserved ahead), so the whole step can be recorded once and replayed with one launch.

A graph is bound to the addresses it was captured with: the cache tensors and this runner's input buffers.
When the MLA cache has to grow (a sequence outruns the capacity, here or in a prefill), every graph is dropped
and recaptured against the new tensors; the runner grows the capacity by ``headroom`` rows so this is rare.
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

from k3.model.cache import K3Cache, KDAState
from k3.ops import pdl

log = logging.getLogger("k3.infer")
# Inductor options of a compiled decode step. combo_kernels fuses independent kernels side by side (on GPUs; the
# CPU backend ignores it): at B=1 / 4K on an H200 it cut a step's kernels from 575 to 380 and its time from 1.65
# to 1.40 ms (docs/decisions.md).
COMPILE_OPTIONS = {"combo_kernels": True}


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
        self.bound = self._tensors()

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
        ids = [int(i) for i in seq_ids]
        n = len(ids)
        if input_ids.shape != (n,) or not self.cache.distinct_slots(ids):
            raise ValueError(
                f"need input_ids [N] and N distinct seq_ids in [0, {self.cache.batch_size}); got "
                f"shape {tuple(input_ids.shape)} and seq_ids={ids}"
            )
        need = max(self.cache.seq_lens[i] for i in ids) + 1
        if need > self.cache.capacity:
            self.cache.reserve(need + self.headroom)
        if self._tensors() != self.bound:  # the cache grew (here or in a prefill): graphs point at old tensors
            if self.graphs:
                log.info(
                    "decode graphs: cache tensors replaced (MLA capacity %d rows); recapturing", self.cache.capacity
                )
            self.graphs.clear()  # frees their memory pool too: the next captures need a new one
            self.pool = torch.cuda.graph_pool_handle()
            self.bound = self._tensors()
        slots = torch.tensor(ids, dtype=torch.int64)
        positions = torch.tensor([self.cache.seq_lens[i] for i in ids], dtype=torch.int64)
        captured = self.graphs.get(n)
        if captured is None:
            captured = self.graphs[n] = self._capture(n, slots, positions)
        captured.input_ids.copy_(input_ids, non_blocking=True)
        captured.slots.copy_(slots, non_blocking=True)
        captured.positions.copy_(positions, non_blocking=True)
        captured.graph.replay()
        self.cache.advance_decode(ids)
        return captured.logits

    @torch.no_grad()
    def _capture(self, n: int, slots: Tensor, positions: Tensor) -> _Captured:
        input_ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        slots, positions = slots.to(self.device), positions.to(self.device)
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
        log.info("decode graphs: captured batch size %d (capacity %d rows)", n, self.cache.capacity)
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
