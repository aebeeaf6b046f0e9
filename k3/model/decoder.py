"""The K3 decoder: embedding -> layers (KDA or MLA mixer, dense FFN or MoE) with Attention Residuals -> norm -> lm_head.

One decoder layer:   h = AttnRes_in(layer, 'attn');  out = mixer(input_layernorm(h));  record(out)
                     h = AttnRes_in(layer, 'mlp');   out = ffn(post_attention_layernorm(h));  record(out)
With ``attn_res.mode == 'none'`` this is the usual pre-norm residual block (Kimi Linear, K2). The residual
stream applies each pre-norm (and the final norm) itself, fused with the depth mix that precedes it.

Inputs are packed: ``input_ids`` [B, T] is flattened to B*T tokens and ``cu_seqlens`` (FlashAttention
convention, over the flattened tokens) marks sequence boundaries; without it every row is one sequence. The
forward turns it into one :class:`k3.ops.segments.Segments` (reading it on the host at most once) and hands that
object to every layer.
KDA state, conv state and attention never cross a boundary. With a ``cache`` of S sequences, segment s of
the call extends sequence s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from k3.config import K3Config
from k3.model.activation import GatedFFN, make_glu
from k3.model.attn_res import ResidualStream, make_mix_params
from k3.model.cache import K3Cache
from k3.model.kda import KimiDeltaAttention
from k3.model.mla import MultiheadLatentAttention
from k3.model.moe import MoE, RoutedExperts, Router
from k3.model.norm import RMSNorm
from k3.model.router_stats import RouterStats
from k3.ops.segments import HostInts, Segments, as_segments, host_values, to_device

# Parameters and buffers that stay fp32 whatever dtype the rest of the model is cast to.
FP32_NAMES = ("e_score_correction_bias", "gate.weight", "A_log", "dt_bias")


@dataclass
class K3Output:
    logits: Tensor  # [B, T, V]
    router_stats: list[RouterStats] = field(default_factory=list)  # one per MoE layer
    cache: K3Cache | None = None
    attn_res_weights: list | None = None  # (layer, sub-layer, mean depth weights [S]) when recorded


class DecoderLayer(nn.Module):
    def __init__(self, config: K3Config, layer_idx: int):
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.layer_idx = layer_idx
        self.mixer = config.mixer(layer_idx)
        self.self_attn = KimiDeltaAttention(config) if self.mixer == "kda" else MultiheadLatentAttention(config)
        self.input_layernorm = RMSNorm(d, eps=eps)
        # a MoE's input also feeds its fp32 router (docs/precision.md), and a plain MoE (no latent projection)
        # returns its routed sum in its input's dtype: under autocast its pre-norm keeps the stream's dtype
        self.post_attention_layernorm = RMSNorm(d, eps=eps, cast=config.ffn(layer_idx) == "dense")
        if config.ffn(layer_idx) == "dense":
            glu = make_glu(config.hidden_act, config.situ_beta, config.situ_linear_beta)
            self.mlp = GatedFFN(d, config.intermediate_size, glu)
        else:
            self.block_sparse_moe = MoE(config, layer_idx)
        if config.attn_res.mode != "none":
            make_mix_params(self, "self_attention_res", d, eps)
            make_mix_params(self, "mlp_res", d, eps)

    def forward(
        self,
        stream: ResidualStream,
        cu_seqlens: Segments | None,
        state=None,
        seq_ids=None,
        positions: Tensor | None = None,
    ) -> RouterStats | None:
        """With ``positions`` (decode: one token per sequence, cu_seqlens unused) the mixer runs its step form."""
        x = stream.input(self.layer_idx, "attn", self.input_layernorm)
        if positions is None:
            stream.add(self.self_attn(x, cu_seqlens, state, seq_ids))
        elif self.mixer == "kda":
            stream.add(self.self_attn.step(x, state, seq_ids))
        else:
            stream.add(self.self_attn.step(x, state, seq_ids, positions))
        h = stream.input(self.layer_idx, "mlp", self.post_attention_layernorm)
        if hasattr(self, "mlp"):
            stream.add(self.mlp(h))
            return None
        out, stats = self.block_sparse_moe(h)
        stream.add(out)
        return stats


class K3Model(nn.Module):
    def __init__(self, config: K3Config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.attn_res.mode != "none":
            make_mix_params(self, "output_attn_res", config.hidden_size, config.rms_norm_eps)

    def mixers(self) -> list[tuple[RMSNorm, nn.Linear]] | None:
        """The AttnRes (key norm, pseudo-query) of every mix: attn and mlp of each layer, then the output mix."""
        if self.config.attn_res.mode == "none":
            return None
        pairs = [
            (getattr(layer, f"{sub}_res_norm"), getattr(layer, f"{sub}_res_proj"))
            for layer in self.layers
            for sub in ("self_attention", "mlp")
        ]
        return pairs + [(self.output_attn_res_norm, self.output_attn_res_proj)]

    def forward(
        self,
        tokens: Tensor,
        cu_seqlens: Segments | None,
        cache: K3Cache | None = None,
        seq_ids: HostInts | Tensor | None = None,
        record_attn_res: bool = False,
        positions: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
    ) -> tuple[Tensor, list, list | None]:
        """tokens [N] packed, cu_seqlens [S+1] -> (hidden [N, d] after the final norm, router stats, AttnRes records).
        Decode step: ``positions`` [N] given, one token per cached sequence ``seq_ids`` (see decode_step).
        ``inputs_embeds`` [N, d]: the token embeddings to use (images spliced in), instead of embedding ``tokens``."""
        x = self.embed_tokens(tokens) if inputs_embeds is None else inputs_embeds
        stream = ResidualStream(
            self.config.attn_res.mode, self.config.attn_res.block_size, x, self.mixers(), record=record_attn_res
        )
        stats = []
        for i, layer in enumerate(self.layers):
            s = layer(stream, cu_seqlens, None if cache is None else cache.layers[i], seq_ids, positions)
            if s is not None:
                stats.append(s)
        return stream.output(self.norm), stats, stream.records


def check_cu_seqlens(cu_seqlens: Segments, batch: int, seqlen: int) -> None:
    """Raise one ValueError if cu_seqlens is not a valid packing of a [batch, seqlen] input."""
    if cu_seqlens.offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.offsets.dtype}")
    bounds = set(cu_seqlens.host) if cu_seqlens.check(batch * seqlen) else set()
    missing = sorted(set(range(seqlen, batch * seqlen, seqlen)) - bounds)
    if missing:
        raise ValueError(f"cu_seqlens must contain every row boundary of the [B, T] input; missing {missing}")


class K3ForCausalLM(nn.Module):
    """The text model. ``model(input_ids [B, T], cu_seqlens=None, cache=None, seq_ids=None) -> K3Output``."""

    def __init__(self, config: K3Config):
        super().__init__()
        self.config = config
        self.model = K3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, initializer_range) for matrices and experts; ones for norms; zeros for AttnRes queries."""
        std = self.config.initializer_range
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)) and not name.endswith("_res_proj"):
                nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, (RoutedExperts, Router)):
                for p in module.parameters(recurse=False):
                    nn.init.normal_(p, 0.0, std)
            elif isinstance(module, nn.Conv1d):
                nn.init.normal_(module.weight, 0.0, 1.0 / math.sqrt(module.weight.shape[-1]))
            elif isinstance(module, KimiDeltaAttention):
                module.reset_gate_parameters()

    def cast(self, dtype: torch.dtype) -> "K3ForCausalLM":
        """Cast to ``dtype`` but keep the router, its bias, A_log and dt_bias in fp32."""
        for name, t in list(self.named_parameters()) + list(self.named_buffers()):
            if t.is_floating_point():
                t.data = t.data.to(torch.float32 if name.endswith(FP32_NAMES) else dtype)
        return self

    def forward(
        self,
        input_ids: Tensor,
        cu_seqlens: Segments | Tensor | None = None,
        cache: K3Cache | None = None,
        seq_ids: list[int] | Tensor | HostInts | None = None,
        record_attn_res: bool = False,
        last_only: bool = False,
        image_features: Tensor | None = None,
    ) -> K3Output:
        """Logits for every input token.

        input_ids [B, T]; cu_seqlens [S+1] over the B*T flattened tokens (default: each row is a sequence), a
        :class:`k3.ops.segments.Segments` or an int tensor (on the CPU: read without a sync; on a device: read once);
        cache: a :class:`K3Cache`; seq_ids: which S cached sequences the segments extend (default 0..S-1, and
        then the cache must hold exactly S sequences); record_attn_res: also return the AttnRes depth weights;
        last_only: logits only at the last token of each of the S sequences ([S, V], what decoding needs);
        image_features [M, d]: embeddings that replace, in order, the M media placeholder tokens
        (``config.vision.media_placeholder_token_id``) of input_ids (see k3.model.multimodal).
        Returns logits [B, T, V] (or [S, V]) and per-MoE-layer router stats.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        b, t = input_ids.shape
        if cu_seqlens is None:
            offsets = torch.arange(0, b * t + 1, t, device=input_ids.device, dtype=torch.int64)
            segments = Segments(offsets, tuple(range(0, b * t + 1, t)))
        else:  # one host read of the offsets (none if they come on the CPU or as Segments); the layers share it
            segments = as_segments(cu_seqlens, input_ids.device)
            check_cu_seqlens(segments, b, t)
        if cache is not None:
            seq_ids = self._check_seq_ids(cache, segments.count, seq_ids, input_ids.device)
        elif seq_ids is not None:
            raise ValueError("seq_ids needs a cache")
        embeds = None if image_features is None else self.splice_images(input_ids.reshape(-1), image_features)
        hidden, stats, records = self.model(
            input_ids.reshape(-1), segments, cache, seq_ids, record_attn_res, inputs_embeds=embeds
        )
        if cache is not None:
            cache.advance(list(seq_ids.host), list(segments.lengths))
        logits = self.lm_head(hidden[segments.offsets[1:] - 1]) if last_only else self.lm_head(hidden).view(b, t, -1)
        return K3Output(logits=logits, router_stats=stats, cache=cache, attn_res_weights=records)

    def decode_step(self, input_ids: Tensor, cache: K3Cache, slots: Tensor, positions: Tensor) -> Tensor:
        """One new token for each of N cached sequences, with nothing read back to the host: the body of a
        CUDA-graph decode (k3.infer.graphs). input_ids, slots (distinct cache slots), positions (each slot's
        current length) [N] on the model's device -> logits [N, V]. KDA and conv states are updated in place and
        MLA rows written at ``positions``; the caller reserves MLA capacity first and calls
        ``cache.advance_decode`` after. :meth:`decode` does both."""
        hidden, _, _ = self.model(input_ids, None, cache, slots, positions=positions)
        return self.lm_head(hidden)

    def decode(self, input_ids: Tensor, cache: K3Cache, seq_ids: list[int]) -> Tensor:
        """Eager decode step: input_ids [N] extend cached sequences ``seq_ids`` (distinct) -> logits [N, V].
        Equal to ``forward(..., last_only=True)`` with one token per sequence."""
        ids = [int(i) for i in seq_ids]
        if input_ids.shape != (len(ids),) or not cache.distinct_slots(ids):
            raise ValueError(
                f"decode needs input_ids [N] and N distinct seq_ids in [0, {cache.batch_size}); got "
                f"shape {tuple(input_ids.shape)} and seq_ids={ids}"
            )
        cache.reserve(max(cache.seq_lens[i] for i in ids) + 1)
        device = input_ids.device
        slots = to_device(torch.tensor(ids, dtype=torch.int64), device)
        positions = to_device(torch.tensor([cache.seq_lens[i] for i in ids], dtype=torch.int64), device)
        logits = self.decode_step(input_ids, cache, slots, positions)
        cache.advance_decode(ids)
        return logits

    def splice_images(self, tokens: Tensor, image_features: Tensor) -> Tensor:
        """Token embeddings [N, d] with the M placeholder positions of tokens [N] replaced by image_features [M, d]
        in order; one ValueError when the counts differ."""
        if self.config.vision is None:
            raise ValueError("image_features given but the config has no vision section")
        mask = tokens == self.config.vision.media_placeholder_token_id
        found = int(mask.sum())
        if image_features.dim() != 2 or image_features.shape != (found, self.config.hidden_size):
            raise ValueError(
                f"the input has {found} media placeholder tokens but image_features has shape "
                f"{tuple(image_features.shape)} (expected [{found}, {self.config.hidden_size}])"
            )
        x = self.model.embed_tokens(tokens)
        return x.masked_scatter(mask.unsqueeze(-1), image_features.to(x.dtype))

    @staticmethod
    def _check_seq_ids(cache: K3Cache, segments: int, seq_ids, device) -> HostInts:
        """The cache slots the segments extend, on ``device`` and on the host (read once here)."""
        if seq_ids is None:
            if cache.batch_size != segments:
                raise ValueError(
                    f"the input has {segments} sequences but the cache holds {cache.batch_size}; "
                    "pass seq_ids to extend a subset"
                )
            return HostInts(torch.arange(segments, device=device), tuple(range(segments)))
        listed = list(host_values(seq_ids)) if isinstance(seq_ids, (Tensor, HostInts)) else [int(i) for i in seq_ids]
        if len(listed) != segments or not cache.distinct_slots(listed):
            raise ValueError(
                f"seq_ids={listed} must name {segments} distinct cached sequences in [0, {cache.batch_size})"
            )
        return HostInts.from_host(listed, device)

    def new_cache(
        self,
        batch_size: int,
        state_dtype: torch.dtype = torch.float32,
        dtype: torch.dtype | None = None,
        capacity: int = 256,
    ) -> K3Cache:
        """An empty cache for ``batch_size`` sequences; latents and conv states in ``dtype`` (default: the
        model's), KDA states in ``state_dtype``."""
        p = self.lm_head.weight
        return K3Cache(
            self.config, batch_size, device=p.device, dtype=dtype or p.dtype, state_dtype=state_dtype, capacity=capacity
        )
