"""The planner's model of one GPU: HBM it needs, and the time of a decode step and a training step, term by term.

Decode step (per GPU, summed over layers): every layer streams the GPU's share of the dense weights and its
sequences' caches; every MoE layer streams the distinct expert replicas its tokens hit on the slowest GPU
(E[hit] = 1 - (1 - k f_j / r_j)^T for a replica of expert j with share f_j, r_j replicas, T tokens in the step),
then sends each token's k rows to the experts' GPUs and back (the latent width l when the MoE is latent: the
all-to-all carries z, not x); with tensor parallel attention, two all-reduces of the layer's activations. Each
layer also pays a fixed cost for its chain of kernel launches, measured on one H200. Bytes move at the measured
HBM bandwidth, FLOPs at the measured bf16 rate.

Training step (per GPU): matrix FLOPs (6 per parameter and token, the activated parameters) plus attention,
dense GEMMs at the measured bf16 rate and expert GEMMs at the grouped-GEMM rate measured at their tokens per
expert; four all-to-alls per MoE layer (dispatch and combine, forward and backward); FSDP's all-gathers and
reduce-scatter of the dense weights over the data-parallel GPUs; Newton-Schulz for every Muon matrix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from k3.config import K3Config
from k3.ops.mx import MXFP4_BYTES_PER_WEIGHT
from k3.plan.cluster import Cluster

EXPERT_BYTES_PER_PARAM = {"bf16": 2.0, "mxfp4": MXFP4_BYTES_PER_WEIGHT}

# Measured on one H200 (benchmarks/results); each figure says where it comes from.
LAYER_OVERHEAD_S = 41.5e-6  # per layer and decode step: the fixed part of decode-targets.json's B=1 / 4K row
# (0.630 ms measured, 0.131 ms of bytes at the copy bandwidth, over its 12 layers)
# bf16 grouped GEMM FLOP/s at tokens per expert (docs/architecture.md#latentmoe, H200)
GROUPED_GEMM = ((128, 203e12), (1024, 535e12))
ACTIVATION_BYTES = 126.0  # training activations per token, layer and unit of width: small-1b's 58.3 GiB peak at
# 8 x 4096 (model-train-precision.json) less 12 bytes per parameter of state, without activation checkpointing
WORKSPACE_GIB = 6.0  # assumed: CUDA context, allocator slack, CUDA graphs, a prefill chunk's activations
STATE_BYTES_PER_PARAM = {"adamw": 16, "muon": 12}  # fp32 weight + gradient + optimizer state (2 or 1 moments)


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a config, counted from its module tree (k3.model.accounting)."""

    name: str
    layers: int
    moe_layers: int
    hidden: int
    experts: int
    top_k: int
    expert_width: int  # the routed experts' input / output width: latent l, or d
    expert_params: int  # one routed expert's parameters (3 matrices)
    dense_params: int  # every parameter but the routed experts (and the vision tower)
    embedding_params: int  # the input embedding: held, but a decode step reads only its tokens' rows
    dense_active: float  # matmul parameters one token uses outside the routed experts
    kda_state_bytes: int  # one sequence's KDA states and conv states (fp32 / bf16), all layers
    mla_bytes_per_token: int  # one cached token's MLA latents (bf16), all layers
    attn_flops_per_token: tuple  # (context, forward FLOPs beyond the matmuls) samples
    muon_ns_flops: float  # one Newton-Schulz pass over every Muon matrix (5 iterations)

    def expert_bytes(self, precision: str) -> float:
        if precision not in EXPERT_BYTES_PER_PARAM:
            raise ValueError(f"--precision={precision!r} must be one of {', '.join(EXPERT_BYTES_PER_PARAM)}")
        return self.expert_params * EXPERT_BYTES_PER_PARAM[precision]


_SHAPES: dict[str, ModelShape] = {}


def model_shape(config: K3Config) -> ModelShape:
    """The :class:`ModelShape` of ``config`` (built once per distinct config: a meta model of K3 takes a second)."""
    key = repr(config)
    if key not in _SHAPES:
        _SHAPES[key] = _shape(config)
    return _SHAPES[key]


def _shape(config: K3Config) -> ModelShape:
    from k3.model.accounting import activated_counts, attention_flops_per_token, build_meta, parameter_counts
    from k3.model.cache import cache_bytes_per_sequence

    model = build_meta(config)
    counts = parameter_counts(model)
    active = activated_counts(config, counts)
    moe = config.moe
    n_moe = len(config.moe_layers)
    width = moe.latent_size or config.hidden_size
    expert_params = 3 * moe.moe_intermediate_size * width
    dense = sum(counts.values()) - counts["routed_experts"] - counts["vision"]
    dense_active = (
        sum(active.values())
        - active["routed_experts"]
        - active["embedding"]
        - active["norms"]
        - active["attn_res"]
        - active["vision"]
    )
    cache = cache_bytes_per_sequence(config, 1)
    ns = 0.0
    for name, p in model.named_parameters():
        if p.dim() < 2 or "embed" in name or name.startswith("lm_head") or "conv1d" in name:
            continue
        a, b = sorted(p.shape[-2:])
        ns += (p.numel() // (a * b)) * 5 * (4 * a * a * b + 2 * a**3)
    attn = tuple((c, sum(attention_flops_per_token(config, c).values())) for c in (1024, 4096, 32768, 131072))
    return ModelShape(
        config.name,
        config.num_hidden_layers,
        n_moe,
        config.hidden_size,
        moe.num_experts,
        moe.num_experts_per_token,
        width,
        expert_params,
        dense,
        counts["embedding"],
        dense_active,
        cache["kda_state_bytes"] + cache["conv_state_bytes"],
        cache["mla_cache_bytes"],
        attn,
        ns,
    )


def attention_flops(shape: ModelShape, context: int) -> float:
    """Forward FLOPs per token beyond the matmuls at ``context`` (linear in context: MLA attention + KDA state)."""
    (c0, f0), (c1, f1) = shape.attn_flops_per_token[0], shape.attn_flops_per_token[-1]
    return f0 + (f1 - f0) * (context - c0) / (c1 - c0)


def grouped_gemm_rate(tokens_per_expert: float) -> float:
    """Measured grouped-GEMM rate, log-linear in tokens per expert between the two measured points, flat outside."""
    (t0, r0), (t1, r1) = GROUPED_GEMM
    x = min(max(tokens_per_expert, t0), t1)
    return r0 + (r1 - r0) * math.log(x / t0) / math.log(t1 / t0)


def all_to_all_time(bytes_per_gpu: float, cluster: Cluster) -> float:
    """One all-to-all where each GPU sends ``bytes_per_gpu`` spread evenly over all GPUs: the intra-node and
    inter-node parts at their bandwidths, in parallel, plus one latency (the slower fabric's)."""
    g, n = cluster.gpus, cluster.per_node
    if g == 1:
        return 0.0
    intra = bytes_per_gpu * (n - 1) / g / cluster.intra_bytes_per_s
    inter = bytes_per_gpu * (g - n) / g / cluster.inter_bytes_per_s
    return max(intra, inter) + (cluster.inter_latency_s if g > n else cluster.intra_latency_s)


def all_reduce_time(nbytes: float, ranks: int, cluster: Cluster) -> float:
    """Ring all-reduce of ``nbytes`` over ``ranks`` GPUs of one node."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / cluster.intra_bytes_per_s + cluster.intra_latency_s
