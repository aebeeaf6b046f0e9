"""A placement plan: the parallel layout, each GPU's memory, each MoE layer's expert placement, and the predicted
decode and training steps with every term shown (k3.plan.cost)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from k3.config import K3Config
from k3.plan import cost
from k3.plan.cluster import Cluster, check_positive_ints
from k3.plan.placement import LayerPlacement, contiguous, min_slots, place

GIB = 2**30


@dataclass(frozen=True)
class Serving:
    """``concurrency`` sequences decode together over the whole cluster; ``contexts``: (length, fraction of the
    sequences) pairs; ``prefix_hit``: the fraction of prompt tokens the prefix cache serves (prefill only)."""

    concurrency: int = 1024
    contexts: tuple = ((32768, 1.0),)
    prefix_hit: float = 0.0

    def __post_init__(self) -> None:
        check_positive_ints(self, "concurrency")
        if not self.contexts or any(c < 1 or not f > 0 for c, f in self.contexts):
            raise ValueError(f"--context={self.contexts!r}: lengths >= 1 with positive fractions")
        if not 0 <= self.prefix_hit < 1:
            raise ValueError(f"--prefix-hit={self.prefix_hit!r} must be in [0, 1)")

    @property
    def mean_context(self) -> float:
        total = sum(f for _, f in self.contexts)
        return sum(c * f for c, f in self.contexts) / total


@dataclass(frozen=True)
class Training:
    """``global_tokens`` tokens per optimizer step in sequences of ``seq_len``; each GPU runs micro-batches of
    ``micro_tokens`` (gradient accumulation up to the global batch), with activation checkpointing or not."""

    global_tokens: int = 4 * 2**20
    seq_len: int = 4096
    micro_tokens: int = 4096
    checkpointing: bool = True

    def __post_init__(self) -> None:
        check_positive_ints(self, "global_tokens", "seq_len", "micro_tokens")


def _tp_choices(cluster: Cluster, heads: int) -> list[int]:
    """Tensor-parallel degrees for attention and the dense path: powers of two inside a node dividing the heads."""
    return [t for t in (1, 2, 4, 8, 16) if t <= cluster.per_node and cluster.per_node % t == 0 and heads % t == 0]


def serving_memory(
    shape: cost.ModelShape, cluster: Cluster, precision: str, work: Serving, tp: int, slots: int
) -> dict:
    """Bytes one GPU holds while serving: dense weights split over ``tp`` (bf16), ``slots`` expert replicas per MoE
    layer, its data-parallel group's caches (KDA states split by head over tp; MLA latents, one shared head, whole
    on every tp rank), the assumed workspace."""
    dp = cluster.gpus // tp
    seqs = math.ceil(work.concurrency / dp)
    dense = shape.dense_params * 2 / tp
    experts = shape.moe_layers * slots * shape.expert_bytes(precision)
    states = seqs * shape.kda_state_bytes / tp
    latents = seqs * shape.mla_bytes_per_token * work.mean_context
    workspace = cost.WORKSPACE_GIB * GIB
    total = dense + experts + states + latents + workspace
    return {
        "dense_weights": dense,
        "experts": experts,
        "kda_states": states,
        "mla_latents": latents,
        "workspace": workspace,
        "total": total,
        "hbm": cluster.hbm_bytes,
        "headroom": cluster.hbm_bytes - total,
        "fits": total <= cluster.hbm_bytes,
        "sequences_per_gpu_group": seqs,
    }


def _hits(p: LayerPlacement, shares: np.ndarray, top_k: int, tokens: int) -> np.ndarray:
    """Expected distinct replicas each GPU streams in a decode step of ``tokens`` tokens: [G]."""
    r = np.asarray(p.replicas, dtype=np.float64)
    q = np.clip(top_k * shares / r, 0.0, 1.0)  # one token's chance of choosing a given replica
    hit = 1.0 - (1.0 - q) ** tokens
    return np.array([hit[xs].sum() if xs else 0.0 for xs in p.gpu_experts])


def place_layers(shares: np.ndarray, cluster: Cluster, slots: int, replicate: bool) -> list[LayerPlacement]:
    return [place(f, cluster.gpus, cluster.per_node, slots, replicate) for f in shares]


def decode_step(
    shape: cost.ModelShape,
    cluster: Cluster,
    precision: str,
    work: Serving,
    tp: int,
    placements: list[LayerPlacement],
    shares: np.ndarray,
    memory: dict,
) -> dict:
    """Predicted seconds of one decode step (every sequence one token), per term; see k3.plan.cost."""
    bw = cluster.hbm_bytes_per_s
    t_tokens = work.concurrency
    group_tokens = math.ceil(t_tokens / (cluster.gpus // tp))
    dense = ((shape.dense_params - shape.embedding_params) * 2 / tp + group_tokens * shape.hidden * 2) / bw
    cache = (2 * memory["kda_states"] + memory["mla_latents"]) / bw  # states read and written, latents read
    hits = np.stack([_hits(p, f, shape.top_k, t_tokens) for p, f in zip(placements, shares)])  # [layers, G]
    eb = shape.expert_bytes(precision)
    experts_max = float(hits.max(1).sum()) * eb / bw
    experts_mean = float(hits.mean(1).sum()) * eb / bw
    # per GPU and unit of width, bf16 rows; the most-loaded GPU receives max / mean times the mean (the straggler)
    skew = float(np.mean([p.max_over_mean for p in placements]))
    row_bytes = t_tokens / cluster.gpus * shape.top_k * 2 * skew
    a2a = 2 * shape.moe_layers * cost.all_to_all_time(row_bytes * shape.expert_width, cluster)
    a2a_full = 2 * shape.moe_layers * cost.all_to_all_time(row_bytes * shape.hidden, cluster)
    a2a_even = 2 * shape.moe_layers * cost.all_to_all_time(row_bytes / skew * shape.expert_width, cluster)
    tp_comm = 2 * shape.layers * cost.all_reduce_time(group_tokens * shape.hidden * 2, tp, cluster)
    flops = 2 * shape.dense_active * group_tokens / tp / cluster.bf16_flops
    overhead = shape.layers * cost.LAYER_OVERHEAD_S
    total = max(dense + cache, flops) + experts_max + a2a + tp_comm + overhead
    return {
        "dense_weights_s": dense,
        "caches_s": cache,
        "dense_flops_s": flops,
        "experts_s": experts_max,
        "experts_mean_gpu_s": experts_mean,
        "straggler_s": experts_max - experts_mean + a2a - a2a_even,
        "straggler_all_to_all_s": a2a - a2a_even,  # the part of the straggler that rests on the all-to-all model
        "all_to_all_s": a2a,
        "all_to_all_full_width_s": a2a_full,
        "tensor_parallel_s": tp_comm,
        "layer_overhead_s": overhead,
        "step_s": total,
        "tokens_per_s": t_tokens / total,
    }


def expected_max_over_mean(p: LayerPlacement, slots_per_step: float) -> float:
    """E[max over GPUs] / mean of one step's token-slots per GPU when ``slots_per_step`` slots are routed with the
    placement's expected shares: each GPU's count ~ Poisson(mean_g), and the maximum of G such counts lies about
    sqrt(2 ln G) standard deviations above the largest mean (checked by simulation in k3.plan.report)."""
    mu = np.asarray(p.gpu_load) * slots_per_step
    g = len(mu)
    spread = math.sqrt(2 * math.log(g)) if g > 1 else 0.0
    return float((mu + spread * np.sqrt(mu)).max() / mu.mean()) if mu.mean() > 0 else 1.0


def _load_summary(before: list[LayerPlacement], after: list[LayerPlacement]) -> dict:
    b = [p.max_over_mean for p in before]
    a = [p.max_over_mean for p in after]
    return {
        "max_over_mean_before": {"mean": float(np.mean(b)), "worst": float(np.max(b))},
        "max_over_mean_after": {"mean": float(np.mean(a)), "worst": float(np.max(a))},
    }


def plan_serving(
    config: K3Config,
    cluster: Cluster,
    precision: str,
    work: Serving,
    shares: np.ndarray,
    tp: int | None = None,
    replicas: int | None = None,
    placements: bool = True,
) -> dict:
    """The fastest layout that fits (tensor-parallel degree ``tp`` and extra expert slots per GPU ``replicas``
    searched when None), or, when none fits, the one that comes closest with its shortfall."""
    shape = cost.model_shape(config)
    base = min_slots(shape.experts, cluster.gpus)
    tps = [tp] if tp else _tp_choices(cluster, config.mla.num_heads)
    extras = [replicas] if replicas is not None else [1, 0]
    candidates = []
    for t in tps:
        for extra in extras:
            mem = serving_memory(shape, cluster, precision, work, t, base + extra)
            candidates.append((t, extra, mem))
    fitting = [c for c in candidates if c[2]["fits"]]
    if not fitting:
        t, extra, mem = max(candidates, key=lambda c: c[2]["headroom"])
        return {
            "fits": False,
            "shortfall_gib": -mem["headroom"] / GIB,
            "layout": _layout(cluster, t, base, extra),
            "memory_gib": _gib(mem),
            "why": _why_not(shape, cluster, precision, mem, t),
        }
    best, placed = None, {}
    for t, extra, mem in fitting:
        if extra not in placed:  # the placement depends on the slots, not on the tensor-parallel degree
            placed[extra] = place_layers(shares, cluster, base + extra, replicate=extra > 0)
        after = placed[extra]
        step = decode_step(shape, cluster, precision, work, t, after, shares, mem)
        if best is None or step["step_s"] < best[3]["step_s"]:
            best = (t, extra, mem, step, after)
    t, extra, mem, step, after = best
    before = [contiguous(f, cluster.gpus) for f in shares]
    step_before = decode_step(shape, cluster, precision, work, t, before, shares, mem)
    out = {
        "fits": True,
        "layout": _layout(cluster, t, base, extra),
        "memory_gib": _gib(mem),
        "load": _load_summary(before, after),
        "decode": step,
        "decode_without_placement": step_before,
        "prefill_s_per_sequence": _prefill(shape, cluster, work, t),
    }
    if placements:
        out["placement"] = [
            {"moe_layer": i, "gpu_experts": p.gpu_experts, "replicas": p.replicas} for i, p in enumerate(after)
        ]
    return out


def _prefill(shape: cost.ModelShape, cluster: Cluster, work: Serving, tp: int) -> float:
    """Compute-bound prefill of one mean-length prompt on its tp group, the cached prefix skipped."""
    c = work.mean_context
    new = c * (1 - work.prefix_hit)
    flops = new * (2 * (shape.dense_active + shape.top_k * shape.expert_params) + cost.attention_flops(shape, c))
    return flops / (tp * cluster.bf16_flops)


def _layout(cluster: Cluster, tp: int, base: int, extra: int) -> dict:
    return {
        "gpus": cluster.gpus,
        "nodes": cluster.nodes,
        "expert_parallel": cluster.gpus,
        "tensor_parallel": tp,
        "data_parallel": cluster.gpus // tp,
        "expert_slots_per_gpu": base + extra,
        "replica_slots_per_gpu": extra,
    }


def _gib(mem: dict) -> dict:
    """A memory dict with its byte figures (the floats) in GiB."""
    return {k: v / GIB if isinstance(v, float) else v for k, v in mem.items()}


def _why_not(shape: cost.ModelShape, cluster: Cluster, precision: str, mem: dict, tp: int) -> str:
    weights = shape.dense_params * 2 + shape.moe_layers * shape.experts * shape.expert_bytes(precision)
    return (
        f"{shape.name} needs {weights / GIB:,.0f} GiB of weights ({precision} experts) plus caches and "
        f"workspace; {cluster.gpus} GPUs x {cluster.hbm_gib:g} GiB = {cluster.gpus * cluster.hbm_gib:,.0f} GiB. "
        f"The closest layout (tensor parallel {tp}) needs {mem['total'] / GIB:,.1f} GiB per GPU: "
        f"short by {-mem['headroom'] / GIB:,.1f} GiB per GPU."
    )


def plan_training(config: K3Config, cluster: Cluster, work: Training, shares: np.ndarray) -> dict:
    """FSDP over all GPUs for the dense path, experts split over all GPUs without replicas (each expert has one
    gradient), placed by load. With activation checkpointing the forward runs twice (4/3 of the FLOPs) and its
    all-to-alls too (six per MoE layer instead of four)."""
    shape = cost.model_shape(config)
    g = cluster.gpus
    tokens = work.global_tokens / g  # per GPU and optimizer step
    slots = min_slots(shape.experts, g)
    params = shape.dense_params + shape.moe_layers * shape.experts * shape.expert_params
    micro = min(work.micro_tokens, tokens)
    if work.checkpointing:  # each layer's fp32 input kept, one layer's activations live during its recomputation
        acts = micro * shape.hidden * (4 * shape.layers + cost.ACTIVATION_BYTES)
    else:
        acts = micro * shape.layers * shape.hidden * cost.ACTIVATION_BYTES
    mem = {
        "weights_grads_optimizer": params * cost.STATE_BYTES_PER_PARAM["muon"] / g,
        "activations": acts,
        "workspace": cost.WORKSPACE_GIB * GIB,
    }
    mem["total"] = sum(mem.values())
    mem["hbm"] = cluster.hbm_bytes
    mem["headroom"] = cluster.hbm_bytes - mem["total"]
    mem["fits"] = mem["total"] <= cluster.hbm_bytes
    after = place_layers(shares, cluster, slots, replicate=False)
    before = [contiguous(f, g) for f in shares]
    imbalance = float(np.mean([expected_max_over_mean(p, work.global_tokens * shape.top_k) for p in after]))
    recompute, passes = (4 / 3, 6) if work.checkpointing else (1.0, 4)
    attn = 3 * cost.attention_flops(shape, work.seq_len / 2) * tokens  # forward + backward, mean position
    t_dense = recompute * (6 * shape.dense_active * tokens + attn) / cluster.bf16_flops
    rows = tokens * shape.top_k  # token-slots through this GPU's experts in a balanced step
    t_experts = recompute * 6 * shape.expert_params * rows * shape.moe_layers / cost.grouped_gemm_rate(rows / slots)
    t_straggler = t_experts * (imbalance - 1)
    a2a = passes * shape.moe_layers * cost.all_to_all_time(rows * 2 * shape.expert_width, cluster)
    link = cluster.inter_bytes_per_s if cluster.nodes > 1 else cluster.intra_bytes_per_s
    fsdp = 3 * shape.dense_params * 2 * (g - 1) / g / link  # all-gather twice, reduce-scatter once, bf16
    ns = shape.muon_ns_flops / g / cluster.bf16_flops
    total = t_dense + t_experts + t_straggler + a2a + fsdp + ns
    flops_model = 6 * (shape.dense_active + shape.top_k * shape.expert_params) * tokens + attn
    return {
        "fits": mem["fits"],
        "memory_gib": _gib(mem),
        "layout": {
            "gpus": g,
            "fsdp": g,
            "expert_parallel": g,
            "expert_slots_per_gpu": slots,
            "micro_batch_tokens": micro,
            "activation_checkpointing": work.checkpointing,
        },
        "load": {**_load_summary(before, after), "per_step_max_over_mean": imbalance},
        "step": {
            "dense_flops_s": t_dense,
            "expert_flops_s": t_experts,
            "straggler_s": t_straggler,
            "straggler_all_to_all_s": 0.0,  # the imbalance scales the expert GEMMs only
            "all_to_all_s": a2a,
            "fsdp_s": fsdp,
            "newton_schulz_s": ns,
            "step_s": total,
            "tokens_per_s": work.global_tokens / total,
            "mfu": flops_model / total / cluster.bf16_flops,
        },
    }


# The all-to-all term (k3.plan.cost.all_to_all_time: bytes over the fabric's rate plus one latency) is not
# calibrated: the one all-to-all we measured (2 H200s, expert parallel 2, benchmarks/results/multi_gpu.json) took 70x
# its prediction, and one point on 2 GPUs cannot say how it scales to a cluster. Plans print it marked so, and the
# straggler shares (k3.plan.runs) are taken over the step without it.
ALL_TO_ALL_CALIBRATED = False


def without_all_to_all(step: dict) -> tuple[float, float]:
    """(straggler seconds, step seconds) of a decode or training step with the all-to-all term left out."""
    return step["straggler_s"] - step["straggler_all_to_all_s"], step["step_s"] - step["all_to_all_s"]


def summary(plan: dict) -> dict:
    """The plan without its per-layer placement lists (what a table or a log line needs)."""
    return {k: v for k, v in plan.items() if k != "placement"}
