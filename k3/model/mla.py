"""Gated multi-head latent attention, NoPE by default (docs/architecture.md#mla).

  q            = W_qb RMSNorm(W_qa x)   (or W_q x without q_lora)        -> per head [q_nope (dn), q_pe (dr)]
  c_kv, k_pe   = split(W_kva x);  c_kv = RMSNorm(c_kv)                     latent (r) + one shared k_pe (dr)
  k_nope, v    = split per head of W_kvb c_kv                              (dn) and (dv)
  o_h          = softmax([q_nope, q_pe] . [k_nope, k_pe] * (dn+dr)^-1/2, causal) v
  y            = W_o [ o * sigmoid(W_g x) ]                               gate only when mla.output_gate
The rope slice is never rotated unless ``mla.rope_theta`` is set (K2).

Two equal forms: ``naive`` expands k/v per head from the latents; ``absorbed`` folds W_kvb into the query
and the output, so attention runs over the cached latent rows [c_kv, k_pe] directly (one shared key/value
head of width r + dr / r). Decode uses the absorbed form by default; the cache only ever holds latent rows.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from k3.config import K3Config
from k3.model.cache import MLAState
from k3.model.norm import RMSNorm
from k3.model.rope import rotate_half_rope
from k3.ops.linear import multi_linear
from k3.ops.mla import attention, latent_attention
from k3.ops.segments import HostInts, Segments, as_segments, host_values
from k3.ops.dtypes import upcast


class MultiheadLatentAttention(nn.Module):
    def __init__(self, config: K3Config):
        super().__init__()
        c = config.mla
        d = config.hidden_size
        self.num_heads, self.dn, self.dr, self.dv, self.r = (
            c.num_heads,
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
            c.kv_lora_rank,
        )
        self.scale = c.qk_head_dim**-0.5
        self.rope_theta = c.rope_theta
        self.absorb: bool | None = None  # None: absorbed when every segment brings one token with a cache
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(d, c.num_heads * c.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, c.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, eps=c.norm_eps)
            self.q_b_proj = nn.Linear(c.q_lora_rank, c.num_heads * c.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, eps=c.norm_eps)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        if c.output_gate:
            self.g_proj = nn.Linear(d, c.num_heads * c.v_head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.v_head_dim, d, bias=False)

    def project(self, x: Tensor, maps: list[Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x [N, d] -> q_nope [N, H, dn], q_pe [N, H, dr] (before RoPE), c_kv [N, r] (normed), k_pe [N, dr].
        ``maps``: x's first two maps already made (q_proj or q_a_proj, kv_a_proj_with_mqa), else made here."""
        n, h = x.shape[0], self.num_heads
        q0, kv = maps if maps is not None else (self._first_q_map(x), self.kv_a_proj_with_mqa(x))
        q = q0 if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(q0))
        q_nope, q_pe = q.view(n, h, self.dn + self.dr).split([self.dn, self.dr], dim=-1)
        c_kv, k_pe = kv.split([self.r, self.dr], dim=-1)
        return q_nope, q_pe, self.kv_a_layernorm(c_kv), k_pe

    @property
    def _first_q_map(self) -> nn.Linear:
        """The query's map of x: q_proj, or q_a_proj where the query is low-rank."""
        return self.q_proj if hasattr(self, "q_proj") else self.q_a_proj

    def absorbed_query(self, q_nope: Tensor, q_pe: Tensor) -> Tensor:
        """q_nope [N, H, dn] folded through kv_b_proj's key half into the latent space, q_pe appended:
        [N, H, r + dr], a query against the cache rows [c_kv, k_pe] themselves."""
        w_k = self.kv_b_proj.weight.view(self.num_heads, self.dn + self.dv, self.r)[:, : self.dn]
        return torch.cat([torch.einsum("nhd,hdr->nhr", q_nope, w_k), q_pe], dim=-1)

    def absorbed_output(self, o_lat: Tensor) -> Tensor:
        """Latent attention output [N, H, r] through kv_b_proj's value half -> [N, H, dv]."""
        w_v = self.kv_b_proj.weight.view(self.num_heads, self.dn + self.dv, self.r)[:, self.dn :]
        return torch.einsum("nhr,hvr->nhv", o_lat, w_v)

    def attend(
        self, q_nope: Tensor, q_pe: Tensor, rows: Tensor, cu_seqlens_q: Segments, cu_seqlens_k: Segments, absorb: bool
    ) -> Tensor:
        """Attention of the queries over key rows [M, r + dr] (latent c_kv and rotated k_pe; segment s of the
        queries sees its key segment, queries last): absorbed (one shared latent head) or with keys and values
        expanded through kv_b_proj. -> o [N, H, dv]."""
        h = self.num_heads
        if absorb:
            keys = rows.unsqueeze(1)  # [M, 1, r + dr]
            o_lat = attention(
                self.absorbed_query(q_nope, q_pe),
                keys,
                keys[..., : self.r],
                scale=self.scale,
                cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k,
            )
            return self.absorbed_output(o_lat)
        c_all, pe_all = rows.split([self.r, self.dr], dim=-1)
        k_nope, v = self.kv_b_proj(c_all).view(-1, h, self.dn + self.dv).split([self.dn, self.dv], dim=-1)
        k = torch.cat([k_nope, pe_all.unsqueeze(1).expand(-1, h, -1)], dim=-1)
        return attention(
            torch.cat([q_nope, q_pe], dim=-1),
            k,
            v,
            scale=self.scale,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
        )

    def forward(
        self,
        x: Tensor,
        cu_seqlens: Segments | Tensor,
        state: MLAState | None = None,
        seq_ids: HostInts | Tensor | None = None,
        absorb: bool | None = None,
    ) -> Tensor:
        """x [N, d] packed tokens of S segments, cu_seqlens [S+1] (Segments or a tensor, k3.ops.segments) -> [N, d].

        With a cache ``state``, segment s continues cached sequence ``seq_ids[s]`` (its latents are appended).
        Segments of a context-parallel shard run the shard's form (``cu_seqlens.shard.mla``).
        """
        segments = as_segments(cu_seqlens, x.device)
        if segments.shard is not None:
            return segments.shard.mla(self, x, segments, state, absorb)
        return self.local_forward(x, segments, state, seq_ids, absorb)

    def local_forward(
        self,
        x: Tensor,
        segments: Segments,
        state: MLAState | None = None,
        seq_ids: HostInts | Tensor | None = None,
        absorb: bool | None = None,
    ) -> Tensor:
        """:meth:`forward` of segments whose documents all lie in ``x``."""
        n = x.shape[0]
        lengths = segments.lengths
        q_nope, q_pe, c_kv, k_pe = self.project(x)
        ids = [] if state is None else host_values(seq_ids)
        past = [0] * len(lengths) if state is None else [state.lengths[i] for i in ids]
        if self.rope_theta is not None:
            positions = torch.cat([torch.arange(p, p + length, device=x.device) for p, length in zip(past, lengths)])
            q_pe = rotate_half_rope(q_pe, positions, self.rope_theta)
            k_pe = rotate_half_rope(k_pe, positions, self.rope_theta)

        if absorb is None:
            absorb = self.absorb if self.absorb is not None else (state is not None and n == len(lengths))
        rows = torch.cat([c_kv, k_pe], dim=-1)  # [N, r + dr]: what the cache keeps per token
        if state is not None:
            state.append_many(list(ids), rows, list(lengths))
        if state is None:
            o = self.attend(q_nope, q_pe, rows, segments, segments, absorb)
        elif absorb:  # straight over the latent cache
            key_lens = HostInts.from_host([state.lengths[i] for i in ids], x.device)
            o_lat = latent_attention(
                self.absorbed_query(q_nope, q_pe),
                state.kv,
                seq_ids=seq_ids,
                lengths=key_lens,
                cu_seqlens_q=segments,
                scale=self.scale,
                v_dim=self.r,
                max_length=max(key_lens.host),
            )
            o = self.absorbed_output(o_lat)
        else:
            offsets = [0]
            for i in ids:
                offsets.append(offsets[-1] + state.lengths[i])
            cu_k = Segments.from_host(offsets, x.device, segments.offsets.dtype)
            o = self.attend(q_nope, q_pe, state.gather(list(ids)).to(x.dtype), segments, cu_k, False)
        return self._output(x, o)

    def step(self, x: Tensor, state: MLAState, slots: Tensor, positions: Tensor) -> Tensor:
        """Decode, absorbed: x [N, d], one new token for each cached sequence ``slots[i]`` whose row goes to
        ``positions[i]`` (its current length) -> [N, d]. The rows fit the cache's capacity (the caller reserves
        it); nothing is read back to the host (CUDA-graph safe). The caller advances the host lengths."""
        n = x.shape[0]
        gated = hasattr(self, "g_proj")
        # x's maps in one call (k3.ops.linear: one Triton launch where chosen, else one linear each)
        weights = [self._first_q_map.weight, self.kv_a_proj_with_mqa.weight] + ([self.g_proj.weight] if gated else [])
        maps = multi_linear(x, weights)
        q_nope, q_pe, c_kv, k_pe = self.project(x, maps[:2])
        if self.rope_theta is not None:
            q_pe = rotate_half_rope(q_pe, positions, self.rope_theta)
            k_pe = rotate_half_rope(k_pe, positions, self.rope_theta)
        state.kv[slots, positions] = torch.cat([c_kv, k_pe], dim=-1).to(state.kv.dtype)
        cu_q = Segments(torch.arange(n + 1, device=x.device), tuple(range(n + 1)))  # one query per sequence
        o_lat = latent_attention(
            self.absorbed_query(q_nope, q_pe),
            state.kv,
            seq_ids=slots,
            lengths=positions + 1,
            cu_seqlens_q=cu_q,
            scale=self.scale,
            v_dim=self.r,
            max_length=state.kv.shape[1],
        )
        return self._output(x, self.absorbed_output(o_lat), maps[2] if gated else None)

    def _output(self, x: Tensor, o: Tensor, gate: Tensor | None = None) -> Tensor:
        """Output gate (when configured) and o_proj: o [N, H, dv] -> [N, d]; ``gate`` the gate's logits
        g_proj(x) [N, H*dv] (default: made here)."""
        o = o.reshape(x.shape[0], self.num_heads * self.dv)
        if hasattr(self, "g_proj"):
            gate = self.g_proj(x) if gate is None else gate
            o = (upcast(o) * torch.sigmoid(upcast(gate))).to(x.dtype)
        return self.o_proj(o)
