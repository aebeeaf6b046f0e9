"""Per-sequence inference cache of the hybrid model, and its memory accounting.

What each layer keeps per sequence:
- KDA layer: the recurrent state S [H, K, V] (fp32 by default) and three conv states [C, W-1] (the last
  W-1 projected q, k, v inputs): constant in context length.
- MLA layer: one latent row per token seen, [c_kv (kv_lora_rank, after kv_a_layernorm), k_pe (rope)], kept in
  a preallocated [S, capacity, r + dr] tensor that doubles when full: linear in context length (the absorbed
  decode attends over these rows directly and never expands them per head).
- Attention Residuals: nothing. Its sources are the same token's own sub-layer outputs, so no state crosses
  tokens; the depth mix is recomputed for every new token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from k3.config import K3Config
from k3.ops.segments import to_device


@dataclass
class KDAState:
    recurrent: Tensor  # [S, H, K, V]
    conv: list[Tensor]  # q, k, v conv states, each [S, C, W-1]


@dataclass
class MLAState:
    kv: Tensor  # [S, capacity, r + dr] latent rows; row t of slot s is valid for t < lengths[s]
    lengths: list[int]

    def rows(self, slot: int) -> Tensor:
        """The valid latent rows of ``slot``, [L, r + dr] (a view)."""
        return self.kv[slot, : self.lengths[slot]]

    def reserve(self, rows: int) -> None:
        """Make room for ``rows`` rows per slot (at least doubling when it grows; the tensor is replaced)."""
        if rows > self.kv.shape[1]:
            grown = self.kv.new_zeros(self.kv.shape[0], max(rows, 2 * self.kv.shape[1]), self.kv.shape[2])
            grown[:, : self.kv.shape[1]] = self.kv
            self.kv = grown

    def append(self, slot: int, rows: Tensor) -> None:
        """Write ``rows`` [n, r + dr] after the slot's last row, doubling the capacity when needed."""
        end = self.lengths[slot] + rows.shape[0]
        self.reserve(end)
        self.kv[slot, self.lengths[slot] : end] = rows.to(self.kv.dtype)
        self.lengths[slot] = end

    def append_many(self, slots: list[int], rows: Tensor, counts: list[int]) -> None:
        """Write ``rows`` [sum(counts), r + dr] after the slots' last rows (the first counts[0] to slots[0], and so
        on) in one indexed write: one copy per slot is host work a pass of many prompts repeats in every layer."""
        if len(slots) == 1:
            self.append(slots[0], rows)
            return
        starts = [self.lengths[s] for s in slots]
        self.reserve(max(a + n for a, n in zip(starts, counts)))
        slot, position = _row_index(slots, starts, counts, self.kv.device)
        self.kv[slot, position] = rows.to(self.kv.dtype)
        for s, n in zip(slots, counts):
            self.lengths[s] += n

    def gather(self, slots: list[int]) -> Tensor:
        """The valid rows of ``slots``, one after another: [sum of their lengths, r + dr] (one indexed read)."""
        if len(slots) == 1:
            return self.rows(slots[0])
        slot, position = _row_index(slots, [0] * len(slots), [self.lengths[s] for s in slots], self.kv.device)
        return self.kv[slot, position]

    def set(self, slot: int, rows: Tensor) -> None:
        self.lengths[slot] = 0
        self.append(slot, rows)


def _row_index(slots: list[int], starts: list[int], counts: list[int], device) -> tuple[Tensor, Tensor]:
    """(slot, position) device index tensors of the rows starts[i] .. starts[i] + counts[i] of slots[i], in order
    (made on the host, copied in one transfer without a sync)."""
    counts_t = torch.tensor(counts)
    slot = torch.repeat_interleave(torch.tensor(slots), counts_t)
    first = torch.cumsum(counts_t, 0) - counts_t  # where each slot's rows begin in the flat order
    position = torch.arange(int(counts_t.sum())) - torch.repeat_interleave(first - torch.tensor(starts), counts_t)
    both = to_device(torch.stack([slot, position]), device)
    return both[0], both[1]


