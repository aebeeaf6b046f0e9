"""Kimi Delta Attention layer (docs/architecture.md#kda).

For each token x (width d), H heads of key width K and value width V:
  q, k, v = SiLU(causal depthwise conv_W(W_{q,k,v} x))            three short convs (one GEMM, one conv)
  q, k    = L2Norm(q), L2Norm(k) per head (eps 1e-6)               q is scaled by K^-1/2 inside the op
  beta    = sigmoid(W_b x)                                          one scalar per head
  g       = -exp(A_log) softplus(f + dt_bias)          (Kimi Linear)     with f = W_fb W_fa x
          = lb * sigmoid(exp(A_log) (f + dt_bias))      (K3, lb = -5)
  S_t     = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T q_t
  y       = W_o [ sigmoid(W_g x) * RMSNorm_head(o) ]      W_g full rank (K3) or g_b(g_a(x)) (Kimi Linear)

Weight names follow the K3 / Kimi-Linear checkpoints (q_proj, q_conv1d, f_a_proj, A_log, dt_bias, b_proj,
g_proj or g_a_proj/g_b_proj, o_norm, o_proj).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from k3.config import K3Config
from k3.model.cache import KDAState
from k3.model.norm import GatedRMSNorm
from k3.ops.conv import causal_conv1d, causal_conv1d_steps
from k3.ops.kda import chunk_kda_raw, kda_decode, kda_gate, l2norm, recurrent_kda
from k3.ops.linear import multi_linear
from k3.ops.segments import HostInts, Segments, as_segments, device_values
from k3.ops.dtypes import upcast


class KimiDeltaAttention(nn.Module):
    def __init__(self, config: K3Config):
        super().__init__()
        c = config.kda
        d = config.hidden_size
        self.num_heads, self.head_dim, self.v_head_dim = c.num_heads, c.head_dim, c.v_head_dim
        self.lower_bound = c.gate_lower_bound
        self.chunk_size = c.chunk_size
        self.l2norm_eps = c.l2norm_eps
        self.mode = "auto"  # "auto" | "chunk" | "recurrent"
        key_dim, value_dim = c.num_heads * c.head_dim, c.num_heads * c.v_head_dim
        self.q_proj = nn.Linear(d, key_dim, bias=False)
        self.k_proj = nn.Linear(d, key_dim, bias=False)
        self.v_proj = nn.Linear(d, value_dim, bias=False)
        self.q_conv1d = nn.Conv1d(key_dim, key_dim, c.conv_kernel_size, groups=key_dim, bias=False)
        self.k_conv1d = nn.Conv1d(key_dim, key_dim, c.conv_kernel_size, groups=key_dim, bias=False)
        self.v_conv1d = nn.Conv1d(value_dim, value_dim, c.conv_kernel_size, groups=value_dim, bias=False)
        self.f_a_proj = nn.Linear(d, c.forget_gate_rank, bias=False)
        self.f_b_proj = nn.Linear(c.forget_gate_rank, key_dim, bias=False)
        self.A_log = nn.Parameter(torch.zeros(c.num_heads))
        self.dt_bias = nn.Parameter(torch.zeros(key_dim))
        self.b_proj = nn.Linear(d, c.num_heads, bias=False)
        if c.full_rank_output_gate:
            self.g_proj = nn.Linear(d, value_dim, bias=False)
        else:
            self.g_a_proj = nn.Linear(d, c.output_gate_rank, bias=False)
            self.g_b_proj = nn.Linear(c.output_gate_rank, value_dim, bias=False)
        self.o_norm = GatedRMSNorm(c.v_head_dim, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(value_dim, d, bias=False)

    @torch.no_grad()
    def reset_gate_parameters(self) -> None:
        """A_log = log U(1, 16) (softplus gate) or 0 (K3 bounded gate); dt_bias = softplus^-1(U_log(1e-3, 0.1))."""
        if self.lower_bound is None:
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1.0, 16.0).log())
        else:
            self.A_log.zero_()
        dt = torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(0.1)).exp().clamp_min(1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def project(self, x: Tensor) -> Tensor:
        """x [N, d] -> the q, k, v projections before the short convs side by side, [N, 2*H*dk + H*dv]: one
        matrix product with the three weights stacked (the convs are depthwise, so they run as one conv over the
        stacked channels: :meth:`conv_weight`)."""
        return F.linear(x, torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]))

    def conv_weight(self) -> Tensor:
        """The three short convs' weights stacked in :meth:`project`'s channel order: [2*H*dk + H*dv, W]."""
        return torch.cat([self.q_conv1d.weight[:, 0], self.k_conv1d.weight[:, 0], self.v_conv1d.weight[:, 0]])

    def qkv_widths(self) -> list[int]:
        """The widths of q, k, v in :meth:`project`'s output (and the convs' channels), in that order."""
        return [self.q_conv1d.weight.shape[0], self.k_conv1d.weight.shape[0], self.v_conv1d.weight.shape[0]]

    def raw_inputs(self, x: Tensor, qkv: list[Tensor]) -> tuple[Tensor, ...]:
        """The convolved q, k, v ([N, C] each, views) and x [N, d] -> q, k (before their L2 norms), v [1, N, H, d*],
        the raw forget projection f [1, N, H, dk] and beta logits b [1, N, H]."""
        n, h, dk = x.shape[0], self.num_heads, self.head_dim
        q, k = (t.view(1, n, h, dk) for t in qkv[:2])
        f = self.f_b_proj(self.f_a_proj(x)).view(1, n, h, dk)
        return q, k, qkv[2].view(1, n, h, self.v_head_dim), f, self.b_proj(x).view(1, n, h)

    def recurrence_inputs(self, x: Tensor, qkv: list[Tensor]) -> tuple[Tensor, ...]:
        """As :meth:`raw_inputs`, with q, k L2-normed, the forget gate g [1, N, H, dk] (log space) in place of f
        and beta [1, N, H] (fp32) in place of b."""
        q, k, v, f, b = self.raw_inputs(x, qkv)
        g = kda_gate(f, self.A_log, self.dt_bias, self.lower_bound)
        beta = torch.sigmoid(upcast(b))
        return l2norm(q, self.l2norm_eps), l2norm(k, self.l2norm_eps), v, g, beta

    def forward(
        self,
        x: Tensor,
        cu_seqlens: Segments | Tensor,
        state: KDAState | None = None,
        seq_ids: HostInts | Tensor | None = None,
    ) -> Tensor:
        """x [N, d] packed tokens of S segments, cu_seqlens [S+1] (Segments or a tensor, k3.ops.segments) -> [N, d].

        With a cache ``state``, segment s continues cached sequence ``seq_ids[s]`` (its rows are updated).
        Segments of a context-parallel shard run the shard's form (``cu_seqlens.shard.kda``).
        """
        segments = as_segments(cu_seqlens, x.device)
        if segments.shard is not None:
            return segments.shard.kda(self, x, segments, state)
        n = x.shape[0]
        widths = self.qkv_widths()
        seq_ids = None if seq_ids is None else device_values(seq_ids)
        init = None if state is None else torch.cat([c[seq_ids] for c in state.conv], dim=1)
        y, conv_state = causal_conv1d(
            self.project(x).unsqueeze(0),
            self.conv_weight(),
            cu_seqlens=segments,
            initial_state=init,
            output_final_state=state is not None,
            activation="silu",
        )
        qkv = list(y[0].split(widths, dim=-1))  # q, k, v [N, C] each (column views)
        if state is not None:
            for c, s in zip(state.conv, conv_state.split(widths, dim=1)):
                c.index_copy_(0, seq_ids, s.to(c.dtype))

        mode = self.mode
        if mode == "auto":
            mode = "recurrent" if n == segments.count else "chunk"  # one new token per sequence: decode
        kwargs = dict(
            initial_state=None if state is None else state.recurrent[seq_ids],
            output_final_state=state is not None,
            cu_seqlens=segments,
        )
        if mode == "chunk":  # the norms, gate and sigmoid inside the op (fused into fla's kernels)
            o, final = chunk_kda_raw(
                *self.raw_inputs(x, qkv),
                A_log=self.A_log,
                dt_bias=self.dt_bias,
                lower_bound=self.lower_bound,
                l2norm_eps=self.l2norm_eps,
                chunk_size=self.chunk_size,
                **kwargs,
            )
        elif mode == "recurrent":
            o, final = recurrent_kda(*self.recurrence_inputs(x, qkv), **kwargs)
        else:
            raise ValueError(f"KDA mode={mode!r} must be 'auto', 'chunk' or 'recurrent'")
        if state is not None:
            state.recurrent.index_copy_(0, seq_ids, final.to(state.recurrent.dtype))  # in place: graphs keep it

        return self._output(x, o[0])

    def step(self, x: Tensor, state: KDAState, slots: Tensor) -> Tensor:
        """Decode: x [N, d], one new token for each cached sequence ``slots[i]`` -> [N, d]. Conv and recurrent
        states are updated in place and nothing is read back to the host (CUDA-graph safe). On a GPU: the six input
        maps, the three short convs and the rest of the core (gates, recurrence, gated norm) one Triton launch each
        where the kernel plan chose them (k3.ops.linear, k3.ops.conv, k3.ops.kda.kda_decode), then o_proj."""
        full_gate = hasattr(self, "g_proj")
        gate_in = self.g_proj if full_gate else self.g_a_proj
        # the six maps of x in one call (k3.ops.linear: one Triton launch where chosen, else six linears)
        *qkv, f_a, b, g = multi_linear(
            x, [p.weight for p in (self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.b_proj, gate_in)]
        )
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        q, k, v = causal_conv1d_steps(
            qkv, [conv.weight[:, 0] for conv in convs], states=state.conv, slots=slots, activation="silu"
        )  # one Triton launch where chosen
        y = kda_decode(
            q,
            k,
            v,
            f_a,
            b,
            g,
            f_b_weight=self.f_b_proj.weight,
            g_b_weight=None if full_gate else self.g_b_proj.weight,
            A_log=self.A_log,
            dt_bias=self.dt_bias,
            lower_bound=self.lower_bound,
            norm_weight=self.o_norm.weight,
            norm_eps=self.o_norm.eps,
            out_dtype=self.o_norm.out_dtype(v) or self.o_proj.weight.dtype,
            state=state.recurrent,
            slots=slots,
            l2norm_eps=self.l2norm_eps,
        )
        return multi_linear(y, [self.o_proj.weight])[0]  # o_proj, a GEMV: one Triton launch where chosen

    def _output(self, x: Tensor, o: Tensor) -> Tensor:
        """Gated per-head RMSNorm and o_proj: o [N, H, V] -> [N, d], the gate [N, H*V] a map of x."""
        n, h, dv = x.shape[0], self.num_heads, self.v_head_dim
        gate = self.g_proj(x) if hasattr(self, "g_proj") else self.g_b_proj(self.g_a_proj(x))
        o = self.o_norm(o, gate.view(n, h, dv)).reshape(n, h * dv)
        if not torch.is_autocast_enabled(o.device.type):  # under autocast o_proj casts (o in x's fp32: 2 more passes)
            o = o.to(self.o_proj.weight.dtype)
        return self.o_proj(o)
