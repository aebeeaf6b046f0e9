"""Per-sequence inference cache of the hybrid model, and its memory accounting.

What each layer keeps per sequence:
- KDA layer: the recurrent state S [H, K, V] (fp32 by default) and three conv states [C, W-1] (the last
  W-1 projected q, k, v inputs): constant in context length.
- MLA layer: the latent c_kv [L, kv_lora_rank] (after kv_a_layernorm) and the shared k_pe [L, rope] for
  every token seen: linear in context length (the absorbed decode never expands them per head).
- Attention Residuals: nothing. Its sources are the same token's own sub-layer outputs, so no state crosses
  tokens; the depth mix is recomputed for every new token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from k3.config import K3Config


@dataclass
class KDAState:
    recurrent: Tensor  # [S, H, K, V]
    conv: list[Tensor]  # q, k, v conv states, each [S, C, W-1]


@dataclass
class MLAState:
    c_kv: list[Tensor]  # per sequence [L_s, kv_lora_rank]
    k_pe: list[Tensor]  # per sequence [L_s, qk_rope_head_dim]


class K3Cache:
    """Cache for ``batch_size`` sequences. A forward call names the sequences its segments extend (``seq_ids``;
    by default segment s extends sequence s and every sequence takes part)."""

    def __init__(self, config: K3Config, batch_size: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, state_dtype: torch.dtype = torch.float32):
        self.config = config
        self.batch_size = batch_size
        self.seq_lens = [0] * batch_size
        self.layers: list[KDAState | MLAState] = []
        kda, mla = config.kda, config.mla
        w = kda.conv_kernel_size - 1
        for i in range(config.num_hidden_layers):
            if config.mixer(i) == "kda":
                self.layers.append(KDAState(
                    recurrent=torch.zeros(batch_size, kda.num_heads, kda.head_dim, kda.v_head_dim, dtype=state_dtype,
                                          device=device),
                    conv=[torch.zeros(batch_size, kda.num_heads * d, w, dtype=dtype, device=device)
                          for d in (kda.head_dim, kda.head_dim, kda.v_head_dim)]))
            else:
                self.layers.append(MLAState(
                    c_kv=[torch.zeros(0, mla.kv_lora_rank, dtype=dtype, device=device) for _ in range(batch_size)],
                    k_pe=[torch.zeros(0, mla.qk_rope_head_dim, dtype=dtype, device=device) for _ in range(batch_size)]))

    def advance(self, seq_ids: list[int], lengths: list[int]) -> None:
        """Record that sequence seq_ids[i] received lengths[i] more tokens (called by the model)."""
        for i, n in zip(seq_ids, lengths):
            self.seq_lens[i] += n

    def nbytes(self) -> int:
        """Bytes held right now by all layers of all sequences."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, KDAState):
                total += layer.recurrent.numel() * layer.recurrent.element_size()
                total += sum(c.numel() * c.element_size() for c in layer.conv)
            else:
                total += sum(t.numel() * t.element_size() for t in layer.c_kv + layer.k_pe)
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
    return {"context": context, "kda_state_bytes": kda_state, "conv_state_bytes": conv_state,
            "mla_cache_bytes": mla_cache, "total_bytes": kda_state + conv_state + mla_cache}