class K3Cache:
    """Cache for ``batch_size`` sequences. A forward call names the sequences its segments extend (``seq_ids``;
    by default segment s extends sequence s and every sequence takes part)."""

    def __init__(
        self,
        config: K3Config,
        batch_size: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        state_dtype: torch.dtype = torch.float32,
        capacity: int = 256,
    ):
        self.config = config
        self.batch_size = batch_size
        self.seq_lens = [0] * batch_size
        self.layers: list[KDAState | MLAState] = []
        kda, mla = config.kda, config.mla
        w = kda.conv_kernel_size - 1
        for i in range(config.num_hidden_layers):
            if config.mixer(i) == "kda":
                self.layers.append(
                    KDAState(
                        recurrent=torch.zeros(
                            batch_size, kda.num_heads, kda.head_dim, kda.v_head_dim, dtype=state_dtype, device=device
                        ),
                        conv=[
                            torch.zeros(batch_size, kda.num_heads * d, w, dtype=dtype, device=device)
                            for d in (kda.head_dim, kda.head_dim, kda.v_head_dim)
                        ],
                    )
                )
            else:
                width = mla.kv_lora_rank + mla.qk_rope_head_dim
                self.layers.append(
                    MLAState(torch.zeros(batch_size, capacity, width, dtype=dtype, device=device), [0] * batch_size)
                )

    def distinct_slots(self, seq_ids: list[int]) -> bool:
        """Whether ``seq_ids`` name distinct sequences of this cache (each in [0, batch_size))."""
        return len(set(seq_ids)) == len(seq_ids) and all(0 <= i < self.batch_size for i in seq_ids)

    def advance(self, seq_ids: list[int], lengths: list[int]) -> None:
        """Record that sequence seq_ids[i] received lengths[i] more tokens (called by the model)."""
        for i, n in zip(seq_ids, lengths):
            self.seq_lens[i] += n

    @property
    def capacity(self) -> int:
        """Latent rows each slot can hold before the MLA tensors grow (unbounded without MLA layers)."""
        return min((layer.kv.shape[1] for layer in self.layers if isinstance(layer, MLAState)), default=1 << 62)

    def reserve(self, rows: int) -> None:
        """Make every MLA layer hold ``rows`` rows per slot (the tensors are replaced if they grow)."""
        for layer in self.layers:
            if isinstance(layer, MLAState):
                layer.reserve(rows)

    def advance_decode(self, seq_ids: list[int]) -> None:
        """Record one decoded token per sequence after ``K3ForCausalLM.decode_step`` (lengths on the host)."""
        for layer in self.layers:
            if isinstance(layer, MLAState):
                for i in seq_ids:
                    layer.lengths[i] += 1
        self.advance(seq_ids, [1] * len(seq_ids))

    def reset(self, slots: list[int]) -> None:
        """Empty sequences ``slots`` (zero KDA and conv state, no MLA latents) for new requests: one in-place fill
        per state tensor for all of them (a fill per slot and tensor is host work a batch of admissions repeats)."""
        if not slots:
            return
        kda = [layer for layer in self.layers if isinstance(layer, KDAState)]
        if kda:
            index = to_device(torch.tensor(slots, dtype=torch.int64), kda[0].recurrent.device)
            for layer in kda:
                for t in (layer.recurrent, *layer.conv):
                    t.index_fill_(0, index, 0)
        for slot in slots:
            self.release(slot)

    def release(self, slot: int) -> None:
        """Forget sequence ``slot``'s length (host bookkeeping only): its states are zeroed when the slot is
        :meth:`reset` for its next request, so freeing costs no device work."""
        for layer in self.layers:
            if isinstance(layer, MLAState):
                layer.lengths[slot] = 0
        self.seq_lens[slot] = 0

    def kda_snapshot(self, slot: int) -> list[tuple[Tensor, list[Tensor]]]:
        """Copies of every KDA layer's (recurrent state, conv states) of ``slot``."""
        return [
            (layer.recurrent[slot].clone(), [c[slot].clone() for c in layer.conv])
            for layer in self.layers
            if isinstance(layer, KDAState)
        ]

    def restore(self, slot: int, kda: list[tuple[Tensor, list[Tensor]]], latents: list[Tensor], length: int) -> None:
        """Set ``slot`` to a state of ``length`` tokens: KDA states from a snapshot, latent rows per MLA layer."""
        kda_layers = [layer for layer in self.layers if isinstance(layer, KDAState)]
        mla_layers = [layer for layer in self.layers if isinstance(layer, MLAState)]
        for layer, (rec, conv) in zip(kda_layers, kda, strict=True):
            layer.recurrent[slot].copy_(rec)
            for dst, src in zip(layer.conv, conv, strict=True):
                dst[slot].copy_(src)
        for layer, rows in zip(mla_layers, latents, strict=True):
            layer.set(slot, rows)
        self.seq_lens[slot] = length

    def nbytes(self, allocated: bool = False) -> int:
        """Bytes of state the sequences hold now (``allocated``: bytes reserved, MLA capacity included)."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, KDAState):
                total += layer.recurrent.numel() * layer.recurrent.element_size()
                total += sum(c.numel() * c.element_size() for c in layer.conv)
            else:
                rows = layer.kv.shape[0] * layer.kv.shape[1] if allocated else sum(layer.lengths)
                total += rows * layer.kv.shape[2] * layer.kv.element_size()
        return total


def cache_bytes_per_sequence(config: K3Config, context: int, state_bytes: int = 4, kv_bytes: int = 2) -> dict:
    """Bytes one sequence needs at ``context`` tokens: the same numbers ``K3Cache.nbytes`` holds.

    state_bytes: KDA recurrent-state element size (4 = fp32); kv_bytes: MLA latent and conv-state element size.
    """
    kda, mla = config.kda, config.mla
    n_kda = sum(1 for i in range(config.num_hidden_layers) if config.mixer(i) == "kda")
    n_mla = config.num_hidden_layers - n_kda
    kda_state = n_kda * kda.num_heads * kda.head_dim * kda.v_head_dim * state_bytes
    conv_state = n_kda * kda.num_heads * (2 * kda.head_dim + kda.v_head_dim) * (kda.conv_kernel_size - 1) * kv_bytes
    mla_cache = n_mla * context * (mla.kv_lora_rank + mla.qk_rope_head_dim) * kv_bytes
    return {
        "context": context,
        "kda_state_bytes": kda_state,
        "conv_state_bytes": conv_state,
        "mla_cache_bytes": mla_cache,
        "total_bytes": kda_state + conv_state + mla_cache,
    }
