"""Parameter, FLOP and byte accounting of a config, as ``k3 info`` and the audit print it (the counting from the
module tree itself: k3.model.accounting, which the placement planner uses too).

Conventions: a multiply-add is 2 FLOPs; "activated" parameters are those a single token touches (all
dense paths plus top-k of the routed experts), the input embedding excluded unless stated; per-token
FLOPs are forward FLOPs of the matmuls plus attention / KDA-state work at a given context (attention
averaged over the positions of a sequence of that length; KDA in its recurrent form, 7 K V per head).
"""

from __future__ import annotations

from torch import nn

from k3.config import K3Config
from k3.model.accounting import activated_counts, attention_flops_per_token, build_meta, parameter_counts
from k3.model.cache import cache_bytes_per_sequence


def flops_per_token(config: K3Config, context: int = 4096, form: str = "forward", counts: dict | None = None) -> dict:
    """Forward FLOPs per token: the one count ``k3 info``, the audit and the benchmarks' MFU use. 2 per activated
    matmul weight (the input embedding's lookup and the norms excluded), the AttnRes depth mixes, and
    :func:`attention_flops_per_token` in ``form``. ``counts``: :func:`parameter_counts` of the config's model,
    when already made. Returns {"matmul", "attn_res_mix", "mla_attention", "kda_state", "total"}; a training step
    is 3x the forward form."""
    from k3.audit.attnres import mix_flops_per_token  # the depth mixes' own cost model

    counts = parameter_counts(build_meta(config)) if counts is None else counts
    active = activated_counts(config, counts)
    out = {
        "matmul": 2.0 * (sum(active.values()) - active["embedding"] - active["norms"] - active["attn_res"]),
        "attn_res_mix": mix_flops_per_token(config),
        **attention_flops_per_token(config, context, form),
    }
    out["total"] = sum(out.values())
    return out


def report(config: K3Config, context: int = 4096, weight_bytes: int = 2, model: nn.Module | None = None) -> dict:
    """Everything ``k3 info`` prints, as a JSON-able dict (``model``: an already built meta model of ``config``)."""
    model = build_meta(config) if model is None else model
    counts = parameter_counts(model)
    active = activated_counts(config, counts)
    total = sum(counts.values())
    activated = sum(active.values()) - active["embedding"]
    flops = flops_per_token(config, context, counts=counts)
    decode = flops_per_token(config, context, "decode", counts=counts)
    layers = [
        {"index": i, "mixer": config.mixer(i), "ffn": config.ffn(i), "attn_res_block": config.attn_res_block(i)}
        for i in range(config.num_hidden_layers)
    ]
    vision = {}  # the tower is counted apart from the text model's totals (docs/architecture.md#vision, #accounting)
    if config.vision is not None and counts["vision"] == 0:
        from k3.model.vision import vision_param_counts

        vision = vision_param_counts(config)
    return {
        "preset": config.name,
        "params_total": total,
        "params_activated": activated,
        "params_activated_with_embedding": activated + active["embedding"],
        "params_by_path": counts,
        "params_activated_by_path": active,
        "params_routed_experts": counts["routed_experts"],
        "params_shared_experts": counts["shared_experts"],
        "params_dense_path": total - counts["routed_experts"] - counts["embedding"] - counts["vision"],
        "params_vision": counts["vision"] + sum(vision.values()),
        "params_vision_encoder": vision.get("encoder", 0),
        "params_vision_projector": vision.get("projector", 0),
        "context": context,
        "flops_per_token_forward": flops["total"],
        "flops_per_token_breakdown": {k: v for k, v in flops.items() if k != "total"},
        "flops_per_token_decode": decode["total"],
        "flops_per_token_decode_breakdown": {k: v for k, v in decode.items() if k != "total"},
        "weight_bytes_per_token": activated * weight_bytes,
        "weight_bytes_dtype_size": weight_bytes,
        "cache_per_sequence": cache_bytes_per_sequence(config, context),
        "layers": layers,
    }
